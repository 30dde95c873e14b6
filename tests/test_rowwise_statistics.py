"""The layer-norm statistics the bf16 backward recomputes from x (mean, then rstd from the variance) are computed
by the row-wise grad-input kernel at -O2, which loads x's rows itself and, with the weight gradient's sum over
tokens as its second output (passes/rowwise_column_sums.py), is their only reader (passes/rowwise_statistics.py):
no reduction kernel is left, the kernel sums each row as those kernels did, and the gradients keep -O0's bits."""
from __future__ import annotations

from neuronc.ir import Op
from neuronc.plans import RowSum, Summed
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def test_the_recomputed_statistics_are_steps_of_the_rowwise_kernel_with_o0s_bits():
    backward, inputs = _backward()  # AOTAutograd's backward of a bf16 LayerNorm + Linear(768, 768), 256 tokens
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    nodes = optimised.graph.nodes()
    assert not [n for n in nodes if n.op is Op.REDUCE_LAST]  # no reduction kernel left
    (row,) = [n for n in nodes if n.op is Op.ROWWISE]
    # the mean's and the variance's row sums, then the grad-input's two
    assert sum(step.op is Op.REDUCE_LAST for step in row.attrs["body"]) == 4
    instrs = [instr for _, instr in row.attrs["plan"].tile.instrs]
    assert any(isinstance(instr, RowSum) and instr.src[0] == "input" for instr in instrs)  # sum(x)
    assert any(isinstance(instr, Summed) and instr.act is Op.MULTIPLY and instr.negated and instr.shift[0] == "step"
               for instr in instrs)  # sum((x - mean)^2), the mean a step of the kernel's own
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)
