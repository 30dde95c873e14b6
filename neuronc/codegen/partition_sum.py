"""A sum over the outer axis of a tensor's memory (a bias or norm-weight gradient, summed over tokens) on the
Tensor engine.

out[r] = sum_t x[t, r] with x laid out [T, R], R contiguous. Read the way REDUCE_LAST's row kernel reads (each
output r on a partition, its T values along the free axis) every partition would gather single elements R apart,
a strided DMA of one element a row. Here tiles of consecutive t (one per partition, their rows whole) load as they
lie, and the sum runs over partitions, which is what the Tensor engine does: ones[t, 1]^T @ tile[t, r] is the
[1, r] row of column sums, accumulating in fp32 in PSUM over the tiles of t. The sums are rounded once into the
output's dtype on their way out of PSUM and stored as one contiguous row. The plan is passes/kernel_plans.py's
PartitionSumPlan. A prologue (an elementwise group of inputs laid out alike, dy * x_hat for a norm weight's
gradient) is computed on each tile before it is summed."""
from __future__ import annotations

import dataclasses

from neuronc.codegen.access import HbmTensor, column_slice, dma_by_rows, first_rows
from neuronc.codegen.elementwise import StepBalancer, emit_body
from neuronc.codegen.emitter import Emitter
from neuronc.ir import Node
from neuronc.isa import Engine, Opcode
from neuronc.plans import MemoryPlan, PartitionSumPlan, View

# The engines that may read PSUM (GpSimd cannot, TRAINIUM.md), taking the evacuations in turn.
_EVACUATING = (Engine.VECTOR, Engine.SCALAR)


def partition_sum(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    plan: PartitionSumPlan = node.attrs["plan"]
    pools = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in plan.pools}
    temps = [pools[f"temp{t}"] for t in range(len({slot for slot in plan.slots if slot is not None}))]
    psum = em.psum_pool()
    # [T, R] as they lie; a per-token input as [T, 1]
    inputs = [HbmTensor.of(memory, x, View(0, (1, 1)), (plan.cols, 1)) if i in plan.per_token
              else HbmTensor.of(memory, x, plan.view, (plan.cols, plan.rows)) for i, x in enumerate(node.inputs)]
    out = HbmTensor.of(memory, node, shape=(plan.rows,))
    ones = pools["ones"].next().ap(plan.tile_rows, 1)
    em.emit(Opcode.MEMSET, Engine.GPSIMD, ones, imm0=1.0)
    turn = 0
    engines = StepBalancer(em)  # the prologue's steps over the Vector, GpSimd and Scalar engines
    for g0 in range(0, plan.rows, plan.group):
        width = min(plan.group, plan.rows - g0)
        banks = [(c0, min(c0 + plan.bank, width)) for c0 in range(0, width, plan.bank)]
        accs = [psum.next().ap(1, c1 - c0) for c0, c1 in banks]
        for n, t0 in enumerate(range(0, plan.cols, plan.tile_rows)):
            rows = min(plan.tile_rows, plan.cols - t0)
            loaded = {}
            for i, x in enumerate(inputs):
                if i in plan.per_token:  # one value a partition, read along the row with stride 0
                    column = pools[f"input{i}"].next().ap(rows, 1)
                    dma_by_rows(em, column, x[t0:t0 + rows].ap)
                    loaded[i] = dataclasses.replace(column, dims=(column.dims[0], (0, width)))
                    continue
                loaded[i] = pools[f"input{i}"].next().ap(rows, width)
                dma_by_rows(em, loaded[i], x[t0:t0 + rows, g0:g0 + width].ap)
            tile = loaded[0] if not plan.prologue else emit_body(
                em, plan.prologue, plan.slots, loaded, [pool.next() for pool in temps], pools["body_out"].next(),
                (rows, width), pools["constants"], node.loc, engines)
            for acc, (c0, c1) in zip(accs, banks):
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, first_rows(ones, rows), column_slice(tile, c0, c1),
                        accumulate=n > 0)
        sums = pools["outs"].next().ap(1, width)
        for acc, (c0, c1) in zip(accs, banks):
            em.emit(Opcode.TENSOR_COPY, _EVACUATING[turn % len(_EVACUATING)], column_slice(sums, c0, c1), acc)
            turn += 1
        em.dma(out[g0:g0 + width].broadcast_rows(1).ap, sums)
