"""The instructions of a ROWWISE kernel's row tile: how its body's steps are computed, and the tiles that takes.

fuse_rowwise (passes/rowwise.py) keeps a group when these tiles fit SBUF, rowwise_schedule prices the ways to
emit them, and the node's RowwisePlan (neuronc/plans.py) carries the result to codegen. Kept apart from the
fusion pass so that both it and the scheduler read this module, and neither the other.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.placement import SBUF_PAGE_BYTES
from neuronc.passes.structural_key import once_per_key, structural_key
from neuronc.plans import OUT_SLOT, Act, Alu2, BnStats, Plain, RowSum, Summed, TilePlan
from neuronc.targets import TARGETS

BUFS = 2  # buffers of each whole-row tile: the next row tile loads while this one is computed
# With room for twice as many, row tiles may be computed in pairs, their steps interleaved, so that the engines'
# in-order queues hold two independent chains; else, with room for one more, two row tiles are loaded ahead.
# Which way a kernel goes is its "schedule" (passes/rowwise_schedule.py, priced); codegen follows it.
PAIRED_BUFS = 2 * BUFS
BUF_CHOICES = (PAIRED_BUFS, BUFS + 1, BUFS)



def input_kind(view: tuple) -> str:
    """"full", "row" (one value per row), "col" (one per column, the same for every row) or "row" for
    one value for everything, by the (row, column) strides of an input's view."""
    _, (sr, sc) = view
    return "full" if sr and sc else "col" if sc else "row"


def step_kinds(body: tuple, views: tuple) -> list:
    """"full" ([rows, cols] tile per row tile), "row" ([rows, 1] per row tile) or "col" ([partitions,
    cols], computed once for all row tiles) for each step of a ROWWISE body."""
    kinds = []
    for step in body:
        arg_kinds = {kinds[ref] if a == "step" else input_kind(views[ref]) for a, ref in step.args if a != "imm"}
        if step.op is Op.REDUCE_LAST:
            kinds.append("row")
        elif "full" in arg_kinds or {"row", "col"} <= arg_kinds:
            kinds.append("full")
        else:
            kinds.append("col" if "col" in arg_kinds else "row")
    return kinds


# The instructions of a row tile --------------------------------------------------------------
#
# A row tile's steps are computed by fewer instructions than there are steps, each exactly as the steps it
# replaces (every instruction computes in fp32 and rounds once, to its destination's dtype):
#   - a widening float convert of an input is no instruction: its readers read the input (they compute in fp32);
#   - a narrowing convert of the result is no instruction: the step before it writes the output tile;
#   - two arithmetic steps, the second reading the first (an fp32 value), are one TENSOR_ALU2 ((a op b) op1 c), and
#     so is one step reading a per-row value (held per partition, not streamed: one pass instead of two);
#   - an activation (or a square) whose row sum is the next step is one ACTIVATE_BIAS_REDUCE, a subtraction of a
#     per-row value before it folded in as the bias (a square of (x - m) as one of (-x + m): the same value);
#   - an activation of a value scaled or shifted by a constant is one ACTIVATE with that scale and bias;
#   - a row sum may go to the Scalar engine (an identity ACTIVATE_BIAS_REDUCE), where codegen finds it free.
# Steps nothing reads any more are dropped. Codegen emits this plan; the SBUF budget counts its tiles.

ACTIVATION_OPS = frozenset(ir.UNARY - {Op.NEGATE, Op.NOT, Op.CONVERT})  # what one ACTIVATE computes
ARITHMETIC = frozenset({Op.ADD, Op.SUBTRACT, Op.MULTIPLY, Op.DIVIDE, Op.MAXIMUM, Op.MINIMUM, Op.POWER})
COMMUTATIVE = frozenset({Op.ADD, Op.MULTIPLY, Op.MAXIMUM, Op.MINIMUM})
_AFFINE = {Op.ADD: lambda c: (1.0, c), Op.SUBTRACT: lambda c: (1.0, -c), Op.MULTIPLY: lambda c: (c, -0.0)}


def _reads(args) -> tuple:
    return tuple(a for a in args if a[0] != "imm")


def _square(step) -> bool:
    return (step.op is Op.MULTIPLY and step.args[0] == step.args[1]) or (
        step.op is Op.POWER and step.args[1] == ("imm", 2.0))


def tile_plan(body: tuple, views: tuple, input_dtypes: list, summed: tuple = (), cols: int | None = None) -> TilePlan:
    """How each step of a ROWWISE body is computed per row tile (see above), and the tile slots that takes.
    `summed`: steps whose values the kernel also sums over its rows (RowwisePlan.sums): kept to the tile's end.
    `cols`: the row's length, when known: a mean and variance of a row (its sum and its squared deviations' sum,
    each divided by `cols`) are then one BnStats (BN_STATS and BN_AGGR).

    It depends on nothing but its arguments, so it is made once per distinct kernel (a frozen plan, shared): the
    SBUF fit, the schedule search, the kernel plan and the norm prologues' tilings ask again for each of a model's
    N copies of one layer norm or softmax."""
    return once_per_key(_PLANNED, lambda: (structural_key(body), structural_key(views), tuple(input_dtypes), tuple(summed),
                                           cols), lambda: _tile_plan(body, views, input_dtypes, summed, cols),
                        _PLANNED_LIMIT)


_PLANNED: dict = {}  # structural key of tile_plan's arguments -> its TilePlan
_PLANNED_LIMIT = 4096  # distinct row-wise bodies remembered per process


def _tile_plan(body: tuple, views: tuple, input_dtypes: list, summed: tuple = (), cols: int | None = None) -> TilePlan:
    kinds = step_kinds(body, views)
    users = [[j for j, step in enumerate(body) for a in step.args if a == ("step", i)] for i in range(len(body))]
    alias, instrs, readers = {}, {}, {}

    def resolve(arg):
        return alias.get(arg[1], arg) if arg[0] == "step" else arg

    def body_input_float(arg) -> bool:
        return input_dtypes[arg[1]].is_float

    def dtype_of(arg):
        return body[arg[1]].dtype if arg[0] == "step" else input_dtypes[arg[1]]

    def full_f32(arg) -> bool:
        return arg[0] == "step" and kinds[arg[1]] == "full" and body[arg[1]].dtype == DType.F32

    def per_row(arg) -> bool:  # one value per row: held per partition by an instruction that reads it
        return (kinds[arg[1]] if arg[0] == "step" else input_kind(views[arg[1]]) if arg[0] == "input" else "") == "row"

    def one_op(arg):
        """(a, b, op) of a full fp32 step computed by one arithmetic op on two tiles, or None."""
        inner = instrs.get(arg[1]) if full_f32(arg) else None
        if isinstance(inner, Alu2) and inner.op1 is None:
            return inner.a, inner.b, inner.op
        if isinstance(inner, Plain) and body[arg[1]].op in ARITHMETIC and len(_reads(inner.args)) == 2:
            return (*inner.args, body[arg[1]].op)
        return None

    def only_reader(u, j) -> bool:
        return all(r == j for r in readers.get(u, ())) and all(k <= j for k in users[u])

    def add(j, instr):
        instrs[j] = instr
        for arg in instr.reads:
            if arg[0] == "step":
                readers.setdefault(arg[1], set()).add(j)

    last = len(body) - 1
    summed_sums = set()
    for j, step in enumerate(body):
        args = tuple(resolve(a) for a in step.args)
        if j in summed_sums:
            continue
        if step.op is Op.CONVERT and step.dtype == DType.F32 and args[0][0] == "input" and body_input_float(args[0]):
            alias[j] = args[0]  # the input's readers compute in fp32 anyway
        elif kinds[j] == "col":
            add(j, Plain(args))
        elif step.op is Op.REDUCE_LAST:
            add(j, RowSum(args[0]) if step.attrs["kind"] == "add" and step.dtype == DType.F32 else Plain(args))
        elif (j < last and kinds[j] == "full" and step.dtype == DType.F32 and body[j + 1].op is Op.REDUCE_LAST
              and body[j + 1].attrs["kind"] == "add" and body[j + 1].dtype == DType.F32
              and body[j + 1].args == (("step", j),) and (step.op in ACTIVATION_OPS or _square(step))):
            src, shift, negated = args[0], None, False
            producer = body[src[1]] if src[0] == "step" else None
            if (producer is not None and producer.op is Op.SUBTRACT and producer.dtype == DType.F32
                    and per_row(resolve(producer.args[1])) and dtype_of(resolve(producer.args[1])) == DType.F32
                    and resolve(producer.args[0])[0] != "imm"):
                src, shift = resolve(producer.args[0]), resolve(producer.args[1])
                negated = _square(step)
            add(j, Summed(Op.MULTIPLY if _square(step) else step.op, src, j + 1, shift, negated))
            summed_sums.add(j + 1)
        elif (step.op in ACTIVATION_OPS and step.dtype == DType.F32 and args[0][0] == "step"
              and body[args[0][1]].op in _AFFINE and body[args[0][1]].dtype == DType.F32 and users[args[0][1]] == [j]
              and len(_reads(body[args[0][1]].args)) == 1 and body[args[0][1]].args[1][0] == "imm"):
            u = body[args[0][1]]
            scale, bias = _AFFINE[u.op](float(u.args[1][1]))
            add(j, Act(step.op, resolve(u.args[0]), scale, bias))
        elif step.op in ARITHMETIC and kinds[j] == "full" and step.dtype.is_float and len(_reads(args)) == 2:
            add(j, _arithmetic(step.op, args, one_op, per_row, lambda u, j=j: only_reader(u, j)))
        else:
            add(j, Plain(args))
    if cols is not None:
        _bn_statistics(body, instrs, users, cols, summed)
    out_step = last
    root = body[last]
    if (root.op is Op.CONVERT and root.dtype.is_float and root.args[0][0] == "step" and last in instrs
            and users[root.args[0][1]] == [last] and body[root.args[0][1]].dtype == DType.F32
            and kinds[root.args[0][1]] == "full" and not isinstance(instrs.get(root.args[0][1]), (Summed, type(None)))):
        out_step = root.args[0][1]  # it writes the output tile, rounding to its dtype: the convert, done
        del instrs[last]
    live = _live(instrs, out_step, kinds, summed)
    instrs = {j: instr for j, instr in instrs.items() if j in live}
    slots, count = _slots(body, instrs, out_step, kinds, summed)
    return TilePlan(tuple(instrs.items()), out_step, tuple(slots.items()), tuple(count.items()))


def _divides_by(step, arg, cols: int) -> bool:
    return step.op is Op.DIVIDE and step.dtype == DType.F32 and step.args == (arg, ("imm", float(cols)))


def _bn_statistics(body, instrs: dict, users: list, cols: int, summed: tuple) -> None:
    """Each mean and population variance of one row, made as the row-wise kernels make them (a RowSum of src
    divided by `cols`; a Summed square of src less that mean, its row sum divided by `cols`), becomes one BnStats
    at the mean's step, which makes the variance's step too: the row sum, the squares and the two divisions go.
    Only when nothing else reads the sums or the squares."""
    for j_sum, row_sum in list(instrs.items()):
        if j_sum not in instrs or not isinstance(row_sum, RowSum) or len(users[j_sum]) != 1:
            continue
        j_mean = users[j_sum][0]
        if not _divides_by(body[j_mean], ("step", j_sum), cols) or not isinstance(instrs.get(j_mean), Plain):
            continue
        for j_sq, sq in instrs.items():
            if (isinstance(sq, Summed) and sq.act is Op.MULTIPLY and sq.src == row_sum.src and sq.negated
                    and sq.shift == ("step", j_mean) and users[j_sq] == [sq.row_sum]
                    and len(users[sq.row_sum]) == 1 and not {j_sum, j_sq, sq.row_sum} & set(summed)):
                j_var = users[sq.row_sum][0]
                if _divides_by(body[j_var], ("step", sq.row_sum), cols) and isinstance(instrs.get(j_var), Plain):
                    for j in (j_sum, j_sq, j_var):
                        del instrs[j]
                    instrs[j_mean] = BnStats(row_sum.src, j_var)
                    break
    ordered = sorted(instrs.items())
    instrs.clear()
    instrs.update(ordered)


def tail_steps(body: tuple, views: tuple, plan: TilePlan) -> tuple:
    """The last instructions of a row tile's plan that are elementwise over full rows (no reduction, no row sum),
    ending with the output's: each column of them needs only the same columns of what it reads, so they may be
    computed a part of the columns at a time, the parts on different engines (a schedule's `cut`)."""
    kinds = step_kinds(body, views)
    tail = []
    instrs = plan.instr_of
    for j in reversed([j for j in instrs if kinds[j] != "col"]):
        instr = instrs[j]
        if (kinds[j] != "full" or isinstance(instr, (Summed, RowSum))
                or (isinstance(instr, Plain) and body[j].op is Op.REDUCE_LAST)):
            break
        tail.append(j)
    return tuple(reversed(tail))


def _arithmetic(op, args, inner_op, per_row, absorbable):
    """A full-row arithmetic step with two tile operands: a TENSOR_ALU2 absorbing the one-op arithmetic step it
    reads (leftmost, or either for a commutative op; `inner_op` gives (a, b, op) of such a step) when that one dies
    with it or its operands stream no more than it does, or a TENSOR_ALU2 holding a per-row operand, or Plain."""
    x, y = args
    for first, other in ((x, y), (y, x)) if op in COMMUTATIVE else ((x, y),):
        inner = inner_op(first)
        if inner is not None:
            a, b, inner_op_ = inner
            if absorbable(first[1]) or sum(not per_row(v) for v in (a, b)) <= 1:
                return Alu2(a, b, inner_op_, other, op)
    if per_row(y):
        return Alu2(x, y, op)
    if per_row(x) and op in COMMUTATIVE:
        return Alu2(y, x, op)
    return Plain(args)


def _live(instrs, out_step, kinds, summed=()) -> set:
    """The steps the output (and the summed steps) need, through what each instruction reads."""
    live, stack = set(), [out_step, *summed]
    maker = {i.var: j for j, i in instrs.items() if isinstance(i, BnStats)}
    while stack:
        j = stack.pop()
        if j in live:
            continue
        live.add(j)
        instr = instrs.get(j)
        if instr is None:  # a Summed's row sum: made by the Summed before it; a BnStats' variance, by it
            stack.append(maker.get(j, j - 1))
            continue
        stack.extend(a[1] for a in instr.reads if a[0] == "step")
    return live


def _slots(body, instrs, out_step, kinds, summed=()) -> tuple:
    """Linear-scan tile slots per kind over the instructions: a value's slot is free after its last reader (a full
    tile may be rewritten in place by its last reader, elementwise; a per-row one only after it); a summed step's
    is never free (its sums read it after the tile's last step)."""
    made = {}  # step -> the instruction index making it
    for j, instr in instrs.items():
        made[j] = j
        if isinstance(instr, Summed):
            made[instr.row_sum] = j
        if isinstance(instr, BnStats):
            made[instr.var] = j
    last = {v: at for v, at in made.items()}
    for j, instr in instrs.items():
        for a in instr.reads:
            if a[0] == "step":
                last[a[1]] = max(last[a[1]], j)
    for v in summed:
        last[v] = len(body)  # read after every step
    free = {"full": [], "row": [], "col": []}
    count = {"full": 0, "row": 0, "col": 0}
    slots = {}
    # The output tile holds nothing before the out step: a value that step reads last may live there (it is
    # overwritten in place, elementwise), when the output's elements are as wide as the value's
    out_free = True

    def release(values, kind):
        free[kind].extend(slots[v] for v in sorted(values) if slots.get(v, OUT_SLOT) != OUT_SLOT and kinds[v] == kind)

    for j in sorted(instrs):
        dying = {v for v, at in last.items() if at == j and made[v] != j}
        release(dying, "full")
        for v in sorted(v for v, at in made.items() if at == j and v != out_step):
            if last[v] == j and kinds[v] == "full":
                continue  # written and never read (an activation made for its row sum): the kernel's scratch tile
            kind = kinds[v]
            if out_free and kind == "full" and last[v] == out_step and body[v].dtype.itemsize <= body[-1].dtype.itemsize:
                slots[v], out_free = OUT_SLOT, False
            elif free[kind]:
                slots[v] = free[kind].pop()
            else:
                slots[v], count[kind] = count[kind], count[kind] + 1
        release(dying, "row")  # col tiles live throughout
        release({v for v, at in made.items() if at == j and last[v] == j}, "row")
    return slots, count


def needs_constants(body: tuple) -> bool:
    """Whether a SELECT of the body takes a constant (codegen makes it a tile per row tile)."""
    return any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body)


def rowwise_sbuf_bytes(body: tuple, views: tuple, input_dtypes: list, out_dtype: DType, cols: int, bufs: int = BUFS,
                       summed: tuple = (), sum_dtypes: tuple = ()) -> int:
    """Bytes per partition the ROWWISE kernel allocates with `bufs` buffers per row tile (codegen allocates
    exactly these tiles); `summed` / `sum_dtypes`: its sums over rows (RowwisePlan.sums) and their outputs' dtypes."""
    tile = tile_plan(body, views, input_dtypes, summed, cols)
    count = tile.count_of

    def slot(elements, itemsize):
        return -(-elements * itemsize // SBUF_PAGE_BYTES) * SBUF_PAGE_BYTES

    wide = max([DType.F32.itemsize, out_dtype.itemsize] + [s.dtype.itemsize for s in body])
    total = slot(cols, wide) * bufs * (count["full"] + needs_constants(body))  # full temporaries, SELECT constants
    total += slot(1, wide) * bufs * (count["row"] + 1) + slot(cols, wide) * count["col"]
    total += 2 * slot(1, wide) + slot(cols, wide)  # a zero bias, the table preload's tile, the Scalar's scratch tile
    for dtype, (_, (sr, sc)) in zip(input_dtypes, views):
        total += slot(cols if sc else 1, dtype.itemsize) * (1 if sr == 0 else bufs)
    for j, dtype in zip(summed, sum_dtypes):  # a sum's ones column and its rounded sums (codegen/rowwise.py)
        total += slot(1, body[j].dtype.itemsize) + slot(cols, dtype.itemsize)
    if any(isinstance(i, BnStats) for i in tile.instr_of.values()):  # BN_STATS' chunks' statistics and BN_AGGR's
        total += slot(bn_stats_width(cols, min(t.bn_stats_max_free for t in TARGETS.values())), 4) * bufs
    return total + slot(cols, wide) * bufs  # the output tile


def bn_stats_width(cols: int, max_free: int) -> int:
    """F32 values a row tile's BnStats writes per partition: 6 per chunk of at most `max_free` columns, then 2."""
    return 6 * -(-cols // max_free) + 2
