"""Codegen: every op is a real tiled kernel that keeps the NeuronCore's tile rules, and the
semaphore waits the sync pass inserts are the ones that make the answer right."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from neuronc.compiler import CompileOptions, compile_exported, compile_graph
from neuronc.errors import NeuronRuntimeError
from neuronc.isa import ActFunc, Engine, Opcode, Space
from neuronc import ir
from neuronc.ir import Op
from neuronc.passes import tiling
from neuronc.targets import get_target
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_matches_eager, compile_module, compiled_outputs, zoo_graph


class Linear(torch.nn.Module):
    def __init__(self, k=300, n=700):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    model, x = Linear().eval(), torch.randn(200, 300)
    return compile_exported(torch.export.export(model, (x,))), model, x


def _instructions(neff):
    return [inst for stream in neff.streams.values() for inst in stream]


def test_matmuls_are_tiled_to_the_tensor_engine_limits(linear):
    compiled, model, x = linear
    target = get_target("trn2")
    matmuls = [i for i in _instructions(compiled.neff) if i.opcode == Opcode.MATMUL]
    for inst in matmuls:
        dst, stationary, moving = inst.operands
        k, m = stationary.shape
        assert k <= target.matmul_max_k and m <= target.matmul_max_m
        assert moving.shape[0] == k and moving.shape[1] <= target.matmul_max_n
        assert dst.space == Space.PSUM and stationary.space == moving.space == Space.SBUF
    # 200 x 300 @ 300 x 700: M in 2 tiles, N in 2 tiles, K in 3 accumulating tiles
    assert len(matmuls) == 2 * 2 * 3
    assert [i.accumulate for i in matmuls[:3]] == [False, True, True]
    out = run_neff(compiled.neff, [x.numpy()]).outputs[0]
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-4, atol=1e-5)


def test_every_on_chip_operand_fits_the_partitions(zoo_model):
    name, model, inputs, _ = zoo_model
    neff = compile_exported(torch.export.export(model, inputs)).neff
    parts = get_target(neff.target).partitions
    for inst in _instructions(neff):
        for ap in inst.operands:
            if ap.space != Space.HBM:
                assert ap.partition + ap.partitions <= parts


def test_convolution_and_pooling_become_matmuls_and_window_reductions():
    graph = compile_graph(zoo_graph("cnn"), CompileOptions()).graph
    ops = {n.op for n in graph.nodes()}
    assert Op.CONVOLUTION not in ops and Op.REDUCE_WINDOW not in ops
    assert Op.MATMUL in ops and Op.REDUCE_LAST in ops and Op.VIEW in ops


def test_dropping_the_semaphore_waits_is_never_silently_right(linear):
    compiled, model, x = linear
    neff = compiled.neff
    assert any(inst.waits for inst in _instructions(neff))
    unsynchronised = dataclasses.replace(neff, streams={
        key: [dataclasses.replace(inst, waits=()) for inst in stream] for key, stream in neff.streams.items()})
    try:
        out = run_neff(unsynchronised, [x.numpy()]).outputs[0]
    except NeuronRuntimeError as err:  # the race is detected: a read of on-chip memory not yet written
        assert "missing semaphore wait" in str(err), err
    else:
        assert not np.allclose(out, model(x).detach().numpy(), rtol=1e-4, atol=1e-5, equal_nan=False)


def test_dma_moves_data_between_hbm_and_sbuf_only_through_dma_queues(linear):
    compiled, _, _ = linear
    for inst in _instructions(compiled.neff):
        touches_hbm = any(ap.space == Space.HBM for ap in inst.operands)
        assert touches_hbm == (inst.engine == Engine.DMA)


@pytest.mark.parametrize("partition, rows, columns", [(0, 128, 768), (64, 64, 4096), (3, 100, 2048)])
def test_a_tile_moved_by_slices_is_cut_at_the_sync_pass_partition_groups(partition, rows, columns):
    """Slices that share a partition group would be ordered one after the other by the sync pass."""
    from neuronc.codegen.access import dma_slices
    from neuronc.codegen.sync import partition_group
    from neuronc.isa import AccessPattern, DType

    target = get_target("trn2")
    tile = AccessPattern(Space.SBUF, DType.BF16, 0, ((1, rows), (1, columns)), partition=partition)
    slices = dma_slices(target, tile)
    assert len(slices) > 1 and slices[0][0] == 0 and slices[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))  # contiguous, in order
    group = partition_group(target)
    groups = [set(range((partition + p0) // group, (partition + p1 - 1) // group + 1)) for p0, p1 in slices]
    assert all(not (g & h) for g, h in zip(groups, groups[1:]))


def test_an_epilogue_step_goes_to_the_engine_that_finishes_it_first():
    """A step waiting for an input made late is not put on the least loaded engine if another one, loaded
    but faster, ends it sooner; and a step never starts before its inputs are made."""
    from neuronc import ir
    from neuronc.codegen.elementwise import StepBalancer
    from neuronc.codegen.emitter import Emitter
    from neuronc.isa import DType
    from neuronc.neff.program import DebugLoc

    target = get_target("trn2")
    em = Emitter(target)
    em.begin_kernel("epilogue", ("multiply",), DebugLoc())
    src, out = (em.sbuf_pool(DType.F32, 512, bufs=1).next().ap(128, 512) for _ in range(2))
    scale = ir.Step(Op.MULTIPLY, (("input", 0), ("imm", 0.5)), DType.F32, {})  # Vector, GpSimd or Scalar
    balancer = StepBalancer(em)
    balancer.busy.update({Engine.VECTOR: 0.0, Engine.GPSIMD: 900.0, Engine.SCALAR: 1000.0})
    done = balancer.compute(scale, out, [src, 0.5], None, None, ready=1000.0)
    assert em.instructions[-1].engine is Engine.GPSIMD  # free by 1000 ns like Vector, and quicker on trn2
    cycles = max(target.elementwise_min_interval_cycles, 512)  # one pass over 512 elements per partition
    assert done == pytest.approx(1000.0 + cycles / target.gpsimd_ghz)
    assert balancer.busy[Engine.GPSIMD] == done and balancer.busy[Engine.VECTOR] == 0.0


class NormThenLinear(torch.nn.Module):
    def __init__(self, width=256, out=512):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(width), torch.nn.Linear(width, out)

    def forward(self, x):
        return self.fc(self.norm(x))


def test_a_kernel_loads_its_first_weights_while_the_previous_kernel_runs():
    torch.manual_seed(0)
    model, x = NormThenLinear().eval(), torch.randn(256, 256)
    program = torch.export.export(model, (x,))
    for level, prefetched in ((0, False), (2, True)):
        neff = compile_exported(program, CompileOptions(opt_level=level)).neff
        # a queue runs in program order: a later kernel's load ahead of an earlier kernel's transfer
        ahead = any(b.kernel < a.kernel for (engine, _), stream in neff.streams.items() if engine == Engine.DMA
                    for a, b in zip(stream, stream[1:]))
        assert ahead == prefetched, level
        out = run_neff(neff, [x.numpy()]).outputs[0]  # the runtime refuses any race the move would cause
        assert_matches_eager(torch.from_numpy(out), model(x))



def _loads_ahead_of_the_previous_kernel(neff) -> int:
    """How many (load of kernel k, transfer of kernel k - 1) pairs a DMA queue runs in that order."""
    count = 0
    for (engine, _), stream in neff.streams.items():
        if engine == Engine.DMA:
            for n, load in enumerate(stream):
                if load.operands[1].space == Space.HBM and load.operands[0].space == Space.SBUF:
                    count += sum(later.kernel == load.kernel - 1 for later in stream[n + 1:])
    return count


def test_loads_go_into_the_time_their_queue_waits_for_the_previous_kernel(monkeypatch):
    """codegen.schedule.into_idle_queue_time (-O3): from the estimated timeline, loads that prefetch_loads' program
    order kept behind the previous kernel's transfers run in the time their queue waits for that kernel's compute;
    the program is faster for it, and its outputs are bit for bit those of the program in prefetch_loads' order
    (the runtime refuses a race). -O2 does not pay the second sync pass and estimate it costs. 1024 tokens: at 512
    the DMA transposes of a K tile side by side (docs/performance.md, issue 16, part 46) leave no queue time to fill."""
    import neuronc.codegen

    torch.manual_seed(0)
    model = zoo.TransformerBlock(256, 4).to(torch.bfloat16).eval()
    x = torch.randn(1, 1024, 256, dtype=torch.bfloat16)
    placed, (out,) = compiled_outputs(model, (x,), opt_level=3)
    placing = []
    monkeypatch.setattr(neuronc.codegen, "into_idle_queue_time", lambda *args: placing.append(args) and None)
    in_program_order, (expected,) = compiled_outputs(model, (x,), opt_level=3)
    assert placing  # -O3 looked for idle queue time
    placing.clear()
    compile_module(model, (x,))
    assert not placing  # -O2 does not
    assert placed.neff.estimated_ns < in_program_order.neff.estimated_ns
    assert (_loads_ahead_of_the_previous_kernel(placed.neff)
            > _loads_ahead_of_the_previous_kernel(in_program_order.neff))
    assert torch.equal(out, expected)
    with torch.no_grad():
        assert_matches_eager(out, model(x))


def _load_queues(neff) -> list:
    """The DMA queue of each load (HBM -> SBUF) of a program, stream by stream in their order."""
    return sorted(inst.queue for stream in neff.streams.values() for inst in stream
                  if inst.opcode == Opcode.DMA_COPY and inst.operands[1].space == Space.HBM
                  and inst.operands[0].space == Space.SBUF)


def test_a_load_goes_into_the_idle_time_of_another_queue_when_it_ends_sooner_there(monkeypatch):
    """codegen.schedule.into_idle_queue_time (-O3) may put a load on another DMA queue than the kernel gave it, where
    the timeline says it ends sooner without delaying that queue's next transfer: a ResNet basic block (fp32, two
    images of 28 x 28) is faster for it than with each load kept on its own queue, and its outputs are bit for bit
    the same (the sync pass orders the moved loads)."""
    import neuronc.codegen.schedule

    torch.manual_seed(0)
    model = zoo.BasicBlock(64, 64).eval()
    x = torch.randn(2, 64, 28, 28)
    requeued, (out,) = compiled_outputs(model, (x,), opt_level=3)
    monkeypatch.setattr(neuronc.codegen.schedule, "_queues_for", lambda load, on_queue: [load.stream])
    own_queues, (expected,) = compiled_outputs(model, (x,), opt_level=3)
    assert requeued.neff.estimated_ns < own_queues.neff.estimated_ns
    assert _load_queues(requeued.neff) != _load_queues(own_queues.neff)
    assert torch.equal(out, expected)
    with torch.no_grad():
        assert_matches_eager(out, model(x))


def test_a_program_of_one_kernel_is_the_same_neff_with_or_without_the_prefetch():
    """A load moves only into the kernel before its own: one kernel's program keeps its emitted order (the eager
    path's programs; codegen.schedule returns it without walking it)."""
    from neuronc.codegen import generate
    from neuronc.frontend.aten_lowering import lower
    from neuronc.passes.memory_plan import plan_memory

    lowered = lower(torch.ops.aten.mm.default, (torch.randn(64, 256), torch.randn(256, 384)), {}, frozenset(), "mm")
    optimised = compile_graph(lowered.graph, CompileOptions()).graph

    plan = plan_memory(optimised)
    with_prefetch, without = (generate(optimised, plan, get_target(), prefetch=p) for p in (True, False))
    assert len(with_prefetch.kernels) == 1
    assert with_prefetch.streams == without.streams

def _hbm_tensor(rows=512, cols=768):
    from neuronc.isa import DType
    from neuronc.neff.program import TensorEntry, TensorKind

    return TensorEntry("out", TensorKind.SCRATCH, DType.BF16, (rows, cols), 0)


def _store(queue, first_row, rows, first_col, cols, width=768):
    """A DMA on `queue` writing [rows, cols] of a row-major bf16 [*, width] HBM tensor from SBUF."""
    from neuronc.isa import AccessPattern, DType, Instruction

    dst = AccessPattern(Space.HBM, DType.BF16, (first_row * width + first_col) * 2, ((width, rows), (1, cols)))
    src = AccessPattern(Space.SBUF, DType.BF16, queue * 4096, ((1, rows), (1, cols)))
    return Instruction(Opcode.DMA_COPY, Engine.DMA, (dst, src), queue=queue)


def test_stores_to_different_columns_of_the_same_rows_do_not_wait_for_each_other():
    """Two pairs of attention heads' outputs, say (a K tile of columns each): a reader of both waits for both."""
    from neuronc.codegen.sync import insert_waits
    from neuronc.isa import AccessPattern, DType, Instruction

    heads01, heads23 = _store(0, 0, 128, 0, 128), _store(1, 0, 128, 128, 128)
    both = AccessPattern(Space.HBM, DType.BF16, 0, ((768, 128), (1, 256)))
    reader = Instruction(Opcode.DMA_COPY, Engine.DMA, (AccessPattern(Space.SBUF, DType.BF16, 65536, ((1, 128), (1, 256))),
                                                       both), queue=2)
    insert_waits([heads01, heads23, reader], [_hbm_tensor()], get_target("trn2"))
    assert heads23.waits == ()
    assert {(w.engine, w.queue) for w in reader.waits} == {(Engine.DMA, 0), (Engine.DMA, 1)}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_sync_pass_orders_any_two_hbm_accesses_that_share_a_byte(data):
    """Whatever their shapes (row blocks, column blocks, transposed element by element), two writes touching a
    common byte of a tensor are ordered (the sync pass tracks HBM by pages of rows and column blocks)."""
    from neuronc.codegen.sync import insert_waits
    from neuronc.isa import AccessPattern, DType, Instruction

    rows, cols = 64, 768

    def access():
        first_row, first_col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
        n_rows = data.draw(st.integers(1, rows - first_row))
        n_cols = data.draw(st.integers(1, cols - first_col))
        if data.draw(st.booleans()):  # [n_cols, n_rows] read transposed: one element of each row at a time
            dims = ((1, min(n_cols, 128)), (cols, n_rows))
        else:
            dims = ((cols, min(n_rows, 128)), (1, n_cols))
        return AccessPattern(Space.HBM, DType.BF16, (first_row * cols + first_col) * 2, dims)

    def elements(ap):
        start = ap.offset // 2
        (s0, n0), (s1, n1) = ap.dims
        return {start + i * s0 + j * s1 for i in range(n0) for j in range(n1)}

    a, b = access(), access()
    writes = [Instruction(Opcode.DMA_COPY, Engine.DMA, (ap, AccessPattern(Space.SBUF, DType.BF16, q * 65536, ap.dims)),
                          queue=q) for q, ap in enumerate((a, b))]
    insert_waits(writes, [_hbm_tensor(rows, cols)], get_target("trn2"))
    if elements(a) & elements(b):
        assert writes[1].waits, (a, b)


def test_the_8_row_pieces_of_a_big_tensors_row_tile_stored_from_four_queues_do_not_wait_for_each_other():
    """A [4096, 4096] layer-norm's output row tile goes out in pieces of 8 rows on queues 0-3: no piece shares a
    byte with another, so none waits (a grid of 32-row cells made each wait for the one before); a reader of the
    32 rows waits for all four."""
    from neuronc.codegen.sync import insert_waits
    from neuronc.isa import AccessPattern, DType, Instruction

    pieces = [_store(q, 8 * q, 8, 0, 4096, width=4096) for q in range(4)]
    rows = AccessPattern(Space.HBM, DType.BF16, 0, ((4096, 32), (1, 4096)))
    reader = Instruction(Opcode.DMA_COPY, Engine.DMA, (AccessPattern(Space.SBUF, DType.BF16, 65536, ((1, 32), (1, 4096))),
                                                       rows), queue=4)
    insert_waits([*pieces, reader], [_hbm_tensor(4096, 4096)], get_target("trn2"))
    assert all(piece.waits == () for piece in pieces)
    assert {(w.engine, w.queue) for w in reader.waits} == {(Engine.DMA, q) for q in range(4)}


def test_a_concatenates_row_blocks_do_not_wait_for_each_other_under_a_reader_cutting_columns_finely():
    """The QKV gradient's concatenate ([512, 2304] bf16) stores blocks of 21 or 22 rows of each third on 16
    queues while the next matmul reads it by 8 rows of 128 columns: ~1,600 cells of exact cuts. On a grid capped at
    1,024 cells the rows were rounded to powers of two and blocks that share no byte waited for each other."""
    from neuronc.codegen.sync import insert_waits
    from neuronc.isa import AccessPattern, DType, Instruction

    width, starts = 2304, [0] + [sum(21 + (b % 3 == 2) for b in range(n)) for n in range(1, 24)] + [512]
    stores = [_store((3 * b + third) % 16, first, stop - first, 768 * third, 768, width=width)
              for b, (first, stop) in enumerate(zip(starts, starts[1:])) for third in range(3)]
    reads = [Instruction(Opcode.DMA_COPY, Engine.DMA,
                         (AccessPattern(Space.SBUF, DType.BF16, 65536, ((1, 8), (1, 128))),
                          AccessPattern(Space.HBM, DType.BF16, (8 * r * width + 128 * c) * 2, ((width, 8), (1, 128)))),
                         queue=(r + c) % 16) for r in range(64) for c in range(18)]
    insert_waits([*stores, *reads], [_hbm_tensor(512, width)], get_target("trn2"))
    assert all(store.waits == () for store in stores)
    assert (Engine.DMA, 0) in {(w.engine, w.queue) for w in reads[1].waits}  # rows 0-7, columns 128-255: store 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_sync_pass_orders_every_pair_of_accesses_that_share_a_byte_on_a_grid_of_any_size(data):
    """Loads and stores of a tensor, on one queue each: whenever two share a byte and one writes, the later one comes
    after the earlier (directly or through other waits), also when the tensor's cells are capped below what its
    accesses' boundaries would cut (the grid coarsened)."""
    from unittest import mock

    from neuronc.codegen import sync
    from neuronc.isa import AccessPattern, DType, Instruction

    rows, cols = 64, 96

    def access():
        first_row, first_col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
        n_rows = data.draw(st.integers(1, rows - first_row))
        n_cols = data.draw(st.integers(1, cols - first_col))
        shape = data.draw(st.sampled_from(["rows", "transposed", "strided"]))
        if shape == "transposed":
            dims = ((1, n_cols), (cols, n_rows))
        elif shape == "strided":  # every other column: bytes between its elements are not its own
            dims = ((cols, n_rows), (2, max(1, n_cols // 2)))
        else:
            dims = ((cols, n_rows), (1, n_cols))
        return AccessPattern(Space.HBM, DType.BF16, (first_row * cols + first_col) * 2, dims)

    def elements(ap):
        start = ap.offset // 2
        (s0, n0), (s1, n1) = ap.dims
        return {start + i * s0 + j * s1 for i in range(n0) for j in range(n1)}

    accesses = [(access(), data.draw(st.booleans())) for _ in range(data.draw(st.integers(2, 5)))]
    program = []
    for q, (ap, writes) in enumerate(accesses):
        on_chip = AccessPattern(Space.SBUF, DType.BF16, 0, ((1, 1), (1, ap.num_elements)), partition=q * 16)
        program.append(Instruction(Opcode.DMA_COPY, Engine.DMA, (ap, on_chip) if writes else (on_chip, ap), queue=q))
    with mock.patch.object(sync, "HBM_CELLS_PER_TENSOR", data.draw(st.sampled_from([1, 3, 8, 1024]))):
        sync.insert_waits(program, [_hbm_tensor(rows, cols)], get_target("trn2"))
    after = [{w.queue for w in inst.waits} for inst in program]  # each queue holds one instruction
    for j in range(len(program)):
        for i in list(after[j]):
            after[j] |= after[i]  # i < j: its own set is complete
    for j, (b, b_writes) in enumerate(accesses):
        for i, (a, a_writes) in enumerate(accesses[:j]):
            if (a_writes or b_writes) and elements(a) & elements(b):
                assert i in after[j], (a, b)


def test_an_attention_output_projection_loads_the_early_heads_columns_while_the_last_heads_run():
    """The projection's A^T is loaded K tile by K tile, each waiting only for its heads' stores, so loading the
    early heads' columns starts before the attention ends (on the estimated timeline: a load that waited for the
    whole attention would start after its last store); the block matches eager."""
    from neuronc.passes.cost_model import replay
    from neuronc.passes.tiling import loads_a_by_k_tile

    torch.manual_seed(0)
    model = zoo.TransformerBlock(width=512, heads=8).eval().to(torch.bfloat16)
    x = torch.randn(1, 256, 512).to(torch.bfloat16)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2))
    projection = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and ir.unreshaped(n.inputs[0]).op is Op.ATTENTION]
    assert len(projection) == 1 and loads_a_by_k_tile(projection[0])
    names = [k.name for k in compiled.neff.kernels]
    attention = next(i for i, name in enumerate(names) if name.startswith("attention"))
    assert names[attention + 1].startswith("matmul")  # the projection
    timeline = list(replay(compiled.neff.streams, get_target(compiled.neff.target)))
    stored = [inst.operands[0].offset for inst, _, _ in timeline
              if inst.kernel == attention and inst.operands[0].space == Space.HBM]
    attention_end = max(end for inst, _, end in timeline if inst.kernel == attention)
    heads_loading = [start for inst, start, _ in timeline if inst.kernel == attention + 1
                     and inst.engine == Engine.DMA and min(stored) <= inst.operands[1].offset <= max(stored)]
    assert min(heads_loading) < attention_end
    out = run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)], model(x))


class _SwiGLU(torch.nn.Module):
    """A SwiGLU MLP, 256 -> 1024 -> 256 without biases: its down projection reads h across its rows."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(256, 1024, bias=False), torch.nn.Linear(256, 1024, bias=False),
                                         torch.nn.Linear(1024, 256, bias=False))

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_a_swiglu_down_projection_starts_on_the_up_projections_early_columns():
    """The down projection reads h = silu(x Wg) * (x Wu) across its rows; the up projection writes h column strip
    by column strip, so the down projection loads h^T K tile by K tile and its first loads start before the up
    projection's kernel ends (a whole-strip load would wait for its last store); the MLP matches eager."""
    from neuronc.passes.cost_model import replay
    from neuronc.passes.tiling import loads_a_by_k_tile, matmul_plan
    from neuronc.plans import MatmulTiling

    torch.manual_seed(0)
    model = _SwiGLU().eval().to(torch.bfloat16)
    x = torch.randn(256, 256).to(torch.bfloat16)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2))
    down = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and n.shape[-1] == 256]
    assert len(down) == 1 and loads_a_by_k_tile(down[0])
    timeline = list(replay(compiled.neff.streams, get_target(compiled.neff.target)))
    last = len(compiled.neff.kernels) - 1
    up_end = max(end for inst, _, end in timeline if inst.kernel == last - 1)
    stored = [inst.operands[0].offset for inst, _, _ in timeline
              if inst.kernel == last - 1 and inst.operands[0].space == Space.HBM]
    h_loads = [start for inst, start, _ in timeline if inst.kernel == last and inst.engine == Engine.DMA
               and min(stored) <= inst.operands[1].offset <= max(stored)]
    assert h_loads and min(h_loads) < up_end
    # only a plan loading h^T as one strip loads it by K tile: in strips of fewer rows, the later strips load
    # after the up projection is done (one DMA each, not one per K tile)
    assert down[0].attrs["plan"].a_by_k_tile and down[0].attrs["tiling"].block * 128 >= down[0].shape[1]
    assert not matmul_plan(down[0], MatmulTiling("a", 1, 128, 512, 128, 2)).a_by_k_tile
    assert not matmul_plan(down[0], MatmulTiling("b", 1, 128, 512, 128, 2)).a_by_k_tile
    out = run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)], model(x))


def test_a_matmul_loading_a_t_by_k_tile_accumulates_its_first_output_tiles_k_tile_by_k_tile(monkeypatch):
    """The SwiGLU down projection loads h^T K tile by K tile, as the up projection writes h column strip by strip:
    its first two output tiles take each K tile's matmuls in turn (codegen/matmul.py `k_tile_lead`), so the Tensor
    engine multiplies the K tiles already in for both while the last ones load, instead of for one. Each element
    sums the same K tiles in the same order, so the outputs are bit for bit those of the tile-by-tile order, and
    eager's values."""
    from neuronc.codegen import matmul as matmul_codegen

    torch.manual_seed(0)
    model = _SwiGLU().eval().to(torch.bfloat16)
    x = torch.randn(256, 256).to(torch.bfloat16)
    compiled, (out,) = compiled_outputs(model, (x,))
    down = len(compiled.neff.kernels) - 1
    matmuls = [i for i in compiled.neff.streams[(Engine.TENSOR, 0)] if i.kernel == down and i.opcode == Opcode.MATMUL]
    k_tiles = 1024 // 128
    first = [(i.dst.partition, i.dst.offset) for i in matmuls[:2 * k_tiles]]
    assert first[0] != first[1]
    assert first[0::2] == [first[0]] * k_tiles and first[1::2] == [first[1]] * k_tiles  # K tile j for both, then j + 1
    monkeypatch.setattr(matmul_codegen, "K_TILE_LEAD", 1)  # one output tile's K tiles after the other's
    _, (tile_by_tile,) = compiled_outputs(model, (x,))
    assert torch.equal(out, tile_by_tile)
    with torch.no_grad():
        assert_matches_eager(out, model(x))


def test_a_scatter_into_a_flat_tensor_copies_its_base_at_dma_bandwidth_not_element_by_element():
    """A scatter into a one-column table (cross-entropy's backward scatters into the flattened logits) copies its
    base as the dense bytes it is, in blocks over the DMA queues: on the estimated timeline the copy takes about
    what reading and writing its bytes needs at the core's HBM bandwidth. Moved as 4-byte rows, each paying a
    DMA's per-row overhead, it took 480 times that (272 ms for GPT-2's 512 x 50304 logits). Matches eager."""
    from neuronc.passes.cost_model import replay

    class Scatter(torch.nn.Module):
        def forward(self, x, i, v):
            return x.index_put((i,), v, accumulate=True)

    torch.manual_seed(0)
    x, i, v = torch.randn(512 * 1000), torch.randint(0, 512 * 1000, (300,)), torch.randn(300)
    compiled = compile_exported(torch.export.export(Scatter(), (x, i, v)))
    target = get_target(compiled.neff.target)
    kernel = next(k for k, info in enumerate(compiled.neff.kernels) if info.name.startswith("scatter_rows"))
    copies = [(start, end) for inst, start, end in replay(compiled.neff.streams, target)
              if inst.kernel == kernel and inst.opcode == Opcode.DMA_COPY
              and all(operand.space == Space.HBM for operand in inst.operands)]
    at_bandwidth = 2 * x.numel() * x.element_size() / target.hbm_gbps  # read once, written once
    assert max(end for _, end in copies) - min(start for start, _ in copies) < 2 * at_bandwidth + 2 * target.dma_fixed_ns
    out = run_neff(compiled.neff, [x.numpy(), i.numpy(), v.numpy()]).outputs[0]
    np.testing.assert_array_equal(out, x.index_put((i,), v, accumulate=True).numpy())


def test_a_layer_norms_last_row_tiles_are_stored_in_slices_of_about_one_issues_worth():
    """GPT-2's layer-norm ([512, 768] bf16): the kernel ends with its last row tiles' stores, each [128, 768] (6.6
    issues' worth of bytes: a DMA moves ~30 KB in its fixed cost's time). They go in 8 slices of 16 partitions,
    the divisor of the 16 partition groups nearest that in ratio, not 4 (rounded down: 1.6 issues each, the kernel
    ending ~2 us later); each slice a DMA of its own on its own queue. Matches eager."""
    torch.manual_seed(0)
    model = torch.nn.LayerNorm(768).eval().to(torch.bfloat16)
    x = torch.randn(512, 768).to(torch.bfloat16)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2))
    (output,) = [t for t in compiled.neff.tensors if t.kind.name == "OUTPUT"]
    last_rows = output.offset + 384 * 768 * 2  # rows 384..511: the last row tile
    last_tile = [inst for stream in compiled.neff.streams.values() for inst in stream
                 if inst.opcode == Opcode.DMA_COPY and inst.operands[0].space == Space.HBM
                 and last_rows <= inst.operands[0].offset < output.offset + output.nbytes]
    assert sorted(s.operands[1].partitions for s in last_tile) == [16] * 8
    assert len({s.queue for s in last_tile}) == 8
    out = run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)], model(x))


def _two_parts_loaded_and_first_matmul_early(compiled) -> None:
    """The program's strided loads (x^T's pieces: 512 tokens a row, one every 768 elements) are two parts of its 6
    K tiles, 4 then 2 (the second the fewest that keep 2 KiB a partition), each cut over all 16 queues, and its
    first matmul starts before the last of them ends."""
    from neuronc.passes.cost_model import replay

    timeline = list(replay(compiled.neff.streams, get_target(compiled.neff.target)))
    strided = [(inst, end) for inst, _, end in timeline if inst.opcode == Opcode.DMA_COPY
               and inst.operands[1].space == Space.HBM and inst.operands[1].dims[-1][0] != 1
               and inst.operands[1].dims[-1][1] > 1]
    assert sorted(inst.operands[1].dims[1][1] for inst, _ in strided) == [2] * 16 + [4] * 16  # K tiles per piece
    assert len({inst.queue for inst, _ in strided}) == 16
    first_matmul = min(start for inst, start, _ in timeline if inst.opcode == Opcode.MATMUL)
    assert first_matmul < max(end for _, end in strided)


def _gpt2_mlp_bf16(name: str) -> tuple:
    """(model, x, compiled at -O2) of GPT-2's MLP (768 -> 3072 -> 768, 512 tokens, bf16): one chained kernel."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768))
    model = model.eval().to(torch.bfloat16)
    x = torch.randn(512, 768).to(torch.bfloat16)
    return model, x, compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2, name=name))


def _matches_eager_bf16(compiled, model, x) -> None:
    out = run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)], model(x))


def test_a_gpt2_mlp_chains_x_transposed_loads_in_two_parts_over_every_queue_and_the_first_matmul_starts_on_the_first(
        monkeypatch):
    """The GPT-2 MLP chain's first matmul keeps x^T ([768, 512], read across x's rows: strided) resident as one
    B strip. It loads as two parts of its 6 K tiles, each cut over all 16 DMA queues, so the first output tile
    accumulates the first part's K tiles while the second part moves (loaded whole, its first matmul waited for
    all of x^T). Matches eager. (DMA transposes left out: on trn2 the price takes them for x^T since their chunks
    of a K tile run side by side, docs/performance.md issue 16 part 46; the subject here is the strided load, which
    a target without them or an fp32 operand keeps.)"""
    monkeypatch.setattr(tiling, "_transpose_options", lambda node, target: [])
    model, x, compiled = _gpt2_mlp_bf16("mlp_two_parts")
    (chained,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert chained.attrs["plan"].first.in_two_parts == "b"
    _two_parts_loaded_and_first_matmul_early(compiled)
    _matches_eager_bf16(compiled, model, x)


class _NormAndProjection(torch.nn.Module):
    """A layer-norm whose result is an output too (so it stays a kernel of its own: passes/norm_prologue.py) and
    the projection reading it."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(768), torch.nn.Linear(768, 2304)

    def forward(self, x):
        y = self.norm(x)
        return self.fc(y), y


def test_a_projection_after_a_layer_norm_loads_its_resident_a_transposed_in_two_parts(monkeypatch):
    """GPT-2's QKV projection reads the layer-norm's [512, 768] result as A, resident as one A^T strip (strided):
    it loads as two parts of its K tiles over every queue, the first matmul starting on the first. Matches eager.
    (The norm is also an output here, so -O2 would fold it into the projection as a stored prologue, which the
    price prefers: that pass is left out, as a program where the norm has other readers has it apart. DMA
    transposes too, which the price takes since part 46 of issue 16: the subject is the strided load.)"""
    from neuronc.passes import pipeline
    from neuronc.passes.norm_prologue import fold_saved_norms_into_matmuls

    monkeypatch.setitem(pipeline.PIPELINES, 2, [p for p in pipeline.PIPELINES[2] if p is not fold_saved_norms_into_matmuls])
    monkeypatch.setattr(tiling, "_transpose_options", lambda node, target: [])
    torch.manual_seed(0)
    model = _NormAndProjection().eval().to(torch.bfloat16)
    x = torch.randn(512, 768).to(torch.bfloat16)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2, name="ln_qkv_two_parts"))
    (projection,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert projection.attrs["plan"].in_two_parts == "a"
    _two_parts_loaded_and_first_matmul_early(compiled)
    outputs = run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16) for out in outputs],
                             list(model(x)))


def test_a_gpt2_mlp_chain_streams_its_first_matmuls_strips_four_deep_and_loads_the_seconds_strips_after_it(monkeypatch):
    """GPT-2's MLP (768 -> 3072 -> 768, 512 tokens, bf16) is one chained kernel. Its first matmul streams W1 in
    strips of one output tile's K tiles, about as long to load (with a DMA's fixed cost) as to multiply: the
    tiling gives them 4 buffers (offered to a chain's first matmul at -O2; the formula picks it). The second's
    strips after its early column are loaded once the first's matmuls are emitted, not halfway through the first,
    where they took the queues from the first's strips. Matches eager."""
    from neuronc.codegen import matmul as matmul_codegen

    loaded_during_first = []
    finish = matmul_codegen._EarlyColumn.finish

    def spy(self, pending):
        loaded_during_first.append(len(self.loaded))
        return finish(self, pending)

    monkeypatch.setattr(matmul_codegen._EarlyColumn, "finish", spy)
    model, x, compiled = _gpt2_mlp_bf16("mlp_chain")
    (chained,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert chained.attrs["chain"].attrs["tiling"].stream_bufs == 4
    assert loaded_during_first == [0]
    _matches_eager_bf16(compiled, model, x)


class _SmallBatchedMatmuls(torch.nn.Module):
    """The MoE model's per-slot expert matmuls: [batch, m, k] @ [batch, k, n], a GELU, times a weight per batch."""

    def forward(self, x, w, weight):
        return torch.nn.functional.gelu(torch.bmm(x, w)) * weight[:, None, None]


@pytest.mark.parametrize("batch,m,k,n", [(32, 1, 32, 64), (14, 3, 200, 48), (2, 16, 32, 32)])
def test_small_batched_matmul_results_share_output_tiles_with_the_bits_of_a_tile_per_batch(monkeypatch, batch, m, k, n):
    """Batches whose results are small are computed side by side in one output tile (one epilogue instruction and
    one store for several batches, not one each), leaving at least four tiles, and every output bit is the one a
    tile per batch gives. The second case has three rows per batch, two K tiles and a last tile of fewer batches;
    the third, two batches, keeps a tile per batch."""
    from neuronc.codegen import matmul

    torch.manual_seed(0)
    inputs = (torch.randn(batch, m, k), torch.randn(batch, k, n) / k ** 0.5, torch.rand(batch))
    program = torch.export.export(_SmallBatchedMatmuls(), inputs)
    side_by_side = compile_exported(program, CompileOptions(opt_level=2)).neff
    monkeypatch.setattr(matmul._Matmul, "batches_per_tile", lambda self: 1)
    tile_per_batch = compile_exported(program, CompileOptions(opt_level=2)).neff
    group = max(1, min(batch // 4, 128 // m, 512 // n))  # batches of an output tile: tile_m 128, tile_n 512

    def gelus(neff):
        return sum(i.opcode == Opcode.ACTIVATE and i.func == ActFunc.GELU for i in _instructions(neff))

    def stores(neff):  # a tile's store may be split by rows over queues
        return sum(i.opcode == Opcode.DMA_COPY and i.operands[0].space == Space.HBM for i in _instructions(neff))

    assert (gelus(tile_per_batch), gelus(side_by_side)) == (batch, -(-batch // group))
    assert stores(side_by_side) < stores(tile_per_batch) if group > 1 else stores(side_by_side) == stores(tile_per_batch)
    arrays = [x.numpy() for x in inputs]
    got, want = (run_neff(neff, arrays).outputs[0] for neff in (side_by_side, tile_per_batch))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert_matches_eager([torch.from_numpy(got)], _SmallBatchedMatmuls()(*inputs))
