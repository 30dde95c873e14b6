"""An activation step reads its operand's scale and width and rounds its result once (-O2,
passes/activation_operands.py): the bf16 exact GELU's converts around erf and a constant multiply feeding erf or
exp are no instructions of their own, and the bits are -O0's (each op its own kernel)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.passes.activation_operands import fold_activation_operands
from neuronc.passes.context import PassContext
from tests.conftest import assert_matches_eager, o2_with_o0_bits


class Gelu(nn.Module):
    def forward(self, x):
        return F.gelu(x)


class GeluBackwardTerms(nn.Module):
    def forward(self, x):  # the exact GELU's derivative, as AOTAutograd's backward spells it
        cdf = (torch.erf(x * 0.7071067811865476) + 1.0) * 0.5
        pdf = torch.exp(x * x * -0.5) * 0.3989422804014327
        return cdf + x * pdf


def _steps(compiled):
    return [s for n in compiled.graph.nodes() if n.op is Op.FUSED for s in n.attrs["body"]]


def test_the_pass_folds_widening_and_narrowing_converts_and_a_scale_into_the_activations():
    graph = parse("""
graph @main(%0) {
  %0 = parameter() : 4x8xbf16 {index = 0, name = "x", kind = "input"}
  %1 = fused(%0) : 4x8xbf16 {
      body = (
          multiply(in0, 0.70703125) : bf16, convert(s0) : f32, erf(s1) : f32, convert(s2) : bf16,
          multiply(in0, -0.5) : f32, exp(s4) : f32, convert(s5) : bf16, add(s3, s6) : bf16),
      views = (none,)}
  return %1
}""")
    (node,) = [n for n in fold_activation_operands(graph, PassContext(opt_level=2)).nodes() if n.op is Op.FUSED]
    body = node.attrs["body"]
    assert [(s.op, s.dtype.name) for s in body] == [(Op.MULTIPLY, "BF16"), (Op.ERF, "BF16"), (Op.EXP, "BF16"),
                                                    (Op.ADD, "BF16")]
    assert body[1].args == (("step", 0),) and "scale" not in body[1].attrs  # a bf16 multiply rounds: kept
    assert body[2].args == (("input", 0),) and body[2].attrs["scale"] == -0.5
    assert body[3].args == (("step", 1), ("step", 2))


def test_the_bf16_gelu_has_no_convert_step_and_the_bits_of_o0():
    torch.manual_seed(0)
    x = (torch.randn(256, 384) * 3).to(torch.bfloat16)
    optimised, (out,) = o2_with_o0_bits(Gelu(), (x,))
    assert not any(s.op is Op.CONVERT for s in _steps(optimised))
    assert_matches_eager(out, F.gelu(x))


def test_constant_multiplies_feeding_erf_and_exp_are_their_scales_with_the_bits_of_o0():
    torch.manual_seed(0)
    x = torch.randn(256, 384) * 3
    optimised, (out,) = o2_with_o0_bits(GeluBackwardTerms(), (x,))
    scaled = [s for s in _steps(optimised) if s.op in (Op.ERF, Op.EXP)]
    assert sorted(s.attrs.get("scale") for s in scaled) == sorted([0.7071067690849304, -0.5])
    assert_matches_eager(out, GeluBackwardTerms()(x))


class GeluBackwardTimesGrad(nn.Module):
    def forward(self, grad, x):  # AOTAutograd's bf16 GELU backward: fp32 terms, the product rounded to bf16
        xf = x.float()
        cdf = (torch.erf(xf * 0.7071067811865476) + 1.0) * 0.5
        pdf = torch.exp(xf * xf * -0.5) * 0.3989422804014327
        return (grad.float() * (cdf + xf * pdf)).to(torch.bfloat16)


def test_the_pass_makes_half_of_one_plus_erf_a_scaled_and_biased_step():
    graph = parse("""
graph @main(%0) {
  %0 = parameter() : 4x8xf32 {index = 0, name = "x", kind = "input"}
  %1 = fused(%0) : 4x8xf32 {
      body = (
          erf(in0) : f32, add(s0, 1.0) : f32, multiply(s1, 0.5) : f32,
          add(in0, 1.0) : f32, multiply(s3, 0.5) : f32, add(s2, s4) : f32),
      views = (none,)}
  return %1
}""")
    (node,) = [n for n in fold_activation_operands(graph, PassContext(opt_level=2)).nodes() if n.op is Op.FUSED]
    body = node.attrs["body"]
    assert [s.op for s in body] == [Op.ERF, Op.MULTIPLY, Op.ADD, Op.MULTIPLY, Op.ADD]
    assert body[1].args == (("step", 0), ("imm", 0.5)) and body[1].attrs == {"bias": 0.5}
    assert body[3].args == (("step", 2), ("imm", 0.5)) and body[3].attrs == {}  # x + 1 is not bounded: kept


def test_the_gelu_backward_computes_its_cdf_in_one_step_with_the_bits_of_o0():
    torch.manual_seed(0)
    x = (torch.randn(256, 384) * 3).to(torch.bfloat16)
    x[0, :5] = torch.tensor([-0.0, 0.0, 1e-38, -30.0, 30.0])  # signed zeros, a subnormal erf, erf = -1 and 1
    grad = torch.randn(256, 384).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(GeluBackwardTimesGrad(), (grad, x))
    assert not any(s.op is Op.ADD and ("imm", 1.0) in s.args for s in _steps(compiled))
    assert any(s.attrs.get("bias") == 0.5 for s in _steps(compiled))
    assert_matches_eager(out, GeluBackwardTimesGrad()(grad, x))
