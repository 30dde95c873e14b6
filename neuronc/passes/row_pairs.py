"""A matmul whose stores are its main traffic stores its output tiles in row pairs: half the store DMAs, each twice
the bytes, and twice the result buffers.

The weight gradients (dW = dy^T @ x over few tokens: MatmulPlan.stores_main, k below m and n, no epilogue operand) store
each [128, 512] bf16 result tile in 8 DMAs of 16 partitions (codegen/matmul.py `flush`, Part 34). A store starts
when its tile's epilogue ends, so each pays its whole ~1.3 us fixed cost (targets.py) before its 0.8 us of data, and
a result buffer is taken again only when its store ends: with the pool's 4 buffers (passes/tiling.py
EPILOGUE_BUFS) the training backward's last ~120 us are that chain (docs/performance.md, issue 16, part 36).

With row pairs (MatmulPlan.row_pairs) two output tiles one above the other, rows m0 .. m0 + 256, are computed with
their rows interleaved: partition p of the first holds row m0 + 2p, of the second row m0 + 2p + 1 (the stationary
operand's columns taken every other one). A slice of partitions of the two tiles side by side is then one rectangle
of HBM rows, stored by one DMA: half the DMAs, each with 2 KiB a partition instead of 1 (the payload curve). The
result pool gets ROW_PAIR_BUFS times its buffers, so that as many stores are in flight as tiles were before. Each
output element sums the same K tiles' products in the same order (the same bits); only for 16-bit operands, which
the emulator sums exactly (fp32 operands go through numpy's SGEMM, whose last bits may depend on the layout).
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.tiling import sbuf_bytes
from neuronc.plans import MatmulPlan
from neuronc.targets import Target

# The result pool's buffers times this with row pairs. Measured (gpt2_train's backward, trn2 bf16, -O2, us): row
# pairs with the 4 buffers 428.6, with 8 (x2) 413.0; without row pairs 427.6, with 8 buffers 426.5, 12 the same.
ROW_PAIR_BUFS = 2


def pairs_rows(plan: MatmulPlan, target: Target) -> bool:
    """Whether the plan's output tiles may go in row pairs: resident A strips of whole 128-row tiles (a step's
    tiles one above the other), at least two row tiles, 16-bit operands, no bias or sums of the result (read by
    rows), and its stores its main traffic (MatmulPlan.stores_main)."""
    tiling = plan.tiling
    return (tiling.resident == "a" and tiling.tile_m == target.partitions and plan.m >= 2 * tiling.tile_m
            and plan.stores_main
            and not (plan.row_pairs or plan.c_sums or plan.a_by_k_tile) and plan.stored_step is None
            and plan.bias_row is None and plan.bias_column is None
            and all(p.dtype.itemsize <= 2 for p in plan.operand_pools if p.name in ("a", "b")))


def _paired(plan: MatmulPlan, target: Target) -> MatmulPlan | None:
    """The plan with row pairs and its result pool's buffers multiplied, or None if those do not fit SBUF."""
    pools = tuple(dataclasses.replace(p, bufs=p.bufs * ROW_PAIR_BUFS) if p.name == "result" else p
                  for p in plan.epilogue_pools)
    used = sbuf_bytes({p.name: (p.dtype, p.elements, p.bufs) for p in plan.operand_pools + pools})
    if used > target.sbuf_bytes_per_partition:
        return None
    return dataclasses.replace(plan, row_pairs=True, epilogue_pools=pools)


def pair_output_rows(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """-O2/-O3, after the tiling and the matmuls' second outputs: row pairs for the matmuls `pairs_rows` takes."""
    def wanted(node: ir.Node) -> bool:
        plan = node.attrs.get("plan")
        return node.op is Op.MATMUL and isinstance(plan, MatmulPlan) and pairs_rows(plan, ctx.target)

    if not any(wanted(node) for node in graph.nodes()):
        return graph

    def pair(node: ir.Node, inputs: tuple) -> ir.Node | None:
        plan = wanted(node) and _paired(node.attrs["plan"], ctx.target)
        if not plan:
            return None
        return dataclasses.replace(ir.with_inputs(node, inputs), attrs={**node.attrs, "plan": plan}, id=next(ir._ids))

    return graph.rewrite(pair)
