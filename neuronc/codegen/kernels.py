"""Kernels: each legalised op becomes a tiled instruction sequence for the emulated NeuronCore.

One function per kernel form, in a registry keyed by op. Every kernel respects the tile rules of
the target: at most `partitions` rows on chip, matmul stationary [K<=128, M<=128] and moving
[K<=128, N<=512] accumulating in fp32 in one PSUM bank, data moved HBM<->SBUF by DMA.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from neuronc import ir
from neuronc.codegen.blocks import blocks
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.errors import NeuronCompileError
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode, Space
from neuronc.ir import Node, Op
from neuronc.passes.legalize import dense_strides
from neuronc.passes.memory_plan import MemoryPlan
from neuronc.passes.rowwise import BUFS, slot_plan, step_kinds

SLOTS_PER_KERNEL = 16  # tile slots a kernel may hold at once; sets the tile size from the SBUF size

ACTIVATIONS = {
    Op.ABS: ActFunc.ABS, Op.EXP: ActFunc.EXP, Op.EXPM1: ActFunc.EXPM1, Op.LOG: ActFunc.LOG,
    Op.LOG1P: ActFunc.LOG1P, Op.SQRT: ActFunc.SQRT, Op.RSQRT: ActFunc.RSQRT, Op.TANH: ActFunc.TANH,
    Op.LOGISTIC: ActFunc.SIGMOID, Op.SIN: ActFunc.SIN, Op.COS: ActFunc.COS, Op.SIGN: ActFunc.SIGN,
    Op.FLOOR: ActFunc.FLOOR, Op.CEIL: ActFunc.CEIL, Op.ROUND: ActFunc.ROUND, Op.ERF: ActFunc.ERF,
    Op.GELU: ActFunc.GELU,
}
ALU = {
    Op.ADD: AluOp.ADD, Op.SUBTRACT: AluOp.SUBTRACT, Op.MULTIPLY: AluOp.MULTIPLY, Op.DIVIDE: AluOp.DIVIDE,
    Op.REMAINDER: AluOp.REMAINDER, Op.POWER: AluOp.POW, Op.MAXIMUM: AluOp.MAX, Op.MINIMUM: AluOp.MIN,
    Op.ATAN2: AluOp.ATAN2, Op.AND: AluOp.AND, Op.OR: AluOp.OR, Op.XOR: AluOp.XOR,
}
COMPARISONS = {"EQ": AluOp.EQ, "NE": AluOp.NE, "LT": AluOp.LT, "LE": AluOp.LE, "GT": AluOp.GT, "GE": AluOp.GE}
REDUCTIONS = {"add": AluOp.ADD, "max": AluOp.MAX, "min": AluOp.MIN, "and": AluOp.MIN, "or": AluOp.MAX}


def _free_for(em: Emitter, slots: int, widest: int) -> int:
    """Elements per partition of each tile when `slots` tiles of up to `widest` bytes an element
    share the partition (each slot rounded up to the emitter's alignment), at most a default tile."""
    slot_bytes = em.target.sbuf_bytes_per_partition // slots - em.SLOT_ALIGNMENT  # room for rounding up
    return min(tile_free_elements(em, DType.F32), slot_bytes // widest)


def tile_free_elements(em: Emitter, dtype: DType) -> int:
    """Elements per partition of one tile, so that a kernel's tile slots fit in SBUF."""
    per_slot = em.target.sbuf_bytes_per_partition // SLOTS_PER_KERNEL
    return min(em.target.max_free_elements_sbuf, per_slot // max(dtype.itemsize, DType.F32.itemsize))


# elementwise -----------------------------------------------------------------------------------


def _last_uses(body) -> list:
    last = list(range(len(body)))
    for j, step in enumerate(body):
        for kind, ref in step.args:
            if kind == "step":
                last[ref] = j
    return last


def _assign_slots(body) -> tuple:
    """Linear-scan allocation of temporary tiles to the steps of a body (the last step writes the
    output tile). Returns (slot of each step or None, number of slots)."""
    last = _last_uses(body)
    free, slots, count = [], [], 0
    for j in range(len(body)):
        for k in range(j):
            if last[k] == j and slots[k] is not None:
                free.append(slots[k])  # the step's inputs die here: their tiles are reusable
        if j == len(body) - 1:
            slots.append(None)
        elif free:
            slots.append(free.pop())
        else:
            slots.append(count)
            count += 1
    return slots, count


def elementwise(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """One or many fused elementwise ops: load each input tile once (through its strided view, if
    the fusion pass folded one in), compute every step of the body in SBUF, store the result."""
    body = ir.body_of(node)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    used = sorted({ref for step in body for kind, ref in step.args if kind == "input"})
    slots, temp_count = _assign_slots(body)
    needs_constants = any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body)
    widest = max([DType.F32.itemsize, node.dtype.itemsize] + [s.dtype.itemsize for s in body]
                 + [node.inputs[i].dtype.itemsize for i in used])
    free = _free_for(em, 3 * len(used) + 2 * temp_count + 3 + (3 if needs_constants else 0), widest)
    inputs = {i: em.sbuf_pool(node.inputs[i].dtype, free, bufs=3) for i in used}
    temps = [em.sbuf_pool(DType.F32, free * widest // DType.F32.itemsize, bufs=2) for _ in range(temp_count)]
    out_pool = em.sbuf_pool(node.dtype, free, bufs=3)
    constants = em.sbuf_pool(DType.F32, free * widest // DType.F32.itemsize, bufs=3) if needs_constants else None
    strides = [dense_strides(node.shape)]
    offsets = [0]
    for i in used:
        view = views[i]
        strides.append(view[1] if view else dense_strides(node.shape))
        offsets.append(view[0] if view else 0)
    for block in blocks(node.shape, strides, free, em.target.partitions, offsets):
        shape = (block.partitions, *block.free)
        loaded = {}
        for k, i in enumerate(used, start=1):
            x = node.inputs[i]
            loaded[i] = inputs[i].next().ap(*shape)
            em.dma(loaded[i], hbm(x.dtype, plan.offset(x) + block.offsets[k] * x.dtype.itemsize, block.dims[k]))
        out = _emit_body(em, body, slots, loaded, [pool.next() for pool in temps], out_pool.next(), shape,
                         constants, node.loc)
        em.dma(hbm(node.dtype, plan.offset(node) + block.offsets[0] * node.dtype.itemsize, block.dims[0]), out)


def _emit_body(em: Emitter, body, slots, loaded: dict, temp_tiles: list, out_tile, shape, constants, loc):
    """Compute each step of `body` on tiles of `shape`: inputs from `loaded` (input index -> AP),
    intermediates in their temporary slots, the last step into `out_tile`. Returns its AP."""
    results = []
    for step, slot in zip(body, slots):
        out = out_tile.ap(*shape) if slot is None else temp_tiles[slot].ap(*shape, dtype=step.dtype)
        args = [loaded[ref] if kind == "input" else results[ref] if kind == "step" else float(ref)
                for kind, ref in step.args]
        _compute(em, step, out, args, constants, loc)
        results.append(out)
    return results[-1]


def _scalar_form(step, args) -> tuple | None:
    """(func, scale, bias, source) computing `step` as one Scalar-engine ACTIVATE, func(scale * x + bias) in
    fp32 rounded once to the destination, exactly as the ALU computes it; or None. A bias of -0.0 adds
    nothing, not even to a zero's sign."""
    if step.op in ACTIVATIONS:
        return ACTIVATIONS[step.op], 1.0, 0.0, args[0]
    if not step.dtype.is_float or not all(isinstance(a, float) or a.dtype.is_float for a in args):
        return None
    if step.op is Op.CONVERT:
        return ActFunc.IDENTITY, 1.0, -0.0, args[0]
    if step.op is Op.NEGATE:
        return ActFunc.IDENTITY, -1.0, -0.0, args[0]
    if len(args) != 2 or isinstance(args[0], float) == isinstance(args[1], float):
        return None
    (x, c), reverse = (args, False) if isinstance(args[1], float) else (args[::-1], True)
    forms = {Op.MULTIPLY: (c, -0.0), Op.ADD: (1.0, c), Op.SUBTRACT: (-1.0, c) if reverse else (1.0, -c)}
    if step.op not in forms:
        return None
    return (ActFunc.IDENTITY, *forms[step.op], x)


class _StepBalancer:
    """Puts each step of a body on the least busy engine that can compute it (as the cost model prices the
    work so far): the Vector engine takes any step, GpSimd those that read no PSUM (it cannot reach PSUM on
    the hardware), the Scalar engine activations and the steps that are a scale and a bias (`_scalar_form`)."""

    def __init__(self, em: Emitter):
        self.em = em
        self.busy = {Engine.VECTOR: 0.0, Engine.GPSIMD: 0.0, Engine.SCALAR: 0.0}

    def compute(self, step, out, args, constants, loc) -> None:
        form = _scalar_form(step, args)
        tiles = [a for a in args if isinstance(a, AccessPattern)]
        engines = [] if step.op in ACTIVATIONS else [Engine.VECTOR]
        if step.op not in ACTIVATIONS and all(t.space != Space.PSUM for t in tiles + [out]):
            engines.append(Engine.GPSIMD)
        if form is not None:
            engines.append(Engine.SCALAR)
        engine = min(engines, key=self.busy.get)
        start = len(self.em.instructions)
        if engine is Engine.SCALAR:
            func, scale, bias, x = form
            self.em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, x, func=func, imm0=scale, imm1=bias)
        else:
            _compute(self.em, step, out, args, constants, loc, engine)
        for inst in self.em.instructions[start:]:
            self.busy[inst.engine] = self.busy.get(inst.engine, 0.0) + instruction_cost_ns(inst, self.em.target)


def _compute(em: Emitter, step, out: AccessPattern, args: list, constants, loc, engine=Engine.VECTOR) -> None:
    """One instruction computing `step` into `out`; args are tiles or floats (scalars). ALU work runs on
    `engine` (Vector or GpSimd), activation functions on the Scalar engine."""
    op = step.op
    tiles = [a for a in args if isinstance(a, AccessPattern)]
    if op in ACTIVATIONS:
        em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, args[0], func=ACTIVATIONS[op], imm0=1.0, imm1=0.0)
    elif op is Op.NEGATE:
        em.emit(Opcode.TENSOR_SCALAR, engine, out, args[0], alu=AluOp.SUBTRACT, imm0=0.0, reverse=True)
    elif op is Op.CONVERT:
        em.emit(Opcode.TENSOR_COPY, engine, out, args[0])
    elif op is Op.NOT:
        alu, imm = (AluOp.EQ, 0.0) if step.dtype == DType.BOOL else (AluOp.XOR, -1.0)
        em.emit(Opcode.TENSOR_SCALAR, engine, out, args[0], alu=alu, imm0=imm)
    elif op in ALU or op is Op.COMPARE:
        alu = COMPARISONS[step.attrs["direction"]] if op is Op.COMPARE else ALU[op]
        a, b = args
        if len(tiles) == 2:
            em.emit(Opcode.TENSOR_TENSOR, engine, out, a, b, alu=alu)
        elif isinstance(a, AccessPattern):
            em.emit(Opcode.TENSOR_SCALAR, engine, out, a, alu=alu, imm0=b)
        else:
            em.emit(Opcode.TENSOR_SCALAR, engine, out, b, alu=alu, imm0=a, reverse=True)
    elif op is Op.SELECT:
        operands = []
        for arg, dtype in zip(args, (DType.BOOL, step.dtype, step.dtype)):
            if not isinstance(arg, AccessPattern):  # a scalar operand: materialise it as a tile
                tile = constants.next().ap(*out.shape, dtype=dtype)
                em.emit(Opcode.MEMSET, Engine.GPSIMD, tile, imm0=arg)
                arg = tile
            operands.append(arg)
        em.emit(Opcode.SELECT, engine, out, *operands)
    else:
        raise NeuronCompileError(f"no elementwise kernel for {op.name.lower()}", location=str(loc))


# data movement ---------------------------------------------------------------------------------


def copy_strided(em: Emitter, dtype: DType, src_offset: int, src_strides, dst_offset: int, dst_strides, shape) -> None:
    """DMA a strided HBM view (element strides, byte offsets) to another, in bounded blocks."""
    size = dtype.itemsize
    for block in blocks(shape, [dst_strides, src_strides], tile_free_elements(em, DType.F32), em.target.partitions):
        em.dma(hbm(dtype, dst_offset + block.offsets[0] * size, block.dims[0]),
               hbm(dtype, src_offset + block.offsets[1] * size, block.dims[1]))


def view_copy(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    x = node.inputs[0]
    size = node.dtype.itemsize
    copy_strided(em, node.dtype, plan.offset(x) + node.attrs["offset"] * size, node.attrs["strides"],
                 plan.offset(node), dense_strides(node.shape), node.shape)


def fill(em: Emitter, dtype: DType, offset: int, count: int, value: float) -> None:
    """Write `value` to `count` contiguous HBM elements: one memset tile, DMA'd out block by block."""
    free = tile_free_elements(em, DType.F32)
    cover = list(blocks((count,), [(1,)], free, em.target.partitions))
    widest = max(b.free_elements for b in cover)
    tile = em.sbuf_pool(dtype, widest, bufs=1).next()
    em.emit(Opcode.MEMSET, Engine.GPSIMD, tile.ap(em.target.partitions, widest), imm0=value)
    for block in cover:
        em.dma(hbm(dtype, offset + block.offsets[0] * dtype.itemsize, block.dims[0]),
               tile.ap(block.partitions, *block.free))


def splat_constant(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    fill(em, node.dtype, plan.offset(node), node.size, float(node.scalar))


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
    """C[b] = A[b] @ B[b]: stationary = A tile transposed [K, M], moving = B tile [K, N], fp32 in PSUM,
    tiled and ordered as the tiling pass decided (attrs["tiling"], passes/tiling.py).

    Operands are loaded as strips [K tile, k tiles x width] by one DMA each (split over the queues by
    partitions): with a resident operand, its strip of `block` output tiles stays in SBUF while the other
    operand's strips stream through it. With an epilogue (fused elementwise consumers: bias, activation,
    residual, cast), each result tile is computed from the PSUM accumulator and the epilogue's other
    inputs on its way out."""
    from neuronc.passes.tiling import default_tiling, epilogue_pools, operand_pools

    a, b, *extra = node.inputs
    (batch, m, n), k = node.shape, node.attrs["k"]
    tiling = node.attrs.get("tiling") or default_tiling(node, em.target)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    (a_offset, (asb, asm, ask)), (b_offset, (bsb, bsk, bsn)) = (
        view or (0, dense_strides(shape)) for view, shape in zip(views, ((batch, m, k), (batch, k, n))))
    extra_views = [view or (0, dense_strides(node.shape)) for view in views[2:]]
    body = node.attrs.get("epilogue") or (ir.Step(Op.CONVERT, (("input", 0),), node.dtype, {}),)
    slots, temp_count = _assign_slots(body)
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    k_tiles = -(-k // tk)
    strips = {name: em.sbuf_pool(dtype, n_, bufs=bufs) for name, (dtype, n_, bufs) in operand_pools(node, tiling).items()}
    out_pools = epilogue_pools(node, tn)
    pool = lambda name: em.sbuf_pool(*out_pools[name][:2], bufs=out_pools[name][2])  # noqa: E731
    result, constants = pool("result"), pool("constants")
    extra_pools = [pool(f"extra{i}") for i in range(len(extra))]
    bias_row = node.attrs.get("bias_row")  # an extra input added into PSUM as a row, by a rank-1 matmul
    if bias_row is not None:
        ones = pool("ones").next().ap(1, tm)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, ones, imm0=1.0)
    temps = [pool(f"temp{i}") for i in range(temp_count)]
    psum = em.psum_pool()
    engines = _StepBalancer(em)
    ci = node.dtype.itemsize

    def load_strip(name, x, element, k_stride, w_stride, width):
        """All K tiles of `width` columns of x ([K, width] at `element`, strided) as [tk, k tiles x width]."""
        tile = strips[name].next().ap(tk, k_tiles * width)
        whole, tail = divmod(k, tk)
        if whole:
            _dma_by_rows(em, _at(tile, 0, min(tk, k), whole, width),
                         hbm(x.dtype, plan.offset(x) + element * x.dtype.itemsize,
                             ((k_stride, min(tk, k)), (tk * k_stride, whole), (w_stride, width))))
        if tail:
            em.dma(_at(tile, whole * width, tail, width),
                   hbm(x.dtype, plan.offset(x) + (element + whole * tk * k_stride) * x.dtype.itemsize,
                       ((k_stride, tail), (w_stride, width))))
        return tile, width

    def a_strip(g, m0, rows):
        return load_strip("a", a, a_offset + g * asb + m0 * asm, ask, asm, min(rows, m - m0))

    def b_strip(g, n0, cols):
        return load_strip("b", b, b_offset + g * bsb + n0 * bsn, bsk, bsn, min(cols, n - n0))

    def in_strip(strip, col, size):
        """The operand of K tile j: `size` columns from `col` of the strip's j-th K tile."""
        tile, width = strip
        return lambda j: _at(tile, j * width + col, min(tk, k - j * tk), size)

    def streamed(name, x, element, k_stride, w_stride, size):
        """The operand of K tile j loaded on demand ([rows, size] tiles, the baseline's stream)."""
        def load(j):
            rows = min(tk, k - j * tk)
            tile = strips[name].next().ap(rows, size)
            em.dma(tile, hbm(x.dtype, plan.offset(x) + (element + j * tk * k_stride) * x.dtype.itemsize,
                             ((k_stride, rows), (w_stride, size))))
            return tile
        return load

    def output_tile(g, m0, n0, stationary, moving):
        """One [mt, nt] output tile: K tiles accumulated in PSUM, the epilogue, the store."""
        mt, nt = min(tm, m - m0), min(tn, n - n0)
        acc = psum.next().ap(mt, nt)
        for j in range(k_tiles):
            em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary(j), moving(j), accumulate=j > 0)
        loaded = {0: acc}
        for i, (x, xpool, (offset, (sb, sm, sn))) in enumerate(zip(extra, extra_pools, extra_views), start=1):
            if i == bias_row:  # acc[m, n] += 1 * bias[n]
                row = xpool.next().ap(1, nt)
                em.dma(row, hbm(x.dtype, plan.offset(x) + (offset + g * sb + n0 * sn) * x.dtype.itemsize, ((0, 1), (sn, nt))))
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, _columns(ones, 0, mt), row,
                        accumulate=True)
                continue
            loaded[i] = xpool.next().ap(mt, nt)
            em.dma(loaded[i], hbm(x.dtype, plan.offset(x) + (offset + g * sb + m0 * sm + n0 * sn) * x.dtype.itemsize,
                                  ((sm, mt), (sn, nt))))
        waiting.append((loaded, [p.next() for p in temps], result.next(), (mt, nt),
                        hbm(node.dtype, plan.offset(node) + ((g * m + m0) * n + n0) * ci, ((n, mt), (1, nt)))))
        if len(waiting) > EPILOGUE_GROUP:  # this tile's matmuls go ahead of the epilogues of the ones before
            flush(keep=1)

    waiting = []  # output tiles whose matmuls are emitted and whose epilogues are not

    def flush(keep=0):
        """The epilogues of the waiting tiles but the last `keep`, step by step across the tiles (independent
        chains side by side on the engines, not one chain at a time), then their stores."""
        jobs = waiting[:len(waiting) - keep]
        del waiting[:len(jobs)]
        outs = _emit_bodies(body, slots, [job[:4] for job in jobs], constants, node.loc, engines)
        for job, out in zip(jobs, outs):  # by rows over several queues: a short store, and its rows' own pages
            _dma_by_rows(em, job[4], out)

    if tiling.resident == "none":
        for g in range(batch):
            for m0 in range(0, m, tm):
                for n0 in range(0, n, tn):
                    output_tile(g, m0, n0,
                                streamed("a", a, a_offset + g * asb + m0 * asm, ask, asm, min(tm, m - m0)),
                                streamed("b", b, b_offset + g * bsb + n0 * bsn, bsk, bsn, min(tn, n - n0)))
        flush()
        return
    # Strip loads in order of use, each followed by the output tiles it completes; every load is issued
    # `stream_bufs - 1` steps ahead (before the previous steps' tiles and their stores), so it overlaps their
    # compute.
    steps = []  # (loader of one strip, [(g, m0, n0, a strip step, a col, b strip step, b col)])
    for g in range(batch):
        if tiling.resident == "a":
            for mb in range(0, m, tiling.block * tm):
                steps.append((lambda g=g, mb=mb: a_strip(g, mb, tiling.block * tm), []))
                a_step = len(steps) - 1
                for n0 in range(0, n, tn):
                    steps.append((lambda g=g, n0=n0: b_strip(g, n0, tn), []))
                    steps[-1][1].extend((g, m0, n0, a_step, m0 - mb, len(steps) - 1, 0)
                                        for m0 in range(mb, min(m, mb + tiling.block * tm), tm))
        else:
            for nb in range(0, n, tiling.block * tn):
                steps.append((lambda g=g, nb=nb: b_strip(g, nb, tiling.block * tn), []))
                b_step = len(steps) - 1
                for m0 in range(0, m, tm):
                    steps.append((lambda g=g, m0=m0: a_strip(g, m0, tm), []))
                    steps[-1][1].extend((g, m0, n0, len(steps) - 1, 0, b_step, n0 - nb)
                                        for n0 in range(nb, min(n, nb + tiling.block * tn), tn))
    loaded: dict = {}
    for i, (_, tiles) in enumerate(steps):
        for j in range(len(loaded), min(len(steps), i + tiling.stream_bufs)):
            loaded[j] = steps[j][0]()
        for g, m0, n0, a_step, a_col, b_step, b_col in tiles:
            output_tile(g, m0, n0, in_strip(loaded[a_step], a_col, min(tm, m - m0)),
                        in_strip(loaded[b_step], b_col, min(tn, n - n0)))
    flush()


EPILOGUE_GROUP = 2  # output tiles whose epilogues a matmul kernel emits side by side


def _emit_bodies(body, slots, jobs, constants, loc, engines) -> list:
    """`_emit_body` for several tiles at once, each step for every tile before the next step: jobs are
    (loaded, temp tiles, out tile, shape). Returns each job's result AP."""
    results = [[] for _ in jobs]
    for step, slot in zip(body, slots):
        for (loaded, temp_tiles, out_tile, shape), done in zip(jobs, results):
            out = out_tile.ap(*shape) if slot is None else temp_tiles[slot].ap(*shape, dtype=step.dtype)
            args = [loaded[ref] if kind == "input" else done[ref] if kind == "step" else float(ref)
                    for kind, ref in step.args]
            engines.compute(step, out, args, constants, loc)
            done.append(out)
    return [done[-1] for done in results]


def reduce_last(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out[r] = reduce(x[r, :]): rows on partitions, columns reduced along the free axis in chunks.

    x is the operand itself, or (after fusion) computed per tile by a prologue body from inputs
    read through their [R, C] views."""
    rows = node.shape[0]
    cols = node.attrs.get("cols") or node.inputs[0].shape[1]
    kind = node.attrs["kind"]
    if kind not in REDUCTIONS:
        raise NeuronCompileError(f"a {kind!r} reduction is not supported yet", location=str(node.loc))
    alu = REDUCTIONS[kind]
    body = node.attrs.get("prologue")
    views = node.attrs.get("views") or ((0, (cols, 1)),)
    slots, temp_count = _assign_slots(body) if body else ([], 0)
    reduced_dtype = body[-1].dtype if body else node.inputs[0].dtype
    acc_dtype = DType.F32 if node.dtype.is_float else node.dtype
    widest = max([DType.F32.itemsize, reduced_dtype.itemsize] + [x.dtype.itemsize for x in node.inputs])
    # inputs, temporaries, body outputs, constants, and the six [rows, 1] accumulator tiles
    chunk = _free_for(em, 3 * len(node.inputs) + 2 * temp_count + 3 + 1 + 6, widest)
    pools = [em.sbuf_pool(x.dtype, chunk, bufs=3) for x in node.inputs]
    temps = [em.sbuf_pool(DType.F32, chunk * widest // DType.F32.itemsize, bufs=2) for _ in range(temp_count)]
    body_out = em.sbuf_pool(reduced_dtype, chunk, bufs=3) if body else None
    constants = em.sbuf_pool(DType.F32, chunk * widest // DType.F32.itemsize, bufs=1) if body else None
    partials = em.sbuf_pool(acc_dtype, 1, bufs=2)
    accs = em.sbuf_pool(acc_dtype, 1, bufs=2)
    outs = em.sbuf_pool(node.dtype, 1, bufs=2)
    for r0 in range(0, rows, em.target.partitions):
        rt = min(em.target.partitions, rows - r0)
        acc = accs.next().ap(rt, 1)
        for c0 in range(0, cols, chunk):
            ct = min(chunk, cols - c0)
            loaded = {}
            for i, (x, pool, (offset, (sr, sc))) in enumerate(zip(node.inputs, pools, views)):
                loaded[i] = pool.next().ap(rt, ct)
                at = offset + r0 * sr + c0 * sc
                em.dma(loaded[i], hbm(x.dtype, plan.offset(x) + at * x.dtype.itemsize, ((sr, rt), (sc, ct))))
            tile = loaded[0] if body is None else _emit_body(
                em, body, slots, loaded, [pool.next() for pool in temps], body_out.next(), (rt, ct), constants, node.loc)
            if c0 == 0:
                em.emit(Opcode.TENSOR_REDUCE, Engine.VECTOR, acc, tile, alu=alu)
            else:
                part = partials.next().ap(rt, 1)
                em.emit(Opcode.TENSOR_REDUCE, Engine.VECTOR, part, tile, alu=alu)
                em.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, acc, acc, part, alu=alu)
        out = outs.next().ap(rt, 1)
        em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, out, acc)
        em.dma(hbm(node.dtype, plan.offset(node) + r0 * node.dtype.itemsize, ((1, rt), (1, 1))), out)


class _SummedActivation(NamedTuple):
    """A ROWWISE step made with its row sum by one ACTIVATE_BIAS_REDUCE: func(src + bias) where bias is
    -shift (a [rows, 1] step) or 0."""

    func: ActFunc
    row_sum: int  # the REDUCE_LAST(add) step it also makes
    src: tuple  # (kind, ref) of the source
    shift: int | None  # the [rows, 1] step subtracted from src, or None


def _summed_activations(body, kinds) -> tuple:
    """({step: _SummedActivation}, {steps they make redundant}): the fp32 full-row activations (or squares)
    whose row sum is the very next step, as exp(x - max) then sum in a softmax, or (x - mean)^2 then sum
    in a layer-norm. A subtraction of a row value used by nothing else is folded in as the bias: fp32
    x + (-m) is x - m exactly, and the row sum is the fp32 sum of the fp32 values, as the reduction's."""
    users = [[j for j, step in enumerate(body) for a, ref in step.args if a == "step" and ref == i]
             for i in range(len(body))]
    fused, skipped = {}, set()
    for j, step in enumerate(body[:-1]):
        reduce = body[j + 1]
        if (kinds[j] != "full" or step.dtype != DType.F32 or reduce.dtype != DType.F32 or reduce.op is not Op.REDUCE_LAST
                or reduce.attrs["kind"] != "add" or reduce.args != (("step", j),)):
            continue
        func, src = _as_activation(step)
        if func is None or src[0] == "imm":
            continue
        shift = None
        if src[0] == "step" and users[src[1]] == [j]:
            producer = body[src[1]]
            if producer.op is Op.SUBTRACT and producer.dtype == DType.F32 and producer.args[1][0] == "step" and \
                    kinds[producer.args[1][1]] == "row" and body[producer.args[1][1]].dtype == DType.F32:
                skipped.add(src[1])
                src, shift = producer.args[0], producer.args[1][1]
        fused[j] = _SummedActivation(func, j + 1, src, shift)
        skipped.add(j + 1)
    return fused, skipped


def _summed_activation(em: Emitter, engines, fused: _SummedActivation, out, tile_of, tiles, results, bias, rt, cols):
    """Emit ``fused`` for a tile of ``rt`` rows: its bias (-shift, or 0), then the activation with its row sum."""
    if fused.shift is None:
        engines.emit(Opcode.MEMSET, bias, imm0=0.0)
    else:
        engines.emit(Opcode.TENSOR_SCALAR, bias, _first_rows(results[fused.shift], rt), alu=AluOp.MULTIPLY, imm0=-1.0)
    kind, ref = fused.src
    src = _first_rows(tiles[ref] if kind == "input" else results[ref], rt)
    src = _broadcast(src, cols) if src.free_elements == 1 < cols else src
    results[fused.row_sum] = tile_of(fused.row_sum)
    em.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, out, results[fused.row_sum], src, bias, func=fused.func,
            imm0=1.0)


def _as_activation(step) -> tuple:
    """(ActFunc, (kind, ref) of its source) computing ``step`` as an activation, or (None, None)."""
    if step.op in ACTIVATIONS:
        return ACTIVATIONS[step.op], step.args[0]
    square = (step.op is Op.MULTIPLY and step.args[0] == step.args[1]) or (
        step.op is Op.POWER and step.args[1] == ("imm", 2.0))
    return (ActFunc.SQUARE, step.args[0]) if square else (None, None)


def rowwise(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """A row-wise normalisation (passes/rowwise.py): for each tile of rows (a row per partition), load
    every input's whole rows once, compute the body's reductions ([rows, 1] results) and elementwise
    steps (reduced values broadcast over the row with a stride-0 read) on chip, store the result once.
    Inputs the same for every row (a norm's weight and bias) are loaded once for all row tiles. With the
    node's "bufs" twice BUFS, row tiles go in pairs whose steps are emitted interleaved, step by step, so the
    engines' in-order queues alternate between two independent chains instead of waiting on one."""
    body, views = node.attrs["body"], node.attrs["views"]
    rows, cols = node.attrs["rows"], node.attrs["cols"]
    kinds = step_kinds(body, views)
    slots, count = slot_plan(body, kinds)
    bufs = node.attrs.get("bufs", BUFS)
    parts = em.target.partitions
    wide = max([DType.F32.itemsize, node.dtype.itemsize] + [s.dtype.itemsize for s in body]) // DType.F32.itemsize
    full_temps = [em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) for _ in range(count["full"])]
    row_temps = [em.sbuf_pool(DType.F32, wide, bufs=bufs) for _ in range(count["row"])]
    summed, skipped = _summed_activations(body, kinds)
    biases = em.sbuf_pool(DType.F32, wide, bufs=bufs) if summed else None  # the budget's spare row tile
    out_pool = em.sbuf_pool(node.dtype, cols, bufs=bufs)
    needs_constants = any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body)
    constants = em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) if needs_constants else None
    engines = _Balancer(em)
    loaded, pools = {}, {}
    for i, (x, (offset, (sr, sc))) in enumerate(zip(node.inputs, views)):
        width = cols if sc else 1
        if sr == 0:  # the same for every row: loaded once, on every partition
            tile = em.sbuf_pool(x.dtype, width, bufs=1).next().ap(parts, width)
            _dma_by_rows(em, tile, hbm(x.dtype, plan.offset(x) + offset * x.dtype.itemsize, ((0, parts), (sc or 1, width))))
            loaded[i] = tile
        else:
            pools[i] = em.sbuf_pool(x.dtype, width, bufs=bufs)
    col_tiles = [em.sbuf_pool(DType.F32, cols * wide, bufs=1).next() for _ in range(count["col"])]
    results = {}  # step -> its result: the col steps once, here; the others per row tile, below
    for j, (step, kind) in enumerate(zip(body, kinds)):
        if kind == "col":
            out = col_tiles[slots[j]].ap(parts, cols, dtype=step.dtype)
            args = [float(ref) if a == "imm" else loaded[ref] if a == "input" else results[ref] for a, ref in step.args]
            engines.compute(step, out, args, constants, node.loc)
            results[j] = out
    sr_out, sc_out = node.attrs["out_strides"]

    def load(r0):
        """Issue the loads of the row tile at r0: its input tiles by input index."""
        rt = min(parts, rows - r0)
        tiles = {}
        for i, x in enumerate(node.inputs):
            offset, (sr, sc) = views[i]
            width = cols if sc else 1
            if i in pools:
                tiles[i] = pools[i].next().ap(rt, width)
                src = hbm(x.dtype, plan.offset(x) + (offset + r0 * sr) * x.dtype.itemsize, ((sr, rt), (sc or 1, width)))
                _dma_by_rows(em, tiles[i], src)
            else:
                tiles[i] = _first_rows(loaded[i], rt)
        return tiles

    def compute(r0, tiles):
        """The steps of the row tile at r0 and its store, a step at a time (a generator: see below)."""
        rt = min(parts, rows - r0)
        full = [pool.next() for pool in full_temps]
        per_row = [pool.next() for pool in row_temps]
        out_tile = out_pool.next()
        results_here = dict(results)

        def tile_of(j):
            width = cols if kinds[j] == "full" else 1
            if slots[j] is None:
                return out_tile.ap(rt, width)
            return (full if kinds[j] == "full" else per_row)[slots[j]].ap(rt, width, dtype=body[j].dtype)

        for j, (step, kind, slot) in enumerate(zip(body, kinds, slots)):
            if kind == "col" or j in skipped:
                continue
            out = tile_of(j)
            if j in summed:
                _summed_activation(em, engines, summed[j], out, tile_of, tiles, results_here, biases.next().ap(rt, 1),
                                   rt, cols)
                results_here[j] = out
                yield
                continue
            args = []
            for a, ref in step.args:
                if a == "imm":
                    args.append(float(ref))
                    continue
                arg = _first_rows(tiles[ref] if a == "input" else results_here[ref], rt)
                args.append(_broadcast(arg, cols) if kind == "full" and arg.free_elements == 1 < cols else arg)
            if step.op is Op.REDUCE_LAST:
                engines.emit(Opcode.TENSOR_REDUCE, out, args[0], alu=REDUCTIONS[step.attrs["kind"]])
            else:
                engines.compute(step, out, args, constants, node.loc)
            results_here[j] = out
            yield
        dst = hbm(node.dtype, plan.offset(node) + r0 * sr_out * node.dtype.itemsize, ((sr_out, rt), (sc_out, cols)))
        _dma_by_rows(em, dst, results_here[len(body) - 1])

    # Groups of `together` row tiles: the next group's loads go ahead of this group's steps and stores on the
    # DMA queues; within a group the tiles' steps are emitted in turn.
    together = bufs // BUFS
    starts = list(range(0, rows, parts))
    groups = [starts[g:g + together] for g in range(0, len(starts), together)]
    ahead = [load(r0) for r0 in groups[0]] if groups else []
    for n, group in enumerate(groups):
        tiles = ahead
        if n + 1 < len(groups):
            ahead = [load(r0) for r0 in groups[n + 1]]
        chains = [compute(r0, t) for r0, t in zip(group, tiles)]
        while chains:
            chains = [chain for chain in chains if next(chain, StopIteration) is not StopIteration]


class _Balancer:
    """Puts each ALU instruction on the Vector or GpSimd engine, whichever has less work so far (as the
    cost model prices it), so the two share a kernel's elementwise work; activations go to Scalar. A copy
    or a scaling by a constant may also go to Scalar (an ACTIVATE of the identity), when it has less work."""

    CANDIDATES = (Engine.VECTOR, Engine.GPSIMD)

    def __init__(self, em: Emitter):
        self.em = em
        self.busy = {e: 0.0 for e in (*self.CANDIDATES, Engine.SCALAR)}

    def _charge(self, start: int) -> None:
        for inst in self.em.instructions[start:]:
            if inst.engine in self.busy:
                self.busy[inst.engine] += instruction_cost_ns(inst, self.em.target)

    def _engine(self) -> Engine:
        return min(self.CANDIDATES, key=self.busy.get)

    def emit(self, opcode, *operands, **fields) -> None:
        start = len(self.em.instructions)
        self.em.emit(opcode, self._engine(), *operands, **fields)
        self._charge(start)

    def compute(self, step, out, args, constants, loc) -> None:
        start = len(self.em.instructions)
        _compute(self.em, step, out, args, constants, loc, self._engine())
        self._charge(start)

    def activate(self, opcode, *operands, **fields) -> None:
        """A Scalar-engine instruction, counted so that the other choices see Scalar's load."""
        start = len(self.em.instructions)
        self.em.emit(opcode, Engine.SCALAR, *operands, **fields)
        self._charge(start)

    def scale(self, dst, src, factor: float) -> None:
        """dst = src * factor (fp32, rounded to dst's dtype) on the least loaded of Vector, GpSimd, Scalar."""
        if min(self.busy, key=self.busy.get) is Engine.SCALAR:
            self.activate(Opcode.ACTIVATE, dst, src, func=ActFunc.IDENTITY, imm0=factor, imm1=0.0)
        elif factor == 1.0:
            self.emit(Opcode.TENSOR_COPY, dst, src)
        else:
            self.emit(Opcode.TENSOR_SCALAR, dst, src, alu=AluOp.MULTIPLY, imm0=factor)


def _broadcast(ap: AccessPattern, cols: int) -> AccessPattern:
    """A [rows, 1] tile read as [rows, cols]: the free axis with stride 0."""
    return dataclasses.replace(ap, dims=(ap.dims[0], (0, cols)))


def _first_rows(ap: AccessPattern, rows: int) -> AccessPattern:
    return dataclasses.replace(ap, dims=((ap.dims[0][0], rows), *ap.dims[1:]))


def _dma_by_rows(em: Emitter, dst: AccessPattern, src: AccessPattern) -> None:
    """One DMA per slice of partitions, on consecutive queues, so that a large tile moves at the
    bandwidth of several queues. A slice is at least the bytes that keep a DMA efficient on the target
    (its efficient bytes per partition, over all partitions, shared by the queues)."""
    t = em.target
    rows = dst.partitions
    nbytes = dst.num_elements * dst.dtype.itemsize
    smallest = t.dma_efficient_bytes_per_partition * t.partitions // t.dma_queues
    pieces = max(1, min(rows, t.dma_queues, nbytes // smallest))
    for k in range(pieces):
        p0, p1 = rows * k // pieces, rows * (k + 1) // pieces
        em.dma(_rows(dst, p0, p1), _rows(src, p0, p1))


def _rows(ap: AccessPattern, p0: int, p1: int) -> AccessPattern:
    """Partitions [p0, p1) of an on-chip tile, or the matching rows of an HBM pattern."""
    stride, _ = ap.dims[0]
    dims = ((stride, p1 - p0), *ap.dims[1:])
    if ap.space == Space.HBM:
        return dataclasses.replace(ap, offset=ap.offset + p0 * stride * ap.dtype.itemsize, dims=dims)
    return dataclasses.replace(ap, partition=ap.partition + p0, dims=dims)


def _row_chunks(em: Emitter, plan: MemoryPlan, rows: Node, width: int, dtype: DType):
    """(index tile, r0, rt, c0, ct, data tile) for every tile of `rows`' index rows x `width` columns:
    up to a partition per row, the row cut to what fits a tile; each index tile loaded from HBM once."""
    count = rows.size
    chunk = min(width, tile_free_elements(em, DType.F32))
    index_tiles = em.sbuf_pool(rows.dtype, 1, bufs=2)
    data = em.sbuf_pool(dtype, chunk, bufs=3)
    for r0 in range(0, count, em.target.partitions):
        rt = min(em.target.partitions, count - r0)
        index = index_tiles.next().ap(rt, 1)
        em.dma(index, hbm(rows.dtype, plan.offset(rows) + r0 * rows.dtype.itemsize, ((1, rt), (1, 1))))
        for c0 in range(0, width, chunk):
            ct = min(chunk, width - c0)
            yield index, r0, rt, c0, ct, data.next().ap(rt, ct)


def gather_rows(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out[i, :] = table[rows[i], :]: row numbers to SBUF, rows fetched by indirect DMA, stored."""
    table, rows = node.inputs
    count, width = table.shape[0], table.shape[1]
    size = node.dtype.itemsize
    for index, r0, rt, c0, ct, tile in _row_chunks(em, plan, rows, width, node.dtype):
        em.dma(tile, hbm(table.dtype, plan.offset(table) + c0 * size, ((width, count), (1, ct))), indices=index)
        em.dma(hbm(node.dtype, plan.offset(node) + (r0 * width + c0) * size, ((width, rt), (1, ct))), tile)


def scatter_rows(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """out = base, then out[rows[i], :] = (or +=) updates[i, :]: updates to SBUF, written by indirect DMA."""
    base, rows, updates = node.inputs
    count, width = base.shape
    size = node.dtype.itemsize
    whole = ((width, count), (1, width))
    em.dma(hbm(node.dtype, plan.offset(node), whole), hbm(base.dtype, plan.offset(base), whole))
    for index, r0, rt, c0, ct, tile in _row_chunks(em, plan, rows, width, node.dtype):
        em.dma(tile, hbm(updates.dtype, plan.offset(updates) + (r0 * width + c0) * size, ((width, rt), (1, ct))))
        em.dma(hbm(node.dtype, plan.offset(node) + c0 * size, ((width, count), (1, ct))), tile, indices=index,
               add=node.attrs["combine"] == "add")


TOP = 8  # values one MAX8 / FIND_INDEX8 / MATCH_REPLACE8 handles
LOWEST_F32 = float(np.finfo(np.float32).min)


def _columns(ap: AccessPattern, c0: int, c1: int) -> AccessPattern:
    """Columns [c0, c1) of a [partitions, n] on-chip tile."""
    return dataclasses.replace(ap, offset=ap.offset + c0 * ap.dtype.itemsize, dims=(ap.dims[0], (1, c1 - c0)))


def topk(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """positions[r, :k] of the k largest of x[r, :], largest first: per tile of rows, rounds of MAX8 (the next
    8 values), FIND_INDEX8 (where they are) and MATCH_REPLACE8 (strike them out with -inf). The keys are
    x raised to at least the lowest finite float, so a struck-out slot is below every real value."""
    (x,) = node.inputs
    rows, n = x.shape
    k = node.attrs["k"]
    width, rounds = max(n, TOP), -(-k // TOP)
    if width > tile_free_elements(em, DType.F32):
        raise NeuronCompileError(f"a sort or top-k over rows of {n} values: at most {tile_free_elements(em, DType.F32)} "
                                 f"fit one tile", location=str(node.loc),
                                 hint="sort shorter rows (split the dimension), or keep this op outside the compiled region")
    loads = em.sbuf_pool(x.dtype, n, bufs=2)
    works = em.sbuf_pool(DType.F32, width, bufs=2)
    bests = em.sbuf_pool(DType.F32, TOP, bufs=2)
    outs = em.sbuf_pool(node.dtype, rounds * TOP, bufs=2)
    size = x.dtype.itemsize
    for r0 in range(0, rows, em.target.partitions):
        rt = min(em.target.partitions, rows - r0)
        tile, work, out = loads.next().ap(rt, n), works.next().ap(rt, width), outs.next().ap(rt, rounds * TOP)
        em.dma(tile, hbm(x.dtype, plan.offset(x) + r0 * n * size, ((n, rt), (1, n))))
        em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, _columns(work, 0, n), tile, alu=AluOp.MAX, imm0=LOWEST_F32)
        if width > n:
            em.emit(Opcode.MEMSET, Engine.VECTOR, _columns(work, n, width), imm0=-np.inf)
        for r in range(rounds):
            best = bests.next().ap(rt, TOP)
            em.emit(Opcode.MAX8, Engine.VECTOR, best, work)
            em.emit(Opcode.FIND_INDEX8, Engine.VECTOR, _columns(out, r * TOP, (r + 1) * TOP), work, best)
            if r + 1 < rounds:
                em.emit(Opcode.MATCH_REPLACE8, Engine.VECTOR, work, work, best, imm0=-np.inf)
        em.dma(hbm(node.dtype, plan.offset(node) + r0 * k * node.dtype.itemsize, ((k, rt), (1, k))), _columns(out, 0, k))
# attention ---------------------------------------------------------------------------------------

NEG_BIG = -3.0e38  # a masked row's running max is held at least here: finite, so exp(-inf - m) = 0, not NaN
CAUSAL_BIAS = -2.0e38  # added to masked scores by a matmul (a -inf would meet the identity's zeros: NaN)


def _at(ap: AccessPattern, element: int, partitions: int, *free: int) -> AccessPattern:
    """The [partitions, free...] tile starting `element` elements into each partition of `ap`'s slot."""
    dims, stride = [], 1
    for size in reversed(free):
        dims.append((stride, size))
        stride *= size
    return dataclasses.replace(ap, offset=ap.offset + element * ap.dtype.itemsize,
                               dims=((1, partitions), *reversed(dims)))


def _identity(em: Emitter, tile, size: int, scratch) -> AccessPattern:
    """An identity matrix [size, size]: iota gives column - partition, compared with 0."""
    ramp = scratch.ap(size, size, dtype=DType.F32)
    em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=0.0, imm1=-1.0)
    ident = tile.ap(size, size)
    em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, ident, ramp, alu=AluOp.EQ, imm0=0.0)
    return ident


def _v_chunks(vt: AccessPattern, chunks: int, rows: int, cols: int, stride: int) -> AccessPattern:
    """`cols` columns of each of `chunks` chunks of `stride` elements of a [partitions, chunks * stride] tile."""
    return dataclasses.replace(vt, dims=((1, rows), (stride, chunks), (1, cols)))


def _is_power_of_two(x: float) -> bool:
    mantissa, _ = np.frexp(x)
    return x > 0 and mantissa == 0.5


def _fused_logits(a: dict) -> bool:
    """Whether one instruction makes the logits (in SBUF) of an ATTENTION node's attrs `a` from the PSUM
    scores: fp32 scores need no rounding of their own, and a power-of-two scale commutes with rounding,
    so round(round(S) * scale) is round(S * scale) (outside the subnormal range)."""
    score, logit = a["score_dtype"], a["logits_dtype"]
    return score == DType.F32 or (_is_power_of_two(a["scale"]) and logit in (DType.F32, score))


def attention(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """softmax(mask(scale * Q K^T)) V, flash-attention style (passes/attention.py).

    Per batch-head, K^T, V (beside a column of ones) and Q^T are loaded once and stay in SBUF. Per tile of 128
    query rows (one per partition), the keys are visited in blocks of a PSUM bank: S = Q K^T into PSUM, the
    causal mask added by a matmul with an on-chip bias tile over the at most 127 keys it cuts (blocks wholly
    above the diagonal skipped). The logits are kept negated, -scale * S, so that their row min is the exp's
    bias b = -m, made in the same pass (TENSOR_SCALAR_REDUCE); P = exp(logits + b) takes one Scalar pass, is
    transposed on the Tensor engine (a matmul with the identity) so the keys lie on partitions, and
    P [V | 1] = [P V | rowsum P] accumulates in PSUM, rescaled in place by e^(b' - b) when the running max
    grows. The output is P V / l. Each block passes through eight stages, one engine hop each, emitted
    software-pipelined so the engines' in-order queues overlap blocks; copies and scalings go to whichever of
    Vector, GpSimd and Scalar has least work, so no one dominates. The scores never leave the chip."""
    from neuronc.passes.attention import (HEADS_AHEAD, KEY_BLOCK, PIPELINE_DEPTH, Q_TILE, causal_cuts, logits_in_sbuf, pools_of,
                                         probability_dtype)

    a = node.attrs
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    batch, sq, dv = node.shape
    sk, d, scale = a["keys"], a["head_dim"], a["scale"]
    causal, offset = a["mask"] == "causal", a["causal_offset"]
    tensor_mask = a["mask"] in ("select", "add")
    p_dtype = probability_dtype(v.dtype)
    materialise, fused = logits_in_sbuf(a), _fused_logits(a)
    block = min(KEY_BLOCK, sk)
    d_tiles, k_chunks = -(-d // Q_TILE), -(-sk // Q_TILE)
    pools = {name: em.sbuf_pool(dtype, n, bufs=bufs) for name, (dtype, n, bufs) in pools_of(node).items()}
    s_psum, pt_psum, o_psum = em.psum_pool(3), em.psum_pool(2), em.psum_pool(2)
    engines = _Balancer(em)
    vector = engines.emit

    def small(name, rows):
        return pools[name].next().ap(rows, 1)

    # constants of the kernel: identities, the causal bias tiles, a mask's fill, the guard's zeros
    identity = _identity(em, pools["identity"].next(), Q_TILE, pools["ramp"].next())
    bias_identity, bias = identity, {}
    if causal:
        if p_dtype != DType.BF16:
            bias_identity = _identity(em, pools["bias_identity"].next(), Q_TILE, pools["ramp"].next())
        ramp = pools["ramp"].next().ap(Q_TILE, Q_TILE, dtype=DType.F32)
        for cut in causal_cuts(sq, sk, offset):
            tile = pools["bias"].next().ap(Q_TILE, Q_TILE)  # column c masks row i where c - i + cut > 0
            em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=float(cut), imm1=-1.0)
            em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, ramp, alu=AluOp.GT, imm0=0.0)
            em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, tile, alu=AluOp.MULTIPLY, imm0=CAUSAL_BIAS)
            bias[cut] = tile
    for _ in range(pools["v"].bufs):  # V's ones columns, which the loads of V leave alone: made once
        vt = pools["v"].next().ap(Q_TILE, k_chunks * (dv + 1))
        ones = _v_chunks(vt, k_chunks, Q_TILE, 1, dv + 1)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, dataclasses.replace(ones, offset=vt.offset + dv * vt.dtype.itemsize), imm0=1.0)
    if a["mask"] == "select":
        fill = pools["fill"].next().ap(Q_TILE, block)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, fill, imm0=-a["fill"])  # negated, as the logits are
    if a["zero_masked_rows"]:
        zeros = pools["zeros"].next().ap(Q_TILE, dv)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, zeros, imm0=0.0)

    def origin(i, g):
        offset0, strides = a["views"][i]
        index = np.unravel_index(g, a["batch_shape"])
        return offset0 + sum(int(j) * s for j, s in zip(index, strides[:-2])), strides[-2], strides[-1]

    def address(x, element):
        return plan.offset(x) + element * x.dtype.itemsize

    def scores_of(g, qtile, kt, q0, qt, k0, kb):
        """S = Q K^T of a key block into PSUM, the causal bias added over the keys the diagonal cuts."""
        scores = s_psum.next().ap(qt, kb)
        for j in range(d_tiles):
            dt = min(Q_TILE, d - j * Q_TILE)
            em.emit(Opcode.MATMUL, Engine.TENSOR, scores, _at(qtile, j * sq + q0, dt, qt),
                    _at(kt, j * sk + k0, dt, kb), accumulate=j > 0)
        first_cut = max(k0, q0 + offset + 1)  # keys from here on are masked for some row of the tile
        if causal and first_cut < k0 + kb:
            cut = k0 - q0 - offset if k0 > q0 + offset else 1
            width = k0 + kb - first_cut
            em.emit(Opcode.MATMUL, Engine.TENSOR, _at(scores, first_cut - k0, qt, width),
                    _at(bias_identity, 0, qt, qt), _at(bias[cut], 0, qt, width), accumulate=True)
        return scores

    def logits_of(g, scores, q0, qt, k0, kb):
        """(src, factor, b or None): the exp's argument is src * factor + b. Materialised logits are negated
        (factor -1); unless a mask tensor comes in between, their row min, b, is made in the same pass."""
        if not materialise:
            return scores, scale, None
        if not fused:  # S rounded as eager rounds it, then scaled
            rounded_scores = pools["scores"].next().ap(qt, kb, dtype=a["score_dtype"])
            engines.scale(rounded_scores, scores, 1.0)
            scores = rounded_scores
        dtype = a["score_dtype"] if fused and a["score_dtype"] != DType.F32 else a["logits_dtype"]
        logits = pools["logits"].next().ap(qt, kb, dtype=dtype)
        if not tensor_mask:
            b = small("b_block", qt)
            vector(Opcode.TENSOR_SCALAR_REDUCE, logits, b, scores, alu=AluOp.MIN, imm0=-scale)
            return logits, -1.0, b
        engines.scale(logits, scores, -scale)
        if tensor_mask:
            mb0, ms, mk = origin(3, g)
            mtile = pools["mask"].next().ap(qt, kb)
            em.dma(mtile, hbm(mask.dtype, address(mask, mb0 + q0 * ms + k0 * mk), ((ms, qt), (mk, kb))))
            if a["mask"] == "add":
                vector(Opcode.TENSOR_TENSOR, logits, logits, mtile, alu=AluOp.SUBTRACT)
            else:
                filled = _at(fill, 0, qt, kb)
                on_true, on_false = (filled, logits) if a["masked_when"] else (logits, filled)
                vector(Opcode.SELECT, logits, mtile, on_true, on_false)
        return logits, -1.0, None

    def row_bias(src, factor, qt):
        """b = -(the row max of the logits) of a key block: the exp's bias."""
        b = small("b_block", qt)
        if factor < 0:  # negated logits: their row min
            vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MIN)
        else:
            vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MAX)
            vector(Opcode.TENSOR_SCALAR, b, b, alu=AluOp.MULTIPLY, imm0=-factor)
        return b

    def transposes(p, qt, chunks):
        """P^T [keys, queries] into PSUM: Tensor-engine transposes (matmuls with the identity) by chunks of
        128 keys, side by side in one bank."""
        pt_acc = pt_psum.next().ap(Q_TILE, len(chunks) * qt)
        for n, (c, rows) in enumerate(chunks):
            em.emit(Opcode.MATMUL, Engine.TENSOR, _at(pt_acc, n * qt, rows, qt), _at(p, c, qt, rows),
                    _at(identity, 0, qt, qt))
        return pt_acc

    def evacuated(pt_acc, qt, kb, chunks):
        """P^T copied from PSUM to SBUF, where the Tensor engine reads it."""
        pt = pools["pt"].next().ap(Q_TILE, len(chunks) * qt)
        whole = kb // Q_TILE
        if whole:
            engines.scale(_at(pt, 0, Q_TILE, whole * qt), _at(pt_acc, 0, Q_TILE, whole * qt), 1.0)
        if kb % Q_TILE:
            engines.scale(_at(pt, whole * qt, kb % Q_TILE, qt), _at(pt_acc, whole * qt, kb % Q_TILE, qt), 1.0)
        return pt

    def load_head(g):
        """K^T [d, Sk] and Q^T [d, Sq] (d on partitions, by tiles of 128), V [Sk, Dv] (keys on partitions, by
        chunks of 128) of one batch-head, resident while its query tiles run."""
        kb0, ks, kd = origin(1, g)
        kt = pools["k"].next().ap(Q_TILE, d_tiles * sk)
        for j in range(d_tiles):
            dt = min(Q_TILE, d - j * Q_TILE)
            _dma_by_rows(em, _at(kt, j * sk, dt, sk), hbm(k.dtype, address(k, kb0 + j * Q_TILE * kd), ((kd, dt), (ks, sk))))
        vb0, vs, vd = origin(2, g)
        vt = pools["v"].next().ap(Q_TILE, k_chunks * (dv + 1))  # [V | 1] by chunks: P [V | 1] = [P V | rowsum P]
        full = sk // Q_TILE
        if full:
            _dma_by_rows(em, _v_chunks(vt, full, Q_TILE, dv, dv + 1),
                         hbm(v.dtype, address(v, vb0), ((vs, Q_TILE), (Q_TILE * vs, full), (vd, dv))))
        if sk % Q_TILE:
            em.dma(_at(vt, full * (dv + 1), sk % Q_TILE, dv),
                   hbm(v.dtype, address(v, vb0 + full * Q_TILE * vs), ((vs, sk % Q_TILE), (vd, dv))))
        qb0, qs, qd = origin(0, g)
        qtile = pools["q"].next().ap(Q_TILE, d_tiles * sq)
        for j in range(d_tiles):
            dt = min(Q_TILE, d - j * Q_TILE)
            _dma_by_rows(em, _at(qtile, j * sq, dt, sq), hbm(q.dtype, address(q, qb0 + j * Q_TILE * qd), ((qd, dt), (qs, sq))))
        return qtile, kt, vt

    def blocks():
        """(g, q0, qt, k0, kb, first, last) of every key block of every query tile, in order."""
        for g in range(batch):
            for q0 in range(0, sq, Q_TILE):
                qt = min(Q_TILE, sq - q0)
                last_key = min(sk, q0 + qt + offset) if causal else sk  # keys beyond are masked for every row
                starts = list(range(0, last_key, block))
                for k0 in starts:
                    yield _Block(g, q0, qt, k0, min(block, last_key - k0), k0 == starts[0], k0 == starts[-1])

    heads: dict = {}

    # One key block passes through these stages, each a hop to another engine; `x` holds what a block's
    # stages made, `row` the online softmax state of its query tile: b = -m, the exp's bias, and acc = [P V | l]
    # in PSUM (l, the row sum, from V's ones column).
    def scores_stage(blk, row, x):
        """S = Q K^T into PSUM, the causal bias added."""
        for g in range(blk.g, blk.g + 1 + HEADS_AHEAD):  # this head's loads, and the next ones' ahead of their turn
            if g not in heads and g < batch:
                heads[g] = load_head(g)
        qtile, kt, _ = heads[blk.g]
        x["scores"] = scores_of(blk.g, qtile, kt, blk.q0, blk.qt, blk.k0, blk.kb)

    def logits_stage(blk, row, x):
        x["src"], x["factor"], x["b_block"] = logits_of(blk.g, x["scores"], blk.q0, blk.qt, blk.k0, blk.kb)

    def bias_stage(blk, row, x):
        """b' = min(b, -rowmax)."""
        b_block = x["b_block"] or row_bias(x["src"], x["factor"], blk.qt)
        if blk.first:
            b_new = b_block
            if tensor_mask:  # a row masked so far keeps a finite bias
                vector(Opcode.TENSOR_SCALAR, b_block, b_block, alu=AluOp.MIN, imm0=-NEG_BIG)
        else:
            b_new = small("b", blk.qt)
            vector(Opcode.TENSOR_TENSOR, b_new, row["b"], b_block, alu=AluOp.MIN)
        x["b_old"], x["b_new"], row["b"] = row.get("b"), b_new, b_new

    def exp_stage(blk, row, x):
        """P = exp(src f + b') in one Scalar pass (its row sum comes with P V, from V's ones column), and
        corr = e^(b' - b), the accumulator's rescaling, in another (-b taken as the source, b' as the bias)."""
        qt, b_new = blk.qt, x["b_new"]
        x["p"] = pools["p"].next().ap(qt, blk.kb)
        engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x["p"], small("rowsum", qt), x["src"], b_new,
                         func=ActFunc.EXP, imm0=x["factor"])
        if not blk.first:
            x["corr"] = small("corr", qt)
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x["corr"], small("dm", qt), x["b_old"], b_new,
                             func=ActFunc.EXP, imm0=-1.0)

    def transpose_stage(blk, row, x):
        x["chunks"] = [(c, min(Q_TILE, blk.kb - c)) for c in range(0, blk.kb, Q_TILE)]
        x["pt_psum"] = transposes(x["p"], blk.qt, x["chunks"])

    def evacuate_stage(blk, row, x):
        x["pt"] = evacuated(x["pt_psum"], blk.qt, blk.kb, x["chunks"])
        if not blk.first:  # the accumulator [P V | l] in PSUM, rescaled before this block's P V adds to it
            acc = row["acc"]
            vector(Opcode.TENSOR_TENSOR, acc, acc, _broadcast(x["corr"], dv + 1), alu=AluOp.MULTIPLY)

    def product_stage(blk, row, x):
        """[P V | rowsum P] into (or added to) the query tile's accumulator in PSUM."""
        qt, vt = blk.qt, heads[blk.g][2]
        if blk.first:
            row["acc"] = o_psum.next().ap(qt, dv + 1)
        for n, (c, rows) in enumerate(x["chunks"]):
            em.emit(Opcode.MATMUL, Engine.TENSOR, row["acc"], _at(x["pt"], n * qt, rows, qt),
                    _at(vt, (blk.k0 + c) // Q_TILE * (dv + 1), rows, dv + 1), accumulate=n > 0 or not blk.first)

    def output_stage(blk, row, x):
        """After the query tile's last block, out = P V / l stored."""
        if not blk.last:
            return
        qt, acc = blk.qt, row["acc"]
        l, out = _at(acc, dv, qt, 1), pools["out"].next().ap(qt, dv)
        vector(Opcode.TENSOR_TENSOR, out, _at(acc, 0, qt, dv), _broadcast(l, dv), alu=AluOp.DIVIDE)
        if a["zero_masked_rows"]:  # a row every key is masked for gives zeros (l = 0), not 0 / 0
            empty = small("empty_row", qt)
            vector(Opcode.TENSOR_SCALAR, empty, l, alu=AluOp.EQ, imm0=0.0)
            vector(Opcode.SELECT, out, _broadcast(empty, dv), _at(zeros, 0, qt, dv), out)
        em.dma(hbm(node.dtype, plan.offset(node) + (blk.g * sq + blk.q0) * dv * node.dtype.itemsize,
                   ((dv, qt), (1, dv))), out)

    # Software-pipelined: at step t, stage s of block t - s is emitted (the oldest block first), so each
    # engine's in-order queue holds later blocks' work while one block's chain crosses the engines.
    stages = (scores_stage, logits_stage, bias_stage, exp_stage, transpose_stage, evacuate_stage, product_stage,
              output_stage)
    assert len(stages) == PIPELINE_DEPTH  # the pools are sized for it
    in_flight: list = []  # (block, row state, what its stages made), oldest first
    rows: dict = {}
    for step, blk in enumerate([*blocks(), *[None] * (len(stages) - 1)]):
        if blk is not None:
            in_flight.append((blk, rows.setdefault((blk.g, blk.q0), {}), {"step": step}))
        for blk_, row, x in in_flight:
            stages[step - x["step"]](blk_, row, x)
        in_flight = [item for item in in_flight if step - item[2]["step"] + 1 < len(stages)]


class _Block(NamedTuple):
    """A key block of a query tile of the attention kernel."""

    g: int  # batch-head
    q0: int
    qt: int
    k0: int
    kb: int
    first: bool  # the query tile's first key block
    last: bool



def convolution(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """The implicit-GEMM convolution, in a module of its own (codegen/conv.py)."""
    from neuronc.codegen.conv import convolution as conv_kernel

    conv_kernel(em, node, plan)


KERNELS = {op: elementwise for op in (ir.ELEMENTWISE - {Op.CLAMP}) | {Op.FUSED}}
KERNELS.update({
    Op.VIEW: view_copy,
    Op.PAD: pad,
    Op.CONCATENATE: concatenate,
    Op.MATMUL: matmul,
    Op.REDUCE_LAST: reduce_last,
    Op.ROWWISE: rowwise,
    Op.ATTENTION: attention,
    Op.CONV: convolution,
    Op.GATHER_ROWS: gather_rows,
    Op.SCATTER_ROWS: scatter_rows,
    Op.TOPK: topk,
})


def kernel_for(node: Node, plan: MemoryPlan):
    """The kernel that computes `node`, or None when it needs no instructions."""
    if node.op in (Op.PARAMETER, Op.RESHAPE):
        return None
    if node.op is Op.CONSTANT:
        return splat_constant if node.is_splat and plan.has_buffer(node) else None
    return KERNELS.get(node.op)

