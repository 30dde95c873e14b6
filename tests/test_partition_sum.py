"""A sum over the outer axis of a tensor's memory (x.sum(0) of a [T, R] tensor: a bias or norm-weight gradient,
summed over tokens) compiles at -O2 to a sum over partitions on the Tensor engine (a matmul by a ones column,
accumulating in fp32 in PSUM) instead of a row reduction reading every element with a strided DMA; the
numbers are eager PyTorch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.isa import Engine, Opcode
from neuronc.plans import PartitionSumPlan, ReducePlan
from tests.conftest import assert_matches_eager, compile_and_run, compile_module, run_program


class SumOverTokens(nn.Module):
    def forward(self, x):
        return x.sum(tuple(range(x.dim() - 1)))


def _reduction_plans(compiled) -> list:
    return [n.attrs["plan"] for n in compiled.graph.nodes() if n.op is Op.REDUCE_LAST]


@pytest.mark.parametrize("shape, dtype", [((200, 96), torch.float32), ((1, 300, 4200), torch.bfloat16)],
                         ids=["fp32-partial-tile", "bf16-two-psum-groups"])
def test_a_sum_over_tokens_is_summed_over_partitions_by_the_tensor_engine(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    compiled, out = compile_and_run(SumOverTokens(), (x,))
    plans = _reduction_plans(compiled)
    assert len(plans) == 1 and isinstance(plans[0], PartitionSumPlan)
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    assert any(i.opcode == Opcode.MATMUL for i in instructions)
    assert not any(i.opcode == Opcode.TENSOR_REDUCE for i in instructions)
    # every load moves whole rows: the innermost dim of each HBM read is contiguous
    loads = [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA for i in stream]
    assert all(i.srcs[0].dims[-1][0] == 1 for i in loads)
    assert_matches_eager(out, SumOverTokens()(x))


def test_the_baseline_keeps_the_row_reduction():
    """-O0 is the reference program (the roofline's bound counts its matmuls): no Tensor-engine sum there."""
    x = torch.randn(200, 96)
    compiled, out = compile_and_run(SumOverTokens(), (x,), opt_level=0)
    assert all(isinstance(p, ReducePlan) for p in _reduction_plans(compiled))
    assert_matches_eager(out, SumOverTokens()(x))


def test_a_max_over_tokens_is_not_a_matmul():
    x = torch.randn(200, 96)
    compiled, out = compile_and_run(_MaxOverTokens(), (x,))
    assert all(isinstance(p, ReducePlan) for p in _reduction_plans(compiled))
    assert_matches_eager(out, x.amax(0))


class _MaxOverTokens(nn.Module):
    def forward(self, x):
        return x.amax(0)


class NormWeightGradient(nn.Module):
    """A layer-norm weight's and bias's gradients: sums over tokens of dy * x_hat and of dy."""

    def forward(self, dy, x_hat):
        return (dy * x_hat).sum((0, 1)), dy.sum((0, 1))


def test_the_summed_product_is_computed_on_each_tile_not_read_from_hbm():
    torch.manual_seed(0)
    dy, x_hat = torch.randn(1, 300, 640), torch.randn(1, 300, 640)
    compiled = compile_module(NormWeightGradient(), (dy, x_hat))
    outputs = run_program(compiled.neff, (dy, x_hat))
    kernels = [n for n in compiled.graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE)]
    assert [n.op for n in kernels] == [Op.REDUCE_LAST, Op.REDUCE_LAST]  # no multiply kernel
    weight_sum = next(n for n in kernels if n.attrs.get("prologue"))
    assert isinstance(weight_sum.attrs["plan"], PartitionSumPlan) and len(weight_sum.inputs) == 2
    for out, expected in zip(outputs, NormWeightGradient()(dy, x_hat)):
        assert_matches_eager(out, expected)
