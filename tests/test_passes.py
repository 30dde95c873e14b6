"""Passes, each run alone: fusion merges elementwise groups and folds views into their readers,
identities vanish, and the block cutter and the reshape-of-a-view rule are exact (property tests)."""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from neuronc import ir
from neuronc.codegen.blocks import blocks
from neuronc.compiler import CompileOptions, compile_exported, compile_graph
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes import pipeline
from neuronc.passes.fusion import fold_converts, fuse_elementwise, fuse_matmul_epilogues, fuse_matmul_operands
from neuronc.passes.layout import store_activations_transposed, store_weights_transposed, view_of_transposed
from neuronc.passes.legalize import reshaped_strides
from neuronc.passes.pipeline import passes_for
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_matches_eager, canonical, run_pass, zoo_graph


def _compile(name, level):
    """A zoo model compiled at -O`level` from the graph the session imported once (conftest.zoo_graph)."""
    model, inputs = zoo.build(name)
    return compile_graph(zoo_graph(name), CompileOptions(opt_level=level)), model, inputs


def test_the_baseline_pipeline_matches_eager(zoo_model):
    """-O0 (one kernel per op) on every zoo model, from the graph the test session imported once; -O2 is the
    golden tests' (test_golden.py), -O1 runs -O0's passes (pipeline.py)."""
    name, _, inputs, expected = zoo_model
    neff = compile_graph(zoo_graph(name), CompileOptions(opt_level=0)).neff
    outputs = run_neff(neff, [x.numpy() for x in inputs]).outputs
    assert_matches_eager([torch.from_numpy(out) for out in outputs], expected)


@pytest.mark.parametrize("level", [1, 3])
def test_the_other_optimisation_levels_match_eager(level):
    """-O3 on three more models: test_differential."""
    compiled, model, inputs = _compile("transformer_block", level)
    with torch.no_grad():
        expected = model(*inputs)
    outputs = run_neff(compiled.neff, [x.numpy() for x in inputs]).outputs
    assert_matches_eager([torch.from_numpy(out) for out in outputs], expected)


def test_linear_layers_become_one_kernel_each_with_bias_and_gelu_as_epilogue():
    baseline, _, _ = _compile("mlp", 0)
    fused, _, _ = _compile("mlp", 2)
    assert len(baseline.neff.kernels) > 20
    assert len(fused.neff.kernels) == 3 + 1  # a kernel per linear layer, and one for the softmax
    ops = [n.op for n in fused.graph.nodes()]
    assert Op.VIEW not in ops  # weight transposes and bias broadcasts are read through their views
    matmuls = [n for n in fused.graph.nodes() if n.op is Op.MATMUL]
    assert len(matmuls) == 3 and all("epilogue" in m.attrs for m in matmuls)
    epilogues = [[step.op for step in m.attrs["epilogue"]] for m in matmuls]
    assert epilogues.count([Op.ADD, Op.GELU]) == 2  # bias + GELU computed from PSUM, twice


X = 'parameter() : {} {{index = 0, name = "x", kind = "input"}}'
Y = 'parameter() : {} {{index = 1, name = "y", kind = "input"}}'


def test_an_elementwise_group_is_one_fused_kernel_reading_splats_as_immediates():
    assert run_pass(fuse_elementwise, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("4x8xf32")}
          %1 = {Y.format("4x8xf32")}
          %2 = exp(%0) : 4x8xf32
          %3 = add(%2, %1) : 4x8xf32
          %4 = constant() : 4x8xf32 {{value = array<f32>[2.0]}}
          %5 = multiply(%3, %4) : 4x8xf32
          return %5
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("4x8xf32")}
          %1 = {Y.format("4x8xf32")}
          %2 = fused(%0, %1) : 4x8xf32 {{
            body = (exp(in0) : f32, add(s0, in1) : f32, multiply(s1, 2.0) : f32), views = (none, none)}}
          return %2
        }}""")


def test_an_elementwise_op_reads_a_transposed_operand_through_its_view():
    assert run_pass(fuse_elementwise, f"""
        graph @f(%0) {{
          %0 = {X.format("4x8xf32")}
          %1 = view(%0) : 8x4xf32 {{offset = 0, strides = (1, 8)}}
          %2 = exp(%1) : 8x4xf32
          return %2
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4x8xf32")}
          %1 = fused(%0) : 8x4xf32 {{body = (exp(in0) : f32,), views = ((0, (1, 8)),)}}
          return %1
        }}""")


def test_a_matmul_reads_a_transposed_weight_through_its_view():
    assert run_pass(fuse_matmul_operands, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("1x2x3xf32")}
          %1 = {Y.format("4x3xf32")}
          %2 = view(%1) : 1x3x4xf32 {{offset = 0, strides = (0, 1, 3)}}
          %3 = matmul(%0, %2) : 1x2x4xf32 {{k = 3}}
          return %3
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("1x2x3xf32")}
          %1 = {Y.format("4x3xf32")}
          %2 = matmul(%0, %1) : 1x2x4xf32 {{k = 3, views = (none, (0, (0, 1, 3)))}}
          return %2
        }}""")


def test_a_bias_and_gelu_after_a_matmul_are_its_epilogue():
    fused = run_pass(fuse_elementwise, f"""
        graph @f(%0, %1, %2) {{
          %0 = {X.format("1x2x3xf32")}
          %1 = {Y.format("1x3x4xf32")}
          %2 = parameter() : 4xf32 {{index = 2, name = "bias", kind = "weight"}}
          %3 = matmul(%0, %1) : 1x2x4xf32 {{k = 3}}
          %4 = reshape(%3) : 2x4xf32
          %5 = view(%2) : 2x4xf32 {{offset = 0, strides = (0, 1)}}
          %6 = add(%4, %5) : 2x4xf32
          %7 = gelu(%6) : 2x4xf32
          return %7
        }}""")
    assert run_pass(fuse_matmul_epilogues, fused) == canonical(f"""
        graph @f(%0, %1, %2) {{
          %0 = {X.format("1x2x3xf32")}
          %1 = {Y.format("1x3x4xf32")}
          %2 = parameter() : 4xf32 {{index = 2, name = "bias", kind = "weight"}}
          %3 = matmul(%0, %1, %2) : 1x2x4xf32 {{
            k = 3, views = (none, none, (0, (0, 0, 1))), epilogue = (add(in0, in1) : f32, gelu(s0) : f32)}}
          %4 = reshape(%3) : 2x4xf32
          return %4
        }}""")


class _Chain(torch.nn.Module):
    """Twenty [256, 256] intermediates, each dead once the next is computed."""

    def forward(self, x):
        for i in range(20):
            x = torch.tanh(x) * 0.5 + i
        return x


def test_dead_intermediates_share_scratch_memory_and_the_program_stays_exact():
    model, x = _Chain(), torch.randn(256, 256)
    neff = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=0)).neff  # a kernel per op
    scratch = [t for t in neff.tensors if t.kind.name == "SCRATCH"]
    assert len(scratch) >= 40
    starts = {t.offset for t in scratch}
    assert len(starts) <= 8  # a few slots, reused by tensors whose lifetimes do not overlap
    assert neff.hbm_size < sum(t.nbytes for t in scratch) / 4
    others = [t for t in neff.tensors if t.kind.name != "SCRATCH"]
    assert not any(t.offset < s.offset + s.nbytes and s.offset < t.offset + t.nbytes for t in others for s in scratch)
    assert_matches_eager(torch.from_numpy(run_neff(neff, [x.numpy()]).outputs[0]), model(x))


def test_the_erf_expansion_of_gelu_is_folded_back_into_one_gelu():
    compiled, _, _ = _compile("mlp", 0)
    ops = [n.op for n in compiled.graph.nodes()]
    assert ops.count(Op.GELU) == 2  # one op per GELU, instead of ~35 (XLA's erf approximation and more)
    assert Op.ERF not in ops and Op.MAXIMUM not in ops  # erf and its clamps are inside GELU
    assert ops.count(Op.DIVIDE) == 1  # only softmax's: the approximations' P/Q divisions are gone


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=4), st.data())
def test_blocks_cover_every_element_once_for_every_operand(shape, data):
    rank = len(shape)
    perm = data.draw(st.permutations(range(rank)))
    dense = np.arange(int(np.prod(shape))).reshape(shape)
    view = np.transpose(dense, perm)  # a transposed operand
    strides = [tuple(s // dense.itemsize for s in np.ascontiguousarray(view).strides),
               tuple(s // dense.itemsize for s in view.strides)]
    max_free = data.draw(st.integers(1, 16))
    parts = data.draw(st.integers(1, 8))
    seen = np.zeros(view.size, dtype=int)
    for block in blocks(view.shape, strides, max_free, parts):
        assert block.partitions <= parts and block.free_elements <= max_free
        out = _gather(np.arange(view.size), block.offsets[0], block.dims[0])
        src = _gather(dense.reshape(-1), block.offsets[1], block.dims[1])
        np.testing.assert_array_equal(src, np.ascontiguousarray(view).reshape(-1)[out])
        seen[out.reshape(-1)] += 1
    assert (seen == 1).all()


def _gather(flat, offset, dims):
    index = np.full([n for _, n in dims], offset)
    for axis, (stride, n) in enumerate(dims):
        shape = [1] * len(dims)
        shape[axis] = n
        index = index + (np.arange(n) * stride).reshape(shape)
    return flat[index]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_reshaped_strides_read_what_numpy_reshape_gives(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    view = np.transpose(np.arange(int(np.prod(shape))).reshape(shape), perm)
    size = view.size
    factors = [d for d in range(1, size + 1) if size % d == 0]
    first = data.draw(st.sampled_from(factors))
    new_shape = (first, size // first) if data.draw(st.booleans()) else (1, size)
    strides = reshaped_strides(view.shape, tuple(s // view.itemsize for s in view.strides), new_shape)
    if np.shares_memory(view.reshape(new_shape), view):  # numpy reshapes it without a copy: strides exist
        assert strides is not None
    if strides is not None:
        read = np.lib.stride_tricks.as_strided(np.arange(size), new_shape, [s * 8 for s in strides])
        np.testing.assert_array_equal(read, view.reshape(new_shape))


def test_layer_norm_variance_is_reduced_straight_from_its_producer_when_rows_do_not_fit_sbuf():
    norm = torch.nn.LayerNorm(60_000).eval()  # whole rows of 60k fp32 do not fit: no ROWWISE kernel
    compiled = compile_exported(torch.export.export(norm, (torch.randn(4, 60_000),)), CompileOptions(opt_level=2))
    assert not any(n.op is Op.ROWWISE for n in compiled.graph.nodes())
    with_prologue = [n for n in compiled.graph.nodes() if n.op is Op.REDUCE_LAST and n.attrs.get("prologue")]
    assert len(with_prologue) == 1  # (x - mean)^2 computed per tile, never stored
    assert Op.MULTIPLY in {s.op for s in with_prologue[0].attrs["prologue"]}


def test_the_compile_time_of_every_stage_and_pass_is_recorded():
    model, inputs = zoo.build("mlp")
    seconds = compile_exported(torch.export.export(model, inputs), CompileOptions(opt_level=2)).seconds
    passes = [name for name in seconds if name.startswith("pass/")]
    assert [name.split("#")[0] for name in passes] == [f"pass/{p.__name__}" for p in passes_for(2)]
    for stage in ("import", "import/torch-mlir", "import/stablehlo->ir", "passes", "memory plan", "codegen",
                  "codegen/kernels", "codegen/sync"):  # (-O2 estimates when the time is read: test_estimate_on_read)
        assert seconds[stage] > 0, stage  # timed: every stage does some work
    assert seconds["passes"] >= sum(seconds[name] for name in passes)
    for total in ("import", "codegen"):  # a total holds its parts
        assert seconds[total] >= sum(value for name, value in seconds.items() if name.startswith(f"{total}/")), total


def _bf16_gelu_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    return model.to(torch.bfloat16), (torch.randn(32, 64).to(torch.bfloat16),)


def test_a_bf16_linear_multiplies_its_bf16_operands_and_adds_its_bias_in_psum():
    model, inputs = _bf16_gelu_mlp()
    compiled = compile_exported(torch.export.export(model, inputs), CompileOptions(opt_level=2))
    matmuls = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert len(matmuls) == 2 and len(compiled.neff.kernels) == 2  # no kernel widens an operand or a bias
    assert all(x.dtype is DType.BF16 for m in matmuls for x in m.inputs)  # bf16 rate, not fp32's quarter
    assert all(m.attrs.get("bias_row") == 1 for m in matmuls)  # the bias row goes into PSUM by a matmul
    epilogues = [[(step.op, step.dtype) for step in m.attrs["epilogue"]] for m in matmuls]
    assert [epilogue[0] for epilogue in epilogues] == [(Op.CONVERT, DType.BF16)] * 2  # PSUM rounded once
    assert all(op is not Op.CONVERT for epilogue in epilogues for op, _ in epilogue[1:])  # no widening left


def test_the_optimised_bf16_mlp_gives_the_baseline_bits():
    """Epilogue converts folded into their instructions, steps moved to the Scalar or GpSimd engine, bf16
    operands multiplied directly: every rounding stays where the baseline (one kernel per op) has it."""
    model, inputs = _bf16_gelu_mlp()
    program = torch.export.export(model, inputs)
    outputs = [run_neff(compile_exported(program, CompileOptions(opt_level=level)).neff,
                        [x.float().numpy().astype(ml_dtypes.bfloat16) for x in inputs]).outputs[0]
               for level in (0, 2)]
    assert outputs[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(*inputs))


@pytest.mark.parametrize("tokens", [300, 640])  # a partial row tile; more row tiles than half the PSUM banks
def test_a_chained_mlp_gives_the_baseline_bits_for_any_number_of_tokens(tokens):
    """The chain's first matmul computed transposed and kept in SBUF, the second's first column accumulated
    while it is made (when its row tiles leave the first matmul half the PSUM banks) or after it: the same
    roundings as one kernel per op."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 96)).eval()
    model, x = model.to(torch.bfloat16), torch.randn(tokens, 64).to(torch.bfloat16)
    program = torch.export.export(model, (x,))
    compiled = {level: compile_exported(program, CompileOptions(opt_level=level)) for level in (0, 2)}
    assert [n.attrs.get("chain") is not None for n in compiled[2].graph.nodes() if n.op is Op.MATMUL] == [True]
    outputs = [run_neff(compiled[level].neff, [x.float().numpy().astype(ml_dtypes.bfloat16)]).outputs[0]
               for level in (0, 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(x))


def _baseline_and_optimised_bits(model, inputs):
    """Runs the model compiled at -O0 and -O2, checks both give the same bits and match eager; returns the -O2
    compilation."""
    program = torch.export.export(model, inputs)
    arrays = [x.float().numpy().astype(ml_dtypes.bfloat16) for x in inputs]
    compiled = {level: compile_exported(program, CompileOptions(opt_level=level)) for level in (0, 2)}
    outputs = [run_neff(compiled[level].neff, arrays).outputs[0] for level in (0, 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(*inputs))
    return compiled[2]


class _LinearWithResidual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(192, 640)

    def forward(self, x, y):
        return self.linear(x) + y


@pytest.mark.parametrize("resident,block,bufs", [("a", 2, 2), ("b", 2, 3), ("none", 1, 3)])
def test_every_tiling_of_a_linear_with_a_bias_row_and_a_residual_gives_the_baseline_bits(
        monkeypatch, resident, block, bufs):
    """Partial row, column and K tiles; the bias row loaded with B's strips (or with each tile when both
    operands stream), the weight's first strip loaded before the activations, the residual by rows."""
    from neuronc.passes import tiling

    def forced(node, target, wide=False, timed=None):
        return tiling.MatmulTiling(resident, block, 128, 512, 128, bufs, tiling.streamed_first(node, resident))

    monkeypatch.setattr(tiling, "choose", forced)
    torch.manual_seed(0)
    model = _LinearWithResidual().eval().to(torch.bfloat16)
    _baseline_and_optimised_bits(model, (torch.randn(300, 192).to(torch.bfloat16),
                                         torch.randn(300, 640).to(torch.bfloat16)))


@pytest.mark.parametrize("resident,block,bufs", [("a", 2, 2), ("b", 1, 3)])
def test_every_tiling_of_a_chain_gives_the_baseline_bits(monkeypatch, resident, block, bufs):
    """The first matmul's bias column loaded with its A strips (two row tiles each, the last strip partial) or
    with each streamed row tile, the second's next column of tiles accumulated partly while the first's last
    epilogues run: the same bits as one kernel per op."""
    from neuronc.passes import tiling

    def forced(node, target, wide=False, timed=None):
        from neuronc.passes.matmul_chain import stages

        first, second = stages(node)
        return (tiling.MatmulTiling(resident, block, 128, 512, 128, bufs, tiling.streamed_first(first, resident)),
                tiling._second_tiling(second, target, bufs))

    monkeypatch.setattr(tiling, "chain_tilings", forced)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.GELU(), torch.nn.Linear(384, 640)).eval()
    model = model.to(torch.bfloat16)
    compiled = _baseline_and_optimised_bits(model, (torch.randn(400, 64).to(torch.bfloat16),))
    chained = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL and n.attrs.get("chain") is not None]
    assert len(chained) == 1 and chained[0].attrs["chain"].attrs.get("bias_column") is not None


def _step(op, args, dtype):
    return ir.Step(op, tuple(args), dtype, {})


def test_fold_converts_writes_an_fp32_result_in_the_narrow_type_its_only_reader_converts_to():
    body = (_step(Op.ADD, [("input", 0), ("input", 1)], DType.F32), _step(Op.CONVERT, [("step", 0)], DType.BF16))
    assert fold_converts(body, {0: DType.F32, 1: DType.F32}) == (
        _step(Op.ADD, [("input", 0), ("input", 1)], DType.BF16),)


def test_fold_converts_lets_fp32_steps_read_a_narrow_value_without_widening_it():
    body = (_step(Op.CONVERT, [("input", 1)], DType.F32), _step(Op.ADD, [("input", 0), ("step", 0)], DType.F32),
            _step(Op.ERF, [("step", 1)], DType.F32))
    assert fold_converts(body, {0: DType.F32, 1: DType.BF16}) == (
        _step(Op.ADD, [("input", 0), ("input", 1)], DType.F32), _step(Op.ERF, [("step", 0)], DType.F32))


def test_fold_converts_keeps_a_convert_whose_source_is_read_elsewhere_or_is_not_a_float():
    shared = (_step(Op.ADD, [("input", 0), ("input", 0)], DType.F32), _step(Op.CONVERT, [("step", 0)], DType.BF16),
              _step(Op.MULTIPLY, [("step", 0), ("step", 1)], DType.F32))
    assert fold_converts(shared, {0: DType.F32}) == shared
    integer = (_step(Op.CONVERT, [("input", 0)], DType.F32), _step(Op.EXP, [("step", 0)], DType.F32))
    assert fold_converts(integer, {0: DType.I32}) == integer


def test_a_weight_read_only_transposed_is_stored_transposed_and_a_tied_one_is_not():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).eval()
    inputs = (torch.randn(8, 64),)
    program = torch.export.export(linear, inputs)
    weights = {level: next(t for t in compile_exported(program, CompileOptions(opt_level=level)).neff.tensors
                           if t.name == "weight") for level in (0, 2)}
    assert weights[0].shape == (32, 64) and weights[2].shape == (64, 32)
    np.testing.assert_array_equal(weights[2].data, linear.weight.detach().numpy().T)


def _head(reads: str) -> str:
    """A [4, 3] weight (values 0..11) read transposed (legalize's view of it) by a matmul, and as `reads` says."""
    return f"""
        graph @f(%0, %1) {{
          %0 = parameter() : 4x3xf32 {{index = 0, name = "w", kind = "weight",
                                       data = array<4x3xf32>[{", ".join(f"{v}.0" for v in range(12))}]}}
          %1 = parameter() : 1x2x3xf32 {{index = 1, name = "x", kind = "input"}}
          %2 = view(%0) : 3x4xf32 {{offset = 0, strides = (1, 3)}}
          %3 = reshape(%2) : 1x3x4xf32
          %4 = matmul(%1, %3) : 1x2x4xf32 {{k = 3}}
          {reads}
        }}"""


def test_a_weight_read_only_transposed_is_stored_transposed_and_read_densely():
    stored = ", ".join(f"{v}.0" for v in np.arange(12).reshape(4, 3).T.reshape(-1))  # 0, 3, 6, 9, 1, 4...
    assert run_pass(store_weights_transposed, _head("return %4")) == canonical(f"""
        graph @f(%0, %1) {{
          %0 = parameter() : 3x4xf32 {{index = 0, name = "w", kind = "weight", data = array<3x4xf32>[{stored}]}}
          %1 = parameter() : 1x2x3xf32 {{index = 1, name = "x", kind = "input"}}
          %2 = reshape(%0) : 1x3x4xf32
          %3 = matmul(%1, %2) : 1x2x4xf32 {{k = 3}}
          return %3
        }}""")


def test_a_tied_weight_also_gathered_by_rows_keeps_its_layout():
    tied = _head("""%5 = constant() : 2xi32 {value = array<2xi32>[3, 0]}
          %6 = gather_rows(%0, %5) : 2x3xf32
          return %4, %6""")  # GPT-2's token embedding: gathered by rows, and read transposed by the LM head
    assert run_pass(store_weights_transposed, tied) == canonical(tied)


def _elements(buffer: np.ndarray, view: tuple, extents: tuple) -> np.ndarray:
    offset, strides = view
    index = offset + sum(np.arange(n).reshape([-1 if i == axis else 1 for i in range(len(extents))]) * stride
                         for axis, (stride, n) in enumerate(zip(strides, extents)))
    return buffer.reshape(-1)[index]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_a_view_of_a_buffer_stored_transposed_reads_the_same_elements_or_is_refused(rows, cols, data):
    axes = data.draw(st.integers(1, 3))
    extents = tuple(data.draw(st.integers(1, 4)) for _ in range(axes))
    strides = tuple(data.draw(st.sampled_from([0, 1, 2, cols, 2 * cols, cols + 1])) for _ in range(axes))
    offset = data.draw(st.integers(0, rows * cols - 1))
    reach = offset + sum(s * (n - 1) for s, n in zip(strides, extents))
    assume(reach < rows * cols)
    dense = np.arange(rows * cols).reshape(rows, cols)
    relaid = view_of_transposed((offset, strides), extents, rows, cols)
    if relaid is not None:
        np.testing.assert_array_equal(_elements(np.ascontiguousarray(dense.T), relaid, extents),
                                      _elements(dense, (offset, strides), extents))
    row, col = divmod(offset, cols)
    along_rows = sum(n - 1 for s, n in zip(strides, extents) if s == cols)
    along_a_row = sum(n - 1 for s, n in zip(strides, extents) if s == 1)
    if cols > 1 and all(s in (0, 1, cols) for s in strides) and row + along_rows < rows and col + along_a_row < cols:
        assert relaid is not None  # a box of the [rows, cols] matrix is a box of its transpose


def _linear_after_layer_norm(tokens=(300,), width=192, residual=False):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

        def forward(self, x):
            y = self.norm(x)
            return self.linear(y) + y if residual else self.linear(y)

    torch.manual_seed(0)
    return Model().eval().to(torch.bfloat16), (torch.randn(*tokens, width).to(torch.bfloat16),)


def _with_and_without_transposed_activations(monkeypatch, model, inputs):
    """-O3 with the activation layout pass always taken (not priced); checks its output has the bits of -O3
    without that pass, and matches eager."""
    program = torch.export.export(model, inputs)
    arrays = [x.float().numpy().astype(ml_dtypes.bfloat16) for x in inputs]
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "PRICED", ())
        compiled = compile_exported(program, CompileOptions(opt_level=3))
        patch.setitem(pipeline.PIPELINES, 3, [p for p in pipeline.PIPELINES[3] if p is not store_activations_transposed])
        plain = compile_exported(program, CompileOptions(opt_level=3))
    outputs = [run_neff(c.neff, arrays).outputs[0] for c in (plain, compiled)]
    np.testing.assert_array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))
    with torch.no_grad():
        assert_matches_eager([torch.from_numpy(outputs[1].astype(np.float32)).to(torch.bfloat16)], model(*inputs))
    return compiled


@pytest.mark.parametrize("tokens", [(300,), (2, 150)])  # a partial row tile; a batch of sequences
def test_a_layer_norm_read_only_by_a_matmul_can_be_written_transposed_with_the_same_bits(monkeypatch, tokens):
    compiled = _with_and_without_transposed_activations(monkeypatch, *_linear_after_layer_norm(tokens))
    (norm,) = [n for n in compiled.graph.nodes() if n.op is Op.ROWWISE]
    (linear,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert norm.attrs["out_strides"] == (1, 300)  # [192, 300]: the matmul's A^T
    assert linear.attrs["views"][0][1][1] == 1  # its strips of A^T are contiguous rows
    assert compiled.neff.kernels[0].ops[-1] == "[stored transposed]"  # as `neuronc inspect --kernels` shows it


@pytest.mark.parametrize("tokens", [(300,), (4096,)])
def test_the_transposed_layer_norm_store_is_kept_only_where_the_cost_model_times_it_faster(tokens):
    model, inputs = _linear_after_layer_norm(tokens)
    compiled = compile_exported(torch.export.export(model, inputs), CompileOptions(opt_level=3))
    with_it, without = compiled.decisions["store_activations_transposed"]  # both emitted and timed
    (norm,) = [n for n in compiled.graph.nodes() if n.op is Op.ROWWISE]
    assert (norm.attrs["out_strides"] != (192, 1)) == (with_it < without)
    assert compiled.neff.estimated_ns == min(with_it, without)


def test_a_layer_norm_also_read_by_rows_keeps_its_layout(monkeypatch):
    compiled = _with_and_without_transposed_activations(monkeypatch, *_linear_after_layer_norm(residual=True))
    (norm,) = [n for n in compiled.graph.nodes() if n.op is Op.ROWWISE]
    assert norm.attrs["out_strides"] == (192, 1)


class _Lambda(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


class _SumOverBatchOfOne(torch.nn.Module):
    def forward(self, x):
        return x.sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sum_over_a_batch_of_one_is_no_reduction_and_matches_eager(dtype):
    """x.sum(0) of a [1, 4, 64, 64] x reads one element per result: a reshape (canonicalize's
    reduce_over_unit_dims), not a reduction of 16,384 one-element rows; bf16's fp32 accumulation of one element
    rounds back to the element."""
    x = torch.randn(1, 4, 64, 64, dtype=dtype)
    compiled = compile_exported(torch.export.export(_SumOverBatchOfOne(), (x,)), CompileOptions())
    assert not [n for n in compiled.graph.nodes() if n.op in (Op.REDUCE, Op.REDUCE_LAST)]
    arrays = [x.float().numpy().astype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else x.numpy()]
    out = torch.from_numpy(np.asarray(run_neff(compiled.neff, arrays).outputs[0], np.float32)).to(dtype)
    assert_matches_eager(out, x.sum(0))
    assert torch.equal(out, x.sum(0))


def test_a_sum_of_one_negative_zero_is_positive_zero_as_in_eager():
    """0 + (-0.0) is +0.0: eager's sum of one -0.0 (over a size-1 dim, or all of a one-element tensor) is +0.0,
    and so is the compiled one (the reduction's +0.0 initial value is not dropped as an identity)."""
    x = torch.tensor([[-0.0, 1.0, -0.0]])
    for f in (lambda t: t.sum(0), lambda t: t.mean(0), lambda t: t[:, :1].sum()):
        compiled = compile_exported(torch.export.export(_Lambda(f), (x,)), CompileOptions())
        out = torch.from_numpy(np.asarray(run_neff(compiled.neff, [x.numpy()]).outputs[0]))
        assert torch.equal(out, f(x)) and torch.equal(out.signbit(), f(x).signbit())
