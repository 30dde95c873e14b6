"""Attention fusion: scaled dot-product attention as one flash-attention-style kernel.

Unfused, attention is a matmul writing the [Sq, Sk] scores of every head to HBM, a softmax reading and
writing them again, and a second matmul reading the probabilities: the S x S tensor makes three round
trips through HBM and dominates the time. Fused (`Op.ATTENTION`, codegen `codegen/attention.py`), a tile of
query rows meets the keys block by block with an online softmax (running max and sum, the accumulator
rescaled), so the scores live only in PSUM and SBUF; causal blocks above the diagonal are skipped.

The pass recognises, after legalisation (before the other fusions), the forms the frontend produces:

    P = softmax(logits(Q @ K^T)) [guarded]      O = P @ V

- `Q @ K^T`: a MATMUL whose operands may be strided views (heads split out of a fused projection,
  K transposed), bf16 -> fp32 conversions (read in their own dtype) and multiplications by a scalar
  (F.scaled_dot_product_attention scales Q and K by sqrt(scale) each);
- logits: scalar multiplications/divisions (the scale), conversions, and at most one mask, either
  `select(pred, fill, x)` / `select(pred, x, fill)` (masked_fill) or `x + bias` (an additive mask), before
  the scale only if it is a -inf select;
- softmax over the last axis: max, subtract, exp, sum, divide (with conversions around it);
- guarded: `select(all(logits == -inf) per row, 0, softmax)`, what torch's SDPA decomposition adds so a
  fully masked row gives zeros rather than NaN.

Grouped-query attention (K and V repeated per group of query heads: repeat_interleave, Hugging Face's `repeat_kv`,
SDPA's enable_gqa; all are a stride-0 view of a new axis, reshaped) reads the K/V heads where they lie: the batch
dims become (batch, kv heads, group), K's and V's stride over the group 0 (see _batch_splits), and the kernel loads
a group's K and V once.

A mask that is a constant lower-triangular pattern with -inf above the diagonal becomes `causal` (made on
chip, never read from HBM, and the blocks it hides skipped); any other mask is read block by block.

attrs of the ATTENTION node (O is [B, Sq, Dv], B merging batch and heads (GQA: batch, kv heads, group); the node's shape is O's, or that of
the permutation of O the model makes next, heads transposed back and merged, which the kernel writes in place):
  batch_shape: B's dims (batch, heads); queries, keys, head_dim, value_dim: Sq, Sk, D, Dv;
  views: per input (element offset, strides over (*batch_shape, rows, cols)) — q [.., Sq, D], k [.., Sk, D],
  v [.., Sk, Dv], mask [.., Sq, Sk]; out_view: where O [*batch_shape, Sq, Dv] lies in the node's dense buffer;
  scale (> 0, on the logits); mask: "none" | "causal" | "select" | "add"; causal_offset (key j is kept for
  query i when j <= i + offset); fill and masked_when (select: logits become fill where pred == masked_when);
  zero_masked_rows (the guard); ops (what was fused, for `neuronc inspect --kernels`).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from neuronc import ir
from neuronc.affine_fit import affine_fit
from neuronc.errors import NeuronCompileError
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.canonicalize import _evaluate
from neuronc.passes.context import PassContext
from neuronc.instruction_cost import dma_transfer_ns, dma_transpose_ns, matmul_pass_ns, transposes_by_dma
from neuronc.passes.cost_model import SBUF_PAGE_BYTES, fits_sbuf
from neuronc.passes.legalize import dense_strides, reshaped_strides
from neuronc.passes.rowwise import _resolve
from neuronc.passes.structural_key import structural_key
from neuronc.placement import SBUF_HAZARD_BYTES, dma_slice_count
from neuronc.plans import AttentionPlan, View, pool_specs
from neuronc.targets import Target

Q_TILE = 128  # query rows per tile: one per partition
KEY_BLOCK = 1024  # keys per block when the logits are made in SBUF: two PSUM banks of fp32 scores
BANK_KEYS = 512  # keys per block when the exp reads the scores in PSUM: one bank, as a third buffer is needed
# Where a query tile meets at least LONG_KEYS keys, the logits are made by blocks of KEY_BLOCK // SPLIT keys (split_blocks):
# the scores' four PSUM banks hold two 1024-key blocks, and the Tensor engine waited for a block's copies out of PSUM
# before the next block's QK^T (trn2, 12 causal bf16 heads of 128 dims, seq 2048: 14.6 of its 26.6 idle us); with
# 512-key blocks four are in flight. A softmax group keeps its 2048 keys (SOFTMAX_BLOCKS * SPLIT blocks), and P^T's
# waits their time (PT_WAIT, PV_WAIT: SPLIT times the steps). Measured (us, 1024-key blocks -> 512): seq 2048, head
# dim 128 276.7 -> 262.1, head dim 64 277.3 -> 272.2; at seq 1024 (12 heads, head dim 128: one block a tile) 85.4 ->
# 82.4 alone, but the Llama layer (16 heads) 1938.1 -> 1939.9, so not below LONG_KEYS
LONG_KEYS = 2048
SPLIT = 2
# The PSUM banks of the scores and of P^T with split blocks (else 4 and 2; the accumulators take 2 of the 8): a block's
# 16-bit P^T takes one bank, and with four blocks of scores in flight the Tensor engine's waits moved to P^T's copies
# out of PSUM. trn2, 12 causal bf16 heads, seq 2048, us (scores, P^T, accumulators): head dim 128 (4, 2, 2) 262.1, (3, 3,
# 2) 261.3, (3, 2, 3) 262.3, (5, 2, 1) and (4, 3, 1) 281.5; head dim 64 (4, 2, 2) 271.1, (3, 3, 2) 268.4
SPLIT_PSUM = (3, 3)
MAX_HEAD_DIM = 511  # the PV product and its row sum [queries, Dv + 1] must fit one PSUM bank
STAGES = 8  # stages of a key block in the kernel's software pipeline, one engine hop each
SOFTMAX_BLOCKS = 2  # key blocks sharing one softmax statistic (2048 keys): one rescaling of the accumulator per 2
HEADS_AHEAD = 2  # a head's K, V and Q are loaded while the two heads before it run: a load takes about two heads' time
# ... or three, where SBUF holds the extra buffers: a load queued behind the previous heads' output stores on the
# in-order DMA queues comes late for short heads (seq 512, head dim 128: 45.9 -> 41.8 us on trn2)
HEADS_AHEAD_MOST = 3
# The first heads made from rows (rows_heads): seq 512, head dim 128, trn2: 36.6 us with one, 34.8 with two, 36.9 with
# three (each adds Tensor transposes and their copies out of PSUM to engines that are the kernel's bottleneck)
ROWS_HEADS = 2
# The last heads whose outputs are stored tile by tile (the kernel ends with them), not a head's tiles at once:
# seq 512, head dim 128, trn2: 2 heads 36.6 us, 3 35.5, 4 34.8, 5 35.5 (with two rows heads). Only where a head
# has several query tiles stored at once (output_tiles > 1; tail_heads): with one, there is no grouped store to
# break up, and the split tile (four transfers on four queues) only adds fixed costs the next kernel's loads
# queue behind. HF GPT-2 small, seq 128, 12 layers, trn2 (benchmarks.compile_graph_alone's graphs): bf16
# 2225.6 -> 2190.2 us, fp32 3422.8 -> 3411.7 us without them; seq 512 unchanged (4 tiles a head).
TAIL_HEADS = 4
# P^T by DMA transposes SBUF -> SBUF (pt_by_dma): a chunk's takes its queue ~4.2 us (its fixed cost and 8 units at half
# a queue's rate), so the pipeline waits PT_WAIT steps between a block's exp and its P^T and PV_WAIT between its P^T and
# its P V, and a block takes at most PT_DMA_CHUNKS chunks by DMA (each on a page of its own). Measured choices, seq
# 2048 / 1024, head dim 128, trn2 (us): waits (0, 2) with 3 chunks 307.9 / -, (0, 3) 290.1 / -, (2, 3) 286.5 / 90.0,
# (1, 4) 287.0 / 91.7, (3, 3) 291.9 / 93.8, (2, 4) 285.6 / 88.7; chunks (with (2, 3)): 3 288.3, 4 286.5, 5 287.6; with
# (2, 4) and a block's last chunks first, seq 2048 head dim 128 / 64: 2 chunks 284.9 / 277.8, 3 284.7 / 277.3 (three
# heads loaded ahead fit SBUF beside them), 4 284.9 / 279.4
PT_WAIT = 2
PV_WAIT = 4
PT_DMA_CHUNKS = 3
# The least chunks the queues must have room for (pt_by_dma): causal, bf16, head dim 128, trn2, the masked_fill form
# (benchmarks/roofline.py Attention) / F.scaled_dot_product_attention, us with the waits and DMA transposes -> without,
# the chunks pt_by_dma counts: 1 head x 1024 keys 19.7 -> 18.6 (8 chunks), 4 x 1024 37.8 -> 39.5 / 41.6 -> 40.8 (34),
# 12 x 1024 88.7 -> 96.5 / 100.8 -> 100.5 (102), 1 x 2048 38.0 -> 35.3 / 39.6 -> 38.4 (58), 2 x 2048 61.3 -> 59.6 /
# 67.1 -> 65.6 (116), 4 x 2048 107.6 -> 108.7 / 119.4 -> 120.4 (231), 12 x 2048 285.6 -> 303.9 / 329.8 -> 336.2 (693)
PT_DMA_LEAST = 200
# P^T's copies out of PSUM to the cheapest engine finishing within COPY_SLACK ns of the soonest (copy_slack). Measured,
# causal bf16, head dim 128, 12 heads, trn2, with cell_heads, us at seq 512 / 1024 / 2048: 0 (the soonest) 31.1 / 91.8
# / 280.2, 300 - / - / 278.9, 500 30.9 / 90.2 / 276.7, 1000 - / - / 281.7, unbounded (always the cheapest) - / - / 282.4
COPY_SLACK = 500.0
# queues_by_clock moves the kernel's last stores to other queues, which the next kernel's loads then queue behind; the
# kernel alone does not see that (part 43's addendum), so it is taken for a clear gain only: at least this fraction of
# the kernel's time. 12 causal bf16 heads of 64 dims at seq 512 gain 29.1 -> 29.0 us alone, and lose in context
# (roofline gpt2_block 151.1 -> 151.4, gpt2 2447.2 -> 2450.8 us); 128 dims gain 30.9 -> 29.9 (3%)
CLOCK_STORES_GAIN = 0.01
FLEX_TEMPORARIES = 4  # tiles a FlexAttention score_mod's steps hold at once (their results rotate through them)


class _NoMatch(Exception):
    pass


def _need(condition: bool) -> None:
    if not condition:
        raise _NoMatch


class _Matcher:
    """Walks from a candidate PV matmul up to the QK^T matmul, collecting the nodes the pattern
    consumes (`inner`, which must not be read from outside) and the kernel's attributes."""

    def __init__(self, consumers: dict, outputs: set):
        self.consumers, self.outputs = consumers, outputs
        self.inner: set = set()
        self.links: list = []  # the reshapes, views and exact conversions the operands are read through
        self.ops: list = []

    def take(self, node):
        self.inner.add(node)
        return node

    def through_reshapes(self, node):
        while node.op is Op.RESHAPE:
            node = self.take(node).inputs[0]
        return node

    def through_converts(self, node):
        node = self.through_reshapes(node)
        while node.op is Op.CONVERT and node.dtype.is_float and node.inputs[0].dtype.is_float:
            node = self.through_reshapes(self.take(node).inputs[0])
        return node

    def row_reduction(self, view, kind: str, of):
        """`view` broadcasts over the last axis a REDUCE_LAST(kind) of the rows of `of`'s last axis;
        returns the node reduced (through reshapes and converts)."""
        _need(view.op is Op.VIEW and view.attrs["offset"] == 0 and view.attrs["strides"][-1] == 0)
        reduced = self.through_reshapes(self.take(view).inputs[0])
        _need(reduced.op is Op.REDUCE_LAST and reduced.attrs["kind"] == kind and "cols" not in reduced.attrs)
        rows = self.take(reduced).inputs[0]
        _need(rows.shape[-1] == of.shape[-1] and len(rows.shape) == 2)
        return self.through_reshapes(rows)

    def softmax(self, node):
        """node = softmax(x) over the last axis; returns x (the logits)."""
        _need(node.op is Op.DIVIDE)
        e, total = self.take(node).inputs
        e = self.through_reshapes(e)
        _need(self.row_reduction(total, "add", node) is e and e.op is Op.EXP)
        shifted = self.through_reshapes(self.take(e).inputs[0])
        _need(shifted.op is Op.SUBTRACT)
        logits, peak = self.take(shifted).inputs
        _need(self.row_reduction(peak, "max", node) is self.through_reshapes(logits))
        self.ops += ["reduce_last", "subtract", "exp", "reduce_last", "divide"]
        return logits

    def guard(self, node):
        """select(all(x == -inf) per row, 0, y) -> (y, x), else (node, None)."""
        if node.op is not Op.SELECT or node.inputs[1].scalar != 0.0:
            return node, None
        pred, _, value = node.inputs
        try:
            saved = set(self.inner)
            self.take(node)
            x = self.row_reduction(pred, "and", value)
            _need(x.op is Op.COMPARE and x.attrs["direction"] == "EQ" and x.inputs[1].scalar == -math.inf)
            self.take(x)
            return value, self.through_reshapes(x.inputs[0])
        except _NoMatch:
            self.inner = saved
            return node, None

    def logits(self, node, attrs: dict):
        """Peel the scale and mask steps off the logits (the kernel computes mask(scale * S));
        returns the QK^T MATMUL."""
        node = self.through_converts(node)
        attrs["logits_dtype"] = node.dtype  # eager rounds the logits to this before the softmax
        scale, after_mask = 1.0, 1.0  # after_mask: the scales applied to the masked logits
        masked = False
        while node.op is not Op.MATMUL:
            _need(node.op in (Op.MULTIPLY, Op.DIVIDE, Op.ADD, Op.SELECT))
            self.take(node)
            if node.op in (Op.MULTIPLY, Op.DIVIDE):
                x, c = node.inputs
                if x.scalar is not None and node.op is Op.MULTIPLY:
                    x, c = c, x
                _need(c.scalar is not None and c.scalar != 0)
                factor = c.scalar if node.op is Op.MULTIPLY else 1.0 / c.scalar
                scale *= factor
                if not masked:
                    after_mask *= factor
                self.ops.append(node.op.name.lower())
                node = self.through_converts(x)
                continue
            _need(not masked)
            masked = True
            if node.op is Op.ADD:
                _need(after_mask == 1.0)  # c * (x + bias) would need the bias scaled
                x, bias = node.inputs
                if _is_mask_like(x) or self.through_converts(bias).op is Op.MATMUL:
                    x, bias = bias, x
                _need(bias.shape == node.shape and bias.dtype.is_float)
                attrs.update(mask="add", mask_node=bias)
            else:
                pred, a, b = node.inputs
                if a.scalar is not None:
                    fill, x, masked_when = a.scalar, b, True
                else:
                    _need(b.scalar is not None)
                    fill, x, masked_when = b.scalar, a, False
                attrs.update(mask="select", mask_node=pred, fill=float(fill) * after_mask, masked_when=masked_when)
            self.ops.append(node.op.name.lower())
            node = self.through_converts(x)
        attrs["scale"] = scale
        return node

    def operand(self, node, scale: float):
        """(source, where, scale) of a matmul operand read through conversions, scalar multiplications and views:
        where(batched) is the (offset, strides) at which the operand, read as `batched` (its shape with the batch
        dims split as the kernel iterates them), lies in source's dense buffer, or None."""
        while True:
            node = self.through_reshapes(node)
            if _widening(node):
                node = self.take(node).inputs[0]
            elif node.op is Op.MULTIPLY and any(x.scalar is not None for x in node.inputs):
                x, c = node.inputs if node.inputs[1].scalar is not None else node.inputs[::-1]
                scale *= c.scalar
                self.take(node)
                node = x
            else:
                break
        # an exact conversion anywhere in the chain is read through: the original's elements (a bf16 model's K
        # repeated for GQA, then converted, then transposed) are where the chain's positions say
        key, source = _view_chain(node, through_widening=True)
        resolved = _resolve(node)
        if resolved is not None and _unwidened(resolved[0]) is source:
            _, offset, strides = resolved
            where = functools.partial(_as_batched, offset, strides, node.shape)
        else:  # a chain that does not merge symbolically (heads split, then transposed; K/V repeated for GQA)
            where = functools.partial(_fitted_chain, key)
        self.links += _chain(node, source)
        return source, where, scale

    def take_private_links(self, root) -> None:
        """Take the links of the operands' view chains that only the pattern reads. The others stay, for their
        other readers (K and V split out of one projection, K then rotated by RoPE outside the pattern: the split
        is read by both): the kernel reads through them to their source, and what their other readers make of them is
        what it was before the match."""
        taken = True
        while taken:
            taken = False
            for link in self.links:
                inside = self.inner | {root}
                if link not in self.inner and link not in self.outputs and self.consumers.get(link, set()) <= inside:
                    self.take(link)
                    taken = True

    def private(self, root) -> bool:
        """Every node the pattern consumes is read only inside it (or by `root`) and is no output."""
        inside = self.inner | {root}
        return all(n not in self.outputs and self.consumers.get(n, set()) <= inside for n in self.inner)


MAX_COMPOSED_ELEMENTS = 1 << 24  # views composed numerically up to this size


def _widening(node) -> bool:
    """A float conversion that every value survives (bf16 -> f32): reading its operand instead is exact.
    (A narrowing one rounds, as eager does: the rounded tensor is what must be read.)"""
    return (node.op is Op.CONVERT and node.dtype.is_float and node.inputs[0].dtype.is_float
            and node.inputs[0].dtype.itemsize < node.dtype.itemsize)


def _unwidened(node):
    """node, or the tensor an exact conversion (or a chain of them) of it reads."""
    while _widening(node):
        node = node.inputs[0]
    return node


def _view_chain(x, through_widening: bool = False) -> tuple:
    """(key, source): the chain of reshapes and views (and, `through_widening`, exact conversions, which move no
    element) from x down to the node they read (`source`), as a key of plain values (x's shape, then each link's
    op, shape and view attributes). The positions x reads in source's dense buffer depend on the key alone: every
    layer of a model has the same chains, fitted once (see _fitted_chain, _fitted_inverse)."""
    links, source = [], x
    while source.op in (Op.RESHAPE, Op.VIEW) or (through_widening and _widening(source)):
        if source.op in (Op.RESHAPE, Op.VIEW):
            links.append((source.op, source.shape) + ((source.attrs["offset"], tuple(source.attrs["strides"]))
                                                      if source.op is Op.VIEW else ()))
        source = source.inputs[0]
    return (tuple(x.shape), tuple(links)), source


def _chain_positions(key: tuple):
    """The element of the dense buffer of the chain's source that each element of its head reads (an array of
    the head's shape), or None when the head is too large to compose numerically."""
    shape, links = key
    size = math.prod(shape)
    if size > MAX_COMPOSED_ELEMENTS or size == 0:
        return None
    positions = np.arange(size, dtype=np.int64).reshape(shape)
    for op, link_shape, *view in links:
        if op is Op.VIEW:
            offset, strides = view
            coords = np.unravel_index(positions, link_shape)
            positions = offset + sum(c * s for c, s in zip(coords, strides))
    return positions


def _composed_view(x, shape: tuple | None = None):
    """(source, offset, strides) reading x through a chain of reshapes and views that do not merge
    symbolically (a view of a reshaped view: heads split out of a projection, then transposed): the
    element positions are composed numerically and fitted by one affine map over `shape` (x's own, or x's
    elements read as another shape: a GQA head axis split into (kv heads, group)), or None."""
    key, source = _view_chain(x)
    fitted = _fitted_chain(key, tuple(shape or x.shape))
    return None if fitted is None else (source, *fitted)


@functools.lru_cache(maxsize=256)
def _fitted_chain(key: tuple, shape: tuple):
    """affine_fit of a chain's positions read as `shape` (as many elements as the chain's head), once per distinct
    chain and shape (a chain of each layer is the same key)."""
    positions = _chain_positions(key)
    if positions is None or math.prod(shape) != positions.size:
        return None
    return affine_fit(positions.reshape(shape))


def _is_permutation(positions: np.ndarray) -> bool:
    """Whether positions (as many as their range) reach each of 0..n-1 once (a linear-time check: np.unique
    hashes or sorts, ~0.25 s per GPT-2 attention)."""
    n = positions.size
    if n == 0 or positions.min() < 0 or positions.max() >= n:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[positions] = True
    return bool(seen.all())


def _output_view(pv, consumers: dict, outputs: set, batched: tuple):
    """(node, offset, strides): the furthest node of the chain of reshapes and views that alone reads the
    PV matmul (heads transposed back and merged: [batch, seq, heads * dim]) that only permutes its elements,
    and where element (*batch, row, col) of the attention output lies in that node's dense buffer; or None.
    The kernel writes straight into that layout, so no copy kernel is left for the permutation."""
    chain, node = [], pv
    while node not in outputs and len(consumers.get(node, ())) == 1:
        (node,) = consumers[node]
        if node.op not in (Op.RESHAPE, Op.VIEW) or node.size != pv.size:
            break
        chain.append(node)
    for end in reversed(chain):
        key, source = _view_chain(end)
        fitted = _fitted_inverse(key, tuple(batched)) if source is pv else None
        if fitted is not None:
            return (end, *fitted)
    return None


@functools.lru_cache(maxsize=256)
def _fitted_inverse(key: tuple, batched: tuple):
    """(offset, strides) where element i of the chain's source (indexed over `batched`) lies in the dense buffer
    of the chain's head, when the chain only permutes the source's elements and that map is affine; else None.
    Once per distinct chain and shape."""
    positions = _chain_positions(key)
    if positions is None or not _is_permutation(positions.reshape(-1)):
        return None
    inverse = np.empty(positions.size, dtype=np.int64)
    inverse[positions.reshape(-1)] = np.arange(positions.size)
    return affine_fit(inverse.reshape(batched))


def _rounded_result(pv, consumers: dict, outputs: set):
    """The node whose value the kernel writes: pv, or the one narrowing float conversion that alone reads it
    (through reshapes: scaled_dot_product_attention on bf16 tensors computes in fp32 and rounds its output once,
    as eager's math path does): the kernel accumulates P @ V in fp32 PSUM either way, and rounding that as it stores the output
    is the same rounding, without an fp32 output and a conversion kernel after it."""
    node = pv
    while node not in outputs and len(consumers.get(node, ())) == 1:
        (node,) = consumers[node]
        if node.op is Op.CONVERT:
            narrowing = node.dtype.is_float and node.dtype.itemsize < pv.dtype.itemsize
            return node if narrowing else pv
        if node.op is not Op.RESHAPE:
            break
    return pv


def _is_mask_like(node) -> bool:
    """A value that is not computed from the scores: a view, constant or input."""
    return ir.unreshaped(node).op in (Op.VIEW, Op.CONSTANT, Op.PARAMETER)


def _chain(node, source) -> list:
    chain = []
    while node is not source:
        chain.append(node)
        node = node.inputs[0]
    return chain


def _batch_splits(batch_shape: tuple):
    """The batch dims the kernel may iterate: the model's own (batch, heads), then, for grouped-query attention,
    heads split into (kv heads, group) for each group size: query head h reads K/V head h // group, which no
    single stride over h says (the K/V repeated by repeat_interleave, by `repeat_kv`'s expand and reshape, or by
    SDPA's enable_gqa), but a stride of 0 over the group's members does, so K and V are read where they lie and
    never repeated in HBM."""
    yield batch_shape
    if not batch_shape:
        return
    *outer, heads = batch_shape
    for group in range(2, heads + 1):
        if heads % group == 0:
            yield (*outer, heads // group, group)


def _as_batched(offset: int, strides: tuple, shape: tuple, batched: tuple):
    """(offset, strides) of an operand of `shape` read as `batched` = (*batch dims, rows, cols), or None."""
    merged = reshaped_strides(shape, strides, batched)
    return None if merged is None else (offset, tuple(merged))


def _causal_offset(masked: np.ndarray):
    """The offset d such that masked[..., i, j] == (j > i + d) for every leading index, or None."""
    sq, sk = masked.shape[-2:]
    first = masked.reshape(-1, sq, sk)[0]
    kept_in_row0 = int(np.argmax(first[0])) if first[0].any() else sk
    d = kept_in_row0 - 1
    if d < 0:
        return None  # query 0 sees no key: its row would be fully masked
    pattern = np.arange(sk)[None, :] > np.arange(sq)[:, None] + d
    return d if np.array_equal(np.broadcast_to(masked, masked.shape[:-2] + (sq, sk)),
                               np.broadcast_to(pattern, masked.shape[:-2] + (sq, sk))) else None


def _mask_constant(root):
    """The value of a mask computed from constants only (iota comparisons, broadcasts, views), evaluated
    here in numpy, or None. (Constant folding leaves big ones alone; a causal mask is one.) An explicit stack
    walks its producers: a chain of them as long as a deep model's never meets Python's recursion limit."""
    memo: dict = {}
    stack = [root]
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        needed = _mask_inputs(node)
        pending = [x for x in needed if x not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        memo[node] = _mask_value(node, [memo[x] for x in needed])
    return memo[root]


def _mask_inputs(node) -> tuple:
    """The inputs whose values `_mask_value` needs for `node`'s (none for a node too large to evaluate)."""
    broadcast_view = node.op is Op.VIEW and node.inputs[0].size <= MAX_COMPOSED_ELEMENTS  # a view costs nothing
    if not (node.size <= MAX_COMPOSED_ELEMENTS or broadcast_view):
        return ()
    if node.op is Op.VIEW:
        return node.inputs[:1]
    if node.op in ir.ELEMENTWISE | {Op.IOTA, Op.RESHAPE, Op.BROADCAST_IN_DIM, Op.TRANSPOSE}:
        return tuple(node.inputs)
    return ()


def _mask_value(node, inputs: list):
    """`node`'s value from its inputs' (`_mask_inputs`), or None."""
    broadcast_view = node.op is Op.VIEW and node.inputs[0].size <= MAX_COMPOSED_ELEMENTS
    if not (node.size <= MAX_COMPOSED_ELEMENTS or broadcast_view):
        return None
    if node.op is Op.CONSTANT:
        return np.asarray(node.attrs["value"])
    if node.op is Op.VIEW:
        x = inputs[0]
        if x is None:
            return None
        flat = np.ascontiguousarray(np.broadcast_to(x, node.inputs[0].shape)).reshape(-1)
        return np.lib.stride_tricks.as_strided(flat[node.attrs["offset"]:], node.shape,
                                               [s * flat.itemsize for s in node.attrs["strides"]])
    if node.op in ir.ELEMENTWISE | {Op.IOTA, Op.RESHAPE, Op.BROADCAST_IN_DIM, Op.TRANSPOSE}:
        if any(x is None for x in inputs):
            return None
        if node.op in (Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_IN_DIM):
            inputs = [np.broadcast_to(inputs[0], node.inputs[0].shape)]
        return _evaluate(node, inputs)
    return None


def _classify_mask(attrs: dict) -> None:
    """A constant causal mask becomes `causal` (made on chip); any other stays a tensor read by blocks."""
    if attrs["mask"] == "none":
        return
    value = _mask_constant(attrs["mask_node"])
    if value is None:
        return
    value = np.broadcast_to(value, attrs["mask_node"].shape)
    value = value[tuple(0 if stride == 0 else slice(None) for stride in value.strides[:-2])]  # one per distinct mask
    if attrs["mask"] == "select" and attrs["fill"] == -math.inf:
        masked = value.astype(bool) == attrs["masked_when"]
    elif attrs["mask"] == "add" and np.all((value == 0) | (value == -np.inf)):
        masked = value == -np.inf
    else:
        return
    offset = _causal_offset(masked)
    if offset is not None:
        attrs.update(mask="causal", causal_offset=offset, mask_node=None)


def _match(pv, consumers: dict, outputs: set, target: Target):
    """(the node replaced, the ATTENTION node) for a candidate PV matmul `pv`, or None: the node replaced is
    pv, or the permutation of pv's elements the kernel writes in place (see _output_view)."""
    m = _Matcher(consumers, outputs)
    attrs = {"mask": "none", "causal_offset": 0, "fill": 0.0, "masked_when": True, "mask_node": None}
    try:
        _need(pv.op is Op.MATMUL and not pv.attrs.get("views") and len(pv.inputs) == 2)
        p = m.through_converts(pv.inputs[0])
        p, guarded = m.guard(p)
        p = m.through_converts(p)
        logits = m.softmax(p)
        _need(guarded is None or m.through_converts(guarded) is m.through_converts(logits))
        qk = m.logits(logits, attrs)
        _need(qk.op is Op.MATMUL and not qk.attrs.get("views") and len(qk.inputs) == 2)
        m.take(qk)
        batch, sq, sk = qk.shape
        _, _, dv = pv.shape
        d = qk.attrs["k"]
        _need(pv.shape[:2] == (batch, sq) and pv.attrs["k"] == sk and 0 < dv <= MAX_HEAD_DIM)
        # the batch dims as the frontend wrote them (batch, heads): heads split out of one projection are
        # strided views that do not merge into one batch dim
        batch_shape = tuple(logits.shape[:-2]) if math.prod(logits.shape[:-2]) == batch else (batch,)
        q, q_where, scale = m.operand(qk.inputs[0], attrs["scale"])
        k, k_where, scale = m.operand(qk.inputs[1], scale)
        v, v_where, _ = m.operand(pv.inputs[1], 1.0)
        _need(scale > 0 and math.isfinite(scale))
        for batch_shape in _batch_splits(batch_shape):
            views = [q_where((*batch_shape, sq, d)), k_where((*batch_shape, d, sk)), v_where((*batch_shape, sk, dv))]
            if None not in views:
                break
        _need(None not in views)
        k_off, k_strides = views[1]
        views[1] = (k_off, (*k_strides[:-2], k_strides[-1], k_strides[-2]))  # K read as [..., Sk, D]
        inputs = [q, k, v]
        _need(all(x.dtype.is_float for x in inputs))
        _classify_mask(attrs)
        mask = attrs.pop("mask_node")
        if mask is not None:
            resolved = _resolve(mask)
            _need(resolved is not None)
            source, offset, strides = resolved
            if source.op is Op.CONSTANT and source.attrs["value"].ndim == 0:
                source, offset, strides = mask, 0, dense_strides(mask.shape)
            view = _as_batched(offset, strides, mask.shape, (*batch_shape, sq, sk))
            _need(view is not None)
            inputs.append(source)
            views.append(view)
            if source is not mask:
                for link in _chain(mask, source):
                    if consumers.get(link, set()) <= m.inner | {pv}:
                        m.take(link)
        m.take_private_links(pv)
        _need(m.private(pv))
        dtypes = {"q": q.dtype, "k": k.dtype, "v": v.dtype, "out": pv.dtype, "p": probability_dtype(v.dtype),
                  "mask": inputs[3].dtype if len(inputs) > 3 else DType.BOOL}
        attrs["score_dtype"] = qk.dtype
        in_sbuf = logits_in_sbuf(attrs | {"scale": scale})
        split = split_blocks(sq, sk, attrs["mask"] == "causal", attrs["causal_offset"], in_sbuf)
        block = KEY_BLOCK // split if split > 1 else None
        cells = cell_heads(math.prod(batch_shape), sq, sk, d, dv, dtypes, attrs["mask"] == "causal",
                           attrs["causal_offset"], target)
        dma_pt = pt_by_dma(math.prod(batch_shape), sq, sk, d, dv, dtypes, attrs["mask"] == "causal",
                           attrs["causal_offset"], target, cells == math.prod(batch_shape))
        may_dma = target.dma_transpose_sbuf_fraction > 0 and dtypes["p"].itemsize == 2  # pt_by_dma's first test
        fitting = [(ahead, rows, by_dma) for by_dma in dict.fromkeys((dma_pt, False, may_dma))
                   for rows in dict.fromkeys((rows_heads(sq, sk, d, dtypes, target, cells > 0), 0))
                   for ahead in (HEADS_AHEAD_MOST, HEADS_AHEAD) if fits_sbuf(sbuf_bytes(tile_pools(
                       sq, sk, d, dv, dtypes, attrs["mask"], guarded is not None, attrs["causal_offset"], in_sbuf,
                       key_block_=block, heads_ahead=ahead, rows_heads_=rows, pt_by_dma_=by_dma, split=split)), target)]
        _need(bool(fitting))
        attrs["heads_ahead"], attrs["rows_heads"], attrs["pt_by_dma"] = fitting[0]
        # P^T by DMA where pt_by_dma's count of chunks did not take it: a choice the kernel's time makes (_timed_choices)
        attrs["pt_dma_option"] = next(((ahead, rows) for ahead, rows, by_dma in fitting if by_dma), None) \
            if not attrs["pt_by_dma"] else None
    except _NoMatch:
        return None
    ops = ("matmul", *reversed(m.ops), "matmul")
    batched = (*batch_shape, sq, dv)
    result = _rounded_result(pv, consumers, outputs)
    written, *out_view = _output_view(result, consumers, outputs, batched) or (result, 0, dense_strides(batched))
    if tuple(out_view) != (0, dense_strides(batched)):
        ops += ("transpose",)
    return written, ir.node(Op.ATTENTION, inputs, written.shape, result.dtype, pv.loc, batch_shape=batch_shape,
                   views=tuple(views), out_view=tuple(out_view), queries=sq, value_dim=dv,
                   scale=float(scale), head_dim=d, keys=sk,
                   mask=attrs["mask"], causal_offset=attrs["causal_offset"], fill=attrs["fill"],
                   masked_when=attrs["masked_when"], zero_masked_rows=guarded is not None, ops=ops,
                   score_dtype=attrs["score_dtype"], logits_dtype=attrs["logits_dtype"],
                   heads_ahead=attrs["heads_ahead"], rows_heads=attrs["rows_heads"], pt_by_dma=attrs["pt_by_dma"],
                   cell_heads=cells, pt_dma_option=attrs["pt_dma_option"],
                   **({"key_block": block, "split": split} if split > 1 else {}),
                   tiling=f"{Q_TILE} queries x {key_block(sk, in_sbuf, block)} keys, Q/K/V resident")


def split_blocks(sq: int, sk: int, causal: bool, offset: int, in_sbuf: bool) -> int:
    """SPLIT where the logits are made in SBUF by KEY_BLOCK blocks and a query tile meets at least LONG_KEYS keys,
    else 1 (see SPLIT)."""
    most = max((min(sk, q0 + min(Q_TILE, sq - q0) + offset) if causal else sk) for q0 in range(0, sq, Q_TILE))
    return SPLIT if in_sbuf and most >= LONG_KEYS else 1


def key_block(sk: int, in_sbuf: bool, block: int | None = None) -> int:
    """Keys per block: the fixed cost of an instruction is paid per 1024 keys when the logits are made in SBUF;
    scores the exp reads in PSUM wait there for it, in three buffers of one bank. (`block`: FlexAttention's
    choice for a sparse mask, see flex_block.)"""
    return min(block or (KEY_BLOCK if in_sbuf else BANK_KEYS), sk)


def causal_cuts(sq: int, sk: int, offset: int, block: int) -> list:
    """The distinct cuts of the key blocks the causal mask cuts through: key first + c is masked for query
    q0 + i when c - i + cut > 0, `first` being the first key masked for some query of the tile (the mask
    covers at most Q_TILE - 1 keys of a block). One on-chip bias tile each, made once per kernel."""
    cuts = set()
    for q0 in range(0, sq, Q_TILE):
        qt = min(Q_TILE, sq - q0)
        for k0 in range(0, min(sk, q0 + qt + offset), block):
            kb = min(block, sk - k0, q0 + qt + offset - k0)
            if max(k0, q0 + offset + 1) < k0 + kb:
                cuts.add(k0 - q0 - offset if k0 > q0 + offset else 1)
    return sorted(cuts)


def key_blocks(sq: int, sk: int, causal: bool, offset: int, block: int) -> int:
    """How many key blocks the kernel visits for one batch-head (causal: none wholly above the diagonal)."""
    return sum(-(-(min(sk, q0 + min(Q_TILE, sq - q0) + offset) if causal else sk) // block)
               for q0 in range(0, sq, Q_TILE))


def softmax_blocks(sq: int, sk: int, causal: bool, offset: int, in_sbuf: bool, block: int | None = None,
                   split: int = 1) -> int:
    """Key blocks per softmax statistic: a query tile's keys are taken by groups of up to SOFTMAX_BLOCKS
    blocks (SPLIT times as many of the split blocks: split_blocks) whose logits are all made (with their row mins)
    before any of them meets exp, so the running max moves, and the accumulator is rescaled, once per group rather
    than once per block. Logits the exp reads from PSUM (not in_sbuf) cannot wait there: one block per group."""
    if not in_sbuf:
        return 1
    most = max(-(-(min(sk, q0 + min(Q_TILE, sq - q0) + offset) if causal else sk) // key_block(sk, in_sbuf, block))
               for q0 in range(0, sq, Q_TILE))
    return max(1, min(SOFTMAX_BLOCKS * split, most))


def pipeline_depth(sq: int, sk: int, causal: bool, offset: int, in_sbuf: bool, block: int | None = None,
                   by_dma: bool = False, split: int = 1) -> int:
    """Key blocks in flight in the kernel's software pipeline: one per stage, and a block waits between its
    logits and its exp until the last block of its softmax group has made its logits, and (`by_dma`: P^T's chunks by
    DMA transposes, pt_by_dma) PT_WAIT steps before its P^T and PV_WAIT before its P V (`split` times as many steps
    of split blocks: split_blocks)."""
    waits = (PT_WAIT + PV_WAIT) * split if by_dma else 0
    return STAGES + softmax_blocks(sq, sk, causal, offset, in_sbuf, block, split) - 1 + waits


def output_tiles(sq: int, dv: int, dtype: DType) -> int:
    """Whole query tiles whose outputs go to HBM in one store: as many as fill an SBUF page per partition (a page is
    what a tile's slot takes anyway), at most the head's. A [128, dv] store alone moves dv elements per partition,
    far below a queue's rate on the payload curve (targets.py)."""
    return max(1, min(sq // Q_TILE, SBUF_PAGE_BYTES // (dv * dtype.itemsize)))


def tail_heads(sq: int, dv: int, dtype: DType) -> int:
    """The last heads whose output tiles are stored one by one over the least-booked queues: TAIL_HEADS where a head's
    tiles are otherwise stored several at once (output_tiles), else none."""
    return TAIL_HEADS if output_tiles(sq, dv, dtype) > 1 else 0


def resident_heads(sq: int, sk: int, causal: bool, offset: int, in_sbuf: bool, block: int | None = None,
                   heads_ahead: int = HEADS_AHEAD, by_dma: bool = False, split: int = 1) -> int:
    """Buffers of a head's K^T, V and Q^T: a head's are loaded `heads_ahead` heads ahead, and stay while any of
    its blocks is in the pipeline (the pipeline's blocks may span several short heads)."""
    depth = pipeline_depth(sq, sk, causal, offset, in_sbuf, block, by_dma, split)
    return -(-depth // max(1, key_blocks(sq, sk, causal, offset, key_block(sk, in_sbuf, block)))) + 1 + heads_ahead


def tile_pools(sq: int, sk: int, d: int, dv: int, dtypes: dict, mask: str, guarded: bool, causal_offset: int,
               in_sbuf: bool, score_mod: bool = False, patterns: tuple = (0, 0), key_block_: int | None = None,
               heads_ahead: int = HEADS_AHEAD, rows_heads_: int = 0, pt_by_dma_: bool = False,
               split: int = 1) -> dict:
    """name -> (dtype, elements per partition, buffers) of every SBUF tile pool of the attention kernel:
    the one list the kernel allocates from and the pass checks against the SBUF budget. dtypes: q, k, v,
    out, p (the probabilities fed to the PV matmul), mask."""
    d_tiles, k_chunks = -(-d // Q_TILE), -(-sk // Q_TILE)
    block = key_block(sk, in_sbuf, key_block_)
    f32 = DType.F32
    shape = (sq, sk, mask == "causal", causal_offset, in_sbuf, key_block_)
    heads, depth = resident_heads(*shape, heads_ahead, pt_by_dma_, split), pipeline_depth(*shape, pt_by_dma_, split)
    group, pt_wait, pv_wait = softmax_blocks(*shape, split), PT_WAIT * split * pt_by_dma_, PV_WAIT * split * pt_by_dma_
    base = depth - pt_wait - pv_wait  # the pipeline's depth without the waits
    pools = {
        # a head's K^T, V and Q^T, resident, for as long as its blocks are in flight; the next head's meanwhile
        "k": (dtypes["k"], d_tiles * sk, heads),
        "v": (dtypes["v"], k_chunks * (dv + 1), heads),  # [V | 1]
        "q": (dtypes["q"], d_tiles * sq, heads),
        "identity": (dtypes["p"], Q_TILE, 1),
        **({"rows": (dtypes["q"], max(sq, sk) // Q_TILE * d, 2 * rows_heads_)} if rows_heads_ else {}),  # Q's, K's
        "ramp": (f32, Q_TILE, 1),
        # P waits for its P^T, and P^T for its P V, through the waits (pt_by_dma)
        "p": (dtypes["p"], block, 3 + pt_wait + pv_wait),
        "pt": (dtypes["p"], -(-block // Q_TILE) * Q_TILE, 3 + pv_wait),
        # P^T's chunks made by DMA transposes, each in a slot of its own (chunks sharing an SBUF hazard cell would wait
        # for each other's queue), up to PT_DMA_CHUNKS a block
        **({"pt_dma": (dtypes["p"], Q_TILE, (3 + pv_wait) * pt_dma_chunks(split))} if pt_by_dma_ else {}),
        # (the tiles made and used before a block's exp, or after its P V, live as long whatever the waits)
        "out": (dtypes["out"], output_tiles(sq, dv, dtypes["out"]) * dv, base),
        "out_tile": (dtypes["out"], dv, base),  # a tile stored alone (the last heads'): never a group's
        "b_blocks": (f32, group, base),  # the row mins of a softmax group's blocks, side by side
        **{name: (f32, 1, base) for name in ("b", "rowsum", "dm")},
        "corr": (f32, 1, depth),  # made by the exp, used by the P V
    }
    if mask == "causal":
        pools["bias_identity"] = (DType.BF16, Q_TILE, 1)
        pools["bias"] = (DType.BF16, Q_TILE, max(1, len(causal_cuts(sq, sk, causal_offset, block))))
    if in_sbuf:  # logits made in SBUF (logits_in_sbuf)
        pools["logits"] = (f32, block, group + 3)  # a group's logits wait for its last block's
        pools["scores"] = (f32, block, 3)
    if mask in ("select", "add"):
        pools["mask"] = (dtypes["mask"], block, 3)
        if mask == "select":
            pools["fill"] = (f32, block, 1)
    if guarded:
        pools["empty_row"] = (DType.U8, 1, 2)
        pools["zeros"] = (dtypes["out"], dv, 1)
    if mask == "blocks":  # FlexAttention's mask patterns, resident, added to the scores by a matmul as causal's
        count, width = patterns
        pools["bias_identity"] = (DType.BF16, Q_TILE, 1)
        pools["patterns"] = (DType.BF16, width, count)
    if score_mod:  # FlexAttention's score_mod: its steps' tiles, the key ramp, the query columns
        pools["flex"] = (f32, block, FLEX_TEMPORARIES)
        pools["kv_ramp"] = (f32, block, 1)
        pools["q_ramp"] = (f32, 1, 1)
        pools["flex_column"] = (f32, 1, 2 * FLEX_TEMPORARIES)
        if mask == "select":
            pools["fill_logits"] = (f32, block, 1)
    return pools


def pt_dma_chunks(split: int) -> int:
    """The most chunks of a block's P^T by DMA: PT_DMA_CHUNKS, of a split block (split_blocks) its share rounded up
    (512-key blocks, seq 2048, head dim 128, trn2: 1 chunk 265.3 us, 2 262.1, 3 262.6; 4 does not fit SBUF)."""
    return -(-PT_DMA_CHUNKS // split)


def rows_heads(sq: int, sk: int, d: int, dtypes: dict, target: Target, cells: bool = False) -> int:
    """The first heads whose Q^T and K^T the kernel makes from their rows on the Tensor engine (codegen/attention.py
    load_rows_transposed) rather than by DMA transposes or strided loads: ROWS_HEADS when a head's rows reach SBUF
    over 4 queues in under half the time its first transposed load takes on its one queue (the pipeline's fill,
    priced by instruction_cost; a DMA transpose of a page of columns, or of a hazard cell with `cells`: cell_heads),
    else none (the transposes then cost the Tensor, Vector and Scalar engines more than the fill they save)."""
    if not (d <= Q_TILE and sq % Q_TILE == 0 and sk % Q_TILE == 0 and dtypes["q"] == dtypes["k"] == dtypes["p"]
            and dtypes["q"].itemsize == 2):
        return 0
    rows, size = max(sq, sk), dtypes["q"].itemsize
    transposed = transposed_loads_ns(d, rows, size, target, cells)[0]
    by_rows = dma_transfer_ns(rows * d * size / 4, True, target, Q_TILE // 4)
    return ROWS_HEADS if 2 * by_rows < transposed else 0


def copy_slack(in_sbuf: bool, fused: bool) -> float:
    """ns: P^T's copies out of PSUM go to the cheapest engine of those that would finish one within this of the
    first (Balancer.scale_soonest), where the scores are copied out of PSUM on their own (logits made in SBUF, not
    fused): Vector copies 16-bit PSUM in performance mode at 1.6x Scalar's speed, Scalar copies the fp32 scores at
    1.25x Vector's, so each engine should take the copies it does fast and the score copies balance the two. Where
    the logits are fused (one Vector pass, or a Scalar pass and GpSimd's min: two hops), moving work between Vector
    and Scalar lengthens the logits' chain instead (trn2, causal bf16, head dim 64, 12 heads, seq 2048: 277.3 ->
    289.3 us with COPY_SLACK)."""
    return COPY_SLACK if in_sbuf and not fused else 0.0


def cell_heads(heads: int, sq: int, sk: int, d: int, dv: int, dtypes: dict, causal: bool, offset: int,
               target: Target) -> int:
    """The first heads whose K^T and Q^T DMA transposes (codegen/attention.py load_transposed) go by SBUF hazard
    cells of columns (placement.SBUF_HAZARD_BYTES: 128 columns of a 2-byte type), each on its own queue, rather than
    by pages (512 columns on one queue): every head where a head's matmuls take the Tensor engine less time than a
    page's transpose takes its queue (the pipeline would wait for a page's transfer at every head), else the first
    head (the pipeline's fill waits for it). A cell's transfer pays the fixed cost a page's pays once, mostly behind
    the previous transfer's data on its queue. Measured, trn2, causal bf16, head dim 128, 12 heads, with copy_slack,
    us by pages / the first head by cells / every head by cells: seq 512 (a head's matmuls 1.6 us, a page's
    transpose 7.6) 34.5 / 34.5 (its first heads are made from rows) / 30.9; seq 1024 (5.8) 94.9 / 92.5 / 90.2; seq
    2048 (21.8) 281.8 / 276.7 / 281.0."""
    size = dtypes["q"].itemsize
    if not transposes_by_dma(d, size, target):  # load_transposed's strided loads: no pages, no cells
        return 0
    page = dma_transpose_ns(Q_TILE, min(max(sq, sk), SBUF_PAGE_BYTES // size), size, target)
    _, tensor = head_ns(sq, sk, d, dv, dtypes, causal, offset, target)
    return heads if tensor < page else 1


def pt_by_dma(heads: int, sq: int, sk: int, d: int, dv: int, dtypes: dict, causal: bool, offset: int,
              target: Target, cells: bool = False) -> bool:
    """Whether the kernel may make chunks of P^T by DMA transposes SBUF -> SBUF instead of on the Tensor engine (with
    their copies out of PSUM on Vector or Scalar), codegen/attention.py choosing each chunk by the work booked on the
    queues and the Tensor engine: where the target has them for P's 2-byte type, and the chunks the queues have room
    for -- the time a head's matmuls take the Tensor engine beyond what its loads and stores take the queues (head_ns),
    on every queue, for every head, over a chunk's transpose -- are at least PT_DMA_LEAST: the pipeline's waits cost
    its start and end a few microseconds, which too few chunks do not pay back."""
    if not (target.dma_transpose_sbuf_fraction > 0 and dtypes["p"].itemsize == 2):
        return False
    queues, tensor = head_ns(sq, sk, d, dv, dtypes, causal, offset, target, cells)
    chunk = dma_transpose_ns(Q_TILE, Q_TILE, dtypes["p"].itemsize, target, from_hbm=False)
    return target.dma_queues * heads * (tensor - queues) / chunk >= PT_DMA_LEAST


def transposed_loads_ns(d: int, rows: int, size: int, target: Target, cells: bool = False) -> list:
    """ns of each transfer load_transposed makes x^T [d, rows] of `size`-byte elements with, each on its queue: DMA
    transposes of a page of columns (of a hazard cell with `cells`: cell_heads), or strided loads split by
    partitions. Priced by instruction_cost's rules."""
    if transposes_by_dma(d, size, target):
        page = (SBUF_HAZARD_BYTES if cells else SBUF_PAGE_BYTES) // size
        return [dma_transpose_ns(d, min(page, rows - r0), size, target) for r0 in range(0, rows, page)]
    pieces = dma_slice_count(d, rows * d * size, target)
    return [dma_transfer_ns(rows * d * size / pieces, False, target, -(-d // pieces))] * pieces


def head_ns(sq: int, sk: int, d: int, dv: int, dtypes: dict, causal: bool, offset: int, target: Target,
            cells: bool = False) -> tuple:
    """(ns, ns): a head's loads of K^T, Q^T (as load_transposed makes them: by pages, or by hazard cells with
    `cells`), V and its output's stores, over all the queues; its matmuls (QK^T, P^T and P V by chunks of 128 keys,
    blocks above a causal diagonal skipped) on the Tensor engine. Each priced by instruction_cost's rules."""
    size = dtypes["q"].itemsize

    def transposed(rows: int) -> float:
        return sum(transposed_loads_ns(d, rows, size, target, cells))

    queues = (transposed(sq) + transposed(sk) + dma_transfer_ns(sk * dv * dtypes["v"].itemsize, True, target)
              + dma_transfer_ns(sq * dv * dtypes["out"].itemsize, True, target)) / target.dma_queues
    chunks = sum(-(-(min(sk, q0 + min(Q_TILE, sq - q0) + offset) if causal else sk) // Q_TILE)
                 for q0 in range(0, sq, Q_TILE))
    tensor = chunks * (-(-d // Q_TILE) * matmul_pass_ns(Q_TILE, False, target) + matmul_pass_ns(Q_TILE, False, target)
                       + matmul_pass_ns(dv + 1, False, target))
    return queues, tensor


def sbuf_bytes(pools: dict) -> int:
    """SBUF bytes per partition of `pools`, slots rounded to the pages tiles are placed on."""
    return sum(-(-n * dtype.itemsize // SBUF_PAGE_BYTES) * SBUF_PAGE_BYTES * bufs for dtype, n, bufs in pools.values())


def pools_of(node: ir.Node) -> dict:
    """tile_pools of an ATTENTION node."""
    a = node.attrs
    q, k, v = node.inputs[:3]
    dtypes = {"q": q.dtype, "k": k.dtype, "v": v.dtype, "out": node.dtype, "p": probability_dtype(v.dtype),
              "mask": node.inputs[3].dtype if len(node.inputs) > 3 else DType.BOOL}
    patterns = tuple(node.inputs[3].shape[::2]) if a["mask"] == "blocks" else (0, 0)  # (count, width)
    return tile_pools(a["queries"], a["keys"], a["head_dim"], a["value_dim"], dtypes, a["mask"],
                      a["zero_masked_rows"], a["causal_offset"], logits_in_sbuf(a), bool(a.get("score_mod")), patterns,
                      a.get("key_block"), a.get("heads_ahead", HEADS_AHEAD), a.get("rows_heads", 0), a.get("pt_by_dma", False),
                      a.get("split", 1))


def rounds_logits(attrs: dict) -> bool:
    """Whether eager rounds the scores or the scaled logits to a narrow dtype (a bf16 model's Q K^T)."""
    return attrs["score_dtype"] != DType.F32 or attrs["logits_dtype"] != DType.F32


def logits_in_sbuf(attrs: dict) -> bool:
    """Whether the kernel makes the logits in SBUF: rounded where eager rounds them, masked by a tensor, or
    scaled by more than 1 (then no masked score can take the exp's bias past fp32's range)."""
    return (rounds_logits(attrs) or attrs["mask"] in ("select", "add") or attrs["scale"] > 1
            or bool(attrs.get("score_mod")) or bool(attrs.get("logits_in_sbuf")))


def probability_dtype(v_dtype: DType) -> DType:
    """The probabilities meet V in the Tensor engine in V's dtype (as eager rounds them before P @ V)."""
    return v_dtype if v_dtype in (DType.BF16, DType.F16) else DType.F32


def _is_power_of_two(x: float) -> bool:
    mantissa, _ = np.frexp(x)
    return x > 0 and mantissa == 0.5


def fused_logits(attrs: dict) -> bool:
    """Whether one instruction makes the logits (in SBUF) of an ATTENTION node's `attrs` from the PSUM scores:
    fp32 scores need no rounding of their own, and a power-of-two scale commutes with rounding, so
    round(round(S) * scale) is round(S * scale) (outside the subnormal range)."""
    score, logit = attrs["score_dtype"], attrs["logits_dtype"]
    return score == DType.F32 or (_is_power_of_two(attrs["scale"]) and logit in (DType.F32, score))


def attention_plan(node: ir.Node) -> AttentionPlan:
    """The kernel plan of an ATTENTION node: its key blocks, software pipeline, dtypes and SBUF pools."""
    a = node.attrs
    sq, sk, offset, causal = a["queries"], a["keys"], a["causal_offset"], a["mask"] == "causal"
    in_sbuf, fused = logits_in_sbuf(a), fused_logits(a)
    block, split = key_block(sk, in_sbuf, a.get("key_block")), a.get("split", 1)
    shape = (sq, sk, causal, offset, in_sbuf, a.get("key_block"))
    return AttentionPlan(
        batch_shape=tuple(a["batch_shape"]), queries=sq, keys=sk, head_dim=a["head_dim"], value_dim=a["value_dim"],
        scale=float(a["scale"]), mask=a["mask"], causal_offset=offset, fill=float(a["fill"]),
        masked_when=bool(a["masked_when"]), zero_masked_rows=bool(a["zero_masked_rows"]),
        views=tuple(View(int(o), tuple(int(x) for x in st)) for o, st in a["views"]),
        out_view=View(int(a["out_view"][0]), tuple(int(x) for x in a["out_view"][1])),
        q_tile=Q_TILE, key_block=block, softmax_blocks=softmax_blocks(*shape, split),
        depth=pipeline_depth(*shape, a.get("pt_by_dma", False), split), pt_by_dma=a.get("pt_by_dma", False),
        pt_wait=PT_WAIT * split, pv_wait=PV_WAIT * split, pt_dma_chunks=pt_dma_chunks(split),
        **(dict(zip(("score_psum", "pt_psum"), SPLIT_PSUM)) if split > 1 else {}),
        heads_ahead=a.get("heads_ahead", HEADS_AHEAD), causal_cuts=tuple(causal_cuts(sq, sk, offset, block)) if causal else (),
        out_tiles=output_tiles(sq, a["value_dim"], node.dtype), rows_heads=a.get("rows_heads", 0),
        cell_heads=a.get("cell_heads", 0), copy_slack=copy_slack(in_sbuf, fused),
        queues_by_clock=a.get("queues_by_clock", False), warm_exp=a.get("warm_exp", False),
        tail_heads=tail_heads(sq, a["value_dim"], node.dtype),
        logits_in_sbuf=in_sbuf, fused_logits=fused, score_dtype=a["score_dtype"],
        logits_dtype=a["score_dtype"] if fused and a["score_dtype"] != DType.F32 else a["logits_dtype"],
        probability_dtype=probability_dtype(node.inputs[2].dtype), pools=pool_specs(pools_of(node)),
        score_mod=tuple(a.get("score_mod", ())), key_visits=tuple(a.get("key_visits", ())))


def _timed_choices(node: ir.Node, timed, memo: dict) -> ir.Node:
    """`node` with its plan, and the choices its kernel's emulated time decides (`timed`: PassContext.choice_time;
    None: as the pass priced them), each taken only if the kernel is faster so:
    - its first heads made from rows (rows_heads) or not: rows_heads prices the pipeline's fill alone, not the
      Tensor-engine transposes and their copies out of PSUM it adds: trn2, 12 causal bf16 heads of 64 dims, kernel
      alone, us with and without: seq 128 17.21 / 15.25, seq 256 22.07 / 21.16, seq 512 31.82 / 32.93;
    - the last heads' output tiles, and the DMA transposes of K^T and Q^T, on the queues that free first on an
      estimated clock (queues_by_clock), not those with least work booked or the round robin's, where the kernel is
      faster so by CLOCK_STORES_GAIN: trn2, 12 causal bf16 heads of 128 dims, seq 512 30.9 -> 29.2 us (the stores
      alone 29.9; taken), seq 2048 276.7 -> 277.3 (the stores alone; not taken);
    - P^T by DMA, with the pipeline's waits, where pt_by_dma's count of chunks did not take it: seq 1024 90.2 -> 85.9;
    - the exp's activation table loaded at the kernel's start, during the fill (warm_exp), not by the first exp on the
      pipeline's path: seq 512 29.2 -> 28.7 (taken), seq 2048 276.7 -> 278.5 (the Balancer's later choices move; not
      taken).
    Decided once per distinct attention (`memo`: a model's layers ask the same); a hit takes the ids the timing took
    (`ir.skip_ids`), so every later node has the id it has without the memo (the ids name the NEFF's tensors)."""
    node.attrs["plan"] = attention_plan(node)
    plan = node.attrs["plan"]
    options = ([{"rows_heads": 0}] if plan.rows_heads else []) + ([{"queues_by_clock": True}] if plan.tail_heads else [])
    if node.attrs.get("pt_dma_option"):
        ahead, rows = node.attrs["pt_dma_option"]
        options.append({"pt_by_dma": True, "heads_ahead": ahead, "rows_heads": rows})
    if not plan.score_mod:  # (a score_mod's own activations take the Scalar engine's table in turn with the exp)
        options.append({"warm_exp": True})
    if not options or timed is None:
        return node
    try:
        key = structural_key((plan, [(x.shape, x.dtype) for x in node.inputs]))
    except TypeError:
        key = None
    if key in memo:
        changes, ids = memo[key]
        ir.skip_ids(ids)
    else:
        start = ir.next_id()
        changes, best = {}, timed(node)[0]
        for option in options:
            merged = {**changes, **option}
            if "rows_heads" in changes and "rows_heads" in option:  # rows heads dropped stay dropped
                merged["rows_heads"] = min(changes["rows_heads"], option["rows_heads"])
            time = timed(_variant(node, merged))[0]
            if time < best * (1 - CLOCK_STORES_GAIN if "queues_by_clock" in option else 1):
                changes, best = merged, time
        if key is not None:
            memo[key] = changes, ir.next_id() - start
    return _variant(node, changes) if changes else node


def _variant(node: ir.Node, changes: dict) -> ir.Node:
    """The ATTENTION `node` with `changes` to its attrs, and its plan."""
    other = ir.node(Op.ATTENTION, node.inputs, node.shape, node.dtype, node.loc, **{**node.attrs, **changes, "plan": None})
    other.attrs["plan"] = attention_plan(other)
    return other


def fuse_attention(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    target = ctx.target
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    matches = dict(match for n in graph.nodes() if n.op is Op.MATMUL
                   for match in [_match(n, consumers, outputs, target)] if match is not None)
    if not matches:
        return graph
    built: dict = {}  # old node -> its rebuilt self: the fused node's inputs are old nodes
    timed: dict = {}  # an attention's key -> (the changes its timing took, the ids that timing took): _timed_choices

    def rebuild(node, inputs):
        if node in matches:
            fused = matches[node]
            result = _timed_choices(ir.node(Op.ATTENTION, [built[x] for x in fused.inputs], fused.shape,
                                                    fused.dtype, fused.loc, **fused.attrs), ctx.choice_time, timed)
        else:
            result = ir.with_inputs(node, inputs)
        built[node] = result
        return result

    return graph.rewrite(rebuild)


def lower_flex_attention(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """FlexAttention's forward (FLEX_ATTENTION, frontend/flex_attention.py) as the flash-attention kernel, at every
    optimisation level: q, k, v dense [batch, heads, seq, dim]; the score_mod's steps applied to each block of
    logits; a causal mask made on chip, or a mask tensor read for the blocks it cuts, the blocks it hides wholly
    never visited (key_visits), rows with no key giving zeros, as flex_attention gives. The kernel's batch-heads are
    (batch, kv head, query head in its group), so GQA's shared K and V are read where they lie."""

    def rule(node, inputs):
        if node.op is not Op.FLEX_ATTENTION:
            return None
        a = node.attrs
        (batch, heads), sq, sk, d, dv = a["batch_shape"], a["queries"], a["keys"], a["head_dim"], a["value_dim"]
        kv_heads = a.get("kv_heads", heads)
        group = heads // kv_heads  # GQA: query head h reads K/V head h // group; batch-heads are (batch, kv head, g)
        views = [(0, (heads * sq * d, group * sq * d, sq * d, d, 1)), (0, (kv_heads * sk * d, sk * d, 0, d, 1)),
                 (0, (kv_heads * sk * dv, sk * dv, 0, dv, 1))]
        if a["mask"] == "select":
            views.append((0, (0, 0, 0, sk, 1)))  # one [sq, sk] pattern for every batch and head
        attrs = dict(batch_shape=(batch, kv_heads, group), views=tuple(views),
                     out_view=(0, (heads * sq * dv, group * sq * dv, sq * dv, dv, 1)),
                     queries=sq, value_dim=dv, scale=float(a["scale"]), head_dim=d, keys=sk, mask=a["mask"],
                     causal_offset=int(a["causal_offset"]), fill=-math.inf, masked_when=False,
                     zero_masked_rows=a["mask"] == "select", ops=("flex_attention",), score_dtype=DType.F32,
                     logits_dtype=DType.F32, score_mod=tuple(a["score_mod"]), logits_in_sbuf=True)
        if not 0 < dv <= MAX_HEAD_DIM:
            raise NeuronCompileError(f"flex_attention with a value dim of {dv}: the kernel takes at most {MAX_HEAD_DIM}",
                                     location=str(node.loc))
        block = key_block(sk, logits_in_sbuf(attrs))
        if a["mask"] == "select" and inputs[3].op is not Op.CONSTANT:  # computed at run time: every block read
            attrs["key_visits"] = tuple(tuple((k0, min(block, sk - k0), True) for k0 in range(0, sk, block))
                                        for _ in range(0, sq, Q_TILE))
        elif a["mask"] == "select":
            mask = np.asarray(inputs[3].attrs["value"], dtype=bool)
            block = attrs["key_block"] = flex_block(mask, sk)
            attrs["key_visits"] = key_visits(mask, block)
            found = None if a["score_mod"] else mask_patterns(mask, block)
            if found is not None:  # partial blocks masked by resident bias patterns, no mask tensor read
                patterns, visits = found
                bias = ir.node(Op.CONSTANT, [], patterns.shape, DType.BF16, node.loc, value=patterns)
                inputs = (*inputs[:3], bias)
                attrs.update(mask="blocks", key_visits=visits, zero_masked_rows=False,
                             views=(*views[:3], (0, dense_strides(patterns.shape))))
        attrs["tiling"] = f"{Q_TILE} queries x {block} keys, Q/K/V resident"
        attention = ir.node(Op.ATTENTION, inputs, node.shape, node.dtype, node.loc, **attrs)
        if not fits_sbuf(sbuf_bytes(pools_of(attention)), ctx.target):
            raise NeuronCompileError(
                f"flex_attention over {sq} queries and {sk} keys (head dim {d}) does not fit SBUF: a head's Q, K and V "
                f"stay resident", location=str(node.loc), hint="shorten the sequence or split it into chunks")
        attention.attrs["plan"] = attention_plan(attention)
        return attention

    return graph.rewrite(rule)


def key_visits(mask: np.ndarray, block: int) -> tuple:
    """Per query tile, the key blocks a [sq, sk] keep-mask leaves anything in: (first key, keys, whether some of
    its scores are masked). A tile with no key at all still visits its first block, to write its zeros."""
    sq, sk = mask.shape
    visits = []
    for q0 in range(0, sq, Q_TILE):
        rows = mask[q0:q0 + Q_TILE]
        tile = []
        for k0 in range(0, sk, block):
            part = rows[:, k0:k0 + block]
            if part.any():
                tile.append((k0, part.shape[1], not part.all()))
        visits.append(tuple(tile) or ((0, min(block, sk), True),))
    return tuple(visits)


PATTERN_BYTES = 48 * 1024  # SBUF bytes per partition the resident mask patterns may take
MASKED_BIAS = -2.0e38  # added to the scores a pattern masks (as the causal bias: finite, so 0 * it is 0)


def mask_patterns(mask: np.ndarray, block: int):
    """(patterns [count, 128, width] bf16 of 0 and MASKED_BIAS, key visits (first key, keys, False, pattern, first
    column)) of a keep-mask whose cut blocks repeat few patterns; None when they need more than PATTERN_BYTES of SBUF
    or a row keeps no key (its zeros need the mask tensor's -inf). A block's pattern covers the columns from its
    first masked one to its last."""
    if not mask.any(axis=1).all():
        return None
    sq, sk = mask.shape
    found: dict = {}
    shapes, visits = [], []
    for q0 in range(0, sq, Q_TILE):
        rows = mask[q0:q0 + Q_TILE]
        tile = []
        for k0 in range(0, sk, block):
            part = rows[:, k0:k0 + block]
            if not part.any():
                continue
            if part.all():
                tile.append((k0, part.shape[1], False, -1, 0))
                continue
            cols = np.nonzero(~part.all(axis=0))[0]
            c0, c1 = int(cols[0]), int(cols[-1]) + 1
            key = (part.shape[0], part[:, c0:c1].tobytes(), c1 - c0)
            if key not in found:
                found[key] = len(shapes)
                shapes.append(part[:, c0:c1])
            tile.append((k0, part.shape[1], False, found[key], c0))
        visits.append(tuple(tile))
    width = max((p.shape[1] for p in shapes), default=1)
    if len(shapes) * width * 2 > PATTERN_BYTES:
        return None
    import ml_dtypes

    bias = np.zeros((max(1, len(shapes)), Q_TILE, width), dtype=np.float32)
    for i, p in enumerate(shapes):
        bias[i, :p.shape[0], :p.shape[1]] = np.where(p, 0.0, MASKED_BIAS)
    return bias.astype(ml_dtypes.bfloat16), tuple(visits)


FLEX_BLOCKS = (1024, 512)  # key block sizes a FlexAttention mask may take
BLOCK_OVERHEAD_KEYS = 1024  # a key block's fixed costs (its instructions' fixed cycles), in keys' worth of work


def flex_block(mask: np.ndarray, sk: int) -> int:
    """The key block of a FlexAttention mask: the size of FLEX_BLOCKS whose visited blocks cost least, a block
    costing its keys plus BLOCK_OVERHEAD_KEYS (a sliding window wastes less of a smaller block)."""
    def cost(block: int) -> int:
        return sum((min(block, sk - k0) + BLOCK_OVERHEAD_KEYS) for visits in key_visits(mask, block)
                   for k0, _, _ in visits)

    return min((b for b in FLEX_BLOCKS if b <= max(sk, FLEX_BLOCKS[-1])), key=lambda b: (cost(b), -b))
