"""Decompositions neuronc writes itself: ATen ops that neither torch-mlir nor torch's own
decomposition table lowers, rewritten into ops that reach StableHLO. One function per op, in a
registry (`OWN`); `torch_import.decomposition_table` merges it after torch-mlir's and torch's tables.
Each is checked against eager in tests/test_ops.py.
"""
from __future__ import annotations

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


def _pair(value) -> tuple:
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value * 2 if len(value) == 1 else value


def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max pooling as the running maximum of the window's kh*kw strided views of the (-inf padded) input,
    and the flat input index of the first maximum (as eager keeps the first). Strided views and elementwise
    maxima fuse into one kernel, where torch's own decomposition gathers every window element; the indices,
    needed only for the backward, are dead code in inference."""
    if ceil_mode or x.dim() not in (3, 4) or not x.is_floating_point():
        from torch._decomp import decomposition_table

        return decomposition_table[aten.max_pool2d_with_indices.default](
            x, kernel_size, stride, padding, dilation, ceil_mode)
    (kh, kw), (sh, sw) = _pair(kernel_size), _pair(stride or kernel_size)
    (ph, pw), (dh, dw) = _pair(padding), _pair(dilation)
    height, width = x.shape[-2:]
    out_h = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    padded = aten.constant_pad_nd(x, [pw, pw, ph, ph], float("-inf"))
    rows = torch.arange(out_h, device=x.device) * sh - ph
    cols = torch.arange(out_w, device=x.device) * sw - pw
    best = index = None
    for i in range(kh):
        for j in range(kw):
            view = padded[..., i * dh: i * dh + sh * (out_h - 1) + 1: sh, j * dw: j * dw + sw * (out_w - 1) + 1: sw]
            here = ((rows[:, None] + i * dh) * width + (cols[None, :] + j * dw)).expand(view.shape)
            if best is None:
                best, index = view, here
                continue
            larger = view > best
            best, index = torch.where(larger, view, best), torch.where(larger, here, index)
    return best, index


OWN = {
    aten.max_pool2d_with_indices.default: _max_pool2d_with_indices,
    aten.remainder.Tensor: _python_remainder,
    aten.remainder.Scalar: _python_remainder,
    aten.sort.stable: _stable_sort,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag,
}
