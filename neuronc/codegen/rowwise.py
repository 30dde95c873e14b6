"""Row-wise kernels: reductions over the last axis and fused normalisations (softmax, layer-norm, RMS-norm),
one row tile per 128 partitions, row tiles computed in pairs when SBUF holds both."""
from __future__ import annotations

import dataclasses

from neuronc.codegen.access import broadcast_columns, column_slice, dma_by_columns, dma_by_rows, first_rows
from neuronc.codegen.elementwise import ACTIVATIONS, ALU, REDUCTIONS, Balancer, assign_slots, emit_body, free_for
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.errors import NeuronCompileError
from neuronc.isa import ActFunc, AluOp, DType, Engine, Opcode
from neuronc.ir import Node, Op
from neuronc.placement import dma_pieces, transposed_store_pieces
from neuronc.plans import OUT_SLOT, Act, Alu2, MemoryPlan, RowSum, RowwisePlan, Summed


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


def _pieces(em: Emitter, tile, latency_bound: bool) -> int:
    """Slices of a row tile's DMA (neuronc/placement.py `dma_pieces`, the rule the schedule's pricing uses)."""
    return dma_pieces(tile.num_elements * tile.dtype.itemsize, tile.partitions, latency_bound, em.target)


def _tile_arg(arg, tiles, results, rt, cols, full: bool, columns=None):
    """The tile an instruction reads for `arg` in a row tile of `rt` rows, or in its columns [c0, c1) when
    `columns` is given; a per-row value read by a full-row instruction is broadcast along the free axis."""
    kind, ref = arg
    tile = first_rows(tiles[ref] if kind == "input" else results[ref], rt)
    if columns is not None and tile.free_elements == cols > 1:
        return column_slice(tile, *columns)
    width = cols if columns is None else columns[1] - columns[0]
    return broadcast_columns(tile, width) if full and tile.free_elements == 1 < width else tile


def _activation_func(op) -> ActFunc:
    return ActFunc.SQUARE if op is Op.MULTIPLY or op is Op.POWER else ACTIVATIONS[op]


class _RowTile:
    """Emits the instructions of one row tile's plan (the RowwisePlan's `tile`)."""

    def __init__(self, engines, node, consts, kernel: RowwisePlan):
        self.engines, self.node, self.consts = engines, node, consts
        self.schedule, self.scalar_steps = kernel.schedule, kernel.scalar_steps

    def emit(self, j, instr, out, read, results, rt, extra, on=None):
        """The instruction(s) of step j into `out`; ALU work on engine `on`, or as the schedule places it."""
        body, engines = self.node.attrs["body"], self.engines
        if isinstance(instr, Alu2):
            a, b = read(instr.a), read(instr.b)
            c = read(instr.c) if instr.c else b
            engines.emit(Opcode.TENSOR_ALU2, out, a, b, c, alu=ALU[instr.op],
                         alu1=ALU[instr.op1] if instr.op1 else AluOp.NONE, on=on)
        elif isinstance(instr, Summed):
            row_sum = extra["tile_of"](instr.row_sum)
            results[instr.row_sum] = row_sum
            if instr.shift is None:
                bias, scale = self.consts["zero"](rt), 1.0
            elif instr.negated:
                bias, scale = read(instr.shift, full=False), -1.0
            else:
                bias, scale = extra["bias"](), 1.0
                engines.emit(Opcode.TENSOR_SCALAR, bias, read(instr.shift, full=False), alu=AluOp.MULTIPLY, imm0=-1.0,
                             on=Engine.SCALAR if self.schedule.row_steps_on_scalar else None)  # a per-row step
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, out, row_sum, read(instr.src), bias,
                             func=_activation_func(instr.act), imm0=scale)
        elif isinstance(instr, Act):
            engines.activate(Opcode.ACTIVATE, out, read(instr.src), func=ACTIVATIONS[instr.act], imm0=instr.scale,
                             imm1=instr.bias)
        elif isinstance(instr, RowSum):
            if self.schedule.row_sum_on_scalar:  # the identity values go to the scratch tile
                engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, self.consts["scratch"](rt), out, read(instr.src),
                                 self.consts["zero"](rt), func=ActFunc.IDENTITY, imm0=1.0)
            else:
                engines.emit(Opcode.TENSOR_REDUCE, out, read(instr.src), alu=AluOp.ADD)
        elif body[j].op is Op.REDUCE_LAST:
            engines.emit(Opcode.TENSOR_REDUCE, out, read(instr.args[0]), alu=REDUCTIONS[body[j].attrs["kind"]])
        else:
            args = [float(ref) if a == "imm" else read((a, ref)) for a, ref in instr.args]
            if on is None and self.schedule.row_steps_on_scalar and out.free_elements == 1 and self.scalar_steps[j]:
                on = Engine.SCALAR  # a per-row value: the Scalar engine, where the row's statistics are made
            engines.compute(body[j], out, args, self.consts["select"], self.node.loc, on=on)


def rowwise(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """A row-wise normalisation (passes/rowwise.py): for each tile of rows (a row per partition), load
    every input's whole rows once, compute the body's reductions ([rows, 1] results) and elementwise
    steps (reduced values broadcast over the row with a stride-0 read) on chip, as the fewer instructions of
    the body's `tile_plan`, and store the result once. Inputs the same for every row (a norm's weight and bias)
    are loaded once for all row tiles. The node's "schedule" (passes/rowwise_schedule.py, priced) says how:
    its row tiles in pairs (their instructions emitted interleaved, so that the engines' in-order queues
    alternate between two independent chains) or one at a time, the row sum and the per-row steps on the Scalar
    engine or not, and where the tail's columns are cut in two halves computed side by side on two engines."""
    body, views = node.attrs["body"], node.attrs["views"]
    rows, cols = node.attrs["rows"], node.attrs["cols"]
    kernel: RowwisePlan = node.attrs["plan"]
    kinds, tiles_plan = kernel.kinds, kernel.tile
    instrs, slots, count = tiles_plan.instr_of, tiles_plan.slot_of, tiles_plan.count_of
    schedule = kernel.schedule
    bufs = schedule.bufs
    parts = em.target.partitions
    wide = max([DType.F32.itemsize, node.dtype.itemsize] + [s.dtype.itemsize for s in body]) // DType.F32.itemsize
    full_temps = [em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) for _ in range(count["full"])]
    row_temps = [em.sbuf_pool(DType.F32, wide, bufs=bufs) for _ in range(count["row"])]
    biases = em.sbuf_pool(DType.F32, wide, bufs=bufs)  # the budget's spare row tile: a Summed's -shift
    zero = None
    out_pool = em.sbuf_pool(node.dtype, cols, bufs=bufs)
    constants = em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) if kernel.needs_constants else None
    engines = Balancer(em)
    scratch = None
    if any(isinstance(i, (Summed, RowSum)) for i in instrs.values()):
        zero = em.sbuf_pool(DType.F32, 1, bufs=1).next().ap(parts, 1)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, zero, imm0=0.0)
        scratch = em.sbuf_pool(DType.F32, cols * wide, bufs=1).next().ap(parts, cols)
    consts = {"zero": lambda rt: first_rows(zero, rt), "scratch": lambda rt: first_rows(scratch, rt), "select": constants}
    loaded, pools = {}, {}
    for i, (x, (offset, (sr, sc))) in enumerate(zip(node.inputs, views)):
        width = cols if sc else 1
        if sr == 0:  # the same for every row: loaded once, on every partition (below)
            loaded[i] = em.sbuf_pool(x.dtype, width, bufs=1).next().ap(parts, width)
        else:
            pools[i] = em.sbuf_pool(x.dtype, width, bufs=bufs)
    col_tiles = [em.sbuf_pool(DType.F32, cols * wide, bufs=1).next() for _ in range(count["col"])]
    results = {}  # step -> its result: the col steps once, here; the others per row tile, below

    def load_shared():
        """Load the inputs the same for every row, and compute the col steps from them."""
        for i, (x, (offset, (sr, sc))) in enumerate(zip(node.inputs, views)):
            if sr == 0:
                width = cols if sc else 1
                src = hbm(x.dtype, plan.offset(x) + offset * x.dtype.itemsize, ((0, parts), (sc or 1, width)))
                dma_by_rows(em, loaded[i], src, _pieces(em, loaded[i], True))
        for j, instr in instrs.items():
            if kinds[j] == "col":
                out = col_tiles[slots[j]].ap(parts, cols, dtype=body[j].dtype)
                args = [float(ref) if a == "imm" else loaded[ref] if a == "input" else results[ref]
                        for a, ref in instr.args]
                engines.compute(body[j], out, args, constants, node.loc)
                results[j] = out

    sr_out, sc_out = node.attrs["out_strides"]
    emitter = _RowTile(engines, node, consts, kernel)
    tail = kernel.tail
    halves = [(0, schedule.cut), (schedule.cut, cols)]  # the tail's columns, side by side on two engines

    def load(r0, first):
        """Issue the loads of the row tile at r0 (of the first group: every queue at once): its input tiles."""
        rt = min(parts, rows - r0)
        tiles = {}
        for i, x in enumerate(node.inputs):
            offset, (sr, sc) = views[i]
            width = cols if sc else 1
            if i in pools:
                tiles[i] = pools[i].next().ap(rt, width)
                src = hbm(x.dtype, plan.offset(x) + (offset + r0 * sr) * x.dtype.itemsize, ((sr, rt), (sc or 1, width)))
                dma_by_rows(em, tiles[i], src, _pieces(em, tiles[i], first))
            else:
                tiles[i] = first_rows(loaded[i], rt)
        return tiles

    def compute(r0, tiles, last):
        """The instructions of the row tile at r0 and its store, one at a time (a generator: see below)."""
        rt = min(parts, rows - r0)
        full = [pool.next() for pool in full_temps]
        per_row = [pool.next() for pool in row_temps]
        out_tile = out_pool.next()
        results_here = dict(results)

        def tile_of(j):
            width = cols if kinds[j] == "full" else 1
            if j == tiles_plan.out_step:
                return out_tile.ap(rt, width)
            if slots.get(j) == OUT_SLOT:
                return out_tile.ap(rt, width, dtype=body[j].dtype)
            if j not in slots:
                return dataclasses.replace(first_rows(scratch, rt), dtype=body[j].dtype)  # nothing reads it
            return (full if kinds[j] == "full" else per_row)[slots[j]].ap(rt, width, dtype=body[j].dtype)

        extra = {"tile_of": tile_of, "bias": lambda: biases.next().ap(rt, 1)}
        for j, instr in instrs.items():
            if kinds[j] == "col" or j in tail:
                continue
            out = tile_of(j)
            full_row = kinds[j] == "full"
            emitter.emit(j, instr, out,
                         lambda arg, full=full_row: _tile_arg(arg, tiles, results_here, rt, cols, full),
                         results_here, rt, extra)
            results_here[j] = out
            yield
        for j in tail:
            results_here[j] = tile_of(j)
        for (c0, c1), on in zip(halves if tail else (), kernel.split_engines):
            for j in tail:
                emitter.emit(j, instrs[j], column_slice(results_here[j], c0, c1),
                             lambda arg: _tile_arg(arg, tiles, results_here, rt, cols, True, (c0, c1)),
                             results_here, rt, extra, on)
                yield
        dst = hbm(node.dtype, plan.offset(node) + r0 * sr_out * node.dtype.itemsize, ((sr_out, rt), (sc_out, cols)))
        out = results_here[tiles_plan.out_step]
        if sc_out == 1:
            dma_by_rows(em, dst, out, _pieces(em, out, last))
        else:  # stored transposed (passes/layout.py)
            dma_by_columns(em, dst, out, transposed_store_pieces(out.num_elements * out.dtype.itemsize, em.target))

    # Groups of `together` row tiles: the next group's loads go ahead of this group's steps and stores on the
    # DMA queues; within a group the tiles' instructions are emitted in turn.
    together = schedule.together
    depth = bufs // together - 1  # groups loaded ahead of the one computed
    starts = list(range(0, rows, parts))
    groups = [starts[g:g + together] for g in range(0, len(starts), together)]
    first = min(depth, schedule.shared_after)  # groups loaded before the shared inputs: the first steps do not read them
    ahead = [[load(r0, n == 0) for r0 in group] for n, group in enumerate(groups[:first])]
    load_shared()
    ahead += [[load(r0, False) for r0 in group] for group in groups[first:depth]]
    for n, group in enumerate(groups):
        if n + depth < len(groups):
            ahead.append([load(r0, False) for r0 in groups[n + depth]])
        tiles = ahead.pop(0)
        chains = [compute(r0, t, n == len(groups) - 1) for r0, t in zip(group, tiles)]
        while chains:
            chains = [chain for chain in chains if next(chain, StopIteration) is not StopIteration]
