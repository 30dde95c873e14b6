"""StableHLO elementwise ops the IR has no op for, written with ops it has (JAX emits them: `jnp.tan`, `jnp.cbrt`,
`lax.round` away from zero, `lax.population_count`, `lax.clz`, `lax.reduce_precision`, and `sign`, whose -0.0 is
-0.0 in StableHLO but +0.0 in the IR's SIGN, as in PyTorch). Each takes the op's operands
as IR nodes (and reduce_precision the format's bit counts) and returns the result node; stablehlo_import registers
them as converters.
"""
from __future__ import annotations


from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.isa import DType


def tan(x: Node, loc) -> Node:
    """sin x / cos x."""
    return _node(Op.DIVIDE, _node(Op.SIN, x, loc=loc), _node(Op.COS, x, loc=loc), loc=loc)


def sign(x: Node, loc) -> Node:
    """StableHLO's sign: SIGN, but a zero is itself (sign(-0.0) is -0.0, as XLA's)."""
    signed = _node(Op.SIGN, x, loc=loc)
    if not x.dtype.is_float:
        return signed
    zero = _node(Op.COMPARE, x, _constant(0.0, x, loc), loc=loc, dtype=DType.BOOL, direction="EQ")
    return _node(Op.SELECT, zero, x, signed, loc=loc, dtype=x.dtype)


def cbrt(x: Node, loc) -> Node:
    """sign(x) |x|^(1/3): the real cube root of a negative number too (and of -0.0, -0.0)."""
    root = _node(Op.POWER, _node(Op.ABS, x, loc=loc), _constant(1.0 / 3.0, x, loc), loc=loc)
    return _node(Op.MULTIPLY, sign(x, loc), root, loc=loc)


def round_half_away_from_zero(x: Node, loc) -> Node:
    """sign(x) (floor(|x|) + (|x| - floor(|x|) >= 0.5)): the fraction is exact (no |x| + 0.5, which rounds
    0.49999997 up); -0.3 and -0.0 give -0.0, NaN and infinities stay."""
    magnitude = _node(Op.ABS, x, loc=loc)
    whole = _node(Op.FLOOR, magnitude, loc=loc)
    half_up = _node(Op.COMPARE, _node(Op.SUBTRACT, magnitude, whole, loc=loc), _constant(0.5, x, loc), loc=loc,
                    dtype=DType.BOOL, direction="GE")
    one = _node(Op.SELECT, half_up, _constant(1.0, x, loc), _constant(0.0, x, loc), loc=loc, dtype=x.dtype)
    return _node(Op.MULTIPLY, sign(x, loc), _node(Op.ADD, whole, one, loc=loc), loc=loc)


def population_count(x: Node, loc) -> Node:
    """The set bits of each integer (SWAR: bit pairs, nibbles, bytes summed by one multiply), in 32 or 64 bits;
    a narrower integer is widened by its bits alone (zero-extended)."""
    wide, bits = _zero_extended(x, loc)
    ones = (1 << wide) - 1  # every mask below is under the signed maximum: exact in a signed type too

    def masked(v, mask):
        return _node(Op.AND, v, _constant(mask, v, loc), loc=loc)

    v = _node(Op.SUBTRACT, bits, masked(_shr(bits, 1, loc), ones // 3), loc=loc)  # 0x55..: pairs
    v = _node(Op.ADD, masked(v, ones // 5), masked(_shr(v, 2, loc), ones // 5), loc=loc)  # 0x33..: nibbles
    v = masked(_node(Op.ADD, v, _shr(v, 4, loc), loc=loc), ones // 17)  # 0x0f..: bytes
    count = _shr(_node(Op.MULTIPLY, v, _constant(ones // 255, v, loc), loc=loc), wide - 8, loc)  # 0x01..: their sum
    return _node(Op.CONVERT, count, loc=loc, dtype=x.dtype)


def count_leading_zeros(x: Node, loc) -> Node:
    """The zero bits above the highest set bit (the width for 0), by halving the span searched: an operand whose
    top `s` bits are zero counts s and shifts them out."""
    wide, bits = _zero_extended(x, loc)
    count = _constant(x.dtype.itemsize * 8 - wide, bits, loc)  # a widened operand's extra zero bits, taken back

    def counted(condition, amount):
        return _node(Op.ADD, count, _node(Op.SELECT, condition, _constant(amount, bits, loc), _constant(0, bits, loc),
                                          loc=loc, dtype=bits.dtype), loc=loc)

    shift = wide // 2
    while shift:
        zero = _node(Op.COMPARE, _shr(bits, wide - shift, loc), _constant(0, bits, loc), loc=loc, dtype=DType.BOOL,
                     direction="EQ")
        count = counted(zero, shift)
        shifted = _node(Op.SHIFT_LEFT, bits, _constant(shift, bits, loc), loc=loc)
        bits = _node(Op.SELECT, zero, shifted, bits, loc=loc, dtype=bits.dtype)
        shift //= 2
    count = counted(_node(Op.COMPARE, bits, _constant(0, bits, loc), loc=loc, dtype=DType.BOOL, direction="EQ"), 1)
    return _node(Op.CONVERT, count, loc=loc, dtype=x.dtype)


def _zero_extended(x: Node, loc) -> tuple:
    """(width, x's bits as an integer of 32 or 64 bits, zero-extended)."""
    width = x.dtype.itemsize * 8
    if width >= 32:
        return width, x
    wide = _node(Op.CONVERT, x, loc=loc, dtype=DType.I32)  # sign-extends a signed type: the mask drops that
    return 32, _node(Op.AND, wide, _constant((1 << width) - 1, wide, loc), loc=loc)


def _shr(x: Node, amount: int, loc) -> Node:
    return _node(Op.SHIFT_RIGHT_LOGICAL, x, _constant(amount, x, loc), loc=loc)


def _constant(value, like: Node, loc) -> Node:
    return ir.splat(value, like.shape, like.dtype, loc)


def _node(op: Op, *inputs: Node, loc, dtype: DType | None = None, **attrs) -> Node:
    return ir.node(op, list(inputs), inputs[0].shape, inputs[0].dtype if dtype is None else dtype, loc, **attrs)


_INTEGER_OF = {DType.F32: DType.I32, DType.BF16: DType.I16, DType.F16: DType.I16}


def reduce_precision(x: Node, exponent_bits: int, mantissa_bits: int, loc) -> Node:
    """x rounded to a float format of `exponent_bits` and `mantissa_bits` and kept in its own type, as XLA computes
    it on the bits: the mantissa rounded to nearest even by adding a bias and truncating, then values whose exponent
    the narrower format cannot hold made a signed infinity (above) or a signed zero (below, no subnormals); NaN stays
    x. None for a type it does not know (the caller refuses it)."""
    if x.dtype not in _INTEGER_OF:
        return None
    whole = _INTEGER_OF[x.dtype]
    width = x.dtype.itemsize * 8
    source_mantissa = {DType.F32: 23, DType.BF16: 7, DType.F16: 10}[x.dtype]
    source_exponent = width - 1 - source_mantissa
    bits = _node(Op.BITCAST, x, loc=loc, dtype=whole)

    def c(value):
        return _constant(value, bits, loc)

    if mantissa_bits < source_mantissa:
        dropped = source_mantissa - mantissa_bits
        last_kept = 1 << dropped
        last_bit = _shr(_node(Op.AND, bits, c(last_kept), loc=loc), dropped, loc)
        bias = _node(Op.ADD, last_bit, c((last_kept >> 1) - 1), loc=loc)  # ties to the even mantissa
        bits = _node(Op.AND, _node(Op.ADD, bits, bias, loc=loc), c(-last_kept), loc=loc)  # ~(last_kept - 1)
    if exponent_bits < source_exponent:
        exponent_mask = ((1 << source_exponent) - 1) << source_mantissa
        source_bias, bias = (1 << (source_exponent - 1)) - 1, (1 << (exponent_bits - 1)) - 1
        exponent = _node(Op.AND, bits, c(exponent_mask), loc=loc)  # the sign masked off: compared as non-negative
        over = _node(Op.COMPARE, exponent, c((source_bias + bias) << source_mantissa), loc=loc, dtype=DType.BOOL,
                     direction="GT")
        under = _node(Op.COMPARE, exponent, c((source_bias - bias) << source_mantissa), loc=loc, dtype=DType.BOOL,
                      direction="LE")
        signed_zero = _node(Op.AND, bits, c(-(1 << (width - 1))), loc=loc)  # the sign bit alone
        signed_inf = _node(Op.OR, signed_zero, c(exponent_mask), loc=loc)
        bits = _node(Op.SELECT, over, signed_inf, _node(Op.SELECT, under, signed_zero, bits, loc=loc, dtype=whole),
                     loc=loc, dtype=whole)
    result = _node(Op.BITCAST, bits, loc=loc, dtype=x.dtype)
    nan = _node(Op.COMPARE, x, x, loc=loc, dtype=DType.BOOL, direction="NE")
    return _node(Op.SELECT, nan, x, result, loc=loc, dtype=x.dtype)


_UNSIGNED_OF_SIZE = {1: DType.U8, 2: DType.U16, 4: DType.U32, 8: DType.U64}


def bitcast_of_another_width(x: Node, shape: tuple, dtype: DType, loc) -> Node:
    """StableHLO's bitcast_convert between types of different widths, little-endian as XLA's: a wider element is its
    narrower parts along a new last dimension, the first part its lowest bits (JAX bitcasts a u32[4] PRNG state to
    u64[2] and back). Integer shifts, masks and conversions on the unsigned types of each width; None for a type
    without a power-of-two width of bytes (the caller refuses it)."""
    if x.dtype is DType.BOOL or dtype is DType.BOOL or {x.dtype.itemsize, dtype.itemsize} - set(_UNSIGNED_OF_SIZE):
        return None
    narrow, wide = sorted((x.dtype.itemsize, dtype.itemsize))
    narrow_u, wide_u, parts, bits = _UNSIGNED_OF_SIZE[narrow], _UNSIGNED_OF_SIZE[wide], wide // narrow, narrow * 8
    if x.dtype.itemsize == wide:  # a wider element split into its parts
        whole = _bitcast_to(x, wide_u, loc)
        pieces = []
        for i in range(parts):
            piece = _shr(whole, i * bits, loc) if i else whole
            piece = ir.node(Op.CONVERT, [piece], x.shape, narrow_u, loc)  # the low bits (integers wrap)
            pieces.append(ir.node(Op.RESHAPE, [piece], x.shape + (1,), narrow_u, loc))
        joined = ir.node(Op.CONCATENATE, pieces, shape, narrow_u, loc, dimension=len(x.shape))
        return _bitcast_to(joined, dtype, loc)
    pieces = _bitcast_to(x, narrow_u, loc)
    rank = len(shape)
    result = None
    for i in range(parts):
        piece = ir.node(Op.SLICE, [pieces], shape + (1,), narrow_u, loc, start=(0,) * rank + (i,),
                        limit=tuple(shape) + (i + 1,), strides=(1,) * (rank + 1))
        piece = ir.node(Op.CONVERT, [ir.node(Op.RESHAPE, [piece], shape, narrow_u, loc)], shape, wide_u, loc)
        if i:
            piece = _node(Op.SHIFT_LEFT, piece, _constant(i * bits, piece, loc), loc=loc)
        result = piece if result is None else _node(Op.OR, result, piece, loc=loc)
    return _bitcast_to(result, dtype, loc)


def _bitcast_to(x: Node, dtype: DType, loc) -> Node:
    return x if x.dtype is dtype else _node(Op.BITCAST, x, loc=loc, dtype=dtype)
