"""The emulated NeuronCore runs hand-built NEFFs with the ISA's semantics (its fast kernels bit for bit),
enforces the hardware's rules, orders streams by their semaphores only, refuses reads of memory nothing
wrote and races, accounts its HBM, and reports a timeline (also without running)."""
from __future__ import annotations

import dataclasses
import gc
import math
import re

import ml_dtypes
import numpy as np
import pytest
import scipy.special

from neuronc.errors import DeviceOutOfMemoryError, InputMismatchError, NeuronRuntimeError
from neuronc.instruction_cost import activation_table, instruction_cost_ns
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, Wait, row_major_dims
from neuronc.neff.program import DebugLoc, Neff, TensorEntry, TensorKind
from neuronc.passes.cost_model import estimate_streams
from neuronc.targets import get_target
from runtime import NeuronCore, run_neff
from runtime.core import access_check_id
from runtime.memory import view
from runtime.semantics import SEMANTICS, kernel

TRN2 = get_target("trn2")
RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------
# Building tiny programs by hand


def hbm(t: TensorEntry) -> AccessPattern:
    """The whole of HBM tensor ``t``, row-major."""
    return AccessPattern(Space.HBM, t.dtype, t.offset, row_major_dims(t.shape))


def chip(shape: tuple, dtype=DType.F32, *, space=Space.SBUF, partition=0, offset=0) -> AccessPattern:
    """A contiguous on-chip tile: ``shape[0]`` partitions from ``partition``, the rest row-major."""
    return AccessPattern(space, dtype, offset, ((1, shape[0]),) + row_major_dims(shape[1:]), partition)


class Program:
    """A Neff under construction: tensors packed back to back in HBM, instructions appended per stream."""

    def __init__(self):
        self.tensors, self.streams, self.debug_locs = [], {}, []

    def tensor(self, name, kind, shape, dtype=DType.F32, data=None) -> TensorEntry:
        offset = sum(t.nbytes for t in self.tensors)
        index = sum(t.kind == kind for t in self.tensors) if kind in (TensorKind.INPUT, TensorKind.OUTPUT) else -1
        t = TensorEntry(name, kind, dtype, tuple(shape), offset, index, data)
        self.tensors.append(t)
        return t

    def emit(self, opcode, engine, *operands, queue=0, **fields) -> Instruction:
        instr = Instruction(opcode, engine, operands, queue=queue, **fields)
        self.streams.setdefault((engine, queue), []).append(instr)
        return instr

    def neff(self, name="test") -> Neff:
        size = sum(t.nbytes for t in self.tensors)
        return Neff(name, "trn2", self.tensors, self.streams, size, debug_locs=self.debug_locs)


def done(engine, count=1, queue=0):
    return (Wait(engine, queue, count),)


@pytest.fixture(scope="module")
def core():
    return NeuronCore("trn2")


def compute_on_chip(core, opcode, engine, arrays, out_shape=None, out_dtype=None, **fields) -> np.ndarray:
    """Run one compute instruction: DMA ``arrays`` HBM->SBUF, compute into SBUF, DMA the result back."""
    p = Program()
    out_shape = arrays[0].shape if out_shape is None else out_shape
    out_dtype = DType.from_numpy(arrays[0].dtype) if out_dtype is None else out_dtype
    srcs, offset = [], 0
    for i, a in enumerate(arrays):
        t = p.tensor(f"x{i}", TensorKind.INPUT, a.shape, DType.from_numpy(a.dtype))
        srcs.append(chip(a.shape, t.dtype, offset=offset))
        offset += a[0].nbytes
        p.emit(Opcode.DMA_COPY, Engine.DMA, srcs[-1], hbm(t))
    out = p.tensor("out", TensorKind.OUTPUT, out_shape, out_dtype)
    dst = chip(out_shape, out_dtype, offset=offset)
    p.emit(opcode, engine, dst, *srcs, waits=done(Engine.DMA, len(arrays)), **fields)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out), dst, queue=1, waits=done(engine))
    return core.load(p.neff()).run(list(arrays)).outputs[0]


def uniform(low, high, shape=(4, 8)) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Data movement and matmul


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.I8])
def test_dma_round_trip_hbm_to_sbuf_to_hbm_returns_the_input(core, dtype):
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (128, 64), dtype)
    y_t = p.tensor("y", TensorKind.OUTPUT, (128, 64), dtype)
    tile = chip((128, 64), dtype, offset=1024)
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), tile, queue=3, waits=done(Engine.DMA))
    x = (RNG.standard_normal((128, 64)) * 50).astype(dtype.numpy)

    (y,) = core.load(p.neff()).run([x]).outputs

    np.testing.assert_array_equal(y, x)



def test_an_on_chip_view_is_the_bytes_of_its_partitions_rows(core):
    """The SBUF's rows lie apart by more than their bytes (runtime.memory.OnChip): a view of a tile at partition 3,
    byte 64, writes those bytes of rows 3..6 (the rows' base found once per Memory, not per view)."""
    from runtime.memory import Memory

    memory = Memory(np.zeros(64, np.uint8), core.sbuf, core.psum)
    tile = np.arange(32, dtype=np.float32).reshape(4, 8)
    memory.view(chip((4, 8), partition=3, offset=64))[...] = tile
    assert np.array_equal(core.sbuf[3:7, 64:96].view(np.float32), tile)

def _add_program():
    """y = x + w, x and w inputs of [128, 64] fp32."""
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (128, 64))
    w_t = p.tensor("w", TensorKind.INPUT, (128, 64))
    y_t = p.tensor("y", TensorKind.OUTPUT, (128, 64))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((128, 64)), hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((128, 64), offset=1024), hbm(w_t), queue=1)
    p.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, chip((128, 64), offset=2048), chip((128, 64)),
           chip((128, 64), offset=1024), alu=AluOp.ADD, waits=(Wait(Engine.DMA, 0, 1), Wait(Engine.DMA, 1, 1)))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((128, 64), offset=2048), queue=2, waits=done(Engine.VECTOR))
    return p


def test_a_bound_input_is_read_in_place_from_the_hosts_array_at_every_run(core):
    program = core.load(_add_program().neff())
    x, w = uniform(-1, 1, (128, 64)), uniform(-1, 1, (128, 64))
    program.bind_inputs({1: w})

    (first,) = program.run([x, None]).outputs
    expected_first = x + w
    w += 1  # changed in place by the host between runs, never given again
    (second,) = program.run([x, None]).outputs

    np.testing.assert_array_equal(first, expected_first)
    np.testing.assert_array_equal(second, x + w)


def test_binding_another_array_or_none_rebinds_the_program(core):
    program = core.load(_add_program().neff())
    x, w, other = (uniform(-1, 1, (128, 64)) for _ in range(3))
    program.bind_inputs({1: w})
    program.run([x, None])

    program.bind_inputs({1: other})
    (with_other,) = program.run([x, None]).outputs
    program.bind_inputs({})
    (copied,) = program.run([x, w]).outputs

    np.testing.assert_array_equal(with_other, x + other)
    np.testing.assert_array_equal(copied, x + w)


def test_run_into_binds_the_arrays_it_is_given_before_it_runs(core):
    """A host that queues runs gives each its own bound arrays: a run reads what it was queued with, though the
    host bound others for a later run meanwhile (the `neuron` device's compiled graphs)."""
    program = core.load(_add_program().neff())
    x, w, other = (uniform(-1, 1, (128, 64)) for _ in range(3))
    first, second = np.empty((128, 64), np.float32), np.empty((128, 64), np.float32)

    program.run_into([x, None], [first], bound={1: w})
    program.run_into([x, None], [second], bound={1: other})

    np.testing.assert_array_equal(first, x + w)
    np.testing.assert_array_equal(second, x + other)


def test_run_into_copies_the_inputs_not_bound_and_reads_the_bound_in_place(core):
    """After a binding, run_into copies only the other inputs: the bound array is read as it is when the program
    runs, the copied one as it was given; binding none copies both again."""
    program = core.load(_add_program().neff())
    x, w = uniform(-1, 1, (128, 64)), uniform(-1, 1, (128, 64))
    out = np.empty((128, 64), np.float32)
    program.run_into([x, None], [out], bound={1: w})
    np.testing.assert_array_equal(out, x + w)
    w += 1.0  # the bound array changed in place: read as it is now
    program.run_into([x, None], [out], bound={1: w})
    np.testing.assert_array_equal(out, x + w)
    program.run_into([x, w * 2], [out], bound={})
    np.testing.assert_array_equal(out, x + w * 2)


def test_binding_the_bound_arrays_again_keeps_the_programs_calls(core):
    program = core.load(_add_program().neff())
    x, w = uniform(-1, 1, (128, 64)), uniform(-1, 1, (128, 64))
    program.bind_inputs({1: w})
    program.run([x, None])
    calls = program._plan

    program.bind_inputs({1: w})

    assert program._plan is calls  # not rebuilt: a host may bind before every run


def test_a_bound_input_must_be_contiguous_and_of_its_inputs_shape_and_dtype(core):
    program = core.load(_add_program().neff())
    with pytest.raises(InputMismatchError, match="C-contiguous"):
        program.bind_inputs({1: uniform(-1, 1, (64, 128)).T})
    with pytest.raises(InputMismatchError, match=r"float32\[128, 64\]"):
        program.bind_inputs({1: uniform(-1, 1, (128, 64)).astype(np.float64)})


def test_matmul_over_k_256_as_two_accumulating_matmuls_equals_numpy_fp32(core):
    k, m, n = 256, 64, 128
    p = Program()
    a_t = p.tensor("a", TensorKind.INPUT, (k, m))  # stationary, K x M
    b_t = p.tensor("b", TensorKind.INPUT, (k, n))  # moving, K x N
    c_t = p.tensor("c", TensorKind.OUTPUT, (m, n))
    half = k // 2
    for tile in range(2):  # K tile i of a at SBUF bytes [i*M*4, ...), of b after both tiles of a
        a_tile = AccessPattern(Space.HBM, DType.F32, a_t.offset + tile * half * m * 4, ((m, half), (1, m)))
        b_tile = AccessPattern(Space.HBM, DType.F32, b_t.offset + tile * half * n * 4, ((n, half), (1, n)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((half, m), offset=tile * m * 4), a_tile)
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((half, n), offset=2 * m * 4 + tile * n * 4), b_tile, queue=1)
    acc = chip((m, n), space=Space.PSUM)
    for tile in range(2):
        p.emit(Opcode.MATMUL, Engine.TENSOR, acc, chip((half, m), offset=tile * m * 4),
               chip((half, n), offset=2 * m * 4 + tile * n * 4), accumulate=tile == 1,
               waits=(Wait(Engine.DMA, 0, tile + 1), Wait(Engine.DMA, 1, tile + 1)))
    out_tile = chip((m, n), offset=64 * 1024)
    p.emit(Opcode.TENSOR_COPY, Engine.VECTOR, out_tile, acc, waits=done(Engine.TENSOR, 2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(c_t), out_tile, queue=2, waits=done(Engine.VECTOR))
    a, b = uniform(-1, 1, (k, m)), uniform(-1, 1, (k, n))

    (c,) = core.load(p.neff()).run([a, b]).outputs

    np.testing.assert_allclose(c, a.T @ b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Hardware rules


def _matmul_program(k=128, m=64, n=128, dst_space=Space.PSUM) -> Program:
    p = Program()
    p.debug_locs.append(DebugLoc("model.py", 12, "blocks.0.mlp", "aten.mm"))
    p.emit(Opcode.MATMUL, Engine.TENSOR, chip((m, n), space=dst_space), chip((k, m)), chip((k, n), offset=4096),
           debug=0)
    return p


@pytest.mark.parametrize(
    "program, problem",
    [
        (_matmul_program(k=129), "K=129"),
        (_matmul_program(n=513), "N=513"),
        (_matmul_program(dst_space=Space.SBUF), "must be in PSUM"),
    ],
    ids=["K=129", "N=513", "dst-in-SBUF"],
)
def test_matmul_tile_rule_violations_name_the_instruction_and_its_source(core, program, problem):
    with pytest.raises(NeuronRuntimeError, match=problem) as err:
        core.load(program.neff())
    assert "MATMUL #0 on TENSOR" in str(err.value)
    assert "model.py:12 in blocks.0.mlp (aten.mm)" in str(err.value)


def test_a_matmul_reads_its_moving_operand_through_two_free_dims_and_counts_n_over_both(core):
    """Every other row of a [K, 2 x lines, width] tile as the moving operand, [K, lines x width] columns (a
    convolution's row pairs): the product equals numpy's on those columns; N counts both free dims."""
    k, m, lines, width = 64, 32, 3, 40
    p = Program()
    a_t = p.tensor("a", TensorKind.INPUT, (k, m))
    b_t = p.tensor("b", TensorKind.INPUT, (k, 2 * lines * width))
    c_t = p.tensor("c", TensorKind.OUTPUT, (m, lines * width))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((k, m)), hbm(a_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((k, 2 * lines * width), offset=4096), hbm(b_t), queue=1)
    moving = AccessPattern(Space.SBUF, DType.F32, 4096, ((1, k), (2 * width, lines), (1, width)))
    acc = chip((m, lines * width), space=Space.PSUM)
    p.emit(Opcode.MATMUL, Engine.TENSOR, acc, chip((k, m)), moving,
           waits=(Wait(Engine.DMA, 0, 1), Wait(Engine.DMA, 1, 1)))
    p.emit(Opcode.TENSOR_COPY, Engine.VECTOR, chip((m, lines * width), offset=64 * 1024), acc,
           waits=done(Engine.TENSOR))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(c_t), chip((m, lines * width), offset=64 * 1024), queue=2,
           waits=done(Engine.VECTOR))
    a, b = uniform(-1, 1, (k, m)), uniform(-1, 1, (k, 2 * lines * width))

    (c,) = core.load(p.neff()).run([a, b]).outputs

    columns = b.reshape(k, lines, 2, width)[:, :, 0, :].reshape(k, lines * width)
    np.testing.assert_allclose(c, a.T @ columns, rtol=1e-5, atol=1e-5)
    too_wide = Program()  # 2 x 300 columns: N = 600 > 512
    too_wide.emit(Opcode.MATMUL, Engine.TENSOR, chip((m, 600), space=Space.PSUM), chip((k, m)),
                  AccessPattern(Space.SBUF, DType.F32, 4096, ((1, k), (600, 2), (1, 300))))
    with pytest.raises(NeuronRuntimeError, match="N=600"):
        core.load(too_wide.neff())
    stationary_3d = Program()
    stationary_3d.emit(Opcode.MATMUL, Engine.TENSOR, chip((m, 64), space=Space.PSUM),
                       AccessPattern(Space.SBUF, DType.F32, 0, ((1, k), (64, 2), (1, m // 2))), chip((k, 64), offset=8192))
    with pytest.raises(NeuronRuntimeError, match="stationary operand must be 2-D"):
        core.load(stationary_3d.neff())


def test_more_than_128_partitions_is_refused(core):
    p = Program()
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((129, 4)))
    with pytest.raises(NeuronRuntimeError, match="MEMSET #0 on VECTOR.*129 partitions"):
        core.load(p.neff())


@pytest.mark.parametrize(
    "operand, problem",
    [
        (chip((2, 4), offset=TRN2.sbuf_bytes_per_partition - 8), "outside"),
        (chip((2, 4), partition=127), r"partitions \[127, 129\)"),
        (AccessPattern(Space.SBUF, DType.F32, 0, ((2, 2), (1, 4))), "partition stride 2"),
    ],
    ids=["past-partition-end", "past-last-partition", "partition-stride"],
)
def test_out_of_bounds_access_pattern_is_refused(core, operand, problem):
    p = Program()
    p.emit(Opcode.MEMSET, Engine.GPSIMD, operand)
    with pytest.raises(NeuronRuntimeError, match=f"MEMSET #0 on GPSIMD.*{problem}"):
        core.load(p.neff())


def test_dma_past_the_end_of_hbm_is_refused(core):
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (4, 8))
    beyond = AccessPattern(Space.HBM, DType.F32, x_t.offset + 4, row_major_dims((4, 8)))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 8)), beyond, queue=5)
    with pytest.raises(NeuronRuntimeError, match="DMA_COPY #0 on DMA queue 5.*outside the program's 128 bytes"):
        core.load(p.neff())


def test_sources_must_have_the_destination_shape(core):
    p = Program()
    p.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, chip((4, 8)), chip((4, 8)), chip((4, 4)), alu=AluOp.ADD)
    with pytest.raises(NeuronRuntimeError, match=r"TENSOR_TENSOR #0 on VECTOR.*operand 2 has shape \(4, 4\)"):
        core.load(p.neff())


def test_program_needing_more_hbm_than_the_target_has_is_refused_naming_its_largest_tensor(core):
    p = Program()
    p.tensor("embedding", TensorKind.SCRATCH, (TRN2.hbm_bytes // 4 + 1,))
    with pytest.raises(DeviceOutOfMemoryError, match=f"needs {TRN2.hbm_bytes + 4} bytes.*embedding"):
        core.load(p.neff())


TINY_HBM = dataclasses.replace(TRN2, name="tiny", hbm_bytes=1000)


def _sized_program(name: str, nbytes: int) -> Neff:
    p = Program()
    p.tensor(f"{name}_activations", TensorKind.SCRATCH, (nbytes // 4,))
    return p.neff(name)


def test_programs_share_their_cores_hbm_and_one_that_does_not_fit_is_refused_saying_what_holds_it():
    core = NeuronCore(TINY_HBM)
    loaded = [core.load(_sized_program("a", 400)), core.load(_sized_program("b", 400))]  # held: dropping frees
    assert core.memory_allocated() == 800 and all(p.loaded for p in loaded)

    with pytest.raises(DeviceOutOfMemoryError) as err:
        core.load(_sized_program("c", 400))

    message = str(err.value)
    for expected in ("program 'c' needs 400 bytes of HBM", "the tiny NeuronCore has 1000 bytes, 200 bytes free",
                     "in use by 'a' (400 bytes), 'b' (400 bytes)", "largest tensors of 'c': c_activations (scratch",
                     "hint: unload programs you no longer need",
                     "use a target with more HBM per NeuronCore (trn2 has 12.0 GiB, ",
                     "use a smaller batch"):
        assert expected in message, message
    assert core.memory_allocated() == 800


def test_unloading_or_dropping_a_program_frees_its_hbm():
    core = NeuronCore(TINY_HBM)
    a, b = core.load(_sized_program("a", 400)), core.load(_sized_program("b", 400))
    b.unload()
    assert core.memory_allocated() == 400 and core.max_memory_allocated() == 800
    c = core.load(_sized_program("c", 600))
    assert core.memory_allocated() == 1000 and core.max_memory_allocated() == 1000
    core.unload(c)
    del a
    gc.collect()
    assert core.memory_allocated() == 0 and core.max_memory_allocated() == 1000
    with pytest.raises(NeuronRuntimeError, match="program 'b' was unloaded"):
        b.run([])
    with pytest.raises(NeuronRuntimeError, match="program 'b' was unloaded"):
        b.run_into([], [])
    core.load(_sized_program("d", 1000))


# ---------------------------------------------------------------------------------------------
# Inputs


def _parallel_loads(queues: int) -> Neff:
    """`queues` DMA queues each loading 512 KiB (4 KiB per partition) from HBM into SBUF at the same time."""
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (queues * 128, 1024))
    for q in range(queues):
        rows = AccessPattern(Space.HBM, DType.F32, x.offset + q * 128 * 1024 * 4, ((1024, 128), (1, 1024)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((128, 1024), offset=q * 4096), rows, queue=q)
    return p.neff()


def test_dma_queues_together_move_no_more_than_the_cores_hbm_bandwidth(core):
    target = core.target
    nbytes = 128 * 1024 * 4
    one = core.load(_parallel_loads(1)).time().estimated_ns
    assert one == pytest.approx(target.dma_fixed_ns + nbytes / target.dma_gbps_per_queue)  # a queue's own rate
    every = core.load(_parallel_loads(target.dma_queues))
    assert target.dma_queues * target.dma_gbps_per_queue > target.hbm_sustained_gbps  # so the queues contend
    assert every.time().estimated_ns == pytest.approx(
        target.dma_fixed_ns + target.dma_queues * nbytes / target.hbm_sustained_gbps)
    neff = _parallel_loads(target.dma_queues)
    assert estimate_streams(neff.streams, target)[0] == every.time().estimated_ns  # the cost model agrees


def _copy_program() -> Neff:
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(p.tensor("y", TensorKind.OUTPUT, (4, 8))), hbm(x_t))
    return p.neff()


@pytest.mark.parametrize(
    "inputs, problem",
    [
        ([np.zeros((4, 9), np.float32)], r"input 0 \('x'\) must be float32\[4, 8\], got float32\[4, 9\]"),
        ([np.zeros((4, 8), np.float64)], r"input 0 \('x'\) must be float32\[4, 8\], got float64"),
        ([], "takes 1 inputs"),
    ],
    ids=["shape", "dtype", "count"],
)
def test_inputs_not_matching_the_tensor_table_are_refused(core, inputs, problem):
    with pytest.raises(InputMismatchError, match=problem):
        core.load(_copy_program()).run(inputs)


def test_weights_are_laid_out_in_hbm_at_load_and_hbm_to_hbm_dma_works():
    p = Program()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    w_t = p.tensor("w", TensorKind.WEIGHT, (2, 3), data=w)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(p.tensor("y", TensorKind.OUTPUT, (2, 3))), hbm(w_t))
    np.testing.assert_array_equal(run_neff(p.neff(), []).outputs[0], w)


# ---------------------------------------------------------------------------------------------
# Compute semantics against numpy / scipy


def _gelu(x):
    return 0.5 * x * (1 + scipy.special.erf(x / math.sqrt(2)))


ACT_REFERENCE = {
    ActFunc.NONE: lambda x: x,
    ActFunc.IDENTITY: lambda x: x,
    ActFunc.EXP: np.exp,
    ActFunc.LOG: np.log,
    ActFunc.TANH: np.tanh,
    ActFunc.SQRT: np.sqrt,
    ActFunc.RSQRT: lambda x: 1 / np.sqrt(x),
    ActFunc.RELU: lambda x: np.maximum(x, 0),
    ActFunc.SIGMOID: lambda x: 1 / (1 + np.exp(-x)),
    ActFunc.ERF: scipy.special.erf,
    ActFunc.GELU: _gelu,
    ActFunc.ABS: np.abs,
    ActFunc.NEG: np.negative,
    ActFunc.SQUARE: np.square,
    ActFunc.SIN: np.sin,
    ActFunc.COS: np.cos,
    ActFunc.SIGN: np.sign,
    ActFunc.RECIPROCAL: lambda x: 1 / x,
    ActFunc.FLOOR: np.floor,
    ActFunc.CEIL: np.ceil,
    ActFunc.NOT: lambda x: (x == 0).astype(x.dtype),
    ActFunc.LOG1P: np.log1p,
    ActFunc.EXPM1: np.expm1,
    ActFunc.ROUND: np.round,
}
POSITIVE_ONLY = {ActFunc.LOG, ActFunc.SQRT, ActFunc.RSQRT}


@pytest.mark.parametrize("func", list(ActFunc), ids=lambda f: f.name)
def test_activate_computes_func_of_scaled_biased_input_like_numpy(core, func):
    x = uniform(0.1, 3) if func in POSITIVE_ONLY else uniform(-3, 3)
    scale, bias = 0.5, 0.25
    if func not in POSITIVE_ONLY:
        x[0, :2] = -bias / scale  # NOT and SIGN see zeros
    got = compute_on_chip(core, Opcode.ACTIVATE, Engine.SCALAR, [x], func=func, imm0=scale, imm1=bias)
    with np.errstate(all="ignore"):
        expected = ACT_REFERENCE[func]((x * np.float32(scale) + np.float32(bias)).astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


ALU_REFERENCE = {
    AluOp.NONE: lambda a, b: a,
    AluOp.ADD: np.add,
    AluOp.SUBTRACT: np.subtract,
    AluOp.MULTIPLY: np.multiply,
    AluOp.DIVIDE: np.divide,
    AluOp.MAX: np.maximum,
    AluOp.MIN: np.minimum,
    AluOp.POW: np.power,
    AluOp.EQ: np.equal,
    AluOp.NE: np.not_equal,
    AluOp.LT: np.less,
    AluOp.LE: np.less_equal,
    AluOp.GT: np.greater,
    AluOp.GE: np.greater_equal,
    AluOp.AND: np.logical_and,
    AluOp.OR: np.logical_or,
    AluOp.XOR: np.logical_xor,
    AluOp.REMAINDER: np.fmod,
    AluOp.ATAN2: np.arctan2,
}


SHIFTS = (AluOp.SHIFT_LEFT, AluOp.SHIFT_RIGHT_LOGICAL, AluOp.SHIFT_RIGHT_ARITHMETIC)  # integers only


@pytest.mark.parametrize("alu", [op for op in AluOp if op not in SHIFTS], ids=lambda op: op.name)
def test_tensor_tensor_computes_every_alu_op_in_fp32_like_numpy(core, alu):
    a, b = uniform(-2, 2), uniform(-2, 2)
    a[0, :3], b[0, 2:5], b[1] = 0, 0, a[1]  # zeros for the logical ops, equal rows for the comparisons
    got = compute_on_chip(core, Opcode.TENSOR_TENSOR, Engine.VECTOR, [a, b], alu=alu)
    with np.errstate(all="ignore"):
        expected = ALU_REFERENCE[alu](a, b).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "alu, expected",
    [
        (AluOp.DIVIDE, lambda a, b: (np.trunc(a / b)).astype(np.int32)),  # C / StableHLO: toward zero
        (AluOp.REMAINDER, np.fmod),  # the dividend's sign
        (AluOp.AND, np.bitwise_and),
        (AluOp.LT, lambda a, b: (a < b).astype(np.int32)),
        # amounts outside [0, 32) (negative ones here): 0 for the logical shifts, the sign for the arithmetic one
        (AluOp.SHIFT_LEFT, lambda a, b: np.where(b >= 0, a.astype(np.int64) << np.abs(b) & 0xFFFFFFFF, 0)
         .astype(np.uint32).view(np.int32)),
        (AluOp.SHIFT_RIGHT_LOGICAL, lambda a, b: np.where(b >= 0, a.view(np.uint32) >> np.abs(b), 0)
         .astype(np.uint32).view(np.int32)),
        (AluOp.SHIFT_RIGHT_ARITHMETIC, lambda a, b: np.where(b >= 0, a >> np.abs(b), np.where(a < 0, -1, 0))
         .astype(np.int32)),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_tensor_tensor_on_integers_computes_in_their_own_type(core, alu, expected):
    a = RNG.integers(-100, 100, (4, 8), dtype=np.int32)
    b = RNG.integers(1, 9, (4, 8), dtype=np.int32) * np.where(RNG.random((4, 8)) < 0.5, -1, 1).astype(np.int32)
    got = compute_on_chip(core, Opcode.TENSOR_TENSOR, Engine.GPSIMD, [a, b], alu=alu)
    np.testing.assert_array_equal(got, expected(a, b))


def test_operation_numpy_refuses_at_run_time_is_reported_with_the_instruction(core):
    a, b = np.full((2, 4), 2, np.int32), np.full((2, 4), -1, np.int32)
    with pytest.raises(NeuronRuntimeError, match="TENSOR_TENSOR #0 on VECTOR.*failed: Integers to negative"):
        compute_on_chip(core, Opcode.TENSOR_TENSOR, Engine.VECTOR, [a, b], alu=AluOp.POW)


@pytest.mark.parametrize("reverse", [False, True])
def test_tensor_scalar_applies_the_immediate_on_the_side_reverse_says(core, reverse):
    x = uniform(-2, 2)
    got = compute_on_chip(core, Opcode.TENSOR_SCALAR, Engine.VECTOR, [x], alu=AluOp.SUBTRACT, imm0=3.0,
                          reverse=reverse)
    np.testing.assert_allclose(got, 3.0 - x if reverse else x - 3.0)


@pytest.mark.parametrize("alu", [AluOp.ADD, AluOp.MAX, AluOp.MIN], ids=lambda op: op.name)
def test_tensor_reduce_reduces_the_last_dim_accumulating_bf16_in_fp32(core, alu):
    x = uniform(-1, 1, (8, 512)).astype(ml_dtypes.bfloat16)
    got = compute_on_chip(core, Opcode.TENSOR_REDUCE, Engine.VECTOR, [x], out_shape=(8, 1), out_dtype=DType.F32,
                          alu=alu)
    reduce = {AluOp.ADD: np.sum, AluOp.MAX: np.max, AluOp.MIN: np.min}[alu]
    np.testing.assert_allclose(got, reduce(x.astype(np.float64), axis=-1, keepdims=True), rtol=1e-5)


def _activate_bias_reduce_program(dst_dtype: DType, row_sum_waits: bool = True) -> Neff:
    """x [4, 8] and bias [4, 1] loaded; ACTIVATE_BIAS_REDUCE(exp) on Scalar; y and its row sum stored from
    two queues, the row sum's store waiting for the Scalar engine (or not)."""
    p = Program()
    x_t, b_t = p.tensor("x", TensorKind.INPUT, (4, 8)), p.tensor("bias", TensorKind.INPUT, (4, 1))
    y_t, s_t = p.tensor("y", TensorKind.OUTPUT, (4, 8), dst_dtype), p.tensor("row_sum", TensorKind.OUTPUT, (4, 1))
    x, bias, y, row_sum = chip((4, 8)), chip((4, 1), offset=64), chip((4, 8), dst_dtype, offset=128), chip((4, 1), offset=192)
    p.emit(Opcode.DMA_COPY, Engine.DMA, x, hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, bias, hbm(b_t))
    p.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, y, row_sum, x, bias, func=ActFunc.EXP, imm0=0.5,
           waits=done(Engine.DMA, 2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), y, queue=1, waits=done(Engine.SCALAR))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(s_t), row_sum, queue=2, waits=done(Engine.SCALAR) if row_sum_waits else ())
    return p.neff()


@pytest.mark.parametrize("dst_dtype", [DType.F32, DType.BF16], ids=lambda d: d.name)
def test_activate_bias_reduce_adds_a_bias_per_partition_and_sums_each_row_before_rounding(core, dst_dtype):
    x, bias = uniform(-3, 3), uniform(-2, 2, (4, 1))
    y, row_sum = core.load(_activate_bias_reduce_program(dst_dtype)).run([x, bias]).outputs

    value = np.exp(x * np.float32(0.5) + bias)  # fp32 throughout, as ACTIVATE
    np.testing.assert_array_equal(y, value.astype(dst_dtype.numpy))
    np.testing.assert_array_equal(row_sum, np.add.reduce(value, axis=-1, keepdims=True, dtype=np.float32))
    np.testing.assert_allclose(row_sum, np.exp(x.astype(np.float64) * 0.5 + bias).sum(-1, keepdims=True), rtol=1e-6)


def test_a_store_of_the_row_sum_not_waiting_for_it_is_refused_as_reading_unwritten_memory(core):
    with pytest.raises(NeuronRuntimeError) as err:
        core.load(_activate_bias_reduce_program(DType.F32, row_sum_waits=False))
    message = str(err.value)
    assert "DMA_COPY #0 on DMA queue 2" in message and "ACTIVATE_BIAS_REDUCE #0 on SCALAR writes it" in message


@pytest.mark.parametrize("operand, shape, problem", [
    (3, (4, 8), "bias must be an F32 [4, 1] tile"), (1, (4, 2), "row sum must be an F32 [4, 1] tile"),
])
def test_activate_bias_reduce_refuses_bias_or_row_sum_not_one_value_per_partition(core, operand, shape, problem):
    operands = [chip((4, 8)), chip((4, 1), offset=64), chip((4, 8), offset=128), chip((4, 1), offset=192)]
    operands[operand] = chip(shape, offset=256)
    p = Program()
    p.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, *operands, func=ActFunc.EXP, imm0=1.0)
    with pytest.raises(NeuronRuntimeError, match=re.escape(problem)):
        core.load(p.neff())


def test_activate_bias_reduce_costs_one_pass_as_activate():
    tile, column = chip((128, 512)), chip((128, 1))
    fused = Instruction(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, (tile, column, tile, column), func=ActFunc.EXP)
    plain = Instruction(Opcode.ACTIVATE, Engine.SCALAR, (tile, tile), func=ActFunc.EXP)
    assert instruction_cost_ns(fused, TRN2) == instruction_cost_ns(plain, TRN2)


def _activate_scaled_program(dst_dtype: DType, src_dtype: DType = DType.F32) -> Neff:
    """x [4, 8], scale [4, 1] and bias [4, 1] loaded; ACTIVATE_SCALED(func) on Scalar; y stored."""
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (4, 8), src_dtype)
    m_t, b_t = p.tensor("scale", TensorKind.INPUT, (4, 1)), p.tensor("bias", TensorKind.INPUT, (4, 1))
    y_t = p.tensor("y", TensorKind.OUTPUT, (4, 8), dst_dtype)
    x, scale, bias = chip((4, 8), src_dtype), chip((4, 1), offset=64), chip((4, 1), offset=128)
    y = chip((4, 8), dst_dtype, offset=192)
    for n, (tile, tensor) in enumerate(((x, x_t), (scale, m_t), (bias, b_t))):
        p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(tensor), queue=n)
    p.emit(Opcode.ACTIVATE_SCALED, Engine.SCALAR, y, x, scale, bias, func=ActFunc.IDENTITY,
           waits=(*done(Engine.DMA, 1, 0), *done(Engine.DMA, 1, 1), *done(Engine.DMA, 1, 2)))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), y, waits=done(Engine.SCALAR))
    return p.neff()


@pytest.mark.parametrize("dst_dtype, src_dtype", [(DType.F32, DType.F32), (DType.BF16, DType.BF16),
                                                  (DType.BF16, DType.F32)], ids=lambda d: d.name)
def test_activate_scaled_scales_and_biases_each_partition_by_its_own_values_in_fp32(core, dst_dtype, src_dtype):
    """(x - mean) * rstd as NKI's layer-norm samples make it: activation(copy, x, scale=rstd, bias=-mean * rstd)."""
    x = uniform(-3, 3).astype(src_dtype.numpy)
    mean, rstd = uniform(-1, 1, (4, 1)), uniform(0.5, 4, (4, 1))
    bias = -mean * rstd
    (y,) = core.load(_activate_scaled_program(dst_dtype, src_dtype)).run([x, rstd, bias]).outputs

    f32 = np.float32
    product = (x.astype(np.float64) * rstd.astype(np.float64)).astype(f32)  # exact in fp64, rounded once to fp32
    value = (product.astype(np.float64) + bias.astype(np.float64)).astype(f32)  # likewise
    np.testing.assert_array_equal(y, value.astype(dst_dtype.numpy))
    np.testing.assert_allclose(y.astype(np.float64), (x.astype(np.float64) - mean) * rstd, rtol=2e-2 if dst_dtype ==
                               DType.BF16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("operand, shape, dtype, problem", [
    (2, (4, 8), DType.F32, "scale must be an F32 [4, 1] tile"), (3, (4, 2), DType.F32, "bias must be an F32 [4, 1] tile"),
    (2, (4, 1), DType.BF16, "scale must be an F32 [4, 1] tile"), (1, (4, 4), DType.F32, "same 2-D"),
])
def test_activate_scaled_refuses_scale_or_bias_not_one_fp32_value_per_partition_also_from_a_neff_files_bytes(
        core, operand, shape, dtype, problem):
    from neuronc.neff import decode, encode
    operands = [chip((4, 8)), chip((4, 8), offset=64), chip((4, 1), offset=128), chip((4, 1), offset=192)]
    operands[operand] = chip(shape, dtype, offset=256)
    p = Program()
    p.emit(Opcode.ACTIVATE_SCALED, Engine.SCALAR, *operands, func=ActFunc.IDENTITY)
    for neff in (p.neff(), decode(encode(p.neff()))):
        with pytest.raises(NeuronRuntimeError, match=re.escape(problem)):
            core.load(neff)


def test_activate_scaled_runs_on_the_scalar_engine_only(core):
    p = Program()
    p.emit(Opcode.ACTIVATE_SCALED, Engine.VECTOR, chip((4, 8)), chip((4, 8), offset=64), chip((4, 1), offset=128),
           chip((4, 1), offset=192), func=ActFunc.IDENTITY)
    with pytest.raises(NeuronRuntimeError, match="cannot run on the VECTOR engine"):
        core.load(p.neff())


def test_activate_scaled_costs_one_pass_as_activate_and_loads_its_functions_table():
    """NKI's activation: its scale and bias, one value per partition, are held for the pass as ACTIVATE's numbers."""
    tile, column = chip((128, 512), DType.BF16), chip((128, 1))
    scaled = Instruction(Opcode.ACTIVATE_SCALED, Engine.SCALAR, (tile, tile, column, column), func=ActFunc.EXP)
    plain = Instruction(Opcode.ACTIVATE, Engine.SCALAR, (tile, tile), func=ActFunc.EXP)
    assert instruction_cost_ns(scaled, TRN2) == instruction_cost_ns(plain, TRN2) == pytest.approx(512 / TRN2.scalar_ghz)
    assert activation_table(scaled) == ActFunc.EXP


def _tensor_scalar_reduce_program(dst_dtype: DType, alu: AluOp) -> Neff:
    """x [4, 8] loaded; TENSOR_SCALAR_REDUCE(x * -0.125, alu) on GpSimd; y and its reduction stored."""
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (4, 8))
    y_t, r_t = p.tensor("y", TensorKind.OUTPUT, (4, 8), dst_dtype), p.tensor("reduced", TensorKind.OUTPUT, (4, 1))
    x, y, reduced = chip((4, 8)), chip((4, 8), dst_dtype, offset=128), chip((4, 1), offset=192)
    p.emit(Opcode.DMA_COPY, Engine.DMA, x, hbm(x_t))
    p.emit(Opcode.TENSOR_SCALAR_REDUCE, Engine.GPSIMD, y, reduced, x, alu=alu, imm0=-0.125, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), y, queue=1, waits=done(Engine.GPSIMD))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(r_t), reduced, queue=2, waits=done(Engine.GPSIMD))
    return p.neff()


@pytest.mark.parametrize("dst_dtype", [DType.F32, DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("alu", [AluOp.ADD, AluOp.MAX, AluOp.MIN], ids=lambda a: a.name)
def test_tensor_scalar_reduce_scales_and_reduces_each_row_of_the_rounded_values(core, dst_dtype, alu):
    x = uniform(-3, 3)
    y, reduced = core.load(_tensor_scalar_reduce_program(dst_dtype, alu)).run([x]).outputs
    value = (x * np.float32(-0.125)).astype(dst_dtype.numpy)
    np.testing.assert_array_equal(y, value)
    reduce = {AluOp.ADD: np.add, AluOp.MAX: np.maximum, AluOp.MIN: np.minimum}[alu]
    np.testing.assert_array_equal(reduced, reduce.reduce(value.astype(np.float32), axis=-1, keepdims=True))


def test_tensor_scalar_reduce_refuses_a_reduction_not_one_fp32_value_per_partition(core):
    p = Program()
    p.emit(Opcode.TENSOR_SCALAR_REDUCE, Engine.VECTOR, chip((4, 8)), chip((4, 2), offset=64), chip((4, 8), offset=128),
           alu=AluOp.MAX, imm0=1.0)
    with pytest.raises(NeuronRuntimeError, match=re.escape("reduction must be an F32 [4, 1] tile")):
        core.load(p.neff())


def test_tensor_scalar_reduce_costs_one_pass_as_tensor_scalar():
    tile, column = chip((128, 512)), chip((128, 1))
    fused = Instruction(Opcode.TENSOR_SCALAR_REDUCE, Engine.VECTOR, (tile, column, tile), alu=AluOp.MIN, imm0=2.0)
    plain = Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (tile, tile), alu=AluOp.MULTIPLY, imm0=2.0)
    assert instruction_cost_ns(fused, TRN2) == instruction_cost_ns(plain, TRN2)


@pytest.mark.parametrize(
    "x, out_dtype, expected",
    [
        (np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8]], np.float32), DType.BF16, [[1.0, 1.0 + 2**-6]]),  # ties to even
        (np.array([[2.7, -2.7, 0.5, -0.5]], np.float32), DType.I32, [[2, -2, 0, 0]]),  # toward zero
    ],
    ids=["f32-to-bf16-nearest-even", "f32-to-i32-truncates"],
)
def test_tensor_copy_converts_like_the_hardware(core, x, out_dtype, expected):
    got = compute_on_chip(core, Opcode.TENSOR_COPY, Engine.VECTOR, [x], out_dtype=out_dtype)
    np.testing.assert_array_equal(got.astype(np.float64), expected)


def test_select_picks_on_true_where_the_predicate_is_nonzero(core):
    pred = np.array([[1, 0, 2, 0]], np.float32)
    got = compute_on_chip(core, Opcode.SELECT, Engine.VECTOR, [pred, pred + 10, pred - 10])
    np.testing.assert_array_equal(got, [[11, -10, 12, -10]])


def test_memset_and_iota_fill_their_destination():
    p = Program()
    ones, ramp = p.tensor("ones", TensorKind.OUTPUT, (2, 3)), p.tensor("ramp", TensorKind.OUTPUT, (3, 2, 2), DType.I32)
    p.emit(Opcode.MEMSET, Engine.GPSIMD, chip((2, 3)), imm0=1.5)
    p.emit(Opcode.IOTA, Engine.GPSIMD, chip((3, 2, 2), DType.I32, offset=64), imm0=5, imm1=10)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(ones), chip((2, 3)), waits=done(Engine.GPSIMD, 2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(ramp), chip((3, 2, 2), DType.I32, offset=64), waits=done(Engine.GPSIMD, 2))

    ones_out, ramp_out = run_neff(p.neff(), []).outputs

    np.testing.assert_array_equal(ones_out, np.full((2, 3), 1.5))
    np.testing.assert_array_equal(ramp_out, 5 + 10 * np.arange(3)[:, None, None] + np.arange(4).reshape(2, 2))


def test_rng_draws_the_philox_stream_of_its_seed_from_its_offset(core):
    """Element (p, i) is number offset + imm0 + p * imm1 + i of numpy's Philox4x64 stream keyed by the seed,
    its top 24 bits as an fp32 in [0, 1)."""
    seed, offset = 2 ** 63 + 12345, 6
    state = np.array([[seed, offset]], np.uint64).view(np.int64)
    got = compute_on_chip(core, Opcode.RNG, Engine.GPSIMD, [state], out_shape=(4, 8), out_dtype=DType.F32,
                          imm0=3, imm1=10)
    stream = np.random.Philox(key=seed).random_raw(offset + 3 + 3 * 10 + 8)
    numbers = offset + 3 + 10 * np.arange(4)[:, None] + np.arange(8)
    np.testing.assert_array_equal(got, (stream[numbers] >> np.uint64(40)) * 2.0 ** -24)


def test_rng_refuses_an_integer_destination_or_a_malformed_state(core):
    state = np.zeros((1, 2), np.int64)
    with pytest.raises(NeuronRuntimeError, match="RNG draws floats"):
        compute_on_chip(core, Opcode.RNG, Engine.GPSIMD, [state], out_shape=(2, 2), out_dtype=DType.I32)
    with pytest.raises(NeuronRuntimeError, match=r"I64 \[1, 2\] tile"):
        compute_on_chip(core, Opcode.RNG, Engine.GPSIMD, [np.zeros((1, 3), np.int64)], out_shape=(2, 2),
                        out_dtype=DType.F32)


def _gather_program() -> Neff:
    p = Program()
    table = p.tensor("table", TensorKind.WEIGHT, (10, 6), data=np.arange(60, dtype=np.float32).reshape(10, 6))
    index_t, out = p.tensor("index", TensorKind.INPUT, (4, 1), DType.I32), p.tensor("y", TensorKind.OUTPUT, (4, 6))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 1), DType.I32), hbm(index_t))
    p.emit(Opcode.DMA_GATHER, Engine.DMA, chip((4, 6), offset=64), hbm(table), chip((4, 1), DType.I32))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out), chip((4, 6), offset=64), queue=1, waits=done(Engine.DMA, 2))
    return p.neff()


def test_dma_gather_fetches_the_indexed_rows_and_refuses_an_index_outside_the_table(core):
    program = core.load(_gather_program())
    table = np.arange(60, dtype=np.float32).reshape(10, 6)
    index = np.array([[3], [0], [9], [3]], np.int32)
    np.testing.assert_array_equal(program.run([index]).outputs[0], table[index[:, 0]])
    with pytest.raises(NeuronRuntimeError, match=r"DMA_GATHER #1 on DMA queue 0.*index 10 \(partition 2\) is "
                                                 r"outside the table's 10 rows"):
        program.run([np.array([[3], [0], [10], [3]], np.int32)])


def _scatter_program(alu: AluOp) -> Neff:
    """y = base (10x6, all 1); then y[index[p]] (+)= rows[p] for 4 rows."""
    p = Program()
    base = p.tensor("base", TensorKind.WEIGHT, (10, 6), data=np.ones((10, 6), np.float32))
    rows = p.tensor("rows", TensorKind.WEIGHT, (4, 6), data=np.arange(24, dtype=np.float32).reshape(4, 6))
    index_t, out = p.tensor("index", TensorKind.INPUT, (4, 1), DType.I32), p.tensor("y", TensorKind.OUTPUT, (10, 6))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 1), DType.I32), hbm(index_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 6), offset=64), hbm(rows))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out), hbm(base))
    p.emit(Opcode.DMA_SCATTER, Engine.DMA, hbm(out), chip((4, 6), offset=64), chip((4, 1), DType.I32), alu=alu)
    return p.neff()


def test_dma_scatter_add_accumulates_repeated_rows_and_overwrite_keeps_the_other_rows(core):
    index = np.array([[3], [0], [9], [3]], np.int32)
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    added = core.load(_scatter_program(AluOp.ADD)).run([index]).outputs[0]
    expected = np.ones((10, 6), np.float32)
    np.add.at(expected, index[:, 0], rows)
    np.testing.assert_array_equal(added, expected)
    written = core.load(_scatter_program(AluOp.NONE)).run([np.array([[3], [0], [9], [5]], np.int32)]).outputs[0]
    expected = np.ones((10, 6), np.float32)
    expected[[3, 0, 9, 5]] = rows
    np.testing.assert_array_equal(written, expected)


def test_dma_scatter_refuses_an_index_outside_the_table(core):
    program = core.load(_scatter_program(AluOp.ADD))
    with pytest.raises(NeuronRuntimeError, match=r"DMA_SCATTER #3 .*index -1 \(partition 1\) is outside"):
        program.run([np.array([[3], [-1], [9], [3]], np.int32)])


# ---------------------------------------------------------------------------------------------
# Ordering between streams and the timeline


def _producer_consumer(consumer_waits: bool) -> Neff:
    """DMA queue 0 loads x; the Vector engine, after a short unrelated MEMSET, doubles it (waiting for the load,
    or not: then it starts while the load is in flight); DMA queue 1 stores the result."""
    p = Program()
    p.debug_locs.append(DebugLoc("model.py", 7, "scale", "aten.mul"))
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (128, 256)), p.tensor("y", TensorKind.OUTPUT, (128, 256))
    tile, result = chip((128, 256)), chip((128, 256), offset=4096)
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 1), offset=8192))
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, result, tile, alu=AluOp.MULTIPLY, imm0=2.0,
           waits=done(Engine.DMA) if consumer_waits else (), debug=0)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), result, queue=1, waits=done(Engine.VECTOR, 2))
    return p.neff()


def test_consumer_waiting_on_the_producers_semaphore_reads_its_data(core):
    x = uniform(-1, 1, (128, 256))
    np.testing.assert_array_equal(core.load(_producer_consumer(True)).run([x]).outputs[0], 2 * x)


def _partly_loaded_tile_program() -> Neff:
    """NKI's masked load: rows 0..63 of a 128-partition tile loaded, the whole tile negated, rows 0..63 stored."""
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (64, 8))
    y_t = p.tensor("y", TensorKind.OUTPUT, (64, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8)), hbm(x_t))
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 8), offset=64), chip((128, 8)), alu=AluOp.MULTIPLY,
           imm0=-1.0, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 8), offset=64), queue=1, waits=done(Engine.VECTOR))
    return p.neff()


def test_a_partly_written_tile_is_refused_unless_on_chip_memory_is_undefined_until_written(core):
    with pytest.raises(NeuronRuntimeError, match="SBUF partition 64 byte 0, which nothing wrote"):
        core.load(_partly_loaded_tile_program())
    program = core.load(_partly_loaded_tile_program(), undefined_on_chip=True)
    x = uniform(-1, 1, (64, 8))
    np.testing.assert_array_equal(program.run([x]).outputs[0], -x)
    assert np.isnan(core.sbuf[64:128, 64:96].view(np.float32)).all()  # the undefined rows read NaN


def test_tiles_far_apart_in_a_partition_are_checked_at_their_own_bytes(core):
    """The check keeps its tables for the bytes the operands use (runtime.memory.Columns), not the whole row: a
    tile at the row's far end, loaded in part and read whole, is still refused at its own byte, and a read of it
    not waiting for its load still names the load."""
    far = 200_000
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (64, 8)), p.tensor("y", TensorKind.OUTPUT, (64, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8)), hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8), offset=far), hbm(x_t), queue=1)
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 8), offset=64), chip((128, 8), offset=far),
           alu=AluOp.MULTIPLY, imm0=-1.0, waits=(Wait(Engine.DMA, 1, 1),))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 8), offset=64), queue=2, waits=done(Engine.VECTOR))
    with pytest.raises(NeuronRuntimeError, match=f"SBUF partition 64 byte {far}, which nothing wrote"):
        core.load(p.neff())
    racy = Program()
    x_t, y_t = racy.tensor("x", TensorKind.INPUT, (64, 8)), racy.tensor("y", TensorKind.OUTPUT, (64, 8))
    racy.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8)), hbm(x_t))
    racy.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8), offset=far), hbm(x_t), queue=1)
    racy.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((64, 8), offset=64), chip((64, 8), offset=far),
              alu=AluOp.MULTIPLY, imm0=-1.0)  # no wait for queue 1's load
    racy.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 8), offset=64), queue=2, waits=done(Engine.VECTOR))
    with pytest.raises(NeuronRuntimeError, match=f"reads SBUF partition 0 byte {far}, which nothing wrote before .*; "
                                                 "DMA_COPY #0 on DMA queue 1 writes it"):
        core.load(racy.neff())


def test_a_tile_nothing_wrote_is_refused_even_when_on_chip_memory_is_undefined_until_written(core):
    p = Program()
    y_t = p.tensor("y", TensorKind.OUTPUT, (64, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 8)))
    with pytest.raises(NeuronRuntimeError, match="nothing wrote"):
        core.load(p.neff(), undefined_on_chip=True)


@pytest.mark.parametrize("consumer_waits_for_the_patch", [True, False])
def test_a_large_tile_written_whole_then_patched_by_another_queue_is_judged_by_the_patch(core,
                                                                                         consumer_waits_for_the_patch):
    """A tile of 32768 entries loaded whole by DMA queue 0 (the check then remembers its one writer instead of
    scanning it, runtime.core._WriterBounds), then its first float overwritten by queue 1 after that load; a reader
    starting after both (behind a long MEMSET) and waiting for queue 0 only races with queue 1's write, found at
    that byte; waiting for both, it reads the patched data."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (128, 256)), p.tensor("y", TensorKind.OUTPUT, (128, 256))
    tile = chip((128, 256))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((1, 1)), AccessPattern(Space.HBM, DType.F32, x_t.offset + 4, ((1, 1), (1, 1))),
           queue=1, waits=done(Engine.DMA))  # x[0, 1] over the tile's first float
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((128, 16384), offset=16384))  # long: the reader starts after the patch
    waits = done(Engine.DMA) + (done(Engine.DMA, queue=1) if consumer_waits_for_the_patch else ())
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=4096), tile, alu=AluOp.MULTIPLY, imm0=2.0,
           waits=waits)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((128, 256), offset=4096), queue=2,
           waits=done(Engine.VECTOR, 2))
    if consumer_waits_for_the_patch:
        x = uniform(-1, 1, (128, 256))
        want = 2 * x
        want[0, 0] = 2 * x[0, 1]
        np.testing.assert_array_equal(core.load(p.neff()).run([x]).outputs[0], want)
        return
    with pytest.raises(NeuronRuntimeError, match="TENSOR_SCALAR #1 on VECTOR .*operand 1 reads SBUF partition 0 "
                                                 "byte 0, last written by DMA_COPY #0 on DMA queue 1"):
        core.load(p.neff())


def _tile_loaded_by_two_queues_then_patched(reader_waits_for_the_patch: bool, floats: int) -> Neff:
    """A tile of 32768 entries loaded by DMA queues 0 and 1 (half each: two writers, so the check gathers them),
    read by VECTOR #0 waiting for both; then ``floats`` floats of partition 0 from the tile's first overwritten by
    queue 2 after that read (x[0, 1:]...); VECTOR #2, after VECTOR #0 in its stream and starting after the patch
    (behind a long MEMSET of the other partitions), reads the tile again."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (128, 256)), p.tensor("y", TensorKind.OUTPUT, (128, 256))
    tile = chip((128, 256))
    halves = [AccessPattern(Space.HBM, DType.F32, x_t.offset + half * 64 * 256 * 4, row_major_dims((64, 256)))
              for half in (0, 1)]
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 256)), halves[0])
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 256), partition=64), halves[1], queue=1)
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=4096), tile, alu=AluOp.MULTIPLY, imm0=2.0,
           waits=done(Engine.DMA) + done(Engine.DMA, queue=1))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((1, floats)),
           AccessPattern(Space.HBM, DType.F32, x_t.offset + 4, ((1, 1), (1, floats))), queue=2, waits=done(Engine.VECTOR))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((127, 16384), partition=1, offset=16384))  # long: the reader starts later
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=8192), tile, alu=AluOp.MULTIPLY, imm0=3.0,
           waits=done(Engine.DMA, queue=2) if reader_waits_for_the_patch else ())
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((128, 256), offset=8192), queue=3,
           waits=done(Engine.VECTOR, 3))
    return p.neff()


@pytest.mark.parametrize("floats", [1, 17000])  # a write of one float; one whose box covers 17 stretches of 4 KiB
def test_a_tile_read_again_after_a_patch_is_judged_by_the_patch_not_by_the_earlier_accepted_read(core, floats):
    """The check remembers that every writer of a large tile happens before an accepted reader of it (so a later
    read ordered after that reader needs no gather, runtime.core._WriterBounds); a write of a byte of the tile in
    between makes it forget: the later reader, in the same stream as the first, races with the patch unless it
    waits for it, found at that byte."""
    x = uniform(-1, 1, (128, 256))
    want = 3 * x
    patched = min(floats, 256)  # of the tile's first row
    want[0, :patched] = 3 * x.reshape(-1)[1:1 + patched]
    program = core.load(_tile_loaded_by_two_queues_then_patched(True, floats))
    np.testing.assert_array_equal(program.run([x]).outputs[0], want)
    with pytest.raises(NeuronRuntimeError, match="TENSOR_SCALAR #2 on VECTOR .*operand 1 reads SBUF partition 0 "
                                                 "byte 0, last written by DMA_COPY #0 on DMA queue 2"):
        core.load(_tile_loaded_by_two_queues_then_patched(False, floats))


def test_a_tile_patched_twice_by_one_queue_after_an_accepted_read_races_with_the_second_patch(core):
    """As above, with queue 2 patching the tile's first float twice: a reader waiting for the first patch only
    races with the second (the check notes the latest write of each stream since the accepted read)."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (128, 256)), p.tensor("y", TensorKind.OUTPUT, (128, 256))
    tile = chip((128, 256))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=4096), tile, alu=AluOp.MULTIPLY, imm0=2.0,
           waits=done(Engine.DMA))
    for element in (1, 2):
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((1, 1)),
               AccessPattern(Space.HBM, DType.F32, x_t.offset + 4 * element, ((1, 1), (1, 1))), queue=2,
               waits=done(Engine.VECTOR))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((127, 16384), partition=1, offset=16384))  # long: the reader starts later
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=8192), tile, alu=AluOp.MULTIPLY, imm0=3.0,
           waits=done(Engine.DMA, queue=2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((128, 256), offset=8192), queue=3,
           waits=done(Engine.VECTOR, 3))
    with pytest.raises(NeuronRuntimeError, match="TENSOR_SCALAR #2 on VECTOR .*operand 1 reads SBUF partition 0 "
                                                 "byte 0, last written by DMA_COPY #1 on DMA queue 2"):
        core.load(p.neff())


def test_a_partly_written_tile_accepted_for_one_kernel_is_still_refused_to_a_later_reader_of_another(core):
    """A read of a partly written large tile is accepted for a kernel whose on-chip memory is undefined until
    written; that acceptance bounds nothing: a reader of another kernel after it in its stream is refused."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (64, 256)), p.tensor("y", TensorKind.OUTPUT, (64, 256))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 256)), hbm(x_t))
    for number, offset in ((0, 4096), (1, 8192)):
        p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((128, 256), offset=offset), chip((128, 256)),
               alu=AluOp.MULTIPLY, imm0=2.0, waits=done(Engine.DMA), kernel=number)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 256), offset=8192), queue=1, waits=done(Engine.VECTOR, 2))
    with pytest.raises(NeuronRuntimeError, match="TENSOR_SCALAR #1 on VECTOR .*SBUF partition 64 byte 0, which "
                                                 "nothing wrote"):
        core.load(p.neff(), undefined_on_chip=frozenset({0}))
    core.load(p.neff(), undefined_on_chip=frozenset({0, 1}))


def test_consumer_not_waiting_for_its_producer_is_refused_as_a_race_naming_both_and_the_source(core):
    with pytest.raises(NeuronRuntimeError) as err:
        core.load(_producer_consumer(False))
    message = str(err.value)
    assert "TENSOR_SCALAR #1 on VECTOR" in message and "operand 1 reads SBUF partition 0 byte 0" in message
    assert "DMA_COPY #0 on DMA queue 0 writes it" in message
    assert "at model.py:7 in scale (aten.mul)" in message
    assert "hint: a missing semaphore wait or a tile read before it is loaded: " \
           "wait for DMA queue 0's semaphore to reach 1" in message


def test_without_the_check_a_consumer_not_waiting_reads_nan_filled_sbuf_instead_of_the_data():
    core = NeuronCore("trn2", check_uninitialised=False)
    program = core.load(_producer_consumer(False))
    x = uniform(-1, 1, (128, 256))
    core.load(_producer_consumer(True)).run([x])  # leaves the right values in SBUF: they must not leak through

    result = program.run([x])

    assert np.isnan(result.outputs[0]).all()
    events = {(e.stream, e.index): e for e in result.timeline.events}
    load, consume = events[(Engine.DMA, 0), 0], events[(Engine.VECTOR, 0), 1]
    assert load.start_ns < consume.start_ns < load.end_ns


def test_a_verdict_of_this_runtimes_access_check_skips_the_check_and_any_other_does_not():
    core, racy = NeuronCore("trn2"), _producer_consumer(False)
    with pytest.raises(NeuronRuntimeError, match="a race|nothing wrote"):
        core.load(racy, checked_by="the id of another runtime's check")
    trusted = core.load(racy, checked_by=access_check_id())  # vouched for (wrongly, here): not checked again
    assert trusted.access_checked
    x = uniform(-1, 1, (128, 256))
    assert not np.allclose(trusted.run([x]).outputs[0], 2 * x)  # the race runs as the timing has it


def test_dropping_any_needed_wait_is_refused_even_when_the_timing_hides_it():
    """Each wait of a two-tile pipeline removed in turn is refused at load as a race. Without the check,
    the timing alone would hide one of them: the second load happens to finish before its consumer starts."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (128, 512)), p.tensor("y", TensorKind.OUTPUT, (128, 512))
    for t in range(2):
        tile, result = chip((128, 256), offset=t * 1024), chip((128, 256), offset=4096 + t * 1024)
        half = AccessPattern(Space.HBM, DType.F32, x_t.offset + t * 1024, ((512, 128), (1, 256)))
        out = AccessPattern(Space.HBM, DType.F32, y_t.offset + t * 1024, ((512, 128), (1, 256)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, tile, half, queue=t)
        p.emit(Opcode.ACTIVATE, Engine.SCALAR, result, tile, func=ActFunc.EXP, imm0=1.0,
               waits=(Wait(Engine.DMA, t, 1),))
        p.emit(Opcode.DMA_COPY, Engine.DMA, out, result, queue=2 + t, waits=done(Engine.SCALAR, t + 1))
    x = uniform(-1, 1, (128, 512))
    np.testing.assert_allclose(NeuronCore("trn2").load(p.neff()).run([x]).outputs[0], np.exp(x), rtol=1e-6)
    waiting = [(key, n) for key, stream in p.streams.items() for n, instr in enumerate(stream) if instr.waits]
    assert len(waiting) == 4
    right_by_timing = 0
    for key, n in waiting:
        streams = {k: list(v) for k, v in p.streams.items()}
        streams[key][n] = dataclasses.replace(streams[key][n], waits=())
        neff = dataclasses.replace(p.neff(), streams=streams)
        with pytest.raises(NeuronRuntimeError, match="(a race|nothing wrote before).*\n.*hint: a missing semaphore "
                                                     "wait.*: wait for"):
            NeuronCore("trn2").load(neff)
        unchecked = NeuronCore("trn2", check_uninitialised=False).load(neff).run([x]).outputs[0]
        right_by_timing += np.allclose(unchecked, np.exp(x), rtol=1e-6)
    assert right_by_timing == 1


def test_an_instruction_reads_its_operands_when_it_starts_not_seeing_a_write_completing_meanwhile(core):
    """A long Vector op reads a tile that a short DMA overwrites while the op runs: a write-after-read race,
    refused by the check; without it, the op computes from what the tile held when it started."""
    p = Program()
    x_t, z_t = p.tensor("x", TensorKind.INPUT, (128, 4096)), p.tensor("z", TensorKind.INPUT, (1, 4))
    y_t = p.tensor("y", TensorKind.OUTPUT, (128, 4096))
    tile, result = chip((128, 4096)), chip((128, 4096), offset=4096 * 4)
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, result, tile, alu=AluOp.MULTIPLY, imm0=2.0, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((1, 4)), hbm(z_t), queue=1, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), result, queue=2, waits=done(Engine.VECTOR))
    x, z = uniform(-1, 1, (128, 4096)), np.full((1, 4), 100.0, np.float32)
    with pytest.raises(NeuronRuntimeError, match=r"DMA_COPY #0 on DMA queue 1.*writes SBUF partition 0 byte 0, "
                                                 r"read \(operand 1\) by TENSOR_SCALAR #0 on VECTOR.*a race"):
        core.load(p.neff())

    result = NeuronCore("trn2", check_uninitialised=False).load(p.neff()).run([x, z])

    events = {(e.stream, e.index): e for e in result.timeline.events}
    op, overwrite = events[(Engine.VECTOR, 0), 0], events[(Engine.DMA, 1), 0]
    assert op.start_ns < overwrite.end_ns < op.end_ns
    np.testing.assert_array_equal(result.outputs[0], 2 * x)


def test_a_tile_read_before_anything_writes_it_is_refused(core):
    p = Program()
    y_t = p.tensor("y", TensorKind.OUTPUT, (4, 8))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((4, 4)), imm0=1.0)  # half the tile
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((4, 8)), waits=done(Engine.VECTOR))
    with pytest.raises(NeuronRuntimeError, match=r"DMA_COPY #0 on DMA queue 0.*operand 1 reads SBUF partition 0 "
                                                 r"byte 16.*\n.*no instruction of the program ever writes it"):
        core.load(p.neff())


def test_reading_scratch_hbm_before_it_is_written_is_refused(core):
    p = Program()
    scratch, y_t = p.tensor("h", TensorKind.SCRATCH, (4, 8)), p.tensor("y", TensorKind.OUTPUT, (4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), hbm(scratch))
    with pytest.raises(NeuronRuntimeError, match=f"reads HBM byte {scratch.offset} \\(of scratch 'h'\\)"):
        core.load(p.neff())


def test_accumulating_matmul_reads_the_psum_its_group_wrote_and_is_not_refused(core):
    p = Program()
    acc, moving = chip((64, 128), space=Space.PSUM), chip((128, 128), offset=1024)
    p.emit(Opcode.MEMSET, Engine.GPSIMD, chip((128, 64)), imm0=1.0)
    p.emit(Opcode.MEMSET, Engine.GPSIMD, moving, imm0=0.5)
    p.emit(Opcode.MATMUL, Engine.TENSOR, acc, chip((128, 64)), moving, waits=done(Engine.GPSIMD, 2))
    p.emit(Opcode.MATMUL, Engine.TENSOR, acc, chip((128, 64)), moving, accumulate=True)
    p.emit(Opcode.TENSOR_COPY, Engine.VECTOR, chip((64, 128), offset=2048), acc, waits=done(Engine.TENSOR, 2))
    y_t = p.tensor("y", TensorKind.OUTPUT, (64, 128))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((64, 128), offset=2048), waits=done(Engine.VECTOR))
    np.testing.assert_array_equal(core.load(p.neff()).run([]).outputs[0], np.full((64, 128), 128.0))
    first, second = p.streams[(Engine.TENSOR, 0)]
    no_start = dataclasses.replace(p.neff(), streams={  # the group's first matmul accumulates into unwritten PSUM
        **p.streams, (Engine.TENSOR, 0): [dataclasses.replace(first, accumulate=True), second]})
    with pytest.raises(NeuronRuntimeError, match="MATMUL #0 on TENSOR.*operand 0 reads PSUM partition 0 byte 0"):
        core.load(no_start)


@pytest.mark.parametrize("waits_for_the_group", [True, False])
def test_a_large_accumulation_is_judged_by_its_own_read_and_a_write_into_it_meanwhile_still_races(core,
                                                                                              waits_for_the_group):
    """An accumulating matmul's write of a large PSUM tile (65,536 entries: the check keeps bounds on its writers)
    is judged by the read of that tile it made at its start when nothing wrote the tile since; a one-float memset
    into the tile while the matmul runs (no wait for it) is still refused, as a write the running matmul reads."""
    p = Program()
    acc, stationary, moving = chip((128, 512), space=Space.PSUM), chip((128, 128)), chip((128, 512), offset=1024)
    p.emit(Opcode.MEMSET, Engine.GPSIMD, stationary, imm0=1.0)
    p.emit(Opcode.MEMSET, Engine.GPSIMD, moving, imm0=0.5)
    p.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary, moving, waits=done(Engine.GPSIMD, 2))
    p.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary, moving, accumulate=True)
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 1), space=Space.PSUM), imm0=7.0,
           waits=done(Engine.TENSOR, 2 if waits_for_the_group else 1))
    p.emit(Opcode.TENSOR_COPY, Engine.VECTOR, chip((128, 512), offset=4096), acc, waits=done(Engine.TENSOR, 2))
    y_t = p.tensor("y", TensorKind.OUTPUT, (128, 512))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((128, 512), offset=4096), waits=done(Engine.VECTOR, 2))
    if waits_for_the_group:
        expected = np.full((128, 512), 128.0)
        expected[0, 0] = 7.0
        np.testing.assert_array_equal(core.load(p.neff()).run([]).outputs[0], expected)
        return
    with pytest.raises(NeuronRuntimeError, match=r"MEMSET #0 on VECTOR.*writes PSUM partition 0 byte 0, read "
                                                 r"\(operand 0\) by MATMUL #1 on TENSOR .*\(a race\)"):
        core.load(p.neff())


def _mixed_grain_program(written_floats: int, read_bytes: int) -> tuple:
    """A program whose scratch ``h`` (8 floats) gets its first ``written_floats`` floats stored, and whose first
    ``read_bytes`` bytes are then loaded as uint8 into output ``m``; output ``y`` (f32) is stored whole. Returns
    (the Program, h, y, m)."""
    p = Program()
    h, y = p.tensor("h", TensorKind.SCRATCH, (8,)), p.tensor("y", TensorKind.OUTPUT, (4, 8))
    m = p.tensor("m", TensorKind.OUTPUT, (1, read_bytes), DType.U8)
    floats = chip((4, 8))
    p.emit(Opcode.MEMSET, Engine.VECTOR, floats, imm0=1.0)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), floats, waits=done(Engine.VECTOR))
    p.emit(Opcode.DMA_COPY, Engine.DMA, AccessPattern(Space.HBM, DType.F32, h.offset, ((1, 1), (1, written_floats))),
           chip((1, written_floats)), queue=1, waits=done(Engine.VECTOR))
    bytes_tile = chip((1, read_bytes), DType.U8, offset=1024)
    p.emit(Opcode.DMA_COPY, Engine.DMA, bytes_tile,
           AccessPattern(Space.HBM, DType.U8, h.offset, ((1, 1), (1, read_bytes))), queue=2, waits=done(Engine.DMA, 1, 1))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(m), bytes_tile, queue=3, waits=done(Engine.DMA, 1, 2))
    return p, h, y, m


def _hbm_tables(monkeypatch) -> list:
    """The HBM writer tables (memory.Cells) each access check of this test makes, filled as loads run."""
    from runtime.core import LoadedProgram
    from runtime.memory import HbmRegions

    made, original = [], LoadedProgram._access_tables

    def spied(self, partitions, dtype, layout, budget):
        tables = original(self, partitions, dtype, layout, budget)
        if isinstance(layout, HbmRegions):
            made.append(tables[0])
        return tables

    monkeypatch.setattr(LoadedProgram, "_access_tables", spied)
    return made


def test_hbm_tables_cover_outputs_and_scratch_only_each_region_at_its_own_granule(core, monkeypatch):
    """Inputs and weights are never written by the program: no table. A region read as bytes keeps an entry per
    byte, one only ever addressed as fp32 an entry per 4 bytes, whatever the other regions need."""
    tables = _hbm_tables(monkeypatch)
    p, h, y, m = _mixed_grain_program(8, 32)
    x = p.tensor("x", TensorKind.INPUT, (64, 64))  # 16 KiB, read by one copy
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 64), offset=4096), hbm(x), queue=4)
    core.load(p.neff())
    (writers,) = tables
    assert [writers.granule_at(t.offset) for t in (h, y, m)] == [1, 4, 1]
    assert writers.table.size == h.nbytes + y.nbytes // 4 + m.nbytes


def test_a_read_of_one_unwritten_byte_in_a_region_of_coarse_neighbours_is_refused_at_that_byte(core, monkeypatch):
    """``y``'s region has an entry per 4 bytes, ``h``'s one per byte: reading 29 bytes of the 28 written is refused
    at byte 28 exactly, reading the 28 is not."""
    tables = _hbm_tables(monkeypatch)
    p, h, *_ = _mixed_grain_program(7, 28)
    core.load(p.neff())
    assert tables[0].granule_at(p.tensors[1].offset) == 4
    p, h, *_ = _mixed_grain_program(7, 29)
    with pytest.raises(NeuronRuntimeError, match=f"operand 1 reads HBM byte {h.offset + 28} \\(of scratch 'h'\\), "
                                                 "which nothing wrote"):
        core.load(p.neff())


@pytest.mark.parametrize("read_bytes", [5, 6])
def test_on_chip_tables_keep_a_granule_per_stretch_and_refuse_one_unwritten_byte_at_that_byte(core, monkeypatch,
                                                                                            read_bytes):
    """On chip, the operands' extents merged where they share a byte are stretches, each with its own granule
    (runtime.memory.Columns): an fp32 tile at bytes [0, 32) keeps an entry per 4 bytes beside a byte tile touching it
    at [32, 38), which keeps one per byte. Reading 6 bytes of the byte tile when 5 were written is refused at byte 37
    exactly; reading the 5 is not."""
    from runtime.core import LoadedProgram
    from runtime.memory import Columns

    made, original = [], LoadedProgram._access_tables

    def spied(self, partitions, dtype, layout, budget):
        tables = original(self, partitions, dtype, layout, budget)
        if isinstance(layout, Columns) and layout.size:
            made.append(tables[0])
        return tables

    monkeypatch.setattr(LoadedProgram, "_access_tables", spied)
    p = Program()
    y, m = p.tensor("y", TensorKind.OUTPUT, (4, 8)), p.tensor("m", TensorKind.OUTPUT, (1, read_bytes), DType.U8)
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((4, 8)), imm0=1.0)
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 5), DType.U8, offset=32), imm0=1.0)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), chip((4, 8)), waits=done(Engine.VECTOR))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(m), chip((1, read_bytes), DType.U8, offset=32), queue=1,
           waits=done(Engine.VECTOR, 2))
    if read_bytes == 5:
        np.testing.assert_array_equal(core.load(p.neff()).run([]).outputs[1], np.ones((1, 5), np.uint8))
        (writers,) = made
        assert [writers.granule_at(b) for b in (0, 28, 32, 36)] == [4, 4, 1, 1]
        assert writers.table.shape == (4, 32 // 4 + 5)
        return
    with pytest.raises(NeuronRuntimeError, match="operand 1 reads SBUF partition 0 byte 37, which nothing wrote"):
        core.load(p.neff())


@pytest.mark.parametrize("first_byte, races", [(15, True), (16, False)])
def test_two_unordered_writes_sharing_one_byte_race_and_touching_ones_do_not(core, first_byte, races):
    """Four floats stored (bytes 0-15 of scratch ``h``) and, on another queue with no wait, 5 bytes from
    ``first_byte``: sharing byte 15 alone is a race, found at that byte; starting at 16 they share none."""
    p = Program()
    h, y = p.tensor("h", TensorKind.SCRATCH, (8,)), p.tensor("y", TensorKind.OUTPUT, (1, 4))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 4)), imm0=1.0)
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 5), DType.U8, offset=1024), imm0=1.0)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), chip((1, 4)), waits=done(Engine.VECTOR, 2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, AccessPattern(Space.HBM, DType.F32, h.offset, ((1, 1), (1, 4))),
           chip((1, 4)), queue=1, waits=done(Engine.VECTOR, 2))
    p.emit(Opcode.DMA_COPY, Engine.DMA, AccessPattern(Space.HBM, DType.U8, h.offset + first_byte, ((1, 1), (1, 5))),
           chip((1, 5), DType.U8, offset=1024), queue=2, waits=done(Engine.VECTOR, 2))
    if not races:
        core.load(p.neff())
        return
    with pytest.raises(NeuronRuntimeError, match=f"writes HBM byte {h.offset + 15} \\(of scratch 'h'\\), also written "
                                                 r"by DMA_COPY #0 on DMA queue [12] .*\(a race\)"):
        core.load(p.neff())


def test_wait_that_can_never_be_met_is_reported_as_deadlock(core):
    p = Program()
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((1, 4)), waits=done(Engine.GPSIMD, 1))
    p.emit(Opcode.MEMSET, Engine.GPSIMD, chip((1, 4), offset=16), waits=done(Engine.VECTOR, 1))
    p.emit(Opcode.MEMSET, Engine.SCALAR, chip((1, 4), offset=32), waits=done(Engine.DMA, 1, queue=7))
    with pytest.raises(NeuronRuntimeError, match="deadlock") as err:
        core.load(p.neff()).run([])
    message = str(err.value)
    assert "MEMSET #0 on VECTOR" in message and "MEMSET #0 on GPSIMD" in message
    assert "waits for DMA queue 7's semaphore to reach 1 (it completed 0 of its 0 instructions)" in message


def test_independent_streams_overlap_and_the_makespan_covers_every_stream():
    p = Program()
    for q in range(4):
        x_t, y_t = p.tensor(f"x{q}", TensorKind.INPUT, (128, 512)), p.tensor(f"y{q}", TensorKind.OUTPUT, (128, 512))
        tile = chip((128, 512), offset=q * 2048)
        p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t), queue=q)
        p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), tile, queue=q)
    xs = [uniform(-1, 1, (128, 512)) for _ in range(4)]

    result = run_neff(p.neff(), xs)

    timeline = result.timeline
    busy = timeline.busy_ns()
    assert all(timeline.estimated_ns >= b for b in busy.values())
    assert timeline.estimated_ns < sum(busy.values())
    assert timeline.hbm_bytes == 8 * 128 * 512 * 4
    assert 0 < timeline.busy_fraction()[Engine.DMA] <= 1
    for x, y in zip(xs, result.outputs):
        np.testing.assert_array_equal(x, y)


def test_timeline_durations_follow_the_cost_rules():
    p = Program()
    for dtype, offset in ((DType.BF16, 0), (DType.F32, 8192)):
        p.emit(Opcode.MATMUL, Engine.TENSOR, chip((128, 512), space=Space.PSUM, offset=offset // 4),
               chip((128, 128), dtype), chip((128, 512), dtype, offset=1024))
    events = NeuronCore("trn2", check_uninitialised=False).load(p.neff()).time().events  # SBUF never written
    bf16, fp32 = events
    assert fp32.end_ns - fp32.start_ns == pytest.approx(TRN2.matmul_fp32_slowdown * (bf16.end_ns - bf16.start_ns))
    for event, instr in zip(events, p.streams[(Engine.TENSOR, 0)]):
        assert event.end_ns - event.start_ns == instruction_cost_ns(instr, TRN2)
    assert fp32.start_ns == bf16.end_ns  # one stream runs in order


def test_dma_with_a_strided_innermost_dim_runs_at_half_bandwidth():
    contiguous = Instruction(Opcode.DMA_COPY, Engine.DMA, (chip((128, 1024)), chip((128, 1024), offset=4096)))
    strided = Instruction(Opcode.DMA_COPY, Engine.DMA, (chip((128, 1024)), AccessPattern(
        Space.SBUF, DType.F32, 4096, ((1, 128), (2, 1024)))))
    transfer_ns = instruction_cost_ns(contiguous, TRN2) - TRN2.dma_fixed_ns
    assert transfer_ns == pytest.approx(128 * 1024 * 4 / TRN2.dma_gbps_per_queue)  # 4 KiB per partition: the rate
    assert instruction_cost_ns(strided, TRN2) - TRN2.dma_fixed_ns == pytest.approx(2 * transfer_ns)


def test_timing_without_inputs_gives_the_timeline_of_a_real_run(core):
    neff = _producer_consumer(True)
    program = core.load(neff)

    timed = program.time()

    ran = program.run([uniform(-1, 1, (128, 256))]).timeline
    assert timed.events == ran.events and timed.hbm_bytes == ran.hbm_bytes > 0
    only_timed = run_neff(neff, numerics=False)
    assert only_timed.outputs == [] and only_timed.timeline == ran


@pytest.fixture(scope="module")
def compiled_mlp():
    from neuronc.compiler import CompileOptions, compile_graph
    from tests import zoo
    from tests.conftest import zoo_graph

    model, inputs = zoo.build("mlp")
    return compile_graph(zoo_graph("mlp"), CompileOptions()).neff, [x.numpy() for x in inputs]


def test_timing_a_compiled_model_gives_the_timeline_of_a_real_run(compiled_mlp):
    neff, inputs = compiled_mlp
    program = NeuronCore("trn2").load(neff)
    assert program.time() == program.run(inputs).timeline


def test_a_compiled_model_missing_a_wait_is_refused_naming_its_kernel_and_pytorch_source_line(compiled_mlp):
    neff, _ = compiled_mlp
    key, n = next((key, n) for key, stream in neff.streams.items() for n, instr in enumerate(stream) if instr.waits)
    streams = {k: list(v) for k, v in neff.streams.items()}
    streams[key][n] = dataclasses.replace(streams[key][n], waits=())
    with pytest.raises(NeuronRuntimeError) as err:
        NeuronCore("trn2").load(dataclasses.replace(neff, streams=streams))
    message, instr = str(err.value), streams[key][n]
    assert f"(kernel {neff.kernels[instr.kernel].name})" in message
    assert f"at {neff.debug_locs[instr.debug]}" in message and "zoo.py:" in message
    assert "hint: a missing semaphore wait" in message


# ---------------------------------------------------------------------------------------------
# The kernels a program is bound to at load compute bit for bit what the semantics say


SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, np.inf, -np.inf, np.nan, 1e-40, -7.25, 100.0, 2.0],
                   np.float32)


def _kernel_and_semantics_agree(opcode, engine, dst_dtype, src_dtypes, shapes=None, in_place=False, **fields):
    """Run one instruction both ways on two copies of a memory holding special values (and random bytes):
    its bound kernel, and ``dst[...] = SEMANTICS[opcode](...)``. Every byte must agree."""
    shapes = shapes or [(4, 8)] * (1 + len(src_dtypes))
    dtypes = (dst_dtype, *src_dtypes)
    operands = [chip(shape, dtype, offset=256 * n) for n, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    if in_place:
        operands[0] = dataclasses.replace(operands[1], dtype=dst_dtype)
    instr = Instruction(opcode, engine, tuple(operands), **fields)
    for fill in ("special", "random"):
        memory = np.zeros((8, 2048), np.uint8)
        if fill == "special":
            memory[...] = np.resize(SPECIAL, (8, 512)).view(np.uint8)
            memory[:, ::7] = RNG.integers(0, 4, (8, 293))  # small integers' low bytes for integer operands
        else:
            memory[...] = RNG.integers(0, 256, memory.shape, dtype=np.uint8)
        reference = memory.copy()
        views, expected = [view(memory, ap) for ap in operands], [view(reference, ap) for ap in operands]
        with np.errstate(all="ignore"):
            try:
                expected[0][...] = SEMANTICS[opcode](instr, *expected)
            except Exception as e:  # noqa: BLE001 - the kernel must refuse alike
                with pytest.raises(type(e)):
                    for call in kernel(instr, *views):
                        call()
                continue
            for call in kernel(instr, *views):
                call()
        np.testing.assert_array_equal(memory, reference, err_msg=f"{fill} {instr}")


FLOAT_ALUS = [op for op in AluOp]
INT_ALUS = [op for op in AluOp if op not in (AluOp.POW, AluOp.ATAN2)]


@pytest.mark.parametrize("dtypes", [(DType.F32, DType.F32, DType.F32), (DType.BF16, DType.F32, DType.BF16),
                                    (DType.F32, DType.BF16, DType.BF16), (DType.I32, DType.I32, DType.I32),
                                    (DType.F32, DType.I32, DType.I32)], ids=lambda d: "-".join(x.name for x in d))
def test_tensor_tensor_and_tensor_scalar_kernels_are_exact(dtypes):
    dst, a, b = dtypes
    for alu in FLOAT_ALUS if DType.F32 in (a, b) or a.is_float else INT_ALUS:
        _kernel_and_semantics_agree(Opcode.TENSOR_TENSOR, Engine.VECTOR, dst, (a, b), alu=alu)
        _kernel_and_semantics_agree(Opcode.TENSOR_TENSOR, Engine.VECTOR, dst, (a, b), alu=alu, in_place=True)
        for reverse in (False, True):
            _kernel_and_semantics_agree(Opcode.TENSOR_SCALAR, Engine.GPSIMD, dst, (a,), alu=alu, imm0=-2.5,
                                        reverse=reverse)
            _kernel_and_semantics_agree(Opcode.TENSOR_SCALAR, Engine.GPSIMD, dst, (a,), alu=alu, imm0=0.0,
                                        reverse=reverse, in_place=True)


@pytest.mark.parametrize("dtypes", [(DType.F32, DType.F32), (DType.BF16, DType.F32), (DType.F32, DType.BF16)],
                         ids=lambda d: "-".join(x.name for x in d))
def test_activate_kernels_are_exact(dtypes):
    for func in ActFunc:
        for scale, bias in ((1.0, 0.0), (-0.5, 0.25)):
            _kernel_and_semantics_agree(Opcode.ACTIVATE, Engine.SCALAR, dtypes[0], (dtypes[1],), func=func,
                                        imm0=scale, imm1=bias)


@pytest.mark.parametrize("dtypes", [(DType.F32, DType.F32), (DType.BF16, DType.F32), (DType.F32, DType.BF16)],
                         ids=lambda d: "-".join(x.name for x in d))
def test_activate_scaled_kernels_are_exact(dtypes):
    for func in ActFunc:
        _kernel_and_semantics_agree(Opcode.ACTIVATE_SCALED, Engine.SCALAR, dtypes[0], (dtypes[1], DType.F32, DType.F32),
                                    shapes=[(4, 8), (4, 8), (4, 1), (4, 1)], func=func)


def test_matmul_reduce_copy_select_memset_iota_and_dma_kernels_are_exact():
    for dtype in (DType.F32, DType.BF16):
        for accumulate in (False, True):
            _kernel_and_semantics_agree(Opcode.MATMUL, Engine.TENSOR, DType.F32, (dtype, dtype),
                                        shapes=[(8, 16), (4, 8), (4, 16)], accumulate=accumulate)
    for dtype in (DType.F32, DType.BF16, DType.I32, DType.I8):
        for alu in (AluOp.ADD, AluOp.MAX, AluOp.MIN):
            _kernel_and_semantics_agree(Opcode.TENSOR_REDUCE, Engine.VECTOR, DType.F32, (dtype,),
                                        shapes=[(4, 1), (4, 8)], alu=alu)
    for dst, src in ((DType.BF16, DType.F32), (DType.I32, DType.F32), (DType.F32, DType.BF16), (DType.F32, DType.I8),
                     (DType.BOOL, DType.F32), (DType.F8E4M3, DType.F32)):
        _kernel_and_semantics_agree(Opcode.TENSOR_COPY, Engine.VECTOR, dst, (src,))
    for pred in (DType.BOOL, DType.F32, DType.BF16):
        for on_false in (DType.F32, DType.BF16):
            for in_place in (False, True):
                _kernel_and_semantics_agree(Opcode.SELECT, Engine.VECTOR, DType.F32, (pred, DType.F32, on_false),
                                            in_place=in_place)
    for dtype in (DType.F32, DType.I32, DType.BF16):
        _kernel_and_semantics_agree(Opcode.MEMSET, Engine.GPSIMD, dtype, (), imm0=-1.5)
        _kernel_and_semantics_agree(Opcode.IOTA, Engine.GPSIMD, dtype, (), imm0=3, imm1=-2)
    for shapes in ([(4, 8), (4, 8)], [(4, 8), (2, 16)], [(8, 4), (4, 8)]):
        _kernel_and_semantics_agree(Opcode.DMA_COPY, Engine.DMA, DType.F32, (DType.F32,), shapes=shapes)


def _top8_program() -> Neff:
    """x [2, 10] -> the 8 largest per row, where they are, and x with them replaced by -1."""
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (2, 10))
    best_t, where_t = p.tensor("best", TensorKind.OUTPUT, (2, 8)), p.tensor("where", TensorKind.OUTPUT, (2, 8), DType.I32)
    rest_t = p.tensor("rest", TensorKind.OUTPUT, (2, 10))
    xs, best, where, rest = chip((2, 10)), chip((2, 8), offset=64), chip((2, 8), DType.I32, offset=128), chip((2, 10), offset=192)
    p.emit(Opcode.DMA_COPY, Engine.DMA, xs, hbm(x))
    p.emit(Opcode.MAX8, Engine.VECTOR, best, xs, waits=done(Engine.DMA))
    p.emit(Opcode.FIND_INDEX8, Engine.VECTOR, where, xs, best)
    p.emit(Opcode.MATCH_REPLACE8, Engine.VECTOR, rest, xs, best, imm0=-1.0)
    for i, (dst, src) in enumerate(((best_t, best), (where_t, where), (rest_t, rest))):
        p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(dst), src, queue=1 + i, waits=done(Engine.VECTOR, 3))
    return p.neff()


def test_top8_instructions_give_repeated_values_distinct_positions(core):
    x = np.array([[5, 1, 9, 9, 0, 3, 7, 9, 2, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], np.float32)
    best, where, rest = core.load(_top8_program()).run([x]).outputs
    np.testing.assert_array_equal(best, [[9, 9, 9, 8, 7, 5, 3, 2], [9, 8, 7, 6, 5, 4, 3, 2]])
    np.testing.assert_array_equal(where, [[2, 3, 7, 9, 6, 0, 5, 8], [9, 8, 7, 6, 5, 4, 3, 2]])
    np.testing.assert_array_equal(rest, [[-1, 1, -1, -1, 0, -1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1, -1, -1, -1, -1]])


def _tensor_alu2_program(alu: AluOp, alu1: AluOp, dst_dtype: DType) -> Neff:
    """a [4, 8], s [4, 1] (read with stride 0: one value per partition), c [4, 8] loaded; TENSOR_ALU2 on GpSimd."""
    p = Program()
    a_t, s_t, c_t = p.tensor("a", TensorKind.INPUT, (4, 8)), p.tensor("s", TensorKind.INPUT, (4, 1)), p.tensor(
        "c", TensorKind.INPUT, (4, 8))
    out_t = p.tensor("out", TensorKind.OUTPUT, (4, 8), dst_dtype)
    a, s, c, out = chip((4, 8)), chip((4, 1), offset=64), chip((4, 8), offset=128), chip((4, 8), dst_dtype, offset=192)
    for tile, t in ((a, a_t), (s, s_t), (c, c_t)):
        p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(t))
    per_partition = dataclasses.replace(s, dims=(s.dims[0], (0, 8)))
    p.emit(Opcode.TENSOR_ALU2, Engine.GPSIMD, out, a, per_partition, c, alu=alu, alu1=alu1, waits=done(Engine.DMA, 3))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out_t), out, queue=1, waits=done(Engine.GPSIMD))
    return p.neff()


@pytest.mark.parametrize("dst_dtype", [DType.F32, DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("alu, alu1", [(AluOp.SUBTRACT, AluOp.MULTIPLY), (AluOp.MULTIPLY, AluOp.ADD),
                                       (AluOp.DIVIDE, AluOp.NONE)], ids=lambda a: a.name)
def test_tensor_alu2_makes_two_alu_ops_in_fp32_and_rounds_once(core, alu, alu1, dst_dtype):
    a, s, c = uniform(-3, 3), uniform(0.5, 2, (4, 1)), uniform(-3, 3)
    (out,) = core.load(_tensor_alu2_program(alu, alu1, dst_dtype)).run([a, s, c]).outputs
    ufunc = {AluOp.SUBTRACT: np.subtract, AluOp.MULTIPLY: np.multiply, AluOp.ADD: np.add, AluOp.DIVIDE: np.divide}
    first = ufunc[alu](a, s)  # fp32 arrays: numpy computes in fp32
    expected = first if alu1 == AluOp.NONE else ufunc[alu1](first, c)
    np.testing.assert_array_equal(out, expected.astype(dst_dtype.numpy))


def test_tensor_alu2_refuses_integers_and_non_arithmetic_ops(core):
    tile = chip((4, 8))
    for dtype, alu in ((DType.I32, AluOp.ADD), (DType.F32, AluOp.XOR)):
        p = Program()
        p.emit(Opcode.TENSOR_ALU2, Engine.VECTOR, chip((4, 8), dtype), tile, tile, tile, alu=alu, alu1=AluOp.ADD)
        with pytest.raises(NeuronRuntimeError, match="TENSOR_ALU2"):
            core.load(p.neff())


def test_tensor_alu2_streams_each_source_once_and_holds_a_per_partition_value():
    tile, column = chip((128, 512)), chip((128, 1))
    per_partition = dataclasses.replace(column, dims=(column.dims[0], (0, 512)))

    def cost(*srcs, alu1=AluOp.MULTIPLY):
        return instruction_cost_ns(Instruction(Opcode.TENSOR_ALU2, Engine.VECTOR, (tile, tile, *srcs), alu=AluOp.SUBTRACT,
                                               alu1=alu1), TRN2)

    def plain(srcs):
        return instruction_cost_ns(Instruction(Opcode.TENSOR_TENSOR, Engine.VECTOR, (tile, *[tile] * srcs),
                                               alu=AluOp.ADD), TRN2)

    assert cost(per_partition, per_partition) == instruction_cost_ns(
        Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (tile, tile), alu=AluOp.ADD, imm0=1.0), TRN2)
    assert cost(per_partition, chip((128, 512), offset=4096)) == plain(2)
    assert cost(chip((128, 512), offset=4096), chip((128, 512), offset=8192)) > plain(2)
    assert cost(per_partition, chip((128, 512), offset=4096), alu1=AluOp.NONE) == cost(per_partition, per_partition)


def _scan_program(alu: AluOp, alu1: AluOp, dst_dtype: DType, engine=Engine.VECTOR, shape=(4, 8)) -> Neff:
    """data0, data1 (``shape``) and initial [4, 1] loaded; TENSOR_TENSOR_SCAN into a ``dst_dtype`` tile."""
    p = Program()
    d0_t, d1_t, i_t = (p.tensor(n, TensorKind.INPUT, s) for n, s in (("d0", shape), ("d1", shape), ("init", (4, 1))))
    out_t = p.tensor("out", TensorKind.OUTPUT, shape, dst_dtype)
    d0, d1, init, out = chip(shape), chip(shape, offset=64), chip((4, 1), offset=128), chip(shape, dst_dtype, offset=192)
    for tile, t in ((d0, d0_t), (d1, d1_t), (init, i_t)):
        p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(t))
    p.emit(Opcode.TENSOR_TENSOR_SCAN, engine, out, d0, d1, init, alu=alu, alu1=alu1, waits=done(Engine.DMA, 3))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out_t), out, queue=1, waits=done(engine))
    return p.neff()


def _scan_reference(op0, op1, d0, d1, init) -> np.ndarray:
    """The NKI docs' loop, one np.float32 scalar at a time."""
    out = np.empty(d0.shape, np.float32)
    for p in range(d0.shape[0]):
        r = np.float32(init[p, 0])
        for i in range(d0.shape[1]):
            r = op1(op0(np.float32(d0[p, i]), r), np.float32(d1[p, i]))
            out[p, i] = r
    return out


@pytest.mark.parametrize("alu, alu1", [(AluOp.MULTIPLY, AluOp.ADD), (AluOp.SUBTRACT, AluOp.MAX),
                                       (AluOp.DIVIDE, AluOp.MULTIPLY)], ids=lambda a: a.name)
def test_tensor_tensor_scan_opcode_carries_each_partitions_result_along_its_free_elements(core, alu, alu1):
    d0, d1, init = uniform(0.5, 1.5), uniform(-2, 2), uniform(-1, 1, (4, 1))
    (out,) = core.load(_scan_program(alu, alu1, DType.F32)).run([d0, d1, init]).outputs
    ufunc = {AluOp.SUBTRACT: np.subtract, AluOp.MULTIPLY: np.multiply, AluOp.ADD: np.add, AluOp.DIVIDE: np.divide,
             AluOp.MAX: np.maximum}
    np.testing.assert_array_equal(out, _scan_reference(ufunc[alu], ufunc[alu1], d0, d1, init))


def test_tensor_tensor_scan_opcode_keeps_its_state_in_fp32_under_a_bf16_destination(core):
    """r = r * 1 + 1/3 in fp32, each r rounded to bf16 only where it is written: a state rounded to bf16 drifts."""
    d0, d1, init = np.ones((4, 8), np.float32), np.full((4, 8), 1 / 3, np.float32), np.zeros((4, 1), np.float32)
    (out,) = core.load(_scan_program(AluOp.MULTIPLY, AluOp.ADD, DType.BF16)).run([d0, d1, init]).outputs
    fp32_state = _scan_reference(np.multiply, np.add, d0, d1, init)
    np.testing.assert_array_equal(out, fp32_state.astype(ml_dtypes.bfloat16))


def test_tensor_tensor_scan_opcode_scans_several_free_dims_in_row_major_order(core):
    d0, d1, init = uniform(0.5, 1.5, (4, 2, 4)), uniform(-2, 2, (4, 2, 4)), uniform(-1, 1, (4, 1))
    (out,) = core.load(_scan_program(AluOp.MULTIPLY, AluOp.ADD, DType.F32, shape=(4, 2, 4))).run([d0, d1, init]).outputs
    flat = _scan_reference(np.multiply, np.add, d0.reshape(4, 8), d1.reshape(4, 8), init)
    np.testing.assert_array_equal(out, flat.reshape(4, 2, 4))


@pytest.mark.parametrize("case, match", [
    ("gpsimd", "cannot run on the GPSIMD engine"), ("both_psum", "at most one"), ("bf16_initial", "initial value"),
    ("compare", "arithmetic ALU ops"), ("integers", "computes on floats")])
def test_tensor_tensor_scan_opcode_refuses_what_the_vector_engines_scan_does_not_do(core, case, match):
    psum = chip((4, 8), space=Space.PSUM)
    dst, d0, d1, init = chip((4, 8)), chip((4, 8), offset=64), chip((4, 8), offset=128), chip((4, 1), offset=192)
    engine, alu = Engine.VECTOR, AluOp.MULTIPLY
    if case == "gpsimd":
        engine = Engine.GPSIMD
    elif case == "both_psum":
        d0, d1 = psum, dataclasses.replace(psum, offset=64)
    elif case == "bf16_initial":
        init = chip((4, 1), DType.BF16, offset=192)
    elif case == "compare":
        alu = AluOp.GT
    else:
        dst = chip((4, 8), DType.I32)
    p = Program()
    p.emit(Opcode.TENSOR_TENSOR_SCAN, engine, dst, d0, d1, init, alu=alu, alu1=AluOp.ADD)
    with pytest.raises(NeuronRuntimeError, match=match):
        core.load(p.neff())


def test_tensor_tensor_scan_opcode_costs_a_tensor_tensor_its_initial_value_held():
    """No documented cost: priced as TENSOR_TENSOR's two streamed inputs, a stated choice (targets.py)."""
    tile = chip((128, 512))
    scan = Instruction(Opcode.TENSOR_TENSOR_SCAN, Engine.VECTOR, (tile, tile, tile, chip((128, 1))),
                       alu=AluOp.MULTIPLY, alu1=AluOp.ADD)
    plain = Instruction(Opcode.TENSOR_TENSOR, Engine.VECTOR, (tile, tile, tile), alu=AluOp.ADD)
    assert instruction_cost_ns(scan, TRN2) == instruction_cost_ns(plain, TRN2)
    bf16 = chip((128, 512), DType.BF16)
    scan16 = dataclasses.replace(scan, operands=(bf16, bf16, bf16, chip((128, 1))))
    assert instruction_cost_ns(scan16, TRN2) == instruction_cost_ns(scan, TRN2)  # no performance mode


def test_the_unordered_writer_of_a_read_is_the_first_writer_whose_stream_clock_does_not_count_past_it():
    """The access check's writer test (ranges of late ids per stream) against its definition, writer by writer:
    writer (t, k), id firsts[t] + k, happens before an instruction whose clock counts past k on stream t; ids 0
    (the host) and 1 (nobody) when their clock slots are set. Tables of 16-bit ids, up to 65,535 (unsigned: a
    program of 32,768 to 65,535 instructions), and writer entries scattered in the table (a strided or transposed
    view, which the test copies together first) too."""
    from runtime.core import _unordered_writer

    rng = np.random.default_rng(0)
    for case in range(600):
        dtype, longest = (np.int16, 6) if case % 2 else (np.uint16, 16_000)
        lengths = rng.integers(0, longest, size=rng.integers(1, 5))
        firsts = [2] + list(2 + np.cumsum(lengths))
        clock = [int(rng.integers(0, n + 1)) for n in lengths] + [bool(rng.integers(2)), bool(rng.integers(2))]
        shape = tuple(rng.integers(1, 4, size=rng.integers(1, 4)))
        who = rng.integers(0, firsts[-1], size=(*shape[:-1], 2 * shape[-1])).astype(dtype)
        who = who[..., ::2] if case % 3 else who[..., :shape[-1]].T  # (strided, or transposed)
        if rng.integers(3) == 0:
            who[...] = who.flat[0]  # a single writer
        n = len(lengths)

        def happens_before(w: int, clock=clock, n=n, firsts=firsts) -> bool:
            if w < 2:
                return bool(clock[n + w])
            t = max(s for s in range(n) if firsts[s] <= w)
            return clock[t] > w - firsts[t]

        late = [int(w) for w in who.flat if not happens_before(int(w))]
        assert _unordered_writer(who, clock, firsts) == (late[0] if late else None)


def _bn_program(width: int, chunks: tuple, dtype=DType.F32) -> Neff:
    """x [4, width] loaded; one BN_STATS per column range of `chunks` side by side, BN_AGGR over them; both stored."""
    p = Program()
    x_t = p.tensor("x", TensorKind.INPUT, (4, width), dtype)
    stats_t = p.tensor("stats", TensorKind.OUTPUT, (4, 6 * len(chunks)))
    aggr_t = p.tensor("aggr", TensorKind.OUTPUT, (4, 2))
    x, stats, aggr = chip((4, width), dtype), chip((4, 6 * len(chunks)), offset=4096), chip((4, 2), offset=8192)
    p.emit(Opcode.DMA_COPY, Engine.DMA, x, hbm(x_t))
    for i, (c0, c1) in enumerate(chunks):
        p.emit(Opcode.BN_STATS, (Engine.VECTOR, Engine.GPSIMD)[i % 2],
               dataclasses.replace(stats, offset=4096 + 24 * i, dims=((1, 4), (1, 6))),
               dataclasses.replace(x, offset=c0 * dtype.itemsize, dims=((1, 4), (1, c1 - c0))), waits=done(Engine.DMA))
    p.emit(Opcode.BN_AGGR, Engine.VECTOR, aggr, stats, waits=done(Engine.GPSIMD, len(chunks) // 2) + done(
        Engine.VECTOR, -(-len(chunks) // 2)))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(stats_t), stats, queue=1, waits=done(Engine.VECTOR, -(-len(chunks) // 2) + 1))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(aggr_t), aggr, queue=2, waits=done(Engine.VECTOR, -(-len(chunks) // 2) + 1))
    return p.neff()


def _docs_bn_stats(x: np.ndarray) -> np.ndarray:
    """NKI's bn_stats output, from its docs: (count, mean, variance * count) of the even, then the odd elements."""
    halves = [x[:, 0::2].astype(np.float64), x[:, 1::2].astype(np.float64)]
    return np.concatenate([np.stack([np.full(len(h), h.shape[1]), h.mean(-1), h.var(-1) * h.shape[1]], -1)
                           for h in halves], -1)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16], ids=lambda d: d.name)
def test_bn_stats_and_bn_aggr_opcodes_give_each_partitions_statistics_mean_and_variance(core, dtype):
    """Three chunks of a row of 700 (Vector and GpSimd), their statistics as NKI documents them and the row's mean
    and population variance (numpy's, in fp64) to fp32's rounding; the values are ~3 +- 2, so a variance made from
    a sum of squares in fp32 would miss by far more."""
    x = uniform(1, 5, (4, 700)).astype(dtype.numpy)
    chunks = ((0, 234), (234, 467), (467, 700))
    stats, aggr = core.load(_bn_program(700, chunks, dtype)).run([x]).outputs
    for i, (c0, c1) in enumerate(chunks):
        np.testing.assert_allclose(stats[:, 6 * i:6 * i + 6], _docs_bn_stats(x[:, c0:c1]), rtol=2e-7)
    wide = x.astype(np.float64)
    np.testing.assert_allclose(aggr[:, 0], wide.mean(-1), rtol=2e-7)
    np.testing.assert_allclose(aggr[:, 1], wide.var(-1), rtol=2e-7)


def test_bn_stats_opcode_of_one_element_gives_an_empty_odd_half(core):
    x = np.array([[3.0], [-1.0], [0.5], [8.0]], np.float32)
    stats, aggr = core.load(_bn_program(1, ((0, 1),))).run([x]).outputs
    np.testing.assert_array_equal(stats, np.concatenate([np.ones((4, 1)), x, np.zeros((4, 4))], -1).astype(np.float32))
    np.testing.assert_array_equal(aggr, np.concatenate([x, np.zeros((4, 1))], -1).astype(np.float32))


@pytest.mark.parametrize("case, match", [
    ("wide", "at most 512 elements"), ("bf16_dst", "F32 \\[4, 6\\] tile in SBUF"), ("scalar", "cannot run on the SCALAR"),
    ("aggr_not_triples", "triples"), ("aggr_wide_dst", "F32 \\[4, 2\\] tile"), ("integers", "float")])
def test_bn_opcodes_refuse_what_nkis_bn_stats_and_bn_aggr_do_not_take_also_from_a_neff_files_bytes(core, case, match):
    """Each malformed instruction alone in a program: refused when a NEFF built in memory is loaded, and when its
    encoded bytes (a hostile NEFF file) are decoded and loaded."""
    from neuronc.neff import decode, encode
    opcode, engine, dst, src = Opcode.BN_STATS, Engine.VECTOR, chip((4, 6)), chip((4, 512), offset=64)
    if case == "wide":
        src = chip((4, 513), offset=64)
    elif case == "bf16_dst":
        dst = chip((4, 6), DType.BF16)
    elif case == "scalar":
        engine = Engine.SCALAR
    elif case == "aggr_not_triples":
        opcode, dst, src = Opcode.BN_AGGR, chip((4, 2)), chip((4, 8), offset=64)
    elif case == "aggr_wide_dst":
        opcode, dst, src = Opcode.BN_AGGR, chip((4, 3)), chip((4, 6), offset=64)
    else:
        src = chip((4, 16), DType.I32, offset=64)
    p = Program()
    p.emit(opcode, engine, dst, src)
    for neff in (p.neff(), decode(encode(p.neff()))):
        with pytest.raises(NeuronRuntimeError, match=match):
            core.load(neff)


def test_bn_opcodes_cost_what_nki_documents():
    """bn_stats "max(MIN_II, N)" Vector cycles for N elements a partition, bn_aggr "max(MIN_II, 13*(N/3))" (targets.py)."""
    def ns(opcode, dst, src, engine=Engine.VECTOR):
        return instruction_cost_ns(Instruction(opcode, engine, (dst, src)), TRN2)

    assert ns(Opcode.BN_STATS, chip((128, 6)), chip((128, 384), DType.BF16)) == pytest.approx(384 / TRN2.vector_ghz)
    assert ns(Opcode.BN_STATS, chip((128, 6)), chip((128, 16))) == pytest.approx(64 / TRN2.vector_ghz)
    assert ns(Opcode.BN_STATS, chip((128, 6)), chip((128, 384)), Engine.GPSIMD) == pytest.approx(384 / TRN2.gpsimd_ghz)
    assert ns(Opcode.BN_AGGR, chip((128, 2)), chip((128, 12))) == pytest.approx(64 / TRN2.vector_ghz)
    assert ns(Opcode.BN_AGGR, chip((128, 2)), chip((128, 60))) == pytest.approx(13 * 20 / TRN2.vector_ghz)
