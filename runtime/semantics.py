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
conversion truncates toward zero. ERF, GELU (erf form) and SIGMOID use scipy.special in fp32.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from neuronc.errors import NeuronRuntimeError
from neuronc.isa import ARITY, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space
from neuronc.targets import Target
from runtime.memory import free_byte_span

F32 = np.float32
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


def _erf(x):
    import scipy.special  # lazily: importing scipy costs a third of a second

    return scipy.special.erf(x)


def _sigmoid(x):
    import scipy.special

    return scipy.special.expit(x)


ACTIVATIONS = {
    ActFunc.NONE: lambda x: x,
    ActFunc.IDENTITY: lambda x: x,
    ActFunc.EXP: np.exp,
    ActFunc.LOG: np.log,
    ActFunc.TANH: np.tanh,
    ActFunc.SQRT: np.sqrt,
    ActFunc.RSQRT: lambda x: np.reciprocal(np.sqrt(x)),
    ActFunc.RELU: lambda x: np.maximum(x, F32(0)),
    ActFunc.SIGMOID: _sigmoid,
    ActFunc.ERF: _erf,
    ActFunc.GELU: lambda x: 0.5 * x * (1.0 + _erf(x * (1.0 / math.sqrt(2.0)))),
    ActFunc.ABS: np.abs,
    ActFunc.NEG: np.negative,
    ActFunc.SQUARE: np.square,
    ActFunc.SIN: np.sin,
    ActFunc.COS: np.cos,
    ActFunc.SIGN: np.sign,
    ActFunc.RECIPROCAL: np.reciprocal,
    ActFunc.FLOOR: np.floor,
    ActFunc.CEIL: np.ceil,
    ActFunc.NOT: lambda x: (x == 0).astype(F32),
    ActFunc.LOG1P: np.log1p,
    ActFunc.EXPM1: np.expm1,
    ActFunc.ROUND: np.rint,  # half to even
}


def _truncating_divide(a, b):
    q = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return q + inexact.astype(q.dtype)


def _by_kind(on_integers, on_floats):
    return lambda a, b: (on_floats if np.result_type(a, b).kind == "f" else on_integers)(a, b)


ALU = {
    AluOp.NONE: lambda a, b: a,
    AluOp.ADD: np.add,
    AluOp.SUBTRACT: np.subtract,
    AluOp.MULTIPLY: np.multiply,
    AluOp.DIVIDE: _by_kind(_truncating_divide, np.divide),
    AluOp.MAX: np.maximum,
    AluOp.MIN: np.minimum,
    AluOp.POW: np.power,
    AluOp.EQ: np.equal,
    AluOp.NE: np.not_equal,
    AluOp.LT: np.less,
    AluOp.LE: np.less_equal,
    AluOp.GT: np.greater,
    AluOp.GE: np.greater_equal,
    AluOp.AND: _by_kind(np.bitwise_and, np.logical_and),
    AluOp.OR: _by_kind(np.bitwise_or, np.logical_or),
    AluOp.XOR: _by_kind(np.bitwise_xor, np.logical_xor),
    AluOp.REMAINDER: np.fmod,
    AluOp.ATAN2: np.arctan2,
}

REDUCTIONS = {AluOp.ADD: np.add, AluOp.MAX: np.maximum, AluOp.MIN: np.minimum}


# ---------------------------------------------------------------------------------------------
# Semantics: fn(instr, dst, *srcs) -> the new value of dst, a fresh array (never a view of memory)
# or a scalar. The runtime reads operands when an instruction starts and writes the value into dst,
# rounding to its dtype, when it completes.


def _dma_copy(instr, dst, src):
    return np.array(src).reshape(dst.shape)


def _matmul(instr, dst, stationary, moving):
    product = stationary.astype(F32, copy=False).T @ moving.astype(F32, copy=False)
    return dst + product if instr.accumulate else product


def _activate(instr, dst, src):
    return ACTIVATIONS[instr.func](src.astype(F32) * F32(instr.imm0) + F32(instr.imm1))


def _tensor_tensor(instr, dst, a, b):
    dtype = _compute_dtype(a.dtype, b.dtype)
    return ALU[instr.alu](a.astype(dtype), b.astype(dtype, copy=False))  # a copied: NONE returns it


def _tensor_scalar(instr, dst, src):
    dtype = _compute_dtype(src.dtype)
    x, imm = src.astype(dtype), np.asarray(instr.imm0).astype(dtype)  # x copied: NONE returns it
    return ALU[instr.alu](imm, x) if instr.reverse else ALU[instr.alu](x, imm)


def _tensor_reduce(instr, dst, src):
    dtype = _compute_dtype(src.dtype)
    return REDUCTIONS[instr.alu].reduce(src.astype(dtype, copy=False), axis=-1, keepdims=True, dtype=dtype)


def _tensor_copy(instr, dst, src):
    return src.astype(dst.dtype)


def _select(instr, dst, pred, on_true, on_false):
    return np.where(pred != 0, on_true, on_false)


def _memset(instr, dst):
    return instr.imm0


def _iota(instr, dst):
    dtype = _compute_dtype(dst.dtype)
    partitions, free = dst.shape[0], dst.size // dst.shape[0]
    rows = np.arange(partitions, dtype=dtype)[:, None] * np.asarray(instr.imm1).astype(dtype)
    values = np.asarray(instr.imm0).astype(dtype) + rows + np.arange(free, dtype=dtype)
    return values.reshape(dst.shape)


SEMANTICS = {
    Opcode.DMA_COPY: _dma_copy,
    Opcode.MATMUL: _matmul,
    Opcode.ACTIVATE: _activate,
    Opcode.TENSOR_TENSOR: _tensor_tensor,
    Opcode.TENSOR_SCALAR: _tensor_scalar,
    Opcode.TENSOR_REDUCE: _tensor_reduce,
    Opcode.TENSOR_COPY: _tensor_copy,
    Opcode.SELECT: _select,
    Opcode.MEMSET: _memset,
    Opcode.IOTA: _iota,
}


# ---------------------------------------------------------------------------------------------
# Rules


_ELEMENTWISE_ENGINES = frozenset({Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD})

# Which engines may run each opcode.
ENGINES = {
    Opcode.DMA_COPY: frozenset({Engine.DMA}),
    Opcode.MATMUL: frozenset({Engine.TENSOR}),
    Opcode.ACTIVATE: frozenset({Engine.SCALAR}),
    **{op: _ELEMENTWISE_ENGINES for op in (Opcode.TENSOR_TENSOR, Opcode.TENSOR_SCALAR, Opcode.TENSOR_REDUCE,
                                           Opcode.TENSOR_COPY, Opcode.SELECT, Opcode.MEMSET, Opcode.IOTA)},
}

# Which memories each engine reaches: DMA moves HBM and SBUF (never PSUM); compute engines work on chip.
SPACES = {
    Engine.DMA: frozenset({Space.HBM, Space.SBUF}),
    **{e: frozenset({Space.SBUF, Space.PSUM}) for e in (Engine.TENSOR, *_ELEMENTWISE_ENGINES)},
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


def _matmul_shapes(instr: Instruction, target: Target):
    dst, stationary, moving = instr.operands
    for name, ap, space in (("stationary", stationary, Space.SBUF), ("moving", moving, Space.SBUF),
                            ("destination", dst, Space.PSUM)):
        if ap.space != space:
            _fail(f"matmul {name} operand is in {ap.space.name}; it must be in {space.name}")
        if len(ap.dims) != 2:
            _fail(f"matmul {name} operand must be 2-D, got shape {ap.shape}")
    if dst.dtype != DType.F32:
        _fail(f"matmul accumulates in fp32: destination is {dst.dtype.name}, must be F32")
    for name, ap in (("stationary", stationary), ("moving", moving)):
        if not ap.dtype.is_float:
            _fail(f"matmul {name} operand is {ap.dtype.name}; the Tensor engine multiplies floats")
    (k, m), (k2, n) = stationary.shape, moving.shape
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


SHAPE_RULES = {
    Opcode.DMA_COPY: _dma_shapes,
    Opcode.MATMUL: _matmul_shapes,
    Opcode.TENSOR_REDUCE: _reduce_shapes,
}

_FREE_LIMIT = {Space.SBUF: lambda t: t.max_free_elements_sbuf, Space.PSUM: lambda t: t.max_free_elements_psum}


def check(instr: Instruction, target: Target) -> None:
    """Raise :class:`NeuronRuntimeError` if ``instr`` breaks a rule of the ISA or of ``target``."""
    if len(instr.operands) != ARITY[instr.opcode]:
        _fail(f"{instr.opcode.name} takes {ARITY[instr.opcode]} operands, got {len(instr.operands)}")
    if instr.engine not in ENGINES[instr.opcode]:
        _fail(f"{instr.opcode.name} cannot run on the {instr.engine.name} engine",
              hint=f"it runs on {' or '.join(sorted(e.name for e in ENGINES[instr.opcode]))}")
    SHAPE_RULES.get(instr.opcode, _same_shape)(instr, target)
    if instr.engine == Engine.DMA and not 0 <= instr.queue < target.dma_queues:
        _fail(f"DMA queue {instr.queue} does not exist; {target.name} has queues 0..{target.dma_queues - 1}")
    for i, ap in enumerate(instr.operands):
        if ap.space not in SPACES[instr.engine]:
            _fail(f"operand {i} is in {ap.space.name}, which the {instr.engine.name} engine cannot reach")
        if ap.space == Space.HBM or not ap.dims:
            continue
        if ap.partitions > target.partitions:
            _fail(f"operand {i} spans {ap.partitions} partitions; the limit is {target.partitions}",
                  hint="tile the partition dimension")
        if instr.engine != Engine.DMA and ap.free_elements > _FREE_LIMIT[ap.space](target):
            _fail(f"operand {i} has {ap.free_elements} free elements per partition in {ap.space.name}; "
                  f"the limit is {_FREE_LIMIT[ap.space](target)}", hint="tile the free dimension")
