"""Indexing kernels: row gathers and scatters by DMA, and top-k with the MAX8 / FIND_INDEX8 /
MATCH_REPLACE8 instructions."""
from __future__ import annotations



import numpy as np

from neuronc.codegen.access import HbmTensor, column_slice, dma_by_rows, dma_slices, row_slice
from neuronc.codegen.elementwise import copy_strided
from neuronc.codegen.emitter import Emitter
from neuronc.isa import AluOp, DType, Engine, Opcode
from neuronc.ir import Node
from neuronc.plans import MemoryPlan


def gather_rows(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out[i, :] = table[rows[i], :]: row numbers to SBUF, rows fetched by indirect DMA, stored."""
    table, rows = node.inputs
    width = table.shape[1]
    source, out = HbmTensor.of(plan, table), HbmTensor.of(plan, node)
    for index, r0, rt, c0, ct, tile in _row_chunks(em, plan, rows, width, node.dtype, node.attrs["plan"].chunk):
        for p0, p1 in dma_slices(em.target, tile):
            em.dma(row_slice(tile, p0, p1), source[:, c0:c0 + ct].ap, indices=row_slice(index, p0, p1))
        dma_by_rows(em, out[r0:r0 + rt, c0:c0 + ct].ap, tile)


def scatter_rows(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out = base, then out[rows[i], :] = (or +=) updates[i, :]: updates to SBUF, written by indirect DMA."""
    base, rows, updates = node.inputs
    width = base.shape[1]
    out = HbmTensor.of(plan, node)
    # the base copied as the dense bytes it is, in blocks of full partitions over the queues (its own rows may be
    # a few bytes long: a one-column base moved row by row paid a DMA's per-row overhead for every element)
    copy_strided(em, node.dtype, plan.offset(base), (1,), plan.offset(node), (1,), (base.size,))
    for index, r0, rt, c0, ct, tile in _row_chunks(em, plan, rows, width, node.dtype, node.attrs["plan"].chunk):
        dma_by_rows(em, tile, HbmTensor.of(plan, updates)[r0:r0 + rt, c0:c0 + ct].ap)
        # one indirect DMA: rows bound for the same table row are written (or added) in order, never racing
        em.dma(out[:, c0:c0 + ct].ap, tile, indices=index, add=node.attrs["combine"] == "add")


TOP = 8  # values one MAX8 / FIND_INDEX8 / MATCH_REPLACE8 handles
LOWEST_F32 = float(np.finfo(np.float32).min)


def topk(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """positions[r, :k] of the k largest of x[r, :], largest first: per tile of rows, rounds of MAX8 (the next
    8 values), FIND_INDEX8 (where they are) and MATCH_REPLACE8 (strike them out with -inf). The keys are
    x raised to at least the lowest finite float, so a struck-out slot is below every real value."""
    (x,) = node.inputs
    rows, n = x.shape
    k = node.attrs["k"]
    width, rounds = node.attrs["plan"].width, node.attrs["plan"].rounds  # rows padded to `width` (passes/kernel_plans.py)
    loads = em.sbuf_pool(x.dtype, n, bufs=2)
    works = em.sbuf_pool(DType.F32, width, bufs=2)
    bests = em.sbuf_pool(DType.F32, TOP, bufs=2)
    outs = em.sbuf_pool(node.dtype, rounds * TOP, bufs=2)
    source, result = HbmTensor.of(plan, x), HbmTensor.of(plan, node)
    for r0 in range(0, rows, em.target.partitions):
        rt = min(em.target.partitions, rows - r0)
        tile, work, out = loads.next().ap(rt, n), works.next().ap(rt, width), outs.next().ap(rt, rounds * TOP)
        em.dma(tile, source[r0:r0 + rt].ap)
        em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, column_slice(work, 0, n), tile, alu=AluOp.MAX, imm0=LOWEST_F32)
        if width > n:
            em.emit(Opcode.MEMSET, Engine.VECTOR, column_slice(work, n, width), imm0=-np.inf)
        for r in range(rounds):
            best = bests.next().ap(rt, TOP)
            em.emit(Opcode.MAX8, Engine.VECTOR, best, work)
            em.emit(Opcode.FIND_INDEX8, Engine.VECTOR, column_slice(out, r * TOP, (r + 1) * TOP), work, best)
            if r + 1 < rounds:
                em.emit(Opcode.MATCH_REPLACE8, Engine.VECTOR, work, work, best, imm0=-np.inf)
        em.dma(result[r0:r0 + rt].ap, column_slice(out, 0, k))
# attention ---------------------------------------------------------------------------------------


def _row_chunks(em: Emitter, plan: MemoryPlan, rows: Node, width: int, dtype: DType, chunk: int):
    """(index tile, r0, rt, c0, ct, data tile) for every tile of `rows`' index rows x `width` columns:
    up to a partition per row, the row cut into chunks of `chunk` columns; each index tile loaded from HBM once."""
    count = rows.size
    numbers = HbmTensor.of(plan, rows, shape=(count,))
    index_tiles = em.sbuf_pool(rows.dtype, 1, bufs=2)
    data = em.sbuf_pool(dtype, chunk, bufs=3)
    for r0 in range(0, count, em.target.partitions):
        rt = min(em.target.partitions, count - r0)
        index = index_tiles.next().ap(rt, 1)
        em.dma(index, numbers[r0:r0 + rt].column.ap)
        for c0 in range(0, width, chunk):
            ct = min(chunk, width - c0)
            yield index, r0, rt, c0, ct, data.next().ap(rt, ct)
