"""Synchronisation: split the program into per-engine streams and add the semaphore waits it needs.

Codegen emits instructions in one program order. Here each goes to its stream (engine, or DMA
queue), and for every cross-stream hazard on the memory it touches (read after write, write after
read, write after write) it gets a wait on the other stream's semaphore. Memory is tracked per HBM
page (a tensor cut into at most HBM_PAGES_PER_TENSOR pages, so row tiles of one tensor stored from
several DMA queues do not wait on each other), per SBUF page and group of partitions (a DMA queue's
share: loads of one tile split by partitions run side by side) and per PSUM bank: coarse, so never
missing a dependency, at the price of a few unnecessary ones. Waits a stream has already implied by
an earlier wait are dropped.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

from neuronc.isa import AccessPattern, Instruction, Space, Wait
from neuronc.passes.cost_model import SBUF_PAGE_BYTES  # granularity of hazard tracking in SBUF
from neuronc.targets import Target

HBM_PAGES_PER_TENSOR = 1024  # bounds the keys of one access; pages are at least HBM_MIN_PAGE_BYTES
HBM_MIN_PAGE_BYTES = 64 * 1024


class _Keys:
    def __init__(self, tensors: list, target: Target):
        ordered = sorted(tensors, key=lambda t: t.offset)
        self.starts = [t.offset for t in ordered]
        self.pages = [max(HBM_MIN_PAGE_BYTES, -(-t.nbytes // HBM_PAGES_PER_TENSOR)) for t in ordered]
        self.psum_bank = target.psum_bank_bytes
        self.partition_group = max(1, target.partitions // target.dma_queues)

    def __call__(self, ap: AccessPattern) -> list:
        if ap.space == Space.HBM:
            tensor = bisect.bisect_right(self.starts, ap.offset) - 1
            reach = [stride * (size - 1) * ap.dtype.itemsize for stride, size in ap.dims]
            first = ap.offset + sum(r for r in reach if r < 0) - self.starts[tensor]
            last = ap.offset + sum(r for r in reach if r > 0) + ap.dtype.itemsize - 1 - self.starts[tensor]
            page = self.pages[tensor]
            return [("hbm", tensor, p) for p in range(first // page, last // page + 1)]
        extent = 1 + sum(stride * (size - 1) for stride, size in ap.dims[1:])
        first, last = ap.offset, ap.offset + extent * ap.dtype.itemsize - 1
        if ap.space == Space.PSUM:
            return [("psum", b) for b in range(first // self.psum_bank, last // self.psum_bank + 1)]
        groups = range(ap.partition // self.partition_group,
                       (ap.partition + ap.partitions - 1) // self.partition_group + 1)
        return [("sbuf", p, g) for p in range(first // SBUF_PAGE_BYTES, last // SBUF_PAGE_BYTES + 1) for g in groups]


def insert_waits(instructions: list, tensors: list, target: Target) -> dict:
    """Returns {(engine, queue): [instructions]} with `waits` filled in."""
    keys = _Keys(tensors, target)
    streams: dict = defaultdict(list)
    last_write: dict = {}
    last_reads: dict = defaultdict(dict)
    known: dict = defaultdict(dict)  # stream -> {other stream: count already waited for}
    for inst in instructions:
        me = inst.stream
        read_keys = [k for ap in inst.reads for k in keys(ap)]
        write_keys = [k for ap in inst.writes for k in keys(ap)]
        need: dict = {}
        for key in read_keys:
            for other, count in last_write.get(key, {}).items():
                need[other] = max(need.get(other, 0), count)
        for key in write_keys:
            for source in (last_write.get(key, {}), last_reads.get(key, {})):
                for other, count in source.items():
                    need[other] = max(need.get(other, 0), count)
        waits = []
        for other, count in sorted(need.items()):
            if other != me and known[me].get(other, 0) < count:
                waits.append(Wait(other[0], other[1], count))
                known[me][other] = count
        inst.waits = tuple(waits)
        streams[me].append(inst)
        position = len(streams[me])
        for key in read_keys:
            last_reads[key][me] = position
        for key in write_keys:
            last_write[key] = {me: position}
            last_reads[key] = {}
    return dict(streams)
