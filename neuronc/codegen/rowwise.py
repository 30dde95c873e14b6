"""Row-wise kernels: reductions over the last axis and fused normalisations (softmax, layer-norm, RMS-norm),
one row tile per 128 partitions, row tiles computed in pairs when SBUF holds both."""
from __future__ import annotations


from typing import NamedTuple


from neuronc.codegen.access import broadcast_columns, dma_by_rows, first_rows
from neuronc.codegen.elementwise import ACTIVATIONS, REDUCTIONS, Balancer, assign_slots, emit_body, free_for
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.errors import NeuronCompileError
from neuronc.isa import ActFunc, AluOp, DType, Engine, Opcode
from neuronc.ir import Node, Op
from neuronc.passes.memory_plan import MemoryPlan
from neuronc.passes.rowwise import BUFS, slot_plan, step_kinds


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
    slots, temp_count = assign_slots(body) if body else ([], 0)
    reduced_dtype = body[-1].dtype if body else node.inputs[0].dtype
    acc_dtype = DType.F32 if node.dtype.is_float else node.dtype
    widest = max([DType.F32.itemsize, reduced_dtype.itemsize] + [x.dtype.itemsize for x in node.inputs])
    # inputs, temporaries, body outputs, constants, and the six [rows, 1] accumulator tiles
    chunk = free_for(em, 3 * len(node.inputs) + 2 * temp_count + 3 + 1 + 6, widest)
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
            tile = loaded[0] if body is None else emit_body(
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
        engines.emit(Opcode.TENSOR_SCALAR, bias, first_rows(results[fused.shift], rt), alu=AluOp.MULTIPLY, imm0=-1.0)
    kind, ref = fused.src
    src = first_rows(tiles[ref] if kind == "input" else results[ref], rt)
    src = broadcast_columns(src, cols) if src.free_elements == 1 < cols else src
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
    engines = Balancer(em)
    loaded, pools = {}, {}
    for i, (x, (offset, (sr, sc))) in enumerate(zip(node.inputs, views)):
        width = cols if sc else 1
        if sr == 0:  # the same for every row: loaded once, on every partition
            tile = em.sbuf_pool(x.dtype, width, bufs=1).next().ap(parts, width)
            dma_by_rows(em, tile, hbm(x.dtype, plan.offset(x) + offset * x.dtype.itemsize, ((0, parts), (sc or 1, width))))
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
                dma_by_rows(em, tiles[i], src)
            else:
                tiles[i] = first_rows(loaded[i], rt)
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
                arg = first_rows(tiles[ref] if a == "input" else results_here[ref], rt)
                args.append(broadcast_columns(arg, cols) if kind == "full" and arg.free_elements == 1 < cols else arg)
            if step.op is Op.REDUCE_LAST:
                engines.emit(Opcode.TENSOR_REDUCE, out, args[0], alu=REDUCTIONS[step.attrs["kind"]])
            else:
                engines.compute(step, out, args, constants, node.loc)
            results_here[j] = out
            yield
        dst = hbm(node.dtype, plan.offset(node) + r0 * sr_out * node.dtype.itemsize, ((sr_out, rt), (sc_out, cols)))
        dma_by_rows(em, dst, results_here[len(body) - 1])

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
