"""A float arithmetic step of a tile and a per-row operand loaded as a column (read with stride 0 along the row:
the layer-norm weight gradient's `x - mean` and `* rstd`, its sum over tokens reading the statistics as columns)
is one TENSOR_ALU2 pass over the tile, the column's value held per partition (codegen/elementwise.py
`_held_column`), not a two-input TENSOR_TENSOR: the same fp32 arithmetic, -O0's bits. Two such steps, the second
reading the first's fp32 value alone (`(x - mean) * rstd`), are one TENSOR_ALU2 holding both columns, and a float
input widened to fp32 for such a step is read as it lies, the instruction widening it (`emit_body`)."""
from __future__ import annotations

import torch

from neuronc.isa import AluOp, DType, Opcode
from tests.test_recomputed_rows import _assert_o0s_bits_and_eagers_values, _backward, _run


def _repeated_column(ap) -> bool:
    return ap.free_elements > 1 and all(stride == 0 for stride, _ in ap.dims[1:])


def test_a_per_row_operand_is_held_in_one_pass_with_o0s_bits():
    backward, inputs = _backward()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    instructions = [inst for stream in optimised.neff.streams.values() for inst in stream]
    held = [inst for inst in instructions if inst.opcode == Opcode.TENSOR_ALU2
            and _repeated_column(inst.srcs[1]) and not _repeated_column(inst.srcs[0])]
    # alone (alu1 NONE), or two of them in one instruction (below), each column held
    assert {op for inst in held for op in (inst.alu, inst.alu1)} >= {AluOp.SUBTRACT, AluOp.MULTIPLY}
    assert not any(inst.opcode == Opcode.TENSOR_TENSOR and any(_repeated_column(ap) for ap in inst.srcs)
                   for inst in instructions)
    for value, base in zip(out, baseline):
        assert value is None or torch.equal(value, base)


def test_x_minus_mean_times_rstd_is_one_pass_reading_bf16_x_with_o0s_bits():
    backward, inputs = _backward()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    # the row-wise kernel's (rowwise_plan), which also makes the weight's sum over tokens (rowwise_column_sums)
    kernels = optimised.neff.kernels
    instructions = [inst for stream in optimised.neff.streams.values() for inst in stream
                    if 0 <= inst.kernel < len(kernels) and kernels[inst.kernel].name.startswith("rowwise")]
    pairs = [inst for inst in instructions if inst.opcode == Opcode.TENSOR_ALU2
             and (inst.alu, inst.alu1) == (AluOp.SUBTRACT, AluOp.MULTIPLY)
             and _repeated_column(inst.srcs[1]) and _repeated_column(inst.srcs[2])]
    assert pairs and all(inst.srcs[0].dtype == DType.BF16 and inst.dst.dtype == DType.F32 for inst in pairs)
    _assert_o0s_bits_and_eagers_values(backward, inputs, out, baseline)
