"""A sum over tokens computed from the rows a row-wise kernel loads is that kernel's second output.

A layer-norm's backward has a row-wise kernel making the grad-input rows from dy, x and the per-token statistics
(one token a partition, 128 tokens a row tile, its rows whole), and the weight gradient's sum over tokens,
(dy * x_hat).sum(0), a kernel of its own (codegen/partition_sum.py) loading the same dy and x tiles, 128 tokens a
tile, to compute the same x_hat again. Here the sum's prologue becomes steps of the row-wise body (those it
already computes taken as they are: x_hat; the one new: dy * x_hat) and the row-wise kernel sums that step over
its rows as the sum's kernel would: ones[128, 1]^T @ each row tile, fp32 in PSUM banks of 512 columns, row tiles
in order, rounded once on the way out (RowwisePlan.sums): the same values, matmuls and order, the same bits. The
sum becomes a KERNEL_OUTPUT of the row-wise kernel (placed by the memory plan with it) and its kernel goes.

Applied when every input of the sum is an input of the row-wise kernel read the same way (its rows, or one value
a token), the sum's tiles are the row tiles (128 tokens, all its outputs in one group), the summed step is over
full rows, and the row tiles still fit SBUF with the value held to the tile's end. The row-wise schedule is kept
as it was chosen (its pricing does not see the new step nor the Tensor engine's matmuls).
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.plans import PartitionSumPlan, RowwisePlan
from neuronc.passes.context import PassContext
from neuronc.passes.rowwise import rowwise_plan
from neuronc.passes.rowwise_plan import rowwise_sbuf_bytes, step_kinds, tail_steps, tile_plan
from neuronc.passes.cost_model import fits_sbuf
from neuronc.passes.second_outputs import as_second_outputs


def _summable(node: ir.Node, target) -> bool:
    """Whether `node` is a sum over tokens with a prologue whose tiles a row-wise kernel's row tiles could be."""
    plan = node.attrs.get("plan")
    return (node.op is Op.REDUCE_LAST and isinstance(plan, PartitionSumPlan) and bool(plan.prologue)
            and node.attrs.get("kind") == "add" and plan.group >= plan.rows
            and plan.tile_rows == target.partitions and plan.bank == target.psum_bank_bytes // DType.F32.itemsize
            and plan.prologue[-1].dtype == {p.name: p.dtype for p in plan.pools}.get("ones"))


def _inputs_in(row: ir.Node, summed: ir.Node) -> dict | None:
    """{the sum's input index: the row-wise kernel's}, each read alike (rows as the sum's view lays them, or one
    value a token), or None when one is not an input of the row-wise kernel."""
    plan: PartitionSumPlan = summed.attrs["plan"]
    found = {}
    for i, x in enumerate(summed.inputs):
        view = (0, (1, 0)) if i in plan.per_token else (plan.view.offset, tuple(plan.view.strides))
        if i not in plan.per_token and tuple(plan.view.strides) != (plan.rows, 1):
            return None
        match = [k for k, (y, v) in enumerate(zip(row.inputs, row.attrs["views"]))
                 if y is x and (v[0], tuple(v[1])) == view]
        if not match:
            return None
        found[i] = match[0]
    return found


def _with_prologue(body: tuple, prologue: tuple, inputs: dict, same: dict) -> tuple:
    """(the body with the prologue's steps before its last step, the step computing the prologue's value): a step
    the body already computes is taken as it is (`same`: each input index -> the first reading the same node
    the same way; a body may read one tensor twice)."""
    head, last = list(body[:-1]), body[-1]

    def key(step):
        return step.op, tuple(("input", same[a[1]]) if a[0] == "input" else a for a in step.args), step.dtype, step.attrs

    index = {}
    for k, step in enumerate(prologue):
        args = tuple(("input", inputs[a[1]]) if a[0] == "input" else ("step", index[a[1]]) if a[0] == "step" else a
                     for a in step.args)
        step = ir.Step(step.op, args, step.dtype, step.attrs)
        found = [j for j, s in enumerate(head) if key(s) == key(step)]
        if found:
            index[k] = found[0]
        else:
            index[k] = len(head)
            head.append(step)
    return (*head, last), index[len(prologue) - 1]


def _ancestors(node: ir.Node) -> set:
    seen, stack = set(), list(node.inputs)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.inputs)
    return seen


def _with_sum(row: ir.Node, summed: ir.Node, ctx: PassContext) -> dict | None:
    """The row-wise kernel's attributes making the sum too, or None when it cannot."""
    plan: PartitionSumPlan = summed.attrs["plan"]
    rows, cols = row.attrs["rows"], row.attrs["cols"]
    if plan.cols != rows or plan.rows != cols or summed in _ancestors(row):
        return None
    inputs = _inputs_in(row, summed)
    if inputs is None:
        return None
    read = list(zip(row.inputs, row.attrs["views"]))
    same = {k: next(i for i, r in enumerate(read) if r[0] is read[k][0] and r[1] == read[k][1])
            for k in range(len(read))}
    body, step = _with_prologue(row.attrs["body"], plan.prologue, inputs, same)
    views, dtypes, schedule = row.attrs["views"], [x.dtype for x in row.inputs], row.attrs["schedule"]
    tile = tile_plan(body, views, dtypes, (step,), cols)
    if (step_kinds(body, views)[step] != "full" or step == tile.out_step or step not in tile.instr_of
            or -(-cols // plan.bank) > ctx.target.psum_banks
            or not fits_sbuf(rowwise_sbuf_bytes(body, views, dtypes, row.dtype, cols, schedule.bufs, (step,),
                                                (summed.dtype,)), ctx.target)):
        return None
    made = rowwise_plan(body, views, dtypes, schedule, ctx.target, cols)
    made = dataclasses.replace(made, tile=tile, tail=tail_steps(body, views, tile) if schedule.cut else (),
                               sums=(step,), sum_bank=plan.bank)
    return {**row.attrs, "body": body, "plan": made,
            "outputs": ((row.shape, row.dtype), (summed.shape, summed.dtype))}


def sum_rows_in_rowwise_kernels(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each sum over tokens computed from a row-wise kernel's rows becomes that kernel's second output."""
    consumers = graph.consumers()
    made: dict = {}  # row-wise kernel -> (its new attributes, the sum it makes)
    taken = set()
    for node in graph.nodes():
        if not _summable(node, ctx.target):
            continue
        for row in sorted({r for x in node.inputs for r in consumers.get(x, ())}, key=lambda r: r.id):
            if (row.op is not Op.ROWWISE or row in made or "outputs" in row.attrs
                    or not isinstance(row.attrs.get("plan"), RowwisePlan)):
                continue
            attrs = _with_sum(row, node, ctx)
            if attrs is not None:
                made[row] = (attrs, node)
                taken.add(node)
                break
    if not made:
        return graph
    return as_second_outputs(graph, made)
