"""The tiling passes price a matmul, chain or convolution candidate by its kernel emitted alone and timed on the
emulator's clock (neuronc.kernel_timing): that price is the compiled program's emulated time, and the tiling
chosen is the fastest one in the emulated program."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.ir import Op
from neuronc.kernel_timing import kernel_time
from neuronc.passes import tiling
from neuronc.targets import get_target
from tests.test_conv import ConvBnRelu


class MatMul(nn.Module):
    def __init__(self, transposed: bool = False):
        super().__init__()
        self.transposed = transposed

    def forward(self, a, b):
        return a @ (b.T if self.transposed else b)


def _compile(model, inputs, dtype):
    model = model.eval().to(dtype)
    inputs = tuple(x.to(dtype) for x in inputs)
    return compile_exported(torch.export.export(model, inputs), CompileOptions(opt_level=3))  # -O3: tilings timed


def _kernel(compiled, op):
    """The program's one kernel, a node of `op`."""
    assert len(compiled.neff.kernels) == 1
    (node,) = [n for n in compiled.graph.nodes() if n.op is op]
    return node


MATMULS = {
    "bf16_384x512x768": (lambda: MatMul(), lambda: (torch.randn(384, 512), torch.randn(512, 768)), torch.bfloat16),
    "bf16_transposed_b": (lambda: MatMul(True), lambda: (torch.randn(256, 640), torch.randn(384, 640)), torch.bfloat16),
    "fp32_linear_gelu": (lambda: nn.Sequential(nn.Linear(256, 512), nn.GELU()), lambda: (torch.randn(200, 256),),
                         torch.float32),
    "bf16_mlp_chain": (lambda: nn.Sequential(nn.Linear(64, 384), nn.GELU(), nn.Linear(384, 640)),
                       lambda: (torch.randn(400, 64),), torch.bfloat16),
}


@pytest.mark.parametrize("case", MATMULS)
def test_a_matmul_kernels_price_is_its_emulated_time_within_five_percent(case):
    torch.manual_seed(0)
    model, inputs, dtype = MATMULS[case]
    compiled = _compile(model(), inputs(), dtype)
    node = _kernel(compiled, Op.MATMUL)
    assert (node.attrs.get("chain") is not None) == (case == "bf16_mlp_chain")
    priced, _ = kernel_time(node, get_target())
    assert priced == pytest.approx(compiled.neff.estimated_ns, rel=0.05)


CONVS = {
    "fp32_conv_bn_relu": (lambda: ConvBnRelu(nn.Conv2d(16, 32, 3, padding=1), norm=True), (2, 16, 20, 20),
                          torch.float32),
    "bf16_stride_2": (lambda: nn.Conv2d(24, 48, 3, stride=2, padding=1), (1, 24, 30, 30), torch.bfloat16),
}


@pytest.mark.parametrize("case", CONVS)
def test_a_convolution_kernels_price_is_its_emulated_time_within_five_percent(case):
    torch.manual_seed(0)
    model, shape, dtype = CONVS[case]
    compiled = _compile(model(), (torch.randn(*shape),), dtype)
    priced, _ = kernel_time(_kernel(compiled, Op.CONV), get_target())
    assert priced == pytest.approx(compiled.neff.estimated_ns, rel=0.05)


def test_the_tiling_chosen_is_the_fastest_candidate_in_the_emulated_program(monkeypatch):
    """Every candidate forced in turn: none makes the program faster than the tiling pass's own choice."""
    torch.manual_seed(0)
    inputs = (torch.randn(512, 512), torch.randn(512, 1024))
    chosen = _compile(MatMul(), inputs, torch.bfloat16)
    node = _kernel(chosen, Op.MATMUL)
    options = tiling.candidates(node, get_target(), True)  # -O3 chooses among the wide set
    assert len(options) > 3
    times = {}
    for option in options:
        monkeypatch.setattr(tiling, "choose", lambda node, target, wide=False, timed=None, o=option: o)
        times[option] = _compile(MatMul(), inputs, torch.bfloat16).neff.estimated_ns
    assert chosen.neff.estimated_ns == min(times.values())
    assert times[node.attrs["tiling"]] == chosen.neff.estimated_ns
