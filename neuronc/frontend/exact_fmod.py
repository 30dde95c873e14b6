"""C's fmod of floats, exactly: cut out of the FX graph before torch-mlir and put back as one REMAINDER node.

torch-mlir lowers `aten.fmod.Tensor` on floats as a - trunc(a / b) * b in the operands' dtype. That is not fmod:
the quotient and the product round, so fp32's fmod(1e7 + 1, 3) is off by whole units and bf16's fmod(-212, 1.5) is
0 (eager: -0.5). The NeuronCore's ALU has the operation itself (AluOp.REMAINDER: the dividend's sign, exact, as
StableHLO's remainder), and torch.remainder (neuronc's decomposition: fmod moved into the divisor's sign) and
grid_sample's reflection padding are built on fmod. Each float fmod is cut out (kernel_calls.GraphCut) and comes
back as REMAINDER on its operands, converted to the result's dtype and broadcast to its shape. Integer fmod stays
with torch-mlir (exact there).
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op


def cut_float_fmod(cut, locations: dict) -> None:
    """Cut every floating-point `aten.fmod.Tensor` out of ``cut``'s graph (see the module docstring)."""
    import torch

    from neuronc.frontend.tensors import dtype_of
    from neuronc.neff.program import DebugLoc

    for node in list(cut.gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.fmod.Tensor:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point or value.is_complex():
            continue
        a, b = node.args[:2]
        if not all(isinstance(x, torch.fx.Node) for x in (a, b)):
            continue
        out = (tuple(value.shape), dtype_of(value.dtype))
        loc = locations.get(node.name, DebugLoc(op="aten.fmod.Tensor"))
        cut.cut(node, [a, b], [out], lambda values, out=out, loc=loc: [_remainder(values, *out, loc)],
                f"fmod{out}", loc)


def _remainder(values: list, shape: tuple, dtype, loc) -> ir.Node:
    operands = []
    for x in values:
        if x.dtype != dtype:
            x = ir.node(Op.CONVERT, [x], x.shape, dtype, loc)
        if x.shape != shape:  # numpy broadcasting: x's dims are the result's last ones
            x = ir.node(Op.BROADCAST_IN_DIM, [x], shape, dtype, loc,
                        dims=tuple(range(len(shape) - len(x.shape), len(shape))))
        operands.append(x)
    return ir.node(Op.REMAINDER, operands, shape, dtype, loc)
