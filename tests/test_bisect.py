"""`neuronc bisect` / `neuronc.bisect`: a wrong lowering injected into a pass is found, with its op, source line,
kernel and pass; a correct program reports no divergence. The expected values come from XLA on CPU (or the
StableHLO interpreter), never from neuronc."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch

import neuronc
from neuronc import ir
from neuronc.passes import fusion, pipeline
from neuronc.reference import run_reference
from tests import jax_programs
from tests.conftest import line_of


class TanhHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.proj(x)) * 0.5 + 1.0  # marker: the fused elementwise group
        return torch.softmax(self.out(h), dim=-1), h  # h returned: kept in HBM, not chained into the next matmul


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return TanhHead().eval(), torch.randn(8, 16)


@pytest.fixture
def sign_flipped_by_fusion(monkeypatch):
    flip_a_sign_in_fusion(monkeypatch)


def flip_a_sign_in_fusion(monkeypatch) -> None:
    """fuse_elementwise made wrong: the elementwise kernel it forms of the tanh group negates its result."""
    real = fusion.fuse_elementwise

    @functools.wraps(real)
    def fuse_elementwise(graph, ctx):
        flipped = []

        def flip(node, inputs):
            if node.op is not ir.Op.FUSED or flipped or all(step.op is not ir.Op.TANH for step in node.attrs["body"]):
                return None
            flipped.append(node)
            body = node.attrs["body"]
            negate = ir.Step(ir.Op.NEGATE, (("step", len(body) - 1),), node.dtype, {})
            return ir.node(ir.Op.FUSED, inputs, node.shape, node.dtype, node.loc, **{**node.attrs, "body": body + (negate,)})

        return real(graph, ctx).rewrite(flip)

    monkeypatch.setattr(pipeline, "PIPELINES", {level: [fuse_elementwise if p is real else p for p in passes]
                                                for level, passes in pipeline.PIPELINES.items()})


def test_a_sign_flipped_by_a_pass_is_found_with_its_line_kernel_and_pass(model_and_input, sign_flipped_by_fusion):
    model, x = model_and_input
    report, = neuronc.bisect(model, x)
    assert report.diverges
    first = report.first
    assert first.value.loc.file == __file__
    assert first.value.loc.line == line_of(__file__, "marker: the fused elementwise group")
    assert first.max_abs > 1.0 and first.outside == first.size  # tanh(.) * 0.5 + 1 > 0, negated: every element
    assert first.kernel
    assert "after pass fuse_elementwise" in report.culprit
    assert report.levels == {0: False, 1: False, 2: True}
    text = str(report)
    assert "first divergence" in text and "fuse_elementwise" in text and f"{__file__}:{first.value.loc.line}" in text


def test_a_correct_model_reports_no_divergence(model_and_input):
    model, x = model_and_input
    report, = neuronc.bisect(model, x)
    assert not report.diverges and report.compared >= 2
    assert "no divergence" in str(report)


def test_cli_bisect_of_a_saved_program(cli, tmp_path, saved_program, model_and_input, monkeypatch):
    model, x = model_and_input
    path = saved_program(model, (x,))
    np.save(tmp_path / "x.npy", (2 * x).numpy())
    agrees = cli("bisect", path, "--input", tmp_path / "x.npy")
    assert agrees.exit_code == 0, agrees.output
    assert "no divergence" in agrees.output
    flip_a_sign_in_fusion(monkeypatch)
    diverges = cli("bisect", path)  # on the example inputs saved with the program
    assert diverges.exit_code == 1
    assert "after pass fuse_elementwise" in diverges.output
    assert f"{__file__}:{line_of(__file__, 'marker: the fused elementwise group')}" in diverges.output


def test_a_jax_function_is_bisected_against_xla():
    function, args = jax_programs.build("sgd_step")
    report, = neuronc.bisect(function, *args)
    assert not report.diverges and report.compared >= 5


def test_cli_bisect_of_stablehlo_with_the_reference_interpreter(cli, tmp_path):
    function, (params, x) = jax_programs.build("mlp")
    path = tmp_path / "mlp.mlir"
    path.write_text(jax.jit(function).lower(params, x).as_text(debug_info=True))
    inputs = []
    for i, array in enumerate(jax.tree_util.tree_leaves((params, x))):
        np.save(tmp_path / f"in{i}.npy", np.asarray(array))
        inputs += ["-i", tmp_path / f"in{i}.npy"]
    result = cli("bisect", path, *inputs, "--reference", "interpreter", "-O0")
    assert result.exit_code == 0, result.output
    assert "reference the StableHLO reference interpreter" in result.output and "no divergence" in result.output


def test_the_reference_executors_agree():
    module = """
    func.func @main(%x: tensor<2x3xf32>, %i: tensor<3xi64>) -> (tensor<2x3xf32>, tensor<3xi64>) {
      %0 = stablehlo.exponential %x : tensor<2x3xf32>
      %1 = stablehlo.add %i, %i : tensor<3xi64>
      return %0, %1 : tensor<2x3xf32>, tensor<3xi64>
    }"""
    x, i = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), np.array([1, 2 ** 40, -3])
    for executor in ("xla", "interpreter"):
        exp, doubled = run_reference(module, [x, i], executor)
        np.testing.assert_allclose(exp, np.exp(x), rtol=1e-6)
        np.testing.assert_array_equal(doubled, 2 * i)  # 64-bit integers survive
    assert not jax.config.jax_enable_x64  # switched on only around the reference's own inputs


def test_the_interpreter_runs_what_torch_mlir_leaves_arith_constants_and_0d_arguments():
    """torch-mlir's modules hold a few tensor `arith.constant`s (the interpreter knows only StableHLO) and 0-d
    arguments (batch-norm's step counter): both run, as XLA runs them."""
    module = """
    func.func @main(%x: tensor<3xf32>, %n: tensor<i64>) -> (tensor<3xf32>, tensor<i64>) {
      %one = arith.constant dense<1> : tensor<1xi64>
      %0 = stablehlo.convert %one : (tensor<1xi64>) -> tensor<1xf32>
      %1 = stablehlo.reshape %0 : (tensor<1xf32>) -> tensor<f32>
      %2 = stablehlo.broadcast_in_dim %1, dims = [] : (tensor<f32>) -> tensor<3xf32>
      %3 = stablehlo.add %x, %2 : tensor<3xf32>
      %4 = stablehlo.add %n, %n : tensor<i64>
      return %3, %4 : tensor<3xf32>, tensor<i64>
    }"""
    x, n = np.array([1.0, 2.0, 3.0], np.float32), np.array(21, np.int64)
    for executor in ("xla", "interpreter"):
        shifted, doubled = run_reference(module, [x, n], executor)
        np.testing.assert_array_equal(shifted, x + 1)
        assert doubled.shape == () and doubled == 42


def test_a_large_bf16_result_of_the_interpreter_keeps_its_values():
    """MLIR prints a large dense attribute as its raw bytes (`dense<"0x...">`), not value by value: a bf16 result of
    more than a hundred elements (found by the bf16 MoE of tests/test_differential.py) is read from those bytes."""
    import ml_dtypes

    module = """
    func.func @main(%x: tensor<4x64xbf16>) -> tensor<4x64xbf16> {
      %0 = stablehlo.negate %x : tensor<4x64xbf16>
      return %0 : tensor<4x64xbf16>
    }"""
    x = np.linspace(-3, 5, 256, dtype=np.float32).reshape(4, 64).astype(ml_dtypes.bfloat16)
    for executor in ("xla", "interpreter"):
        (negated,) = run_reference(module, [x], executor)
        assert negated.dtype == x.dtype and negated.shape == x.shape
        np.testing.assert_array_equal(negated.view(np.uint16), (-x).view(np.uint16))


def test_a_program_given_the_wrong_number_of_inputs_is_refused(cli, tmp_path, saved_program, model_and_input):
    model, x = model_and_input
    path = saved_program(model, (x,))
    np.save(tmp_path / "x.npy", x.numpy())
    result = cli("bisect", path, "-i", tmp_path / "x.npy", "-i", tmp_path / "x.npy")
    assert result.exit_code == 1 and "takes 1 inputs" in result.output and "got 2" in result.output
