"""A matmul whose epilogue rounds its result to bf16 and widens it back to fp32 (AOTAutograd's bf16 `mm` read
through a convert: the layer-norm backward's dy) stores the bf16 result at -O2 when every reader can widen it on
load (passes/widening_reads.py `widen_matmul_results_on_read`): the row-wise grad-input kernel and the sums over
tokens read dy as bf16, a sum of dy alone sums it as it lies on the Tensor engine, and an arithmetic step reads
it without a widening copy (codegen/elementwise.py). A widening convert is exact: the gradients keep -O0's bits."""
from __future__ import annotations

from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.isa import DType, Opcode
from neuronc.passes.context import PassContext
from neuronc.passes.widening_reads import widen_matmul_results_on_read
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def test_the_grad_input_matmul_stores_bf16_and_its_readers_widen_it_with_o0s_bits():
    backward, inputs = _backward()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    matmuls = [n for n in optimised.graph.nodes() if n.op is Op.MATMUL]
    assert matmuls and all(n.dtype == DType.BF16 for n in matmuls)  # dy [256, 768] stored as bf16, not fp32
    kernels = optimised.neff.kernels
    sums = [inst for stream in optimised.neff.streams.values() for inst in stream
            if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("reduce_last")]
    # no pass widens a loaded bf16 tile into an fp32 copy (a per-token column, rstd, still is): the Tensor engine
    # sums bf16 dy as it lies (the norm bias's gradient), the multiply by x-hat reads it as it lies (the weight's)
    assert not [inst for inst in sums if inst.opcode == Opcode.TENSOR_COPY and inst.srcs[0].free_elements > 1
                and inst.srcs[0].dtype == DType.BF16 and inst.dst.dtype == DType.F32]
    # the linear bias's and the norm bias's sums of bf16 dy, ones-column matmuls on the Tensor engine; both are now
    # second outputs of the matmuls reading or making dy (passes/matmul_column_sums.py, test_matmul_column_sums.py)
    ones_matmuls = [inst for stream in optimised.neff.streams.values() for inst in stream
                    if inst.opcode == Opcode.MATMUL and inst.srcs[0].free_elements == 1]
    assert len({inst.kernel for inst in ones_matmuls if inst.srcs[1].dtype == DType.BF16}) == 2
    # the norm weight's dy * x_hat, now in the row-wise kernel (passes/rowwise_column_sums.py), reads bf16 dy
    rows = [inst for stream in optimised.neff.streams.values() for inst in stream
            if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("rowwise")]
    assert any(inst.opcode == Opcode.TENSOR_TENSOR and DType.BF16 in {ap.dtype for ap in inst.srcs}
               and inst.dst.dtype == DType.F32 for inst in rows)
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)


_GRAPH = """
graph @main(%0, %1) {
  %0 = parameter() : 1x4x8xbf16 {index = 0, name = "a", kind = "input"}
  %1 = parameter() : 1x8x8xbf16 {index = 1, name = "b", kind = "input"}
  %2 = matmul(%0, %1) : 1x4x8xf32 {k = 8, epilogue = (convert(in0) : bf16, convert(s0) : f32)}
  %3 = reshape(%2) : 4x8xf32
  %4 = reduce_last(%3) : 8xf32 {kind = "add", cols = 4, views = ((0, (1, 8)),)}
  %5 = fused(%2, %0) : 1x4x8xf32 {body = (convert(in1) : f32, multiply(in0, s0) : f32)}
  %6 = %READER
  return %4, %5, %6
}"""


def test_the_pass_narrows_the_matmul_and_widens_each_reader():
    graph = parse(_GRAPH.replace("%6 = %READER", "%6 = fused(%0) : 1x4x8xf32 {body = (convert(in0) : f32,)}"))
    done = widen_matmul_results_on_read(graph, PassContext(opt_level=2))
    total, product, _ = done.outputs
    (reshaped,) = total.inputs
    (matmul,) = reshaped.inputs
    assert matmul.op is Op.MATMUL and matmul.dtype == DType.BF16 and reshaped.dtype == DType.BF16
    assert [(s.op, s.dtype) for s in matmul.attrs["epilogue"]] == [(Op.CONVERT, DType.BF16)]
    assert [(s.op, s.args) for s in total.attrs["prologue"]] == [(Op.CONVERT, (("input", 0),))]
    assert product.inputs[0] is matmul
    assert [(s.op, s.args) for s in product.attrs["body"]] == [
        (Op.CONVERT, (("input", 0),)), (Op.CONVERT, (("input", 1),)), (Op.MULTIPLY, (("step", 0), ("step", 1)))]


def test_a_reader_that_cannot_widen_keeps_the_fp32_result():
    graph = parse(_GRAPH.replace("%6 = %READER", "%6 = matmul(%2, %2) : 1x4x8xf32 {k = 8}"))
    assert widen_matmul_results_on_read(graph, PassContext(opt_level=2)) is graph
