"""Decompositions neuronc writes itself: ATen ops that neither torch-mlir nor torch's own
decomposition table lowers, rewritten into ops that reach StableHLO. One function per op, in a
registry (`OWN`); `torch_import.decomposition_table` merges it after torch-mlir's and torch's tables.
Each is checked against eager in tests/test_ops.py.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch

aten = torch.ops.aten

EMBEDDING_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


def _stable_sort(x, *, stable=None, dim=-1, descending=False):
    """torch-mlir lowers only sort.default; neuronc's sort keeps equal keys in order either way (stable)."""
    return aten.sort.default(x, dim, descending)


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Bags of rows of `weight`: bag b holds indices[offsets[b]:offsets[b + 1]]. With static shapes, the bag
    of each index is a count of the offsets at or before it; sum and mean add rows into their bag
    (index_add: a scatter-add), max takes a masked maximum over every (bag, index) pair."""
    count = indices.shape[0]
    starts = offsets[:-1] if include_last_offset else offsets
    bags = starts.shape[0]
    position = torch.arange(count, device=indices.device)
    bag_of = (position[:, None] >= starts[None, :]).sum(1) - 1  # offset2bag
    if include_last_offset:
        bag_of = torch.where(position < offsets[-1], bag_of, bags)  # indices past the last offset join no bag
    keep = (indices != padding_idx) & (bag_of < bags) if padding_idx >= 0 else bag_of < bags
    rows = weight[indices]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    rows = torch.where(keep[:, None], rows, torch.zeros((), dtype=rows.dtype))
    safe_bag = torch.where(keep, bag_of, 0)
    sizes = torch.zeros(bags, dtype=torch.int64).index_add(0, safe_bag, keep.long())
    mode_name = EMBEDDING_BAG_MODES[mode]
    if mode_name == "max":
        member = (bag_of[None, :] == torch.arange(bags)[:, None]) & keep[None, :]  # [bags, count]
        lowest = torch.finfo(rows.dtype).min
        candidates = torch.where(member[:, :, None], rows[None, :, :], lowest)
        output, arg = candidates.max(dim=1)
        output = torch.where(sizes[:, None] > 0, output, torch.zeros((), dtype=rows.dtype))
        max_indices = torch.where(sizes[:, None] > 0, indices[arg], -1)
    else:
        output = torch.zeros(bags, weight.shape[1], dtype=rows.dtype).index_add(0, safe_bag, rows)
        if mode_name == "mean":
            output = output / sizes.clamp(min=1)[:, None].to(rows.dtype)
        max_indices = torch.zeros(bags if mode_name == "max" else 0, dtype=torch.int64)
    return output, bag_of, sizes, max_indices


def _python_remainder(a, b):
    """torch.remainder is Python's modulo (the divisor's sign); torch-mlir lowers it to stablehlo.remainder,
    C's fmod (the dividend's sign), and torch's own decomposition gives prims.remainder, which torch-mlir
    does not lower. fmod, moved into the divisor's sign."""
    divisor_negative = b < 0
    if not isinstance(b, torch.Tensor):  # torch-mlir lowers fmod.Tensor, not fmod.Scalar
        b = torch.scalar_tensor(b, dtype=a.dtype)
    r = torch.fmod(a, b)
    return torch.where((r != 0) & ((r < 0) != divisor_negative), r + b, r)


def _tuple(value, n: int) -> tuple:
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value * n if len(value) == 1 else value


def _pair(value) -> tuple:
    return _tuple(value, 2)


def _pooled_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape: with ceil_mode, a last partial window counts if it starts inside the
    input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    """Per spatial dim (kernel, stride, padding, dilation, output size, extra high padding): the padding
    a ceil_mode window reaches past the input's right padding is explicit, so no window is cut short."""
    kernel = _tuple(kernel_size, nd)
    stride = _tuple(stride or kernel_size, nd)
    padding, dilation = _tuple(padding, nd), _tuple(dilation, nd)
    dims = []
    for size, k, s, p, d in zip(x.shape[-nd:], kernel, stride, padding, dilation):
        out = _pooled_size(size, k, s, p, d, ceil_mode)
        extra = max(0, (out - 1) * s + d * (k - 1) + 1 - (size + 2 * p))
        dims.append((k, s, p, d, out, extra))
    return dims


def _pad_spatial(x, dims, value):
    pads = []
    for k, s, p, d, out, extra in reversed(dims):  # constant_pad_nd lists the last dim first
        pads += [p, p + extra]
    return aten.constant_pad_nd(x, pads, value)


def _max_pool_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, nd):
    """Max pooling (2-d, 3-d) as the running maximum of the window's strided views of the (-inf padded)
    input, and the flat input index of the maximum eager picks (the first; the last NaN, as eager's
    `val > max || isnan(val)`). ceil_mode's last partial window reads -inf past the input. Strided views and
    elementwise maxima fuse into one kernel, where torch's own decomposition gathers every window element;
    the indices, needed only for the backward, are dead code in inference. (torch-mlir's own lowering of
    max_pool3d with ceil_mode pads both sides, which shifts every window: wrong results.)"""
    if x.dim() not in (nd + 1, nd + 2) or not x.is_floating_point():
        from torch._decomp import decomposition_table

        op = aten.max_pool2d_with_indices.default if nd == 2 else aten.max_pool3d_with_indices.default
        return decomposition_table[op](x, kernel_size, stride, padding, dilation, ceil_mode)
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    padded = _pad_spatial(x, dims, float("-inf"))
    sizes = x.shape[-nd:]
    best = index = None
    for offsets in itertools.product(*(range(k) for k, *_ in dims)):
        view, here = padded, None
        for axis, ((k, s, p, d, out, extra), i, size) in enumerate(zip(dims, offsets, sizes)):
            dim = x.dim() - nd + axis
            view = aten.slice(view, dim, i * d, i * d + s * (out - 1) + 1, s)
            position = torch.arange(out, device=x.device) * s - p + i * d  # along this axis, in the input
            shape = [1] * nd
            shape[axis] = out
            position = position.reshape(shape)
            here = position if here is None else here * size + position
        here = here.expand(view.shape)
        if best is None:
            best, index = view, here
            continue
        larger = (view > best) | torch.isnan(view)
        best, index = torch.where(larger, view, best), torch.where(larger, here, index)
    return best, index


def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, nd=2)


def _max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, nd=3)


def _avg_pool_divisor(dims, sizes, count_include_pad: bool, dtype):
    """Eager's divisor of each output position: the window clipped to the padded input (count_include_pad)
    or to the input itself; a number where every window has the same, else a tensor over the spatial dims
    (made of aranges, which the compiler folds into a constant)."""
    counts = []
    for (k, s, p, d, out, extra), size in zip(dims, sizes):
        start = np.arange(out) * s - p
        end = np.minimum(start + k, size + p)
        if not count_include_pad:
            end, start = np.minimum(end, size), np.maximum(start, 0)
        counts.append(end - start)
    if all(len(set(c.tolist())) == 1 for c in counts):
        return float(np.prod([c[0] for c in counts]))
    divisor = None
    for axis, ((k, s, p, d, out, extra), size) in enumerate(zip(dims, sizes)):
        start = torch.arange(out) * s - p
        end = torch.clamp(start + k, max=size + p)
        if not count_include_pad:
            end, start = torch.clamp(end, max=size), torch.clamp(start, min=0)
        shape = [1] * len(dims)
        shape[axis] = out
        count = (end - start).reshape(shape)
        divisor = count if divisor is None else divisor * count
    return divisor.to(dtype)


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, *, nd):
    """Average pooling: window sums, each spatial dim in turn (a sum of the window's strided views of the zero
    padded input), divided by eager's divisor (divisor_override, or the window's size clipped as eager
    clips it). torch-mlir's own lowering ignores divisor_override and cuts ceil_mode's last window
    differently from eager: silently wrong results; its plain form is kept."""
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, 1, ceil_mode)
    total = _pad_spatial(x, dims, 0.0)
    for axis, (k, s, p, d, out, extra) in enumerate(dims):
        dim = x.dim() - nd + axis
        views = [aten.slice(total, dim, i, i + s * (out - 1) + 1, s) for i in range(k)]
        total = functools.reduce(torch.add, views)
    if divisor_override:
        return total / divisor_override
    return total / _avg_pool_divisor(dims, x.shape[-nd:], count_include_pad, x.dtype)


def _needs_own_avg_pool(ceil_mode, divisor_override) -> bool:
    return bool(ceil_mode) or divisor_override is not None


def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if not _needs_own_avg_pool(ceil_mode, divisor_override) or not x.is_floating_point():
        return NotImplemented
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd=2)


def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if not x.is_floating_point():
        return NotImplemented
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd=3)


def _spread(g, dim: int, stride: int):
    """g with stride - 1 zeros between its elements along dim: g[j] lands at j * stride (a pad, a reshape
    and a slice, where a strided scatter would be a scatter)."""
    if stride == 1:
        return g
    n = g.shape[dim]
    g = g.unsqueeze(dim + 1)
    pads = [0, 0] * (g.dim() - 1 - (dim + 1)) + [0, stride - 1]
    g = aten.constant_pad_nd(g, pads, 0.0)
    g = g.reshape(*g.shape[:dim], n * stride, *g.shape[dim + 2:])
    return aten.slice(g, dim, 0, stride * (n - 1) + 1)


def _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, *, nd):
    """The adjoint of `_avg_pool`, one spatial dim at a time (the window sum is separable): each output's
    gradient over its divisor, spread to its window's start and summed over the window's offsets, then the
    padding cut off. (torch-mlir cannot lower avg_pool{2,3}d_backward.)"""
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, 1, ceil_mode)
    divisor = divisor_override or _avg_pool_divisor(dims, x.shape[-nd:], count_include_pad, grad.dtype)
    g = grad / divisor
    for axis, ((k, s, p, d, out, extra), size) in enumerate(zip(dims, x.shape[-nd:])):
        dim = x.dim() - nd + axis
        spread = _spread(g, dim, s)
        length = size + 2 * p + extra
        total = None
        for i in range(k):
            pads = [0, 0] * (x.dim() - 1 - dim) + [i, length - i - spread.shape[dim]]
            shifted = aten.constant_pad_nd(spread, pads, 0.0)
            total = shifted if total is None else total + shifted
        g = aten.slice(total, dim, p, p + size)
    return g


def _avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                              nd=2)


def _avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                              nd=3)


def _max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each output's gradient added at the input position its index names (a scatter-add over the
    flattened spatial dims)."""
    batch = x.shape[:-3]
    flat_grad = grad.reshape(*batch, -1)
    flat_index = indices.reshape(*batch, -1)
    spatial = x.shape[-3] * x.shape[-2] * x.shape[-1]
    total = torch.zeros(*batch, spatial, dtype=grad.dtype, device=grad.device).scatter_add(-1, flat_index, flat_grad)
    return total.reshape(x.shape)


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """x with src written over x[start:end:step] along dim (the backward of a slice, e.g. RoPE's rotate_half):
    with step 1 the untouched parts and src concatenated; with a step, src spread to every step-th position
    (a pad and a reshape) and selected where the slice lies. torch's own decomposition gathers from src
    through an index per element; torch-mlir does not lower the op itself."""
    dim = dim % x.dim() if x.dim() else 0
    size = x.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    count = max(0, (end - start + step - 1) // step)
    if count == 0:
        return x.clone()
    shape = list(x.shape)
    shape[dim] = count
    src = src.expand(shape).to(x.dtype)
    if step == 1:
        parts = [aten.slice(x, dim, 0, start), src, aten.slice(x, dim, end, size)]
        return torch.cat([p for p in parts if p.shape[dim] > 0], dim)
    spread = _spread(src, dim, step)
    after = size - start - spread.shape[dim]
    placed = aten.constant_pad_nd(spread, [0, 0] * (x.dim() - 1 - dim) + [start, after], 0.0)
    position = torch.arange(size, device=x.device)
    inside = (position >= start) & (position < start + spread.shape[dim]) & ((position - start) % step == 0)
    mask_shape = [1] * x.dim()
    mask_shape[dim] = size
    return torch.where(inside.reshape(mask_shape), placed, x)


def _logaddexp(a, b):
    """log(exp(a) + exp(b)) without overflow: the larger plus log1p of the smaller's share (a == b, infinities
    included, is a + log 2)."""
    larger = torch.maximum(a, b)
    return torch.where(a == b, a + math.log(2.0), larger + torch.log1p(torch.exp(-torch.abs(a - b))))


def _logcumsumexp(x, dim):
    """Running log-sum-exp as a scan of log-sum-exp over doubling strides (Hillis-Steele: ceil(log2 n)
    elementwise steps of shifted views). torch-mlir lowers it as log(cumsum(exp(x))), which overflows to inf
    for inputs above ~88 (float32): silently wrong results."""
    if x.dim() == 0:
        return x.clone()
    dim = dim % x.dim()
    n = x.shape[dim]
    stride = 1
    while stride < n:
        pads = [0, 0] * (x.dim() - 1 - dim) + [stride, 0]
        shifted = aten.slice(aten.constant_pad_nd(x, pads, float("-inf")), dim, 0, n)
        x = _logaddexp(x, shifted)
        stride *= 2
    return x


OWN = {
    aten.max_pool2d_with_indices.default: _max_pool2d_with_indices,
    aten.max_pool3d_with_indices.default: _max_pool3d_with_indices,
    aten.avg_pool2d.default: _avg_pool2d,
    aten.avg_pool3d.default: _avg_pool3d,
    aten.logcumsumexp.default: _logcumsumexp,
    aten.slice_scatter.default: _slice_scatter,
    aten.avg_pool2d_backward.default: _avg_pool2d_backward,
    aten.avg_pool3d_backward.default: _avg_pool3d_backward,
    aten.max_pool3d_with_indices_backward.default: _max_pool3d_with_indices_backward,
    aten.remainder.Tensor: _python_remainder,
    aten.remainder.Scalar: _python_remainder,
    aten.sort.stable: _stable_sort,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag,
}
