"""Fusion of elementwise ops: a group of elementwise ops of one shape, whose intermediate results
are used only inside the group, is computed in one kernel, tile by tile in SBUF, instead of making
a round trip through HBM per op. Strided views feeding the group (broadcasts, transposes, slices)
are read through their access pattern by the kernel's DMAs instead of being copied first.

A fused node is `Op.FUSED` with a body of `ir.Step`s and, per input, the view it is read through
(or None). Groups are found in reverse topological order: an op joins its consumers' group when
all its consumers are in that one group, so every group has a single root whose value leaves it.
Fusing always saves time under the cost model (no HBM store and reload, fewer fixed costs) while
the kernel's tiles fit SBUF, which the limits below guarantee.
"""
from __future__ import annotations

from typing import Callable

from neuronc import ir
from neuronc.isa import DType
from neuronc.ir import Op, Step
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import dense_strides, reshaped_strides

MAX_STEPS = 64
MAX_INPUTS = 8


def private_chain(reader, x, consumers: dict, outputs: set) -> list | None:
    """[x, the reshapes under it..., the value they reshape] when each link is read by the next
    one only (the first by `reader`) and none is an output; else None."""
    chain = [x]
    while chain[-1].op is Op.RESHAPE:
        chain.append(chain[-1].inputs[0])
    private = all(consumers.get(c) == {r} for c, r in zip(chain, [reader] + chain))
    return chain if private and not any(c in outputs for c in chain) else None


def _groups(graph: ir.Graph) -> dict:
    """node -> the root of its fusion group (elementwise nodes only)."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    root_of, size = {}, {}
    for n in reversed(graph.nodes()):
        if n.op not in ir.ELEMENTWISE:
            continue
        users = consumers.get(n, set())
        roots = {root_of.get(c) for c in users}
        joinable = (n not in outputs and users and len(roots) == 1 and None not in roots
                    and all(c.shape == n.shape for c in users))
        root = roots.pop() if joinable else n
        if root is not n and size[root] >= MAX_STEPS:
            root = n
        root_of[n] = root
        size[root] = size.get(root, 0) + 1
    return root_of


def fuse_elementwise(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    root_of = _groups(graph)
    members: dict = {}
    for n in graph.nodes():
        if n in root_of:
            members.setdefault(root_of[n], []).append(n)  # topological order
    new_inputs: dict = {}

    def fuse(node, inputs):
        new_inputs[node] = inputs
        if root_of.get(node) is not node:
            return None
        group = members[node]
        position = {m: j for j, m in enumerate(group)}
        steps, externals = [], []  # externals: (node, view), view = None or (offset, strides)

        def external(x) -> tuple:
            view = None
            if x.op is Op.VIEW and x.inputs[0].op is not Op.CONSTANT:
                x, view = x.inputs[0], (x.attrs["offset"], x.attrs["strides"])  # read through the view
            if (x, view) not in externals:
                externals.append((x, view))
            return ("input", externals.index((x, view)))

        for m in group:
            args = []
            for old, new in zip(m.inputs, new_inputs[m]):
                if old in position:
                    args.append(("step", position[old]))
                elif new.scalar is not None and float(new.scalar) == new.scalar:  # an immediate is a float64
                    args.append(("imm", new.scalar))
                else:
                    args.append(external(new))
            steps.append(Step(m.op, tuple(args), m.dtype, m.attrs))
        viewed = any(view is not None for _, view in externals)
        if (len(steps) == 1 and not viewed) or len(externals) > MAX_INPUTS:
            return None  # nothing to gain, or too many inputs: the group's ops stay separate kernels
        # the float converts the instructions do anyway folded (a bf16 x * c that eager computes in fp32 is
        # convert, multiply, convert in the graph: one instruction)
        body = fold_converts(tuple(steps), {i: x.dtype for i, (x, _) in enumerate(externals)})
        return ir.node(Op.FUSED, [x for x, _ in externals], node.shape, node.dtype, node.loc,
                       body=body, views=tuple(view for _, view in externals))

    return graph.rewrite(fuse)


def _as_view(x):
    """(source, (offset, strides)) reading x's values from a materialised tensor, or (x, None)."""
    source, offset, strides, shape = x, 0, dense_strides(x.shape), x.shape
    if source.op is Op.RESHAPE:
        source = source.inputs[0]
        if source.op is not Op.VIEW:
            return source, None  # a reshape of a dense tensor is the same bytes: nothing to fold
        strides = reshaped_strides(source.shape, source.attrs["strides"], shape)
        if strides is None:
            return x, None
        offset = source.attrs["offset"]
    elif source.op is Op.VIEW:
        offset, strides = source.attrs["offset"], source.attrs["strides"]
    else:
        return x, None
    inner = source.inputs[0]
    if inner.op is Op.CONSTANT:
        return x, None
    return inner, (offset, tuple(strides))


def fuse_matmul_operands(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Matmuls read transposed, sliced or broadcast operands through their views: the Tensor
    engine's operand loads are DMAs with any access pattern, so the copy of the view is saved."""

    def fold(node, inputs):
        if node.op is not Op.MATMUL:
            return None
        operands = [_as_view(x) for x in inputs]
        if all(view is None for _, view in operands):
            return None
        return ir.node(Op.MATMUL, [x for x, _ in operands], node.shape, node.dtype, node.loc, k=node.attrs["k"],
                       views=tuple(view for _, view in operands))

    return graph.rewrite(fold)


def fuse_matmul_epilogues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """An elementwise group reading a matmul's result (its only reader) becomes the matmul's
    epilogue: computed from the PSUM accumulator tile by tile, the product never touches HBM.
    Repeated until nothing changes, so chains of groups (bias add, then GELU) all join; then the
    epilogue's float converts are folded into the instructions around them (`fold_converts`)."""
    fused = fuse_epilogues(graph, Op.MATMUL)
    consumers = fused.consumers()
    outputs = set(fused.outputs)

    def fold(node, inputs):
        if node.op is not Op.MATMUL or not node.attrs.get("epilogue"):
            return None
        inputs, body = list(inputs), tuple(node.attrs["epilogue"])
        for i in range(2, len(inputs)):  # an epilogue input widened for this matmul only: widened in the epilogue
            x = node.inputs[i]
            if (x.op is Op.CONVERT and x.dtype is DType.F32 and x.inputs[0].dtype in _NARROW
                    and consumers.get(x) == {node} and x not in outputs and inputs[i].op is Op.CONVERT):
                inputs[i] = inputs[i].inputs[0]
                body = _widened_input(body, i - 1)
        dtypes = {0: DType.F32} | {i: x.dtype for i, x in enumerate(inputs[2:], start=1)}  # 0: the accumulator
        body = fold_converts(body, dtypes)
        views = node.attrs.get("views") or (None,) * len(inputs)
        attrs = {**node.attrs, "epilogue": body}
        row = _bias_row(body, inputs, views)
        if row is not None:  # the bias is added by the Tensor engine: the epilogue reads the sum from PSUM
            first = body[0]
            attrs.update(epilogue=(first._replace(op=Op.CONVERT, args=(("input", 0),)),) + body[1:], bias_row=row)
        return ir.node(Op.MATMUL, inputs, node.shape, node.dtype, node.loc, **attrs)

    return fused.rewrite(fold)


def fuse_epilogues(graph: ir.Graph, kind: Op, refine: Callable[[ir.Node], ir.Node | None] = lambda node: node
                   ) -> ir.Graph:
    """Elementwise consumers of `kind` nodes (kernels accumulating in PSUM, first two inputs their operands)
    folded in as their epilogue, until nothing changes. `refine(fused)` may adjust a fused node (re-tile
    it) or reject the fusion with None."""
    while True:
        fused = _fold_epilogues_once(graph, kind, refine)
        if len(fused.nodes()) == len(graph.nodes()):
            return fused
        graph = fused

def _bias_row(body, inputs, views) -> int | None:
    """The epilogue input j that is a 16-bit float row [N] added to the accumulator by the first step (a
    linear layer's bias) and read by nothing else, or None. The kernel adds it into PSUM with a rank-1
    matmul (ones [1, M] x bias [1, N]): fp32 acc + the exact product 1 * bias, rounded to fp32, is the ADD's
    fp32 sum, so the first step becomes the rounding of the PSUM value to the ADD's dtype."""
    if not body or body[0].op is not Op.ADD or ("input", 0) not in body[0].args:
        return None
    (kind, j), = [arg for arg in body[0].args if arg != ("input", 0)] or [("imm", None)]
    if kind != "input" or any(("input", j) in step.args for step in body[1:]):
        return None
    x, view = inputs[1 + j], views[1 + j]
    if x.dtype not in _NARROW or view is None or tuple(view[1]) != (0, 0, 1):
        return None
    return j


def _widened_input(body, index: int) -> tuple:
    """`body` reading input `index` through a first step converting it to fp32."""
    def shift(arg):
        kind, ref = arg
        return ("step", 0) if arg == ("input", index) else ("step", ref + 1) if kind == "step" else arg

    first = Step(Op.CONVERT, (("input", index),), DType.F32, {})
    return (first,) + tuple(step._replace(args=tuple(map(shift, step.args))) for step in body)


# Steps computed in fp32 and rounded once to their dtype by the instruction that writes them.
_ROUNDED_ONCE = frozenset(op for op in Op if ir.facts(op).rounded_once)
_NARROW = (DType.BF16, DType.F16)


def _dtype_of(body, arg, inputs_dtype) -> DType | None:
    kind, ref = arg
    return body[ref].dtype if kind == "step" else inputs_dtype(ref) if kind == "input" else None


def fold_converts(body: tuple, input_dtypes: dict | None = None) -> tuple:
    """A body without the float converts an instruction does anyway. A kernel computes each step in fp32 and
    rounds it once to the step's dtype as it writes it, so (exactly):
    * convert_bf16(x) of an fp32 step x read by nothing else: x is written in bf16 directly;
    * convert_f32(y) of a bf16/fp16 value y, read only by fp32-computing steps: they read y (widening is exact).
    `input_dtypes` (input index -> dtype) tells the inputs' dtypes; unknown inputs keep their converts."""
    body = list(body)
    dtype_of_input = (lambda i: input_dtypes.get(i)) if input_dtypes else (lambda i: None)
    last = len(body) - 1
    users = [[j for j, step in enumerate(body) if ("step", i) in step.args] for i in range(len(body))]
    alias: dict = {}  # step -> the (kind, ref) it is replaced by
    for j, step in enumerate(body):
        if step.op is not Op.CONVERT or step.args[0][0] == "imm":
            continue
        src = step.args[0]
        src_dtype = _dtype_of(body, src, dtype_of_input)
        if (step.dtype in _NARROW and src[0] == "step" and src_dtype is DType.F32 and users[src[1]] == [j]
                and body[src[1]].op in _ROUNDED_ONCE and src[1] not in alias):
            body[src[1]] = body[src[1]]._replace(dtype=step.dtype)
            alias[j] = src
        elif (step.dtype is DType.F32 and src_dtype in _NARROW and j != last and users[j]
              and all(body[u].op in _ROUNDED_ONCE for u in users[j])):
            alias[j] = src
    if not alias:
        return tuple(body)

    def resolve(arg):
        while arg[0] == "step" and arg[1] in alias:
            arg = alias[arg[1]]
        return arg

    return _without(body, alias, resolve, resolve(("step", last))[1])  # the last step is never an input's alias


def _without(body, alias, resolve, root) -> tuple:
    """The steps the root needs (aliased steps dropped, args resolved), renumbered, the root last."""
    needed, stack = set(), [root]
    while stack:
        j = stack.pop()
        if j in needed:
            continue
        needed.add(j)
        stack.extend(r for kind, r in map(resolve, body[j].args) if kind == "step")
    order = sorted(needed)
    number = {j: n for n, j in enumerate(order)}
    return tuple(body[j]._replace(args=tuple(("step", number[r]) if kind == "step" else (kind, r)
                                             for kind, r in map(resolve, body[j].args))) for j in order)


def _fold_epilogues_once(graph: ir.Graph, kind: Op, refine) -> ir.Graph:
    consumers = graph.consumers()
    outputs = set(graph.outputs)

    def product(node, position):
        """The `kind` node whose value input `position` of `node` is, if `node` is its only reader."""
        chain = private_chain(node, node.inputs[position], consumers, outputs)
        views = node.attrs.get("views") or (None,) * len(node.inputs)
        if chain is not None and chain[-1].op is kind and views[position] is None:
            return chain[-1]
        return None

    def fold(node, inputs):
        if node.op not in ir.ELEMENTWISE | {Op.FUSED}:
            return None
        position = next((p for p in range(len(node.inputs)) if product(node, p) is not None), None)
        if position is None:
            return None
        matmul = ir.unreshaped(inputs[position])
        views = node.attrs.get("views") or (None,) * len(node.inputs)
        body = ir.body_of(node)
        read = {a[1] for step in body for a in step.args if a[0] == "input"}
        previous = matmul.attrs.get("epilogue", ())  # an epilogue already there runs first
        matmul_views = matmul.attrs.get("views") or (None,) * len(matmul.inputs)
        extra, extra_views, index = list(matmul.inputs[2:]), list(matmul_views[2:]), {}
        for j, (x, view) in enumerate(zip(inputs, views)):
            if j == position or j not in read:
                continue
            offset, strides = view or (0, dense_strides(node.shape))
            strides = reshaped_strides(node.shape, strides, matmul.shape)
            if strides is None:
                return None  # this input cannot be read in the matmul's [B, M, N] coordinates
            index[j] = 1 + len(extra)
            extra.append(x)
            extra_views.append((offset, strides))
        steps = list(previous)
        if not steps and matmul.dtype != DType.F32:  # the product is rounded to its dtype before its readers see it
            steps.append(Step(Op.CONVERT, (("input", 0),), matmul.dtype, {}))
        base = len(steps)
        result = ("step", base - 1) if steps else ("input", 0)
        for step in body:
            args = tuple(
                (result if a[1] == position else ("input", index[a[1]])) if a[0] == "input"
                else ("step", base + a[1]) if a[0] == "step" else a
                for a in step.args
            )
            steps.append(step._replace(args=args))
        if len(steps) > MAX_STEPS or len(extra) > MAX_INPUTS:
            return None
        fused = ir.node(kind, [*matmul.inputs[:2], *extra], matmul.shape, node.dtype, matmul.loc,
                        **{**matmul.attrs, "views": tuple(matmul_views[:2]) + tuple(extra_views),
                           "epilogue": tuple(steps)})
        fused = refine(fused)
        if fused is None:
            return None
        return fused if fused.shape == node.shape else ir.node(Op.RESHAPE, [fused], node.shape, node.dtype, node.loc)

    return graph.rewrite(fold)


def _compact(body, inputs, views) -> tuple:
    """Keep only the inputs the body reads, renumbering its ("input", i) args."""
    read = sorted({a[1] for step in body for a in step.args if a[0] == "input"})
    index = {old: new for new, old in enumerate(read)}
    body = tuple(step._replace(args=tuple(("input", index[a[1]]) if a[0] == "input" else a for a in step.args))
                 for step in body)
    return body, [inputs[i] for i in read], [views[i] for i in read]


def fuse_reduction_prologues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """A reduction reads its [R, C] operand through the operand's producer: an elementwise group
    (computed tile by tile before the reduce, never stored) or a strided view (a transposed or
    windowed operand, read in place)."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)

    def fold(node, inputs):
        if node.op is not Op.REDUCE_LAST or "cols" in node.attrs:
            return None
        chain = private_chain(node, node.inputs[0], consumers, outputs)
        if chain is None:
            return None
        producer, new = chain[-1], ir.unreshaped(inputs[0])
        rows, cols = node.inputs[0].shape
        if producer.op in ir.ELEMENTWISE | {Op.FUSED}:
            body = ir.body_of(new)
            views = new.attrs.get("views") or (None,) * len(new.inputs)
            body, sources, views = _compact(body, list(new.inputs), list(views))
        elif producer.op is Op.VIEW and new.inputs[0].op is not Op.CONSTANT:
            body, sources, views = None, [new.inputs[0]], [(new.attrs["offset"], new.attrs["strides"])]
        else:
            return None
        converted = []
        for view in views:
            offset, strides = view or (0, dense_strides(new.shape))
            strides = reshaped_strides(new.shape, strides, (rows, cols))
            if strides is None:
                return None
            converted.append((offset, strides))
        if len(sources) > MAX_INPUTS:
            return None
        return ir.node(Op.REDUCE_LAST, sources, node.shape, node.dtype, node.loc, kind=node.attrs["kind"],
                       cols=cols, prologue=body, views=tuple(converted))

    return graph.rewrite(fold)
