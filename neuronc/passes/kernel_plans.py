"""Plans of the kernels no fusion pass shapes: elementwise (fused or single) ops, last-axis reductions, gathers,
scatters and top-k. Their tile sizes follow from the SBUF budget alone (no alternatives to price), so they are
planned here, at the end of every pipeline (passes/tiling.py's passes end with `plan_kernels`, a pass of its
own signature), and codegen follows the plans (neuronc/plans.py)."""
from __future__ import annotations

import dataclasses

from neuronc import ir, op_facts
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node, Op
from neuronc.isa import DType
from neuronc.placement import free_for, tile_free_elements
from neuronc.plans import (ElementwisePlan, PartitionSumPlan, PoolSpec, ReducePlan, RowSum, RowsPlan, Summed, TopkPlan,
                           View)
from neuronc.passes.rowwise_plan import tile_plan
from neuronc.passes.context import PassContext
from neuronc.targets import Target

REDUCTIONS = tuple(kind for kind, r in op_facts.REDUCTIONS.items() if r.alu is not None)  # TENSOR_REDUCE computes these
TOP = 8  # values one MAX8 / FIND_INDEX8 / MATCH_REPLACE8 handles
# Row tiles of a reduction whose [rows, 1] results one DMA stores: each store moves a few bytes per partition and
# pays a DMA's fixed cost, so they are gathered side by side (64 tiles: 256 bytes a partition in fp32).
STORE_TILES = 64


def assign_slots(body: tuple, kept: int | None = None) -> tuple:
    """Linear-scan allocation of temporary tiles to the steps of a body (the last step writes the output tile);
    step `kept`'s tile is held to the end (it is stored too). Returns (slot of each step or None, number of slots)."""
    last = list(range(len(body)))
    for j, step in enumerate(body):
        for kind, ref in step.args:
            if kind == "step":
                last[ref] = j
    if kept is not None:
        last[kept] = len(body)
    free, slots, count = [], [], 0
    for j in range(len(body)):
        for k in range(j):
            if last[k] == j and slots[k] is not None:
                free.append(slots[k])  # the step's inputs die here: their tiles are reusable
        if j == len(body) - 1:
            slots.append(None)
        elif free:
            slots.append(free.pop())
        else:
            slots.append(count)
            count += 1
    return slots, count


def _needs_constants(body) -> bool:
    """Whether a SELECT of the body takes a constant (the kernel makes it a tile)."""
    return any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body)


def elementwise_plan(node: Node, target: Target) -> ElementwisePlan:
    """Load each read input tile once (through its strided view, if the fusion pass folded one in), compute
    every step in SBUF, store the result: tiles as large as the SBUF shared by all of them allows."""
    body = ir.body_of(node)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    used = sorted({ref for step in body for kind, ref in step.args if kind == "input"})
    slots, temp_count = assign_slots(body)
    constants = _needs_constants(body)
    widest = max([DType.F32.itemsize, node.dtype.itemsize] + [s.dtype.itemsize for s in body]
                 + [node.inputs[i].dtype.itemsize for i in used])
    free = free_for(target, 3 * len(used) + 2 * temp_count + 3 + (3 if constants else 0), widest)
    wide = free * widest // DType.F32.itemsize
    pools = [PoolSpec(f"input{i}", node.inputs[i].dtype, free, 3) for i in used]
    pools += [PoolSpec(f"temp{t}", DType.F32, wide, 2) for t in range(temp_count)]
    pools.append(PoolSpec("out", node.dtype, free, 3))
    if constants:
        pools.append(PoolSpec("constants", DType.F32, wide, 3))
    return ElementwisePlan(body=tuple(body), inputs=tuple(used),
                           views=(View.of(None, node.shape), *(View.of(views[i], node.shape) for i in used)),
                           slots=tuple(slots), free=free, pools=tuple(pools))


def reduce_plan(node: Node, target: Target) -> ReducePlan | PartitionSumPlan:
    """out[r] = reduce(x[r, :]) with rows on partitions, the columns reduced in chunks as large as the SBUF
    shared by the inputs, the prologue's temporaries and the accumulators allows; or, for a sum whose reduced
    axis is the outer one of its input's memory, a sum over partitions on the Tensor engine."""
    rows = node.shape[0]
    cols = node.attrs.get("cols") or node.inputs[0].shape[1]
    kind = node.attrs["kind"]
    if kind not in REDUCTIONS:
        raise NeuronCompileError(f"a {kind!r} reduction is not supported yet", location=str(node.loc))
    body = tuple(node.attrs.get("prologue") or ())
    views = node.attrs.get("views") or ((0, (cols, 1)),)
    if _sums_over_partitions(node, kind, body, views, cols):
        per_token = tuple(i for i, view in enumerate(views) if _per_token(*view))
        laid = next(view for i, view in enumerate(views) if i not in per_token)
        return partition_sum_plan(node, laid, cols, target, body, per_token)
    slots, temp_count = assign_slots(body) if body else ([], 0)
    reduced_dtype = body[-1].dtype if body else node.inputs[0].dtype
    acc_dtype = DType.F32 if node.dtype.is_float else node.dtype
    widest = max([DType.F32.itemsize, reduced_dtype.itemsize] + [x.dtype.itemsize for x in node.inputs])
    # inputs, temporaries, body outputs, constants (a select may materialise two scalars, each a tile of its own:
    # with one buffer both were the same tile, and argmax over a dim of size 1 returned 1), and the six [rows, 1]
    # accumulator tiles
    chunk = free_for(target, 3 * len(node.inputs) + 2 * temp_count + 3 + 2 + 6, widest)
    wide = chunk * widest // DType.F32.itemsize
    # an input with one value per row (column stride 0) is loaded as a [rows, 1] column, not a chunk of copies
    pools = [PoolSpec(f"input{i}", x.dtype, 1 if strides[1] == 0 and cols > 1 else chunk, 3)
             for i, (x, (_, strides)) in enumerate(zip(node.inputs, views))]
    pools += [PoolSpec(f"temp{t}", DType.F32, wide, 2) for t in range(temp_count)]
    if body:
        pools += [PoolSpec("body_out", reduced_dtype, chunk, 3), PoolSpec("constants", DType.F32, wide, 2)]
    store_tiles = min(-(-rows // target.partitions), STORE_TILES)
    pools += [PoolSpec("partials", acc_dtype, 1, 2), PoolSpec("accs", acc_dtype, 1, 2),
              PoolSpec("outs", node.dtype, store_tiles, 2)]
    epilogue = tuple(node.attrs.get("epilogue") or ())  # passes/reduction_epilogues.py
    epilogue_slots, epilogue_temps = assign_slots(epilogue) if epilogue else ([], 0)
    pools += [PoolSpec(f"etemp{t}", DType.F32, 1, 2) for t in range(epilogue_temps)]
    if epilogue:
        pools.append(PoolSpec("eout", node.dtype, 1, 2))
    on_scalar = _sum_on_scalar(node, body, views)
    if on_scalar is not None and getattr(on_scalar, "shift", None) is None:
        pools.append(PoolSpec("zero", DType.F32, 1, 1))  # the activation's bias
    elif on_scalar is not None and not on_scalar.negated:
        pools.append(PoolSpec("bias", DType.F32, 1, 2))  # the shift negated
    return ReducePlan(rows=rows, cols=cols, kind=kind, prologue=body, slots=tuple(slots),
                      views=tuple(View(int(offset), tuple(int(s) for s in strides)) for offset, strides in views),
                      chunk=chunk, pools=tuple(pools), store_tiles=store_tiles, epilogue=epilogue,
                      epilogue_slots=tuple(epilogue_slots), on_scalar=on_scalar)


def _sum_on_scalar(node: Node, body: tuple, views: tuple) -> Summed | RowSum | None:
    """A float sum whose prologue, planned as a row-wise body ending in the sum is (rowwise_plan's rules), is one
    Summed (an activation or square of an input, a per-row input subtracted first) or one RowSum of an input
    (widened on load): the Scalar engine's ACTIVATE_BIAS_REDUCE computes it in one pass over the loaded chunk, the
    same fp32 values summed the same way, where the Vector engine takes a pass per step and one for the sum (a
    layer-norm's mean and variance, recomputed in the backward)."""
    if node.attrs["kind"] != "add" or not node.dtype.is_float or not body or body[-1].dtype != DType.F32:
        return None
    row_sum = ir.Step(Op.REDUCE_LAST, (("step", len(body) - 1),), DType.F32, {"kind": "add"})
    instrs = [instr for _, instr in tile_plan((*body, row_sum), views, [x.dtype for x in node.inputs]).instrs]
    if len(instrs) != 1 or not isinstance(instrs[0], (Summed, RowSum)):
        return None
    return instrs[0] if all(arg[0] == "input" for arg in instrs[0].reads) else None


def _sums_over_partitions(node: Node, kind: str, body: tuple, views: tuple, cols: int) -> bool:
    """Whether a reduction is a float sum of inputs read transposed: out[r] = sum_c x[c, r], the outputs r
    contiguous in memory (row stride 1) and the summed values c rows apart (a bias gradient, sum over tokens), x
    an input or a prologue computed from inputs all read through that view (passes/partition_sum_prologues.py).
    Rows on partitions, the way REDUCE_LAST reads, each partition's values would be `cols` single elements `row
    stride` apart, a strided DMA of 4-byte pieces; loaded as they lie, whole rows of x are tiles of [c, r] and
    the sum is over partitions, which the Tensor engine computes (a matmul by a ones vector)."""
    if kind != "add" or cols < 2 or (not body and len(node.inputs) != 1):
        return False
    if not (node.dtype.is_float and all(x.dtype.is_float for x in node.inputs)) or (body and not body[-1].dtype.is_float):
        return False
    laid = {(offset, tuple(strides)) for offset, strides in views if not _per_token(offset, strides)}
    if len(laid) != 1 or (len(laid) != len(set(views)) and not body):
        return False
    ((_, (row_stride, col_stride)),) = laid
    return row_stride == 1 and col_stride >= node.shape[0]


def _per_token(offset: int, strides) -> bool:
    """An input of a sum over tokens holding one value per token (a row's mean), the same for every output."""
    return offset == 0 and tuple(strides) == (0, 1)


def partition_sum_plan(node: Node, view: tuple, cols: int, target: Target, body: tuple = (),
                       per_token: tuple = ()) -> PartitionSumPlan:
    """out[r] = sum_t x[t, r] (x [T, R] as it lies in memory, or computed from inputs that lie so by the prologue
    `body`): tiles of `partitions` t, whole rows of as many outputs as every PSUM bank and the SBUF left hold,
    accumulated by matmuls of a ones column in fp32 (see PartitionSumPlan)."""
    rows = node.shape[0]
    if len(body) == 1 and _widens_input(body[0], node):  # summed as it lies: the matmul widens it to fp32
        body = ()
    offset, (row_stride, col_stride) = view
    bank = target.psum_bank_bytes // DType.F32.itemsize
    slots, temp_count = assign_slots(body) if body else ([], 0)
    summed = body[-1].dtype if body else node.inputs[0].dtype
    widest = max([DType.F32.itemsize, summed.itemsize] + [x.dtype.itemsize for x in node.inputs])
    # inputs (3 buffers each), temporaries (2), the prologue's result (3) and constants (2), the sums (2)
    room = free_for(target, 3 * len(node.inputs) + 2 * temp_count + (5 if body else 0) + 2, widest)
    group = min(rows, bank * target.psum_banks, max(bank, room // bank * bank))
    wide = group * widest // DType.F32.itemsize
    pools = [PoolSpec(f"input{i}", x.dtype, 1 if i in per_token else group, 3) for i, x in enumerate(node.inputs)]
    pools += [PoolSpec(f"temp{t}", DType.F32, wide, 2) for t in range(temp_count)]
    if body:
        pools += [PoolSpec("body_out", summed, group, 3), PoolSpec("constants", DType.F32, wide, 2)]
    pools += [PoolSpec("ones", summed, 1, 1), PoolSpec("outs", node.dtype, group, 2)]
    return PartitionSumPlan(rows=rows, cols=cols, view=View(int(offset), (int(col_stride), int(row_stride))),
                            tile_rows=min(target.partitions, cols), group=group, bank=bank, pools=tuple(pools),
                            prologue=tuple(body), slots=tuple(slots), per_token=tuple(per_token))


def _widens_input(step, node: Node) -> bool:
    """Whether `step` only widens a float input of `node` to fp32 (exact)."""
    return (step.op is Op.CONVERT and step.dtype == DType.F32 and step.args[0][0] == "input"
            and node.inputs[step.args[0][1]].dtype.is_float)


def topk_plan(node: Node, target: Target) -> TopkPlan:
    """Rows padded to at least 8 values, in one tile: rows longer than a tile are refused."""
    n, k = node.inputs[0].shape[1], node.attrs["k"]
    width, most = max(n, TOP), tile_free_elements(target)
    if width > most:
        raise NeuronCompileError(f"a sort or top-k over rows of {n} values: at most {most} fit one tile",
                                 location=str(node.loc),
                                 hint="sort shorter rows (split the dimension), or keep this op outside the compiled region")
    return TopkPlan(width=width, rounds=-(-k // TOP))


def rows_plan(node: Node, target: Target) -> RowsPlan:
    """Table rows cut into columns that fit a tile."""
    return RowsPlan(chunk=min(node.shape[1], tile_free_elements(target)))


_PLANNERS = {Op.FUSED: elementwise_plan, Op.REDUCE_LAST: reduce_plan, Op.TOPK: topk_plan,
             Op.GATHER_ROWS: rows_plan, Op.SCATTER_ROWS: rows_plan}
_PLANNERS.update({op: elementwise_plan for op in ir.ELEMENTWISE - {Op.CLAMP}})


def plan_kernels(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Every elementwise, reduction and indexing kernel with its plan (attrs["plan"])."""
    target = ctx.target

    def plan(node, inputs):
        planner = _PLANNERS.get(node.op)
        if planner is None:
            return None
        node = node if inputs == node.inputs else dataclasses.replace(node, inputs=inputs)
        return dataclasses.replace(node, attrs={**node.attrs, "plan": planner(node, target)}, id=next(ir._ids))

    return graph.rewrite(plan)
