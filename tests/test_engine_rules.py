"""The documented rules of the NeuronCore's engines and DMA queues (TRAINIUM.md, "Corrections and additions"):
GpSimd never reaches PSUM (refused at load, and never chosen by codegen); which engines may access SBUF and PSUM at
the same time on trn1 and on trn2 (timing); DMA costs per target, the payload curve and the per-transfer latency a
queue overlaps with the previous transfer's data; the elementwise costs (minimum initiation interval, dependent
spacing, the Vector engine's performance mode on trn2, activation-table loads)."""
from __future__ import annotations

import dataclasses

import pytest

from neuronc.errors import NeuronRuntimeError
from neuronc.instruction_cost import PlannedStreams, dma_transfer_ns, instruction_cost_ns, payload_efficiency
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode, Space
from neuronc.neff.program import DebugLoc, TensorKind
from neuronc.stream_timing import estimate_streams
from neuronc.targets import get_target
from runtime import NeuronCore
from tests.test_runtime import Program, chip, done, hbm

TRN1, TRN2 = get_target("trn1"), get_target("trn2")
BANK = TRN2.psum_bank_bytes


def _load(p: Program, target: str):
    return NeuronCore(target, check_uninitialised=False).load(dataclasses.replace(p.neff(), target=target))


@pytest.mark.parametrize("opcode, operands", [
    (Opcode.MEMSET, (chip((128, 64), space=Space.PSUM),)),
    (Opcode.TENSOR_COPY, (chip((128, 64)), chip((128, 64), space=Space.PSUM))),
], ids=["writes-psum", "reads-psum"])
def test_a_gpsimd_instruction_with_a_psum_operand_is_refused_at_load(opcode, operands):
    p = Program()
    p.emit(opcode, Engine.GPSIMD, *operands)
    with pytest.raises(NeuronRuntimeError, match="in PSUM, which the GPSIMD engine cannot reach") as err:
        _load(p, "trn2")
    assert "VECTOR" in err.value.hint  # the way out: an engine that reaches PSUM


def test_the_same_instruction_on_the_vector_engine_loads():
    p = Program()
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((128, 64), space=Space.PSUM))
    _load(p, "trn2")


def _two_engines(first: Engine, first_tile: AccessPattern, second: Engine, second_tile: AccessPattern) -> Program:
    """Two independent MEMSETs of 512 elements, one on each engine."""
    p = Program()
    p.emit(Opcode.MEMSET, first, first_tile)
    p.emit(Opcode.MEMSET, second, second_tile)
    return p


def _overlap(p: Program, target: str) -> bool:
    a, b = _load(p, target).time().events
    return a.start_ns < b.end_ns and b.start_ns < a.end_ns


def test_vector_and_gpsimd_access_sbuf_in_parallel_on_trn2_but_not_on_trn1():
    p = _two_engines(Engine.VECTOR, chip((128, 512)), Engine.GPSIMD, chip((128, 512), offset=4096))
    assert _overlap(p, "trn2")
    assert not _overlap(p, "trn1")


def test_vector_and_scalar_access_psum_in_parallel_on_trn2_only_in_different_banks():
    different = _two_engines(Engine.VECTOR, chip((128, 256), space=Space.PSUM), Engine.SCALAR,
                             chip((128, 256), space=Space.PSUM, offset=BANK))
    same = _two_engines(Engine.VECTOR, chip((128, 128), space=Space.PSUM), Engine.SCALAR,
                        chip((128, 128), space=Space.PSUM, offset=512))
    assert _overlap(different, "trn2")
    assert not _overlap(same, "trn2")
    assert not _overlap(different, "trn1")  # trn1: never at the same time


def test_the_compilers_estimate_applies_the_same_access_rules():
    p = _two_engines(Engine.VECTOR, chip((128, 512)), Engine.GPSIMD, chip((128, 512), offset=4096))
    for target in ("trn1", "trn2"):
        assert estimate_streams(p.streams, get_target(target))[0] == _load(p, target).time().estimated_ns


def test_dma_engine_rates_are_the_documented_achievable_rates_per_target():
    assert [get_target(t).dma_gbps_per_queue for t in ("trn1", "trn2", "trn3")] == [17.0, 23.0, 33.0]


def test_a_dma_moving_little_per_partition_runs_far_below_the_engines_rate():
    assert payload_efficiency(4096, TRN2) == 1.0
    assert payload_efficiency(2048, TRN2) > 0.9  # approaches peak
    assert payload_efficiency(128, TRN2) < 0.4  # severely overhead-bound
    small = dma_transfer_ns(128 * 64, True, TRN2, 128) - TRN2.dma_fixed_ns  # 64 B per partition
    assert small > 3 * 128 * 64 / TRN2.dma_gbps_per_queue


def _queue_of_loads(count: int, waits_on_vector: bool = False) -> Program:
    """`count` loads of 4 KiB per partition on one DMA queue, each into its own tile."""
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (count * 128, 1024))
    for n in range(count):
        rows = AccessPattern(Space.HBM, DType.F32, x.offset + n * 128 * 4096, ((1024, 128), (1, 1024)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((128, 1024), offset=n * 4096), rows)
    return p


def test_a_queue_prepares_its_next_transfer_while_one_moves_data():
    one = instruction_cost_ns(_queue_of_loads(1).streams[(Engine.DMA, 0)][0], TRN2)
    transfer = one - TRN2.dma_fixed_ns
    assert transfer > TRN2.dma_fixed_ns  # 4 KiB per partition moves longer than the fixed cost: it hides
    events = _load(_queue_of_loads(3), "trn2").time().events
    assert events[0].end_ns - events[0].start_ns == pytest.approx(one)
    for before, after in zip(events, events[1:]):  # later transfers pay only their bytes (HBM permitting)
        assert after.end_ns - before.end_ns == pytest.approx(max(transfer, 128 * 4096 / TRN2.hbm_sustained_gbps))


@pytest.mark.parametrize("columns", [128, 512])  # 512 B and 2 KiB per partition
def test_the_matmul_planners_queue_time_of_loads_is_the_emulators(columns):
    """cost_model.strip_load_ns (what matmul_ns and conv_ns charge a DMA queue per load) against the emulator's
    clock of back-to-back loads on one queue: the first pays its whole fixed cost, each later one only what its
    data does not cover."""
    from neuronc.passes.cost_model import strip_load_ns

    from neuronc.placement import dma_slice_count

    count, pieces = 4, dma_slice_count(128, 128 * columns * 4, TRN2)  # a load is split by partitions
    rows = 128 // pieces  # a piece's partitions: `count` pieces on one queue
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (count * rows, columns))
    for n in range(count):
        part = AccessPattern(Space.HBM, DType.F32, x.offset + n * rows * columns * 4, ((columns, rows), (1, columns)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((rows, columns), offset=n * columns * 4), part)
    queue_time, one = strip_load_ns(128, 128 * columns * 4, True, TRN2)
    assert one == pytest.approx(instruction_cost_ns(p.streams[(Engine.DMA, 0)][0], TRN2))
    events = _load(p, "trn2").time().events
    planned = one + (count - 1) * queue_time / pieces  # the first piece's latency, then each later one's queue time
    assert events[-1].end_ns - events[0].start_ns == pytest.approx(planned, rel=1e-6)


def test_a_transfer_waiting_on_a_semaphore_pays_its_latency_after_the_wait():
    p = Program()
    out = p.tensor("out", TensorKind.OUTPUT, (128, 1024))
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((128, 1024)))
    store = p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out), chip((128, 1024)), waits=done(Engine.VECTOR))
    memset, dma = _load(p, "trn2").time().events
    assert dma.start_ns == memset.end_ns
    assert dma.end_ns - dma.start_ns == pytest.approx(instruction_cost_ns(store, TRN2))


def test_codegen_never_places_a_psum_operand_on_gpsimd():
    from neuronc.codegen.elementwise import Balancer
    from neuronc.codegen.emitter import Emitter
    from neuronc.isa import AluOp

    em = Emitter(TRN2)
    em.begin_kernel("k", (), DebugLoc())
    balancer = Balancer(em)
    balancer.busy[Engine.VECTOR] = 1e9  # GpSimd is far less busy: it would be chosen if it could reach PSUM
    psum, sbuf = chip((128, 64), space=Space.PSUM), chip((128, 64))
    balancer.emit(Opcode.TENSOR_SCALAR, sbuf, psum, alu=AluOp.MULTIPLY, imm0=2.0)
    balancer.emit(Opcode.TENSOR_SCALAR, sbuf, sbuf, alu=AluOp.MULTIPLY, imm0=2.0)
    assert [i.engine for i in em.instructions] == [Engine.VECTOR, Engine.GPSIMD]


def test_a_psum_copy_goes_to_scalar_when_scalar_has_less_work_than_vector_however_idle_gpsimd_is():
    from neuronc.codegen.elementwise import Balancer
    from neuronc.codegen.emitter import Emitter

    em = Emitter(TRN2)
    em.begin_kernel("k", (), DebugLoc())
    balancer = Balancer(em)
    balancer.busy[Engine.VECTOR], balancer.busy[Engine.SCALAR] = 2000.0, 1000.0  # GpSimd: 0, but it cannot reach PSUM
    psum, sbuf = chip((128, 64), space=Space.PSUM), chip((128, 64))
    balancer.scale(sbuf, psum, 1.0)
    balancer.scale(sbuf, sbuf, 1.0)  # an SBUF copy: idle GpSimd can take it
    assert [i.engine for i in em.instructions] == [Engine.SCALAR, Engine.GPSIMD]


def test_compiled_attention_puts_no_psum_operand_on_gpsimd():
    import math

    import torch

    from neuronc.compiler import CompileOptions, compile_exported

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

    inputs = tuple(torch.randn(1, 2, 256, 64, dtype=torch.bfloat16) for _ in range(3))
    neff = compile_exported(torch.export.export(Attention(), inputs), CompileOptions(opt_level=2, name="attn")).neff
    gpsimd = neff.streams[(Engine.GPSIMD, 0)]
    assert gpsimd  # the kernel still uses GpSimd, on SBUF
    assert not [i for i in gpsimd if any(ap.space == Space.PSUM for ap in i.operands)]
    assert any(n.name.startswith("attention") for n in neff.kernels)


def _starts(p: Program, target: str = "trn2") -> list:
    return [e.start_ns for e in _load(p, target).time().events]


def test_a_tiny_instruction_takes_the_minimum_initiation_interval():
    p = Program()
    one = p.emit(Opcode.TENSOR_COPY, Engine.SCALAR, chip((128, 1)), chip((128, 1), offset=64))
    assert instruction_cost_ns(one, TRN2) == pytest.approx(64 / TRN2.scalar_ghz)  # MIN_II, ~64 cycles
    big = p.emit(Opcode.TENSOR_COPY, Engine.SCALAR, chip((128, 1024)), chip((128, 1024), offset=8192))
    assert instruction_cost_ns(big, TRN2) == pytest.approx(1024 / TRN2.scalar_ghz)  # N cycles, no fixed cost


def _activations(dependent: bool, count: int = 3) -> Program:
    """`count` 1-element identity activations on the Scalar engine, each reading the previous one's output
    (dependent) or its own tile."""
    p = Program()
    for n in range(count):
        src = chip((128, 1), offset=4 * (n if dependent else 64 + n))
        p.emit(Opcode.ACTIVATE, Engine.SCALAR, chip((128, 1), offset=4 * (n + 1)), src, func=ActFunc.IDENTITY,
               imm0=1.0)
    return p


def test_dependent_one_element_activations_start_the_documented_264_cycles_apart():
    starts = _starts(_activations(dependent=True))
    for before, after in zip(starts, starts[1:]):
        assert (after - before) * TRN2.scalar_ghz == pytest.approx(264)  # nki_perf_guide: 189 ns, 264 cycles
    independent = _starts(_activations(dependent=False))
    for before, after in zip(independent, independent[1:]):
        assert (after - before) * TRN2.scalar_ghz == pytest.approx(64)


def _copy(dtype: DType, space: Space = Space.SBUF, engine: Engine = Engine.VECTOR) -> Program:
    p = Program()
    p.emit(Opcode.TENSOR_COPY, engine, chip((128, 2048), dtype), chip((128, 2048), dtype, space=space, offset=0))
    return p


def _only_ns(p: Program, target: str = "trn2") -> float:
    (event,) = _load(p, target).time().events
    return event.end_ns - event.start_ns


def test_the_vector_engine_copies_16_bit_sbuf_tiles_four_times_faster_on_trn2_only():
    fp32 = _only_ns(_copy(DType.F32))
    assert _only_ns(_copy(DType.BF16)) == pytest.approx(fp32 / 4)
    assert _only_ns(_copy(DType.BF16, Space.PSUM)) == pytest.approx(fp32 / 2)  # one side in PSUM: 2x
    assert _only_ns(_copy(DType.BF16, engine=Engine.GPSIMD)) == pytest.approx(2048 / TRN2.gpsimd_ghz)  # Vector only
    assert _only_ns(_copy(DType.BF16), "trn1") == _only_ns(_copy(DType.F32), "trn1")  # no performance mode


def test_the_vector_engine_adds_16_bit_sbuf_tiles_twice_as_fast_on_trn2():
    def add(dtype):
        p = Program()
        p.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, chip((128, 512), dtype), chip((128, 512), dtype, offset=4096),
               chip((128, 512), dtype, offset=8192), alu=AluOp.ADD)
        return _only_ns(p)
    assert add(DType.F32) == pytest.approx(2 * 512 / TRN2.vector_ghz)  # two inputs: 2N cycles
    assert add(DType.BF16) == pytest.approx(512 / TRN2.vector_ghz)


def test_the_scalar_engine_loads_an_activation_table_when_the_function_changes():
    p = Program()
    for n, func in enumerate((ActFunc.EXP, ActFunc.EXP, ActFunc.TANH, ActFunc.IDENTITY, ActFunc.EXP)):
        p.emit(Opcode.ACTIVATE, Engine.SCALAR, chip((128, 512), offset=2048 * n), chip((128, 512), offset=16384),
               func=func, imm0=1.0)
    durations = [e.end_ns - e.start_ns for e in _load(p, "trn2").time().events]
    plain, load = 512 / TRN2.scalar_ghz, TRN2.activation_table_load_cycles / TRN2.scalar_ghz
    assert durations == pytest.approx([plain + load, plain, plain + load, plain, plain + load])
    assert estimate_streams(p.streams, TRN2)[0] == pytest.approx(sum(durations))  # the compiler's estimate agrees


def test_a_planners_streams_charge_the_spacing_and_table_loads_the_emulators_clock_charges():
    """passes/rowwise_schedule.py prices schedules before their instructions exist with PlannedStreams: the same
    dependent spacing and activation-table loads as the emulator's clock (one rule, instruction_cost)."""
    tiles = {name: chip((128, 512), offset=2048 * n) for n, name in enumerate("abcde")}
    steps = [("a", "b", ActFunc.EXP), ("b", "c", ActFunc.EXP), ("a", "d", ActFunc.TANH), ("d", "e", ActFunc.IDENTITY)]
    p = Program()
    for src, dst, func in steps:
        p.emit(Opcode.ACTIVATE, Engine.SCALAR, tiles[dst], tiles[src], func=func, imm0=1.0)
    emulated = [t for e in _load(p, "trn2").time().events for t in (e.start_ns, e.end_ns)]
    planned = PlannedStreams(TRN2)
    priced = [t for src, dst, func in steps for t in
              planned.run(Engine.SCALAR, 512 / TRN2.scalar_ghz, 0.0, reads=(src,), makes=(dst,), func=func)[:2]]
    assert priced == pytest.approx(emulated)  # (start, end) of each
    gap = TRN2.dependent_spacing_cycles / TRN2.scalar_ghz
    assert emulated[2] == pytest.approx(emulated[1] + gap)  # the second reads the first's output
    assert emulated[4] == pytest.approx(emulated[3])  # the third does not


def _transpose(dtype: DType, accumulate: bool = False) -> Program:
    p = Program()
    p.emit(Opcode.MATMUL, Engine.TENSOR, chip((128, 128), dtype, space=Space.PSUM), chip((128, 128), DType.BF16),
           chip((128, 128), DType.BF16, offset=1024), accumulate=accumulate)
    return p


def test_a_matmul_writes_16_bit_psum_only_as_the_transpose_mode_of_trn2():
    _load(_transpose(DType.BF16), "trn2")  # transpose mode: bf16 P^T in PSUM
    with pytest.raises(NeuronRuntimeError, match="no transpose mode"):
        _load(_transpose(DType.BF16), "trn1")
    with pytest.raises(NeuronRuntimeError, match="transpose mode"):
        _load(_transpose(DType.BF16, accumulate=True), "trn2")


@pytest.mark.parametrize("target, transposes_in_bf16", [("trn2", True), ("trn1", False)])
def test_the_attention_kernel_transposes_bf16_p_in_transpose_mode_where_the_target_has_it(target, transposes_in_bf16):
    import torch

    from neuronc.compiler import CompileOptions, compile_exported

    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q, k, v)

    q, k, v = (torch.randn(1, 2, 256, 64).to(torch.bfloat16) for _ in range(3))
    neff = compile_exported(torch.export.export(Attention(), (q, k, v)), CompileOptions(opt_level=2, target=target)).neff
    matmuls = [i for i in neff.streams[(Engine.TENSOR, 0)] if i.opcode is Opcode.MATMUL]
    assert any(i.dst.dtype is DType.BF16 for i in matmuls) == transposes_in_bf16


def test_a_gather_with_no_on_chip_operand_is_priced_by_its_destination_not_a_crash():
    """Found by `fuzz_neff --seed 3` (case 123264: a DMA_GATHER's SBUF destination replaced by an HBM pattern): the
    cost of an indirect DMA looked for its on-chip side and raised StopIteration at load, before the rules refused it."""
    from neuronc.instruction_cost import transfer_bytes
    from neuronc.isa import AccessPattern, DType, Engine, Instruction, Opcode, Space

    table = AccessPattern(Space.HBM, DType.F32, 0, ((16, 4), (1, 16)))
    indices = AccessPattern(Space.HBM, DType.I32, 4096, ((1, 4), (1, 1)))
    gather = Instruction(Opcode.DMA_GATHER, Engine.DMA, (AccessPattern(Space.HBM, DType.F32, 8192, ((16, 4), (1, 16))),
                                                         table, indices))
    assert transfer_bytes(gather) == 4 * 16 * 4


def _dma_transpose(rows: int, cols: int, dtype: DType = DType.BF16, from_sbuf: bool = False) -> tuple:
    """x [rows, cols] in HBM transposed by a DMA into SBUF (from HBM, or from SBUF after a plain load), stored."""
    import numpy as np

    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (rows, cols), dtype)
    out = p.tensor("out", TensorKind.OUTPUT, (cols, rows), dtype)
    src, waits = hbm(x), ()
    if from_sbuf:
        src = chip((rows, cols), dtype, offset=4096)
        p.emit(Opcode.DMA_COPY, Engine.DMA, src, hbm(x), queue=1)
        waits = done(Engine.DMA, queue=1)
    transpose = p.emit(Opcode.DMA_TRANSPOSE, Engine.DMA, chip((cols, rows), dtype), src, waits=waits)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(out), chip((cols, rows), dtype), queue=2, waits=done(Engine.DMA))
    values = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols).astype(dtype.numpy)
    return p, transpose, values


@pytest.mark.parametrize("from_sbuf", [False, True], ids=["hbm-to-sbuf", "sbuf-to-sbuf"])
def test_a_dma_transpose_gives_the_transpose_bit_for_bit(from_sbuf):
    import numpy as np

    p, _, x = _dma_transpose(64, 128, from_sbuf=from_sbuf)
    out = _load(p, "trn2").run([x]).outputs[0]
    assert out.shape == (128, 64)
    assert np.array_equal(out.view(np.uint16), x.T.view(np.uint16))


def test_a_dma_transpose_runs_at_the_documented_fraction_of_a_queues_rate():
    _, from_hbm, _ = _dma_transpose(512, 128)  # destination [128, 512]: 32 full units
    _, from_sbuf, _ = _dma_transpose(512, 128, from_sbuf=True)
    moved = 128 * 512 * 2
    assert instruction_cost_ns(from_hbm, TRN2) == pytest.approx(TRN2.dma_fixed_ns + moved / (0.9 * 23.0))
    assert instruction_cost_ns(from_sbuf, TRN2) == pytest.approx(TRN2.dma_fixed_ns + moved / (0.5 * 23.0))
    _, half, _ = _dma_transpose(512, 64)  # 64 partitions: the same units, half of each empty
    assert instruction_cost_ns(half, TRN2) == pytest.approx(instruction_cost_ns(from_hbm, TRN2))


@pytest.mark.parametrize("target, rows, cols, dtype, problem", [
    ("trn1", 64, 128, DType.BF16, "trn1 has no DMA transpose"),
    ("trn2", 64, 128, DType.F32, "2-byte type"),
    ("trn2", 40, 128, DType.BF16, "tiles of 16"),
], ids=["trn1", "fp32", "partial-unit"])
def test_a_dma_transpose_outside_the_documented_rules_is_refused_at_load(target, rows, cols, dtype, problem):
    p, _, _ = _dma_transpose(rows, cols, dtype)
    with pytest.raises(NeuronRuntimeError, match=problem):
        _load(p, target)
