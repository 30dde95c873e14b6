"""The sync pass's waits computed for the whole program at once (codegen.sync_arrays) are the walk's
(codegen.sync.SyncState, one instruction after another), wait for wait, in the same streams."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from neuronc import codegen
from neuronc.codegen import sync_arrays
from neuronc.codegen.sync import HazardGrid, SyncState, insert_waits
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.isa import AccessPattern, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff.program import TensorEntry, TensorKind
from neuronc.targets import get_target
from tests import zoo


def _walked(instructions: list, grid: HazardGrid) -> tuple:
    """(each instruction's waits, the streams' keys and instruction ids in the streams' order: the NEFF's) from the
    walk."""
    state = SyncState(instructions, grid)
    state.compute(instructions, 0, len(instructions))
    return [inst.waits for inst in instructions], [(k, [id(i) for i in v]) for k, v in state.streams.items()]


def _at_once(instructions: list, grid: HazardGrid) -> tuple:
    state = SyncState(instructions, grid)
    streams = sync_arrays.waits_at_once(instructions, grid.access, state.number, state.stream_keys)
    return [inst.waits for inst in instructions], [(k, [id(i) for i in v]) for k, v in streams.items()]


@pytest.fixture
def programs(monkeypatch):
    """The (instructions, grid) codegen synchronises, for every program compiled while it is active."""
    seen = []

    def capturing(instructions, tensors, target, grid=None, repeats=None):
        seen.append((instructions, grid))
        return insert_waits(instructions, tensors, target, grid, repeats)

    monkeypatch.setattr(codegen, "insert_waits", capturing)
    return seen


@pytest.mark.parametrize(("dtype", "level"), [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 0)])
def test_a_gpt2s_waits_at_once_are_the_walks(dtype, level, programs):
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=3, heads=2, context=32).eval().to(dtype)
    compile_exported(torch.export.export(model, (torch.randint(0, 64, (1, 32)),)), CompileOptions(opt_level=level))
    instructions, grid = programs[-1]  # the whole program: kernels timed by the passes (choice_time) come first
    walked = _walked(instructions, grid)
    assert sum(map(len, walked[0])) > 100  # a program with many hazards across streams
    assert _at_once(instructions, grid) == walked


@pytest.mark.parametrize("narrow_key_bits", [32, 0])  # keys sorted as 32-bit integers, or as 64-bit ones
def test_an_mlp_stacks_waits_at_once_are_the_walks(narrow_key_bits, programs, monkeypatch):
    monkeypatch.setattr(sync_arrays, "NARROW_KEY_BITS", narrow_key_bits)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())]).eval()
    compile_exported(torch.export.export(model, (torch.randn(32, 64),)), CompileOptions(opt_level=2))
    instructions, grid = programs[-1]  # the whole program: kernels timed by the passes (choice_time) come first
    assert _at_once(instructions, grid) == _walked(instructions, grid)


def _copy(queue: int, dst: AccessPattern, src: AccessPattern) -> Instruction:
    return Instruction(Opcode.DMA_COPY, Engine.DMA, (dst, src), queue=queue)


def _rows(first: int) -> AccessPattern:
    """64 rows of a [1024, 64] fp32 HBM tensor from row `first`."""
    return AccessPattern(Space.HBM, DType.F32, first * 64 * 4, ((64, 64), (1, 64)))


TILE = AccessPattern(Space.SBUF, DType.F32, 0, ((1, 64), (1, 64)))
TENSORS = [TensorEntry("x", TensorKind.SCRATCH, DType.F32, (1024, 64), 0)]


def test_each_hazard_kind_gives_the_wait_it_needs_and_a_write_forgets_the_reads_before_it():
    program = [
        _copy(0, TILE, _rows(0)),  # q0 #1: loads the tile (reads rows 0-63, never written)
        _copy(1, _rows(512), TILE),  # q1 #1: reads the tile after q0's write
        _copy(2, _rows(576), TILE),  # q2 #1: likewise
        _copy(0, TILE, _rows(64)),  # q0 #2: overwrites the tile both read
        _copy(1, _rows(512), TILE),  # q1 #2: reads the new tile
        _copy(1, _rows(512), TILE),  # q1 #3: the same, already waited for
        _copy(3, TILE, TILE),  # q3 #1: rewrites the tile in place: after q0 #2 and the reads since (not q2's, before it)
        _copy(4, _rows(0), TILE),  # q4 #1: reads q3's tile; overwrites rows 0-63, read by q0 #1 before any write
    ]
    expected = [(), ((Engine.DMA, 0, 1),), ((Engine.DMA, 0, 1),), ((Engine.DMA, 1, 1), (Engine.DMA, 2, 1)),
                ((Engine.DMA, 0, 2),), (), ((Engine.DMA, 0, 2), (Engine.DMA, 1, 3)),
                ((Engine.DMA, 0, 1), (Engine.DMA, 3, 1))]
    grid = HazardGrid(program, TENSORS, get_target("trn2"))
    waits, streams = _at_once(program, grid)
    assert waits == [tuple(Wait(*w) for w in row) for row in expected]
    assert streams == [((Engine.DMA, q), [id(i) for i in program if i.queue == q]) for q in (0, 1, 2, 3, 4)]
    assert _walked(program, grid) == (waits, streams)


@pytest.mark.parametrize("chunk", [1, 50, 1000])
def test_a_program_of_more_accesses_than_a_chunk_takes_its_cells_range_by_range_with_the_walks_waits(
        chunk, programs, monkeypatch):
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=2, heads=2, context=32).eval()
    compile_exported(torch.export.export(model, (torch.randint(0, 64, (1, 32)),)), CompileOptions(opt_level=2))
    instructions, grid = programs[-1]  # the whole program: kernels timed by the passes (choice_time) come first
    walked = _walked(instructions, grid)
    flat, _tags, sizes = sync_arrays._ordering_spans(list(map(grid.access, instructions)), len(instructions))
    ranges = sync_arrays._cell_ranges(flat, sizes, chunk)
    assert len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == flat[:, 1].max()
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # in order, nothing left out
    monkeypatch.setattr(sync_arrays, "CHUNK_ACCESSES", chunk)
    assert _at_once(instructions, grid) == walked


def test_a_program_touching_no_memory_waits_for_nothing():
    program = [Instruction(Opcode.DMA_COPY, Engine.DMA, (), queue=0)]
    grid = HazardGrid(program, TENSORS, get_target("trn2"))
    assert _at_once(program, grid) == ([()], [((Engine.DMA, 0), [id(program[0])])])


def test_the_streams_come_in_the_order_of_their_first_instruction_as_the_walk_appends_them():
    program = [_copy(3, TILE, _rows(0)), _copy(0, _rows(512), TILE), _copy(3, TILE, _rows(64))]
    grid = HazardGrid(program, TENSORS, get_target("trn2"))
    waits, streams = _at_once(program, grid)
    assert [key for key, _ in streams] == [(Engine.DMA, 3), (Engine.DMA, 0)]  # not sorted: the NEFF lists them so
    assert waits == [(), (Wait(Engine.DMA, 3, 1),), (Wait(Engine.DMA, 0, 1),)]
    assert _walked(program, grid) == (waits, streams)


def test_a_read_of_a_tensor_no_instruction_writes_is_no_sorted_access_and_orders_nothing():
    # the weight w ([1024, 64] fp32 after x) is only read: the grid gives its reads no cells, so the sorted accesses
    # are x's and the tile's alone, and the waits are the walk's, the tile's (q2 reloads it after q0 loaded it and q1
    # stored it)
    weight = AccessPattern(Space.HBM, DType.F32, 1024 * 64 * 4, ((64, 64), (1, 64)))
    tensors = [*TENSORS, TensorEntry("w", TensorKind.WEIGHT, DType.F32, (1024, 64), 1024 * 64 * 4)]
    program = [_copy(0, TILE, weight), _copy(1, _rows(0), TILE), _copy(2, TILE, weight), _copy(3, _rows(64), TILE)]
    grid = HazardGrid(program, tensors, get_target("trn2"))
    assert grid.ap_spans[id(weight)] == () and grid.access(program[1])[1]  # the weight no cells, x some
    flat, tags, sizes = sync_arrays._ordering_spans(list(map(grid.access, program)), len(program))
    keys, bits = sync_arrays._sorted_keys(flat, tags, sizes, len(program), 0, int(flat[:, 1].max()))
    assert sorted({int(key) >> 1 & ((1 << (bits - 1)) - 1) for key in keys if not int(key) & 1}) == [1, 3]  # readers
    waits, streams = _at_once(program, grid)
    assert waits == [(), (Wait(Engine.DMA, 0, 1),), (Wait(Engine.DMA, 0, 1), Wait(Engine.DMA, 1, 1)),
                     (Wait(Engine.DMA, 2, 1),)]
    assert _walked(program, grid) == (waits, streams)
