"""Ops whose output size depends on tensor data, in a bounded form a fixed-shape program can compute.

A NEFF has static shapes, so `nonzero` (and what PyTorch builds on it: `argwhere`, `masked_select`, indexing with a
boolean mask) cannot return "as many rows as there are true elements". What a static-shape device does instead (as
XLA's dynamic padder, or JAX's `nonzero(size=...)`): compute the result padded to its bound (the input's number of
elements) together with the count, read the count on the host, and slice. `nonzero_static` is that bounded form in
PyTorch itself, lowered here with ops the device runs: an exclusive running count of the mask gives each true
element its output row, its coordinates are scattered to that row, and rows past the count (or past `size`) keep
`fill_value`.

`BOUNDED_FORMS` rewrites the data-dependent ops into bounded form + count + slice: the count is read back with
`aten._local_scalar_dense` (as `.item()`), the one place where a size is born, which `pytorch/data_dependent.py`
turns into a device -> host read of one integer and a specialisation of the rest of the graph.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def nonzero_static(x, *, size: int, fill_value: int = -1):
    """aten.nonzero_static: the coordinates of x's first ``size`` nonzero elements in row-major order, int64
    [size, x.dim()], rows past the count filled with ``fill_value``."""
    flat = (x != 0).reshape(-1)
    n, rank = flat.numel(), x.dim()
    device = x.device
    if size * rank == 0:  # no element to compute (a 0-d input's rows have no coordinate)
        return torch.full((size, rank), fill_value, dtype=torch.int64, device=device)
    ones = flat.to(torch.int32)
    before = torch.cumsum(ones, 0) - ones  # how many true elements precede each one: its output row
    spare = size  # a row past the result, where unselected elements (and those beyond `size`) are written
    row = torch.where(flat & (before < size), before, spare).to(torch.int64)
    position = torch.arange(n, dtype=torch.int64, device=device)
    coordinates = []
    stride = n
    for extent in x.shape:
        stride //= max(extent, 1)
        coordinates.append(torch.div(position, max(stride, 1), rounding_mode="floor") % max(extent, 1))
    values = (torch.stack(coordinates, 1) if coordinates
              else torch.zeros((n, 0), dtype=torch.int64, device=device))
    filled = torch.full((size + 1, rank), fill_value, dtype=torch.int64, device=device)
    return filled.index_put((row,), values)[:size]


def _bounded_rows(mask) -> tuple:
    """(nonzero_static of `mask` over every element, the count of its true elements read on the host, with the
    bounds that hold by construction told to the tracer)."""
    rows = nonzero_static(mask, size=mask.numel(), fill_value=0)
    count = (mask != 0).sum().item()
    torch._check(count >= 0)
    torch._check(count <= mask.numel())
    return rows, count


def bounded_nonzero(x):
    """aten.nonzero as nonzero_static over every element, its count read on the host, and a slice."""
    rows, count = _bounded_rows(x)
    return rows[:count]


def bounded_masked_select(x, mask):
    """aten.masked_select: x's elements where mask (both broadcast) is true, gathered at the bounded nonzero rows."""
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    flat_mask = mask.expand(shape).reshape(-1)
    rows, count = _bounded_rows(flat_mask)
    return x.expand(shape).reshape(-1)[rows[:, 0]][:count]


def bounded_index(x, indices):
    """aten.index.Tensor with one boolean mask after leading full slices (``x[mask]``, ``x[:, mask]``): the mask
    becomes its bounded nonzero coordinates (as eager turns it into its nonzero), the gather runs on them and the
    result is sliced to the count. Other index forms are left to the lowering of aten.index."""
    masks = [n for n, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or indices[masks[0]].dtype not in (torch.bool, torch.uint8):
        return NotImplemented
    dim = masks[0]
    mask = indices[dim]
    rows, count = _bounded_rows(mask)
    gathered = aten.index.Tensor(x, [None] * dim + list(rows.unbind(1)))
    return gathered.narrow(dim, 0, count)


OWN = {aten.nonzero_static.default: nonzero_static}  # the decomposition table's: always a static shape

BOUNDED_FORMS = {
    aten.nonzero.default: bounded_nonzero,
    aten.argwhere.default: bounded_nonzero,
    aten.masked_select.default: bounded_masked_select,
    aten.index.Tensor: bounded_index,
}
