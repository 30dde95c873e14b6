"""Slices of access patterns (a tile at an offset, rows, columns, a column broadcast), tensors in HBM addressed by
slices (`HbmTensor`), and the DMA split that moves a large tile over several queues: the vocabulary kernels build
their tiles from."""
from __future__ import annotations

import dataclasses

from neuronc.codegen.emitter import Emitter
from neuronc.codegen.sync import partition_group
from neuronc.ir import Node
from neuronc.isa import AccessPattern, DType, Space, row_major_dims
from neuronc.placement import dma_slice_count
from neuronc.plans import MemoryPlan, View, dense_strides
from neuronc.targets import Target


def tile_at(ap: AccessPattern, element: int, partitions: int, *free: int) -> AccessPattern:
    """The [partitions, free...] tile starting `element` elements into each partition of `ap`'s slot."""
    return dataclasses.replace(ap, offset=ap.offset + element * ap.dtype.itemsize,
                               dims=((1, partitions), *row_major_dims(free)))


def column_slice(ap: AccessPattern, c0: int, c1: int) -> AccessPattern:
    """Columns [c0, c1) of a [partitions, n] on-chip tile, or of a [rows, n] HBM pattern (its column stride)."""
    stride = ap.dims[1][0] if ap.space == Space.HBM else 1
    return dataclasses.replace(ap, offset=ap.offset + c0 * stride * ap.dtype.itemsize, dims=(ap.dims[0], (stride, c1 - c0)))


def row_slice(ap: AccessPattern, p0: int, p1: int) -> AccessPattern:
    """Partitions [p0, p1) of an on-chip tile, or the matching rows of an HBM pattern."""
    stride, _ = ap.dims[0]
    dims = ((stride, p1 - p0), *ap.dims[1:])
    if ap.space == Space.HBM:
        return dataclasses.replace(ap, offset=ap.offset + p0 * stride * ap.dtype.itemsize, dims=dims)
    return dataclasses.replace(ap, partition=ap.partition + p0, dims=dims)


def first_rows(ap: AccessPattern, rows: int) -> AccessPattern:
    return dataclasses.replace(ap, dims=((ap.dims[0][0], rows), *ap.dims[1:]))


def broadcast_columns(ap: AccessPattern, cols: int) -> AccessPattern:
    """A [rows, 1] tile read as [rows, cols]: the free axis with stride 0."""
    return dataclasses.replace(ap, dims=(ap.dims[0], (0, cols)))


def dma_by_rows(em: Emitter, dst: AccessPattern, src: AccessPattern, pieces: int | None = None) -> None:
    """One DMA per slice of partitions, on consecutive queues, so that a large tile moves at the
    bandwidth of several queues (see :func:`dma_slices`; `pieces` at most, when given)."""
    onchip = dst if dst.space != Space.HBM else src
    for p0, p1 in dma_slices(em.target, onchip, pieces):
        em.dma(row_slice(dst, p0, p1), row_slice(src, p0, p1))


def dma_by_columns(em: Emitter, dst: AccessPattern, src: AccessPattern, pieces: int) -> None:
    """One DMA per slice of columns (every partition), on consecutive queues: the split of a tile stored
    transposed, where a slice of partitions would write a few elements of every row of the destination and
    so share its hazard-tracking pages with every other slice (a slice of columns writes rows of its own)."""
    onchip = dst if dst.space != Space.HBM else src
    (_, cols), = onchip.dims[1:]
    pieces = max(1, min(cols, pieces))
    for c0, c1 in ((cols * k // pieces, cols * (k + 1) // pieces) for k in range(pieces)):
        em.dma(column_slice(dst, c0, c1), column_slice(src, c0, c1))


def dma_slices(target: Target, tile: AccessPattern, pieces: int | None = None) -> list:
    """[(p0, p1)] slices of a tile's partitions (relative to its first) that DMAs on consecutive queues move
    at once, cut at partition-group boundaries (a slice sharing a group with the next would be ordered
    before it). `pieces` slices at most; by default the cost model's `dma_slice_count`."""
    rows = tile.partitions
    if pieces is None:
        pieces = dma_slice_count(rows, tile.num_elements * tile.dtype.itemsize, target)
    pieces = max(1, min(rows, pieces))
    if tile.space == Space.HBM:
        return [(rows * k // pieces, rows * (k + 1) // pieces) for k in range(pieces)]
    group, base = partition_group(target), tile.partition
    first, last = base // group, (base + rows - 1) // group  # the groups the tile touches
    pieces = min(pieces, last - first + 1)
    cuts = [0] + [(first + (last - first + 1) * k // pieces) * group - base for k in range(1, pieces)] + [rows]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclasses.dataclass(frozen=True)
class HbmTensor:
    """A tensor in HBM as a kernel addresses it, the way NKI kernels write it: `x[g, m0:m1, n0:n1]` is the view of
    those elements (an int drops its dim, a slice narrows it, a step strides it), `x.T` swaps its last two dims,
    `x.tiled(t)` cuts its rows into tiles side by side, and `x.ap` is the access pattern a DMA moves."""

    dtype: DType
    offset: int  # bytes: where element [0, ..., 0] lies
    dims: tuple  # ((element stride, size), ...), outermost first

    @classmethod
    def of(cls, memory: MemoryPlan, node: Node, view: View | None = None, shape: tuple | None = None) -> "HbmTensor":
        """`node`'s buffer read through `view` (None: densely) as a tensor of `shape` (default: the node's)."""
        shape = node.shape if shape is None else shape
        view = view or View(0, dense_strides(shape))
        return cls(node.dtype, memory.offset(node) + view.offset * node.dtype.itemsize,
                   tuple((int(stride), int(size)) for stride, size in zip(view.strides, shape)))

    def __getitem__(self, index) -> "HbmTensor":
        index = index if isinstance(index, tuple) else (index,)
        offset, dims = self.offset, []
        for k, (stride, size) in enumerate(self.dims):
            at = index[k] if k < len(index) else slice(None)
            if isinstance(at, slice):
                start, stop, step = int(at.start or 0), size if at.stop is None else int(at.stop), int(at.step or 1)
                offset += start * stride * self.dtype.itemsize
                dims.append((stride * step, -(-(stop - start) // step)))
            else:
                offset += int(at) * stride * self.dtype.itemsize
        return HbmTensor(self.dtype, offset, tuple(dims))

    @property
    def T(self) -> "HbmTensor":  # noqa: N802 (numpy's name)
        return dataclasses.replace(self, dims=(*self.dims[:-2], self.dims[-1], self.dims[-2]))

    def permute(self, *axes: int) -> "HbmTensor":
        """The dims in the order `axes` (numpy's transpose)."""
        return dataclasses.replace(self, dims=tuple(self.dims[a] for a in axes))

    def broadcast_rows(self, rows: int) -> "HbmTensor":
        """`rows` copies of the tensor, one above the other: a leading dim of stride 0."""
        return dataclasses.replace(self, dims=((0, rows), *self.dims))

    def tiled(self, size: int) -> "HbmTensor":
        """Rows [0, n x size) as [size, n, ...]: row r of tile t at [r, t] (tiles side by side on the free axis)."""
        (stride, rows), *rest = self.dims
        return dataclasses.replace(self, dims=((stride, size), (stride * size, rows // size), *rest))

    @property
    def column(self) -> "HbmTensor":
        """A vector as a [rows, 1] column."""
        return dataclasses.replace(self, dims=(*self.dims, (1, 1)))

    @property
    def ap(self) -> AccessPattern:
        return AccessPattern(Space.HBM, self.dtype, int(self.offset), self.dims)

    def block(self, element: int, dims: tuple) -> AccessPattern:
        """The elements from `element` on through `dims` ((stride, size), ...): a block of codegen.blocks."""
        return AccessPattern(Space.HBM, self.dtype, int(self.offset + element * self.dtype.itemsize),
                             tuple((int(stride), int(size)) for stride, size in dims))
