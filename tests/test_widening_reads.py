"""A widening convert read by several kernels (the bf16 layer-norm backward's x in fp32) is no kernel of its own at
-O2 (passes/widening_reads.py): the row reductions and the elementwise kernel widen x on load, with the bits of
-O0, where the convert is a kernel."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.ir import Op
from tests.conftest import o2_with_o0_bits


class Statistics(nn.Module):
    def forward(self, x):  # as AOTAutograd's bf16 layer-norm backward recomputes them
        wide = x.float()
        mean = wide.mean(-1, keepdim=True)
        variance = (wide - mean).pow(2).mean(-1, keepdim=True)
        return wide - mean, variance  # two values leave: no row-wise kernel


def test_no_kernel_writes_the_widened_copy_and_the_bits_are_o0s():
    torch.manual_seed(0)
    x = torch.randn(256, 768).to(torch.bfloat16)
    optimised, out = o2_with_o0_bits(Statistics(), (x,))
    assert not any(n.op is Op.CONVERT and n.dtype.name == "F32" for n in optimised.graph.nodes())
    for value, expected in zip(out, Statistics()(x.float())):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)


def test_the_pass_makes_each_reader_widen_on_load():
    from neuronc.ir_text import parse
    from neuronc.passes.context import PassContext
    from neuronc.passes.widening_reads import widen_on_read

    graph = parse("""
graph @main(%0) {
  %0 = parameter() : 4x8xbf16 {index = 0, name = "x", kind = "input"}
  %1 = convert(%0) : 4x8xf32
  %2 = reduce_last(%1) : 4xf32 {kind = "add"}
  %3 = reshape(%2) : 4x1xf32
  %4 = fused(%1, %3) : 4x8xf32 {body = (subtract(in0, in1) : f32,), views = (none, (0, (1, 0)))}
  return %2, %4
}""")
    widened = widen_on_read(graph, PassContext(opt_level=2))
    nodes = {n.op: n for n in widened.nodes()}
    assert Op.CONVERT not in nodes
    reduction, fused = nodes[Op.REDUCE_LAST], nodes[Op.FUSED]
    assert reduction.inputs[0] is widened.params[0] and reduction.attrs["cols"] == 8
    assert [(s.op, s.dtype.name) for s in reduction.attrs["prologue"]] == [(Op.CONVERT, "F32")]
    assert fused.inputs[0] is widened.params[0]
    assert [(s.op, s.args) for s in fused.attrs["body"]] == [(Op.CONVERT, (("input", 0),)),
                                                            (Op.SUBTRACT, (("step", 0), ("input", 1)))]
