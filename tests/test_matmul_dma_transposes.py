"""A matmul operand read across its rows (A of x @ W^T: A^T's strips [K, rows]; B = W^T of a weight stored [out, in])
is a strided load at half a queue's rate, far down the payload curve. Where the tiling's price says so
(MatmulTiling.transposes) its strips load instead as DMA transposes, K tile by K tile, each a whole SBUF page of
columns (trn2's [128, 16] units of a 2-byte type at 0.9 of a queue's rate). Only how the operand reaches SBUF
changes: the bits stay -O0's and match eager."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.isa import Engine, Opcode
from neuronc.placement import SBUF_PAGE_BYTES
from tests.conftest import assert_matches_eager, o2_with_o0_bits


class Linear(nn.Module):
    def forward(self, x, w):
        return x @ w.t()


def _transposes(compiled) -> list:
    return [i for stream in compiled.neff.streams.values() for i in stream
            if i.engine is Engine.DMA and i.opcode is Opcode.DMA_TRANSPOSE]


def test_a_bf16_linear_loads_its_transposed_strips_as_dma_transposes_of_whole_k_tiles_with_o0s_bits():
    torch.manual_seed(0)
    x, w = torch.randn(512, 768).to(torch.bfloat16), torch.randn(2304, 768).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(Linear(), (x, w))
    assert_matches_eager(out, Linear()(x, w))
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert matmul.attrs["plan"].tiling.transposes  # the price chose them
    transposes = _transposes(compiled)
    assert transposes
    for instr in transposes:
        dst, src = instr.operands
        assert dst.partitions == 128 and src.dims[-1] == (1, 128)  # a whole K tile, contiguous in HBM
        assert dst.free_elements * dst.dtype.itemsize == SBUF_PAGE_BYTES  # one page of columns each


def test_fp32_operands_keep_their_strided_loads():
    torch.manual_seed(0)  # small integers: every fp32 sum exact whatever its order
    x, w = torch.randint(-4, 5, (512, 768)).float(), torch.randint(-4, 5, (1024, 768)).float()
    compiled, (out,) = o2_with_o0_bits(Linear(), (x, w))
    assert_matches_eager(out, Linear()(x, w))
    assert not _transposes(compiled)  # DMA transposes move 2-byte types only
