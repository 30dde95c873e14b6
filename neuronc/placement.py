"""Placement rules that codegen follows and the cost model prices by the same functions.

Where tiles go on chip (pages of SBUF_PAGE_BYTES per partition; the sync pass tracks hazards by SBUF_HAZARD_BYTES) and
how a transfer is cut into DMAs on several queues (slices of whole partition groups) are rules of the code
generator, not choices about a kernel: a planning pass prices a candidate with them before its instructions
exist, and codegen emits exactly what they say. They live here, below both, so neither imports the other.
"""
from __future__ import annotations

import math

from neuronc.targets import Target

# On-chip tiles are placed on pages of this many bytes per partition (so two tiles never share a hazard cell,
# below): a placement granularity of codegen, not a hardware number.
SBUF_PAGE_BYTES = 1024
# The sync pass tracks SBUF hazards per this many bytes of a partition (a page's quarter): accesses of one tile
# that share no such cell do not wait for each other, so a K tile's DMA transposes (`transpose_chunks`) go a row
# tile (128 columns of 2 bytes) per queue side by side. A precision of the compiler's hazard analysis, not a
# hardware number (the semaphores are codegen's): finer cells order every access that shares a byte, as pages
# did, and fewer that do not. Measured with strips of whole pages (docs/performance.md, issue 16, part 46): cells
# and chunks of 1024 bytes gpt2_train 625.3 us, gpt2_block 159.9; of 512: 603.7, 157.7; of 256: 599.4, 156.4; of
# 128: 636.7, 158.8 (more DMAs, each paying its fixed cost).
SBUF_HAZARD_BYTES = 256


def partition_group(target: Target) -> int:
    """Partitions per DMA queue's share of a tile, the granularity of SBUF hazards across partitions (the sync
    pass's columns): DMAs of slices cut at group boundaries (codegen.access.dma_slices) run side by side."""
    return max(1, target.partitions // target.dma_queues)


def dma_slice_count(rows: int, nbytes: int, target: Target) -> int:
    """Into how many partition slices codegen splits a DMA of `nbytes` over `rows` partitions (one queue each):
    as many as the queues, each at least the bytes that keep a DMA efficient on the target (its efficient
    bytes per partition, over all partitions, shared by the queues)."""
    smallest = target.dma_efficient_bytes_per_partition * target.partitions // target.dma_queues
    return max(1, min(rows, target.dma_queues, nbytes // smallest))


def dma_pieces(nbytes: int, rows: int, latency_bound: bool, target: Target) -> int:
    """Slices (one queue each) of a row tile's DMA: when the kernel waits on this transfer (its first loads, its last
    stores) a divisor of the tile's groups of partitions (codegen cuts slices at their boundaries: uneven slices
    would end with the largest) giving each slice about one issue's worth of bytes: the divisor nearest, in ratio,
    to the tile's bytes over the bytes a queue moves in one issue time (at most the queues). A slice much shorter
    than its issue leaves the queue's next transfer waiting on its fixed cost; a much longer one keeps the kernel
    waiting on fewer queues. (Rounding down to a divisor, as before, cut a [128, 768] bf16 tile -- 6.6 issues'
    worth -- into 4 slices of 1.6 issues each instead of 8 of 0.8: the GPT-2 block's layer-norms ended 2.3 us
    later each.) Else the default, `dma_slice_count`."""
    if not latency_bound:
        return dma_slice_count(rows, nbytes, target)
    worth_issuing = target.dma_fixed_ns * target.dma_gbps_per_queue  # bytes moved in one issue time
    groups = -(-rows // partition_group(target))  # codegen.access.dma_slices' cut points
    wanted = max(1.0, nbytes / worth_issuing)
    divisors = [n for n in range(1, min(target.dma_queues, groups) + 1) if groups % n == 0]
    return min(divisors, key=lambda n: (abs(math.log(n / wanted)), n))


def transposed_store_pieces(nbytes: int, target: Target) -> int:
    """Slices (one queue each, by columns) of a row tile stored transposed (passes/layout.py): a strided transfer,
    at half a queue's bandwidth, so every row tile's store is cut as a last store is, into as many slices as give
    each a transfer at least as long as its issue. Measured on the GPT-2 block: 169.0 us, against 175.7 with the
    default slices for all but the last row tile."""
    worth_issuing = target.dma_fixed_ns * target.dma_gbps_per_queue / 2  # strided bytes moved in one issue time
    return max(1, min(target.dma_queues, int(nbytes // worth_issuing)))


SLOTS_PER_KERNEL = 16  # tile slots a kernel may hold at once; sets the tile size of copies from the SBUF size


def tile_free_elements(target: Target, itemsize: int = 4) -> int:
    """Elements per partition of one tile (of elements of at least fp32's width), so that a kernel's
    SLOTS_PER_KERNEL tile slots fit in SBUF."""
    per_slot = target.sbuf_bytes_per_partition // SLOTS_PER_KERNEL
    return min(target.max_free_elements_sbuf, per_slot // max(itemsize, 4))


def free_for(target: Target, slots: int, widest: int) -> int:
    """Elements per partition of each tile when `slots` tiles of up to `widest` bytes an element share the
    partition (each slot rounded up to the page tiles are placed on), at most a default tile."""
    slot_bytes = target.sbuf_bytes_per_partition // slots - SBUF_PAGE_BYTES  # room for rounding up
    return min(tile_free_elements(target), slot_bytes // widest)


def transpose_chunks(width: int, itemsize: int) -> list:
    """[(c0, c1)] the columns of a [128, width] tile that one DMA transpose each moves: one SBUF hazard cell of
    them at most (SBUF_HAZARD_BYTES: chunks sharing a cell would wait for each other), each on its own queue."""
    cell = SBUF_HAZARD_BYTES // itemsize
    return [(c0, min(width, c0 + cell)) for c0 in range(0, width, cell)]
