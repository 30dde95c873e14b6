"""Mixed precision: neuronx-cc's `--auto-cast none|matmult|all` and `--auto-cast-type`, given through
NEURON_CC_FLAGS or options, and `torch.autocast` regions under torch.compile, each checked against
eager PyTorch in fp32 (or under the same autocast) within the tolerance of the narrower type."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.errors import NeuronConfigError
from neuronc.ir import Op
from neuronc.isa import DType
from runtime import run_neff
from tests import zoo
from tests.conftest import OnDevice, assert_matches_eager

NARROW = {"bf16": (DType.BF16, torch.bfloat16), "fp16": (DType.F16, torch.float16)}


def compile_mlp(monkeypatch, flags: str):
    """The zoo MLP compiled with these NEURON_CC_FLAGS: (compiled, fp32 output, fp32 eager output)."""
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--no_cache {flags}")
    model, inputs = zoo.build("mlp")
    compiled = compile_exported(torch.export.export(model, inputs), CompileOptions.from_dict({}))
    out = torch.from_numpy(run_neff(compiled.neff, [x.numpy() for x in inputs]).outputs[0])
    with torch.no_grad():
        return compiled, out, model(*inputs)


def matmul_operand_dtypes(graph) -> set:
    """Dtypes of what the Tensor engine multiplies (later inputs of a MATMUL feed its epilogue)."""
    return {x.dtype for n in graph.nodes() if n.op is Op.MATMUL for x in n.inputs[:2]}


@pytest.mark.parametrize("cast_type", ["bf16", "fp16"])
def test_matmult_runs_the_matmuls_in_the_cast_type_and_matches_fp32_eager(monkeypatch, cast_type):
    compiled, out, expected = compile_mlp(monkeypatch, f"--auto-cast matmult --auto-cast-type {cast_type}")
    narrow, torch_dtype = NARROW[cast_type]
    assert matmul_operand_dtypes(compiled.graph) == {narrow}
    assert len([n for n in compiled.graph.nodes() if n.op is Op.MATMUL]) == 3
    assert_matches_eager(out, expected, tolerance=torch_dtype)
    assert not torch.equal(out, expected)  # the narrower matmuls did change the numbers


def test_none_leaves_fp32_exact(monkeypatch):
    compiled, out, expected = compile_mlp(monkeypatch, "--auto-cast none")
    assert {n.dtype for n in compiled.graph.nodes()} == {DType.F32}
    assert_matches_eager(out, expected)


def test_all_computes_every_fp32_op_in_the_cast_type_behind_an_fp32_interface(monkeypatch):
    compiled, out, expected = compile_mlp(monkeypatch, "--auto-cast=all --auto-cast-type=bf16")
    graph = compiled.graph
    interface = set(graph.params) | set(graph.outputs)
    assert all(n.dtype is DType.F32 for n in interface)
    assert {n.dtype for n in graph.nodes() if n not in interface} == {DType.BF16}
    assert_matches_eager(out, expected, tolerance=torch.bfloat16)


def _mlp_with_fp8_matmuls(model, x):
    """The zoo MLP run by eager PyTorch with each matmul's operands rounded to float8_e4m3fn (the rest in fp32)."""
    def linear(layer, x):
        return F.linear(x.to(torch.float8_e4m3fn).float(), layer.weight.to(torch.float8_e4m3fn).float(), layer.bias)

    with torch.no_grad():
        x = F.gelu(linear(model.fc1, x))
        x = F.gelu(linear(model.fc2, x))
        return torch.softmax(linear(model.fc3, x), dim=-1)


def test_fp8_matmuls_are_e4m3_and_match_eager_with_the_same_rounding(monkeypatch):
    compiled, out, expected = compile_mlp(monkeypatch, "--auto-cast matmult --auto-cast-type fp8_e4m3")
    assert matmul_operand_dtypes(compiled.graph) == {DType.F8E4M3}
    model, (x,) = zoo.build("mlp")
    # fp32's tolerance: the program rounds exactly as eager with the same e4m3 rounding (measured 1.5e-8 apart),
    # while it is 1e-3 from fp32 eager, inside bf16's tolerance, so a looser bound would not see fp8 missing
    assert_matches_eager(out, _mlp_with_fp8_matmuls(model, x))
    _, bf16_out, _ = compile_mlp(monkeypatch, "--auto-cast matmult --auto-cast-type bf16")
    assert (out - expected).abs().max() > (bf16_out - expected).abs().max()  # 3 mantissa bits, not 7


@pytest.mark.parametrize("options", [dict(auto_cast="fast"), dict(auto_cast="all", auto_cast_type="int8")])
def test_an_unknown_mode_or_type_is_refused_with_the_choices(options):
    with pytest.raises(NeuronConfigError, match="unknown --auto-cast") as caught:
        CompileOptions(**options)
    assert "hint: use one of" in str(caught.value)


@pytest.mark.parametrize("name", ["mlp", "transformer_block"])
def test_torch_autocast_regions_match_eager_under_the_same_autocast(name):
    model, inputs = zoo.build(name)
    compiled = OnDevice(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(*inputs)
        actual = compiled(*inputs)
    assert_matches_eager(actual, expected, tolerance=torch.bfloat16)


DOT = """
    graph @f(%0, %1) {{
      %0 = parameter() : 2x3xf32 {{index = 0, name = "x", kind = "input"}}
      %1 = parameter() : 3x4xf32 {{index = 1, name = "w", kind = "weight"}}
      %2 = dot_general({a}, {b}) : 2x4xf32 {{lhs_batch = (), rhs_batch = (), lhs_contract = (1,), rhs_contract = (0,)}}
      %3 = exp(%2) : 2x4xf32
      return %3
    }}"""


def test_auto_cast_matmult_in_ir_text_casts_the_operands_of_matmuls_only():
    from neuronc.passes.auto_cast import AutoCast, auto_cast
    from tests.conftest import canonical, run_pass

    cast = DOT.format(a="%4", b="%5").replace("      %2 =", """      %4 = convert(%0) : 2x3xbf16
      %5 = convert(%1) : 3x4xbf16
      %2 =""")
    assert run_pass(auto_cast, DOT.format(a="%0", b="%1"), cast=AutoCast("matmult", "bf16")) == canonical(cast)
    assert run_pass(auto_cast, DOT.format(a="%0", b="%1")) == canonical(DOT.format(a="%0", b="%1"))  # none


def test_all_leaves_bitcasts_reading_fp32_bytes(monkeypatch):
    # signbit and a float sort's order key read an fp32's bits; narrowed to bf16 they would read half the bytes
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache --auto-cast=all --auto-cast-type=bf16")
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()  # exact in bf16
    x[0, 3], x[1, 7] = float("nan"), -0.0
    for fn in (torch.signbit, lambda t: torch.sort(t, dim=1, stable=True)[1]):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="neuron", fullgraph=True)(x), fn(x))
