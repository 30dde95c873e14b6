"""``nki.language`` (``nl``): tensors, memory, index vectors, loops, loads and stores, and tile math.

The names and meanings are NKI's (the public NKI API reference, both its ``nl.load``/``nl.store``/``nl.arange``
style and its ``nl.ndarray`` + ``nisa.dma_copy`` style). Math calls return tiles (``ops.Result``): computed
into a fresh SBUF tile (PSUM for matmul), or straight into the tile they are assigned to.
"""
from __future__ import annotations

import builtins
import contextlib

import numpy as np

from neuronc.isa import ActFunc, AluOp, DType, Space
from neuronc.nki import ops
from neuronc.nki.dtypes import (bf16, bfloat16, bool_, finfo, float8_e4m3, float8_e4m3fn, float8_e5m2,  # noqa: F401
                                float16, float32, fp16, fp32, int8, int16, int32, isa_dtype, tfloat32, uint8)
from neuronc.nki.index import Arange, mgrid  # noqa: F401
from neuronc.nki.tensor import (DynSlice, NkiTensor, ParDim, buffer_space, hbm, par_dim, private_hbm,  # noqa: F401
                                psum, sbuf, shared_hbm)
from neuronc.nki.trace import current, fail

uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
int64 = np.dtype(np.int64)


# ---------------------------------------------------------------------------------------------------------
# Tile sizes


class _TileSize:
    """``nl.tile_size``: the hardware tile limits (of the target being traced, trn2 outside a kernel)."""

    @staticmethod
    def _target():
        from neuronc.nki.trace import _local
        from neuronc.targets import get_target

        trace = getattr(_local, "trace", None)
        return trace.target if trace is not None else get_target("trn2")

    @property
    def pmax(self) -> int:
        return self._target().partitions

    @property
    def gemm_stationary_fmax(self) -> int:
        return self._target().matmul_max_m

    @property
    def gemm_moving_fmax(self) -> int:
        return self._target().matmul_max_n

    @property
    def psum_bank_fmax(self) -> int:
        return self._target().psum_bank_bytes // 4

    @property
    def psum_bank_fmax_bytes(self) -> int:
        return self._target().psum_bank_bytes

    @property
    def psum_fmax(self) -> int:
        return self._target().psum_bytes_per_partition // 4 // 4  # NKI's 2048 fp32 (deprecated name)

    @property
    def psum_num_banks(self) -> int:
        return self._target().psum_banks

    @property
    def sbuf_fmax_bytes(self) -> int:
        return self._target().sbuf_bytes_per_partition

    @property
    def sbuf_fmax(self) -> int:
        return self._target().sbuf_bytes_per_partition // 4

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_size_bytes(self) -> int:
        return self._target().sbuf_bytes

    @property
    def bn_stats_fmax(self) -> int:
        return self._target().bn_stats_max_free

    psum_min_align = 4
    sbuf_min_align = 1


tile_size = _TileSize()


# ---------------------------------------------------------------------------------------------------------
# Memory


def is_psum(buffer) -> bool:
    return buffer_space(buffer) == Space.PSUM


def is_sbuf(buffer) -> bool:
    return buffer_space(buffer) == Space.SBUF


def is_hbm(buffer) -> bool:
    return buffer_space(buffer) == Space.HBM


def is_on_chip(buffer) -> bool:
    return buffer_space(buffer) != Space.HBM


def ndarray(shape, dtype, buffer=None, name: str = "", **kwargs) -> NkiTensor:
    """A new tensor (uninitialised) on ``buffer`` (SBUF by default)."""
    trace = current()
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    space = buffer_space(buffer)
    dtype = isa_dtype(dtype)
    if space == Space.HBM:
        kind = "output" if buffer in (shared_hbm, "shared_hbm") else "scratch"
        if buffer in (hbm, private_hbm, "hbm", "private_hbm"):
            kind = "scratch"
        return trace.hbm_tensor(tuple(int(s) for s in shape), dtype, kind, name)
    trace.flush()
    trace.api = "nl.ndarray"
    return trace.onchip(space, shape, dtype, name)


def zeros(shape, dtype, buffer=None, name: str = "", **kwargs) -> NkiTensor:
    return full(shape, 0.0, dtype, buffer=buffer, name=name)


def ones(shape, dtype, buffer=None, name: str = "", **kwargs) -> NkiTensor:
    return full(shape, 1.0, dtype, buffer=buffer, name=name)


def full(shape, fill_value, dtype, buffer=None, name: str = "", **kwargs) -> NkiTensor:
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    if t.space == Space.PSUM and fill_value == 0:
        t.storage.zero_pending = True  # made only if no matmul overwrites it first
        return t
    if t.on_chip and t.pdim != 0:
        for index in np.ndindex(*t.shape[:t.pdim]):
            ops.memset(t[index], fill_value, api="nl.full")
        return t
    ops.memset(t, fill_value, api="nl.full")
    return t


def zeros_like(x, dtype=None, buffer=None, name: str = "", **kwargs):
    return zeros(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def ones_like(x, dtype=None, buffer=None, name: str = "", **kwargs):
    return ones(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def empty_like(x, dtype=None, buffer=None, name: str = "", **kwargs):
    return ndarray(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def shared_identity_matrix(n, dtype=uint8, dst=None, **kwargs) -> NkiTensor:
    """An n x n identity tile in SBUF (made on chip by an iota and a compare)."""
    trace = current()
    ident = trace.identity(isa_dtype(dtype), n)
    if dst is not None:
        ops.copy(dst, ident, api="nl.shared_identity_matrix")
        return dst
    return ident


def ds(start, size) -> DynSlice:
    return DynSlice(start, size)


def arange(*args) -> Arange:
    start, stop = (0, args[0]) if len(args) == 1 else args[:2]
    return Arange(start, stop)


# ---------------------------------------------------------------------------------------------------------
# Loops and SPMD programs


def affine_range(start, stop=None, step=1, **kwargs):
    """Loops are unrolled when the kernel is traced: affine_range, sequential_range and static_range are range."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def dynamic_range(*args, **kwargs):
    fail("loops with bounds known only on the device are not supported", api="nl.dynamic_range", unsupported=True,
         hint="use affine_range / sequential_range / static_range with Python ints")


def program_id(axis: int = 0) -> int:
    trace = current()
    if axis >= len(trace.program_id):
        fail(f"nl.program_id({axis}) in a launch grid of {len(trace.program_id)} dims", api="nl.program_id",
             hint="launch with kernel[n0, n1, ...](...)")
    return trace.program_id[axis]


def num_programs(axes=0) -> int:
    grid = current().grid_shape
    if axes is None:
        return int(np.prod(grid))
    return grid[axes] if isinstance(axes, int) else int(np.prod([grid[a] for a in axes]))


def program_ndim() -> int:
    return len(current().program_id)


@contextlib.contextmanager
def no_reorder():
    yield


def device_print(prefix, tensor, **kwargs):
    fail("kernel values exist only on the emulated device", api="nl.device_print", unsupported=True,
         hint="return the tensor from the kernel (or store it to an output) to inspect it")


# ---------------------------------------------------------------------------------------------------------
# Data movement


def load(src, dtype=None, mask=None, **kwargs):
    return ops.load(src, dtype=dtype, mask=mask)


def store(dst, value, mask=None, **kwargs):
    ops.store(dst, value, mask=mask)


def load_transpose2d(src, dtype=None, mask=None, **kwargs):
    return ops.load_transpose2d(src, dtype=dtype, mask=mask)


def copy(x, dtype=None, mask=None, **kwargs):
    x = ops.tile(x, "nl.copy", "x") if isinstance(x, NkiTensor) and x.on_chip else x
    if isinstance(x, NkiTensor) and not x.on_chip:
        return ops.load(x, dtype=dtype, mask=mask, api="nl.copy")
    dtype = isa_dtype(dtype) if dtype is not None else x.isa_dtype
    return ops.result(x.shape, dtype, lambda dst: ops.copy(dst, x, mask=mask, api="nl.copy"), "nl.copy")


def _sbuf_operand(x: NkiTensor, api: str) -> NkiTensor:
    """A matmul operand in SBUF (a PSUM tile is copied out first)."""
    x = ops.tile(x, api)
    if x.space == Space.PSUM:
        staged = current().onchip(Space.SBUF, x.shape, DType.F32, "matmul_operand")
        ops.copy(staged, x, api=api)
        return staged
    return x


def matmul(x, y, transpose_x: bool = False, mask=None, **kwargs):
    """x @ y (x given transposed, [K, M], when ``transpose_x``), tiled over K (128) and N (512) into one fp32 PSUM
    tile. Without transpose_x, x [M, K] is transposed on the Tensor engine first."""
    api = "nl.matmul"
    x, y = _sbuf_operand(x, api), _sbuf_operand(y, api)
    trace = current()
    if not transpose_x:
        m, k = x.partitions, x.free_size
        xt = trace.onchip(Space.SBUF, (k, m), x.isa_dtype, "matmul_xT")
        for k0 in range(0, k, 128):
            k1 = builtins.min(k, k0 + 128)
            ops.transpose(xt[k0:k1, :], x.reshape((m, k))[:, k0:k1], api=api)
        x = xt
    k, m = x.partitions, x.free_size
    k2, n = y.partitions, y.free_size
    if k != k2:
        fail(f"contraction sizes differ: {k} and {k2}", api=api)
    if m > trace.target.matmul_max_m:
        fail(f"the result has {m} rows; a matmul result tile has at most {trace.target.matmul_max_m} partitions",
             api=api, hint="tile M")

    def make(dst, accumulate=False):
        flat = dst.reshape((m, n)) if dst.tile().free_size == n else dst
        for n0 in range(0, n, trace.target.matmul_max_n):
            n1 = builtins.min(n, n0 + trace.target.matmul_max_n)
            for step, k0 in enumerate(range(0, k, trace.target.matmul_max_k)):
                k1 = builtins.min(k, k0 + trace.target.matmul_max_k)
                ops.matmul(flat[:, n0:n1], x.reshape((k, m))[k0:k1, :], y.reshape((k, n))[k0:k1, n0:n1],
                           accumulate=accumulate or step > 0, api=api, mask=mask)

    return ops.accumulating_result((m, n), make, api)


def transpose(x, dtype=None, mask=None, **kwargs):
    """x[P, F].T as an SBUF tile (a Tensor-engine transpose through PSUM)."""
    x = ops.tile(x, "nl.transpose")
    x = _sbuf_operand(x, "nl.transpose")
    dtype = isa_dtype(dtype) if dtype is not None else x.isa_dtype
    return ops.result((x.free_size, x.partitions), dtype, lambda dst: ops.transpose(dst, x, api="nl.transpose"),
                      "nl.transpose", spaces=(Space.SBUF, Space.PSUM))


# ---------------------------------------------------------------------------------------------------------
# Elementwise math


def _result_dtype(operands, dtype) -> DType:
    if dtype is not None:
        return isa_dtype(dtype)
    tiles = [x for x in operands if isinstance(x, NkiTensor)]
    floats = [t.isa_dtype for t in tiles if t.isa_dtype.is_float]
    if floats:
        return DType.F32 if DType.F32 in floats else floats[0]
    return tiles[0].isa_dtype


def _result_shape(a: NkiTensor, b: NkiTensor | None) -> tuple:
    a = a.tile()
    if b is None:
        return a.shape
    b = b.tile()
    p = builtins.max(a.partitions, b.partitions)
    if a.free_size == b.free_size:
        return (p,) + a.free_shape
    if b.free_size == 1:
        return (p,) + a.free_shape
    if a.free_size == 1:
        return (p,) + b.free_shape
    try:
        return (p,) + tuple(np.broadcast_shapes(a.free_shape, b.free_shape))
    except ValueError:
        fail(f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast", api="nl elementwise op")


def _binary(name: str, alu: AluOp, x, y, dtype=None, mask=None, compare: bool = False):
    api = f"nl.{name}"
    x_tile, y_tile = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
    if not x_tile and not y_tile:
        from neuronc.nki.index import Affine

        if isinstance(x, (Affine, Arange)) or isinstance(y, (Affine, Arange)):
            fail("elementwise math on nl.arange expressions", api=api,
                 hint="make index values with nisa.iota, or compare index expressions to form a mask")
        return _python_binary(alu, x, y)
    for t in (x, y):
        if isinstance(t, NkiTensor) and not t.on_chip:
            fail("an operand is in HBM", api=api, hint="load it first (nl.load)")
    tiles = [t for t in (x, y) if isinstance(t, NkiTensor)]
    if compare and dtype is None:
        out_dtype = DType.BOOL
    else:
        out_dtype = _result_dtype(tiles, dtype)
    shape = _result_shape(tiles[0], tiles[1] if len(tiles) > 1 else None)

    def make(dst):
        ops.tensor_tensor(dst, x, y, alu, mask=mask, api=api)

    return ops.result(shape, out_dtype, make, api)


def _python_binary(alu, x, y):
    import operator

    return {AluOp.ADD: operator.add, AluOp.SUBTRACT: operator.sub, AluOp.MULTIPLY: operator.mul,
            AluOp.DIVIDE: operator.truediv, AluOp.MAX: builtins.max, AluOp.MIN: builtins.min,
            AluOp.POW: operator.pow}.get(alu, lambda a, b: fail("math on two numbers", api="nl"))(x, y)


def _make_binary(name: str, alu: AluOp, compare: bool = False):
    def fn(x, y, dtype=None, mask=None, **kwargs):
        return _binary(name, alu, x, y, dtype=dtype, mask=mask, compare=compare)

    fn.__name__ = fn.nki_name = name
    fn.__doc__ = f"nl.{name}(x, y): elementwise, on the Vector or GpSimd engine (one of x, y may be a number)."
    return fn


add = _make_binary("add", AluOp.ADD)
subtract = _make_binary("subtract", AluOp.SUBTRACT)
multiply = _make_binary("multiply", AluOp.MULTIPLY)
divide = _make_binary("divide", AluOp.DIVIDE)
maximum = _make_binary("maximum", AluOp.MAX)
minimum = _make_binary("minimum", AluOp.MIN)
power = _make_binary("power", AluOp.POW)
fmod = _make_binary("fmod", AluOp.REMAINDER)
mod = fmod
equal = _make_binary("equal", AluOp.EQ, compare=True)
not_equal = _make_binary("not_equal", AluOp.NE, compare=True)
less = _make_binary("less", AluOp.LT, compare=True)
less_equal = _make_binary("less_equal", AluOp.LE, compare=True)
greater = _make_binary("greater", AluOp.GT, compare=True)
greater_equal = _make_binary("greater_equal", AluOp.GE, compare=True)
logical_and = _make_binary("logical_and", AluOp.AND, compare=True)
logical_or = _make_binary("logical_or", AluOp.OR, compare=True)
logical_xor = _make_binary("logical_xor", AluOp.XOR, compare=True)
bitwise_and = _make_binary("bitwise_and", AluOp.AND)
bitwise_or = _make_binary("bitwise_or", AluOp.OR)
bitwise_xor = _make_binary("bitwise_xor", AluOp.XOR)


def _unary(name: str, func: ActFunc, x, dtype=None, mask=None):
    api = f"nl.{name}"
    if not isinstance(x, NkiTensor):
        import math

        table = {ActFunc.EXP: math.exp, ActFunc.LOG: math.log, ActFunc.SQRT: math.sqrt,
                 ActFunc.TANH: math.tanh, ActFunc.ABS: builtins.abs, ActFunc.NEG: lambda v: -v}
        if func in table:
            return table[func](x)
        fail("math on a number", api=api)
    x = ops.tile(x, api, "x")
    out = _result_dtype([x], dtype)
    if not x.isa_dtype.is_float and func == ActFunc.NEG:
        return ops.result(x.shape, out, lambda dst: ops.tensor_scalar(dst, x, AluOp.MULTIPLY, -1.0, api=api), api)
    return ops.result(x.shape, out, lambda dst: ops.activation(dst, func, x, mask=mask, api=api), api)


def _make_unary(name: str, func: ActFunc):
    def fn(x, dtype=None, mask=None, **kwargs):
        return _unary(name, func, x, dtype=dtype, mask=mask)

    fn.__name__ = fn.nki_name = name
    fn.__doc__ = f"nl.{name}(x): elementwise, on the Scalar engine (one activation pass)."
    return fn


exp = _make_unary("exp", ActFunc.EXP)
log = _make_unary("log", ActFunc.LOG)
tanh = _make_unary("tanh", ActFunc.TANH)
sqrt = _make_unary("sqrt", ActFunc.SQRT)
rsqrt = _make_unary("rsqrt", ActFunc.RSQRT)
relu = _make_unary("relu", ActFunc.RELU)
sigmoid = _make_unary("sigmoid", ActFunc.SIGMOID)
gelu = _make_unary("gelu", ActFunc.GELU)
erf = _make_unary("erf", ActFunc.ERF)
abs = _make_unary("abs", ActFunc.ABS)
negative = _make_unary("negative", ActFunc.NEG)
square = _make_unary("square", ActFunc.SQUARE)
sin = _make_unary("sin", ActFunc.SIN)
cos = _make_unary("cos", ActFunc.COS)
sign = _make_unary("sign", ActFunc.SIGN)
reciprocal = _make_unary("reciprocal", ActFunc.RECIPROCAL)
floor = _make_unary("floor", ActFunc.FLOOR)
ceil = _make_unary("ceil", ActFunc.CEIL)
log1p = _make_unary("log1p", ActFunc.LOG1P)
expm1 = _make_unary("expm1", ActFunc.EXPM1)
logical_not = _make_unary("logical_not", ActFunc.NOT)


def silu(x, dtype=None, mask=None, **kwargs):
    """x * sigmoid(x): a sigmoid (Scalar) into fp32, then a multiply (Vector)."""
    api = "nl.silu"
    x = ops.tile(x, api, "x")
    out = _result_dtype([x], dtype)

    def make(dst):
        s = current().onchip(Space.SBUF, x.shape, DType.F32, "silu_sigmoid")
        ops.activation(s, ActFunc.SIGMOID, x, mask=mask, api=api)
        ops.tensor_tensor(dst, x, s, AluOp.MULTIPLY, mask=mask, api=api)

    return ops.result(x.shape, out, make, api)


def _unsupported(name: str):
    def fn(*args, **kwargs):
        fail("not supported by neuronc.nki", api=f"nl.{name}", unsupported=True,
             hint="the emulated instruction set has no instruction for it; compose it from supported calls")

    fn.__name__ = fn.nki_name = name
    return fn


for _name in ("gelu_dx", "gelu_apprx_tanh", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "silu_dx", "softplus",
              "mish", "erf_dx", "tan", "arctan", "trunc", "invert", "left_shift", "right_shift", "prod", "all",
              "dropout", "rand", "random_seed", "gather_flattened", "abs_max", "abs_min", "shared_constant",
              "fori_loop", "while_loop"):
    globals()[_name] = _unsupported(_name)


# ---------------------------------------------------------------------------------------------------------
# Reductions and normalisations


def _reduction(name: str, alu: AluOp, x, axis, dtype=None, keepdims=False, mask=None):
    api = f"nl.{name}"
    x = ops.tile(x, api, "x")
    out = isa_dtype(dtype) if dtype is not None else x.isa_dtype
    shape = ops.reduce_shape(x.shape, axis, keepdims)
    return ops.result(shape, out, lambda dst: ops.tensor_reduce(dst, alu, x, axis, mask=mask, api=api), api)


def sum(x, axis, dtype=None, keepdims=False, mask=None, **kwargs):  # noqa: A001 - NKI's name
    return _reduction("sum", AluOp.ADD, x, axis, dtype, keepdims, mask)


def max(x, axis, dtype=None, keepdims=False, mask=None, **kwargs):  # noqa: A001
    return _reduction("max", AluOp.MAX, x, axis, dtype, keepdims, mask)


def min(x, axis, dtype=None, keepdims=False, mask=None, **kwargs):  # noqa: A001
    return _reduction("min", AluOp.MIN, x, axis, dtype, keepdims, mask)


sum.nki_name, max.nki_name, min.nki_name = "sum", "max", "min"


def _count(x: NkiTensor, axis) -> int:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return int(np.prod([x.shape[a] for a in axes]))


def mean(x, axis, dtype=None, keepdims=False, mask=None, **kwargs):
    """The sum over ``axis`` into fp32, divided by the count (two steps, fp32 in between)."""
    api = "nl.mean"
    x = ops.tile(x, api, "x")
    out = isa_dtype(dtype) if dtype is not None else x.isa_dtype
    shape = ops.reduce_shape(x.shape, axis, keepdims)
    n = _count(x, axis)

    def make(dst):
        total = current().onchip(Space.SBUF, shape, DType.F32, "mean_sum")
        ops.tensor_reduce(total, AluOp.ADD, x, axis, mask=mask, api=api)
        ops.tensor_scalar(dst, total, AluOp.DIVIDE, float(n), api=api)

    return ops.result(shape, out, make, api)


def var(x, axis, dtype=None, mask=None, **kwargs):
    """The mean of (x - mean)^2 over ``axis`` (the square and its sum in one Scalar pass)."""
    api = "nl.var"
    x = ops.tile(x, api, "x")
    out = isa_dtype(dtype) if dtype is not None else x.isa_dtype
    shape = ops.reduce_shape(x.shape, axis, True)
    n = _count(x, axis)

    def make(dst):
        trace = current()
        total = trace.onchip(Space.SBUF, shape, DType.F32, "var_sum")
        ops.tensor_reduce(total, AluOp.ADD, x, axis, api=api)
        neg_mean = trace.onchip(Space.SBUF, shape, DType.F32, "var_neg_mean")
        ops.tensor_scalar(neg_mean, total, AluOp.DIVIDE, float(-n), api=api)
        squares = trace.onchip(Space.SBUF, x.shape, DType.F32, "var_squares")
        sq_sum = trace.onchip(Space.SBUF, shape, DType.F32, "var_square_sum")
        ops.activation(squares, ActFunc.SQUARE, x, bias=neg_mean, reduce_res=sq_sum, api=api)
        ops.tensor_scalar(dst, sq_sum, AluOp.DIVIDE, float(n), api=api)

    return ops.result(shape, out, make, api)


def softmax(x, axis=-1, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """exp(x - max) / sum over the last axis: the negated row max (Vector), the exp with its row sum in one
    Scalar pass, the division by the per-partition sum (Vector)."""
    api = "nl.softmax"
    x = ops.tile(x, api, "x")
    if axis not in (-1, x.ndim - 1, 1) or x.ndim != 2:
        fail("softmax over the last axis of a 2-D tile", api=api, unsupported=True)
    out = isa_dtype(dtype) if dtype is not None else x.isa_dtype

    def make(dst):
        trace = current()
        p = x.partitions
        neg_max = trace.onchip(Space.SBUF, (p, 1), DType.F32, "softmax_neg_max")
        ops.tensor_reduce(neg_max, AluOp.MAX, x, 1, negate=True, api=api)
        e = trace.onchip(Space.SBUF, x.shape, DType.F32, "softmax_exp")
        total = trace.onchip(Space.SBUF, (p, 1), DType.F32, "softmax_sum")
        ops.activation(e, ActFunc.EXP, x, bias=neg_max, reduce_res=total, api=api)
        ops.tensor_tensor(dst, e, total, AluOp.DIVIDE, api=api)

    return ops.result(x.shape, out, make, api)


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """x / sqrt(mean(x^2) + eps) * w: the squares summed in one Scalar pass, rsqrt(sum / n + eps) as one
    activation, then two multiplies."""
    api = "nl.rms_norm"
    x = ops.tile(x, api, "x")
    out = isa_dtype(dtype) if dtype is not None else x.isa_dtype

    def make(dst):
        trace = current()
        p = x.partitions
        squares = trace.onchip(Space.SBUF, x.shape, DType.F32, "rms_squares")
        total = trace.onchip(Space.SBUF, (p, 1), DType.F32, "rms_sum")
        ops.activation(squares, ActFunc.SQUARE, x, reduce_res=total, api=api)
        rstd = trace.onchip(Space.SBUF, (p, 1), DType.F32, "rms_rstd")
        ops.activation(rstd, ActFunc.RSQRT, total, bias=float(epsilon), scale=1.0 / n, api=api)
        normed = trace.onchip(Space.SBUF, x.shape, DType.F32, "rms_normed")
        ops.tensor_tensor(normed, x, rstd, AluOp.MULTIPLY, api=api)
        ops.tensor_tensor(dst, normed, w, AluOp.MULTIPLY, api=api)

    return ops.result(x.shape, out, make, api)


def where(condition, x, y, dtype=None, mask=None, **kwargs):
    api = "nl.where"
    cond = ops.tile(condition, api, "condition")
    tiles = [t for t in (x, y) if isinstance(t, NkiTensor)]
    out = _result_dtype(tiles, dtype) if tiles else (isa_dtype(dtype) if dtype is not None else DType.F32)
    return ops.result(cond.shape, out, lambda dst: ops.select(dst, cond, x, y, mask=mask, api=api), api)


def atomic_rmw(dst, value, op, mask=None, **kwargs):
    """dst[idx, ...] <op>= value for rows picked by a tile of row numbers: an indirect DMA scatter that accumulates
    (repeated rows add up). Only addition is supported."""
    from neuronc.nki.opnames import ALU, lookup
    from neuronc.nki.tensor import Indirect

    if lookup(op, ALU, "op", "nl.atomic_rmw") != AluOp.ADD:
        fail("only op=nl.add is supported", api="nl.atomic_rmw", unsupported=True)
    if not isinstance(dst, Indirect):
        fail("dst must be HBM rows picked by a tile of row numbers (t[idx, ...])", api="nl.atomic_rmw")
    ops.indirect_dma(dst, ops.tile(value, "nl.atomic_rmw", "value"), "nl.atomic_rmw", add=True)


def expand_dims(x, axis):
    return x.expand_dims(axis)


def broadcast_to(x, shape, dtype=None):
    return x.broadcast_to(shape)


def static_cast(x, dtype):
    return x.astype(dtype)


# ---------------------------------------------------------------------------------------------------------
# Operators on tiles (a + b, x * 2.0, t[...] += matmul, ...)


def _iop(op_name: str, alu: AluOp):
    def method(self, other):
        api = f"{op_name}="
        trace = current()
        if alu == AluOp.ADD and isinstance(other, ops.Result) and trace.pending is other \
                and other.accumulates and self.space == Space.PSUM:
            # psum[...] += matmul(...): the matmul accumulates into the PSUM tile (onto nl.zeros: overwrites it)
            trace.pending = None
            other._make(self, not self.storage.zero_pending)
            return self
        ops.tensor_tensor(self, self, other, alu, api=api)
        return self

    return method


def _op(fn, swap=False):
    def method(self, other):
        return fn(other, self) if swap else fn(self, other)

    return method


NkiTensor.__add__ = _op(add)
NkiTensor.__radd__ = _op(add, swap=True)
NkiTensor.__sub__ = _op(subtract)
NkiTensor.__rsub__ = _op(subtract, swap=True)
NkiTensor.__mul__ = _op(multiply)
NkiTensor.__rmul__ = _op(multiply, swap=True)
NkiTensor.__truediv__ = _op(divide)
NkiTensor.__rtruediv__ = _op(divide, swap=True)
NkiTensor.__pow__ = _op(power)
NkiTensor.__lt__ = _op(less)
NkiTensor.__le__ = _op(less_equal)
NkiTensor.__gt__ = _op(greater)
NkiTensor.__ge__ = _op(greater_equal)
NkiTensor.__eq__ = _op(equal)
NkiTensor.__ne__ = _op(not_equal)
NkiTensor.__hash__ = object.__hash__
NkiTensor.__and__ = _op(logical_and)
NkiTensor.__or__ = _op(logical_or)
NkiTensor.__neg__ = lambda self: negative(self)
NkiTensor.__iadd__ = _iop("+", AluOp.ADD)
NkiTensor.__isub__ = _iop("-", AluOp.SUBTRACT)
NkiTensor.__imul__ = _iop("*", AluOp.MULTIPLY)
