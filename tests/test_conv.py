"""The implicit-GEMM convolution kernel (passes/conv.py, codegen/conv.py) against eager PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.ir import Op
from neuronc.targets import get_target
from runtime import run_neff
from tests.conftest import assert_matches_eager


class ConvBnRelu(nn.Module):
    """A convolution, then (optionally) BatchNorm in eval mode, ReLU and a residual add."""

    def __init__(self, conv: nn.Module, norm: bool = False, residual: bool = False):
        super().__init__()
        self.conv, self.residual = conv, residual
        self.norm = nn.BatchNorm2d(conv.out_channels) if norm else None
        if self.norm is not None:
            with torch.no_grad():  # running statistics other than the identity's
                self.norm.running_mean.uniform_(-0.5, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = self.conv(x)
        if self.norm is None:
            return y
        y = F.relu(self.norm(y))
        return F.relu(y + x) if self.residual else y


def _compiled(model, x, level=2):
    model = model.eval()
    with torch.no_grad():
        expected = model(x)
    compiled = compile_exported(torch.export.export(model, (x,)), CompileOptions(opt_level=level))
    got = torch.from_numpy(run_neff(compiled.neff, [x.numpy()]).outputs[0])
    return compiled, got, expected


def _convs(compiled) -> list:
    return [n for n in compiled.graph.nodes() if n.op is Op.CONV]


CASES = {
    "3x3_padding_1": ((2, 5, 9, 11), lambda: nn.Conv2d(5, 7, 3, padding=1)),
    "stride_2": ((2, 4, 9, 7), lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1)),
    "no_padding_odd_sizes": ((1, 3, 7, 13), lambda: nn.Conv2d(3, 4, (3, 5), bias=False)),
    "asymmetric_stride_dilation_padding": ((1, 5, 10, 11), lambda: nn.Conv2d(5, 3, (3, 2), stride=(1, 2),
                                                                            padding=(2, 0), dilation=(2, 1))),
    "channels_over_128": ((1, 130, 6, 5), lambda: nn.Conv2d(130, 140, 3, padding=1, bias=False)),
    "conv1d": ((2, 6, 20), lambda: nn.Conv1d(6, 8, 5, padding=2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_convolution_is_one_implicit_gemm_kernel_matching_eager(name):
    shape, make = CASES[name]
    torch.manual_seed(0)
    compiled, got, expected = _compiled(make(), torch.randn(*shape))
    assert len(_convs(compiled)) == 1
    assert Op.MATMUL not in [n.op for n in compiled.graph.nodes()]  # no im2col + matmul
    assert_matches_eager(got, expected)


def test_taps_are_paired_on_the_partitions_when_there_are_at_most_64_input_channels():
    from neuronc.passes.conv import geometry, tap_plan

    torch.manual_seed(0)
    compiled, got, expected = _compiled(nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(1, 64, 12, 12))
    (conv,) = _convs(compiled)
    plan = tap_plan(geometry(conv, get_target().partitions), conv.attrs["tiling"].band, halves=1)
    assert plan.copies == 2 and len(plan.matmuls) == 6  # 3 pairs of neighbouring columns + 3 single taps
    assert_matches_eager(got, expected)


@pytest.mark.parametrize("shape, stride", [((1, 64, 40, 70), 1), ((2, 32, 6, 9), 1), ((1, 16, 20, 140), 2)],
                         ids=["wide", "narrow", "strided"])
def test_rows_are_paired_on_the_output_partitions_when_there_are_at_most_64_output_channels(shape, stride):
    from neuronc.passes.conv import geometry, tap_plan

    torch.manual_seed(0)
    channels = shape[1]
    model = ConvBnRelu(nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False), norm=True,
                       residual=stride == 1)
    compiled, got, expected = _compiled(model, torch.randn(*shape))
    (conv,) = _convs(compiled)
    plan = tap_plan(geometry(conv, get_target().partitions), 8, halves=2)
    # every (tap, row) product of two output rows exactly once, 18 in 6 matmuls (3 blocks of the 4 each)
    computed = sorted((t, mh) for _, blocks in plan.matmuls for _, mh, t in blocks)
    assert computed == [(t, h) for t in range(9) for h in (0, 1)]
    if stride == 1:
        assert len(plan.matmuls) == 6  # where one row at a time takes 6 matmuls per row
    if conv.shape[-1] > 64:  # rows wider than the Tensor engine's minimum interval: pairs of rows pay off
        assert conv.attrs["tiling"].halves == 2
    assert_matches_eager(got, expected)


def test_batch_norm_relu_and_residual_are_the_epilogue_with_per_channel_values_computed_once():
    from neuronc.passes.conv import epilogue_plan

    torch.manual_seed(0)
    model = ConvBnRelu(nn.Conv2d(8, 8, 3, padding=1, bias=False), norm=True, residual=True)
    compiled, got, expected = _compiled(model, torch.randn(2, 8, 10, 10))
    (conv,) = _convs(compiled)
    assert len(compiled.neff.kernels) == 1  # 1 / sqrt(var + eps) too is computed in the conv's prologue
    plan = epilogue_plan(conv)
    # (acc - mean) * invstd * gamma + beta folded: the scale into the weights, the shift as the ReLU's bias;
    # per element, only the ReLU, the residual add and the last ReLU remain
    assert plan.scale is not None and plan.shift is not None and plan.biased is not None
    assert [conv.attrs["epilogue"][j].op for j, kind in enumerate(plan.kinds[:len(conv.attrs["epilogue"])])
            if kind == "element"] == [Op.MAXIMUM, Op.ADD, Op.MAXIMUM]
    assert_matches_eager(got, expected)


def test_the_baseline_keeps_im2col_and_matches_eager_too():
    torch.manual_seed(0)
    compiled, got, expected = _compiled(nn.Conv2d(4, 6, 3, stride=2, padding=1), torch.randn(2, 4, 9, 7), level=0)
    assert not _convs(compiled)
    assert_matches_eager(got, expected)


@pytest.mark.parametrize("make, channels", [(lambda: nn.Conv2d(4, 4, 3, padding=1, groups=2), 4),
                                           (lambda: nn.ConvTranspose2d(4, 4, 2, stride=2), 4),  # lhs dilation
                                           (lambda: nn.Conv2d(3, 8, 4, stride=4), 3)],  # windows do not overlap
                         ids=["grouped", "transposed", "patches"])
def test_convolutions_the_kernel_does_not_take_stay_on_im2col_and_match_eager(make, channels):
    torch.manual_seed(0)
    compiled, got, expected = _compiled(make(), torch.randn(2, channels, 8, 8))
    assert not _convs(compiled)
    assert_matches_eager(got, expected)
