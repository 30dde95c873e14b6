"""A sum over tokens of a weight-gradient matmul's A is that matmul's second output: dy is loaded once.

A linear layer's backward computes dW = dy^T @ x (A = dy read transposed: [features, tokens]) and db = dy summed
over tokens, two kernels that each load all of dy. The matmul keeps A^T ([tokens, features], dy as it lies) in
SBUF as its resident strip; the sum is ones[tokens, 1]^T @ that strip, the same matmuls of a ones column the
sum's own kernel makes (codegen/partition_sum.py: fp32 in PSUM over the same 128-token tiles in the same order,
rounded once on the way out: the same bits). So the sum becomes the matmul's second output (MatmulPlan.a_sums;
a KERNEL_OUTPUT node, which the memory plan places with its kernel) and its kernel goes. Runs after the tiling
(it needs A resident), on a plain matmul (no chain, prologue, bias or batch) and a sum without a prologue.
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Op
from neuronc.plans import MatmulPlan, PartitionSumPlan, PoolSpec
from neuronc.passes.context import PassContext
from neuronc.passes.tiling import sbuf_bytes


def _summed_operand(plan: MatmulPlan) -> bool:
    """Whether the plan's A strips could give A's sums over K: resident A read transposed (A^T dense)."""
    return (plan.tiling.resident == "a" and plan.batch == 1 and plan.bias_row is None and plan.bias_column is None
            and not plan.a_sums and plan.a.offset == 0 and tuple(plan.a.strides[1:]) == (1, plan.m))


def _sum_of(matmul: ir.Node, reader: ir.Node, outputs: set) -> bool:
    """Whether `reader` (a REDUCE_LAST) sums the matmul's A over K as the plan's A^T strips hold it."""
    plan, mine = matmul.attrs["plan"], reader.attrs.get("plan")
    strip = {p.name: p.dtype for p in plan.operand_pools}.get("a")
    return (isinstance(mine, PartitionSumPlan) and not mine.prologue and not mine.per_token
            and strip == reader.inputs[0].dtype == {p.name: p.dtype for p in mine.pools}.get("input0")
            and reader.attrs.get("kind") == "add" and len(reader.inputs) == 1
            and ir.unreshaped(reader.inputs[0]) is ir.unreshaped(matmul.inputs[0])
            and mine.rows == plan.m and mine.cols == plan.k and mine.view.offset == 0
            and tuple(mine.view.strides) == (plan.m, 1) and mine.tile_rows == plan.tiling.tile_k)


def _with_sums(matmul: ir.Node, reader: ir.Node, ctx: PassContext) -> MatmulPlan | None:
    """The matmul's plan making the sums too, or None when its pools would not fit SBUF."""
    plan = matmul.attrs["plan"]
    width = min(plan.m, plan.tiling.block * plan.tiling.tile_m)
    pools = plan.epilogue_pools + (PoolSpec("sums_ones", matmul.inputs[0].dtype, 1, 1),
                                   PoolSpec("sums", reader.dtype, width, 2))
    used = sbuf_bytes({p.name: (p.dtype, p.elements, p.bufs) for p in plan.operand_pools + pools})
    if used > ctx.target.sbuf_bytes_per_partition:
        return None
    return dataclasses.replace(plan, a_sums=True, epilogue_pools=pools)


def sum_operands_in_matmuls(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    outputs = set(graph.outputs)
    consumers = graph.consumers()
    made: dict = {}  # matmul -> (the new matmul, the sum it replaces)
    for node in graph.nodes():
        if node.op is not Op.MATMUL or not isinstance(node.attrs.get("plan"), MatmulPlan) or "outputs" in node.attrs:
            continue
        if not _summed_operand(node.attrs["plan"]):
            continue
        source = ir.unreshaped(node.inputs[0])
        readers = [r for x in (source, *(c for c in consumers.get(source, ()) if c.op is Op.RESHAPE))
                   for r in consumers.get(x, ()) if r.op is Op.REDUCE_LAST]
        reader = next((r for r in readers if _sum_of(node, r, outputs) and r not in
                       {s for _, s in made.values()}), None)
        plan = reader and _with_sums(node, reader, ctx)
        if plan is None:
            continue
        attrs = {**node.attrs, "plan": plan, "outputs": ((node.shape, node.dtype), (reader.shape, reader.dtype))}
        made[node] = (ir.Node(Op.MATMUL, node.inputs, node.shape, node.dtype, attrs, node.loc, origin=node.origin),
                      reader)
    if not made:
        return graph
    sums = {reader: matmul for matmul, (_, reader) in made.items()}

    def rewrite(node: ir.Node, inputs: tuple) -> ir.Node | None:
        if node in made:
            if ir.with_inputs(made[node][0], inputs) is not made[node][0]:  # its sum's KERNEL_OUTPUT reads that node
                raise NeuronCompileError(f"matmul {node.id} changed while its sum moved into it",
                                         hint="this is a bug in neuronc's passes; please report it")
            return made[node][0]
        if node in sums:
            new = made[sums[node]][0]
            return ir.node(Op.KERNEL_OUTPUT, [new], node.shape, node.dtype, node.loc, index=1)
        return None

    return graph.rewrite(rewrite)
