"""A per-row elementwise kernel read only through broadcasts (the layer-norm backward's rounded mean,
`convert(convert(mean) : bf16) : f32` over [rows, 1], read by x-hat) is computed by its readers at -O2
(passes/per_row_producers.py), on the [rows, 1] column they load (codegen/elementwise.py), with -O0's bits."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.isa import Engine
from neuronc.passes.context import PassContext
from neuronc.passes.per_row_producers import fold_per_row_producers
from tests.conftest import compiled_outputs


class CentredRows(nn.Module):
    def forward(self, x):  # as AOTAutograd's bf16 layer-norm backward computes x-hat
        wide = x.float()
        mean = wide.mean(-1, keepdim=True)
        variance = (wide - mean).pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + 1e-5).to(torch.bfloat16)
        x_hat = (wide - mean.to(torch.bfloat16).float()) * rstd.float()
        return x_hat, x_hat.sum(0), rstd  # read by a sum over rows too: no row-wise kernel takes it


def test_the_rounded_mean_is_computed_by_x_hat_with_o0s_bits():
    torch.manual_seed(0)
    x = (torch.randn(256, 768) * torch.logspace(-3, 3, 256)[:, None] + 7.0).to(torch.bfloat16)
    optimised, out = compiled_outputs(CentredRows(), (x,))
    _, baseline = compiled_outputs(CentredRows(), (x,), opt_level=0)
    assert not any(n.op is Op.FUSED and n.shape[-1] == 1 for n in optimised.graph.nodes())  # no per-row kernel
    x_hat, rstd = out[0], out[2]
    assert torch.equal(x_hat, baseline[0]) and torch.equal(rstd, baseline[2])  # the sum over rows: another order
    for value, expected in zip(out, CentredRows()(x)):
        torch.testing.assert_close(value, expected, rtol=2e-2, atol=1e-2)


def test_a_step_of_per_row_values_is_computed_once_a_partition():
    x = torch.randn(256, 768).to(torch.bfloat16)
    neff = compiled_outputs(CentredRows(), (x,))[0].neff
    fused = {i for i, k in enumerate(neff.kernels) if k.name.startswith("fused")}
    steps = [inst for (engine, _), stream in neff.streams.items() if engine is not Engine.DMA
             for inst in stream if inst.kernel in fused]
    # the two converts of the mean and the convert of rstd, each on a [partitions, 1] column of each block
    assert any(inst.operands[0].free_elements == 1 for inst in steps)
    assert all(inst.operands[0].free_elements == 1 or inst.operands[0].free_elements > 64 for inst in steps)


def test_the_pass_folds_a_per_row_kernel_into_its_broadcasting_reader():
    graph = parse("""
graph @main(%0, %1) {
  %0 = parameter() : 4x8xf32 {index = 0, name = "x", kind = "input"}
  %1 = parameter() : 4x1xf32 {index = 1, name = "mean", kind = "input"}
  %2 = fused(%1) : 4x1xf32 {body = (convert(in0) : bf16, convert(s0) : f32), views = (none,)}
  %3 = fused(%0, %2) : 4x8xf32 {body = (subtract(in0, in1) : f32, multiply(s0, 2.0) : f32), views = (none, (0, (1, 0)))}
  return %3
}""")
    folded = fold_per_row_producers(graph, PassContext(opt_level=2))
    (reader,) = folded.outputs
    assert reader.op is Op.FUSED and list(reader.inputs) == list(folded.params)
    assert reader.attrs["views"] == (None, (0, (1, 0)))
    assert [(s.op, s.args) for s in reader.attrs["body"]] == [
        (Op.CONVERT, (("input", 1),)), (Op.CONVERT, (("step", 0),)),
        (Op.SUBTRACT, (("input", 0), ("step", 1))), (Op.MULTIPLY, (("step", 2), ("imm", 2.0)))]


def test_a_per_row_kernel_read_as_it_lies_or_comparing_is_kept():
    graph = parse("""
graph @main(%0, %1) {
  %0 = parameter() : 4x8xf32 {index = 0, name = "x", kind = "input"}
  %1 = parameter() : 4x1xf32 {index = 1, name = "mean", kind = "input"}
  %2 = fused(%1) : 4x1xf32 {body = (convert(in0) : bf16, convert(s0) : f32), views = (none,)}
  %3 = fused(%0, %2) : 4x8xf32 {body = (subtract(in0, in1) : f32,), views = (none, (0, (1, 0)))}
  %4 = fused(%2) : 4x1xf32 {body = (multiply(in0, 3.0) : f32,), views = (none,)}
  %5 = compare(%1, %1) : 4x1xbool {direction = "GT"}
  %6 = fused(%0, %5) : 4x8xf32 {body = (select(in1, in0, in0) : f32,), views = (none, (0, (1, 0)))}
  return %3, %4, %6
}""")
    kept = fold_per_row_producers(graph, PassContext(opt_level=2))
    assert sum(n.op is Op.FUSED and n.shape == (4, 1) for n in kept.nodes()) == 2
    assert kept.outputs[0].inputs[1].op is Op.FUSED
