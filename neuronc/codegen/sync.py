"""Synchronisation: split the program into per-engine streams and add the semaphore waits it needs.

Codegen emits instructions in one program order. Here each goes to its stream (engine, or DMA
queue), and for every cross-stream hazard on the memory it touches (read after write, write after
read, write after write) it gets a wait on the other stream's semaphore. Memory is tracked per HBM
page (a tensor cut into at most HBM_PAGES_PER_TENSOR pages, so row tiles of one tensor stored from
several DMA queues do not wait on each other; a 2-D tensor's pages of rows further cut into column
blocks, so an attention's output columns of a pair of heads, or a transposed store's, do not wait for
the other columns of the same rows), per SBUF page and group of partitions (a DMA queue's share: loads
of one tile split by partitions run side by side) and per PSUM bank: coarse, so never missing a
dependency, at the price of a few unnecessary ones. Waits a stream has already implied by
an earlier wait are dropped.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

from neuronc.isa import AccessPattern, Space, Wait
from neuronc.placement import SBUF_PAGE_BYTES, partition_group  # granularity of hazard tracking in SBUF
from neuronc.targets import Target

HBM_PAGES_PER_TENSOR = 1024  # bounds the keys of one access; pages are at least HBM_MIN_PAGE_BYTES
HBM_MIN_PAGE_BYTES = 4 * 1024
# a 2-D tensor's rows are tracked in up to 8 column blocks of at least 256 bytes (a K tile of bf16)
HBM_COLUMNS, HBM_COLUMN_BYTES = 8, 256


def _power_of_two_above(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class _Regions:
    """Where an access pattern falls on the hazard-tracking grid of its memory: a box of rows (HBM pages of
    one tensor, PSUM banks, SBUF pages) by columns (SBUF partition groups; one column elsewhere)."""

    def __init__(self, tensors: list, target: Target):
        # Tensors that share bytes (scratch buffers reused over time) start at the same offset (the memory
        # plan's slots): one block of pages per start, as long as its longest tensor.
        blocks: dict = {}
        widths: dict = {}  # start -> the row bytes of every tensor there (one value: tracked as rows by columns)
        for t in tensors:
            blocks[t.offset] = max(blocks.get(t.offset, 0), t.nbytes)
            widths.setdefault(t.offset, set()).add(t.shape[-1] * t.dtype.itemsize if len(t.shape) >= 2 else 0)
        self.starts = sorted(blocks)
        # Pages are powers of two, so that tiles of power-of-two rows never share a page at their boundary
        self.pages = [max(HBM_MIN_PAGE_BYTES, _power_of_two_above(-(-blocks[start] // HBM_PAGES_PER_TENSOR)))
                      for start in self.starts]
        self.rows = []  # per block: (row bytes, rows per page, column bytes), or None for pages of bytes
        for start, page in zip(self.starts, self.pages):
            (width,) = widths[start] if len(widths[start]) == 1 else (0,)
            columns = min(HBM_COLUMNS, width // HBM_COLUMN_BYTES)
            if columns > 1:  # pages of a power of two rows, as many cells as HBM_PAGES_PER_TENSOR pages at most
                rows = -(-blocks[start] // width)
                per_page = _power_of_two_above(max(1, page // width, -(-rows * columns // HBM_PAGES_PER_TENSOR)))
                self.rows.append((width, per_page, -(-width // columns)))
            else:
                self.rows.append(None)
        self.psum_bank = target.psum_bank_bytes
        self.partition_group = partition_group(target)

    def __call__(self, ap: AccessPattern) -> tuple:
        """(space, tensor index or -1, first row, last row, first column, last column), bounds included."""
        if ap.space == Space.HBM:
            tensor = bisect.bisect_right(self.starts, ap.offset) - 1
            box = self._rows_by_columns(ap, tensor) if self.rows[tensor] else None
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
            if self.rows[tensor]:  # the rows it spans, every column
                width, rows_per_page, column_bytes = self.rows[tensor]
                return (Space.HBM, tensor, first // width // rows_per_page, last // width // rows_per_page,
                        0, (width - 1) // column_bytes)
            page = self.pages[tensor]
            return Space.HBM, tensor, first // page, last // page, 0, 0
        extent = 1
        for stride, size in ap.dims[1:]:
            extent += stride * (size - 1)
        first, last = ap.offset, ap.offset + extent * ap.dtype.itemsize - 1
        if ap.space == Space.PSUM:
            return Space.PSUM, -1, first // self.psum_bank, last // self.psum_bank, 0, 0
        group = self.partition_group
        return (Space.SBUF, -1, first // SBUF_PAGE_BYTES, last // SBUF_PAGE_BYTES,
                ap.partition // group, (ap.partition + ap.partitions - 1) // group)

    def _rows_by_columns(self, ap: AccessPattern, tensor: int) -> tuple | None:
        """The box of an HBM access in its block's rows (grouped by page) by column blocks, when each of its axes
        steps along rows or within a row without leaving it; else None (then: every column of the rows it spans)."""
        width, rows_per_page, column_bytes = self.rows[tensor]
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
        return (Space.HBM, tensor, row // rows_per_page, last_row // rows_per_page,
                col // column_bytes, last_col // column_bytes)


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
    """The tracking cells of every memory, numbered: one block per HBM tensor (its pages, as far as accesses
    reach), PSUM (its banks) and SBUF (page by page, the partition groups of a page side by side), so a box
    is one contiguous span of cell numbers, or one per page when it covers only some partition groups. A 2-D
    HBM tensor's block is numbered page by page (the column blocks of a page side by side), or column block by
    column block (its pages consecutive within each) when its accesses are fewer spans so: a few columns of
    every row, say the heads of a fused qkv projection, are a few spans instead of one per page."""

    def __init__(self, boxes: list):
        reach: dict = {}  # (space, tensor) -> (first row, last row, columns)
        for space, tensor, row0, row1, _c0, col1 in boxes:
            lo, hi, cols = reach.get((space, tensor), (row0, row1, col1 + 1))
            reach[(space, tensor)] = (min(lo, row0), max(hi, row1), max(cols, col1 + 1))
        self.blocks, self.count = {}, 0  # (space, tensor) -> (first cell, first row, rows, columns)
        for block, (lo, hi, cols) in reach.items():
            self.blocks[block] = (self.count, lo, hi - lo + 1, cols)
            self.count += (hi - lo + 1) * cols
        extra_spans = {block: 0 for block, (_, _, cols) in reach.items() if cols > 1 and block[0] == Space.HBM}
        for box in boxes:  # spans numbered by column minus spans numbered by page, over a block's distinct boxes
            if box[:2] in extra_spans:
                extra_spans[box[:2]] += self._span_count(box, True) - self._span_count(box, False)
        self.by_column = {block for block, more in extra_spans.items() if more < 0}

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


class HazardGrid:
    """What each instruction of a program touches, as [start, stop) spans of tracking cells: the one
    description of memory that the scheduling pass (codegen.schedule) and the waits share."""

    def __init__(self, instructions: list, tensors: list, target: Target):
        regions = _Regions(tensors, target)
        boxes: dict = {}  # AccessPattern -> its box (many instructions share operands)
        for inst in instructions:
            for ap in (*inst.reads, *inst.writes):
                if ap not in boxes:
                    boxes[ap] = regions(ap)
        distinct = list(dict.fromkeys(boxes.values()))
        layout = _Cells(distinct)
        spans = {box: layout.spans(box) for box in distinct}
        self.count = layout.count
        self._access = {id(inst): ([span for ap in inst.reads for span in spans[boxes[ap]]],
                                   [span for ap in inst.writes for span in spans[boxes[ap]]])
                        for inst in instructions}

    def access(self, inst) -> tuple:
        """(spans read, spans written) of an instruction of the program."""
        return self._access[id(inst)]


def insert_waits(instructions: list, tensors: list, target: Target, grid: HazardGrid | None = None) -> dict:
    """Returns {(engine, queue): [instructions]} with `waits` filled in (`grid`: the program's, if made)."""
    grid = grid or HazardGrid(instructions, tensors, target)
    stream_keys = sorted({inst.stream for inst in instructions})
    number = {key: n for n, key in enumerate(stream_keys)}
    cells = [_NEVER] * grid.count
    known = [[0] * len(stream_keys) for _ in stream_keys]  # [me][other]: count already waited for
    streams: dict = defaultdict(list)
    for inst in instructions:
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
    return dict(streams)
