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

Moving an instruction up past instructions whose memory it does not share (no read-write, write-read or
write-write overlap on the hazard grid of codegen.sync) keeps the program's meaning; the sync pass then
orders the streams from the new program order.
"""
from __future__ import annotations

import bisect


from neuronc.codegen.sync import HazardGrid
from neuronc.isa import Engine, Instruction, Opcode, Space


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
        if inst.engine != Engine.DMA and inst.reads and steps.get(inst.kernel, 0) < PREFETCH_STEPS:
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
    needs = _first_reads(instructions, grid)
    # program position of each cell's last writer, and of its last reader or writer: Python lists, as the spans are
    # short (tens of cells) and a numpy call per span cost more than the list operation
    last_write = [-1] * grid.count
    last_use = [-1] * grid.count
    first: dict = {}  # kernel -> position of its first instruction
    last_load: dict = {}  # kernel -> position of its last load
    moved: dict = {}  # original position of a moved load -> the position it now precedes
    last_on_queue: dict = {}  # (kernel, stream) -> position of its last instruction
    for position, inst in enumerate(instructions):
        kernel = inst.kernel
        first.setdefault(kernel, position)
        reads, writes = grid.access(inst)
        if _is_load(inst):
            if kernel - 1 in first and kernel in needs and any(_overlaps(needs[kernel], a, b) for a, b in writes):
                after = max([max(last_write[a:b]) for a, b in reads if b > a]
                            + [max(last_use[a:b]) for a, b in writes if b > a], default=-1)
                if after < first[kernel] - 1:  # depends on nothing of its own kernel
                    at = max(after, last_load.get(kernel - 1, first[kernel - 1] - 1))
                    if after >= first[kernel - 1]:  # it waits for the previous kernel: not ahead of it on its queue
                        at = max(at, last_on_queue.get((kernel - 1, inst.stream), -1))
                    moved[position] = at + 1
            last_load[kernel] = position
        last_on_queue[(kernel, inst.stream)] = position
        for a, b in reads:  # (positions only grow: the latest use is this one)
            last_use[a:b] = [position] * (b - a)
        for a, b in writes:
            last_write[a:b] = last_use[a:b] = [position] * (b - a)
    arriving: dict = {}
    for position, before in moved.items():
        arriving.setdefault(before, []).append(instructions[position])
    order = []
    for position, inst in enumerate(instructions):
        order.extend(arriving.get(position, ()))
        if position not in moved:
            order.append(inst)
    return order
