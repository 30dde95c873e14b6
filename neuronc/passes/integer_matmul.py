"""Integer matrix products, exact, on engines that multiply floats.

The Tensor engine multiplies floats and sums in fp32. Integers of at most 8 bits are exact in bf16, and a sum of
their products is exact in fp32 while it stays under 2^24: so an int8 (uint8, bool) product is computed there, in
pieces of the contraction short enough for that (1,024 for int8 x int8), each piece converted to int32 and the
pieces added (quantized inference: `torch._int_mm`, JAX's `preferred_element_type=jnp.int32`). Wider integers
multiply and sum on the Vector engine in the result's integer type, which wraps as PyTorch's and XLA's integer
arithmetic does (a broadcast product and a reduction: memory grows with m x k x n, as it is meant for the index
arithmetic and small products these are).

legalize calls it with the product's operands as [b, m, k] and [b, k, n] (as it makes them for MATMUL); the result
is StableHLO-level IR (DOT_GENERAL of floats, REDUCE, CONVERT...) that its next sweep lowers.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.isa import DType

EXACT_FP32_SUM = 2 ** 24  # fp32's significand: integers below this in magnitude are exact
_MAGNITUDE = {DType.BOOL: 1, DType.I8: 128, DType.U8: 255}  # the largest |value| of each narrow integer type


def exact_integer_dot(lhs: Node, rhs: Node, dtype: DType, loc) -> Node:
    """[b, m, k] x [b, k, n] -> [b, m, n] of `dtype`, integer operands or result, as exact pieces."""
    (b, m, _), n = lhs.shape, rhs.shape[2]
    if lhs.dtype in _MAGNITUDE and rhs.dtype in _MAGNITUDE:
        product = _on_tensor_engine(lhs, rhs, EXACT_FP32_SUM // (_MAGNITUDE[lhs.dtype] * _MAGNITUDE[rhs.dtype]), loc)
    elif dtype.is_float:  # wide integers into a float result (JAX's preferred_element_type): XLA converts
        lhs, rhs = (_converted(x, dtype, loc) for x in (lhs, rhs))
        product = ir.node(Op.DOT_GENERAL, [lhs, rhs], (b, m, n), dtype, loc, **_BATCHED)
    else:
        product = _on_vector_engine(lhs, rhs, dtype, loc)
    return _converted(product, dtype, loc)


_BATCHED = dict(lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))  # [b,m,k] x [b,k,n]


def _on_tensor_engine(lhs: Node, rhs: Node, piece: int, loc) -> Node:
    """[b, m, k] x [b, k, n] of narrow integers -> int32: bf16 matmuls of at most `piece` of the contraction."""
    (b, m, k), n = lhs.shape, rhs.shape[2]
    total = None
    for start in range(0, k, piece):
        stop = min(k, start + piece)
        left = _converted(_sliced(lhs, 2, start, stop, loc), DType.BF16, loc)
        right = _converted(_sliced(rhs, 1, start, stop, loc), DType.BF16, loc)
        sums = ir.node(Op.DOT_GENERAL, [left, right], (b, m, n), DType.F32, loc, **_BATCHED)
        part = _converted(sums, DType.I32, loc)
        total = part if total is None else ir.node(Op.ADD, [total, part], (b, m, n), DType.I32, loc)
    return total


def _on_vector_engine(lhs: Node, rhs: Node, dtype: DType, loc) -> Node:
    """[b, m, k] x [b, k, n] -> [b, m, n] in `dtype`: the products of a broadcast, summed over k."""
    (b, m, k), n = lhs.shape, rhs.shape[2]
    lhs4 = ir.node(Op.BROADCAST_IN_DIM, [_converted(lhs, dtype, loc)], (b, m, k, n), dtype, loc, dims=(0, 1, 2))
    rhs4 = ir.node(Op.BROADCAST_IN_DIM, [_converted(rhs, dtype, loc)], (b, m, k, n), dtype, loc, dims=(0, 2, 3))
    products = ir.node(Op.MULTIPLY, [lhs4, rhs4], (b, m, k, n), dtype, loc)
    zero = ir.splat(0, (), dtype, loc)
    return ir.node(Op.REDUCE, [products, zero], (b, m, n), dtype, loc, dims=(2,), kind="add")


def _converted(x: Node, dtype: DType, loc) -> Node:
    return x if x.dtype is dtype else ir.node(Op.CONVERT, [x], x.shape, dtype, loc)


def _sliced(x: Node, dim: int, start: int, stop: int, loc) -> Node:
    if (start, stop) == (0, x.shape[dim]):
        return x
    shape = tuple(stop - start if d == dim else s for d, s in enumerate(x.shape))
    return ir.node(Op.SLICE, [x], shape, x.dtype, loc, start=tuple(start if d == dim else 0 for d in range(len(shape))),
                   limit=tuple(stop if d == dim else s for d, s in enumerate(x.shape)), strides=(1,) * len(shape))
