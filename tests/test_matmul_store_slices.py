"""How a matmul stores its result tiles (codegen/matmul.py `flush`): a kernel whose stores are its main traffic (a
weight gradient `x^T @ dy` over few tokens: no epilogue operand loaded per tile, k below both m and n) stores each
tile over half the DMA queues, slices of 16 partitions; one with an epilogue operand (a residual), a long k (a
projection) or a k above its rows (an LM head) keeps the default slices, 32 partitions for a [128, 512] bf16 tile. Only the placement of the
stores changes: the bits stay -O0's and match eager."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.isa import Engine, Space
from neuronc.targets import get_target
from tests.conftest import assert_matches_eager, o2_with_o0_bits


class WeightGradient(nn.Module):
    def forward(self, x, dy):
        return x.t() @ dy


class WithResidual(nn.Module):
    def forward(self, a, b, r):
        return a @ b + r


def _store_partitions(compiled) -> set:
    """The partitions each store DMA of the program's matmul kernels moves."""
    neff = compiled.neff
    matmuls = {i for i, k in enumerate(neff.kernels) if k.name.startswith("matmul")}
    return {i.operands[1].partitions for stream in neff.streams.values() for i in stream
            if i.engine is Engine.DMA and i.kernel in matmuls and i.operands[0].space is Space.HBM}


def test_weight_gradient_tiles_are_stored_over_half_the_queues():
    torch.manual_seed(0)
    x, dy = torch.randn(256, 512).to(torch.bfloat16), torch.randn(256, 512).to(torch.bfloat16)  # k 256, m = n = 512
    compiled, (out,) = o2_with_o0_bits(WeightGradient(), (x, dy))
    assert_matches_eager(out, WeightGradient()(x, dy))
    target = get_target("trn2")
    assert _store_partitions(compiled) == {target.partitions // (target.dma_queues // 2)}


def test_a_matmul_with_an_epilogue_operand_keeps_the_default_store_slices():
    torch.manual_seed(0)
    a, b = torch.randn(256, 256).to(torch.bfloat16), torch.randn(256, 512).to(torch.bfloat16)
    r = torch.randn(256, 512).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(WithResidual(), (a, b, r))
    assert_matches_eager(out, WithResidual()(a, b, r))
    assert 32 in _store_partitions(compiled)  # [128, 512] bf16 tiles in 4 slices; the kernel's last one in 8


class Projection(nn.Module):
    def forward(self, a, b):
        return a @ b


def test_a_matmul_with_a_long_k_keeps_the_default_store_slices():
    torch.manual_seed(0)
    a, b = torch.randn(256, 1024).to(torch.bfloat16), torch.randn(1024, 512).to(torch.bfloat16)  # k 1024 > 341
    compiled, (out,) = o2_with_o0_bits(Projection(), (a, b))
    assert_matches_eager(out, Projection()(a, b))
    assert 32 in _store_partitions(compiled)


def test_a_matmul_with_k_above_its_rows_keeps_the_default_store_slices():
    torch.manual_seed(0)  # an LM head's shape: k 384 over 256 tokens, n 2048 (k below the harmonic mean of m and n)
    a, b = torch.randn(256, 384).to(torch.bfloat16), torch.randn(384, 2048).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(Projection(), (a, b))
    assert_matches_eager(out, Projection()(a, b))
    assert 32 in _store_partitions(compiled)
