"""A sum over tokens of a weight-gradient matmul's A is that matmul's second output: dy is loaded once.

A linear layer's backward computes dW = dy^T @ x (A = dy read transposed: [features, tokens]) and db = dy summed
over tokens, two kernels that each load all of dy. The matmul keeps A^T ([tokens, features], dy as it lies) in
SBUF as its resident strip; the sum is ones[tokens, 1]^T @ that strip, the same matmuls of a ones column the
sum's own kernel makes (codegen/partition_sum.py: fp32 in PSUM over the same 128-token tiles in the same order,
rounded once on the way out: the same bits). So the sum becomes the matmul's second output (MatmulPlan.a_sums;
a KERNEL_OUTPUT node, which the memory plan places with its kernel) and its kernel goes. Runs after the tiling
(it needs A resident), on a plain matmul (no chain, prologue, bias or batch) and a sum without a prologue.

Likewise a sum over tokens of a matmul's result (a norm's bias gradient: the sum of the dy the grad-input matmul
dy @ W makes) is ones[128, 1]^T @ each result tile as it is stored, accumulated over the row tiles in order in
PSUM banks of its own (MatmulPlan.c_sums): the stored values, the sum kernel's tiles and order, the same bits.
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.plans import MatmulPlan, PartitionSumPlan, PoolSpec
from neuronc.passes.context import PassContext
from neuronc.passes.second_outputs import as_second_outputs
from neuronc.passes.tiling import sbuf_bytes


def _summed_operand(plan: MatmulPlan) -> bool:
    """Whether the plan's A strips could give A's sums over K: resident A read transposed (A^T dense)."""
    return (plan.tiling.resident == "a" and plan.batch == 1 and plan.bias_row is None and plan.bias_column is None
            and not plan.a_sums and not plan.c_sums and plan.a.offset == 0 and tuple(plan.a.strides[1:]) == (1, plan.m))


def _sum_of(matmul: ir.Node, reader: ir.Node) -> bool:
    """Whether `reader` (a REDUCE_LAST) sums the matmul's A over K as the plan's A^T strips hold it."""
    plan, mine = matmul.attrs["plan"], reader.attrs.get("plan")
    strip = {p.name: p.dtype for p in plan.operand_pools}.get("a")
    return (isinstance(mine, PartitionSumPlan) and not mine.prologue and not mine.per_token
            and strip == reader.inputs[0].dtype == {p.name: p.dtype for p in mine.pools}.get("input0")
            and reader.attrs.get("kind") == "add" and len(reader.inputs) == 1
            and ir.unreshaped(reader.inputs[0]) is ir.unreshaped(matmul.inputs[0])
            and mine.rows == plan.m and mine.cols == plan.k and mine.view.offset == 0
            and tuple(mine.view.strides) == (plan.m, 1) and mine.tile_rows == plan.tiling.tile_k)


def _sum_of_result(matmul: ir.Node, reader: ir.Node) -> bool:
    """Whether `reader` (a REDUCE_LAST) sums the matmul's result over its rows as the result tiles hold it: each
    output tile [128 rows, columns] in bf16 as stored, summed over row tiles in order (the sum's own tiles)."""
    plan, mine = matmul.attrs["plan"], reader.attrs.get("plan")
    return (isinstance(mine, PartitionSumPlan) and not mine.prologue and not mine.per_token
            and reader.attrs.get("kind") == "add" and len(reader.inputs) == 1
            and ir.unreshaped(reader.inputs[0]) is matmul and reader.inputs[0].dtype == matmul.dtype
            and {p.name: p.dtype for p in mine.pools}.get("input0") == matmul.dtype
            and mine.rows == plan.n and mine.cols == plan.m and mine.view.offset == 0
            and tuple(mine.view.strides) == (plan.n, 1) and mine.tile_rows == plan.tiling.tile_m)


def _summed_result(plan: MatmulPlan, target) -> bool:
    """Whether the plan's result tiles could give its sums over rows: one batch, no caller's tiles, the
    accumulators of all its columns (PSUM banks) beside at least 4 for its output tiles."""
    return (plan.batch == 1 and not plan.a_sums and not plan.c_sums and plan.tiling.resident != "none"
            and _banks(plan, target) <= target.psum_banks - 4)


def _banks(plan: MatmulPlan, target) -> int:
    return -(-plan.n // (target.psum_bank_bytes // DType.F32.itemsize))  # fp32 accumulators


def _with_sums(matmul: ir.Node, reader: ir.Node, ctx: PassContext, of_result: bool) -> MatmulPlan | None:
    """The matmul's plan making the sums too (of A, or `of_result`), or None when its pools would not fit SBUF."""
    plan = matmul.attrs["plan"]
    if of_result:
        ones, width = matmul.dtype, min(plan.n, plan.tiling.tile_n)
    else:
        ones, width = matmul.inputs[0].dtype, min(plan.m, plan.tiling.block * plan.tiling.tile_m)
    pools = plan.epilogue_pools + (PoolSpec("sums_ones", ones, 1, 1), PoolSpec("sums", reader.dtype, width, 2))
    used = sbuf_bytes({p.name: (p.dtype, p.elements, p.bufs) for p in plan.operand_pools + pools})
    if used > ctx.target.sbuf_bytes_per_partition:
        return None
    return dataclasses.replace(plan, a_sums=not of_result, c_sums=of_result, epilogue_pools=pools)


def sum_operands_in_matmuls(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    consumers = graph.consumers()
    made: dict = {}  # matmul -> (the new matmul, the sum it replaces)

    def sums_of(x: ir.Node) -> list:  # the REDUCE_LASTs reading x or a reshape of it, not taken yet
        taken = {s for _, s in made.values()}
        return [r for y in (x, *(c for c in consumers.get(x, ()) if c.op is Op.RESHAPE))
                for r in consumers.get(y, ()) if r.op is Op.REDUCE_LAST and r not in taken]

    for node in graph.nodes():
        if node.op is not Op.MATMUL or not isinstance(node.attrs.get("plan"), MatmulPlan) or "outputs" in node.attrs:
            continue
        plan = None
        if _summed_operand(node.attrs["plan"]):
            reader = next((r for r in sums_of(ir.unreshaped(node.inputs[0])) if _sum_of(node, r)), None)
            plan = reader and _with_sums(node, reader, ctx, of_result=False)
        if plan is None and _summed_result(node.attrs["plan"], ctx.target):
            reader = next((r for r in sums_of(node) if _sum_of_result(node, r)), None)
            plan = reader and _with_sums(node, reader, ctx, of_result=True)
        if plan is None:
            continue
        attrs = {**node.attrs, "plan": plan, "outputs": ((node.shape, node.dtype), (reader.shape, reader.dtype))}
        made[node] = (attrs, reader)
    if not made:
        return graph
    return as_second_outputs(graph, made)
