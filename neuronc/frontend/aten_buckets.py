"""Shape buckets for single ATen ops: which sizes of an op's operands may be padded up to a bucket without
changing a bit of the elements the op's real call computes (issue 20, part 8).

An eager op meeting a new size along a dim where its results are independent per index (an elementwise op's
every dim, a row-wise op's non-reduced dims)
can run the program compiled for a bucket of that size on padded operands, and keep the leading slice of the
results: one program per bucket instead of one per size. The rules below say, per op, which dims of which
arguments may be padded and with what; :func:`plan` applies them to one call. The eager path
(``neuronc.pytorch.eager``) pads the operands, runs the bucket's program and slices its results.

Two kinds of padding.

*Exact* (``RULES``): a result element of the real call is computed from the same operand elements by the same
instructions whichever the padded size, when the padded dim is not reduced: the elements added along a padded
dim are then only ever combined with each other (an elementwise op's padded lanes, a softmax's padded rows). A
reduction *over* a padded dim is exact only when the pad is the reduction's identity and the result does not
depend on the order of its terms: ``all``/``any`` on bool (logical and/or). The bucketed result is the unpadded
program's, bit for bit (``tests/test_eager_buckets.py`` compares them, NaN and inf among the data).

*Reordering* (``REORDERING_RULES``): a float sum over a padded dim — a sum's reduced dim padded with ``-0.0``, a
softmax's with ``-inf`` (its ``exp`` is ``+0``), the contraction of ``mm``/``bmm`` with ``+0.0`` on the left and
``-0.0`` on the right (each padded product is ``-0.0``), and a matmul's other dims (the emulator's fp32 matmul is
numpy's BLAS, whose summation order for one result element changes with the operands' other sizes). The padded
terms are exact identities (``x + -0.0 == x`` for every ``x``, ``-0.0`` included; ``-inf`` never wins a max), so
the value is the same sum of the same terms, but in another grouping: the bits may differ from the unpadded
program's in the last places, as any reordered float sum does (``benchmarks/padding_exactness.py`` counts them;
docs/performance.md issue 20, parts 10 and 12), and the result matches CPU eager within the per-dtype
tolerances. This is how generation is served on the real hardware too (sequence-length buckets). A reordering
dim is padded only where the op's size differs from the size it had when first met (the key length of
generate()'s ``q @ K^T``, ``softmax`` and ``probs @ V``; never a model's fixed width), and only when the caller
allows it: ``NEURON_EAGER_BUCKETS=exact`` and ``torch.use_deterministic_algorithms(True)`` keep to exact padding,
since with reordering an op's last bits at a size depend on whether it met another size first.

Padding fills a padded region with a copy of the last real index along that dim ("edge"): the padded lanes
then compute on values the real lanes already meet (no new division by zero, log of 0, overflow), and an
integer op sees no value it would not otherwise; a reduced dim is filled with the reduction's identity.

The ladder (a stated choice): a size ``n > 1`` goes to the next power of two, so padding at most doubles a dim
and a dim has ~log2(max size) programs; sizes 0 and 1 are never padded. An operand whose padded form would
exceed :data:`MAX_ELEMENTS` elements is not bucketed (large tensors: the compile is a small part of their cost,
the padded work and memory a large one).
"""
from __future__ import annotations

import dataclasses

import torch

aten = torch.ops.aten

MAX_ELEMENTS = 1 << 20  # a padded operand larger than this: the op is not bucketed (a stated choice)
EDGE = "edge"  # fill a padded region with the last real index along the dim
SUM_IDENTITY = -0.0  # x + -0.0 == x for every x, -0.0 included (+0.0 would turn a sum of -0.0s into +0.0)


def bucket(n: int) -> int:
    """The bucket of size ``n``: the next power of two (0 and 1 stay)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Pad:
    """How one tensor argument is padded: its bucket shape and, per padded dim, the fill."""

    shape: tuple
    fills: tuple  # ((dim, fill), ...): fill is EDGE or a Python number (the reduction's identity)


# ---- the rules: per op, which dims of which arguments may be padded ------------------------------------
# A rule maps (args, kwargs) to {argument position: {dim: fill}} or None (not bucketed for this call).
# Dims not named are not padded. Every padded argument's dims must be such that the result elements of the
# real call read only the real part of every operand (see the module's docstring).

def _dims(x: torch.Tensor, skip=()) -> dict:
    return {d: EDGE for d in range(x.dim()) if d not in skip}


def _elementwise(args, kwargs):
    """A pointwise op (``torch.Tag.pointwise``): every dim of every tensor argument that is not broadcast."""
    tensors = {i: x for i, x in enumerate(args) if isinstance(x, torch.Tensor)}
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()) or not tensors:
        return None
    shape = torch.broadcast_shapes(*(x.shape for x in tensors.values()))
    pads = {}
    for i, x in tensors.items():
        lead = len(shape) - x.dim()
        pads[i] = {d: EDGE for d in range(x.dim()) if x.shape[d] == shape[lead + d] and x.shape[d] > 1}
    return pads


def _normal(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _rows_over(position_of_dim: int, tensors=(0,)):
    """A row-wise op reducing over ``args[position_of_dim]`` (an int dim): every other dim of ``tensors``."""
    def rule(args, kwargs):
        x = args[0]
        dim = _normal(args[position_of_dim], x.dim())
        return {i: _dims(args[i], skip=(dim,)) for i in tensors}
    return rule


def _reduced_dims(args, kwargs) -> set | None:
    """The dims ``op(self, dim, ...)`` reduces over (``dim`` an int or a list), normalised; None when it reduces
    every dim (no ``dim``, an empty list, a 0-d input)."""
    x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or x.dim() == 0:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {_normal(d, x.dim()) for d in dims} or None


def _reduction(identity=None):
    """``op(self, dim, keepdim...)`` reducing over ``dim`` (an int or a list): the other dims; the reduced
    dims too when ``identity`` is given and the input is bool (logical and/or: order-free, exact)."""
    def rule(args, kwargs):
        x, reduced = args[0], _reduced_dims(args, kwargs)
        if reduced is None:
            return None
        pads = _dims(x, skip=reduced)
        if identity is not None and x.dtype == torch.bool:
            pads.update({d: identity for d in reduced})
        return {0: pads}
    return rule


def _layer_norm(args, kwargs):
    x, normalized = args[0], args[1]
    return {0: {d: EDGE for d in range(x.dim() - len(normalized))}}


RULES = {
    # schema name -> rule; pointwise ops (torch.Tag.pointwise) not named here use _elementwise
    "aten::floor_divide": _elementwise,  # not tagged pointwise
    "aten::_softmax": _rows_over(1),
    "aten::_log_softmax": _rows_over(1),
    "aten::_softmax_backward_data": _rows_over(2, tensors=(0, 1)),
    "aten::_log_softmax_backward_data": _rows_over(2, tensors=(0, 1)),
    "aten::native_layer_norm": _layer_norm,
    "aten::sum.dim_IntList": _reduction(),
    "aten::mean.dim": _reduction(),
    "aten::amax": _reduction(),
    "aten::amin": _reduction(),
    "aten::all.dim": _reduction(identity=True),
    "aten::all.dims": _reduction(identity=True),
    "aten::any.dim": _reduction(identity=False),
    "aten::any.dims": _reduction(identity=False),
}

def _float_sum(args, kwargs):
    """``sum(self, dim, ...)`` of a float tensor: its reduced dims, padded with the sum's identity."""
    reduced = _reduced_dims(args, kwargs)
    if not args[0].dtype.is_floating_point or reduced is None or kwargs.get("dtype") is not None:
        return None
    return {0: {d: SUM_IDENTITY for d in reduced}}


def _softmax_row(args, kwargs):
    """``_softmax(self, dim, half_to_float)``: the reduced dim, padded with -inf (whose exp is +0)."""
    x = args[0]
    if not x.dtype.is_floating_point or x.dim() == 0:
        return None
    return {0: {_normal(args[1], x.dim()): float("-inf")}}


def _matmul(args, kwargs):
    """``mm(a, b)`` / ``bmm(a, b)``: every dim; the contraction padded with +0.0 in ``a`` and -0.0 in ``b``, so
    each padded product is -0.0 and adds nothing (nor meets a real inf or NaN)."""
    a, b = args[0], args[1]
    if not (a.dtype.is_floating_point and b.dtype == a.dtype):
        return None
    return {0: {**_dims(a, skip=(a.dim() - 1,)), a.dim() - 1: 0.0},
            1: {**_dims(b, skip=(b.dim() - 2,)), b.dim() - 2: SUM_IDENTITY}}


REORDERING_RULES = {
    # schema name -> rule: dims whose padding regroups a float sum (the module's docstring); padded only where
    # the size differs from the op's first, and only when reordering is allowed
    "aten::sum.dim_IntList": _float_sum,
    "aten::_softmax": _softmax_row,
    "aten::_log_softmax": _softmax_row,
    "aten::mm": _matmul,
    "aten::bmm": _matmul,
}


NOT_BUCKETED = {
    # pointwise-tagged ops whose result is not per index, or that are better left alone
    "aten::clone",  # a copy (DMA in eager): nothing to compile
}


def _schema_name(op) -> str:
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def rule_of(op):
    """The bucket rule of ``op`` (a functional ATen op), or None."""
    name = _schema_name(op)
    if name in RULES:
        return RULES[name]
    if name in NOT_BUCKETED or name.split(".")[0] in NOT_BUCKETED:
        return None
    if torch.Tag.pointwise in op.tags and len(op._schema.returns) == 1:
        return _elementwise
    return None


def _wanted(rule, args, kwargs) -> dict:
    if rule is None:
        return {}
    try:
        return rule(args, kwargs) or {}
    except (TypeError, IndexError, ValueError, RuntimeError):  # an overload's arguments the rule does not read
        return {}


def _changed(dims: dict, shape, first) -> dict:
    """The dims of ``dims`` where ``shape`` differs from ``first`` (the shape the argument had when first met)."""
    if first is None or len(first) != len(shape):
        return dims
    return {d: fill for d, fill in dims.items() if shape[d] != first[d]}


def plan(op, args: tuple, kwargs: dict, first: tuple | None = None):
    """{argument position: Pad} for the tensor arguments this call pads, or None when nothing is padded (no
    rule, a dim already at its bucket, or an operand too large). ``first`` (the shapes of ``args`` when the op
    was first met, None for a non-tensor) allows reordering padding, of the dims whose size changed since."""
    wanted = _wanted(rule_of(op), args, kwargs)
    if first is not None:
        for position, dims in _wanted(REORDERING_RULES.get(_schema_name(op)), args, kwargs).items():
            was = first[position] if position < len(first) else None
            wanted.setdefault(position, {}).update(_changed(dims, args[position].shape, was))
    pads = {}
    for position, dims in wanted.items():
        x = args[position]
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return None
        shape = list(x.shape)
        fills = []
        for d, fill in sorted(dims.items()):
            if bucket(shape[d]) != shape[d]:
                shape[d] = bucket(shape[d])
                fills.append((d, fill))
        if fills:
            if torch.Size(shape).numel() > MAX_ELEMENTS:
                return None
            pads[position] = Pad(tuple(shape), tuple(fills))
    return pads or None
