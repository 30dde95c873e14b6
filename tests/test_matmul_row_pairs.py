"""Row pairs (passes/row_pairs.py, codegen/matmul.py `output_tile_of_pair`): a matmul whose stores are its main
traffic (a weight gradient `x^T @ dy` over few tokens) computes two output tiles one above the other with their rows
interleaved (partition p: rows m0 + 2p and m0 + 2p + 1) and stores each slice of partitions of the pair by one DMA
of a rectangle of rows: half the store DMAs. Only the order of rows on partitions changes: the bits stay -O0's and
match eager. Not for fp32 operands, nor for a matmul loading an epilogue operand per tile."""
from __future__ import annotations

import pytest
import torch

from neuronc.isa import Engine, Opcode, Space
from neuronc.plans import MatmulPlan
from tests.conftest import assert_matches_eager, o2_with_o0_bits
from tests.test_matmul_store_slices import WeightGradient, WithResidual


def _plans(compiled) -> list:
    return [n.attrs["plan"] for n in compiled.graph.nodes() if isinstance(n.attrs.get("plan"), MatmulPlan)]


def _stores(compiled) -> list:
    """The store DMAs of the program's matmul kernels."""
    neff = compiled.neff
    matmuls = {i for i, k in enumerate(neff.kernels) if k.name.startswith("matmul")}
    return [i for stream in neff.streams.values() for i in stream
            if i.engine is Engine.DMA and i.kernel in matmuls and i.operands[0].space is Space.HBM]


@pytest.mark.parametrize("m", [768, 640])  # 3 pairs; 2 pairs and a row tile alone
def test_a_weight_gradient_stores_its_tiles_in_row_pairs_with_o0s_bits(m):
    torch.manual_seed(0)
    x, dy = torch.randn(256, m).to(torch.bfloat16), torch.randn(256, 512).to(torch.bfloat16)  # k 256, n 512
    compiled, (out,) = o2_with_o0_bits(WeightGradient(), (x, dy))
    assert_matches_eager(out, WeightGradient()(x, dy))
    plan, = _plans(compiled)
    assert plan.row_pairs
    stores = _stores(compiled)
    # a slice of partitions of a pair: [p, 2, 512], rows 2p and 2p + 1 (HBM row stride 512); of a tile alone [p, 512]
    paired = [s for s in stores if len(s.operands[1].dims) == 3]
    assert all(s.operands[0].dims[1] == (512, 2) and s.operands[1].shape[1:] == (2, 512) for s in paired)
    assert sum(s.operands[1].partitions for s in paired) == m // 256 * 128  # each pair's rows once, two a partition
    assert sum(s.operands[1].partitions for s in stores if s not in paired) == m % 256
    # the stationary operands of the pairs read A^T's columns every other one
    strided = [i for stream in compiled.neff.streams.values() for i in stream
               if i.opcode is Opcode.MATMUL and i.operands[1].dims[1] == (2, 128)]
    assert len(strided) == m // 256 * 2 * 256 // 128  # each paired tile's K tiles


def test_fp32_operands_and_an_epilogue_operand_keep_one_tile_a_store():
    torch.manual_seed(0)
    # small integers: every fp32 product and partial sum is exact, so any order of summation (the Tensor
    # engine's, this CPU's BLAS) gives eager's bits; with randn one element of 393,216 near zero differed by
    # 1.2e-5 on one machine's BLAS
    x, dy = torch.randint(-8, 9, (256, 768)).float(), torch.randint(-8, 9, (256, 512)).float()
    compiled, (out,) = o2_with_o0_bits(WeightGradient(), (x, dy))
    assert torch.equal(out, WeightGradient()(x, dy))
    assert not any(plan.row_pairs for plan in _plans(compiled))
    a, b = torch.randn(512, 256).to(torch.bfloat16), torch.randn(256, 512).to(torch.bfloat16)
    r = torch.randn(512, 512).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(WithResidual(), (a, b, r))
    assert_matches_eager(out, WithResidual()(a, b, r))
    assert not any(plan.row_pairs for plan in _plans(compiled))
    assert all(len(s.operands[1].dims) == 2 for s in _stores(compiled))
