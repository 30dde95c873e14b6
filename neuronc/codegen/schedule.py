"""Scheduling across kernels: a kernel's loads start while the previous kernel still computes.

Codegen emits kernel after kernel, and each DMA queue runs its transfers in program order, so a kernel's
first loads sat behind the previous kernel's last stores, which wait for its last compute: the Tensor
engine of every kernel started only after its operands' whole trip. `prefetch_loads` moves the loads that
a kernel's first steps read (the weights of its first output tile, say), when they depend on nothing of
that kernel, up into the previous kernel: right after the last instruction they depend on (a store of the
rows they read, the last use of the SBUF they fill) and after that kernel's own loads, so they neither
overtake a conflicting access nor delay the previous kernel's inputs; a load that waits for the previous
kernel also goes after that kernel's last transfer on its own queue, which it would otherwise hold up.
The emitter places consecutive kernels' tiles at opposite ends of SBUF, so most of them have no SBUF
conflict to wait for.

Program order cannot tell a load that waits behind the previous kernel's last transfers for nothing (its operand
was stored long before, the queue sits idle waiting for that kernel's compute) from one that would delay them:
`into_idle_queue_time` reads the estimated timeline of prefetch_loads' order and moves a load (any of a kernel's
loads that depends on nothing of its kernel) before the first transfer on its queue that it would not delay.
codegen.generate keeps that order when the estimate says it is faster.

Moving an instruction up past instructions whose memory it does not share (no read-write, write-read or
write-write overlap on the hazard grid of codegen.sync) keeps the program's meaning; the sync pass then
orders the streams from the new program order.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

from neuronc.codegen.sync import HazardGrid
from neuronc.instruction_cost import instruction_cost_ns, start_latency_ns
from neuronc.isa import Engine, Instruction, Opcode, Space
from neuronc.targets import Target


# How many of a kernel's first computing instructions get their operands prefetched: enough for a matmul's
# first output tile over its K slices or a row-wise kernel's first row tile. Prefetching more (all the
# weights a kernel can hold) takes HBM bandwidth from the previous kernel's last stores, which the next
# kernel waits for. Measured (`python -m benchmarks.roofline --cases gpt2_block,gpt2`), GPT-2-small block /
# 12-layer forward in us: no prefetch 176.6 / 2738.0, 1 or 4 steps 172.0 / 2685.6, 8 171.3 / 2661.6,
# 12 or 16 171.3 / 2654.8, 24 171.5 / 2659.6, 64 175.5 / 2708.6; with transposed layer-norm stores
# (passes/layout.py): 8 169.0 / 2629.6, 12 or 16 169.0 / 2629.8, 64 175.2 / 2698.4.
PREFETCH_STEPS = 12


def _is_load(inst: Instruction) -> bool:
    return (inst.opcode == Opcode.DMA_COPY and inst.operands[1].space == Space.HBM
            and inst.operands[0].space == Space.SBUF)


def _first_reads(instructions: list, grid: HazardGrid) -> dict:
    """{kernel: the sorted, merged [start, stop) spans of tracking cells its first PREFETCH_STEPS computing
    instructions read} (spans, not a mask of every cell per kernel: that grew with kernels x cells)."""
    steps: dict = {}
    needs: dict = {}
    for inst in instructions:
        if inst.engine != Engine.DMA and steps.get(inst.kernel, 0) < PREFETCH_STEPS and inst.reads:
            steps[inst.kernel] = steps.get(inst.kernel, 0) + 1
            needs.setdefault(inst.kernel, []).extend(grid.access(inst)[0])
    return {kernel: _merged(spans) for kernel, spans in needs.items()}


def _merged(spans: list) -> tuple:
    """(starts, stops) of the union of [start, stop) spans, sorted and disjoint."""
    starts, stops = [], []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if stops and a <= stops[-1]:
            stops[-1] = max(stops[-1], b)
        else:
            starts.append(a)
            stops.append(b)
    return starts, stops


def _touches(merged: tuple, spans: list) -> bool:
    """Whether any of the [start, stop) `spans` shares a cell with the merged spans."""
    return any(_overlaps(merged, a, b) for a, b in spans)


def _overlaps(merged: tuple, a: int, b: int) -> bool:
    """Whether [a, b) shares a cell with the merged spans."""
    if b <= a:
        return False
    starts, stops = merged
    k = bisect.bisect_right(starts, a) - 1  # the last span starting at or before a
    if k >= 0 and stops[k] > a:
        return True
    return k + 1 < len(starts) and starts[k + 1] < b


def prefetch_loads(instructions: list, grid: HazardGrid) -> list:
    """The instructions in a new program order: the loads a kernel's first steps read, when they depend on
    nothing of their own kernel, moved up into the previous kernel (everything else in emitted order). A program
    of one kernel (an eager op's, mostly) has no previous kernel to move a load into: its order is kept, unwalked."""
    if all(inst.kernel == instructions[0].kernel for inst in instructions):
        return list(instructions)
    return _reordered(instructions, {position: p.before for position, p in _placements(instructions, grid).items()})


class _Placement(NamedTuple):
    """Where prefetch_loads puts a load: before the instruction at position `before`. `earliest` is the first
    position it may precede (after everything it depends on and the previous kernel's loads); `before` is later
    when it waits for the previous kernel (then it goes after that kernel's last transfer on its queue); `after`
    is the position of the last instruction it depends on (-1: none)."""

    before: int
    earliest: int
    after: int
    first_step: bool = True  # read by the kernel's first PREFETCH_STEPS computing instructions


def _placements(instructions: list, grid: HazardGrid, every_load: bool = False) -> dict:
    """{original position of a moved load: its _Placement} (with `every_load`, also of the loads the kernel's
    first steps do not read)."""
    needs = _first_reads(instructions, grid)
    # program position of each cell's last writer, and of its last reader or writer: Python lists, as the spans are
    # short (tens of cells) and a numpy call per span cost more than the list operation
    last_write = [-1] * grid.count
    last_use = [-1] * grid.count
    first: dict = {}  # kernel -> position of its first instruction
    last_load: dict = {}  # kernel -> position of its last load
    moved: dict = {}  # original position of a moved load -> its placement
    last_on_queue: dict = {}  # (kernel, engine, queue) -> position of its last instruction (DMA queues only)
    # Whether a load writes what its kernel's first steps read, asked once per (those reads, the spans of the load's
    # destination): the copies of a repeated kernel (codegen.reuse) read the same on-chip cells in their first steps
    # (a computing instruction reads no HBM) and load into the same SBUF pattern objects, whose spans are one object
    # (HazardGrid.ap_spans: one per box, which patterns of one box share too), so a layer's loads are judged once for
    # every layer. Exact: the same spans object is the same cells.
    alike: dict = {}  # a kernel's needs -> their number
    need_of = {kernel: alike.setdefault((tuple(starts), tuple(stops)), len(alike))
               for kernel, (starts, stops) in needs.items()}
    touches: dict = {}  # (number of a kernel's needs, id(spans written)) -> whether they overlap
    access, dma_copy = grid.access, Opcode.DMA_COPY
    accesses = list(map(access, instructions))
    sbuf_start, sbuf_stop = grid.sbuf_cells
    # the SBUF cells a load writes as strided slices (_strided: a load of some partition groups writes one span per
    # row of cells), made once per spans object: a load of one destination takes that pattern's spans object
    # (HazardGrid.access), which a repeated layer's copies of a load share (codegen.reuse); the grid holds every
    # spans object while this runs, so an id is not reused
    sliced: dict = {}
    hbm, sbuf, dma, current = Space.HBM, Space.SBUF, Engine.DMA, None
    for position, (inst, (reads, writes)) in enumerate(zip(instructions, accesses)):
        kernel = inst.kernel
        if kernel != current:
            current = kernel
            if kernel not in first:
                first[kernel] = position
        if inst.opcode is dma_copy and inst.operands[1].space is hbm and inst.operands[0].space is sbuf:  # _is_load
            into = sliced.get(id(writes))
            if into is None:  # (its one destination is SBUF: every span in SBUF's cells)
                into = sliced[id(writes)] = _strided([span for span in writes if span[1] > span[0]])
            first_step = False
            if kernel in need_of:
                key = (need_of[kernel], id(writes))
                first_step = touches.get(key)
                if first_step is None:
                    first_step = touches[key] = _touches(needs[kernel], writes)
            if kernel - 1 in first and (first_step or every_load):
                # the HBM cells it reads: their last writes (a weight's, which no instruction writes, has no cells:
                # HazardGrid); the SBUF cells it writes: their last uses
                after = max([max(last_write[a:b]) for a, b in reads if b > a]
                            + [max(last_use[a:b:step]) for a, b, step, _ in into], default=-1)
                if after < first[kernel] - 1:  # depends on nothing of its own kernel
                    at = earliest = max(after, last_load.get(kernel - 1, first[kernel - 1] - 1))
                    if after >= first[kernel - 1]:  # it waits for the previous kernel: not ahead of it on its queue
                        at = max(at, last_on_queue.get((kernel - 1, inst.engine, inst.queue), -1))
                    moved[position] = _Placement(at + 1, earliest + 1, after, first_step)
            last_load[kernel] = position
            last_on_queue[(kernel, inst.engine, inst.queue)] = position
            for a, b, step, n in into:  # (it reads HBM only)
                last_use[a:b:step] = [position] * n
            continue
        if inst.engine is dma:  # (kernel, *Instruction.stream): asked for a load's own, a DMA queue (a DMA_COPY runs on
            # the DMA engine: codegen.emitter), so kept for DMA queues only
            last_on_queue[(kernel, dma, inst.queue)] = position
        # (positions only grow: the latest use is this one). A load's `after` reads last_write only on the HBM cells it
        # reads and last_use only on the SBUF cells it writes, so uses are kept for SBUF cells and writes for the
        # others (a span never leaves its block: HazardGrid.block_starts)
        for a, b in reads:
            if sbuf_start <= a < sbuf_stop:
                last_use[a:b] = [position] * (b - a)
        for a, b in writes:
            if sbuf_start <= a < sbuf_stop:
                last_use[a:b] = [position] * (b - a)
            else:
                last_write[a:b] = [position] * (b - a)
    return moved


def _strided(spans: list) -> list:
    """[(start, stop, step, cells)] slices covering exactly the cells of the non-empty [start, stop) `spans`: spans of
    one length at one stride (an SBUF box over some partition groups of several rows: codegen.sync _Cells numbers
    a span per row) as one strided slice per column when they are more spans than columns, else the spans."""
    if len(spans) > 2:
        (a0, b0), (a1, _) = spans[0], spans[1]
        width, stride, count = b0 - a0, a1 - a0, len(spans)
        if width < count and stride >= width and all(
                b - a == width and a == a0 + k * stride for k, (a, b) in enumerate(spans)):
            stop = a0 + (count - 1) * stride + 1
            return [(a0 + j, stop + j, stride, count) for j in range(width)]
    return [(a, b, 1, b - a) for a, b in spans]


def _reordered(instructions: list, moved: dict) -> list:
    """The instructions with each moved one ({original position: the position it now precedes}) taken out of its
    place and put before that position (in their original order when several go to one place)."""
    arriving: dict = {}
    for position, before in sorted(moved.items()):
        arriving.setdefault(before, []).append(instructions[position])
    order = []
    for position, inst in enumerate(instructions):
        order.extend(arriving.get(position, ()))
        if position not in moved:
            order.append(inst)
    return order


def into_idle_queue_time(instructions: list, grid: HazardGrid, timeline: dict, target: Target,
                         any_queue: bool = False) -> tuple | None:
    """A new order of the emitted `instructions` and {position: DMA queue} of the loads that change queue (None: the
    same as prefetch_loads'), given `timeline` ({id(instruction): (start ns, end ns)}) of prefetch_loads' order: each
    load that depends on nothing of its own kernel (those its first steps read, and the others) goes up to before the
    first instruction on its queue, after what it depends on, that it would not delay: one that starts in the
    timeline no earlier than the load would end there (its operand written and the queue free; the load's fixed cost
    overlapping the previous transfer's data, as stream_timing has it). With `any_queue`, another queue's such place
    is taken where the load ends sooner there (every queue reaches all of HBM and SBUF: a queue only orders its
    transfers). So a load fills time a queue spends waiting, for the previous kernel's compute mostly, where
    prefetch_loads' program order put it behind that kernel's last transfers on its queue."""
    placed = _placements(instructions, grid, every_load=True)
    moved = {position: p.before for position, p in placed.items() if p.first_step}
    on_queue: dict = {}  # stream -> original positions of its DMAs
    for position, inst in enumerate(instructions):
        if inst.engine == Engine.DMA:
            on_queue.setdefault(inst.stream, []).append(position)
    free_at = _queue_free_times(instructions, on_queue, timeline)
    now, queues = dict(moved), {}
    for position, placement in sorted(placed.items()):
        load = instructions[position]
        ready = timeline[id(instructions[placement.after])][1] if placement.after >= 0 else 0.0
        alone, latency = instruction_cost_ns(load, target), start_latency_ns(load, target)
        best = None  # (end, transfer, stream): the place where the load ends soonest, its own queue's on a tie
        for stream in _queues_for(load, on_queue) if any_queue else [load.stream]:
            queue = on_queue[stream]
            for transfer in queue[bisect.bisect_left(queue, placement.after + 1):]:
                if transfer >= moved.get(position, position):
                    break
                ends = max(ready + alone, free_at[id(instructions[transfer])] + alone - latency)
                if ends <= timeline[id(instructions[transfer])][0]:
                    if best is None or ends < best[0]:
                        best = (ends, transfer, stream)
                    break
        if best is not None:
            ends, transfer, stream = best
            now[position] = transfer
            if stream != load.stream:
                queues[position] = stream[1]
            free_at[id(instructions[transfer])] = ends  # the next load put before it starts after this one
    return (_reordered(instructions, now), queues) if now != moved or queues else None


def _queues_for(load: Instruction, on_queue: dict) -> list:
    """The DMA queues (streams) a load may run on, its own first: any of the program's."""
    return [load.stream] + [stream for stream in on_queue if stream != load.stream]


def _queue_free_times(instructions: list, on_queue: dict, timeline: dict) -> dict:
    """{id(DMA instruction): when the instruction before it on its queue (`on_queue`: stream -> positions of its
    DMAs) ends in `timeline` (0: none)}."""
    free_at = {}
    for positions in on_queue.values():
        previous = 0.0
        for inst in sorted((instructions[p] for p in positions), key=lambda i: timeline[id(i)][0]):
            free_at[id(inst)] = previous
            previous = timeline[id(inst)][1]
    return free_at
