"""A fused elementwise kernel with an activation on the Scalar engine is software-pipelined (codegen/elementwise.py):
the next block's steps up to its activation are emitted before this block's steps after it, so the in-order Vector
engine works on them while Scalar computes; values keep -O0's bits."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc.isa import Engine, Opcode
from tests.conftest import o2_with_o0_bits


class ExactGelu(nn.Module):
    """GELU written out (F.gelu of bf16 is one fp32 function, as eager's): x * 0.5 and x * 0.7071 (each rounded to
    bf16, the number kept in fp32), erf on Scalar, then add and multiply."""

    def forward(self, x):
        return x * 0.5 * (1 + torch.erf(x * 0.7071067811865476))


def _vector_steps(neff) -> list:
    """(opcode, immediate) of each Vector instruction of the program's fused kernel, in program order."""
    fused = {i for i, k in enumerate(neff.kernels) if k.name.startswith("fused")}
    return [(inst.opcode, inst.imm0) for inst in neff.streams.get((Engine.VECTOR, 0), []) if inst.kernel in fused]


def test_the_second_blocks_first_step_comes_before_the_first_blocks_product_with_o0s_bits():
    torch.manual_seed(0)
    x = torch.randn(512, 3072).to(torch.bfloat16)  # blocks of [128, 3072]
    optimised, (out,) = o2_with_o0_bits(ExactGelu(), (x,))
    steps = _vector_steps(optimised.neff)
    half, scale = (Opcode.TENSOR_SCALAR, 0.5), (Opcode.TENSOR_SCALAR, torch.tensor(0.7071067811865476).item())
    assert steps[:4] == [half, scale, half, scale]  # both blocks' first steps before block one's steps after its erf
    assert steps.index((Opcode.TENSOR_TENSOR, 0.0)) > 4
    torch.testing.assert_close(out, F.gelu(x), rtol=2e-2, atol=1e-2)
