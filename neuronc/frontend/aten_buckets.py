"""Shape buckets for single ATen ops: which sizes of an op's operands may be padded up to a bucket without
changing a bit of the elements the op's real call computes (issue 20, part 8).

An eager op meeting a new size along a dim where its results are independent per index (an elementwise op's
every dim, a row-wise op's non-reduced dims)
can run the program compiled for a bucket of that size on padded operands, and keep the leading slice of the
results: one program per bucket instead of one per size. The rules below say, per op, which dims of which
arguments may be padded and with what; :func:`plan` applies them to one call. The eager path
(``neuronc.pytorch.eager``) pads the operands, runs the bucket's program and slices its results.

Exactness. A result element of the real call is computed from the same operand elements by the same
instructions whichever the padded size, when the padded dim is not reduced: the elements added along a
padded dim are then only ever combined with each other (an elementwise op's padded lanes, a softmax's
padded rows). A reduction *over* a padded dim is bucketed only when the pad is
the reduction's identity and the reduction's result does not depend on the order of its terms: ``all``/``any``
on bool (logical and/or). Sums, means, softmax, the matmul's contraction (``probs @ V`` over the key length)
are not: padding with zeros or -inf would keep the value but not, in general, the bits (the order and the
grouping of a float sum change with its length, and ``-0.0 + 0.0`` is ``+0.0``). ``tests/test_eager_buckets.py``
compares the bucketed path's bits with the op's own program and with CPU eager, NaN and inf among the data.

Matmuls are not bucketed, although a result element reads only its row of the left operand and its column of
the right: the emulator's fp32 matmul is numpy's (BLAS), whose summation order for one element changes with
the operands' other sizes (``A.T @ B`` against the same product padded to the next power of two in M or in N,
K in 6..32, M and N in 1..17: 43 of 100 padded-M and 66 of 100 padded-N products differ in some bit), and the
bucketed result must be the unpadded program's, bit for bit. Whether a padded product keeps its bits is a property
of the OpenBLAS kernel set numpy picks for the CPU, not of the op: generate()'s ``q @ K^T`` at decode shapes keeps
them under the SkylakeX set and loses them at 117 of 121 key lengths under the Haswell set, and ``probs @ V`` and
the softmax lose them under both (``benchmarks/padding_exactness.py``, docs/performance.md issue 20 part 10), so no
rule here can be exact on every machine. The hardware's PE array accumulates each result
in K order whatever M and N are; an emulated matmul with that property would make the rows of ``x @ W`` and
the key columns of ``q @ K^T`` bucketable.

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


def _reduction(identity=None):
    """``op(self, dim, keepdim...)`` reducing over ``dim`` (an int or a list): the other dims; the reduced
    dims too when ``identity`` is given and the input is bool (logical and/or: order-free, exact)."""
    def rule(args, kwargs):
        x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None or x.dim() == 0:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not dims:  # an empty list reduces every dim
            return None
        reduced = {_normal(d, x.dim()) for d in dims}
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


def plan(op, args: tuple, kwargs: dict):
    """{argument position: Pad} for the tensor arguments this call pads, or None when nothing is padded (no
    rule, a dim already at its bucket, or an operand too large)."""
    rule = rule_of(op)
    if rule is None:
        return None
    try:
        wanted = rule(args, kwargs)
    except (TypeError, IndexError, ValueError, RuntimeError):  # an overload's arguments the rule does not read
        return None
    if not wanted:
        return None
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
