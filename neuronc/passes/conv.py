"""Convolutions as implicit GEMM: the input loaded once into SBUF, a KxK convolution as K*K shifted matmuls.

The im2col lowering (passes/legalize.py) copies every input element K*K times through HBM before a matmul
reads it back. Here a convolution stays one kernel (`Op.CONV`, codegen/conv.py): per image and band of
output rows, the input rows it needs are loaded once into SBUF, channels on the partitions, into a zeroed
tile (the padding is the tile's zero border, never an HBM copy). Each tap (kh, kw) of the kernel is then a
matmul whose moving operand is that tile read at a shifted offset: stationary = w[:, :, kh, kw] as
[C tile, O tile], moving = [C tile, rows x pitch] input elements, accumulated over taps and C tiles in one
PSUM bank as [O tile, rows x pitch]. A row of the tile is `pitch` elements, wider than the output row: the
extra columns of each PSUM row are computed and dropped.

A stride s is read with a stride-1 pattern too: the band is stored as s_h x s_w phase planes (element
(y, x) of the padded input in plane (y mod s_h, x mod s_w) at (y div s_h, x div s_w)), and each tap reads
one plane at the offset (kh d_h div s_h, kw d_w div s_w).

With 64 channels or fewer the Tensor engine would be a quarter used: taps are paired on K (a shifted copy
of the band on the upper partitions) and output rows on M (the upper output partitions make the next row),
see `TapPlan`.

The bias, BatchNorm(eval) scale and shift, activation and residual add reading the result become the
kernel's epilogue (`fuse_conv_epilogues`), computed from PSUM on the way out; values the same for a whole
output channel (a BatchNorm's rsqrt(var + eps)) are computed once per channel, not per element, and the
affine head of the epilogue is folded into the weights and the activation's bias (`EpiloguePlan`).

The tiling (rows per PSUM block, output rows per loaded band, rows paired or not) is chosen by pricing the
candidates that fit SBUF with `cost_model.conv_ns`. Convolutions this kernel does not take (groups, transposed
convolutions, rows wider than a PSUM bank, weights too large for SBUF) stay on the im2col path, as do those whose
windows do not overlap (a patch embedding): im2col copies nothing twice there.
"""
from __future__ import annotations

import dataclasses
import functools

from neuronc import ir
from neuronc.ir import Node, Op, Step
from neuronc.isa import DType
from neuronc.passes.context import PassContext
from neuronc.passes.cost_model import SBUF_PAGE_BYTES, cheapest, conv_ns
from neuronc.passes.legalize import reshape
from neuronc.plans import ConvGeometry, ConvPlan, ConvTiling, EpiloguePlan, TapPlan, View, pool_specs
from neuronc.targets import Target

INPUT_BUFS = 2  # input bands in SBUF: the next one loads while this one is multiplied
STORE_QUEUES = 8  # DMA queues the results are stored on (the others load)
MAX_SHIFTS = 24  # shifts of the second copy tried by tap_plan (bounds compile time for large kernels)
PSUM_BUFS = 4  # PSUM banks the accumulators rotate over: the epilogue of one block overlaps the next one's matmuls


@functools.lru_cache(maxsize=256)  # asked for by every tiling candidate of every convolution
def tap_plan(g: ConvGeometry, band: int, halves: int = 1) -> TapPlan:
    """The fewest matmuls covering every (tap, half), by a greedy cover over the candidate offsets, for the best
    shift of the second copy (or none)."""
    offsets = [g.tap_offset(tap, band) for tap in g.taps]
    deltas = [0]
    if g.c_tiles == 1 and 2 * g.channels <= g.partitions:  # shifts from the first tap to the others
        deltas += sorted({offset - min(offsets) for offset in offsets} - {0})[:MAX_SHIFTS]
    best = None
    for delta in deltas:
        k_halves = (0, 1) if delta else (0,)
        where = {(offsets[t] + mh * g.pitch - kh * delta, kh, mh): t for t in range(len(offsets))
                 for kh in k_halves for mh in range(halves)}
        by_offset: dict = {}  # offset -> the blocks a matmul there could fill
        at: dict = {}  # (tap, half) -> the offsets whose matmul could compute it
        for (a, kh, mh), t in where.items():
            by_offset.setdefault(a, []).append((kh, mh, t))
            at.setdefault((t, mh), []).append(a)
        count = {a: len(blocks) for a, blocks in by_offset.items()}  # of (tap, half) not computed yet
        left = {(t, mh) for t in range(len(offsets)) for mh in range(halves)}
        matmuls = []
        while left:
            a = min(count, key=lambda a: (-count[a], a))
            blocks = sorted((kh, mh, t) for kh, mh, t in by_offset[a] if (t, mh) in left)
            for _, mh, t in blocks:
                left.discard((t, mh))
                for other in at[(t, mh)]:
                    count[other] -= 1
            matmuls.append((a, tuple(blocks)))
        if best is None or len(matmuls) < len(best.matmuls):
            best = TapPlan(delta, halves, tuple(matmuls))
    return best


def geometry(node: Node, partitions: int) -> ConvGeometry:
    x, w = node.inputs[:2]
    a = node.attrs
    return ConvGeometry(x.shape[0], x.shape[1], x.shape[2], x.shape[3], w.shape[0], tuple(w.shape[2:]),
                        tuple(node.shape[2:]), tuple(a["strides"]), tuple(map(tuple, a["padding"])),
                        tuple(a["dilation"]), partitions)


# eligibility and lowering -----------------------------------------------------------------------------------


def _overlapping(node: Node) -> bool:
    """Whether neighbouring windows share input elements (the kernel reaches past the stride in some dim): else
    im2col copies each element at most once (a patch embedding, a strided 1x1 convolution) and is as good."""
    a, kernel = node.attrs, node.inputs[1].shape[2:]
    return any((k - 1) * d + 1 > s for k, d, s in zip(kernel, a["rhs_dilation"], a["strides"]))


def _eligible(node: Node) -> bool:
    a = node.attrs
    spatial = len(node.shape) - 2
    x, w = node.inputs
    return (spatial in (1, 2) and a["groups"] == 1 and all(d == 1 for d in a["lhs_dilation"]) and _overlapping(node)
            and x.dtype.is_float and w.dtype.is_float and node.dtype.is_float and node.size > 0
            and all(lo >= 0 and hi >= 0 for lo, hi in a["padding"]))


def lower_convolutions(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each convolution the implicit-GEMM kernel takes becomes an `Op.CONV` (1-D ones as 2-D with one row);
    the others are left to legalize's im2col."""
    target = ctx.target

    def lower(node, inputs):
        if node.op is not Op.CONVOLUTION or not _eligible(node):
            return None
        a = node.attrs
        x, w = inputs
        if len(node.shape) == 3:  # [N, C, W] as [N, C, 1, W]
            x = reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]), node.loc)
            w = reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]), node.loc)
            shape = (node.shape[0], node.shape[1], 1, node.shape[2])
            strides, padding, dilation = (1, *a["strides"]), ((0, 0), *a["padding"]), (1, *a["rhs_dilation"])
        else:
            shape, strides, padding, dilation = node.shape, a["strides"], a["padding"], a["rhs_dilation"]
        conv = ir.node(Op.CONV, [x, w], shape, node.dtype, node.loc, strides=tuple(strides),
                       padding=tuple(tuple(p) for p in padding), dilation=tuple(dilation))
        tiling = choose_tiling(conv, target)
        if tiling is None:
            return None
        conv.attrs.update(tiling=tiling, plan=conv_plan(conv, tiling, target.partitions))
        return reshape(conv, node.shape, node.loc)

    return graph.rewrite(lower)


# the epilogue: which values are per channel ------------------------------------------------------------------


def channel_inputs(node: Node) -> set:
    """Epilogue inputs (indices into node.inputs) the same for every element of an output channel: read
    through a view with stride 0 along the batch and both spatial dims."""
    views = node.attrs.get("views") or ()
    return {i for i, view in enumerate(views) if i >= 2 and view is not None
            and (view[1][0], view[1][2], view[1][3]) == (0, 0, 0)}


def step_kinds(node: Node) -> list:
    """Per epilogue step, "channel" (depends on per-channel inputs and immediates only: computed once per
    output channel) or "element" (computed for every output element)."""
    per_channel = channel_inputs(node)
    kinds: list = []
    for step in node.attrs.get("epilogue") or ():
        channel = all((kind == "imm") or (kind == "input" and ref != 0 and ref + 1 in per_channel)
                      or (kind == "step" and kinds[ref] == "channel") for kind, ref in step.args)
        kinds.append("channel" if channel else "element")
    if kinds:
        kinds[-1] = "element"  # the result is made for every element
    return kinds


def epilogue_body(node: Node) -> tuple:
    return node.attrs.get("epilogue") or (Step(Op.CONVERT, (("input", 0),), node.dtype, {}),)


AFFINE = {Op.ADD, Op.SUBTRACT, Op.MULTIPLY, Op.DIVIDE}
ACTIVATION_OPS = {Op.EXP, Op.TANH, Op.LOGISTIC, Op.GELU, Op.ERF, Op.SQRT, Op.RSQRT, Op.ABS}  # and max(x, 0)


def epilogue_plan(node: Node) -> EpiloguePlan:
    body = list(epilogue_body(node))
    kinds = step_kinds(node) if node.attrs.get("epilogue") else ["element"]
    users = [[j for j, step in enumerate(body) for a in step.args if a == ("step", i)] for i in range(len(body))]
    plain = EpiloguePlan(tuple(body), tuple(kinds), None, None, None, None)
    x, w = node.inputs[:2]
    if not node.attrs.get("epilogue") or x.dtype != DType.F32 or w.dtype != DType.F32:
        return plain

    per_channel = channel_inputs(node)

    def channel_value(arg) -> bool:
        return (arg[0] == "imm" or (arg[0] == "input" and arg[1] != 0 and arg[1] + 1 in per_channel)
                or (arg[0] == "step" and kinds[arg[1]] == "channel"))

    def combine(op, a, b):
        if a is None or b is None:
            return a if b is None else b
        if a[0] == b[0] == "imm":
            value = {Op.ADD: a[1] + b[1], Op.SUBTRACT: a[1] - b[1], Op.MULTIPLY: a[1] * b[1]}.get(op)
            if value is not None:
                return ("imm", value)
        body.append(Step(op, (a, b), DType.F32, {}))
        kinds.append("channel")
        return ("step", len(body) - 1)

    chain, scale, shift, folded = ("input", 0), None, None, None
    for j, step in enumerate(list(body)):
        if kinds[j] == "channel":
            continue
        if step.op not in AFFINE or step.dtype != DType.F32 or chain not in step.args or len(set(step.args)) != 2:
            break
        c = step.args[1] if step.args[0] == chain else step.args[0]
        if not channel_value(c) or (chain[0] == "step" and users[chain[1]] != [j]):
            break
        first = step.args[0] == chain
        if step.op is Op.ADD:
            shift = combine(Op.ADD, shift, c)
        elif step.op is Op.SUBTRACT and first:
            shift = combine(Op.SUBTRACT, shift if shift is not None else ("imm", 0.0), c)
        elif step.op is Op.SUBTRACT:  # c - value
            scale = combine(Op.MULTIPLY, scale if scale is not None else ("imm", 1.0), ("imm", -1.0))
            shift = combine(Op.SUBTRACT, c, shift) if shift is not None else c
        elif step.op is Op.MULTIPLY:
            scale, shift = combine(Op.MULTIPLY, scale, c), None if shift is None else combine(Op.MULTIPLY, shift, c)
        elif first:  # value / c
            scale = combine(Op.DIVIDE, scale if scale is not None else ("imm", 1.0), c)
            shift = None if shift is None else combine(Op.DIVIDE, shift, c)
        else:
            break
        kinds[j], chain, folded = "folded", ("step", j), j
    if folded is None:
        return plain
    # additions of other values, then an activation: the shift is the activation's bias
    biased, value = None, chain
    for j in range(folded + 1, len(body)):
        step = body[j]
        if kinds[j] != "element":
            continue
        if value[0] == "step" and users[value[1]] != [j]:
            break
        relu = step.op is Op.MAXIMUM and set(step.args) == {value, ("imm", 0.0)}
        if relu or (step.op in ACTIVATION_OPS and step.args == (value,)):
            biased = j if shift is not None and step.dtype == DType.F32 else None
            break
        if step.op is not Op.ADD or value not in step.args or step.dtype != DType.F32 or len(set(step.args)) != 2:
            break
        value = ("step", j)
    return EpiloguePlan(tuple(body), tuple(kinds), scale, shift, folded, biased)


def element_slots(body: tuple, kinds: tuple) -> tuple:
    """Linear-scan slots of the per-element steps' temporaries (the last step writes the result tile):
    (slot per step or None, number of slots)."""
    last = list(range(len(body)))
    for j, step in enumerate(body):
        for kind, ref in step.args:
            if kind == "step":
                last[ref] = j
    free, slots, count = [], [None] * len(body), 0
    for j, kind in enumerate(kinds):
        for k in range(j):
            if last[k] == j and slots[k] is not None and kinds[k] == "element":
                free.append(slots[k])
        if kind != "element" or j == len(body) - 1:
            continue
        if free:
            slots[j] = free.pop()
        else:
            slots[j], count = count, count + 1
    return slots, count


# SBUF budget and tiling -------------------------------------------------------------------------------------


def _page(nbytes: int) -> int:
    return -(-nbytes // SBUF_PAGE_BYTES) * SBUF_PAGE_BYTES


def pools(node: Node, tiling: ConvTiling, partitions: int) -> dict:
    """name -> (dtype, elements per partition, buffers) of every SBUF pool of the kernel; codegen allocates
    exactly these."""
    g = geometry(node, partitions)
    x, w, *extras = node.inputs
    plan = epilogue_plan(node)
    body, kinds = plan.body, plan.kinds
    _, temps = element_slots(body, kinds)
    per_channel = channel_inputs(node)
    block = tiling.rows // tiling.halves * g.pitch  # element tiles keep the accumulator's rows of `pitch` elements
    co_tiles = -(-g.out_channels // partitions)
    taps = tap_plan(g, tiling.band, tiling.halves)
    found = {
        "input": (x.dtype, g.c_tiles * g.band_elements(tiling.band + tiling.halves - 1, taps.delta), INPUT_BUFS),
        "raw_weights": (w.dtype, g.c_tiles * g.out_channels * len(g.taps), 1),
        "weights": (w.dtype, g.c_tiles * g.out_channels * tiling.halves * len(taps.matmuls), 1),
        "result": (node.dtype, tiling.band // tiling.halves * g.pitch, 2),
    }
    for i, extra in enumerate(extras, start=2):
        found[f"extra{i}"] = (extra.dtype, co_tiles, 1) if i in per_channel else (extra.dtype, block, 2)
        if i in per_channel and plan.scale is not None:  # along the free axis too, for the weights' scale
            found[f"extra_row{i}"] = (extra.dtype, g.out_channels, 1)
    for j, kind in enumerate(kinds):
        if kind == "channel":
            found[f"channel{j}"] = (DType.F32, 2 * co_tiles, 1)  # room for 8-byte dtypes
            if plan.scale is not None:
                found[f"channel_row{j}"] = (DType.F32, 2 * g.out_channels, 1)
    if plan.shift is not None:
        found["row_sum"] = (DType.F32, 1, 2)
        if plan.biased is None and plan.folded != max(j for j, k in enumerate(kinds) if k != "channel"):
            found["shifted"] = (DType.F32, block, 2)
    found.update({f"temp{t}": (DType.F32, 2 * block, 2) for t in range(temps)})
    if any(s.op is Op.SELECT and any(a[0] == "imm" for a in s.args) for s in body):
        found["constants"] = (DType.F32, 2 * block, 2)
    return found


def sbuf_bytes(node: Node, tiling: ConvTiling, partitions: int) -> int:
    return sum(_page(n * dtype.itemsize) * bufs for dtype, n, bufs in pools(node, tiling, partitions).values())


def candidates(node: Node, target: Target) -> list:
    """Tilings whose accumulator fits a PSUM bank and whose pools fit SBUF: as many rows per block as a bank
    holds (or the same number of blocks, balanced), bands of 1, 2, 4... blocks up to the whole image."""
    g = geometry(node, target.partitions)
    oh = g.out[0]
    bank = target.psum_bank_bytes // DType.F32.itemsize
    if g.pitch > min(bank, target.matmul_max_n) or g.out[1] > target.max_free_elements_psum:
        return []
    found = []
    for halves in (1, 2) if 2 * g.out_channels <= target.partitions and oh % 2 == 0 and oh > 1 else (1,):
        widest = min(oh, halves * (bank // g.pitch), halves * (target.matmul_max_n // g.pitch)) // halves * halves
        if widest < halves:
            continue
        blocks = -(-oh // widest)
        for rows in sorted({widest, -(-oh // blocks // halves) * halves}):
            band = rows
            while True:
                found.append(ConvTiling(rows, min(band, oh), halves))
                if band >= oh:
                    break
                band *= 2
    budget = target.sbuf_bytes_per_partition
    return [t for t in dict.fromkeys(found) if sbuf_bytes(node, t, target.partitions) <= budget]


NEAR = 0.005  # tilings priced this close to the cheapest are as good to the model: the evenest of them is taken


def _unevenness(tiling: ConvTiling, rows: int) -> int:
    """How much shorter the last band is than the others: a short last band cannot hide the stores of the one
    before it, which the analytic price does not see."""
    return (-rows) % tiling.band


def choose_tiling(node: Node, target: Target, timed=None) -> ConvTiling | None:
    """The candidate of least time, or None if none fits: with `timed` (PassContext.kernel_time), each candidate's
    kernel emitted alone and timed on the emulator's clock (`cost_model.cheapest`, the evenest bands of equals);
    else the one `cost_model.conv_ns` prices lowest (the evenest bands among those within NEAR of it)."""
    options = candidates(node, target)
    if not options:
        return None
    g = geometry(node, target.partitions)
    x, w, *extras = node.inputs
    per_channel = channel_inputs(node)
    plan = epilogue_plan(node)
    steps = plan.kinds.count("element") + (plan.shift is not None and plan.biased is None)
    element_bytes = sum(e.dtype.itemsize for i, e in enumerate(extras, start=2) if i not in per_channel)
    price = {t: conv_ns(g, t, tap_plan(g, t.band, t.halves), x.dtype, node.dtype, element_bytes, steps, target) for t in options}
    if timed is not None:
        return cheapest(options, price.get, lambda t: timed(_planned(node, t, target)),
                        tie=lambda t: _unevenness(t, g.out[0]))
    least = min(price.values())
    near = [t for t in options if price[t] <= least * (1 + NEAR)]
    return min(near, key=lambda t: (_unevenness(t, g.out[0]), price[t]))


def conv_plan(node: Node, tiling: ConvTiling, partitions: int) -> ConvPlan:
    """The kernel plan of a CONV node under `tiling`: geometry, taps, epilogue, slots, views and SBUF pools."""
    g = geometry(node, partitions)
    epilogue = epilogue_plan(node)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    return ConvPlan(geometry=g, tiling=tiling, taps=tap_plan(g, tiling.band, tiling.halves), epilogue=epilogue,
                    slots=tuple(element_slots(epilogue.body, epilogue.kinds)[0]),
                    channel_inputs=tuple(sorted(channel_inputs(node))),
                    views=tuple(View.of(view, node.shape if i >= 2 else x.shape)  # extras: as the result
                                for i, (view, x) in enumerate(zip(views, node.inputs))),
                    pools=pool_specs(pools(node, tiling, partitions)), psum_bufs=PSUM_BUFS, store_queues=STORE_QUEUES)


def _planned(node: Node, tiling: ConvTiling, target: Target) -> Node:
    """`node` (a CONV) tiled by `tiling`, its kernel plan attached."""
    return dataclasses.replace(node, attrs={**node.attrs, "tiling": tiling,
                                            "plan": conv_plan(node, tiling, target.partitions)})


def _tiled(node: Node, target: Target, timed=None) -> Node | None:
    """`node` (a CONV) with the tiling of least time and its plan, or None if none fits."""
    tiling = choose_tiling(node, target, timed)
    return None if tiling is None else _planned(node, tiling, target)


def fuse_conv_epilogues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Elementwise consumers of a convolution (bias, BatchNorm, activation, residual add) become its epilogue,
    as a matmul's (fusion.fuse_matmul_epilogues), when the kernel still fits SBUF; the tiling is re-chosen."""
    target = ctx.target
    from neuronc.passes.fusion import fuse_epilogues

    def retile(node: Node) -> Node | None:
        return _tiled(node, target)

    fused = _absorb_channel_producers(fuse_epilogues(graph, Op.CONV, retile), target)
    if ctx.kernel_time is None:
        return fused

    def timed(node, inputs):  # each kernel's final tiling: the candidates timed (the fits were judged above)
        if node.op is not Op.CONV:
            return None
        node = ir.with_inputs(node, inputs)
        return _tiled(node, target, ctx.kernel_time)

    return fused.rewrite(timed)


def _absorb_channel_producers(graph: ir.Graph, target: Target) -> ir.Graph:
    """A per-channel epilogue input made by an elementwise kernel read by the convolution alone (a BatchNorm's
    1 / sqrt(var + eps)) is computed in the convolution's prologue instead, once per channel: its steps join
    the epilogue ahead of the others, its inputs are read through the same view."""
    from neuronc.passes.fusion import MAX_INPUTS, MAX_STEPS, private_chain

    consumers, outputs = graph.consumers(), set(graph.outputs)

    def absorb(node, inputs):
        if node.op is not Op.CONV or not node.attrs.get("epilogue"):
            return None
        body, views, new_inputs = list(node.attrs["epilogue"]), list(node.attrs["views"]), list(inputs)
        for i in sorted(channel_inputs(node)):
            chain = private_chain(node, node.inputs[i], consumers, outputs)
            producer = ir.unreshaped(inputs[i])
            viewed = any(producer.attrs.get("views") or ())
            if chain is None or chain[-1].op not in ir.ELEMENTWISE | {Op.FUSED} or viewed:
                continue
            head = ir.body_of(producer)
            if any(x.shape != producer.shape for x in producer.inputs) or len(body) + len(head) > MAX_STEPS:
                continue
            first = len(new_inputs)  # the producer's inputs, read through the conv's view of the producer
            new_inputs += producer.inputs
            views += [views[i]] * len(producer.inputs)
            shift = len(head)
            head = [step._replace(args=tuple(("input", first - 1 + ref) if kind == "input" else (kind, ref)
                                             for kind, ref in step.args)) for step in head]
            body = head + [step._replace(args=tuple(
                ("step", shift - 1) if (kind, ref) == ("input", i - 1) else ("step", ref + shift) if kind == "step"
                else (kind, ref) for kind, ref in step.args)) for step in body]
        if len(new_inputs) == len(inputs):
            return None
        # keep the inputs the body still reads (the accumulator's operands always)
        read = sorted({ref + 1 for step in body for kind, ref in step.args if kind == "input" and ref > 0})
        if len(read) > MAX_INPUTS:
            return None
        index = {old: new for new, old in enumerate([0, 1, *read])}
        body = [step._replace(args=tuple(("input", index[ref + 1] - 1) if kind == "input" and ref > 0 else (kind, ref)
                                         for kind, ref in step.args)) for step in body]
        fused = dataclasses.replace(node, inputs=tuple(new_inputs[k] for k in [0, 1, *read]), id=next(ir._ids),
                                    attrs={**node.attrs, "epilogue": tuple(body),
                                           "views": tuple(views[k] for k in [0, 1, *read])})
        return _tiled(fused, target)

    return graph.rewrite(absorb)
