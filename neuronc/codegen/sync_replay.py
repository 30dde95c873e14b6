"""Repeated layers synchronised once: the waits of a span of instructions that repeats the span before it.

A model of N identical layers emits N copies of one layer's instructions (codegen.reuse instantiates each recorded
kernel per layer), so the sync pass (codegen.sync) would find the same hazards N times. Here the program is cut
into spans of one period of its repetition (found from the recordings' keys), and a span B that repeats the span
A before it, instruction for instruction, takes A's waits (each count moved by the instructions its stream ran
in between) when that is provably what computing B's waits one by one gives:
- instruction j of B is on the stream A's instruction j is on under one bijection of streams (DMA queues turn
  round robin), and touches the cells A's touches under one shift per block of cells (an HBM tensor's grid, SBUF,
  PSUM), equal span lengths, distinct blocks onto distinct blocks;
- the state B starts from matches the one A started from on every cell A touches, as each access that sees it
  (those up to and including A's first write of the cell) sees it: the earlier writer (and, for an access that
  writes the cell, the earlier readers) its stream has not yet waited for are the same in both, at the same position
  counted from the period's start, on corresponding streams; the ones it has waited for give no wait in either (what a stream has waited for only grows).
Then every instruction of B finds the same hazards as A's, shifted, and emits the same waits; the cells B
touches end in A's end state shifted (written cells), or their own earlier state with B's reads (cells only
read), which is exactly what the one-by-one pass leaves. Anything else: B is computed one by one.

The correspondence is proved once per distinct pair of access patterns (not per span), and the boundary only for
the accesses that see a period's start state (up to its first write of each cell), listed once per run of replays
and mapped onto the later periods (_profile, _advance).

Off by default (codegen.generate's `replay`): exact (tests/test_sync_replay.py compares the NEFF bytes), but not yet
cheaper than the pass it replaces: Python per touched cell and per instruction remains (HF GPT-2, 12 layers:
docs/performance.md, issue 24 parts 7 and 8).
"""
from __future__ import annotations

import bisect
import operator
from collections import Counter

import numpy as np

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
    number = state.number
    streams_of = [number[inst.stream] for inst in instructions]
    spans_of: dict = {}  # id(AccessPattern) -> its spans as (block, first cell, length): _correspondence
    # Activations of consecutive layers may take turns in two scratch slots whose tracking cells are cut differently
    # (each slot's grid is cut where any of its tensors is accessed): a period of two (or more) of the repetitions
    # then maps every block of cells onto one of the same cuts.
    base, first_found = start - size, None
    for times in range(1, 5):
        if base + 2 * times * size <= len(instructions):
            first_found = _correspondence(state, instructions, streams_of, base, base + times * size, times * size,
                                          spans_of)
            if first_found is not None:
                start, size = base + times * size, times * size
                break
    state.compute(instructions, 0, start - size)
    previous = _snapshot(state)
    state.compute(instructions, start - size, start)
    a = start - size
    reference = None  # (a period R's profile, R's blocks -> (this A's block, cell shift), R's streams -> A's)
    inherited = None  # (A's streams -> B's, the profile's cells in A) of the last period replayed from this reference
    while a + 2 * size <= len(instructions):
        b = a + size
        current = _snapshot(state)
        found = None
        if None not in keyed[b:b + size] and keyed[b:b + size] == keyed[a:b]:
            found = first_found if a == base else _correspondence(state, instructions, streams_of, a, b, size,
                                                                  spans_of)
        if found is None:
            reference = inherited = None
            state.compute(instructions, b, b + size)
        else:
            if reference is None:
                reference = _profile(state, instructions, streams_of, a, size)
            inherited = _replay(state, instructions, streams_of, a, b, size, previous, current, reference, found,
                                inherited)
            if inherited is None:
                state.compute(instructions, b, b + size)
            reference = _advance(reference, found)
            if reference is None:
                inherited = None
        previous, a = current, b
    state.compute(instructions, a + size, len(instructions))


def _snapshot(state: SyncState) -> tuple:
    """(cells, each stream's instruction count, known waits) at this point."""
    return (state.cells[:], [len(state.streams.get(key, ())) for key in state.stream_keys],
            [row[:] for row in state.known])


def _correspondence(state: SyncState, instructions: list, streams_of: list, a: int, b: int, size: int,
                    spans_of: dict | None = None) -> tuple | None:
    """(streams of A -> streams of B, blocks of cells of A -> (block of B, cell shift)) when instructions[b:b + size]
    repeat instructions[a:a + size] so: the same opcodes and operand counts, streams under one bijection, and every
    access pattern of B touching the spans of A's pattern in its place, shifted by one shift per block (distinct
    blocks onto distinct blocks); else None. The patterns are compared once per distinct pair (the instances of one
    recording share their on-chip patterns, and an instance its rebound HBM ones), not per instruction; `spans_of`
    keeps each pattern's spans as (block, first cell, length) between calls."""
    on_a, on_b = streams_of[a:b], streams_of[b:b + size]
    sigma = dict(zip(on_a, on_b))
    if len(set(zip(on_a, on_b))) != len(sigma) or len(set(sigma.values())) != len(sigma):
        return None
    run_a, run_b = instructions[a:b], instructions[b:b + size]
    if [(i.opcode, i.accumulate, len(i.operands)) for i in run_a] != \
            [(i.opcode, i.accumulate, len(i.operands)) for i in run_b]:
        return None  # (reads and writes are the operands split by opcode and accumulate)
    # (operand counts are equal instruction by instruction: the flat lists pair operand with operand)
    pairs = set(zip([id(ap) for inst in run_a for ap in inst.operands], [id(ap) for inst in run_b for ap in inst.operands]))
    spans_of = {} if spans_of is None else spans_of
    ap_spans, starts = state.grid.ap_spans, state.grid.block_starts

    def spans(key: int) -> tuple:
        found = spans_of.get(key)
        if found is None:
            found = spans_of[key] = tuple((bisect.bisect_right(starts, first) - 1, first, stop - first)
                                          for first, stop in ap_spans[key])
        return found

    blocks: dict = {}  # block of A -> (block of B, cell shift)
    same: set = set()  # blocks of the patterns A and B share (shift 0)
    for pa, pb in pairs:
        if pa == pb:
            same.update(block for block, _, _ in spans(pa))
            continue
        spans_a, spans_b = spans(pa), spans(pb)
        if len(spans_a) != len(spans_b):
            return None
        for (block_a, first, length), (block_b, first_b, length_b) in zip(spans_a, spans_b):
            if length != length_b or first_b + length_b > starts[block_b + 1] or blocks.setdefault(
                    block_a, (block_b, first_b - first)) != (block_b, first_b - first):
                return None
    for block in same:
        if blocks.setdefault(block, (block, 0)) != (block, 0):
            return None
    if len({block for block, _ in blocks.values()}) != len(blocks):
        return None
    return sigma, blocks


def _profile(state: SyncState, instructions: list, streams_of: list, a: int, size: int) -> tuple:
    """(profile, identity block map, identity stream map) of the period instructions[a:a + size]. The profile: its
    touched cells in order, as numpy arrays (`cells`) and per block (`runs`: (block, stop in `cells`)); the accesses
    of each that see the state the period starts from (`accesses`: each (stream, whether it writes) up to and
    including the period's first write of the cell; later ones see only the period's own state); and which are
    written (`written`, `read`: positions in `cells`). Made once per run of replays: the next periods' are this one
    mapped by the correspondences (_advance), not walked again."""
    grid = state.grid
    exposed: list = [None] * grid.count  # per cell: None (untouched), or (accesses seeing the start, written)
    for j in range(a, a + size):
        me = streams_of[j]
        reads, writes = grid.access(instructions[j])
        for writing, spans in ((False, reads), (True, writes)):
            updated: dict = {}
            for first, stop in spans:
                run = exposed[first:stop]
                for e in set(run):
                    if e not in updated:
                        if e is None:
                            updated[e] = (frozenset(((me, writing),)), writing)
                        elif e[1]:  # written earlier in the period: its state is the period's own
                            updated[e] = e
                        else:
                            updated[e] = (e[0] | {(me, writing)}, writing)
                exposed[first:stop] = [updated[e] for e in run]
    touched = [cell for cell, e in enumerate(exposed) if e is not None]
    starts, runs = grid.block_starts, []
    for position, cell in enumerate(touched):
        block = bisect.bisect_right(starts, cell) - 1
        if runs and runs[-1][0] == block:
            runs[-1][1] = position + 1
        else:
            runs.append([block, position + 1])
    profile = {
        "cells": np.array(touched, dtype=np.int64),
        "runs": [tuple(run) for run in runs],
        "accesses": tuple(exposed[cell][0] for cell in touched),
        "written": np.array([k for k, cell in enumerate(touched) if exposed[cell][1]], dtype=np.int64),
        "read": np.array([k for k, cell in enumerate(touched) if not exposed[cell][1]], dtype=np.int64),
    }
    return profile, {block: (block, 0) for block, _ in runs}, {m: m for m in set(streams_of[a:a + size])}


def _advance(reference: tuple, found: tuple) -> tuple | None:
    """The reference's maps onto the next period (B of `found`), or None where B does not cover them."""
    profile, block_map, stream_map = reference
    sigma, blocks = found
    moved = {}
    for block, (block_a, shift) in block_map.items():
        if block_a not in blocks:
            return None
        block_b, more = blocks[block_a]
        moved[block] = (block_b, shift + more)
    if any(m not in sigma for m in stream_map.values()):
        return None
    return profile, moved, {m: sigma[x] for m, x in stream_map.items()}


def _gather(values: list, positions) -> list:
    """values[p] for each p of `positions` (a list of ints)."""
    if len(positions) == 0:
        return []
    if len(positions) == 1:
        return [values[positions[0]]]
    return list(operator.itemgetter(*positions)(values))


def _live(last: _Last, m: int, writes: bool, counts: list, known: list) -> dict:
    """{(writer or reader, stream): position from the period's start} of the earlier accesses on a cell that an
    access of stream m may wait for: those later than what m had waited for (readers only if m writes)."""
    found = {}
    if last.writer >= 0 and last.writer != m and last.position > known[m][last.writer]:
        found[("w", last.writer)] = last.position - counts[last.writer]
    if writes:
        for o, p in last.reads.items():
            if o != m and p > known[m][o]:
                found[("r", o)] = p - counts[o]
    return found


def _replay(state: SyncState, instructions: list, streams_of: list, a: int, b: int, size: int, before_a: tuple,
            before_b: tuple, reference: tuple, found: tuple, inherited: tuple | None = None) -> tuple | None:
    """Instructions[b:b + size] given the waits of instructions[a:a + size] when that is exact; None (nothing
    changed) when it is not proved, else what the next period's replay inherits (_unproved). `reference`: a profile
    mapped onto A (_profile, _advance); `found`: A -> B (_correspondence); `inherited`: what A's own replay (from the
    period before it, through the same reference) returned, or None."""
    cells_a, counts_a, known_a = before_a
    cells_b, counts_b, known_b = before_b
    profile, block_map, stream_map = reference
    sigma, blocks = found
    shift_a, shift_b, lengths, begin = [], [], [], 0  # per run of the profile's cells: its shift onto A and onto B
    for block, stop in profile["runs"]:
        block_a, shift = block_map[block]
        if block_a not in blocks:
            return None
        shift_a.append(shift)
        shift_b.append(shift + blocks[block_a][1])
        lengths.append(stop - begin)
        begin = stop
    cells_on_a = profile["cells"] + np.repeat(np.array(shift_a, dtype=np.int64), lengths)
    cells_on_b = profile["cells"] + np.repeat(np.array(shift_b, dtype=np.int64), lengths)
    on_a, on_b = cells_on_a.tolist(), cells_on_b.tolist()
    # the boundary: every access that sees the state its period starts from sees the same in B as in A (the earlier
    # writer it may wait for inline, the readers a write may wait for by _live), except on the cells it holds for
    # by induction (_unproved)
    checked = _unproved(profile, cells_on_a, cells_on_b, sigma, inherited)
    accesses = profile["accesses"]
    if checked is not None:
        accesses = _gather(accesses, checked)
        on_a_checked, on_b_checked = _gather(on_a, checked), _gather(on_b, checked)
    else:
        on_a_checked, on_b_checked = on_a, on_b
    for x, y, accesses in set(zip(_gather(cells_a, on_a_checked), _gather(cells_b, on_b_checked), accesses)):
        for m, writes in accesses:
            m = stream_map[m]
            n = sigma[m]
            w, v = x.writer, y.writer
            live_a = w >= 0 and w != m and x.position > known_a[m][w]
            if live_a != (v >= 0 and v != n and y.position > known_b[n][v]):
                return None
            if live_a and (sigma.get(w) != v or x.position - counts_a[w] != y.position - counts_b[v]):
                return None
            if writes and (x.reads or y.reads):
                found_a = _live(x, m, writes, counts_a, known_a)
                found_b = _live(y, n, writes, counts_b, known_b)
                if len(found_a) != len(found_b):
                    return None
                for (kind, o), r in found_a.items():
                    if o not in sigma or found_b.get((kind, sigma[o])) != r:
                        return None
    # proved: B's waits are A's, moved; then B's end state
    keys, streams, known, number = state.stream_keys, state.streams, state.known, state.number
    moved = {o: counts_b[y] - counts_a[o] for o, y in sigma.items()}
    for inst_a, inst_b, me in zip(instructions[a:b], instructions[b:b + size], streams_of[b:b + size]):
        waits_a = inst_a.waits
        if len(waits_a) == 1:
            o = number[(waits_a[0].engine, waits_a[0].queue)]
            n, count = sigma[o], waits_a[0].count + moved[o]
            inst_b.waits = (Wait(*keys[n], count),)
            known[me][n] = count
        elif waits_a:
            waits = sorted((sigma[o], wait.count + moved[o])
                           for wait in waits_a for o in (number[(wait.engine, wait.queue)],))
            inst_b.waits = tuple(Wait(*keys[o], count) for o, count in waits)
            mine = known[me]
            for o, count in waits:
                mine[o] = count
        else:
            inst_b.waits = ()
        streams[keys[me]].append(inst_b)
    cells = state.cells
    # cells A wrote: A's end state, moved (every entry is the period's own)
    written_a = [on_a[k] for k in profile["written"].tolist()]
    ends = _gather(cells_b, written_a)
    new_written = {}
    for end_a in set(ends):
        new_written[end_a] = _Last(sigma[end_a.writer], end_a.position + moved[end_a.writer],
                                   {sigma[o]: p + moved[o] for o, p in end_a.reads.items()})
    for cell, end_a in zip([on_b[k] for k in profile["written"].tolist()], ends):
        cells[cell] = new_written[end_a]
    # cells A only read: B's start state with B's reads (A's reads since its start, moved)
    read = profile["read"].tolist()
    read_b = [on_b[k] for k in read]
    pairs = list(zip(_gather(cells_b, [on_a[k] for k in read]), _gather(cells_b, read_b)))
    new_read = {}
    for end_a, start_b in set(pairs):
        reads = dict(start_b.reads)
        for o, p in end_a.reads.items():
            if p > counts_a[o]:
                reads[sigma[o]] = p + moved[o]
        new_read[(end_a, start_b)] = _Last(start_b.writer, start_b.position, reads)
    for cell, pair in zip(read_b, pairs):
        cells[cell] = new_read[pair]
    return sigma, cells_on_a


def _unproved(profile: dict, on_a, on_b, sigma: dict, inherited: tuple | None) -> list | None:
    """Positions in the profile of the cells whose boundary state _replay must compare (None: every cell).

    By induction, not the cells B starts from in a state A wrote, when A was itself replayed from the period Z
    before it through the same profile, under the same stream bijection (Z -> A as A -> B), and the cell stands to A
    as the cell it corresponds to in A stood to Z: profile cell k is, in B, the cell that A wrote as profile cell k'
    (on_b[k] = on_a[k'], k' written), and in A the cell that Z wrote as k' (on_a[k] = on_z[k']). A's replay set
    that cell of A to Z's end state moved, so B sees what A saw, moved; the counts each stream had waited for agree
    too, since A's waits are Z's moved (a stream's wait in A on a writer of A is there iff its counterpart is in Z,
    and otherwise both count less than any of the period's own positions). So the comparison holds on those cells
    without being made: the writes of one layer read by the next (its residual stream) and the scratch cells each
    period rewrites."""
    if inherited is None:
        return None
    sigma_before, on_z = inherited
    if sigma_before != sigma:
        return None
    written = profile["written"]
    if len(written) == 0:
        return None
    written_in_a = on_a[written]
    order = np.argsort(written_in_a, kind="stable")
    sorted_written = written_in_a[order]
    slot = np.minimum(np.searchsorted(sorted_written, on_b), len(sorted_written) - 1)
    k_prime = written[order[slot]]
    held = (sorted_written[slot] == on_b) & (on_z[k_prime] == on_a)
    return np.flatnonzero(~held).tolist()
