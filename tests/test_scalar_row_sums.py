"""A row sum whose prologue is one activation of an input (its identity widened on load, or a square of it minus a
per-row input: a layer-norm's mean and variance, which the bf16 backward recomputes as reductions) is one
ACTIVATE_BIAS_REDUCE on the Scalar engine per chunk (passes/kernel_plans.py `on_scalar`, codegen/rowwise.py),
not a Vector pass per step and a TENSOR_REDUCE; the same fp32 values summed the same way: -O0's bits."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.isa import Opcode
from neuronc.plans import RowSum, Summed
from tests.conftest import o2_with_o0_bits


class Statistics(nn.Module):
    def forward(self, x):  # as AOTAutograd's bf16 layer-norm backward recomputes them
        wide = x.float()
        mean = wide.mean(-1, keepdim=True)
        variance = (wide - mean).pow(2).mean(-1, keepdim=True)
        return mean, torch.rsqrt(variance + 1e-5).to(torch.bfloat16)


class ShiftedExpSum(nn.Module):
    def forward(self, x, shift):  # exp(x - m) summed: the shift is the activation's bias negated (-m)
        return (x.float() - shift).exp().sum(-1)


def _reductions(compiled) -> tuple:
    """(the REDUCE_LAST nodes' plans, the opcodes of their kernels' instructions)."""
    plans = [n.attrs["plan"] for n in compiled.graph.nodes() if n.op is Op.REDUCE_LAST]
    kernels = {i for i, k in enumerate(compiled.neff.kernels) if k.name.startswith("reduce_last")}
    opcodes = {inst.opcode for stream in compiled.neff.streams.values() for inst in stream if inst.kernel in kernels}
    return plans, opcodes


def test_the_layer_norm_statistics_are_summed_on_the_scalar_engine_with_o0s_bits():
    torch.manual_seed(0)
    x = (torch.randn(256, 768) * torch.logspace(-3, 3, 256)[:, None] + 7.0).to(torch.bfloat16)
    optimised, out = o2_with_o0_bits(Statistics(), (x,))
    plans, opcodes = _reductions(optimised)
    mean, variance = (plan.on_scalar for plan in plans)
    assert mean == RowSum(("input", 0))
    assert isinstance(variance, Summed) and variance.act is Op.MULTIPLY and variance.negated
    assert variance.src == ("input", 0) and variance.shift == ("input", 1)
    assert Opcode.ACTIVATE_BIAS_REDUCE in opcodes and Opcode.TENSOR_REDUCE not in opcodes
    for value, expected in zip(out, Statistics()(x)):
        torch.testing.assert_close(value, expected, rtol=2e-2, atol=1e-4)


def test_a_shifted_activation_takes_the_negated_shift_as_its_bias_with_o0s_bits():
    torch.manual_seed(0)
    x, shift = torch.randn(200, 300).to(torch.bfloat16), torch.randn(200, 1)
    optimised, (out,) = o2_with_o0_bits(ShiftedExpSum(), (x, shift))
    plans, opcodes = _reductions(optimised)
    # (the prologue is subtract, exp: x's widening convert is folded, the subtract reads it widened)
    assert [plan.on_scalar for plan in plans] == [Summed(Op.EXP, ("input", 0), 2, ("input", 1), False)]
    assert Opcode.TENSOR_REDUCE not in opcodes
    torch.testing.assert_close(out, ShiftedExpSum()(x, shift), rtol=1e-5, atol=1e-5)
