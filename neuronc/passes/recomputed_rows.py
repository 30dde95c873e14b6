"""An elementwise kernel over [tokens, C] read only by a row-wise kernel and sums over tokens is computed by each.

The layer-norm backward's x-hat, `(x - mean) * rstd` over [512, 768] in fp32, is read by the row-wise grad-input
kernel and by the weight gradient's sum over tokens, `(dy * x_hat).sum(0)`. As a kernel of its own it loads x
(bf16), stores 1.5 MB of fp32, and both readers load that back: ~25 us on the critical path per norm, on DMA
queues, its engines nearly idle. Each reader loads rows of tokens anyway (the row-wise kernel a token a
partition, the sum over tokens 128 tokens a tile), so each computes x-hat from x and the per-token statistics
itself: the same float steps on the same values (the same bits). Applied when the kernel's inputs are laid out as
its rows or hold one value a token, and every reader is a ROWWISE kernel or a sum over partitions with a prologue.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import dense_strides
from neuronc.passes.per_row_producers import dropped, with_producer
from neuronc.passes.reduction_epilogues import ARITHMETIC
from neuronc.passes.rowwise import rebuilt_rowwise


def _token_strides(node) -> list | None:
    """Per input of an elementwise kernel over [1..., T, C]: its (token stride, column stride, offset) as the kernel
    reads it, or None when an input is not a row a token or one value a token."""
    if len(node.shape) < 2 or any(n != 1 for n in node.shape[:-2]):
        return None
    found = []
    for x, view in zip(node.inputs, node.attrs.get("views") or (None,) * len(node.inputs)):
        offset, strides = view if view is not None else (0, dense_strides(node.shape)) if x.shape == node.shape \
            else (None, None)
        if strides is None:
            return None
        t, c = strides[-2:]
        if (t, c) not in ((node.shape[-1], 1), (1, 0)) or offset != 0:
            return None
        found.append((t, c))
    return found


def _recomputable(node, outputs: set) -> bool:
    return (node.op is Op.FUSED and node not in outputs and node.dtype.is_float
            and all(s.op in ARITHMETIC and s.dtype.is_float for s in node.attrs["body"])
            and _token_strides(node) is not None)


def _reader_views(reader, producer) -> list | None:
    """The views, in `reader`'s terms, of the producer's inputs, or None when `reader` cannot compute it: a
    ROWWISE kernel reading it as its rows, or a sum over tokens (a prologue) reading it transposed."""
    slots = [i for i, x in enumerate(reader.inputs) if x is producer]
    if len(slots) != 1:
        return None
    cols = producer.shape[-1]
    view = reader.attrs.get("views")[slots[0]] if reader.attrs.get("views") else None
    strides = _token_strides(producer)
    if reader.op is Op.ROWWISE and view == (0, (cols, 1)):
        return [(0, (t, c)) for t, c in strides]
    if reader.op is Op.REDUCE_LAST and "cols" in reader.attrs and reader.attrs.get("prologue") \
            and view == (0, (1, cols)):
        return [(0, (c, t)) for t, c in strides]
    return None


def recompute_rows_in_readers(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each elementwise kernel over tokens read only by row-wise kernels and sums over tokens is computed by them."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    producers = {}
    for node in graph.nodes():
        if _recomputable(node, outputs):
            readers = consumers.get(node, ())
            views = {reader: _reader_views(reader, node) for reader in readers}
            if readers and all(v is not None for v in views.values()):
                producers[node] = views
    if not producers:
        return graph
    reading = {reader: producer for producer, views in producers.items() for reader in views}

    def recompute(node, inputs):
        producer = reading.get(node)
        if producer is None:
            return None
        slot = node.inputs.index(producer)
        key = "body" if node.op is Op.ROWWISE else "prologue"
        new_inputs, views, body = with_producer(list(inputs), list(node.attrs["views"]), node.attrs[key], slot,
                                                list(inputs[slot].inputs), producers[producer][node],
                                                producer.attrs["body"])
        new_inputs, views, body = dropped(new_inputs, views, body, slot)
        if node.op is Op.ROWWISE:
            # None (no room in SBUF): the reader keeps reading the kernel
            return rebuilt_rowwise(node, new_inputs, tuple(views), body, ctx.target)
        return ir.node(Op.REDUCE_LAST, new_inputs, node.shape, node.dtype, node.loc,
                       **{**node.attrs, "prologue": body, "views": tuple(views)})

    return graph.rewrite(recompute)
