"""Layout of weights and of matmul results: a weight the program reads only transposed is stored transposed,
and so is a matmul result read only as other matmuls' left operand (when the cost model says it pays).

The Tensor engine takes both matmul operands with the contraction axis K on partitions. A linear layer's
weight W [out, in] is read as W^T [in, out]: with W stored row-major, every strip of W^T is a strided DMA
(an element at a time across rows, half a queue's bandwidth). A weight's bytes are in the NEFF, so the
compiler may lay them out as it likes: when every reader of a 2-D weight reads its transpose, the NEFF
stores W^T and the readers read it densely. Weights given at run time (torch.compile's lifted parameters
are program inputs) keep the layout they come in.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.legalize import dense_strides
from neuronc.targets import Target


def _is_transpose_of(view: ir.Node, param: ir.Node) -> bool:
    rows, cols = param.shape
    return (view.op is Op.VIEW and view.shape == (cols, rows) and view.attrs["offset"] == 0
            and tuple(view.attrs["strides"]) == (1, cols))


def store_weights_transposed(graph: ir.Graph) -> ir.Graph:
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    turned = {}  # old weight -> the weight stored transposed
    for p in graph.params:
        readers = consumers.get(p, set())
        if (p.attrs.get("kind") == "weight" and p.attrs.get("data") is not None and len(p.shape) == 2
                and p not in outputs and readers and all(_is_transpose_of(r, p) for r in readers)):
            data = np.ascontiguousarray(np.asarray(p.attrs["data"]).T)
            turned[p] = dataclasses.replace(p, shape=p.shape[::-1], attrs={**p.attrs, "data": data},
                                            id=next(ir._ids))
    if not turned:
        return graph

    def relayout(node, inputs):
        if node in turned:
            return turned[node]
        if node.op is Op.VIEW and node.inputs[0] in turned:
            return inputs[0]  # the transpose is the stored weight itself
        return None

    return graph.rewrite(relayout)


# Matmul results stored transposed ------------------------------------------------------------------------
#
# A matmul C = A @ B reads A^T (K on partitions): when A is another matmul's result P [M, K] stored row-major,
# every strip of A^T is a strided DMA at half a queue's bandwidth. The producer can as well compute
# P^T = B_p^T A_p^T: the same matmul with its operands' roles swapped (each read through a transposed view),
# its epilogue's inputs read transposed, and its result tiles [N rows, M columns] stored densely as P^T. The
# reader then takes P^T's strips contiguously. A bias row of the producer (one value per output column)
# becomes one value per partition of the swapped tiles: the epilogue adds it in its first Scalar-engine pass
# instead of by a rank-1 matmul per tile. The tiling pass's cost model decides whether the swap pays.


def _transposed_view(view, shape) -> tuple:
    """(offset, strides) reading a [B, X, Y] operand seen through `view` as its [B, Y, X] transpose."""
    offset, (sb, sx, sy) = view or (0, dense_strides(shape))
    return offset, (sb, sy, sx)


def _swapped(node: ir.Node) -> ir.Node:
    """The matmul computing `node`'s result transposed: [B, N, M] = B^T [B, N, K] @ A^T [B, K, M]."""
    batch, m, n = node.shape
    k = node.attrs["k"]
    a, b, *extras = node.inputs
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    swapped = [_transposed_view(views[1], (batch, k, n)), _transposed_view(views[0], (batch, m, k))]
    swapped += [_transposed_view(view, node.shape) for view in views[2:]]
    attrs = {key: value for key, value in node.attrs.items() if key not in ("views", "bias_row", "tiling")}
    if node.attrs.get("bias_row") is not None:
        attrs["bias_column"] = node.attrs["bias_row"]
    return ir.node(Op.MATMUL, [b, a, *extras], (batch, n, m), node.dtype, node.loc, views=tuple(swapped), **attrs)


def _reader_of_transposed(reader: ir.Node, source: ir.Node) -> ir.Node:
    """`reader` (a matmul whose A operand is a producer's result) reading it from the producer stored
    transposed, `source` [B, K, M]."""
    batch, k, m = source.shape
    views = list(reader.attrs.get("views") or (None,) * len(reader.inputs))
    views[0] = (0, (k * m, 1, m))
    attrs = {key: value for key, value in reader.attrs.items() if key not in ("views", "tiling")}
    return ir.node(Op.MATMUL, [source, *reader.inputs[1:]], reader.shape, reader.dtype, reader.loc,
                   views=tuple(views), **attrs)


def _readers_as_a(node: ir.Node, consumers: dict, outputs: set) -> list | None:
    """The matmuls reading `node` (a matmul result, directly or through RESHAPEs that keep its elements'
    order) only as their dense A operand, each with A's shape [B, M, K] that of `node`; None if any other
    node reads it."""
    if node.op is not Op.MATMUL or node in outputs:
        return None
    readers, frontier = [], [node]
    while frontier:
        x = frontier.pop()
        for reader in consumers.get(x, ()):
            if reader.op is Op.RESHAPE and reader not in outputs:
                frontier.append(reader)
                continue
            views = reader.attrs.get("views") or (None,) * len(reader.inputs)
            if (reader.op is not Op.MATMUL or reader.inputs[0] is not x or x in reader.inputs[1:]
                    or views[0] is not None
                    or (reader.shape[0], reader.shape[1], reader.attrs["k"]) != node.shape):
                return None
            readers.append(reader)
    return readers or None


def store_matmul_results_transposed(graph: ir.Graph, target: Target) -> ir.Graph:
    """Each matmul result read only as other matmuls' A operand is computed and stored transposed when the
    cost model prices the producer and its readers cheaper that way (each tiled as the tiling pass would)."""
    from neuronc.passes.tiling import choose, price

    def cost(node):
        return price(node, choose(node, target), target)

    consumers, outputs = graph.consumers(), set(graph.outputs)
    swap, readers = set(), {}  # producers to swap; reader -> its producer
    for node in graph.nodes():
        found = _readers_as_a(node, consumers, outputs)
        if not found:
            continue
        swapped = _swapped(node)
        moved = [_reader_of_transposed(r, swapped) for r in found]
        if cost(swapped) + sum(map(cost, moved)) < cost(node) + sum(map(cost, found)):
            swap.add(node)
            readers.update((r, node) for r in found)
    if not swap:
        return graph
    done = {}  # swapped producer -> its new node

    def relayout(node, inputs):
        if node not in swap and node not in readers:
            return None
        new = dataclasses.replace(node, inputs=inputs, id=next(ir._ids))
        if node in readers:
            new = _reader_of_transposed(new, done[readers[node]])
        if node in swap:
            new = done[node] = _swapped(new)
        return new

    return graph.rewrite(relayout)
