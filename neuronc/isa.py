"""The emulated NeuronCore instruction set: what an instruction is and what its operands mean.

This is a ground-floor module. Codegen writes these instructions, the NEFF codec encodes them,
the cost model prices them and the runtime executes them; none of those may disagree on the
meaning, so it is written down once, here.

Memory model
------------
* HBM is a flat byte array. An HBM operand names a byte ``offset`` and element strides.
* SBUF and PSUM are 2-D: ``partitions x bytes_per_partition``. An on-chip operand names its first
  ``partition``, a byte ``offset`` inside every partition it covers, and element strides along the
  free axis. Its first dimension is the partition dimension (stride 1 partition).

Every operand is an :class:`AccessPattern`: ``dims`` is a tuple of ``(stride, size)`` pairs,
outermost first, strides in elements of ``dtype``. ``dims[0]`` is the partition dimension. A
stride of 0 broadcasts. The logical shape of an operand is ``tuple(size for _, size in dims)``.
An operand has 1 to ``MAX_DIMS`` dims, each of at least one element. An operand an instruction writes
addresses each byte at most once (no stride-0 or overlapping dims: which write would win is undefined);
so does the table of a DMA_GATHER.

Instruction semantics (``dst`` is always ``operands[0]``)
--------------------------------------------------------
``DMA_COPY(dst, src)``                     dst[...] = src[...]; same dtype, same element count
                                           (shapes may differ, elements are taken in row-major order).
``DMA_TRANSPOSE(dst, src)``                dst[j, i] = src[i, j]: a 2-D transpose by the DMA engines (trn2+;
                                           NKI's dma_transpose), dst [A, B] in SBUF, src [B, A] in HBM or
                                           SBUF, one 2-byte dtype; B a multiple of 16 (the DMA engines
                                           co-operate on [128, 16] tiles of dst: targets.py).
``MATMUL(dst, stationary, moving)``        dst[M, N] (+)= stationary[K, M].T @ moving[K, N] in fp32;
                                           dst is in PSUM; ``accumulate`` adds to dst instead of
                                           overwriting it (the accumulation group over K tiles).
                                           With 16- or 8-bit operands each of the M x N sums over K is
                                           rounded to fp32 once (the emulator sums in fp64: its bits
                                           depend on neither the tile's M and N nor the host's BLAS).
                                           fp32 operands are summed in fp32 in BLAS's order.
                                           trn2+: a bf16/fp16 dst with operands of its dtype, not
                                           accumulating, is the Tensor engine's transpose mode.
``ACTIVATE(dst, src)``                     dst = func(src * imm0 + imm1)   (Scalar engine)
``ACTIVATE_BIAS_REDUCE(dst, row_sum, src, bias)``
                                           dst = func(src * imm0 + bias[p, 0]) and, in the same pass,
                                           row_sum[p, 0] = the fp32 sum over the free axis of that
                                           value before it is rounded to dst's dtype (Scalar engine;
                                           NKI's activation with ``bias`` and ``reduce_res``). bias and
                                           row_sum are fp32 [p, 1] tiles in SBUF; src has dst's shape, 2-D.
                                           Two destinations: dst and row_sum (see ``Instruction.writes``).
``ACTIVATE_SCALED(dst, src, scale, bias)``  dst = func(src * scale[p, 0] + bias[p, 0]) (Scalar engine; NKI's activation
                                           with a [P, 1] ``scale`` tile and a ``bias`` tile): ACTIVATE with a scale
                                           and a bias per partition, fp32 [p, 1] tiles in SBUF held for the pass;
                                           src has dst's shape, 2-D. In fp32 as ACTIVATE: the product rounded to
                                           fp32, the sum rounded to fp32, func's value rounded once to dst's dtype.
``TENSOR_SCALAR_REDUCE(dst, reduced, src)``
                                           dst = src * imm0 (fp32, rounded to dst's dtype) and, in the same
                                           pass, reduced[p, 0] = the alu-reduction (ADD, MAX or MIN) of those
                                           dst values over the free axes (Vector/GpSimd engine; NKI's
                                           tensor_scalar_reduce with a multiplication). reduced is an fp32
                                           [p, 1] tile in SBUF; src has dst's shape, 2-D. Two destinations.
``TENSOR_TENSOR(dst, a, b)``               dst = alu(a, b)
``TENSOR_ALU2(dst, a, b, c)``              dst = alu1(alu(a, b), c): two ALU ops in one pass, in fp32, rounded once
                                           to dst's dtype (NKI's tensor_scalar with op0/op1 and
                                           scalar_tensor_tensor). b and c have dst's shape; a per-partition
                                           value is a [p, 1] tile read with stride 0 along the free axes.
                                           ``alu1`` NONE: dst = alu(a, b) (c is not read). Floats only
                                           (Vector/GpSimd engine).
``TENSOR_TENSOR_SCAN(dst, data0, data1, initial)``
                                           a scan along the free elements of each partition (row-major):
                                           r = initial[p, 0]; for each i in turn r = alu1(alu(data0[p, i], r),
                                           data1[p, i]) and dst[p, i] = r. r stays fp32 (rounded to fp32 after
                                           each op, never to dst's dtype), dst gets each r rounded to its dtype
                                           (NKI's tensor_tensor_scan; Vector engine only, as NKI documents it).
                                           data0 and data1 have dst's shape; initial is an fp32 [p, 1] SBUF tile.
                                           Arithmetic ALU ops (TENSOR_ALU2's), floats only.
``BN_STATS(dst, src)``                     the statistics of each partition's free elements (NKI's bn_stats): src a float
                                           [p, n] tile (2-D, n <= BN_STATS_FMAX, targets.py), dst an F32 [p, 6]
                                           SBUF tile: (count, mean, M2) of the elements at even free indices
                                           (0, 2, ...), then of those at odd ones, M2 the sum of squared deviations
                                           from the mean (NKI's "variance * count"). Defined exactly: each half's
                                           sum is taken in fp64 (numpy's pairwise order), divided by its count and
                                           rounded once to fp32 (the mean); M2 sums (x - mean)^2 in fp64 with that
                                           fp32 mean and rounds once. An empty half gives (0, 0, 0).
                                           (Vector/GpSimd engine.)
``BN_AGGR(dst, src)``                      mean and variance from BN_STATS results (NKI's bn_aggr): src an F32
                                           [p, 3k] tile of k (count, mean, M2) triples, dst an F32 [p, 2] SBUF
                                           tile: (mean, variance), the population variance (divided by the count).
                                           In fp64 from the triples' values, rounded once each to fp32: N = sum
                                           n_i, mean = sum(n_i m_i) / N, variance = (sum M2_i + sum n_i (m_i -
                                           mean)^2) / N with that fp64 mean (Chan's combination); N = 0 gives NaN.
                                           (Vector/GpSimd engine.)
``TENSOR_SCALAR(dst, src)``                dst = alu(src, imm0), or alu(imm0, src) when ``reverse``
``TENSOR_REDUCE(dst, src)``                dst[..., 0] = alu-reduction of src over its last dim;
                                           dst has src's shape with the last size replaced by 1.
``TENSOR_COPY(dst, src)``                  dst = src converted to dst's dtype (round to nearest even)
``SELECT(dst, pred, on_true, on_false)``   dst = where(pred != 0, on_true, on_false)
``MEMSET(dst)``                            dst = imm0
``IOTA(dst)``                              dst[p, i...] = imm0 + p * imm1 + (row-major free index)
``DMA_GATHER(dst, table, indices)``        dst[p, ...] = table[indices[p, 0], ...]  (an indirect DMA)
                                           table is an HBM pattern whose dims[0] = (row stride, rows)
                                           bounds the rows; indices is an integer [p, 1] SBUF tile;
                                           an index outside [0, rows) is an error, not a wrap.
``DMA_SCATTER(table, src, indices)``       table[indices[p, 0], ...] = src[p, ...], or += with ``alu`` ADD
                                           (an indirect DMA writing rows; ADD is an atomic read-modify-write,
                                           so repeated indices accumulate, as NKI's ``atomic_rmw``). With
                                           repeated indices and no ALU, the last partition's row wins.
                                           table is an HBM pattern like DMA_GATHER's; it is read as well as
                                           written (rows no index names keep their values).
``MAX8(dst, src)``                         dst[p, 0:8] = the 8 largest values of src[p, :] (fp32), largest first.
``FIND_INDEX8(dst, src, values)``          dst[p, j] = a position i with src[p, i] == values[p, j] (int32), taking
                                           for j = 0..7 in turn the first such position not taken by an
                                           earlier j (so repeated values get distinct positions); -1 if none.
``RNG(dst, state)``                        dst[p, i...] = uniform random numbers in [0, 1): element number
                                           e = offset + imm0 + p * imm1 + (row-major free index) of the
                                           counter-based stream of the key ``seed``, where (seed, offset)
                                           is ``state``, an I64 [1, 2] SBUF tile (the seed's bits as an
                                           int64). Element e is the (e % 4)-th 64-bit word of the Philox4x64-10
                                           block at counter e // 4 + 1 (``numpy.random.Philox(key=seed)``'s
                                           stream), its top bits scaled to [0, 1): as many bits as dst's
                                           float dtype holds exactly (24 for fp32, 8 for bf16, 11 for fp16).
                                           The GpSimd engine's random-number generator: a draw is a pure
                                           function of (seed, element number), so tiles are independent.
``MATCH_REPLACE8(dst, src, values)``       dst = src, except that for j = 0..7 in turn the first position holding
                                           values[p, j] not yet replaced is set to imm0. With MAX8 and
                                           FIND_INDEX8, the Vector engine's way to top-k and sort (NKI's
                                           max8 / nc_find_index8 / nc_match_replace8).

Collectives (the collective engine; operands in HBM, both dense, of one dtype)
--------------------------------------------------------------------------
``imm0`` is the number of ranks of the group (the NeuronCores taking part, this one among them) and ``imm1``
the group: its index in the table of groups the host gives the runtime's transport (a program may use several,
e.g. the two dimensions of a 2-D mesh). Every rank of the group runs the same program; a collective completes
on all of them with the same result. Rank r's blocks are the r-th of ``imm0`` equal contiguous slices.
``ALL_REDUCE(dst, src)``                   dst = the alu-reduction (ADD, MAX, MIN or MULTIPLY) of every rank's src,
                                           in fp32 for floats (their own type for integers), rounded once to dst's
                                           dtype; dst has src's shape.
``ALL_GATHER(dst, src)``                   block r of dst = rank r's src (dst has ``imm0`` times src's elements).
``REDUCE_SCATTER(dst, src)``               dst = block r (this rank's) of the alu-reduction of every rank's src,
                                           as ALL_REDUCE computes it (src has ``imm0`` times dst's elements).
``ALL_TO_ALL(dst, src)``                   block j of dst = block r (this rank's) of rank j's src (same sizes).

Immediates (``imm0``, ``imm1``) are float64; an integer operation takes them in its own type, saturating
(the largest int64, which float64 rounds up to 2**63, stays the largest int64).

Arithmetic on Vector/Scalar/GpSimd engines is done in fp32 (integers in their own type) and
rounded to the destination dtype, as on the chip. Integer DIVIDE truncates toward zero and
REMAINDER takes the dividend's sign (C's ``/`` and ``fmod``), as StableHLO's divide and remainder.

Registers and loops (format 1.13)
---------------------------------
A program may declare integer *registers* (``neff.program.Register``: a name and a range [lo, hi], 32-bit as NKI's
loop bounds are), set by the host at each launch from the launch's arguments, as runtime scalars are inputs
(NKI's ``VirtualRegister``), and *loops* (``neff.program.Loop``): a hardware loop over one copy of its body (its own
streams) whose trip count is a register's value, 0 allowed (NKI's ``dynamic_range`` / ``fori_loop``). Registers are
read only as loop bounds and offsets, as NKI documents them: an HBM operand's ``terms`` add ``coefficient * value``
bytes to its offset, the value a register's (``source`` >= 0) or the enclosing loop's index (``LOOP_INDEX``). A
program with loops runs its loops in order, each iteration after the previous one has completed on every stream
(the iteration boundary is a barrier; a stated choice), so a ``Wait`` in a body counts the instructions of that
stream in the same iteration: the semaphore count it stands for is that count plus the loop index times the
stream's body length plus what the stream ran before the loop (affine in the loop index).

Ordering
--------
Each stream (an engine, or one DMA queue) executes its instructions in order. Every instruction,
when it completes, increments its stream's semaphore by one, so a stream's semaphore counts its
completed instructions. ``waits`` lists ``(engine, queue, count)``: the instruction may not start
until that stream's semaphore is at least ``count``. Nothing else orders two streams.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import ml_dtypes
import numpy as np


# The enums below hash as the ints they equal (`__hash__ = int.__hash__`, in C, set in each class body so that every
# dict keyed by them is built with it) instead of as their names (Enum.__hash__, a Python call at every dict or set
# lookup: an instruction's stream key (engine, queue), DESTINATIONS by opcode, a few per instruction in codegen's
# passes over a program). A name's hash is salted per process, so no result could depend on the order of a set of
# them (as for ir.Op); an int's hash is the one of the int an IntEnum already compares equal to.
class Space(enum.IntEnum):
    __hash__ = int.__hash__
    HBM = 0
    SBUF = 1
    PSUM = 2


class Engine(enum.IntEnum):
    __hash__ = int.__hash__
    TENSOR = 0
    VECTOR = 1
    SCALAR = 2
    GPSIMD = 3
    DMA = 4
    COLLECTIVE = 5  # the collective-communication engine: its cores move data between the ranks of a group


class DType(enum.IntEnum):
    __hash__ = int.__hash__
    F32 = 0
    BF16 = 1
    F16 = 2
    F8E4M3 = 3
    F8E5M2 = 4
    I8 = 5
    I16 = 6
    I32 = 7
    I64 = 8
    U8 = 9
    BOOL = 10
    F64 = 11
    U16 = 12  # the unsigned integers of JAX's PRNG (threefry2x32 works in uint32, counters in uint64)
    U32 = 13
    U64 = 14

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZES[self]  # a tuple indexed by the value: read for every operand of every instruction

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.BF16, DType.F16, DType.F8E4M3, DType.F8E5M2, DType.F64)

    @staticmethod
    def from_numpy(dtype) -> "DType":
        dtype = np.dtype(dtype)
        for d, n in _NUMPY.items():
            if n == dtype:
                return d
        raise ValueError(f"no neuronc dtype for numpy dtype {dtype}")


def holds_floats(dtype) -> bool:
    """Whether a numpy dtype holds floating-point numbers: numpy's own (kind "f") and ml_dtypes' bfloat16 and
    float8 types, which numpy sees as kind "V" (a `dtype.kind == "f"` test takes them for integers)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in _NARROW_FLOATS


_NUMPY = {
    DType.F32: np.dtype(np.float32),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F16: np.dtype(np.float16),
    DType.F8E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.F8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.I8: np.dtype(np.int8),
    DType.I16: np.dtype(np.int16),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
    DType.F64: np.dtype(np.float64),
    DType.U16: np.dtype(np.uint16),
    DType.U32: np.dtype(np.uint32),
    DType.U64: np.dtype(np.uint64),
}
_ITEMSIZES = tuple(_NUMPY[DType(value)].itemsize for value in range(len(DType)))
# PyTorch converts to float8_e4m3fn saturating: past +-E4M3_MAX (infinities included) a value becomes +-E4M3_MAX, NaN
# stays NaN. numpy's cast (ml_dtypes), StableHLO's convert (XLA's, as JAX programs keep it) and the engines give NaN
# there, so PyTorch's frontend clamps first (frontend/float_semantics.py) and so does the device's copy between
# dtypes (pytorch/eager.py `_assign`).
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_NARROW_FLOATS = frozenset(np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))


class Opcode(enum.IntEnum):
    __hash__ = int.__hash__
    DMA_COPY = 0
    MATMUL = 1
    ACTIVATE = 2
    TENSOR_TENSOR = 3
    TENSOR_SCALAR = 4
    TENSOR_REDUCE = 5
    TENSOR_COPY = 6
    SELECT = 7
    MEMSET = 8
    IOTA = 9
    DMA_GATHER = 10
    DMA_SCATTER = 11
    MAX8 = 12
    FIND_INDEX8 = 13
    MATCH_REPLACE8 = 14
    RNG = 19
    ACTIVATE_BIAS_REDUCE = 20  # 15-19 left for opcodes other branches may add
    TENSOR_SCALAR_REDUCE = 21
    TENSOR_ALU2 = 22
    DMA_TRANSPOSE = 23
    TENSOR_TENSOR_SCAN = 24
    BN_STATS = 25
    BN_AGGR = 26
    ACTIVATE_SCALED = 27
    # the collective engine's (40-49: kept clear of the numbers other branches take for compute opcodes)
    ALL_REDUCE = 40
    ALL_GATHER = 41
    REDUCE_SCATTER = 42
    ALL_TO_ALL = 43


# Operand count of each opcode (dst included).
ARITY = {
    Opcode.DMA_COPY: 2,
    Opcode.MATMUL: 3,
    Opcode.ACTIVATE: 2,
    Opcode.TENSOR_TENSOR: 3,
    Opcode.TENSOR_SCALAR: 2,
    Opcode.TENSOR_REDUCE: 2,
    Opcode.TENSOR_COPY: 2,
    Opcode.SELECT: 4,
    Opcode.MEMSET: 1,
    Opcode.IOTA: 1,
    Opcode.DMA_GATHER: 3,
    Opcode.DMA_SCATTER: 3,
    Opcode.MAX8: 2,
    Opcode.FIND_INDEX8: 3,
    Opcode.MATCH_REPLACE8: 3,
    Opcode.RNG: 2,
    Opcode.ACTIVATE_BIAS_REDUCE: 4,
    Opcode.TENSOR_SCALAR_REDUCE: 3,
    Opcode.TENSOR_ALU2: 4,
    Opcode.DMA_TRANSPOSE: 2,
    Opcode.TENSOR_TENSOR_SCAN: 4,
    Opcode.BN_STATS: 2,
    Opcode.BN_AGGR: 2,
    Opcode.ACTIVATE_SCALED: 4,
    Opcode.ALL_REDUCE: 2,
    Opcode.ALL_GATHER: 2,
    Opcode.REDUCE_SCATTER: 2,
    Opcode.ALL_TO_ALL: 2,
}

# How many leading operands an opcode writes (1 unless listed): its destinations, before its sources.
DESTINATIONS = {
    Opcode.ACTIVATE_BIAS_REDUCE: 2,
    Opcode.TENSOR_SCALAR_REDUCE: 2,
}


class CollectiveOp(enum.IntEnum):
    """What a collective does (priced by neuronc.collective_cost)."""

    __hash__ = int.__hash__

    ALL_REDUCE = 0
    ALL_GATHER = 1
    REDUCE_SCATTER = 2
    ALL_TO_ALL = 3
    BROADCAST = 4
    REDUCE = 5
    SEND = 6
    RECV = 7
    BARRIER = 8


# The collective each opcode of the collective engine performs, and the reductions it may apply.
COLLECTIVES = {
    Opcode.ALL_REDUCE: CollectiveOp.ALL_REDUCE,
    Opcode.ALL_GATHER: CollectiveOp.ALL_GATHER,
    Opcode.REDUCE_SCATTER: CollectiveOp.REDUCE_SCATTER,
    Opcode.ALL_TO_ALL: CollectiveOp.ALL_TO_ALL,
}


class AluOp(enum.IntEnum):
    __hash__ = int.__hash__
    NONE = 0
    ADD = 1
    SUBTRACT = 2
    MULTIPLY = 3
    DIVIDE = 4
    MAX = 5
    MIN = 6
    POW = 7
    EQ = 8
    NE = 9
    LT = 10
    LE = 11
    GT = 12
    GE = 13
    AND = 14
    OR = 15
    XOR = 16
    REMAINDER = 17
    ATAN2 = 18
    # the shifts: integers only, on the engines and at the cost of the other ALU ops (AND/OR/XOR), a stated choice
    SHIFT_LEFT = 19  # an amount outside [0, bits) gives 0 (StableHLO's shift_left)
    SHIFT_RIGHT_LOGICAL = 20  # zero fill; an amount outside [0, bits) gives 0
    SHIFT_RIGHT_ARITHMETIC = 21  # sign fill; an amount outside [0, bits) gives the sign bit everywhere


COLLECTIVE_REDUCTIONS = frozenset({AluOp.ADD, AluOp.MAX, AluOp.MIN, AluOp.MULTIPLY})


class ActFunc(enum.IntEnum):
    __hash__ = int.__hash__
    NONE = 0
    IDENTITY = 1
    EXP = 2
    LOG = 3
    TANH = 4
    SQRT = 5
    RSQRT = 6
    RELU = 7
    SIGMOID = 8
    ERF = 9
    GELU = 10
    ABS = 11
    NEG = 12
    SQUARE = 13
    SIN = 14
    COS = 15
    SIGN = 16
    RECIPROCAL = 17
    FLOOR = 18
    CEIL = 19
    NOT = 20
    LOG1P = 21
    EXPM1 = 22
    ROUND = 23


# `Opcode.MATMUL` is a Python call (EnumType.__getattr__ makes every class attribute lookup one): the properties an
# instruction is asked for per use read these module names instead
_MATMUL, _DMA_SCATTER = Opcode.MATMUL, Opcode.DMA_SCATTER


# ERF (and GELU's erf) is computed by the rational approximation XLA uses for f32, a few ulp from
# the exact value: erf(x) ~ x * P(x^2) / Q(x^2) with x clamped to [-4, 4] (coefficients highest
# power first). The compiler also recognises this expansion in imported graphs.
ERF_F32_P = (-2.72614237e-10, 2.77068146e-08, -2.10102394e-06, -5.69250624e-05, -7.34990637e-04,
             -2.954600e-03, -1.60960332e-02)
ERF_F32_Q = (-1.45660715e-05, -2.13374049e-04, -1.68282702e-03, -7.37332925e-03, -1.42647391e-02)
ERF_F32_CLAMP = 4.0


# The most dimensions an access pattern may have (its partition dimension included). A stated bound: the
# hardware's on-chip access patterns have at most four free dimensions ("NKI Access Patterns", AWS Neuron
# docs), but this ISA lets codegen describe an N-d block of a tensor in one pattern, and its blocks have up to
# about 1 + log2(free elements of a tile) dimensions (every free dimension but the innermost has two or more
# elements), 17 on trn2. 32 leaves room above that and keeps the emulator's numpy views (which add a
# dimension or two) well inside numpy's limit of 64.
MAX_DIMS = 32


LOOP_INDEX = -1  # a term's source: the index of the loop the instruction is in (0, 1, ... in the body's iterations)


class Wait(NamedTuple):
    """Do not start before stream (engine, queue) has completed ``count`` instructions."""

    engine: Engine
    queue: int
    count: int


def row_major_dims(shape) -> tuple:
    """``((stride, size), ...)`` of a dense row-major block of ``shape``, in elements (innermost stride 1)."""
    dims, stride = [], 1
    for size in reversed(shape):
        dims.append((stride, int(size)))
        stride *= int(size)
    return tuple(reversed(dims))


@dataclasses.dataclass(frozen=True)
class AccessPattern:
    space: Space
    dtype: DType
    offset: int  # bytes: into HBM, or into each partition on chip
    dims: tuple  # ((stride, size), ...) in elements, outermost first; dims[0] is the partition dim
    partition: int = 0  # first partition (on chip only)
    terms: tuple = ()  # ((source, bytes), ...): HBM only, offset + sum(bytes * value of source); see "Registers"

    @property
    def shape(self) -> tuple:
        return tuple(size for _, size in self.dims)

    @property
    def num_elements(self) -> int:
        n = 1
        for _, size in self.dims:
            n *= size
        return n

    @property
    def partitions(self) -> int:
        return self.dims[0][1] if self.dims else 1

    @property
    def free_elements(self) -> int:
        n = 1
        for _, size in self.dims[1:]:
            n *= size
        return n


@dataclasses.dataclass
class Instruction:
    opcode: Opcode
    engine: Engine
    operands: tuple  # of AccessPattern; operands[0] is the destination
    queue: int = 0  # DMA queue index; 0 for compute engines
    alu: AluOp = AluOp.NONE
    alu1: AluOp = AluOp.NONE  # TENSOR_ALU2: the second operation
    func: ActFunc = ActFunc.NONE
    imm0: float = 0.0  # ACTIVATE(_BIAS_REDUCE): scale (codegen always sets it; ACTIVATE_SCALED: its scale operand);
    # others: the scalar operand
    imm1: float = 0.0  # ACTIVATE: bias (ACTIVATE_BIAS_REDUCE takes it from its bias operand)
    accumulate: bool = False
    reverse: bool = False
    waits: tuple = ()  # of Wait
    kernel: int = -1  # index into the program's kernel table (-1: none)
    debug: int = -1  # index into the program's debug-location table (-1: none)

    @property
    def stream(self) -> tuple:
        return (self.engine, self.queue)

    @property
    def dst(self) -> AccessPattern:
        return self.operands[0]

    @property
    def writes(self) -> tuple:
        """The operands the instruction writes: its destination, and a second one for the opcodes that have
        it (DESTINATIONS), which follows the first."""
        return self.operands[:DESTINATIONS.get(self.opcode, 1)]

    @property
    def srcs(self) -> tuple:
        return self.operands[DESTINATIONS.get(self.opcode, 1):]

    @property
    def reads(self) -> tuple:
        """The operands the instruction reads: its sources, and its destination when it updates it in place
        (a matmul accumulating into PSUM, a scatter writing some rows of its table). Always a suffix of
        the operands."""
        opcode = self.opcode
        if (opcode == _MATMUL and self.accumulate) or opcode == _DMA_SCATTER:
            return self.operands
        return self.operands[DESTINATIONS.get(opcode, 1):]
