"""Two arithmetic steps of a tile and a per-row column, the second reading the first's fp32 value alone (the
layer-norm weight gradient's `(x - mean) * rstd` in its sum over tokens), are one TENSOR_ALU2 holding both columns,
and a float input widened to fp32 for such a step is read as it lies, the instruction widening it
(codegen/elementwise.py `emit_body`): the same fp32 arithmetic, -O0's bits and eager's values."""
from __future__ import annotations

import torch

from neuronc.isa import AluOp, DType, Opcode
from tests.test_recomputed_rows import _backward, _run


def _repeated_column(ap) -> bool:
    return ap.free_elements > 1 and all(stride == 0 for stride, _ in ap.dims[1:])


def test_x_minus_mean_times_rstd_is_one_pass_reading_bf16_x_with_o0s_bits():
    backward, inputs = _backward()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    kernels = optimised.neff.kernels  # the sums over tokens' (the row-wise kernel makes its own pairs: rowwise_plan)
    instructions = [inst for stream in optimised.neff.streams.values() for inst in stream
                    if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("reduce_last")]
    pairs = [inst for inst in instructions if inst.opcode == Opcode.TENSOR_ALU2
             and (inst.alu, inst.alu1) == (AluOp.SUBTRACT, AluOp.MULTIPLY)
             and _repeated_column(inst.srcs[1]) and _repeated_column(inst.srcs[2])]
    assert pairs and all(inst.srcs[0].dtype == DType.BF16 and inst.dst.dtype == DType.F32 for inst in pairs)
    expected = backward(*inputs)
    for value, base, eager in zip(out, baseline, expected):
        if value is None:
            continue
        assert torch.equal(value, base)
        torch.testing.assert_close(value.float(), eager.float(), rtol=2e-2, atol=2e-2)
