"""Addresses of a kernel's on-chip tiles, chosen once the whole kernel is traced.

Each tile lives from the first instruction touching it to the last; a tile's bytes are reused by a later tile
only after that. Tiles are placed round the memory like a ring (the first free place at or after where the last
one was placed, wrapping), so a loop's tiles rotate over all the free bytes and the next iteration's tiles do not
reuse this one's (whose reads the next iteration's writes would have to wait for: the semaphores the sync pass
adds order what does share bytes). SBUF tiles start on the sync pass's tracking pages (no false
dependencies between tiles), falling back to tighter packing when the pages do not fit; a PSUM tile lies within
one bank (a matmul's accumulation group must), or spans whole banks.
"""
from __future__ import annotations

from neuronc.errors import KernelError
from neuronc.isa import Space
from neuronc.passes.cost_model import SBUF_PAGE_BYTES
from neuronc.targets import Target

_MIN_ALIGN = 64


class _Free:
    """Free byte ranges [start, end) of a memory, each with when it was freed (-1: never used)."""

    def __init__(self, capacity: int):
        self.blocks = [[0, capacity, -1]]
        self.cursor = 0

    def take(self, size: int, align: int) -> int | None:
        fits = []
        for i, (start, end, _) in enumerate(self.blocks):
            at = -(-max(start, self.cursor if start < self.cursor < end else start) // align) * align
            if at + size > end:
                at = -(-start // align) * align
            if at + size <= end:
                fits.append((at < self.cursor, at, i))  # at or after the cursor first, then wrapped round
        if not fits:
            return None
        _, at, i = min(fits)
        self.cursor = at + size
        start, end, freed = self.blocks.pop(i)
        pieces = [[start, at, freed]] if at > start else []
        if at + size < end:
            pieces.append([at + size, end, freed])
        self.blocks[i:i] = pieces
        return at

    def give(self, start: int, size: int, when: int) -> None:
        self.blocks.append([start, start + size, when])
        self.blocks.sort()
        merged = []
        for block in self.blocks:
            if merged and merged[-1][1] == block[0]:
                merged[-1][1] = block[1]
                merged[-1][2] = max(merged[-1][2], block[2])
            else:
                merged.append(block)
        self.blocks = merged


def _layout(storage, space: Space, target: Target, page: int) -> tuple:
    """(bytes per partition, alignment) of a tile."""
    n = max(storage.nbytes, 1)
    if space == Space.PSUM:
        bank = target.psum_bank_bytes
        if n <= bank:
            size = max(_MIN_ALIGN, 1 << (n - 1).bit_length())
            return size, size
        return -(-n // bank) * bank, bank
    size = -(-n // page) * page
    return size, page


def allocate(storages: list, target: Target) -> None:
    """Set ``base`` (bytes into each partition) of every on-chip storage some instruction touches."""
    for space in (Space.SBUF, Space.PSUM):
        used = sorted((s for s in storages if s.space == space and s.first is not None), key=lambda s: (s.first, s.id))
        pages = (SBUF_PAGE_BYTES, _MIN_ALIGN) if space == Space.SBUF else (None,)
        for i, page in enumerate(pages):
            failure = _allocate(used, space, target, page)
            if failure is None:
                break
            if i == len(pages) - 1:
                raise failure


def _allocate(used: list, space: Space, target: Target, page) -> KernelError | None:
    capacity = target.sbuf_bytes_per_partition if space == Space.SBUF else target.psum_bytes_per_partition
    free = _Free(capacity)
    live: list = []  # (last, storage, start, size)
    for s in used:
        size, align = _layout(s, space, target, page)
        still = []
        for entry in live:
            if entry[0] < s.first:
                free.give(entry[2], entry[3], entry[0])
            else:
                still.append(entry)
        live = still
        at = free.take(size, align) if size <= capacity else None
        if at is None:
            return _exhausted(s, size, [(e[1], e[3]) for e in live], space, capacity, target)
        s.base = at
        live.append((s.last, s, at, size))
    return None


def _exhausted(storage, size: int, live: list, space: Space, capacity: int, target: Target) -> KernelError:
    held = sum(n for _, n in live)
    biggest = sorted(live, key=lambda e: -e[1])[:6]
    listing = "; ".join(f"{s.name} {n} B from {s.loc.file.rsplit('/', 1)[-1]}:{s.loc.line}" if s.loc else
                        f"{s.name} {n} B" for s, n in biggest)
    if space == Space.PSUM:
        hint = (f"PSUM is {target.psum_banks} banks of {target.psum_bank_bytes} bytes per partition; fewer PSUM "
                f"tiles live at once (copy results out of PSUM sooner, or reuse one tile)")
    else:
        hint = "fewer or smaller tiles live at once (smaller blocks, or allocate tiles inside the loop that uses them)"
    return KernelError(
        f"{space.name} is full: tile {storage.name!r} needs {size} bytes per partition, but {held} of the "
        f"{capacity} bytes per partition are held by {len(live)} live tiles (largest: {listing})",
        hint=hint, location=str(storage.loc) if storage.loc else "")
