"""The facts of every op of the graph IR, in one table, and the numpy meaning of the engines' functions.

A ground-floor module (beside `neuronc.isa`): the compiler and the runtime both read it, and it imports neither.

* `FACTS`: one `OpFact` per op of the IR (`neuronc.ir.Op` is made from this table, in its order): how many
  operands it takes, its dtype rule, the StableHLO ops imported as it one to one, its elementwise semantics
  (numpy), the instruction that computes it (a Scalar-engine function or a Vector/GpSimd ALU op), its cost class
  and its attributes. The importer, the constant folder, the fusion passes, codegen and the IR verifier read it.
* `SCALAR_FUNCTIONS` and `ALU_FUNCTIONS`: what each `ActFunc` and `AluOp` of the instruction set computes, in
  numpy; the runtime executes instructions with them, and an op computed by one instruction folds constants
  with the same function, so a folded constant is the value the device would compute.

A new elementwise op computed by an existing instruction is one entry of `FACTS`. One computed by a new
Scalar-engine function also needs the function: an `ActFunc` member (neuronc/isa.py, and the NEFF schema that
mirrors it) and its numpy meaning in `SCALAR_FUNCTIONS`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np

from neuronc.isa import ERF_F32_CLAMP, ERF_F32_P, ERF_F32_Q, ActFunc, AluOp, holds_floats

F32 = np.float32

# --- what the engines' functions compute --------------------------------------------------------------------------

# erf as the ISA defines it (isa.ERF_F32_*): about 5x faster than scipy.special.erf on float32 arrays, which
# matters: GELU runs it on whole activation tiles. P and Q evaluated together (Horner on a [2, ...] stack, Q's
# missing leading coefficients zero: 0 * x^2 + 0 stays 0 for the clamped, finite x^2), in ufunc calls only
# (np.clip costs several): on tiny tiles the number of numpy calls is the cost.
_ERF_PQ = np.array([ERF_F32_P, (0.0,) * (len(ERF_F32_P) - len(ERF_F32_Q)) + ERF_F32_Q], dtype=np.float32)


@functools.cache
def _erf_columns(ndim: int) -> tuple:
    """The coefficient pairs of _ERF_PQ, shaped to broadcast against a [2, ...] stack of ndim-d arrays."""
    return tuple(c.reshape((2,) + (1,) * ndim) for c in _ERF_PQ.T)


def erf(x: np.ndarray) -> np.ndarray:
    """XLA's f32 rational approximation of erf, on x clamped to [-4, 4] (isa.ERF_F32_*)."""
    x = np.asarray(x, dtype=np.float32)
    x = np.minimum(np.maximum(x, np.float32(-ERF_F32_CLAMP)), np.float32(ERF_F32_CLAMP))
    x2 = x * x
    first, *rest = _erf_columns(x.ndim)
    pq = first * x2
    for c in rest[:-1]:
        pq += c
        pq *= x2
    pq += rest[-1]
    p, q = pq[0, ...], pq[1, ...]  # views, 0-d arrays for a 0-d x
    p *= x
    p /= q
    return np.minimum(np.maximum(p, np.float32(-1), out=p), np.float32(1), out=p)


def gelu(x: np.ndarray) -> np.ndarray:
    """x * (1 + erf(x / sqrt 2)) / 2, with the ISA's erf."""
    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))


def sigmoid(x: np.ndarray) -> np.ndarray:
    import scipy.special

    return scipy.special.expit(x)


def identity(x: np.ndarray) -> np.ndarray:
    return x


# ActFunc -> f(x): the Scalar engine's functions (ACTIVATE computes f(scale * x + bias) in fp32).
SCALAR_FUNCTIONS: dict = {
    ActFunc.NONE: identity,
    ActFunc.IDENTITY: identity,
    ActFunc.EXP: np.exp,
    ActFunc.LOG: np.log,
    ActFunc.TANH: np.tanh,
    ActFunc.SQRT: np.sqrt,
    ActFunc.RSQRT: lambda x: np.reciprocal(np.sqrt(x)),
    ActFunc.RELU: lambda x: np.maximum(x, F32(0)),
    ActFunc.SIGMOID: sigmoid,
    ActFunc.ERF: erf,
    ActFunc.GELU: gelu,
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


def truncating_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero (C's `/`, StableHLO's divide)."""
    q = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return q + inexact.astype(q.dtype)


def _shift(a, b, shift: Callable, overflow: Callable) -> np.ndarray:
    """a shifted by b, elementwise, in a's integer type; an amount outside [0, bits) gives overflow(a) (StableHLO's
    rule: numpy, like C, leaves such shifts undefined)."""
    a = np.asarray(a)
    b = np.asarray(b)
    bits = a.dtype.itemsize * 8
    inside = (b >= 0) & (b < bits)
    amount = np.where(inside, b, 0).astype(a.dtype)
    return np.where(inside, shift(a, amount), overflow(a)).astype(a.dtype)


def shift_left(a, b) -> np.ndarray:
    return _shift(a, b, np.left_shift, np.zeros_like)


def shift_right_logical(a, b) -> np.ndarray:
    """Zero fill: the bits read as unsigned, shifted, read back in a's type."""
    a = np.asarray(a)
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    return _shift(a.astype(unsigned), b, np.right_shift, np.zeros_like).astype(a.dtype)


def shift_right_arithmetic(a, b) -> np.ndarray:
    """Sign fill: an amount of bits or more leaves every bit the sign bit (0 for unsigned types)."""
    a = np.asarray(a)
    bits = a.dtype.itemsize * 8
    return _shift(a, b, np.right_shift, lambda x: np.right_shift(x, x.dtype.type(bits - 1)))


class ByKind:
    """An ALU op that means one function on integers (and booleans) and another on floats."""

    def __init__(self, on_integers: Callable, on_floats: Callable):
        self.on_integers, self.on_floats = on_integers, on_floats

    def __call__(self, a, b):
        return self.pick(np.result_type(a, b))(a, b)

    def pick(self, dtype: np.dtype) -> Callable:
        return self.on_floats if holds_floats(dtype) else self.on_integers


# AluOp -> f(a, b): the Vector and GpSimd engines' ALU (floats computed in fp32, integers in their own type).
ALU_FUNCTIONS: dict = {
    AluOp.NONE: lambda a, b: a,
    AluOp.ADD: np.add,
    AluOp.SUBTRACT: np.subtract,
    AluOp.MULTIPLY: np.multiply,
    AluOp.DIVIDE: ByKind(truncating_divide, np.divide),
    AluOp.MAX: np.maximum,
    AluOp.MIN: np.minimum,
    AluOp.POW: np.power,
    AluOp.EQ: np.equal,
    AluOp.NE: np.not_equal,
    AluOp.LT: np.less,
    AluOp.LE: np.less_equal,
    AluOp.GT: np.greater,
    AluOp.GE: np.greater_equal,
    AluOp.AND: ByKind(np.bitwise_and, np.logical_and),
    AluOp.OR: ByKind(np.bitwise_or, np.logical_or),
    AluOp.XOR: ByKind(np.bitwise_xor, np.logical_xor),
    AluOp.REMAINDER: np.fmod,
    AluOp.ATAN2: np.arctan2,
    AluOp.SHIFT_LEFT: shift_left,
    AluOp.SHIFT_RIGHT_LOGICAL: shift_right_logical,
    AluOp.SHIFT_RIGHT_ARITHMETIC: shift_right_arithmetic,
}

# COMPARE's directions: the ALU op computing each.
COMPARISONS = {"EQ": AluOp.EQ, "NE": AluOp.NE, "LT": AluOp.LT, "LE": AluOp.LE, "GT": AluOp.GT, "GE": AluOp.GE}


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A reduction kind of REDUCE / REDUCE_LAST: its identity, the binary op combining two partial results, and
    the ALU op of the instruction reducing a tile (booleans reduce as 0/1: `and` is a min, `or` a max), if any."""

    identity: float | bool
    combine: str  # an Op name
    alu: AluOp | None


REDUCTIONS = {
    "add": Reduction(0.0, "ADD", AluOp.ADD),
    "max": Reduction(-math.inf, "MAXIMUM", AluOp.MAX),
    "min": Reduction(math.inf, "MINIMUM", AluOp.MIN),
    "mul": Reduction(1.0, "MULTIPLY", None),
    "and": Reduction(True, "AND", AluOp.MIN),
    "or": Reduction(False, "OR", AluOp.MAX),
}


# --- the ops of the IR --------------------------------------------------------------------------------------------

# Cost classes: what computes an op, as the cost model and the engine balancers see it.
FREE = "free"  # no instruction: a leaf, or an alias of its operand's bytes (RESHAPE)
SCALAR = "scalar"  # one pass of the Scalar engine (ACTIVATE)
ALU = "alu"  # one pass of the Vector or GpSimd engine (or the Scalar engine's scaled identity for some)
DMA = "dma"  # data movement by the DMA queues (views, pads, concatenation, gathers, scatters)
TENSOR = "tensor"  # the Tensor engine (matmul and the kernels around it)
KERNEL = "kernel"  # a fused kernel, priced by its plan
COLLECTIVE = "collective"  # the collective engine: a collective of the ranks of a process group, priced by the
# interconnect model (neuronc/collective_cost.py)

# Dtype rules: how an op's result dtype relates to its operands'.
SAME = "same"  # operands and result share one dtype
PREDICATE = "predicate"  # operands share one dtype, the result is BOOL
CONVERT = "convert"  # any dtype to any dtype
BITCAST = "bitcast"  # another dtype of the same width: the same bytes read as it
SELECTS = "selects"  # (pred BOOL, on_true, on_false) of the result's dtype
FIRST = "first"  # the result has the first operand's dtype (the others are indices, or the initial value)
ANY = "any"  # set by the op (leaves, contractions and kernels)

# Attribute kinds (the verifier checks them): "int", "ints" (a tuple of ints), "float", "bool", "str", "array",
# "dtype", "collective" (an isa.CollectiveOp), "alu" (an isa.AluOp), "pairs" (a tuple of (int, int)), "steps" (a
# tuple of ir.Step), "views" (a tuple of None or (offset, strides)), "any", or a tuple of the strings allowed. A
# name ending in "?" is optional.
REDUCE_KINDS = tuple(REDUCTIONS)
DIRECTIONS = tuple(COMPARISONS)


@dataclasses.dataclass(frozen=True)
class OpFact:
    name: str  # the ir.Op member
    kind: str  # "leaf" | "unary" | "binary" | "ternary" | "movement" | "reduction" | "indexing" | "kernel"
    arity: int | tuple | None  # operand count (a tuple: the counts allowed; None: any)
    dtype: str  # dtype rule (SAME, PREDICATE, ...)
    cost: str  # cost class (FREE, SCALAR, ...)
    stablehlo: tuple = ()  # StableHLO / CHLO ops imported as this op one to one, with no attributes
    numpy: Callable | None = None  # elementwise semantics on numpy arrays (None: the instruction's function)
    activation: ActFunc | None = None  # one Scalar-engine ACTIVATE computes it
    alu: AluOp | None = None  # one Vector/GpSimd ALU instruction computes it
    rounded_once: bool = False  # a kernel computes it in fp32 and rounds once to the dtype it writes
    attrs: dict = dataclasses.field(default_factory=dict)  # attribute -> kind (see above)
    open_attrs: bool = False  # other attributes allowed (kernels: what their passes attach)

    @property
    def elementwise(self) -> bool:
        return self.kind in ("unary", "binary", "ternary")

    @property
    def semantics(self) -> Callable | None:
        """The numpy function computing the op elementwise: its own, or its instruction's."""
        if self.numpy is not None:
            return self.numpy
        if self.activation is not None:
            return SCALAR_FUNCTIONS[self.activation]
        if self.alu is not None:
            return ALU_FUNCTIONS[self.alu]
        return None


def _unary(name, stablehlo=(), activation=None, numpy=None, rounded_once=True, dtype=SAME, **more) -> OpFact:
    return OpFact(name, "unary", 1, dtype, SCALAR if activation else ALU, tuple(stablehlo), numpy, activation,
                  rounded_once=rounded_once, **more)


def _binary(name, stablehlo=(), alu=None, numpy=None, rounded_once=True, dtype=SAME, **more) -> OpFact:
    return OpFact(name, "binary", 2, dtype, ALU, tuple(stablehlo), numpy, alu=alu, rounded_once=rounded_once, **more)


def _logical_not(x):
    return np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)


def _compare(a, b, direction: str):
    return ALU_FUNCTIONS[COMPARISONS[direction]](a, b)


def _clamp(low, x, high):
    return np.minimum(np.maximum(x, low), high)


_VIEW = {"offset": "int", "strides": "ints"}
_INDEXING = {"window_dims": "ints", "dropped_dims": "ints", "operand_batching_dims": "ints",
             "indices_batching_dims": "ints", "index_map": "ints", "index_vector_dim": "int", "window": "ints"}

FACTS = (
    # leaves
    OpFact("PARAMETER", "leaf", 0, ANY, FREE, attrs={"index": "int", "name": "str", "kind": ("input", "weight"),
                                                       "data?": "array"}),
    OpFact("CONSTANT", "leaf", 0, ANY, FREE, attrs={"value": "array"}),  # a 0-d value: a splat of the shape
    OpFact("IOTA", "leaf", 0, ANY, ALU, ("stablehlo.iota",), attrs={"dimension": "int"}),
    # elementwise, unary
    _unary("NEGATE", ["stablehlo.negate"], numpy=np.negative),  # TENSOR_SCALAR (0 - x), or ACTIVATE(-1 * x)
    _unary("ABS", ["stablehlo.abs"], ActFunc.ABS),
    _unary("EXP", ["stablehlo.exponential"], ActFunc.EXP),
    _unary("EXPM1", ["stablehlo.exponential_minus_one"], ActFunc.EXPM1),
    _unary("LOG", ["stablehlo.log"], ActFunc.LOG),
    _unary("LOG1P", ["stablehlo.log_plus_one"], ActFunc.LOG1P),
    _unary("SQRT", ["stablehlo.sqrt"], ActFunc.SQRT),
    _unary("RSQRT", ["stablehlo.rsqrt"], ActFunc.RSQRT),
    _unary("TANH", ["stablehlo.tanh"], ActFunc.TANH),
    _unary("LOGISTIC", ["stablehlo.logistic"], ActFunc.SIGMOID),
    _unary("SIN", ["stablehlo.sine"], ActFunc.SIN),
    _unary("COS", ["stablehlo.cosine"], ActFunc.COS),
    _unary("SIGN", ["stablehlo.sign"], ActFunc.SIGN, rounded_once=False),
    _unary("FLOOR", ["stablehlo.floor"], ActFunc.FLOOR, rounded_once=False),
    _unary("CEIL", ["stablehlo.ceil"], ActFunc.CEIL, rounded_once=False),
    _unary("ROUND", ["stablehlo.round_nearest_even"], ActFunc.ROUND, rounded_once=False),  # half to even
    _unary("ERF", ["chlo.erf"], ActFunc.ERF),
    _unary("GELU", [], ActFunc.GELU),  # x * (1 + erf(x / sqrt 2)) / 2; raised by canonicalize
    _unary("NOT", ["stablehlo.not"], numpy=_logical_not, rounded_once=False),  # TENSOR_SCALAR (x == 0, x ^ -1)
    _unary("CONVERT", ["stablehlo.convert"], numpy=identity, rounded_once=False, dtype=CONVERT),  # TENSOR_COPY
    # elementwise, binary
    _binary("ADD", ["stablehlo.add"], AluOp.ADD),
    _binary("SUBTRACT", ["stablehlo.subtract"], AluOp.SUBTRACT),
    _binary("MULTIPLY", ["stablehlo.multiply"], AluOp.MULTIPLY),
    _binary("DIVIDE", ["stablehlo.divide"], AluOp.DIVIDE),  # integers: toward zero
    _binary("REMAINDER", ["stablehlo.remainder"], AluOp.REMAINDER, rounded_once=False),  # the dividend's sign
    _binary("POWER", ["stablehlo.power"], AluOp.POW),
    _binary("MAXIMUM", ["stablehlo.maximum"], AluOp.MAX),
    _binary("MINIMUM", ["stablehlo.minimum"], AluOp.MIN),
    _binary("ATAN2", ["stablehlo.atan2"], AluOp.ATAN2, rounded_once=False),
    _binary("AND", ["stablehlo.and"], AluOp.AND, rounded_once=False),
    _binary("OR", ["stablehlo.or"], AluOp.OR, rounded_once=False),
    _binary("XOR", ["stablehlo.xor"], AluOp.XOR, rounded_once=False),
    _binary("SHIFT_LEFT", ["stablehlo.shift_left"], AluOp.SHIFT_LEFT, rounded_once=False),  # integers only
    _binary("SHIFT_RIGHT_LOGICAL", ["stablehlo.shift_right_logical"], AluOp.SHIFT_RIGHT_LOGICAL, rounded_once=False),
    _binary("SHIFT_RIGHT_ARITHMETIC", ["stablehlo.shift_right_arithmetic"], AluOp.SHIFT_RIGHT_ARITHMETIC,
            rounded_once=False),
    _binary("COMPARE", [], numpy=_compare, rounded_once=False, dtype=PREDICATE,  # the ALU op of its direction
            attrs={"direction": DIRECTIONS}),
    # elementwise, ternary
    OpFact("SELECT", "ternary", 3, SELECTS, ALU, ("stablehlo.select",), np.where),  # (pred, on_true, on_false)
    OpFact("CLAMP", "ternary", 3, SAME, ALU, ("stablehlo.clamp",), _clamp),  # (min, x, max)
    # data movement
    OpFact("RESHAPE", "movement", 1, SAME, FREE, ("stablehlo.reshape",)),
    OpFact("BROADCAST_IN_DIM", "movement", 1, SAME, DMA, attrs={"dims": "ints"}),  # operand dim i -> dims[i]
    OpFact("TRANSPOSE", "movement", 1, SAME, DMA, attrs={"perm": "ints"}),
    OpFact("SLICE", "movement", 1, SAME, DMA, attrs={"start": "ints", "limit": "ints", "strides": "ints"}),
    OpFact("CONCATENATE", "movement", None, SAME, DMA,  # views?, shapes?: passes/view_chains.py
           attrs={"dimension": "int", "views?": "any", "shapes?": "any"}),
    OpFact("PAD", "movement", (1, 2), SAME, DMA,  # (x, pad value), or legalized: (x,) with the value an attribute
           attrs={"low": "ints", "high": "ints", "interior": "ints", "value?": "float"}),
    OpFact("REVERSE", "movement", 1, SAME, DMA, attrs={"dims": "ints"}),
    OpFact("BITCAST", "movement", 1, BITCAST, DMA),  # stablehlo.bitcast_convert of one width: a copy of the bytes
    # reductions and contractions
    OpFact("REDUCE", "reduction", 2, SAME, ALU, attrs={"dims": "ints", "kind": REDUCE_KINDS}),  # (x, init)
    OpFact("REDUCE_WINDOW", "reduction", 2, SAME, ALU,  # (x, init)
           attrs={"window": "ints", "strides": "ints", "padding": "pairs", "kind": REDUCE_KINDS}),
    OpFact("DOT_GENERAL", "reduction", 2, ANY, TENSOR,
           attrs={"lhs_batch": "ints", "rhs_batch": "ints", "lhs_contract": "ints", "rhs_contract": "ints"}),
    OpFact("CONVOLUTION", "reduction", 2, ANY, TENSOR,
           attrs={"strides": "ints", "padding": "pairs", "lhs_dilation": "ints", "rhs_dilation": "ints",
                  "groups": "int"}),
    # StableHLO's gather/scatter, normalised (see passes/indexing.py); SCATTER also combine (add, replace, max...);
    # bounds: absent for PyTorch's meaning (an index outside the operand is a run-time error), else StableHLO's
    OpFact("GATHER", "indexing", 2, FIRST, DMA, attrs={**_INDEXING, "bounds?": ("clamp",)}),  # (operand, indices)
    OpFact("TOPK", "indexing", 1, ANY, ALU,  # int32 positions of the k largest (smallest) along a dim, in order
           attrs={"dimension": "int", "k": "int", "descending": "bool"}),
    OpFact("SCATTER", "indexing", 3, FIRST, DMA,  # (operand, indices, updates)
           attrs={**_INDEXING, "combine": ("add", "replace", "max", "min", "mul"), "bounds?": ("drop",)}),
    # kernel-level ops, produced by legalize and the fusion passes
    OpFact("VIEW", "kernel", 1, SAME, DMA, attrs=_VIEW),  # a copy of a strided view of the operand's dense buffer
    OpFact("MATMUL", "kernel", None, ANY, TENSOR, attrs={"k": "int"}, open_attrs=True),  # [B,M,K] x [B,K,N]
    OpFact("REDUCE_LAST", "kernel", None, ANY, ALU, attrs={"kind": REDUCE_KINDS}, open_attrs=True),  # [R,C] -> [R]
    OpFact("GATHER_ROWS", "kernel", 2, FIRST, DMA),  # (table [V, W], rows [N]) -> [N, W]
    OpFact("SCATTER_ROWS", "kernel", 3, FIRST, DMA, attrs={"combine": ("add", "replace")}),  # (base, rows, updates)
    OpFact("FUSED", "kernel", None, ANY, KERNEL, attrs={"body": "steps", "views": "views"}),  # elementwise ops
    OpFact("ROWWISE", "kernel", None, ANY, KERNEL, attrs={"body": "steps"}, open_attrs=True),  # normalisations
    OpFact("CONV", "kernel", None, ANY, TENSOR, open_attrs=True),  # implicit-GEMM convolution (passes/conv.py)
    OpFact("ATTENTION", "kernel", None, ANY, TENSOR, open_attrs=True),  # flash attention (passes/attention.py)
    # x -> a collective of the ranks of a process group (frontend/collectives.py), one instruction of the
    # collective engine; group: the group's number among the graph's groups
    OpFact("COLLECTIVE", "kernel", 1, SAME, COLLECTIVE,
           attrs={"collective": "collective", "reduce": "alu", "ranks": "int", "group": "int"}),
    # FlexAttention's forward (frontend/flex_attention.py): (q, k, v[, mask]) -> out; lowered to ATTENTION
    OpFact("FLEX_ATTENTION", "kernel", (3, 4), ANY, TENSOR, open_attrs=True),
    # custom kernels (neuronc.nki): a traced kernel called on its inputs, placed as it is (codegen/custom.py); its
    # first output is the node's value, the others KERNEL_OUTPUT nodes; outputs and scratch: ((shape, dtype), ...)
    # views?, shapes?: passes/kernel_views.py; output_views?: passes/concatenation_in_place.py
    OpFact("CUSTOM_KERNEL", "kernel", None, ANY, KERNEL,
           attrs={"kernel": "any", "outputs": "any", "scratch": "any", "views?": "any", "shapes?": "any",
                  "output_views?": "any"}),
    # (custom kernel, or a matmul with an `outputs` attribute: passes/matmul_column_sums.py) -> its output index
    OpFact("KERNEL_OUTPUT", "kernel", 1, ANY, FREE, attrs={"index": "int"}),
    # (state I64[2] = (seed, offset), a run-time input) -> uniform floats in [0, 1), element e the draw number
    # offset + first + e (row-major) of the GpSimd engine's RNG stream of the seed (frontend/random_draws.py)
    OpFact("RANDOM", "kernel", 1, ANY, KERNEL, attrs={"first": "int"}),
)

BY_NAME = {fact.name: fact for fact in FACTS}
assert len(BY_NAME) == len(FACTS), "an op is listed twice"
