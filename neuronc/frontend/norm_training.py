"""Layer-norm in training graphs: the backward recomputes the row statistics instead of the forward saving them.

AOTAutograd's training forward returns `native_layer_norm`'s mean and rstd for the backward: three values leave
the normalisation, so the row-wise fusion pass (which makes a normalisation one kernel when one value leaves it)
leaves it as separate reduction and elementwise kernels, each a round trip of the rows through HBM. With the
backward recomputing mean and rstd from the input it is given anyway (two more row reductions in a kernel that
reads the rows already), the forward's statistics are read by nobody, the partitioner does not save them, and the
forward layer-norm is one row-wise kernel.

The backward op is not given eps: the forward's decomposition records it on its rstd (the same traced tensor the
backward receives, in the one joint trace AOTAutograd makes); a backward whose rstd has no record (not traced
with its forward) uses the saved statistics, as torch's decomposition does.
"""
from __future__ import annotations

import weakref


def recomputed_in_backward(table: dict) -> dict:
    """For a training graph's table: `native_layer_norm` recording eps, and its backward recomputing the
    statistics (in fp32 for narrow types, as the forward computes them), ``table``'s decompositions otherwise."""
    import torch

    aten = torch.ops.aten
    forward_op, backward_op = aten.native_layer_norm.default, aten.native_layer_norm_backward.default
    decompose_forward, decompose_backward = table[forward_op], table[backward_op]
    eps_of: dict = {}  # id(rstd) -> (a weak reference to it, eps): tensors compare elementwise, not as keys

    def forward(x, normalized_shape, weight, bias, eps):
        out, mean, rstd = decompose_forward(x, normalized_shape, weight, bias, eps)
        key = id(rstd)
        eps_of[key] = (weakref.ref(rstd, lambda _: eps_of.pop(key, None)), eps)
        return out, mean, rstd

    def backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
        recorded, eps = eps_of.get(id(rstd), (None, None))
        if recorded is not None and recorded() is rstd:
            dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
            wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
            saved = mean.dtype, rstd.dtype
            mean = wide.mean(dims, keepdim=True)
            rstd = torch.rsqrt((wide - mean).square().mean(dims, keepdim=True) + eps)
            mean, rstd = mean.to(saved[0]), rstd.to(saved[1])
        return decompose_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask)

    return {forward_op: forward, backward_op: backward}
