"""The hazard grid (codegen.sync) and the prefetch step (codegen.schedule) on a program of repeated layers: what
each instruction touches is read from it once, an instruction of one pattern read or written takes that pattern's
spans as they are, and the prefetch, which keeps uses only for SBUF cells and writes only for the others, places
each load after the last earlier instruction it conflicts with on any cell."""
from __future__ import annotations

import pytest
import torch

from neuronc import codegen
from neuronc.codegen import schedule
from neuronc.codegen.sync import HazardGrid
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.isa import Instruction, Space
from neuronc.placement import SBUF_HAZARD_BYTES, SBUF_PAGE_BYTES, partition_group
from neuronc.targets import get_target
from tests import zoo


def _program(width: int, layers: int, context: int) -> tuple:
    """(instructions in emitted order, tensors, target, the grid) of a GPT-2's forward at -O2."""
    programs = []
    prefetch = codegen.prefetch_loads

    def capturing(instructions, grid):
        programs.append((list(instructions), grid))
        return prefetch(instructions, grid)

    codegen.prefetch_loads = capturing
    try:
        torch.manual_seed(0)
        model = zoo.GPT2(vocab=64, width=width, layers=layers, heads=2, context=context).eval()
        compiled = compile_exported(torch.export.export(model, (torch.randint(0, 64, (1, context)),)),
                                    CompileOptions(opt_level=2))
    finally:
        codegen.prefetch_loads = prefetch
    instructions, grid = programs[-1]  # the whole program: kernels timed by the passes (choice_time) come first
    return instructions, compiled.neff.tensors, get_target(compiled.neff.target), grid


@pytest.fixture(scope="module")
def program():
    """A 3-layer GPT-2's (width 64, context 32)."""
    return _program(64, 3, 32)


def test_the_grid_reads_what_each_instruction_reads_and_writes_once(program, monkeypatch):
    instructions, tensors, target, grid = program
    counts = {"reads": 0, "writes": 0}
    for name in counts:
        original = getattr(Instruction, name)

        def counting(inst, original=original, name=name):
            counts[name] += 1
            return original.fget(inst)

        monkeypatch.setattr(Instruction, name, property(counting))
    made = HazardGrid(instructions, tensors, target)
    assert counts == {"reads": len(instructions), "writes": len(instructions)}
    monkeypatch.undo()
    assert [made.access(inst) for inst in instructions] == [grid.access(inst) for inst in instructions]


def test_an_instruction_of_one_pattern_read_or_written_takes_that_patterns_spans(program):
    instructions, _, _, grid = program
    alone = [inst for inst in instructions if len(inst.reads) == 1]
    assert len(alone) > 100
    for inst in alone:
        assert grid.access(inst)[0] is grid.ap_spans[id(inst.reads[0])]
    for inst in instructions:
        assert grid.access(inst)[1] is grid.ap_spans[id(inst.writes[0])] or len(inst.writes) > 1
        reads, writes = grid.access(inst)  # several patterns: their spans in operand order
        assert list(reads) == [span for ap in inst.reads for span in grid.ap_spans[id(ap)]]
        assert list(writes) == [span for ap in inst.writes for span in grid.ap_spans[id(ap)]]


def test_the_sbuf_cells_are_the_spans_of_sbuf_patterns_and_no_others(program):
    instructions, _, _, grid = program
    start, stop = grid.sbuf_cells
    spaces = {"in": set(), "out": set()}
    for inst in instructions:
        for ap in inst.operands:
            for a, b in grid.ap_spans[id(ap)]:
                spaces["in" if start <= a and b <= stop else "out"].add(ap.space)
    assert spaces == {"in": {Space.SBUF}, "out": {Space.HBM, Space.PSUM}}


def _sbuf_box(ap, target) -> tuple:
    """(first, last) SBUF_HAZARD_BYTES row and (first, last) partition group of an SBUF pattern, bounds included."""
    extent = 1 + sum(stride * (size - 1) for stride, size in ap.dims[1:])
    last = ap.offset + extent * ap.dtype.itemsize - 1
    group = partition_group(target)
    return (ap.offset // SBUF_HAZARD_BYTES, last // SBUF_HAZARD_BYTES, ap.partition // group,
            (ap.partition + ap.partitions - 1) // group)


def test_sbuf_patterns_share_a_cell_exactly_when_they_share_a_row_of_a_partition_group(program):
    # SBUF is cut only where some access starts or stops (codegen.sync _sbuf_grid): exact, and the tiles of whole
    # pages, those nothing cuts finer, touch fewer cells than their SBUF_HAZARD_BYTES rows
    instructions, _, target, grid = program
    patterns = list({id(ap): ap for inst in instructions for ap in inst.operands if ap.space == Space.SBUF}.values())
    boxes = [_sbuf_box(ap, target) for ap in patterns]
    cells = [{c for a, b in grid.ap_spans[id(ap)] for c in range(a, b)} for ap in patterns]
    for i in range(len(patterns)):
        for j in range(i):
            (a0, a1, g0, g1), (b0, b1, h0, h1) = boxes[i], boxes[j]
            assert (a0 <= b1 and b0 <= a1 and g0 <= h1 and h0 <= g1) == bool(cells[i] & cells[j])
    rows = SBUF_PAGE_BYTES // SBUF_HAZARD_BYTES
    paged = [(len(cell), (b1 + 1 - b0) * (g1 + 1 - g0)) for (b0, b1, g0, g1), cell in zip(boxes, cells)
             if b0 % rows == 0 and (b1 + 1) % rows == 0]
    assert paged and all(touched <= units for touched, units in paged)
    assert sum(touched for touched, _ in paged) < sum(units for _, units in paged)


def test_a_moved_load_goes_after_the_last_earlier_instruction_it_conflicts_with_on_any_cell(program):
    instructions, _, _, grid = program
    cells = [tuple({cell for a, b in spans for cell in range(a, b)} for spans in grid.access(inst))
             for inst in instructions]
    placements = schedule._placements(instructions, grid, every_load=True)
    assert len(placements) > 20
    for position, placement in placements.items():
        reads, writes = cells[position]
        conflicting = [q for q in range(position) if cells[q][1] & reads or (cells[q][0] | cells[q][1]) & writes]
        assert placement.after == max(conflicting, default=-1)
    assert {p.after >= 0 for p in placements.values()} == {True, False}  # some wait for an earlier instruction



def test_a_loads_sbuf_cells_are_looked_at_as_strided_slices_of_the_same_cells():
    # a load of some partition groups writes a span of cells per row of cells (codegen.sync _Cells numbers SBUF row
    # by row): the prefetch reads and sets them as one strided slice per column of groups, fewer operations. Width
    # 256: a weight tile's partitions of 1 KiB are loaded a few partition groups per queue
    instructions, _, _, grid = _program(256, 2, 64)
    spans = slices = 0
    for inst in instructions:
        if not schedule._is_load(inst):
            continue
        writes = [span for span in grid.access(inst)[1] if span[1] > span[0]]
        strided = schedule._strided(writes)
        assert sorted(c for a, b, step, n in strided for c in range(a, b, step)) == sorted(
            c for a, b in writes for c in range(a, b))
        assert all(len(range(a, b, step)) == n for a, b, step, n in strided)
        spans, slices = spans + len(writes), slices + len(strided)
    assert slices < spans / 2


def test_a_read_of_a_tensor_no_instruction_writes_gets_no_cells_and_every_other_hbm_pattern_some(program):
    # a weight (or an input) is never written by the program: its reads order nothing (no write before or after them),
    # so the grid gives them no cells, and the sync pass and the prefetch do no work for a layer's weights
    instructions, tensors, _, grid = program
    starts = sorted({t.offset for t in tensors})

    def block(ap) -> int:
        return max(start for start in starts if start <= ap.offset)

    written = {block(ap) for inst in instructions for ap in inst.writes if ap.space == Space.HBM}
    empty = set()
    for inst in instructions:
        for ap in inst.operands:
            if ap.space == Space.HBM:
                assert (grid.ap_spans[id(ap)] == ()) == (block(ap) not in written)
                empty.add(grid.ap_spans[id(ap)] == ())
    assert empty == {True, False}
