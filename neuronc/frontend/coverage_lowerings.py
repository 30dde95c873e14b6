"""Lowerings of ATen ops that torch-mlir cannot lower and whose torch decomposition stops on another op it cannot
lower either (issue 21: named "cannot be compiled" by `benchmarks.opinfo`'s whole run), and of the degenerate forms
of common ops that torch-mlir refuses (a 0-d cumsum, a roll by zero, a zero-length slice, a boolean-mask index_put).

Each is a rewrite into ops that reach StableHLO, registered like decompositions.OWN (torch_import merges `OWN` after
it); a lowering returns NotImplemented for the forms it does not cover, which then stay refusals with their reason.
Tested against eager in tests/test_coverage_lowerings.py.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from neuronc.frontend.decompositions import _empty

aten = torch.ops.aten


def _known(*sizes) -> bool:
    """Whether every size or index is a plain int. The rules below compare them in Python; a symbolic one (a size
    born of tensor data, in pytorch/data_dependent.py's re-trace with unbacked sizes) would turn each comparison
    into a guard that cannot be decided, and the trace would fail: such forms are left to torch's own ops."""
    return all(isinstance(size, int) for size in sizes if size is not None)


def _hypot(a, b):
    """sqrt(a^2 + b^2) as std::hypot: scaled by the larger magnitude so that no square overflows or underflows;
    inf if either is infinite (even with a NaN beside it), NaN if either is NaN otherwise, 0 for two zeros.
    bf16/fp16 are computed in fp32 and rounded once, as eager's opmath."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    if dtype == torch.float64:
        return NotImplemented
    a, b = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32))
    abs_a, abs_b = torch.abs(a), torch.abs(b)
    larger, smaller = torch.maximum(abs_a, abs_b), torch.minimum(abs_a, abs_b)
    ratio = smaller / torch.where(larger == 0, torch.ones_like(larger), larger)
    result = larger * torch.sqrt(1.0 + ratio * ratio)
    result = torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(result, math.nan), result)
    return torch.where(torch.isinf(a) | torch.isinf(b), torch.full_like(result, math.inf), result).to(dtype)


def _dist(a, b, p=2):
    """torch.dist: the p-norm of a - b (broadcast), as linalg_vector_norm (torch's decomposition writes norm.Scalar,
    which torch-mlir cannot lower)."""
    return aten.linalg_vector_norm.default(a - b, float(p))


def _tan(x):
    """tan = sin / cos (StableHLO's tan has no kernel); both are accurate to an ulp, so the quotient is within
    fp32's tolerance of eager's tan everywhere, the poles included (cos(x) of an fp32 x is never 0)."""
    if not x.is_floating_point() or x.dtype == torch.float64:
        return NotImplemented
    x32 = x.to(torch.float32)  # bf16/fp16 in fp32, rounded once, as eager's opmath
    return (torch.sin(x32) / torch.cos(x32)).to(x.dtype)


def _empty_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """decompositions._empty's zeros (a NEFF's outputs are contiguous: the memory format changes nothing
    observable)."""
    return _empty(x.shape, dtype=dtype or x.dtype, device=device or x.device)


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _empty(size, dtype=dtype, device=device)


def _batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    """Training batch norm with its running statistics updated: torch's own decomposition, but for the cuDNN
    reserve (empty on every other backend): torch makes it as a 0-d uint8 scalar_tensor expanded, which torch-mlir
    cannot lower; here it is a one-element uint8 comparison expanded to no element."""
    from torch._decomp.decompositions import native_batch_norm_helper
    output, save_mean, save_rstd, new_mean, new_var = native_batch_norm_helper(
        input, weight, bias, running_mean, running_var, True, momentum, eps, True)
    reserve = (input.reshape(-1)[:1] > 0).to(torch.uint8).expand(0)
    return output, save_mean, save_rstd, reserve, new_mean, new_var


def _cumsum(x, dim, *, dtype=None):
    """cumsum of a 0-d tensor is the tensor (in the result dtype: int64 for integers and bools, as eager); other
    ranks are torch-mlir's."""
    if x.dim() != 0:
        return NotImplemented
    if dtype is None:
        dtype = torch.int64 if not (x.is_floating_point() or x.is_complex()) else x.dtype
    return x.to(dtype).clone()


def _roll(x, shifts, dims=()):
    """roll by whole turns (every shift a multiple of its dim's size: 0 included) is the tensor itself; torch's
    decomposition cuts a zero-length slice there, which torch-mlir refuses. Other shifts are torch-mlir's."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    sizes = [x.numel()] if not dims else [x.shape[d] for d in dims]
    if not _known(*sizes, *shifts) or any(size and shift % size for shift, size in zip(shifts, sizes)):
        return NotImplemented
    return x.clone()


def _slice(x, dim=0, start=None, end=None, step=1):
    """A slice that selects nothing: zeros of the empty shape (torch-mlir cannot lower a zero-length slice);
    other slices are torch-mlir's."""
    size = x.shape[dim]
    if not _known(size, start, end, *x.shape):
        return NotImplemented
    first = 0 if start is None else (start + size if start < 0 else start)
    last = size if end is None else (end + size if end < 0 else end)
    first, last = min(max(first, 0), size), min(max(last, 0), size)
    if last > first:
        return NotImplemented
    shape = list(x.shape)
    shape[dim] = 0
    return torch.zeros(shape, dtype=x.dtype, device=x.device)


def _index_put(x, indices, values, accumulate=False):
    """x[mask] = values with one boolean mask over x's leading dims and `values` one value or one row broadcast to
    every selected row (loss_parallel and masked targets write this way): a select, mask ? values : x (accumulate:
    x + values where the mask holds). Then the count of selected rows (data) never becomes a shape. Values with one row per selected element (a data-dependent shape) and integer
    indices stay torch-mlir's."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype not in (torch.bool, torch.uint8):
        return NotImplemented
    if not _known(*x.shape, *indices[0].shape, *values.shape):
        return NotImplemented
    mask = indices[0].to(torch.bool)
    row_shape = x.shape[mask.dim():]
    row = values
    while row.dim() > len(row_shape) and row.shape[0] == 1:
        row = row.squeeze(0)
    if row.dim() > len(row_shape) or list(mask.shape) != list(x.shape[:mask.dim()]):
        return NotImplemented
    row = row.to(x.dtype).expand(row_shape)
    selected = mask.reshape(*mask.shape, *([1] * len(row_shape)))
    if accumulate:
        return x + torch.where(selected, row, torch.zeros_like(row))
    return torch.where(selected, row, x)


_BILINEAR_SUPPORT = 1.0  # the triangle filter max(0, 1 - |x|) is nonzero on (-1, 1): interp_size 2, halved


def _antialias_weights(input_size: int, output_size: int, align_corners: bool, scale) -> np.ndarray:
    """[output_size, input_size] weights of ATen's antialiased bilinear resampling along one dim
    (UpSampleKernel.cpp, _compute_indices_min_size_weights_aa), in fp32 as ATen computes them for fp32: output i
    averages the inputs within `support` of its centre scale (i + 1/2), weighted by the triangle filter stretched
    by the scale when downsampling, normalised to sum 1."""
    f32 = np.float32
    if align_corners:
        ratio = f32(input_size - 1) / f32(output_size - 1) if output_size > 1 else f32(0)
    else:
        ratio = f32(1.0 / scale) if scale is not None and scale > 0 else f32(input_size) / f32(output_size)
    support = f32(_BILINEAR_SUPPORT) * ratio if ratio >= 1 else f32(_BILINEAR_SUPPORT)
    inverse = f32(1) / ratio if ratio >= 1 else f32(1)
    weights = np.zeros((output_size, input_size), dtype=np.float32)
    for i in range(output_size):
        center = ratio * f32(i + 0.5)
        first = max(int(center - support + f32(0.5)), 0)
        count = min(int(center + support + f32(0.5)), input_size) - first
        row = np.array([max(f32(0), f32(1) - abs((f32(j + first) - center + f32(0.5)) * inverse))
                        for j in range(count)], dtype=np.float32)
        total = row.sum(dtype=np.float32)
        weights[i, first:first + count] = row / total if total != 0 else row
    return weights


def _upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    """Antialiased bilinear resizing (interpolate(..., antialias=True)): separable, each of H and W a product with
    its constant weight matrix (torch-mlir has no lowering of it)."""
    if not x.is_floating_point() or not _known(*x.shape, *output_size):
        return NotImplemented
    (height, width), (out_height, out_width) = x.shape[-2:], output_size
    rows = torch.from_numpy(_antialias_weights(height, out_height, align_corners, scales_h)).to(x.dtype)
    columns = torch.from_numpy(_antialias_weights(width, out_width, align_corners, scales_w)).to(x.dtype)
    return rows @ (x @ columns.T)


_SCATTER_REDUCTIONS = {"add": "sum", "multiply": "prod"}


def _scatter_reduce_src(x, dim, index, src, reduce):
    """scatter(..., reduce='add' | 'multiply'), the older form: scatter_reduce with the tensor's own values
    included (include_self), which compiles."""
    return aten.scatter_reduce.two(x, dim, index, src, _SCATTER_REDUCTIONS[reduce], include_self=True)


def _scatter_reduce_value(x, dim, index, value, reduce):
    """scatter(..., value, reduce=...): the same with every source element `value`."""
    src = torch.full(index.shape, value, dtype=x.dtype, device=x.device)
    return _scatter_reduce_src(x, dim, index, src, reduce)


OWN = {
    aten._upsample_bilinear2d_aa.default: _upsample_bilinear2d_aa,
    aten.scatter.reduce: _scatter_reduce_src,
    aten.scatter.value_reduce: _scatter_reduce_value,
    aten.hypot.default: _hypot,
    aten.dist.default: _dist,
    aten.tan.default: _tan,
    aten._batch_norm_with_update_functional.default: _batch_norm_with_update_functional,
    aten.empty_like.default: _empty_like,
    aten.empty_permuted.default: _empty_permuted,
    aten.cumsum.default: _cumsum,
    aten.roll.default: _roll,
    aten.slice.Tensor: _slice,
    aten.index_put.default: _index_put,
}
