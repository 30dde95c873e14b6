"""Kernel plans: what the planning passes decided about each fused kernel, as frozen data that codegen reads.

A pass that shapes a kernel (tiling for matmuls and chains, fuse_rowwise, fuse_attention, the convolution
passes; passes/kernel_plans.py for the elementwise, reduction and indexing kernels) computes its plan once and
attaches it to the node (attrs["plan"]); codegen emits instructions from the plan and decides nothing, and
imports nothing from `neuronc.passes` (this module sits below both). A plan is
plain values: ints, bools, strings, enums, tuples and nested plans, so the IR printer prints it field by field
and the parser reads it back.

The shared placement rules (the page tiles are placed on, the partition groups and the DMA splits that both
codegen follows and the cost model prices) live in `neuronc.placement`.
"""
from __future__ import annotations

import dataclasses

from neuronc.isa import DType


# Constants an epilogue holds as [partitions, 1] fp32 columns of its "columns" pool (codegen.elementwise.StepBalancer:
# a biased multiply's scale and bias, read with stride 0 by a TENSOR_ALU2 off the Scalar engine).
CONSTANT_COLUMNS = 4


@dataclasses.dataclass
class MemoryPlan:
    """Where in HBM every tensor lives (passes/memory_plan.py): codegen addresses them through it."""

    tensors: list  # TensorEntry, in HBM order
    placement: dict  # node -> TensorEntry holding the node's bytes (aliases share one)
    hbm_size: int

    def offset(self, node: object) -> int:
        return self.placement[node].offset

    def has_buffer(self, node: object) -> bool:
        return node in self.placement


def dense_strides(shape: tuple) -> tuple:
    """Element strides of a dense row-major tensor of `shape`."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def concatenated_pieces(node) -> list:
    """Per input of a CONCATENATE node: (offset, strides, shape, placed, start): the input's elements read as
    `shape` at element `strides` from `offset` in it, written at strides `placed` from element `start` of the
    concatenation. An input read through a view (passes/view_chains.py: attributes `views` and `shapes`, the
    inputs as the concatenation sees them) is read at the view's positions; any other densely."""
    dim = node.attrs["dimension"]
    out_strides = dense_strides(node.shape)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    shapes = node.attrs.get("shapes") or tuple(x.shape for x in node.inputs)
    pieces, position = [], 0
    for view, shape in zip(views, shapes):
        offset, strides, copied, placed = view if view is not None else (0, dense_strides(shape), shape, out_strides)
        pieces.append((offset, tuple(strides), tuple(copied), tuple(placed), position * out_strides[dim]))
        position += shape[dim]
    return pieces


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """An SBUF tile pool a kernel allocates: `bufs` slots of `elements` of `dtype` per partition."""

    name: str
    dtype: DType
    elements: int
    bufs: int


def pool_specs(pools: dict) -> tuple:
    """{name: (dtype, elements, bufs)} as PoolSpecs, in the dict's order (the order the kernel allocates them)."""
    return tuple(PoolSpec(name, dtype, elements, bufs) for name, (dtype, elements, bufs) in pools.items())


@dataclasses.dataclass(frozen=True)
class View:
    """How a kernel reads (or writes) a tensor in HBM: the element `offset` of its first element and the element
    `strides` of its dims (a transpose, a broadcast with stride 0, a slice...)."""

    offset: int
    strides: tuple

    @classmethod
    def of(cls, view: tuple | None, shape: tuple) -> "View":
        """An IR view attribute ((offset, strides) or None for a dense read of `shape`) as a View."""
        offset, strides = view or (0, dense_strides(shape))
        return cls(int(offset), tuple(int(s) for s in strides))


# matmuls and chains (passes/tiling.py, passes/matmul_chain.py) -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    resident: str  # "a" | "b" | "none"
    block: int  # output tiles along M ("a") or N ("b") whose operand strip stays resident
    tile_m: int
    tile_n: int
    tile_k: int
    stream_bufs: int  # buffers of the streamed operand's strip (loads go this many steps minus one ahead)
    streamed_first: bool = False  # the first streamed strip loaded before the first resident one
    transposes: str = ""  # the operands ("a", "b") whose strided strips load as DMA transposes, K tile by K tile

    def __str__(self) -> str:
        keep = {"a": f"A rows x{self.block} resident", "b": f"B cols x{self.block} resident", "none": "streamed"}
        first = " streamed first" if self.streamed_first else ""
        transposes = f" DMA-transposed {self.transposes}" if self.transposes else ""
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k} {keep[self.resident]} bufs={self.stream_bufs}{first}"
                f"{transposes}")


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """One matmul kernel C[b] = A[b] @ B[b] ([batch, m, k] @ [batch, k, n]) with its fused epilogue.

    `epilogue` is the body computed on each output tile (steps of the IR; step 0 reads the accumulator as
    input 0, input i >= 1 the matmul's extra input i - 1); `bias_row` / `bias_column` name the extra input
    added as a row into PSUM by a rank-1 matmul / as one value per partition by the first step."""

    batch: int
    m: int
    n: int
    k: int
    dtype: DType  # the result's
    tiling: MatmulTiling
    a: View  # A [batch, m, k]
    b: View  # B [batch, k, n]
    extras: tuple  # View of each extra input, read as the [batch, m, n] result
    epilogue: tuple
    slots: tuple  # per epilogue step: its temporary's slot, or None (the last step writes the result tile)
    operand_pools: tuple  # PoolSpecs of the operand strips ("a", "b", "bias_row", "bias_column")
    epilogue_pools: tuple  # PoolSpecs of the output side ("result", "constants", "extraI", "tempI", ...)
    bias_row: int | None = None
    bias_column: int | None = None
    a_by_k_tile: bool = False  # A^T's one strip loaded one DMA per K tile (passes/tiling.py `loads_a_by_k_tile`,
    # `loads_a_once`)
    in_two_parts: str = ""  # the operand ("a" or "b") whose one strided strip loads as two parts of its K tiles, each
    # over every queue (passes/tiling.py `loads_in_two_parts`, codegen/matmul.py `last_part_k_tiles`); "" for none
    epilogue_group: int = 2  # output tiles whose epilogues are emitted side by side (after the next one's matmuls)
    a_sums: bool = False  # A's sums over K (A^T's column sums) as a second output, from the resident A strips
    # (passes/matmul_column_sums.py): pools "sums_ones" [K tile, 1] and "sums" [1, strip width] among epilogue_pools
    c_sums: bool = False  # or the result's sums over its rows, from its result tiles as stored: "sums_ones"
    # [M tile, 1] and "sums" [1, tile_n]; the accumulators of all its columns held in PSUM banks of their own
    row_pairs: bool = False  # output tiles one above the other computed with rows interleaved and stored together
    # (passes/row_pairs.py): each slice of partitions of the pair one DMA of twice the rows
    stored_step: int | None = None  # an epilogue step whose tile is stored too, as the kernel's second output
    # (passes/shared_epilogues.py: a matmul's own result, read by others beside the elementwise epilogue it took)

    @property
    def stores_main(self) -> bool:
        """Whether its stores are its main traffic: no epilogue operand loaded per output tile, and K shorter than
        both sides of the result (the weight gradients over few tokens; not the LM head, k 768 over 512 tokens,
        whose 77 MB weight streams beside its stores). codegen/matmul.py `flush`, passes/row_pairs.py."""
        return not self.extras and self.k < min(self.m, self.n)


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """Two matmuls in one kernel (passes/matmul_chain.py): the first one's result, computed transposed, stays
    in SBUF as the second one's A^T. The node's inputs[:split] are the first's inputs, inputs[split:] the
    second's but A; with `early_rows`, that many row tiles of the second accumulate K tile by K tile as the
    first makes them."""

    split: int
    first: MatmulPlan
    second: MatmulPlan
    early_rows: int
    first_loc: object  # the first matmul's source location (instructions it emits carry it)
    lag: int = 2  # the first's tiles made between the making of a K tile and the second's matmuls reading it
    lead_part: int = 4  # the part of its K tiles the next strip's tiles accumulate while the first's last epilogues run


@dataclasses.dataclass(frozen=True)
class ProloguePlan:
    """A matmul whose A (or a chain whose first matmul's B, x^T) is computed by a row-wise kernel's steps in the same
    kernel (passes/norm_prologue.py): the norm's row tiles (`norm`, its body and views over the node's
    inputs[:split], [rows, cols]), each transposed on the Tensor engine into the resident strip of A^T (x^T), and
    the matmul (`matmul`, that operand not loaded) over inputs[split:] with the norm's result at `operand`."""

    split: int
    norm: "RowwisePlan"
    body: tuple
    views: tuple
    rows: int
    cols: int
    dtype: DType  # the norm's result's (A's)
    loc: object  # the norm's source location (instructions it emits carry it)
    matmul: "MatmulPlan | ChainPlan"  # a chain: its first matmul's B is the norm's transpose
    operand: int = 0  # where the norm's result goes among the matmul's inputs (inputs[split:])
    stored: bool = False  # the norm's row tiles stored too, as the kernel's second output (passes/norm_prologue.py:
    # a norm result others read as well, such as a training graph's saved layer-norm output)
    affine: tuple = ()  # the views (offset, strides) of inputs[split - len(affine):split]: gamma (and beta), applied
    # a partition in the copies out of the transposes' PSUM (passes/norm_prologue.py `_affine_after`); the norm's
    # body reads the inputs before them


# row-wise kernels (passes/rowwise_plan.py, passes/rowwise_schedule.py) -------------------------------------
#
# A row tile's steps are computed by fewer instructions than there are steps (passes/rowwise_plan.py says how);
# these are the instruction forms. An argument is ("input", i), ("step", j) or ("imm", value).

def _tiles(args) -> tuple:
    return tuple(a for a in args if a[0] != "imm")


@dataclasses.dataclass(frozen=True)
class Plain:
    """The step as it is: one instruction (TENSOR_REDUCE for a reduction)."""
    args: tuple

    @property
    def reads(self) -> tuple:
        return _tiles(self.args)


@dataclasses.dataclass(frozen=True)
class Alu2:
    """(a op b), then op1 with c unless op1 is None: one TENSOR_ALU2."""
    a: tuple
    b: tuple
    op: object  # an ir.Op
    c: tuple | None = None
    op1: object = None

    @property
    def reads(self) -> tuple:
        return (self.a, self.b) + ((self.c,) if self.c else ())


@dataclasses.dataclass(frozen=True)
class Summed:
    """act(scale * src + bias) and its row sum, step `row_sum`: one ACTIVATE_BIAS_REDUCE. The bias is 0 without a
    shift; with one, the shift itself when `negated` (scale -1: a square of m - x) or else -shift (scale 1)."""
    act: object  # an activation ir.Op, or MULTIPLY for a square
    src: tuple
    row_sum: int
    shift: tuple | None = None
    negated: bool = False

    @property
    def reads(self) -> tuple:
        return (self.src,) + ((self.shift,) if self.shift else ())


@dataclasses.dataclass(frozen=True)
class Act:
    """act(scale * src + bias) with immediate scale and bias: one ACTIVATE."""
    act: object
    src: tuple
    scale: float
    bias: float

    @property
    def reads(self) -> tuple:
        return (self.src,)


@dataclasses.dataclass(frozen=True)
class RowSum:
    """The fp32 row sum of src: TENSOR_REDUCE, or an identity ACTIVATE_BIAS_REDUCE on the Scalar engine."""
    src: tuple

    @property
    def reads(self) -> tuple:
        return (self.src,)


@dataclasses.dataclass(frozen=True)
class BnStats:
    """The mean of src's row (this step, the row sum's division by the columns) and its population variance (step
    `var`, the sum of squared deviations from that mean divided likewise): one BN_STATS per chunk of the row and one
    BN_AGGR on the Vector/GpSimd engines, in place of a row sum, a Summed square and the two divisions."""
    src: tuple
    var: int

    @property
    def reads(self) -> tuple:
        return (self.src,)

    @staticmethod
    def chunks(cols: int, max_free: int) -> tuple:
        """The column ranges of the row's BN_STATS: as few as hold at most `max_free` columns each, equal to within one
        column (the instructions' results, and so their values, depend on these bounds)."""
        k = -(-cols // max_free)
        return tuple((i * cols // k, (i + 1) * cols // k) for i in range(k))


OUT_SLOT = "out"  # the slot of a value kept in the output tile


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How a ROWWISE body's steps are computed per row tile, and the tile slots that takes."""
    instrs: tuple  # (step, Plain | Alu2 | Summed | Act | RowSum | BnStats), in step order; col steps are Plain
    out_step: int  # the step whose instruction writes the output tile
    slots: tuple  # (step, slot): its tile slot of its kind (OUT_SLOT: the output tile); a Summed's row sum has
    # one too. The out step has none, nor a full value nothing reads (it goes to the kernel's scratch tile)
    count: tuple  # (("full", n), ("row", n), ("col", n)): slots of each kind

    @property
    def instr_of(self) -> dict:
        return dict(self.instrs)

    @property
    def slot_of(self) -> dict:
        return dict(self.slots)

    @property
    def count_of(self) -> dict:
        return dict(self.count)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a ROWWISE kernel's row tiles go on the engines (passes/rowwise_schedule.py, priced)."""
    bufs: int  # buffers of each per-row-tile pool (passes/rowwise_plan.py BUF_CHOICES)
    together: int  # row tiles whose instructions are emitted interleaved (2 needs PAIRED_BUFS)
    row_sum_on_scalar: bool  # a plain row sum as an identity ACTIVATE_BIAS_REDUCE, else TENSOR_REDUCE on an ALU engine
    row_steps_on_scalar: bool  # per-row ALU steps (a mean's division) on the Scalar engine, next to the row sums
    cut: int  # the tail's columns [0, cut) and [cut, cols) on two engines side by side (`split_engines`); 0: whole
    shared_after: int  # groups of row tiles loaded before the inputs shared by every row (a norm's weight)
    bn_tiles: int = 0  # the first row tiles whose BnStats are BN_STATS and BN_AGGR (Vector/GpSimd); the others make
    # them as the steps they stand for (a row sum, a Summed square, the divisions: passes/rowwise_plan.py)


@dataclasses.dataclass(frozen=True)
class RowwisePlan:
    """A ROWWISE kernel: its schedule, its row tile's instructions, and what they need."""
    schedule: Schedule
    tile: TilePlan
    kinds: tuple  # per step: "full", "row" or "col" (passes/rowwise_plan.py `step_kinds`)
    tail: tuple  # the steps computed by column halves when the schedule cuts (else empty)
    split_engines: tuple  # the Engines of the two halves of a cut tail
    needs_constants: bool  # a SELECT takes a constant (a tile of it per row tile)
    scalar_steps: tuple  # per step: a per-row ALU step the schedule may put on the Scalar engine
    sums: tuple = ()  # steps whose values are also summed over the rows, each a further output of the kernel (its
    # index 1, 2...: passes/rowwise_column_sums.py), ones[128, 1]^T @ each row tile accumulating in PSUM banks of
    # `sum_bank` columns, row tiles in order, rounded once into the output's dtype after the last
    sum_bank: int = 512  # columns per matmul of a sum (one PSUM bank of fp32)


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """A REDUCE_LAST kernel: out[r] = reduce(x[r, :]), x the input or a prologue body computed per tile from the
    inputs read through their [R, C] views; columns reduced `chunk` at a time (passes/kernel_plans.py)."""
    rows: int
    cols: int
    kind: str  # "add" | "max" | "min" | "and" | "or"
    prologue: tuple  # IR steps computing x per tile (empty: x is input 0)
    slots: tuple  # per prologue step: its temporary's slot, or None (the last step's output tile)
    views: tuple  # View [R, C] of each input
    chunk: int  # columns per tile
    pools: tuple  # PoolSpecs
    store_tiles: int = 1  # row tiles whose reductions one DMA stores (side by side in an "outs" tile)
    epilogue: tuple = ()  # IR steps computed on each row tile's [rows, 1] result before its store (input 0: it)
    epilogue_slots: tuple = ()  # per epilogue step: its temporary's slot ("etemp<i>"), or None (the "eout" tile)
    # The prologue and the sum as one ACTIVATE_BIAS_REDUCE on the Scalar engine: a RowSum (an identity of an input,
    # widened on load) or a Summed (an activation or square of an input, a per-row input subtracted as the bias),
    # reading inputs ("input", i) only (passes/kernel_plans.py); None: the prologue's steps and a TENSOR_REDUCE
    on_scalar: Summed | RowSum | None = None


@dataclasses.dataclass(frozen=True)
class PartitionSumPlan:
    """A REDUCE_LAST kernel summing its input (or a prologue of its inputs) over the outer axis of their memory:
    out[r] = sum_t x[t, r] for x laid out [T, R] (T the reduced axis, R contiguous; a bias or norm-weight gradient's sum over tokens). Tiles of
    `tile_rows` consecutive t (one per partition, whole rows of up to `group` outputs) are loaded as they lie and
    summed over partitions by the Tensor engine, ones[T, 1]^T @ tile accumulating in fp32 in PSUM, a bank of
    `bank` outputs per matmul; the sums are rounded once into the output (passes/kernel_plans.py)."""
    rows: int  # R: the outputs
    cols: int  # T: the values summed into each
    view: View  # the input as [T, R] (its memory order)
    tile_rows: int  # T per tile: the partitions
    group: int  # outputs accumulated at once (PSUM banks x bank)
    bank: int  # outputs per matmul (one PSUM bank of fp32)
    pools: tuple  # PoolSpecs: "input<i>" [tile_rows, group], the prologue's, "ones" [tile_rows, 1], "outs" [1, group]
    prologue: tuple = ()  # IR steps computing x per tile from the inputs, all read through `view` (empty: input 0)
    slots: tuple = ()  # per prologue step: its temporary's slot, or None (the "body_out" tile)
    per_token: tuple = ()  # the inputs holding one value per t (a [T] vector): loaded as a [tile_rows, 1] column


# elementwise and indexing kernels (passes/kernel_plans.py) ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ElementwisePlan:
    """One or many fused elementwise ops computed tile by tile: the body, the inputs it reads, how each operand
    lies over the node's shape, the tile size and the pools."""
    body: tuple  # IR steps
    inputs: tuple  # indices of the inputs the body reads
    views: tuple  # View of the result (dense), then of each read input, over the node's shape
    slots: tuple  # per step: its temporary's slot, or None (the last step writes the output tile)
    free: int  # elements per partition of a tile
    pools: tuple  # PoolSpecs: "input{i}", "temp{t}", "out", "constants"


@dataclasses.dataclass(frozen=True)
class RowsPlan:
    """A GATHER_ROWS / SCATTER_ROWS kernel: rows moved by indirect DMA, each cut into `chunk` columns per tile."""
    chunk: int


@dataclasses.dataclass(frozen=True)
class TopkPlan:
    """A TOPK kernel: per tile of rows, `rounds` rounds of the 8 largest over rows padded to `width` values."""
    width: int
    rounds: int


# attention (passes/attention.py) -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The flash-attention kernel of an ATTENTION node: its sizes, its key blocks and pipeline, its pools."""
    batch_shape: tuple  # (batch, heads): the batch-heads
    queries: int
    keys: int
    head_dim: int
    value_dim: int
    scale: float
    mask: str  # "none" | "causal" | "select" | "add"
    causal_offset: int  # causal: key j is seen by query i when j <= i + offset
    fill: float  # select: the logits' value where the mask tensor equals `masked_when`
    masked_when: bool
    zero_masked_rows: bool  # a row every key is masked for gives zeros
    views: tuple  # View of q [.., Sq, D], k [.., Sk, D], v [.., Sk, Dv] (and the mask [.., Sq, Sk])
    out_view: View  # where O [*batch_shape, Sq, Dv] lies in the node's buffer
    q_tile: int  # query rows per tile (one per partition)
    key_block: int  # keys per block
    softmax_blocks: int  # key blocks sharing one softmax statistic
    depth: int  # key blocks in flight in the software pipeline
    heads_ahead: int  # heads whose K, V, Q are loaded ahead of their turn
    causal_cuts: tuple  # the distinct cuts of the causal bias tiles
    logits_in_sbuf: bool
    fused_logits: bool  # one instruction makes the logits from the PSUM scores
    score_dtype: DType
    logits_dtype: DType  # the dtype the logits are made in
    probability_dtype: DType
    pools: tuple  # PoolSpecs
    # FlexAttention (passes/attention.py lower_flex_attention): the score_mod's elementwise steps on each block of
    # logits, and per query tile the key blocks visited, each (first key, keys, whether the mask tensor is read)
    score_mod: tuple = ()
    key_visits: tuple = ()
    out_tiles: int = 1  # whole query tiles of a head stored together (passes/attention.py output_tiles)
    rows_heads: int = 0  # the first heads whose Q^T, K^T are transposed on the Tensor engine (rows_heads)
    cell_heads: int = 0  # the first heads whose K^T, Q^T DMA transposes go a hazard cell of columns each (cell_heads)
    copy_slack: float = 0.0  # ns: P^T's copies out of PSUM go to the cheapest engine finishing within it (copy_slack)
    tail_heads: int = 2  # the last heads whose outputs are stored tile by tile
    # ... and the DMA transposes of K^T and Q^T, on the queues that free first on an estimated clock (freest_queue)
    queues_by_clock: bool = False
    warm_exp: bool = False  # the exp's activation table loaded at the kernel's start (passes/attention.py _timed_choices)
    pt_by_dma: bool = False  # chunks of P^T may be DMA transposes, with waits in the pipeline (pt_by_dma)
    # (with pt_by_dma) the pipeline steps a block waits before its P^T and before its P V, and the most chunks of a
    # block's P^T made by DMA (passes/attention.py PT_WAIT, PV_WAIT, PT_DMA_CHUNKS)
    pt_wait: int = 0
    pv_wait: int = 0
    pt_dma_chunks: int = 0
    # PSUM banks of the scores and of P^T (passes/attention.py SPLIT_PSUM, where blocks are split; the accumulators take two more)
    score_psum: int = 4
    pt_psum: int = 2

    @property
    def batch(self) -> int:
        """Batch-heads: the kernel's outer loop."""
        count = 1
        for size in self.batch_shape:
            count *= size
        return count


# convolutions (passes/conv.py) ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Sizes of a 2-D convolution [N, C, H, W] x [O, C, KH, KW] -> [N, O, OH, OW] and of its SBUF planes."""

    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple  # (KH, KW)
    out: tuple  # (OH, OW)
    strides: tuple
    padding: tuple  # ((top, bottom), (left, right))
    dilation: tuple
    partitions: int  # the target's: channels are tiled by this many

    @property
    def taps(self) -> list:
        """(kh, kw, plane, row offset, column offset) of every tap, in the planes of the strided input."""
        (kh_, kw_), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilation
        return [(kh, kw, (kh * dh % sh) * sw + kw * dw % sw, kh * dh // sh, kw * dw // sw)
                for kh in range(kh_) for kw in range(kw_)]

    @property
    def phases(self) -> int:
        return self.strides[0] * self.strides[1]

    @property
    def pitch(self) -> int:
        """Elements of one row of a plane: the output row plus the reach of the kernel's columns."""
        return self.out[1] + (self.kernel[1] - 1) * self.dilation[1] // self.strides[1]

    def plane_rows(self, band: int) -> int:
        return band + (self.kernel[0] - 1) * self.dilation[0] // self.strides[0]

    def plane_elements(self, band: int) -> int:
        return self.plane_rows(band) * self.pitch

    def band_elements(self, band: int, margin: int = 0) -> int:
        """Elements per partition of one C tile's band: its planes after `margin` elements, plus one row of
        slack that the last tap's dropped columns read past the end."""
        return margin + self.phases * self.plane_elements(band) + self.pitch

    def tap_offset(self, tap: tuple, band: int) -> int:
        """Where a tap reads in the band, relative to the output element it contributes to."""
        _, _, plane, dr, dc = tap
        return plane * self.plane_elements(band) + dr * self.pitch + dc

    @property
    def c_tiles(self) -> int:
        return -(-self.channels // self.partitions)


@dataclasses.dataclass(frozen=True)
class TapPlan:
    """Which taps each matmul computes. A 128 x 128 Tensor engine multiplying C <= 64 input channels into O <= 64
    output channels is a quarter used; two ways fill it:

    - on K (C <= 64): a second copy of the band on partitions [C, 2C), shifted `delta` elements, so the moving
      operand holds the input at two offsets, a and a + delta: two taps per matmul;
    - on M (O <= 64, `halves` 2): the output partitions [O, 2O) compute the next output row, whose taps read
      one row (`pitch` elements) further: the same moving operand serves tap t of this row and the tap one
      kernel row above of the next. Each matmul then makes one row of each half (N = pitch).

    A matmul is (a, blocks): its moving operand starts `a` elements into the band (relative to its output
    row), and each block (k half, m half, tap) of its stationary holds that tap's weights; other blocks are zero."""

    delta: int  # 0: one copy of the band
    halves: int  # 1, or 2: the upper output partitions make the next row
    matmuls: tuple

    @property
    def copies(self) -> int:
        return 2 if self.delta else 1


@dataclasses.dataclass(frozen=True)
class ConvTiling:
    rows: int  # output rows per PSUM accumulator block (rows / halves x pitch <= one bank)
    band: int  # output rows whose input rows are loaded at once (a multiple of rows, or all of them)
    halves: int = 1  # 2: output rows two at a time on the output partitions (TapPlan)

    def __str__(self) -> str:
        pairs = ", row pairs" if self.halves == 2 else ""
        return f"{self.rows} rows/block, {self.band} rows/band{pairs}"


@dataclasses.dataclass(frozen=True)
class EpiloguePlan:
    """How the kernel computes its epilogue. Its first element steps, while each is the previous value (at first,
    the accumulator) plus, minus, times or over a per-channel value (a bias, a BatchNorm's mean, scale and
    shift), make acc * scale + shift: the scale is folded into the weights (w[o] * scale[o], as BatchNorm
    folding does; eager's own BatchNorm computes x * scale + shift too), the shift is the bias of the Scalar
    engine's activation (ACTIVATE_BIAS_REDUCE, one value per partition), of the activation step that follows
    (after any additions of other inputs, such as a residual) or of an identity. The steps `body` adds after
    the epilogue's make the scale and the shift, once per channel."""

    body: tuple  # the epilogue's steps, then the per-channel steps making scale and shift
    kinds: tuple  # per step: "channel", "element", or "folded" (into scale and shift)
    scale: tuple | None  # ("step", j) or ("imm", v): the per-channel factor folded into the weights
    shift: tuple | None  # ("step", j) or ("imm", v): the per-channel value added as an activation's bias
    folded: int | None  # the last folded step: its value is acc * scale (+ shift unless `biased`)
    biased: int | None  # the activation step whose bias is the shift (after additions of other inputs)


@dataclasses.dataclass(frozen=True)
class ConvPlan:
    """An implicit-GEMM convolution kernel (passes/conv.py): its geometry, tiling, taps and epilogue."""

    geometry: ConvGeometry
    tiling: ConvTiling
    taps: TapPlan  # which taps (and rows) each matmul computes
    epilogue: EpiloguePlan
    slots: tuple  # per epilogue step: its temporary's slot, or None
    channel_inputs: tuple  # indices of the inputs the same for every element of an output channel
    views: tuple  # View of every input (dense where the IR has none)
    pools: tuple  # PoolSpecs
    psum_bufs: int  # PSUM banks the accumulators rotate over
    store_queues: int  # DMA queues the results are stored on (the others load)


__all__ = ["MemoryPlan", "dense_strides", "PoolSpec", "pool_specs", "View", "MatmulTiling", "MatmulPlan", "ChainPlan",
           "Plain", "Alu2", "Summed", "Act", "RowSum", "BnStats", "OUT_SLOT", "TilePlan", "Schedule", "RowwisePlan", "ReducePlan",
           "ElementwisePlan", "RowsPlan", "TopkPlan", "AttentionPlan", "ConvGeometry", "TapPlan", "ConvTiling",
           "EpiloguePlan", "ConvPlan"]
