"""The sync pass's waits for a whole program at once, with array operations instead of a walk per instruction.

codegen.sync walks the program and keeps, per tracking cell, its last write and the reads since; an instruction
waits, on each other stream, for the latest position it must follow: the last writer of every cell it touches
(read after write, write after write) and, for the cells it writes, every read since that write (write after
read); a wait a stream already implied by an earlier wait of its own is dropped. All of that is a function of
each cell's accesses in program order, so here every (cell, instruction, read or write) access is listed as one
integer key, the keys sorted (cell by cell, each cell's accesses in program order, an instruction's reads before its
writes), and for each access the previous write and the next write of its cell found by running maxima and minima:
a previous write gives the access a need of (the writer's stream, its position), and a read gives the next write a
need of (the reader's stream, its position). The needs of an instruction are reduced by stream (maximum) and
filtered by its stream's running maximum of earlier needs (what it already waited for). The waits are those of the
walk, wait for wait (tests/test_sync_arrays.py compares them); the cost is in numpy per access instead of Python
per span and per distinct cell state, so it grows with the program's cells touched, not with its instructions' Python.
A read of a tensor no instruction writes (a weight's) would give no need either way: the hazard grid gives it no cells.
"""
from __future__ import annotations

from itertools import chain, repeat

import numpy as np

from neuronc.isa import Wait

# The accesses of at most this many (cell, instruction) pairs are sorted at once: the arrays take about 40 bytes per
# access at their peak, so a program of more (HF GPT-2 small at sequence 512, fp32: over 4 M) is taken in ranges of
# cells, each holding at most this many (a cell's accesses never split: its waits need them all together).
CHUNK_ACCESSES = 4_000_000
NARROW_KEY_BITS = 32  # keys of at most this many bits are sorted as unsigned 32-bit integers (about twice as fast)


def waits_at_once(instructions: list, access, number: dict, stream_keys: list) -> dict:
    """Sets every instruction's `waits` and returns {(engine, queue): [instructions]} as codegen.sync's walk does
    (`access`: HazardGrid.access; `number`: stream key -> its number in `stream_keys`, sorted). Python per
    instruction is kept to a few comprehensions: each instruction's place in its stream is counted with numpy, the
    waits are made per wait. The cells are taken in ranges of at most CHUNK_ACCESSES accesses (each cell's needs
    are its own, so the ranges' needs combine by their maximum)."""
    n, s_count = len(instructions), len(stream_keys)
    flat, tags, sizes = _ordering_spans(list(map(access, instructions)), n)
    me = np.fromiter(map(number.__getitem__, [(inst.engine, inst.queue) for inst in instructions]), dtype=np.int64,
                     count=n)  # (engine, queue): Instruction.stream
    positions = np.zeros(n, dtype=np.int64)  # each instruction's 1-based place in its stream
    rows_of = {}  # stream number -> its instructions' rows, in program order
    for stream in range(s_count):
        mine = np.flatnonzero(me == stream)
        if len(mine):
            rows_of[stream] = mine
            positions[mine] = np.arange(1, len(mine) + 1)
    # the streams in order of their first instruction, as a walk appending each instruction to its stream makes them
    streams = {stream_keys[stream]: list(map(instructions.__getitem__, rows.tolist()))
               for stream, rows in sorted(rows_of.items(), key=lambda item: item[1][0])}
    for inst in instructions:
        inst.waits = ()
    if len(sizes) == 0:
        return streams
    need = np.zeros((n, s_count), dtype=np.int64)
    for lo, hi in _cell_ranges(flat, sizes, CHUNK_ACCESSES):
        keys, bits = _sorted_keys(flat, tags, sizes, n, lo, hi)
        if len(keys):
            np.maximum(need, _needs(keys, bits, me, positions, s_count), out=need)
    need[np.arange(n), me] = 0  # a stream needs no wait for itself
    emitted = np.zeros((n, s_count), dtype=bool)
    for mine in rows_of.values():
        wanted = need[mine]
        already = np.maximum.accumulate(wanted, axis=0)
        emitted[mine[1:]] = wanted[1:] > already[:-1]
        emitted[mine[0]] = wanted[0] > 0
    rows, columns = np.nonzero(emitted)  # by row, then by stream: each instruction's waits in stream order
    if len(rows) == 0:
        return streams
    # each Wait made from a zip of (engine, queue, count) in C (tuple.__new__, no Python per wait)
    engines = np.array([engine for engine, _ in stream_keys], dtype=object)
    queues = np.array([queue for _, queue in stream_keys], dtype=np.int64)
    made = list(map(tuple.__new__, repeat(Wait), zip(engines[columns].tolist(), queues[columns].tolist(),
                                                      need[rows, columns].tolist())))
    firsts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    for row, a, b in zip(rows[firsts].tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(made)]):
        instructions[row].waits = tuple(made[a:b])
    return streams


def _needs(keys: np.ndarray, bits: int, me: np.ndarray, pos: np.ndarray, s_count: int) -> np.ndarray:
    """[instruction x stream] the latest position of that stream each instruction must follow (0: none), from the
    sorted access keys (int32 working arrays, each freed when used: several bytes per access, for millions)."""
    count = len(keys)
    keys = keys.astype(np.int64, copy=False)
    cell = (keys >> bits).astype(np.int32)
    who = ((keys >> 1) & ((1 << (bits - 1)) - 1)).astype(np.int32)
    writes = (keys & 1).astype(bool)
    del keys
    index = np.arange(count, dtype=np.int32)
    first = np.empty(count, dtype=bool)
    first[0], first[1:] = True, cell[1:] != cell[:-1]
    group_start = np.maximum.accumulate(np.where(first, index, 0))
    del first
    need = np.zeros(len(me) * s_count, dtype=np.int64)
    # the latest write before each access, in its cell (an instruction's own reads come before its writes)
    before = np.empty(count, dtype=np.int32)
    before[0] = -1
    np.maximum.accumulate(np.where(writes[:-1], index[:-1], -1), out=before[1:])
    has_before = before >= group_start
    del group_start
    writer = who[before[has_before]]
    del before
    np.maximum.at(need, who[has_before] * np.int64(s_count) + me[writer], pos[writer])
    del has_before, writer
    # the next write after each read, in its cell: it must follow that read
    following = np.minimum.accumulate(np.where(writes, index, count)[::-1])[::-1]
    del index
    reads = ~writes & (following < count)
    reads[reads] = cell[following[reads]] == cell[reads]
    del cell, writes
    reader = who[reads]
    np.maximum.at(need, who[following[reads]] * np.int64(s_count) + me[reader], pos[reader])
    return need.reshape(len(me), s_count)


def _ordering_spans(spans: list, n: int) -> tuple:
    """(flat, tags, sizes) of the spans: [start, stop) of each, instruction x 2 + (1 for a write), its cell count;
    spans read, then written, by each instruction in turn, the empty ones left out. (A read of a tensor no
    instruction writes, a weight's, which orders nothing, has no spans: codegen.sync HazardGrid.)"""
    flat, lengths = _flattened(list(chain.from_iterable(spans)))  # [start, stop) of each span, in that order
    tags = np.repeat(np.arange(2 * n, dtype=np.int64), lengths)  # instruction x 2 + (1 for a write), per span
    sizes = flat[:, 1] - flat[:, 0]
    kept = sizes > 0
    return flat[kept], tags[kept], sizes[kept]


def _flattened(sequences: list) -> tuple:
    """([start, stop) of every span of `sequences` (sequences of spans), in order, as an [n, 2] array; each sequence's
    length). Each distinct sequence object is read once in Python and gathered by numpy: the instructions of a
    repeated layer, and of one pattern, share their sequences (HazardGrid.ap_spans), so most are met many times."""
    ids = list(map(id, sequences))
    distinct = dict(zip(ids, sequences))  # id -> the sequence, in order of first use
    number = dict(zip(distinct, range(len(distinct))))
    index = np.fromiter(map(number.__getitem__, ids), dtype=np.int64, count=len(ids))
    sizes = np.fromiter(map(len, distinct.values()), dtype=np.int64, count=len(distinct))
    spans = np.fromiter(chain.from_iterable(chain.from_iterable(distinct.values())), dtype=np.int64,
                        count=2 * int(sizes.sum())).reshape(-1, 2)
    lengths = sizes[index]
    firsts = np.cumsum(sizes) - sizes  # where each distinct sequence's spans begin in `spans`
    total = int(lengths.sum())
    rows = np.repeat(firsts[index] - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)
    return spans[rows], lengths


def span_counts(bounds: np.ndarray, size: int) -> np.ndarray:
    """[how many of the [start, stop) spans `bounds` (rows of an [n, 2] array, stops <= size) hold cell c, for c in
    0..size-1]."""
    cover = np.zeros(size + 1, dtype=np.int64)
    np.add.at(cover, bounds[:, 0], 1)
    np.add.at(cover, bounds[:, 1], -1)
    return np.cumsum(cover[:size])


def _cell_ranges(flat: np.ndarray, sizes: np.ndarray, most: int) -> list:
    """[lo, hi) ranges of cells covering every span, in order, each touched by at most `most` accesses (more only
    where one cell alone has more)."""
    end = int(flat[:, 1].max())
    if int(sizes.sum()) <= most:
        return [(0, end)]
    upto = np.cumsum(span_counts(flat, end))  # accesses of the cells up to and including each
    ranges, lo = [], 0
    while lo < end:
        taken = int(upto[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(upto, taken + most, side="right")))
        ranges.append((lo, min(hi, end)))
        lo = hi
    return ranges


def _sorted_keys(flat: np.ndarray, tags: np.ndarray, sizes: np.ndarray, n: int, lo: int, hi: int) -> tuple:
    """(keys, bits): cell << bits | instruction << 1 | (1 for a write), one per distinct access to the cells [lo,
    hi) of the spans (flat, tags, sizes: _ordering_spans'), sorted."""
    if lo > 0 or hi < int(flat[:, 1].max()):
        flat = np.clip(flat, lo, hi)
        sizes = flat[:, 1] - flat[:, 0]
        inside = sizes > 0
        flat, tags, sizes = flat[inside], tags[inside], sizes[inside]
    total = int(sizes.sum())
    offsets = np.cumsum(sizes) - sizes  # where each span's cells begin in the flat list
    keys = np.repeat(flat[:, 0] - offsets, sizes)  # each access's cell, then the key, in place
    keys += np.arange(total)
    bits = (2 * n - 1).bit_length()
    keys <<= bits
    keys |= np.repeat(tags, sizes)
    if total and int(flat[:, 1].max()).bit_length() + bits <= NARROW_KEY_BITS:
        keys = keys.astype(np.uint32)
    keys = np.sort(keys)
    distinct = np.empty(len(keys), dtype=bool)
    if len(keys):
        distinct[0], distinct[1:] = True, keys[1:] != keys[:-1]
    return keys[distinct], bits
