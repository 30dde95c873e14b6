"""`F.scaled_dot_product_attention` in training graphs: kept whole through AOTAutograd, compiled as the NKI library's
flash forward and backward.

On CPU tensors SDPA is ``aten._scaled_dot_product_flash_attention_for_cpu`` (the output and the log-sum-exp), whose
backward AOTAutograd records as one op, ``_scaled_dot_product_flash_attention_for_cpu_backward``. Decomposed (the
table's default, and what inference wants: the attention pass fuses the math back into the compiler's flash
kernel), the training forward saves the [batch, heads, seq, seq] probabilities and the backward is matmuls,
reductions and elementwise ops over S x S tensors in HBM. Here, as inductor does, the op stays whole when it is
traced for training (the backend's table for a graph some input of which requires a gradient, grad enabled:
``decomposition_table(training=True)``) and the library kernels compute it (:func:`library_computes`), its
decomposition declines (``NotImplemented``: make_fx then records the op itself), and the frontend (:func:`cut_for_training`) cuts the
forward and the backward out of their graphs as the library's flash kernels, as FlexAttention's training is
(frontend/flex_attention.py): the forward writes the log-sum-exp and the backward recomputes P block by block from it.

Masks: ``is_causal`` is the kernels' own causal mask, made on chip. SDPA turns a boolean ``attn_mask`` into an
additive one (``where(mask, 0, -inf)``) before its kernel; where the graph shows that, the boolean mask is the
kernels' run-time keep-mask ([seq, seq], or [batch or 1, heads or 1, seq, seq]). Any other additive mask (the
backward graph's saved one, a float mask) is a run-time term added to the scaled scores (the score_mod step
``score + term``), an fp32 grid read block by block, its -inf entries clamped to the kernels' finite MASKED so a
block whose keys are all masked rescales away as the kernels' own masks do.
"""
from __future__ import annotations

import math

from neuronc.frontend import fx_splice

LIBRARY_DTYPES = ("float32", "bfloat16")  # the library kernels' q, k, v


def _ops():
    import torch

    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def library_computes(query, key, value, dropout_p, attn_mask) -> bool:
    """Whether the library's flash kernels compute SDPA on these tensors (fake or real): q, k, v of [batch, heads,
    seq, d] (k and v may have fewer heads, GQA), one sequence for queries and keys, a multiple of 128, d <= 128,
    fp32 or bf16, no dropout, and a mask (if any) that broadcasts to the scores and needs no gradient."""
    import torch

    from neuronc.nki.library.flash_attention import P

    tensors = (query, key, value)
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in tensors) or dropout_p:
        return False
    batch, heads, seq, d = query.shape
    if key.shape != value.shape or (key.shape[0], key.shape[2], key.shape[3]) != (batch, seq, d):
        return False
    if not key.shape[1] or heads % key.shape[1] or seq % P or d > P:
        return False
    if len({t.dtype for t in tensors}) != 1 or str(query.dtype).removeprefix("torch.") not in LIBRARY_DTYPES:
        return False
    if attn_mask is None:
        return True
    if attn_mask.requires_grad or attn_mask.dim() > 4 or not (attn_mask.is_floating_point()
                                                              or attn_mask.dtype == torch.bool):
        return False
    try:
        torch.broadcast_shapes(tuple(attn_mask.shape), (batch, heads, seq, seq))
    except RuntimeError:
        return False
    return True


def kept_in_training(table: dict) -> dict:
    """For a training graph's table: decompositions of the forward and backward ops that decline (the op stays
    whole) where the frontend cuts them as the library kernels: the forward traced with grad enabled (the tensors
    seen here are below autograd: an intermediate's requires_grad is not visible), the backward whenever the
    forward was kept (given a log-sum-exp, not the probabilities the forward's decomposition returns in its
    place). Otherwise ``table``'s own decompositions."""
    import torch

    forward_op, backward_op = _ops()
    decompose_forward, decompose_backward = table.get(forward_op), table.get(backward_op)

    def forward(*args, **kwargs):
        a = _keywords(forward_op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        if torch.is_grad_enabled() and library_computes(q, k, v, a["dropout_p"], a["attn_mask"]):
            return NotImplemented
        return NotImplemented if decompose_forward is None else decompose_forward(*args, **kwargs)

    def backward(*args, **kwargs):
        a = _keywords(backward_op, args, kwargs)
        if library_computes(a["query"], a["key"], a["value"], a["dropout_p"], a["attn_mask"]) and \
                tuple(a["logsumexp"].shape) == tuple(a["query"].shape[:3]):  # a real log-sum-exp: the forward kept
            return NotImplemented
        return NotImplemented if decompose_backward is None else decompose_backward(*args, **kwargs)

    return {forward_op: forward, backward_op: backward}


def _keywords(op, args, kwargs) -> dict:
    """An SDPA call's arguments, every one by its schema name."""
    from torch.fx.operator_schemas import normalize_function

    return normalize_function(op, args, kwargs, normalize_to_only_use_kwargs=True).kwargs


def _number(value):
    """A scalar argument's value: a Python number, or a `scalar_tensor` node's (None otherwise)."""
    import torch
    import torch.fx

    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.fx.Node) and value.target is torch.ops.aten.scalar_tensor.default:
        return float(value.args[0])
    return None


def _boolean_source(mask):
    """The boolean keep-mask an additive mask was made from (SDPA's ``where(mask, 0, -inf)``), or None."""
    import torch
    import torch.fx

    if isinstance(mask, torch.fx.Node) and mask.target is torch.ops.aten.where.self and \
            _number(mask.args[1]) == 0.0 and _number(mask.args[2]) == -math.inf and \
            mask.args[0].meta["val"].dtype == torch.bool:
        return mask.args[0]
    return None


def _mask_nodes(gm, node, mask, shape: tuple, keep: bool):
    """FX nodes before ``node`` making what the kernels read of ``mask``: a bool keep-mask ([seq, seq] when the same
    for every batch and head, else [batch or 1, heads or 1, seq, seq]) when ``keep``, else the additive mask as an
    fp32 [batch or 1, heads or 1, seq, seq] term, -inf clamped to MASKED."""
    import torch
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table
    from neuronc.nki.library.flash_attention import MASKED

    batch, heads, seq, _ = shape
    given = mask.meta["val"]
    full = (1,) * (4 - given.dim()) + tuple(given.shape)
    wide = (batch if full[0] > 1 else 1, heads if full[1] > 1 else 1, seq, seq)

    def made(m):
        m = torch.broadcast_to(m.reshape(full), wide)
        if keep:
            return ((m if wide[:2] != (1, 1) else m[0, 0]).contiguous(),)
        return (m.to(torch.float32).clamp_min(MASKED).contiguous(),)

    with detect_fake_mode([given]):
        traced = make_fx(made, decomposition_table=decomposition_table())(given)
    (result,) = fx_splice.insert_traced(gm, node, traced, [mask])
    return result


def cut_for_training(cut, locations: dict) -> None:
    """Cut each kept SDPA forward and backward (see the module docstring) out of ``cut``'s graph as the library's
    flash kernel."""
    import hashlib

    import torch

    from neuronc.frontend.flex_attention import library_nodes, traced_library_kernel
    from neuronc.frontend.kernel_calls import _fingerprint
    from neuronc.neff.program import DebugLoc
    from neuronc.nki.library.flash_attention import flash_attention_backward, flash_attention_forward

    forward_op, backward_op = _ops()
    for node in list(cut.gm.graph.nodes):
        if node.op != "call_function" or node.target not in (forward_op, backward_op):
            continue
        forward = node.target is forward_op
        a = _keywords(node.target, node.args, node.kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        values = [x.meta["val"] for x in (q, k, v)]
        if not library_computes(*values, a["dropout_p"], None if mask is None else mask.meta["val"]):
            continue
        if not forward and tuple(a["logsumexp"].meta["val"].shape) != tuple(values[0].shape[:3]):
            continue
        shape, dtype = tuple(values[0].shape), values[0].dtype
        batch, heads, seq, d = shape
        kv_heads = values[1].shape[1]
        flat = (batch * heads, seq, d)
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(d)
        causal = bool(a["is_causal"])
        plan = dict(causal=causal, score_mod=(), blocks=None, mask=None)
        extra, mask_shape, term_shapes = [], None, ()
        if mask is not None:
            if causal:
                continue  # SDPA refuses both
            source = _boolean_source(mask)
            extra = [_mask_nodes(cut.gm, node, source if source is not None else mask, shape, source is not None)]
            if source is not None:
                plan.update(mask="runtime")
                mask_shape = tuple(extra[0].meta["val"].shape)
            else:
                plan.update(score_mod=(("add", (("score",), ("term", 0))),))
                term_shapes = (tuple(extra[0].meta["val"].shape),)
        if forward:
            traced = traced_library_kernel(flash_attention_forward, [flat] * 3, [dtype] * 3, float(scale), plan,
                                           heads, term_shapes, mask_shape=mask_shape)
            outputs = [(shape, traced.outputs[0].dtype), ((batch, heads, seq), traced.outputs[1].dtype)]
            inputs = [q, k, v]
        else:
            traced = traced_library_kernel(flash_attention_backward, [flat] * 5 + [flat[:2]],
                                           [dtype] * 5 + [torch.float32], float(scale), plan, heads, term_shapes,
                                           mask_shape=mask_shape)
            kv_shape = (batch, kv_heads, seq, d)
            outputs = [(shape, traced.outputs[0].dtype)] + [(kv_shape, traced.outputs[0].dtype)] * 2
            inputs = [q, k, v, a["out"], a["grad_out"], a["logsumexp"]]
        loc = locations.get(node.name, DebugLoc())
        digest = _fingerprint(f"sdpa_{'forward' if forward else 'backward'}", traced)
        runtime_mask, n_terms = plan["mask"] == "runtime", len(term_shapes)
        cut.cut(node, inputs + extra, outputs,
                lambda values, traced=traced, forward=forward, shape=shape, kv_heads=kv_heads, loc=loc,
                runtime_mask=runtime_mask, n_terms=n_terms:
                library_nodes(values, traced, forward, shape, kv_heads, loc, runtime_mask=runtime_mask,
                              n_terms=n_terms, natural_lse=True)[:2 if forward else 3],
                hashlib.sha256(digest.encode()).hexdigest(), loc)


# -- attention written out (matmul, scale, mask, softmax, matmul) in a training graph --------------------------
#
# A model that writes attention itself (the zoo's GPT-2 block: `softmax((q @ k^T) / c masked_fill(~causal, -inf))
# @ v`) trains through AOTAutograd as those ops: its forward saves the softmax's [batch, heads, seq, seq]
# probabilities and its backward differentiates them op by op. In a training graph (Dynamo's, before AOTAutograd),
# that chain is rewritten to F.scaled_dot_product_attention, as inductor's fuse_attention does, so it takes the
# flash kernels above; inference graphs are left to the attention pass, which fuses the chain into the compiler's
# flash kernel already. The rewrite is exact in fp32 (the same softmax of the same scaled scores); in bf16 the flash
# kernels keep the scores and probabilities in fp32 where eager rounds each op's result to bf16 (closer to the fp32
# math, as SDPA on CPU is).


def _call(node, *names) -> bool:
    """Whether ``node`` calls one of ``names``: a function's or method's name (Dynamo records `q @ k` as
    operator.matmul, `x.softmax` as a method, `torch.softmax` as a function)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in names


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _value(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _constant_tensor(node):
    """The value of a subgraph made only of factory and elementwise calls on constants (`tril(ones(s, s))`), or
    None when it reads an input."""
    import torch
    import torch.fx

    env = {}

    def evaluate(n):
        if n in env:
            return env[n]
        if n.op not in ("call_function", "call_method"):
            raise LookupError(n)
        args = torch.fx.node.map_arg(n.args, evaluate)
        kwargs = torch.fx.node.map_arg(n.kwargs, evaluate)
        env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        return env[n]

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            value = evaluate(node)
    except Exception:  # noqa: BLE001 - not a constant
        return None
    return value if isinstance(value, torch.Tensor) else None


def _transposed_last_dims(node):
    """k, when ``node`` is k.transpose(-2, -1) of a 4-d k (else None)."""
    if not _call(node, "transpose") or len(node.args) != 3 or _value(node.args[0]) is None:
        return None
    dims = {d % 4 for d in node.args[1:] if isinstance(d, int)}
    return node.args[0] if _value(node.args[0]).dim() == 4 and dims == {2, 3} else None


def explicit_attention_as_sdpa(gm) -> int:
    """In place, in a Dynamo graph traced for training: each `softmax(scale(q @ k.transpose(-2, -1)) [masked_fill(
    ~keep, -inf)], -1) @ v` whose intermediate results nothing else reads, and which the library kernels compute,
    rewritten as F.scaled_dot_product_attention (a causal `keep` that is a constant tril: is_causal). Returns how many."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    rewritten = 0
    for out in list(gm.graph.nodes):
        if not (_call(out, "matmul") and len(out.args) == 2):
            continue
        probs, v = out.args
        if not (_call(probs, "softmax") and _only_user(probs) is out):
            continue
        dim = probs.kwargs.get("dim", probs.args[1] if len(probs.args) > 1 else None)
        if dim not in (-1, 3) or probs.kwargs.get("dtype") is not None or len(probs.args) > 2:
            continue
        scores, keep, causal = probs.args[0], None, False
        chain = [out, probs]
        if _call(scores, "masked_fill") and _only_user(scores) is probs and len(scores.args) == 3 and \
                scores.args[2] == -math.inf:
            hidden = scores.args[1]
            chain.append(scores)
            scores = scores.args[0]
            if _call(hidden, "invert", "__invert__", "logical_not") and len(hidden.args) == 1:
                keep = hidden.args[0]
                chain.append(hidden)
            else:
                continue
        if not _only_user(scores):
            continue
        scale = 1.0
        if _call(scores, "truediv", "div", "mul") and len(scores.args) == 2 and isinstance(scores.args[1], float):
            scale = 1.0 / scores.args[1] if _call(scores, "truediv", "div") else scores.args[1]
            chain.append(scores)
            scores = scores.args[0]
            if not _only_user(scores):
                continue
        if not (_call(scores, "matmul") and len(scores.args) == 2):
            continue
        chain += [scores, scores.args[1]]
        q, k = scores.args[0], _transposed_last_dims(scores.args[1])
        if k is None or any(_value(x) is None for x in (q, k, v)):
            continue
        seq = _value(q).shape[2]
        if keep is not None:
            constant = _constant_tensor(keep)
            if constant is not None and np.array_equal(constant.cpu().numpy(), np.tril(np.ones((seq, seq), dtype=bool))):
                chain.append(keep)
                keep, causal = None, True
        mask_value = None if keep is None else _value(keep)
        if mask_value is not None and mask_value.dtype != torch.bool:
            continue
        if not library_computes(_value(q), _value(k), _value(v), 0.0, mask_value):
            continue
        with gm.graph.inserting_before(out):
            sdpa = gm.graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                          dict(attn_mask=keep, is_causal=causal, scale=scale))
        sdpa.meta = dict(out.meta)
        out.replace_all_uses_with(sdpa)
        _erase_unread(gm.graph, chain)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _erase_unread(graph, nodes: list) -> None:
    """Erase ``nodes`` and what only they read (a causal mask's constant subgraph), once nothing reads them."""
    stack, erased = list(nodes), set()
    while stack:
        n = stack.pop(0)
        if n not in erased and not n.users and n.op in ("call_function", "call_method"):
            inputs = n.all_input_nodes
            graph.erase_node(n)
            erased.add(n)
            stack.extend(inputs)
