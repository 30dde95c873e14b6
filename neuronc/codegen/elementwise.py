"""Element-wise kernels and the tile helpers every kernel shares: a fused chain of element-wise ops
computed tile by tile, steps spread over the Vector/Scalar/GpSimd engines, and the data-movement kernels
(strided view copies, bitcasts, fills, pads, concatenation) that need no arithmetic."""
from __future__ import annotations

import dataclasses
import functools

from neuronc import ir, op_facts
from neuronc.codegen.access import HbmTensor, column_slice, dma_by_rows, row_slice
from neuronc.codegen.blocks import blocks
from neuronc.codegen.emitter import Emitter, Pool, Tile, hbm
from neuronc.errors import NeuronCompileError
from neuronc.instruction_cost import (dependent_gap_ns, engine_pass_ns, instruction_cost_ns, perf_mode_operands,
                                      perf_mode_speedup, reads_written, step_costs, table_load_ns, table_of)
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space
from neuronc.ir import Node, Op
from neuronc.placement import tile_free_elements
from neuronc.neff.program import DebugLoc
from neuronc.plans import CONSTANT_COLUMNS, ElementwisePlan, MemoryPlan, concatenated_pieces, dense_strides


# How each elementwise op is computed (the op-facts table, neuronc/op_facts.py): by one Scalar-engine function,
# by one ALU op, or (COMPARE) by the ALU op of its direction; reductions by the ALU op of their kind.
ACTIVATIONS = {op: ir.facts(op).activation for op in Op if ir.facts(op).activation is not None}
ALU = {op: ir.facts(op).alu for op in Op if ir.facts(op).alu is not None}
COMPARISONS = op_facts.COMPARISONS
REDUCTIONS = {kind: r.alu for kind, r in op_facts.REDUCTIONS.items() if r.alu is not None}


def elementwise(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    """One or many fused elementwise ops (its ElementwisePlan): load each input tile once (through its strided
    view, if the fusion pass folded one in), compute every step of the body in SBUF, store the result."""
    plan: ElementwisePlan = node.attrs["plan"]
    pools = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in plan.pools}
    temps = [pools[f"temp{t}"] for t in range(len({slot for slot in plan.slots if slot is not None}))]
    tensors = [HbmTensor(x.dtype, memory.offset(x), ()) for x in (node, *(node.inputs[i] for i in plan.inputs))]

    def load(block) -> dict:
        loaded = {}
        for k, i in enumerate(plan.inputs, start=1):
            (stride, _), *free = block.dims[k]
            if block.free_elements > 1 and not any(s for s, _ in free):
                # one value per partition, repeated along the free axes (a row's mean): loaded once per
                # partition and read with stride 0, not moved as copies
                column = pools[f"input{i}"].next().ap(block.partitions, 1)
                dma_by_rows(em, column, tensors[k].block(block.offsets[k], ((stride, block.partitions), (1, 1))))
                loaded[i] = dataclasses.replace(column, dims=(column.dims[0], *((0, n) for n in block.free)))
                continue
            loaded[i] = pools[f"input{i}"].next().ap(block.partitions, *block.free)
            dma_by_rows(em, loaded[i], tensors[k].block(block.offsets[k], block.dims[k]))
        return loaded

    def first_steps(block, loaded) -> tuple:
        """(the block's steps, its result): emitted up to its first step on the Scalar engine, the result None
        until all are (`_finished`)."""
        steps = emit_steps(em, plan.body, plan.slots, loaded, [pool.next() for pool in temps], pools["out"].next(),
                           (block.partitions, *block.free), pools.get("constants"), node.loc)
        mark = len(em.instructions)
        while not any(inst.engine is Engine.SCALAR for inst in em.instructions[mark:]):
            try:
                next(steps)
            except StopIteration as done:  # no step on Scalar: the block is done
                return steps, done.value
        return steps, None

    # The next block's loads are issued before this block's store: on the in-order DMA queues they would
    # otherwise wait behind the store, which waits for this block's steps (the input pools hold three blocks).
    # A block with a step on the Scalar engine (an activation) is finished after the next block's first steps,
    # up to its own: the in-order Vector engine works on them while Scalar computes this block's activation,
    # instead of waiting for it (a software pipeline; every pool holds two blocks, or blocks go one by one).
    cut = list(blocks(node.shape, [view.strides for view in plan.views], plan.free, em.target.partitions,
                      [view.offset for view in plan.views]))
    two_in_flight = all(p.bufs >= 2 for p in plan.pools)
    loads_ahead = 2 if two_in_flight and all(p.bufs >= 3 for p in plan.pools if p.name.startswith("input")) else 1
    loaded: list = []  # per block loaded so far, its input tiles

    def load_until(stop: int) -> None:
        while len(loaded) < min(stop, len(cut)):
            loaded.append(load(cut[len(loaded)]))

    load_until(1)
    steps, out = first_steps(cut[0], loaded[0]) if cut else (None, None)
    for n, block in enumerate(cut):
        following = None
        if n + 1 < len(cut):
            pipelined = out is None and two_in_flight
            load_until(n + 1 + (loads_ahead if pipelined else 1))  # the one after the next: stores wait longer
            if pipelined:
                following = first_steps(cut[n + 1], loaded[n + 1])
        out = out if out is not None else _finished(steps)
        dma_by_rows(em, tensors[0].block(block.offsets[0], block.dims[0]), out)
        if n + 1 < len(cut):
            steps, out = following or first_steps(cut[n + 1], loaded[n + 1])


def emit_body(em: Emitter, body: tuple, slots: list, loaded: dict, temp_tiles: list, out_tile: Tile, shape: tuple,
              constants: Pool | None, loc: DebugLoc, engines: "StepBalancer | None" = None) -> AccessPattern:
    """The steps of `body` emitted (`emit_steps`); returns the AP of the last one's result."""
    return _finished(emit_steps(em, body, slots, loaded, temp_tiles, out_tile, shape, constants, loc, engines))


def _finished(steps) -> AccessPattern:
    """The rest of an `emit_steps` generator emitted; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def emit_steps(em: Emitter, body: tuple, slots: list, loaded: dict, temp_tiles: list, out_tile: Tile, shape: tuple,
               constants: Pool | None, loc: DebugLoc, engines: "StepBalancer | None" = None):
    """A generator emitting `body`'s steps, pausing after each one computed (a caller may emit other work between
    them). Computes each step of `body` on tiles of `shape`: inputs from `loaded` (input index -> AP),
    intermediates in their temporary slots, the last step into `out_tile`; returns (as StopIteration's value) the
    AP of the last one's result. With `engines`, each
    step goes to the engine that would finish it first (StepBalancer), else to the Vector engine.

    A step read by one step alone may wait for its reader (`_Deferred`): two steps each of a tile and a held
    column, the second reading the first's fp32 value, are one TENSOR_ALU2 (`_held_pair`: the layer-norm
    backward's `(x - mean) * rstd`), and such a step reads a float input widened to fp32 as the input itself (the
    instruction widens it as it reads it); either is computed on its own otherwise, when its reader comes."""
    results, made = [], {}
    reads = step_reads(body)
    deferred: dict = {}  # step -> _Deferred

    def compute(step, out, args, steps):  # `steps`: the body's steps it computes; returns when it is done
        if engines is None:
            compute_step(em, step, out, args, constants, loc)
            return 0.0
        ready = max([made.get(ref, 0.0) for j in steps for ref in reads[j]], default=0.0)
        return engines.compute(step, out, args, constants, loc, ready)

    def settle(step, args: list, steps: list) -> list:
        """`args` with each deferred widening that `step` reads as its held tile replaced by the input; any
        other deferred step's value computed now."""
        held = args[0] if "then" in step.attrs else (_held_column(step, args) or (None,))[0]
        settled, widened = [], {}  # id of a deferred widening's tile -> the input read instead (x * x reads it twice)
        for a in args:
            later = next((j for j, d in deferred.items() if d.out is a), None)
            if later is not None:
                d = deferred.pop(later)
                if d.widens is not None and (a is held or _reads_widened(step)):
                    widened[id(a)] = d.widens
                else:
                    made[later] = compute(body[later], d.out, settle(body[later], d.args, [later]), [later])
            settled.append(widened.get(id(a), a))
        return settled

    for i, (step, slot) in enumerate(zip(body, slots)):
        args = [loaded[ref] if kind == "input" else results[ref] if kind == "step" else float(ref)
                for kind, ref in step.args]
        steps = [i]
        if i and i - 1 in deferred and deferred[i - 1].widens is None:  # the step before, held for this one
            first = deferred[i - 1]
            pair = _held_pair(body[i - 1], first.args, step, args, first.out)
            if pair is not None:
                del deferred[i - 1]
                step, args, steps = *pair, [i - 1, i]
        tiles = [a for a in args if isinstance(a, AccessPattern)]
        if slot is not None and tiles and all(_repeated_column(a) for a in tiles):
            # a step of per-row values only (a row's mean rounded): computed once a partition, on the column,
            # and read along the row with stride 0 as its operands were
            column = temp_tiles[slot].ap(shape[0], 1, dtype=step.dtype)
            made[i] = compute(step, column, [_column_of(a) if isinstance(a, AccessPattern) else a for a in args], steps)
            results.append(dataclasses.replace(column, dims=(column.dims[0], *((0, n) for n in shape[1:]))))
            yield
            continue
        out = out_tile.ap(*shape) if slot is None else temp_tiles[slot].ap(*shape, dtype=step.dtype)
        results.append(out)
        if len(steps) == 1 and _one_reader(reads, i):
            widens = _widened_input(step, args)
            if widens is not None or (i + 1 in _one_reader(reads, i) and step.dtype == DType.F32
                                      and _held_column(step, args) is not None):
                deferred[i] = _Deferred(out, args, widens)
                continue
        done = compute(step, out, settle(step, args, steps), steps)
        made.update(dict.fromkeys(steps, done))
        yield
    return results[-1]


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A step of a body waiting for its one reader (see `emit_body`): where its value goes, its operands, and
    the input it widens to fp32 (None: a held-column step waiting to pair with the next)."""

    out: AccessPattern
    args: list
    widens: AccessPattern | None


def _one_reader(reads: list, j: int) -> set:
    """{the step reading step j}, when exactly one step reads it (else the empty set)."""
    readers = {i for i, r in enumerate(reads) if j in r}
    return readers if len(readers) == 1 else set()


def _widened_input(step, args: list) -> AccessPattern | None:
    """The float input tile `step` converts to fp32 (exactly), else None."""
    if step.op is not Op.CONVERT or step.dtype != DType.F32 or step.args[0][0] != "input":
        return None
    x = args[0]
    return x if x.dtype.is_float and not _repeated_column(x) else None


def _reads_widened(step) -> bool:
    """Whether `step`'s instruction reads a float operand as it lies and widens it to fp32 itself: an arithmetic
    step with an fp32 result (TENSOR_TENSOR, TENSOR_SCALAR and TENSOR_ALU2 compute in fp32 from any float
    operand), so a widening convert feeding it need not be computed."""
    return step.op in _HELD_COLUMN_OPS and step.dtype == DType.F32 and not step.attrs


def _held_pair(first, first_args: list, second, second_args: list, first_out: AccessPattern) -> tuple | None:
    """(Step, [x, column, column']) computing `second` of `first`'s result in one TENSOR_ALU2, when both are
    arithmetic of a tile and a held column (`_held_column`) and the first's result is the second's tile: alu1(alu(x,
    column), column') in fp32, the fp32 value of `first` never rounded, as the two steps compute it. Else None."""
    x, column = _held_column(first, first_args)
    held = _held_column(second, second_args)
    if held is None or held[0] is not first_out or second.op not in ALU:
        return None
    return ir.Step(first.op, (), second.dtype, {"then": second.op}), [x, column, held[1]]


def _repeated_column(ap: AccessPattern) -> bool:
    """One value a partition read along its free axes with stride 0 (a loaded per-row operand)."""
    return ap.free_elements > 1 and all(stride == 0 for stride, _ in ap.dims[1:])


_HELD_COLUMN_OPS = frozenset({Op.ADD, Op.SUBTRACT, Op.MULTIPLY, Op.DIVIDE, Op.MAXIMUM, Op.MINIMUM})
_COMMUTATIVE = frozenset({Op.ADD, Op.MULTIPLY, Op.MAXIMUM, Op.MINIMUM})


def _held_column(step, args) -> tuple | None:
    """(x, column) of a float arithmetic step of a tile and a repeated column (one value a partition read with
    stride 0: a per-row operand), x the streamed operand: one TENSOR_ALU2 pass over x, the column's value held
    per partition, computed in fp32 as TENSOR_TENSOR computes it (the column second, or either for a
    commutative op); None for any other step."""
    if step.op not in _HELD_COLUMN_OPS or not step.dtype.is_float or len(args) != 2:
        return None
    if not all(isinstance(a, AccessPattern) and a.dtype.is_float for a in args):
        return None
    a, b = args
    if _repeated_column(b) and not _repeated_column(a):
        return a, b
    if _repeated_column(a) and not _repeated_column(b) and step.op in _COMMUTATIVE:
        return b, a
    return None


def _column_of(ap: AccessPattern) -> AccessPattern:
    """The [partitions, 1] column a repeated column reads."""
    return dataclasses.replace(ap, dims=(ap.dims[0], (1, 1)))


def activation_scale(step) -> tuple:
    """(scale, bias) of an activation step's ACTIVATE: the scale passes/activation_operands.py folded into it, or
    1.0, with a bias of -0.0: it adds nothing, not even to a zero's sign (-0.0 + 0.0 is +0.0, and eager's sqrt,
    tanh, floor... of -0.0 are -0.0, its rsqrt -inf)."""
    scale = step.attrs.get("scale")
    return (1.0 if scale is None else scale), -0.0


def _scalar_form(step, args) -> tuple | None:
    """(func, scale, bias, source) computing `step` as one Scalar-engine ACTIVATE, func(scale * x + bias) in
    fp32 rounded once to the destination, exactly as the ALU computes it; or None. A bias of -0.0 adds
    nothing, not even to a zero's sign."""
    if step.op in ACTIVATIONS:
        return ACTIVATIONS[step.op], *activation_scale(step), args[0]
    if not step.dtype.is_float or not all(isinstance(a, float) or a.dtype.is_float for a in args):
        return None
    if step.op is Op.CONVERT:
        return ActFunc.IDENTITY, 1.0, -0.0, args[0]
    if step.op is Op.NEGATE:
        return ActFunc.IDENTITY, -1.0, -0.0, args[0]
    if len(args) != 2 or isinstance(args[0], float) == isinstance(args[1], float):
        return None
    (x, c), reverse = (args, False) if isinstance(args[1], float) else (args[::-1], True)
    forms = {Op.MULTIPLY: (c, step.attrs.get("bias", -0.0)), Op.ADD: (1.0, c), Op.SUBTRACT: (-1.0, c) if reverse else (1.0, -c)}
    if step.op not in forms:
        return None
    return (ActFunc.IDENTITY, *forms[step.op], x)


class StepBalancer:
    """Puts each step of a body on the engine that can compute it and would finish it first (as the cost model
    prices the work so far, the step starting once its engine is free and its inputs are made): the Vector
    engine takes any step, GpSimd those that read no PSUM (it cannot reach PSUM on the hardware), the Scalar
    engine activations and the steps that are a scale and a bias (`_scalar_form`). Placing by finish time, not
    by load alone, keeps a chain of steps from waiting on an engine that is free but far behind its inputs."""

    def __init__(self, em: Emitter, columns: Pool | None = None):
        self.em = em
        self.columns = columns  # a [partitions, CONSTANT_COLUMNS] fp32 slot for constants read with stride 0
        self.column_of: dict = {}  # value -> its [partitions, 1] column, made once
        self.busy = {Engine.VECTOR: 0.0, Engine.GPSIMD: 0.0, Engine.SCALAR: 0.0}  # when each is free again
        self.last: dict = {}  # engine -> (its last instruction, the activation table it left loaded)

    def loaded_table(self) -> ActFunc | None:
        """The activation table the Scalar engine has loaded after the steps booked so far (None: none yet)."""
        return self.last.get(Engine.SCALAR, (None, None))[1]

    def compute(self, step, out, args, constants, loc, ready: float = 0.0) -> float:
        """Emit `step`; `ready` is when its inputs are made. Returns when it is done."""
        form = _scalar_form(step, args)
        tiles = [a for a in args if isinstance(a, AccessPattern)]
        engines = [] if step.op in ACTIVATIONS or ("bias" in step.attrs and not self.has_columns(form)) \
            else [Engine.VECTOR]
        scaled = step.op is Op.MULTIPLY and "scale" in step.attrs  # t * scale * y (scaled_products)
        if scaled:
            form = None
        if engines and all(t.space != Space.PSUM for t in tiles + [out]):
            engines.append(Engine.GPSIMD)
        if form is not None:
            engines.append(Engine.SCALAR)
        elements = max(ap.free_elements for ap in tiles + [out])
        held = args[:2] if "then" in step.attrs else _held_column(step, args)  # one pass, the columns held

        def finish(engine):
            """When `step` would end on `engine`, priced as the emulator's clock will price it: its passes, the
            Vector performance mode, the dependent spacing after the engine's last instruction when that one wrote
            an input, an activation-table load (instruction_cost)."""
            target = self.em.target
            passes = 1 if engine is Engine.SCALAR or held is not None else max(1, len(tiles))
            last, loaded = self.last.get(engine, (None, None))
            gap = dependent_gap_ns(engine, target) if last is not None and reads_written(tiles, last) else 0.0
            shape = None if engine is Engine.SCALAR or step.op is Op.SELECT else {1: "copy", 2: "tensor_tensor"}.get(
                1 if held is not None else len(tiles))
            speedup = perf_mode_speedup(engine, shape, perf_mode_operands(out, tiles), target)
            table = table_of(form[0]) if engine is Engine.SCALAR else None
            load = table_load_ns(engine, target) if table is not None and table != loaded else 0.0
            return max(self.busy[engine] + gap, ready) + engine_pass_ns(engine, elements, passes, target, speedup) + load

        engine = min(engines, key=finish)
        start = len(self.em.instructions)
        if engine is Engine.SCALAR:
            func, scale, bias, x = form
            self.em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, x, func=func, imm0=scale, imm1=bias)
        elif scaled:  # (t * scale) * y, both products in fp32: the two multiplies' arithmetic
            t, y = args
            scale = self.column(step.attrs["scale"], out)
            start = len(self.em.instructions)
            self.em.emit(Opcode.TENSOR_ALU2, engine, out, t, scale, y, alu=AluOp.MULTIPLY, alu1=AluOp.MULTIPLY)
        elif "bias" in step.attrs:  # scale * x + bias in fp32, rounded once: the ACTIVATE's arithmetic
            _, scale, bias, x = form
            scale, bias = self.column(scale, out), self.column(bias, out)
            start = len(self.em.instructions)
            self.em.emit(Opcode.TENSOR_ALU2, engine, out, x, scale, bias, alu=AluOp.MULTIPLY, alu1=AluOp.ADD)
        else:
            compute_step(self.em, step, out, args, constants, loc, engine)
        return self.account(self.em.instructions[start:], ready)

    def has_columns(self, form) -> bool:
        """Whether a biased multiply's scale and bias can be read as constant columns (made or room for them)."""
        if self.columns is None or form is None:
            return False
        wanted = {form[1], form[2]} - set(self.column_of)
        return len(self.column_of) + len(wanted) <= CONSTANT_COLUMNS

    def column(self, value: float, like: AccessPattern) -> AccessPattern:
        """`value` in every partition, read with stride 0 along `like`'s free axes (a MEMSET the first time)."""
        if value not in self.column_of:
            tile = column_slice(self.columns_tile.ap(self.em.target.partitions, CONSTANT_COLUMNS),
                                len(self.column_of), len(self.column_of) + 1)
            self.em.emit(Opcode.MEMSET, Engine.GPSIMD, tile, imm0=value)
            self.account(self.em.instructions[-1:])
            self.column_of[value] = tile
        column = row_slice(self.column_of[value], 0, like.partitions)
        return dataclasses.replace(column, dims=(column.dims[0], *((0, n) for _, n in like.dims[1:])))

    @functools.cached_property
    def columns_tile(self) -> Tile:
        return self.columns.next()

    def account(self, instructions, ready: float = 0.0) -> float:
        """Book `instructions` (emitted in order, on the balancer's engines) after `ready`; returns their end."""
        end = ready
        for inst in instructions:  # each priced as the emulator's clock prices it (instruction_cost.step_costs)
            previous, loaded = self.last.get(inst.engine, (None, None))
            extra, gap, loaded = step_costs(inst, previous, loaded, self.em.target)
            end = max(self.busy.get(inst.engine, 0.0) + gap, end) + instruction_cost_ns(inst, self.em.target) + extra
            self.busy[inst.engine] = end
            self.last[inst.engine] = inst, loaded
        return end


def table_order(body: tuple, slots: list, loaded: ActFunc | None, steps: list, emitted: list, later: list) -> list:
    """An order to compute `steps` of `body` in (each after the steps it reads; `emitted`: the orders in which
    the tiles computed their steps before these; `later`: the steps after these, in body order) in which an
    activation needing another table than the one loaded waits while any other step can go: a body of two
    tables (the GELU backward's erf and exp) computed for one group of tiles after another then loads each
    table once a group, not twice (instruction_cost.table_load_ns). `steps` in body order when the reordering
    would write a temporary slot (`slots`, allocated in body order) whose value is still to be read."""
    tables = [table_of(ACTIVATIONS[s.op]) if s.op in ACTIVATIONS else None for s in body]
    if len({tables[j] for j in steps if tables[j] is not None}) < 2:
        return list(steps)
    reads = step_reads(body)
    order, left = [], list(steps)
    while left:
        ready = [j for j in left if reads[j] <= set(order).union(*emitted)]
        waiting = [j for j in ready if tables[j] not in (None, loaded)]
        j = next((j for j in ready if j not in waiting), ready[0])
        loaded = tables[j] or loaded
        order.append(j)
        left.remove(j)
    holds = all(slots_hold(before + order + later, reads, slots) for before in emitted)
    return order if holds else list(steps)


def scaled_products(body: tuple) -> dict:
    """{step m: (step j, the Step computing it in one TENSOR_ALU2)} for each fp32 `multiply(y, s_j)` whose operand
    s_j = `multiply(t, c)` (fp32, a tile times a constant) is read by it alone: (t * c) * y in fp32 as the two
    steps compute it (the GELU backward's `x * (exp(...) * 0.3989)`). StepBalancer.compute takes the Step (a
    multiply of t and y with a "scale"), its constant read as a column."""
    readers: dict = {}
    for m, step in enumerate(body):
        for kind, ref in step.args:
            if kind == "step":
                readers.setdefault(ref, []).append(m)
    fused = {}
    for m, step in enumerate(body):
        if step.op is not Op.MULTIPLY or step.dtype != DType.F32 or "bias" in step.attrs:
            continue
        for side, (kind, j) in enumerate(step.args):
            other = step.args[1 - side]
            inner = body[j] if kind == "step" else None
            if inner is None or other[0] == "imm" or readers.get(j) != [m] or inner.op is not Op.MULTIPLY \
                    or inner.dtype != DType.F32 or inner.attrs or [a[0] for a in inner.args] != ["step", "imm"]:
                continue
            if not (isinstance(inner.args[0][1], int)) or m in fused or j in {k for k, _ in fused.values()}:
                continue
            fused[m] = (j, ir.Step(Op.MULTIPLY, (inner.args[0], other), DType.F32, {"scale": inner.args[1][1]}))
            break
    return fused


def step_reads(body: tuple) -> list:
    """Per step of `body`, the steps it reads."""
    return [{ref for kind, ref in s.args if kind == "step"} for s in body]


def slots_hold(order: list, reads: list, slots: list) -> bool:
    """Whether computing the steps in `order` writes no slot holding a value a later step of it still reads
    (`reads`: step_reads of the body)."""
    held: dict = {}  # slot -> the step whose value it holds
    for n, j in enumerate(order):
        owner = held.get(slots[j])
        if owner is not None and any(owner in reads[k] for k in order[n + 1:]):
            return False
        if slots[j] is not None:
            held[slots[j]] = j
    return True


def compute_step(em: Emitter, step: ir.Step, out: AccessPattern, args: list, constants: Pool | None, loc: DebugLoc,
                 engine: Engine = Engine.VECTOR) -> None:
    """One instruction computing `step` into `out`; args are tiles or floats (scalars). ALU work runs on
    `engine` (Vector or GpSimd), activation functions on the Scalar engine."""
    op = step.op
    tiles = [a for a in args if isinstance(a, AccessPattern)]
    if op in ACTIVATIONS:
        scale, bias = activation_scale(step)
        em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, args[0], func=ACTIVATIONS[op], imm0=scale, imm1=bias)
    elif "bias" in step.attrs:  # a multiply with a bias (passes/activation_operands.py): scale * x + bias
        func, scale, bias, x = _scalar_form(step, args)
        em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, x, func=func, imm0=scale, imm1=bias)
    elif op is Op.NEGATE and step.dtype.is_float:  # times -1, exact: 0 - x would make -(+0.0) +0.0
        em.emit(Opcode.TENSOR_SCALAR, engine, out, args[0], alu=AluOp.MULTIPLY, imm0=-1.0)
    elif op is Op.NEGATE:
        em.emit(Opcode.TENSOR_SCALAR, engine, out, args[0], alu=AluOp.SUBTRACT, imm0=0.0, reverse=True)
    elif op is Op.CONVERT:
        em.emit(Opcode.TENSOR_COPY, engine, out, args[0])
    elif op is Op.NOT:
        every_bit = float(2 ** (8 * step.dtype.itemsize) - 1) if step.dtype.numpy.kind == "u" else -1.0
        alu, imm = (AluOp.EQ, 0.0) if step.dtype == DType.BOOL else (AluOp.XOR, every_bit)
        em.emit(Opcode.TENSOR_SCALAR, engine, out, args[0], alu=alu, imm0=imm)
    elif "then" in step.attrs:  # two arithmetic steps of a tile and held columns (`_held_pair`): one pass
        x, column, second = args
        em.emit(Opcode.TENSOR_ALU2, engine, out, x, column, second, alu=ALU[op], alu1=ALU[step.attrs["then"]])
    elif op in ALU or op is Op.COMPARE:
        alu = COMPARISONS[step.attrs["direction"]] if op is Op.COMPARE else ALU[op]
        a, b = args
        held = _held_column(step, args)
        if held is not None:  # one pass over x, the per-partition value held (rowwise_plan's Alu2 of a per-row value)
            x, column = held
            em.emit(Opcode.TENSOR_ALU2, engine, out, x, column, column, alu=alu)
        elif len(tiles) == 2:
            em.emit(Opcode.TENSOR_TENSOR, engine, out, a, b, alu=alu)
        elif isinstance(a, AccessPattern):
            em.emit(Opcode.TENSOR_SCALAR, engine, out, a, alu=alu, imm0=b)
        else:
            em.emit(Opcode.TENSOR_SCALAR, engine, out, b, alu=alu, imm0=a, reverse=True)
    elif op is Op.SELECT:
        operands, materialised = [], set()
        for arg, dtype in zip(args, (DType.BOOL, step.dtype, step.dtype)):
            if not isinstance(arg, AccessPattern):  # a scalar operand: materialise it as a tile
                made = constants.next()
                if made.offset in materialised:  # a pool of too few buffers would give both scalars one tile
                    raise NeuronCompileError("a select of two scalars needs two constant tiles; its kernel's "
                                             "constants pool has one", location=str(loc))
                materialised.add(made.offset)
                tile = made.ap(*out.shape, dtype=dtype)
                em.emit(Opcode.MEMSET, Engine.GPSIMD, tile, imm0=arg)
                arg = tile
            operands.append(arg)
        em.emit(Opcode.SELECT, engine, out, *operands)
    else:
        raise NeuronCompileError(f"no elementwise kernel for {op.name.lower()}", location=str(loc))


# data movement ---------------------------------------------------------------------------------


def copy_strided(em: Emitter, dtype: DType, src_offset: int, src_strides: tuple, dst_offset: int, dst_strides: tuple,
                 shape: tuple) -> None:
    """DMA a strided HBM view (element strides, byte offsets) to another, in bounded blocks, each by row
    slices over the queues."""
    size = dtype.itemsize
    for block in blocks(shape, [dst_strides, src_strides], tile_free_elements(em.target), em.target.partitions):
        dma_by_rows(em, hbm(dtype, dst_offset + block.offsets[0] * size, block.dims[0]),
                    hbm(dtype, src_offset + block.offsets[1] * size, block.dims[1]))


def view_copy(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    x = node.inputs[0]
    size = node.dtype.itemsize
    copy_strided(em, node.dtype, plan.offset(x) + node.attrs["offset"] * size, node.attrs["strides"],
                 plan.offset(node), dense_strides(node.shape), node.shape)


def bitcast_copy(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """The operand's bytes copied as they are, read as the result's dtype of the same width (DMA moves bytes)."""
    copy_strided(em, node.dtype, plan.offset(node.inputs[0]), dense_strides(node.shape), plan.offset(node),
                 dense_strides(node.shape), node.shape)


def fill(em: Emitter, dtype: DType, offset: int, count: int, value: float) -> None:
    """Write `value` to `count` contiguous HBM elements: one memset tile, DMA'd out block by block (none for an
    empty tensor)."""
    if count == 0:
        return
    free = tile_free_elements(em.target)
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
    """Each input copied into its place (plans.concatenated_pieces: an input read through a view is copied from
    the view's strided positions in its source)."""
    size = node.dtype.itemsize
    for x, (offset, strides, copied, placed, start) in zip(node.inputs, concatenated_pieces(node)):
        copy_strided(em, node.dtype, plan.offset(x) + offset * size, strides,
                     plan.offset(node) + start * size, placed, copied)


# matmul and reductions -------------------------------------------------------------------------


class Balancer:
    """Puts each ALU instruction on the Vector or GpSimd engine, whichever has less work so far (as the
    cost model prices it), so the two share a kernel's elementwise work; activations go to Scalar. A copy
    or a scaling by a constant may also go to Scalar (an ACTIVATE of the identity), when it has less work.
    GpSimd is offered only for instructions that touch no PSUM tile: it cannot reach PSUM on the hardware."""

    CANDIDATES = (Engine.VECTOR, Engine.GPSIMD)

    def __init__(self, em: Emitter):
        self.em = em
        self.busy = {e: 0.0 for e in (*self.CANDIDATES, Engine.SCALAR)}
        self.last: dict = {}  # engine -> (its last instruction placed here, the activation table it left loaded)

    def _charge(self, start: int) -> None:
        """Book the instructions emitted since `start` with the emulator's costs: each one's duration, the table
        load and the dependent spacing it pays after the previous one placed on its engine (instruction_cost)."""
        for inst in self.em.instructions[start:]:
            if inst.engine in self.busy:
                previous, loaded = self.last.get(inst.engine, (None, None))
                extra, gap, loaded = step_costs(inst, previous, loaded, self.em.target)
                self.busy[inst.engine] += instruction_cost_ns(inst, self.em.target) + extra + gap
                self.last[inst.engine] = inst, loaded

    def _engine(self, tiles, on: Engine | None = None) -> Engine:
        if on is not None:
            return on
        reach = [e for e in self.CANDIDATES if e is not Engine.GPSIMD or all(
            not isinstance(t, AccessPattern) or t.space != Space.PSUM for t in tiles)]
        return min(reach, key=self.busy.get)

    def emit(self, opcode, *operands, on: Engine | None = None, **fields) -> None:
        """An ALU instruction on the least loaded candidate that reaches its operands, or on engine `on` when
        the caller places it."""
        start = len(self.em.instructions)
        self.em.emit(opcode, self._engine(operands, on), *operands, **fields)
        self._charge(start)

    def compute(self, step, out, args, constants, loc, on: Engine | None = None) -> None:
        start = len(self.em.instructions)
        compute_step(self.em, step, out, args, constants, loc, self._engine([out, *args], on))
        self._charge(start)

    def scalar_is_freest(self, tiles=()) -> bool:
        """Whether Scalar has less work than every engine that could run an ALU instruction on `tiles` (GpSimd's
        idle time does not count for an instruction it cannot run: one touching PSUM)."""
        return self.busy[Engine.SCALAR] < self.busy[self._engine(tiles)]

    def activate(self, opcode, *operands, **fields) -> None:
        """A Scalar-engine instruction, counted so that the other choices see Scalar's load."""
        start = len(self.em.instructions)
        self.em.emit(opcode, Engine.SCALAR, *operands, **fields)
        self._charge(start)

    def finish(self, engine: Engine, opcode: Opcode, operands: tuple, **fields) -> float:
        """When an instruction would end on `engine` after the work booked there (not emitted): its cost, the
        dependent spacing and the table load it would pay (instruction_cost, as `_charge` books them)."""
        inst = Instruction(opcode, engine, tuple(operands), **fields)
        previous, loaded = self.last.get(engine, (None, None))
        extra, gap, _ = step_costs(inst, previous, loaded, self.em.target)
        return self.busy[engine] + gap + extra + instruction_cost_ns(inst, self.em.target)

    def scale_soonest(self, dst, src, factor: float, slack: float = 0.0) -> None:
        """dst = src * factor (fp32, rounded to dst's dtype) on whichever of Vector, GpSimd (no PSUM) and Scalar
        would finish it first, each priced as the emulator prices it there (its clock, the Vector performance mode,
        the dependent spacing, a table load): unlike `scale`, a copy goes where it is cheap, not only where there
        is least work (a bf16 copy from PSUM takes the Vector engine half Scalar's time, an fp32 one Scalar 0.8 of
        Vector's). With `slack` (ns), the cheapest of the engines that would finish it within `slack` of the first:
        an engine's time spent where another engine is faster is lost to the work only it does well."""
        forms = [(Engine.SCALAR, Opcode.ACTIVATE, dict(func=ActFunc.IDENTITY, imm0=factor, imm1=0.0))]
        alu = (Opcode.TENSOR_COPY, {}) if factor == 1.0 else (Opcode.TENSOR_SCALAR,
                                                               dict(alu=AluOp.MULTIPLY, imm0=factor))
        forms += [(e, alu[0], alu[1]) for e in self.CANDIDATES
                  if e is not Engine.GPSIMD or Space.PSUM not in (dst.space, src.space)]

        ends = [self.finish(engine, opcode, (dst, src), **fields) for engine, opcode, fields in forms]
        best = min(range(len(forms)), key=ends.__getitem__)
        if slack:
            costs = [instruction_cost_ns(Instruction(opcode, engine, (dst, src), **fields), self.em.target)
                     for engine, opcode, fields in forms]
            best = min((n for n in range(len(forms)) if ends[n] <= ends[best] + slack),
                       key=lambda n: (costs[n], ends[n]))
        engine, opcode, fields = forms[best]
        start = len(self.em.instructions)
        self.em.emit(opcode, engine, dst, src, **fields)
        self._charge(start)

    def scale(self, dst, src, factor: float) -> None:
        """dst = src * factor (fp32, rounded to dst's dtype) on the least loaded of Vector, GpSimd, Scalar."""
        if self.scalar_is_freest((dst, src)):
            self.activate(Opcode.ACTIVATE, dst, src, func=ActFunc.IDENTITY, imm0=factor, imm1=0.0)
        elif factor == 1.0:
            self.emit(Opcode.TENSOR_COPY, dst, src)
        else:
            self.emit(Opcode.TENSOR_SCALAR, dst, src, alu=AluOp.MULTIPLY, imm0=factor)
