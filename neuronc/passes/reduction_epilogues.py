"""A per-row elementwise kernel reading only a row reduction's result is the reduction's epilogue.

The layer-norm backward recomputes its statistics: a row sum then `divide(sum, 768)` (the mean), a row sum of
squares then `rsqrt(var / 768 + eps)`. Each of those per-row steps is a kernel of its own over 512 values: a
launch, a load and a store on the critical path for a few instructions. The reduction holds each row's result
on chip (a [rows, 1] fp32 accumulator), so it computes the same steps there, on the same fp32 values, before its
store (the same bits): applied when the elementwise kernel reads nothing else (scalars aside) and is the only
reader of an fp32 row reduction over rows laid out along the free axis.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.context import PassContext

# float arithmetic only: a compare or select (a cond's predicate, `y.mean() > 0.1`) writes no float the
# reduction's store takes, and is left to its own kernel
ARITHMETIC = (Op.DIVIDE, Op.MULTIPLY, Op.ADD, Op.SUBTRACT, Op.RSQRT, Op.SQRT, Op.CONVERT)
_ELEMENTWISE = (Op.FUSED, *ARITHMETIC)


def _foldable_reduction(node, outputs: set) -> bool:
    """An fp32 row reduction along the free axis (not a sum over partitions) with no epilogue yet."""
    views = node.attrs.get("views") or ()
    return (node.op is Op.REDUCE_LAST and node.dtype == DType.F32 and node not in outputs
            and "epilogue" not in node.attrs and all(strides[1] in (0, 1) for _, strides in views))


def _epilogue_reader(reduction, consumers: dict, outputs: set):
    """The elementwise kernel reading `reduction` (directly or through a reshape only it reads), or None."""
    readers = consumers.get(reduction, ())
    if len(readers) != 1:
        return None
    (reader,) = readers
    if reader.op is Op.RESHAPE:
        if reader in outputs or len(consumers.get(reader, ())) != 1:
            return None
        (reader,) = consumers[reader]
    if reader.op not in _ELEMENTWISE or reader.attrs.get("views") not in (None, (None,)):
        return None
    if reader.size != reduction.size or any(x.scalar is None for x in reader.inputs[1:]) \
            or reader.inputs[0].scalar is not None:
        return None
    body = ir.body_of(reader)
    if not reader.dtype.is_float or any(s.op not in ARITHMETIC or not s.dtype.is_float for s in body) \
            or any(kind == "input" and ref != 0 for s in body for kind, ref in s.args):
        return None
    return reader


def fold_reduction_epilogues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each per-row elementwise kernel reading only a row reduction is computed by the reduction before its store."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    folds = {}
    for node in graph.nodes():
        if _foldable_reduction(node, outputs):
            reader = _epilogue_reader(node, consumers, outputs)
            if reader is not None:
                folds[reader] = node
    if not folds:
        return graph

    def fold(node, inputs):
        if node not in folds:
            return None
        reduction = inputs[0] if inputs[0].op is Op.REDUCE_LAST else inputs[0].inputs[0]  # rebuilt: its new inputs
        folded = ir.node(Op.REDUCE_LAST, list(reduction.inputs), reduction.shape, node.dtype, reduction.loc,
                         **reduction.attrs, epilogue=tuple(ir.body_of(node)))
        if node.shape == reduction.shape:
            return folded
        return ir.node(Op.RESHAPE, [folded], node.shape, node.dtype, node.loc)

    return graph.rewrite(fold)
