"""Row-wise fusion: a normalisation (softmax, log-softmax, layer-norm, RMS-norm, ...) as one kernel.

Such a computation reduces rows of an [R, C] iteration space (the reduced axis, C, need not be the
last axis of the tensors: rows and columns are any merge of their axes) and broadcasts the reduced
values back over the row. Unfused, every reduction and every elementwise group between them is a
kernel of its own and the row makes a round trip through HBM for each. Fused, a tile of rows (one
row per partition) is loaded once, every reduction and elementwise step runs on chip, and the
result is stored once: HBM sees each input and the output once, the minimum.

The pass grows a group around each reduction: elementwise producers whose value is read only inside
the group, and elementwise consumers and further reductions reading the group's values. A group is
kept when it computes a normalisation (a full-row value reads a reduced one), has one value leaving
it, and its whole-row tiles fit SBUF (`rowwise_sbuf_bytes`, against the target's budget from the
cost model); otherwise the graph is left as it was, for the other fusion passes.

The result is `Op.ROWWISE` with attrs: body (a tuple of `ir.Step`, REDUCE_LAST steps reducing the
columns), rows, cols, views (per input: (element offset, (row stride, column stride)); a column
stride of 0 is a per-row value, a row stride of 0 a per-column one such as a norm's weight) and
out_strides (how the [R, C] result is stored into the node's dense buffer).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from neuronc import ir
from neuronc.ir import Op, Step
from neuronc.isa import DType
from neuronc.passes.cost_model import SBUF_PAGE_BYTES, fits_sbuf
from neuronc.passes.legalize import dense_strides, reshaped_strides
from neuronc.targets import Target, get_target

MAX_INPUTS = 8
MAX_STEPS = 64
REDUCTIONS = ("add", "max", "min")  # what TENSOR_REDUCE computes
BUFS = 2  # buffers of each whole-row tile: the next row tile loads while this one is computed
# With room for twice as many, row tiles may be computed in pairs, their steps interleaved, so that the engines'
# in-order queues hold two independent chains; else, with room for one more, two row tiles are loaded ahead.
# Which way a kernel goes is its "schedule" (passes/rowwise_schedule.py, priced), codegen follows it.
PAIRED_BUFS = 2 * BUFS
BUF_CHOICES = (PAIRED_BUFS, BUFS + 1, BUFS)


# Reading values through reshapes and views --------------------------------------------------------


def _links(node) -> bool:
    return node.op in (Op.RESHAPE, Op.VIEW)


def _resolve(x):
    """(source, offset, strides over x.shape): the materialised value x reads through its chain of
    reshapes (aliases) and views, as element offset and strides into the source's dense buffer, or
    None when no single strided view says it (a view of a strided view that does not merge)."""
    offset, strides, shape = 0, dense_strides(x.shape), x.shape
    while _links(x):
        if x.op is Op.VIEW:
            if offset or strides != dense_strides(shape):
                return None
            strides = reshaped_strides(x.shape, x.attrs["strides"], shape)
            if strides is None:
                return None
            offset, strides = x.attrs["offset"], tuple(strides)
        x = x.inputs[0]  # a reshape's bytes are its operand's
    return x, offset, tuple(strides)


# The [R, C] frame of a group ------------------------------------------------------------------


class Frame:
    """Rows and columns of a group, and how a dense tensor of the group's full shape maps onto them:
    each of the two axes is a merge of axes of `shape` (`groups`, innermost first)."""

    def __init__(self, shape, rows, cols, groups):
        self.shape, self.rows, self.cols, self.groups = tuple(shape), rows, cols, groups
        self.dense = self.strides(dense_strides(shape))

    def strides(self, strides):
        """(row stride, column stride) of a tensor of `shape` read with `strides`, or None."""
        result = []
        for axes in self.groups:
            if not axes:
                result.append(0)
                continue
            size, first = 1, strides[axes[0]]
            for a in axes:
                if strides[a] != first * size:
                    return None
                size *= self.shape[a]
            result.append(first)
        return tuple(result)


def _frame(shape, rows, cols, strides):
    """The Frame in which a dense tensor of `shape` read with (row, col) element strides `strides`
    is an [rows, cols] matrix, or None when the two axes are not merges of the tensor's axes."""
    dense = dense_strides(shape)
    free = {a for a, n in enumerate(shape) if n > 1}
    groups = []
    for stride, size in zip(strides, (rows, cols)):
        axes, covered = [], 1
        while covered < size:
            step = stride * covered
            match = [a for a in free if dense[a] == step and size % (covered * shape[a]) == 0]
            if not match:
                return None
            axes.append(match[0])
            free.discard(match[0])
            covered *= shape[match[0]]
        groups.append(axes)
    if free:
        return None
    return Frame(shape, rows, cols, groups)


# Growing a group ----------------------------------------------------------------------------


class _Group:
    def __init__(self, consumers: dict, outputs: set, seed):
        self.consumers = consumers  # of the whole graph (Graph.consumers), shared by every group
        self.outputs = outputs
        self.seed = seed
        self.frame = None
        self.members: dict = {}  # node -> "full" | "row"

    def users(self, node) -> set:
        """The non-link nodes that read `node`, through chains of reshapes and views."""
        found, stack = set(), [node]
        while stack:
            for c in self.consumers.get(stack.pop(), ()):
                (stack.append if _links(c) else found.add)(c)
        return found

    def escapes(self, node) -> bool:
        if node in self.outputs or any(_links(c) and c in self.outputs for c in self._link_closure(node)):
            return True
        return not self.users(node) <= set(self.members)

    def _link_closure(self, node):
        found, stack = [], [node]
        while stack:
            for c in self.consumers.get(stack.pop(), ()):
                if _links(c):
                    found.append(c)
                    stack.append(c)
        return found

    # how a node of `kind` reads one of its inputs, in the frame: (source, offset, (row stride, col stride))
    def read(self, consumer, kind, x):
        resolved = _resolve(x)
        if resolved is None:
            return None
        source, offset, strides = resolved
        if consumer.op is Op.REDUCE_LAST:
            return (source, offset, strides) if len(strides) == 2 else None
        if kind == "full":
            mapped = self.frame.strides(strides) if x.shape == self.frame.shape else None
        else:  # a per-row or per-column value: its elements in row-major order along its axis
            size = self.frame.rows if kind == "row" else self.frame.cols
            flat = reshaped_strides(x.shape, strides, (size,))
            mapped = None if flat is None else (flat[0], 0) if kind == "row" else (0, flat[0])
        return None if mapped is None else (source, offset, mapped)

    def shape_kind(self, node):
        """What a node computes in the frame by its shape: the full [R, C] values, or one per row."""
        if node.op is Op.REDUCE_LAST:
            return "row"
        if node.shape == self.frame.shape:
            return "full"
        return "row" if node.size == self.frame.rows else None

    def admissible(self, node, kind) -> bool:
        """Whether `node` may be computed in the group as `kind`: each input is a scalar, a member read
        as the group holds it, or a value from outside read in the frame."""
        if kind is None or node.op not in ir.ELEMENTWISE and not (
                node.op is Op.REDUCE_LAST and node.attrs["kind"] in REDUCTIONS and node.dtype.is_float
                and node.inputs[0].shape == (self.frame.rows, self.frame.cols)):
            return False
        for x in node.inputs:
            if x.scalar is not None:
                continue
            read = self.read(node, kind, x)
            if read is None:
                return False
            source, offset, strides = read
            if source in self.members and not self.holds(source, offset, strides):
                return False
            if kind == "col" and source in self.members and self.members[source] != "col":
                return False
        return True

    def holds(self, member, offset, strides) -> bool:
        """Whether a read of a member with this view gets the member's values as the group holds them."""
        return not offset and self.layout_is(self.members[member], strides)

    def layout_is(self, kind, strides) -> bool:
        if kind == "full":
            return strides == self.frame.dense
        if kind == "col":
            return strides[0] == 0 and (strides[1] == 1 or self.frame.cols == 1)
        return strides[1] == 0 and (strides[0] == 1 or self.frame.rows == 1)

    def producer_kind(self, consumer, x):
        """(source, the kind it would have as a member) of what member `consumer` reads through `x`:
        the kind whose layout the read is (a per-column value is a norm's weight converted, say)."""
        read = self.read(consumer, self.members[consumer], x)
        if read is None:
            return None, None
        source, offset, strides = read
        sizes = {"full": math.prod(self.frame.shape), "row": self.frame.rows, "col": self.frame.cols}
        for kind in ("full", "row", "col"):
            shaped = source.shape == self.frame.shape if kind == "full" else source.size == sizes[kind]
            if shaped and not offset and self.layout_is(kind, strides) and (kind != "full" or self.shape_kind(source)):
                return source, kind
        return source, None

    def grow(self) -> bool:
        seed = self.seed
        resolved = _resolve(seed.inputs[0])
        if resolved is None:
            return False
        source, offset, strides = resolved
        rows, cols = seed.inputs[0].shape
        if offset or len(strides) != 2:
            return False
        self.frame = _frame(source.shape, rows, cols, strides)
        if self.frame is None or self.frame.dense != strides:
            return False
        self.members[seed] = "row"
        changed = True
        while changed:
            changed = False
            for member in list(self.members):
                for user in self.users(member):  # consumers computed in the group too
                    if user not in self.members and self.admissible(user, self.shape_kind(user)):
                        self.members[user] = self.shape_kind(user)
                        changed = True
                for x in member.inputs:  # producers read only inside the group
                    if x.scalar is not None:
                        continue
                    source, kind = self.producer_kind(member, x)
                    if (source is not None and source not in self.members and source not in self.outputs
                            and self.users(source) <= set(self.members) and not _reads_a_product(source)
                            and self.admissible(source, kind)):
                        self.members[source] = kind
                        changed = True
        return True

    def prune(self, order: dict):
        """Drop the latest escaping members until one value leaves the group; the root, or None."""
        while self.members:
            escaping = [m for m in self.members if self.escapes(m)]
            if len(escaping) == 1 and self._consistent():
                return escaping[0]
            if not escaping:
                return None
            del self.members[max(escaping, key=order.get)]
        return None

    def _consistent(self) -> bool:
        """Every member still reads only admissible inputs (pruning can remove what one relied on)."""
        return all(self.admissible_now(m) for m in self.members)

    def admissible_now(self, node) -> bool:
        members = self.members
        self.members = {k: v for k, v in members.items() if k is not node}
        ok = self.admissible(node, members[node])
        self.members = members
        return ok


def _reads_a_product(node) -> bool:
    """Whether node reads a matmul's result: it is left to be the matmul's epilogue (fusion.py), where
    it is computed from PSUM on the product's way out at no HBM cost."""
    return any(ir.unreshaped(x).op is Op.MATMUL for x in node.inputs)


def _externals_independent(members: dict, externals: list) -> bool:
    """No input of the group depends on a value computed in it (that would be a cycle)."""
    stack, seen = list(externals), set()
    while stack:
        n = stack.pop()
        if n in members:
            return False
        if n not in seen:
            seen.add(n)
            stack.extend(n.inputs)
    return True


# Building the kernel node -----------------------------------------------------------------------


def _body(group: _Group, order: dict, root):
    """(steps, externals [(node, view)]) of a group, in topological order, identical steps shared."""
    members = sorted(group.members, key=order.get)
    index, steps, externals, seen = {}, [], [], {}
    for m in members:
        args = []
        for x in m.inputs:
            if x.scalar is not None:
                args.append(("imm", x.scalar))
                continue
            source, offset, strides = group.read(m, group.members[m], x)
            if source in group.members:
                args.append(("step", index[source]))
            else:
                view = (offset, strides)
                if (source, view) not in externals:
                    externals.append((source, view))
                args.append(("input", externals.index((source, view))))
        attrs = {"kind": m.attrs["kind"]} if m.op is Op.REDUCE_LAST else m.attrs
        step = Step(m.op, tuple(args), m.dtype, attrs)
        key = (step.op, step.args, step.dtype, tuple(sorted((k, repr(v)) for k, v in attrs.items())))
        if key in seen and m is not root:
            index[m] = seen[key]  # the same value computed twice (layer-norm's two means): once
            continue
        seen[key] = index[m] = len(steps)
        steps.append(step)
    if index[root] != len(steps) - 1:
        return None, None
    return tuple(steps), externals


def input_kind(view) -> str:
    """"full", "row" (one value per row), "col" (one per column, the same for every row) or "row" for
    one value for everything, by the (row, column) strides of an input's view."""
    _, (sr, sc) = view
    return "full" if sr and sc else "col" if sc else "row"


def step_kinds(body, views) -> list:
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


def _tiles(args) -> tuple:
    return tuple(a for a in args if a[0] != "imm")


class Plain(NamedTuple):
    """The step as it is: one instruction (TENSOR_REDUCE for a reduction)."""
    args: tuple

    @property
    def reads(self):
        return _tiles(self.args)


class Alu2(NamedTuple):
    """(a op b), then op1 with c unless op1 is None: one TENSOR_ALU2."""
    a: tuple
    b: tuple
    op: Op
    c: tuple | None = None
    op1: Op | None = None

    @property
    def reads(self):
        return (self.a, self.b) + ((self.c,) if self.c else ())


class Summed(NamedTuple):
    """act(scale * src + bias) and its row sum, step `row_sum`: one ACTIVATE_BIAS_REDUCE. The bias is 0 without a
    shift; with one, the shift itself when `negated` (scale -1: a square of m - x) or else -shift (scale 1)."""
    act: Op  # an activation, or MULTIPLY for a square
    src: tuple
    row_sum: int
    shift: tuple | None = None
    negated: bool = False

    @property
    def reads(self):
        return (self.src,) + ((self.shift,) if self.shift else ())


class Act(NamedTuple):
    """act(scale * src + bias) with immediate scale and bias: one ACTIVATE."""
    act: Op
    src: tuple
    scale: float
    bias: float

    @property
    def reads(self):
        return (self.src,)


class RowSum(NamedTuple):
    """The fp32 row sum of src: TENSOR_REDUCE, or an identity ACTIVATE_BIAS_REDUCE on the Scalar engine."""
    src: tuple

    @property
    def reads(self):
        return (self.src,)


class TilePlan(NamedTuple):
    instrs: dict  # step -> how it is computed (Plain, Alu2, ...), in step order; col steps are Plain
    out_step: int  # the step whose instruction writes the output tile
    slots: dict  # step -> its tile slot of its kind; a Summed's row sum has one too. The out step has none, nor
    # a full value nothing reads (it goes to one scratch tile of the kernel, written by the Scalar engine alone)
    count: dict  # kind -> slots


def _square(step) -> bool:
    return (step.op is Op.MULTIPLY and step.args[0] == step.args[1]) or (
        step.op is Op.POWER and step.args[1] == ("imm", 2.0))


def tile_plan(body, views, input_dtypes) -> TilePlan:
    """How each step of a ROWWISE body is computed per row tile (see above), and the tile slots that takes."""
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
        if isinstance(inner, Plain) and body[arg[1]].op in ARITHMETIC and len(_tiles(inner.args)) == 2:
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
              and len(_tiles(body[args[0][1]].args)) == 1 and body[args[0][1]].args[1][0] == "imm"):
            u = body[args[0][1]]
            scale, bias = _AFFINE[u.op](float(u.args[1][1]))
            add(j, Act(step.op, resolve(u.args[0]), scale, bias))
        elif step.op in ARITHMETIC and kinds[j] == "full" and step.dtype.is_float and len(_tiles(args)) == 2:
            add(j, _arithmetic(step.op, args, one_op, per_row, lambda u: only_reader(u, j)))
        else:
            add(j, Plain(args))
    out_step = last
    root = body[last]
    if (root.op is Op.CONVERT and root.dtype.is_float and root.args[0][0] == "step" and last in instrs
            and users[root.args[0][1]] == [last] and body[root.args[0][1]].dtype == DType.F32
            and kinds[root.args[0][1]] == "full" and not isinstance(instrs.get(root.args[0][1]), (Summed, type(None)))):
        out_step = root.args[0][1]  # it writes the output tile, rounding to its dtype: the convert, done
        del instrs[last]
    live = _live(instrs, out_step, kinds)
    instrs = {j: instr for j, instr in instrs.items() if j in live}
    slots, count = _slots(body, instrs, out_step, kinds)
    return TilePlan(instrs, out_step, slots, count)


def tail_steps(body, views, plan: TilePlan) -> tuple:
    """The last instructions of a row tile's plan that are elementwise over full rows (no reduction, no row sum),
    ending with the output's: each column of them needs only the same columns of what it reads, so they may be
    computed a part of the columns at a time, the parts on different engines (a schedule's `cut`)."""
    kinds = step_kinds(body, views)
    tail = []
    for j in reversed([j for j in plan.instrs if kinds[j] != "col"]):
        instr = plan.instrs[j]
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


def _live(instrs, out_step, kinds) -> set:
    """The steps the output needs, through what each instruction reads."""
    live, stack = set(), [out_step]
    while stack:
        j = stack.pop()
        if j in live:
            continue
        live.add(j)
        instr = instrs.get(j)
        if instr is None:  # a Summed's row sum: made by the Summed before it
            stack.append(j - 1)
            continue
        stack.extend(a[1] for a in instr.reads if a[0] == "step")
    return live


OUT_SLOT = "out"  # the slot of a value kept in the output tile


def _slots(body, instrs, out_step, kinds) -> tuple:
    """Linear-scan tile slots per kind over the instructions: a value's slot is free after its last reader (a full
    tile may be rewritten in place by its last reader, elementwise; a per-row one only after it)."""
    made = {}  # step -> the instruction index making it
    for j, instr in instrs.items():
        made[j] = j
        if isinstance(instr, Summed):
            made[instr.row_sum] = j
    last = {v: at for v, at in made.items()}
    for j, instr in instrs.items():
        for a in instr.reads:
            if a[0] == "step":
                last[a[1]] = max(last[a[1]], j)
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


def needs_constants(body) -> bool:
    """Whether a SELECT of the body takes a constant (codegen makes it a tile per row tile)."""
    return any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body)


def rowwise_sbuf_bytes(body, views, input_dtypes, out_dtype: DType, cols: int, bufs: int = BUFS) -> int:
    """Bytes per partition the ROWWISE kernel allocates with `bufs` buffers per row tile (codegen allocates
    exactly these tiles)."""
    count = tile_plan(body, views, input_dtypes).count

    def slot(elements, itemsize):
        return -(-elements * itemsize // SBUF_PAGE_BYTES) * SBUF_PAGE_BYTES

    wide = max([DType.F32.itemsize, out_dtype.itemsize] + [s.dtype.itemsize for s in body])
    total = slot(cols, wide) * bufs * (count["full"] + needs_constants(body))  # full temporaries, SELECT constants
    total += slot(1, wide) * bufs * (count["row"] + 1) + slot(cols, wide) * count["col"]
    total += slot(1, wide) + slot(cols, wide)  # a zero bias and the Scalar engine's scratch tile
    for dtype, (_, (sr, sc)) in zip(input_dtypes, views):
        total += slot(cols if sc else 1, dtype.itemsize) * (1 if sr == 0 else bufs)
    return total + slot(cols, wide) * bufs  # the output tile


def fuse_rowwise(graph: ir.Graph, target: Target | None = None) -> ir.Graph:
    """Each row-wise normalisation becomes one ROWWISE kernel when its row tiles fit SBUF."""
    target = target or get_target()
    nodes = graph.nodes()
    order = {n: i for i, n in enumerate(nodes)}
    taken, roots = set(), {}
    consumers, outputs = graph.consumers(), set(graph.outputs)
    for seed in nodes:
        if seed.op is not Op.REDUCE_LAST or seed in taken:
            continue
        group = _Group(consumers, outputs, seed)
        if not group.grow():
            continue
        root = group.prune(order)
        if root is None or group.members[root] != "full" or taken & set(group.members):
            continue
        body, externals = _body(group, order, root)
        if body is None or len(body) > MAX_STEPS or len(externals) > MAX_INPUTS:
            continue
        views = [view for _, view in externals]
        kinds = step_kinds(body, views)
        if kinds[-1] != "full" or not any(s.op is Op.REDUCE_LAST for s in body):
            continue
        reads_reduced = any(kinds[j] == "full" and any(a[0] == "step" and kinds[a[1]] == "row" for a in s.args)
                            for j, s in enumerate(body))
        if not reads_reduced or not _externals_independent(group.members, [x for x, _ in externals]):
            continue
        frame = group.frame
        dtypes = [x.dtype for x, _ in externals]
        fitting = [bufs for bufs in BUF_CHOICES
                   if fits_sbuf(rowwise_sbuf_bytes(body, views, dtypes, root.dtype, frame.cols, bufs), target)]
        if frame.cols > target.max_free_elements_sbuf or not fitting:
            continue
        from neuronc.passes.rowwise_schedule import choose_schedule  # it prices this module's tile plans

        schedule = choose_schedule(body, views, dtypes, root.dtype, frame.rows, frame.cols, fitting, target)
        taken |= set(group.members)
        roots[root] = (body, externals, frame, schedule)
    if not roots:
        return graph
    return _rewrite(graph, roots)


def _rewrite(graph: ir.Graph, roots: dict) -> ir.Graph:
    new_of: dict = {}

    def fuse(node, inputs):
        for old, new in zip(node.inputs, inputs):
            new_of[old] = new
        if node not in roots:
            return None
        body, externals, frame, schedule = roots[node]
        return ir.node(Op.ROWWISE, [new_of.get(x, x) for x, _ in externals], node.shape, node.dtype, node.loc,
                       body=body, views=tuple(v for _, v in externals), rows=frame.rows, cols=frame.cols,
                       out_strides=frame.dense, schedule=schedule)

    for p in graph.params:
        new_of[p] = p
    return graph.rewrite(fuse)
