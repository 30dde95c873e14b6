"""Row-wise kernels: reductions over the last axis and fused normalisations (softmax, layer-norm, RMS-norm),
one row tile per 128 partitions, row tiles computed in pairs when SBUF holds both."""
from __future__ import annotations

import dataclasses

from neuronc.codegen.access import (HbmTensor, broadcast_columns, column_slice, dma_by_columns, dma_by_rows,
                                    first_rows, tile_at)
from neuronc.codegen.elementwise import ACTIVATIONS, ALU, REDUCTIONS, Balancer, emit_body
from neuronc.codegen.emitter import Emitter
from neuronc.codegen.partition_sum import partition_sum
from neuronc.instruction_cost import table_of
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode
from neuronc.ir import Node, Op
from neuronc.placement import dma_pieces, transposed_store_pieces
from neuronc.plans import (OUT_SLOT, Act, Alu2, BnStats, MemoryPlan, PartitionSumPlan, Plain, ReducePlan, RowSum, Summed,
                           View)


def reduce_last(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    """out[r] = reduce(x[r, :]) (its ReducePlan): rows on partitions, columns reduced along the free axis in chunks.

    x is the operand itself, or (after fusion) computed per tile by a prologue body from inputs
    read through their [R, C] views. The reductions of `store_tiles` row tiles are stored by one DMA. A chunk's load is cut by partitions over several DMA queues (as a row-wise
    kernel's); an input with one value per row (a column stride of 0: a mean the prologue subtracts) is loaded
    once per row tile as a [rows, 1] column and read broadcast along the free axis, not as a chunk of copies.
    A plan with `on_scalar` sums each chunk by one ACTIVATE_BIAS_REDUCE instead of the prologue and a TENSOR_REDUCE."""
    plan: ReducePlan = node.attrs["plan"]
    if isinstance(plan, PartitionSumPlan):  # a sum over the outer axis of the input's memory
        partition_sum(em, node, memory)
        return
    alu, body, chunk = REDUCTIONS[plan.kind], plan.prologue, plan.chunk
    pools = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in plan.pools}
    temps = [pools[f"temp{t}"] for t in range(len({slot for slot in plan.slots if slot is not None}))]
    inputs = [HbmTensor.of(memory, x, view, (plan.rows, plan.cols)) for x, view in zip(node.inputs, plan.views)]
    out = HbmTensor.of(memory, node, shape=(plan.rows,))
    per_row = {i for i, view in enumerate(plan.views) if view.strides[1] == 0 and plan.cols > 1}
    parts, results, first = em.target.partitions, None, 0
    zero = pools["zero"].next().ap(parts, 1) if "zero" in pools else None
    if zero is not None:
        em.emit(Opcode.MEMSET, Engine.GPSIMD, zero, imm0=0.0)
    for r0 in range(0, plan.rows, parts):
        rt = min(em.target.partitions, plan.rows - r0)
        acc = pools["accs"].next().ap(rt, 1)
        columns = {}
        for i in sorted(per_row):
            columns[i] = pools[f"input{i}"].next().ap(rt, 1)
            em.dma(columns[i], inputs[i][r0:r0 + rt, 0].column.ap)
        for c0 in range(0, plan.cols, chunk):
            ct = min(chunk, plan.cols - c0)
            loaded = {}
            for i, x in enumerate(inputs):
                if i in per_row:
                    loaded[i] = broadcast_columns(columns[i], ct)
                    continue
                loaded[i] = pools[f"input{i}"].next().ap(rt, ct)
                dma_by_rows(em, loaded[i], x[r0:r0 + rt, c0:c0 + ct].ap, _pieces(em, loaded[i], r0 == 0 and c0 == 0))
            part = acc if c0 == 0 else pools["partials"].next().ap(rt, 1)
            if plan.on_scalar is not None:
                _sum_on_scalar(em, plan.on_scalar, part, pools, loaded, columns, zero, (rt, ct))
            else:
                tile = loaded[0] if not body else emit_body(
                    em, body, plan.slots, loaded, [pool.next() for pool in temps], pools["body_out"].next(), (rt, ct),
                    pools["constants"], node.loc)
                em.emit(Opcode.TENSOR_REDUCE, Engine.VECTOR, part, tile, alu=alu)
            if c0:
                em.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, acc, acc, part, alu=alu)
        t = r0 // parts
        if t % plan.store_tiles == 0:
            results, first = pools["outs"].next(), t
        if plan.epilogue:  # the per-row steps of the reduction's reader, on its fp32 result (reduction_epilogues)
            acc = emit_body(em, plan.epilogue, plan.epilogue_slots, {0: acc},
                            [pools[f"etemp{i}"].next() for i in range(len(set(plan.epilogue_slots) - {None}))],
                            pools["eout"].next(), (rt, 1), None, node.loc)
        em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, tile_at(results.ap(parts, plan.store_tiles), t - first, rt, 1), acc)
        if t - first + 1 == plan.store_tiles or r0 + rt == plan.rows:
            _store_row_tiles(em, out, results.ap(parts, plan.store_tiles), first, t + 1, plan.rows)


def _sum_on_scalar(em: Emitter, instr, row_sum: AccessPattern, pools: dict, loaded: dict, columns: dict,
                   zero: AccessPattern | None, shape: tuple) -> None:
    """A chunk's prologue and sum as one ACTIVATE_BIAS_REDUCE (the plan's `on_scalar`, a RowSum or a Summed over
    inputs) into `row_sum`: func(scale * x + bias), x the loaded chunk (widened as it is read), the bias 0 or the
    per-row input (`columns`) as the row-wise kernels' Summed takes it; the activation values go to a scratch
    tile, nothing reads them."""
    rt, ct = shape
    func, scale, bias = ActFunc.IDENTITY, 1.0, None
    if isinstance(instr, Summed):
        func = _activation_func(instr.act)
        if instr.shift is not None:
            shift = columns[instr.shift[1]]
            if instr.negated:
                bias, scale = shift, -1.0
            else:
                bias = pools["bias"].next().ap(rt, 1)
                em.emit(Opcode.TENSOR_SCALAR, Engine.SCALAR, bias, shift, alu=AluOp.MULTIPLY, imm0=-1.0)
    em.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, pools["body_out"].next().ap(rt, ct), row_sum,
            loaded[instr.src[1]], first_rows(zero, rt) if bias is None else bias, func=func, imm0=scale)


def _store_row_tiles(em: Emitter, out: HbmTensor, results: AccessPattern, first: int, end: int, rows: int) -> None:
    """Store the reductions of row tiles [first, end), held side by side in `results` (tile t's [rows, 1] in
    column t - first), each tile's by a DMA of its own on the next queue: a few bytes per partition move far below
    a queue's rate, so the transfers run side by side (cut by columns, each writes output rows of its own)."""
    parts = em.target.partitions
    whole = min(end, rows // parts) - first
    if whole > 0:
        dma_by_columns(em, out[first * parts:(first + whole) * parts].tiled(parts).ap, tile_at(results, 0, parts, whole),
                       whole)
    if end * parts > rows:
        r0 = (end - 1) * parts
        em.dma(out[r0:rows].column.ap, tile_at(results, end - 1 - first, rows - r0, 1))


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


def rowwise(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    """A row-wise normalisation (passes/rowwise.py): for each tile of rows (a row per partition), load
    every input's whole rows once, compute the body's reductions ([rows, 1] results) and elementwise
    steps (reduced values broadcast over the row with a stride-0 read) on chip, as the fewer instructions of
    the plan's row tile, and store the result once. Inputs the same for every row (a norm's weight and bias)
    are loaded once for all row tiles. The plan's schedule (passes/rowwise_schedule.py, priced) says how:
    its row tiles in pairs (their instructions emitted interleaved, so that the engines' in-order queues
    alternate between two independent chains) or one at a time, the row sum and the per-row steps on the Scalar
    engine or not, and where the tail's columns are cut in two halves computed side by side on two engines."""
    compute_row_tiles(Rowwise(em, node, memory))


def compute_row_tiles(kernel: "Rowwise") -> None:
    """Every row tile of `kernel`, as its plan's schedule orders them (each stored by `kernel.store`)."""
    for _ in row_tile_groups(kernel):
        pass


def row_tile_groups(kernel: "Rowwise"):
    """The row tiles of `kernel` computed group by group as its plan's schedule orders them: a generator yielding
    the first rows of each group's tiles once their instructions (and stores) are emitted, so that a caller can
    emit other work between groups (a matmul's prologue: the matmuls of the rows made so far)."""
    em = kernel.em
    # Groups of `together` row tiles: the next group's loads go ahead of this group's steps and stores on the
    # DMA queues; within a group the tiles' instructions are emitted in turn.
    schedule = kernel.plan.schedule
    together = schedule.together
    depth = schedule.bufs // together - 1  # groups loaded ahead of the one computed
    starts = list(range(0, kernel.rows, em.target.partitions))
    groups = [starts[g:g + together] for g in range(0, len(starts), together)]
    first = min(depth, schedule.shared_after)  # groups loaded before the shared inputs: the first steps do not read them
    ahead = [[kernel.load(r0, n == 0) for r0 in group] for n, group in enumerate(groups[:first])]
    kernel.load_shared()
    ahead += [[kernel.load(r0, False) for r0 in group] for group in groups[first:depth]]
    for n, group in enumerate(groups):
        if n + depth < len(groups):
            ahead.append([kernel.load(r0, False) for r0 in groups[n + depth]])
        tiles = ahead.pop(0)
        chains = [kernel.compute(r0, t, n == len(groups) - 1) for r0, t in zip(group, tiles)]
        while chains:
            chains = [chain for chain in chains if next(chain, StopIteration) is not StopIteration]
        yield group


@dataclasses.dataclass
class _RowTileState:
    """One row tile being computed: its rows, its loaded inputs, its tiles, and the values its steps made."""

    r0: int
    rt: int
    tiles: dict  # input -> its tile (rows r0..r0+rt)
    full: list  # the full-row temporaries' tiles
    per_row: list  # the per-row temporaries' tiles
    out_tile: object  # the output tile's slot
    results: dict  # step -> its value


class Rowwise:
    """One ROWWISE kernel's instructions (its RowwisePlan): the pools and constant tiles its row tiles share,
    the inputs in HBM, and a method per phase (the shared inputs, a row tile's loads, its steps and store)."""

    def __init__(self, em: Emitter, node: Node, memory: MemoryPlan, sink=None, shared_loads=None):
        self.em, self.node, self.sink = em, node, sink
        self.shared_loads = shared_loads  # a caller's own loads, emitted where the shared inputs' are (a prologue's)
        plan = self.plan = node.attrs["plan"]
        self.body, self.kinds = node.attrs["body"], plan.kinds
        self.rows, self.cols = rows, cols = node.attrs["rows"], node.attrs["cols"]
        self.instrs, self.slots, count = plan.tile.instr_of, plan.tile.slot_of, plan.tile.count_of
        bufs, parts = plan.schedule.bufs, em.target.partitions
        wide = max([DType.F32.itemsize, node.dtype.itemsize] + [s.dtype.itemsize for s in self.body]) // DType.F32.itemsize
        self.full_temps = [em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) for _ in range(count["full"])]
        self.row_temps = [em.sbuf_pool(DType.F32, wide, bufs=bufs) for _ in range(count["row"])]
        self.biases = em.sbuf_pool(DType.F32, wide, bufs=bufs)  # the budget's spare row tile: a Summed's -shift
        self.out_pool = em.sbuf_pool(node.dtype, cols, bufs=bufs)
        self.constants = em.sbuf_pool(DType.F32, cols * wide, bufs=bufs) if plan.needs_constants else None
        self.engines = Balancer(em)
        self.bn_chunks = BnStats.chunks(cols, em.target.bn_stats_max_free)
        self.bn_stats = em.sbuf_pool(DType.F32, 6 * len(self.bn_chunks) + 2, bufs=bufs) if any(
            isinstance(i, BnStats) for i in self.instrs.values()) else None  # the chunks' statistics, then BN_AGGR's
        self.zero = self.scratch = None
        if any(isinstance(i, (Summed, RowSum, BnStats)) for i in self.instrs.values()):
            self.zero = em.sbuf_pool(DType.F32, 1, bufs=1).next().ap(parts, 1)
            em.emit(Opcode.MEMSET, Engine.GPSIMD, self.zero, imm0=0.0)
            self.scratch = em.sbuf_pool(DType.F32, cols * wide, bufs=1).next().ap(parts, cols)
        self.preload_table()
        # the inputs in HBM as [rows, cols] (a column stride of 0: one value per row; a row stride of 0: the same
        # for every row, loaded once on every partition), and their tiles
        self.inputs = [HbmTensor.of(memory, x, View(offset, tuple(strides)), (rows, cols))
                       for x, (offset, strides) in zip(node.inputs, node.attrs["views"])]
        self.shared, self.pools = {}, {}
        for i, (x, tensor) in enumerate(zip(node.inputs, self.inputs)):
            (sr, _), width = tensor.dims[0], self.width(tensor)
            if sr == 0:
                self.shared[i] = em.sbuf_pool(x.dtype, width, bufs=1).next().ap(parts, width)
            else:
                self.pools[i] = em.sbuf_pool(x.dtype, width, bufs=bufs)
        self.col_tiles = [em.sbuf_pool(DType.F32, cols * wide, bufs=1).next() for _ in range(count["col"])]
        self.results = {}  # step -> its result: the col steps, made once for all row tiles
        self.out = None if sink is not None else HbmTensor.of(memory, node, View(0, tuple(node.attrs["out_strides"])),
                                                               (rows, cols))
        self.sums = [_ColumnSums(em, node, memory, j, k) for k, j in enumerate(plan.sums, 1)]

    def first_table(self) -> ActFunc | None:
        """The first activation function of a row tile's instructions that needs a table loaded in the Scalar engine
        (instruction_cost.table_of), or None."""
        for j, instr in self.instrs.items():
            func = (ACTIVATIONS[instr.act] if isinstance(instr, Act) else _activation_func(instr.act)
                    if isinstance(instr, Summed) else ACTIVATIONS.get(self.body[j].op) if isinstance(instr, Plain)
                    and "bias" not in self.body[j].attrs else None)
            if func is not None and self.kinds[j] != "col" and table_of(func) is not None:
                return func
        return None

    def preload_table(self) -> None:
        """That table loaded at the kernel's start, while the first row tile loads: an ACTIVATE of it on a [p, 1]
        tile of ones (so the first row tile's activation does not wait for the load on its chain)."""
        func = self.first_table()
        if func is None:
            return
        tile = self.em.sbuf_pool(DType.F32, 2, bufs=1).next().ap(self.em.target.partitions, 2)
        self.engines.emit(Opcode.MEMSET, column_slice(tile, 0, 1), imm0=1.0, on=Engine.SCALAR)
        self.engines.activate(Opcode.ACTIVATE, column_slice(tile, 1, 2), column_slice(tile, 0, 1), func=func, imm0=1.0)

    def width(self, tensor: HbmTensor) -> int:
        """The columns of an input's tile: all of them, or one for a value per row."""
        return self.cols if tensor.dims[1][0] else 1

    def rows_of(self, tensor: HbmTensor, r0: int, rt: int) -> AccessPattern:
        """Rows [r0, r0 + rt) of an input in HBM ([rt, 1] for a value per row)."""
        return tensor[r0:r0 + rt].ap if tensor.dims[1][0] else tensor[r0:r0 + rt, 0].column.ap

    # loads --------------------------------------------------------------------------------------------
    def load_shared(self) -> None:
        """Load the inputs the same for every row, and compute the col steps from them."""
        em, parts = self.em, self.em.target.partitions
        if self.shared_loads is not None:
            self.shared_loads()
        for i, tile in self.shared.items():
            dma_by_rows(em, tile, self.rows_of(self.inputs[i], 0, parts), _pieces(em, tile, True))
        for j, instr in self.instrs.items():
            if self.kinds[j] == "col":
                out = self.col_tiles[self.slots[j]].ap(parts, self.cols, dtype=self.body[j].dtype)
                args = [float(ref) if a == "imm" else self.shared[ref] if a == "input" else self.results[ref]
                        for a, ref in instr.args]
                self.engines.compute(self.body[j], out, args, self.constants, self.node.loc)
                self.results[j] = out

    def load(self, r0: int, first: bool) -> dict:
        """Issue the loads of the row tile at r0 (of the first group: every queue at once): its input tiles."""
        rt = min(self.em.target.partitions, self.rows - r0)
        tiles = {}
        for i, tensor in enumerate(self.inputs):
            if i in self.pools:
                tiles[i] = self.pools[i].next().ap(rt, self.width(tensor))
                dma_by_rows(self.em, tiles[i], self.rows_of(tensor, r0, rt), _pieces(self.em, tiles[i], first))
            else:
                tiles[i] = first_rows(self.shared[i], rt)
        return tiles

    # a row tile's steps -------------------------------------------------------------------------------
    def compute(self, r0: int, tiles: dict, last: bool):
        """The instructions of the row tile at r0 and its store, one at a time (a generator: `rowwise` interleaves
        the row tiles of a group)."""
        rt = min(self.em.target.partitions, self.rows - r0)
        state = _RowTileState(r0, rt, tiles, [pool.next() for pool in self.full_temps],
                              [pool.next() for pool in self.row_temps], self.out_pool.next(), dict(self.results))
        tail, kinds = self.plan.tail, self.kinds
        for j, instr in self.instrs.items():
            if kinds[j] == "col" or j in tail:
                continue
            out = self.tile_of(state, j)
            made = self.emit_step(state, j, instr, out, full=kinds[j] == "full")
            state.results[j] = out if made is None else made
            yield
        for j in tail:
            state.results[j] = self.tile_of(state, j)
        halves = [(0, self.plan.schedule.cut), (self.plan.schedule.cut, self.cols)]  # side by side on two engines
        for columns, on in zip(halves if tail else (), self.plan.split_engines):
            for j in tail:
                self.emit_step(state, j, self.instrs[j], column_slice(state.results[j], *columns), full=True,
                               columns=columns, on=on)
                yield
        for sums in self.sums:
            sums.add(state.results[sums.step], state.r0, state.rt, self.rows)
        self.store(state, last)

    def tile_of(self, state: _RowTileState, j: int) -> AccessPattern:
        """Where step j's value goes in the row tile: the output tile, a temporary, or the scratch tile."""
        body, kinds, slots = self.body, self.kinds, self.slots
        width = self.cols if kinds[j] == "full" else 1
        if j == self.plan.tile.out_step:
            return state.out_tile.ap(state.rt, width)
        if slots.get(j) == OUT_SLOT:
            return state.out_tile.ap(state.rt, width, dtype=body[j].dtype)
        if j not in slots:
            return dataclasses.replace(first_rows(self.scratch, state.rt), dtype=body[j].dtype)  # nothing reads it
        return (state.full if kinds[j] == "full" else state.per_row)[slots[j]].ap(state.rt, width, dtype=body[j].dtype)

    def emit_step(self, state: _RowTileState, j: int, instr, out: AccessPattern, *, full: bool,
                  columns: tuple | None = None, on: Engine | None = None) -> AccessPattern | None:
        """The instruction(s) of step j into `out` (its columns `columns` of a cut tail); ALU work on engine `on`,
        or as the schedule places it. `full`: the step is over full rows (per-row values it reads are broadcast).
        Returns where the step's value is instead, when not in `out` (a BnStats' mean, beside its variance)."""
        engines, schedule, rt = self.engines, self.plan.schedule, state.rt

        def read(arg, full: bool = full):
            return _tile_arg(arg, state.tiles, state.results, rt, self.cols, full, columns)

        if isinstance(instr, Alu2):
            a, b = read(instr.a), read(instr.b)
            c = read(instr.c) if instr.c else b
            engines.emit(Opcode.TENSOR_ALU2, out, a, b, c, alu=ALU[instr.op],
                         alu1=ALU[instr.op1] if instr.op1 else AluOp.NONE, on=on)
        elif isinstance(instr, Summed):
            row_sum = self.tile_of(state, instr.row_sum)
            state.results[instr.row_sum] = row_sum
            if instr.shift is None:
                bias, scale = first_rows(self.zero, rt), 1.0
            elif instr.negated:
                bias, scale = read(instr.shift, full=False), -1.0
            else:
                bias, scale = self.biases.next().ap(rt, 1), 1.0
                engines.emit(Opcode.TENSOR_SCALAR, bias, read(instr.shift, full=False), alu=AluOp.MULTIPLY, imm0=-1.0,
                             on=Engine.SCALAR if schedule.row_steps_on_scalar else None)  # a per-row step
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, out, row_sum, read(instr.src), bias,
                             func=_activation_func(instr.act), imm0=scale)
        elif isinstance(instr, BnStats):
            stats, k = self.bn_stats.next().ap(rt, 6 * len(self.bn_chunks) + 2), 6 * len(self.bn_chunks)
            src = read(instr.src, full=True)
            mean, var = column_slice(stats, k, k + 1), column_slice(stats, k + 1, k + 2)
            state.results[instr.var] = var
            if state.r0 // self.em.target.partitions < schedule.bn_tiles:
                # one BN_STATS a chunk, each on the less loaded ALU engine, then BN_AGGR
                for i, (c0, c1) in enumerate(self.bn_chunks):
                    engines.emit(Opcode.BN_STATS, column_slice(stats, 6 * i, 6 * i + 6), column_slice(src, c0, c1),
                                 on=on)
                engines.emit(Opcode.BN_AGGR, column_slice(stats, k, k + 2), column_slice(stats, 0, k), on=on)
                return mean
            # as the steps it stands for: the row sum, the mean, the squares of (mean - x) summed, the variance
            total, squares = column_slice(stats, 0, 1), column_slice(stats, 1, 2)
            if schedule.row_sum_on_scalar:
                engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, first_rows(self.scratch, rt), total, src,
                                 first_rows(self.zero, rt), func=ActFunc.IDENTITY, imm0=1.0)
            else:
                engines.emit(Opcode.TENSOR_REDUCE, total, src, alu=AluOp.ADD)
            row_on = Engine.SCALAR if schedule.row_steps_on_scalar else None
            self.engines.compute(self.body[j], mean, [total, float(self.cols)], self.constants, self.node.loc,
                                 on=row_on if self.plan.scalar_steps[j] else None)
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, first_rows(self.scratch, rt), squares, src, mean,
                             func=ActFunc.SQUARE, imm0=-1.0)
            self.engines.compute(self.body[instr.var], var, [squares, float(self.cols)], self.constants,
                                 self.node.loc, on=row_on if self.plan.scalar_steps[instr.var] else None)
            return mean
        elif isinstance(instr, Act):
            engines.activate(Opcode.ACTIVATE, out, read(instr.src), func=ACTIVATIONS[instr.act], imm0=instr.scale,
                             imm1=instr.bias)
        elif isinstance(instr, RowSum):
            if schedule.row_sum_on_scalar:  # the identity values go to the scratch tile
                engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, first_rows(self.scratch, rt), out, read(instr.src),
                                 first_rows(self.zero, rt), func=ActFunc.IDENTITY, imm0=1.0)
            else:
                engines.emit(Opcode.TENSOR_REDUCE, out, read(instr.src), alu=AluOp.ADD)
        elif self.body[j].op is Op.REDUCE_LAST:
            engines.emit(Opcode.TENSOR_REDUCE, out, read(instr.args[0]), alu=REDUCTIONS[self.body[j].attrs["kind"]])
        else:
            args = [float(ref) if a == "imm" else read((a, ref)) for a, ref in instr.args]
            if on is None and schedule.row_steps_on_scalar and out.free_elements == 1 and self.plan.scalar_steps[j]:
                on = Engine.SCALAR  # a per-row value: the Scalar engine, where the row's statistics are made
            engines.compute(self.body[j], out, args, self.constants, self.node.loc, on=on)

    def store(self, state: _RowTileState, last: bool) -> None:
        """The row tile's result stored, by rows over several queues, or by columns when stored transposed; or
        handed to `sink(r0, tile)` (a matmul's prologue: it stays on chip)."""
        out = state.results[self.plan.tile.out_step]
        if self.sink is not None:
            self.sink(state.r0, out)
            return
        dst = self.out[state.r0:state.r0 + state.rt].ap
        if self.out.dims[1][0] == 1:
            dma_by_rows(self.em, dst, out, _pieces(self.em, out, last))
        else:  # stored transposed (passes/layout.py)
            dma_by_columns(self.em, dst, out, transposed_store_pieces(out.num_elements * out.dtype.itemsize, self.em.target))


class _ColumnSums:
    """A step's values summed over the kernel's rows, its k-th output (RowwisePlan.sums): ones[rt, 1]^T @ each row
    tile's value, a PSUM bank of `sum_bank` columns a matmul, accumulated over the row tiles in order; after the
    last, rounded once into the output's dtype on the way out of PSUM (Vector and Scalar in turn) and stored as one
    row. The matmuls, tiles, order and rounding of a sum over tokens' own kernel (codegen/partition_sum.py)."""

    def __init__(self, em: Emitter, node: Node, memory: MemoryPlan, step: int, k: int):
        plan, cols, parts = node.attrs["plan"], node.attrs["cols"], em.target.partitions
        self.em, self.step, self.cols = em, step, cols
        shape, dtype = node.attrs["outputs"][k]
        self.banks = [(c0, min(c0 + plan.sum_bank, cols)) for c0 in range(0, cols, plan.sum_bank)]
        self.ones = em.sbuf_pool(node.attrs["body"][step].dtype, 1, bufs=1).next().ap(parts, 1)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, self.ones, imm0=1.0)
        self.sums = em.sbuf_pool(dtype, cols, bufs=1).next().ap(1, cols)
        psum = em.psum_pool(bufs=len(self.banks))
        self.accs = [psum.next().ap(1, c1 - c0) for c0, c1 in self.banks]
        self.out = HbmTensor(dtype, memory.placement[(node, k)].offset, ((1, cols),))

    def add(self, tile: AccessPattern, r0: int, rt: int, rows: int) -> None:
        """The row tile at r0 ([rt, cols], the step's value) summed into the accumulators; stored after the last."""
        em = self.em
        for acc, (c0, c1) in zip(self.accs, self.banks):
            em.emit(Opcode.MATMUL, Engine.TENSOR, acc, first_rows(self.ones, rt), column_slice(tile, c0, c1),
                    accumulate=r0 > 0)
        if r0 + rt == rows:
            for turn, (acc, (c0, c1)) in enumerate(zip(self.accs, self.banks)):
                em.emit(Opcode.TENSOR_COPY, (Engine.VECTOR, Engine.SCALAR)[turn % 2], column_slice(self.sums, c0, c1),
                        acc)
            em.dma(self.out[0:self.cols].broadcast_rows(1).ap, self.sums)
