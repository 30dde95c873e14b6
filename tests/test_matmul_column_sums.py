"""A linear layer's bias gradient (dy summed over tokens) is the second output of its weight-gradient matmul
dW = dy^T @ x at -O2 (passes/matmul_column_sums.py): the matmul's resident A^T strip is dy as it lies, summed by
ones-column matmuls in the order of the sum's own kernel, so dy is loaded once and the gradients keep -O0's bits.
So is a sum over tokens of a matmul's result (a norm's bias gradient of the grad-input matmul's dy), from its
result tiles as they are stored."""
from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.roofline import _aot_graphs
from neuronc.ir import Op
from neuronc.ir_text import parse, to_text
from neuronc.isa import DType, Opcode
from neuronc.passes.context import PassContext
from neuronc.passes.matmul_column_sums import sum_operands_in_matmuls
from neuronc.passes.tiling import tile_matmuls
from neuronc.plans import MatmulPlan
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def test_the_bias_gradients_are_made_by_the_matmuls_reading_or_making_dy_with_o0s_bits():
    backward, inputs = _backward()  # AOTAutograd's backward of a bf16 LayerNorm + Linear(768, 768), 256 tokens
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    seconds = [n for n in optimised.graph.nodes() if n.op is Op.KERNEL_OUTPUT]
    assert all(n in optimised.graph.outputs and n.shape == (768,) for n in seconds)
    # the linear bias's: dy summed from the weight-gradient matmul's resident dy^T strip; the norm bias's: the
    # grad-input matmul's result (the norm's dy) summed from its result tiles
    # (the norm weight's is the row-wise kernel's second output: tests/test_rowwise_column_sums.py)
    plans = [n.inputs[0].attrs["plan"] for n in seconds if n.inputs[0].op is Op.MATMUL]
    assert sorted((p.a_sums, p.c_sums) for p in plans) == [(False, True), (True, False)]
    kernels = optimised.neff.kernels
    mine = [inst for stream in optimised.neff.streams.values() for inst in stream
            if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("matmul")
            and inst.opcode == Opcode.MATMUL and inst.srcs[0].free_elements == 1]
    # ones[128, 1]^T @ each of the 2 token tiles, a bank of 512 sums and one of 256: 4 matmuls in each of 2 kernels
    assert len(mine) == 8 and len({inst.kernel for inst in mine}) == 2
    assert all(inst.srcs[1].dtype == DType.BF16 and inst.dst.partitions == 1 for inst in mine)
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)


_GRAPH = """
graph @main(%0, %1) {
  %0 = parameter() : 512x768xbf16 {index = 0, name = "dy", kind = "input"}
  %1 = parameter() : 512x768xbf16 {index = 1, name = "x", kind = "input"}
  %2 = matmul(%0, %1) : 1x768x768xbf16 {k = 512, views = (%VIEW, none), epilogue = (convert(in0) : bf16,)}
  %3 = reduce_last(%SUMMED) : 768xbf16 {kind = "add", cols = 512, views = ((0, (1, 768)),)}
  return %2, %3
}"""


def _tiled(summed: str = "%0"):
    ctx = PassContext(opt_level=2)
    graph = tile_matmuls(parse(_GRAPH.replace("%VIEW", "(0, (0, 1, 768))").replace("%SUMMED", summed)), ctx)
    return graph, ctx


def test_the_pass_makes_the_sum_over_tokens_the_matmuls_second_output():
    graph, ctx = _tiled()
    assert graph.outputs[0].attrs["plan"].tiling.resident == "a"
    done = sum_operands_in_matmuls(graph, ctx)
    matmul, second = done.outputs
    assert matmul.op is Op.MATMUL and second.op is Op.KERNEL_OUTPUT and second.inputs == (matmul,)
    assert second.attrs["index"] == 1 and second.shape == (768,) and second.dtype == DType.BF16
    plan = matmul.attrs["plan"]
    assert isinstance(plan, MatmulPlan) and plan.a_sums
    assert {p.name for p in plan.epilogue_pools} >= {"sums_ones", "sums"}
    assert matmul.attrs["outputs"] == (((1, 768, 768), DType.BF16), ((768,), DType.BF16))
    assert not [n for n in done.nodes() if n.op is Op.REDUCE_LAST]
    assert "kernel_output(" in to_text(done)


def test_a_sum_of_the_matmuls_other_operand_stays_a_kernel():
    graph, ctx = _tiled("%1")  # x is B, streamed: no resident strip of it to sum
    assert sum_operands_in_matmuls(graph, ctx) is graph


_RESULT_SUMMED = """
graph @main(%0, %1) {
  %0 = parameter() : 512x768xbf16 {index = 0, name = "dq", kind = "input"}
  %1 = parameter() : 768x768xbf16 {index = 1, name = "w", kind = "input"}
  %2 = matmul(%0, %1) : 1x512x768xbf16 {k = 768, epilogue = (convert(in0) : bf16,)}
  %3 = reshape(%2) : 512x768xbf16
  %4 = reduce_last(%3) : 768xbf16 {kind = "add", cols = 512, views = ((0, (1, 768)),)}
  return %2, %4
}"""


def test_the_pass_makes_the_sum_over_tokens_of_a_matmuls_result_its_second_output():
    ctx = PassContext(opt_level=2)
    done = sum_operands_in_matmuls(tile_matmuls(parse(_RESULT_SUMMED), ctx), ctx)
    matmul, second = done.outputs
    assert second.op is Op.KERNEL_OUTPUT and second.inputs == (matmul,) and second.attrs["index"] == 1
    plan = matmul.attrs["plan"]
    assert plan.c_sums and not plan.a_sums
    assert matmul.attrs["outputs"] == (((1, 512, 768), DType.BF16), ((768,), DType.BF16))
    assert not [n for n in done.nodes() if n.op is Op.REDUCE_LAST]


def test_a_bias_gradient_summed_from_two_resident_strips_keeps_o0s_bits():
    torch.manual_seed(0)
    model = nn.Linear(768, 3072).to(torch.bfloat16)  # dW [3072, 768]: A^T's 3072 columns in more than one strip
    backward = _aot_graphs(model, (torch.randn(1, 512, 768).to(torch.bfloat16),), True)[1]
    inputs = [torch.randn(p.meta["val"].shape).to(p.meta["val"].dtype)
              for p in backward.graph.nodes if p.op == "placeholder"]
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    (second,) = [n for n in optimised.graph.nodes() if n.op is Op.KERNEL_OUTPUT]
    plan = second.inputs[0].attrs["plan"]
    assert plan.a_sums and plan.m > plan.tiling.block * plan.tiling.tile_m
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)
