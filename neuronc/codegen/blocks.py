"""Cutting an N-d iteration space into on-chip blocks, for several strided operands at once.

Elementwise kernels and copies walk a tensor shape while each operand reads or writes it through
its own element strides (dense, transposed, broadcast with stride 0, sliced...). A block is
`[p <= partitions, free...]`: a partition dim and the inner dims as the free axis, each operand
an affine access pattern over it. Dims every operand can merge are merged first, so a dense
tensor becomes one long dim, which is split so that all partitions are used.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, NamedTuple


class Block(NamedTuple):
    offsets: tuple  # element offset of the block's first element, per operand
    partitions: int
    free: tuple  # sizes of the free dims
    dims: tuple  # per operand: ((partition stride, p), (stride, size), ...) in elements

    @property
    def free_elements(self) -> int:
        return math.prod(self.free)


def _merged(shape, strides: list) -> list:
    """[(size, (stride per operand))] with size-1 dims dropped and mergeable neighbours merged."""
    merged = []
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        these = tuple(s[axis] for s in strides)
        if merged and all(prev == cur * size for prev, cur in zip(merged[-1][1], these)):
            merged[-1] = (merged[-1][0] * size, these)
        else:
            merged.append((size, these))
    return merged or [(1, tuple(1 for _ in strides))]


def blocks(shape: tuple, strides: list, max_free: int, partitions: int, offsets: list | None = None) -> Iterator[Block]:
    """Yield the Blocks covering `shape`; `strides` has one stride tuple per operand."""
    if 0 in shape:
        return
    offsets = tuple(offsets or (0,) * len(strides))
    dims = _merged(shape, strides)
    size, inner = dims[-1]
    if size > max_free or len(dims) == 1:
        # Split the innermost dim into [size // f, f] (+ a tail), using every partition if small.
        f = min(max_free, max(1, math.ceil(size / partitions)) if len(dims) == 1 else size)
        if len(dims) == 1:
            f = _whole_rows(f, size, next((n for n in reversed(shape) if n > 1), 1), partitions)
        body, tail = divmod(size, f)
        if tail:
            yield from _cut(dims[:-1] + [(tail, inner)], [o + body * f * s for o, s in zip(offsets, inner)],
                            max_free, partitions)
        if not body:
            return
        dims = dims[:-1] + [(body, tuple(s * f for s in inner)), (f, inner)]
    yield from _cut(dims, offsets, max_free, partitions)


def _whole_rows(f: int, size: int, row: int, partitions: int) -> int:
    """A partition's share `f` of a dense tensor of `size` elements in rows of `row`, moved to a row boundary: a
    multiple of the row, or a divisor of it (not below half of f), when that takes no more blocks of `partitions`;
    else f. Slices of partitions then cover whole rows, and DMAs of neighbouring slices share no row of the tensor,
    which the hazard tracking (codegen/sync.py: HBM by rows and bytes within a row) would order one after another."""
    if row >= size or f == row:
        return f
    aligned = f // row * row if f > row else next((d for d in range(f, f // 2, -1) if row % d == 0), f)
    tiles = lambda share: -(-size // share // partitions)  # noqa: E731
    return aligned if tiles(aligned) <= tiles(f) else f


def _cut(dims: list, offsets, max_free: int, partitions: int):
    # The partition dim is the outermost dim whose inner dims fit in `max_free`.
    split = len(dims) - 1
    while split > 0 and math.prod(n for n, _ in dims[split:]) <= max_free:
        split -= 1
    outer, (pn, pstrides), inner = dims[:split], dims[split], dims[split + 1:]
    free = tuple(n for n, _ in inner)
    operands = range(len(offsets))
    for index in itertools.product(*(range(n) for n, _ in outer)):
        base = [offsets[k] + sum(i * s[k] for i, (_, s) in zip(index, outer)) for k in operands]
        for p0 in range(0, pn, partitions):
            p = min(partitions, pn - p0)
            yield Block(
                offsets=tuple(base[k] + p0 * pstrides[k] for k in operands),
                partitions=p,
                free=free,
                dims=tuple(((pstrides[k], p), *((s[k], n) for n, s in inner)) for k in operands),
            )
