"""How a ROWWISE kernel's row tiles are scheduled on the engines, chosen by pricing each candidate.

A row tile's work is a chain: its loads, its row statistics (reductions and a few per-row steps), then its tail
(the elementwise passes over the full rows after the last reduction) and its store. With few row tiles (GPT-2's
512 rows are four) the chains barely overlap unless the engines' in-order queues take them well; with many, the
busiest engine sets the pace. Which arrangement is fastest depends on the body, the width and the row count, so
each candidate `Schedule` is priced by `rowwise_ns`, a replay of what codegen emits for it with the rules of
`neuronc.instruction_cost` (the same numbers the emulator's clock uses), and the cheapest is kept.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

from neuronc import ir
from neuronc.instruction_cost import (HbmChannel, PlannedStreams, dma_transfer_ns, engine_pass_ns, perf_mode_speedup,
                                      remaining_latency_ns, table_of)
from neuronc.ir import BINARY, Op, Step
from neuronc.isa import ActFunc, DType, Engine, Space
from neuronc.passes.rowwise_plan import ACTIVATION_OPS, PAIRED_BUFS, input_kind, step_kinds, tail_steps, tile_plan
from neuronc.passes.structural_key import once_per_key, structural_key
from neuronc.placement import SBUF_PAGE_BYTES, dma_pieces, transposed_store_pieces  # noqa: F401 (rules it prices)
from neuronc.plans import Act, Alu2, BnStats, RowSum, Schedule, Summed
from neuronc.targets import Target

ALU_ENGINES = (Engine.VECTOR, Engine.GPSIMD)  # codegen's Balancer shares ALU work between these
ALU_OPS = frozenset(BINARY - {Op.COMPARE})  # the binary ops one ALU instruction computes (codegen's ALU table)


def per_row_alu(step: Step) -> bool:
    """Whether a per-row step is one float ALU instruction, which a schedule may put on the Scalar engine (NKI's
    tensor_scalar runs on the Vector, Scalar or GpSimd engine)."""
    return step.op in ALU_OPS and step.dtype.is_float


def split_engines(target: Target) -> tuple:
    """The engines of a cut tail's two halves: the faster ALU engine takes the first, wider one."""
    return tuple(sorted(ALU_ENGINES, key=lambda e: -_alu_ghz(e, target)))


def _alu_ghz(engine: Engine, target: Target) -> float:
    return target.vector_ghz if engine is Engine.VECTOR else target.gpsimd_ghz


def _cuts(body, plan, tail, out_dtype: DType, cols: int, target: Target) -> list:
    """Columns where a tail may be cut: at a page boundary of every tile it writes (so that the two halves share
    no page the sync pass tracks), near the split that would finish both halves together."""
    if not tail:
        return []
    widths = [DType.F32.itemsize] + [out_dtype.itemsize] + [body[j].dtype.itemsize for j in tail]
    step = SBUF_PAGE_BYTES // min(widths)
    fast, slow = (_alu_ghz(e, target) for e in split_engines(target))
    even = cols * fast / (fast + slow)
    near = {int(even // step) * step, -(-int(even) // step) * step}
    return sorted(c for c in near if 0 < c < cols)


def candidates(body: tuple, views: tuple, input_dtypes: list, out_dtype: DType, cols: int, fitting: list, target: Target,
               rows: int = 0) -> list:
    """Every schedule the kernel may take: with its largest fitting buffers (pairs of row tiles need PAIRED_BUFS),
    the row sums and per-row steps on the Scalar engine or not, the tail whole or cut, shared inputs loaded after
    the first one or two groups of row tiles, and a mean and variance (BnStats) made by BN_STATS on the Vector /
    GpSimd engines in no row tile, the first group's (the start of every chain), or all of the `rows`' tiles."""
    plan = tile_plan(body, views, input_dtypes, cols=cols)
    kinds = step_kinds(body, views)
    tail = tail_steps(body, views, plan)
    bufs = fitting[0]
    together = (1, 2) if bufs == PAIRED_BUFS else (1,)
    # a choice that changes nothing in this kernel is not offered twice
    row_sums = (True, False) if any(isinstance(i, RowSum) for i in plan.instr_of.values()) else (True,)
    row_steps = (True, False) if any(kinds[j] == "row" and per_row_alu(body[j]) or isinstance(i, Summed) and i.shift
                                     and not i.negated for j, i in plan.instr_of.items()) else (True,)
    cuts = [0] + _cuts(body, plan, tail, out_dtype, cols, target)
    shared = (1, 2) if any(v[1][0] == 0 for v in views) else (1,)
    bn = any(isinstance(i, BnStats) for i in plan.instr_of.values())
    tiles = -(-rows // target.partitions)
    return [Schedule(bufs, t, s, r, c, a, b) for t, s, r, c, a in itertools.product(together, row_sums, row_steps,
                                                                                      cuts, shared)
            if bufs // t - 1 >= a  # groups loaded ahead: at least one, and those loaded before the shared inputs
            for b in (sorted({0, min(t, tiles), tiles}) if bn else (0,))]


class _Op(NamedTuple):
    engine: object  # an Engine, or "alu" (the Balancer's choice)
    elements: int
    passes: int
    after: tuple  # the steps whose values it reads
    reads_input: bool  # a row-tile input
    reads_shared: bool  # an input the same for every row
    makes: tuple  # the steps it makes
    ends_step: bool = True  # the last instruction of its plan step (codegen's chains yield after each step)
    func: object = None  # the ActFunc of an activation (its table), None for an ALU instruction
    form: str | None = None  # its Vector performance-mode form (instruction_cost.perf_mode_speedup)
    dtypes: tuple = ()  # the dtypes of its destination and streamed sources (all in SBUF, contiguous)


def _tile_ops(body, views, input_dtypes, plan, schedule: Schedule, cols: int, target: Target, bn: bool = True) -> list:
    """The instructions of one row tile as codegen emits them, each as an _Op (its BnStats as BN_STATS and BN_AGGR
    when `bn`, else as the steps they stand for)."""
    kinds = step_kinds(body, views)
    tail = tail_steps(body, views, plan) if schedule.cut else ()

    def kind_of(arg):
        return kinds[arg[1]] if arg[0] == "step" else input_kind(views[arg[1]]) if arg[0] == "input" else "imm"

    def streamed(args):
        return len({a for a in args if kind_of(a) in ("full", "col")})

    def dtype_of(arg):
        return body[arg[1]].dtype if arg[0] == "step" else input_dtypes[arg[1]]

    def op(engine, elements, passes, args, makes, func=None, form=None):
        steps = tuple(a[1] for a in args if a[0] == "step" and kinds[a[1]] != "col")
        inputs = [a for a in args if a[0] == "input"]
        dst = body[makes[0]].dtype if makes else DType.F32
        held = elements > 1  # over full rows a per-row value is held, not streamed
        dtypes = (dst, *(dtype_of(a) for a in args if a[0] != "imm" and not (held and kind_of(a) == "row")))
        return _Op(engine, elements, max(1, passes), steps, any(kind_of(a) != "col" for a in inputs),
                   any(kind_of(a) == "col" for a in args), makes, True, func, form, dtypes)

    def alu_form(reads):
        """The performance-mode form of the ALU instruction computing from `reads` (codegen's compute_step)."""
        return {1: "copy", 2: "tensor_tensor"}.get(len(reads))

    ops, tail_ops = [], []
    for j, instr in plan.instr_of.items():
        if kinds[j] == "col":
            continue
        width = cols if kinds[j] == "full" else 1
        if isinstance(instr, Alu2):
            engine, passes, reads = "alu", streamed(instr.reads), instr.reads
            func, form = None, ("copy" if passes == 1 else "tensor_tensor")
        elif isinstance(instr, Summed):
            bias = ()
            if instr.shift is not None and not instr.negated:  # the bias, -shift: a per-row ALU step
                negate = op(Engine.SCALAR if schedule.row_steps_on_scalar else "alu", 1, 1, (instr.shift,), (),
                            form="copy")
                ops.append(negate._replace(makes=(("bias", j),), ends_step=False, dtypes=(DType.F32, DType.F32)))
                bias = (("bias", j),)
            summed = op(Engine.SCALAR, cols, 1, instr.reads, (j, instr.row_sum), func=_act_func(instr.act))
            ops.append(summed._replace(after=summed.after + bias))
            continue
        elif isinstance(instr, BnStats) and not bn:  # a row sum, the mean, the squares of (mean - x) summed, variance
            total = ("sum", j)
            row = op(Engine.SCALAR if schedule.row_sum_on_scalar else "alu", cols, 1, instr.reads, (),
                     func=ActFunc.IDENTITY if schedule.row_sum_on_scalar else None)
            ops.append(row._replace(makes=(total,), ends_step=False))
            for made, after in ((j, total), (instr.var, ("squares", j))):
                if made == instr.var:
                    squares = op(Engine.SCALAR, cols, 1, instr.reads, (), func=ActFunc.SQUARE)
                    ops.append(squares._replace(makes=(after,), after=squares.after + (j,), ends_step=False))
                scalar = schedule.row_steps_on_scalar and per_row_alu(body[made])
                mean = op(Engine.SCALAR if scalar else "alu", 1, 1, (), (made,),
                          func=ActFunc.IDENTITY if scalar else None, form="copy")
                ops.append(mean._replace(after=(after,), dtypes=(DType.F32, DType.F32), ends_step=made == instr.var))
            continue
        elif isinstance(instr, BnStats):  # codegen's BN_STATS per chunk (each on the less loaded ALU engine), BN_AGGR
            chunks = BnStats.chunks(cols, target.bn_stats_max_free)
            for c0, c1 in chunks:
                stats = op("alu", c1 - c0, 1, instr.reads, ())
                ops.append(stats._replace(makes=(("bn", j),), ends_step=False, dtypes=(DType.F32, dtype_of(instr.src))))
            aggr = op("alu", 2 * len(chunks) * target.bn_aggr_cycles_per_triple, 1, (), (j, instr.var))
            ops.append(aggr._replace(after=(("bn", j),), dtypes=(DType.F32, DType.F32)))
            continue
        elif isinstance(instr, Act):
            engine, passes, reads, func, form = Engine.SCALAR, 1, instr.reads, ir.facts(instr.act).activation, None
        elif isinstance(instr, RowSum):
            engine, passes, reads = Engine.SCALAR if schedule.row_sum_on_scalar else "alu", 1, instr.reads
            func, form, width = (ActFunc.IDENTITY if schedule.row_sum_on_scalar else None), None, cols
        elif body[j].op is Op.REDUCE_LAST:
            engine, passes, reads, width, func, form = "alu", 1, instr.reads, cols, None, None
        else:
            reads = tuple(a for a in instr.args if a[0] != "imm")
            scalar = body[j].op in ACTIVATION_OPS or (
                schedule.row_steps_on_scalar and width == 1 and per_row_alu(body[j]))
            engine = Engine.SCALAR if scalar else "alu"
            # on the Scalar engine an ALU step is an ACTIVATE of the identity (codegen's _scalar_form)
            func = (ir.facts(body[j].op).activation or ActFunc.IDENTITY) if scalar else None
            form = None if body[j].op is Op.SELECT else alu_form(reads)
            passes = len(reads)
            width = cols if any(kind_of(a) in ("full", "col") for a in reads) else width
        if j in tail:
            tail_ops.append((j, engine, passes, reads, func, form))
        else:
            ops.append(op(engine, width, passes, reads, (j,), func, form))
    for (c0, c1), half_engine in zip(((0, schedule.cut), (schedule.cut, cols)) if tail else (), split_engines(target)):
        for j, engine, passes, reads, func, form in tail_ops:  # an activation stays on the Scalar engine
            ops.append(op(half_engine if engine == "alu" else engine, c1 - c0, passes, reads, (j,), func, form))
    return ops


def _act_func(act) -> ActFunc:
    """The function of a Summed activation (a square for MULTIPLY), as codegen's `_activation_func`."""
    return ActFunc.SQUARE if act is Op.MULTIPLY or act is Op.POWER else ir.facts(act).activation


def rowwise_ns(body: tuple, views: tuple, input_dtypes: list, out_dtype: DType, rows: int, cols: int, schedule: Schedule,
               target: Target, prologue: bool = False) -> float:
    """Estimated time of a ROWWISE kernel under `schedule`: codegen's instructions in codegen's order, each on its
    engine's (or DMA queue's) in-order queue once the values it reads are made, its cost by instruction_cost's rules;
    loads of a row tile wait for the tile `bufs` before it to be done with their buffer; DMAs share the HBM channel.
    `prologue`: the kernel is a matmul's prologue (passes/norm_prologue.py), each row tile not stored but transposed
    on the Tensor engine a [128, 128] block at a time and copied out of PSUM on the Vector engine (codegen/matmul.py)."""
    plan = tile_plan(body, views, input_dtypes, cols=cols)
    forms = {bn: _tile_ops(body, views, input_dtypes, plan, schedule, cols, target, bn)  # (the forms it reads:
             for bn in {schedule.bn_tiles > 0, False}}  # no BN_STATS tile, as most kernels, makes one form)
    parts = target.partitions
    engines = PlannedStreams(target)  # the Vector, Scalar and GpSimd streams, with the emulator's stream rules
    load = {e: 0.0 for e in (*ALU_ENGINES, Engine.SCALAR)}  # the Balancer's work so far
    queues = [0.0] * target.dma_queues
    moving = [0.0] * target.dma_queues  # when each queue's last transfer began moving data
    turn = [0]
    hbm = HbmChannel(target)

    def dma(nbytes: int, pieces: int, ready: float, rows: int) -> float:
        """A transfer cut into `pieces` on the next queues, each as the emulator's clock runs it: its fixed cost
        (start latency) prepared while the queue's previous transfer moves data, its bytes through the HBM
        channel (stream_timing.simulate)."""
        end = ready
        for _ in range(pieces):
            q = turn[0] % len(queues)
            turn[0] += 1
            start = max(queues[q], ready)
            lead = remaining_latency_ns(start, ready, moving[q], target.dma_fixed_ns)
            duration = dma_transfer_ns(nbytes / pieces, True, target, -(-rows // pieces)) - target.dma_fixed_ns + lead
            moving[q] = start + lead
            queues[q] = hbm.end(start, duration, nbytes / pieces, lead)
            end = max(end, queues[q])
        return end

    first = [o.func for o in forms[schedule.bn_tiles > 0] if o.func is not None and table_of(o.func) is not None]
    if first:  # codegen's preload of the first table (a MEMSET and an ACTIVATE of [p, 1] at the kernel's start)
        for func in (None, first[0]):
            _, _, charged = engines.run(Engine.SCALAR, engine_pass_ns(Engine.SCALAR, 1, 1, target), 0.0, func=func)
            load[Engine.SCALAR] += charged
    tile_inputs = [(dt, v) for dt, v in zip(input_dtypes, views) if v[1][0] != 0]
    shared = [(dt, v) for dt, v in zip(input_dtypes, views) if v[1][0] == 0]
    starts = list(range(0, rows, parts))
    done_at = {}  # row tile -> when its last instruction ends

    def load_tile(n, first):
        rt = min(parts, rows - starts[n])
        ready = done_at.get(n - schedule.bufs, 0.0)
        end = ready
        for dt, (_, (_, sc)) in tile_inputs:
            nbytes = rt * (cols if sc else 1) * dt.itemsize
            end = max(end, dma(nbytes, dma_pieces(nbytes, rt, first, target), ready, rt))
        return end

    def run(n, loaded, shared_end, last):
        """The instructions of row tile n, one per step of the generator (codegen's interleaving)."""
        rt = min(parts, rows - starts[n])
        made = {}
        for o in forms[n < schedule.bn_tiles]:
            engine = o.engine if o.engine != "alu" else min(ALU_ENGINES, key=load.get)
            speedup = perf_mode_speedup(engine, o.form, [(dt, Space.SBUF, True) for dt in o.dtypes], target)
            cost = engine_pass_ns(engine, o.elements, o.passes, target, speedup)
            ready = max([made.get(s, 0.0) for s in o.after] + [loaded if o.reads_input else 0.0,
                                                                 shared_end if o.reads_shared else 0.0])
            _, end, charged = engines.run(engine, cost, ready, reads=[(n, s) for s in o.after],
                                          makes=[(n, s) for s in o.makes], func=o.func)
            load[engine] += charged
            for s in o.makes:
                made[s] = max(made.get(s, 0.0), end)
            if o.ends_step:
                yield
        out = made.get(plan.out_step, 0.0)
        if prologue:  # each transposed block's copy out of PSUM (the transposes' own time is the Tensor engine's)
            block = target.matmul_max_k
            copy = engine_pass_ns(Engine.VECTOR, rt, 1, target, perf_mode_speedup(
                Engine.VECTOR, "copy", [(out_dtype, Space.SBUF, True), (out_dtype, Space.PSUM, True)], target))
            for _ in range(-(-cols // block)):
                _, out, charged = engines.run(Engine.VECTOR, copy, out)
                load[Engine.VECTOR] += charged
            done_at[n] = out
            return
        nbytes = rt * cols * out_dtype.itemsize
        done_at[n] = dma(nbytes, dma_pieces(nbytes, rt, last, target), out, rt)

    groups = [list(range(g, min(g + schedule.together, len(starts)))) for g in range(0, len(starts), schedule.together)]
    depth = schedule.bufs // schedule.together - 1
    first = min(depth, schedule.shared_after)
    ahead = [[load_tile(n, g == 0) for n in group] for g, group in enumerate(groups[:first])]
    shared_end = 0.0
    for dt, (_, (_, sc)) in shared:
        nbytes = parts * (cols if sc else 1) * dt.itemsize
        shared_end = max(shared_end, dma(nbytes, dma_pieces(nbytes, parts, True, target), 0.0, parts))
    ahead += [[load_tile(n, False) for n in group] for group in groups[first:depth]]
    for g, group in enumerate(groups):
        if g + depth < len(groups):
            ahead.append([load_tile(n, False) for n in groups[g + depth]])
        loaded = ahead.pop(0)
        chains = [run(n, t, shared_end, g == len(groups) - 1) for n, t in zip(group, loaded)]
        while chains:
            chains = [c for c in chains if next(c, StopIteration) is not StopIteration]
    return max(list(done_at.values()) + list(engines.free.values()))


def choose_schedule(body: tuple, views: tuple, input_dtypes: list, out_dtype: DType, rows: int, cols: int, fitting: list,
                    target: Target, known: dict | None = None, prologue: bool = False) -> Schedule:
    """The candidate schedule `rowwise_ns` prices cheapest (the first of equals); `prologue`: as a matmul's prologue.

    The choice depends on nothing but its arguments, so it is made once per distinct kernel: a model's N copies of
    one layer norm (or softmax) share one search, and get the very schedule each search would have chosen.
    `known`: keys made before of some of the arguments' objects (structural_key.keyed_once)."""
    def search() -> Schedule:
        options = candidates(body, views, input_dtypes, out_dtype, cols, fitting, target, rows)
        return min(options, key=lambda s: rowwise_ns(body, views, input_dtypes, out_dtype, rows, cols, s, target,
                                                     prologue))

    return once_per_key(_CHOSEN, lambda: (structural_key(body, known), structural_key(views, known),
                                          tuple(input_dtypes), out_dtype,
                                          rows, cols, tuple(fitting), target, prologue), search, _CHOSEN_LIMIT)


def ranked_schedules(body: tuple, views: tuple, input_dtypes: list, out_dtype: DType, rows: int, cols: int,
                     fitting: list, target: Target, count: int, margin: float, prologue: bool = False) -> list:
    """Up to `count` candidate schedules of distinct `rowwise_ns` prices within `margin` times the cheapest,
    cheapest first (of equal prices the first, as `choose_schedule` keeps): its choice and its runners-up, for a
    caller that times each in context (a folded norm's kernel, passes/norm_prologue.py)."""
    def search() -> tuple:
        options = candidates(body, views, input_dtypes, out_dtype, cols, fitting, target, rows)
        prices = [rowwise_ns(body, views, input_dtypes, out_dtype, rows, cols, s, target, prologue) for s in options]
        ranked, seen = [], set()
        for i in sorted(range(len(options)), key=prices.__getitem__):
            if prices[i] in seen or prices[i] > margin * min(prices) or len(ranked) == count:
                continue
            seen.add(prices[i])
            ranked.append(options[i])
        return tuple(ranked)

    return list(once_per_key(_RANKED, lambda: (structural_key(body), structural_key(views), tuple(input_dtypes),
                                               out_dtype, rows, cols, tuple(fitting), target, count, margin,
                                               prologue), search, _CHOSEN_LIMIT))


_RANKED: dict = {}  # structural key of ranked_schedules' arguments -> its schedules
_CHOSEN: dict = {}  # structural key of choose_schedule's arguments -> its schedule
_CHOSEN_LIMIT = 4096  # distinct row-wise kernels remembered per process
