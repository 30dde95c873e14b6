"""FlexAttention in FX graphs: the `flex_attention` / `flex_attention_backward` higher-order ops, as ATen ops.

Dynamo captures ``torch.nn.attention.flex_attention.flex_attention`` as a higher-order op whose ``score_mod`` and
``mask_mod`` are subgraphs, and AOTAutograd's backward graph as ``flex_attention_backward``; torch-mlir lowers
neither. Here each is replaced in the FX graph by the ATen ops of PyTorch's own dense implementation of the op
(``sdpa_dense`` / ``sdpa_dense_backward``, what eager runs on CPU), traced with make_fx through the frontend's
decompositions: the score_mod and mask_mod become elementwise ops over index tensors, the scores a matmul, the
softmax and its backward ordinary ops, all of which neuronc compiles. The forward is then fused by the attention
pass into one flash-attention kernel, the score_mod's steps and the mask inside it (passes/attention.py).
"""
from __future__ import annotations

import operator

from neuronc.frontend import fx_splice
from neuronc.score_mod_steps import is_identity


def _hops():
    import torch

    hop = torch.ops.higher_order
    return {hop.flex_attention, hop.flex_attention_backward}


def decompose_flex_attention(gm) -> bool:
    """In place: every FlexAttention higher-order op of ``gm`` replaced by its dense ATen implementation. Returns
    whether there was one."""
    import torch.fx

    hops = _hops()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in hops]
    for node in nodes:
        _flatten_buffer_gradients(gm, node)
        fx_splice.replace_with_traced(gm, node, *_dense_graph(gm, node))
    if nodes:
        fx_splice.drop_replaced_subgraphs(gm)
    return bool(nodes) and isinstance(gm, torch.fx.GraphModule)


def _flatten_buffer_gradients(gm, node) -> None:
    """The backward's fourth output is a tuple, the gradients of the score_mod's captured tensors (a learned bias
    table): ``getitem(getitem(node, 3), i)`` read as ``getitem(node, 3 + i)``, the i-th of the flat outputs
    (`_flat`)."""
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 3:
            for reader in list(user.users):
                if reader.target is not operator.getitem:
                    raise AssertionError(f"unexpected use of {user.name}: {reader}")
                reader.args = (node, 3 + reader.args[1])
            gm.graph.erase_node(user)


def _dense_graph(gm, node):
    """(the dense implementation of ``node`` traced by make_fx, the FX nodes feeding its placeholders)."""
    import torch
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops.flex_attention import sdpa_dense_backward
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    feeds: list = []

    def lift(value):
        """Arguments with their tensors replaced by slots of the traced function's inputs."""
        if isinstance(value, torch.fx.Node):
            if value.op == "get_attr":
                return _batchable(getattr(gm, value.target))
            feeds.append(value)
            return _Slot(len(feeds) - 1)
        if isinstance(value, (tuple, list)):
            return type(value)(lift(v) for v in value)
        return value

    args = lift(node.args)
    impl = _forward if node.target is torch.ops.higher_order.flex_attention else sdpa_dense_backward

    def fill(value, tensors):
        if isinstance(value, _Slot):
            return tensors[value.index]
        if isinstance(value, (tuple, list)):
            return type(value)(fill(v, tensors) for v in value)
        return value

    backward = node.target is torch.ops.higher_order.flex_attention_backward
    wanted = {u.args[1] - 3 for u in node.users if u.target is operator.getitem and u.args[1] > 2} if backward \
        else set()

    def dense(*tensors):
        with torch.no_grad():
            out = impl(*fill(args, tensors))
        return _flat(out)

    fakes = [n.meta["val"] for n in feeds]
    fake_mode = detect_fake_mode(fakes)
    for i in wanted:  # the dense backward computes a captured tensor's gradient only if it requires one
        slot = args[12][i]
        fakes[slot.index] = fakes[slot.index].detach().requires_grad_()
    with fake_mode:  # functionalized: the dense backward fills preallocated gradients in place
        if wanted:  # traced first with those tensors requiring a gradient (functionalize's tensors cannot)
            dense = make_fx(dense)(*fakes)
            fakes = [f.detach() for f in fakes]
        traced = make_fx(torch.func.functionalize(dense, remove="mutations"),
                         decomposition_table={**decomposition_table(), **_scatter_decomposition()})(*fakes)
    return traced, feeds


def _scatter_decomposition() -> dict:
    """The joint graph's ``flex_lib.zeros_and_scatter`` (a captured tensor's gradient: dS added at the indices the
    score_mod read) as what it computes, an accumulating index_put into zeros (torch-mlir lowers that), summed in
    fp32 and rounded once (a bf16 table's entries sum hundreds of terms: bf16 additions drift past its tolerance)."""
    import torch
    import torch._dynamo._trace_wrapped_higher_order_op  # noqa: F401 - registers flex_lib.zeros_and_scatter

    def zeros_and_scatter(shape, indices, vals):
        zeros = torch.zeros(shape, device=vals.device, dtype=torch.float32)
        return torch.ops.aten.index_put(zeros, indices, vals.float(), accumulate=True).to(vals.dtype)

    return {torch.ops.flex_lib.zeros_and_scatter.default: zeros_and_scatter}


def _forward(*args):
    """The forward HOP's dense math (sdpa_dense without its final copy into the query's strides: neuronc's
    tensors are dense)."""
    from torch._higher_order_ops.flex_attention import math_attention

    return math_attention(*args)


def _batchable(value):
    """A score_mod / mask_mod / joint subgraph whose dtype conversions vmap batches.

    PyTorch's dense implementation runs these subgraphs under five nested vmaps (batch, head, query, key). The joint
    graph of a bf16 score_mod converts its gradient with ``prims.convert_element_type``, which has no batching rule:
    vmap's fallback then runs it once per element, B*H*Sq*Sk traced calls (a 1x2x256x256 bf16 backward did not finish
    tracing in 40 minutes). ``aten._to_copy`` is the same conversion with a batching rule; the decompositions turn it
    back into a conversion after vmap has batched it."""
    import copy

    import torch
    import torch.fx

    if not isinstance(value, torch.fx.GraphModule):
        return value
    convert = torch.ops.prims.convert_element_type.default
    if not any(n.target is convert for n in value.graph.nodes):
        return value
    value = copy.deepcopy(value)
    for n in value.graph.nodes:
        if n.target is convert:
            source, dtype = n.args
            n.target, n.args, n.kwargs = torch.ops.aten._to_copy.default, (source,), {"dtype": dtype}
    value.recompile()
    return value


class _Slot:
    def __init__(self, index: int):
        self.index = index


def _flat(value) -> tuple:
    """The HOP's outputs flattened (the backward's fourth is a tuple of captured buffers' gradients)."""
    out = []
    for v in value:
        if isinstance(v, (tuple, list)):
            out.extend(v)
        else:
            out.append(v)
    return tuple(out)


# -- the forward as one flash-attention kernel ------------------------------------------------------------------
#
# A forward flex_attention whose auxiliary outputs nobody reads (inference; training reads the log-sum-exp) is cut
# out of the graph (kernel_calls.GraphCut) and comes back as one FLEX_ATTENTION node: the compiler's flash-attention
# kernel (passes/attention.py lowers it), the score_mod's ATen ops turned into elementwise steps the kernel runs on
# each block of logits, the mask_mod evaluated here over the whole (query, key) grid: a causal pattern becomes the
# kernel's on-chip causal mask, another pattern a constant mask read block by block, whole blocks it hides skipped.
# A mask_mod reading tensors the graph takes (a document mask's per-token ids) and the same for every batch and head
# is computed by the graph as one [sq, sk] bool tensor the kernel reads block by block: every block is visited, as
# which ones it hides is known only at run time.
# GQA (fewer key/value heads, each shared by a group of query heads) reads each group's K and V in place.
# A score_mod reading tensors the graph takes or computes, or a run-time mask differing by batch or head, is the NKI
# library's flash forward's (below: the compiler's kernel reads no such operand); anything else keeps the dense
# lowering above.

# score_mod ATen ops -> step names (elementwise, in fp32 like the dense implementation)
_STEP_OPS = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg", "abs": "abs", "exp": "exp", "log": "log",
    "tanh": "tanh", "sqrt": "sqrt", "rsqrt": "rsqrt", "sigmoid": "sigmoid", "where": "where", "lt": "lt",
    "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "maximum": "max", "minimum": "min", "pow": "pow",
    "exp2": "exp2", "reciprocal": "reciprocal", "floor": "floor", "ceil": "ceil", "sign": "sign",
}
_CLAMPS = {"clamp", "clamp_min", "clamp_max"}
_IDENTITY_OPS = {"_to_copy", "convert_element_type", "clone", "alias", "detach", "lift_fresh_copy"}


class _NotFlash(Exception):
    pass


def _aten_name(target) -> str:
    name = getattr(target, "__name__", str(target))  # "add.Tensor"
    return name.split(".")[0]


def score_steps(score_gm, buffers: list, terms: "RunTimeTerms | None" = None) -> tuple:
    """The score_mod subgraph as steps: ((op, args), ...), args ("score",), ("b",), ("h",), ("q",), ("kv",),
    ("imm", value), ("step", j), ("table", values, index arg) (a constant buffer read at b or h), ("term", i) (the
    i-th of ``terms``, computed by the graph); raises _NotFlash."""
    import torch.fx
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    names = ["score", "b", "h", "q", "kv"]
    env, steps = {}, []
    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    for n, name in zip(placeholders, names + [None] * len(buffers)):
        env[n] = (name,) if name else None
    for n, buffer in zip(placeholders[5:], buffers):
        env[n] = ("buffer", buffer)
    terms = terms or RunTimeTerms([], frozenset())
    for i, n in enumerate(terms.nodes):
        env[n] = ("term", i)
    needed = _needed(score_gm, terms.nodes)

    def ref(x):
        if isinstance(x, torch.fx.Node):
            value = env[x]
            if value is not None and value[0] == "buffer" and value[1] is not None and value[1].numel() == 1:
                with unset_fake_temporarily():  # torch.tensor(c) in the score_mod
                    return ("imm", float(fx_splice.real_constant(value[1]).reshape(())))
            if value is None or value[0] == "buffer":
                raise _NotFlash
            return value
        if isinstance(x, (bool, int, float)):
            return ("imm", float(x))
        raise _NotFlash

    for n in score_gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            if n.op == "get_attr":
                env[n] = ("buffer", getattr(score_gm, n.target))
            continue
        if n.op != "output" and (n in terms.computed or n not in needed):
            continue  # a term's value (or only what computes one): the graph's
        if n.op == "output":
            result = n.args[0]
            result = result[0] if isinstance(result, (tuple, list)) else result
            final = ref(result)
            if final != ("step", len(steps) - 1):
                steps.append(("add", (final, ("imm", 0.0))))
            return tuple(steps)
        name = _aten_name(n.target)
        if name in _IDENTITY_OPS:
            env[n] = ref(n.args[0])
            continue
        if name in ("index", "select") and isinstance(n.args[0], torch.fx.Node) and env[n.args[0]] and \
                env[n.args[0]][0] == "buffer":
            table = env[n.args[0]][1]
            index = n.args[1][0] if name == "index" else n.args[2]
            where = ref(index)
            if where not in (("b",), ("h",)) or table is None or table.dim() != 1:
                raise _NotFlash
            steps.append(("table", (("values", tuple(float(x) for x in table.tolist())), where)))
            env[n] = ("step", len(steps) - 1)
            continue
        if name in _CLAMPS:  # where(x < lo, lo, where(x > hi, hi, x)): clamp's value, and its gradient at the bounds
            lo, hi = _clamp_bounds(name, n)
            value = ref(n.args[0])
            for bound, compare in ((lo, "lt"), (hi, "gt")):
                if bound is not None:
                    bound = ref(bound)
                    steps.append((compare, (value, bound)))
                    steps.append(("where", (("step", len(steps) - 1), bound, value)))
                    value = ("step", len(steps) - 1)
            env[n] = value
            continue
        op = _STEP_OPS.get(name)
        if op is None or n.kwargs.get("alpha", 1) != 1:
            raise _NotFlash
        args = tuple(ref(a) for a in n.args)
        if op in ("div",) and n.kwargs.get("rounding_mode"):
            raise _NotFlash
        steps.append((op, args))
        env[n] = ("step", len(steps) - 1)
    raise _NotFlash


def _upstream(nodes, stop=()) -> set:
    """``nodes`` and every node they read, directly or not; the inputs of a node in ``stop`` are not followed."""
    found, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            if n not in stop:
                stack.extend(n.all_input_nodes)
    return found


def _needed(score_gm, terms: list) -> set:
    """The subgraph's nodes the result reads, not counting what only computes a term."""
    return _upstream([next(n for n in score_gm.graph.nodes if n.op == "output")], stop=terms)


class RunTimeTerms:
    """The parts of a score_mod that read tensors the graph takes or computes (a learned bias table, per-head ALiBi
    slopes captured in the closure) and not the score: computed by the graph over the (batch, head, query, key) grid
    and read by the flash kernels as ("term", i) operands.

    ``nodes``: the score_mod subgraph's nodes (or placeholders) whose values are terms, in graph order; ``computed``:
    every node the graph computes for them. A term is as small as exactness allows: a read of such a tensor
    (``bias[h, q - kv + c]``: a [heads, seq, seq] grid; ``slopes[h]``: a value per head, a column), grown through the
    ops after it that eager computes in a 16-bit float (``slopes_bf16[h] * (kv - q)`` rounds its product to bf16:
    the kernels compute steps in fp32, so the graph computes that product as eager does) and through ops the kernels
    have no step for (a read of a read)."""

    def __init__(self, nodes: list, computed: frozenset):
        self.nodes, self.computed = nodes, computed

    def __bool__(self) -> bool:
        return bool(self.nodes)


def run_time_terms(score_gm, run_time: list) -> RunTimeTerms:
    """The score_mod's terms (see RunTimeTerms); ``run_time``: per captured tensor, whether the graph takes or
    computes it (not a constant). Raises _NotFlash for a run-time tensor the score_mod reads with the score."""
    import torch

    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    reads = {p for p, late in zip(placeholders[5:], run_time) if late}
    if not reads:
        return RunTimeTerms([], frozenset())
    on_score, on_reads, computed = {placeholders[0]}, set(reads), set()
    for n in score_gm.graph.nodes:
        if n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        if any(i in on_score for i in inputs):
            on_score.add(n)
        if any(i in on_reads for i in inputs):
            on_reads.add(n)
        if n in on_reads and n not in on_score:
            dtype = getattr(n.meta.get("val"), "dtype", None)
            name = _aten_name(n.target)
            if any(i in reads for i in inputs) or dtype in (torch.bfloat16, torch.float16) or \
                    (name not in _STEP_OPS and name not in _CLAMPS and name not in _IDENTITY_OPS):
                computed.add(n)
    for p in reads:  # read whole by a step (a 0-d tensor: score * w): the tensor itself is the term
        if any(u not in computed for u in p.users):
            if getattr(p.meta.get("val"), "dim", lambda: 1)() != 0:
                raise _NotFlash
            computed.add(p)
    nodes = [n for n in score_gm.graph.nodes if n in computed and any(u not in computed for u in n.users)]
    if any(n in on_score for n in computed):
        raise _NotFlash
    return RunTimeTerms(nodes, frozenset(computed))


def diagonals(score_gm, terms: RunTimeTerms, heads: int, seq: int) -> tuple:
    """Per term, c when it is a relative-position table's read ``table[h, q - kv + c]`` (the kernels read the table
    itself, block by block: no [heads, seq, seq] grid), else None."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    found = []
    for n in terms.nodes:
        c = None
        table = n.args[0] if n.op == "call_function" and _aten_name(n.target) == "index" else None
        value = getattr(getattr(table, "meta", {}).get("val"), "shape", ())
        if table in placeholders[5:] and len(value) == 2 and value[0] >= heads and len(n.args[1]) == 2 and \
                n.args[1][0] is placeholders[2]:
            position = n.args[1][1]
            ancestors = _upstream([position])
            if not ancestors & (set(placeholders[:3]) | set(placeholders[5:])):
                with unset_fake_temporarily():
                    q, kv = torch.arange(seq).view(seq, 1), torch.arange(seq).view(1, seq)
                    env = {placeholders[3]: q, placeholders[4]: kv}
                    for m in score_gm.graph.nodes:
                        if m in ancestors and m.op == "call_function":
                            env[m] = m.target(*torch.fx.node.map_arg(m.args, env.__getitem__),
                                              **torch.fx.node.map_arg(m.kwargs, env.__getitem__))
                    at = torch.broadcast_to(env[position], (seq, seq))
                    first = int(at[0, 0])
                    if torch.equal(at, first + q - kv) and int(at.min()) >= 0 and int(at.max()) < value[1]:
                        c = first
        found.append(c)
    return tuple(found)


def term_values(score_gm, terms: RunTimeTerms, buffers: list, batch: int, heads: int, sq: int, sk: int,
                device=None, diagonal: tuple = ()) -> list:
    """The terms' values (torch ops on ``buffers``, the score_mod's captured tensors), each fp32 [batch or 1,
    heads or 1, sq, sk] or, for a term that does not vary with the key, [.., sq, 1]: what the kernels read; where
    ``diagonal`` (see diagonals) has a number, the table itself in fp32. The indices are made on ``device``, the
    run-time tensors' (a `neuron` tensor's ops take no CPU operand)."""
    import torch
    import torch.fx

    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q = torch.arange(sq, device=device).view(1, 1, sq, 1)
    kv = torch.arange(sk, device=device).view(1, 1, 1, sk)
    env = dict(zip(placeholders, [None, b, h, q, kv] + list(buffers)))
    wanted = _upstream(n for i, n in enumerate(terms.nodes) if i >= len(diagonal) or diagonal[i] is None)
    for n in score_gm.graph.nodes:
        if n not in wanted or n.op == "placeholder":
            continue
        if n.op == "get_attr":
            env[n] = fx_splice.real_constant(getattr(score_gm, n.target))
            continue
        args = torch.fx.node.map_arg(n.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
        env[n] = n.target(*args, **kwargs)
    values = []
    for i, n in enumerate(terms.nodes):
        if i < len(diagonal) and diagonal[i] is not None:
            values.append(env[n.args[0]].to(torch.float32).contiguous())
            continue
        t = env[n]
        t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
        keys = sk if t.shape[3] != 1 else 1
        values.append(t.to(torch.float32).expand(t.shape[0], t.shape[1], sq, keys).contiguous())
    return values


def _term_nodes(gm, node, score_gm, terms: RunTimeTerms, buffers: list, batch: int, heads: int, sq: int, sk: int,
                diagonal: tuple = ()):
    """FX nodes before ``node`` computing the terms' values (term_values) from the graph's tensors ``buffers``."""
    import torch
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    lifted = [b for b in buffers if isinstance(b, torch.fx.Node) and b.op != "get_attr"]

    def values(*tensors):
        return tuple(term_values(score_gm, terms, _captured(gm, buffers, tensors), batch, heads, sq, sk,
                                 tensors[0].device, diagonal))

    fakes = [n.meta["val"] for n in lifted]
    with detect_fake_mode(fakes):
        traced = make_fx(values, decomposition_table=decomposition_table())(*fakes)
    return fx_splice.insert_traced(gm, node, traced, lifted)


def _captured(gm, buffers: list, tensors) -> list:
    """A score_mod's or mask_mod's captured tensors: constants' real values, the others from ``tensors``."""
    import torch.fx

    values = iter(tensors)
    return [fx_splice.real_constant(getattr(gm, b.target)) if isinstance(b, torch.fx.Node) and b.op == "get_attr"
            else next(values) if isinstance(b, torch.fx.Node) else b for b in buffers]


def _clamp_bounds(name: str, n) -> tuple:
    """(min, max) of a clamp node, None where it has none."""
    args = list(n.args[1:]) + [None, None]
    if name == "clamp":
        return n.kwargs.get("min", args[0]), n.kwargs.get("max", args[1])
    if name == "clamp_min":
        return n.kwargs.get("min", args[0]), None
    return None, n.kwargs.get("max", args[0])


def static_mask(mask_gm, buffers: list, batch: int, heads: int, sq: int, sk: int):
    """The mask_mod evaluated over the whole grid, as one bool [sq, sk] array when it is the same for every
    batch and head (else raises _NotFlash)."""
    import numpy as np
    import torch

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if any(b is None for b in buffers):
        raise _NotFlash
    with unset_fake_temporarily(), torch.no_grad():  # real values, outside the compiler's fake tensor mode
        b = torch.arange(batch).view(batch, 1, 1, 1)
        h = torch.arange(heads).view(1, heads, 1, 1)
        q = torch.arange(sq).view(1, 1, sq, 1)
        kv = torch.arange(sk).view(1, 1, 1, sk)
        try:
            value = mask_gm(b, h, q, kv, *buffers)
        except Exception as e:  # noqa: BLE001 - a mask_mod not made of broadcasting ops: the dense path
            raise _NotFlash from e
        value = torch.broadcast_to(value, (batch, heads, sq, sk)).cpu().numpy().astype(bool)  # a noop mask: `neuron`
    first = value[0, 0]
    if not (value == first).all():
        raise _NotFlash
    return np.ascontiguousarray(first)


def _same_for_every_head(mask_gm) -> bool:
    """Whether a mask_mod ignores its batch and head indices (its value one [sq, sk] pattern)."""
    placeholders = [n for n in mask_gm.graph.nodes if n.op == "placeholder"]
    return len(placeholders) >= 4 and not placeholders[0].users and not placeholders[1].users


def _runtime_mask(gm, node, mask_gm, buffers: list, sq: int, sk: int, per_head: tuple | None = None):
    """FX nodes before ``node`` computing the [sq, sk] keep-mask of a mask_mod that reads tensors the graph takes
    or computes (``buffers``): the mask_mod's ops over a column of query and a row of key indices. ``per_head``
    (batch, heads): a mask_mod reading the batch or head index, its mask [batch or 1, heads or 1, sq, sk]."""
    import torch
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    lifted = [b for b in buffers if isinstance(b, torch.fx.Node) and b.op != "get_attr"]

    def mask(*tensors):
        args = _captured(gm, buffers, tensors)
        q = torch.arange(sq, dtype=torch.int64).view(sq, 1)
        kv = torch.arange(sk, dtype=torch.int64).view(1, sk)
        if per_head is None:
            zero = torch.zeros((), dtype=torch.int64)
            return (torch.broadcast_to(mask_gm(zero, zero, q, kv, *args), (sq, sk)).to(torch.bool),)
        batch, heads = per_head
        device = tensors[0].device if tensors else None  # a `neuron` tensor's ops take no CPU operand
        b, h, q, kv = (torch.arange(n, device=device).view([n if i == axis else 1 for i in range(4)])
                       for axis, n in enumerate((batch, heads, sq, sk)))
        keep = mask_gm(b, h, q, kv, *args)
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        return (torch.broadcast_to(keep, (keep.shape[0], keep.shape[1], sq, sk)).to(torch.bool).contiguous(),)

    fakes = [n.meta["val"] for n in lifted]
    with detect_fake_mode(fakes):
        traced = make_fx(mask, decomposition_table=decomposition_table())(*fakes)
    (result,) = fx_splice.insert_traced(gm, node, traced, lifted)
    return result


def _constant_of(gm, node):
    """The value of a get_attr tensor (None for a value the graph computes or takes as input)."""
    import torch.fx

    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return fx_splice.real_constant(getattr(gm, node.target))
    return None


def _flash_spec(gm, node) -> dict:
    """What the flash kernel needs of a forward flex_attention node, or raises _NotFlash."""
    import numpy as np

    (q, k, v, score_mod, block_mask, scale, _options, score_buffers, mask_buffers) = node.args[:9]
    if any(user.target is operator.getitem and user.args[1] != 0 and user.users for user in node.users):
        raise _NotFlash  # the log-sum-exp is read (training): the dense forward makes it
    qv, kv_, vv = (x.meta["val"] for x in (q, k, v))
    if qv.dim() != 4 or kv_.dim() != 4 or kv_.shape[0] != qv.shape[0] or vv.shape[:3] != kv_.shape[:3]:
        raise _NotFlash  # broadcast batches
    if kv_.shape[1] == 0 or qv.shape[1] % kv_.shape[1]:
        raise _NotFlash  # not GQA's grouping (flex_attention refuses it)
    if not (qv.dtype == kv_.dtype == vv.dtype) or not qv.dtype.is_floating_point:
        raise _NotFlash
    batch, heads, sq, d = qv.shape
    sk, dv = kv_.shape[2], vv.shape[3]
    score_gm = getattr(gm, score_mod.target)
    steps = score_steps(score_gm, [_constant_of(gm, b) for b in score_buffers])
    if is_identity(steps):
        steps = ()
    mask_gm = getattr(gm, block_mask[-1].target)
    constants = [_constant_of(gm, b) for b in mask_buffers]
    runtime = any(c is None for c in constants)
    if runtime and not _same_for_every_head(mask_gm):
        raise _NotFlash
    mask = None if runtime else static_mask(mask_gm, constants, batch, heads, sq, sk)
    spec = dict(batch_shape=(batch, heads), kv_heads=kv_.shape[1], queries=sq, keys=sk, head_dim=d, value_dim=dv,
                scale=float(scale), score_mod=steps, mask="none", causal_offset=0, mask_value=None)
    if runtime:  # computed by the graph (a document mask's ids), read block by block
        spec.update(mask="select", runtime_mask=True)
        return spec
    if mask.all():
        return spec
    kept = mask[0]
    offset = int(kept.sum()) - 1  # a causal pattern keeps keys 0..offset for query 0
    causal = offset >= 0 and kept[:offset + 1].all() and np.array_equal(
        mask, np.arange(sk)[None, :] <= np.arange(sq)[:, None] + offset)
    if causal and not steps:  # the kernel's own causal mask, made on chip (with a score_mod: applied after it)
        spec.update(mask="causal", causal_offset=offset)
    else:
        spec.update(mask="select", mask_value=mask)
    return spec


def cut_flex_attention(cut, locations: dict) -> None:
    """Cut each forward flex_attention the flash kernel computes out of the graph (see above)."""
    import hashlib

    import torch

    from neuronc.frontend.tensors import dtype_of
    from neuronc.isa import DType
    from neuronc.neff.program import DebugLoc

    for node in list(cut.gm.graph.nodes):
        if node.op == "call_function" and node.target in (torch.ops.higher_order.flex_attention,
                                                          torch.ops.higher_order.flex_attention_backward):
            try:
                _cut_for_training(cut, node, locations)
                continue
            except _NotFlash:
                pass
        if node.op != "call_function" or node.target is not torch.ops.higher_order.flex_attention:
            continue
        try:
            spec = _flash_spec(cut.gm, node)
        except _NotFlash:
            continue
        q, k, v = node.args[:3]
        inputs = [q, k, v]
        if spec.get("runtime_mask"):
            mask_gm = getattr(cut.gm, node.args[4][-1].target)
            inputs.append(_runtime_mask(cut.gm, node, mask_gm, list(node.args[8]), spec["queries"], spec["keys"]))
        batch, heads = spec["batch_shape"]
        dtype = dtype_of(q.meta["val"].dtype)
        out = ((batch, heads, spec["queries"], spec["value_dim"]), dtype)
        lse = ((batch, heads, spec["queries"]), DType.F32)
        loc = locations.get(node.name, DebugLoc())
        mask = spec["mask_value"]
        digest = hashlib.sha256(repr({k_: v_ for k_, v_ in spec.items() if k_ != "mask_value"}).encode())
        if mask is not None:
            digest.update(mask.tobytes())
        cut.cut(node, inputs, [out, lse, lse],
                lambda values, spec=spec, loc=loc, out=out: _flex_node(values, spec, out, loc), digest.hexdigest(), loc)


def _flex_node(values: list, spec: dict, out: tuple, loc) -> list:
    import dataclasses

    from neuronc import ir
    from neuronc.ir import Op
    from neuronc.isa import DType

    inputs = list(values)
    mask = spec["mask_value"]
    if mask is not None:
        inputs.append(ir.node(Op.CONSTANT, [], mask.shape, DType.BOOL, loc, value=mask))
    attrs = {k: v for k, v in spec.items() if k != "mask_value"}
    node = ir.node(Op.FLEX_ATTENTION, inputs, out[0], out[1], dataclasses.replace(loc, op="flex_attention"), **attrs)
    return [node, None, None]


# -- training: the NKI library's flash forward (with the log-sum-exp) and backward ------------------------------
#
# In training the forward's log-sum-exp is read by the backward. Where the NKI library's flash-attention kernels
# compute the same thing (neuronc/nki/library/flash_attention.py: q, k, v of one shape [batch, heads, seq, d] (k and
# v may have fewer heads: GQA), seq a multiple of 128, d <= 128, fp32 or bf16; a score_mod whose steps they can
# differentiate (score_steps.py); a static mask the same for every batch and head, or any run-time mask), the
# forward and the backward flex_attention are each cut out as that kernel: the backward recomputes P block by
# block from the log-sum-exp instead of the dense backward's S x S scores in HBM. No score_mod with no mask or the
# causal one is the kernels' built-in path; otherwise a static mask is a constant [seq, seq] keep-mask and a table
# of its 128 x 128 blocks (hidden ones skipped, fully kept ones read no mask), a mask reading tensors the graph takes
# (a document mask's ids) is computed by the graph ([seq, seq], or per head [.., heads, seq, seq] when it reads the
# head) and read for every block. A score_mod's reads of tensors the graph takes (RunTimeTerms: `slopes[h]`,
# `table[h, q - kv + c]`) are computed by the graph and read by the kernels as ("term", i) operands; the backward
# kernel writes dY * dy/dterm for the terms of tensors whose gradient is read, and the graph applies each term's
# vjp (a table's scatter-add, in fp32) to make it. flex_attention's log-sum-exp is in base 2 (its kernels work in
# ln 2 space); the library's is natural: converted on the way out and back.

# False: training, and inference with a tensor-reading score_mod or a per-head run-time mask, keep the dense lowering
# (benchmarks/flex_attention.py's peer)
LIBRARY_KERNELS_FOR_TRAINING = True


def _library_plan(gm, node, q, k, v, score_mod, block_mask, score_buffers, mask_buffers) -> dict:
    """How the library kernels compute this flex_attention: dict(causal, score_mod, blocks, mask: a constant bool
    [seq, seq] array, "runtime" or None); raises _NotFlash when they do not compute it."""
    import numpy as np
    import torch

    from neuronc.nki.library.flash_attention import HIDDEN, KEPT, PARTLY, P
    from neuronc.nki.library.score_steps import Unsupported, check_differentiable

    qv, kv_, vv = (x.meta["val"] for x in (q, k, v))
    if qv.dim() != 4 or kv_.shape != vv.shape or kv_.dim() != 4 or not (qv.dtype == kv_.dtype == vv.dtype):
        raise _NotFlash
    batch, heads, seq, d = qv.shape
    if (kv_.shape[0], kv_.shape[2], kv_.shape[3]) != (batch, seq, d) or heads % kv_.shape[1]:
        raise _NotFlash  # GQA's groups are fine (K and V repeated for the kernel, their gradients summed)
    if qv.dtype not in (torch.float32, torch.bfloat16) or seq % P or d > P:
        raise _NotFlash
    score_gm = getattr(gm, score_mod.target)
    captured = [_constant_of(gm, b) for b in score_buffers]
    terms = run_time_terms(score_gm, [c is None for c in captured])
    steps = score_steps(score_gm, captured, terms)
    steps = () if is_identity(steps) else steps
    try:
        check_differentiable(steps)
    except Unsupported as e:
        raise _NotFlash from e
    mask_gm = getattr(gm, block_mask[-1].target)
    constants = [_constant_of(gm, b) for b in mask_buffers]
    plan = dict(causal=False, score_mod=steps, blocks=None, mask=None, terms=terms)
    if any(c is None for c in constants):  # read at run time (a document mask's ids), per head if it reads h
        plan.update(mask="runtime", per_head=not _same_for_every_head(mask_gm))
        return plan
    mask = static_mask(mask_gm, constants, batch, heads, seq, seq)
    if mask.all():
        return plan
    if not steps and np.array_equal(mask, np.tril(np.ones((seq, seq), dtype=bool))):
        plan.update(causal=True)  # the kernels' own causal mask, made on chip
        return plan
    tiles = seq // P
    cells = mask.reshape(tiles, P, tiles, P)
    kept, seen = cells.all(axis=(1, 3)), cells.any(axis=(1, 3))
    plan.update(mask=mask, blocks=tuple(tuple(KEPT if kept[i, j] else PARTLY if seen[i, j] else HIDDEN
                                              for j in range(tiles)) for i in range(tiles)))
    return plan


def traced_library_kernel(kernel, shapes: list, dtypes: list, scale: float, plan: dict, heads: int,
                           term_shapes: tuple = (), term_grads: tuple = (), mask_shape: tuple | None = None,
                           diagonal: tuple = ()):
    import numpy as np

    from neuronc.frontend.tensors import dtype_of

    arrays = [np.empty(shape, dtype=dtype_of(dtype).numpy) for shape, dtype in zip(shapes, dtypes)]
    options = dict(scale=scale, causal=plan["causal"])
    if plan["score_mod"] or plan["mask"] is not None:
        seq = shapes[0][1]
        options.update(score_mod=plan["score_mod"], blocks=plan["blocks"], heads=heads,
                       mask=None if plan["mask"] is None else np.empty(mask_shape or (seq, seq), dtype=bool))
    if term_shapes:
        options.update(terms=tuple(np.empty(shape, dtype=np.float32) for shape in term_shapes))
    if any(c is not None for c in diagonal):
        options.update(diagonals=tuple(diagonal))
    if term_grads:
        options.update(term_grads=tuple(term_grads))
    return kernel.trace(*arrays, **options)


def _cut_for_training(cut, node, locations: dict) -> None:
    """Cut a forward flex_attention whose log-sum-exp is read, or a backward one, as the library's kernel (see
    above); raises _NotFlash when it does not apply. A forward whose score_mod reads run-time tensors is cut this
    way in inference too (the compiler's own flash kernel reads no such operand)."""
    import hashlib

    import torch

    from neuronc.frontend.kernel_calls import _fingerprint
    from neuronc.neff.program import DebugLoc
    from neuronc.nki.library.flash_attention import flash_attention_backward, flash_attention_forward

    if not LIBRARY_KERNELS_FOR_TRAINING:
        raise _NotFlash
    gm = cut.gm
    forward = node.target is torch.ops.higher_order.flex_attention
    getters = {u.args[1]: u for u in node.users if u.target is operator.getitem and u.users}
    if forward:
        q, k, v, score_mod, block_mask, scale, _options, score_buffers, mask_buffers = node.args[:9]
        if 2 in getters:
            raise _NotFlash  # the row max read
    else:
        (q, k, v, out, lse, grad_out, grad_lse, score_mod, _joint, block_mask, scale, _options, score_buffers,
         mask_buffers) = node.args[:14]
        if grad_lse is not None or grad_out is None or any(i > 3 for i in getters):
            raise _NotFlash  # the log-sum-exp's own gradient
    plan = _library_plan(gm, node, q, k, v, score_mod, block_mask, score_buffers, mask_buffers)
    terms = plan["terms"]
    if forward and 1 not in getters and not terms and not plan.get("per_head"):
        raise _NotFlash  # inference: the compiler's flash kernel (cut_flex_attention)
    qv = q.meta["val"]
    shape, dtype = tuple(qv.shape), qv.dtype
    batch, heads, seq, d = shape
    kv_heads = k.meta["val"].shape[1]
    flat = (batch * heads, seq, d)
    loc = locations.get(node.name, DebugLoc())
    score_gm = getattr(gm, score_mod.target)
    wanted = {} if forward else _wanted_buffer_gradients(node)
    if any(_constant_of(gm, score_buffers[i]) is not None for i in wanted):
        raise _NotFlash  # a constant's gradient (before any node is added to the graph)
    diagonal = diagonals(score_gm, terms, heads, seq) if terms else ()
    term_inputs = _term_nodes(gm, node, score_gm, terms, list(score_buffers), batch, heads, seq, seq, diagonal) \
        if terms else []
    term_shapes = tuple(tuple(t.meta["val"].shape) for t in term_inputs)
    mask = plan["mask"]
    runtime_mask = isinstance(mask, str)
    mask_inputs, mask_shape = [], None
    if runtime_mask:  # computed by the graph from the tensors the mask_mod reads
        mask_inputs = [_runtime_mask(gm, node, getattr(gm, block_mask[-1].target), list(mask_buffers), seq, seq,
                                     (batch, heads) if plan["per_head"] else None)]
        mask_shape = tuple(mask_inputs[0].meta["val"].shape)
        mask = None
    if forward:
        traced = traced_library_kernel(flash_attention_forward, [flat] * 3, [dtype] * 3, float(scale), plan, heads,
                                        term_shapes, mask_shape=mask_shape, diagonal=diagonal)
        lse = ((batch, heads, seq), traced.outputs[1].dtype)
        outputs = [(shape, traced.outputs[0].dtype), lse, lse]  # out, log-sum-exp, row max (not made: not read)
        inputs = [q, k, v]
    else:
        term_grads = _terms_reading(score_gm, terms, list(wanted))
        traced = traced_library_kernel(flash_attention_backward, [flat] * 5 + [flat[:2]],
                                        [dtype] * 5 + [torch.float32], float(scale), plan, heads, term_shapes,
                                        term_grads, mask_shape, diagonal)
        kv_shape = (batch, kv_heads, seq, d)
        outputs = [(shape, traced.outputs[0].dtype)] + [(kv_shape, traced.outputs[0].dtype)] * 2 + \
            [(tuple(o.shape), o.dtype) for o in traced.outputs[3:]]
        inputs = [q, k, v, out, grad_out, lse]
        if wanted:
            _apply_term_gradients(gm, node, score_gm, terms, list(score_buffers), wanted, term_grads, term_shapes,
                                  [o.shape for o in traced.outputs[3:]], shape, diagonal)
    inputs.extend(mask_inputs + term_inputs)
    n_terms = len(term_inputs)
    digest = hashlib.sha256(_fingerprint(f"flex_attention_{'forward' if forward else 'backward'}", traced).encode())
    if mask is not None:  # a constant input: its values are not in the instructions
        digest.update(mask.tobytes())
    cut.cut(node, inputs, outputs,
            lambda values, traced=traced, forward=forward, shape=shape, kv_heads=kv_heads, loc=loc, mask=mask,
            runtime_mask=runtime_mask, n_terms=n_terms:
            library_nodes(values, traced, forward, shape, kv_heads, loc, mask, runtime_mask, n_terms),
            digest.hexdigest(), loc)


def _wanted_buffer_gradients(node) -> dict:
    """A backward flex_attention's read gradients of the score_mod's captured tensors: {index: getitem node} (the
    getitems of unread ones erased)."""
    wanted = {}
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 3:
            if any(reader.target is not operator.getitem for reader in user.users):
                raise _NotFlash
            for reader in list(user.users):
                if reader.users:
                    wanted[reader.args[1]] = reader
            if not wanted:
                for reader in list(user.users):
                    node.graph.erase_node(reader)
                node.graph.erase_node(user)
    return wanted


def _terms_reading(score_gm, terms: RunTimeTerms, captured: list) -> tuple:
    """The indices of the terms computed from any of the captured tensors ``captured`` (their indices)."""
    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    sources = {placeholders[5 + i] for i in captured}
    found = []
    for t, n in enumerate(terms.nodes):
        if _upstream([n]) & sources:
            found.append(t)
    return tuple(found)


def _diagonal_sums(g, c: int, table: tuple):
    """The gradient of table[h, q - kv + c] ([rows, length]) from g [heads, seq, seq], fp32: each entry the sum of
    g along its diagonal, by moves and one sum (no scatter): with g's keys reversed, the diagonal q - kv is the
    anti-diagonal q + j, which a row-wise shift (pad each row, read the rows one element shorter) lines up in a
    column, summed along the last axis."""
    import torch.nn.functional as F

    heads, seq, _ = g.shape
    shifted = F.pad(g.flip(-1), (0, seq + 1)).reshape(heads, -1)[:, :seq * 2 * seq].reshape(heads, seq, 2 * seq)
    sums = shifted.transpose(1, 2).sum(-1)[:, :2 * seq - 1]  # [h, m]: the sum over q - kv = m - (seq - 1)
    low = c - (seq - 1)
    return F.pad(sums, (low, table[1] - low - (2 * seq - 1), 0, table[0] - heads))


def _apply_term_gradients(gm, node, score_gm, terms, buffers: list, wanted: dict, term_grads: tuple,
                          term_shapes: tuple, grad_shapes: list, shape: tuple, diagonal: tuple = ()) -> None:
    """The gradients of the captured tensors ``wanted`` reads, from the backward kernel's dY * dy/dterm outputs
    (getitem(node, 3 + n), n-th of ``term_grads``): the terms' vjp (a learned table's scatter-add; a relative-position
    table's diagonal sums, see _diagonal_sums), summed in fp32 and rounded once to the tensor's dtype, replacing
    getitem(getitem(node, 3), i)."""
    import torch
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    batch, heads, seq, _ = shape
    lifted = [b for b in buffers if isinstance(b, torch.fx.Node) and b.op != "get_attr"]
    positions = [buffers.index(b) for b in lifted]
    order = sorted(wanted)
    if any(i not in positions for i in order):
        raise _NotFlash  # a constant's gradient

    placeholders = [n for n in score_gm.graph.nodes if n.op == "placeholder"]
    tables = {t: placeholders.index(terms.nodes[t].args[0]) - 5 for t, c in enumerate(diagonal) if c is not None}
    plain = [t for t in range(len(terms.nodes)) if t not in tables]

    def gradients(*tensors):
        late, grads = tensors[:len(lifted)], tensors[len(lifted):]
        base = _captured(gm, buffers, late)
        total = {}
        if any(t in term_grads for t in plain):
            def values(*chosen):
                captured = list(base)
                for i, x in zip(order, chosen):
                    captured[i] = x
                return tuple(term_values(score_gm, RunTimeTerms([terms.nodes[t] for t in plain], terms.computed),
                                         captured, batch, heads, seq, seq, late[0].device))

            outs, vjp = torch.func.vjp(values, *(base[i].float() for i in order))
            cotangents = []
            for t, out in zip(plain, outs):
                if t not in term_grads:
                    cotangents.append(torch.zeros_like(out))
                    continue
                g = grads[term_grads.index(t)].reshape(batch, heads, seq, out.shape[3])
                dims = [dim for dim in (0, 1) if out.shape[dim] == 1 and g.shape[dim] > 1]  # (a sum over one
                # element is a slow REDUCE: the compiler does not make it a reshape)
                cotangents.append(g.sum(dims, keepdim=True) if dims else g)
            total = dict(zip(order, vjp(tuple(cotangents))))
        for t, i in tables.items():  # table[h, q - kv + c]: its gradient sums dY * dy/dterm along diagonals
            if t in term_grads and i in wanted:
                g = grads[term_grads.index(t)].reshape(batch, heads, seq, seq)
                g = g.sum(0) if batch > 1 else g[0]
                sums = _diagonal_sums(g, diagonal[t], base[i].shape)
                total[i] = sums if total.get(i) is None else total[i] + sums
        return tuple((total[i] if total.get(i) is not None else torch.zeros_like(base[i], dtype=torch.float32))
                     .to(base[i].dtype) for i in order)

    fakes = [n.meta["val"] for n in lifted]
    fake_mode = detect_fake_mode(fakes)
    with fake_mode:
        device = fakes[0].device  # the captured tensors' (the kernel's outputs are read beside them)
        fakes = fakes + [torch.empty(s, dtype=torch.float32, device=device) for s in grad_shapes]
        traced = make_fx(torch.func.functionalize(gradients, remove="mutations"),
                         decomposition_table=decomposition_table())(*fakes)
    tuple_getter = next(u for u in node.users if u.target is operator.getitem and u.args[1] == 3)
    graph = gm.graph
    with graph.inserting_before(tuple_getter):
        outputs = [graph.call_function(operator.getitem, (node, 3 + n)) for n in range(len(term_grads))]
    for n, out in enumerate(outputs):
        with fake_mode:
            out.meta["val"] = torch.empty(grad_shapes[n], dtype=torch.float32, device=device)
    results = fx_splice.insert_traced(gm, tuple_getter, traced, lifted + outputs)
    for i, result in zip(order, results):
        wanted[i].replace_all_uses_with(result)
    for reader in list(tuple_getter.users):
        graph.erase_node(reader)
    graph.erase_node(tuple_getter)


def library_nodes(values: list, traced, forward: bool, shape: tuple, kv_heads: int, loc, mask=None,
                   runtime_mask: bool = False, n_terms: int = 0, natural_lse: bool = False) -> list:
    """The library kernel's nodes on flex_attention's [batch, heads, ...] values (then a run-time mask, then the
    score_mod's run-time terms), and ``mask`` (a constant keep-mask), its results as flex_attention's (then the
    backward's dY * dy/dterm outputs); with GQA, each K/V head repeated for the query heads of its group and their
    gradients summed over it, in fp32, as flex_attention's dense backward sums them. ``natural_lse``: the
    log-sum-exp given and returned is the library's own, natural (SDPA's), not flex_attention's base 2."""
    import math

    import numpy as np

    from neuronc import ir
    from neuronc.frontend.kernel_calls import _kernel_nodes
    from neuronc.ir import Op
    from neuronc.isa import DType

    batch, heads, seq, d = shape

    def reshaped(x, dims):
        return ir.node(Op.RESHAPE, [x], dims, x.dtype, loc)

    def scaled(x, factor):
        c = ir.node(Op.CONSTANT, [], x.shape, DType.F32, loc, value=np.array(factor, dtype=np.float32))
        return ir.node(Op.MULTIPLY, [x, c], x.shape, DType.F32, loc)

    flat = (batch * heads, seq, d)
    group = heads // kv_heads
    grouped = (batch, kv_heads, group, seq, d)

    def repeated(x):  # [batch, kv_heads, seq, d] -> [batch * heads, seq, d], kv head j serving heads j*g..j*g+g-1
        if group == 1:
            return reshaped(x, flat)
        spread = ir.node(Op.BROADCAST_IN_DIM, [reshaped(x, (batch, kv_heads, 1, seq, d))], grouped, x.dtype, loc,
                         dims=(0, 1, 2, 3, 4))
        return reshaped(spread, flat)

    def summed(x):  # the gradient of `repeated`
        if group == 1:
            return reshaped(x, (batch, kv_heads, seq, d))
        wide = ir.node(Op.CONVERT, [reshaped(x, grouped)], grouped, DType.F32, loc)
        zero = ir.node(Op.CONSTANT, [], (), DType.F32, loc, value=np.array(0.0, dtype=np.float32))
        total = ir.node(Op.REDUCE, [wide, zero], (batch, kv_heads, seq, d), DType.F32, loc, dims=(2,), kind="add")
        return total if x.dtype == DType.F32 else ir.node(Op.CONVERT, [total], total.shape, x.dtype, loc)

    first = 3 if forward else 6
    masks = values[first:first + 1] if runtime_mask else []
    terms = values[first + len(masks):first + len(masks) + n_terms]
    if mask is not None:
        masks = [ir.node(Op.CONSTANT, [], mask.shape, DType.BOOL, loc, value=mask)]
    if forward:
        q, k, v = values[:3]
        out, lse = _kernel_nodes(traced, [reshaped(q, flat), repeated(k), repeated(v)] + masks + terms, loc)
        lse = reshaped(lse, (batch, heads, seq))
        return [reshaped(out, shape), lse if natural_lse else scaled(lse, 1.0 / math.log(2)), None]  # flex: base 2
    q, k, v, out, grad_out, lse = values[:6]
    lse = reshaped(lse if natural_lse else scaled(lse, math.log(2)), flat[:2])
    grad_q, grad_k, grad_v, *grad_terms = _kernel_nodes(
        traced, [reshaped(q, flat), repeated(k), repeated(v), reshaped(out, flat), reshaped(grad_out, flat), lse]
        + masks + terms, loc)
    return [reshaped(grad_q, shape), summed(grad_k), summed(grad_v)] + grad_terms
