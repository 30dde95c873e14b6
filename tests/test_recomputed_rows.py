"""The layer-norm backward's x-hat, read by the row-wise grad-input kernel and the weight gradient's sum over
tokens, is computed by both at -O2 (passes/recomputed_rows.py; the sum reads the per-token statistics as columns,
codegen/partition_sum.py): no kernel writes it, and the gradients keep -O0's bits."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from benchmarks.roofline import _aot_graphs
from neuronc.compiler import CompileOptions, compile_fx
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.passes.context import PassContext
from neuronc.passes.kernel_plans import reduce_plan
from neuronc.plans import PartitionSumPlan
from neuronc.targets import get_target
from neuronc.passes.recomputed_rows import recompute_rows_in_readers
from runtime import run_neff


def _backward():
    """AOTAutograd's backward graph of LayerNorm then Linear in bf16 (as GPT-2's), and inputs for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(768), nn.Linear(768, 768)).to(torch.bfloat16)
    x = (torch.randn(1, 256, 768) * torch.logspace(-2, 2, 256)[None, :, None] + 3.0).to(torch.bfloat16)
    backward = _aot_graphs(model, (x,), True)[1]
    inputs = [torch.randn(p.meta["val"].shape).to(p.meta["val"].dtype)
              for p in backward.graph.nodes if p.op == "placeholder"]
    inputs[1] = x
    return backward, inputs


def _run(backward, inputs, level):
    compiled = compile_fx(copy.deepcopy(backward), CompileOptions(opt_level=level))
    outputs = run_neff(compiled.neff, [to_numpy(t) for t in inputs]).outputs
    return compiled, [None if i is None else from_numpy(outputs[i]) for i in compiled.output_layout]


def _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline):
    """Each gradient bit for bit -O0's, and eager's within bf16's rounding (eager rounds each op to bf16)."""
    expected = backward(*inputs)
    for value, base, eager in zip(out, baseline, expected):
        if value is None:
            continue
        assert torch.equal(value, base)
        torch.testing.assert_close(value.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_x_hat_is_computed_by_its_readers_with_o0s_bits():
    backward, inputs = _backward()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    kinds = [n.op for n in optimised.graph.nodes()]
    assert Op.FUSED not in kinds and kinds.count(Op.ROWWISE) == 1  # no kernel writes x-hat
    sums = [reduce_plan(n, get_target("trn2")) for n in optimised.graph.nodes()
            if n.op is Op.REDUCE_LAST and n.shape == (768,)]
    assert all(isinstance(plan, PartitionSumPlan) for plan in sums)  # on the Tensor engine, mean and rstd as columns
    # none left: the linear bias's and the norm bias's are second outputs of the matmuls reading or making their dy
    # (passes/matmul_column_sums.py, tests/test_matmul_column_sums.py), the norm weight's of the row-wise kernel,
    # which computes x-hat (passes/rowwise_column_sums.py, tests/test_rowwise_column_sums.py)
    assert sums == []
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)


def test_the_pass_moves_x_hat_into_a_rowwise_kernel_and_a_sum_over_tokens():
    graph = parse("""
graph @main(%0, %1, %2) {
  %0 = parameter() : 1x4x8xbf16 {index = 0, name = "x", kind = "input"}
  %1 = parameter() : 1x4x1xf32 {index = 1, name = "mean", kind = "input"}
  %2 = parameter() : 1x4x8xf32 {index = 2, name = "dy", kind = "input"}
  %3 = fused(%0, %1) : 1x4x8xf32 {body = (convert(in0) : f32, subtract(s0, in1) : f32), views = (none, (0, (4, 1, 0)))}
  %4 = reduce_last(%2, %3) : 8xf32 {kind = "add", cols = 4, views = ((0, (1, 8)), (0, (1, 8))), prologue = (multiply(in0, in1) : f32,)}
  return %4
}""")
    done = recompute_rows_in_readers(graph, PassContext(opt_level=2))
    (total,) = done.outputs
    assert list(total.inputs) == [done.params[2], done.params[0], done.params[1]]
    assert total.attrs["views"] == ((0, (1, 8)), (0, (1, 8)), (0, (0, 1)))
    assert [(s.op, s.args) for s in total.attrs["prologue"]] == [
        (Op.CONVERT, (("input", 1),)), (Op.SUBTRACT, (("step", 0), ("input", 2))),
        (Op.MULTIPLY, (("input", 0), ("step", 1)))]
