"""The fused attention kernel: flash attention tiled over the sequence with an online softmax, software-
pipelined over the engines, no S x S tensor in HBM (passes/attention.py decides when it applies)."""
from __future__ import annotations


import dataclasses
from typing import NamedTuple

import numpy as np

from neuronc.codegen.access import broadcast_columns, dma_by_rows, tile_at
from neuronc.codegen.elementwise import Balancer
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode
from neuronc.ir import Node
from neuronc.plans import AttentionPlan, MemoryPlan


NEG_BIG = -3.0e38  # a masked row's running max is held at least here: finite, so exp(-inf - m) = 0, not NaN
CAUSAL_BIAS = -2.0e38  # added to masked scores by a matmul (a -inf would meet the identity's zeros: NaN)


def _identity(em: Emitter, tile, size: int, scratch) -> AccessPattern:
    """An identity matrix [size, size]: iota gives column - partition, compared with 0."""
    ramp = scratch.ap(size, size, dtype=DType.F32)
    em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=0.0, imm1=-1.0)
    ident = tile.ap(size, size)
    em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, ident, ramp, alu=AluOp.EQ, imm0=0.0)
    return ident


def _v_chunks(vt: AccessPattern, chunks: int, rows: int, cols: int, stride: int) -> AccessPattern:
    """`cols` columns of each of `chunks` chunks of `stride` elements of a [partitions, chunks * stride] tile."""
    return dataclasses.replace(vt, dims=((1, rows), (stride, chunks), (1, cols)))


def attention(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """softmax(mask(scale * Q K^T)) V, flash-attention style (passes/attention.py).

    Per batch-head, K^T, V (beside a column of ones) and Q^T are loaded once and stay in SBUF. Per tile of 128
    query rows (one per partition), the keys are visited in blocks of a PSUM bank: S = Q K^T into PSUM, the
    causal mask added by a matmul with an on-chip bias tile over the at most 127 keys it cuts (blocks wholly
    above the diagonal skipped). The logits are kept negated, -scale * S, so that their row min is the exp's
    bias b = -m, made in the same pass (TENSOR_SCALAR_REDUCE); P = exp(logits + b) takes one Scalar pass, is
    transposed on the Tensor engine (a matmul with the identity) so the keys lie on partitions, and
    P [V | 1] = [P V | rowsum P] accumulates in PSUM, rescaled in place by e^(b' - b) when the running max
    grows. The output is P V / l. Each block passes through eight stages, one engine hop each, emitted
    software-pipelined so the engines' in-order queues overlap blocks; copies and scalings go to whichever of
    Vector, GpSimd and Scalar has least work, so no one dominates. The scores never leave the chip."""
    a: AttentionPlan = node.attrs["plan"]
    Q_TILE, HEADS_AHEAD = a.q_tile, a.heads_ahead  # noqa: N806
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    batch, sq, dv = a.batch, a.queries, a.value_dim
    sk, d, scale = a.keys, a.head_dim, a.scale
    causal, offset = a.mask == "causal", a.causal_offset
    tensor_mask = a.mask in ("select", "add")
    p_dtype = a.probability_dtype
    materialise, fused = a.logits_in_sbuf, a.fused_logits
    block = a.key_block
    group_size, depth = a.softmax_blocks, a.depth
    d_tiles, k_chunks = -(-d // Q_TILE), -(-sk // Q_TILE)
    pools = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in a.pools}
    bank = em.psum_bank_elements()
    score_banks = -(-block // bank)  # a key block's fp32 scores span this many PSUM banks
    s_psum, pt_psum, o_psum = em.psum_pool(4 // score_banks * score_banks), em.psum_pool(2), em.psum_pool(2)
    engines = Balancer(em)
    vector = engines.emit

    def small(name, rows):
        return pools[name].next().ap(rows, 1)

    # constants of the kernel: identities, the causal bias tiles, a mask's fill, the guard's zeros
    identity = _identity(em, pools["identity"].next(), Q_TILE, pools["ramp"].next())
    bias_identity, bias = identity, {}
    if causal:
        if p_dtype != DType.BF16:
            bias_identity = _identity(em, pools["bias_identity"].next(), Q_TILE, pools["ramp"].next())
        ramp = pools["ramp"].next().ap(Q_TILE, Q_TILE, dtype=DType.F32)
        for cut in a.causal_cuts:
            tile = pools["bias"].next().ap(Q_TILE, Q_TILE)  # column c masks row i where c - i + cut > 0
            em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=float(cut), imm1=-1.0)
            em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, ramp, alu=AluOp.GT, imm0=0.0)
            em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, tile, alu=AluOp.MULTIPLY, imm0=CAUSAL_BIAS)
            bias[cut] = tile
    for _ in range(pools["v"].bufs):  # V's ones columns, which the loads of V leave alone: made once
        vt = pools["v"].next().ap(Q_TILE, k_chunks * (dv + 1))
        ones = _v_chunks(vt, k_chunks, Q_TILE, 1, dv + 1)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, dataclasses.replace(ones, offset=vt.offset + dv * vt.dtype.itemsize), imm0=1.0)
    if a.mask == "select":
        fill = pools["fill"].next().ap(Q_TILE, block)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, fill, imm0=-a.fill)  # negated, as the logits are
    if a.zero_masked_rows:
        zeros = pools["zeros"].next().ap(Q_TILE, dv)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, zeros, imm0=0.0)

    def origin(i, g):
        """(element, row stride, column stride) of batch-head g of input i (-1: the output)."""
        view = a.views[i] if i >= 0 else a.out_view
        offset0, strides = view.offset, view.strides
        index = np.unravel_index(g, a.batch_shape)
        return offset0 + sum(int(j) * s for j, s in zip(index, strides[:-2])), strides[-2], strides[-1]

    def address(x, element):
        return plan.offset(x) + element * x.dtype.itemsize

    def score_tile(qt, kb):
        """A [qt, kb] fp32 tile on consecutive PSUM banks (a matmul writes within one: by bank_spans)."""
        slots = [s_psum.next() for _ in range(score_banks)]
        assert all(b.offset == a.offset + em.target.psum_bank_bytes for a, b in zip(slots, slots[1:]))
        return slots[0].ap(qt, kb)

    def bank_spans(c0, c1):
        """[c0, c1) cut at the PSUM bank boundaries of a score tile's columns."""
        return [(c, min(c1, (c // bank + 1) * bank)) for c in range(c0, c1) if c == c0 or c % bank == 0]

    def scores_of(g, qtile, kt, q0, qt, k0, kb):
        """S = Q K^T of a key block into PSUM, the causal bias added over the keys the diagonal cuts."""
        scores = score_tile(qt, kb)
        for c0, c1 in bank_spans(0, kb):
            for j in range(d_tiles):
                dt = min(Q_TILE, d - j * Q_TILE)
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(scores, c0, qt, c1 - c0),
                        tile_at(qtile, j * sq + q0, dt, qt), tile_at(kt, j * sk + k0 + c0, dt, c1 - c0),
                        accumulate=j > 0)
        first_cut = max(k0, q0 + offset + 1)  # keys from here on are masked for some row of the tile
        if causal and first_cut < k0 + kb:
            cut = k0 - q0 - offset if k0 > q0 + offset else 1
            for c0, c1 in bank_spans(first_cut - k0, kb):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(scores, c0, qt, c1 - c0),
                        tile_at(bias_identity, 0, qt, qt),
                        tile_at(bias[cut], c0 - (first_cut - k0), qt, c1 - c0), accumulate=True)
        return scores

    def logits_of(g, scores, q0, qt, k0, kb, b, logits):
        """(src, factor): the exp's argument is src * factor + bias, and b [qt, 1] = -(the row max of src *
        factor). Materialised logits are made negated (factor -1) in `logits`; unless a mask tensor comes in
        between, their row min, b, is made in the same pass."""
        if not materialise:
            row_bias(b, scores, scale)
            return scores, scale
        if not fused:  # S rounded as eager rounds it, then scaled
            rounded_scores = pools["scores"].next().ap(qt, kb, dtype=a.score_dtype)
            engines.scale(rounded_scores, scores, 1.0)
            scores = rounded_scores
        if not tensor_mask:
            vector(Opcode.TENSOR_SCALAR_REDUCE, logits, b, scores, alu=AluOp.MIN, imm0=-scale)
            return logits, -1.0
        engines.scale(logits, scores, -scale)
        if tensor_mask:
            mb0, ms, mk = origin(3, g)
            mtile = pools["mask"].next().ap(qt, kb)
            em.dma(mtile, hbm(mask.dtype, address(mask, mb0 + q0 * ms + k0 * mk), ((ms, qt), (mk, kb))))
            if a.mask == "add":
                vector(Opcode.TENSOR_TENSOR, logits, logits, mtile, alu=AluOp.SUBTRACT)
            else:
                filled = tile_at(fill, 0, qt, kb)
                on_true, on_false = (filled, logits) if a.masked_when else (logits, filled)
                vector(Opcode.SELECT, logits, mtile, on_true, on_false)
        row_bias(b, logits, -1.0)
        return logits, -1.0

    def row_bias(b, src, factor):
        """b = -(the row max of src * factor) of a key block."""
        if factor < 0:  # negated logits: their row min
            vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MIN)
        else:
            vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MAX)
            vector(Opcode.TENSOR_SCALAR, b, b, alu=AluOp.MULTIPLY, imm0=-factor)

    def transposes(p, qt, chunks):
        """P^T [keys, queries] into PSUM: Tensor-engine transposes (matmuls with the identity) by chunks of
        128 keys, side by side, a bank's worth of chunks per PSUM buffer; [(buffer, its chunks)]."""
        per_bank = max(1, bank // qt)
        parts = []
        for first in range(0, len(chunks), per_bank):
            part = chunks[first:first + per_bank]
            pt_acc = pt_psum.next().ap(Q_TILE, len(part) * qt)
            for n, (c, rows) in enumerate(part):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(pt_acc, n * qt, rows, qt), tile_at(p, c, qt, rows),
                        tile_at(identity, 0, qt, qt))
            parts.append((pt_acc, part))
        return parts

    def evacuated(parts, qt, chunks):
        """P^T copied from PSUM to SBUF, where the Tensor engine reads it: chunk n at column n * qt."""
        pt = pools["pt"].next().ap(Q_TILE, len(chunks) * qt)
        n0 = 0
        for pt_acc, part in parts:
            whole = sum(rows == Q_TILE for _, rows in part)
            if whole:
                engines.scale(tile_at(pt, n0 * qt, Q_TILE, whole * qt), tile_at(pt_acc, 0, Q_TILE, whole * qt), 1.0)
            for n, (_, rows) in enumerate(part[whole:], whole):
                engines.scale(tile_at(pt, (n0 + n) * qt, rows, qt), tile_at(pt_acc, n * qt, rows, qt), 1.0)
            n0 += len(part)
        return pt

    def load_head(g):
        """K^T [d, Sk] and Q^T [d, Sq] (d on partitions, by tiles of 128), V [Sk, Dv] (keys on partitions, by
        chunks of 128) of one batch-head, resident while its query tiles run."""
        kb0, ks, kd = origin(1, g)
        kt = pools["k"].next().ap(Q_TILE, d_tiles * sk)
        for j in range(d_tiles):
            dt = min(Q_TILE, d - j * Q_TILE)
            dma_by_rows(em, tile_at(kt, j * sk, dt, sk), hbm(k.dtype, address(k, kb0 + j * Q_TILE * kd), ((kd, dt), (ks, sk))))
        vb0, vs, vd = origin(2, g)
        vt = pools["v"].next().ap(Q_TILE, k_chunks * (dv + 1))  # [V | 1] by chunks: P [V | 1] = [P V | rowsum P]
        full = sk // Q_TILE
        if full:
            dma_by_rows(em, _v_chunks(vt, full, Q_TILE, dv, dv + 1),
                         hbm(v.dtype, address(v, vb0), ((vs, Q_TILE), (Q_TILE * vs, full), (vd, dv))))
        if sk % Q_TILE:
            em.dma(tile_at(vt, full * (dv + 1), sk % Q_TILE, dv),
                   hbm(v.dtype, address(v, vb0 + full * Q_TILE * vs), ((vs, sk % Q_TILE), (vd, dv))))
        qb0, qs, qd = origin(0, g)
        qtile = pools["q"].next().ap(Q_TILE, d_tiles * sq)
        for j in range(d_tiles):
            dt = min(Q_TILE, d - j * Q_TILE)
            dma_by_rows(em, tile_at(qtile, j * sq, dt, sq), hbm(q.dtype, address(q, qb0 + j * Q_TILE * qd), ((qd, dt), (qs, sq))))
        return qtile, kt, vt

    def blocks():
        """(g, q0, qt, k0, kb, first, last) of every key block of every query tile, in order."""
        for g in range(batch):
            for q0 in range(0, sq, Q_TILE):
                qt = min(Q_TILE, sq - q0)
                last_key = min(sk, q0 + qt + offset) if causal else sk  # keys beyond are masked for every row
                starts = list(range(0, last_key, block))
                for n, k0 in enumerate(starts):
                    member = n % group_size
                    members = min(group_size, len(starts) - (n - member))
                    yield _Block(g, q0, qt, k0, min(block, last_key - k0), n == 0, n == len(starts) - 1,
                                 member, members)

    heads: dict = {}

    # One key block passes through these stages, each a hop to another engine; `x` holds what a block's
    # stages made, `row` the online softmax state of its query tile: b = -m, the exp's bias, and acc = [P V | l]
    # in PSUM (l, the row sum, from V's ones column). The blocks of a softmax group share x["group"]: their
    # row mins side by side, and the bias b' their exps take, made once all their logits are.
    def scores_stage(blk, row, x):
        """S = Q K^T into PSUM, the causal bias added."""
        for g in range(blk.g, blk.g + 1 + HEADS_AHEAD):  # this head's loads, and the next ones' ahead of their turn
            if g not in heads and g < batch:
                heads[g] = load_head(g)
        qtile, kt, _ = heads[blk.g]
        x["scores"] = scores_of(blk.g, qtile, kt, blk.q0, blk.qt, blk.k0, blk.kb)

    logits_dtype = a.logits_dtype

    def logits_stage(blk, row, x):
        """The block's logits and their row min, in its column of the group's."""
        qt = blk.qt
        if blk.member == 0:
            row["group"] = {"b_blocks": pools["b_blocks"].next().ap(qt, blk.members)}
        group = x["group"] = row["group"]
        b = tile_at(group["b_blocks"], blk.member, qt, 1)
        logits = pools["logits"].next().ap(qt, blk.kb, dtype=logits_dtype) if materialise else None
        x["src"], x["factor"] = logits_of(blk.g, x["scores"], blk.q0, qt, blk.k0, blk.kb, b, logits)

    def bias_stage(blk, row, x):
        """After a softmax group's last block: b' = min(b, the group's row mins)."""
        if blk.member < blk.members - 1:
            return
        group, qt = x["group"], blk.qt
        b_group = group["b_blocks"]
        if blk.members > 1:
            b_group = small("b", qt)
            vector(Opcode.TENSOR_REDUCE, b_group, group["b_blocks"], alu=AluOp.MIN)
        if "b" not in row:
            b_new = b_group
            if tensor_mask:  # a row masked so far keeps a finite bias
                vector(Opcode.TENSOR_SCALAR, b_group, b_group, alu=AluOp.MIN, imm0=-NEG_BIG)
        else:
            b_new = small("b", qt)
            vector(Opcode.TENSOR_TENSOR, b_new, row["b"], b_group, alu=AluOp.MIN)
        group["b_old"], group["b_new"], row["b"] = row.get("b"), b_new, b_new

    def exp_stage(blk, row, x):
        """P = exp(src f + b') in one Scalar pass (its row sum comes with P V, from V's ones column), and, for
        the first block of a group after the first, corr = e^(b' - b), the accumulator's rescaling, in another
        (-b taken as the source, b' as the bias). (One exp per block, not per group: the group's first
        transposes would wait for all of its exps.)"""
        qt, group = blk.qt, x["group"]
        x["p"] = pools["p"].next().ap(qt, blk.kb)
        engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x["p"], small("rowsum", qt), x["src"], group["b_new"],
                         func=ActFunc.EXP, imm0=x["factor"])
        if blk.member == 0 and group["b_old"] is not None:
            x["corr"] = small("corr", qt)
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x["corr"], small("dm", qt), group["b_old"],
                             group["b_new"], func=ActFunc.EXP, imm0=-1.0)

    def transpose_stage(blk, row, x):
        x["chunks"] = [(c, min(Q_TILE, blk.kb - c)) for c in range(0, blk.kb, Q_TILE)]
        x["pt_psum"] = transposes(x["p"], blk.qt, x["chunks"])

    def evacuate_stage(blk, row, x):
        x["pt"] = evacuated(x["pt_psum"], blk.qt, x["chunks"])
        if "corr" in x:  # the accumulator [P V | l] in PSUM, rescaled before this block's P V adds to it
            acc = row["acc"]
            corr = broadcast_columns(x["corr"], dv + 1)  # held per partition: one pass
            vector(Opcode.TENSOR_ALU2, acc, acc, corr, corr, alu=AluOp.MULTIPLY)

    def product_stage(blk, row, x):
        """[P V | rowsum P] into (or added to) the query tile's accumulator in PSUM."""
        qt, vt = blk.qt, heads[blk.g][2]
        if blk.first:
            row["acc"] = o_psum.next().ap(qt, dv + 1)
        for n, (c, rows) in enumerate(x["chunks"]):
            em.emit(Opcode.MATMUL, Engine.TENSOR, row["acc"], tile_at(x["pt"], n * qt, rows, qt),
                    tile_at(vt, (blk.k0 + c) // Q_TILE * (dv + 1), rows, dv + 1), accumulate=n > 0 or not blk.first)

    def output_stage(blk, row, x):
        """After the query tile's last block, out = P V / l stored."""
        if not blk.last:
            return
        qt, acc = blk.qt, row["acc"]
        l, out = tile_at(acc, dv, qt, 1), pools["out"].next().ap(qt, dv)
        per_row = broadcast_columns(l, dv)  # held per partition: one pass over P V, divided as TENSOR_TENSOR would
        vector(Opcode.TENSOR_ALU2, out, tile_at(acc, 0, qt, dv), per_row, per_row, alu=AluOp.DIVIDE)
        if a.zero_masked_rows:  # a row every key is masked for gives zeros (l = 0), not 0 / 0
            empty = small("empty_row", qt)
            vector(Opcode.TENSOR_SCALAR, empty, l, alu=AluOp.EQ, imm0=0.0)
            vector(Opcode.SELECT, out, broadcast_columns(empty, dv), tile_at(zeros, 0, qt, dv), out)
        ob0, os_, od = origin(-1, blk.g)
        em.dma(hbm(node.dtype, address(node, ob0 + blk.q0 * os_), ((os_, qt), (od, dv))), out)

    def waiting_stage(blk, row, x):
        """A block waits here for the later blocks of its softmax group to make their logits."""

    # Software-pipelined: at step t, stage s of block t - s is emitted (the oldest block first), so each
    # engine's in-order queue holds later blocks' work while one block's chain crosses the engines.
    stages = (scores_stage, logits_stage, bias_stage, *[waiting_stage] * (group_size - 1), exp_stage,
              transpose_stage, evacuate_stage, product_stage, output_stage)
    assert len(stages) == depth  # the pools are sized for it
    in_flight: list = []  # (block, row state, what its stages made), oldest first
    rows: dict = {}
    for step, blk in enumerate([*blocks(), *[None] * (len(stages) - 1)]):
        if blk is not None:
            in_flight.append((blk, rows.setdefault((blk.g, blk.q0), {}), {"step": step}))
        for blk_, row, x in in_flight:
            stages[step - x["step"]](blk_, row, x)
        in_flight = [item for item in in_flight if step - item[2]["step"] + 1 < len(stages)]


class _Block(NamedTuple):
    """A key block of a query tile of the attention kernel."""

    g: int  # batch-head
    q0: int
    qt: int
    k0: int
    kb: int
    first: bool  # the query tile's first key block
    last: bool
    member: int  # its place in its softmax group
    members: int  # the blocks of its softmax group
