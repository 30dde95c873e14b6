"""Synchronisation: split the program into per-engine streams and add the semaphore waits it needs.

Codegen emits instructions in one program order. Here each goes to its stream (engine, or DMA
queue), and for every cross-stream hazard on the memory it touches (read after write, write after
read, write after write) it gets a wait on the other stream's semaphore. Memory is tracked per cell of a grid:
an HBM tensor's grid is cut at every boundary its accesses have (a 2-D tensor's rows by bytes within a row, so the
8-row pieces of one row tile stored from several DMA queues, an attention's output columns of a pair of heads, or a
transposed store's columns, do not wait for each other; other tensors by bytes), exact unless a tensor's accesses
would make more than HBM_CELLS_PER_TENSOR cells (then its cuts are rounded to a power of two); SBUF per quarter
page (placement.SBUF_HAZARD_BYTES: a K tile's DMA transposes, a row tile of columns each, run side by side) and
group of partitions (a DMA queue's share: loads of one tile split by partitions run side by side); PSUM per bank.
A coarse cell never misses a dependency, at the price of a few unnecessary ones. An HBM tensor no instruction writes
(a weight, an input) gets no cells: its reads order nothing. Waits a stream has already implied by an earlier wait
are dropped.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

from neuronc.codegen.sync_arrays import waits_at_once
from neuronc.isa import AccessPattern, Space, Wait
from neuronc.placement import SBUF_HAZARD_BYTES, partition_group  # granularity of hazard tracking in SBUF
from neuronc.targets import Target

# bounds the cells of one HBM tensor (so the keys of one access): a tensor whose accesses cut it finer is tracked on a
# coarser grid (boundaries rounded down to a power of two), never missing an overlap. 4096: a training step's QKV
# gradient ([512, 2304], stored in 21-row blocks of each third, read by 8 rows of 128 columns) cuts ~1,600 cells;
# at 1024 its row blocks shared cells and waited for each other (docs/performance.md, issue 16, Part 21)
HBM_CELLS_PER_TENSOR = 4096


def _coarser(points: list, quantum: int) -> list:
    """Cut points rounded down to a multiple of `quantum`, the last one kept: every access still falls between the
    first and the last, and accesses that shared a cell still do."""
    return sorted({point // quantum * quantum for point in points[:-1]} | {points[-1]})


def _cuts(rows: list, columns: list, cells: int) -> tuple:
    """(row cuts, column cuts) of a grid of at most `cells` cells: the given cut points, the axis with more
    intervals rounded to ever larger powers of two while the grid has more."""
    exact, quantum, cuts = (rows, columns), [1, 1], [rows, columns]
    while (len(cuts[0]) - 1) * (len(cuts[1]) - 1) > cells:
        axis = 0 if len(cuts[0]) >= len(cuts[1]) else 1
        quantum[axis] *= 2
        cuts[axis] = _coarser(exact[axis], quantum[axis])
    return cuts[0], cuts[1]


class _Regions:
    """Where an access pattern falls on the hazard-tracking grid of its memory: a box of rows (HBM rows or bytes of
    one tensor, PSUM banks, SBUF pages) by columns (a 2-D HBM tensor's bytes within a row, SBUF partition groups; one
    column elsewhere). HBM boxes are first measured in rows and bytes (`extent`), then numbered on each tensor's
    grid of the boundaries its accesses have (`grid`): exact, so accesses that share no byte share no cell."""

    def __init__(self, tensors: list, target: Target):
        # Tensors that share bytes (scratch buffers reused over time) start at the same offset (the memory
        # plan's slots): one block per start, tracked as rows by columns when every tensor there has one row width.
        widths: dict = {}  # start -> the row bytes of every tensor there
        for t in tensors:
            widths.setdefault(t.offset, set()).add(t.shape[-1] * t.dtype.itemsize if len(t.shape) >= 2 else 0)
        self.starts = sorted(widths)
        self.widths = [next(iter(widths[start])) if len(widths[start]) == 1 else 0 for start in self.starts]
        self.psum_bank = target.psum_bank_bytes
        self.partition_group = partition_group(target)

    def block(self, ap: AccessPattern) -> int:
        """The number of the HBM block an HBM access lies in (as `extent` finds it)."""
        return bisect.bisect_right(self.starts, ap.offset) - 1

    def extent(self, ap: AccessPattern) -> tuple:
        """An HBM access's box in its block: (space, block, first row, stop row, first column, stop column), rows and
        columns in rows and bytes of the block's width (bytes and one column when it has none), stops excluded.
        An on-chip access's box in cells (bounds included: see __call__)."""
        if ap.space != Space.HBM:
            return self(ap)
        tensor = bisect.bisect_right(self.starts, ap.offset) - 1
        width = self.widths[tensor]
        box = self._rows_by_columns(ap, tensor, width) if width else None
        if box is not None:
            return box
        first = last = ap.offset - self.starts[tensor]
        for stride, size in ap.dims:
            reach = stride * (size - 1) * ap.dtype.itemsize
            if reach < 0:
                first += reach
            else:
                last += reach
        last += ap.dtype.itemsize - 1
        if width:  # the rows it spans, every column
            return Space.HBM, tensor, first // width, last // width + 1, 0, width
        return Space.HBM, tensor, first, last + 1, 0, 1

    def grid(self, extents, cut_alike: bool) -> tuple:
        """({HBM extent: its box of cells, bounds included}, {block: (its group, rows, columns)} for the blocks cut
        alike): each block's rows cut at every access's first and stop row, its columns likewise (coarser where that
        makes more than HBM_CELLS_PER_TENSOR cells). With `cut_alike`, blocks of one row width are cut at the union
        of their cuts when that stays within HBM_CELLS_PER_TENSOR (a finer exact grid: the same overlaps, so the same
        waits and prefetch), so that consecutive layers' activations in different scratch slots are tracked on grids
        that are the same up to a shift (codegen.sync_replay maps one layer's cells onto the next's); without it (the
        sync pass of waits_at_once), each block keeps its own cuts: fewer cells per access, which that pass pays per
        cell."""
        by_block: dict = {}
        for box in extents:
            by_block.setdefault(box[1], []).append(box)
        exact = {block: (sorted({box[2] for box in boxes} | {box[3] for box in boxes}),
                         sorted({box[4] for box in boxes} | {box[5] for box in boxes}))
                 for block, boxes in by_block.items()}
        by_width: dict = {}
        for block in exact:
            by_width.setdefault(self.widths[block], []).append(block)
        shared, alike = {}, {}
        for width, blocks in by_width.items():
            rows = sorted(set().union(*(exact[block][0] for block in blocks)))
            columns = sorted(set().union(*(exact[block][1] for block in blocks)))
            if cut_alike and len(blocks) > 1 and (len(rows) - 1) * (len(columns) - 1) <= HBM_CELLS_PER_TENSOR:
                for block in blocks:
                    shared[block] = (rows, columns)
                    alike[block] = (width, len(rows) - 1, len(columns) - 1)
        cells = {}
        for block, boxes in by_block.items():
            row_cuts, column_cuts = shared.get(block) or _cuts(*exact[block], HBM_CELLS_PER_TENSOR)
            for box in boxes:
                cells[box] = (Space.HBM, block, bisect.bisect_right(row_cuts, box[2]) - 1,
                              bisect.bisect_left(row_cuts, box[3]) - 1, bisect.bisect_right(column_cuts, box[4]) - 1,
                              bisect.bisect_left(column_cuts, box[5]) - 1)
        return cells, alike

    def __call__(self, ap: AccessPattern) -> tuple:
        """An on-chip access's box: (space, -1, first row, last row, first column, last column), bounds included."""
        extent = 1
        for stride, size in ap.dims[1:]:
            extent += stride * (size - 1)
        first, last = ap.offset, ap.offset + extent * ap.dtype.itemsize - 1
        if ap.space == Space.PSUM:
            return Space.PSUM, -1, first // self.psum_bank, last // self.psum_bank, 0, 0
        group = self.partition_group
        return (Space.SBUF, -1, first // SBUF_HAZARD_BYTES, last // SBUF_HAZARD_BYTES,
                ap.partition // group, (ap.partition + ap.partitions - 1) // group)

    def _rows_by_columns(self, ap: AccessPattern, tensor: int, width: int) -> tuple | None:
        """The extent of an HBM access in its block's rows by bytes of a row, when each of its axes steps along rows
        or within a row without leaving it; else None (then: every column of the rows it spans)."""
        row, col = divmod(ap.offset - self.starts[tensor], width)
        last_row, last_col = row, col + ap.dtype.itemsize - 1
        for stride, size in ap.dims:
            step = stride * ap.dtype.itemsize
            if size == 1 or step == 0:
                continue
            if step < 0:
                return None
            if step % width == 0:
                last_row += step // width * (size - 1)
            elif step < width:
                last_col += step * (size - 1)
            else:
                return None
        if last_col >= width:
            return None
        return Space.HBM, tensor, row, last_row + 1, col, last_col + 1


class _Last:
    """What one tracking cell last saw: its last write (stream number and position in that stream; stream
    -1 for none) and, since then, the last read of each stream. Immutable, so that the many cells one
    instruction touches share one object and a hazard check looks at each distinct object once."""

    __slots__ = ("writer", "position", "reads")

    def __init__(self, writer: int, position: int, reads: dict):
        self.writer, self.position, self.reads = writer, position, reads

    def read_by(self, stream: int, position: int) -> "_Last":
        return _Last(self.writer, self.position, {**self.reads, stream: position})


_NEVER = _Last(-1, 0, {})


class _Cells:
    """The tracking cells of every memory, numbered: one block per HBM tensor (its grid's cells), PSUM (its banks)
    and SBUF (hazard cell by cell, SBUF_HAZARD_BYTES each, the partition groups of a cell side by side), so a box is one
    contiguous span of cell numbers, or one per cell when it covers only some partition groups. A 2-D HBM tensor's block is numbered row by
    row of cells (the column cells of a row side by side), or column by column (its rows consecutive within each)
    when its accesses are fewer spans so: a few columns of every row, say the heads of a fused qkv projection, are
    a few spans instead of one per row of cells."""

    def __init__(self, boxes: list, alike: dict):
        reach: dict = {}  # (space, tensor) -> (first row, last row, columns)
        for space, tensor, row0, row1, _c0, col1 in boxes:
            lo, hi, cols = reach.get((space, tensor), (row0, row1, col1 + 1))
            reach[(space, tensor)] = (min(lo, row0), max(hi, row1), max(cols, col1 + 1))
        for block, (_, rows, cols) in alike.items():  # blocks cut alike: numbered alike, every cell of the grid
            reach[(Space.HBM, block)] = (0, rows - 1, cols)
        self.blocks, self.count = {}, 0  # (space, tensor) -> (first cell, first row, rows, columns)
        for block, (lo, hi, cols) in reach.items():
            self.blocks[block] = (self.count, lo, hi - lo + 1, cols)
            self.count += (hi - lo + 1) * cols
        extra_spans = {block: 0 for block, (_, _, cols) in reach.items() if cols > 1 and block[0] == Space.HBM}
        for box in boxes:  # spans numbered by column minus spans numbered by page, over a block's distinct boxes
            if box[:2] in extra_spans:
                extra_spans[box[:2]] += self._span_count(box, True) - self._span_count(box, False)
        groups: dict = {}  # blocks cut alike are numbered alike: by column if that makes fewer spans over them all
        for block in extra_spans:
            if block[1] in alike:
                groups[alike[block[1]][0]] = groups.get(alike[block[1]][0], 0) + extra_spans[block]
        self.by_column = {block for block, more in extra_spans.items()
                          if (groups[alike[block[1]][0]] if block[1] in alike else more) < 0}

    def _span_count(self, box: tuple, by_column: bool) -> int:
        """len(self._spans(box, by_column)), without making them."""
        space, tensor, row0, row1, col0, col1 = box
        _, lo, rows, cols = self.blocks[(space, tensor)]
        if by_column:
            return 1 if row0 == lo and row1 == lo + rows - 1 else col1 - col0 + 1
        return 1 if col0 == 0 and col1 == cols - 1 else row1 - row0 + 1

    def _spans(self, box: tuple, by_column: bool) -> tuple:
        space, tensor, row0, row1, col0, col1 = box
        base, lo, rows, cols = self.blocks[(space, tensor)]
        if by_column:
            if row0 == lo and row1 == lo + rows - 1:
                return ((base + col0 * rows, base + (col1 + 1) * rows),)
            return tuple((base + col * rows + row0 - lo, base + col * rows + row1 - lo + 1)
                         for col in range(col0, col1 + 1))
        if col0 == 0 and col1 == cols - 1:
            return ((base + (row0 - lo) * cols, base + (row1 - lo + 1) * cols),)
        return tuple((base + (row - lo) * cols + col0, base + (row - lo) * cols + col1 + 1)
                     for row in range(row0, row1 + 1))

    def spans(self, box: tuple) -> tuple:
        """The [start, stop) spans of cell numbers of `box`."""
        return self._spans(box, box[:2] in self.by_column)


def _sbuf_grid(boxes: set) -> dict:
    """{SBUF box: the same box on SBUF's grid cut only where some access starts or stops} (rows of SBUF_HAZARD_BYTES
    merged between cuts): exact, as accesses that share a row share the merged row holding it and only those, and
    most tiles start and stop on page boundaries, so an access touches few cells where it would touch a row each."""
    cuts = sorted({box[2] for box in boxes} | {box[3] + 1 for box in boxes})
    return {box: (box[0], box[1], bisect.bisect_left(cuts, box[2]), bisect.bisect_left(cuts, box[3] + 1) - 1, *box[4:])
            for box in boxes}


class HazardGrid:
    """What each instruction of a program touches, as [start, stop) spans of tracking cells: the one
    description of memory that the scheduling pass (codegen.schedule) and the waits share."""

    def __init__(self, instructions: list, tensors: list, target: Target, cut_alike: bool = False):
        """`cut_alike`: HBM blocks of one row width on one grid (_Regions.grid), for codegen.sync_replay."""
        regions = _Regions(tensors, target)
        # Access patterns keyed by identity (the instructions hold them, and many share one; equal patterns that are
        # distinct objects get the same extent twice: hashing a pattern's fields at every use cost more). Boxes in
        # order of first use, writes before reads, as they number the cells.
        extents: dict = {}  # id(AccessPattern) -> its extent, then its spans of cells
        operands = [(inst.reads, inst.writes) for inst in instructions]  # (properties: read once per instruction)
        for _, writes in operands:
            for ap in writes:
                if id(ap) not in extents:
                    extents[id(ap)] = regions.extent(ap)
        # An HBM block no instruction writes (a weight's, an input's) orders nothing: a read of it follows no write
        # and no write follows it. Its reads get no cells (box None, no spans), so the grid, the sync pass and the
        # prefetch do no work for a layer's weights; the waits and placements are the same (no cell they shared with
        # another access is left out).
        written = {box[1] for box in extents.values() if box[0] == Space.HBM}
        for reads, _ in operands:
            for ap in reads:
                if id(ap) not in extents:
                    extents[id(ap)] = regions.extent(ap) if ap.space != Space.HBM or regions.block(ap) in written \
                        else None
        hbm, alike = regions.grid({box for box in extents.values() if box is not None and box[0] == Space.HBM},
                                  cut_alike)
        cells = {**hbm, **_sbuf_grid({box for box in extents.values() if box is not None and box[0] == Space.SBUF})}
        boxes = {key: cells.get(box, box) for key, box in extents.items()}
        distinct = [box for box in dict.fromkeys(boxes.values()) if box is not None]
        layout = _Cells(distinct, alike)
        spans = {box: layout.spans(box) for box in distinct}
        spans[None] = ()
        self.count = layout.count
        # the first cell of each block (an HBM tensor's grid, PSUM, SBUF), sorted, and the cell count: a span never
        # leaves its block (codegen.sync_replay maps one program span's cells onto another's block by block)
        self.block_starts = sorted(first for first, _, _, _ in layout.blocks.values()) + [layout.count]
        first, _, rows, columns = layout.blocks.get((Space.SBUF, -1), (0, 0, 0, 0))
        self.sbuf_cells = (first, first + rows * columns)  # [start, stop) of SBUF's cells (codegen.schedule)
        ap_spans = {key: spans[box] for key, box in boxes.items()}
        self.ap_spans = ap_spans  # id(AccessPattern) -> its spans (codegen.sync_replay compares patterns with them)
        # (an instruction of one pattern read, or written, takes that pattern's tuple of spans itself)
        self._access = dict(zip(map(id, instructions), [
            (ap_spans[id(reads[0])] if len(reads) == 1 else [span for ap in reads for span in ap_spans[id(ap)]],
             ap_spans[id(writes[0])] if len(writes) == 1 else [span for ap in writes for span in ap_spans[id(ap)]])
            for reads, writes in operands]))

    def access(self, inst) -> tuple:
        """(spans read, spans written) of an instruction of the program: sequences of [start, stop), the very tuple
        of HazardGrid.ap_spans when one pattern is read (or written); read them, do not change them."""
        return self._access[id(inst)]


def insert_waits(instructions: list, tensors: list, target: Target, grid: HazardGrid | None = None,
                 repeats: dict | None = None) -> dict:
    """Returns {(engine, queue): [instructions]} with `waits` filled in (`grid`: the program's, if made). With
    `repeats` ({id(instruction): a key equal for the copies of one recorded instruction}: codegen.reuse's), a span of
    instructions that repeats the one before it takes that span's waits when its boundary state proves them the
    same (codegen.sync_replay); the waits are those computed one by one either way."""
    grid = grid or HazardGrid(instructions, tensors, target, cut_alike=bool(repeats))
    state = SyncState(instructions, grid)
    if not repeats:
        return waits_at_once(instructions, grid.access, state.number, state.stream_keys)
    from neuronc.codegen.sync_replay import replay_repeats  # noqa: PLC0415 - it builds on this module
    replay_repeats(state, instructions, repeats)
    return dict(state.streams)


class SyncState:
    """The sync pass's state while it walks the program: each tracking cell's `_Last`, what each stream has
    already waited for, and the streams so far."""

    def __init__(self, instructions: list, grid: HazardGrid):
        self.grid = grid
        self.stream_keys = sorted({(inst.engine, inst.queue) for inst in instructions})  # Instruction.stream
        self.number = {key: n for n, key in enumerate(self.stream_keys)}
        self.cells = [_NEVER] * grid.count
        self.known = [[0] * len(self.stream_keys) for _ in self.stream_keys]  # [me][other]: count already waited for
        self.streams: dict = defaultdict(list)

    def compute(self, instructions: list, begin: int, end: int) -> None:
        """Waits of instructions[begin:end], one by one."""
        grid, cells, known, streams, number, stream_keys = (self.grid, self.cells, self.known, self.streams,
                                                             self.number, self.stream_keys)
        for inst in instructions[begin:end]:
            me = number[inst.stream]
            read_spans, write_spans = grid.access(inst)
            need: dict = {}
            seen = [set(cells[start:stop]) for start, stop in read_spans]  # the distinct _Last of each span read
            for last in set().union(*seen):  # read after write
                if last.writer >= 0 and need.get(last.writer, 0) < last.position:
                    need[last.writer] = last.position
            for start, stop in write_spans:  # write after write, write after read
                for last in set(cells[start:stop]):
                    if last.writer >= 0 and need.get(last.writer, 0) < last.position:
                        need[last.writer] = last.position
                    for other, position in last.reads.items():
                        if need.get(other, 0) < position:
                            need[other] = position
            waits, mine = [], known[me]
            for other in sorted(need):
                if other != me and mine[other] < need[other]:
                    waits.append(Wait(*stream_keys[other], need[other]))
                    mine[other] = need[other]
            inst.waits = tuple(waits)
            stream = streams[inst.stream]
            stream.append(inst)
            position = len(stream)
            updated: dict = {}  # a _Last -> its value once this instruction read it (one per value, for all spans)
            for (start, stop), distinct in zip(read_spans, seen):
                if len(distinct) == 1:
                    last = distinct.pop()
                    if last not in updated:
                        updated[last] = last.read_by(me, position)
                    cells[start:stop] = [updated[last]] * (stop - start)
                else:
                    for last in distinct:
                        if last not in updated:
                            updated[last] = last.read_by(me, position)
                    cells[start:stop] = [updated.get(last, last) for last in cells[start:stop]]
            written = _Last(me, position, {})
            for start, stop in write_spans:
                cells[start:stop] = [written] * (stop - start)
