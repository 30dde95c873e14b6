"""Memory planning: where in the core's HBM every tensor of a legalised graph lives.

Inputs, outputs, weights and constants become entries of the NEFF's tensor table; intermediates
get scratch space. A RESHAPE is an alias: it shares its operand's bytes. Splat constants only need
memory when a consumer reads them as a tensor (elementwise kernels take them as immediates).
Buffers are not yet reused across lifetimes (planned in the optimisation work).
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.neff.program import TensorEntry, TensorKind

ALIGNMENT = 64  # bytes; keeps every tensor's start aligned for any dtype and for DMA descriptors


@dataclasses.dataclass
class MemoryPlan:
    tensors: list  # TensorEntry, in HBM order
    placement: dict  # node -> TensorEntry holding the node's bytes (aliases share one)
    hbm_size: int

    def offset(self, node: ir.Node) -> int:
        return self.placement[node].offset

    def has_buffer(self, node: ir.Node) -> bool:
        return node in self.placement


def _needs_buffer(node: ir.Node, consumers: dict, outputs: set) -> bool:
    if node.op is not Op.CONSTANT or not node.is_splat:
        return True
    return node in outputs or any(c.op not in ir.ELEMENTWISE for c in consumers.get(node, ()))


def plan_memory(graph: ir.Graph) -> MemoryPlan:
    nodes = graph.nodes()
    consumers = graph.consumers()
    # An output that reshapes a value is that value's bytes: the value is placed in the output.
    # (legalize guarantees that each output's root is its own, not a parameter or constant.)
    output_index = {}
    for i, o in enumerate(graph.outputs):
        output_index[ir.unreshaped(o)] = (i, o)
    tensors, placement, cursor = [], {}, 0
    input_count = 0
    for n in nodes:
        if n.op is Op.RESHAPE:
            placement[n] = placement[n.inputs[0]]
            continue
        if not _needs_buffer(n, consumers, set(output_index)):
            continue
        if n in output_index:
            index, out = output_index[n]
            entry = TensorEntry(f"output{index}", TensorKind.OUTPUT, out.dtype, out.shape, 0, index)
        elif n.op is Op.PARAMETER and n.attrs["kind"] == "input":
            entry = TensorEntry(n.attrs["name"], TensorKind.INPUT, n.dtype, n.shape, 0, input_count)
            input_count += 1
        elif n.op is Op.PARAMETER:
            entry = TensorEntry(n.attrs["name"], TensorKind.WEIGHT, n.dtype, n.shape, 0, -1, n.attrs["data"])
        elif n.op is Op.CONSTANT and not n.is_splat:
            entry = TensorEntry(f"const{n.id}", TensorKind.CONSTANT, n.dtype, n.shape, 0, -1,
                                n.attrs["value"].reshape(n.shape))
        else:
            entry = TensorEntry(f"t{n.id}_{n.op.name.lower()}", TensorKind.SCRATCH, n.dtype, n.shape, 0)
        entry.offset = cursor
        cursor += -(-max(entry.nbytes, 1) // ALIGNMENT) * ALIGNMENT
        tensors.append(entry)
        placement[n] = entry
    return MemoryPlan(tensors, placement, cursor)
