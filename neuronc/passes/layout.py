"""Layouts: a weight the program reads only transposed is stored transposed, and so is an intermediate that
only matmuls read, as the operand they load transposed, when its producer can write it in any order.

The Tensor engine takes both matmul operands with the contraction axis K on partitions. A linear layer's
weight W [out, in] is read as W^T [in, out]: with W stored row-major, every strip of W^T is a strided DMA
(an element at a time across rows, half a queue's bandwidth). A weight's bytes are in the NEFF, so the
compiler may lay them out as it likes: when every reader of a 2-D weight reads its transpose, the NEFF
stores W^T and the readers read it densely. Weights given at run time (torch.compile's lifted parameters
are program inputs) keep the layout they come in.

The same holds for an activation that a matmul reads as its left operand (A [M, K], loaded as A^T strips: K
on partitions) or as a transposed right operand: a layer-norm's output feeding a projection or an MLP. A
row-wise kernel writes its result through strides (out_strides), so it writes the result transposed [K, M]
instead, and the reader's strips become contiguous loads. The strided transfer moves into the producer's
stores, spread over its row tiles and overlapped with its compute, where it was the first thing the matmul
waited for.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import dense_strides


def _is_transpose_of(view: ir.Node, param: ir.Node) -> bool:
    rows, cols = param.shape
    return (view.op is Op.VIEW and view.shape == (cols, rows) and view.attrs["offset"] == 0
            and tuple(view.attrs["strides"]) == (1, cols))


def store_weights_transposed(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
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


def view_of_transposed(view: tuple, extents: tuple, rows: int, cols: int) -> tuple | None:
    """`view` ((offset, strides) of a read of `extents` from a dense [rows, cols] buffer) as a read of the same
    elements from that buffer stored transposed ([cols, rows]); None when an axis of the view does not step
    along a row or along a column alone (it would carry from one into the other)."""
    offset, strides = view
    first_row, first_col = divmod(offset, cols)
    last_row, last_col, new = first_row, first_col, []
    for stride, extent in zip(strides, extents):
        if stride < 0:
            return None
        if stride % cols == 0:
            last_row += stride // cols * (extent - 1)
            new.append(stride // cols)
        elif stride < cols:
            last_col += stride * (extent - 1)
            new.append(stride * rows)
        elif extent == 1:
            new.append(0)
        else:
            return None
    if last_row >= rows or last_col >= cols:
        return None
    return first_row + first_col * rows, tuple(new)


def _operand_view(reader: ir.Node, index: int) -> tuple:
    """(view, extents, free axis) of a matmul's operand `index`: A [B, M, K] (its strips A^T: M along the free
    axis) or B [B, K, N] (N along the free axis)."""
    (batch, m, n), k = reader.shape, reader.attrs["k"]
    extents = (batch, m, k) if index == 0 else (batch, k, n)
    view = (reader.attrs.get("views") or (None,) * len(reader.inputs))[index]
    return view or (0, dense_strides(extents)), extents, 1 if index == 0 else 2


def _gains(reader: ir.Node, x: ir.Node, rows: int, cols: int) -> bool:
    """Whether `reader` is a matmul loading x (or a reshape of it) as an operand whose strips are strided now
    and contiguous with x stored transposed."""
    aliases = [i for i, y in enumerate(reader.inputs) if ir.unreshaped(y) is x]
    if reader.op is not Op.MATMUL or reader.attrs.get("chain") or len(aliases) != 1:
        return False
    index, = aliases
    if index > 1:
        return False  # an epilogue input is read by rows
    view, extents, free = _operand_view(reader, index)
    relaid = view_of_transposed(view, extents, rows, cols)
    return relaid is not None and view[1][free] != 1 and relaid[1][free] == 1


def _written_transposed(node: ir.Node, rows: int, cols: int) -> dict | None:
    """The attributes with which a row-wise kernel writes its result transposed, or None.

    Attention could too (its out_view), but measured on the GPT-2 block it costs more than the projection
    saves: 176.0 us against 169.0. Its [128, 64] output tiles become strided stores, one per head and query
    tile, slower on the queues that also carry its Q, K and V loads."""
    if node.op is not Op.ROWWISE:
        return None
    relaid = view_of_transposed((0, node.attrs["out_strides"]), (node.attrs["rows"], node.attrs["cols"]), rows, cols)
    return {"out_strides": relaid[1]} if relaid is not None and relaid[0] == 0 else None


def _readers(node: ir.Node, consumers: dict, outputs: set) -> list:
    """The nodes reading `node`'s buffer, directly or through RESHAPEs (aliases of its bytes); [] when one of
    those aliases is a program output (its layout is the caller's)."""
    readers, aliases = [], [node]
    while aliases:
        for reader in consumers.get(aliases.pop(), ()):
            if reader.op is not Op.RESHAPE:
                readers.append(reader)
            elif reader in outputs:
                return []
            else:
                aliases.append(reader)
    return readers


def store_activations_transposed(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Results of row-wise kernels that only matmuls read, each as an operand it loads transposed,
    are written transposed ([cols, rows] of the result seen as [rows, cols]) and read through the new layout."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    turned = {}  # node -> (rows, cols, its attributes writing the result transposed)
    for node in graph.nodes():
        if node in outputs or not node.shape:
            continue
        cols = node.shape[-1]
        rows = node.size // cols if cols else 0
        readers = _readers(node, consumers, outputs)
        attrs = _written_transposed(node, rows, cols) if readers and rows > 1 and cols > 1 else None
        if attrs is not None and all(_gains(reader, node, rows, cols) for reader in readers):
            turned[node] = (rows, cols, attrs)
    if not turned:
        return graph

    def relayout(node, inputs):
        if node in turned:
            attrs = {**node.attrs, **turned[node][2]}
            return dataclasses.replace(node, inputs=inputs, attrs=attrs, id=next(ir._ids))
        if node.op is Op.RESHAPE or not any(ir.unreshaped(x) in turned for x in node.inputs):
            return None
        views = list(node.attrs.get("views") or (None,) * len(node.inputs))
        for index, x in enumerate(node.inputs):
            if ir.unreshaped(x) in turned:
                view, extents, _ = _operand_view(node, index)
                views[index] = view_of_transposed(view, extents, *turned[ir.unreshaped(x)][:2])
        return dataclasses.replace(node, inputs=inputs, attrs={**node.attrs, "views": tuple(views)}, id=next(ir._ids))

    return graph.rewrite(relayout)
