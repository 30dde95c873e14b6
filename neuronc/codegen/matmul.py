"""The matmul kernel: stationary and moving tiles on the Tensor engine accumulating in PSUM, loads issued ahead,
and the fused epilogue (bias, activation, residual, cast) computed from PSUM on the other engines.

The kernel follows its MatmulPlan (passes/tiling.py): the tiles and loop order, the operand strips it keeps
resident, the pools. `_Matmul` holds what its stages share (the tensors in HBM, the pools, the output tiles
whose epilogues are pending) and has a method per stage: load a strip, accumulate an output tile, compute the
epilogues and store, walk the strips in order of use. A chain (ChainPlan, passes/matmul_chain.py) is two of
them, the first one's result kept in SBUF as the second one's A^T (`_EarlyColumn`: the second's first column
accumulated while the first runs)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from neuronc import ir
from neuronc.codegen.access import HbmTensor, broadcast_columns, column_slice, dma_by_rows, first_rows, tile_at
from neuronc.codegen.attention import identity
from neuronc.codegen.elementwise import StepBalancer, scaled_products, slots_hold, step_reads, table_order
from neuronc.codegen.emitter import Emitter, Pool
from neuronc.codegen.rowwise import Rowwise, row_tile_groups
from neuronc.errors import NeuronCompileError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode, Space
from neuronc.ir import Node, Op
from neuronc.placement import transpose_chunks
from neuronc.plans import ChainPlan, MatmulPlan, MemoryPlan, ProloguePlan, dense_strides
from neuronc.targets import Target


# PSUM banks of a chain's prologue for its transposes; the first matmul's other banks (2 of 4 on trn2) hold its
# lead tiles while the norm's row tiles are made (`_Matmul.lead_tiles`). Measured (GPT-2 block, trn2 bf16, us):
# all rows first (no lead tiles) 165.4; 1 bank for the transposes, 3 lead tiles 165.6; 2 and 2 164.8; 3 and 1
# 164.8. More lead tiles hold more banks and A strips through the prologue, and their epilogues (the GELU, on
# the Scalar engine mostly) come all at once after it, where the Tensor engine then waits for banks.
TRANSPOSE_BANKS = 2

# Output tiles of a matmul whose A^T loads K tile by K tile (MatmulPlan.a_by_k_tile) accumulated K tile by K tile
# (`_Matmul.k_tile_lead`). Measured (`python -m benchmarks.roofline`, trn2 bf16, -O2), GPT-2 block in us: 1 (the
# order before: one tile's K tiles, then the next tile's) 164.8, 2 163.8, 3 164.3, 4 165.2 (the lead tiles'
# epilogues all come after the last K tile; the Tensor engine then waits for banks). With 2: SwiGLU MLP 519.7 ->
# 511.0, Llama layer 2108.5 -> 2105.5, 12-layer GPT-2 2633.4 -> 2621.9.
K_TILE_LEAD = 2


def matmul(em: Emitter, node: Node, memory: MemoryPlan) -> None:
    """A matmul kernel, or a chain of two (passes/matmul_chain.py): the first one's result, computed
    transposed, stays in SBUF as the second one's stationary operand."""
    plan = node.attrs["plan"]
    if isinstance(plan, MatmulPlan):
        _Matmul(em, plan, memory, node.inputs, node.loc, home=node).emit()
    elif isinstance(plan, ProloguePlan):
        _prologued(em, plan, memory, node)
    else:
        _chain(em, plan, memory, node)


def _prologued(em: Emitter, plan: ProloguePlan, memory: MemoryPlan, node: Node) -> None:
    """A matmul whose A is a norm's result (passes/norm_prologue.py), or a chain whose first matmul's B is its
    transpose: each row tile of the norm, computed as the row-wise kernel computes it, is transposed on the Tensor
    engine (matmuls with the identity, a PSUM bank's worth of K tiles at a time) and copied into the resident
    strip of the norm's transpose, K tile j at columns [j x rows + r0, ...); the matmul multiplies from there (the
    operand not loaded), the matmuls of each row tile's output tiles emitted as soon as that row tile is made."""
    tk, rows = (plan.matmul.first if isinstance(plan.matmul, ChainPlan) else plan.matmul).tiling.tile_k, plan.rows
    kept = em.sbuf_pool(plan.dtype, plan.cols // tk * rows, bufs=1).next().ap(tk, plan.cols // tk * rows)
    eye = identity(em, em.sbuf_pool(plan.dtype, tk, bufs=1).next(), tk, em.sbuf_pool(DType.F32, tk, bufs=1).next())
    chain = plan.matmul if isinstance(plan.matmul, ChainPlan) else None
    # the transposes take their banks from the matmul's pool (the first matmul's, in a chain): they are done before
    # its output tiles need them; in a chain, TRANSPOSE_BANKS of them, the others holding the first's lead tiles
    psum = em.psum_pool(bufs=em.target.psum_banks - (chain.early_rows if chain else 0))
    transposes = psum.part(0, TRANSPOSE_BANKS) if chain else psum
    # trn2+: the transpose mode writes 16-bit results to PSUM, which the evacuating engines copy faster (targets.py)
    mode = em.target.tensor_transpose_mode and plan.dtype in (DType.BF16, DType.F16)
    per_bank = em.target.psum_bank_bytes // (plan.dtype.itemsize if mode else DType.F32.itemsize) // tk
    norm = ir.node(Op.ROWWISE, list(node.inputs[:plan.split - len(plan.affine)]), (rows, plan.cols), plan.dtype,
                   plan.loc,
                   body=plan.body, views=plan.views, rows=rows, cols=plan.cols, plan=plan.norm)
    kernel: Rowwise

    stored = None  # the norm's result in HBM, the kernel's last output (ProloguePlan.stored; 1 or, after a stored
    if plan.stored:  # epilogue step's, 2)
        index = len(node.attrs["outputs"]) - 1
        stored = HbmTensor(plan.dtype, memory.placement[(node, index)].offset, ((plan.cols, rows), (1, plan.cols)))

    # the norm's gamma (and beta) when the copies out of PSUM apply them (ProloguePlan.affine): each loaded as
    # [K tiles, tk] rows (contiguous: a strided [tk, K tiles] load of a few bytes a partition costs ~3x as much),
    # where the norm loads its inputs the same for every row (after its first row tiles', before the later ones' and
    # B's strips), then transposed on the Tensor engine with the norm's first row tile, into [tk, K tiles]: K tile
    # j's values one a partition in column j (passes/norm_prologue.py checks K tiles <= partitions, the dtype A's)
    k_tiles, rows_of_vectors, vectors = plan.cols // tk, [], []

    def load_vectors() -> None:
        for x, (offset, strides) in zip(node.inputs[plan.split - len(plan.affine):plan.split], plan.affine):
            loaded = em.sbuf_pool(x.dtype, tk, bufs=1).next().ap(k_tiles, tk)
            em.dma(loaded, HbmTensor(x.dtype, memory.offset(x) + offset * x.dtype.itemsize,
                                     ((strides[1] * tk, k_tiles), (strides[1], tk))).ap)
            rows_of_vectors.append(loaded)

    def transpose_vectors() -> None:
        for loaded in rows_of_vectors:
            acc = transposes.next().ap(tk, k_tiles, dtype=plan.dtype if mode else DType.F32)
            em.emit(Opcode.MATMUL, Engine.TENSOR, acc, loaded, tile_at(eye, 0, k_tiles, k_tiles))
            vectors.append(em.sbuf_pool(plan.dtype, k_tiles, bufs=1).next().ap(tk, k_tiles))
            kernel.engines.emit(Opcode.TENSOR_COPY, vectors[-1], acc)

    def copy(dst: AccessPattern, acc: AccessPattern, j: int) -> None:
        """K tile j's transposed block out of PSUM: copied, or y * gamma (+ beta), gamma and beta held a partition."""
        if not plan.affine:
            kernel.engines.emit(Opcode.TENSOR_COPY, dst, acc)
            return
        held = [broadcast_columns(column_slice(v, j, j + 1), acc.free_elements) for v in vectors]
        kernel.engines.emit(Opcode.TENSOR_ALU2, dst, acc, held[0], held[-1], alu=AluOp.MULTIPLY,
                            alu1=AluOp.ADD if len(held) == 2 else AluOp.NONE)

    def transposed(r0: int, tile: AccessPattern) -> None:
        rt = tile.partitions
        if stored is not None:
            dma_by_rows(em, stored[r0:r0 + rt].ap, tile)
        if rows_of_vectors and not vectors:
            transpose_vectors()
        for j0 in range(0, plan.cols // tk, per_bank):
            group = range(j0, min(j0 + per_bank, plan.cols // tk))
            acc = transposes.next().ap(tk, len(group) * rt, dtype=plan.dtype if mode else DType.F32)
            for n, j in enumerate(group):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(acc, n * rt, tk, rt), tile_at(tile, j * tk, rt, tk),
                        tile_at(eye, 0, rt, rt))
            for n, j in enumerate(group):
                copy(tile_at(kept, j * rows + r0, tk, rt), tile_at(acc, n * rt, tk, rt), j)

    kernel = Rowwise(em, norm, memory, sink=transposed, shared_loads=load_vectors if plan.affine else None)
    groups, made = row_tile_groups(kernel), set()

    def make_rows(m0: int) -> None:  # the norm's row tiles up to the one holding row m0, before its matmuls
        while m0 not in made:
            em.locate(plan.loc)
            made.update(next(groups))
            em.locate(None)

    make_rows(0)  # the first row tiles' loads go ahead of B's strips on the queues
    rest = list(node.inputs[plan.split:])
    inputs = (*rest[:plan.operand], None, *rest[plan.operand:])
    if chain:  # the first's B, x^T: its output tiles read every token; its lead tiles a row tile at a time
        _chain(em, chain, memory, node, inputs, b_resident=kept, psum=psum,
               lead=(psum.part(TRANSPOSE_BANKS, psum.bufs - TRANSPOSE_BANKS), make_rows))
        return
    _Matmul(em, plan.matmul, memory, inputs, node.loc, home=node, a_resident=kept, psum=psum,
            before_tile=make_rows).emit()


def _chain(em: Emitter, chain: ChainPlan, memory: MemoryPlan, node: Node, inputs: tuple | None = None,
           b_resident: AccessPattern | None = None, psum: Pool | None = None, lead: tuple | None = None) -> None:
    """`inputs`: the node's, unless a prologue makes the first's B (`b_resident`, its input None); `psum`: the
    first's PSUM pool, if the caller made it; `lead`: (PSUM pool, make_columns) when the prologue makes B's
    columns a block at a time (`_Matmul.lead_tiles`)."""
    first, second = chain.first, chain.second
    inputs = node.inputs if inputs is None else inputs
    first_inputs, second_inputs = inputs[:chain.split], (None, *inputs[chain.split:])
    tiling = second.tiling
    k_tiles = -(-first.m // tiling.tile_k)
    kept = em.sbuf_pool(first.dtype, k_tiles * first.n, bufs=1).next().ap(tiling.tile_k, k_tiles * first.n)
    psum = psum or em.psum_pool(bufs=em.target.psum_banks - chain.early_rows)
    if not chain.early_rows:
        em.locate(chain.first_loc)
        _Matmul(em, first, memory, first_inputs, chain.first_loc, sink=kept, psum=psum, b_resident=b_resident,
                lead=lead).emit()
        em.locate(None)
        _Matmul(em, second, memory, second_inputs, node.loc, home=node, a_resident=kept, psum=psum).emit()
        return
    early_psum = em.psum_pool(bufs=chain.early_rows)
    rest = _Matmul(em, second, memory, second_inputs, node.loc, home=node, a_resident=kept,
                   psum=psum).early_column(early_psum, chain.lead_part)
    # The second's first column of output tiles accumulates K tile by K tile as the first makes them, `lag` of
    # the first's tiles behind (so their epilogues are done when the Tensor engine reaches these matmuls). The
    # second's other strips load once the first's matmuls are emitted (`finish`), not during the first: there
    # they took the queues from the first's streamed strips and the early column's K tiles, and the first
    # waited for its strips (GPT-2 MLP, trn2 bf16: 73.0 us with them loaded halfway through the first, 72.1
    # without).
    made, pending = [0] * k_tiles, []
    first_tiles = -(-first.n // first.tiling.tile_n)

    def made_tile(m0: int) -> None:
        j = m0 // tiling.tile_k
        made[j] += 1
        if made[j] == first_tiles:
            pending.append(j)
            rest.load_k(j)
        while len(pending) > chain.lag:
            rest.accumulate_k(pending.pop(0))

    em.locate(chain.first_loc)  # the second's early matmuls, emitted among the first's, keep the first's location
    _Matmul(em, first, memory, first_inputs, chain.first_loc, sink=kept, psum=psum, after_tile=made_tile,
            b_resident=b_resident, lead=lead).emit()
    em.locate(None)
    rest.finish(pending)


@dataclasses.dataclass(frozen=True)
class _Strip:
    """A loaded operand strip: [K tile, k tiles x width] in SBUF, and the part of the bias that travels with it
    (B's strips: the bias row's columns, [1, width]; A's: the bias column's rows, [M tile, row tiles])."""

    tile: AccessPattern
    width: int
    bias: AccessPattern | None = None


@dataclasses.dataclass(frozen=True)
class _StripColumns:
    """`size` columns from `col` of a loaded strip: K tile j of them is an operand of the matmuls of K tile j."""

    strip: _Strip
    col: int
    size: int
    tile_k: int
    k: int
    step: int = 1  # columns col, col + step, ...: a row pair's stationary (`output_tile_of_pair`)

    def k_tile(self, j: int) -> AccessPattern:
        tile = tile_at(self.strip.tile, j * self.strip.width + self.col, min(self.tile_k, self.k - j * self.tile_k),
                       self.size)
        return tile if self.step == 1 else dataclasses.replace(tile, dims=(tile.dims[0], (self.step, self.size)))


@dataclasses.dataclass(frozen=True)
class _Streamed:
    """An operand loaded K tile by K tile on demand ([rows, size] tiles: the baseline's stream), from `x` [K, size]."""

    kernel: "_Matmul"
    pool: Pool
    x: HbmTensor

    def k_tile(self, j: int) -> AccessPattern:
        tk = self.kernel.tk
        rows, size = min(tk, self.kernel.plan.k - j * tk), self.x.dims[1][1]
        tile = self.pool.next().ap(rows, size)
        self.kernel.em.dma(tile, self.x[j * tk:j * tk + rows].ap)
        return tile


@dataclasses.dataclass(frozen=True)
class _Placed:
    """An output tile placed in a tile the caller owns (a chain's kept result), in place of a pool's slot."""

    at: AccessPattern

    def ap(self, *shape, dtype=None) -> AccessPattern:
        return self.at


@dataclasses.dataclass(frozen=True)
class _Job:
    """An output tile whose matmuls are emitted and whose epilogue is not: its epilogue's inputs (0: the
    accumulator), temporaries, result tile and shape, where it is stored (None: kept on chip), its first row."""

    loaded: dict
    temps: list
    out: object  # a Tile, or _Placed
    shape: tuple
    store: AccessPattern | None
    m0: int
    n0: int = 0
    done: dict = dataclasses.field(default_factory=dict)  # step -> its result AP, as emitted so far
    made: dict = dataclasses.field(default_factory=dict)  # step -> when the balancer books it done
    order: list = dataclasses.field(default_factory=list)  # the steps in the order they were emitted
    second: AccessPattern | None = None  # where the plan's stored step goes (MatmulPlan.stored_step), or None


@dataclasses.dataclass(frozen=True)
class _OutputTile:
    """An output tile of a strip walk: batch g, rows from m0, columns from n0, and where its operands lie: the
    loads (step numbers) of its A and B strips and its columns in them."""

    g: int
    m0: int
    n0: int
    a_load: int
    a_col: int
    b_load: int
    b_col: int


@dataclasses.dataclass(frozen=True)
class _Load:
    """A step of the strip walk: the load of one strip and the output tiles it completes."""

    load: Callable
    tiles: list


@dataclasses.dataclass(frozen=True)
class _Operands:
    stationary: _StripColumns
    moving: _StripColumns
    row: AccessPattern | None  # the tile's part of the bias row, loaded with its B strip
    column: AccessPattern | None  # ... of the bias column, loaded with its A strip


class _Matmul:
    """C[b] = A[b] @ B[b]: stationary = A tile transposed [K, M], moving = B tile [K, N], fp32 in PSUM, tiled and
    ordered as the plan says.

    Operands are loaded as strips [K tile, k tiles x width] by one DMA each (split over the queues by partitions):
    with a resident operand, its strip of `block` output tiles stays in SBUF while the other operand's strips
    stream through it. With an epilogue (fused elementwise consumers: bias, activation, residual, cast), each
    result tile is computed from the PSUM accumulator and the epilogue's other inputs on its way out.

    With `a_resident` ([K tile, k tiles x M] in SBUF: A^T, all of it), A is not loaded, nor B with `b_resident`
    ([K tile, k tiles x N]: all of B, which has no bias row then); with `sink` ([M tile,
    M tiles x N] in SBUF), result tiles go there (row tile i at columns i x N) instead of to HBM `home`'s buffer;
    `psum`, a PSUM pool to share; `after_tile(m0)` is called once a row tile's epilogue is emitted, `before_tile(m0)`
    before the matmuls of an output tile from row m0 (a prologue making A^T's rows: `_prologued`); `lead`:
    (PSUM pool, make_columns) for a resident B made a column block at a time (`lead_tiles`)."""

    def __init__(self, em: Emitter, plan: MatmulPlan, memory: MemoryPlan, inputs: tuple, loc, *,
                 home: Node | None = None, a_resident: AccessPattern | None = None,
                 b_resident: AccessPattern | None = None, sink: AccessPattern | None = None,
                 psum: Pool | None = None, after_tile: Callable | None = None, before_tile: Callable | None = None,
                 lead: tuple | None = None):
        self.em, self.plan, self.loc, self.lead = em, plan, loc, lead
        self.a_resident, self.b_resident = a_resident, b_resident
        self.sink, self.after_tile, self.before_tile = sink, after_tile, before_tile
        a, b, *extras = inputs
        batch, m, n, k = plan.batch, plan.m, plan.n, plan.k
        self.tm, self.tn, self.tk = plan.tiling.tile_m, plan.tiling.tile_n, plan.tiling.tile_k
        self.k_tiles = -(-k // self.tk)
        # the tensors in HBM: A^T [batch, k, m], B [batch, k, n], the epilogue's inputs and the result [batch, m, n]
        self.a_t = HbmTensor.of(memory, a, plan.a, (batch, m, k)).T if a_resident is None else None
        self.b = HbmTensor.of(memory, b, plan.b, (batch, k, n)) if b_resident is None else None
        self.extras = [HbmTensor.of(memory, x, view, (batch, m, n)) for x, view in zip(extras, plan.extras)]
        self.out = HbmTensor.of(memory, home) if sink is None else None
        self.slots = plan.slots
        temp_count = len({slot for slot in plan.slots if slot is not None})
        self.strips = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in plan.operand_pools
                       if not (p.name == "a" and a_resident is not None) and not (p.name == "b" and b_resident is not None)}
        specs = {p.name: p for p in plan.epilogue_pools}

        def pool(name: str) -> Pool:
            return em.sbuf_pool(specs[name].dtype, specs[name].elements, bufs=specs[name].bufs)

        self.result, self.constants = pool("result"), pool("constants")
        self.extra_pools = [pool(f"extra{i}") if f"extra{i}" in specs else None for i in range(len(extras))]
        if plan.bias_row is not None:  # an extra input added into PSUM as a row, by a rank-1 matmul with ones
            self.ones = pool("ones").next().ap(1, self.tm)
            em.emit(Opcode.MEMSET, Engine.GPSIMD, self.ones, imm0=1.0)
        if plan.bias_column is not None:  # an extra input of one value per row, added by the first step
            self.column_sums, self.widened = pool("row_sum"), pool("bias")
        self.temps = [pool(f"temp{i}") for i in range(temp_count)]
        self.summed: set = set()  # the A strip loads (steps) whose sums are emitted (plan.a_sums)
        self.row_sums: dict = {}  # plan.c_sums: column n0 -> (its accumulator [1, nt], row tiles summed into it)
        if plan.c_sums:  # the accumulators of all columns' sums in banks of their own, beside the output tiles'
            banks = -(-plan.n // em.psum_bank_elements())
            self.psum = psum or em.psum_pool(bufs=em.target.psum_banks - banks)
            self.sums_psum = em.psum_pool(bufs=banks)
        else:
            self.psum = psum or em.psum_pool()
        if plan.a_sums or plan.c_sums:  # A's sums over K or the result's over rows, the kernel's second output
            self.sums_ones = pool("sums_ones").next().ap(self.tk if plan.a_sums else self.tm, 1)
            self.sums = pool("sums")
            em.emit(Opcode.MEMSET, Engine.GPSIMD, self.sums_ones, imm0=1.0)
            size = plan.m if plan.a_sums else plan.n
            self.sums_out = HbmTensor(specs["sums"].dtype, memory.placement[(home, 1)].offset, ((1, size),))
        self.second = None  # the stored step's tensor (MatmulPlan.stored_step: the kernel's second output)
        if plan.stored_step is not None:
            if sink is not None or plan.row_pairs:
                raise NeuronCompileError("a matmul kernel storing an epilogue step must store its result too",
                                         hint="this is a bug in neuronc's passes; please report it")
            shape = (batch, m, n)
            self.second = HbmTensor(plan.epilogue[plan.stored_step].dtype, memory.placement[(home, 1)].offset,
                                    tuple(zip(dense_strides(shape), shape)))
        self.engines = StepBalancer(em, pool("columns") if "columns" in specs else None)
        self.waiting: list = []  # _Jobs: output tiles whose matmuls are emitted and whose epilogues are not
        self.early = early_steps(plan.epilogue, plan.slots)
        # tiles waiting after a flush: the next one, or with early steps the next group, so that 2 x epilogue_group
        # tiles are in flight (the epilogue pools' EPILOGUE_BUFS, passes/tiling.py) and their early steps go in
        # batches of all of them, every other flush (`flush`)
        self.kept = plan.epilogue_group if self.early else 1
        self.unstarted: list = []  # waiting _Jobs whose early steps are not emitted yet
        self.partners: dict = {}  # id(a row pair's first _Job) -> (its second, the pair's rows in HBM)
        self.paired = plan.row_pairs and (sink, a_resident, b_resident, after_tile, before_tile, lead) == (None,) * 6

    # loading strips -------------------------------------------------------------------------------------
    def load_strip(self, name: str, x: HbmTensor) -> AccessPattern:
        """All K tiles of x ([K, width]) as [tk, k tiles x width]: one DMA split over the queues by partitions, or
        one per K tile for an A^T strip its producer writes column block by column block (MatmulPlan.a_by_k_tile),
        or two parts of the K tiles, each over every queue, for a strided resident strip (MatmulPlan.in_two_parts)."""
        em, tk, width = self.em, self.tk, x.dims[1][1]
        tile = self.strips[name].next().ap(tk, self.k_tiles * width)
        whole, tail = divmod(self.plan.k, tk)
        if whole and name in self.plan.tiling.transposes:  # each K tile's [width, tk] rows transposed by the DMA
            for j in range(whole):  # engines, by chunks of an SBUF page of columns, each on its own queue
                for c0, c1 in transpose_chunks(width, x.dtype.itemsize):
                    em.dma(tile_at(tile, j * width + c0, tk, c1 - c0), x[j * tk:(j + 1) * tk, c0:c1].T.ap,
                           transpose=True)
        elif whole and name == "a" and self.plan.a_by_k_tile:
            for j in range(whole):
                dma_by_rows(em, tile_at(tile, j * width, tk, width), x[j * tk:(j + 1) * tk].ap)
        elif whole > 1 and name == self.plan.in_two_parts:
            cut = whole - last_part_k_tiles(whole, width * x.ap.dtype.itemsize, em.target)
            for j0, j1 in ((0, cut), (cut, whole)):
                dma_by_rows(em, tile_at(tile, j0 * width, tk, j1 - j0, width), x[j0 * tk:j1 * tk].tiled(tk).ap,
                            em.target.dma_queues)
        elif whole:
            dma_by_rows(em, tile_at(tile, 0, tk, whole, width), x[:whole * tk].tiled(tk).ap)
        if tail:
            em.dma(tile_at(tile, whole * width, tail, width), x[whole * tk:].ap)
        return tile

    def a_strip(self, g: int, m0: int, rows: int) -> _Strip:
        if self.a_resident is not None:
            return _Strip(self.a_resident, self.plan.m)
        rows = min(rows, self.plan.m - m0)
        tile = self.load_strip("a", self.a_t[g, :, m0:m0 + rows])
        return _Strip(tile, rows, self.bias_column_of(g, m0, rows) if self.plan.bias_column is not None else None)

    def b_strip(self, g: int, n0: int, cols: int) -> _Strip:
        if self.b_resident is not None:
            return _Strip(self.b_resident, self.plan.n)
        cols = min(cols, self.plan.n - n0)
        tile = self.load_strip("b", self.b[g, :, n0:n0 + cols])
        return _Strip(tile, cols, self.bias_row_of(g, n0, cols) if self.plan.bias_row is not None else None)

    def bias_row_of(self, g: int, n0: int, cols: int) -> AccessPattern:
        """[1, cols] of the bias row from column n0, loaded now (with the B strip it is added to)."""
        row = self.strips["bias_row"].next().ap(1, cols)
        self.em.dma(row, self.extras[self.plan.bias_row - 1][g, 0:1, n0:n0 + cols].ap)
        return row

    def bias_column_of(self, g: int, m0: int, rows: int) -> AccessPattern:
        """[M tile, row tiles] of the bias column from row m0 (row tile i in column i), loaded now."""
        tm = self.tm
        x = self.extras[self.plan.bias_column - 1][g, m0:m0 + rows, 0]
        tiles, tail = divmod(rows, tm)
        column = self.strips["bias_column"].next().ap(min(tm, rows), tiles + bool(tail))
        if tiles:
            self.em.dma(tile_at(column, 0, min(tm, rows), tiles), x[:tiles * tm].tiled(tm).ap)
        if tail:
            self.em.dma(tile_at(column, tiles, tail, 1), x[tiles * tm:].column.ap)
        return column

    def sum_strip(self, strip: _Strip, m0: int) -> None:
        """Columns m0.. of A's sums over K from its resident strip [K tile, k tiles x width]: ones^T @ each K tile
        accumulated in fp32 in PSUM, a bank of columns at a time, rounded once on the way out and stored as a row:
        the matmuls, order and rounding of the sum's own kernel (codegen/partition_sum.py, the same bits)."""
        em, width = self.em, strip.width
        bank = em.psum_bank_elements()
        sums = self.sums.next().ap(1, width)
        for turn, c0 in enumerate(range(0, width, bank)):
            c1 = min(c0 + bank, width)
            acc = self.psum.next().ap(1, c1 - c0)
            for j in range(self.k_tiles):
                rows = min(self.tk, self.plan.k - j * self.tk)
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, first_rows(self.sums_ones, rows),
                        tile_at(strip.tile, j * width + c0, rows, c1 - c0), accumulate=j > 0)
            em.emit(Opcode.TENSOR_COPY, (Engine.VECTOR, Engine.SCALAR)[turn % 2], column_slice(sums, c0, c1), acc)
        em.dma(self.sums_out[m0:m0 + width].broadcast_rows(1).ap, sums)

    def sum_rows(self, job: "_Job", out: AccessPattern) -> None:
        """An output tile's result (as stored) summed over its rows into its columns' accumulator, row tiles in
        order; after the last row tile, the sums rounded once and stored as a row: the matmuls, order and rounding
        of the sum's own kernel over the stored result (codegen/partition_sum.py, the same bits)."""
        em, (mt, nt), n0 = self.em, job.shape, job.n0
        acc, count = self.row_sums.get(n0) or (self.sums_psum.next().ap(1, nt), 0)
        em.emit(Opcode.MATMUL, Engine.TENSOR, acc, first_rows(self.sums_ones, mt), out, accumulate=count > 0)
        count += 1
        self.row_sums[n0] = (acc, count)
        if count == -(-self.plan.m // self.tm):
            sums = self.sums.next().ap(1, nt)
            em.emit(Opcode.TENSOR_COPY, (Engine.VECTOR, Engine.SCALAR)[n0 // self.tn % 2], sums, acc)
            em.dma(self.sums_out[n0:n0 + nt].broadcast_rows(1).ap, sums)

    def columns(self, strip: _Strip, col: int, size: int) -> _StripColumns:
        return _StripColumns(strip, col, size, self.tk, self.plan.k)

    # output tiles ---------------------------------------------------------------------------------------
    def output_tile(self, g: int, m0: int, n0: int, stationary, moving, acc: AccessPattern | None = None,
                    row: AccessPattern | None = None, column: AccessPattern | None = None, batches: int = 1) -> None:
        """One [mt, nt] output tile: K tiles accumulated in PSUM (unless `acc` holds them), the epilogue's inputs
        loaded, its epilogue and store queued. `row` / `column`: its part of the bias row / column, loaded with
        the strips (else loaded here). With `batches` > 1, `acc` holds batches g, g + 1, ... side by side
        ([mt, batches x nt], see `side_by_side`), and so do the epilogue's inputs and result."""
        em, plan = self.em, self.plan
        mt, nt = min(self.tm, plan.m - m0), min(self.tn, plan.n - n0)

        def block(x: HbmTensor) -> AccessPattern:  # this tile's elements of a [batch, m, n] tensor, as the tile holds them
            if batches == 1:
                return x[g, m0:m0 + mt, n0:n0 + nt].ap
            return x[g:g + batches, m0:m0 + mt, n0:n0 + nt].permute(1, 0, 2).ap

        if acc is None:
            acc = self.psum.next().ap(mt, nt)
            for j in range(self.k_tiles):
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary.k_tile(j), moving.k_tile(j), accumulate=j > 0)
        loaded = {0: acc}
        for i, (x, pool) in enumerate(zip(self.extras, self.extra_pools), start=1):
            if i == plan.bias_row:  # acc[m, n] += 1 * bias[n]
                row = row if row is not None else self.bias_row_of(g, n0, nt)
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, column_slice(self.ones, 0, mt), row, accumulate=True)
                continue
            if i == plan.bias_column:  # [mt, 1] values widened to fp32 for the first step's per-partition bias
                column = column if column is not None else self.bias_column_of(g, m0, mt)
                loaded[i] = self.widened.next().ap(mt, 1)
                em.emit(Opcode.TENSOR_COPY, Engine.GPSIMD, loaded[i], column)
                self.engines.account(em.instructions[-1:])
                loaded["row_sum"] = self.column_sums.next().ap(mt, 1)
                continue
            loaded[i] = pool.next().ap(mt, batches * nt)  # by rows over several queues, as the store
            dma_by_rows(em, loaded[i], block(x))
        temps = [pool.next() for pool in self.temps]
        if self.sink is not None:
            job = _Job(loaded, temps, _Placed(tile_at(self.sink, m0 // self.tm * plan.n + n0, mt, nt)), (mt, nt),
                       None, m0)
        else:
            job = _Job(loaded, temps, self.result.next(), (mt, batches * nt), block(self.out), m0, n0,
                       second=None if self.second is None else block(self.second))
        self.waiting.append(job)
        if self.early:  # the steps not reading the accumulator, a group of tiles at a time, ahead of the flush
            self.unstarted.append(job)
        if len(self.waiting) >= self.plan.epilogue_group + self.kept:  # the kept tiles' matmuls go ahead of the
            self.flush(keep=self.kept)  # epilogues of the ones before

    def output_tile_of_pair(self, g: int, m0: int, n0: int, stationary, moving, parity: int) -> None:
        """`output_tile` for half of a row pair (MatmulPlan.row_pairs, passes/row_pairs.py): rows m0 + parity + 2p
        of the output on partition p (`stationary` takes A^T's columns every other one), so that the pair's two
        result tiles side by side hold rows m0 .. m0 + 2 tm in order, partition by partition: `flush` stores a
        slice of their partitions by one DMA, a rectangle of rows (`pair_store`)."""
        em, plan = self.em, self.plan
        mt, nt = self.tm, min(self.tn, plan.n - n0)
        acc = self.psum.next().ap(mt, nt)
        for j in range(self.k_tiles):
            em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary.k_tile(j), moving.k_tile(j), accumulate=j > 0)
        job = _Job({0: acc}, [pool.next() for pool in self.temps], self.result.next(), (mt, nt),
                   self.out[g, m0 + parity:m0 + parity + 2 * mt:2, n0:n0 + nt].ap, m0, n0)
        if parity:
            self.partners[id(self.waiting[-1])] = (job, self.out[g, m0:m0 + 2 * mt, n0:n0 + nt])
        self.waiting.append(job)
        if self.early:
            self.unstarted.append(job)
        if len(self.waiting) >= self.plan.epilogue_group + self.kept:
            self.flush(keep=self.kept)

    def flush(self, keep: int = 0, last: bool = False) -> None:
        """The epilogues of the waiting tiles but the last `keep`, step by step across the tiles (independent
        chains side by side on the engines, not one chain at a time), then their stores. The `last` tile of
        the kernel is stored by rows over half the queues (the other half may still hold the store before it):
        nothing comes after it to share them with."""
        em = self.em
        jobs = self.waiting[:len(self.waiting) - keep]
        del self.waiting[:len(jobs)]
        # the early steps of all the tiles in flight at once (the GELU backward's derivative of 4 tiles: erf and exp
        # tables loaded once for the 4, 4 independent chains x * x -> exp -> multiply -> add side by side on the
        # in-order engines), else of the flushed tiles only (none once the batches are under way)
        batch = len(self.unstarted) >= 2 * self.plan.epilogue_group or last
        self.start(list(self.unstarted) if batch else [job for job in self.unstarted if job in jobs])
        rest = [j for j in range(len(self.plan.epilogue)) if j not in self.early]
        outs = _emit_bodies(self.plan.epilogue, self.slots, jobs, self.constants, self.loc, self.engines,
                            self.plan.bias_column, rest, self.plan.stored_step)
        # a kernel whose stores are its main traffic (MatmulPlan.stores_main: the weight gradients) stores each tile
        # over half the queues, as its last one: each tile's store ends sooner. Others keep the default slices
        # (Part 34: the Llama layer's projections, k 2048-5632, lose 22 us with it; Part 36: GPT-2's LM head, k 768
        # over 512 tokens, 87 us)
        spread = em.target.dma_queues // 2 if self.plan.stores_main else None
        for job in jobs:  # the stored step's tiles (made before the results): a second output
            if job.second is not None:
                dma_by_rows(em, job.second, job.done[self.plan.stored_step], spread)
        stored: set = set()
        for i, (job, out) in enumerate(zip(jobs, outs)):  # by rows over several queues: a short store, its rows'
            if job.store is None or id(job) in stored:  # own pages
                continue
            pair = self.partners.pop(id(job), None)
            if pair is not None and i + 1 < len(jobs) and jobs[i + 1] is pair[0]:  # a row pair: one store
                stored.add(id(pair[0]))
                dst, src = self.pair_store(pair[1], out, outs[i + 1])
                if dst is not None:
                    dma_by_rows(em, dst, src, em.target.dma_queues // 2 if last and pair[0] is jobs[-1] else spread)
                    continue
                dma_by_rows(em, job.store, out, spread)
                job, out = pair[0], outs[i + 1]
            dma_by_rows(em, job.store, out, em.target.dma_queues // 2 if last and job is jobs[-1] else spread)
        if self.plan.c_sums:
            for job, out in zip(jobs, outs):
                self.sum_rows(job, out)
        for job in jobs:
            if self.after_tile is not None:
                self.after_tile(job.m0)

    @staticmethod
    def pair_store(rows: HbmTensor, first: AccessPattern, second: AccessPattern) -> tuple:
        """(HBM rows [2 tm, nt] as [tm, 2, nt], the pair's two result tiles as [tm, 2, nt]) for one store of a row
        pair; (None, None) when the second tile's slot does not lie after the first's at a whole element."""
        step = second.offset - first.offset
        if step <= 0 or step % first.dtype.itemsize:
            return None, None
        (stride, count), *rest = rows.dims
        dst = AccessPattern(Space.HBM, rows.dtype, int(rows.offset), ((2 * stride, count // 2), (stride, 2), *rest))
        return dst, dataclasses.replace(first, dims=(first.dims[0], (step // first.dtype.itemsize, 2), *first.dims[1:]))

    def start(self, jobs: list) -> None:
        """The early steps of `jobs` (those not reading the accumulator: the GELU backward's derivative of its
        saved input): emitted with the tiles' matmuls, so the engines compute them while earlier tiles'
        epilogues wait for their inputs, and only the accumulator's steps are left for the flush."""
        jobs = [job for job in jobs if not job.order]
        for job in jobs:
            self.unstarted.remove(job)
        if jobs:
            _emit_bodies(self.plan.epilogue, self.slots, jobs, self.constants, self.loc, self.engines,
                         self.plan.bias_column, self.early, self.plan.stored_step)

    # the walk over the strips ---------------------------------------------------------------------------
    def emit(self) -> None:
        """The whole kernel: both operands streamed tile by tile, or the strips walked as the tiling says."""
        if self.plan.tiling.resident == "none":
            self.emit_streamed()
        else:
            self.run(self.strip_walk(), {})

    def emit_streamed(self) -> None:
        plan, tm, tn = self.plan, self.tm, self.tn
        group = self.batches_per_tile()
        if group > 1:
            for g0 in range(0, plan.batch, group):
                self.side_by_side(g0, min(group, plan.batch - g0))
            self.flush(last=True)
            return
        for g in range(plan.batch):
            for m0 in range(0, plan.m, tm):
                for n0 in range(0, plan.n, tn):
                    self.output_tile(g, m0, n0,
                                     _Streamed(self, self.strips["a"], self.a_t[g, :, m0:m0 + min(tm, plan.m - m0)]),
                                     _Streamed(self, self.strips["b"], self.b[g, :, n0:n0 + min(tn, plan.n - n0)]))
        self.flush(last=True)

    def batches_per_tile(self) -> int:
        """How many batches share an output tile, side by side (`side_by_side`): as many whole [m, n] results as
        the tile's [tile_m, tile_n] holds, leaving at least SIDE_BY_SIDE_TILES tiles; 1 when that is fewer than 2.
        A batched matmul of small results (the MoE model's per-slot [1, 64]) otherwise makes an epilogue and a store
        per batch, each an instruction on a few elements. Not with a bias row or column (added tile by tile), a
        caller's operand or result tile, or a prologue making A."""
        plan = self.plan
        if (plan.bias_row is not None or plan.bias_column is not None or self.sink is not None
                or self.a_resident is not None or self.b_resident is not None or self.before_tile is not None
                or plan.m > self.tm or plan.n > self.tn):
            return 1
        return max(1, min(plan.batch // SIDE_BY_SIDE_TILES, self.tm // plan.m, self.tn // plan.n))

    def side_by_side(self, g0: int, count: int) -> None:
        """Batches g0 .. g0 + count - 1 in one output tile [m, count x n], batch g0 + i's result at columns i x n:
        each K tile of their A^T and B loaded by one DMA each ([K tile, count x m] and [K tile, count x n], batch i
        at columns i x m and i x n), each batch's matmuls into its own columns, then one epilogue and one store for
        all of them. Each result element is made by the same matmuls and epilogue steps as with a tile per batch."""
        em, plan, tk = self.em, self.plan, self.tk
        m, n = plan.m, plan.n
        acc = self.psum.next().ap(m, count * n)
        for j in range(self.k_tiles):
            rows = min(tk, plan.k - j * tk)
            a = self.strips["a"].next().ap(rows, count * m)
            em.dma(a, self.a_t[g0:g0 + count, j * tk:j * tk + rows].permute(1, 0, 2).ap)
            b = self.strips["b"].next().ap(rows, count * n)
            em.dma(b, self.b[g0:g0 + count, j * tk:j * tk + rows].permute(1, 0, 2).ap)
            for i in range(count):
                em.emit(Opcode.MATMUL, Engine.TENSOR, tile_at(acc, i * n, m, n), tile_at(a, i * m, rows, m),
                        tile_at(b, i * n, rows, n), accumulate=j > 0)
        self.output_tile(g0, 0, 0, None, None, acc=acc, batches=count)

    def strip_walk(self, first_column: int = 0) -> list:
        """The strip loads in order of use (_Loads), each with the output tiles it completes (columns from
        `first_column` on)."""
        plan, tm, tn = self.plan, self.tm, self.tn
        block = plan.tiling.block
        steps: list = []
        for g in range(plan.batch):
            if plan.tiling.resident == "a":
                for mb in range(0, plan.m, block * tm):
                    steps.append(_Load(functools.partial(self.a_strip, g, mb, block * tm), []))
                    a_load = len(steps) - 1
                    for n0 in range(first_column, plan.n, tn):
                        steps.append(_Load(functools.partial(self.b_strip, g, n0, tn), []))
                        steps[-1].tiles.extend(_OutputTile(g, m0, n0, a_load, m0 - mb, len(steps) - 1, 0)
                                               for m0 in range(mb, min(plan.m, mb + block * tm), tm))
            else:
                for nb in range(first_column, plan.n, block * tn):
                    steps.append(_Load(functools.partial(self.b_strip, g, nb, block * tn), []))
                    b_load = len(steps) - 1
                    for m0 in range(0, plan.m, tm):
                        steps.append(_Load(functools.partial(self.a_strip, g, m0, tm), []))
                        steps[-1].tiles.extend(_OutputTile(g, m0, n0, len(steps) - 1, 0, b_load, n0 - nb)
                                               for n0 in range(nb, min(plan.n, nb + block * tn), tn))
        if plan.tiling.streamed_first and self.a_resident is None and len(steps) > 1:
            return _streamed_first(steps)
        return steps

    def run(self, steps: list, loaded: dict) -> None:
        """Every strip load issued `stream_bufs - 1` steps ahead (before the previous steps' tiles and their
        stores), so it overlaps their compute; `loaded`: the strips loaded already, by step."""
        if self.lead is not None:
            accumulated = self.lead_tiles(steps, loaded)
        elif self.plan.a_by_k_tile and self.a_resident is None and self.before_tile is None:
            accumulated = self.k_tile_lead(steps, loaded)
        else:
            accumulated = {}
        for i, step in enumerate(steps):
            for j in range(len(loaded), min(len(steps), i + self.plan.tiling.stream_bufs)):
                loaded[j] = steps[j].load()
            paired = None
            for t, tile in enumerate(step.tiles):
                if self.plan.a_sums and tile.a_load not in self.summed:  # with its strip's first output tile
                    self.summed.add(tile.a_load)
                    self.sum_strip(loaded[tile.a_load], tile.m0 - tile.a_col)
                if tile is paired:
                    continue
                if self.paired and not accumulated and t + 1 < len(step.tiles) \
                        and self.pairs(tile, step.tiles[t + 1]):  # this tile and the next as a row pair
                    paired = step.tiles[t + 1]
                    ops = self.operands(tile, loaded)
                    for parity in (0, 1):
                        self.output_tile_of_pair(tile.g, tile.m0, tile.n0, dataclasses.replace(
                            ops.stationary, col=ops.stationary.col + parity, step=2), ops.moving, parity)
                    continue
                if tile in accumulated:
                    ops = self.operands(tile, loaded)
                    self.output_tile(tile.g, tile.m0, tile.n0, None, None, acc=accumulated[tile], row=ops.row,
                                     column=ops.column)
                    continue
                if self.before_tile is not None:
                    self.before_tile(tile.m0)
                ops = self.operands(tile, loaded)
                self.output_tile(tile.g, tile.m0, tile.n0, ops.stationary, ops.moving, row=ops.row, column=ops.column)
        self.flush(last=True)

    def pairs(self, tile: _OutputTile, after: _OutputTile) -> bool:
        """Whether `tile` and `after`, the next output tile of a step, make a row pair (`output_tile_of_pair`):
        whole row tiles one above the other, in the same strips."""
        tm = self.tm
        return (after.g, after.n0, after.a_load, after.b_load) == (tile.g, tile.n0, tile.a_load, tile.b_load) \
            and after.m0 == tile.m0 + tm and after.a_col == tile.a_col + tm and tile.m0 + 2 * tm <= self.plan.m

    def lead_tiles(self, steps: list, loaded: dict) -> dict:
        """The first output tiles (one per bank of the lead's pool, their strips within the loads kept ahead)
        accumulated a block of B's columns at a time, `make_columns(n0)` called before the matmuls reading
        B's columns from n0: a chain's prologue makes B = x^T a row tile of the norm at a time, and the Tensor
        engine multiplies each one while the norm's next ones are made, instead of waiting for all of them.
        Each accumulator element sums the same K tiles in the same order as one matmul over all columns would
        (the same bits). Returns {output tile: its accumulator}; their epilogues are for `run`."""
        pool, make_columns = self.lead
        accs = self.first_tiles(steps, loaded, pool, pool.bufs)
        block = self.em.target.partitions
        for n0 in range(0, self.plan.n, block):
            make_columns(n0)
            for tile in accs:
                ops = self.operands(tile, loaded)
                col = n0 - tile.n0  # the block's first column in this tile, if it has it
                if not 0 <= col < ops.moving.size:
                    continue
                width = min(block, ops.moving.size - col)
                moving = dataclasses.replace(ops.moving, col=ops.moving.col + col, size=width)
                for j in range(self.k_tiles):
                    self.em.emit(Opcode.MATMUL, Engine.TENSOR, column_slice(accs[tile], col, col + width),
                                 ops.stationary.k_tile(j), moving.k_tile(j), accumulate=j > 0)
        return accs

    def first_tiles(self, steps: list, loaded: dict, pool: Pool, count: int) -> dict:
        """{output tile: an accumulator from `pool`} of the first `count` output tiles whose strips are within the
        loads kept ahead (`stream_bufs` steps), those strips loaded (into `loaded`)."""
        tiles = [(i, tile) for i, step in enumerate(steps) for tile in step.tiles]
        tiles = [(i, tile) for i, tile in tiles if i < self.plan.tiling.stream_bufs][:count]
        for j in range(len(loaded), max((i for i, _ in tiles), default=-1) + 1):
            loaded[j] = steps[j].load()
        return {tile: pool.next().ap(min(self.tm, self.plan.m - tile.m0), min(self.tn, self.plan.n - tile.n0))
                for _, tile in tiles}

    def k_tile_lead(self, steps: list, loaded: dict) -> dict:
        """The first K_TILE_LEAD output tiles accumulated K tile by K tile, each K tile's matmuls for all of them
        before the next K tile's, when A^T loads one DMA per K tile (MatmulPlan.a_by_k_tile: its producer, an
        attention or a matmul, writes it column block by column block). Its producer's last columns, the last
        K tile, arrive last: the Tensor engine multiplies the K tiles already in for several tiles instead of
        one, and only the last K tile's matmuls are left when it lands. Each accumulator element sums the same K
        tiles in the same order as `output_tile` would (the same bits). Returns {output tile: its accumulator};
        their epilogues are for `run`."""
        accs = self.first_tiles(steps, loaded, self.psum, K_TILE_LEAD)
        for j in range(self.k_tiles):
            for tile, acc in accs.items():
                ops = self.operands(tile, loaded)
                self.em.emit(Opcode.MATMUL, Engine.TENSOR, acc, ops.stationary.k_tile(j), ops.moving.k_tile(j),
                             accumulate=j > 0)
        return accs

    def operands(self, tile: _OutputTile, loaded: dict) -> _Operands:
        """An output tile's operands and bias parts, from the loaded strips."""
        mt, nt = min(self.tm, self.plan.m - tile.m0), min(self.tn, self.plan.n - tile.n0)
        a_strip, b_strip = loaded[tile.a_load], loaded[tile.b_load]
        return _Operands(stationary=self.columns(a_strip, tile.a_col, mt), moving=self.columns(b_strip, tile.b_col, nt),
                         row=b_strip.bias and tile_at(b_strip.bias, tile.b_col, 1, nt),
                         column=a_strip.bias and tile_at(a_strip.bias, tile.a_col // self.tm, mt, 1))

    def early_column(self, early_psum: Pool, lead_part: int) -> "_EarlyColumn":
        """A chain's second matmul, emitted in parts while the first makes A^T (nothing emitted yet but the
        first column's bias row): its first column of output tiles takes its accumulators from `early_psum`."""
        return _EarlyColumn(self, early_psum, lead_part)


class _EarlyColumn:
    """A chain's second matmul in parts, interleaved with the making of its A^T by the first (see `_chain`)."""

    def __init__(self, kernel: _Matmul, early_psum: Pool, lead_part: int):
        plan, self.kernel, self.lead_part = kernel.plan, kernel, lead_part
        width = self.width = min(kernel.tn, plan.n)
        self.strip = _Strip(kernel.strips["b"].next().ap(kernel.tk, kernel.k_tiles * width), width,  # a K tile at a
                            kernel.bias_row_of(0, 0, width) if plan.bias_row is not None else None)  # time; bias now
        self.accs = [(m0, early_psum.next().ap(min(kernel.tm, plan.m - m0), width)) for m0 in range(0, plan.m, kernel.tm)]
        self.steps, self.loaded = kernel.strip_walk(first_column=kernel.tn), {}

    def load_k(self, j: int) -> None:
        """Load K tile j of the first output column's B strip."""
        kernel = self.kernel
        rows = min(kernel.tk, kernel.plan.k - j * kernel.tk)
        dma_by_rows(kernel.em, tile_at(self.strip.tile, j * self.width, rows, self.width),
                    kernel.b[0, j * kernel.tk:j * kernel.tk + rows, 0:self.width].ap)

    def accumulate_k(self, j: int) -> None:
        """The first column's matmuls of K tile j, once A^T's K tile j is made."""
        kernel, plan = self.kernel, self.kernel.plan
        for m0, acc in self.accs:
            stationary = kernel.columns(_Strip(kernel.a_resident, plan.m), m0, min(kernel.tm, plan.m - m0))
            moving = kernel.columns(self.strip, 0, min(kernel.tn, plan.n))
            kernel.em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary.k_tile(j), moving.k_tile(j), accumulate=j > 0)

    def finish(self, pending: list) -> None:
        """The rest, once the first matmul's matmuls are emitted, `pending` its K tiles whose early matmuls are not
        (the last made: their epilogues end last). The next strip's output tiles first accumulate a part of the
        other K tiles, so the Tensor engine has work while those epilogues finish; then the early column is
        finished, then those tiles one by one (each one's epilogue beside the next one's matmuls), then the rest."""
        kernel, steps, loaded = self.kernel, self.steps, self.loaded
        k_tiles = kernel.k_tiles
        head = next((i for i, step in enumerate(steps) if step.tiles), None)
        ahead = []  # (output tile, its accumulator, its operands)
        if head is not None and pending:
            for j in range(len(loaded), head + 1):
                loaded[j] = steps[j].load()
            ahead = [(tile, kernel.psum.next().ap(min(kernel.tm, kernel.plan.m - tile.m0),
                                                  min(kernel.tn, kernel.plan.n - tile.n0)), kernel.operands(tile, loaded))
                     for tile in steps[head].tiles]
            steps[head] = dataclasses.replace(steps[head], tiles=[])
        order = [j for j in range(k_tiles) if j not in pending] + list(pending)
        lead = -(-(k_tiles - len(pending)) // self.lead_part)

        def accumulate(acc: AccessPattern, ops: _Operands, part) -> None:
            for index in part:
                j = order[index]
                kernel.em.emit(Opcode.MATMUL, Engine.TENSOR, acc, ops.stationary.k_tile(j), ops.moving.k_tile(j),
                               accumulate=index > 0)

        for index in range(lead):
            for _, acc, ops in ahead:
                accumulate(acc, ops, [index])
        for j in pending:
            self.accumulate_k(j)
        for m0, acc in self.accs:
            kernel.output_tile(0, m0, 0, None, None, acc=acc, row=self.strip.bias)
        for tile, acc, ops in ahead:
            accumulate(acc, ops, range(lead, k_tiles))
            kernel.output_tile(tile.g, tile.m0, tile.n0, None, None, acc=acc, row=ops.row, column=ops.column)
        kernel.run(steps, loaded)


# Batches side by side leave at least this many output tiles, so that a tile's epilogue and store still run beside
# the next one's matmuls. Measured (trn2, -O2, estimated us): two batches in one tile, the attention-score matmuls
# of the zoo's bert / llama / vit ([2, 16, 32], [2, 32, 64], [2, 17, 32]), 104.5 -> 108.2, 194.5 -> 205.8 and
# 101.8 -> 108.3; with 4, those stay a tile per batch and moe ([32, 1, 64] and [32, 1, 32], 8 batches a tile)
# 252.7 -> 214.5, mamba ([64, 38, 1], 3 a tile) 298.6 -> 279.3.
SIDE_BY_SIDE_TILES = 4


def last_part_k_tiles(k_tiles: int, bytes_per_k_tile: int, target: Target) -> int:
    """How many of a strip's K tiles its second part holds (MatmulPlan.in_two_parts): a third, rounded up, and at
    least those whose slices, one per queue, keep half the efficient payload a partition (2 KiB on trn2: the
    payload curve's near-peak part, targets.py); at most all but one. The first output tile's first matmuls run
    on the first part while the second moves: a smaller second part lands sooner after the first, a larger first
    part lands later. Measured (trn2, bf16, us), parts of the GPT-2 MLP's / block's x^T (6 K tiles, 1 KiB a
    partition each): 3 + 3 71.51 / 181.90, **4 + 2** 71.35 / 181.53, 5 + 1 71.86 / 182.09, 2 + 4 71.73 / 182.33;
    of the SwiGLU MLP's (16 K tiles): 8 + 8 520.16, **10 + 6** 519.73, 11 + 5 519.52, 12 + 4 523.20, 14 + 2 524.0
    (no simple rule found the 11 + 5 without losing elsewhere)."""
    payload = -(-(target.dma_efficient_bytes_per_partition // 2) // bytes_per_k_tile)
    return max(1, min(k_tiles - 1, max(-(-k_tiles // 3), payload)))


def _streamed_first(steps: list) -> list:
    """The steps with the first streamed strip loaded before the first resident one: its output tiles move to
    the resident strip's step (the later of their two loads), the step numbers they name swapped."""
    swap = {0: 1, 1: 0}
    steps = [_Load(steps[1].load, []), _Load(steps[0].load, steps[1].tiles), *steps[2:]]
    return [_Load(step.load, [dataclasses.replace(tile, a_load=swap.get(tile.a_load, tile.a_load),
                                                  b_load=swap.get(tile.b_load, tile.b_load)) for tile in step.tiles])
            for step in steps]


def early_steps(body: tuple, slots: list) -> list:
    """The steps of an epilogue that read no accumulator (input 0), directly or through other steps, when
    there are some and computing them first keeps every temporary slot's value until its last reader
    (`slots` are allocated in body order); else none."""
    late: set = set()
    for j, step in enumerate(body):
        if any((kind == "input" and ref == 0) or (kind == "step" and ref in late) for kind, ref in step.args):
            late.add(j)
    early = [j for j in range(len(body)) if j not in late]
    return early if early and slots_hold(early + sorted(late), step_reads(body), slots) else []


def _emit_bodies(body: tuple, slots: list, jobs: list, constants: Pool, loc, engines: StepBalancer,
                 bias_column: int | None = None, steps: list | None = None, kept: int | None = None) -> list:
    """`emit_body` for several tiles (_Jobs) at once, each step for every tile before the next step: `steps`
    (all by default; each job keeps the results of those emitted before). Returns each job's result AP. Each
    step goes to the engine that would finish it first, after the steps it reads (`StepBalancer`), in the order
    `table_order` gives. With `bias_column`, the first step (the accumulator rounded to its dtype) adds that
    input's per-partition values on its way, in one Scalar pass. Step `kept` is written to its own tile (it is
    stored too), never computed inside its reader's instruction."""
    steps = list(range(len(body))) if steps is None else steps
    fused = {m: pair for m, pair in (scaled_products(body) if engines.columns is not None else {}).items()
             if m in steps and pair[0] in steps and pair[0] != kept}  # a multiply and its reader emitted together
    emitted = [job.order for job in jobs]  # the same steps for every job, maybe in other orders
    later = [j for j in range(len(body)) if j not in steps and j not in emitted[0]]
    for index in table_order(body, slots, engines.loaded_table(), steps, emitted, later):
        step, slot = body[index], slots[index]
        if any(j == index for j, _ in fused.values()):  # computed by its one reader's TENSOR_ALU2
            for job in jobs:
                job.order.append(index)
            continue
        step = fused[index][1] if index in fused else step
        for job in jobs:
            done, times = job.done, job.made
            out = job.out.ap(*job.shape) if slot is None else job.temps[slot].ap(*job.shape, dtype=step.dtype)
            args = [job.loaded[ref] if kind == "input" else done[ref] if kind == "step" else float(ref)
                    for kind, ref in step.args]
            ready = max([times[ref] for kind, ref in step.args if kind == "step"], default=0.0)
            if index == 0 and bias_column is not None:  # acc + bias in fp32, rounded once: the ADD's sum
                engines.em.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, out, job.loaded["row_sum"], args[0],
                                job.loaded[bias_column], func=ActFunc.IDENTITY, imm0=1.0)
                times[index] = engines.account(engines.em.instructions[-1:], ready)
            else:
                times[index] = engines.compute(step, out, args, constants, loc, ready)
            done[index] = out
            job.order.append(index)
    return [job.done.get(len(body) - 1) for job in jobs]
