"""A linear layer's bias gradient (dy summed over tokens) is the second output of its weight-gradient matmul
dW = dy^T @ x at -O2 (passes/matmul_column_sums.py): the matmul's resident A^T strip is dy as it lies, summed by
ones-column matmuls in the order of the sum's own kernel, so dy is loaded once and the gradients keep -O0's bits."""
from __future__ import annotations

from neuronc.ir import Op
from neuronc.ir_text import parse, to_text
from neuronc.isa import DType, Opcode
from neuronc.passes.context import PassContext
from neuronc.passes.matmul_column_sums import sum_operands_in_matmuls
from neuronc.passes.tiling import tile_matmuls
from neuronc.plans import MatmulPlan
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def test_the_linear_bias_gradient_is_made_by_the_weight_gradient_matmul_with_o0s_bits():
    backward, inputs = _backward()  # AOTAutograd's backward of a bf16 LayerNorm + Linear(768, 768), 256 tokens
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    (second,) = [n for n in optimised.graph.nodes() if n.op is Op.KERNEL_OUTPUT]
    (matmul,) = second.inputs
    assert matmul.op is Op.MATMUL and matmul.attrs["plan"].a_sums and second.shape == (768,)
    assert second in optimised.graph.outputs
    kernels = optimised.neff.kernels
    mine = [inst for stream in optimised.neff.streams.values() for inst in stream
            if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("matmul")
            and inst.opcode == Opcode.MATMUL and inst.srcs[0].free_elements == 1]
    # ones[128, 1]^T @ each of the 2 token tiles of dy, a bank of 512 sums and one of 256: 4 matmuls in one kernel
    assert len(mine) == 4 and len({inst.kernel for inst in mine}) == 1
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
