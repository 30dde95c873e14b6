"""Layout of weights: a weight the program reads only transposed is stored transposed.

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
