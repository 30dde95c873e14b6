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
    from torch.fx.operator_schemas import normalize_function

    forward_op, backward_op = _ops()
    decompose_forward, decompose_backward = table.get(forward_op), table.get(backward_op)

    def arguments(op, args, kwargs) -> dict:
        return normalize_function(op, args, kwargs, normalize_to_only_use_kwargs=True).kwargs

    def forward(*args, **kwargs):
        a = arguments(forward_op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        if torch.is_grad_enabled() and library_computes(q, k, v, a["dropout_p"], a["attn_mask"]):
            return NotImplemented
        return NotImplemented if decompose_forward is None else decompose_forward(*args, **kwargs)

    def backward(*args, **kwargs):
        a = arguments(backward_op, args, kwargs)
        if library_computes(a["query"], a["key"], a["value"], a["dropout_p"], a["attn_mask"]) and \
                tuple(a["logsumexp"].shape) == tuple(a["query"].shape[:3]):  # a real log-sum-exp: the forward kept
            return NotImplemented
        return NotImplemented if decompose_backward is None else decompose_backward(*args, **kwargs)

    return {forward_op: forward, backward_op: backward}


def _arguments(node) -> dict:
    from torch.fx.operator_schemas import normalize_function

    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


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
        a = _arguments(node)
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
