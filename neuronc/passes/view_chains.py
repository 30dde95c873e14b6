"""A view of a reshaped view reads the first view's source once: one strided copy instead of two; a concatenate
reads its inputs through their views.

Attention's heads are split out of the QKV projection as `view(reshape(view(qkv)))`: the slice of q, k or v
(a VIEW, a strided copy of its own), the reshape to [batch, seq, heads, d], and the head transpose (a second
VIEW, another copy). The two views do not merge symbolically through the reshape, but the element positions
the chain reads compose to one affine map of the source (attention.py's `_composed_view`, which the attention
pass fits the same chains with): the head transpose then reads the projection itself, and the first copy is
left to whatever else reads it (dead code when nothing does). Each copy moves the same bytes as before; one
fewer kernel does it.

The backward's dq, dk and dv are transposed back out of the heads ([heads, seq, d] -> [seq, heads * d], a copy
each) only to be copied again into the concatenated [seq, 3 * width] gradient of the QKV projection. The
concatenate copies each input into its place with a strided DMA anyway, so it may read an input through its
view chain (`views`: per input None or (offset, strides, shape, placed): the input's elements read as `shape`
at `strides` from `offset` in the chain's source and written with strides `placed` from the input's place;
`shapes`: the inputs' shapes as the concatenation sees them) when nothing else reads the chain: the three transposes' kernels go.
"""
from __future__ import annotations

import math

import numpy as np

from neuronc import ir
from neuronc.ir import Op
from neuronc.affine_fit import affine_fit
from neuronc.passes.attention import MAX_COMPOSED_ELEMENTS, _composed_view
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import view
from neuronc.plans import dense_strides


def _reads_a_view_through_a_reshape(node) -> bool:
    """Whether `node` is a VIEW of a chain of reshapes ending at another VIEW (what no symbolic merge composes)."""
    if node.op is not Op.VIEW:
        return False
    below = node.inputs[0]
    while below.op is Op.RESHAPE:
        below = below.inputs[0]
    return below is not node.inputs[0] and below.op is Op.VIEW


def compose_view_chains(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each VIEW of a reshaped VIEW whose positions compose to one affine map reads the chain's source."""
    composed = {}
    for node in graph.nodes():
        if _reads_a_view_through_a_reshape(node):
            fitted = _composed_view(node)
            if fitted is not None:
                composed[node] = fitted
    if not composed:
        return graph

    def compose(node, inputs):
        if node not in composed:
            return None
        _, offset, strides = composed[node]
        source = inputs[0]  # the rewritten chain ends at the source's replacement (views stay views of it)
        while source.op in (Op.RESHAPE, Op.VIEW):
            source = source.inputs[0]
        return view(source, node.shape, strides, offset, node.loc)

    return graph.rewrite(compose)


def _concatenated_view(x, consumers: dict, outputs: set, reader, out_strides: tuple):
    """(source, offset, strides, shape, placed) through which `reader` may read its input `x` (a chain of
    reshapes and views, at least one view, read by `reader` alone): x's elements as `shape` (the chain's top
    view's, which a head split makes finer than x's) at `strides` from `offset` in source, placed with strides
    `placed` in the concatenation (whose dense strides are `out_strides`); or None."""
    chain, read_by, top_view = x, reader, None
    while chain.op in (Op.RESHAPE, Op.VIEW):
        if chain in outputs or consumers.get(chain) != {read_by}:
            return None
        if chain.op is Op.VIEW and top_view is None:
            top_view = chain
        read_by, chain = chain, chain.inputs[0]
    if top_view is None or math.prod(x.shape) > MAX_COMPOSED_ELEMENTS:
        return None
    fitted = _composed_view(x, top_view.shape)
    grid = np.indices(x.shape, dtype=np.int64)
    placed = affine_fit(sum(g * s for g, s in zip(grid, out_strides)).reshape(top_view.shape))
    if fitted is None or placed is None:
        return None
    return (*fitted, top_view.shape, placed[1])


def concatenate_through_views(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each CONCATENATE reads the inputs that are view chains read by it alone through their composed views."""
    def found(node, consumers, outputs):
        out_strides = dense_strides(node.shape)
        return [_concatenated_view(x, consumers, outputs, node, out_strides) for x in node.inputs]

    return inputs_through_views(graph, Op.CONCATENATE, found)


def inputs_through_views(graph: ir.Graph, kind: Op, found) -> ir.Graph:
    """Each `kind` node reads the inputs ``found(node, consumers, outputs)`` names (per input None, or (source,
    view...): a chain of views read through its composed view) from the chain's source instead: attributes `views`
    (per input None or the view) and `shapes` (the inputs' shapes as the node reads them)."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    through = {}
    for node in graph.nodes():
        if node.op is kind and "views" not in node.attrs:
            views = found(node, consumers, outputs)
            if any(f is not None for f in views):
                through[node] = views

    def read_through(node, inputs):
        if node not in through:
            return None
        sources, views = [], []
        for x, viewed in zip(inputs, through[node]):
            if viewed is None:
                sources.append(x)
                views.append(None)
                continue
            source = x  # the rewritten chain ends at the source's replacement
            while source.op in (Op.RESHAPE, Op.VIEW):
                source = source.inputs[0]
            sources.append(source)
            views.append(viewed[1:])
        return ir.node(kind, sources, node.shape, node.dtype, node.loc, **node.attrs, views=tuple(views),
                       shapes=tuple(tuple(x.shape) for x in node.inputs))

    return graph.rewrite(read_through) if through else graph
