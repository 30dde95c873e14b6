"""``nki.isa`` (``nisa``): one NKI ISA call, one (or a few documented) instructions of the emulated NeuronCore.

Each function takes both of NKI's calling conventions: the current one, writing into ``dst``
(``nisa.nc_matmul(dst=psum_tile, stationary=a, moving=b)``), and the earlier one, returning a new tile
(``psum_tile += nisa.nc_matmul(a, b)``; ``x = nisa.activation(op=nl.exp, data=t)``). A call is in the
``dst`` convention when it passes ``dst`` or puts a tensor where that convention puts it.
"""
from __future__ import annotations

import enum

from neuronc.isa import AluOp, DType, Engine, Opcode, Space
from neuronc.nki import ops
from neuronc.nki.dtypes import isa_dtype
from neuronc.nki.index import Affine, Predicate
from neuronc.nki.opnames import ALU, REDUCE, lookup
from neuronc.nki.tensor import NkiTensor
from neuronc.nki.trace import current, fail


class engine(enum.Enum):
    """Neuron Device engines (``nisa.engine.vector``...); ``unknown`` lets neuronc choose."""

    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)

_ENGINES = {engine.tensor: Engine.TENSOR, engine.vector: Engine.VECTOR, engine.scalar: Engine.SCALAR,
            engine.gpsimd: Engine.GPSIMD, engine.unknown: None, None: None, 0: None}


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.IntEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    return {"trn1": nc_version.gen2, "trn2": nc_version.gen3, "trn3": nc_version.gen4}[current().target.name]


def _engine(e, api: str):
    if e in _ENGINES:
        return _ENGINES[e]
    if isinstance(e, Engine):
        return e
    fail(f"engine={e!r} is not an engine", api=api)


def _split(args: tuple, kwargs: dict, new_style: bool, names_new: tuple, names_old: tuple) -> dict:
    names = names_new if new_style else names_old
    if len(args) > len(names):
        raise TypeError(f"too many positional arguments ({len(args)})")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in bound:
            raise TypeError(f"argument {k} given twice")
        bound[k] = v
    return bound


def _new(args, kwargs, at: int = 0) -> bool:
    """Whether a call is in the dst convention: it passes dst, or a tensor sits at position ``at`` (where the
    earlier convention has a non-tensor) ."""
    return "dst" in kwargs or (len(args) > at and isinstance(args[at], NkiTensor))


def _new_pair(args, kwargs) -> bool:
    """The dst convention of an API whose earlier form takes the source tensor first (bn_stats(data) against
    bn_stats(dst, data)): dst given, or two tensors."""
    return "dst" in kwargs or (len(args) >= 2 and all(isinstance(a, NkiTensor) for a in args[:2]))


def _out_dtype(bound: dict, default: DType) -> DType:
    return isa_dtype(bound["dtype"]) if bound.get("dtype") is not None else default


# ---------------------------------------------------------------------------------------------------------
# Tensor engine


def nc_matmul(*args, **kwargs):
    """dst[M, N] = stationary[K, M].T @ moving[K, N] (fp32 in PSUM); ``accumulate`` None accumulates onto earlier
    matmuls' results there. tile_position / tile_size (the PE array's row/column tiling) compute the same
    values here; they do not change the emulated time."""
    api = "nisa.nc_matmul"
    new = "dst" in kwargs or len(args) >= 3
    b = _split(args, kwargs, new, ("dst", "stationary", "moving", "is_stationary_onezero", "is_moving_onezero",
                                   "is_transpose", "accumulate", "tile_position", "tile_size", "perf_mode", "name"),
               ("stationary", "moving"))
    if b.get("perf_mode") not in (None, matmul_perf_mode.none, "none"):
        fail(f"perf_mode={b['perf_mode']}: the double-row fp8 mode is not emulated", api=api, unsupported=True)
    st, mv = b["stationary"], b["moving"]
    if new:
        ops.matmul(b["dst"], st, mv, accumulate=b.get("accumulate"), api=api, mask=b.get("mask"))
        return None
    st, mv = ops.tile(st, api, "stationary"), ops.tile(mv, api, "moving")
    shape = (st.free_size, mv.free_size)
    return ops.accumulating_result(
        shape, lambda dst, accumulate=False: ops.matmul(dst, st, mv, accumulate=accumulate, api=api,
                                                        mask=b.get("mask")), api)


def nc_transpose(*args, **kwargs):
    """dst[F, P] = data[P, F].T on the Tensor engine (through PSUM)."""
    api = "nisa.nc_transpose"
    new = "dst" in kwargs or len(args) >= 2
    b = _split(args, kwargs, new, ("dst", "data", "engine", "name"), ("data",))
    if _engine(b.get("engine"), api) == Engine.VECTOR:
        fail("the Vector engine's 32x32 transpose is not emulated", api=api, unsupported=True,
             hint="omit engine= (the Tensor engine transposes up to [128, 128])")
    data = ops.tile(b["data"], api, "data")
    if new:
        ops.transpose(b["dst"], data, api=api)
        return None
    out = _out_dtype(b, DType.F32)
    return ops.result((data.free_size, data.partitions), out, lambda dst: ops.transpose(dst, data, api=api), api,
                      space=Space.PSUM if out == DType.F32 else Space.SBUF)


# ---------------------------------------------------------------------------------------------------------
# Scalar engine


def activation(*args, **kwargs):
    """dst = op(data * scale + bias) on the Scalar engine; with ``reduce_res`` its row sums in the same pass."""
    api = "nisa.activation"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "op", "data", "bias", "scale", "reduce_op", "reduce_res", "reduce_cmd",
                                   "name"), ("op", "data"))
    cmd = b.get("reduce_cmd", reduce_cmd.idle)
    if cmd in (reduce_cmd.reduce, reduce_cmd.load_reduce, reduce_cmd.reset):
        fail(f"reduce_cmd={cmd}: accumulating across activations in the engine's registers is not emulated",
             api=api, unsupported=True, hint="pass reduce_res to each call and add the partial sums")
    return _activation(b, new, api)


def activation_reduce(*args, **kwargs):
    api = "nisa.activation_reduce"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "op", "data", "reduce_op", "reduce_res", "bias", "scale", "name"),
               ("op", "data"))
    return _activation(b, new, api)


def _activation(b: dict, new: bool, api: str):
    data = b["data"]
    call = dict(bias=b.get("bias"), scale=b.get("scale", 1.0), reduce_res=b.get("reduce_res"),
                reduce_op=b.get("reduce_op"), mask=b.get("mask"), api=api)
    if new:
        ops.activation(b["dst"], b["op"], data, **call)
        return None
    data = ops.tile(data, api, "data")
    out = _out_dtype(b, data.isa_dtype)
    return ops.result(data.shape, out, lambda dst: ops.activation(dst, b["op"], data, **call), api,
                      spaces=(Space.SBUF, Space.PSUM))


# ---------------------------------------------------------------------------------------------------------
# Vector / GpSimd engines


def tensor_tensor(*args, **kwargs):
    """dst = data1 <op> data2, elementwise (Vector or GpSimd)."""
    api = "nisa.tensor_tensor"
    new = "dst" in kwargs or (len(args) >= 3 and isinstance(args[2], NkiTensor))
    b = _split(args, kwargs, new, ("dst", "data1", "data2", "op", "engine", "name"), ("data1", "data2", "op"))
    eng = _engine(b.get("engine"), api)
    if new:
        ops.tensor_tensor(b["dst"], b["data1"], b["data2"], b["op"], engine=eng, mask=b.get("mask"), api=api)
        return None
    d1, d2 = b["data1"], b["data2"]
    tiles = [t for t in (d1, d2) if isinstance(t, NkiTensor)]
    out = _out_dtype(b, _promote(tiles))
    shape = max((t.tile().shape for t in tiles), key=lambda s: (s[0], _size(s)))
    return ops.result(shape, out, lambda dst: ops.tensor_tensor(dst, d1, d2, b["op"], engine=eng, mask=b.get("mask"),
                                                                api=api), api)


def _size(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _promote(tiles) -> DType:
    floats = [t.isa_dtype for t in tiles if t.isa_dtype.is_float]
    if floats:
        return DType.F32 if DType.F32 in floats else floats[0]
    return tiles[0].isa_dtype


def tensor_scalar(*args, **kwargs):
    """dst = (data <op0> operand0) <op1> operand1, operands numbers or [P, 1] tiles."""
    api = "nisa.tensor_scalar"
    new = "dst" in kwargs or (len(args) >= 2 and isinstance(args[1], NkiTensor))
    b = _split(args, kwargs, new, ("dst", "data", "op0", "operand0", "reverse0", "op1", "operand1", "reverse1",
                                   "engine", "name"),
               ("data", "op0", "operand0", "reverse0", "op1", "operand1", "reverse1"))
    eng = _engine(b.get("engine"), api)
    call = dict(reverse0=b.get("reverse0", False), op1=b.get("op1"), operand1=b.get("operand1"),
                reverse1=b.get("reverse1", False), engine=eng, mask=b.get("mask"), api=api)
    if new:
        ops.tensor_scalar(b["dst"], b["data"], b["op0"], b["operand0"], **call)
        return None
    data = ops.tile(b["data"], api, "data")
    out = _out_dtype(b, data.isa_dtype)
    return ops.result(data.shape, out, lambda dst: ops.tensor_scalar(dst, data, b["op0"], b["operand0"], **call),
                      api)


def scalar_tensor_tensor(*args, **kwargs):
    """dst = (data <op0> operand0) <op1> operand1, operand1 a tile: one pass (TENSOR_ALU2)."""
    api = "nisa.scalar_tensor_tensor"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1",
                                   "name"), ())
    call = dict(reverse0=b.get("reverse0", False), reverse1=b.get("reverse1", False), mask=b.get("mask"), api=api)
    if new:
        ops.scalar_tensor_tensor(b["dst"], b["data"], b["op0"], b["operand0"], b["op1"], b["operand1"], **call)
        return None
    data = ops.tile(b["data"], api, "data")
    out = _out_dtype(b, data.isa_dtype)
    return ops.result(data.shape, out, lambda dst: ops.scalar_tensor_tensor(
        dst, data, b["op0"], b["operand0"], b["op1"], b["operand1"], **call), api)


def tensor_tensor_scan(*args, **kwargs):
    """dst[:, i] = (data0[:, i] <op0> dst[:, i-1]) <op1> data1[:, i], dst[:, -1] = initial: a scan along the free
    axis on the Vector engine, in fp32 (TENSOR_TENSOR_SCAN)."""
    api = "nisa.tensor_tensor_scan"
    new = _scan_new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "data0", "data1", "initial", "op0", "op1", "reverse0", "reverse1", "name"),
               ("data0", "data1", "initial", "op0", "op1", "reverse0", "reverse1"))
    call = dict(reverse0=b.get("reverse0", False), reverse1=b.get("reverse1", False), mask=b.get("mask"), api=api)
    if new:
        ops.tensor_tensor_scan(b["dst"], b["data0"], b["data1"], b["initial"], b["op0"], b["op1"], **call)
        return None
    data0 = ops.tile(b["data0"], api, "data0")
    out = _out_dtype(b, data0.isa_dtype)
    return ops.result(data0.shape, out, lambda dst: ops.tensor_tensor_scan(
        dst, data0, b["data1"], b["initial"], b["op0"], b["op1"], **call), api)


def _scan_new(args, kwargs) -> bool:
    """Whether a tensor_tensor_scan call is in the dst convention (dst, data0, data1, initial, op0, op1): dst given,
    a number or tile fourth (where the earlier convention has op0), or three tensors with initial by name."""
    if "dst" in kwargs:
        return True
    if len(args) >= 4:
        return isinstance(args[3], (NkiTensor, int, float)) and not isinstance(args[3], bool)
    return len(args) == 3 and "initial" in kwargs


def tensor_reduce(*args, **kwargs):
    """dst = reduction of data over its free ``axis`` (add, max, min); ``negate`` multiplies by -1."""
    api = "nisa.tensor_reduce"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "op", "data", "axis", "negate", "keepdims", "name"), ("op", "data", "axis"))
    call = dict(negate=b.get("negate", False), mask=b.get("mask"), api=api)
    if new:
        ops.tensor_reduce(b["dst"], b["op"], b["data"], b["axis"], **call)
        return None
    data = ops.tile(b["data"], api, "data")
    out = _out_dtype(b, data.isa_dtype)
    shape = ops.reduce_shape(data.shape, b["axis"], b.get("keepdims", False))
    return ops.result(shape, out, lambda dst: ops.tensor_reduce(dst, b["op"], data, b["axis"], **call), api)


def tensor_copy(*args, **kwargs):
    """dst = src converted to dst's dtype (Vector, Scalar or GpSimd)."""
    api = "nisa.tensor_copy"
    new = "dst" in kwargs or len(args) >= 2
    b = _split(args, kwargs, new, ("dst", "src", "engine", "name"), ("src",))
    eng = _engine(b.get("engine"), api)
    if new:
        ops.copy(b["dst"], b["src"], engine=eng, mask=b.get("mask"), api=api)
        return None
    src = b["src"]
    out = _out_dtype(b, src.isa_dtype)
    return ops.result(src.tile().shape, out, lambda dst: ops.copy(dst, src, engine=eng, mask=b.get("mask"), api=api),
                      api)


def tensor_copy_predicated(dst, src, predicate, reverse_pred: bool = False, name=None, **kwargs):
    """dst = predicate ? src : dst (a SELECT reading dst as its false branch)."""
    api = "nisa.tensor_copy_predicated"
    if reverse_pred:
        ops.select(dst, predicate, dst, src, api=api)
    else:
        ops.select(dst, predicate, src, dst, api=api)


def reciprocal(*args, **kwargs):
    """dst = 1 / data on the Vector engine (a reversed division of 1.0 by each element)."""
    api = "nisa.reciprocal"
    new = "dst" in kwargs or len(args) >= 2
    b = _split(args, kwargs, new, ("dst", "data", "name"), ("data",))
    eng = _engine(b.get("engine"), api)
    if new:
        ops.tensor_scalar(b["dst"], b["data"], AluOp.DIVIDE, 1.0, reverse0=True, engine=eng, api=api)
        return None
    data = ops.tile(b["data"], api, "data")
    out = _out_dtype(b, data.isa_dtype)
    return ops.result(data.shape, out, lambda dst: ops.tensor_scalar(dst, data, AluOp.DIVIDE, 1.0, reverse0=True,
                                                                     engine=eng, mask=b.get("mask"), api=api), api)


def memset(*args, **kwargs):
    api = "nisa.memset"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "value", "engine", "name"), ("shape", "value", "dtype"))
    eng = _engine(b.get("engine"), api)
    if new:
        ops.memset(b["dst"], b["value"], engine=eng, mask=b.get("mask"), api=api)
        return None
    t = current().onchip(Space.SBUF, tuple(b["shape"]), isa_dtype(b["dtype"]), "memset")
    ops.memset(t, b["value"], engine=eng, mask=b.get("mask"), api=api)
    return t


def iota(*args, **kwargs):
    """dst[p, ...] = offset + p * channel_multiplier + sum(step * index) (the ``pattern`` [[step, num], ...]), or in
    the earlier convention the values of an nl.arange expression; GpSimd, in int32, converted to dst's dtype."""
    api = "nisa.iota"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "pattern", "offset", "channel_multiplier", "name"), ("expr", "dtype"))
    if new:
        dst = ops.tile(b["dst"], api, "dst")
        coefs = _pattern_coefs(b["pattern"], dst, api)
        ops.iota_affine(dst, int(b.get("offset", 0)), int(b.get("channel_multiplier", 0)), coefs, api)
        return None
    expr = Affine.of(b["expr"])
    vars_ = list(expr.terms)
    ndim = vars_[0].ndim if vars_ else 2
    shape = [1] * builtins_max(ndim, 2)
    for v in vars_:
        shape[v.axis] = v.size
    out = current().onchip(Space.SBUF, tuple(shape), isa_dtype(b["dtype"]), "iota")
    pc = sum(c for v, c in expr.terms.items() if v.axis == 0)
    free = [sum(c for v, c in expr.terms.items() if v.axis == i) for i in range(1, len(shape))]
    ops.iota_affine(out, expr.const, pc, free, api)
    return out


def builtins_max(a, b):
    return a if a > b else b


def _pattern_coefs(pattern, dst: NkiTensor, api: str) -> list:
    """The free-axis coefficients of an iota ``pattern`` [[step, num], ...] laid over dst's free shape."""
    pattern = [tuple(p) for p in pattern]
    nums = [n for _, n in pattern]
    if _size(nums) != dst.free_size:
        fail(f"pattern {pattern} makes {_size(nums)} values per partition; dst has {dst.free_size}", api=api)
    if tuple(n for n in nums if n > 1) == tuple(n for n in dst.free_shape if n > 1):
        steps = [s for s, n in pattern if n > 1]
        it = iter(steps)
        return [next(it) if n > 1 else 0 for n in dst.free_shape]
    # a pattern over a flattened free axis: affine in the flat index only if it is row-major in it
    flat = dst.reshape((dst.partitions, dst.free_size)) if dst._contiguous_free() else None
    if flat is None:
        fail(f"pattern {pattern} does not match dst's free shape {list(dst.free_shape)}", api=api, unsupported=True)
    stride, ok = None, True
    expect = 1
    for s, n in reversed(pattern):
        if n == 1:
            continue
        if stride is None:
            stride = s
        ok &= s == stride * expect
        expect *= n
    if not ok:
        fail(f"pattern {pattern} is not affine in the flat index of dst {list(dst.shape)}", api=api, unsupported=True)
    coefs = [0] * len(dst.free_shape)
    rm = 1
    for i in reversed(range(len(dst.free_shape))):
        coefs[i] = (stride or 0) * rm
        rm *= dst.free_shape[i]
    return coefs


def affine_select(*args, **kwargs):
    """dst = pred ? on_true_tile : on_false_value, the predicate an affine function of the tile's indices compared
    with 0 (made on chip: an iota (GpSimd), a compare, then a select)."""
    api = "nisa.affine_select"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "pattern", "channel_multiplier", "on_true_tile", "on_false_value",
                                   "cmp_op", "offset", "name"), ("pred", "on_true_tile", "on_false_value"))
    on_true = ops.tile(b["on_true_tile"], api, "on_true_tile")
    false_value = float(b["on_false_value"])
    if new:
        dst = ops.tile(b["dst"], api, "dst")
        coefs = _pattern_coefs(b["pattern"], dst, api)
        cmp = lookup(b.get("cmp_op", "equal"), ALU, "cmp_op", api)
        op = {AluOp.EQ: "==", AluOp.NE: "!=", AluOp.LT: "<", AluOp.LE: "<=", AluOp.GT: ">", AluOp.GE: ">="}.get(cmp)
        if op is None:
            fail(f"cmp_op {b.get('cmp_op')} is not a comparison", api=api)
        _affine_select_coefs(dst, int(b.get("offset", 0)), int(b["channel_multiplier"]), coefs, op, on_true,
                             false_value, api)
        return None
    pred = b["pred"]
    if not isinstance(pred, Predicate):
        fail("pred must be a comparison of nl.arange expressions", api=api)
    out = _out_dtype(b, on_true.isa_dtype)

    def make(dst):
        views = ops.apply_mask(b.get("mask"), [dst, on_true], api)
        if views is None:
            return
        d, t = views
        mask_tile = ops.affine_predicate(_shifted(pred, dst, d), d.shape, api)
        _select_const(d, mask_tile, t, false_value, api)

    return ops.result(on_true.shape, out, make, api, spaces=(Space.SBUF,))


def _shifted(pred: Predicate, full: NkiTensor, part: NkiTensor) -> Predicate:
    """The predicate on a masked part of a tile: index vectors start where the part starts."""
    full, part = full.tile(), part.tile()
    offsets = {0: part.partition - full.partition}
    if len(full.dims) == len(part.dims):
        for axis in range(1, len(full.dims)):
            stride = full.dims[axis][0] or 1
            offsets[axis] = (part.offset - full.offset) // stride if part.dims[axis][1] != full.dims[axis][1] else 0
    atoms = []
    for affine, op in pred.atoms:
        const = affine.const + sum(c * offsets.get(v.axis, 0) for v, c in affine.terms.items())
        from neuronc.nki.index import Var

        terms = {}
        for v, c in affine.terms.items():
            size = part.dims[v.axis][1] if v.axis < len(part.dims) else v.size
            nv = Var(size, v.axis, v.ndim)
            terms[nv] = c
        atoms.append((Affine(terms, const), op))
    return Predicate(tuple(atoms))


def _affine_select_coefs(dst, offset, channel_multiplier, coefs, op, on_true, false_value, api):
    trace = current()
    values = trace.onchip(Space.SBUF, dst.shape, DType.I32, "affine_values")
    ops.iota_affine(values, offset, channel_multiplier, coefs, api)
    mask = trace.onchip(Space.SBUF, dst.shape, DType.U8, "affine_mask")
    alu = {"<": AluOp.LT, "<=": AluOp.LE, ">": AluOp.GT, ">=": AluOp.GE, "==": AluOp.EQ, "!=": AluOp.NE}[op]
    ops._binary_with(mask, values, alu, 0.0, False, Engine.GPSIMD, api)
    _select_const(dst, mask, on_true, false_value, api)


def _select_const(dst, mask, on_true, false_value, api):
    """dst = mask ? on_true : false_value; the value in a [P, 1] tile of on_true's dtype (fp32 when that is what
    dst holds, as NKI's on_false_value is fp32)."""
    trace = current()
    dst = dst.tile()
    value_tile = trace.onchip(Space.SBUF, (dst.partitions, 1), dst.isa_dtype, "on_false")
    ops.memset(value_tile, false_value, api=api)
    ops.select(dst, mask, on_true, value_tile, api=api)


def tensor_scalar_reduce(*args, **kwargs):
    """dst = data <op0> operand0, and reduce_res = its reduction over the free axes: one TENSOR_SCALAR_REDUCE when
    op0 multiplies by a number; otherwise the tensor_scalar then a tensor_reduce."""
    api = "nisa.tensor_scalar_reduce"
    new = _new(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "data", "op0", "operand0", "reduce_op", "reduce_res", "reverse0",
                                   "reduce_cmd", "reduce_init", "reduce_res_negate", "name"), ())
    data = ops.tile(b["data"], api, "data")
    if not new:
        out = _out_dtype(b, data.isa_dtype)
        dst = current().onchip(Space.SBUF, data.shape, out, "tensor_scalar_reduce")
    else:
        dst = b["dst"]
    _tensor_scalar_reduce(dst, data, b, api)
    return None if new else dst


def _tensor_scalar_reduce(dst, data, b, api):
    trace = current()
    alu = lookup(b["op0"], ALU, "op0", api)
    red = lookup(b["reduce_op"], REDUCE, "reduce_op", api)
    res = b.get("reduce_res")
    dst = ops.tile(dst, api, "dst")
    if b.get("reduce_cmd", reduce_cmd.reset_reduce) not in (reduce_cmd.reset_reduce, None):
        fail("reduce_cmd other than reset_reduce is not emulated", api=api, unsupported=True)
    negate = b.get("reduce_res_negate", False)
    direct = (alu == AluOp.MULTIPLY and not isinstance(b["operand0"], NkiTensor) and res is not None and not negate
              and res.isa_dtype == DType.F32 and res.space == Space.SBUF and dst.isa_dtype.is_float
              and data.isa_dtype.is_float and len(dst.shape) == 2)
    if direct:
        d, s = ops.common_shape([dst, data])
        trace.emit(Opcode.TENSOR_SCALAR_REDUCE, Engine.VECTOR,
                   [(dst.storage, d), (res.storage, ops.tile(res, api).access()), (data.storage, s)], api, alu=red,
                   imm0=float(b["operand0"]))
        return
    ops.tensor_scalar(dst, data, alu, b["operand0"], reverse0=b.get("reverse0", False), api=api)
    if res is not None:
        ops.tensor_reduce(res, red, dst, tuple(range(1, len(dst.shape))), negate=negate, api=api)


def tensor_partition_reduce(*args, **kwargs):
    fail("not supported by neuronc.nki", api="nisa.tensor_partition_reduce", unsupported=True,
         hint="reduce across partitions with nisa.nc_matmul by a ones column (the "
                                 "Tensor engine contracts over partitions)")


def max8(*args, **kwargs):
    """dst[p, 0:8] = the 8 largest values of src[p, :], largest first (Vector)."""
    api = "nisa.max8"
    new = _new_pair(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "src", "name"), ("src",))
    src = ops.tile(b["src"], api, "src")
    dst = b["dst"] if new else current().onchip(Space.SBUF, (src.partitions, 8), _out_dtype(b, src.isa_dtype), "max8")
    d = ops.tile(dst, api, "dst")
    current().emit(Opcode.MAX8, Engine.VECTOR, [(d.storage, d.access()), (src.storage, ops._flat2(src, api, "src"))], api)
    return None if new else dst


def nc_find_index8(dst, data, vals, name=None, **kwargs):
    api = "nisa.nc_find_index8"
    d, s, v = (ops.tile(x, api) for x in (dst, data, vals))
    current().emit(Opcode.FIND_INDEX8, Engine.VECTOR, [d, (s.storage, ops._flat2(s, api, "data")), v], api)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None, **kwargs):
    api = "nisa.nc_match_replace8"
    if dst_idx is not None:
        nc_find_index8(dst_idx, data, vals)
    d, s, v = (ops.tile(x, api) for x in (dst, data, vals))
    current().emit(Opcode.MATCH_REPLACE8, Engine.VECTOR, [(d.storage, ops._flat2(d, api, "dst")),
                                                          (s.storage, ops._flat2(s, api, "data")), v], api,
                   imm0=float(imm))


# ---------------------------------------------------------------------------------------------------------
# BatchNorm statistics: one BN_STATS per chunk of <= 512 elements, one BN_AGGR over the chunks' results (as NKI's
# layer-norm uses them). A chunk's 6 statistics are NKI's: (count, mean, count * variance) of its even elements,
# then of its odd ones (isa.py: BN_STATS, BN_AGGR).


def _statistics_into(opcode, out, shape, data, api, name):
    """One `opcode` (Vector) of `data` into `out`: directly when it is an F32 SBUF tile, else into a scratch F32 tile
    copied into it afterwards (the engine "is capable of casting the float32 results")."""
    res = ops.tile(out, api, "dst")
    fp = res if res.isa_dtype == DType.F32 and res.space == Space.SBUF else \
        ops.tile(current().onchip(Space.SBUF, shape, DType.F32, name), api, "dst")
    current().emit(opcode, Engine.VECTOR, [(fp.storage, ops._flat2(fp, api, "dst")),
                                          (data.storage, ops._flat2(data, api, "data"))], api)
    if fp is not res:
        ops.copy(res, fp, api=api)


def bn_stats(*args, **kwargs):
    """Per partition, (count, mean, count * variance) of the even and of the odd elements of data (<= 512 per
    partition): one BN_STATS (Vector)."""
    api = "nisa.bn_stats"
    new = _new_pair(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "data", "name"), ("data",))
    data = ops.tile(b["data"], api, "data")
    views = ops.apply_mask(b.get("mask"), [data], api)
    if views is None:
        return None
    data = views[0]
    trace = current()
    p, n = data.partitions, data.free_size
    if n > trace.target.bn_stats_max_free:
        fail(f"bn_stats reads at most {trace.target.bn_stats_max_free} elements per partition "
             f"(nl.tile_size.bn_stats_fmax); data has {n}", api=api, hint="call bn_stats on each 512-element chunk and bn_aggr over their results")
    out = b["dst"] if new else trace.onchip(Space.SBUF, (p, 6), _out_dtype(b, data.isa_dtype), "bn_stats")
    _statistics_into(Opcode.BN_STATS, out, (p, 6), data, api, "bn_stats_fp32")
    return None if new else out


def bn_aggr(*args, **kwargs):
    """[mean, variance] per partition from (count, mean, count * variance) triples (bn_stats results side by side):
    one BN_AGGR (Vector), combined in fp32 results as isa.py defines."""
    api = "nisa.bn_aggr"
    new = _new_pair(args, kwargs)
    b = _split(args, kwargs, new, ("dst", "data", "name"), ("data",))
    data = ops.tile(b["data"], api, "data")
    trace = current()
    p, width = data.partitions, data.free_size
    if width % 3 or not width:
        fail(f"bn_aggr reads (count, mean, count * variance) triples; data has {width} per partition", api=api)
    if data.isa_dtype != DType.F32:
        src = ops.tile(trace.onchip(Space.SBUF, (p, width), DType.F32, "bn_aggr_in"), api, "data")
        ops.copy(src, data.reshape((p, width)), api=api)
        data = src
    out = b["dst"] if new else trace.onchip(Space.SBUF, (p, 2), _out_dtype(b, data.isa_dtype), "bn_aggr")
    _statistics_into(Opcode.BN_AGGR, out, (p, 2), data, api, "bn_aggr_fp32")
    return None if new else out


# ---------------------------------------------------------------------------------------------------------
# DMA


def dma_copy(*args, **kwargs):
    """dst = src by DMA (HBM and SBUF; a dtype change through a compute-engine conversion)."""
    api = "nisa.dma_copy"
    b = _split(args, kwargs, True, ("dst", "src", "priority", "oob_mode", "dge_mode", "engine", "name"), ())
    if b.get("oob_mode") not in (None, oob_mode.error):
        fail("oob_mode=skip is not emulated", api=api, unsupported=True)
    ops.dma(b["dst"], b["src"], api, mask=b.get("mask"))


def dma_transpose(*args, **kwargs):
    api = "nisa.dma_transpose"
    new = "dst" in kwargs or len(args) >= 2
    b = _split(args, kwargs, new, ("dst", "src", "axes", "priority", "dge_mode", "oob_mode", "name"), ("src",))
    src = b["src"]
    if new:
        ops.dma_transpose(b["dst"], src, b.get("axes"), api=api)
        return None
    perm = tuple(b.get("axes") or {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[src.ndim])
    shape = tuple(src.shape[a] for a in perm)
    out = _out_dtype(b, src.isa_dtype)
    return ops.result(shape, out, lambda dst: ops.dma_transpose(dst, src, perm, api=api), api, spaces=(Space.SBUF,),
                      exact_any_dtype=False)


def _unsupported(name: str):
    def fn(*args, **kwargs):
        fail("not supported by neuronc.nki", api=f"nisa.{name}", unsupported=True,
             hint="the emulated instruction set has no instruction for it; compose it from supported calls")

    fn.__name__ = fn.nki_name = name
    return fn


for _name in ("nc_matmul_mx", "activate2", "tensor_scalar_cumulative", "exponential",
              "quantize_mx", "dropout", "range_select", "select_reduce", "sequence_bounds", "local_gather",
              "nc_n_gather", "nc_stream_shuffle", "register_alloc", "register_load", "register_move",
              "register_store", "core_barrier", "sendrecv", "rng", "rand2", "rand_set_state", "rand_get_state",
              "set_rng_seed", "nonzero_with_count", "topk", "dma_compute", "builtin_custom_op",
              "tensor_copy_dynamic_src"):
    globals()[_name] = _unsupported(_name)
