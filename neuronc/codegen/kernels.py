"""Kernels: each legalised op becomes a tiled instruction sequence for the emulated NeuronCore.

One function per kernel form, in a registry keyed by op. Every kernel respects the tile rules of
the target: at most `partitions` rows on chip, matmul stationary [K<=128, M<=128] and moving
[K<=128, N<=512] accumulating in fp32 in one PSUM bank, data moved HBM<->SBUF by DMA.
"""
from __future__ import annotations

import itertools
import math

from neuronc import ir
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.errors import NeuronCompileError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode
from neuronc.ir import Node, Op
from neuronc.passes.legalize import dense_strides
from neuronc.passes.memory_plan import MemoryPlan

SLOTS_PER_KERNEL = 16  # tile slots a kernel may hold at once; sets the tile size from the SBUF size

ACTIVATIONS = {
    Op.ABS: ActFunc.ABS, Op.EXP: ActFunc.EXP, Op.EXPM1: ActFunc.EXPM1, Op.LOG: ActFunc.LOG,
    Op.LOG1P: ActFunc.LOG1P, Op.SQRT: ActFunc.SQRT, Op.RSQRT: ActFunc.RSQRT, Op.TANH: ActFunc.TANH,
    Op.LOGISTIC: ActFunc.SIGMOID, Op.SIN: ActFunc.SIN, Op.COS: ActFunc.COS, Op.SIGN: ActFunc.SIGN,
    Op.FLOOR: ActFunc.FLOOR, Op.CEIL: ActFunc.CEIL, Op.ROUND: ActFunc.ROUND, Op.ERF: ActFunc.ERF,
}
ALU = {
    Op.ADD: AluOp.ADD, Op.SUBTRACT: AluOp.SUBTRACT, Op.MULTIPLY: AluOp.MULTIPLY, Op.DIVIDE: AluOp.DIVIDE,
    Op.REMAINDER: AluOp.REMAINDER, Op.POWER: AluOp.POW, Op.MAXIMUM: AluOp.MAX, Op.MINIMUM: AluOp.MIN,
    Op.ATAN2: AluOp.ATAN2, Op.AND: AluOp.AND, Op.OR: AluOp.OR, Op.XOR: AluOp.XOR,
}
COMPARISONS = {"EQ": AluOp.EQ, "NE": AluOp.NE, "LT": AluOp.LT, "LE": AluOp.LE, "GT": AluOp.GT, "GE": AluOp.GE}
REDUCTIONS = {"add": AluOp.ADD, "max": AluOp.MAX, "min": AluOp.MIN, "and": AluOp.MIN, "or": AluOp.MAX}


def tile_free_elements(em: Emitter, dtype: DType) -> int:
    """Elements per partition of one tile, so that a kernel's tile slots fit in SBUF."""
    per_slot = em.target.sbuf_bytes_per_partition // SLOTS_PER_KERNEL
    return min(em.target.max_free_elements_sbuf, per_slot // max(dtype.itemsize, DType.F32.itemsize))


def _scalar(node: Node):
    value = node.attrs["value"]
    return value.item() if value.ndim == 0 else None


# elementwise -----------------------------------------------------------------------------------


def _flat_blocks(em: Emitter, n: int, dtype: DType):
    """Cover n contiguous elements with [partitions, free] blocks: yields (element offset, p, f)."""
    parts = em.target.partitions
    free = min(tile_free_elements(em, dtype), max(1, math.ceil(n / parts)))
    rows, tail = divmod(n, free)
    for r0 in range(0, rows, parts):
        yield r0 * free, min(parts, rows - r0), free
    if tail:
        yield rows * free, 1, tail


def elementwise(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    tensors = [i for i in node.inputs if plan.has_buffer(i) and not (i.op is Op.CONSTANT and i.is_splat)]
    free = tile_free_elements(em, DType.F32)
    pools = {i: em.sbuf_pool(i.dtype, free, bufs=3) for i in tensors}
    out_pool = em.sbuf_pool(node.dtype, free, bufs=3)
    const_pool = em.sbuf_pool(DType.F32, free, bufs=1) if node.op is Op.SELECT else None
    for start, p, f in _flat_blocks(em, node.size, DType.F32):
        loaded = {}
        for i in tensors:
            if i in loaded:
                continue
            tile = pools[i].next().ap(p, f)
            em.dma(tile, hbm(i.dtype, plan.offset(i) + start * i.dtype.itemsize, ((f, p), (1, f))))
            loaded[i] = tile
        out = out_pool.next().ap(p, f)
        _compute(em, node, out, loaded, const_pool)
        em.dma(hbm(node.dtype, plan.offset(node) + start * node.dtype.itemsize, ((f, p), (1, f))), out)


def _compute(em: Emitter, node: Node, out: AccessPattern, loaded: dict, const_pool) -> None:
    op = node.op
    args = [loaded.get(i) for i in node.inputs]
    if op in ACTIVATIONS:
        em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, args[0], func=ACTIVATIONS[op], imm0=1.0, imm1=0.0)
    elif op is Op.NEGATE:
        em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, out, args[0], alu=AluOp.SUBTRACT, imm0=0.0, reverse=True)
    elif op is Op.CONVERT:
        em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, out, args[0])
    elif op is Op.NOT:
        alu, imm = (AluOp.EQ, 0.0) if node.dtype == DType.BOOL else (AluOp.XOR, -1.0)
        em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, out, args[0], alu=alu, imm0=imm)
    elif op in ALU or op is Op.COMPARE:
        alu = COMPARISONS[node.attrs["direction"]] if op is Op.COMPARE else ALU[op]
        a, b = args
        if a is not None and b is not None:
            em.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, out, a, b, alu=alu)
        elif a is not None:
            em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, out, a, alu=alu, imm0=float(_scalar(node.inputs[1])))
        else:
            em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, out, b, alu=alu, imm0=float(_scalar(node.inputs[0])), reverse=True)
    elif op is Op.SELECT:
        operands = []
        for i, tile in zip(node.inputs, args):
            if tile is None:  # a splat operand: materialise it as a tile of the same shape
                tile = const_pool.next().ap(*out.shape, dtype=i.dtype)
                em.emit(Opcode.MEMSET, Engine.GPSIMD, tile, imm0=float(_scalar(i)))
            operands.append(tile)
        em.emit(Opcode.SELECT, Engine.VECTOR, out, *operands)
    else:
        raise NeuronCompileError(f"no elementwise kernel for {op.name.lower()}", location=str(node.loc))


# data movement ---------------------------------------------------------------------------------


def _merge_dims(shape, src_strides, dst_strides):
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    merged = []
    for n, s, d in dims:
        if merged and merged[-1][1] == s * n and merged[-1][2] == d * n:
            pn, _, _ = merged[-1]
            merged[-1] = (pn * n, s, d)
        else:
            merged.append((n, s, d))
    return merged or [(1, 1, 1)]


def copy_strided(em: Emitter, dtype: DType, src_offset: int, src_strides, dst_offset: int, dst_strides, shape) -> None:
    """DMA a strided HBM view (element strides, byte offsets) to another, in bounded blocks."""
    if 0 in shape:
        return
    max_free = tile_free_elements(em, DType.F32)
    dims = _merge_dims(shape, src_strides, dst_strides)
    n, s, d = dims[-1]
    if n > max_free:  # split the innermost dimension into [n // f, f] plus a tail
        f = max_free
        body, tail = divmod(n, f)
        if tail:
            size = dtype.itemsize
            copy_strided(em, dtype, src_offset + body * f * s * size, [x[1] for x in dims[:-1]] + [s],
                         dst_offset + body * f * d * size, [x[2] for x in dims[:-1]] + [d],
                         [x[0] for x in dims[:-1]] + [tail])
        dims = dims[:-1] + [(body, s * f, d * f), (f, s, d)]
    _copy_blocks(em, dtype, src_offset, dst_offset, dims, max_free)


def _copy_blocks(em, dtype, src_offset, dst_offset, dims, max_free) -> None:
    # The partition dim of a block is the outermost dim whose inner dims fit in `max_free`.
    split = len(dims) - 1
    while split > 0 and math.prod(n for n, _, _ in dims[split:]) <= max_free:
        split -= 1
    parts = em.target.partitions
    size = dtype.itemsize
    outer, (pn, ps, pd), inner = dims[:split], dims[split], dims[split + 1:]
    for index in itertools.product(*(range(n) for n, _, _ in outer)):
        so = src_offset + sum(i * s for i, (_, s, _) in zip(index, outer)) * size
        do = dst_offset + sum(i * d for i, (_, _, d) in zip(index, outer)) * size
        for p0 in range(0, pn, parts):
            p = min(parts, pn - p0)
            src = hbm(dtype, so + p0 * ps * size, ((ps, p), *((s, n) for n, s, _ in inner)))
            dst = hbm(dtype, do + p0 * pd * size, ((pd, p), *((d, n) for n, _, d in inner)))
            em.dma(dst, src)


def view_copy(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    x = node.inputs[0]
    size = node.dtype.itemsize
    copy_strided(em, node.dtype, plan.offset(x) + node.attrs["offset"] * size, node.attrs["strides"],
                 plan.offset(node), dense_strides(node.shape), node.shape)


def fill(em: Emitter, dtype: DType, offset: int, count: int, value: float) -> None:
    """Write `value` to `count` contiguous HBM elements: one memset tile, DMA'd out block by block."""
    free = tile_free_elements(em, DType.F32)
    tile = em.sbuf_pool(dtype, free, bufs=1).next()
    parts = em.target.partitions
    em.emit(Opcode.MEMSET, Engine.GPSIMD, tile.ap(parts, min(free, max(1, math.ceil(count / parts)))), imm0=value)
    for start, p, f in _flat_blocks(em, count, DType.F32):
        em.dma(hbm(dtype, offset + start * dtype.itemsize, ((f, p), (1, f))), tile.ap(p, f))


def splat_constant(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    fill(em, node.dtype, plan.offset(node), node.size, float(_scalar(node)))


def pad(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    x = node.inputs[0]
    a = node.attrs
    fill(em, node.dtype, plan.offset(node), node.size, a["value"])
    out_strides = dense_strides(node.shape)
    start = sum(lo * s for lo, s in zip(a["low"], out_strides))
    copy_strided(em, node.dtype, plan.offset(x), dense_strides(x.shape),
                 plan.offset(node) + start * node.dtype.itemsize,
                 [s * (it + 1) for s, it in zip(out_strides, a["interior"])], x.shape)


def concatenate(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    dim = node.attrs["dimension"]
    out_strides = dense_strides(node.shape)
    position = 0
    for x in node.inputs:
        copy_strided(em, node.dtype, plan.offset(x), dense_strides(x.shape),
                     plan.offset(node) + position * out_strides[dim] * node.dtype.itemsize, out_strides, x.shape)
        position += x.shape[dim]


# matmul and reductions -------------------------------------------------------------------------


def matmul(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """C[b] = A[b] @ B[b]: stationary = A tile transposed [K, M], moving = B tile [K, N], fp32 in PSUM."""
    a, b = node.inputs
    batch, m, k = a.shape
    n = b.shape[2]
    t = em.target
    tk, tm, tn = t.matmul_max_k, t.matmul_max_m, min(t.matmul_max_n, em.psum_bank_elements())
    stationary = em.sbuf_pool(a.dtype, tm, bufs=3)
    moving = em.sbuf_pool(b.dtype, tn, bufs=3)
    result = em.sbuf_pool(node.dtype, tn, bufs=2)
    psum = em.psum_pool()
    ai, bi, ci = a.dtype.itemsize, b.dtype.itemsize, node.dtype.itemsize
    for g in range(batch):
        for m0 in range(0, m, tm):
            mt = min(tm, m - m0)
            for n0 in range(0, n, tn):
                nt = min(tn, n - n0)
                acc = psum.next().ap(mt, nt)
                for k0 in range(0, k, tk):
                    kt = min(tk, k - k0)
                    st = stationary.next().ap(kt, mt)
                    em.dma(st, hbm(a.dtype, plan.offset(a) + ((g * m + m0) * k + k0) * ai, ((1, kt), (k, mt))))
                    mv = moving.next().ap(kt, nt)
                    em.dma(mv, hbm(b.dtype, plan.offset(b) + ((g * k + k0) * n + n0) * bi, ((n, kt), (1, nt))))
                    em.emit(Opcode.MATMUL, Engine.TENSOR, acc, st, mv, accumulate=k0 > 0)
                out = result.next().ap(mt, nt)
                em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, out, acc)
                em.dma(hbm(node.dtype, plan.offset(node) + ((g * m + m0) * n + n0) * ci, ((n, mt), (1, nt))), out)


def reduce_last(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out[r] = reduce(x[r, :]): rows on partitions, columns reduced along the free axis in chunks."""
    x = node.inputs[0]
    rows, cols = x.shape
    kind = node.attrs["kind"]
    if kind not in REDUCTIONS:
        raise NeuronCompileError(f"a {kind!r} reduction is not supported yet", location=str(node.loc))
    alu = REDUCTIONS[kind]
    acc_dtype = DType.F32 if node.dtype.is_float else node.dtype
    chunk = tile_free_elements(em, DType.F32)
    tiles = em.sbuf_pool(x.dtype, chunk, bufs=3)
    partials = em.sbuf_pool(acc_dtype, 1, bufs=2)
    accs = em.sbuf_pool(acc_dtype, 1, bufs=2)
    outs = em.sbuf_pool(node.dtype, 1, bufs=2)
    xi = x.dtype.itemsize
    for r0 in range(0, rows, em.target.partitions):
        rt = min(em.target.partitions, rows - r0)
        acc = accs.next().ap(rt, 1)
        for c0 in range(0, cols, chunk):
            ct = min(chunk, cols - c0)
            tile = tiles.next().ap(rt, ct)
            em.dma(tile, hbm(x.dtype, plan.offset(x) + (r0 * cols + c0) * xi, ((cols, rt), (1, ct))))
            if c0 == 0:
                em.emit(Opcode.TENSOR_REDUCE, Engine.VECTOR, acc, tile, alu=alu)
            else:
                part = partials.next().ap(rt, 1)
                em.emit(Opcode.TENSOR_REDUCE, Engine.VECTOR, part, tile, alu=alu)
                em.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, acc, acc, part, alu=alu)
        out = outs.next().ap(rt, 1)
        em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, out, acc)
        em.dma(hbm(node.dtype, plan.offset(node) + r0 * node.dtype.itemsize, ((1, rt), (1, 1))), out)


KERNELS = {op: elementwise for op in ir.ELEMENTWISE - {Op.CLAMP}}
KERNELS.update({
    Op.VIEW: view_copy,
    Op.PAD: pad,
    Op.CONCATENATE: concatenate,
    Op.MATMUL: matmul,
    Op.REDUCE_LAST: reduce_last,
})


def kernel_for(node: Node, plan: MemoryPlan):
    """The kernel that computes `node`, or None when it needs no instructions."""
    if node.op in (Op.PARAMETER, Op.RESHAPE):
        return None
    if node.op is Op.CONSTANT:
        return splat_constant if node.is_splat and plan.has_buffer(node) else None
    return KERNELS.get(node.op)

