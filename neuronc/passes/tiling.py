"""Tiling: the tile sizes and loop order of every matmul, chosen by pricing candidates with the cost model.

A matmul C[b] = A[b] @ B[b] is computed in output tiles of [tile_m <= 128, tile_n <= one PSUM bank],
accumulating over K tiles of 128. What costs time besides the Tensor engine is moving operands: each
operand tile is a DMA with a fixed issue cost, and the same tile may be loaded many times. A tiling keeps
one operand's strip resident in SBUF — all K tiles of `block` columns of B ("b") or `block` rows of A
("a"), loaded by a few large DMAs spread over the queues — while the other operand streams through it
strip by strip, double (or more) buffered so the next strip loads while this one is multiplied. With
resident "none" both operands stream tile by tile (the baseline, -O0/-O1).

`tile_matmuls` (-O2) tries every resident choice with blocks of 1, 2, 4... output tiles up to the whole
operand, within the SBUF left after the epilogue's tiles; `search_matmul_tiles` (-O3) also tries narrower
N tiles and deeper buffering. The price of a candidate is its kernel emitted alone and timed on the emulator's
clock (`PassContext.kernel_time`, neuronc.kernel_timing: exactly the time codegen's instructions take); the
formula `cost_model.matmul_ns` orders the candidates for that and stands in when no compiler is around. The decision is the node's
attrs["tiling"] (a `MatmulTiling`) and its kernel plan attrs["plan"] (a `MatmulPlan`, or a `ChainPlan` for a
chain: neuronc/plans.py), which codegen follows, deciding nothing.

Chains (passes/matmul_chain.py) are tiled here too: `Chain` and `stages` say how a chained node holds its two
matmuls, and the chain's pricing lives beside the single matmul's.
"""
from __future__ import annotations

import dataclasses
import pickle

from neuronc import ir, ir_text
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.locs_apart import LocsApart, located_nowhere
from neuronc.passes.context import PassContext
from neuronc.passes.cost_model import SBUF_PAGE_BYTES, Servers, cheapest, matmul_ns, strip_ns
from neuronc.passes.kernel_plans import assign_slots, plan_kernels
from neuronc.passes.rowwise_plan import rowwise_sbuf_bytes
from neuronc.plans import CONSTANT_COLUMNS, ChainPlan, MatmulPlan, MatmulTiling, ProloguePlan, View, pool_specs
from neuronc.targets import Target


def _pages(elements: int, dtype: DType) -> int:
    """Bytes per partition of a tile slot of `elements`, rounded up to the placement page."""
    return -(-elements * dtype.itemsize // SBUF_PAGE_BYTES) * SBUF_PAGE_BYTES


EPILOGUE_BUFS = 4  # output tiles whose epilogues may be in flight at once (spread over three engines)
EPILOGUE_GROUP = 2  # output tiles whose epilogues the kernel emits side by side
CHAIN_LAG = 2  # a chain's first-matmul tiles between the making of a K tile and the second's matmuls reading it
CHAIN_LEAD_PART = 4  # the part of its K tiles the next strip's tiles accumulate while the first's last epilogues run


def epilogue_pools(node: ir.Node, tile_n: int) -> dict:
    """name -> (dtype, elements, buffers) of the matmul kernel's output-side pools: the result tile, the
    epilogue's other inputs and temporaries, constants. The kernel allocates exactly these."""
    body = node.attrs.get("epilogue") or (ir.Step(Op.CONVERT, (("input", 0),), node.dtype, {}),)
    temps = len(body) - 1  # at most one per step but the last (the kernel's slot plan may use fewer)
    bufs = EPILOGUE_BUFS
    pools = {"result": (node.dtype, tile_n, bufs), "constants": (DType.F32, tile_n * 2, 2)}
    pools.update({f"extra{i}": (x.dtype, tile_n, bufs) for i, x in enumerate(node.inputs[2:])})
    row = node.attrs.get("bias_row")
    if row is not None:  # a bias row added in PSUM by a [1, M] row of ones (the row travels with B's strips)
        del pools[f"extra{row - 1}"]
        pools["ones"] = (node.inputs[1 + row].dtype, max(tile_n, 128), 1)
    column = node.attrs.get("bias_column")
    if column is not None:  # one value per row (travelling with A's strips), widened to fp32; the row sums
        del pools[f"extra{column - 1}"]
        pools.update(bias=(DType.F32, 1, bufs), row_sum=(DType.F32, 1, bufs))
    if any("bias" in step.attrs for step in body):  # a biased multiply's constants, for the Vector and GpSimd engines
        pools["columns"] = (DType.F32, CONSTANT_COLUMNS, 1)
    widest = max(step.dtype.itemsize for step in body)  # a temporary holds one step's values
    pools.update({f"temp{i}": (DType.F32, -(-tile_n * widest // DType.F32.itemsize), bufs) for i in range(temps)})
    return pools


def operand_pools(node: ir.Node, tiling: MatmulTiling) -> dict:
    """name -> (dtype, elements, buffers) of the operand strips: "a" holds [K tile, k tiles x rows], "b"
    [K tile, k tiles x columns]; the resident one double buffered (the next strip loads meanwhile). A bias
    row travels with B's strips ("bias_row": [1, columns]), a bias column with A's ("bias_column": [M tile,
    row tiles]), so that it is loaded with the strip it is added to, not queued behind later strips."""
    a, b = node.inputs[:2]
    k_tiles = -(-node.attrs["k"] // tiling.tile_k)
    if tiling.resident == "a":
        rows, columns, a_bufs, b_bufs = tiling.block, 1, 2, tiling.stream_bufs
    elif tiling.resident == "b":
        rows, columns, a_bufs, b_bufs = 1, tiling.block, tiling.stream_bufs, 2
    else:  # tile by tile: a K tile of each operand, a bias per output tile
        rows, columns, a_bufs, b_bufs = 1, 1, tiling.stream_bufs, tiling.stream_bufs
        k_tiles = 1
    pools = {"a": (a.dtype, k_tiles * rows * tiling.tile_m, a_bufs),
             "b": (b.dtype, k_tiles * columns * tiling.tile_n, b_bufs)}
    row, column = node.attrs.get("bias_row"), node.attrs.get("bias_column")
    if row is not None:
        pools["bias_row"] = (node.inputs[1 + row].dtype, columns * tiling.tile_n, b_bufs)
    if column is not None:
        pools["bias_column"] = (node.inputs[1 + column].dtype, rows, a_bufs)
    return pools


def sbuf_bytes(pools: dict) -> int:
    return sum(_pages(n, dtype) * bufs for dtype, n, bufs in pools.values())


def fits(node: ir.Node, tiling: MatmulTiling, target: Target) -> bool:
    used = sbuf_bytes(operand_pools(node, tiling)) + sbuf_bytes(epilogue_pools(node, tiling.tile_n))
    return used <= target.sbuf_bytes_per_partition


def default_tiling(node: ir.Node, target: Target) -> MatmulTiling:
    """The baseline: the largest tiles the Tensor engine takes, both operands streamed tile by tile."""
    return MatmulTiling("none", 1, target.matmul_max_m, _max_tile_n(target), target.matmul_max_k, 3)


def _max_tile_n(target: Target) -> int:
    return min(target.matmul_max_n, target.psum_bank_bytes // DType.F32.itemsize)


@ir_text.register  # printed in the node's text: codegen.reuse keys each layer's chained matmul kernel by it
@dataclasses.dataclass(frozen=True)
class Chain:
    """attrs["chain"] of a chained MATMUL node (passes/matmul_chain.py)."""

    split: int  # the first matmul's inputs are the node's inputs[:split]
    shape: tuple  # the first matmul's result, transposed: [1, N1, M]
    dtype: object
    attrs: dict  # the first matmul's attributes (views of its swapped operands, epilogue, bias column, tiling)
    loc: object  # the first matmul's source location

    def __hash__(self) -> int:
        return hash((self.split, self.shape))


def stages(node: ir.Node) -> tuple:
    """(first, second): the two matmuls of a chained node, the second reading the first's result as A."""
    chain = node.attrs["chain"]
    first = ir.node(Op.MATMUL, list(node.inputs[:chain.split]), chain.shape, chain.dtype, chain.loc, **chain.attrs)
    attrs = {key: value for key, value in node.attrs.items() if key != "chain"}
    second = ir.node(Op.MATMUL, [first, *node.inputs[chain.split:]], node.shape, node.dtype, node.loc, **attrs)
    return first, second


def _is_weight(x: ir.Node) -> bool:
    """Whether an operand is in HBM before the program runs (a weight or a constant, through reshapes)."""
    while x.op is Op.RESHAPE:
        x = x.inputs[0]
    return x.op is Op.CONSTANT or (x.op is Op.PARAMETER and x.attrs.get("kind") == "weight")


def streamed_first(node: ir.Node, resident: str) -> bool:
    """Whether the first strip of the streamed operand should load before the resident one: when it is a
    weight and the resident operand is not, it loads while the kernel before (that makes the resident
    operand) finishes, and the first output tile waits for one strip less."""
    a, b = node.inputs[:2]
    streamed, kept = (b, a) if resident == "a" else (a, b)
    return resident != "none" and _is_weight(streamed) and not _is_weight(kept)


def candidates(node: ir.Node, target: Target, wide: bool, deep: bool = False) -> list:
    """The tilings to price: both resident choices with blocks of 1, 2, 4... output tiles, streamed operands double
    or triple buffered (`wide`, -O3: also narrower N tiles and 4 buffers; `deep`: 4 buffers too, for a chain's
    first matmul, whose streamed strips are one output tile's K tiles each, about as long to load, with a DMA's
    fixed cost, as to multiply, on queues it shares with the second's early column: the formula picks 4 on the
    GPT-2 MLP, 72.3 us priced against 73.7 with 3)."""
    batch, m, n = node.shape
    tile_ns = [_max_tile_n(target)] + ([256, 128] if wide else [])
    bufs = [2, 3] + ([4] if wide or deep else [])
    found = []
    for tile_n in tile_ns:
        tm, tk = target.matmul_max_m, target.matmul_max_k
        for stream_bufs in bufs:
            found.append(MatmulTiling("none", 1, tm, tile_n, tk, stream_bufs))
            for resident, tiles in (("a", -(-m // tm)), ("b", -(-n // tile_n))):
                block = 1
                while True:
                    found.append(MatmulTiling(resident, min(block, tiles), tm, tile_n, tk, stream_bufs,
                                              streamed_first(node, resident)))
                    if block >= tiles:
                        break
                    block *= 2
    found += [dataclasses.replace(t, transposes=which) for t in found if t.resident != "none"
              for which in _transpose_options(node, target) if all(_whole_pages(node, t, c) for c in which)]
    return [t for t in dict.fromkeys(found) if fits(node, t, target)]


def transposable(node: ir.Node, operand: str, target: Target) -> bool:
    """Whether the strips of `operand` ("a": A^T [K, M], "b": B [K, N]) may load as DMA transposes
    (MatmulTiling.transposes): read across the operand's rows (a strided load otherwise), each K tile's elements
    contiguous in HBM, a 2-byte type, and widths of whole [128, 16] units on a target that has them."""
    views = node.attrs.get("views") or (None, None)
    x, view = (node.inputs[0], views[0]) if operand == "a" else (node.inputs[1], views[1])
    batch, m, n = node.shape
    k = node.attrs["k"]
    strides = view[1] if view else ((m * k, k, 1) if operand == "a" else (k * n, n, 1))
    k_stride = strides[2] if operand == "a" else strides[1]
    width = m if operand == "a" else n
    return (target.dma_transpose_hbm_fraction > 0 and x.dtype.itemsize == 2 and k_stride == 1
            and not _contiguous(node)[operand == "b"] and width % target.dma_transpose_inner == 0
            and k >= target.matmul_max_k)


def _whole_pages(node: ir.Node, tiling: MatmulTiling, operand: str) -> bool:
    """Whether every strip of `operand` under `tiling` is whole SBUF pages wide per K tile: DMA transposes of K
    tiles sharing a page wait for each other (the sync pass tracks SBUF by pages), one queue at a time."""
    _, m, n = node.shape
    extent, tile = (m, tiling.tile_m) if operand == "a" else (n, tiling.tile_n)
    width = tiling.block * tile if tiling.resident == operand else tile
    page = SBUF_PAGE_BYTES // node.inputs[operand == "b"].dtype.itemsize
    return all(min(width, extent - r0) % page == 0 for r0 in range(0, extent, width))


def _transpose_options(node: ir.Node, target: Target) -> list:
    """The non-empty sets of operands whose strips may load as DMA transposes: "a", "b", "ab"."""
    which = "".join(operand for operand in "ab" if transposable(node, operand, target))
    return [w for w in ("a", "b", "ab") if w and all(c in which for c in w)]


def _extras_bytes(node: ir.Node) -> int:
    """Bytes of the epilogue's other inputs per output element (a bias row or column is not a tile)."""
    rows = (node.attrs.get("bias_row"), node.attrs.get("bias_column"))
    return sum(x.dtype.itemsize for i, x in enumerate(node.inputs[2:], start=1) if i not in rows)


def _contiguous(node: ir.Node) -> tuple:
    """Whether the strips of A^T ([K, M]: M along the free axis) and of B ([K, N]) are contiguous reads."""
    views = node.attrs.get("views") or (None, None)
    strides = [view[1] if view else None for view in views[:2]]
    a_rows_stride = strides[0][1] if strides[0] else node.attrs["k"]  # A [B, M, K]: the M stride
    b_cols_stride = strides[1][2] if strides[1] else 1  # B [B, K, N]: the N stride
    return a_rows_stride == 1, b_cols_stride == 1


def loads_a_by_k_tile(node: ir.Node) -> bool:
    """Whether the kernel loads its A^T strips K tile by K tile: when A is read across its rows (a strided read)
    and made by a kernel that writes it column block by column block -- an attention (head after head) or a
    matmul (output strip after strip) -- so its K tiles are ready one after another. Each K tile then waits only
    for the stores that write its columns (the sync pass tracks HBM by column blocks), so the prefetch
    (codegen/schedule.py) and the first matmuls run while the producer's last columns are computed. Other strips
    stay one DMA each, which costs one issue instead of one per K tile. Measured (trn2, bf16): GPT-2-small block /
    12-layer forward 168.2 / 2628.9 us with one DMA per strip, 166.5 / 2607.7 with this for attention outputs;
    the SwiGLU MLP's down projection, reading the up projection's result, 533.7 -> 521.9 us (its first matmul
    21.4 us instead of 51.0 us after the up projection's last); loading every strided A^T strip by K tile
    (inputs included) costs the 4096^3 matmul 1771 -> 1787 us."""
    return not _contiguous(node)[0] and ir.unreshaped(node.inputs[0]).op in (Op.ATTENTION, Op.MATMUL)


def loads_a_once(node: ir.Node, tiling: MatmulTiling) -> bool:
    """Whether the kernel under `tiling` loads A^T as one strip (A resident, its block every row, one batch):
    the only plans whose A^T codegen loads K tile by K tile when `loads_a_by_k_tile`. With several strips, the
    first can overlap the producer's last columns but every later one loads after the producer is done, where
    one DMA per strip costs fewer issues; and a streamed strip is [K, 128 rows], 256 bytes per partition per K
    tile in bf16, far down the DMA payload curve. Measured (trn2, bf16, `benchmarks.roofline`), by K tile for
    every A^T strip -> for the first strip only -> for a single strip only: SwiGLU MLP 521.9 -> 542.3 -> 521.9
    us, Llama layer (its down projection: two A strips of 512 rows) 2219.7 -> 2214.5 -> 2206.0, GPT-2 block
    forward + backward 2122.9 -> 2109.2 -> 2092.5 (the last two as with attention outputs alone). The formula
    (`price`) still charges every A^T strip of a flagged node by K tile; that charge is what keeps the SwiGLU
    down projection on its A-resident plan (525.0 us whole, 521.9 by K tile) rather than the B-resident one the
    uncharged formula prefers (533.7)."""
    batch, m, _ = node.shape
    return tiling.resident == "a" and tiling.block * tiling.tile_m >= m and batch == 1


def loads_in_two_parts(node: ir.Node, tiling: MatmulTiling) -> str:
    """The operand ("a", "b"; "" for none) whose strip the kernel loads as two parts of its K tiles, each cut over
    every DMA queue (codegen/matmul.py `last_part_k_tiles` sizes them): the resident operand when it is one strip
    (its block every row or column, one batch) read across its rows (a strided read at half a queue's rate: x^T
    of the GPT-2 MLP chain's first matmul, B, and of the block's QKV projection, A^T, [768, 512] each, 5.6 us on
    16 queues), unless A^T loads K tile by K tile (`loads_a_by_k_tile`). Loaded whole, the first output tile's
    first matmul waited for all of it; in two parts, it accumulates the first part's K tiles while the second
    moves. Measured (trn2, bf16, `benchmarks.roofline`), GPT-2 MLP / block: 72.1 / 183.0 us whole, 71.9 / 184.6
    by K tile (`dma_by_rows`' 4 slices of 1 KiB a partition), 71.1 / 183.8 by groups of 4 + 2 K tiles on 16 and
    8 queues (the later group on half the queues is the block's tail), 71.5 / 182.5 by halves of B, each over
    every queue, 71.5 / 181.9 by halves of B and of A^T, 71.4 / 181.5 by 4 + 2 K tiles over every queue. `price`
    does not model it (it prices the strip whole)."""
    batch, m, n = node.shape
    if batch != 1 or -(-node.attrs["k"] // tiling.tile_k) < 2:
        return ""
    a_contiguous, b_contiguous = _contiguous(node)
    if tiling.resident == "b" and tiling.block * tiling.tile_n >= n and not b_contiguous and "b" not in tiling.transposes:
        return "b"
    if (loads_a_once(node, tiling) and not a_contiguous and not loads_a_by_k_tile(node)
            and "a" not in tiling.transposes):
        return "a"
    return ""


def price(node: ir.Node, tiling: MatmulTiling, target: Target, servers: Servers | None = None, **chained) -> float:
    """The cost model's estimate of the matmul kernel of `node` under `tiling` (`servers`, `chained`: as part of
    a chain, see `chain_price`)."""
    a, b = node.inputs[:2]
    return matmul_ns(node.shape, node.attrs["k"], a.dtype, b.dtype, node.dtype, _extras_bytes(node),
                     node.attrs.get("epilogue") or (), tiling, target, _contiguous(node),
                     node.attrs.get("bias_row") is not None, node.attrs.get("bias_column") is not None,
                     servers, a_by_k_tile=loads_a_by_k_tile(node), second_bytes=_second_bytes(node), **chained)


def _second_bytes(node: ir.Node) -> int:
    """Bytes per element of the step stored as the kernel's second output (passes/shared_epilogues.py), or 0."""
    stored = node.attrs.get("stored_step")
    return 0 if stored is None else node.attrs["epilogue"][stored].dtype.itemsize


def planned(node: ir.Node, tiling: MatmulTiling) -> ir.Node:
    """`node` tiled by `tiling`, its kernel plan attached (what codegen emits)."""
    return dataclasses.replace(node, attrs={**node.attrs, "tiling": tiling, "plan": matmul_plan(node, tiling)},
                               id=next(ir._ids))


def choose(node: ir.Node, target: Target, wide: bool = False, timed=None) -> MatmulTiling:
    """The candidate of least time (the baseline if none fits): with `timed` (PassContext.kernel_time), each
    candidate's kernel emitted alone and timed on the emulator's clock (`cost_model.cheapest`), else the least
    `price`."""
    options = candidates(node, target, wide)
    if not options:
        return default_tiling(node, target)
    return cheapest(options, lambda t: price(node, t, target),
                    None if timed is None else lambda t: timed(planned(node, t)))


# Chains (passes/matmul_chain.py): the second matmul keeps all of A^T (the first's result) in SBUF and streams
# B's strips through it; the first is tiled in the SBUF left.

def _second_tiling(second: ir.Node, target: Target, stream_bufs: int) -> MatmulTiling:
    tiles = -(-second.shape[1] // target.matmul_max_m)
    return MatmulTiling("a", tiles, target.matmul_max_m, _max_tile_n(target), target.matmul_max_k, stream_bufs)


def _chain_bytes(first: ir.Node, second: ir.Node, first_tiling: MatmulTiling, second_tiling: MatmulTiling) -> int:
    """SBUF bytes per partition of a chain: the kept result, then both matmuls' pools (the second's A not loaded)."""
    _, rows, columns = first.shape
    kept = _pages(-(-rows // second_tiling.tile_k) * columns, first.dtype)
    second_pools = {name: p for name, p in operand_pools(second, second_tiling).items() if name != "a"}
    return (kept + sbuf_bytes(operand_pools(first, first_tiling)) + sbuf_bytes(epilogue_pools(first, first_tiling.tile_n))
            + sbuf_bytes(second_pools) + sbuf_bytes(epilogue_pools(second, second_tiling.tile_n)))


def early_rows(second: ir.Node, target: Target) -> int:
    """How many row tiles of a chain's second matmul codegen accumulates early, K tile by K tile as the first
    matmul makes them (its first column of output tiles, in PSUM banks of their own): all of them when they
    take at most half the banks, else none."""
    rows = -(-second.shape[1] // target.matmul_max_m)
    return rows if rows <= target.psum_banks // 2 else 0


def chain_price(node: ir.Node, first_tiling: MatmulTiling, second_tiling: MatmulTiling, target: Target) -> float:
    """The cost model's estimate of a chained node's kernel: the first matmul (its result kept in SBUF, not
    stored), then the second (A^T not loaded), on the same Tensor engine, epilogue engines and DMA queues.
    With early rows, the second's first column strip (a K tile at a time) is loaded while the first runs (its other
    strips after: codegen/matmul.py `_chain`), and the first has the PSUM banks the early tiles do not take."""
    first, second = stages(node)
    early = early_rows(second, target)
    servers = Servers(target, target.psum_banks - early)
    preloaded, meanwhile = 0, 0.0
    if early:
        b, n, k = second.inputs[1], second.shape[2], second.attrs["k"]
        tn, tk = second_tiling.tile_n, second_tiling.tile_k
        column = strip_ns(tk, tk, min(tn, n), b.dtype.itemsize, _contiguous(second)[1], 0, target)[0]
        preloaded = 1  # the early column's strip
        meanwhile = -(-k // tk) * column
    price(first, first_tiling, target, servers, sink=True, meanwhile_ns=meanwhile)
    return price(second, second_tiling, target, servers, a_kept=True, preloaded=preloaded)


def chain_options(node: ir.Node, target: Target, wide: bool = False) -> list:
    """Every (first's tiling, second's tiling) of a chained node that fits beside the kept result."""
    first, second = stages(node)
    return [(t, _second_tiling(second, target, stream_bufs)) for stream_bufs in (3, 2)
            for t in candidates(first, target, wide, deep=True)
            if _chain_bytes(first, second, t, _second_tiling(second, target, stream_bufs))
            <= target.sbuf_bytes_per_partition]


def chain_planned(node: ir.Node, first_tiling: MatmulTiling, second_tiling: MatmulTiling, target: Target) -> ir.Node:
    """A chained node tiled by its two tilings, its kernel plan attached (what codegen emits)."""
    chain = dataclasses.replace(node.attrs["chain"], attrs={**node.attrs["chain"].attrs, "tiling": first_tiling})
    node = dataclasses.replace(node, attrs={**node.attrs, "chain": chain, "tiling": second_tiling})
    return dataclasses.replace(node, attrs={**node.attrs, "plan": chain_plan(node, first_tiling, second_tiling, target)},
                               id=next(ir._ids))


def chain_tilings(node: ir.Node, target: Target, wide: bool = False, timed=None) -> tuple | None:
    """(first's tiling, second's tiling) of a chained node: the pair of least time for the chain as a whole among
    those that fit, the deeper buffered of equals; None if none fits. With `timed` (PassContext.kernel_time), each
    pair's kernel emitted alone and timed (`cost_model.cheapest`), else the least `chain_price`."""
    options = chain_options(node, target, wide)
    if not options:
        return None
    return cheapest(options, lambda o: chain_price(node, *o, target),
                    None if timed is None else lambda o: timed(chain_planned(node, *o, target)),
                    tie=lambda o: (-o[0].stream_bufs, -o[1].stream_bufs))


def chain_sbuf_bytes(node: ir.Node, target: Target) -> int:
    """SBUF bytes per partition of a chained node's kernel as tiled (more than there is if no tiling fits)."""
    tilings = chain_tilings(node, target)
    if tilings is None:
        return target.sbuf_bytes_per_partition + 1
    return _chain_bytes(*stages(node), *tilings)


def matmul_plan(node: ir.Node, tiling: MatmulTiling) -> MatmulPlan:
    """The kernel plan of a matmul node under `tiling`: its sizes, operand views, epilogue and SBUF pools."""
    batch, m, n = node.shape
    k = node.attrs["k"]
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    epilogue = tuple(node.attrs.get("epilogue") or (ir.Step(Op.CONVERT, (("input", 0),), node.dtype, {}),))
    return MatmulPlan(
        batch=batch, m=m, n=n, k=k, dtype=node.dtype, tiling=tiling,
        a=View.of(views[0], (batch, m, k)), b=View.of(views[1], (batch, k, n)),
        extras=tuple(View.of(view, node.shape) for view in views[2:]),
        epilogue=epilogue, slots=tuple(assign_slots(epilogue, node.attrs.get("stored_step"))[0]),
        operand_pools=pool_specs(operand_pools(node, tiling)), epilogue_pools=pool_specs(epilogue_pools(node, tiling.tile_n)),
        bias_row=node.attrs.get("bias_row"), bias_column=node.attrs.get("bias_column"),
        a_by_k_tile=loads_a_by_k_tile(node) and loads_a_once(node, tiling), in_two_parts=loads_in_two_parts(node, tiling),
        epilogue_group=EPILOGUE_GROUP, stored_step=node.attrs.get("stored_step"))


def chain_plan(node: ir.Node, first_tiling: MatmulTiling, second_tiling: MatmulTiling, target: Target) -> ChainPlan:
    """The kernel plan of a chained node under its two tilings."""
    first, second = stages(node)
    return ChainPlan(split=node.attrs["chain"].split, first=matmul_plan(first, first_tiling),
                     second=matmul_plan(second, second_tiling), early_rows=early_rows(second, target),
                     first_loc=first.loc, lag=CHAIN_LAG, lead_part=CHAIN_LEAD_PART)


# Prologues (passes/norm_prologue.py): the matmul keeps all of A^T (the norm's result, transposed on chip) in SBUF
# as the chain's second matmul does, and streams B's strips through it; a chain's first matmul keeps all of its B,
# x^T, so. The norm's row tiles are computed in the same kernel (codegen/matmul.py `_prologued`).

@ir_text.register
@dataclasses.dataclass(frozen=True)
class Prologue:
    """attrs["prologue"] of a MATMUL node computing an operand by a row-wise kernel's steps (passes/norm_prologue.py):
    A of a matmul, or B of a chain's first matmul (which computes its result transposed: x^T)."""

    split: int  # the norm's inputs are the node's inputs[:split]
    operand: int  # the norm's result is input `operand` of the matmul (of inputs[split:] with it inserted)
    dtype: object  # the norm's result's
    attrs: dict  # the ROWWISE node's attributes (body, views, rows, cols, out_strides, schedule, plan)
    loc: object  # the norm's source location
    stored: bool = False  # the norm's result stored too, as the kernel's second output
    affine: tuple = ()  # the views (offset, strides) of the last len(affine) of inputs[:split]: the norm's gamma (and
    # beta), per column, applied in the copies out of the transposes' PSUM, not by its body (passes/norm_prologue.py
    # `_affine_after`)

    @property
    def norm_inputs(self) -> int:
        """How many of the node's first inputs are the norm's body's own (the affine vectors after them)."""
        return self.split - len(self.affine)

    def __hash__(self) -> int:
        return hash((self.split, self.operand, self.attrs["rows"], self.attrs["cols"], self.stored, self.affine))


def prologue_stages(node: ir.Node) -> tuple:
    """(norm, matmul): the ROWWISE node and the matmul (or chain) reading its result, of a node with a prologue."""
    prologue = node.attrs["prologue"]
    rows, cols = prologue.attrs["rows"], prologue.attrs["cols"]
    norm = ir.node(Op.ROWWISE, list(node.inputs[:prologue.norm_inputs]), (1, rows, cols), prologue.dtype,
                   prologue.loc, **prologue.attrs)
    rest = list(node.inputs[prologue.split:])
    attrs = {key: value for key, value in node.attrs.items() if key != "prologue"}
    matmul = ir.node(Op.MATMUL, [*rest[:prologue.operand], norm, *rest[prologue.operand:]], node.shape, node.dtype,
                     node.loc, **attrs)
    return norm, matmul


def _one_strip(tiling: MatmulTiling, matmul: ir.Node) -> bool:
    """Whether a chain's first matmul keeps all of B (x^T, the norm's transpose) resident as one strip."""
    return tiling.resident == "b" and tiling.block * tiling.tile_n >= matmul.shape[2]


def _prologue_bytes(node: ir.Node, tiling) -> int:
    """SBUF bytes per partition of a prologued kernel: the norm's row tiles, the kept transpose and its transposes'
    identity, then the matmul's pools (the norm's operand not loaded) or the chain's (its first's B not loaded)."""
    norm, matmul = prologue_stages(node)
    body, views, cols = norm.attrs["body"], norm.attrs["views"], norm.attrs["cols"]
    tile_k = (tiling[1] if isinstance(tiling, tuple) else tiling).tile_k
    kept = _pages(-(-cols // tile_k) * norm.attrs["rows"], norm.dtype)
    identity = _pages(tile_k, norm.dtype) + _pages(tile_k, DType.F32)
    prologue = node.attrs["prologue"]  # gamma (and beta) loaded as [K tiles, tile_k], transposed: [tile_k, K tiles]
    identity += sum(_pages(tile_k, x.dtype) + _pages(-(-cols // tile_k), x.dtype)
                    for x in node.inputs[prologue.norm_inputs:prologue.split])
    if isinstance(tiling, tuple):  # a chain: its first's B strip is the kept transpose
        first, second = stages(matmul)
        pools = _chain_bytes(first, second, *tiling) - sbuf_bytes({"b": operand_pools(first, tiling[0])["b"]})
    else:
        pools = sbuf_bytes({name: p for name, p in operand_pools(matmul, tiling).items() if name != "a"})
        pools += sbuf_bytes(epilogue_pools(matmul, tiling.tile_n))
    return rowwise_sbuf_bytes(body, views, [x.dtype for x in norm.inputs], norm.dtype, cols,
                              norm.attrs["plan"].schedule.bufs) + kept + identity + pools


def _prologue_search(node: ir.Node, target: Target):
    """The least `price` / `chain_price` of a prologued node's matmul or chain alone (the operand charged as loaded,
    which the kernel transposes on chip instead) among the tilings that fit, the deeper buffered of equals."""
    _, matmul = prologue_stages(node)
    if matmul.attrs.get("chain") is not None:
        first, _ = stages(matmul)
        options = [o for o in chain_options(matmul, target) if _one_strip(o[0], first)
                   and _prologue_bytes(node, o) <= target.sbuf_bytes_per_partition]
        return cheapest(options, lambda o: chain_price(matmul, *o, target), None,
                        tie=lambda o: (-o[0].stream_bufs, -o[1].stream_bufs)) if options else None
    plain = [_second_tiling(matmul, target, bufs) for bufs in (3, 2)]
    # B's strips read across its rows (a weight stored [out, in]: a training graph's, not stored transposed) may load
    # as DMA transposes, priced as any tiling's (`price`); A is made on chip, never loaded
    plain += [dataclasses.replace(t, transposes="b") for t in plain
              if "b" in _transpose_options(matmul, target) and _whole_pages(matmul, t, "b")]
    options = [t for t in plain if _prologue_bytes(node, t) <= target.sbuf_bytes_per_partition]
    return cheapest(options, lambda t: price(matmul, t, target), None, tie=lambda t: -t.stream_bufs) if options else None


def _tiled_bytes(node: ir.Node, target: Target) -> int:
    tiling = prologue_tiling(node, target)
    return target.sbuf_bytes_per_partition + 1 if tiling is None else _prologue_bytes(node, tiling)


def _input_facts(x: ir.Node) -> tuple:
    """Everything the tiling reads of a matmul's input: its type, the op it is a reshape of, whether a weight."""
    return x.shape, x.dtype, ir.unreshaped(x).op, _is_weight(x)


def _stand_in(shape: tuple, dtype: DType, op: Op, weight: bool) -> ir.Node:
    """An input of those `_input_facts` and no other (no inputs, no location, no id taken)."""
    return ir.Node(op, (), shape, dtype, {"kind": "weight"} if weight and op is Op.PARAMETER else {}, id=-1)


def _located_nowhere(key: tuple) -> ir.Node:
    """The prologued node a `_prologue_key` describes, built from the key alone: its attributes with every location
    empty, each input a `_stand_in`."""
    _, shape, dtype, attrs, inputs, _ = key
    return ir.Node(Op.MATMUL, tuple(_stand_in(*facts) for facts in inputs), shape, dtype, located_nowhere(attrs),
                   id=-1)


def _prologue_key(make, node: ir.Node, target: Target) -> tuple:
    return (make.__name__, node.shape, node.dtype, LocsApart().key(node.attrs),
            tuple(_input_facts(x) for x in node.inputs), target)


def _once_per_prologue(make, node: ir.Node, target: Target):
    """`make(node, target)`, made once per distinct `_prologue_key` and on the node that key describes (its
    locations empty, its inputs stand-ins of the same facts): a function of the key by construction, so a model's
    repeated layers tile their norm prologues once (issue 24). Equal to `make` on the node itself as long as no
    price reads a location or an input beyond its facts (tests/test_tiling_once_per_key.py compares both). A hit
    takes the ids `make` took (`ir.skip_ids`), so every later node has the id it has without the memo (the ids
    name the NEFF's tensors). A node whose attributes do not pickle is made as it is."""
    try:
        key = _prologue_key(make, node, target)
        hash(key)
    except (pickle.PicklingError, TypeError, AttributeError):
        return make(node, target)
    if key in _PROLOGUES:
        found, ids = _PROLOGUES[key]
        ir.skip_ids(ids)
        return found
    if len(_PROLOGUES) >= _PROLOGUES_LIMIT:
        _PROLOGUES.clear()
    start = ir.next_id()
    found = make(_located_nowhere(key), target)
    _PROLOGUES[key] = found, ir.next_id() - start
    return found


_PROLOGUES: dict = {}  # _prologue_key -> (its tiling or SBUF bytes, the ids making it took)
_PROLOGUES_LIMIT = 2048  # distinct prologued kernels' tilings and sizes remembered per process


def prologue_tiling(node: ir.Node, target: Target):
    """The tiling of a prologued node's matmul (A resident as one strip), or its chain's pair (the first's B
    resident as one strip): `_prologue_search`, once per distinct node but for locations; None if none fits."""
    return _once_per_prologue(_prologue_search, node, target)


def prologue_sbuf_bytes(node: ir.Node, target: Target) -> int:
    """SBUF bytes per partition of a prologued node's kernel as tiled (more than there is if no tiling fits)."""
    return _once_per_prologue(_tiled_bytes, node, target)


def prologue_planned(node: ir.Node, target: Target) -> ir.Node:
    """A prologued node tiled, its kernel plan (a ProloguePlan) attached."""
    tiling = prologue_tiling(node, target)
    norm, matmul = prologue_stages(node)
    if isinstance(tiling, tuple):
        inner = chain_plan(matmul, *tiling, target)
        attrs = {"chain": dataclasses.replace(node.attrs["chain"], attrs={**node.attrs["chain"].attrs,
                                                                          "tiling": tiling[0]}), "tiling": tiling[1]}
    else:
        inner, attrs = matmul_plan(matmul, tiling), {"tiling": tiling}
    plan = ProloguePlan(split=node.attrs["prologue"].split, norm=norm.attrs["plan"], body=norm.attrs["body"],
                        views=norm.attrs["views"], rows=norm.attrs["rows"], cols=norm.attrs["cols"],
                        dtype=norm.dtype, loc=norm.loc, matmul=inner, operand=node.attrs["prologue"].operand,
                        stored=node.attrs["prologue"].stored, affine=node.attrs["prologue"].affine)
    return dataclasses.replace(node, attrs={**node.attrs, **attrs, "plan": plan}, id=next(ir._ids))


def _tile_all(graph: ir.Graph, target: Target, pick, wide: bool = False, timed=None) -> ir.Graph:
    def tile(node, inputs):
        if node.op is not Op.MATMUL:
            return None
        node = ir.with_inputs(node, inputs)
        if node.attrs.get("prologue") is not None:  # made only where a tiling fits (passes/norm_prologue.py)
            return prologue_planned(node, target)
        if node.attrs.get("chain") is not None:  # made only where a tiling fits (passes/matmul_chain.py)
            return chain_planned(node, *chain_tilings(node, target, wide, timed), target)
        return planned(node, pick(node, target))

    return graph.rewrite(tile)


def baseline_tiles(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """-O0/-O1: every matmul streams both operands tile by tile (the other kernels planned: `plan_kernels`)."""
    return plan_kernels(_tile_all(graph, ctx.target, default_tiling), ctx)


def choice_key(node: ir.Node) -> tuple:
    """Everything `choose` reads of a matmul node without `timed` (the formula's inputs): its type and attributes,
    and each input's type, the op it is a reshape of (`loads_a_by_k_tile`) and whether it is a weight
    (`streamed_first`). Two nodes of one key get the same tiling: a model's repeated layers price their matmuls
    once (issue 24: 49 searches of 9 prices each at HF GPT-2's 12 layers, 2 distinct)."""
    return (node.shape, node.dtype, ir_text.attrs_text(node.attrs),
            tuple((x.shape, x.dtype, ir.unreshaped(x).op, _is_weight(x)) for x in node.inputs))


def _choose_once_per_key():
    """`choose` (formula prices, no `timed`) for a pass over one graph, each distinct `choice_key` searched once."""
    chosen: dict = {}

    def pick(node: ir.Node, target: Target) -> MatmulTiling:
        key = choice_key(node)
        if key not in chosen:
            chosen[key] = choose(node, target)
        return chosen[key]

    return pick


def tile_matmuls(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """-O2: resident operand and block size searched with the cost model (the other kernels planned)."""
    pick = (_choose_once_per_key() if ctx.kernel_time is None
            else lambda node, t: choose(node, t, timed=ctx.kernel_time))
    return plan_kernels(_tile_all(graph, ctx.target, pick, timed=ctx.kernel_time), ctx)


def search_matmul_tiles(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """-O3: also narrower N tiles and deeper buffering of the streamed operand (the other kernels planned)."""
    return plan_kernels(_tile_all(graph, ctx.target, lambda node, t: choose(node, t, wide=True, timed=ctx.kernel_time),
                                  wide=True, timed=ctx.kernel_time), ctx)
