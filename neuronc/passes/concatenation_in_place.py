"""A custom kernel whose outputs are read only by one concatenation writes them into their places in it: no
concatenate kernel.

The flash backward's dq, dk and dv ([heads, seq, d] each) are joined into the QKV projection's gradient
([seq, 3 * width]) by a CONCATENATE that reads each through its head transpose (passes/view_chains.py): a kernel
of its own that moves 2.4 MB only to lay the three out side by side. As XLA, IREE and TVM place a concatenation's
operands in its buffer, a producer whose only reader is the concatenation may write there itself. Here the
producer is a traced kernel: each of its HBM accesses of an output is an access pattern of that output's dense
elements, and when each maps to one access pattern of the output's place in the concatenation
(`nki.kernel.TracedKernel.writes_output_through`), the kernel node becomes the concatenation: its one output is
the concatenation's tensor and attribute `output_views` gives, per traced output, (offset, strides) of its
elements there (codegen/custom.py binds the mapped accesses). The kernel's stores move the same elements, at the
concatenation's strides, priced as such; the concatenate's copies go.

Only a concatenation of every output of one kernel (each once, read by it alone) is taken: the kernel then writes
one tensor. A compiler kernel producing an operand would need strided stores of its own; none does here.
"""
from __future__ import annotations

import math

import numpy as np

from neuronc import ir
from neuronc.affine_fit import affine_fit
from neuronc.ir import Op
from neuronc.passes.attention import MAX_COMPOSED_ELEMENTS
from neuronc.passes.context import PassContext
from neuronc.plans import concatenated_pieces


def _place(x, piece) -> tuple | None:
    """(offset, strides) of the dense elements of `x` in the concatenation that copies them as `piece`
    (plans.concatenated_pieces), when each element is copied once to positions one affine map gives; or None."""
    offset, strides, shape, placed, start = piece
    grid = np.indices(shape, dtype=np.int64)
    read = (offset + sum(g * s for g, s in zip(grid, strides))).reshape(-1)
    if read.size != math.prod(x.shape) or read.min() < 0 or read.max() >= read.size \
            or np.unique(read).size != read.size:
        return None  # an element copied twice or not at all: the copy is no placement of the whole output
    written = np.empty(read.size, dtype=np.int64)
    written[read] = (start + sum(g * p for g, p in zip(grid, placed))).reshape(-1)
    return affine_fit(written.reshape(x.shape))


def _kernel_outputs(concat, consumers: dict, outputs: set):
    """(kernel, {output index: input position}) when `concat` joins every output of one custom kernel once, each
    read by it alone and none a graph output; else None."""
    kernels, joined = set(), {}
    for position, x in enumerate(concat.inputs):
        if x.op is Op.KERNEL_OUTPUT:
            kernel, index = x.inputs[0], x.attrs["index"]
        elif x.op is Op.CUSTOM_KERNEL:
            kernel, index = x, 0
        else:
            return None
        if x in outputs or index in joined or (x.op is Op.KERNEL_OUTPUT and consumers.get(x) != {concat}):
            return None
        kernels.add(kernel)
        joined[index] = position
    if len(kernels) != 1:
        return None
    (kernel,) = kernels
    if kernel in outputs or "output_views" in kernel.attrs:
        return None
    if any(r is not concat and r.op is not Op.KERNEL_OUTPUT for r in consumers.get(kernel, ())):
        return None  # its first output is read by another node too
    if len(joined) != len(kernel.attrs["outputs"]) or kernel.dtype != concat.dtype:
        return None
    return kernel, joined


def _in_place(concat, consumers: dict, outputs: set):
    """(kernel, output_views) when the kernel feeding `concat` may write its outputs in their places; else None."""
    from neuronc.nki.kernel import traced_kernel  # (imported here: neuronc.nki builds on codegen)

    found = _kernel_outputs(concat, consumers, outputs)
    if found is None or math.prod(concat.shape) > MAX_COMPOSED_ELEMENTS:
        return None
    kernel, joined = found
    traced = traced_kernel(kernel.attrs["kernel"])
    pieces = concatenated_pieces(concat)
    views = []
    for index in range(len(joined)):
        position = joined[index]
        place = _place(concat.inputs[position], pieces[position])
        if place is None or not traced.writes_output_through(index, *place):
            return None
        views.append(place)
    return kernel, tuple(views)


def write_outputs_into_concatenations(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each CONCATENATE of every output of one custom kernel (read by it alone) becomes that kernel, writing each
    output into its place (attribute `output_views`), when every access of each output maps there."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    in_place = {}
    for node in graph.nodes():
        if node.op is Op.CONCATENATE:
            found = _in_place(node, consumers, outputs)
            if found is not None:
                in_place[node] = found

    def write_in_place(node, inputs):
        if node not in in_place:
            return None
        kernel = next(x if x.op is Op.CUSTOM_KERNEL else x.inputs[0] for x in inputs)  # the rewritten kernel
        attrs = dict(kernel.attrs, outputs=((node.shape, node.dtype),), output_views=in_place[node][1])
        return ir.node(Op.CUSTOM_KERNEL, kernel.inputs, node.shape, node.dtype, kernel.loc, **attrs)

    return graph.rewrite(write_in_place) if in_place else graph
