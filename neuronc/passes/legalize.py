"""Legalisation: rewrite StableHLO-level ops into the few kernel forms codegen knows.

After this pass a graph holds only: parameters and constants, elementwise ops whose operands have
the result's shape (or are splat constants), RESHAPE (an alias, no data moves), VIEW (copy of an
affine strided view: transposes, broadcasts, slices, im2col patches, pooling windows), PAD,
CONCATENATE, MATMUL ([B,M,K] x [B,K,N]), REDUCE_LAST ([R,C] -> [R]), TOPK over the last dim of
[R, n], and GATHER_ROWS / SCATTER_ROWS (from passes/indexing.py, which runs first).

Convolutions become im2col + MATMUL, pooling becomes windows + REDUCE_LAST, dot_general becomes
transposes + MATMUL, general reductions become a transpose + REDUCE_LAST. Each is a named rewrite rule
(passes/rewrite.py); the pass runs them with canonicalize's simplifications (reshape chains and no-ops the
lowering makes) to a fixed point.
"""
from __future__ import annotations

import math


import numpy as np

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node, Op
from neuronc.isa import DType
from neuronc.neff.program import DebugLoc
from neuronc.op_facts import REDUCTIONS
from neuronc.passes.canonicalize import SIMPLIFY, fold_constant
from neuronc.passes.context import PassContext
from neuronc.passes.integer_matmul import exact_integer_dot
from neuronc.passes.rewrite import Rule, rewrite

REDUCE_IDENTITY = {kind: r.identity for kind, r in REDUCTIONS.items()}
REDUCE_COMBINE = {kind: Op[r.combine] for kind, r in REDUCTIONS.items()}


def dense_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def reshaped_strides(shape: tuple, strides: tuple, new_shape: tuple) -> tuple | None:
    """Strides that read a strided view of `shape` as `new_shape` in row-major order, or None if
    no single set of strides can (the reshape would need a copy). As numpy's no-copy reshape: the old and new
    dims (size-1 dims aside) are grouped into runs of equal product; a run's old dims must be contiguous among
    themselves, and its new dims step through them from the run's innermost stride."""
    if math.prod(shape) != math.prod(new_shape):
        return None
    if math.prod(shape) == 0:
        return dense_strides(new_shape)  # nothing is read
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    new = [k for k, n in enumerate(new_shape) if n != 1]
    result, i, j = [0] * len(new_shape), 0, 0
    while i < len(old):
        first_old, first_new, size_old, size_new = i, j, old[i][0], new_shape[new[j]]
        i, j = i + 1, j + 1
        while size_old != size_new:  # equal products overall: the run closes before either list ends
            if size_old < size_new:
                size_old, i = size_old * old[i][0], i + 1
            else:
                size_new, j = size_new * new_shape[new[j]], j + 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(first_old, i - 1)):
            return None
        stride = old[i - 1][1]
        for k in reversed(new[first_new:j]):
            result[k], stride = stride, stride * new_shape[k]
    return tuple(result)

def view(x: Node, shape: tuple, strides: tuple, offset: int = 0, loc: DebugLoc | None = None) -> Node:
    if tuple(shape) == x.shape and tuple(strides) == dense_strides(x.shape) and offset == 0:
        return x
    return ir.node(Op.VIEW, [x], shape, x.dtype, loc or x.loc, offset=int(offset), strides=tuple(int(s) for s in strides))


def reshape(x: Node, shape: tuple, loc: DebugLoc | None = None) -> Node:
    shape = tuple(int(s) for s in shape)
    if shape == x.shape:
        return x
    if x.op is Op.RESHAPE:
        x = x.inputs[0]
    return ir.node(Op.RESHAPE, [x], shape, x.dtype, loc or x.loc)


def transpose(x: Node, perm: tuple, loc: DebugLoc | None = None) -> Node:
    strides = dense_strides(x.shape)
    return view(x, [x.shape[p] for p in perm], [strides[p] for p in perm], 0, loc)


def splat_value(node: Node) -> float | int | bool | None:
    """The value of a constant holding one value (a splat, or any one-element tensor), else None."""
    if node.scalar is not None or node.op is not Op.CONSTANT:
        return node.scalar
    value = node.attrs["value"]
    return value.reshape(-1)[0].item() if value.size == 1 else None


def broadcast_to(x: Node, shape: tuple, loc: DebugLoc | None = None) -> Node:
    if x.shape == tuple(shape):
        return x
    if x.shape == ():
        return _broadcast(x, (x,), dims=(), shape=tuple(shape), loc=loc)
    raise AssertionError(f"cannot broadcast {x.shape} to {shape}")


# rules -----------------------------------------------------------------------------------------


def _broadcast(node, inputs, dims=None, shape=None, loc=None):
    x = inputs[0]
    dims = node.attrs["dims"] if dims is None else dims
    shape = node.shape if shape is None else shape
    loc = loc or node.loc
    if splat_value(x) is not None and x.size == 1:
        return ir.node(Op.CONSTANT, [], shape, x.dtype, loc, value=np.array(splat_value(x), x.dtype.numpy))
    xs = dense_strides(x.shape)
    strides = [0] * len(shape)
    for i, d in enumerate(dims):
        if x.shape[i] == shape[d]:
            strides[d] = xs[i]
    return view(x, shape, strides, 0, loc)


def _transpose(node, inputs):
    return transpose(inputs[0], node.attrs["perm"], node.loc)


def _slice(node, inputs):
    x = inputs[0]
    xs = dense_strides(x.shape)
    a = node.attrs
    offset = sum(s * st for s, st in zip(a["start"], xs))
    return view(x, node.shape, [st * step for st, step in zip(xs, a["strides"])], offset, node.loc)


def _reverse(node, inputs):
    """A reversal is a view with negative strides, starting at the last element of each dim."""
    x = inputs[0]
    strides = list(dense_strides(x.shape))
    offset = 0
    for d in node.attrs["dims"]:
        offset += (x.shape[d] - 1) * strides[d]
        strides[d] = -strides[d]
    return view(x, x.shape, strides, offset, node.loc)


def _pad(node, inputs):
    if len(inputs) == 1:  # legal already: the padding value is an attribute
        return None
    x, value = inputs
    pad_value = splat_value(value)
    a = node.attrs
    if pad_value is None:  # a run-time value (JAX's lax.pad of a traced scalar): x padded with 0, then selected
        zero = ir.splat(0, (), x.dtype, node.loc)
        padded = ir.node(Op.PAD, [x, zero], node.shape, node.dtype, node.loc, **a)
        spread = ir.node(Op.BROADCAST_IN_DIM, [value], node.shape, node.dtype, node.loc, dims=())
        return ir.node(Op.SELECT, [_padded_positions(x.shape, node.shape, a, node.loc), padded, spread], node.shape,
                       node.dtype, node.loc)
    return pad(x, pad_value, a["low"], a["high"], a["interior"], node.loc)


def _padded_positions(shape: tuple, result: tuple, attrs: dict, loc) -> Node:
    """Bool [result]: where a pad's operand elements land (one constant vector per dim, broadcast and and-ed)."""
    mask = None
    for d, (n, size, lo, step) in enumerate(zip(shape, result, attrs["low"], attrs["interior"])):
        positions = lo + np.arange(n) * (step + 1)
        vector = np.zeros(size, bool)
        vector[positions[(positions >= 0) & (positions < size)]] = True
        if vector.all():
            continue
        spread = ir.node(Op.BROADCAST_IN_DIM, [ir.node(Op.CONSTANT, [], (size,), DType.BOOL, loc, value=vector)],
                         result, DType.BOOL, loc, dims=(d,))
        mask = spread if mask is None else ir.node(Op.AND, [mask, spread], result, DType.BOOL, loc)
    return mask if mask is not None else ir.splat(True, result, DType.BOOL, loc)


def pad(x: Node, value: float, low: tuple, high: tuple, interior: tuple | None = None,
        loc: DebugLoc | None = None) -> Node:
    """x padded with `value`: `low`/`high` elements at each end (negative crops), `interior`
    elements between neighbours."""
    low, high = list(low), list(high)
    interior = tuple(interior or (0,) * len(x.shape))
    if any(v < 0 for v in low + high) and any(interior):  # StableHLO crops after the interior padding: so here
        grown = pad(x, value, [max(0, v) for v in low], [max(0, v) for v in high], interior, loc)
        return pad(grown, value, [min(0, v) for v in low], [min(0, v) for v in high], None, loc)
    if any(v < 0 for v in low + high):
        xs = dense_strides(x.shape)
        start = [max(0, -lo) for lo in low]
        limit = [s - max(0, -hi) for s, hi in zip(x.shape, high)]
        x = view(x, [b - a for a, b in zip(start, limit)], xs, sum(a * s for a, s in zip(start, xs)), loc)
        low, high = [max(0, v) for v in low], [max(0, v) for v in high]
    if not any(low) and not any(high) and not any(interior):
        return x
    shape = [lo + hi + s + max(0, s - 1) * it for s, lo, hi, it in zip(x.shape, low, high, interior)]
    return ir.node(Op.PAD, [x], shape, x.dtype, loc or x.loc, value=float(value), low=tuple(low),
                   high=tuple(high), interior=interior)


def _clamp(node, inputs):
    lo, x, hi = inputs
    lo, hi = broadcast_to(lo, x.shape, node.loc), broadcast_to(hi, x.shape, node.loc)
    low = ir.node(Op.MAXIMUM, [x, lo], node.shape, node.dtype, node.loc)
    return ir.node(Op.MINIMUM, [low, hi], node.shape, node.dtype, node.loc)


def _select(node, inputs):
    if all(i.shape == node.shape for i in inputs):
        return None
    inputs = [broadcast_to(i, node.shape, node.loc) for i in inputs]
    return ir.node(Op.SELECT, inputs, node.shape, node.dtype, node.loc)


def _combine_init(node, result, init):
    kind = node.attrs["kind"]
    init_value = splat_value(init)
    if init_value is not None and init_value == REDUCE_IDENTITY[kind]:
        return result
    return ir.node(REDUCE_COMBINE[kind], [result, broadcast_to(init, result.shape, node.loc)], result.shape, result.dtype, node.loc)


def _reduce(node, inputs):
    x, init = inputs
    dims = tuple(sorted(node.attrs["dims"]))
    kept = [d for d in range(len(x.shape)) if d not in dims]
    rows = int(math.prod([x.shape[d] for d in kept]))
    cols = int(math.prod([x.shape[d] for d in dims]))
    if cols == 0 and node.attrs["kind"] != "mul":
        raise _unsupported(node, "a reduction over an empty dimension")
    xt = transpose(x, kept + list(dims), node.loc)
    reduced = _reduce_rows(node, reshape(xt, (rows, cols), node.loc))
    return _combine_init(node, reshape(reduced, node.shape, node.loc), init)


def _reduce_window(node, inputs):
    x, init = inputs
    a = node.attrs
    init_value = splat_value(init)
    if init_value is None:
        raise _unsupported(node, "a pooling window with a non-constant initial value")
    padded = pad(x, init_value, [lo for lo, _ in a["padding"]], [hi for _, hi in a["padding"]], None, node.loc)
    ps = dense_strides(padded.shape)
    shape = list(node.shape) + list(a["window"])
    strides = [st * s for st, s in zip(ps, a["strides"])] + list(ps)
    patches = view(padded, shape, strides, 0, node.loc)
    rows, cols = node.size, int(math.prod(a["window"]))
    reduced = _reduce_rows(node, reshape(patches, (rows, cols), node.loc))
    return _combine_init(node, reshape(reduced, node.shape, node.loc), init)


def _reduce_rows(node, x: Node) -> Node:
    """x [rows, cols] reduced along each row as `node` reduces (its kind, its dtype): a REDUCE_LAST, or for a
    product a binary tree of elementwise multiplies, since TENSOR_REDUCE has no multiply (the first half of the
    columns times the second, ceil(log2 cols) times, an odd count padded with 1; the multiplies fuse into
    elementwise kernels). The tree's order is not a sequential product's: prod rounds as a pairwise sum does."""
    rows, count = x.shape
    if node.attrs["kind"] != "mul":
        return ir.node(Op.REDUCE_LAST, [x], (rows,), node.dtype, node.loc, kind=node.attrs["kind"])
    if count == 0:
        return ir.node(Op.CONSTANT, [], (rows,), node.dtype, node.loc, value=np.array(1, node.dtype.numpy))
    while count > 1:
        if count % 2:
            x, count = pad(x, 1, (0, 0), (0, 1), None, node.loc), count + 1
        half = count // 2
        halves = [view(x, (rows, half), (count, 1), start, node.loc) for start in (0, half)]
        x, count = ir.node(Op.MULTIPLY, halves, (rows, half), x.dtype, node.loc), half
    return reshape(x, (rows,), node.loc)


def _dot_general(node, inputs):
    lhs, rhs = inputs
    a = node.attrs
    lb, lc, rb, rc = list(a["lhs_batch"]), list(a["lhs_contract"]), list(a["rhs_batch"]), list(a["rhs_contract"])
    lfree = [d for d in range(len(lhs.shape)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs.shape)) if d not in rb + rc]
    size = lambda x, dims: int(math.prod([x.shape[d] for d in dims]))  # noqa: E731
    b, m, k, n = size(lhs, lb), size(lhs, lfree), size(lhs, lc), size(rhs, rfree)
    lhs3 = reshape(transpose(lhs, lb + lfree + lc, node.loc), (b, m, k), node.loc)
    rhs3 = reshape(transpose(rhs, rb + rc + rfree, node.loc), (b, k, n), node.loc)
    if not (node.dtype.is_float and lhs.dtype.is_float and rhs.dtype.is_float):  # StableHLO-level pieces, lowered
        product = exact_integer_dot(lhs3, rhs3, node.dtype, node.loc)  # by the next sweep
    else:
        product = ir.node(Op.MATMUL, [lhs3, rhs3], (b, m, n), node.dtype, node.loc, k=k)
    return reshape(product, node.shape, node.loc)


def _convolution(node, inputs):
    x, w = inputs
    a = node.attrs
    spatial = len(x.shape) - 2
    groups = a["groups"]
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    kernel = w.shape[2:]
    out_spatial = node.shape[2:]
    og = o // groups
    interior = [0, 0] + [d - 1 for d in a["lhs_dilation"]]
    low = [0, 0] + [lo for lo, _ in a["padding"]]
    high = [0, 0] + [hi for _, hi in a["padding"]]
    padded = pad(x, 0.0, low, high, interior, node.loc)
    sn, sc, *ss = dense_strides(padded.shape)
    shape = [groups, n, *out_spatial, cg, *kernel]
    strides = [cg * sc, sn, *[s * st for s, st in zip(ss, a["strides"])], sc,
               *[s * d for s, d in zip(ss, a["rhs_dilation"])]]
    positions = int(math.prod(out_spatial))
    window = cg * int(math.prod(kernel))
    patches = reshape(view(padded, shape, strides, 0, node.loc), (groups, n * positions, window), node.loc)
    weights = transpose(reshape(w, (groups, og, window), node.loc), (0, 2, 1), node.loc)
    product = ir.node(Op.MATMUL, [patches, weights], (groups, n * positions, og), node.dtype, node.loc, k=window)
    # product[g, (n, p...), o] -> result[n, g * og + o, p...]
    spatial_strides = [og * s for s in dense_strides(out_spatial)]
    result = view(product, (n, groups, og, *out_spatial), (positions * og, n * positions * og, 1, *spatial_strides),
                  0, node.loc)
    assert len(spatial_strides) == spatial
    return reshape(result, node.shape, node.loc)


def _unsupported(node, what: str) -> NeuronCompileError:
    return NeuronCompileError(f"{what} is not supported yet", location=str(node.loc),
                              hint="rewrite this operation, or keep it outside the compiled region")


def _integer_abs(node, inputs):
    """|x| of an integer as max(x, -x), in the integers: ABS is a Scalar-engine function, which computes in fp32
    (|2**24 + 1| was 2**24). -x wraps at the type's minimum, as eager's abs does; an unsigned |x| is x."""
    x = inputs[0]
    if node.dtype.is_float:
        return None
    if x.dtype == DType.BOOL or x.dtype.numpy.kind == "u":
        return x
    return ir.node(Op.MAXIMUM, [x, ir.node(Op.NEGATE, [x], x.shape, x.dtype, node.loc)], node.shape, node.dtype,
                   node.loc)


def _topk(node, inputs):
    """Along the last dim of a [rows, n] matrix, largest first (an ascending sort is of the negation, in int32 for
    narrower integers: negating a uint8 wraps, and int8's -128 is its own negation)."""
    x = inputs[0]
    dim, last = node.attrs["dimension"], len(x.shape) - 1
    if len(x.shape) == 2 and dim == 1 and node.attrs["descending"]:  # legal already
        return None
    if not node.attrs["descending"]:
        if not x.dtype.is_float and x.dtype.itemsize < 4:  # wider keys come here as int32 digits or order keys
            x = ir.node(Op.CONVERT, [x], x.shape, DType.I32, node.loc)
        x = ir.node(Op.NEGATE, [x], x.shape, x.dtype, node.loc)
    perm = [d for d in range(len(x.shape)) if d != dim] + [dim]
    rows = reshape(transpose(x, perm, node.loc), (x.size // x.shape[dim], x.shape[dim]), node.loc)
    k = node.attrs["k"]
    top = ir.node(Op.TOPK, [rows], (rows.shape[0], k), node.dtype, node.loc, dimension=1, k=k, descending=True)
    moved = reshape(top, [node.shape[d] for d in perm], node.loc)
    return transpose(moved, [perm.index(d) for d in range(len(perm))], node.loc) if dim != last else moved


LEGALIZE = (
    Rule("broadcast_as_view", frozenset({Op.BROADCAST_IN_DIM}), _broadcast),
    Rule("transpose_as_view", frozenset({Op.TRANSPOSE}), _transpose),
    Rule("slice_as_view", frozenset({Op.SLICE}), _slice),
    Rule("pad_value_as_attribute", frozenset({Op.PAD}), _pad),
    Rule("reverse_as_view", frozenset({Op.REVERSE}), _reverse),
    Rule("clamp_as_max_min", frozenset({Op.CLAMP}), _clamp),
    Rule("integer_abs_as_max", frozenset({Op.ABS}), _integer_abs),
    Rule("select_of_whole_operands", frozenset({Op.SELECT}), _select),
    Rule("reduce_as_reduce_last", frozenset({Op.REDUCE}), _reduce),
    Rule("pooling_as_reduce_last", frozenset({Op.REDUCE_WINDOW}), _reduce_window),
    Rule("dot_general_as_matmul", frozenset({Op.DOT_GENERAL}), _dot_general),
    Rule("convolution_as_im2col_matmul", frozenset({Op.CONVOLUTION}), _convolution),
    Rule("topk_along_rows", frozenset({Op.TOPK}), _topk),
)


def legalize(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """The pass: the lowering rules and the simplifications, to a fixed point; then each output gets a buffer
    of its own. Constants are folded too: a rule may compute on a constant (a sort of constant keys negates them),
    and an elementwise kernel of constants alone has no tile to compute from."""
    return _outputs_own_buffers(rewrite(graph, LEGALIZE + SIMPLIFY + (fold_constant,), ctx))


def _outputs_own_buffers(graph: ir.Graph) -> ir.Graph:
    """Each output gets a buffer of its own: copy outputs that alias a parameter, a constant, or
    another output (a RESHAPE aliases its operand)."""
    outputs, seen = [], set()
    for out in graph.outputs:
        root = ir.unreshaped(out)
        if root.op in (Op.PARAMETER, Op.CONSTANT) or root in seen:
            out = ir.node(Op.VIEW, [out], out.shape, out.dtype, out.loc, offset=0, strides=dense_strides(out.shape))
            root = out
        seen.add(root)
        outputs.append(out)
    return ir.Graph(graph.params, outputs, graph.name)
