"""A row reduction read only by row-wise kernels, from rows they load themselves, is computed by them.

A layer-norm's backward recomputes the forward's statistics from x (part 9 of issue 16: the forward saves none):
mean = sum(x) / C and rstd = rsqrt(sum((x - mean)^2) / C + eps), two REDUCE_LAST kernels each loading all of x,
the second the first's result too. Once the weight gradient's sum over tokens is the row-wise grad-input kernel's
(passes/rowwise_column_sums.py), that kernel is their only reader, and it loads x's rows itself: the reductions
become steps of its body (their prologue, the row sum, their epilogue), which its tile plan computes as the
reduction kernels did (a row sum, or an activation's, as one ACTIVATE_BIAS_REDUCE over a row of C values, the
per-row steps after it): the same values, and the kernels and their loads of x go. A reduction read by another
reduction (the mean, read by the variance's) is taken once its reader is.
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.plans import ReducePlan, RowwisePlan
from neuronc.passes.context import PassContext
from neuronc.passes.cost_model import fits_sbuf
from neuronc.passes.rowwise import rebuilt_rowwise
from neuronc.passes.rowwise_plan import rowwise_sbuf_bytes, tail_steps, tile_plan

_PER_ROW = (0, (1, 0))


def _read_per_row(reduction: ir.Node, consumers: dict, outputs: set) -> list | None:
    """[(row-wise kernel, its input index)] reading the reduction (or a reshape of it to [..., rows, 1]) as one
    value a row, or None when anything else reads it."""
    found, stack = [], [reduction]
    while stack:
        x = stack.pop()
        if x in outputs:
            return None
        for reader in consumers.get(x, ()):
            if reader.op is Op.RESHAPE and reader.shape and reader.shape[-1] == 1:
                stack.append(reader)
                continue
            if reader.op is not Op.ROWWISE or not isinstance(reader.attrs.get("plan"), RowwisePlan):
                return None
            slots = [k for k, y in enumerate(reader.inputs) if y is x]
            if any(tuple(reader.attrs["views"][k]) != _PER_ROW for k in slots):
                return None
            found += [(reader, k) for k in slots]
    return found


def _foldable(node: ir.Node) -> bool:
    plan = node.attrs.get("plan")
    return (node.op is Op.REDUCE_LAST and isinstance(plan, ReducePlan) and node.shape and plan.rows == node.shape[-1]
            and all(s.dtype == DType.F32 for s in plan.prologue) and not any(
                a[0] == "input" and a[1] != 0 for s in plan.epilogue for a in s.args)
            and (plan.epilogue or node.dtype == DType.F32))


def _folded(row: ir.Node, reduction: ir.Node, slots: set, target) -> ir.Node | None:
    """`row` computing `reduction` itself in place of reading it at its inputs `slots`, or None."""
    plan: ReducePlan = reduction.attrs["plan"]
    rows, cols = row.attrs["rows"], row.attrs["cols"]
    if plan.rows != rows or plan.cols != cols:
        return None
    views = [(v[0], tuple(v[1])) for v in row.attrs["views"]]
    mapped = {}
    for i, (x, view) in enumerate(zip(reduction.inputs, plan.views)):
        want = (view.offset, tuple(view.strides))
        match = [k for k, y in enumerate(row.inputs) if y is x and views[k] == want]
        if not match:
            return None
        mapped[i] = match[0]
    steps = []
    for step in plan.prologue:
        steps.append(ir.Step(step.op, tuple(("input", mapped[a[1]]) if a[0] == "input" else a for a in step.args),
                             step.dtype, step.attrs))
    source = ("step", len(steps) - 1) if steps else ("input", mapped[0])
    steps.append(ir.Step(Op.REDUCE_LAST, (source,), DType.F32, {"kind": plan.kind}))
    reduced = len(steps) - 1
    for step in plan.epilogue:
        steps.append(ir.Step(step.op, tuple(("step", reduced + 1 + a[1]) if a[0] == "step" else ("step", reduced)
                                            if a[0] == "input" else a for a in step.args), step.dtype, step.attrs))
    value, n = ("step", len(steps) - 1), len(steps)
    body = [*steps]
    for step in row.attrs["body"]:
        args = tuple(value if a[0] == "input" and a[1] in slots else ("step", a[1] + n) if a[0] == "step" else a
                     for a in step.args)
        body.append(ir.Step(step.op, args, step.dtype, step.attrs))
    used = sorted({a[1] for s in body for a in s.args if a[0] == "input"})
    renumber = {old: k for k, old in enumerate(used)}
    body = tuple(ir.Step(s.op, tuple(("input", renumber[a[1]]) if a[0] == "input" else a for a in s.args), s.dtype,
                         s.attrs) for s in body)
    inputs, views = [row.inputs[k] for k in used], tuple(row.attrs["views"][k] for k in used)
    made = rebuilt_rowwise(row, inputs, views, body, target)
    if made is None:
        return None
    old: RowwisePlan = row.attrs["plan"]
    if old.sums:  # its sums over rows (passes/rowwise_column_sums.py) kept, their steps renumbered
        summed = tuple(j + n for j in old.sums)
        dtypes, schedule = [x.dtype for x in inputs], made.attrs["schedule"]
        sum_dtypes = tuple(dtype for _, dtype in row.attrs["outputs"][1:])
        if not fits_sbuf(rowwise_sbuf_bytes(body, views, dtypes, row.dtype, cols, schedule.bufs, summed, sum_dtypes),
                         target):
            return None
        tile = tile_plan(body, views, dtypes, summed, cols)
        plan_ = dataclasses.replace(made.attrs["plan"], tile=tile, sums=summed, sum_bank=old.sum_bank,
                                    tail=tail_steps(body, views, tile) if schedule.cut else ())
        made = ir.Node(Op.ROWWISE, made.inputs, made.shape, made.dtype,
                       {**made.attrs, "plan": plan_, "outputs": row.attrs["outputs"]}, made.loc)
    return made


def _fold_round(graph: ir.Graph, ctx: PassContext) -> ir.Graph | None:
    """The graph with every reduction foldable now folded into its readers (a kernel takes one a round), or None."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    new: dict = {}  # row-wise kernel -> itself computing a reduction
    for node in graph.nodes():
        if not _foldable(node):
            continue
        readers = _read_per_row(node, consumers, outputs)
        if not readers or any(row in new for row, _ in readers):
            continue
        rows: dict = {}
        for row, k in readers:
            rows.setdefault(row, set()).add(k)
        made = {row: _folded(row, node, slots, ctx.target) for row, slots in rows.items()}
        if all(n is not None for n in made.values()):
            new.update(made)
    if not new:
        return None

    def replace(old: ir.Node, inputs: tuple) -> ir.Node | None:
        if old not in new:
            return None
        kept, made = dict(zip(old.inputs, inputs)), new[old]
        return ir.Node(Op.ROWWISE, tuple(kept[x] for x in made.inputs), made.shape, made.dtype, made.attrs, made.loc)

    return graph.rewrite(replace)


def recompute_statistics_in_rowwise(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each row reduction read only by row-wise kernels loading its rows is computed by them, readers first."""
    while (folded := _fold_round(graph, ctx)) is not None:
        graph = folded
    return graph
