"""Elementwise kernels computing the same body from the same inputs, merged into one.

Lowering makes some values more than once: each gather and scatter clamps and converts its own indices to int32 table
rows (passes/indexing.py), so an index tensor read by several of them (the MoE model's routed token and expert numbers)
is converted once per reader. Where such a copy is fused into its reader's elementwise kernel it costs no kernel of
its own; where the copies are left as kernels of their own after fusion, each is a load, its steps and a store. This
merges those: a FUSED node with the same inputs, shape, dtype and attributes as an earlier one is that one.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.passes.context import PassContext


def merge_duplicate_kernels(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    made: dict = {}  # (inputs, shape, dtype) -> the FUSED nodes kept with them

    def merged(node: Node, inputs: tuple) -> Node | None:
        if node.op is not Op.FUSED:
            return None
        node = ir.with_inputs(node, inputs)
        kept = made.setdefault((inputs, node.shape, node.dtype), [])
        same = next((other for other in kept if _same_attrs(other, node)), None)
        if same is None:
            kept.append(node)
            return node
        return same

    return graph.rewrite(merged)


def _same_attrs(a: Node, b: Node) -> bool:
    try:
        return bool(a.attrs == b.attrs)
    except ValueError:  # an array among them (compared elementwise): not merged
        return False
