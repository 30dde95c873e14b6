"""What each instruction does, executed with numpy on views of the core's memory, and the hardware
rules an instruction must obey before it may run.

The meaning of every opcode is fixed by the docstring of :mod:`neuronc.isa`; this module is its
executable form. ``check`` enforces the rules (operand count, which engine runs what, which memory
each engine reaches, partition and free-size limits, the Tensor engine's tile rules, operand
shapes) and raises :class:`NeuronRuntimeError` with the problem; the caller adds which
instruction it was. ``SEMANTICS`` maps each opcode to ``fn(instr, dst, *srcs)``, which computes the
destination's new value from views of the operands.

Numerics, as on the chip: Vector/Scalar/GpSimd arithmetic on floats is done in fp32 and rounded
(to nearest even) to the destination dtype; integers compute in their own type (a bool computes
as uint8). Integer DIVIDE truncates toward zero and REMAINDER takes the dividend's sign (C's ``/``
and ``fmod``, as StableHLO's divide and remainder); AND/OR/XOR are bitwise on integers and logical (1/0) on floats; the ALU op
NONE passes its first operand through and the activation NONE is the identity. Float to integer
conversion truncates toward zero. ERF and GELU (erf form) use XLA's f32 rational approximation of
erf; SIGMOID uses scipy.special.expit in fp32. MATMUL of 16- or 8-bit operands sums its products in fp64
and rounds each sum once to fp32, so that its bits are a function of the operands alone (numpy's fp32 matmul
adds in an order that depends on the tile's M and N and on the host CPU's BLAS kernel).
"""
from __future__ import annotations

import functools
import math
import struct
import threading
from typing import Callable
from functools import partial

import ml_dtypes
import numpy as np

from neuronc.errors import NeuronRuntimeError
from neuronc.isa import (ARITY, COLLECTIVE_REDUCTIONS, COLLECTIVES, ERF_F32_CLAMP, ERF_F32_P, ERF_F32_Q, MAX_DIMS,
                         ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, row_major_dims)
from neuronc.op_facts import (ALU_FUNCTIONS, SCALAR_FUNCTIONS, ByKind, shift_left,
                              shift_right_arithmetic, shift_right_logical)
from neuronc.targets import Target
from runtime.memory import free_byte_span

F32 = np.float32
F64 = np.float64
# numpy's copyto without its __array_function__ dispatch (NEP 18's `_implementation`: the same C function, for the
# ndarrays the runtime passes): the dispatch costs more than the copy of a small tile (0.78 against 0.31 us the
# call on a [1, 64] fp32 tile here), and the bound kernels make several hundred copies a run of a small model.
_copyto = getattr(np.copyto, "_implementation", np.copyto)
_FLOATS = frozenset(d.numpy for d in DType if d.is_float)


@functools.cache
def _compute_dtype(*dtypes) -> np.dtype:
    """fp32 if any operand is a float, else the operands' common integer type (bool as uint8)."""
    if _FLOATS.intersection(dtypes):
        return np.dtype(F32)
    common = np.result_type(*dtypes)
    return np.dtype(np.uint8) if common == np.bool_ else common


# ---------------------------------------------------------------------------------------------
# Tables of functions


# What each Scalar-engine function and ALU op computes: the op-facts table's (neuronc/op_facts.py), which the
# compiler's constant folding reads too.
ACTIVATIONS = SCALAR_FUNCTIONS
ALU = ALU_FUNCTIONS

REDUCTIONS = {AluOp.ADD: np.add, AluOp.MAX: np.maximum, AluOp.MIN: np.minimum}


# ---------------------------------------------------------------------------------------------
# Semantics: fn(instr, dst, *srcs) -> the new value of dst, a fresh array (never a view of memory)
# or a scalar; for an instruction with two destinations (Instruction.writes, which lead the operands
# and so arrive as dst and srcs[0]), a pair of such values. The runtime reads operands when an instruction starts and writes the value into dst,
# rounding to its dtype, when it completes.


def _dma_copy(instr, dst, src):
    return np.array(src).reshape(dst.shape)


def _dma_transpose(instr, dst, src):
    return np.array(src).T


def _matmul(instr, dst, stationary, moving):
    moving = moving.reshape(moving.shape[0], -1)  # [K, N]: a moving operand read through two free dims
    wide = _matmul_sum_dtype(stationary, moving)
    product = (stationary.astype(wide, copy=False).T @ moving.astype(wide, copy=False)).astype(F32, copy=False)
    return dst + product if instr.accumulate else product


def _matmul_sum_dtype(stationary: np.ndarray, moving: np.ndarray) -> type:
    """fp64 for 16- and 8-bit operands: their products are exact there and so are the sums (unless the products
    span 2**30), so each rounds once to fp32 whatever order BLAS adds in; numpy's fp32 matmul adds in an order that
    depends on the tile's M and N and on the host CPU. fp32 operands stay fp32: fp64 would double the emulator's
    matmul time, and an fp32 operand's products are not exact in fp64 either."""
    return F64 if max(stationary.dtype.itemsize, moving.dtype.itemsize) <= 2 else F32


def _activate(instr, dst, src):
    return ACTIVATIONS[instr.func](src.astype(F32) * F32(instr.imm0) + F32(instr.imm1))


def _activate_bias_reduce(instr, dst, row_sum, src, bias):
    """(dst, row_sum): two destinations, so a pair of values."""
    value = ACTIVATIONS[instr.func](src.astype(F32) * F32(instr.imm0) + bias.astype(F32, copy=False))
    return value, np.add.reduce(np.asarray(value, F32), axis=-1, keepdims=True, dtype=F32)


def _activate_scaled(instr, dst, src, scale, bias):
    return ACTIVATIONS[instr.func](src.astype(F32) * scale.astype(F32, copy=False) + bias.astype(F32, copy=False))


def _tensor_scalar_reduce(instr, dst, reduced, src):
    """(dst, reduced): the scaled values rounded to dst's dtype, and their reduction over the free axis."""
    value = np.asarray(src.astype(F32) * F32(instr.imm0)).astype(dst.dtype)
    return value, REDUCTIONS[instr.alu].reduce(value.astype(F32), axis=-1, keepdims=True)


def _tensor_alu2(instr, dst, a, b, c):
    """alu1(alu(a, b), c) in fp32; the first result is an fp32 value, never rounded to dst's dtype."""
    first = ALU[instr.alu](a.astype(F32), b.astype(F32, copy=False))
    return first if instr.alu1 == AluOp.NONE else ALU[instr.alu1](first, c.astype(F32, copy=False))


def _halves_stats(x):
    """(count, mean, M2) of each row of x (float64 [p, n]): the mean is the fp64 sum over the count, rounded to fp32;
    M2 the fp64 sum of squared deviations from that fp32 mean, rounded to fp32. An empty row gives (0, 0, 0)."""
    p, n = x.shape
    if n == 0:
        return np.zeros((p, 3), F32)
    mean = (x.sum(axis=-1) / n).astype(F32)
    m2 = np.square(x - mean.astype(np.float64)[:, None]).sum(axis=-1).astype(F32)
    return np.stack([np.full(p, n, F32), mean, m2], axis=-1)


def _bn_stats(instr, dst, src):
    """(count, mean, M2) of the even then the odd free positions of each partition (isa.py: BN_STATS)."""
    x = np.asarray(src, np.float64)
    return np.concatenate([_halves_stats(x[:, 0::2]), _halves_stats(x[:, 1::2])], axis=-1)


def _bn_aggr(instr, dst, src):
    """(mean, variance) of each partition from its (count, mean, M2) triples, combined in fp64 (isa.py: BN_AGGR)."""
    t = np.asarray(src, np.float64).reshape(src.shape[0], -1, 3)
    n, m, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = n.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (n * m).sum(axis=-1) / total
        var = (m2.sum(axis=-1) + (n * np.square(m - mean[:, None])).sum(axis=-1)) / total
    return np.stack([mean, var], axis=-1).astype(F32)


def _tensor_tensor_scan(instr, dst, data0, data1, initial):
    """r = alu1(alu(data0[p, i], r), data1[p, i]) for each free element i in row-major order, r starting at
    initial[p, 0] and kept in fp32 (each op rounds to fp32, as numpy's fp32 ufuncs do); dst[p, i] = r. Sequential:
    element i reads the fp32 r of element i - 1, so the order of the ops is the hardware's."""
    rows = dst.shape[0]
    x0 = data0.astype(F32).reshape(rows, -1)
    x1 = data1.astype(F32).reshape(rows, -1)
    op0, op1 = ALU[instr.alu], ALU[instr.alu1]
    out = np.empty(x0.shape, F32)
    r = initial.astype(F32).reshape(rows)
    for i in range(x0.shape[1]):
        r = op1(op0(x0[:, i], r), x1[:, i])
        out[:, i] = r
    return out.reshape(dst.shape)


def _tensor_tensor(instr, dst, a, b):
    dtype = _compute_dtype(a.dtype, b.dtype)
    return ALU[instr.alu](a.astype(dtype), b.astype(dtype, copy=False))  # a copied: NONE returns it


def immediate(value: float, dtype: np.dtype | type) -> np.ndarray:
    """An instruction's immediate (a float64 in the NEFF) in an operation's type; integers saturate, so a
    bound like the largest int64 (which float64 rounds up to 2**63) stays the largest int64."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if value >= info.max:
            return np.asarray(info.max, dtype)
        if value <= info.min:
            return np.asarray(info.min, dtype)
    return np.asarray(value).astype(dtype)


def _tensor_scalar(instr, dst, src):
    dtype = _compute_dtype(src.dtype)
    x, imm = src.astype(dtype), immediate(instr.imm0, dtype)  # x copied: NONE returns it
    return ALU[instr.alu](imm, x) if instr.reverse else ALU[instr.alu](x, imm)


def _tensor_reduce(instr, dst, src):
    dtype = _compute_dtype(src.dtype)
    return REDUCTIONS[instr.alu].reduce(src.astype(dtype, copy=False), axis=-1, keepdims=True, dtype=dtype)


def _tensor_copy(instr, dst, src):
    return src.astype(dst.dtype)


def _select(instr, dst, pred, on_true, on_false):
    return np.where(pred != 0, on_true, on_false)


def _memset(instr, dst):
    return immediate(instr.imm0, dst.dtype)


def _iota(instr, dst):
    dtype = _compute_dtype(dst.dtype)
    partitions, free = dst.shape[0], dst.size // dst.shape[0]
    rows = np.arange(partitions, dtype=dtype)[:, None] * immediate(instr.imm1, dtype)
    values = immediate(instr.imm0, dtype) + rows + np.arange(free, dtype=dtype)
    return values.reshape(dst.shape)


def _row_indices(indices, rows: int) -> np.ndarray:
    index = indices.reshape(-1)
    outside = (index < 0) | (index >= rows)
    if outside.any():
        p = int(np.argmax(outside))
        raise IndexError(f"index {index[p]} (partition {p}) is outside the table's {rows} rows")
    return index.astype(np.intp)


def _dma_gather(instr, dst, table, indices):
    return table[_row_indices(indices, table.shape[0])]


def _dma_scatter(instr, table, src, indices):
    rows = _row_indices(indices, table.shape[0])
    updated = np.array(table)
    if instr.alu == AluOp.ADD:  # an atomic read-modify-write: repeated rows accumulate, in fp32 for floats
        dtype = _compute_dtype(table.dtype, src.dtype)
        total = updated.astype(dtype)
        np.add.at(total, rows, src.astype(dtype))
        return total
    updated[rows] = src
    return updated


@functools.cache
def _uniform_bits(dtype: np.dtype) -> int:
    """Random bits an RNG draw keeps: what the float dtype holds exactly in [0, 1) (its mantissa and the
    implicit bit), so no draw rounds up to 1."""
    return int(ml_dtypes.finfo(dtype).nmant) + 1


_philox = threading.local()  # one numpy Philox per thread, re-keyed for each draw (making one costs ~25 us)


def philox_words(seed: int, first: int, count: int) -> np.ndarray:
    """Words first .. first + count - 1 of the Philox4x64-10 stream keyed by ``seed`` (uint64): numpy's Philox
    bit generator does the rounds, from the block holding word ``first``."""
    generator = getattr(_philox, "generator", None)
    if generator is None:
        generator = _philox.generator = np.random.Philox(0)
    start = first - first % 4
    generator.state = {"bit_generator": "Philox", "buffer": _NO_BUFFER, "buffer_pos": 4, "has_uint32": 0,
                       "uinteger": 0, "state": {"counter": np.array([start // 4 % 2 ** 64, start // 4 >> 64, 0, 0],
                                                                    np.uint64),
                                                "key": np.array([seed, 0], np.uint64)}}
    return generator.random_raw(first - start + count)[first - start:]


_NO_BUFFER = np.zeros(4, np.uint64)


def _rng(instr, dst, state):
    words = np.ascontiguousarray(state).view(np.uint64).reshape(-1)
    seed, offset = int(words[0]), int(words[1])
    partitions, free = dst.shape[0], dst.size // dst.shape[0]
    first, stride = offset + int(instr.imm0), int(instr.imm1)
    if stride == free or partitions == 1:  # the tile's elements are consecutive numbers of the stream
        words = philox_words(seed, first, partitions * free).reshape(partitions, free)
    elif (partitions - 1) * stride + free <= 4 * partitions * free:  # close together: draw the span, pick
        numbers = np.arange(partitions)[:, None] * stride + np.arange(free)
        words = philox_words(seed, first, (partitions - 1) * stride + free)[numbers]
    else:  # far apart: each partition's own words (drawing the span between them could take gigabytes)
        words = np.stack([philox_words(seed, first + p * stride, free) for p in range(partitions)])
    bits = _uniform_bits(dst.dtype if dst.dtype in _FLOATS else np.dtype(F32))
    exact = F32 if bits <= 24 else np.float64  # k-bit integers times 2**-k are exact in either
    return ((words >> np.uint64(64 - bits)).astype(exact) * exact(2.0 ** -bits)).reshape(dst.shape)


TOP = 8  # values MAX8 / FIND_INDEX8 / MATCH_REPLACE8 handle at once


def _max8(instr, dst, src):
    x = src.astype(F32)
    return -np.sort(-x, axis=-1)[:, :TOP]


def _matches(src, values):
    """(found, position), each [rows, 8]: whether value j of a row occurs in it, and where; each position is
    taken at most once, in order of j. So a value repeated among the eight takes its occurrences in turn: the
    j-th copy of a value gets the row's j-th occurrence of it."""
    x, v = src.astype(F32), values.astype(F32)
    same = v[:, :, None] == v[:, None, :]  # [rows, j, j']
    copy = np.tril(same, -1).sum(axis=2)  # how many earlier j' hold the same value
    equal = x[:, None, :] == v[:, :, None]  # [rows, j, n]
    # Running count of occurrences; in uint8 it may wrap after 255, but it first equals copy + 1 (at most 8)
    # at the true occurrence, and argmax takes the first hit.
    hit = equal & (np.cumsum(equal, axis=2, dtype=np.uint8) == (copy + 1)[:, :, None])
    return hit.any(axis=2), hit.argmax(axis=2)


def _find_index8(instr, dst, src, values):
    found, position = _matches(src, values)
    return np.where(found, position, -1)


def _match_replace8(instr, dst, src, values):
    out = src.astype(F32)
    found, position = _matches(src, values)
    rows = np.broadcast_to(np.arange(out.shape[0])[:, None], found.shape)
    out[rows[found], position[found]] = F32(instr.imm0)
    return out


SEMANTICS = {
    Opcode.DMA_COPY: _dma_copy,
    Opcode.DMA_TRANSPOSE: _dma_transpose,
    Opcode.MATMUL: _matmul,
    Opcode.ACTIVATE: _activate,
    Opcode.TENSOR_TENSOR: _tensor_tensor,
    Opcode.TENSOR_SCALAR: _tensor_scalar,
    Opcode.TENSOR_REDUCE: _tensor_reduce,
    Opcode.TENSOR_COPY: _tensor_copy,
    Opcode.SELECT: _select,
    Opcode.MEMSET: _memset,
    Opcode.IOTA: _iota,
    Opcode.DMA_GATHER: _dma_gather,
    Opcode.DMA_SCATTER: _dma_scatter,
    Opcode.MAX8: _max8,
    Opcode.FIND_INDEX8: _find_index8,
    Opcode.MATCH_REPLACE8: _match_replace8,
    Opcode.RNG: _rng,
    Opcode.ACTIVATE_BIAS_REDUCE: _activate_bias_reduce,
    Opcode.ACTIVATE_SCALED: _activate_scaled,
    Opcode.TENSOR_SCALAR_REDUCE: _tensor_scalar_reduce,
    Opcode.TENSOR_ALU2: _tensor_alu2,
    Opcode.TENSOR_TENSOR_SCAN: _tensor_tensor_scan,
    Opcode.BN_STATS: _bn_stats,
    Opcode.BN_AGGR: _bn_aggr,
}


# ---------------------------------------------------------------------------------------------
# Kernels: one instruction bound to the views of its operands, as a list of calls that read the
# sources and write the destination. Built once when a program is loaded, called on every run, so
# the common instructions cost one or two numpy calls each, with no temporaries and no dispatch.
#
# A kernel's result is bit for bit ``dst[...] = SEMANTICS[opcode](instr, dst, *srcs)``. So it writes
# straight into dst only with operations whose result cannot depend on how numpy iterates (its SIMD
# and scalar loops could differ in the last ulp of exp, say): the correctly rounded float operations
# below, maximum and minimum (numpy returns the second operand of max(-0.0, 0.0) on every path; the
# tests hold it to that) and all integer arithmetic. Everything else, reductions included, computes
# as the semantics above do and assigns.

_EXACT_FLOAT_UFUNCS = frozenset({
    np.add, np.subtract, np.multiply, np.divide, np.fmod, np.sqrt, np.negative, np.absolute, np.square,
    np.reciprocal, np.floor, np.ceil, np.rint, np.maximum, np.minimum, np.equal, np.not_equal, np.less,
    np.less_equal, np.greater, np.greater_equal, np.logical_and, np.logical_or, np.logical_xor,
})


def _store(dst, fn, *args):
    """The generic step: compute a fresh value, then round it into dst."""
    dst[...] = fn(*args)


def store_all(dsts: tuple, values: object) -> None:
    """Round an instruction's value into its destinations: ``values`` is one value per destination
    when there are several (Instruction.writes), else the value of the one."""
    if len(dsts) == 1:
        dsts[0][...] = values
        return
    for dst, value in zip(dsts, values):
        dst[...] = value


def _store_all(dsts: tuple, fn, *args):
    store_all(dsts, fn(*args))


def _as(new, dtype: np.dtype, operands: tuple) -> tuple:
    """(operands converted to ``dtype``, the calls converting them): a scratch array per operand that
    is not already of ``dtype``, like ``astype`` but allocated once."""
    converted, calls = [], []
    for x in operands:
        if x.dtype != dtype:
            scratch = new(x.shape, dtype)
            calls.append(partial(_copyto, scratch, x, "unsafe"))
            x = scratch
        converted.append(x)
    return tuple(converted), calls


def _ufunc_into(new, fn, args: tuple, dst: np.ndarray):
    """Calls computing ``fn(*args)`` into dst, or None when its result could depend on memory layout."""
    if not isinstance(fn, np.ufunc):
        return None
    loop = fn.resolve_dtypes(tuple(np.asarray(a).dtype for a in args) + (None,) * fn.nout)
    if any(d.kind == "f" for d in loop[:fn.nin]) and fn not in _EXACT_FLOAT_UFUNCS:
        return None
    if loop[-1] == dst.dtype:
        return [_call_into(fn, args, dst)]
    out = new(dst.shape, loop[-1])
    return [_call_into(fn, args, out), partial(_copyto, dst, out, "unsafe")]


def _call_into(fn: np.ufunc, args: tuple, out: np.ndarray):
    """``fn(*args)`` into ``out``; out passed by position where numpy allows it: a keyword costs 0.4 us a call."""
    return partial(fn, *args, out=out) if fn in (np.maximum, np.minimum) else partial(fn, *args, out)


def _reshaped(a: np.ndarray, shape: tuple):
    """A view of ``a`` with ``shape`` (row-major order), or None if that needs a copy."""
    v = a.reshape(shape)
    return v if np.may_share_memory(v, a) else None


def _dma_copy_kernel(instr, new, dst, src):
    if src.shape == dst.shape:
        return [partial(_copyto, dst, src)]
    src_as_dst = _reshaped(src, dst.shape)
    if src_as_dst is not None:
        return [partial(_copyto, dst, src_as_dst)]
    dst_as_src = _reshaped(dst, src.shape)
    return [partial(_copyto, dst_as_src, src)] if dst_as_src is not None else None


def _matmul_kernel(instr, new, dst, stationary, moving):  # _matmul's semantics, no temporaries
    wide = np.dtype(_matmul_sum_dtype(stationary, moving))
    (stationary, moving), calls = _as(new, wide, (stationary, moving))
    if moving.ndim > 2:  # read through two free dims: gathered into [K, N] columns first
        flat = new((moving.shape[0], moving[0].size), wide)
        calls.append(partial(_copyto, flat.reshape(moving.shape), moving))
        moving = flat
    if not instr.accumulate and dst.dtype == wide and dst.flags.c_contiguous:  # laid out as a fresh product (a
        # one-partition result, as batched matmuls of small results have): the same BLAS call, into dst itself
        return calls + [partial(np.matmul, stationary.T, moving, dst)]
    sums = new(dst.shape, wide)  # C order, as numpy lays out a fresh product: the same BLAS call
    calls.append(partial(np.matmul, stationary.T, moving, sums))
    if wide != F32:
        product = new(dst.shape, F32)
        calls.append(partial(_copyto, product, sums, "unsafe"))  # each sum rounded once to fp32
        sums = product
    calls.append(partial(np.add, dst, sums, dst) if instr.accumulate else partial(_copyto, dst, sums))
    return calls


def _activate_kernel(instr, new, dst, src):
    (x,), calls = _as(new, np.dtype(F32), (src,))
    scaled = new(src.shape, F32)  # C order, as src.astype(F32) * scale + bias would be
    calls += [partial(np.multiply, x, _constant(instr.imm0), scaled),
              partial(np.add, scaled, _constant(instr.imm1), scaled)]
    return calls + _function_into(new, instr.func, scaled, dst)


def _function_into(new, func: ActFunc, scaled: np.ndarray, dst: np.ndarray) -> list:
    """Calls storing ``ACTIVATIONS[func](scaled)`` into dst (``scaled`` a C-ordered fp32 scratch array)."""
    fn = ACTIVATIONS[func]
    if func in (ActFunc.NONE, ActFunc.IDENTITY):
        return [partial(_copyto, dst, scaled, "unsafe")]
    if func in (ActFunc.ERF, ActFunc.GELU):
        return _erf_gelu_into(new, func, scaled, dst)
    if func == ActFunc.RSQRT:  # reciprocal(sqrt(x)): both correctly rounded
        root = new(scaled.shape, F32)
        return [partial(np.sqrt, scaled, root)] + _ufunc_into(new, np.reciprocal, (root,), dst)
    if func == ActFunc.RELU:  # maximum(x, 0)
        return _ufunc_into(new, np.maximum, (scaled, _constant(0.0)), dst)
    fast = _ufunc_into(new, fn, (scaled,), dst)
    if fast is None and isinstance(fn, np.ufunc) and fn.nin == 1 and fn.resolve_dtypes(
            (np.dtype(F32), None)) == (np.dtype(F32), np.dtype(F32)):
        # Into a fresh C-ordered array of scaled's shape, as fn(scaled) would make: the same loop, the same bits.
        value = new(scaled.shape, F32)
        fast = [partial(fn, scaled, value), partial(_copyto, dst, value, "unsafe")]
    return fast or [partial(_store, dst, fn, scaled)]


# op_facts.erf and op_facts.gelu as calls on scratch arrays: the same roundings of the same operands in the same
# order, so the same bits, without their ~20 temporaries. Constants are 0-d arrays: numpy turns a scalar into one
# on every call (~1 us of a [1, 64] tile's 1.5), and broadcasting a shaped constant costs 3x a same-shape operand,
# so P and Q are evaluated apart, where op_facts stacks them (Q's two leading zero coefficients there give
# 0 * x^2 + 0 = 0, then 0 + Q0 = Q0: the same values). Only correctly rounded operations (multiply, add, divide)
# and clamps, none of which depends on how numpy iterates. A clamp is one call where numpy has its clip ufunc
# (max then min per element, a NaN operand returned as it is, as maximum and minimum do; tests hold it to that).
_CLIP = getattr(getattr(getattr(np, "_core", None), "umath", None), "clip", None)


def _constant(value: float) -> np.ndarray:
    """``value`` rounded to fp32, as a 0-d array (what numpy makes of an fp32 scalar operand), made once per value:
    kept by its bits, since -0.0 == 0.0 as a key."""
    return _constant_of_bits(struct.pack("<d", value))


@functools.cache
def _constant_of_bits(bits: bytes) -> np.ndarray:
    array = np.array(struct.unpack("<d", bits)[0], F32)
    array.flags.writeable = False
    return array


def _clamp(x: np.ndarray, lo: float, hi: float, out: np.ndarray) -> list:
    lo, hi = _constant(lo), _constant(hi)
    if _CLIP is not None:
        return [partial(_CLIP, x, lo, hi, out)]
    return [partial(np.maximum, x, lo, out=out), partial(np.minimum, out, hi, out=out)]


def _horner(new, coefficients: tuple, x2: np.ndarray) -> tuple:
    """(calls, value) of the polynomial in x2 with ``coefficients`` (highest first), in fp32 as op_facts.erf."""
    value = new(x2.shape, F32)
    calls = [partial(np.multiply, _constant(coefficients[0]), x2, value)]
    for c in coefficients[1:-1]:
        calls += [partial(np.add, value, _constant(c), value), partial(np.multiply, value, x2, value)]
    return calls + [partial(np.add, value, _constant(coefficients[-1]), value)], value


def _erf_gelu_into(new, func: ActFunc, x: np.ndarray, dst: np.ndarray) -> list:
    shape, calls = x.shape, []
    if func == ActFunc.GELU:  # 0.5 * x * (1.0 + erf(x * (1.0 / sqrt 2)))
        half_x, x_over_root2 = new(shape, F32), new(shape, F32)
        calls += [partial(np.multiply, _constant(0.5), x, half_x),
                  partial(np.multiply, x, _constant(1.0 / math.sqrt(2.0)), x_over_root2)]
        x = x_over_root2
    clamped, x2 = new(shape, F32), new(shape, F32)  # erf(x), as op_facts.erf
    calls += _clamp(x, -ERF_F32_CLAMP, ERF_F32_CLAMP, clamped) + [partial(np.multiply, clamped, clamped, x2)]
    p_calls, p = _horner(new, ERF_F32_P, x2)
    q_calls, q = _horner(new, ERF_F32_Q, x2)
    calls += p_calls + q_calls + [partial(np.multiply, p, clamped, p), partial(np.divide, p, q, p)]
    if func == ActFunc.ERF:
        if dst.dtype == F32:
            return calls + _clamp(p, -1.0, 1.0, dst)
        return calls + _clamp(p, -1.0, 1.0, p) + [partial(_copyto, dst, p, "unsafe")]
    calls += _clamp(p, -1.0, 1.0, p) + [partial(np.add, _constant(1.0), p, p)]
    if dst.dtype == F32:
        return calls + [partial(np.multiply, half_x, p, dst)]
    return calls + [partial(np.multiply, half_x, p, p), partial(_copyto, dst, p, "unsafe")]


def _tensor_tensor_kernel(instr, new, dst, a, b):
    dtype = _compute_dtype(a.dtype, b.dtype)
    (a, b), calls = _as(new, dtype, (a, b))
    if instr.alu == AluOp.NONE:
        return calls + [partial(_copyto, dst, a, "unsafe")]
    fn = ALU[instr.alu]
    fn = fn.pick(dtype) if isinstance(fn, ByKind) else fn
    fast = _ufunc_into(new, fn, (a, b), dst)
    return calls + fast if fast else None


def _tensor_scalar_kernel(instr, new, dst, src):
    dtype = _compute_dtype(src.dtype)
    (x,), calls = _as(new, dtype, (src,))
    imm = immediate(instr.imm0, dtype)
    if instr.alu == AluOp.NONE:  # passes its first operand through
        return [partial(_copyto, dst, imm, "unsafe")] if instr.reverse else calls + [
            partial(_copyto, dst, x, "unsafe")]
    fn = ALU[instr.alu]
    fn = fn.pick(dtype) if isinstance(fn, ByKind) else fn
    if fn in (shift_left, shift_right_logical, shift_right_arithmetic) and not instr.reverse and dtype.kind in "iu":
        return calls + _shift_kernel(instr, new, dst, x, dtype)
    if fn is np.power and dtype == F32 and not instr.reverse and imm == 2.0:
        fn, imm = np.multiply, x  # numpy's fp32 power by 2 is x * x, every bit (benchmarks/power_identities.py)
    fast = _ufunc_into(new, fn, (imm, x) if instr.reverse else (x, imm), dst)
    return calls + fast if fast else None


def _tensor_reduce_kernel(instr, new, dst, src):
    dtype = _compute_dtype(src.dtype)
    (x,), calls = _as(new, dtype, (src,))
    return calls + [partial(_store, dst, REDUCTIONS[instr.alu].reduce, x, -1, dtype, None, True)]


def _select_kernel(instr, new, dst, pred, on_true, on_false):
    """Copy on_false, then on_true where pred != 0: no arithmetic, so exact whenever the values need no
    conversion and dst overlaps nothing it is yet to read."""
    if on_true.dtype != dst.dtype or on_false.dtype != dst.dtype or any(
            np.shares_memory(dst, x) for x in (pred, on_true)):  # exact: every on-chip view spans the rows
        return None
    mask = new(pred.shape, bool)
    return [partial(np.not_equal, pred, pred.dtype.type(0), mask), partial(_copyto, dst, on_false),
            partial(_copyto, dst, on_true, "no", mask)]


def _tensor_copy_kernel(instr, new, dst, src):
    return [partial(_copyto, dst, src, "unsafe")]


def _iota_kernel(instr, new, dst):
    return [partial(_copyto, dst, _iota(instr, dst), "unsafe")]  # the values depend on nothing: made once


def _memset_kernel(instr, new, dst):
    return [partial(dst.__setitem__, Ellipsis, immediate(instr.imm0, dst.dtype))]


def _shift_kernel(instr, new, dst, x, dtype):
    """TENSOR_SCALAR shifting by its immediate (op_facts' shifts): the amount is known at load, so one integer ufunc
    call (exact whatever the layout) or, for an amount outside [0, bits), the constant it gives."""
    bits, fn = dtype.itemsize * 8, ALU[instr.alu]
    amount = immediate(instr.imm0, dtype)
    inside = 0 <= amount < bits
    unsigned = np.dtype(f"u{dtype.itemsize}")
    if fn is shift_right_logical:  # the bits read as unsigned
        x, ufunc, amount = x.view(unsigned), np.right_shift, amount.astype(unsigned)
    elif fn is shift_left:
        ufunc = np.left_shift
    else:  # arithmetic: an amount outside leaves every bit the sign bit
        ufunc, amount = np.right_shift, amount if inside else dtype.type(bits - 1)
    if not inside and fn is not shift_right_arithmetic:
        return [partial(_copyto, dst, dtype.type(0), "unsafe")]
    if dst.dtype == dtype:
        return [partial(ufunc, x, amount, dst.view(x.dtype))]
    out = new(dst.shape, x.dtype)
    return [partial(ufunc, x, amount, out), partial(_copyto, dst, out.view(dtype), "unsafe")]


def _activate_bias_reduce_kernel(instr, new, dst, row_sum, src, bias):
    (x, b), calls = _as(new, np.dtype(F32), (src, bias))
    scaled = new(src.shape, F32)  # C order, as src.astype(F32) * scale + bias would be
    calls += [partial(np.multiply, x, _constant(instr.imm0), scaled), partial(np.add, scaled, b, scaled)]
    fn = ACTIVATIONS[instr.func]
    if instr.func in (ActFunc.NONE, ActFunc.IDENTITY):
        value = scaled
    elif instr.func in (ActFunc.ERF, ActFunc.GELU) or isinstance(fn, np.ufunc) and fn.nin == 1 and fn.resolve_dtypes(
            (np.dtype(F32), None)) == (np.dtype(F32), np.dtype(F32)):
        # Into a fresh C-ordered array of scaled's shape, as fn(scaled) would make: the same loop, the same bits.
        value = new(src.shape, F32)
        calls += _erf_gelu_into(new, instr.func, scaled, value) if instr.func in (ActFunc.ERF, ActFunc.GELU) else [
            partial(fn, scaled, value)]
    else:
        return None
    return calls + [partial(_copyto, dst, value, "unsafe"),
                    partial(_store, row_sum, np.add.reduce, value, -1, F32, None, True)]


def _activate_scaled_kernel(instr, new, dst, src, scale, bias):
    (x, m, b), calls = _as(new, np.dtype(F32), (src, scale, bias))
    scaled = new(src.shape, F32)  # C order, as src.astype(F32) * scale + bias would be
    calls += [partial(np.multiply, x, m, scaled), partial(np.add, scaled, b, scaled)]
    return calls + _function_into(new, instr.func, scaled, dst)


def _tensor_alu2_kernel(instr, new, dst, a, b, c):
    """alu1(alu(a, b), c) with the correctly rounded ALU ops (POW computes as the semantics do)."""
    ops = [ALU[instr.alu]] + ([] if instr.alu1 == AluOp.NONE else [ALU[instr.alu1]])
    ops = [fn.pick(np.dtype(F32)) if isinstance(fn, ByKind) else fn for fn in ops]
    if not all(fn in _EXACT_FLOAT_UFUNCS for fn in ops):
        return None
    if len(ops) == 1:
        (a, b), calls = _as(new, np.dtype(F32), (a, b))
        return calls + _ufunc_into(new, ops[0], (a, b), dst)
    (a, b, c), calls = _as(new, np.dtype(F32), (a, b, c))
    first = new(dst.shape, F32)
    return calls + [_call_into(ops[0], (a, b), first)] + _ufunc_into(new, ops[1], (first, c), dst)


def _max8_kernel(instr, new, dst, src):
    """-sort(-x)[:, :8]: negated into a C-ordered array, sorted in place (as np.sort sorts its C-ordered copy)."""
    (x,), calls = _as(new, np.dtype(F32), (src,))
    negated = new(src.shape, F32)
    calls += [partial(np.negative, x, negated), partial(negated.sort, -1)]
    if dst.dtype == F32:
        return calls + [partial(np.negative, negated[:, :TOP], dst)]
    top = new(dst.shape, F32)
    return calls + [partial(np.negative, negated[:, :TOP], top), partial(_copyto, dst, top, "unsafe")]


# Lower triangle with its diagonal: j' <= j. Among values[j'] for j' <= j, the number equal to values[j] is the
# occurrence _matches gives value j (its earlier copies and itself); a NaN value equals nothing and matches nowhere.
_UP_TO = np.tril(np.ones((TOP, TOP), bool))


def _hits(new, src, values) -> tuple:
    """(calls, hit, x): hit [rows, 8, n] marks where each value j of a row is found, as _matches says (its running
    count of occurrences reaching its occurrence number), at most once per j; x the source in fp32."""
    (x, v), calls = _as(new, np.dtype(F32), (src, values))
    rows, n = x.shape
    count = np.uint8 if n < 2**8 else np.uint16 if n < 2**16 else np.uint32  # never wraps: a single hit per j
    same, occurrence = new((rows, TOP, TOP), bool), new((rows, TOP), count)
    equal, running, hit = new((rows, TOP, n), bool), new((rows, TOP, n), count), new((rows, TOP, n), bool)
    calls += [partial(np.equal, v[:, :, None], v[:, None, :], same), partial(np.logical_and, same, _UP_TO, same),
              partial(np.add.reduce, same, 2, count, occurrence),
              partial(np.equal, x[:, None, :], v[:, :, None], equal),
              partial(np.add.accumulate, equal, 2, count, running),
              partial(np.equal, running, occurrence[:, :, None], hit), partial(np.logical_and, hit, equal, hit)]
    return calls, hit, x


# Rows this short (a routed token's scores, [1, 32]) are matched in Python: numpy's calls on [rows, 8, n] broadcasts
# cost more there than a loop over the values. A choice, measured on the MoE zoo model's [1, 32] rows.
SMALL_TOP8 = 64  # rows * (n + 8) at most


def _small_matches(x: np.ndarray, values: np.ndarray) -> list:
    """What _matches finds, per row in Python on fp32 arrays: rows of the 8 positions (None: not found). Python
    floats hold fp32 values exactly and compare as fp32 does (-0.0 == 0.0, a NaN equals nothing: list.index skips
    only the very object, and the values are other objects than the row's), so the j-th copy of a value takes the
    row's j-th occurrence of it."""
    found = []
    for row, wanted in zip(x.tolist(), values.tolist()):
        last: dict = {}  # value -> the occurrence its previous copy took (len(row) once there is none)
        positions = []
        for value in wanted:
            try:
                n = row.index(value, last.get(value, -1) + 1)
            except ValueError:
                n = len(row)
            last[value] = n
            positions.append(None if n == len(row) else n)
        found.append(positions)
    return found


def _small_find_index8(dst, x, values, position) -> None:
    """With `position` None, dst (int32 or int64) takes the positions as they are: a list assigned there costs
    about half of one assigned to an intp array and copied (0.62 against 1.18 us for [1, 8] here)."""
    found = [[-1 if n is None else n for n in row] for row in _small_matches(x, values)]
    if position is None:
        dst[...] = found
    else:
        position[...] = found
        _copyto(dst, position, "unsafe")


def _small_match_replace8(out, x, values, replacement) -> None:
    hits = [(r, n) for r, row in enumerate(_small_matches(x, values)) for n in row if n is not None]
    _copyto(out, x)
    if hits:
        rows, columns = zip(*hits)
        out[rows, columns] = replacement


def _find_index8_kernel(instr, new, dst, src, values):
    rows, n = src.shape
    if rows * (n + TOP) <= SMALL_TOP8:
        (x, v), calls = _as(new, np.dtype(F32), (src, values))
        wide = dst.dtype in (np.dtype(np.int32), np.dtype(np.int64))  # holds -1 and every position as it is
        return calls + [partial(_small_find_index8, dst, x, v, None if wide else new((rows, TOP), np.intp))]
    calls, hit, _ = _hits(new, src, values)
    position, missing = new((rows, TOP), np.intp), new((rows, TOP), bool)
    return calls + [partial(hit.argmax, 2, position), partial(np.logical_or.reduce, hit, 2, None, missing),
                    partial(np.logical_not, missing, missing), partial(_copyto, dst, position, "unsafe"),
                    partial(_copyto, dst, np.intp(-1), "unsafe", missing)]


def _match_replace8_kernel(instr, new, dst, src, values):
    rows, n = src.shape
    out = dst if dst.dtype == F32 else new(dst.shape, F32)
    if rows * (n + TOP) <= SMALL_TOP8:
        (x, v), calls = _as(new, np.dtype(F32), (src, values))
        calls.append(partial(_small_match_replace8, out, x, v, _constant(instr.imm0)))
    else:
        calls, hit, x = _hits(new, src, values)
        replaced = new(x.shape, bool)
        calls.append(partial(np.logical_or.reduce, hit, 1, None, replaced))  # a position is taken by one j at most
        calls += [partial(_copyto, out, x), partial(_copyto, out, _constant(instr.imm0), "unsafe", replaced)]
    return calls if out is dst else calls + [partial(_copyto, dst, out, "unsafe")]


def _checked_rows(indices: np.ndarray, rows: int, index: np.ndarray, unsigned: np.ndarray) -> None:
    """The indices, as intp into ``index``; refused as _row_indices refuses them. ``unsigned`` is ``index`` viewed
    as uintp, where a negative index is at least 2**63: one reduction finds an index below 0 or past the rows."""
    _copyto(index, indices, "unsafe")
    if len(index) and unsigned.max() >= rows:
        _row_indices(indices, rows)  # raises, naming the first index outside


def _dma_gather_kernel(instr, new, dst, table, indices):
    index = new((indices.shape[0],), np.intp)
    return [partial(_checked_rows, indices[:, 0], table.shape[0], index, index.view(np.uintp)),
            partial(table.take, index, 0, dst, "wrap")]  # every index checked inside; the method: np.take's
    # Python wrapper costs more than the take of a few rows (0.9 against 0.2 us for 32 here)


def _dma_scatter_kernel(instr, new, table, src, indices):
    """The rows written into the table where it lies: the semantics' copy of the whole table, updated and stored
    back, holds the same bytes (the table is in HBM, the rows and indices on chip: they cannot overlap). Every
    index is checked before any row is written, as the semantics check them. An accumulating scatter adds in
    place only when the table and rows are already of the type it adds in (np.add.at on the table itself)."""
    index = new((indices.shape[0],), np.intp)
    check_rows = partial(_checked_rows, indices[:, 0], table.shape[0], index, index.view(np.uintp))
    if instr.alu == AluOp.NONE:
        return [check_rows, partial(table.__setitem__, index, src)]
    if table.dtype == src.dtype == _compute_dtype(table.dtype, src.dtype):
        return [check_rows, partial(np.add.at, table, index, src)]
    return None


_KERNELS = {
    Opcode.MAX8: _max8_kernel,
    Opcode.FIND_INDEX8: _find_index8_kernel,
    Opcode.MATCH_REPLACE8: _match_replace8_kernel,
    Opcode.DMA_GATHER: _dma_gather_kernel,
    Opcode.DMA_SCATTER: _dma_scatter_kernel,
    Opcode.ACTIVATE_BIAS_REDUCE: _activate_bias_reduce_kernel,
    Opcode.ACTIVATE_SCALED: _activate_scaled_kernel,
    Opcode.TENSOR_ALU2: _tensor_alu2_kernel,
    Opcode.DMA_COPY: _dma_copy_kernel,
    Opcode.MATMUL: _matmul_kernel,
    Opcode.ACTIVATE: _activate_kernel,
    Opcode.TENSOR_TENSOR: _tensor_tensor_kernel,
    Opcode.TENSOR_SCALAR: _tensor_scalar_kernel,
    Opcode.TENSOR_REDUCE: _tensor_reduce_kernel,
    Opcode.TENSOR_COPY: _tensor_copy_kernel,
    Opcode.SELECT: _select_kernel,
    Opcode.IOTA: _iota_kernel,
    Opcode.MEMSET: _memset_kernel,
}


def kernel(instr: Instruction, dst: np.ndarray, *srcs: np.ndarray, new: Callable = np.empty) -> list:
    """``instr`` on these views of its operands, as a list of calls to make in order; each returns nothing.

    ``new(shape, dtype)`` makes the temporary arrays the calls use (see :class:`Scratch`)."""
    build = _KERNELS.get(instr.opcode)
    dsts = (dst, *srcs)[:len(instr.writes)]
    return (build(instr, new, dst, *srcs) if build else None) or [
        partial(_store_all, dsts, SEMANTICS[instr.opcode], instr, dst, *srcs)]


class Scratch:
    """Temporary arrays shared by the kernels of a program. A kernel's calls are made back to back and
    leave nothing in their temporaries, so the n-th array of a shape and dtype that one kernel asks for
    can be the n-th of every other: a program needs a few of each instead of one per instruction."""

    def __init__(self):
        self.arrays, self.taken = {}, {}

    def __call__(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype))
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        arrays = self.arrays.setdefault(key, [])
        if n == len(arrays):
            arrays.append(np.empty(shape, dtype))
        return arrays[n]

    def next_kernel(self) -> None:
        """The arrays handed out so far are free again."""
        self.taken.clear()


# ---------------------------------------------------------------------------------------------
# Rules


_ELEMENTWISE_ENGINES = frozenset({Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD})

# Which engines may run each opcode.
ENGINES = {
    Opcode.DMA_COPY: frozenset({Engine.DMA}),
    Opcode.DMA_TRANSPOSE: frozenset({Engine.DMA}),
    Opcode.DMA_GATHER: frozenset({Engine.DMA}),
    Opcode.DMA_SCATTER: frozenset({Engine.DMA}),
    Opcode.MATMUL: frozenset({Engine.TENSOR}),
    Opcode.ACTIVATE: frozenset({Engine.SCALAR}),
    Opcode.ACTIVATE_BIAS_REDUCE: frozenset({Engine.SCALAR}),
    Opcode.ACTIVATE_SCALED: frozenset({Engine.SCALAR}),
    **{op: _ELEMENTWISE_ENGINES for op in (Opcode.TENSOR_TENSOR, Opcode.TENSOR_SCALAR, Opcode.TENSOR_REDUCE,
                                           Opcode.TENSOR_COPY, Opcode.SELECT, Opcode.MEMSET, Opcode.IOTA)},
    Opcode.RNG: frozenset({Engine.GPSIMD}),
    Opcode.TENSOR_TENSOR_SCAN: frozenset({Engine.VECTOR}),  # NKI: "using Vector Engine" (tensor_tensor_scan)
    **{op: frozenset({Engine.COLLECTIVE}) for op in COLLECTIVES},
    **{op: frozenset({Engine.VECTOR, Engine.GPSIMD}) for op in (Opcode.MAX8, Opcode.FIND_INDEX8, Opcode.MATCH_REPLACE8,
                                                               Opcode.TENSOR_SCALAR_REDUCE, Opcode.TENSOR_ALU2,
                                                               Opcode.BN_STATS, Opcode.BN_AGGR)},
}

# Which memories each engine reaches: DMA moves HBM and SBUF (never PSUM); compute engines work on chip, but GpSimd
# never reaches PSUM (TRAINIUM.md, "Corrections and additions": "GpSimd cannot access PSUM"; aws-neuron-sdk
# nki/guides/architecture/trainium2_arch.rst): an instruction with a PSUM operand runs on Vector or Scalar.
SPACES = {
    Engine.DMA: frozenset({Space.HBM, Space.SBUF}),
    Engine.COLLECTIVE: frozenset({Space.HBM}),
    Engine.GPSIMD: frozenset({Space.SBUF}),
    **{e: frozenset({Space.SBUF, Space.PSUM}) for e in (Engine.TENSOR, Engine.VECTOR, Engine.SCALAR)},
}


def _fail(problem: str, hint: str = ""):
    raise NeuronRuntimeError(problem, hint=hint)


def _same_shape(instr: Instruction, target: Target):
    for i, src in enumerate(instr.srcs, 1):
        if src.shape != instr.dst.shape:
            _fail(f"operand {i} has shape {src.shape} but the destination has {instr.dst.shape}",
                  hint="sources must have the destination's shape; broadcast with stride-0 dimensions")


def _dma_shapes(instr: Instruction, target: Target):
    dst, src = instr.operands
    if dst.dtype != src.dtype:
        _fail(f"DMA copies bytes: source is {src.dtype.name} but destination is {dst.dtype.name}",
              hint="convert with TENSOR_COPY on a compute engine")
    if dst.num_elements != src.num_elements:
        _fail(f"DMA source has {src.num_elements} elements but destination has {dst.num_elements}")


def _dma_transpose_shapes(instr: Instruction, target: Target):
    """nki.isa.dma_transpose's rules (targets.py): trn2+, 2-byte types, SBUF destination, 2-D [A, B] = [B, A]^T,
    B a multiple of the [partitions, 16] unit's inner size."""
    dst, src = instr.operands
    if not target.dma_transpose_hbm_fraction:
        _fail(f"{target.name} has no DMA transpose", hint="transpose on the Tensor engine (a matmul by the identity)")
    if dst.dtype != src.dtype or dst.dtype.itemsize != 2:
        _fail(f"DMA transpose moves one 2-byte type; source is {src.dtype.name}, destination {dst.dtype.name}",
              hint="transpose 4-byte types on the Tensor engine")
    if dst.space != Space.SBUF:
        _fail(f"DMA transpose writes SBUF; its destination is in {dst.space.name}")
    if len(dst.shape) != 2 or src.shape != dst.shape[::-1]:
        _fail(f"DMA transpose takes a 2-D source to its transpose; source {src.shape}, destination {dst.shape}")
    if dst.shape[1] % target.dma_transpose_inner:
        _fail(f"DMA transpose's destination has {dst.shape[1]} elements per partition; the DMA engines transpose "
              f"tiles of {target.dma_transpose_inner}", hint=f"a multiple of {target.dma_transpose_inner}")


def _matmul_shapes(instr: Instruction, target: Target):
    dst, stationary, moving = instr.operands
    for name, ap, space in (("stationary", stationary, Space.SBUF), ("moving", moving, Space.SBUF),
                            ("destination", dst, Space.PSUM)):
        if ap.space != space:
            _fail(f"matmul {name} operand is in {ap.space.name}; it must be in {space.name}")
        if len(ap.dims) != 2 and not (name == "moving" and len(ap.dims) == 3):
            # The moving operand may read its N columns through two free dims (rows of a strided tile): the
            # read logic walks up to 4-D access patterns, most instructions 1-3 free dims (NKI, "NKI Access
            # Patterns"); the stationary operand and the PSUM result stay [K, M] / [M, N].
            _fail(f"matmul {name} operand must be 2-D{' or 3-D' if name == 'moving' else ''}, got shape {ap.shape}")
    if dst.dtype in (DType.BF16, DType.F16) and target.tensor_transpose_mode:  # transpose mode (targets.py)
        if instr.accumulate or stationary.dtype != dst.dtype or moving.dtype != dst.dtype:
            _fail(f"a matmul writing {dst.dtype.name} to PSUM is the Tensor engine's transpose mode: its operands "
                  f"must be {dst.dtype.name} too and it cannot accumulate",
                  hint="write F32 to PSUM for a matmul, or transpose a 16-bit tile by the identity")
    elif dst.dtype != DType.F32:
        _fail(f"matmul accumulates in fp32: destination is {dst.dtype.name}, must be F32"
              + ("" if target.tensor_transpose_mode else f" ({target.name} has no transpose mode)"))
    for name, ap in (("stationary", stationary), ("moving", moving)):
        if not ap.dtype.is_float:
            _fail(f"matmul {name} operand is {ap.dtype.name}; the Tensor engine multiplies floats")
    (k, m), (k2, n) = stationary.shape, (moving.shape[0], moving.free_elements)
    for what, size, limit in (("K", k, target.matmul_max_k), ("M", m, target.matmul_max_m),
                              ("N", n, target.matmul_max_n)):
        if size > limit:
            _fail(f"matmul {what}={size} exceeds the Tensor engine's limit {what}<={limit} on {target.name}",
                  hint="tile the matmul; accumulate over K tiles into one PSUM bank")
    if k2 != k or dst.shape != (m, n):
        _fail(f"matmul shapes do not agree: stationary [K={k}, M={m}], moving [K={k2}, N={n}], "
              f"destination {list(dst.shape)} (must be [{m}, {n}])")
    lo, hi = free_byte_span(dst, dst.dims[1:])
    bank = target.psum_bank_bytes
    if lo // bank != (hi - 1) // bank:
        _fail(f"matmul destination spans PSUM bytes [{lo}, {hi}) across banks of {bank} bytes; "
              f"it must lie within one bank")


def _reduce_shapes(instr: Instruction, target: Target):
    dst, src = instr.operands
    if instr.alu not in REDUCTIONS:
        _fail(f"TENSOR_REDUCE supports {', '.join(op.name for op in REDUCTIONS)}, not {instr.alu.name}")
    if len(src.dims) < 2:
        _fail(f"TENSOR_REDUCE reduces the free axis; source shape {src.shape} has none")
    if dst.shape != src.shape[:-1] + (1,):
        _fail(f"TENSOR_REDUCE destination has shape {dst.shape}, must be {src.shape[:-1] + (1,)}")


def _activate_bias_reduce_shapes(instr: Instruction, target: Target):
    """ACTIVATE_BIAS_REDUCE(dst[p, n], row_sum[p, 1] fp32, src[p, n], bias[p, 1] fp32), the two [p, 1]
    tiles in SBUF."""
    dst, row_sum, src, bias = instr.operands
    _per_partition_activation("ACTIVATE_BIAS_REDUCE", dst, src, {"row sum": row_sum, "bias": bias})


def _activate_scaled_shapes(instr: Instruction, target: Target):
    """ACTIVATE_SCALED(dst[p, n], src[p, n], scale[p, 1] fp32, bias[p, 1] fp32), the two [p, 1] tiles in SBUF."""
    dst, src, scale, bias = instr.operands
    _per_partition_activation("ACTIVATE_SCALED", dst, src, {"scale": scale, "bias": bias})


def _per_partition_activation(opcode: str, dst, src, columns: dict):
    """An activation of a 2-D [partitions, elements] tile whose other operands (`columns`, by name) hold one fp32
    value per partition: F32 [p, 1] tiles in SBUF."""
    if len(dst.dims) != 2 or src.shape != dst.shape:
        _fail(f"{opcode} source {list(src.shape)} and destination {list(dst.shape)} must be the "
              f"same 2-D [partitions, elements] shape")
    for name, ap in columns.items():
        if ap.shape != (dst.shape[0], 1) or ap.dtype != DType.F32 or ap.space != Space.SBUF:
            _fail(f"{opcode} {name} must be an F32 [{dst.shape[0]}, 1] tile in SBUF, got "
                  f"{ap.dtype.name}{list(ap.shape)} in {ap.space.name}",
                  hint="one fp32 value per partition, in SBUF")


def _tensor_scalar_reduce_shapes(instr: Instruction, target: Target):
    """TENSOR_SCALAR_REDUCE(dst[p, n] float, reduced[p, 1] fp32 in SBUF, src[p, n] float), reducing by ADD, MAX
    or MIN."""
    dst, reduced, src = instr.operands
    if len(dst.dims) != 2 or src.shape != dst.shape or not (dst.dtype.is_float and src.dtype.is_float):
        _fail(f"TENSOR_SCALAR_REDUCE source {src.dtype.name}{list(src.shape)} and destination "
              f"{dst.dtype.name}{list(dst.shape)} must be float tiles of the same 2-D [partitions, elements] shape")
    if reduced.shape != (dst.shape[0], 1) or reduced.dtype != DType.F32 or reduced.space != Space.SBUF:
        _fail(f"TENSOR_SCALAR_REDUCE's reduction must be an F32 [{dst.shape[0]}, 1] tile in SBUF, got "
              f"{reduced.dtype.name}{list(reduced.shape)} in {reduced.space.name}", hint="one fp32 value per partition, in SBUF")
    if instr.alu not in REDUCTIONS:
        _fail(f"TENSOR_SCALAR_REDUCE reduces by ADD, MAX or MIN, not {instr.alu.name}")


# The ALU ops TENSOR_ALU2 takes: the arithmetic ones (a comparison's 0/1 or a bitwise op has no use in the middle
# of a float computation).
ALU2_OPS = frozenset({AluOp.ADD, AluOp.SUBTRACT, AluOp.MULTIPLY, AluOp.DIVIDE, AluOp.MAX, AluOp.MIN, AluOp.POW})


def _tensor_alu2_shapes(instr: Instruction, target: Target):
    """TENSOR_ALU2(dst, a, b, c): float operands of dst's shape (stride 0 broadcasts), arithmetic ALU ops."""
    _same_shape(instr, target)
    if not all(ap.dtype.is_float for ap in instr.operands):
        _fail(f"TENSOR_ALU2 computes on floats, got {', '.join(ap.dtype.name for ap in instr.operands)}",
              hint="use TENSOR_TENSOR / TENSOR_SCALAR for integers")
    if instr.alu not in ALU2_OPS or instr.alu1 not in ALU2_OPS | {AluOp.NONE}:
        _fail(f"TENSOR_ALU2 takes arithmetic ALU ops ({', '.join(op.name for op in sorted(ALU2_OPS))}; alu1 also "
              f"NONE), got {instr.alu.name} then {instr.alu1.name}")
    if instr.reverse:
        _fail("TENSOR_ALU2 has no reversed form", hint="swap the operands of a commutative op, or use TENSOR_TENSOR")


def _tensor_tensor_scan_shapes(instr: Instruction, target: Target):
    """TENSOR_TENSOR_SCAN(dst, data0, data1, initial): float data of dst's shape (not both in PSUM, as NKI says),
    initial an fp32 [p, 1] SBUF tile, two arithmetic ALU ops."""
    dst, data0, data1, initial = instr.operands
    if not all(ap.dtype.is_float for ap in instr.operands):
        _fail(f"TENSOR_TENSOR_SCAN computes on floats, got {', '.join(ap.dtype.name for ap in instr.operands)}",
              hint="convert integer tiles to fp32 with TENSOR_COPY first")
    for i, ap in ((1, data0), (2, data1)):
        if ap.shape != dst.shape:
            _fail(f"TENSOR_TENSOR_SCAN operand {i} has shape {ap.shape} but the destination has {dst.shape}")
    if data0.space == data1.space == Space.PSUM:
        _fail("TENSOR_TENSOR_SCAN reads at most one of its two data tiles from PSUM", hint="copy one to SBUF first")
    if initial.shape != (dst.shape[0], 1) or initial.dtype != DType.F32 or initial.space != Space.SBUF:
        _fail(f"TENSOR_TENSOR_SCAN's initial value must be an F32 [{dst.shape[0]}, 1] tile in SBUF, got "
              f"{initial.dtype.name}{list(initial.shape)} in {initial.space.name}", hint="one fp32 value per partition")
    if instr.alu not in ALU2_OPS or instr.alu1 not in ALU2_OPS:
        _fail(f"TENSOR_TENSOR_SCAN takes two arithmetic ALU ops ({', '.join(op.name for op in sorted(ALU2_OPS))}), "
              f"got {instr.alu.name} then {instr.alu1.name}")
    if instr.reverse:
        _fail("TENSOR_TENSOR_SCAN has no reversed form", hint="its ops take (data0, previous) then (value, data1)")


def _bn_shapes(instr: Instruction, target: Target):
    """BN_STATS(dst F32 [p, 6] in SBUF, src float [p, n <= bn_stats_max_free]) and BN_AGGR(dst F32 [p, 2] in SBUF,
    src F32 [p, 3k] of (count, mean, M2) triples): 2-D tiles of the same partitions."""
    name, (dst, src) = instr.opcode.name, instr.operands
    width = 6 if instr.opcode == Opcode.BN_STATS else 2
    if len(dst.dims) != 2 or dst.shape != (src.shape[0], width) or dst.dtype != DType.F32 or dst.space != Space.SBUF:
        _fail(f"{name}'s destination must be an F32 [{src.shape[0]}, {width}] tile in SBUF, got "
              f"{dst.dtype.name}{list(dst.shape)} in {dst.space.name}",
              hint="convert the statistics with TENSOR_COPY afterwards if another dtype is wanted")
    if len(src.dims) != 2 or not src.dtype.is_float:
        _fail(f"{name} reads a 2-D float [partitions, elements] tile, got {src.dtype.name}{list(src.shape)}")
    if instr.opcode == Opcode.BN_STATS and src.shape[1] > target.bn_stats_max_free:
        _fail(f"BN_STATS reads at most {target.bn_stats_max_free} elements per partition, got {src.shape[1]}",
              hint="one BN_STATS per chunk of the row, their results side by side, then one BN_AGGR")
    if instr.opcode == Opcode.BN_AGGR and (src.dtype != DType.F32 or src.shape[1] % 3 or not src.shape[1]):
        _fail(f"BN_AGGR reads F32 (count, mean, M2) triples, [p, 3k] with k >= 1; got {src.dtype.name}{list(src.shape)}")


def _indirect_shapes(instr: Instruction, target: Target):
    """DMA_GATHER(rows, table, indices) and DMA_SCATTER(table, rows, indices): the table in HBM, the rows
    and their indices in SBUF."""
    name = instr.opcode.name
    gather = instr.opcode == Opcode.DMA_GATHER
    (rows, table), indices = (instr.operands[:2] if gather else instr.operands[1::-1]), instr.operands[2]
    if table.space != Space.HBM or indices.space != Space.SBUF:
        _fail(f"{name} has its table in HBM ({table.space.name} given) and its indices in SBUF "
              f"({indices.space.name} given)")
    if indices.dtype.is_float or indices.shape != (rows.shape[0], 1):
        _fail(f"{name} indices must be an integer [{rows.shape[0]}, 1] tile, got {indices.dtype.name}"
              f"{list(indices.shape)}")
    if rows.dtype != table.dtype or rows.shape[1:] != table.shape[1:]:
        _fail(f"{name} moves rows of the table {table.dtype.name}{list(table.shape)}; the tile is "
              f"{rows.dtype.name}{list(rows.shape)}")
    if instr.alu not in (AluOp.NONE, AluOp.ADD) or (gather and instr.alu != AluOp.NONE):
        _fail(f"{name} does not support ALU op {instr.alu.name}", hint="DMA_SCATTER may ADD; nothing else")


def _top8_shapes(instr: Instruction, target: Target):
    """MAX8(dst[p, 8], src[p, n]), FIND_INDEX8(dst[p, 8] int, src[p, n], values[p, 8]) and
    MATCH_REPLACE8(dst[p, n], src[p, n], values[p, 8]), all 2-D with n >= 8."""
    name, dst, src = instr.opcode.name, instr.dst, instr.srcs[0]
    values = instr.srcs[1] if len(instr.srcs) > 1 else dst
    if len(src.shape) != 2 or src.shape[1] < TOP:
        _fail(f"{name} reads rows of at least {TOP} values, got {list(src.shape)}")
    if values.shape != (src.shape[0], TOP):
        _fail(f"{name} values must be [{src.shape[0]}, {TOP}], got {list(values.shape)}")
    if instr.opcode == Opcode.MATCH_REPLACE8 and dst.shape != src.shape:
        _fail(f"MATCH_REPLACE8 destination {list(dst.shape)} must have the source's shape {list(src.shape)}")
    if instr.opcode == Opcode.FIND_INDEX8 and (dst.shape != values.shape or dst.dtype.is_float):
        _fail(f"FIND_INDEX8 writes [{src.shape[0]}, {TOP}] integer positions, got {dst.dtype.name}{list(dst.shape)}")


def _rng_shapes(instr: Instruction, target: Target):
    """RNG(dst float, state I64 [1, 2] in SBUF)."""
    dst, state = instr.operands
    if not dst.dtype.is_float:
        _fail(f"RNG draws floats in [0, 1); its destination is {dst.dtype.name}",
              hint="draw into a float tile and convert it with TENSOR_COPY")
    if state.dtype != DType.I64 or state.shape != (1, 2) or state.space != Space.SBUF:
        _fail(f"RNG state must be an I64 [1, 2] tile (seed, offset) in SBUF, got {state.dtype.name}"
              f"{list(state.shape)} in {state.space.name}")
    if not all(math.isfinite(imm) and 0 <= imm < 2**63 and imm == int(imm) for imm in (instr.imm0, instr.imm1)):
        _fail(f"RNG element numbers imm0={instr.imm0}, imm1={instr.imm1} must be whole, not negative and below 2**63")


def _collective_shapes(instr: Instruction, target: Target):
    """ALL_REDUCE / ALL_GATHER / REDUCE_SCATTER / ALL_TO_ALL(dst, src): dense HBM operands of one dtype, sized as
    the collective of imm0 ranks needs; imm1 a group number."""
    name, (dst, src) = instr.opcode.name, instr.operands
    ranks, group = instr.imm0, instr.imm1
    if ranks < 1 or ranks != int(ranks) or group < 0 or group != int(group):
        _fail(f"{name} needs a whole number of ranks >= 1 (imm0 = {ranks}) and a group number >= 0 (imm1 = {group})")
    if dst.dtype != src.dtype:
        _fail(f"{name} moves {src.dtype.name} into {dst.dtype.name}: the operands must have one dtype")
    for i, ap in enumerate(instr.operands):
        if ap.dims != row_major_dims(ap.shape):
            _fail(f"{name} operand {i} must be dense in HBM (row-major strides), got dims {list(ap.dims)}")
    n, ranks = src.num_elements, int(ranks)
    expected = {Opcode.ALL_GATHER: n * ranks, Opcode.REDUCE_SCATTER: n // ranks}.get(instr.opcode, n)
    if instr.opcode in (Opcode.REDUCE_SCATTER, Opcode.ALL_TO_ALL) and n % ranks:
        _fail(f"{name} cuts its {n} source elements into {ranks} equal blocks, one per rank: they do not divide")
    if dst.num_elements != expected:
        _fail(f"{name} over {ranks} ranks of {n} source elements gives {expected}, but the destination has "
              f"{dst.num_elements}", hint="the blocks of the ranks are equal slices of the buffer")
    reduces = instr.opcode in (Opcode.ALL_REDUCE, Opcode.REDUCE_SCATTER)
    if reduces and instr.alu not in COLLECTIVE_REDUCTIONS or not reduces and instr.alu != AluOp.NONE:
        allowed = ", ".join(op.name for op in sorted(COLLECTIVE_REDUCTIONS)) if reduces else "NONE"
        _fail(f"{name} does not reduce by {instr.alu.name}", hint=f"its ALU op is one of {allowed}")


SHAPE_RULES = {
    **{op: _collective_shapes for op in COLLECTIVES},
    Opcode.RNG: _rng_shapes,
    Opcode.MAX8: _top8_shapes,
    Opcode.FIND_INDEX8: _top8_shapes,
    Opcode.MATCH_REPLACE8: _top8_shapes,
    Opcode.DMA_GATHER: _indirect_shapes,
    Opcode.DMA_SCATTER: _indirect_shapes,
    Opcode.DMA_COPY: _dma_shapes,
    Opcode.DMA_TRANSPOSE: _dma_transpose_shapes,
    Opcode.MATMUL: _matmul_shapes,
    Opcode.TENSOR_REDUCE: _reduce_shapes,
    Opcode.ACTIVATE_BIAS_REDUCE: _activate_bias_reduce_shapes,
    Opcode.ACTIVATE_SCALED: _activate_scaled_shapes,
    Opcode.TENSOR_SCALAR_REDUCE: _tensor_scalar_reduce_shapes,
    Opcode.TENSOR_ALU2: _tensor_alu2_shapes,
    Opcode.TENSOR_TENSOR_SCAN: _tensor_tensor_scan_shapes,
    Opcode.BN_STATS: _bn_shapes,
    Opcode.BN_AGGR: _bn_shapes,
}

_FREE_LIMIT = {Space.SBUF: lambda t: t.max_free_elements_sbuf, Space.PSUM: lambda t: t.max_free_elements_psum}


def addresses_bytes_once(ap) -> bool:
    """Whether no two elements of ``ap`` share a byte (partitions are distinct rows on chip). Exact for the
    patterns codegen makes (each dim's stride reaches past all the dims with smaller strides); a pattern
    that interleaves its dims without overlapping is refused too, which no program needs."""
    reach = ap.dtype.itemsize  # bytes spanned by one element, then by the dims taken so far
    for stride, size in sorted((abs(stride) * ap.dtype.itemsize, size) for stride, size in
                               (ap.dims if ap.space == Space.HBM else ap.dims[1:]) if size > 1):
        if stride < reach:
            return False
        reach += stride * (size - 1)
    return True


def check(instr: Instruction, target: Target) -> None:
    """Raise :class:`NeuronRuntimeError` if ``instr`` breaks a rule of the ISA or of ``target``."""
    if len(instr.operands) != ARITY[instr.opcode]:
        _fail(f"{instr.opcode.name} takes {ARITY[instr.opcode]} operands, got {len(instr.operands)}")
    for i, ap in enumerate(instr.operands):
        if not 1 <= len(ap.dims) <= MAX_DIMS:
            _fail(f"operand {i} has {len(ap.dims)} dimensions; an access pattern has 1 to {MAX_DIMS}")
    if instr.engine not in ENGINES[instr.opcode]:
        _fail(f"{instr.opcode.name} cannot run on the {instr.engine.name} engine",
              hint=f"it runs on {' or '.join(sorted(e.name for e in ENGINES[instr.opcode]))}")
    SHAPE_RULES.get(instr.opcode, _same_shape)(instr, target)
    if instr.engine == Engine.DMA and not 0 <= instr.queue < target.dma_queues:
        _fail(f"DMA queue {instr.queue} does not exist; {target.name} has queues 0..{target.dma_queues - 1}")
    if instr.engine != Engine.DMA and instr.queue != 0:
        _fail(f"the {instr.engine.name} engine has one instruction queue, 0; the instruction names queue {instr.queue}")
    distinct = [*enumerate(instr.writes)] + ([(1, instr.operands[1])] if instr.opcode == Opcode.DMA_GATHER else [])
    for i, ap in distinct:
        if not addresses_bytes_once(ap):
            _fail(f"operand {i} addresses some bytes more than once (dims {list(ap.dims)}); an instruction writes "
                  f"each byte at most once, and an indirect DMA's table holds each row once")
    for i, ap in enumerate(instr.operands):
        if ap.space not in SPACES[instr.engine]:
            _fail(f"operand {i} is in {ap.space.name}, which the {instr.engine.name} engine cannot reach",
                  hint="place the instruction on an engine that reaches " + ap.space.name + " ("
                  + ", ".join(sorted(e.name for e in ENGINES[instr.opcode] if ap.space in SPACES[e])) + ")")
        if ap.space == Space.HBM or not ap.dims:
            continue
        if ap.partitions > target.partitions:
            _fail(f"operand {i} spans {ap.partitions} partitions; the limit is {target.partitions}",
                  hint="tile the partition dimension")
        if instr.engine != Engine.DMA and ap.free_elements > _FREE_LIMIT[ap.space](target):
            _fail(f"operand {i} has {ap.free_elements} free elements per partition in {ap.space.name}; "
                  f"the limit is {_FREE_LIMIT[ap.space](target)}", hint="tile the free dimension")
