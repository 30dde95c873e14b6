"""A per-row elementwise kernel reading only a row reduction (the layer-norm backward's mean = sum / 768 and
rsqrt(var / 768 + eps)) is the reduction's epilogue at -O2 (passes/reduction_epilogues.py): computed on the
reduction's fp32 row results before its store, with the bits of -O0, where each is a kernel of its own."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.passes.context import PassContext
from neuronc.passes.reduction_epilogues import fold_reduction_epilogues
from tests.conftest import o2_with_o0_bits


class Statistics(nn.Module):
    def forward(self, x):  # as AOTAutograd's bf16 layer-norm backward recomputes them
        wide = x.float()
        mean = wide.mean(-1, keepdim=True)
        variance = (wide - mean).pow(2).mean(-1, keepdim=True)
        return wide - mean, torch.rsqrt(variance + 1e-5).to(torch.bfloat16)


def test_the_per_row_steps_are_the_reductions_epilogues_with_o0s_bits():
    torch.manual_seed(0)
    x = (torch.randn(256, 768) * torch.logspace(-3, 3, 256)[:, None] + 7.0).to(torch.bfloat16)
    optimised, out = o2_with_o0_bits(Statistics(), (x,))
    epilogues = [n.attrs["epilogue"] for n in optimised.graph.nodes() if n.attrs.get("epilogue")
                 and n.op is Op.REDUCE_LAST]
    assert [[s.op for s in e] for e in epilogues] == [[Op.DIVIDE, Op.ADD, Op.RSQRT]]
    assert not any(n.op is Op.FUSED and n.size == 256 for n in optimised.graph.nodes())  # no per-row kernel
    for value, expected in zip(out, Statistics()(x)):
        torch.testing.assert_close(value, expected, rtol=2e-2, atol=1e-4)


def test_the_pass_folds_a_reader_of_the_reduction_alone():
    graph = parse("""
graph @main(%0) {
  %0 = parameter() : 4x8xbf16 {index = 0, name = "x", kind = "input"}
  %1 = reduce_last(%0) : 4xf32 {kind = "add", cols = 8, prologue = (convert(in0) : f32,), views = ((0, (8, 1)),)}
  %2 = reshape(%1) : 4x1xf32
  %3 = fused(%2) : 4x1xbf16 {body = (divide(in0, 8.0) : f32, rsqrt(s0) : bf16), views = (none,)}
  return %3
}""")
    folded = fold_reduction_epilogues(graph, PassContext(opt_level=2))
    (reshape,) = folded.outputs
    reduction = reshape.inputs[0]
    assert reshape.op is Op.RESHAPE and reshape.shape == (4, 1) and reshape.dtype.name == "BF16"
    assert reduction.op is Op.REDUCE_LAST and reduction.inputs[0] is folded.params[0]
    assert reduction.dtype.name == "BF16" and reduction.attrs["cols"] == 8
    assert [(s.op, s.args) for s in reduction.attrs["epilogue"]] == [
        (Op.DIVIDE, (("input", 0), ("imm", 8.0))), (Op.RSQRT, (("step", 0),))]
    assert not any(n.op is Op.FUSED for n in folded.nodes())


def test_a_reduction_read_twice_or_a_reader_of_two_tensors_is_kept():
    graph = parse("""
graph @main(%0, %1) {
  %0 = parameter() : 4x8xf32 {index = 0, name = "x", kind = "input"}
  %1 = parameter() : 4xf32 {index = 1, name = "y", kind = "input"}
  %2 = reduce_last(%0) : 4xf32 {kind = "add"}
  %3 = fused(%2, %1) : 4xf32 {body = (add(in0, in1) : f32,), views = (none, none)}
  %4 = reduce_last(%0) : 4xf32 {kind = "max"}
  %5 = fused(%4) : 4xf32 {body = (exp(in0) : f32,), views = (none,)}
  return %3, %4, %5
}""")
    kept = fold_reduction_epilogues(graph, PassContext(opt_level=2))
    assert sum(n.op is Op.FUSED for n in kept.nodes()) == 2
    assert not any("epilogue" in n.attrs for n in kept.nodes())
