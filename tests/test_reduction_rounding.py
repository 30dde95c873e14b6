"""An fp32 reduction read only by a convert to a narrower float (a bf16 training graph's weight and bias
gradients: fp32 sums over tokens, then bf16) computes the narrower dtype itself at -O2: one kernel fewer, the
same bits as the reduction and the convert apart (-O0), and eager PyTorch's numbers."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from runtime import run_neff
from tests.conftest import assert_matches_eager


class RoundedReductions(nn.Module):
    def forward(self, x):
        return x.sum(0).to(torch.bfloat16), x.amax(-1).to(torch.bfloat16), x.sum(-1)


@pytest.fixture(scope="module")
def programs():
    torch.manual_seed(0)
    x = torch.randn(300, 768)
    program = torch.export.export(RoundedReductions(), (x,))
    results = {}
    for level in (0, 2):
        compiled = compile_exported(program, CompileOptions(opt_level=level))
        results[level] = compiled, [from_numpy(o) for o in run_neff(compiled.neff, [to_numpy(x)]).outputs]
    return x, results


def test_the_reductions_write_bf16_and_no_convert_is_left(programs):
    _, results = programs
    compiled, _ = results[2]
    reductions = [n for n in compiled.graph.nodes() if n.op is Op.REDUCE_LAST]
    assert sorted(n.dtype.name for n in reductions) == ["BF16", "BF16", "F32"]  # the fp32 row sum is an output
    assert not any(n.op is Op.CONVERT for n in compiled.graph.nodes())
    assert len(compiled.neff.kernels) == 3


def test_the_bits_are_those_of_the_reduction_and_the_convert_apart(programs):
    x, results = programs
    (_, optimised), (_, baseline) = results[2], results[0]
    for out, base, expected in zip(optimised, baseline, RoundedReductions()(x)):
        assert torch.equal(out, base)
        assert_matches_eager(out, expected)
