"""A custom kernel reads an input that is a view chain through the composed view: no copy of the view.

The flash backward reads the output gradient split into heads ([seq, heads * d] -> [heads, seq, d]): a VIEW, a
strided copy of 0.8 MB, only for the kernel to load it again. A traced kernel's HBM accesses are access patterns
of its dense inputs; where the input is a chain of views and reshapes read by the kernel alone, each access is
mapped through the chain's composed view (attention.py's `_composed_view`) onto the chain's source, when each stays
one access pattern there (`nki.kernel.TracedKernel.reads_input_through`): the kernel reads the source (attribute
`views`: per input None or (offset, strides) of the input's elements in it; `shapes`: the inputs' shapes as the
kernel sees them), and the copy's kernel goes. The accesses move the same elements, with the source's strides.
"""
from __future__ import annotations

import math

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.attention import MAX_COMPOSED_ELEMENTS, _composed_view
from neuronc.passes.context import PassContext
from neuronc.passes.view_chains import inputs_through_views


def _viewed_input(kernel, position: int, x, consumers: dict, outputs: set, reader):
    """(source, offset, strides) through which the traced ``kernel`` may read its input ``x`` (a chain of reshapes
    and at least one view, read by ``reader`` alone), or None."""
    chain, read_by, views = x, reader, 0
    while chain.op in (Op.RESHAPE, Op.VIEW):
        if chain in outputs or consumers.get(chain) != {read_by}:
            return None
        views += chain.op is Op.VIEW
        read_by, chain = chain, chain.inputs[0]
    if not views or math.prod(x.shape) > MAX_COMPOSED_ELEMENTS or chain.dtype != x.dtype:
        return None
    fitted = _composed_view(x)
    if fitted is None or not kernel.reads_input_through(position, fitted[1], fitted[2]):
        return None
    return fitted


def read_kernel_inputs_through_views(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each CUSTOM_KERNEL reads the inputs that are view chains read by it alone through their composed views."""
    from neuronc.nki.kernel import traced_kernel  # (imported here: neuronc.nki builds on codegen)

    def found(node, consumers, outputs):
        kernel = traced_kernel(node.attrs["kernel"])
        return [_viewed_input(kernel, i, x, consumers, outputs, node) for i, x in enumerate(node.inputs)]

    return inputs_through_views(graph, Op.CUSTOM_KERNEL, found)
