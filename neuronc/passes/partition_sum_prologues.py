"""A sum over tokens computes the elementwise group it sums, tile by tile, instead of reading it from HBM.

A layer-norm weight's gradient is sum_t (dy * x_hat)[t, :]: an elementwise kernel writes dy * x_hat ([T, C] in
fp32), and the sum over tokens (a partition sum, passes/kernel_plans.py) reads it back. fuse_reduction_prologues
folds one producer into a reduction, here the transposing view; this pass folds the elementwise group behind it
as well when every operand of the group is dense over the group's shape (so each is read through the same
transposed view): the partition sum loads the operands' tiles, computes the group on chip and sums the result.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.fusion import private_chain
from neuronc.passes.legalize import dense_strides

MAX_INPUTS = 4  # operand tiles of a partition sum's prologue (each a [128, group] tile, three buffers)


def _transposed_sum(node) -> bool:
    """A float sum of one dense [T, R] input read as [R, T] (row stride 1, column stride R), nothing folded yet."""
    if node.op is not Op.REDUCE_LAST or "cols" not in node.attrs or node.attrs.get("prologue"):
        return False
    if node.attrs["kind"] != "add" or len(node.inputs) != 1 or not node.dtype.is_float:
        return False
    (offset, (row_stride, col_stride)), = node.attrs["views"]
    return offset == 0 and row_stride == 1 and col_stride == node.shape[0]


def _dense_group(producer) -> bool:
    """An elementwise node or group whose every operand is read densely over its shape."""
    if producer.op not in ir.ELEMENTWISE | {Op.FUSED} or not producer.dtype.is_float:
        return False
    views = producer.attrs.get("views") or (None,) * len(producer.inputs)
    operands = list(zip(producer.inputs, views))
    return 0 < len(operands) <= MAX_INPUTS and all(x.scalar is None for x in producer.inputs) and all(
        x.shape == producer.shape and x.dtype.is_float
        and (view is None or tuple(view) == (0, dense_strides(producer.shape))) for x, view in operands)


def fold_partition_sum_prologues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each sum over tokens of an elementwise group read by nothing else computes that group as its prologue."""
    consumers, outputs = graph.consumers(), set(graph.outputs)

    def fold(node, inputs):
        if not _transposed_sum(node):
            return None
        chain = private_chain(node, node.inputs[0], consumers, outputs)
        if chain is None or not _dense_group(chain[-1]):
            return None
        new = ir.unreshaped(inputs[0])
        body = ir.body_of(new)
        sources = list(new.inputs)
        view = node.attrs["views"][0]
        return ir.node(Op.REDUCE_LAST, sources, node.shape, node.dtype, node.loc, kind="add",
                       cols=node.attrs["cols"], prologue=body, views=tuple(view for _ in sources))

    return graph.rewrite(fold)
