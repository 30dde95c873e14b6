"""Gather and scatter: StableHLO's general index semantics, lowered to moves of whole rows.

A StableHLO gather reads, for every index vector, a window of the operand starting where the vector
says; a scatter writes (or adds) windows of updates the same way. The device moves rows by index
(DMA_GATHER, DMA_SCATTER). So the operand is seen as a [rows, width] table, `width` covering the
trailing operand dims that every window spans whole, and this pass computes with ordinary
elementwise IR the table row of every row of every window. What is left is GATHER_ROWS
([V, W] table, [N] rows -> [N, W]) and SCATTER_ROWS ([V, W] base, [N] rows, [N, W] updates).

An index outside the operand is an error at run time, as in eager PyTorch: its row becomes V, which the
DMA refuses. A gather or scatter from JAX or a StableHLO file (`bounds` "clamp" or "drop") means what
StableHLO says: a gather's start indices are clamped so the window lies inside the operand, and a
scatter's updates outside it are dropped (written to a spare row V of the base, then cut off).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node, Op
from neuronc.isa import DType
from neuronc.passes.context import PassContext

ROW = DType.I32  # the DMA's index type


def lower_gather_scatter(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    return graph.rewrite(lambda node, inputs: _RULES[node.op](node, *inputs) if node.op in _RULES else None)


def _gather(node: Node, operand: Node, indices: Node) -> Node:
    space = _IndexSpace(node, operand.shape, indices)
    table = ir.node(Op.RESHAPE, [operand], (space.rows, space.width), operand.dtype, node.loc)
    rows = ir.node(Op.GATHER_ROWS, [table, space.row_numbers()], (space.count, space.width), node.dtype, node.loc)
    canonical = ir.node(Op.RESHAPE, [rows], space.canonical_shape + space.row_shape, node.dtype, node.loc)
    # canonical order: batch dims, then window dims in operand order; the result puts the window at window_dims
    batch_positions = [d for d in range(len(node.shape)) if d not in node.attrs["window_dims"]]
    perm = [0] * len(node.shape)
    for i, d in enumerate(batch_positions + list(node.attrs["window_dims"])):
        perm[d] = i
    return ir.node(Op.TRANSPOSE, [canonical], node.shape, node.dtype, node.loc, perm=tuple(perm))


def _scatter(node: Node, operand: Node, indices: Node, updates: Node) -> Node:
    space = _IndexSpace(node, operand.shape, indices)
    window_dims = list(node.attrs["window_dims"])
    batch_positions = [d for d in range(len(updates.shape)) if d not in window_dims]
    perm = tuple(batch_positions + window_dims)
    ordered = ir.node(Op.TRANSPOSE, [updates], [updates.shape[d] for d in perm], updates.dtype, node.loc, perm=perm)
    rows_of_updates = ir.node(Op.RESHAPE, [ordered], (space.count, space.width), updates.dtype, node.loc)
    base = ir.node(Op.RESHAPE, [operand], (space.rows, space.width), operand.dtype, node.loc)
    if node.attrs["combine"] in _COMBINED:
        combined = _combined_by_row(node, base, space.row_numbers(), rows_of_updates)
        return ir.node(Op.RESHAPE, [combined], node.shape, node.dtype, node.loc)
    dropping = space.bounds == "drop"
    if dropping:  # row V exists: the updates outside the operand land there
        zero = ir.splat(0, (), operand.dtype, node.loc)
        base = ir.node(Op.PAD, [base, zero], (space.rows + 1, space.width), operand.dtype, node.loc, low=(0, 0),
                       high=(1, 0), interior=(0, 0))
    scattered = ir.node(Op.SCATTER_ROWS, [base, space.row_numbers(), rows_of_updates], base.shape, node.dtype,
                      node.loc, combine=node.attrs["combine"])
    if dropping:
        scattered = ir.node(Op.SLICE, [scattered], (space.rows, space.width), node.dtype, node.loc, start=(0, 0),
                            limit=(space.rows, space.width), strides=(1, 1))
    return ir.node(Op.RESHAPE, [scattered], node.shape, node.dtype, node.loc)


_COMBINED = {"max": Op.MAXIMUM, "min": Op.MINIMUM, "mul": Op.MULTIPLY}  # combine -> the elementwise op


def _combined_by_row(node: Node, base: Node, rows: Node, updates: Node) -> Node:
    """A scatter combining by max, min or product (JAX's `.at[i].max`, `segment_max`): the DMA only writes or
    adds, so each table row reduces the updates aimed at it, picked from all of them by a one-hot comparison of
    row numbers ([V, N, W] elements: meant for the small scatters these are), and combines that with itself. An
    update outside the table matches no row: dropped. Exact for max and min; a product is formed as a tree,
    not in update order (integer products wrap the same either way)."""
    (count, width), table, loc = updates.shape, base.shape[0], node.loc
    kind, op = node.attrs["combine"], _COMBINED[node.attrs["combine"]]
    shape = (table, count, width)
    numbers = ir.node(Op.BROADCAST_IN_DIM, [rows], (table, count), ROW, loc, dims=(1,))
    hit = ir.node(Op.COMPARE, [ir.node(Op.IOTA, [], (table, count), ROW, loc, dimension=0), numbers], (table, count),
                  DType.BOOL, loc, direction="EQ")
    hit = ir.node(Op.BROADCAST_IN_DIM, [hit], shape, DType.BOOL, loc, dims=(0, 1))
    spread = ir.node(Op.BROADCAST_IN_DIM, [updates], shape, updates.dtype, loc, dims=(1, 2))
    identity = _identity(kind, updates.dtype)
    picked = ir.node(Op.SELECT, [hit, spread, _splat(identity, shape, loc, updates.dtype)], shape, updates.dtype, loc)
    reduced = ir.node(Op.REDUCE, [picked, _splat(identity, (), loc, updates.dtype)], (table, width), updates.dtype, loc,
                      dims=(1,), kind=kind)
    return ir.node(op, [base, reduced], base.shape, node.dtype, loc)


def _identity(kind: str, dtype: DType):
    if kind == "mul":
        return 1
    if dtype.is_float:
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype.numpy) if dtype is not DType.BOOL else None
    return (info.min if kind == "max" else info.max) if info else kind == "min"


# -- sort keys TOPK cannot compare exactly --------------------------------------------------------------------
# TOPK compares in fp32 (MAX8, FIND_INDEX8, MATCH_REPLACE8). Its 24-bit significand holds integer keys exactly
# only up to 2^24; it cannot find a NaN (NaN equals nothing); and it raises its keys to the lowest finite float
# (a struck-out slot is -inf), so -inf and -FLT_MAX tie (+inf and +FLT_MAX once an ascending sort negates them).
# So every float key is first mapped to an integer ordered as PyTorch orders floats, and integer keys wider than
# 24 bits are sorted by 16-bit digits, each exact in fp32.
_SIGNED_WIDE = {DType.I32: True, DType.I64: True, DType.U32: False, DType.U64: False}
_DIGIT_BITS = 16
_EXACT_BITS = 24  # fp32's significand: a TOPK of integer keys below 2^24 in magnitude is exact
_CANONICAL_NAN = 0x7FC00000  # fp32's quiet NaN: as an int32, above +inf's 0x7F800000
_SIGN = -(1 << 31)


def _constant(value, like: Node, loc, dtype: DType | None = None) -> Node:
    dtype = dtype or like.dtype
    return ir.node(Op.CONSTANT, [], like.shape, dtype, loc, value=np.array(value).astype(dtype.numpy))


def float_order_key(x: Node, loc) -> Node:
    """int32 keys ordered as PyTorch orders the floats x (a sort, top-k, median): -0 equal to 0, every NaN one
    value above +inf. A non-negative float's IEEE bits order as an int32 does; a negative float's order reversed
    once its bits but the sign are flipped. A narrower float is widened to fp32 first (exactly)."""
    f = x if x.dtype is DType.F32 else ir.node(Op.CONVERT, [x], x.shape, DType.F32, loc)
    bits = ir.node(Op.BITCAST, [f], f.shape, DType.I32, loc)
    nan = ir.node(Op.COMPARE, [f, f], f.shape, DType.BOOL, loc, direction="NE")
    zero = ir.node(Op.COMPARE, [f, _constant(0.0, f, loc)], f.shape, DType.BOOL, loc, direction="EQ")
    bits = ir.node(Op.SELECT, [zero, _constant(0, bits, loc), bits], bits.shape, DType.I32, loc)
    bits = ir.node(Op.SELECT, [nan, _constant(_CANONICAL_NAN, bits, loc), bits], bits.shape, DType.I32, loc)
    negative = ir.node(Op.COMPARE, [bits, _constant(0, bits, loc)], bits.shape, DType.BOOL, loc, direction="LT")
    flipped = ir.node(Op.XOR, [bits, _constant(~_SIGN, bits, loc)], bits.shape, DType.I32, loc)
    return ir.node(Op.SELECT, [negative, flipped, bits], bits.shape, DType.I32, loc)


def _significant_bits(dtype: DType) -> int:
    """The bits of a float's order key that vary: fp32's sign and exponent, and the float's own significand bits
    (a bf16 widened to fp32 has 16 trailing zero bits)."""
    return 1 + 8 + int(ml_dtypes.finfo(dtype.numpy).nmant)


def _narrowed(key: Node, bits: int, loc) -> Node:
    """An int32 order key whose low 32 - bits bits never vary, as keys 0 .. 2^bits - 1 in the same order (the
    sign bit flipped: the bits then order as an unsigned number's; shifted right past the constant bits)."""
    unsigned = ir.node(Op.XOR, [key, _constant(_SIGN, key, loc)], key.shape, DType.I32, loc)
    return ir.node(Op.SHIFT_RIGHT_LOGICAL, [unsigned, _constant(32 - bits, key, loc)], key.shape, DType.I32, loc)


def _digits(node: Node, x: Node) -> list:
    """x's keys as int32 digits of 16 bits, least significant first, ordered as the keys are when compared most
    significant digit first (a signed key's sign bit flipped: its bits then order as an unsigned number's)."""
    def constant(value):
        return _constant(value, x, node.loc)

    bits = x.dtype.itemsize * 8
    if _SIGNED_WIDE[x.dtype]:
        x = ir.node(Op.XOR, [x, constant(-(1 << (bits - 1)))], x.shape, x.dtype, node.loc)
    digits = []
    for shift in range(0, bits, _DIGIT_BITS):
        shifted = ir.node(Op.SHIFT_RIGHT_LOGICAL, [x, constant(shift)], x.shape, x.dtype, node.loc) if shift else x
        digit = ir.node(Op.AND, [shifted, constant((1 << _DIGIT_BITS) - 1)], x.shape, x.dtype, node.loc)
        # int32, not fp32: an --auto-cast all leaves integers alone (a digit in bf16 would not be exact)
        digits.append(digit if x.dtype is DType.I32 else ir.node(Op.CONVERT, [digit], x.shape, DType.I32, node.loc))
    return digits


def _taken(x: Node, positions: Node, dim: int, loc) -> Node:
    """x[..., positions[...], ...] along dim (positions: x's shape but for its length along dim), as row gathers."""
    rank, others = len(x.shape), tuple(d for d in range(len(x.shape)) if d != dim)
    gather = ir.node(Op.GATHER, [x, positions], positions.shape, x.dtype, loc, window_dims=(), dropped_dims=(dim,),
                     operand_batching_dims=others, indices_batching_dims=others, index_map=(dim,),
                     index_vector_dim=rank, window=(1,) * rank)
    return _gather(gather, x, positions)


def _sort_by_digits(node: Node, keys: Node) -> Node:
    """A sort or top-k of wide integer keys as stable sorts by 16-bit digits, least significant first (an LSD
    radix sort: each pass is TOPK's stable order of one digit, read through the positions of the passes before)."""
    dim, k = node.attrs["dimension"], node.attrs["k"]
    digits, order = _digits(node, keys), None
    for i, digit in enumerate(digits):
        key = digit if order is None else _taken(digit, order, dim, node.loc)
        count = k if i == len(digits) - 1 else keys.shape[dim]
        shape = tuple(count if d == dim else s for d, s in enumerate(keys.shape))
        step = ir.node(Op.TOPK, [key], shape, node.dtype, node.loc, dimension=dim, k=count,
                       descending=node.attrs["descending"])
        order = step if order is None else _taken(order, step, dim, node.loc)
    return order


def _top_k_by_digits(node: Node, key: Node) -> Node:
    """The k < n first of int32 keys in 4 TOPKs of k (not a whole-row pass and one of k): the k first by the high
    digit find the boundary digit h of the k-th; the keys above h (all in the result) and the low digits of those
    at h (the contenders) choose the k; those k are then sorted by low digit, then high digit (LSD). Keys tied
    whole keep input order: both choosing keys order them by index among themselves."""
    dim, k, loc = node.attrs["dimension"], node.attrs["k"], node.loc
    mask = (1 << _DIGIT_BITS) - 1
    unsigned = ir.node(Op.XOR, [key, _constant(_SIGN, key, loc)], key.shape, DType.I32, loc)
    high = ir.node(Op.SHIFT_RIGHT_LOGICAL, [unsigned, _constant(_DIGIT_BITS, key, loc)], key.shape, DType.I32, loc)
    low = ir.node(Op.AND, [unsigned, _constant(mask, key, loc)], key.shape, DType.I32, loc)
    if not node.attrs["descending"]:  # the smallest first: the largest of the digits' complements
        high = ir.node(Op.SUBTRACT, [_constant(mask, key, loc), high], key.shape, DType.I32, loc)
        low = ir.node(Op.SUBTRACT, [_constant(mask, key, loc), low], key.shape, DType.I32, loc)
    shape = tuple(k if d == dim else s for d, s in enumerate(key.shape))

    def first_k(x: Node) -> Node:
        return ir.node(Op.TOPK, [x], shape, node.dtype, loc, dimension=dim, k=k, descending=True)

    by_high = first_k(high)
    start = tuple(k - 1 if d == dim else 0 for d in range(len(shape)))
    last = ir.node(Op.SLICE, [by_high], tuple(1 if d == dim else s for d, s in enumerate(shape)), node.dtype, loc,
                   start=start, limit=shape, strides=(1,) * len(shape))
    kept = tuple(d for d in range(len(shape)) if d != dim)
    boundary = ir.node(Op.RESHAPE, [_taken(high, last, dim, loc)], tuple(shape[d] for d in kept), DType.I32, loc)
    boundary = ir.node(Op.BROADCAST_IN_DIM, [boundary], key.shape, DType.I32, loc, dims=kept)
    above = ir.node(Op.COMPARE, [high, boundary], key.shape, DType.BOOL, loc, direction="GT")
    at = ir.node(Op.COMPARE, [high, boundary], key.shape, DType.BOOL, loc, direction="EQ")
    contender = ir.node(Op.SELECT, [at, low, _constant(-1, key, loc)], key.shape, DType.I32, loc)
    choice = ir.node(Op.SELECT, [above, _constant(mask + 1, key, loc), contender], key.shape, DType.I32, loc)
    chosen = first_k(choice)
    by_low = first_k(_taken(low, chosen, dim, loc))
    order = _taken(by_low, first_k(_taken(_taken(high, chosen, dim, loc), by_low, dim, loc)), dim, loc)
    return _taken(chosen, order, dim, loc)


def _exact_sort(node: Node, keys: Node) -> Node | None:
    """A TOPK whose keys it compares exactly: float keys by their order key (in one TOPK when it has at most 24
    varying bits: bf16, fp16, fp8; by digits for fp32), integer keys wider than 24 bits by digits."""
    if keys.dtype.is_float and keys.dtype is not DType.F64:
        order, bits = float_order_key(keys, node.loc), _significant_bits(keys.dtype)
        if bits > _EXACT_BITS:
            return _top_k_by_digits(node, order) if _few(node, keys) else _sort_by_digits(node, order)
        return ir.node(Op.TOPK, [_narrowed(order, bits, node.loc)], node.shape, node.dtype, node.loc, **node.attrs)
    if keys.dtype is DType.I32 and _few(node, keys):
        return _top_k_by_digits(node, keys)
    if keys.dtype in _SIGNED_WIDE:
        return _sort_by_digits(node, keys)
    return None


def _few(node: Node, keys: Node) -> bool:
    """Whether 4 TOPKs of k values cost less than a whole-row pass and one of k (TOPK's rounds grow with k)."""
    return 3 * node.attrs["k"] < keys.shape[node.attrs["dimension"]]


_RULES = {Op.GATHER: _gather, Op.SCATTER: _scatter, Op.TOPK: _exact_sort}


class _IndexSpace:
    """The windows of one gather/scatter as table rows.

    Canonical order of the rows: the batch dims (the dims of the indices but the index vector's), then the
    window dims that lie before the row (`lead`). A window spans the operand dims after `lead` whole."""

    def __init__(self, node: Node, shape: tuple, indices: Node):
        a = node.attrs
        self.node, self.shape, self.indices, self.a = node, shape, indices, a
        self.window = a["window"]
        self.bounds = a.get("bounds", "checked")  # or "clamp" (StableHLO's gather), "drop" (its scatter)
        fixed = set(a["index_map"]) | set(a["operand_batching_dims"]) | set(a["dropped_dims"])
        split = len(shape)
        while split > 0 and split - 1 not in fixed and self.window[split - 1] == shape[split - 1]:
            split -= 1
        self.split = split  # operand dims [split:) form the row
        self.row_shape = tuple(shape[split:])
        self.width = math.prod(self.row_shape)
        self.rows = math.prod(shape[:split])
        vector_dim = a["index_vector_dim"]
        self.batch_dims = [d for d in range(len(indices.shape)) if d != vector_dim]
        self.lead = [d for d in range(split) if d not in a["dropped_dims"] and d not in a["operand_batching_dims"]]
        self.canonical_shape = tuple([indices.shape[d] for d in self.batch_dims] + [self.window[d] for d in self.lead])
        self.count = math.prod(self.canonical_shape)
        if self.rows * max(self.width, 1) >= np.iinfo(ROW.numpy).max:
            raise NeuronCompileError(f"an operand of {self.rows} x {self.width} elements is too large to index",
                                     location=str(node.loc), hint="split the tensor before indexing it")

    def row_numbers(self) -> Node:
        """[count] int32: the table row of each canonical window row (V where an index is out of bounds, unless
        the gather clamps it)."""
        loc, shape = self.node.loc, self.canonical_shape
        strides = [math.prod(self.shape[d + 1:self.split]) for d in range(self.split)]
        terms, checks = [], []
        for k, d in enumerate(self.a["index_map"]):
            start = self._component(k)
            limit = self.shape[d] - self.window[d]
            if self.bounds == "clamp":
                start = ir.node(Op.CLAMP, [_splat(0, start.shape, loc), start, _splat(limit, start.shape, loc)],
                                start.shape, ROW, loc)
            else:
                checks.append(_and(_compare(start, 0, "GE", loc), _compare(start, limit, "LE", loc), loc))
            terms.append(_scaled(_spread(start, shape, range(len(self.batch_dims)), loc), strides[d], loc))
        for d, indices_dim in zip(self.a["operand_batching_dims"], self.a["indices_batching_dims"]):
            position = self.batch_dims.index(indices_dim)
            terms.append(_scaled(ir.node(Op.IOTA, [], shape, ROW, loc, dimension=position), strides[d], loc))
        for i, d in enumerate(self.lead):
            if self.window[d] > 1:
                position = len(self.batch_dims) + i
                terms.append(_scaled(ir.node(Op.IOTA, [], shape, ROW, loc, dimension=position), strides[d], loc))
        row = terms[0] if terms else _splat(0, shape, loc)
        for term in terms[1:]:
            row = ir.node(Op.ADD, [row, term], shape, ROW, loc)
        row_lookup = self.split == 1 and self.window[0] == 1 and len(terms) == 1  # a lookup of whole rows:
        if checks and (not row_lookup or self.bounds == "drop"):  # the DMA's own bounds check is the index's
            valid = checks[0]
            for check in checks[1:]:
                valid = _and(valid, check, loc)
            valid = _spread(valid, shape, range(len(self.batch_dims)), loc)
            row = ir.node(Op.SELECT, [valid, row, _splat(self.rows, shape, loc)], shape, ROW, loc)
        return ir.node(Op.RESHAPE, [row], (self.count,), ROW, loc)

    def _component(self, k: int) -> Node:
        """Index component k over the batch dims, in int32."""
        indices, loc = self.indices, self.node.loc
        batch = tuple(indices.shape[d] for d in self.batch_dims)
        vector_dim = self.a["index_vector_dim"]
        if vector_dim < len(indices.shape):
            start = [0] * len(indices.shape)
            limit = list(indices.shape)
            start[vector_dim], limit[vector_dim] = k, k + 1
            sliced = tuple(limit[d] - start[d] for d in range(len(limit)))
            indices = ir.node(Op.SLICE, [indices], sliced, indices.dtype, loc, start=tuple(start), limit=tuple(limit),
                            strides=(1,) * len(limit))
            indices = ir.node(Op.RESHAPE, [indices], batch, indices.dtype, loc)
        if indices.dtype != ROW:
            held, row = np.iinfo(indices.dtype.numpy), np.iinfo(ROW.numpy)
            if held.min < row.min or held.max > row.max:  # int64, uint32, uint64: values out of range stay so
                low, high = (_splat(v, batch, loc, indices.dtype) for v in (max(held.min, -1), row.max))
                indices = ir.node(Op.CLAMP, [low, indices, high], batch, indices.dtype, loc)
            indices = ir.node(Op.CONVERT, [indices], batch, ROW, loc)
        return indices


def _splat(value, shape, loc, dtype=ROW) -> Node:
    return ir.splat(value, shape, dtype, loc)


def _scaled(x: Node, factor: int, loc) -> Node:
    return x if factor == 1 else ir.node(Op.MULTIPLY, [x, _splat(factor, x.shape, loc)], x.shape, ROW, loc)


def _spread(x: Node, shape, dims, loc) -> Node:
    dims = tuple(dims)
    if x.shape == tuple(shape):
        return x
    return ir.node(Op.BROADCAST_IN_DIM, [x], shape, x.dtype, loc, dims=dims)


def _compare(x: Node, value: int, direction: str, loc) -> Node:
    return ir.node(Op.COMPARE, [x, _splat(value, x.shape, loc)], x.shape, DType.BOOL, loc, direction=direction)


def _and(a: Node, b: Node, loc) -> Node:
    return ir.node(Op.AND, [a, b], a.shape, DType.BOOL, loc)
