"""The layer-norm statistics the bf16 backward recomputes from x (mean, then rstd from the variance) are computed
by the row-wise grad-input kernel at -O2, which loads x's rows itself and, with the weight gradient's sum over
tokens as its second output (passes/rowwise_column_sums.py), is their only reader (passes/rowwise_statistics.py):
no reduction kernel is left, the kernel sums each row as those kernels did, and the gradients keep -O0's bits."""
from __future__ import annotations

import dataclasses

import torch

from neuronc.ir import Op
from neuronc.passes import rowwise_schedule
from neuronc.plans import BnStats
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def test_the_recomputed_statistics_are_steps_of_the_rowwise_kernel_with_o0s_bits(monkeypatch):
    """The mean and the variance of x are one BnStats step of the kernel (passes/rowwise_plan.py); the row tiles its
    schedule gives BN_STATS (`bn_tiles`) round them otherwise than -O0's row sums (within eager's tolerance), the
    others as -O0 does: with `bn_tiles` 0 the gradients have -O0's bits."""
    backward, inputs = _backward()  # AOTAutograd's backward of a bf16 LayerNorm + Linear(768, 768), 256 tokens
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    nodes = optimised.graph.nodes()
    assert not [n for n in nodes if n.op is Op.REDUCE_LAST]  # no reduction kernel left
    (row,) = [n for n in nodes if n.op is Op.ROWWISE]
    # the mean's and the variance's row sums, then the grad-input's two
    assert sum(step.op is Op.REDUCE_LAST for step in row.attrs["body"]) == 4
    instrs = [instr for _, instr in row.attrs["plan"].tile.instrs]
    assert any(isinstance(instr, BnStats) and instr.src[0] == "input" for instr in instrs)  # mean and variance of x
    if row.attrs["schedule"].bn_tiles:
        real = rowwise_schedule.choose_schedule
        monkeypatch.setattr(rowwise_schedule, "choose_schedule",
                            lambda *args, **kw: dataclasses.replace(real(*args, **kw), bn_tiles=0))
        for value, eager in zip(out, backward(*inputs)):  # eager's values within bf16's rounding, as the helper's
            if value is not None:
                torch.testing.assert_close(value.float(), eager.float(), rtol=2e-2, atol=2e-2)
        optimised, out = _run(backward, inputs, 2)
        assert not _rows(optimised)[0].attrs["schedule"].bn_tiles
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)


def _rows(compiled):
    return [n for n in compiled.graph.nodes() if n.op is Op.ROWWISE]
