"""stablehlo.select_and_scatter (the gradient of JAX's max and min pooling) as elementwise IR.

The op chooses one element of every window of the operand (the first valid one, replaced by each later one
the `select` comparison does not keep) and adds the window's source value at the chosen position. Windows
are read as W strided slices of the padded operand, one per window offset in row-major order, so the choice is
a running select over W tensors of the source's shape, and each offset's share of the source goes back to
its positions by an interior padding (the positions its windows start at). Padding is never chosen: only
positions inside the operand are valid, as in XLA's implementation.
"""
from __future__ import annotations

import itertools

import numpy as np

from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.isa import DType


def select_and_scatter(operand: Node, source: Node, init: Node, keep: str, window: tuple, strides: tuple,
                       padding: tuple, loc) -> Node:
    """The result of scattering `source` by adding at the positions of `operand` that `keep` (a comparison,
    "GE" for max pooling: the chosen value is kept while chosen >= candidate) chooses in each window."""
    rank, out = len(operand.shape), source.shape
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(operand.shape, padding))
    wide = _padded(operand, padding, loc)
    offsets = list(itertools.product(*(range(w) for w in window)))
    chosen_value = chosen = seen = None
    for k, offset in enumerate(offsets):
        value = ir.node(Op.SLICE, [wide], out, operand.dtype, loc, start=offset,
                        limit=tuple(o + (n - 1) * s + 1 for o, n, s in zip(offset, out, strides)), strides=strides)
        valid = _valid(offset, operand.shape, out, strides, padding, loc)
        if chosen is None:
            chosen_value, chosen, seen = value, ir.splat(0, out, DType.I32, loc), valid
            continue
        kept = ir.node(Op.COMPARE, [chosen_value, value], out, DType.BOOL, loc, direction=keep)
        take = _not(kept, loc) if seen is None else ir.node(Op.OR, [_not(seen, loc), _not(kept, loc)], out,
                                                              DType.BOOL, loc)
        if valid is not None:
            take = ir.node(Op.AND, [valid, take], out, DType.BOOL, loc)
        chosen_value = ir.node(Op.SELECT, [take, value, chosen_value], out, operand.dtype, loc)
        chosen = ir.node(Op.SELECT, [take, ir.splat(k, out, DType.I32, loc), chosen], out, DType.I32, loc)
        if seen is not None:
            seen = None if valid is None else ir.node(Op.OR, [seen, valid], out, DType.BOOL, loc)
    zero = ir.splat(0, (), source.dtype, loc)
    result = ir.node(Op.BROADCAST_IN_DIM, [init], padded, source.dtype, loc, dims=())
    for k in reversed(range(len(offsets))):  # later windows' offsets first: each position sums in window order
        share = ir.node(Op.COMPARE, [chosen, ir.splat(k, out, DType.I32, loc)], out, DType.BOOL, loc, direction="EQ")
        if seen is not None:
            share = ir.node(Op.AND, [share, seen], out, DType.BOOL, loc)
        part = ir.node(Op.SELECT, [share, source, ir.splat(0, out, source.dtype, loc)], out, source.dtype, loc)
        offset = offsets[k]
        high = tuple(p - (o + (n - 1) * s + 1) for p, o, n, s in zip(padded, offset, out, strides))
        placed = ir.node(Op.PAD, [part, zero], padded, source.dtype, loc, low=offset, high=high,
                         interior=tuple(s - 1 for s in strides))
        result = ir.node(Op.ADD, [result, placed], padded, source.dtype, loc)
    if padded == operand.shape:
        return result
    return ir.node(Op.SLICE, [result], operand.shape, source.dtype, loc, start=tuple(lo for lo, _ in padding),
                   limit=tuple(lo + n for (lo, _), n in zip(padding, operand.shape)), strides=(1,) * rank)


def _padded(x: Node, padding: tuple, loc) -> Node:
    if all(lo == 0 and hi == 0 for lo, hi in padding):
        return x
    shape = tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, padding))
    return ir.node(Op.PAD, [x, ir.splat(0, (), x.dtype, loc)], shape, x.dtype, loc, low=tuple(lo for lo, _ in padding),
                   high=tuple(hi for _, hi in padding), interior=(0,) * len(shape))


def _valid(offset, shape, out, strides, padding, loc) -> Node | None:
    """Which windows' elements at `offset` lie inside the operand (None: all of them); a constant over the
    padded dims, broadcast over the others."""
    dims, masks = [], []
    for d, (o, n, s, (lo, _)) in enumerate(zip(offset, out, strides, padding)):
        position = o + np.arange(n) * s - lo
        inside = (position >= 0) & (position < shape[d])
        if not inside.all():
            dims.append(d)
            masks.append(inside)
    if not dims:
        return None
    mask = np.ones([out[d] for d in dims], bool)
    for i, inside in enumerate(masks):
        mask &= inside.reshape([-1 if j == i else 1 for j in range(len(dims))])
    small = ir.node(Op.CONSTANT, [], mask.shape, DType.BOOL, loc, value=mask)
    return ir.node(Op.BROADCAST_IN_DIM, [small], out, DType.BOOL, loc, dims=tuple(dims))


def _not(x: Node, loc) -> Node:
    return ir.node(Op.NOT, [x], x.shape, DType.BOOL, loc)

