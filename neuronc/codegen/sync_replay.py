"""Repeated layers synchronised once: the waits of a span of instructions that repeats the span before it.

A model of N identical layers emits N copies of one layer's instructions (codegen.reuse instantiates each recorded
kernel per layer), so the sync pass (codegen.sync) would find the same hazards N times. Here the program is cut
into spans of one period of its repetition (found from the recordings' keys), and a span B that repeats the span
A before it, instruction for instruction, takes A's waits (each count moved by the instructions its stream ran
in between) when that is provably what computing B's waits one by one gives:
- instruction j of B is on the stream A's instruction j is on under one bijection of streams (DMA queues turn
  round robin), and touches the cells A's touches under one shift per block of cells (an HBM tensor's grid, SBUF,
  PSUM), equal span lengths, distinct blocks onto distinct blocks;
- the state B starts from matches the one A started from on every cell A touches, as each stream that touches the
  cell sees it: the earlier writer (and, for a stream that writes the cell, the earlier readers) that stream has
  not yet waited for are the same in both, at the same position counted from the layer's start, on corresponding
  streams; the ones it has waited for give no wait in either (what a stream has waited for only grows).
Then every instruction of B finds the same hazards as A's, shifted, and emits the same waits; the cells B
touches end in A's end state shifted (written cells), or their own earlier state with B's reads (cells only
read), which is exactly what the one-by-one pass leaves. Anything else: B is computed one by one.

Off by default (codegen.generate's `replay`): exact (tests/test_sync_replay.py compares the NEFF bytes), but the
check visits every span of every instruction and each distinct pair of cell states, which costs as much CPU as the
pass it replaces (HF GPT-2, 12 layers: docs/performance.md, issue 24 part 7).
"""
from __future__ import annotations

import bisect
from collections import Counter

from neuronc.codegen.sync import SyncState, _Last
from neuronc.isa import Wait


def period(instructions: list, repeats: dict) -> tuple:
    """(first index of the longest repetition, instructions per period), or (0, 0) if the program does not repeat:
    the kernels' period is the shift under which most kernels meet one of the same recording (ties: the shorter)."""
    keys, counts = [], Counter()
    for inst in instructions:
        counts[inst.kernel] += 1
        if len(keys) <= inst.kernel:
            keys.extend([None] * (inst.kernel + 1 - len(keys)))
        if keys[inst.kernel] is None:
            found = repeats.get(id(inst))
            keys[inst.kernel] = found[0] if found else ("alone", inst.kernel)
    best, kernels = 0, 0
    for shift in range(1, len(keys) // 2 + 1):
        matches = sum(keys[k] == keys[k - shift] for k in range(shift, len(keys)))
        if matches > best:
            best, kernels = matches, shift
    if best < kernels or kernels == 0:
        return 0, 0
    first = next(k for k in range(kernels, len(keys)) if keys[k] == keys[k - kernels])
    size = sum(counts[k] for k in range(first, first + kernels))
    keyed = [repeats.get(id(inst)) for inst in instructions]
    start, run, best = None, 0, 0  # the longest run of instructions that repeat the one a period before
    for i in range(size, len(instructions) + 1):
        if i < len(instructions) and keyed[i] is not None and keyed[i] == keyed[i - size]:
            run += 1
        else:
            if run > best:
                start, best = i - run, run
            run = 0
    return (0, 0) if start is None else (start, size)


def replay_repeats(state: SyncState, instructions: list, repeats: dict) -> None:
    """The sync pass over the whole program, period by period (see the module's docstring)."""
    start, size = period(instructions, repeats)
    if size == 0:
        state.compute(instructions, 0, len(instructions))
        return
    keyed = [repeats.get(id(inst)) for inst in instructions]
    # Activations of consecutive layers may take turns in two scratch slots whose tracking cells are cut differently
    # (each slot's grid is cut where any of its tensors is accessed): a period of two (or more) of the repetitions
    # then maps every block of cells onto one of the same cuts.
    base = start - size
    for times in range(1, 5):
        if base + 2 * times * size <= len(instructions) and _correspondence(
                state, instructions, base, base + times * size, times * size) is not None:
            start, size = base + times * size, times * size
            break
    state.compute(instructions, 0, start - size)
    previous = _snapshot(state)
    state.compute(instructions, start - size, start)
    a = start - size
    while a + 2 * size <= len(instructions):
        b = a + size
        current = _snapshot(state)
        same = None not in keyed[b:b + size] and keyed[b:b + size] == keyed[a:b]
        if not (same and _replay(state, instructions, a, b, size, previous, current)):
            state.compute(instructions, b, b + size)
        previous, a = current, b
    state.compute(instructions, a + size, len(instructions))


def _snapshot(state: SyncState) -> tuple:
    """(cells, each stream's instruction count, known waits) at this point."""
    return (state.cells[:], [len(state.streams.get(key, ())) for key in state.stream_keys],
            [row[:] for row in state.known])


def _correspondence(state: SyncState, instructions: list, a: int, b: int, size: int) -> tuple | None:
    """(streams of A -> streams of B, blocks of cells of A -> (block of B, shift), A's spans -> their start in B, the
    spans A writes, A's spans -> the streams that access them and whether they write) when instructions[b:b + size] repeat instructions[a:a + size] so; else None."""
    grid, number = state.grid, state.number
    sigma: dict = {}
    for j in range(size):
        x, y = number[instructions[a + j].stream], number[instructions[b + j].stream]
        if sigma.setdefault(x, y) != y:
            return None
    if len(set(sigma.values())) != len(sigma):
        return None
    starts = grid.block_starts
    blocks: dict = {}  # block of A -> (block of B, cell shift)
    mapped: dict = {}  # span of A -> its start in B
    written: set = set()  # spans A writes
    accessors: dict = {}  # span of A -> {(stream, whether it writes)}
    for j in range(size):
        reads_a, writes_a = grid.access(instructions[a + j])
        reads_b, writes_b = grid.access(instructions[b + j])
        if len(reads_a) != len(reads_b) or len(writes_a) != len(writes_b):
            return None
        written.update(writes_a)
        me = number[instructions[a + j].stream]
        for span in reads_a:
            accessors.setdefault(span, set()).add((me, False))
        for span in writes_a:
            accessors.setdefault(span, set()).add((me, True))
        for spans_a, spans_b in ((reads_a, reads_b), (writes_a, writes_b)):
            for span, (start, stop) in zip(spans_a, spans_b):
                known_start = mapped.get(span)
                if known_start is not None:
                    if known_start != start or span[1] - span[0] != stop - start:
                        return None
                    continue
                if span[1] - span[0] != stop - start:
                    return None
                block_a = bisect.bisect_right(starts, span[0]) - 1
                block_b = bisect.bisect_right(starts, start) - 1
                if stop > starts[block_b + 1] or blocks.setdefault(block_a, (block_b, start - span[0])) != (
                        block_b, start - span[0]):
                    return None
                mapped[span] = start
    if len({block for block, _ in blocks.values()}) != len(blocks):
        return None
    return sigma, blocks, mapped, written, {span: frozenset(found) for span, found in accessors.items()}


def _replay(state: SyncState, instructions: list, a: int, b: int, size: int, before_a: tuple,
            before_b: tuple) -> bool:
    """Instructions[b:b + size] given the waits of instructions[a:a + size] when that is exact; False (nothing
    changed) when it is not proved."""
    grid, number = state.grid, state.number
    cells_a, counts_a, known_a = before_a
    cells_b, counts_b, known_b = before_b
    found = _correspondence(state, instructions, a, b, size)
    if found is None:
        return False
    sigma, blocks, mapped, written, accessors = found
    starts = grid.block_starts
    # cells A touches: 1 read only, 2 written; in runs within one block, with their shift onto B
    marks = bytearray(grid.count)
    for start, stop in mapped:
        marks[start:stop] = b"\x01" * (stop - start)
    for start, stop in written:
        marks[start:stop] = b"\x02" * (stop - start)
    touched = []  # (first cell, stop, shift)
    for span in sorted(mapped):
        shift = mapped[span] - span[0]
        if touched and span[0] <= touched[-1][1] and touched[-1][2] == shift and \
                bisect.bisect_right(starts, span[0]) == bisect.bisect_right(starts, touched[-1][0]):
            if span[1] > touched[-1][1]:
                touched[-1] = (touched[-1][0], span[1], shift)
        else:
            touched.append((span[0], span[1], shift))

    def live(last: _Last, m: int, writes: bool, counts: list, known: list) -> dict:
        """{(writer or reader, stream): position from the layer's start} of the earlier accesses on a cell that
        an access of stream m may wait for: those later than what m had waited for (readers only if m writes)."""
        found = {}
        if last.writer >= 0 and last.writer != m and last.position > known[m][last.writer]:
            found[("w", last.writer)] = last.position - counts[last.writer]
        if writes:
            for o, p in last.reads.items():
                if o != m and p > known[m][o]:
                    found[("r", o)] = p - counts[o]
        return found

    checked: set = set()
    for span, start_b in mapped.items():
        streams_of = accessors[span]
        for x, y in set(zip(cells_a[span[0]:span[1]], cells_b[start_b:start_b + span[1] - span[0]])):
            key = (x, y, streams_of)
            if key in checked:
                continue
            checked.add(key)
            for m, writes in streams_of:  # each gives the same waits in B as in A
                found_a = live(x, m, writes, counts_a, known_a)
                found_b = live(y, sigma[m], writes, counts_b, known_b)
                if len(found_a) != len(found_b):
                    return False
                for (kind, o), r in found_a.items():
                    if o not in sigma or found_b.get((kind, sigma[o])) != r:
                        return False
    # proved: B's waits are A's, moved; then B's end state
    keys, streams, known = state.stream_keys, state.streams, state.known
    moved = {o: counts_b[y] - counts_a[o] for o, y in sigma.items()}
    for j in range(size):
        inst_a, inst_b = instructions[a + j], instructions[b + j]
        me = number[inst_b.stream]
        waits = []
        for wait in inst_a.waits:
            o = number[(wait.engine, wait.queue)]
            waits.append((sigma[o], wait.count + moved[o]))
        waits.sort()
        inst_b.waits = tuple(Wait(*keys[o], count) for o, count in waits)
        for o, count in waits:
            known[me][o] = count
        streams[inst_b.stream].append(inst_b)
    cells = state.cells
    new_written: dict = {}  # A's end state of a cell it wrote -> B's (every entry is the layer's own)
    new_read: dict = {}  # (A's end state, B's start state) of a cell only read -> B's start with B's reads
    for first, stop, shift in touched:
        ends, begins, kinds = cells_b[first:stop], cells_b[first + shift:stop + shift], marks[first:stop]
        for end_a, kind, start_b in set(zip(ends, kinds, begins)):
            if kind == 2:
                if end_a not in new_written:
                    new_written[end_a] = _Last(sigma[end_a.writer], end_a.position + moved[end_a.writer],
                                               {sigma[o]: p + moved[o] for o, p in end_a.reads.items()})
            elif (end_a, start_b) not in new_read:
                reads = dict(start_b.reads)
                for o, p in end_a.reads.items():
                    if p > counts_a[o]:
                        reads[sigma[o]] = p + moved[o]
                new_read[(end_a, start_b)] = _Last(start_b.writer, start_b.position, reads)
        cells[first + shift:stop + shift] = [new_written[e] if k == 2 else new_read[(e, b)]
                                             for e, k, b in zip(ends, kinds, begins)]
    return True
