"""`stablehlo.rng_bit_generator` as XLA's CPU computes it: xla/service/rng_bit_generator_expander.cc over the
generators of xla/hlo/builder/lib/prng.cc, step for step, so the bits equal `jax.jit`'s on the CPU.

The state is u64[n]: its first element is the key. THREE_FRY (n = 2): the second element is a counter, each output
block is ThreeFry2x32 of (counter + its index) and the counter advances by the number of blocks. PHILOX (and DEFAULT,
which is Philox on XLA's CPU): the counter is 128 bits, elements 1 and 2 (low first) when n >= 3, else the state
reversed (its low half the second element, its high half the key), of which only the low half is returned. 8- and
16-bit outputs are 32-bit outputs truncated; 64-bit outputs join two 32-bit words (low first). Everything is integer
IR: u32 adds, xors and rotations (wrapping), and Philox's 32x32 -> 64-bit products in u64, as XLA computes them.
"""
from __future__ import annotations

import math

from neuronc import ir
from neuronc.ir import Node, Op
from neuronc.isa import DType

_U64, _U32 = DType.U64, DType.U32
_UNSIGNED = {1: DType.U8, 2: DType.U16, 4: DType.U32, 8: DType.U64}
_ALGORITHMS = ("DEFAULT", "THREE_FRY", "PHILOX")

_THREEFRY_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_THREEFRY_PARITY = 0x1BD11BDA
_PHILOX_W32A, _PHILOX_W32B = 0x9E3779B9, 0xBB67AE85  # the key's increments per round
_PHILOX_M4X32A, _PHILOX_M4X32B = 0xD2511F53, 0xCD9E8D57  # the round's multipliers


def refusal(state: Node, algorithm: str, shape: tuple, dtype: DType) -> str | None:
    """Why this rng_bit_generator cannot be lowered (None: it can)."""
    if algorithm not in _ALGORITHMS:
        return f"algorithm {algorithm}"
    if state.dtype is not _U64 or len(state.shape) != 1:
        return f"a state of {state.dtype.name.lower()}{list(state.shape)} (XLA's is u64[n])"
    if state.shape[0] not in ((2,) if algorithm == "THREE_FRY" else (2, 3)):
        return f"a {algorithm} state of {state.shape[0]} elements (XLA's: 2, or 3 for PHILOX)"
    if dtype.is_float or dtype is DType.BOOL or dtype.itemsize not in _UNSIGNED:
        return f"{dtype.name.lower()} bits (XLA's CPU makes integers)"
    if math.prod(shape) == 0:
        return "an empty output"
    return None


def rng_bit_generator(state: Node, algorithm: str, shape: tuple, dtype: DType, loc) -> tuple:
    """(new state, bits of `shape` and `dtype`), as XLA's CPU; `refusal` first."""
    key = _element(state, 0, loc)
    unsigned = _UNSIGNED[dtype.itemsize]
    if algorithm == "THREE_FRY":
        counter = _element(state, 1, loc)
        bits, counter = (_threefry_64 if unsigned is _U64 else _threefry_32)(key, counter, shape, loc)
        counters = [counter]
    else:
        low, high = (_element(state, 1, loc), _element(state, 2, loc)) if state.shape[0] >= 3 else \
            (_element(state, 1, loc), key)
        bits, counters = (_philox_64 if unsigned is _U64 else _philox_32)(key, (low, high), shape, loc)
        counters = counters if state.shape[0] >= 3 else counters[:1]
    new_state = _node(Op.CONCATENATE, key, *counters, loc=loc, shape=state.shape, dimension=0)
    if unsigned not in (_U64, _U32):
        bits = _node(Op.CONVERT, bits, loc=loc, dtype=unsigned)  # the 32-bit words' low bits
    if unsigned is not dtype:
        bits = _node(Op.BITCAST, bits, loc=loc, dtype=dtype)
    return new_state, bits


# ThreeFry2x32 (prng.cc ThreeFryRngBit32 / ThreeFryRngBit64)


def _threefry_32(key, counter, shape, loc) -> tuple:
    """Each output pair from one block: the shape split in halves along its first even dimension (else its
    largest), the two words of block j the elements 2j and 2j + 1 along it (the last dropped if it is odd)."""
    rank = len(shape)
    if rank == 0:
        split, outer, size, inner = 0, 1, 1, 1
    else:
        even = [d for d in range(rank) if shape[d] % 2 == 0]
        split = even[0] if even else max(range(rank), key=lambda d: (shape[d], -d))
        outer, size, inner = math.prod(shape[:split]), shape[split], math.prod(shape[split + 1:])
    half = (size + 1) // 2
    blocks = outer * half * inner
    x0, x1 = _threefry(_counted(counter, blocks, loc), key, loc)
    words = [_node(Op.RESHAPE, x, loc=loc, shape=(outer, half, 1, inner)) for x in (x0, x1)]
    bits = _node(Op.CONCATENATE, *words, loc=loc, shape=(outer, half, 2, inner), dimension=2)
    bits = _node(Op.RESHAPE, bits, loc=loc, shape=(outer, 2 * half, inner))
    if 2 * half != size:
        bits = _node(Op.SLICE, bits, loc=loc, shape=(outer, size, inner), start=(0, 0, 0), limit=(outer, size, inner),
                     strides=(1, 1, 1))
    return _node(Op.RESHAPE, bits, loc=loc, shape=shape), _plus(counter, blocks, loc)


def _threefry_64(key, counter, shape, loc) -> tuple:
    """One block per output: its two words joined, the first the low half."""
    blocks = math.prod(shape)
    x0, x1 = _threefry(_counted(counter, blocks, loc), key, loc)
    return _node(Op.RESHAPE, _joined(x0, x1, loc), loc=loc, shape=shape), _plus(counter, blocks, loc)


def _counted(counter, blocks: int, loc) -> Node:
    """counter + [0, 1, ..., blocks - 1] in u64 (wrapping)."""
    iota = ir.node(Op.IOTA, [], (blocks,), _U64, loc, dimension=0)
    return _node(Op.ADD, _spread(counter, blocks, loc), iota, loc=loc)


def _threefry(counters, key, loc) -> tuple:
    """ThreeFry2x32, 20 rounds, of each u64 counter's (low, high) words under the key's."""
    key = _spread(key, counters.shape[0], loc)
    ks = [_low(key, loc), _high(key, loc)]
    ks.append(_xor(_xor(_const(_THREEFRY_PARITY, ks[0], loc), ks[0], loc), ks[1], loc))
    x = [_add(_low(counters, loc), ks[0], loc), _add(_high(counters, loc), ks[1], loc)]
    for group in range(5):
        for rotation in _THREEFRY_ROTATIONS[4 * (group % 2):4 * (group % 2) + 4]:
            x[0] = _add(x[0], x[1], loc)
            x[1] = _xor(x[0], _rotated_left(x[1], rotation, loc), loc)
        x[0] = _add(x[0], ks[(group + 1) % 3], loc)
        x[1] = _add(_add(x[1], ks[(group + 2) % 3], loc), _const(group + 1, x[1], loc), loc)
    return x[0], x[1]


def _rotated_left(v, distance: int, loc) -> Node:
    left = _node(Op.SHIFT_LEFT, v, _const(distance, v, loc), loc=loc)
    return _node(Op.OR, left, _node(Op.SHIFT_RIGHT_LOGICAL, v, _const(32 - distance, v, loc), loc=loc), loc=loc)


# Philox4x32 (prng.cc PhiloxRngBit32 / PhiloxRngBit64)


def _philox_32(key, counter, shape, loc) -> tuple:
    """Four outputs per block, block i's words at 4i .. 4i + 3 (the last block's extra words dropped)."""
    return _interleaved(*_philox(key, counter, math.prod(shape), loc), shape, loc)


def _philox_64(key, counter, shape, loc) -> tuple:
    """Two outputs per block, each two of its words joined (the first the low half)."""
    words, counter = _philox(key, counter, 2 * math.prod(shape), loc)
    return _interleaved([_joined(*words[:2], loc), _joined(*words[2:], loc)], counter, shape, loc)


def _interleaved(words: list, counter, shape, loc) -> tuple:
    blocks, n = words[0].shape[0], math.prod(shape)
    columns = [_node(Op.RESHAPE, w, loc=loc, shape=(blocks, 1)) for w in words]
    bits = _node(Op.CONCATENATE, *columns, loc=loc, shape=(blocks, len(words)), dimension=1)
    bits = _node(Op.RESHAPE, bits, loc=loc, shape=(blocks * len(words),))
    if blocks * len(words) != n:
        bits = _node(Op.SLICE, bits, loc=loc, shape=(n,), start=(0,), limit=(n,), strides=(1,))
    return _node(Op.RESHAPE, bits, loc=loc, shape=shape), counter


def _philox(key, counter: tuple, words: int, loc) -> tuple:
    """([4 u32 words] of Philox4x32-10 for each of ceil(words / 4) blocks, the 128-bit counter advanced by them)."""
    blocks = -(-words // 4)
    low, high = counter
    first = _spread(low, blocks, loc)
    lows = _node(Op.ADD, first, ir.node(Op.IOTA, [], (blocks,), _U64, loc, dimension=0), loc=loc)
    highs = _carried(lows, first, _spread(high, blocks, loc), loc)
    x = [_low(lows, loc), _high(lows, loc), _low(highs, loc), _high(highs, loc)]
    key = _spread(key, blocks, loc)
    k = [_low(key, loc), _high(key, loc)]
    for _ in range(10):
        high0, low0 = _multiplied(x[0], _PHILOX_M4X32A, loc)
        high1, low1 = _multiplied(x[2], _PHILOX_M4X32B, loc)
        x = [_xor(_xor(high1, x[1], loc), k[0], loc), low1, _xor(_xor(high0, x[3], loc), k[1], loc), low0]
        k = [_add(k[0], _const(_PHILOX_W32A, k[0], loc), loc), _add(k[1], _const(_PHILOX_W32B, k[1], loc), loc)]
    next_low = _plus(low, blocks, loc)
    return x, [next_low, _carried(next_low, low, high, loc)]


def _multiplied(x, factor: int, loc) -> tuple:
    """(high, low) u32 words of the 64-bit product x * factor."""
    product = _node(Op.MULTIPLY, _node(Op.CONVERT, x, loc=loc, dtype=_U64), _const(factor, x, loc, _U64), loc=loc)
    return _high(product, loc), _low(product, loc)


def _carried(new_low, old_low, high, loc) -> Node:
    """The 128-bit sum's high half: high + 1 where the low half wrapped."""
    wrapped = _node(Op.COMPARE, new_low, old_low, loc=loc, dtype=DType.BOOL, direction="LT")
    return _node(Op.SELECT, wrapped, _add(high, _const(1, high, loc), loc), high, loc=loc, dtype=high.dtype)


# words and elements


def _element(state, i: int, loc) -> Node:
    """state[i] as a u64[1]."""
    return _node(Op.SLICE, state, loc=loc, shape=(1,), start=(i,), limit=(i + 1,), strides=(1,))


def _spread(x, n: int, loc) -> Node:
    """A u64[1] broadcast to [n]."""
    return x if n == 1 else _node(Op.BROADCAST_IN_DIM, x, loc=loc, shape=(n,), dims=(0,))


def _plus(x, n: int, loc) -> Node:
    return _add(x, _const(n, x, loc), loc)


def _low(x, loc) -> Node:
    return _node(Op.CONVERT, x, loc=loc, dtype=_U32)


def _high(x, loc) -> Node:
    return _low(_node(Op.SHIFT_RIGHT_LOGICAL, x, _const(32, x, loc), loc=loc), loc)


def _joined(low, high, loc) -> Node:
    wide_high = _node(Op.CONVERT, high, loc=loc, dtype=_U64)
    shifted = _node(Op.SHIFT_LEFT, wide_high, _const(32, wide_high, loc), loc=loc)
    return _node(Op.OR, _node(Op.CONVERT, low, loc=loc, dtype=_U64), shifted, loc=loc)


def _add(a, b, loc) -> Node:
    return _node(Op.ADD, a, b, loc=loc)


def _xor(a, b, loc) -> Node:
    return _node(Op.XOR, a, b, loc=loc)


def _const(value: int, like: Node, loc, dtype: DType | None = None) -> Node:
    return ir.splat(value, like.shape, dtype or like.dtype, loc)


def _node(op: Op, *inputs: Node, loc, shape: tuple | None = None, dtype: DType | None = None, **attrs) -> Node:
    return ir.node(op, list(inputs), inputs[0].shape if shape is None else shape,
                   inputs[0].dtype if dtype is None else dtype, loc, **attrs)
