"""Canonicalisation: make the imported graph small and regular before anything is decided about it.

Named rewrite rules (passes/rewrite.py), run together to a fixed point by `canonicalize`:
* `fold_constant`: evaluate a node whose inputs are all constants (with the op's numpy semantics from the
  op-facts table, as the device computes it), keeping splats (one value broadcast to a shape) as 0-d arrays.
* the simplifications (`SIMPLIFY`, which legalize runs too): drop no-op converts, reshapes, transposes and
  broadcasts and identities (x + 0, x * 1, x / 1); merge reshape chains; a gather of consecutive constant rows
  is a slice; slice before broadcasting (a slice of a broadcast is the broadcast of a slice, and never
  materialises the large tensor); a constant of one repeated value is a splat; a contraction over no elements
  (K = 0) is a zero splat; a reduction over dims of size 1 only is a reshape of its operand, and the size-1 dims
  of a reduction over others are dropped from it.
* `narrow_matmul_operands`: a matmul of operands widened from one narrow float type (bf16 x bf16 in fp32,
  as decompositions write a bf16 `addmm`) reads the narrow operands: the Tensor engine multiplies them
  exactly and accumulates in fp32, so the result is the same, at the narrow type's rate and bytes.
* `raise_erf`, `drop_clamp_of_erf`, `raise_gelu`: fold torch-mlir's expansion of erf (a rational polynomial)
  back into one ERF, and the erf form of GELU into one GELU: single Scalar-engine instructions.

`demote_f64` runs first, alone: the NeuronCore has no fp64; decompositions introduce f64 arithmetic on constants
and statistics (e.g. layer-norm variance). Like neuronx-cc, compute it in fp32. A float64 input or output is
refused unless `--auto-cast fp64-to-fp32` (passes/auto_cast.py) accepts it as an fp32 one.
"""
from __future__ import annotations

import math

import numpy as np

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.isa import ERF_F32_CLAMP, ERF_F32_P, ERF_F32_Q, DType, holds_floats
from neuronc.ir import Op
from neuronc.op_facts import REDUCTIONS
from neuronc.passes.context import PassContext
from neuronc.passes.rewrite import rule, rewrite


def demote_f64(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """The pass: every float64 node in float32. A program taking or returning float64 is refused, unless
    `--auto-cast fp64-to-fp32` accepts it: its float64 inputs and outputs are then fp32 ones (the host casts)."""
    wide = [p for p in graph.params if p.dtype == DType.F64] + [o for o in graph.outputs if o.dtype == DType.F64]
    if wide and not ctx.cast.fp64:
        raise NeuronCompileError(
            "the NeuronCore has no float64; this graph takes or returns float64 tensors "
            "(--auto-cast fp64-to-fp32 computes them in fp32)",
            problems=[f"{n.attrs.get('name', 'output')}: {n.shape} float64" for n in wide],
            hint="compile with --auto-cast fp64-to-fp32 (NEURON_CC_FLAGS, or torch.compile's "
                 "options={'auto_cast': 'fp64-to-fp32'}) to compute it in fp32 with float64 inputs and outputs "
                 "cast at the boundary; or convert inputs and the model to float32 (model.float(), x.float())",
        )

    return rewrite(graph, [demote_float64], ctx)


@rule()
def demote_float64(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A float64 node computed in float32 (a float64 constant's or weight's value rounded to float32)."""
    if node.dtype != DType.F64:
        return None
    attrs = dict(node.attrs)
    if node.op is Op.CONSTANT:
        attrs["value"] = node.attrs["value"].astype(np.float32)
    if node.op is Op.PARAMETER and attrs.get("data") is not None:
        attrs["data"] = np.asarray(attrs["data"]).astype(np.float32)
    return ir.node(node.op, inputs, node.shape, DType.F32, node.loc, **attrs)


# numpy evaluation of the ops constant folding handles ------------------------------------------


def _computable(value: np.ndarray) -> np.ndarray:
    """Floats narrower than fp32 widened to fp32, as the engines compute them (the result is rounded back)."""
    return value.astype(np.float32) if holds_floats(value.dtype) and value.dtype.itemsize < 4 else value


def _evaluate(node: ir.Node, values: list):
    """Value of `node` given its inputs' values (0-d arrays are splats); None if not foldable."""
    op, a = node.op, node.attrs
    out_dtype = node.dtype.numpy
    if op is Op.IOTA:
        shape = [1] * len(node.shape)
        shape[a["dimension"]] = node.shape[a["dimension"]]
        return np.broadcast_to(np.arange(node.shape[a["dimension"]]).reshape(shape), node.shape).astype(out_dtype)
    splat = all(v.ndim == 0 for v in values)
    if op in ir.ELEMENTWISE:  # the op's semantics from the op-facts table: what the device computes
        fact = ir.facts(op)
        with np.errstate(all="ignore"):
            if op is Op.COMPARE:
                result = fact.numpy(*values, a["direction"])
            else:
                result = fact.semantics(*map(_computable, values))
            result = np.asarray(result)
            if not splat:
                result = result.reshape(node.shape) if result.size == node.size else np.broadcast_to(result, node.shape)
            return result.astype(out_dtype)  # inf/NaN to an integer as the runtime's copy converts it, silently
    if op is Op.BITCAST:
        return values[0].view(out_dtype)  # the same bytes (a splat stays a splat)
    if op in (Op.RESHAPE, Op.BROADCAST_IN_DIM, Op.TRANSPOSE):
        x = values[0]
        if x.ndim == 0:  # a splat stays a splat
            return x.astype(out_dtype)
        if op is Op.RESHAPE:
            return x.reshape(node.shape)
        if op is Op.TRANSPOSE:
            return np.transpose(x, a["perm"])
        shape = [1] * len(node.shape)
        for i, d in enumerate(a["dims"]):
            shape[d] = x.shape[i]
        return np.broadcast_to(x.reshape(shape), node.shape).copy()
    return None


def _full(value: np.ndarray, shape) -> np.ndarray:
    return np.broadcast_to(value, shape) if value.ndim == 0 else value


FOLD_MAX_ELEMENTS = 1 << 16  # a constant computed from full (not splat) constants is folded up to this size


@rule(*ir.ELEMENTWISE, Op.IOTA, Op.RESHAPE, Op.BROADCAST_IN_DIM, Op.TRANSPOSE, Op.BITCAST)
def fold_constant(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A node whose inputs are all constants, evaluated."""
    if not all(i.op is Op.CONSTANT for i in inputs):
        return None
    values = [i.attrs["value"] for i in inputs]
    if node.op in (Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_IN_DIM) and values[0].ndim != 0:
        values = [_full(values[0], inputs[0].shape)]
    elif not all(v.ndim == 0 for v in values):
        values = [_full(v, i.shape) for v, i in zip(values, inputs)]
    if node.size > FOLD_MAX_ELEMENTS and not all(v.ndim == 0 for v in values):
        return None
    value = _evaluate(node, values)
    if value is None:
        return None
    value = np.ascontiguousarray(value) if value.ndim else value  # (ascontiguousarray makes a splat 1-d)
    return ir.node(Op.CONSTANT, [], node.shape, node.dtype, node.loc, value=value)


def _is_identity(value, identity, combine: Op, dtype: DType) -> bool:
    """Whether `value` is the identity of `combine` on `dtype`. For floats the additive identity is -0.0, not
    +0.0: (-0.0) + (+0.0) is +0.0 (IEEE 754), so dropping an added +0.0 would turn eager's +0.0 into -0.0."""
    if value != identity:
        return False
    return not (combine is Op.ADD and dtype.is_float and not np.signbit(value))


# x op identity == x: (op, which operand may be the identity, the identity's value; x - (+0.0) is x for every x)
_IDENTITIES = {
    Op.ADD: ((0, 0.0), (1, 0.0)),
    Op.SUBTRACT: ((1, 0.0),),
    Op.MULTIPLY: ((0, 1.0), (1, 1.0)),
    Op.DIVIDE: ((1, 1.0),),
}


@rule(*_IDENTITIES)
def drop_identity_operand(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1: x (for floats x + (-0.0), not x + (+0.0): see `_is_identity`)."""
    for position, identity in _IDENTITIES[node.op]:
        constant, other = inputs[position], inputs[1 - position]
        if constant.scalar is not None and _is_identity(constant.scalar, identity, node.op, node.dtype) \
                and other.shape == node.shape and other.dtype == node.dtype:
            return other
    return None


@rule(Op.CONVERT)
def drop_noop_convert(node: ir.Node, inputs: tuple) -> ir.Node | None:
    return inputs[0] if inputs[0].dtype == node.dtype else None


@rule(Op.RESHAPE, Op.BROADCAST_IN_DIM)
def drop_noop_reshape(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A reshape to the same shape, a broadcast to the same shape along the same dims."""
    x = inputs[0]
    if x.shape == node.shape and (node.op is Op.RESHAPE or tuple(node.attrs["dims"]) == tuple(range(len(x.shape)))):
        return x
    return None


@rule(Op.TRANSPOSE)
def drop_identity_transpose(node: ir.Node, inputs: tuple) -> ir.Node | None:
    return inputs[0] if tuple(node.attrs["perm"]) == tuple(range(len(node.shape))) else None


@rule(Op.RESHAPE)
def merge_reshapes(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A reshape of a reshape is one reshape."""
    x = inputs[0]
    return ir.node(Op.RESHAPE, x.inputs, node.shape, node.dtype, node.loc) if x.op is Op.RESHAPE else None


@rule(Op.GATHER_ROWS)
def gather_of_consecutive_rows_as_slice(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A gather of consecutive rows known at compile time (GPT-2's positions, an arange) is a slice of the
    table, which kernels read in place; rows outside the table stay a gather (its run-time error)."""
    table, rows = inputs
    if rows.op is not Op.CONSTANT or node.shape[0] < 1:
        return None
    first = int(np.asarray(rows.attrs["value"]).reshape(-1)[0])
    wanted = np.arange(first, first + node.shape[0])
    if first < 0 or wanted[-1] >= table.shape[0] or not np.array_equal(
            np.broadcast_to(rows.attrs["value"], rows.shape), wanted):
        return None
    return ir.node(Op.SLICE, [table], node.shape, node.dtype, node.loc, start=(first, 0),
                   limit=(first + node.shape[0], table.shape[1]), strides=(1, 1))


@rule(Op.SLICE)
def slice_before_broadcast(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """slice(broadcast_in_dim(x)) as broadcast_in_dim(slice(x)): x's broadcast dims are read at [0:1]."""
    broadcast = inputs[0]
    if broadcast.op is not Op.BROADCAST_IN_DIM:
        return None
    x, dims = broadcast.inputs[0], broadcast.attrs["dims"]
    start, limit, strides = [], [], []
    for i, d in enumerate(dims):
        if x.shape[i] == 1:
            start, limit, strides = start + [0], limit + [1], strides + [1]
        else:
            start, limit = start + [node.attrs["start"][d]], limit + [node.attrs["limit"][d]]
            strides.append(node.attrs["strides"][d])
    shape = tuple(1 if x.shape[i] == 1 else node.shape[d] for i, d in enumerate(dims))
    if shape != x.shape:
        x = ir.node(Op.SLICE, [x], shape, x.dtype, node.loc, start=tuple(start), limit=tuple(limit),
                    strides=tuple(strides))
    return ir.node(Op.BROADCAST_IN_DIM, [x], node.shape, node.dtype, node.loc, dims=tuple(dims))


@rule(Op.CONSTANT)
def splat_uniform_constant(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A constant holding one value many times is a splat of it."""
    value = node.attrs["value"]
    if value.ndim == 0 or node.size <= 1:
        return None
    flat = value.reshape(-1)
    if not (flat == flat[0]).all():
        return None
    return ir.node(Op.CONSTANT, [], node.shape, node.dtype, node.loc, value=np.array(flat[0], value.dtype))


@rule(Op.DOT_GENERAL)
def empty_contraction_is_zero(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A product contracting over no elements ([M, 0] x [0, N]) is a zero splat: the sum of nothing. Its
    kernel would accumulate no tile into PSUM and then read it unwritten (the verifier refuses MATMUL k = 0)."""
    if node.size == 0 or all(inputs[0].shape[d] for d in node.attrs["lhs_contract"]):
        return None
    return ir.node(Op.CONSTANT, [], node.shape, node.dtype, node.loc, value=np.array(0, node.dtype.numpy))


def _reduction_init_is_identity(node: ir.Node, init: ir.Node) -> bool:
    value = init.attrs["value"] if init.op is Op.CONSTANT else None
    reduction = REDUCTIONS[node.attrs["kind"]]
    return value is not None and value.size == 1 and \
        _is_identity(value.reshape(-1)[0].item(), reduction.identity, Op[reduction.combine], node.dtype)


@rule(Op.REDUCE)
def reduce_over_unit_dims(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """A reduction over dims of size 1 only (`x.sum(0)` of a [1, ...] x) reads one element per result: it is x
    reshaped (then combined with the initial value if that is not the reduction's identity, and converted if the
    result's dtype differs), not a reduction of one-element rows (a REDUCE over 524,288 rows of one element was
    22 ms of a FlexAttention backward, docs/performance.md, issue 19). A reduction over other dims too drops
    its size-1 dims (x reshaped without them), so legalize moves no size-1 dim.

    Exact as the reduction rounds: one element accumulated in fp32 and rounded to its narrow type is the
    element; max/min/mul/and/or of the identity and x is x. A float sum's +0.0 initial value is not its identity
    (0 + (-0.0) is +0.0, eager's sum of one -0.0): it stays, added to the reshaped x."""
    x, init = inputs
    dims = tuple(node.attrs["dims"])
    unit = [d for d in dims if x.shape[d] == 1]
    if not unit or (len(unit) == len(dims) and init.shape != () and not _reduction_init_is_identity(node, init)):
        return None
    squeezed = tuple(s for d, s in enumerate(x.shape) if d not in unit)
    x = ir.node(Op.RESHAPE, [x], squeezed, x.dtype, node.loc)
    if len(unit) < len(dims):  # the other dims, numbered in the squeezed operand
        rest = tuple(d - sum(u < d for u in unit) for d in dims if d not in unit)
        return ir.node(Op.REDUCE, [x, init], node.shape, node.dtype, node.loc, **{**node.attrs, "dims": rest})
    if x.dtype != node.dtype:
        x = ir.node(Op.CONVERT, [x], node.shape, node.dtype, node.loc)
    if _reduction_init_is_identity(node, init):
        return x
    init = ir.node(Op.BROADCAST_IN_DIM, [init], node.shape, init.dtype, node.loc, dims=())
    return ir.node(Op[REDUCTIONS[node.attrs["kind"]].combine], [x, init], node.shape, node.dtype, node.loc)


# the simplifications: canonicalize runs them, and legalize, after it, for what its lowering makes trivial
SIMPLIFY = (drop_identity_operand, drop_noop_convert, drop_noop_reshape, drop_identity_transpose, merge_reshapes,
            gather_of_consecutive_rows_as_slice, slice_before_broadcast, splat_uniform_constant,
            empty_contraction_is_zero, reduce_over_unit_dims)


def simplify(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """The pass: the simplification rules, to a fixed point."""
    return rewrite(graph, SIMPLIFY, ctx)


_NARROW_FLOATS = (DType.BF16, DType.F16, DType.F8E4M3, DType.F8E5M2)


def _widened(x: ir.Node) -> ir.Node | None:
    return x.inputs[0] if x.op is Op.CONVERT and x.dtype is DType.F32 and x.inputs[0].dtype in _NARROW_FLOATS \
        else None


@rule(Op.DOT_GENERAL)
def narrow_matmul_operands(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """DOT_GENERAL(convert_f32(a), convert_f32(b)) with a and b of one narrow float type -> DOT_GENERAL(a, b)
    with the same fp32 result. Exact: widening is exact, a product of two narrow floats is exact in fp32,
    and the accumulation is fp32 either way (the emulator widens the operands itself)."""
    if node.dtype is not DType.F32:
        return None
    narrow = [_widened(x) for x in inputs]
    if None in narrow or len({x.dtype for x in narrow}) != 1:
        return None
    return ir.node(node.op, narrow, node.shape, node.dtype, node.loc, **node.attrs)


# erf, recognised ------------------------------------------------------------------------------
# StableHLO has no erf: torch-mlir expands chlo.erf into XLA's f32 rational approximation,
#   erf(x) ~ x * P(x^2) / Q(x^2) on x clamped to [-4, 4],
# about 30 elementwise ops per GELU. The Scalar engine computes erf in one instruction (with this
# very approximation, see isa.ERF_F32_P), so the expansion is folded back into ERF when its
# coefficients are exactly XLA's.


def _horner(node, x2) -> list | None:
    """Coefficients (highest power first) if `node` is c0*x2 (+c1)*x2 (+c2)... evaluated by Horner."""
    if node.op is Op.ADD:
        for inner, constant in (node.inputs, node.inputs[::-1]):
            c = constant.scalar
            if c is not None and inner.op is Op.MULTIPLY:
                head = _horner_product(inner, x2)
                if head is not None:
                    return head + [c]
        return None
    return _horner_product(node, x2)


def _horner_product(node, x2) -> list | None:
    if node.op is not Op.MULTIPLY:
        return None
    a, b = node.inputs
    other = b if a is x2 else a if b is x2 else None
    if other is None:
        return None
    c = other.scalar
    return [c] if c is not None else _horner(other, x2)


def _matches(found, expected) -> bool:
    return found is not None and len(found) == len(expected) and all(
        abs(f - e) <= 1e-6 * abs(e) for f, e in zip(found, expected))


@rule(Op.CLAMP)
def drop_clamp_of_erf(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """erf's output clamped to a range holding [-1, 1]: the clamp changes nothing."""
    if inputs[1].op is Op.ERF:
        low, high = inputs[0].scalar, inputs[2].scalar
        if low is not None and high is not None and low <= -1 and high >= 1:
            return inputs[1]
    return None


@rule(Op.DIVIDE)
def raise_erf(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """XLA's expansion of erf, x * P(x^2) / Q(x^2), is one ERF; so is the clamp of its input to [-4, 4], which
    changes nothing in f32 (erf(4) rounds to 1)."""
    if inputs[0].op is not Op.MULTIPLY:
        return None
    numerator, denominator = inputs
    for x, p in (numerator.inputs, numerator.inputs[::-1]):
        x2 = _square_in(p, x)
        if x2 is not None and _matches(_horner(p, x2), ERF_F32_P) and _matches(_horner(denominator, x2), ERF_F32_Q):
            if x.op is Op.CLAMP and x.inputs[0].scalar == -ERF_F32_CLAMP and x.inputs[2].scalar == ERF_F32_CLAMP:
                x = x.inputs[1]
            return ir.node(Op.ERF, [x], node.shape, node.dtype, node.loc)
    return None


def _half_of(node: ir.Node) -> ir.Node | None:  # x * 0.5 -> x
    if node.op is Op.MULTIPLY:
        for x, c in (node.inputs, node.inputs[::-1]):
            if c.scalar == 0.5:
                return x
    return None


def _erf_term_of(node: ir.Node) -> ir.Node | None:  # 1 + erf(x * (1 / sqrt 2)) -> x
    if node.op is not Op.ADD:
        return None
    for e, one in (node.inputs, node.inputs[::-1]):
        if one.scalar == 1.0 and e.op is Op.ERF and e.inputs[0].op is Op.MULTIPLY:
            for x, c in (e.inputs[0].inputs, e.inputs[0].inputs[::-1]):
                k = c.scalar
                if k is not None and abs(k - math.sqrt(0.5)) <= 1e-6:
                    return x
    return None


@rule(Op.MULTIPLY)
def raise_gelu(node: ir.Node, inputs: tuple) -> ir.Node | None:
    """x * 0.5 * (1 + erf(x / sqrt 2)), as decompositions write GELU, is one GELU (one Scalar-engine
    instruction)."""
    for a, b in (inputs, inputs[::-1]):
        x = _half_of(a)
        if x is not None and _erf_term_of(b) is x:
            return ir.node(Op.GELU, [x], node.shape, node.dtype, node.loc)
    return None


CANONICALIZE = (fold_constant, *SIMPLIFY, drop_clamp_of_erf, raise_erf, raise_gelu, narrow_matmul_operands)


def canonicalize(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """The pass: constants folded, no-ops dropped, erf and GELU raised, matmul operands narrowed, to a fixed
    point."""
    return rewrite(graph, CANONICALIZE, ctx)


def _square_in(node, x):
    """The node x*x among the operands of the Horner chain rooted at `node`, or None."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op not in (Op.ADD, Op.MULTIPLY):
            continue
        seen.add(n)
        if n.op is Op.MULTIPLY and n.inputs[0] is x and n.inputs[1] is x:
            return n
        stack.extend(n.inputs)
    return None
