"""A view of a reshaped view reads the first view's source once: one strided copy instead of two.

Attention's heads are split out of the QKV projection as `view(reshape(view(qkv)))`: the slice of q, k or v
(a VIEW, a strided copy of its own), the reshape to [batch, seq, heads, d], and the head transpose (a second
VIEW, another copy). The two views do not merge symbolically through the reshape, but the element positions
the chain reads compose to one affine map of the source (attention.py's `_composed_view`, which the attention
pass fits the same chains with): the head transpose then reads the projection itself, and the first copy is
left to whatever else reads it (dead code when nothing does). Each copy moves the same bytes as before; one
fewer kernel does it.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.attention import _composed_view
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import view


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
