"""Norms folded into the matmul that reads them (passes/norm_prologue.py, codegen/matmul.py `_prologued`): the
row-wise kernel's row tiles computed in the matmul's kernel and transposed on the Tensor engine into its
resident A^T, instead of stored to HBM and loaded back strided."""
from __future__ import annotations

import copy
import functools
from unittest import mock

import ml_dtypes
import numpy as np
import torch

from neuronc import ir_text
from benchmarks.roofline import _aot_graphs
from neuronc.compiler import CompileOptions, compile_exported, compile_fx
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.neff.program import TensorKind
from neuronc.ir import Op
from neuronc.codegen.matmul import TRANSPOSE_BANKS
from neuronc.isa import AluOp, DType, Engine, Opcode, Space
from neuronc.passes import pipeline, rowwise_schedule
from neuronc.passes.norm_prologue import fold_norms_into_matmuls, fold_saved_norms_into_matmuls
from neuronc.plans import ChainPlan, ProloguePlan
from runtime import run_neff
from tests import zoo
from tests.conftest import (assert_as_accurate_as_eager, assert_matches_eager, canonical, compile_module, run_pass,
                            run_program)

# A layer-norm over 256 features of 128 tokens (bf16) read by one projection (256 -> 384, a bias row): the graph
# -O2 hands the pass (fuse_rowwise's ROWWISE node with its plan), its weights given at run time.
_LAYER_NORM = """
graph @t(%0, %1, %2, %3, %4) {
  %0 = parameter() : 256xbf16 {index = 0, name = "ln.weight", kind = "input"}
  %1 = parameter() : 256xbf16 {index = 1, name = "ln.bias", kind = "input"}
  %2 = parameter() : 256x384xbf16 {index = 2, name = "proj.weight", kind = "input"}
  %3 = parameter() : 384xbf16 {index = 3, name = "proj.bias", kind = "input"}
  %4 = parameter() : 128x256xbf16 {index = 4, name = "x", kind = "input"}
  %5 = rowwise(%4, %0, %1) : 128x256xbf16 {
      body = (
          convert(in0) : f32, reduce_last(s0) : f32 {kind = "add"}, divide(s1, 256.0) : f32, subtract(s0, s2) : f32,
          multiply(s3, s3) : f32, reduce_last(s4) : f32 {kind = "add"}, divide(s5, 256.0) : f32,
          add(s6, 9.999999747378752e-06) : f32, rsqrt(s7) : f32, multiply(s3, s8) : f32, convert(in1) : f32,
          multiply(s9, s10) : f32, convert(in2) : f32, add(s11, s12) : f32, convert(s13) : bf16),
      views = ((0, (256, 1)), (0, (0, 1)), (0, (0, 1))),
      rows = 128,
      cols = 256,
      out_strides = (256, 1),
      schedule = Schedule(bufs=4, together=1, row_sum_on_scalar=true, row_steps_on_scalar=false, cut=0, shared_after=1),
      plan = RowwisePlan(
          schedule=Schedule(bufs=4, together=1, row_sum_on_scalar=true, row_steps_on_scalar=false, cut=0, shared_after=1),
          tile=TilePlan(
              instrs=(
                  (1, RowSum(src=("input", 0))), (2, Plain(args=(("step", 1), ("imm", 256.0)))),
                  (4, Summed(act=Op.MULTIPLY, src=("input", 0), row_sum=5, shift=("step", 2), negated=true)),
                  (6, Plain(args=(("step", 5), ("imm", 256.0)))),
                  (8, Act(act=Op.RSQRT, src=("step", 6), scale=1.0, bias=9.999999747378752e-06)),
                  (9, Alu2(a=("input", 0), b=("step", 2), op=Op.SUBTRACT, c=("step", 8), op1=Op.MULTIPLY)),
                  (13, Alu2(a=("step", 9), b=("input", 1), op=Op.MULTIPLY, c=("input", 2), op1=Op.ADD))),
              out_step=13, slots=((1, 0), (2, 1), (5, 0), (6, 2), (8, 0), (9, 0)),
              count=(("full", 1), ("row", 3), ("col", 0))),
          kinds=(
              "full", "row", "row", "full", "full", "row", "row", "row", "row", "full", "col", "full", "col", "full",
              "full"),
          tail=(), split_engines=(Engine.GPSIMD, Engine.VECTOR), needs_constants=false,
          scalar_steps=(false, false, true, true, true, false, true, true, false, true, false, true, false, true, false))}
  %6 = reshape(%5) : 1x128x256xbf16
  %7 = reshape(%2) : 1x256x384xbf16
  %8 = matmul(%6, %7, %3) : 1x128x384xbf16 {
      k = 256,
      views = (none, none, (0, (0, 0, 1))),
      epilogue = (convert(in0) : bf16,),
      bias_row = 1}
  %9 = reshape(%8) : 128x384xbf16
"""


def _program(tail: str) -> str:
    return _LAYER_NORM + tail + "\n}"


def test_a_norm_read_only_by_a_matmul_as_its_a_becomes_that_matmuls_prologue():
    folded = run_pass(fold_norms_into_matmuls, _program("  return %9"))
    graph = ir_text.parse(folded)
    assert sorted(n.op.name for n in graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE)) == ["MATMUL"]
    (matmul,) = [n for n in graph.nodes() if n.op is Op.MATMUL]
    prologue = matmul.attrs["prologue"]
    assert prologue.split == 3 and prologue.attrs["rows"] == 128 and prologue.attrs["cols"] == 256
    # the norm's inputs (x, its weight and bias), then the matmul's but A (W, its bias row)
    assert [x.attrs.get("name") for x in matmul.inputs[:3]] == ["x", "ln.weight", "ln.bias"]
    assert ir_text.parse(folded).nodes()[-1].shape == (128, 384)
    assert canonical(folded) == folded  # prints and parses back


def test_a_norm_that_is_also_an_output_is_folded_and_stored_by_the_matmuls_kernel_as_its_second_output():
    """A training graph saves the layer-norm's result for the backward: the kernel computes the norm as its
    prologue and also stores its row tiles (ProloguePlan.stored), the output its KERNEL_OUTPUT 1. That is the other
    pass's (priced): the fold of norms only a matmul reads leaves it alone."""
    program = _program("  return %9, %5")
    assert run_pass(fold_norms_into_matmuls, program) == canonical(program)
    folded = run_pass(fold_saved_norms_into_matmuls, program)
    graph = ir_text.parse(folded)
    assert Op.ROWWISE not in {n.op for n in graph.nodes()}
    (matmul,) = [n for n in graph.nodes() if n.op is Op.MATMUL]
    assert matmul.attrs["prologue"].stored
    assert matmul.attrs["outputs"] == (((1, 128, 384), DType.BF16), ((128, 256), DType.BF16))
    second = graph.outputs[1]
    assert second.op is Op.KERNEL_OUTPUT and second.inputs == (matmul,) and second.attrs["index"] == 1
    assert canonical(folded) == folded  # prints and parses back


class _SavedNorm(torch.nn.Module):
    """A layer-norm whose result is an output too (a training graph saves it for the weight's gradient)."""

    def __init__(self, width: int, out: int):
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(width), torch.nn.Linear(width, out)

    def forward(self, x):
        y = self.norm(x)
        return self.proj(y), y


def test_a_stored_norm_gives_the_bits_of_the_norm_and_the_matmul_apart_and_is_never_loaded():
    torch.manual_seed(0)
    model, x = _SavedNorm(768, 2304).eval().to(torch.bfloat16), torch.randn(512, 768).to(torch.bfloat16)
    with mock.patch.object(pipeline, "PRICED", ()):  # taken, not priced (the next test prices it)
        compiled = _compiled(torch.export.export(model, (x,)), "stored")
    assert len(compiled[2].neff.kernels) == 1 and len(compiled["apart"].neff.kernels) == 2
    inputs = [x.float().numpy().astype(ml_dtypes.bfloat16)]
    folded, apart = (run_neff(compiled[key].neff, inputs).outputs for key in (2, "apart"))
    assert len(folded) == len(apart) == 2
    for mine, theirs in zip(folded, apart):
        assert np.array_equal(np.asarray(mine).view(np.uint16), np.asarray(theirs).view(np.uint16))
    assert_matches_eager([torch.from_numpy(np.asarray(o).astype(np.float32)).to(torch.bfloat16) for o in folded],
                         model(x))
    neff = compiled[2].neff
    (norm,) = [t for t in neff.tensors if tuple(t.shape) == (512, 768) and t.name.startswith("output")]
    reads = [i for stream in neff.streams.values() for i in stream if i.engine is Engine.DMA
             and i.operands[1].space is Space.HBM and norm.offset <= i.operands[1].offset < norm.offset + norm.nbytes]
    assert not reads  # written once by the kernel, never loaded back


def _training_forward():
    """AOTAutograd's forward graph of a bf16 LayerNorm -> Linear -> GELU -> Linear (it saves the norm's result, h
    and gelu(h)) and its inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256)).to(torch.bfloat16)
    x = torch.randn(1, 256, 256).to(torch.bfloat16)
    forward, _ = _aot_graphs(model, (x,), True)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    generator = torch.Generator().manual_seed(1)
    # the weights ([out, in]) at nn.Linear's scale: unit-variance weights make sums the size of bf16's rounding steps
    inputs = [(torch.randn(n.meta["val"].shape, generator=generator) * (0.05 if n.meta["val"].dim() == 2 else 1.0))
              .to(n.meta["val"].dtype) for n in placeholders]
    return forward, inputs


class _Outputs(torch.nn.Module):
    """The outputs `made` of a graph module (those its compiled program makes, not inputs returned as given)."""

    def __init__(self, graph, made):
        super().__init__()
        self.graph, self.made = graph, made

    def forward(self, *inputs):
        outputs = self.graph(*inputs)
        return [outputs[k] for k in self.made]


def test_a_stored_norm_and_a_stored_epilogue_step_are_one_kernels_outputs_2_and_1_with_the_bits_apart():
    """The matmul reading a saved norm already stores h (its shared epilogue's step, output 1): the norm is folded
    as its prologue all the same and stored as output 2. One kernel makes gelu(h), h and the norm, with the bits of
    the norm's kernel and the matmul's apart and eager's values; neither h nor the norm is loaded back."""
    forward, inputs = _training_forward()
    with mock.patch.object(pipeline, "PRICED", ()):  # taken, not priced
        folded = compile_fx(copy.deepcopy(forward), CompileOptions(opt_level=2, name="stored_both"),
                            inputs_returned_as_given=True)
    (matmul,) = [n for n in folded.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("prologue")]
    assert matmul.attrs["prologue"].stored and matmul.attrs["plan"].matmul.stored_step is not None
    assert [shape[-2:] for shape, _ in matmul.attrs["outputs"]] == [(256, 1024), (256, 1024), (256, 256)]
    assert {n.attrs["index"] for n in folded.graph.nodes() if n.op is Op.KERNEL_OUTPUT and n.inputs[0] is matmul} \
        == {1, 2}
    assert Op.ROWWISE not in {n.op for n in folded.graph.nodes()} and Op.FUSED not in {n.op for n in folded.graph.nodes()}
    schedule = matmul.attrs["prologue"].attrs["schedule"]
    apart = [p for p in pipeline.PIPELINES[2] if p is not fold_saved_norms_into_matmuls]
    with mock.patch.dict(pipeline.PIPELINES, {2: apart}), mock.patch.object(
            rowwise_schedule, "choose_schedule", lambda *args, **kw: schedule):
        unfolded = compile_fx(copy.deepcopy(forward), CompileOptions(opt_level=2, name="stored_both_apart"),
                              inputs_returned_as_given=True)
    assert Op.ROWWISE in {n.op for n in unfolded.graph.nodes()}
    assert len(unfolded.neff.kernels) == len(folded.neff.kernels) + 1
    arrays = [to_numpy(t) for t in inputs]
    mine, theirs = (run_neff(c.neff, arrays).outputs for c in (folded, unfolded))
    made = [k for k, i in enumerate(folded.output_layout) if i is not None and not isinstance(i, tuple)]
    assert len(made) >= 4  # the result, the norm, h and gelu(h)
    for k in made:
        i, j = folded.output_layout[k], unfolded.output_layout[k]
        assert np.array_equal(np.asarray(mine[i]).view(np.uint8), np.asarray(theirs[j]).view(np.uint8))
    assert_as_accurate_as_eager([from_numpy(mine[folded.output_layout[k]]) for k in made],
                                _Outputs(forward, made), inputs)
    neff = folded.neff
    saved = [t for t in neff.tensors if t.kind is TensorKind.OUTPUT and tuple(t.shape)[-2:] in ((256, 256), (256, 1024))]
    read = {t.name for i in (i for stream in neff.streams.values() for i in stream if i.engine is Engine.DMA)
            for t in saved if i.operands[1].space is Space.HBM and t.offset <= i.operands[1].offset < t.offset + t.nbytes}
    stored = {n for n in folded.graph.nodes() if n.op is Op.KERNEL_OUTPUT and n.inputs[0] is matmul}
    assert len(saved) >= 3 and len(stored) == 2
    assert len(read) == 1  # gelu(h), read by the second matmul; the norm and h written once, never loaded back


def test_a_saved_norm_is_folded_only_where_the_cost_model_times_the_program_faster():
    torch.manual_seed(0)
    model, x = _SavedNorm(768, 2304).eval().to(torch.bfloat16), torch.randn(512, 768).to(torch.bfloat16)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=2, name="saved"))
    with_it, without = compiled.decisions["fold_saved_norms_into_matmuls"]  # both emitted and timed
    folded = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("prologue")]
    assert bool(folded) == (with_it < without)
    assert compiled.neff.estimated_ns == min(with_it, without)


def test_a_norm_read_by_two_matmuls_stays_a_kernel_of_its_own():
    program = _program("""  %10 = matmul(%6, %7, %3) : 1x128x384xbf16 {
      k = 256,
      views = (none, none, (0, (0, 0, 1))),
      epilogue = (convert(in0) : bf16,),
      bias_row = 1}
  return %9, %10""")
    assert run_pass(fold_norms_into_matmuls, program) == canonical(program)


def _layer_norm_projection(width: int, out: int, tokens: int) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, out)).eval().to(torch.bfloat16)
    return model, torch.randn(tokens, width).to(torch.bfloat16)


def _run(compiled, x) -> np.ndarray:
    return run_neff(compiled.neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]


def _compiled(program, name: str) -> dict:
    """The program at -O2 (key 2) and at -O2 without the norm folds (key "apart": the norm a row-wise kernel
    of its own under the prologue's schedule, its result stored and loaded by the matmul). The folded kernel must
    give the latter's bits: the norm's row tiles are computed by the same plan and schedule. (-O0's bits are no
    reference: -O2's norms may make their mean and variance with BN_STATS / BN_AGGR, which round otherwise than -O0's
    row sums, in the row tiles their schedule says.)"""
    folded = compile_exported(program, CompileOptions(opt_level=2, name=name))
    (matmul,) = [n for n in folded.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("prologue")]
    schedule = matmul.attrs["prologue"].attrs["schedule"]
    apart = [p for p in pipeline.PIPELINES[2] if p not in (fold_norms_into_matmuls, fold_saved_norms_into_matmuls)]
    with mock.patch.dict(pipeline.PIPELINES, {2: apart}), mock.patch.object(
            rowwise_schedule, "choose_schedule", lambda *args, **kw: schedule):
        unfolded = compile_exported(program, CompileOptions(opt_level=2, name=f"{name}_apart"))
    return {2: folded, "apart": unfolded}


def test_gpt2s_layer_norm_and_qkv_projection_are_one_kernel_giving_the_baseline_bits():
    """GPT-2's layer-norm -> QKV projection (768 -> 2304, 512 tokens, bf16) at -O2: one kernel, whose Tensor engine
    transposes the norm's 4 row tiles (6 K tiles each) into A^T and loads no A^T from HBM; the same bits as the norm
    and the projection in kernels of their own, and eager's values."""
    model, x = _layer_norm_projection(768, 2304, 512)
    program = torch.export.export(model, (x,))
    compiled = _compiled(program, "ln_qkv")
    assert len(compiled["apart"].neff.kernels) == 2
    (kernel,) = compiled[2].neff.kernels
    (matmul,) = [n for n in compiled[2].graph.nodes() if n.op is Op.MATMUL]
    assert isinstance(matmul.attrs["plan"], ProloguePlan)
    transposes = [i for i in compiled[2].neff.streams[(Engine.TENSOR, 0)]
                  if i.opcode == Opcode.MATMUL and i.operands[0].partitions == 128 and i.operands[2].dims[1][1] == 128
                  and i.operands[1].dims[1][1] == 128 and i.operands[0].dims[1][1] == 128]
    assert len(transposes) == 4 * 6
    outputs = [_run(compiled[level], x) for level in ("apart", 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(x))


@functools.lru_cache(maxsize=1)
def _layer_norm_mlp() -> tuple:
    """GPT-2's second layer-norm -> MLP (768 -> 3072 -> GELU -> 768, 512 tokens, bf16), its input, and its
    programs at -O2 with and without the norm folded (`_compiled`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(768), torch.nn.Linear(768, 3072), torch.nn.GELU(),
                                torch.nn.Linear(3072, 768)).eval().to(torch.bfloat16)
    x = torch.randn(512, 768).to(torch.bfloat16)
    program = torch.export.export(model, (x,))
    return model, x, _compiled(program, "ln_mlp")


def test_gpt2s_layer_norm_and_mlp_chain_are_one_kernel_giving_the_baseline_bits():
    """GPT-2's second layer-norm -> MLP at -O2: one kernel, the chain (passes/matmul_chain.py) whose first matmul's
    resident x^T the norm's transposed row tiles make, so no strided load of x^T; the same bits as the norm in a
    kernel of its own, and eager's values."""
    model, x, compiled = _layer_norm_mlp()
    (kernel,) = compiled[2].neff.kernels
    (matmul,) = [n for n in compiled[2].graph.nodes() if n.op is Op.MATMUL]
    plan = matmul.attrs["plan"]
    assert isinstance(plan, ProloguePlan) and isinstance(plan.matmul, ChainPlan) and plan.operand == 1
    strided = [i for (engine, _), stream in compiled[2].neff.streams.items() if engine == Engine.DMA for i in stream
               if i.operands[1].space == Space.HBM and i.operands[1].dims[-1][0] != 1 and i.operands[1].dims[-1][1] > 1]
    assert not strided  # x^T is made on chip (and gamma and beta, applied by the copies: ProloguePlan.affine)
    assert len(plan.affine) == 2
    outputs = [_run(compiled[level], x) for level in ("apart", 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(x))


def test_the_mlp_chains_first_output_tiles_multiply_each_row_tile_of_the_norm_as_it_is_made():
    """In the layer-norm -> MLP chain, the first matmul's lead output tiles (h^T, all 512 tokens wide) accumulate a
    128-token block at a time, each block's matmuls (N = 128) on the Tensor engine before the norm's last row tile
    is transposed, instead of every row tile first; each element sums the same K tiles in the same order, so the
    output has the bits of the norm in a kernel of its own, and eager's values."""
    model, x, compiled = _layer_norm_mlp()
    tensor = compiled[2].neff.streams[(Engine.TENSOR, 0)]
    transposes = [n for n, i in enumerate(tensor) if i.opcode == Opcode.MATMUL and i.dst.dtype != DType.F32
                  and i.operands[1].partitions == 128]
    assert len(transposes) == 4 * 6  # 4 row tiles of 6 K tiles each, into 16-bit PSUM (transpose mode)
    vectors = [i for i in tensor if i.opcode == Opcode.MATMUL and i.dst.dtype != DType.F32 and i.dst.partitions == 128
               and i.operands[1].partitions == 6]
    assert len(vectors) == 2  # gamma and beta, loaded [6, 128], transposed to [128, 6] (ProloguePlan.affine)
    early = [i for i in tensor[:transposes[-1]] if i.opcode == Opcode.MATMUL and i.dst.dtype == DType.F32]
    assert early and all(i.operands[2].free_elements == 128 for i in early)
    lead_tiles = 8 - 4 - TRANSPOSE_BANKS  # trn2's PSUM banks, less the second's early column and the transposes
    assert len(early) >= lead_tiles * 6  # at least the first token block of each lead tile, over its 6 K tiles
    outputs = [_run(compiled[level], x) for level in ("apart", 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(x))


def test_an_fp32_norm_stays_a_kernel_of_its_own():
    """Only 16-bit results are folded (their Tensor-engine transposes are exact)."""
    model, x = _layer_norm_projection(256, 384, 128)
    compiled = compile_exported(torch.export.export(model.float(), (x.float(),)), CompileOptions(opt_level=2))
    assert [n.op for n in compiled.graph.nodes() if n.op in (Op.ROWWISE, Op.MATMUL)] == [Op.ROWWISE, Op.MATMUL]


def test_a_bf16_gpt2_folds_every_layer_norm_into_its_matmul_and_is_as_accurate_as_eager():
    """A 2-layer GPT-2 (width 128, 128 tokens, bf16): each block's two layer-norms and the final one become their
    matmuls' prologues (at 128 tokens the MLP is not chained: its first Linear takes the norm as A), the repeated
    layers' kernels generated once (codegen/reuse.py), and the logits as accurate as eager's in bf16."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=256, width=128, layers=2, heads=4, context=128).eval().to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 128))
    compiled = compile_module(model, (ids,))
    prologues = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("prologue") is not None]
    assert len(prologues) == 5 and not any(n.op is Op.ROWWISE for n in compiled.graph.nodes())
    assert_as_accurate_as_eager(run_program(compiled.neff, (ids,)), model, (ids,))


def test_a_folded_norm_takes_the_schedule_priced_for_a_prologue_which_is_faster_there(monkeypatch):
    """The norm's schedule is chosen again for the matmul's prologue (its row tiles copied out of the transposes'
    PSUM by the Vector engine, not stored): on GPT-2's layer-norm -> MLP chain (its 4 row tiles all before the first
    matmul) it differs from the norm's own and the kernel is faster with it, with eager's values."""
    from neuronc.passes import norm_prologue

    model, x, _ = _layer_norm_mlp()  # (cached as compiled by default)
    # the schedule's choice with the norm's whole body (its gamma and beta applied by the body, not in the copies)
    monkeypatch.setattr(norm_prologue, "AFFINE_AFTER", False)
    program = torch.export.export(model, (x,))
    compiled = compile_exported(program, CompileOptions(opt_level=2, name="ln_mlp_whole"))
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    monkeypatch.setattr(norm_prologue, "_as_prologue", lambda norm, target, *args: [dict(norm.attrs)])
    own = compile_exported(program, CompileOptions(opt_level=2, name="ln_mlp_own"))
    (kept,) = [n for n in own.graph.nodes() if n.op is Op.MATMUL]
    assert matmul.attrs["prologue"].attrs["schedule"] != kept.attrs["prologue"].attrs["schedule"]
    assert compiled.neff.estimated_ns < own.neff.estimated_ns
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(_run(compiled, x).astype(np.float32)).to(torch.bfloat16)], model(x))


def test_a_folded_norms_schedule_is_the_one_of_its_best_priced_whose_kernel_is_timed_fastest(monkeypatch):
    """The prologue's own price sees neither the matmul's strips nor its transposes, so of its few best-priced
    schedules (norm_prologue.PROLOGUE_TIMED) the kernel takes the one the emulator's clock times fastest in the
    folded kernel (PassContext.choice_time). On GPT-2's layer-norm -> QKV projection that is not the best-priced,
    and the program is faster than with the best-priced one; the bits are the norm's apart under that schedule
    (test_gpt2s_layer_norm_and_qkv_projection_are_one_kernel_giving_the_baseline_bits), the values eager's."""
    from neuronc.passes import norm_prologue

    monkeypatch.setattr(norm_prologue, "AFFINE_AFTER", False)  # (the norm's whole body: its gamma and beta in it)
    model, x = _layer_norm_projection(768, 2304, 512)
    program = torch.export.export(model, (x,))
    timed = compile_exported(program, CompileOptions(opt_level=2, name="ln_qkv_timed"))
    monkeypatch.setattr(norm_prologue, "_TIMED", {})
    monkeypatch.setattr(norm_prologue, "PROLOGUE_TIMED", 1)
    priced = compile_exported(program, CompileOptions(opt_level=2, name="ln_qkv_priced"))
    schedules = [[n.attrs["prologue"].attrs["schedule"] for n in c.graph.nodes() if n.op is Op.MATMUL][0]
                 for c in (timed, priced)]
    assert schedules[0] != schedules[1]
    assert timed.neff.estimated_ns < priced.neff.estimated_ns
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(_run(timed, x).astype(np.float32)).to(torch.bfloat16)], model(x))


def test_a_folded_norms_gamma_and_beta_are_applied_in_the_copies_out_of_the_transposes(monkeypatch):
    """A layer-norm with trained-like gamma and beta (768 features, 512 tokens, bf16) read by a projection: folded,
    its body stops at y = (x - mean) * rstd, rounded to bf16 for the transposes, and gamma and beta (loaded as
    [6, 128] rows and transposed on chip: one value a partition) are applied by the copies out of PSUM, one
    TENSOR_ALU2 a K tile on the Vector engine, held [p, 1] operands, none of the row tiles' passes: the kernel is
    faster (the cost model's estimate) than with them in the body, and as accurate as eager (y is rounded twice,
    once by the copy)."""
    from neuronc.passes import norm_prologue

    model, x = _layer_norm_projection(768, 2304, 512)
    with torch.no_grad():
        model[0].weight.copy_(1 + 0.5 * torch.randn(768))
        model[0].bias.copy_(0.5 * torch.randn(768))
    compiled = compile_module(model, (x,), name="ln_affine_after")
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    plan = matmul.attrs["plan"]
    assert isinstance(plan, ProloguePlan) and len(plan.affine) == 2
    assert plan.body[-1].op is Op.CONVERT and plan.body[-2].op is Op.MULTIPLY and len(plan.body) == 15 - 4
    copies = [i for i in compiled.neff.streams[(Engine.VECTOR, 0)] if i.opcode == Opcode.TENSOR_ALU2
              and i.operands[1].space == Space.PSUM]
    assert len(copies) == 4 * 6
    assert all(ap.dims[1] == (0, 128) and ap.dtype == DType.BF16 for i in copies for ap in i.operands[2:])
    loads = [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA for i in stream
             if i.operands[0].space == Space.SBUF and i.operands[0].dims == ((1, 6), (1, 128))]
    assert len(loads) == 2  # gamma and beta as [6, 128] rows, contiguous, transposed on chip
    monkeypatch.setattr(norm_prologue, "AFFINE_AFTER", False)
    monkeypatch.setattr(norm_prologue, "_TIMED", {})
    whole = compile_module(model, (x,), name="ln_affine_in_body")
    (kept,) = [n for n in whole.graph.nodes() if n.op is Op.MATMUL]
    assert kept.attrs["plan"].affine == () and len(kept.attrs["plan"].body) == 15
    assert compiled.neff.estimated_ns < whole.neff.estimated_ns
    assert_as_accurate_as_eager(run_program(compiled.neff, (x,)), model, (x,))


def test_a_bf16_gpt2_with_trained_like_layer_norms_applies_each_layers_gamma_and_beta_in_its_copies():
    """The 2-layer GPT-2 above with each layer-norm's gamma and beta drawn apart (1 + 0.5 N, 0.5 N): its five
    folded norms apply them in the copies out of the transposes' PSUM (ProloguePlan.affine), the repeated layers'
    kernels generated once (codegen/reuse.py) each reading its own layer's vectors, and the logits are as accurate
    as eager's in bf16."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=256, width=128, layers=2, heads=4, context=128).eval().to(torch.bfloat16)
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
            norm.bias.copy_(0.5 * torch.randn_like(norm.bias))
    ids = torch.randint(0, 256, (1, 128))
    compiled = compile_module(model, (ids,))
    prologues = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("prologue") is not None]
    assert [len(n.attrs["plan"].affine) for n in prologues] == [2] * 5
    assert_as_accurate_as_eager(run_program(compiled.neff, (ids,)), model, (ids,))


def test_a_folded_norm_without_beta_applies_its_gamma_alone_in_the_copies():
    """A layer-norm without a bias (256 features, 128 tokens, bf16) read by a projection: gamma alone goes into the
    copies out of the transposes' PSUM (one TENSOR_ALU2 a K tile multiplying by the held value, its second op
    none), as accurate as eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(256, bias=False), torch.nn.Linear(256, 384))
    model = model.eval().to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(1 + 0.5 * torch.randn(256))
    x = torch.randn(128, 256).to(torch.bfloat16)
    compiled = compile_module(model, (x,), name="ln_gamma_after")
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert len(matmul.attrs["plan"].affine) == 1
    copies = [i for i in compiled.neff.streams[(Engine.VECTOR, 0)] if i.opcode == Opcode.TENSOR_ALU2
              and i.operands[1].space == Space.PSUM]
    assert len(copies) == 2 and all(i.alu == AluOp.MULTIPLY and i.alu1 == AluOp.NONE for i in copies)
    assert_as_accurate_as_eager(run_program(compiled.neff, (x,)), model, (x,))
