"""Registers and hardware loops (neuronc/isa.py, "Registers and loops"; runtime/loops.py): one program for every
row count, proven at load for every register value in range, its timeline priced per iteration."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from neuronc.errors import InputMismatchError, NeffFormatError, NeuronRuntimeError
from neuronc.isa import LOOP_INDEX, AccessPattern, AluOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff.program import Loop, Neff, Register, TensorEntry, TensorKind
from runtime import NeuronCore
from runtime.loops import registers_for_rows

WIDTH = 64
ROW = WIDTH * 4  # bytes of a row (fp32)
BLOCKS = (128, 16, 1)


@pytest.fixture(scope="module")
def core():
    return NeuronCore("trn2")


def chip(rows: int, offset: int = 0) -> AccessPattern:
    return AccessPattern(Space.SBUF, DType.F32, offset, ((1, rows), (1, WIDTH)))


def rows_program(max_tiles: int = 4, *, read_terms=None, write_terms=None, blocks=BLOCKS, scale=2.0,
                 spare: int = 0) -> Neff:
    """y = x * scale on [n, WIDTH] fp32 for every n up to max_tiles * 128 + 127: a loop of 128-row tiles, then one
    of 16-row and one of 1-row tiles, each at the offset the rows before it give."""
    capacity = max_tiles * blocks[0] + blocks[0] - 1
    registers = [Register("tiles", 0, max_tiles)] + [Register(f"rows{b}", 0, a // b - 1)
                                                     for a, b in zip(blocks, blocks[1:])]
    rows = tuple((r, b) for r, b in enumerate(blocks))
    x = TensorEntry("x", TensorKind.INPUT, DType.F32, (capacity + spare, WIDTH), 0, 0, rows=rows)
    y = TensorEntry("y", TensorKind.OUTPUT, DType.F32, (capacity, WIDTH), x.nbytes, 0, rows=rows)
    loops = []
    for level, block in enumerate(blocks):
        before = tuple((r, blocks[r] * ROW) for r in range(level))  # the rows of the larger blocks
        terms = before + ((LOOP_INDEX, block * ROW),)
        src = AccessPattern(Space.HBM, DType.F32, x.offset, ((WIDTH, block), (1, WIDTH)), 0,
                            terms if read_terms is None else read_terms(level, terms))
        dst = AccessPattern(Space.HBM, DType.F32, y.offset, ((WIDTH, block), (1, WIDTH)), 0,
                            terms if write_terms is None else write_terms(level, terms))
        streams = {
            (Engine.DMA, 0): [Instruction(Opcode.DMA_COPY, Engine.DMA, (chip(block), src))],
            (Engine.VECTOR, 0): [Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (chip(block, 1024), chip(block)),
                                             alu=AluOp.MULTIPLY, imm0=scale, waits=(Wait(Engine.DMA, 0, 1),))],
            (Engine.DMA, 1): [Instruction(Opcode.DMA_COPY, Engine.DMA, (dst, chip(block, 1024)), queue=1,
                                          waits=(Wait(Engine.VECTOR, 0, 1),))],
        }
        loops.append(Loop(level, streams))
    return Neff("rows", "trn2", [x, y], {}, x.nbytes + y.nbytes, registers=registers, loops=loops)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 127, 128, 129, 300, 639])
def test_one_loaded_program_serves_every_row_count_in_its_range_exactly(core, n):
    program = core.load(rows_program())
    x = np.random.default_rng(n).standard_normal((n, WIDTH)).astype(np.float32)

    (y,) = program.at(registers_for_rows(n, BLOCKS)).run([x]).outputs

    assert y.shape == (n, WIDTH)
    np.testing.assert_array_equal(y, x * np.float32(2))


def test_launches_at_other_values_reuse_the_program_and_leave_nothing_of_each_other(core):
    program = core.load(rows_program())
    outs = {}
    for n in (300, 5, 300):
        x = np.full((n, WIDTH), n, np.float32)
        outs.setdefault(n, []).append(program.at(registers_for_rows(n, BLOCKS)).run([x]).outputs[0])
    assert all(np.array_equal(y, np.full((n, WIDTH), 2 * n, np.float32)) for n, ys in outs.items() for y in ys)


def test_the_timeline_prices_each_iteration_and_its_branch(core):
    program = core.load(rows_program())
    target = core.target
    branch = target.loop_iteration_cycles / target.vector_ghz
    one = program.at((1, 0, 0)).time().estimated_ns
    three = program.at((3, 0, 0)).time().estimated_ns
    none = program.at((0, 0, 0)).time()

    assert none.estimated_ns == 0.0 and none.events == []
    assert three == pytest.approx(3 * one)
    assert one > branch and len(program.at((3, 0, 0)).time().events) == 9
    assert program.at((0, 1, 0)).time().estimated_ns < one  # a 16-row tile moves less


def test_a_register_value_outside_its_range_is_refused(core):
    program = core.load(rows_program(max_tiles=2))
    with pytest.raises(InputMismatchError, match=r"register 'tiles'.*\[0, 2\], got 3"):
        program.at((3, 0, 0))
    with pytest.raises(InputMismatchError, match="3 registers"):
        program.at((1, 0))


def test_a_loop_reading_past_the_rows_a_launch_passes_is_refused(core):
    # the 1-row tiles read one row further than they should: inside the tensor, past the rows a launch passes
    program = rows_program(read_terms=lambda level, terms: terms + ((2, ROW),) if level == 2 else terms, spare=16)
    with pytest.raises(NeuronRuntimeError, match="reads input 'x' past the rows"):
        core.load(program)


def test_a_loop_leaving_output_rows_unwritten_is_refused(core):
    # the 16-row tiles skip the rows of the 128-row ones: they overwrite the first rows, the later stay unwritten
    program = rows_program(write_terms=lambda level, terms: terms[1:] if level == 1 else terms)
    with pytest.raises(NeuronRuntimeError, match="may leave bytes of output 'y' unwritten at register values"):
        core.load(program)


def test_an_access_out_of_its_tensor_at_the_ranges_extreme_is_refused(core):
    program = rows_program()
    program.registers[0] = Register("tiles", 0, 5)  # the tensors hold 4 tiles and a remainder
    program.tensors = [dataclasses.replace(t, rows=()) for t in program.tensors]
    with pytest.raises(NeuronRuntimeError, match="register values' extreme"):
        core.load(program)


def test_a_body_that_races_with_itself_is_refused_for_every_value(core):
    program = rows_program()
    store = program.loops[0].streams[(Engine.DMA, 1)][0]
    store.waits = ()  # the store no longer waits for the multiply it copies out
    with pytest.raises(NeuronRuntimeError, match="race|unwritten|nothing wrote|wait"):
        core.load(program)


def test_a_written_tensor_addressed_with_two_sets_of_terms_in_one_body_is_refused(core):
    program = rows_program()
    body = program.loops[0].streams
    dst = body[(Engine.DMA, 1)][0].operands[0]
    other = dataclasses.replace(dst, terms=((0, ROW),), dims=((WIDTH, 1), (1, WIDTH)))  # row T of y
    body[(Engine.DMA, 2)] = [Instruction(Opcode.DMA_COPY, Engine.DMA, (other, chip(1, 1024)), queue=2,
                                         waits=(Wait(Engine.VECTOR, 0, 1),))]
    with pytest.raises(NeuronRuntimeError, match="different register terms"):
        core.load(program)


@pytest.mark.parametrize("change, problem", [
    (lambda p: p.registers.__setitem__(0, Register("tiles", 3, 2)), r"range \[3, 2\]"),
    (lambda p: p.registers.__setitem__(0, Register("tiles", 0, 1 << 31)), "range"),
    (lambda p: setattr(p.loops[0], "register", 7), "counts with register 7"),
    (lambda p: setattr(p.loops[0], "streams", {}), "no instructions"),
    (lambda p: p.streams.setdefault((Engine.VECTOR, 0), []).append(
        Instruction(Opcode.MEMSET, Engine.VECTOR, (chip(1),))), "outside them"),
    (lambda p: setattr(p.loops[1].streams[(Engine.VECTOR, 0)][0], "waits", (Wait(Engine.DMA, 0, 2),)),
     "waits for 2 instructions"),
    (lambda p: setattr(p.loops[1].streams[(Engine.VECTOR, 0)][0], "waits", (Wait(Engine.DMA, 5, 1),)),
     "a body waits only on itself"),
    (lambda p: setattr(p.loops[0].streams[(Engine.DMA, 0)][0], "operands",
                       (dataclasses.replace(chip(128), terms=((0, 4),)), p.loops[0].streams[(Engine.DMA, 0)][0].operands[1])),
     "only HBM offsets take registers"),
    (lambda p: setattr(p.loops[0].streams[(Engine.DMA, 0)][0], "operands",
                       (chip(128), dataclasses.replace(p.loops[0].streams[(Engine.DMA, 0)][0].operands[1],
                                                       terms=((9, 4),)))), "reads register 9"),
    (lambda p: p.tensors.__setitem__(0, dataclasses.replace(p.tensors[0], rows=((0, 1000),))), "row term"),
    (lambda p: p.tensors.__setitem__(0, dataclasses.replace(p.tensors[0], rows=((0, 256),))), "up to 1024 rows"),
])
def test_a_malformed_register_or_loop_is_refused_by_the_verifier(change, problem):
    from neuronc.neff.verifier import check_references

    program = rows_program()
    change(program)
    with pytest.raises(NeffFormatError, match=problem):
        check_references(program)


def test_a_looped_program_round_trips_through_a_neff_file_and_runs_the_same(core, tmp_path):
    from neuronc.neff import load, save

    program = rows_program()
    save(program, tmp_path / "rows.neff")
    again = load(tmp_path / "rows.neff")
    x = np.random.default_rng(1).standard_normal((200, WIDTH)).astype(np.float32)

    assert again.registers == program.registers and again.tensors[0].rows == program.tensors[0].rows
    assert [loop.streams for loop in again.loops] == [loop.streams for loop in program.loops]
    (y,) = core.load(again).at(registers_for_rows(200, BLOCKS)).run([x]).outputs
    np.testing.assert_array_equal(y, x * np.float32(2))


def test_a_neff_file_with_a_hostile_loop_is_refused_when_read(tmp_path):
    from neuronc.neff import decode, encode

    program = rows_program()
    program.loops[0].register = 2  # valid: encodes
    data = bytearray(encode(program))
    program.loops[0].register = 9  # refused by encode's own check
    with pytest.raises(NeffFormatError, match="counts with register 9"):
        encode(program)
    # the same change made in the file: the reader's verifier refuses it
    bad = rows_program()
    bad.loops[0].register = 9
    with pytest.raises(NeffFormatError, match="counts with register 9"):
        decode(_with_check_skipped(bad))
    assert decode(bytes(data)).loops[0].register == 2


def _with_check_skipped(neff) -> bytes:
    """``neff`` encoded without the writer's own checks: what a hostile or damaged file may hold."""
    from unittest import mock

    from neuronc.neff import writer

    with mock.patch.object(writer, "check_references", lambda neff: None):
        return writer.encode(neff)
