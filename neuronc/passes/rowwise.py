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

from neuronc import ir
from neuronc.ir import Op, Step
from neuronc.passes.context import PassContext
from neuronc.passes.cost_model import fits_sbuf
from neuronc.passes.legalize import dense_strides, reshaped_strides
from neuronc.passes.rowwise_plan import (ACTIVATION_OPS, BUF_CHOICES, BUFS, PAIRED_BUFS,  # noqa: F401 (re-exported)
                                         needs_constants, rowwise_sbuf_bytes, step_kinds, tail_steps, tile_plan)
from neuronc.passes import rowwise_schedule
from neuronc.passes.rowwise_schedule import per_row_alu, split_engines
from neuronc.passes.structural_key import keyed_once, once_per_key
from neuronc.plans import RowwisePlan, Schedule
from neuronc.targets import Target

MAX_INPUTS = 8
MAX_STEPS = 64
REDUCTIONS = ("add", "max", "min")  # what TENSOR_REDUCE computes
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
    def __init__(self, consumers: dict, outputs: set, seed, known: dict | None = None):
        self.consumers = consumers  # of the whole graph (Graph.consumers), shared by every group
        self.outputs = outputs
        self.seed = seed
        self.frame = None
        self.members: dict = {}  # node -> "full" | "row"
        # what depends on the graph alone, shared by the pass's groups: ("users", node) -> users(node), ("resolved",
        # node) -> _resolve(node) (a layer's groups ask about the same nodes again and again while growing)
        self.known = {} if known is None else known

    def users(self, node) -> set:
        """The non-link nodes that read `node`, through chains of reshapes and views (the set is shared: not to be
        changed)."""
        key = ("users", node)
        found = self.known.get(key)
        if found is None:
            found, stack = set(), [node]
            while stack:
                for c in self.consumers.get(stack.pop(), ()):
                    (stack.append if _links(c) else found.add)(c)
            self.known[key] = found
        return found

    def resolved(self, x):
        """_resolve(x), once per node of the graph."""
        key = ("resolved", x)
        if key not in self.known:
            self.known[key] = _resolve(x)
        return self.known[key]

    def read_only_inside(self, node) -> bool:
        """Whether every user of `node` is a member."""
        members = self.members
        return all(u in members for u in self.users(node))

    def escapes(self, node) -> bool:
        if node in self.outputs or any(_links(c) and c in self.outputs for c in self._link_closure(node)):
            return True
        return not self.read_only_inside(node)

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
        resolved = self.resolved(x)
        if resolved is None:
            return None
        source, offset, strides = resolved
        if consumer.op is Op.REDUCE_LAST:
            return (source, offset, self.in_frame(strides)) if len(strides) == 2 else None
        if kind == "full":
            mapped = self.frame.strides(strides) if x.shape == self.frame.shape else None
        else:  # a per-row or per-column value: its elements in row-major order along its axis
            size = self.frame.rows if kind == "row" else self.frame.cols
            flat = reshaped_strides(x.shape, strides, (size,))
            mapped = None if flat is None else (flat[0], 0) if kind == "row" else (0, flat[0])
        return None if mapped is None else (source, offset, self.in_frame(mapped))

    def in_frame(self, strides):
        """(row stride, column stride) with the row stride of a frame of one row 0: it steps over nothing, and a
        decode step's [1, C] rows are read with the stride C (the frame's own dense layout says 0)."""
        return (0, strides[1]) if self.frame.rows == 1 else tuple(strides)

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
        resolved = self.resolved(seed.inputs[0])
        if resolved is None:
            return False
        source, offset, strides = resolved
        rows, cols = seed.inputs[0].shape
        if offset or len(strides) != 2:
            return False
        self.frame = _frame(source.shape, rows, cols, strides)
        if self.frame is None or self.frame.dense != self.in_frame(strides):
            return False
        self.members[seed] = "row"
        producers: dict = {}  # (member, input) -> producer_kind(member, input)
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
                    if (member, x) not in producers:  # a member's kind and the frame are fixed while growing
                        producers[member, x] = self.producer_kind(member, x)
                    source, kind = producers[member, x]
                    if (source is not None and source not in self.members and source not in self.outputs
                            and self.read_only_inside(source) and not _reads_a_product(source)
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


def _externals_independent(members: dict, externals: list, order: dict) -> bool:
    """No input of the group depends on a value computed in it (that would be a cycle). A path from a member to an
    input passes only through nodes later in the topological `order` than that member, so the walk leaves out the
    nodes before the earliest member (in a stack of layers, every earlier layer: a walk per group through them all
    grew with the square of the layers)."""
    earliest = min(order[m] for m in members)
    stack, seen = [x for x in externals if order[x] > earliest], set()
    while stack:
        n = stack.pop()
        if n in members:
            return False
        if n not in seen:
            seen.add(n)
            stack.extend(i for i in n.inputs if order[i] > earliest)
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


def fuse_rowwise(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each row-wise normalisation becomes one ROWWISE kernel when its row tiles fit SBUF."""
    target = ctx.target
    nodes = graph.nodes()
    order = {n: i for i, n in enumerate(nodes)}
    taken, roots = set(), {}
    consumers, outputs = graph.consumers(), set(graph.outputs)
    known: dict = {}  # the groups' shared answers about the graph (_Group.known)
    fits: dict = {}  # structural key of a body, its views and dtypes -> the buffer counts that fit SBUF
    for seed in nodes:
        if seed.op is not Op.REDUCE_LAST or seed in taken:
            continue
        group = _Group(consumers, outputs, seed, known)
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
        if not reads_reduced or not _externals_independent(group.members, [x for x, _ in externals], order):
            continue
        frame = group.frame
        dtypes = [x.dtype for x, _ in externals]
        known = keyed_once(body, *views)  # keyed once for the fit, the schedule and the plan (the same objects)
        fitting = _fitting(body, views, dtypes, root.dtype, frame.cols, target, fits, known)
        if frame.cols > target.max_free_elements_sbuf or not fitting:
            continue
        schedule = rowwise_schedule.choose_schedule(body, views, dtypes, root.dtype, frame.rows, frame.cols, fitting, target,
                                                    known)
        taken |= set(group.members)
        roots[root] = (body, externals, frame, schedule, known)
    if not roots:
        return graph
    return _rewrite(graph, roots, target)


def _fitting(body: tuple, views: list, dtypes: list, out_dtype, cols: int, target: Target, fits: dict,
             known: dict | None = None) -> list:
    """The buffer counts (BUF_CHOICES) with which the kernel's row tiles fit SBUF: computed once per distinct kernel
    of a pass (`fits`, keyed by rowwise_schedule.structural_key; a model's N copies of a layer norm are one).
    `known`: keys made before of the body and views (structural_key.keyed_once)."""
    return list(once_per_key(fits, lambda: rowwise_schedule.structural_key((body, views, dtypes, out_dtype, cols), known),
                             lambda: [bufs for bufs in BUF_CHOICES if fits_sbuf(
                                 rowwise_sbuf_bytes(body, views, dtypes, out_dtype, cols, bufs), target)]))


def rowwise_plan(body: tuple, views: tuple, input_dtypes: list, schedule: Schedule, target: Target,
                 cols: int | None = None) -> RowwisePlan:
    """The kernel plan of a ROWWISE node: its schedule, its row tile's instructions (passes/rowwise_plan.py)."""
    tile = tile_plan(body, views, input_dtypes, cols=cols)
    return RowwisePlan(schedule=schedule, tile=tile, kinds=tuple(step_kinds(body, views)),
                       tail=tail_steps(body, views, tile) if schedule.cut else (),
                       split_engines=split_engines(target), needs_constants=needs_constants(body),
                       scalar_steps=tuple(per_row_alu(step) for step in body))


def _rowwise_node(inputs: list, body: tuple, views: tuple, like, rows: int, cols: int, out_strides, schedule: Schedule,
                  target: Target, plans: dict | None = None, known: dict | None = None) -> ir.Node:
    """The ROWWISE node; with `plans`, its plan made once per distinct (body, views, dtypes, schedule) and shared
    (`known`: keys made before of the body and views, structural_key.keyed_once)."""
    dtypes = [x.dtype for x in inputs]
    if plans is None:
        plan = rowwise_plan(body, views, dtypes, schedule, target, cols)
    else:
        plan = once_per_key(plans, lambda: rowwise_schedule.structural_key((body, views, dtypes, schedule, cols), known),
                            lambda: rowwise_plan(body, views, dtypes, schedule, target, cols))
    return ir.node(Op.ROWWISE, inputs, like.shape, like.dtype, like.loc, body=body, views=views, rows=rows, cols=cols,
                   out_strides=out_strides, schedule=schedule, plan=plan)


def rebuilt_rowwise(node, inputs: list, views: tuple, body: tuple, target: Target):
    """A ROWWISE node computing `body` from `inputs` (read through `views`) over node's rows, its schedule chosen
    again; None when its row tiles no longer fit SBUF."""
    rows, cols = node.attrs["rows"], node.attrs["cols"]
    dtypes = [x.dtype for x in inputs]
    fitting = [bufs for bufs in BUF_CHOICES
               if fits_sbuf(rowwise_sbuf_bytes(body, views, dtypes, node.dtype, cols, bufs), target)]
    if not fitting:
        return None
    schedule = rowwise_schedule.choose_schedule(body, views, dtypes, node.dtype, rows, cols, fitting, target)
    return _rowwise_node(inputs, body, views, node, rows, cols, node.attrs["out_strides"], schedule, target)


def _rewrite(graph: ir.Graph, roots: dict, target: Target) -> ir.Graph:
    new_of: dict = {}
    plans: dict = {}  # one plan per distinct kernel (_rowwise_node)

    def fuse(node, inputs):
        for old, new in zip(node.inputs, inputs):
            new_of[old] = new
        if node not in roots:
            return None
        body, externals, frame, schedule, known = roots[node]
        inputs = [new_of.get(x, x) for x, _ in externals]
        return _rowwise_node(inputs, body, tuple(v for _, v in externals), node, frame.rows, frame.cols, frame.dense,
                             schedule, target, plans, known)

    for p in graph.params:
        new_of[p] = p
    return graph.rewrite(fuse)
