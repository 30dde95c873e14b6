"""A layer-norm weight's gradient, (dy * x_hat) summed over tokens, is the second output of the row-wise grad-input
kernel at -O2 (passes/rowwise_column_sums.py): that kernel already loads dy and x and computes x_hat for its rows,
multiplies them once more and sums the product over its row tiles with ones-column matmuls, in the order of the
sum's own kernel (codegen/partition_sum.py), so the gradients keep -O0's bits and the sum's kernel goes."""
from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.roofline import _aot_graphs
from neuronc.ir import Op
from neuronc.isa import DType, Opcode
from neuronc.plans import RowwisePlan
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def _ones_matmuls(compiled, kind: str) -> list:
    kernels = compiled.neff.kernels
    return [inst for stream in compiled.neff.streams.values() for inst in stream
            if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith(kind)
            and inst.opcode == Opcode.MATMUL and inst.srcs[0].free_elements == 1]


def test_the_norm_weight_gradient_is_a_second_output_of_the_rowwise_kernel_with_o0s_bits():
    backward, inputs = _backward()  # AOTAutograd's backward of a bf16 LayerNorm + Linear(768, 768), 256 tokens
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    nodes = optimised.graph.nodes()
    assert not [n for n in nodes if n.op is Op.REDUCE_LAST and n.shape == (768,)]  # no sum over tokens left
    (second,) = [n for n in nodes if n.op is Op.KERNEL_OUTPUT and n.inputs[0].op is Op.ROWWISE]
    assert second in optimised.graph.outputs and second.shape == (768,) and second.dtype == DType.BF16
    row = second.inputs[0]
    plan: RowwisePlan = row.attrs["plan"]
    (step,) = plan.sums
    body = row.attrs["body"]
    assert body[step].op is Op.MULTIPLY and body[step].dtype == DType.F32  # dy * x_hat
    # x_hat is the body's own (the grad-input rows read it too), not computed a second time for the sum
    x_hat = body[step].args[1]
    assert x_hat[0] == "step" and any(x_hat in s.args for j, s in enumerate(body) if j != step)
    # ones[128, 1]^T @ each of the 2 row tiles' fp32 products, a bank of 512 sums and one of 256
    mine = _ones_matmuls(optimised, "rowwise")
    assert len(mine) == 4 and all(inst.srcs[1].dtype == DType.F32 and inst.dst.partitions == 1 for inst in mine)
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)


def test_row_tiles_in_pairs_and_a_partial_last_one_keep_o0s_bits():
    torch.manual_seed(1)
    model = nn.Sequential(nn.LayerNorm(768), nn.Linear(768, 768)).to(torch.bfloat16)
    x = (torch.randn(1, 600, 768) * 2.0 + 1.0).to(torch.bfloat16)  # 5 row tiles, the last of 88 rows
    backward = _aot_graphs(model, (x,), True)[1]
    inputs = [torch.randn(p.meta["val"].shape).to(p.meta["val"].dtype)
              for p in backward.graph.nodes if p.op == "placeholder"]
    inputs[1] = x
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    assert [n.op for n in optimised.graph.nodes() if n.op is Op.KERNEL_OUTPUT and n.inputs[0].op is Op.ROWWISE]
    assert len(_ones_matmuls(optimised, "rowwise")) == 10  # 5 row tiles x 2 banks
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)
