"""A node the kernel that reads or makes its operands can also compute becomes that kernel's second output.

The column-sum passes (matmul_column_sums, rowwise_column_sums) choose which kernel takes which sum; this module
rewrites the graph once they have: the kernel is remade with the attributes that plan both outputs, and the sum
becomes a KERNEL_OUTPUT (index 1) of it, which the memory plan places as the kernel's second result."""
from __future__ import annotations

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Op


def as_second_outputs(graph: ir.Graph, made: dict) -> ir.Graph:
    """``graph`` with each kernel of ``made`` (kernel -> (its new attributes, the node it now also makes)) remade
    with those attributes, and each such node the kernel's KERNEL_OUTPUT 1."""
    final, kept = {}, {}  # old kernel -> its new node; old absorbed node -> itself in the first rewrite's graph
    absorbed = {node for _, node in made.values()}

    def remade(node: ir.Node, inputs: tuple) -> ir.Node | None:
        if node in made:
            final[node] = ir.Node(node.op, inputs, node.shape, node.dtype, made[node][0], node.loc)
            return final[node]
        if node in absorbed:
            kept[node] = ir.with_inputs(node, inputs)
            return kept[node]
        return None

    graph = graph.rewrite(remade)  # the kernels first: an absorbed node may come before its kernel in the order
    kernel_of = {kept[node]: final[kernel] for kernel, (_, node) in made.items()}
    kernels = set(final.values())

    def outputs_of(node: ir.Node, inputs: tuple) -> ir.Node | None:
        if node in kernels and ir.with_inputs(node, inputs) is not node:  # its KERNEL_OUTPUT reads that node
            raise NeuronCompileError(f"{node.op.name.lower()} kernel {node.id} reads a node that moved into it",
                                     hint="this is a bug in neuronc's passes; please report it")
        if node in kernel_of:
            return ir.node(Op.KERNEL_OUTPUT, [kernel_of[node]], node.shape, node.dtype, node.loc, index=1)
        return None

    return graph.rewrite(outputs_of)
