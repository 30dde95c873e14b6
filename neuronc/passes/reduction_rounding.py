"""A float reduction whose result is only rounded to a narrower float computes that dtype itself.

AOTAutograd's bf16 training graphs sum in fp32 and convert: a norm weight's or bias's gradient is the fp32 sum
over tokens, then a convert to bf16, a kernel of its own (a few microseconds, most of them a DMA's fixed cost).
The reduction kernels accumulate in fp32 and round once into their output's dtype (passes/kernel_plans.py), so a
REDUCE_LAST read only by such a convert may write the narrower dtype directly: the same bits, one kernel fewer.
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.context import PassContext

ROUNDED_KINDS = ("add", "max", "min")  # accumulated in fp32 by every reduction kernel, rounded once at the end


def _rounded_reduction(convert, consumers: dict, outputs: set):
    """The fp32 REDUCE_LAST that `convert` only narrows to a float dtype, or None."""
    if convert.op is not Op.CONVERT or not convert.dtype.is_float or convert.dtype.itemsize >= DType.F32.itemsize:
        return None
    reduced = convert.inputs[0]
    if (reduced.op is not Op.REDUCE_LAST or reduced.dtype != DType.F32 or reduced.attrs["kind"] not in ROUNDED_KINDS
            or reduced in outputs or consumers.get(reduced) != {convert}):
        return None
    return reduced


def round_reductions_once(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each fp32 reduction read only by a convert to a narrower float computes the narrower dtype."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    narrowed = {}
    for node in graph.nodes():
        reduced = _rounded_reduction(node, consumers, outputs)
        if reduced is not None:
            narrowed[reduced] = node.dtype
    if not narrowed:
        return graph

    def narrow(node, inputs):
        if node in narrowed:
            return dataclasses.replace(node, inputs=inputs, dtype=narrowed[node], id=next(ir._ids))
        if node.op is Op.CONVERT and node.inputs[0] in narrowed:
            return inputs[0]  # the reduction now computes this value
        return None

    return graph.rewrite(narrow)
