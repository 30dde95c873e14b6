"""Sorts and top-k of rows wider than a tile: chunks a TOPK kernel can take, merged exactly.

The TOPK kernel (MAX8, FIND_INDEX8, MATCH_REPLACE8; codegen/indexing.py) holds a whole row in one SBUF tile, so
a row of more values than a tile holds (3584 on trn2, the default target; 3072 on trn1) cannot be its operand. This pass rewrites every TOPK
over such rows before lower_gather_scatter makes its keys exact, in one of two ways:

- **A top-k of few values (4k <= a tile): the top-k of each tile-wide chunk, then the top-k of the chunks'
  winners.** The k first of a row are among the k first of each chunk, so a TOPK of k over the C * k winners
  (concatenated in chunk order, each chunk's in its own order) gives them; repeated while the winners are still
  wider than a tile (each round divides the width by 4 at least). Exact and stable like one TOPK: each TOPK is
  lowered exactly by lower_gather_scatter (NaN/-0/inf order keys, integer digits), and tied winners stand in
  input order (chunk order, then each chunk's stable order), which the merge keeps. The row is padded to whole
  chunks with a key every real key precedes or ties (-inf / NaN, the integer's limit): padding comes last among
  ties, so it is never among the k first of n >= k real keys. Cost: a TOPK of k per chunk (k / 8 rounds over a
  tile) and a short merge: ~n / tile times one tile's top-k.
- **Anything else (a whole sort, a median, a top-k of many): a stable rank by counting, then a scatter.** The
  position of key i in the stable order is the number of keys before it: those strictly before it, and the
  equal ones of a lower index. That count is computed with exact int32 comparisons of PyTorch's order key
  (floats as lower_gather_scatter orders them: -0 equal to 0, NaN above +inf; the vector engine compares int32
  keys as integers, not in fp32), blocks of query keys at a time ([rows, block, n] comparisons of at most
  BLOCK_ELEMENTS and BLOCK queries), summed per key: keys left of a block count when before or tied, keys right
  of it when strictly before, and only the block's own square compares indices. Each key's index is then
  written at its rank by one row scatter (DMA). It costs n^2 comparisons per row, where a TOPK sort of a row
  within a tile costs n / 8 rounds of 3 ops over the row (on one partition per row): estimated 2.5 ms for a
  sort of [1, 3600] fp32 and 10.6 ms for [1, 8000] (DMA-bound: each block streams its broadcast key rows from
  HBM), where one TOPK sort of [1, 3000] fp32 is 12.2 ms. Rows do not share the work (a TOPK sorts 128 rows at
  once), so many wide rows cost rows x n^2. 64-bit keys are refused (a count on two 32-bit digits is not built).
  Chosen over the alternatives the ISA allows: a merge sort of TOPK-sorted chunks needs either the same
  comparisons or a binary search per key (log n dependent single-element gathers, each a DMA), and a bitonic
  network over chunks needs a power-of-two width, (key, index) compare-exchanges on both 16-bit digits of a
  32-bit key and log^2 n dependent passes; the count is one exact pass with no data-dependent access until the
  final scatter.
"""
from __future__ import annotations

import math

import numpy as np

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node, Op
from neuronc.isa import DType
from neuronc.passes.context import PassContext
from neuronc.passes.indexing import float_order_key
from neuronc.placement import tile_free_elements

BLOCK_ELEMENTS = 1 << 22  # comparisons of one block of the counting sort ([rows, block, n]: 16 MiB of int32)
BLOCK = 512  # query keys of one block at most (4 partition tiles; 128 made 8000 values 14.6 ms, 512 11.1)
COUNTED_VALUES = 16384  # a stated choice: the widest row ranked by counting (n^2 comparisons a row: 2.7e8 here; a
#                        row of 200,000 would be 4e10, and its program did not fit 20 GB of host memory to compile)
_SIGN = -(1 << 31)


def split_wide_sorts(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Every TOPK over rows wider than the TOPK kernel's tile, as TOPKs of chunks and a merge, or a count."""
    width = tile_free_elements(ctx.target)

    def rewrite(node: Node, inputs: tuple) -> Node | None:
        if node.op is not Op.TOPK or max(inputs[0].shape[node.attrs["dimension"]], 8) <= width:
            return None
        n, k, descending = inputs[0].shape[node.attrs["dimension"]], node.attrs["k"], node.attrs["descending"]
        if 4 * k > width and n > COUNTED_VALUES:
            raise NeuronCompileError(
                f"a sort or top-k over rows of {n} values: at most {COUNTED_VALUES} fit (one tile holds {width}; "
                "wider rows are ranked by counting, n^2 comparisons a row)", location=str(node.loc),
                hint=f"sort rows of at most {COUNTED_VALUES} values (split the row and merge on the host), or ask "
                "for a top-k of at most a quarter of a tile")
        rows, restore = _as_rows(inputs[0], node.attrs["dimension"], node.loc)
        positions = _top_k(rows, k, descending, width, node) if 4 * k <= width else _ranked(rows, k, descending, node)
        return restore(positions)

    return graph.rewrite(rewrite)


def _as_rows(x: Node, dim: int, loc):
    """x as [rows, n] with dim last, and the function putting a [rows, k] result of it back in x's layout."""
    perm = tuple(d for d in range(len(x.shape)) if d != dim) + (dim,)
    moved = tuple(x.shape[d] for d in perm)
    rows = math.prod(moved[:-1])
    t = x if perm == tuple(range(len(perm))) else ir.node(Op.TRANSPOSE, [x], moved, x.dtype, loc, perm=perm)
    flat = ir.node(Op.RESHAPE, [t], (rows, x.shape[dim]), x.dtype, loc)

    def restore(result: Node) -> Node:
        k = result.shape[1]
        back = ir.node(Op.RESHAPE, [result], moved[:-1] + (k,), result.dtype, loc)
        if perm == tuple(range(len(perm))):
            return back
        inverse = tuple(perm.index(d) for d in range(len(perm)))
        return ir.node(Op.TRANSPOSE, [back], tuple((moved[:-1] + (k,))[p] for p in inverse), result.dtype, loc,
                       perm=inverse)

    return flat, restore


# -- a top-k of few: chunks, then their winners -----------------------------------------------------------------

def _top_k(keys: Node, k: int, descending: bool, width: int, node: Node) -> Node:
    """int32 positions [rows, k] of the k first of each row of keys [rows, n] (n > width, 4k <= width)."""
    loc, (rows, n) = node.loc, keys.shape
    chunks = -(-n // width)
    chunk = -(-n // chunks)
    padded = keys
    if chunks * chunk > n:
        fill = ir.node(Op.CONSTANT, [], (rows, chunks * chunk - n), keys.dtype, loc,
                       value=np.array(_last_key(keys.dtype, descending), keys.dtype.numpy))
        padded = ir.node(Op.CONCATENATE, [keys, fill], (rows, chunks * chunk), keys.dtype, loc, dimension=1)
    pieces = ir.node(Op.RESHAPE, [padded], (rows * chunks, chunk), keys.dtype, loc)
    local = ir.node(Op.TOPK, [pieces], (rows * chunks, k), node.dtype, loc, dimension=1, k=k, descending=descending)
    local = ir.node(Op.RESHAPE, [local], (rows, chunks, k), node.dtype, loc)
    start = ir.node(Op.MULTIPLY, [ir.node(Op.IOTA, [], local.shape, node.dtype, loc, dimension=1),
                                  ir.splat(chunk, local.shape, node.dtype, loc)], local.shape, node.dtype, loc)
    winners = ir.node(Op.RESHAPE, [ir.node(Op.ADD, [local, start], local.shape, node.dtype, loc)],
                      (rows, chunks * k), node.dtype, loc)
    keys_of_winners = _taken(padded, winners, loc)
    if chunks * k > width:
        merged = _top_k(keys_of_winners, k, descending, width, node)
    else:
        merged = ir.node(Op.TOPK, [keys_of_winners], (rows, k), node.dtype, loc, dimension=1, k=k,
                         descending=descending)
    return _taken(winners, merged, loc)


def _last_key(dtype: DType, descending: bool):
    """A key every key precedes or ties in the order asked for: the smallest (descending) or largest."""
    if dtype.is_float:
        return -np.inf if descending else np.nan  # NaN is the largest in PyTorch's order
    if dtype is DType.BOOL:
        return not descending
    info = np.iinfo(dtype.numpy)
    return info.min if descending else info.max


def _taken(x: Node, positions: Node, loc) -> Node:
    """x[r, positions[r, j]] of [rows, n] x and [rows, m] positions: a StableHLO gather (lower_gather_scatter
    lowers it to row gathers)."""
    return ir.node(Op.GATHER, [x, positions], positions.shape, x.dtype, loc, window_dims=(), dropped_dims=(1,),
                   operand_batching_dims=(0,), indices_batching_dims=(0,), index_map=(1,), index_vector_dim=2,
                   window=(1, 1))


# -- anything else: a stable rank by counting ---------------------------------------------------------------------

def _ranked(keys: Node, k: int, descending: bool, node: Node) -> Node:
    """int32 positions [rows, k] of the first k of each row's stable sort: each key's rank counted, its index
    scattered to its rank."""
    loc, (rows, n) = node.loc, keys.shape
    order = _order_key(keys, node)
    block = max(1, min(n, BLOCK, BLOCK_ELEMENTS // max(rows * n, 1)))
    counts = [_rank_block(order, q0, min(n, q0 + block), descending, loc) for q0 in range(0, n, block)]
    rank = counts[0] if len(counts) == 1 else ir.node(Op.CONCATENATE, counts, (rows, n), DType.I32, loc, dimension=1)
    row_start = ir.node(Op.MULTIPLY, [ir.node(Op.IOTA, [], (rows, n), DType.I32, loc, dimension=0),
                                      ir.splat(n, (rows, n), DType.I32, loc)], (rows, n), DType.I32, loc)
    target = ir.node(Op.RESHAPE, [ir.node(Op.ADD, [row_start, rank], (rows, n), DType.I32, loc)], (rows * n,),
                     DType.I32, loc)
    index = ir.node(Op.RESHAPE, [ir.node(Op.IOTA, [], (rows, n), node.dtype, loc, dimension=1)], (rows * n, 1),
                    node.dtype, loc)
    base = ir.splat(0, (rows * n, 1), node.dtype, loc)
    sorted_ = ir.node(Op.SCATTER_ROWS, [base, target, index], (rows * n, 1), node.dtype, loc, combine="replace")
    positions = ir.node(Op.RESHAPE, [sorted_], (rows, n), node.dtype, loc)
    if k == n:
        return positions
    return ir.node(Op.SLICE, [positions], (rows, k), node.dtype, loc, start=(0, 0), limit=(rows, k), strides=(1, 1))


def _rank_block(order: Node, q0: int, q1: int, descending: bool, loc) -> Node:
    """[rows, q1 - q0]: how many keys of each row come before keys q0 .. q1 - 1 in its stable order: those
    strictly before, and the equal ones of a lower index. Keys left of the block are counted when before or tied,
    keys right of it when strictly before; only the block's own square compares indices."""
    rows, n = order.shape
    strictly, or_tied = ("GT", "GE") if descending else ("LT", "LE")
    query = _columns(order, q0, q1, loc)
    counts = []
    if q0 > 0:
        counts.append(_count(_compare(_columns(order, 0, q0, loc), query, or_tied, loc), loc))
    if q1 < n:
        counts.append(_count(_compare(_columns(order, q1, n, loc), query, strictly, loc), loc))
    square = _columns(order, q0, q1, loc)
    before, before_or_tied = _compare(square, query, strictly, loc), _compare(square, query, or_tied, loc)
    shape = before.shape
    earlier = ir.node(Op.COMPARE, [ir.node(Op.IOTA, [], shape, DType.I32, loc, dimension=2),
                                   ir.node(Op.IOTA, [], shape, DType.I32, loc, dimension=1)], shape, DType.BOOL, loc,
                      direction="LT")
    counts.append(_count(ir.node(Op.SELECT, [earlier, before_or_tied, before], shape, DType.BOOL, loc), loc))
    total = counts[0]
    for count in counts[1:]:
        total = ir.node(Op.ADD, [total, count], total.shape, DType.I32, loc)
    return total


def _columns(x: Node, c0: int, c1: int, loc) -> Node:
    rows = x.shape[0]
    return ir.node(Op.SLICE, [x], (rows, c1 - c0), x.dtype, loc, start=(0, c0), limit=(rows, c1), strides=(1, 1))


def _compare(others: Node, query: Node, direction: str, loc) -> Node:
    """[rows, queries, others]: others[r, j] <direction> query[r, i]."""
    shape = (query.shape[0], query.shape[1], others.shape[1])
    other = ir.node(Op.BROADCAST_IN_DIM, [others], shape, DType.I32, loc, dims=(0, 2))
    spread = ir.node(Op.BROADCAST_IN_DIM, [query], shape, DType.I32, loc, dims=(0, 1))
    return ir.node(Op.COMPARE, [other, spread], shape, DType.BOOL, loc, direction=direction)


def _count(holds: Node, loc) -> Node:
    """[rows, queries]: how many of the last dim hold."""
    ones = ir.node(Op.CONVERT, [holds], holds.shape, DType.I32, loc)
    return ir.node(Op.REDUCE, [ones, ir.splat(0, (), DType.I32, loc)], holds.shape[:2], DType.I32, loc, dims=(2,),
                   kind="add")


def _order_key(keys: Node, node: Node) -> Node:
    """int32 keys ordered as PyTorch orders keys (floats: -0 equal to 0, NaN largest)."""
    loc, dtype = node.loc, keys.dtype
    if dtype.is_float:
        return float_order_key(keys, loc)
    if dtype is DType.I32:
        return keys
    if dtype is DType.U32:
        bits = ir.node(Op.BITCAST, [keys], keys.shape, DType.I32, loc)
        return ir.node(Op.XOR, [bits, ir.splat(_SIGN, keys.shape, DType.I32, loc)], keys.shape, DType.I32, loc)
    if dtype.itemsize < 4:
        return ir.node(Op.CONVERT, [keys], keys.shape, DType.I32, loc)
    raise NeuronCompileError(f"a sort of {keys.shape[1]} {dtype.name} keys a row: rows wider than a tile are sorted "
                             "by counting on 32-bit keys", location=str(node.loc),
                             hint="sort rows of at most a tile, or convert the keys to int32 if their values fit")

