"""The fused attention kernel: flash attention tiled over the sequence with an online softmax, software-
pipelined over the engines, no S x S tensor in HBM (passes/attention.py decides when it applies and plans it).

`_Attention` holds what the kernel's stages share (the tensors in HBM, the pools, the constant tiles, the heads
loaded) and has a method per stage a key block passes through; `attention` runs the software pipeline."""
from __future__ import annotations

import dataclasses

import numpy as np

from neuronc.codegen.access import HbmTensor, broadcast_columns, dma_by_rows, dma_slices, row_slice, tile_at
from neuronc.codegen.elementwise import Balancer
from neuronc.codegen.emitter import Emitter
from neuronc.instruction_cost import dma_transpose_ns, instruction_cost_ns, transposes_by_dma
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode, Space
from neuronc.ir import Node
from neuronc.placement import SBUF_HAZARD_BYTES, SBUF_PAGE_BYTES, partition_group
from neuronc.plans import MemoryPlan


# queues_by_clock: the kernel's clock taken as this many times the Tensor engine's work booked (the engine is busy
# ~0.8 of the time): trn2, 12 causal bf16 heads of 128 dims, seq 512, us: 1.0 31.2, 1.1 30.3, 1.15-1.3 29.9, 1.5 30.9
STORE_CLOCK = 1.2
NEG_BIG = -3.0e38  # a masked row's running max is held at least here: finite, so exp(-inf - m) = 0, not NaN
CAUSAL_BIAS = -2.0e38  # added to masked scores by a matmul (a -inf would meet the identity's zeros: NaN)


def identity(em: Emitter, tile, size: int, scratch) -> AccessPattern:
    """An identity matrix [size, size]: iota gives column - partition, compared with 0."""
    ramp = scratch.ap(size, size, dtype=DType.F32)
    em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=0.0, imm1=-1.0)
    ident = tile.ap(size, size)
    em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, ident, ramp, alu=AluOp.EQ, imm0=0.0)
    return ident


def _v_chunks(vt: AccessPattern, chunks: int, rows: int, cols: int, stride: int) -> AccessPattern:
    """`cols` columns of each of `chunks` chunks of `stride` elements of a [partitions, chunks * stride] tile."""
    return dataclasses.replace(vt, dims=((1, rows), (stride, chunks), (1, cols)))


def attention(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    """softmax(mask(scale * Q K^T)) V, flash-attention style (passes/attention.py).

    Per batch-head, K^T, V (beside a column of ones) and Q^T are loaded once and stay in SBUF. Per tile of 128
    query rows (one per partition), the keys are visited in blocks of a PSUM bank: S = Q K^T into PSUM, the
    causal mask added by a matmul with an on-chip bias tile over the at most 127 keys it cuts (blocks wholly
    above the diagonal skipped). The logits are kept negated, -scale * S, so that their row min is the exp's
    bias b = -m, made in the same pass (TENSOR_SCALAR_REDUCE); P = exp(logits + b) takes one Scalar pass, is
    transposed on the Tensor engine (a matmul with the identity) so the keys lie on partitions, and
    P [V | 1] = [P V | rowsum P] accumulates in PSUM, rescaled in place by e^(b' - b) when the running max
    grows. The output is P V / l. Each block passes through eight stages, one engine hop each, emitted
    software-pipelined so the engines' in-order queues overlap blocks (where the queues have room, some chunks of
    P^T are DMA transposes SBUF -> SBUF instead, and the pipeline waits a few steps for them: pt_by_dma); copies and scalings go to whichever of
    Vector, GpSimd and Scalar has least work, so no one dominates. The scores never leave the chip."""
    kernel = _Attention(em, node, memory)
    # Software-pipelined: at step t, stage s of block t - s is emitted (the oldest block first), so each
    # engine's in-order queue holds later blocks' work while one block's chain crosses the engines.
    stages = kernel.stages()
    in_flight: list = []  # _KeyBlock, oldest first
    rows: dict = {}
    for step, blk in enumerate([*kernel.blocks(), *[None] * (len(stages) - 1)]):
        if blk is not None:
            in_flight.append(_KeyBlock(blk, rows.setdefault((blk.g, blk.q0), _QueryTile()), step))
        for x in in_flight:
            stages[step - x.step](x)
        in_flight = [x for x in in_flight if step - x.step + 1 < len(stages)]


@dataclasses.dataclass(frozen=True)
class _Block:
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
    masked: bool = True  # a mask tensor's block is read (key_visits: not for blocks the mask leaves whole)
    pattern: int = -1  # FlexAttention's mask patterns: the one added to this block's scores (-1: none)
    pattern_col: int = 0  # from this column of the block on


@dataclasses.dataclass
class _Group:
    """The shared state of a softmax group's blocks: their row mins side by side, and the bias b' their exps take
    (with the b it replaces), made once all their logits are."""

    b_blocks: AccessPattern
    b_old: AccessPattern | None = None
    b_new: AccessPattern | None = None


@dataclasses.dataclass
class _QueryTile:
    """The online softmax state of a query tile: b = -m, the exp's bias, and acc = [P V | l] in PSUM (l, the row
    sum, from V's ones column); the softmax group being made."""

    b: AccessPattern | None = None
    acc: AccessPattern | None = None
    group: _Group | None = None


@dataclasses.dataclass
class _KeyBlock:
    """A key block in the pipeline: its query tile's state, the step it entered, and what its stages made."""

    blk: _Block
    row: _QueryTile
    step: int
    group: _Group | None = None
    scores: AccessPattern | None = None  # S = Q K^T in PSUM
    src: AccessPattern | None = None  # the exp's argument is src * factor + b
    factor: float = 1.0
    p: AccessPattern | None = None  # P = exp(...)
    corr: AccessPattern | None = None  # e^(b' - b), the accumulator's rescaling
    chunks: list | None = None  # (column, keys) of P's chunks of 128 keys
    pt_psum: list | None = None  # P^T in PSUM: [(buffer, its chunks)]
    pt: AccessPattern | None = None  # P^T in SBUF
    pt_dma: dict | None = None  # chunk -> its P^T in SBUF, made by a DMA transpose (pt_by_dma)


class _Attention:
    """One attention kernel's instructions (its AttentionPlan): the constants, a head's loads, and the stages of a
    key block, each a hop to another engine."""

    def __init__(self, em: Emitter, node: Node, memory: MemoryPlan):
        self.em, self.node = em, node
        a = self.plan = node.attrs["plan"]
        q, k, v = node.inputs[:3]
        batch, sq, sk = a.batch_shape, a.queries, a.keys
        self.q = HbmTensor.of(memory, q, a.views[0], (*batch, sq, a.head_dim))
        self.k = HbmTensor.of(memory, k, a.views[1], (*batch, sk, a.head_dim))
        self.v = HbmTensor.of(memory, v, a.views[2], (*batch, sk, a.value_dim))
        self.mask = HbmTensor.of(memory, node.inputs[3], a.views[3], (*batch, sq, sk)) if len(node.inputs) > 3 and \
            a.mask != "blocks" else None
        self.patterns = HbmTensor.of(memory, node.inputs[3]) if a.mask == "blocks" else None
        self.out = HbmTensor.of(memory, node, a.out_view, (*batch, sq, a.value_dim))
        self.causal, self.tensor_mask = a.mask == "causal", a.mask in ("select", "add")
        self.d_tiles, self.k_chunks = -(-a.head_dim // a.q_tile), -(-sk // a.q_tile)
        self.pools = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in a.pools}
        self.bank = em.psum_bank_elements()
        self.score_banks = -(-a.key_block // self.bank)  # a key block's fp32 scores span this many PSUM banks
        self.s_psum = em.psum_pool(a.score_psum // self.score_banks * self.score_banks)
        self.pt_psum, self.o_psum = em.psum_pool(a.pt_psum), em.psum_pool(2)
        self.engines = Balancer(em)
        self.heads: dict = {}  # batch-head -> its (Q^T, K^T, [V | 1]) tiles
        self.cells = False  # the head being loaded has its K^T and Q^T transposed by hazard cells (plan.cell_heads)
        self.kv_loaded = None  # ((K, V) in HBM, K^T, [V | 1]) of the head loaded last: a GQA group's shared K and V
        # the kernel's DMA work booked on each queue, and the round robin's turn at its start (freest_queue)
        self.queue_ns = [0.0] * em.target.dma_queues
        self.queue_free = [0.0] * em.target.dma_queues
        self.tensor_ns = 0.0  # the kernel's Tensor-engine work booked so far (pt_by_dma)
        self.booked_upto, self.first_turn = len(em.instructions), em.dma_turn
        self.out_groups: dict = {}  # (batch-head, group of query tiles) -> their outputs' tile, until stored
        self.make_constants()

    def small(self, name: str, rows: int) -> AccessPattern:
        return self.pools[name].next().ap(rows, 1)

    def vector(self, *args, **kwargs) -> None:
        """An ALU instruction on whichever engine has least work."""
        self.engines.emit(*args, **kwargs)

    def head(self, x: HbmTensor, g: int) -> HbmTensor:
        """Batch-head g of x [*batch_shape, rows, cols]."""
        return x[tuple(int(i) for i in np.unravel_index(g, self.plan.batch_shape))]

    def make_constants(self) -> None:
        """The kernel's constants: identities, the causal bias tiles, V's ones columns, a mask's fill, the guard's
        zeros."""
        em, a, pools, q_tile = self.em, self.plan, self.pools, self.plan.q_tile
        self.identity = identity(em, pools["identity"].next(), q_tile, pools["ramp"].next())
        self.bias_identity, self.bias = self.identity, {}
        if (self.causal or self.patterns is not None) and a.probability_dtype != DType.BF16:
            self.bias_identity = identity(em, pools["bias_identity"].next(), q_tile, pools["ramp"].next())
        self.pattern_tiles = []
        if self.patterns is not None:  # FlexAttention's mask patterns, loaded once
            count, _, width = self.patterns.dims[0][1], None, self.patterns.dims[2][1]
            for i in range(count):
                tile = pools["patterns"].next().ap(q_tile, width)
                dma_by_rows(em, tile, self.patterns[i].ap)
                self.pattern_tiles.append(tile)
        if self.causal:
            ramp = pools["ramp"].next().ap(q_tile, q_tile, dtype=DType.F32)
            for cut in a.causal_cuts:
                tile = pools["bias"].next().ap(q_tile, q_tile)  # column c masks row i where c - i + cut > 0
                em.emit(Opcode.IOTA, Engine.GPSIMD, ramp, imm0=float(cut), imm1=-1.0)
                em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, ramp, alu=AluOp.GT, imm0=0.0)
                em.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, tile, tile, alu=AluOp.MULTIPLY, imm0=CAUSAL_BIAS)
                self.bias[cut] = tile
        dv = a.value_dim
        for _ in range(pools["v"].bufs):  # V's ones columns, which the loads of V leave alone: made once
            vt = pools["v"].next().ap(q_tile, self.k_chunks * (dv + 1))
            ones = _v_chunks(vt, self.k_chunks, q_tile, 1, dv + 1)
            em.emit(Opcode.MEMSET, Engine.GPSIMD, dataclasses.replace(ones, offset=vt.offset + dv * vt.dtype.itemsize),
                    imm0=1.0)
        if a.mask == "select":
            self.fill = pools["fill"].next().ap(q_tile, a.key_block)
            em.emit(Opcode.MEMSET, Engine.GPSIMD, self.fill, imm0=-a.fill)  # negated, as the logits are
        if a.zero_masked_rows:
            self.zeros = pools["zeros"].next().ap(q_tile, dv)
            em.emit(Opcode.MEMSET, Engine.GPSIMD, self.zeros, imm0=0.0)
        if a.warm_exp:  # the exp's activation table loaded during the fill, not by the first exp, on the pipeline's
            # path (the first P^T and P V wait for it): an exp of a column of the identity, its result unused
            self.engines.activate(Opcode.ACTIVATE, self.small("dm", q_tile), tile_at(self.identity, 0, q_tile, 1),
                                  func=ActFunc.EXP, imm0=1.0, imm1=0.0)
        self.score_mod = None
        if a.score_mod:  # FlexAttention: the score_mod's steps on each block of logits (codegen/score_mod.py)
            from neuronc.codegen.score_mod import ScoreMod

            self.score_mod = ScoreMod(self, a.score_mod, q_tile, a.key_block)
            if a.mask == "select":
                self.fill_logits = pools["fill_logits"].next().ap(q_tile, a.key_block)
                em.emit(Opcode.MEMSET, Engine.GPSIMD, self.fill_logits, imm0=a.fill)

    def blocks(self):
        """The _Block of every key block of every query tile, in order."""
        a = self.plan
        sq, sk, offset, q_tile, block, group_size = (a.queries, a.keys, a.causal_offset, a.q_tile, a.key_block,
                                                     a.softmax_blocks)
        for g in range(a.batch):
            for q0 in range(0, sq, q_tile):
                qt = min(q_tile, sq - q0)
                if a.key_visits:  # FlexAttention: only the blocks its mask leaves anything in
                    visits = a.key_visits[q0 // q_tile]
                else:
                    last_key = min(sk, q0 + qt + offset) if self.causal else sk  # keys beyond: masked for every row
                    visits = [(k0, min(block, last_key - k0), True) for k0 in range(0, last_key, block)]
                for n, (k0, kb, masked, *pattern) in enumerate(visits):
                    member = n % group_size
                    members = min(group_size, len(visits) - (n - member))
                    yield _Block(g, q0, qt, k0, kb, n == 0, n == len(visits) - 1, member, members, masked,
                                 *pattern)

    def stages(self) -> tuple:
        """The stages a key block passes through, in order (the pools are sized for as many blocks in flight)."""
        by_dma = self.plan.pt_by_dma  # P^T's DMA transposes take microseconds: the pipeline waits for them
        stages = (self.scores_stage, self.logits_stage, self.bias_stage,
                  *[self.waiting_stage] * (self.plan.softmax_blocks - 1), self.exp_stage,
                  *[self.waiting_stage] * (self.plan.pt_wait * by_dma), self.transpose_stage, self.evacuate_stage,
                  *[self.waiting_stage] * (self.plan.pv_wait * by_dma), self.product_stage, self.output_stage)
        assert len(stages) == self.plan.depth
        return stages

    # a head's loads -----------------------------------------------------------------------------------
    def load_head(self, g: int) -> tuple:
        """K^T [d, Sk] and Q^T [d, Sq] (d on partitions, by tiles of 128), V [Sk, Dv] (keys on partitions, by
        chunks of 128) of one batch-head, resident while its query tiles run. The query heads of a GQA group read
        the same K and V (a stride of 0 over the group's members): those are loaded once, for its first member,
        and stay while the members after it run (a pool's buffer is taken again only `bufs` loads later)."""
        q_tile, sq = self.plan.q_tile, self.plan.queries
        k, v = self.head(self.k, g), self.head(self.v, g)
        first = g < self.plan.rows_heads  # the pipeline's fill waits for these: transposed on the Tensor engine
        shared = self.kv_loaded is not None and self.kv_loaded[0] == (k, v)
        self.cells = g < self.plan.cell_heads
        kt = self.kv_loaded[1] if shared else self.load_k(k, first)
        # the kernel's first head, when transposed by DMA, loads Q^T before V: the first scores need K^T and Q^T, the
        # first P V comes later (issued after V, Q^T's transposes queue behind V's loads: seq 2048, head dim 128,
        # trn2: 306.4 -> 303.9 us; its rows, made on 4 queues, do not: seq 512, head dim 128: 34.8 -> 35.5 us)
        vt = self.kv_loaded[2] if shared else None if g == 0 and not first else self.load_v(v)
        qtile = self.pools["q"].next().ap(q_tile, self.d_tiles * sq)
        (self.load_rows_transposed if first else self.load_transposed)(qtile, self.head(self.q, g), sq)
        if vt is None:
            vt = self.load_v(v)
        self.kv_loaded = ((k, v), kt, vt)
        return qtile, kt, vt

    def load_k(self, k: HbmTensor, first: bool = False) -> AccessPattern:
        """K^T of one head into SBUF."""
        kt = self.pools["k"].next().ap(self.plan.q_tile, self.d_tiles * self.plan.keys)
        (self.load_rows_transposed if first else self.load_transposed)(kt, k, self.plan.keys)
        return kt

    def load_v(self, v: HbmTensor) -> AccessPattern:
        """[V | 1] of one head into SBUF, by chunks of 128 keys: P [V | 1] = [P V | rowsum P]."""
        em, q_tile, sk, dv = self.em, self.plan.q_tile, self.plan.keys, self.plan.value_dim
        vt = self.pools["v"].next().ap(q_tile, self.k_chunks * (dv + 1))
        full = sk // q_tile
        if full:
            dma_by_rows(em, _v_chunks(vt, full, q_tile, dv, dv + 1), v[0:full * q_tile].tiled(q_tile).ap)
        if sk % q_tile:
            em.dma(tile_at(vt, full * (dv + 1), sk % q_tile, dv), v[full * q_tile:sk].ap)
        return vt

    def load_transposed(self, tile: AccessPattern, x: HbmTensor, rows: int) -> None:
        """x^T [d, rows] into `tile` (d on partitions, by tiles of 128, each `rows` wide) from x [rows, d] in HBM.
        A tile of 128 partitions of a 2-byte type with contiguous rows is one DMA transpose where the target has
        them (isa.py's DMA_TRANSPOSE: its documented friendly pattern, whole [128, 16] units, at 0.9 of a queue's
        rate); anything else is strided loads (each element its own run: half a queue's rate, targets.py), split
        over queues by partition groups. Transposes go by chunks of an SBUF page of columns, or of one hazard cell of
        them for the plan's cell_heads (the sync pass's cells: chunks sharing one would wait for each other), each on
        its own queue. (A DMA transpose of fewer partitions pays whole units: at head dim 64 it is slower than the
        strided loads on two queues.)"""
        em, q_tile, d = self.em, self.plan.q_tile, self.plan.head_dim
        page = (SBUF_HAZARD_BYTES if self.cells else SBUF_PAGE_BYTES) // x.dtype.itemsize
        for j in range(self.d_tiles):
            d0, dt = j * q_tile, min(q_tile, d - j * q_tile)
            if (transposes_by_dma(dt, x.dtype.itemsize, em.target) and x.dims[-1][0] == 1
                    and rows % em.target.dma_transpose_inner == 0):
                for r0 in range(0, rows, page):
                    r1 = min(rows, r0 + page)
                    # on the queue that frees first on the kernel's clock, with the plan's queues_by_clock
                    dst, src = tile_at(tile, j * rows + r0, dt, r1 - r0), x[r0:r1, d0:d0 + dt].ap
                    if self.plan.queues_by_clock:
                        em.dma_on(self.freest_queue(True), dst, src, transpose=True)
                    else:
                        em.dma(dst, src, transpose=True)
            else:
                dma_by_rows(em, tile_at(tile, j * rows, dt, rows), x.T[d0:d0 + dt].ap)

    def load_rows_transposed(self, tile: AccessPattern, x: HbmTensor, rows: int) -> None:
        """x^T [d <= 128, rows] into `tile` as load_transposed does, for the kernel's first heads, which the
        pipeline's fill waits for (passes/attention.py rows_heads): x's rows loaded as they lie (chunks of 128 rows on
        partitions, split by partitions over 4 queues), transposed on the Tensor engine (matmuls with the identity:
        exact) into PSUM, a bank at a time, and copied to `tile` by whichever engine finishes first."""
        em, q_tile, d = self.em, self.plan.q_tile, self.plan.head_dim
        chunks = rows // q_tile
        stage = self.pools["rows"].next().ap(q_tile, chunks * d)
        dma_by_rows(em, _v_chunks(stage, chunks, q_tile, d, d), x[0:rows].tiled(q_tile).ap,
                    em.target.dma_queues // 4)
        mode = em.target.tensor_transpose_mode  # trn2+: 16-bit results in PSUM (the pass asks for a 2-byte x)
        per_bank = max(1, self.bank * (2 if mode else 1) // q_tile)
        for first in range(0, chunks, per_bank):
            part = range(first, min(chunks, first + per_bank))
            acc = self.pt_psum.next().ap(d, len(part) * q_tile, dtype=stage.dtype if mode else DType.F32)
            for n, c in enumerate(part):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(acc, n * q_tile, d, q_tile),
                        tile_at(stage, c * d, q_tile, d), tile_at(self.identity, 0, q_tile, q_tile))
            self.engines.scale_soonest(tile_at(tile, first * q_tile, d, len(part) * q_tile), acc, 1.0,
                                       self.plan.copy_slack)

    def freest_queue(self, by_clock: bool = False) -> int:
        """The DMA queue with least work booked by the kernel's transfers so far (each priced as the emulator
        prices it alone), or with `by_clock` and the plan's queues_by_clock, the one that frees first on the kernel's
        estimated clock (`queue_free`); of equal ones, the first counted from the queue the kernel's round robin started
        on, so that the choice turns with the kernel's other transfers (a reused kernel's instances: Emitter.dma_on)."""
        self.book()
        n = len(self.queue_ns)
        booked = self.queue_free if by_clock and self.plan.queues_by_clock else self.queue_ns
        return min(range(n), key=lambda q: (booked[q], (q - self.first_turn) % n))

    def book(self) -> None:
        """Book the kernel's DMA and Tensor-engine instructions emitted since the last booking, each priced as the
        emulator prices it alone; and when each queue frees on an estimated clock (`queue_free`): a load may start
        when issued, a store when the kernel's clock reaches it (STORE_CLOCK times the Tensor engine's work booked
        before it), and a transfer behind another on its queue prepares while that one moves data (its fixed cost
        hidden, as stream_timing overlaps it)."""
        for inst in self.em.instructions[self.booked_upto:]:
            if inst.engine == Engine.DMA:
                cost, q = instruction_cost_ns(inst, self.em.target), inst.queue
                self.queue_ns[q] += cost
                ready = STORE_CLOCK * self.tensor_ns if inst.operands[0].space == Space.HBM else 0.0
                self.queue_free[q] = max(self.queue_free[q] + cost - self.em.target.dma_fixed_ns, ready + cost)
            elif inst.engine == Engine.TENSOR:
                self.tensor_ns += instruction_cost_ns(inst, self.em.target)
        self.booked_upto = len(self.em.instructions)

    # helpers of the stages ----------------------------------------------------------------------------
    def score_tile(self, qt: int, kb: int) -> AccessPattern:
        """A [qt, kb] fp32 tile on consecutive PSUM banks (a matmul writes within one: by bank_spans)."""
        slots = [self.s_psum.next() for _ in range(self.score_banks)]
        assert all(b.offset == a.offset + self.em.target.psum_bank_bytes for a, b in zip(slots, slots[1:]))
        return slots[0].ap(qt, kb)

    def bank_spans(self, c0: int, c1: int) -> list:
        """[c0, c1) cut at the PSUM bank boundaries of a score tile's columns."""
        bank = self.bank
        return [(c, min(c1, (c // bank + 1) * bank)) for c in range(c0, c1) if c == c0 or c % bank == 0]

    def scores_of(self, qtile: AccessPattern, kt: AccessPattern, q0: int, qt: int, k0: int, kb: int) -> AccessPattern:
        """S = Q K^T of a key block into PSUM, the causal bias added over the keys the diagonal cuts."""
        em, a, q_tile = self.em, self.plan, self.plan.q_tile
        scores = self.score_tile(qt, kb)
        for c0, c1 in self.bank_spans(0, kb):
            for j in range(self.d_tiles):
                dt = min(q_tile, a.head_dim - j * q_tile)
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(scores, c0, qt, c1 - c0),
                        tile_at(qtile, j * a.queries + q0, dt, qt), tile_at(kt, j * a.keys + k0 + c0, dt, c1 - c0),
                        accumulate=j > 0)
        offset = a.causal_offset
        first_cut = max(k0, q0 + offset + 1)  # keys from here on are masked for some row of the tile
        if self.causal and first_cut < k0 + kb:
            cut = k0 - q0 - offset if k0 > q0 + offset else 1
            for c0, c1 in self.bank_spans(first_cut - k0, kb):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(scores, c0, qt, c1 - c0),
                        tile_at(self.bias_identity, 0, qt, qt),
                        tile_at(self.bias[cut], c0 - (first_cut - k0), qt, c1 - c0), accumulate=True)
        return scores

    def logits_of(self, g: int, scores: AccessPattern, q0: int, qt: int, k0: int, kb: int, b: AccessPattern,
                  logits: AccessPattern | None, masked: bool = True) -> tuple:
        """(src, factor): the exp's argument is src * factor + bias, and b [qt, 1] = -(the row max of src *
        factor). Materialised logits are made negated (factor -1) in `logits`; unless a mask tensor comes in
        between, their row min, b, is made in the same pass."""
        a, engines, vector = self.plan, self.engines, self.vector
        if not a.logits_in_sbuf:
            self.row_bias(b, scores, a.scale)
            return scores, a.scale
        if not a.fused_logits:  # S rounded as eager rounds it, then scaled
            rounded_scores = self.pools["scores"].next().ap(qt, kb, dtype=a.score_dtype)
            engines.scale_soonest(rounded_scores, scores, 1.0)
            scores = rounded_scores
        if self.score_mod is not None:
            return self.modified_logits(g, scores, q0, qt, k0, kb, b, logits, masked)
        if not self.tensor_mask or not masked:
            self.negated_logits(logits, b, scores, -a.scale)
            return logits, -1.0
        engines.scale_soonest(logits, scores, -a.scale)
        mtile = self.pools["mask"].next().ap(qt, kb)
        self.em.dma(mtile, self.head(self.mask, g)[q0:q0 + qt, k0:k0 + kb].ap)
        if a.mask == "add":
            vector(Opcode.TENSOR_TENSOR, logits, logits, mtile, alu=AluOp.SUBTRACT)
        else:
            filled = tile_at(self.fill, 0, qt, kb)
            on_true, on_false = (filled, logits) if a.masked_when else (logits, filled)
            vector(Opcode.SELECT, logits, mtile, on_true, on_false)
        self.row_bias(b, logits, -1.0)
        return logits, -1.0

    def negated_logits(self, logits: AccessPattern, b: AccessPattern, scores: AccessPattern, factor: float) -> None:
        """logits = scores * factor (rounded to the logits' dtype) and b = their row min: one Vector pass
        (TENSOR_SCALAR_REDUCE), or, when that would end later, a Scalar pass making the logits and a GpSimd pass
        taking their min in SBUF (the scores in PSUM are out of GpSimd's reach), so that the three engines share
        the per-score work."""
        engines = self.engines
        if scores.space != Space.PSUM:  # within GpSimd's reach: the least loaded of Vector and GpSimd, in one pass
            self.vector(Opcode.TENSOR_SCALAR_REDUCE, logits, b, scores, alu=AluOp.MIN, imm0=factor)
            return
        fused = engines.finish(Engine.VECTOR, Opcode.TENSOR_SCALAR_REDUCE, (logits, b, scores), alu=AluOp.MIN,
                               imm0=factor)
        made = engines.finish(Engine.SCALAR, Opcode.ACTIVATE, (logits, scores), func=ActFunc.IDENTITY, imm0=factor,
                              imm1=-0.0)
        if made < fused:
            reduced = max(made, engines.finish(Engine.GPSIMD, Opcode.TENSOR_REDUCE, (b, logits), alu=AluOp.MIN))
            if reduced < fused:
                engines.activate(Opcode.ACTIVATE, logits, scores, func=ActFunc.IDENTITY, imm0=factor, imm1=-0.0)
                engines.emit(Opcode.TENSOR_REDUCE, b, logits, alu=AluOp.MIN, on=Engine.GPSIMD)
                return
        engines.emit(Opcode.TENSOR_SCALAR_REDUCE, logits, b, scores, alu=AluOp.MIN, imm0=factor, on=Engine.VECTOR)

    def modified_logits(self, g: int, scores: AccessPattern, q0: int, qt: int, k0: int, kb: int, b: AccessPattern,
                        logits: AccessPattern, masked: bool) -> tuple:
        """FlexAttention: logits = scale * S, then the score_mod's steps, then the mask (masked scores -inf, after
        the score_mod as flex_attention applies it), and b = -(their row max)."""
        a = self.plan
        self.engines.scale_soonest(logits, scores, a.scale)
        batch, kv_head, member = (int(i) for i in np.unravel_index(g, a.batch_shape))  # (batch, kv head, g)
        head = kv_head * a.batch_shape[2] + member
        self.score_mod.apply(logits, batch, head, q0, qt, k0, kb)
        if self.tensor_mask and masked:
            mtile = self.pools["mask"].next().ap(qt, kb)
            self.em.dma(mtile, self.head(self.mask, g)[q0:q0 + qt, k0:k0 + kb].ap)
            self.vector(Opcode.SELECT, logits, mtile, logits, tile_at(self.fill_logits, 0, qt, kb))
        self.row_bias(b, logits, 1.0)
        return logits, 1.0

    def row_bias(self, b: AccessPattern, src: AccessPattern, factor: float) -> None:
        """b = -(the row max of src * factor) of a key block."""
        if factor < 0:  # negated logits: their row min
            self.vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MIN)
        else:
            self.vector(Opcode.TENSOR_REDUCE, b, src, alu=AluOp.MAX)
            self.vector(Opcode.TENSOR_SCALAR, b, b, alu=AluOp.MULTIPLY, imm0=-factor)

    def transposes(self, p: AccessPattern, qt: int, chunks: list) -> list:
        """P^T [keys, queries] into PSUM: Tensor-engine transposes (matmuls with the identity) of `chunks` of
        128 keys, side by side, a bank's worth of consecutive chunks per PSUM buffer; [(buffer, its chunks)]."""
        per_bank = max(1, self.bank // qt)
        parts = []
        # trn2+: the transpose mode writes 16-bit P^T to PSUM, which the evacuating engines copy faster (targets.py)
        mode = self.em.target.tensor_transpose_mode and p.dtype in (DType.BF16, DType.F16)
        runs: list = []  # runs of consecutive chunks, cut at a bank's worth
        for chunk in chunks:
            if runs and len(runs[-1]) < per_bank and runs[-1][-1][0] + self.plan.q_tile == chunk[0]:
                runs[-1].append(chunk)
            else:
                runs.append([chunk])
        for part in runs:
            pt_acc = self.pt_psum.next().ap(self.plan.q_tile, len(part) * qt, dtype=p.dtype if mode else DType.F32)
            for n, (c, rows) in enumerate(part):
                self.em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(pt_acc, n * qt, rows, qt), tile_at(p, c, qt, rows),
                             tile_at(self.identity, 0, qt, qt))
            parts.append((pt_acc, part))
        return parts

    def evacuated(self, parts: list, qt: int, chunks: list, pt: AccessPattern | None = None) -> AccessPattern:
        """P^T copied from PSUM to SBUF (into `pt`, or a new tile), where the Tensor engine reads it: the chunk of
        keys from n * q_tile at column n * qt."""
        q_tile, engines = self.plan.q_tile, self.engines
        if pt is None:
            pt = self.pools["pt"].next().ap(q_tile, len(chunks) * qt)
        for pt_acc, part in parts:
            n0 = part[0][0] // q_tile
            whole = sum(rows == q_tile for _, rows in part)
            if whole:
                engines.scale_soonest(tile_at(pt, n0 * qt, q_tile, whole * qt), tile_at(pt_acc, 0, q_tile, whole * qt),
                                      1.0, self.plan.copy_slack)
            for n, (_, rows) in enumerate(part[whole:], whole):
                engines.scale_soonest(tile_at(pt, (n0 + n) * qt, rows, qt), tile_at(pt_acc, n * qt, rows, qt), 1.0,
                                      self.plan.copy_slack)
        return pt

    # the stages of a key block ------------------------------------------------------------------------
    # The blocks of a softmax group share a _Group: their row mins side by side, and the bias b' their exps take,
    # made once all their logits are.
    def scores_stage(self, x: _KeyBlock) -> None:
        """S = Q K^T into PSUM, the causal bias added."""
        blk = x.blk
        for g in range(blk.g, blk.g + 1 + self.plan.heads_ahead):  # this head's loads, and the next ones' ahead
            if g not in self.heads and g < self.plan.batch:
                self.heads[g] = self.load_head(g)
        qtile, kt, _ = self.heads[blk.g]
        x.scores = self.scores_of(qtile, kt, blk.q0, blk.qt, blk.k0, blk.kb)
        if blk.pattern >= 0:  # FlexAttention: the block's mask pattern added as the causal bias is
            tile = self.pattern_tiles[blk.pattern]
            width = min(tile.dims[1][1], blk.kb - blk.pattern_col)
            for c0, c1 in self.bank_spans(blk.pattern_col, blk.pattern_col + width):
                self.em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(x.scores, c0, blk.qt, c1 - c0),
                             tile_at(self.bias_identity, 0, blk.qt, blk.qt),
                             tile_at(tile, c0 - blk.pattern_col, blk.qt, c1 - c0), accumulate=True)

    def logits_stage(self, x: _KeyBlock) -> None:
        """The block's logits and their row min, in its column of the group's."""
        blk, row = x.blk, x.row
        if blk.member == 0:
            row.group = _Group(self.pools["b_blocks"].next().ap(blk.qt, blk.members))
        x.group = row.group
        b = tile_at(x.group.b_blocks, blk.member, blk.qt, 1)
        logits = (self.pools["logits"].next().ap(blk.qt, blk.kb, dtype=self.plan.logits_dtype)
                  if self.plan.logits_in_sbuf else None)
        x.src, x.factor = self.logits_of(blk.g, x.scores, blk.q0, blk.qt, blk.k0, blk.kb, b, logits, blk.masked)

    def bias_stage(self, x: _KeyBlock) -> None:
        """After a softmax group's last block: b' = min(b, the group's row mins)."""
        blk, row, group = x.blk, x.row, x.group
        if blk.member < blk.members - 1:
            return
        b_group = group.b_blocks
        if blk.members > 1:
            b_group = self.small("b", blk.qt)
            self.vector(Opcode.TENSOR_REDUCE, b_group, group.b_blocks, alu=AluOp.MIN)
        if row.b is None:
            b_new = b_group
            if self.tensor_mask:  # a row masked so far keeps a finite bias
                self.vector(Opcode.TENSOR_SCALAR, b_group, b_group, alu=AluOp.MIN, imm0=-NEG_BIG)
        else:
            b_new = self.small("b", blk.qt)
            self.vector(Opcode.TENSOR_TENSOR, b_new, row.b, b_group, alu=AluOp.MIN)
        group.b_old, group.b_new, row.b = row.b, b_new, b_new

    def exp_stage(self, x: _KeyBlock) -> None:
        """P = exp(src f + b') in one Scalar pass (its row sum comes with P V, from V's ones column), and, for
        the first block of a group after the first, corr = e^(b' - b), the accumulator's rescaling, in another
        (-b taken as the source, b' as the bias). (One exp per block, not per group: the group's first
        transposes would wait for all of its exps.)"""
        blk, group, engines = x.blk, x.group, self.engines
        x.p = self.pools["p"].next().ap(blk.qt, blk.kb)
        engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x.p, self.small("rowsum", blk.qt), x.src, group.b_new,
                         func=ActFunc.EXP, imm0=x.factor)
        if blk.member == 0 and group.b_old is not None:
            x.corr = self.small("corr", blk.qt)
            engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, x.corr, self.small("dm", blk.qt), group.b_old,
                             group.b_new, func=ActFunc.EXP, imm0=-1.0)

    def transpose_stage(self, x: _KeyBlock) -> None:
        """P^T: by chunks of 128 keys, each a Tensor-engine transpose into PSUM (evacuated in the next stage), or,
        with the plan's pt_by_dma, a DMA transpose SBUF -> SBUF where pt_by_dma prices it so."""
        q_tile, qt = self.plan.q_tile, x.blk.qt
        x.chunks = [(c, min(q_tile, x.blk.kb - c)) for c in range(0, x.blk.kb, q_tile)]
        on_tensor = x.chunks
        x.pt_dma = {}
        if self.plan.pt_by_dma:
            x.pt = self.pools["pt"].next().ap(q_tile, len(x.chunks) * qt)
            on_tensor = []
            # the block's last chunks first: its P V starts with the chunks the Tensor engine transposed (seq 2048, head
            # dim 128 / 64, trn2: the first chunks by DMA 285.6 / 281.1 us, the last 284.9 / 279.4)
            for c, rows in x.chunks[::-1]:
                queue = self.pt_by_dma(rows, qt) if len(x.pt_dma) < self.plan.pt_dma_chunks else None
                if queue is None:
                    on_tensor.append((c, rows))
                else:
                    x.pt_dma[c] = self.pools["pt_dma"].next().ap(rows, qt)
                    self.em.dma_on(queue, x.pt_dma[c], tile_at(x.p, c, qt, rows), transpose=True)
        x.pt_psum = self.transposes(x.p, qt, sorted(on_tensor))

    def pt_by_dma(self, rows: int, qt: int) -> int | None:
        """The queue for a chunk of P^T [rows, qt] by DMA transpose, or None for a Tensor-engine transpose: the
        freest queue when its booked work with the transpose stays within the Tensor engine's booked work (and qt
        whole units of the DMA engines' transpose: isa.py)."""
        if qt % self.em.target.dma_transpose_inner:
            return None
        queue = self.freest_queue()
        cost = dma_transpose_ns(rows, qt, self.plan.probability_dtype.itemsize, self.em.target, from_hbm=False)
        return queue if self.queue_ns[queue] + cost <= self.tensor_ns else None

    def evacuate_stage(self, x: _KeyBlock) -> None:
        x.pt = self.evacuated(x.pt_psum, x.blk.qt, x.chunks, x.pt)
        if not self.plan.pt_by_dma:
            self.rescale(x)

    def rescale(self, x: _KeyBlock) -> None:
        if x.corr is not None:  # the accumulator [P V | l] in PSUM, rescaled before this block's P V adds to it
            acc = x.row.acc
            corr = broadcast_columns(x.corr, self.plan.value_dim + 1)  # held per partition: one pass
            self.vector(Opcode.TENSOR_ALU2, acc, acc, corr, corr, alu=AluOp.MULTIPLY)

    def product_stage(self, x: _KeyBlock) -> None:
        """[P V | rowsum P] into (or added to) the query tile's accumulator in PSUM."""
        blk, dv, q_tile = x.blk, self.plan.value_dim, self.plan.q_tile
        vt = self.heads[blk.g][2]
        if self.plan.pt_by_dma:
            self.rescale(x)
        if blk.first:
            x.row.acc = self.o_psum.next().ap(blk.qt, dv + 1)
        for n, (c, rows) in enumerate(x.chunks):
            pt = x.pt_dma[c] if c in x.pt_dma else tile_at(x.pt, n * blk.qt, rows, blk.qt)
            self.em.emit(Opcode.MATMUL, Engine.TENSOR, x.row.acc, pt,
                         tile_at(vt, (blk.k0 + c) // q_tile * (dv + 1), rows, dv + 1),
                         accumulate=n > 0 or not blk.first)

    def output_stage(self, x: _KeyBlock) -> None:
        """After the query tile's last block, out = P V / l, stored with the head's next whole query tiles (up to
        out_tiles of them: a store of a [128, dv] tile moves only dv elements per partition, far below a queue's
        rate on the payload curve) when it is the last of them."""
        blk, dv, q_tile = x.blk, self.plan.value_dim, self.plan.q_tile
        if not blk.last:
            return
        qt, acc = blk.qt, x.row.acc
        tiles, whole = self.plan.out_tiles, self.plan.queries // q_tile
        n = blk.q0 // q_tile
        # the last heads' tiles go out one by one, by slices of partitions on the queues with least work booked (the
        # kernel ends when they are stored): a head's grouped store takes one queue for microseconds
        grouped = qt == q_tile and tiles > 1 and blk.g < self.plan.batch - self.plan.tail_heads
        if grouped:
            key = (blk.g, n // tiles)
            if key not in self.out_groups:
                self.out_groups[key] = self.pools["out"].next().ap(q_tile, tiles * dv)
            group = self.out_groups[key]
            out = tile_at(group, n % tiles * dv, qt, dv)
        else:
            out = self.pools["out_tile"].next().ap(qt, dv)
        l = tile_at(acc, dv, qt, 1)
        per_row = broadcast_columns(l, dv)  # held per partition: one pass over P V, divided as TENSOR_TENSOR would
        self.vector(Opcode.TENSOR_ALU2, out, tile_at(acc, 0, qt, dv), per_row, per_row, alu=AluOp.DIVIDE)
        if self.plan.zero_masked_rows:  # a row every key is masked for gives zeros (l = 0), not 0 / 0
            empty = self.small("empty_row", qt)
            self.vector(Opcode.TENSOR_SCALAR, empty, l, alu=AluOp.EQ, imm0=0.0)
            self.vector(Opcode.SELECT, out, broadcast_columns(empty, dv), tile_at(self.zeros, 0, qt, dv), out)
        if not grouped:
            target = self.em.target
            tail = blk.g >= self.plan.batch - self.plan.tail_heads
            pieces = min(target.dma_queues // 4, qt // partition_group(target)) if tail else 1
            dst = self.head(self.out, blk.g)[blk.q0:blk.q0 + qt].ap
            if tail:
                for p0, p1 in dma_slices(target, out, max(1, pieces)):
                    self.em.dma_on(self.freest_queue(True), row_slice(dst, p0, p1), row_slice(out, p0, p1))
            else:
                dma_by_rows(self.em, dst, out, max(1, pieces))
        elif n % tiles == tiles - 1 or n == whole - 1:
            first = n - n % tiles
            self.em.dma(self.head(self.out, blk.g)[first * q_tile:(n + 1) * q_tile].tiled(q_tile).ap,
                        _v_chunks(self.out_groups.pop(key), n + 1 - first, q_tile, dv, dv))

    def waiting_stage(self, x: _KeyBlock) -> None:
        """A block waits here for the later blocks of its softmax group to make their logits."""
