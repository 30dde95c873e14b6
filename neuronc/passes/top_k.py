"""A sort read only in its first k positions is a top-k of k.

torch-mlir lowers `torch.topk(x, k)` as a sort of the whole row followed by slices of its first k values and
indices, so the importer builds a TOPK of the whole row (k = n) read by a gather (the values) and a convert (the
indices), each read by a slice of its first k. The device's TOPK of k costs rounds that grow with k, and a TOPK of
fp32 or int32 keys with k < n / 3 takes 4 TOPKs of k instead of a whole-row digit pass (passes/indexing.py): so
here such a sort becomes a TOPK of the largest k any slice reads. It is exact: TOPK's order is a stable sort's
(ties in input order, NaN placed by the order key lower_gather_scatter gives float keys, whatever k), so the
first k of the whole sort are the top-k of k. Runs before lower_gather_scatter, which lowers the TOPK it leaves.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.passes.context import PassContext


def top_k_of_sorts(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Every whole-row TOPK whose uses all slice its first positions (directly, or through the gather of its
    values or the convert of its indices) narrowed to the k those slices read."""
    readers, outputs = graph.consumers(), set(graph.outputs)
    narrowed = {}  # a whole-row TOPK -> the k its readers read
    for node in graph.nodes():
        if node.op is Op.TOPK and node.attrs["k"] == node.shape[node.attrs["dimension"]]:
            k = _prefix_read(node, node, readers, outputs)
            if k is not None and k < node.attrs["k"]:
                narrowed[node] = k
    if not narrowed:
        return graph
    carried = {}  # a node of a narrowed sort (the TOPK, its gather, its convert) -> its dim

    def rewrite(node: Node, inputs: tuple) -> Node | None:
        if node in narrowed:
            dim, k = node.attrs["dimension"], narrowed[node]
            carried[node] = dim
            return ir.node(Op.TOPK, list(inputs), _with(node.shape, dim, k), node.dtype, node.loc,
                           **{**node.attrs, "k": k})
        sort = _sort_read(node)
        if sort is not None and sort in carried:
            dim = carried[node] = carried[sort]
            new_sort = inputs[node.inputs.index(sort)]
            shape = _with(node.shape, dim, new_sort.shape[dim])
            return ir.node(node.op, list(inputs), shape, node.dtype, node.loc, **node.attrs)  # a gather's window is 1
        if node.op is Op.SLICE and node.inputs[0] in carried:
            source = inputs[0]
            if tuple(node.shape) == tuple(source.shape):
                return source
            return ir.node(Op.SLICE, [source], node.shape, node.dtype, node.loc, **node.attrs)
        return None

    return graph.rewrite(rewrite)


def _with(shape: tuple, dim: int, size: int) -> tuple:
    return tuple(size if d == dim else s for d, s in enumerate(shape))


def _prefix_read(node: Node, sort: Node, readers: dict, outputs: set) -> int | None:
    """The largest k of the slices of `node`'s first k positions along the sort's dim that read it, through the
    sort's values gather and indices convert; None if anything else reads it (or it is a graph output)."""
    if node in outputs or not readers.get(node):
        return None
    dim, largest = sort.attrs["dimension"], 0
    for reader in readers[node]:
        if reader.op is Op.SLICE and _is_prefix(reader, dim):
            k = reader.shape[dim]
        elif node is sort and _sort_read(reader) is sort:
            k = _prefix_read(reader, sort, readers, outputs)
        else:
            return None
        if k is None:
            return None
        largest = max(largest, k)
    return largest


def _is_prefix(slice_: Node, dim: int) -> bool:
    """A slice taking the first positions along dim and every position of the other dims, with stride 1."""
    a, source = slice_.attrs, slice_.inputs[0].shape
    return (all(s == 0 for s in a["start"]) and all(s == 1 for s in a["strides"])
            and all(a["limit"][d] == source[d] for d in range(len(source)) if d != dim))


def _sort_read(node: Node) -> Node | None:
    """The whole-row TOPK whose positions node reads as a sort's result (the convert giving its indices, or the
    gather of another operand at its positions, as stablehlo_import builds them), else None."""
    if node.op is Op.CONVERT and node.inputs[0].op is Op.TOPK:
        return node.inputs[0]
    if node.op is Op.GATHER and len(node.inputs) == 2 and node.inputs[1].op is Op.TOPK:
        sort, a = node.inputs[1], node.attrs
        dim, rank = sort.attrs["dimension"], len(node.shape)
        others = tuple(d for d in range(rank) if d != dim)
        if (node.inputs[0] is not sort and a["window_dims"] == () and tuple(a["dropped_dims"]) == (dim,)
                and tuple(a["index_map"]) == (dim,) and tuple(a["operand_batching_dims"]) == others
                and tuple(a["indices_batching_dims"]) == others and a["index_vector_dim"] == rank
                and tuple(node.shape) == tuple(sort.shape)):
            return sort
    return None

