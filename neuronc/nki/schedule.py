"""Scheduling a traced kernel: its instructions reordered so the engines work side by side.

A kernel is traced in program order: each loop iteration's chain of instructions (a load, a matmul, an exp, a
transpose, ...) follows the previous iteration's. Every engine runs its own queue in order, so in program order an
engine's work for the next iteration waits behind this iteration's, which waits for other engines: the chain is
serial. NKI's compiler schedules a kernel's instructions (``affine_range`` says iterations are independent); so
does this: a list scheduler over the kernel's dependencies (two instructions touching overlapping bytes of the
same tile or tensor, one writing, stay in program order; nothing else orders them), each instruction placed,
in turn, where it can start earliest on its engine or DMA queue (the cost model's durations), ties in program
order. The result means what the program order means; the sync pass then adds the semaphore waits it needs.
"""
from __future__ import annotations

import heapq

from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import DESTINATIONS, Instruction, Space


def _box(ap) -> tuple:
    """(first partition, end partition, first byte, end byte) an access pattern may touch (HBM: partition 0)."""
    lo = hi = ap.offset
    dims = ap.dims if ap.space == Space.HBM else ap.dims[1:]
    for stride, size in dims:
        reach = stride * (size - 1) * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    if ap.space == Space.HBM:
        return 0, 1, lo, hi + ap.dtype.itemsize
    return ap.partition, ap.partition + ap.dims[0][1], lo, hi + ap.dtype.itemsize


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _inside(a: tuple, b: tuple) -> bool:
    """Whether box a lies within box b."""
    return b[0] <= a[0] and a[1] <= b[1] and b[2] <= a[2] and a[3] <= b[3]


BUCKET = {Space.SBUF: 1024, Space.PSUM: 2048}  # bytes per partition of the on-chip buckets searched for overlaps


def _keys(storage, box: tuple, space: Space) -> list:
    """The buckets an access falls in: on chip, pages of the memory (tiles reuse each other's bytes); in HBM, its
    tensor (tensors never share bytes)."""
    if space == Space.HBM:
        return [("hbm", storage.id)]
    size = BUCKET[space]
    base = storage.base
    return [(space, page) for page in range((base + box[2]) // size, (base + box[3] - 1) // size + 1)]


def _coarse(box: tuple, space: Space, group: int) -> tuple:
    """An on-chip box widened to the cells the sync pass tracks hazards by (SBUF pages by partition groups, PSUM
    banks): what it orders, the schedule must order too, or the sync pass would serialise the engines in the
    schedule's order for bytes that do not even overlap."""
    size = BUCKET[space]
    p0, p1 = (box[0] // group * group, -(-box[1] // group) * group) if space == Space.SBUF else (0, 128)
    return p0, p1, box[2] // size * size, -(-box[3] // size) * size


def dependencies(instrs: list, group: int = 8) -> list:
    """For each instruction (trace.Emitted), the earlier ones it must follow: read after write, write after read,
    write after write on overlapping bytes (on chip: at the tiles' addresses, so tiles that reuse bytes are
    ordered too, by the sync pass's tracking cells; in HBM: of one tensor)."""
    history: dict = {}  # bucket -> [(box, index, writes)]
    deps = []
    for index, e in enumerate(instrs):
        writes = DESTINATIONS.get(e.opcode, 1)
        accesses = []
        for position, (storage, ap) in enumerate(e.operands):
            box = _box(ap)
            if ap.space != Space.HBM:
                box = _coarse((box[0], box[1], box[2] + storage.base, box[3] + storage.base), ap.space, group)
            accesses.append((_keys(storage, _box(ap), ap.space), box, position < writes))
        mine = set()
        for keys, box, is_write in accesses:
            for key in keys:
                for other_box, other, other_writes in history.get(key, ()):
                    if (is_write or other_writes) and _overlap(box, other_box):
                        mine.add(other)
        mine.discard(index)
        deps.append(mine)
        for keys, box, is_write in accesses:
            for key in keys:
                entries = history.setdefault(key, [])
                if is_write:  # earlier accesses inside what this writes are ordered through it from now on
                    entries[:] = [x for x in entries if not _inside(x[0], box)]
                entries.append((box, index, is_write))
    return deps


def schedule(instrs: list, target) -> list:
    """The instructions in a new program order (see the module docstring)."""
    n = len(instrs)
    if n < 3:
        return list(instrs)
    from neuronc.passes.cost_model import partition_group

    deps = dependencies(instrs, partition_group(target))
    users = [[] for _ in range(n)]
    waiting = [len(d) for d in deps]
    for index, d in enumerate(deps):
        for p in d:
            users[p].append(index)
    durations = [instruction_cost_ns(Instruction(e.opcode, e.engine, tuple(ap for _, ap in e.operands),
                                                 queue=e.queue, **e.fields), target) for e in instrs]
    streams = {}
    for e in instrs:
        streams.setdefault((e.engine, e.queue), [])
    free = {s: 0.0 for s in streams}
    ready_heaps = {s: [] for s in streams}  # (ready time, index) of instructions whose dependencies are placed
    finish = [0.0] * n
    for index in range(n):
        if not waiting[index]:
            heapq.heappush(ready_heaps[(instrs[index].engine, instrs[index].queue)], (0.0, index))
    order = []
    while len(order) < n:
        best = None
        for stream, heap in ready_heaps.items():
            if heap:
                ready, index = heap[0]
                key = (max(ready, free[stream]), index)
                if best is None or key < best[0]:
                    best = (key, stream)
        (start, index), stream = best
        heapq.heappop(ready_heaps[stream])
        finish[index] = start + durations[index]
        free[stream] = finish[index]
        order.append(instrs[index])
        for user in users[index]:
            waiting[user] -= 1
            if not waiting[user]:
                ready = max(finish[p] for p in deps[user])
                heapq.heappush(ready_heaps[(instrs[user].engine, instrs[user].queue)], (ready, user))
    return order
