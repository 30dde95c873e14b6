"""What each kernel-language operation emits: the instructions of :mod:`neuronc.isa` for a DMA, a matmul, an
activation, an ALU op, a reduction, a copy, a select, an iota.

Every operation here takes its destination (``nisa.*`` style). ``nl.*`` style calls return a :class:`Result`: a
fresh tile whose instructions are made when it is first read, or written straight into the destination it is
assigned to (``t[...] = nl.exp(x)`` makes one instruction, not an exp and a copy) when that rounds the same.

Operations outside what one instruction does are made of several, each documented where it is made; all of them
compute as NKI documents the operation (floats in fp32, rounded once to the destination).
"""
from __future__ import annotations

import math
import sys

import numpy as np

from neuronc.isa import ActFunc, AluOp, DType, Engine, Opcode, Space
from neuronc.nki import dtypes
from neuronc.nki.index import Predicate
from neuronc.nki.opnames import ACT, ALU, ARITHMETIC, COMMUTATIVE, REDUCE, lookup
from neuronc.nki.tensor import Indirect, NkiTensor, common_shape
from neuronc.nki.trace import current, fail
from neuronc.passes.cost_model import dma_slice_count, partition_group

VECTOR_ENGINES = (Engine.VECTOR, Engine.GPSIMD)
COPY_ENGINES = (Engine.VECTOR, Engine.GPSIMD, Engine.SCALAR)
ALU2_OPS = ARITHMETIC


# ---------------------------------------------------------------------------------------------------------
# Results of nl.* calls


class Result(NkiTensor):
    """A tile computed by an ``nl.*``-style call. Its instructions are made when it is first used (its own
    temporary tile) or by ``t[...] = result`` straight into ``t``."""

    accumulates = False  # a matmul result: ``psum += result`` accumulates it (make(dst, accumulate))

    def __init__(self, base: NkiTensor, make, spaces, exact_any_dtype: bool, api: str):
        super().__init__(base.storage, base.isa_dtype, base.offset, base.dims, base.pdim, base.partition)
        self._make, self._spaces, self._exact_any, self._api = make, spaces, exact_any_dtype, api


def result(shape, dtype: DType, make, api: str, space: Space = Space.SBUF, spaces=(Space.SBUF, Space.PSUM),
           exact_any_dtype: bool = True) -> Result:
    trace = current()
    trace.flush()
    base = trace.onchip(space, shape, dtype, f"{api.split('.')[-1]}_{len(trace.storages)}")
    r = Result(base, make, spaces, exact_any_dtype, api)
    trace.pending = r
    return r


def accumulating_result(shape, make, api: str) -> Result:
    """A matmul's result: an fp32 PSUM tile; ``make(dst, accumulate)``."""
    r = result(shape, DType.F32, make, api, space=Space.PSUM, spaces=(Space.PSUM,))
    r.accumulates = True
    return r


def materialise(r: Result) -> None:
    r._make(NkiTensor(r.storage, r.isa_dtype, r.offset, r.dims, r.pdim, r.partition))


def _can_redirect(value: Result, dst: NkiTensor) -> bool:
    if dst.space not in value._spaces:
        return False
    if dst.isa_dtype != value.isa_dtype and not (value._exact_any and value.isa_dtype == DType.F32):
        return False
    if dst.size != value.size and dst.tile().free_size != value.free_size:
        return False
    return True


# References to a Result held by the kernel's call of `t[...] = nl.f(...)` (the evaluation stack, __setitem__'s and
# assign's arguments, getrefcount's): more means the kernel keeps it in a variable, and it must stay a tile of its own.
_TEMPORARY_REFS = 4


def assign(dst: NkiTensor, value, mask=None) -> None:
    """``dst[...] = value``: a scalar fills it; a tile is copied (DMA into HBM); an ``nl.*`` result that nothing
    else holds is computed straight into it."""
    trace = current()
    if not isinstance(value, NkiTensor):
        if isinstance(value, Predicate):
            fail("assigning an nl.arange comparison to a tile", api="assignment",
                 hint="use nisa.iota / nisa.affine_select to make index-dependent values")
        memset(dst, value, mask=mask)
        return
    if value.storage is dst.storage and value.offset == dst.offset and value.dims == dst.dims \
            and value.partition == dst.partition:
        return
    if isinstance(value, Result) and trace.pending is value and _can_redirect(value, dst) \
            and sys.getrefcount(value) <= _TEMPORARY_REFS + 1:
        trace.pending = None
        value._make(dst)
        value.storage, value.offset, value.dims, value.pdim, value.partition = (
            dst.storage, dst.offset, dst.dims, dst.pdim, dst.partition)
        value._dtype = dst.isa_dtype
        return
    if dst.space == Space.HBM or value.space == Space.HBM:
        dma(dst, value, "assignment")
    else:
        copy(dst, value, mask=mask, api="assignment")


# ---------------------------------------------------------------------------------------------------------
# Operands


def tile(x, api: str, what: str = "operand") -> NkiTensor:
    """``x`` as an on-chip tile (partition dim first)."""
    if not isinstance(x, NkiTensor):
        fail(f"{what} must be a tile, got {type(x).__name__}", api=api)
    if x.space == Space.HBM:
        fail(f"{what} is in HBM; compute engines read SBUF and PSUM only", api=api,
             hint="load it first (nl.load / nisa.dma_copy into an SBUF tile)")
    return x.tile()


def fit(src: NkiTensor, like: NkiTensor, api: str) -> NkiTensor:
    """``src`` read with ``like``'s shape: as is when the element counts per partition agree, else broadcast
    along the free dims (a [P, 1] value per partition, or numpy broadcasting of the free shapes)."""
    src = src.tile()
    if src.partitions != like.partitions:
        if src.partitions == 1:
            src = broadcast_partitions(src, like.partitions)
        else:
            fail(f"operands have {src.partitions} and {like.partitions} partitions", api=api)
    if src.free_size == like.free_size:
        return src
    if src.free_size == 1:
        return src._with(dims=((1, src.partitions),) + tuple((0, s) for s in like.free_shape))
    fs, ls = src.free_shape, like.free_shape
    if len(fs) <= len(ls):
        fs = (1,) * (len(ls) - len(fs)) + fs
        sdims = ((0, 1),) * (len(ls) - len(src.free_shape)) + src.dims[1:]
        dims = []
        for (stride, size), want in zip(sdims, ls):
            if size == want:
                dims.append((stride, size))
            elif size == 1:
                dims.append((0, want))
            else:
                break
        else:
            return src._with(dims=((1, src.partitions),) + tuple(dims))
    fail(f"operand of shape {list(src.shape)} does not broadcast to {list(like.shape)}", api=api)


def apply_mask(mask, views: list, api: str):
    """The views restricted to what ``mask`` keeps (None: nothing to do). A mask is a Python bool or a
    conjunction of bounds on nl.arange vectors; a view's dim is restricted when it runs along that vector."""
    if mask is None or mask is True:
        return views
    if mask is False:
        return None
    if not isinstance(mask, Predicate):
        fail(f"mask={mask!r}: a mask is a comparison of nl.arange expressions (or a Python bool)", api=api)
    ranges = mask.ranges()
    if None in ranges:
        return None
    out = []
    for view in views:
        if not isinstance(view, NkiTensor):
            out.append(view)
            continue
        t = view if view.space == Space.HBM else view.tile()
        for v, (lo, hi) in ranges.items():
            if hi <= lo:
                return None
            dims = list(t.dims)
            for i, ((stride, size), var) in enumerate(zip(dims, t.vars)):
                # a tile not indexed by v: its dim i runs along v if v is that axis of an index grid of its rank,
                # or, for the partition dim, axis 0 of any grid (the samples' 2-D result of a 4-D grid's reduction)
                if var is v or (var is None and v.axis == i and (v.ndim == len(dims) or i == 0 and t.on_chip)
                                and size == v.size):
                    if i == 0 and t.on_chip:
                        t = t._with(dims=((1, hi - lo),) + tuple(dims[1:]), partition=t.partition + lo,
                                    vars=t.vars)
                    else:
                        dims[i] = (stride, hi - lo)
                        t = t._with(offset=t.offset + lo * stride, dims=tuple(dims), vars=t.vars)
                    dims = list(t.dims)
        out.append(t)
    return out


def _const_column(value: float, partitions: int) -> NkiTensor:
    """A [partitions, 1] fp32 tile holding ``value`` (a MEMSET, made once per value), for instructions that take
    per-partition operands where the kernel gave a number."""
    trace = current()
    key = ("const", float(value))
    cache = trace.__dict__.setdefault("_consts", {})
    if key not in cache:
        p = trace.target.partitions
        t = trace.onchip(Space.SBUF, (p, 1), DType.F32, f"const_{value}")
        trace.emit(Opcode.MEMSET, Engine.GPSIMD, [t], "constant", imm0=float(value))
        cache[key] = t
    return cache[key][0:partitions, :]


def _scratch(shape, dtype: DType, space: Space = Space.SBUF, name: str = "scratch") -> NkiTensor:
    return current().onchip(space, shape, dtype, name)


def _float(dtype: DType) -> bool:
    return dtype.is_float


# ---------------------------------------------------------------------------------------------------------
# Data movement


def dma(dst: NkiTensor, src: NkiTensor, api: str, mask=None) -> None:
    """dst = src by DMA (HBM <-> SBUF, SBUF -> SBUF). A dtype change goes through a staging tile converted on a
    compute engine (NKI's DMA converts through fp32: the same values); PSUM, which DMA cannot reach, through
    an SBUF copy. Large transfers are cut into partition slices on consecutive queues."""
    trace = current()
    if isinstance(src, Indirect) or isinstance(dst, Indirect):
        indirect_dma(dst, src, api)
        return
    views = apply_mask(mask, [dst, src], api)
    if views is None:
        return
    dst, src = views
    if not isinstance(src, NkiTensor) or not isinstance(dst, NkiTensor):
        fail("DMA operands must be tensors", api=api)
    if dst.space == Space.HBM and src.space == Space.HBM:
        if dst.isa_dtype != src.isa_dtype:
            fail("an HBM to HBM copy changing dtype", api=api, unsupported=True, hint="stage it through SBUF")
        _dma_pieces(trace, dst, src, api)
        return
    if dst.space == Space.PSUM or src.space == Space.PSUM:
        onchip, other = (dst, src) if dst.space == Space.PSUM else (src, dst)
        if other.space != Space.HBM:
            copy(dst, src, api=api)
            return
        stage = _scratch(onchip.tile().shape, onchip.isa_dtype, name="psum_stage")
        if src.space == Space.PSUM:
            copy(stage, src, api=api)
            dma(dst, stage, api)
        else:
            dma(stage, src, api)
            copy(dst, stage, api=api)
        return
    if dst.isa_dtype != src.isa_dtype:
        if dst.space != Space.HBM and src.space != Space.HBM:
            copy(dst, src, api=api)
            return
        onchip = dst if dst.space != Space.HBM else src
        stage = _scratch(onchip.tile().shape, src.isa_dtype if dst.space != Space.HBM else dst.isa_dtype,
                         name="dtype_stage")
        if dst.space != Space.HBM:
            dma(stage, src, api)
            copy(dst, stage, api=api)
        else:
            copy(stage, src, api=api)
            dma(dst, stage, api)
        return
    _dma_pieces(trace, dst, src, api)


def indirect_dma(dst, src, api: str, add: bool = False) -> None:
    """A gather (src rows picked by a tile of row numbers) into an SBUF tile, or a scatter of an SBUF tile's rows
    into the rows a tile of row numbers picks (``add``: accumulated, NKI's atomic_rmw): one indirect DMA. An index
    outside the tensor is a run-time error, as the emulated DMA raises it."""
    trace = current()
    gather = isinstance(src, Indirect)
    rows, table = (dst, src) if gather else (src, dst)
    if not isinstance(rows, NkiTensor) or rows.space != Space.SBUF:
        fail("an indirect DMA moves rows between HBM and an SBUF tile", api=api)
    rows = rows.tile()
    index = tile(table.index, api, "index")
    if index.isa_dtype.is_float or index.free_size != 1 or index.partitions != rows.partitions:
        fail(f"row numbers must be an integer [{rows.partitions}, 1] tile, got {index.isa_dtype.name}"
             f"{list(index.shape)}", api=api)
    if rows.isa_dtype != table.view.isa_dtype:
        fail(f"an indirect DMA moves {table.view.isa_dtype.name} rows into a {rows.isa_dtype.name} tile", api=api,
             unsupported=True, hint="gather in the tensor's dtype, then convert with nisa.tensor_copy")
    t = table.table()
    row_ap = rows.access()
    import dataclasses

    row_ap = dataclasses.replace(row_ap, dims=(row_ap.dims[0],) + t.dims[1:]) if row_ap.free_elements == \
        int(np.prod([n for _, n in t.dims[1:]])) else row_ap
    if gather:
        trace.emit(Opcode.DMA_GATHER, Engine.DMA, [(rows.storage, row_ap), (table.view.storage, t),
                                                   (index.storage, index.access())], api)
    else:
        trace.emit(Opcode.DMA_SCATTER, Engine.DMA, [(table.view.storage, t), (rows.storage, row_ap),
                                                    (index.storage, index.access())], api,
                   alu=AluOp.ADD if add else AluOp.NONE)


def _dma_pieces(trace, dst: NkiTensor, src: NkiTensor, api: str) -> None:
    onchip = dst if dst.space != Space.HBM else (src if src.space != Space.HBM else None)
    if onchip is None:
        d, s = common_shape([dst, src])
        trace.emit(Opcode.DMA_COPY, Engine.DMA, [(dst.storage, d), (src.storage, s)], api)
        return
    tile_view = onchip.tile()
    other = src if onchip is dst else dst
    try:
        d, s = common_shape([dst.tile() if dst.on_chip else dst, src.tile() if src.on_chip else src])
    except Exception:
        if other.size != tile_view.size:
            fail(f"DMA between {list(dst.shape)} and {list(src.shape)}: {dst.size} and {src.size} elements", api=api)
        raise
    rows = tile_view.partitions
    nbytes = tile_view.size * tile_view.itemsize
    pieces = max(1, min(rows, dma_slice_count(rows, nbytes, trace.target)))
    group = partition_group(trace.target)
    base = tile_view.partition
    first, last = base // group, (base + rows - 1) // group
    pieces = min(pieces, last - first + 1)
    cuts = [0] + [(first + (last - first + 1) * k // pieces) * group - base for k in range(1, pieces)] + [rows]
    for p0, p1 in zip(cuts, cuts[1:]):
        if p1 > p0:
            trace.emit(Opcode.DMA_COPY, Engine.DMA, [(dst.storage, _rows(d, p0, p1)), (src.storage, _rows(s, p0, p1))],
                       api)


def _rows(ap, p0: int, p1: int):
    import dataclasses

    stride, size = ap.dims[0]
    dims = ((stride, p1 - p0), *ap.dims[1:])
    if ap.space == Space.HBM:
        return dataclasses.replace(ap, offset=ap.offset + p0 * stride * ap.dtype.itemsize, dims=dims)
    return dataclasses.replace(ap, partition=ap.partition + p0, dims=dims)


def load(src: NkiTensor, dtype=None, mask=None, api: str = "nl.load") -> Result:
    if isinstance(src, Indirect):
        dtype = dtypes.isa_dtype(dtype) if dtype is not None else src.view.isa_dtype
        return result(src.shape, dtype, lambda dst: dma(dst, src, api), api, spaces=(Space.SBUF,),
                      exact_any_dtype=False)
    if not isinstance(src, NkiTensor):
        fail("nl.load reads a tensor", api=api)
    if src.space != Space.HBM:
        fail("nl.load reads HBM; the source is already on chip", api=api, hint="use nl.copy / nisa.tensor_copy")
    dtype = dtypes.isa_dtype(dtype) if dtype is not None else src.isa_dtype
    while src.ndim < 2:  # a vector (the samples' A[rows, i]) loads as a column [n, 1], a number as [1, 1]
        src = src.expand_dims(src.ndim)
    return result(src.shape, dtype, lambda dst: dma(dst, src, api, mask=mask), api, spaces=(Space.SBUF,),
                  exact_any_dtype=False)


def store(dst: NkiTensor, value, mask=None, api: str = "nl.store") -> None:
    if isinstance(dst, Indirect):
        indirect_dma(dst, value, api)
        return
    if not isinstance(dst, NkiTensor) or dst.space != Space.HBM:
        fail("nl.store writes an HBM tensor", api=api, hint="assign to on-chip tiles with t[...] = value")
    if not isinstance(value, NkiTensor):
        stage = _scratch(dst.shape if dst.ndim >= 2 else (dst.size, 1), dst.isa_dtype, name="store_fill")
        memset(stage, value)
        value = stage
    dma(dst, value, api, mask=mask)


def load_transpose2d(src: NkiTensor, dtype=None, mask=None, api: str = "nl.load_transpose2d") -> Result:
    """A [F, P] HBM view loaded as a [P, F] tile: one DMA reading the source by columns (strided: the cost model
    prices it at half the bandwidth of a contiguous one)."""
    if src.space != Space.HBM or src.ndim != 2:
        fail("nl.load_transpose2d reads a 2-D HBM tensor", api=api)
    transposed = src._with(dims=(src.dims[1], src.dims[0]), vars=(src.vars[1], src.vars[0]))
    return load(transposed, dtype=dtype, mask=mask, api=api)


def dma_transpose(dst: NkiTensor, src: NkiTensor, axes=None, api: str = "nisa.dma_transpose") -> None:
    """The DMA engine's transpose, as a DMA reading the HBM source with permuted strides (2-D: (1, 0); 3-D:
    (2, 1, 0); 4-D: (3, 1, 2, 0), NKI's permutations)."""
    if src.space != Space.HBM:
        fail("dma_transpose from SBUF is not supported (the emulated DMA reads SBUF by partitions)", api=api,
             unsupported=True, hint="transpose on chip with nisa.nc_transpose")
    perm = tuple(axes) if axes is not None else {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}.get(src.ndim)
    if perm is None or sorted(perm) != list(range(src.ndim)):
        fail(f"axes {axes} for a {src.ndim}-D source", api=api)
    dma(dst, src.permute(perm), api)


# ---------------------------------------------------------------------------------------------------------
# Tensor engine


def matmul(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, accumulate=None,
           api: str = "nisa.nc_matmul", mask=None, transposing: bool = False) -> None:
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N] on the Tensor engine (fp32 in PSUM). ``accumulate`` None:
    accumulate onto what earlier matmuls wrote there, as NKI infers it."""
    trace = current()
    views = apply_mask(mask, [dst, stationary, moving], api)
    if views is None:
        return
    dst, stationary, moving = (tile(v, api, w) for v, w in zip(views, ("dst", "stationary", "moving")))
    if dst.space != Space.PSUM:
        fail(f"the matmul result goes to PSUM; dst is in {dst.space.name}", api=api,
             hint="allocate it with buffer=nl.psum, then copy it to SBUF")
    if dst.isa_dtype != DType.F32 and not transposing:
        fail(f"the matmul result is fp32 in PSUM on {trace.target.name}; dst is {dst.isa_dtype.name}", api=api,
             hint="declare the PSUM tile nl.float32 and convert when copying it out")
    k, m = stationary.partitions, stationary.free_size
    k2, n = moving.partitions, moving.free_size
    st = _flat2(stationary, api, "stationary")
    mv = _flat2(moving, api, "moving")
    out = _flat2(dst, api, "dst")
    if accumulate is None:
        accumulate = trace.matmul_accumulates(dst)
    del k, m, k2, n
    trace.emit(Opcode.MATMUL, Engine.TENSOR, [(dst.storage, out), (stationary.storage, st), (moving.storage, mv)],
               api, accumulate=bool(accumulate))


def _flat2(t: NkiTensor, api: str, what: str):
    """A tile as a 2-D [partitions, free] access pattern (its free dims must merge into one)."""
    import dataclasses

    ap = t.access()
    free = ap.dims[1:]
    stride = free[-1][0]
    expect = stride
    for s, size in reversed(free):
        if size != 1 and s != expect:
            fail(f"the {what} tile {list(t.shape)} is not contiguous along its free dims", api=api,
                 hint="pass a contiguous tile (copy it first)")
        expect = s * size if size != 1 else expect
    return dataclasses.replace(ap, dims=(ap.dims[0], (stride, t.free_size)))


def transpose(dst: NkiTensor, data: NkiTensor, api: str = "nisa.nc_transpose") -> None:
    """dst[F, P] = data[P, F].T on the Tensor engine: a matmul of data (stationary) by an identity (moving), into
    PSUM; on trn2+ a bf16/fp16 tile into a PSUM tile of its dtype directly (the Tensor engine's transpose mode,
    targets.py); any other destination gets the transpose through an fp32 PSUM tile and a copy."""
    trace = current()
    data = tile(data, api, "data")
    dst = tile(dst, api, "dst")
    if data.space != Space.SBUF:
        fail("the Tensor engine transposes SBUF tiles; data is in PSUM", api=api, unsupported=True,
             hint="copy it to SBUF first (the Vector engine's 32x32 transpose is not emulated)")
    p, f = data.partitions, data.free_size
    if f > trace.target.matmul_max_m or p > trace.target.matmul_max_k:
        fail(f"nc_transpose of a [{p}, {f}] tile: the Tensor engine transposes at most [128, 128]", api=api)
    if dst.partitions != f or dst.free_size != p:
        fail(f"transposing [{p}, {f}] into a tile of shape {list(dst.shape)}", api=api)
    if dst.space == Space.PSUM and dst.isa_dtype == DType.F32:
        target = dst
    elif dst.space == Space.PSUM and dst.isa_dtype == data.isa_dtype and trace.target.tensor_transpose_mode and \
            dst.isa_dtype in (DType.BF16, DType.F16):  # trn2+: the transpose mode writes 16-bit values to PSUM
        target = dst
    else:
        target = _scratch((f, p), DType.F32, Space.PSUM, "transpose_psum")
    ident = trace.identity(data.isa_dtype if data.isa_dtype.is_float else DType.F32, p)
    if not data.isa_dtype.is_float:
        fail("nc_transpose of an integer tile", api=api, unsupported=True)
    matmul(target, data, ident, accumulate=False, api=api, transposing=target.isa_dtype != DType.F32)
    if target is not dst:
        copy(dst, target, api=api)


def broadcast_partitions(t: NkiTensor, partitions: int) -> NkiTensor:
    """A [1, F] tile copied onto ``partitions`` partitions: a matmul of a ones row (K = 1) by it, 512 columns at a
    time, then a copy out of PSUM (exact: each product is 1.0 * x in fp32)."""
    trace = current()
    api = "broadcast_to"
    t = t.tile()
    if not t.isa_dtype.is_float:
        fail("broadcasting an integer tile across partitions", api=api, unsupported=True)
    ones = _scratch((1, partitions), t.isa_dtype, name="ones_row")
    memset(ones, 1.0)
    out = _scratch((partitions,) + t.free_shape, t.isa_dtype, name="partition_broadcast")
    flat_out = out.reshape((partitions, t.free_size))
    flat_in = t.reshape((1, t.free_size)) if t._contiguous_free() else None
    if flat_in is None:
        fail("broadcasting a strided [1, F] tile across partitions", api=api, unsupported=True)
    chunk = trace.target.matmul_max_n
    for c0 in range(0, t.free_size, chunk):
        c1 = min(t.free_size, c0 + chunk)
        acc = _scratch((partitions, c1 - c0), DType.F32, Space.PSUM, "broadcast_psum")
        matmul(acc, ones, flat_in[:, c0:c1], accumulate=False, api=api)
        copy(flat_out[:, c0:c1], acc, api=api)
    return out


# ---------------------------------------------------------------------------------------------------------
# Vector / Scalar / GpSimd engines


def _engine(engine, candidates, operands) -> Engine:
    if engine is not None:
        return engine
    return current().pick_engine(candidates, operands)


def copy(dst: NkiTensor, src: NkiTensor, engine: Engine | None = None, mask=None, api: str = "nisa.tensor_copy") -> None:
    views = apply_mask(mask, [dst, src], api)
    if views is None:
        return
    dst, src = views
    if src.space == Space.HBM or dst.space == Space.HBM:
        dma(dst, src, api)
        return
    dst = tile(dst, api, "dst")
    src = fit(tile(src, api, "src"), dst, api)
    d, s = common_shape([dst, src])
    eng = _engine(engine, COPY_ENGINES, [dst, src])
    _check_engine(eng, [dst, src], api)
    current().emit(Opcode.TENSOR_COPY, eng, [(dst.storage, d), (src.storage, s)], api)


def _check_engine(engine: Engine, operands, api: str) -> None:
    if engine == Engine.GPSIMD and any(isinstance(x, NkiTensor) and x.space == Space.PSUM for x in operands):
        fail("the GpSimd engine cannot access PSUM", api=api, hint="use engine=nisa.engine.vector")


def memset(dst: NkiTensor, value, engine: Engine | None = None, mask=None, api: str = "nisa.memset") -> None:
    views = apply_mask(mask, [dst], api)
    if views is None:
        return
    (dst,) = views
    if dst.space == Space.HBM:
        stage = _scratch(dst.shape if dst.ndim >= 2 else (max(1, dst.size), 1), dst.isa_dtype, name="fill")
        memset(stage, value, engine)
        dma(dst, stage, api)
        return
    dst = tile(dst, api, "dst")
    if dst.space == Space.PSUM and engine is None:
        engine = Engine.VECTOR
    eng = _engine(engine, VECTOR_ENGINES, [dst])
    _check_engine(eng, [dst], api)
    current().emit(Opcode.MEMSET, eng, [dst], api, imm0=float(value))


def tensor_tensor(dst: NkiTensor, a, b, op, engine: Engine | None = None, mask=None,
                  api: str = "nisa.tensor_tensor") -> None:
    """dst = a <op> b elementwise (Vector or GpSimd). A per-partition operand (a [P, 1] tile) is read with stride 0;
    one float op with such an operand is one TENSOR_ALU2 pass (NKI's tensor_scalar), as cheap as one input."""
    alu = lookup(op, ALU, "op", api) if not isinstance(op, AluOp) else op
    if not isinstance(a, NkiTensor) or not isinstance(b, NkiTensor):
        scalar_first = not isinstance(a, NkiTensor)
        data, value = (b, a) if scalar_first else (a, b)
        tensor_scalar(dst, data, alu, value, reverse0=scalar_first, engine=engine, mask=mask, api=api)
        return
    views = apply_mask(mask, [dst, a, b], api)
    if views is None:
        return
    dst, a, b = views
    dst = tile(dst, api, "dst")
    a, b = tile(a, api, "data1"), tile(b, api, "data2")
    if a.space == Space.PSUM and b.space == Space.PSUM:
        fail("both inputs are in PSUM; at most one may be", api=api, hint="copy one to SBUF first")
    per_partition = [x.free_size == 1 and dst.free_size > 1 for x in (a, b)]
    a, b = fit(a, dst, api), fit(b, dst, api)
    floats = all(x.isa_dtype.is_float for x in (dst, a, b))
    trace = current()
    if floats and any(per_partition) and alu in ALU2_OPS:
        d, x, y = common_shape([dst, a, b])
        eng = _engine(engine, VECTOR_ENGINES, [dst, a, b])
        _check_engine(eng, [dst, a, b], api)
        trace.emit(Opcode.TENSOR_ALU2, eng, [(dst.storage, d), (a.storage, x), (b.storage, y), (a.storage, x)], api,
                   alu=alu, alu1=AluOp.NONE)
        return
    d, x, y = common_shape([dst, a, b])
    eng = _engine(engine, VECTOR_ENGINES, [dst, a, b])
    _check_engine(eng, [dst, a, b], api)
    trace.emit(Opcode.TENSOR_TENSOR, eng, [(dst.storage, d), (a.storage, x), (b.storage, y)], api, alu=alu)


def _operand_value(x, api: str):
    """A tensor_scalar operand: a number, or a [P, 1] tile (one value per partition)."""
    if isinstance(x, NkiTensor):
        t = tile(x, api, "operand")
        if t.free_size != 1:
            fail(f"a per-partition operand must be [P, 1], got {list(t.shape)}", api=api)
        return t
    if isinstance(x, (bool, int, float, np.number)):
        return float(x)
    fail(f"operand {x!r} must be a number or a [P, 1] tile", api=api)


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0, operand0, reverse0: bool = False, op1=None, operand1=None,
                  reverse1: bool = False, engine: Engine | None = None, mask=None,
                  api: str = "nisa.tensor_scalar") -> None:
    """dst = (data <op0> operand0) <op1> operand1, the operands numbers or [P, 1] tiles, computed in fp32 and
    rounded once. One op with a number: TENSOR_SCALAR (Vector, GpSimd, or Scalar for add/multiply); otherwise
    TENSOR_ALU2 (Vector/GpSimd), numbers held in [P, 1] constant tiles; what TENSOR_ALU2 cannot order (a reversed
    second op) in two steps through an fp32 tile (the same single rounding)."""
    trace = current()
    alu0 = lookup(op0, ALU, "op0", api)
    alu1 = lookup(op1, ALU, "op1", api) if op1 is not None else AluOp.NONE
    views = apply_mask(mask, [dst, data], api)
    if views is None:
        return
    dst, data = views
    dst, data = tile(dst, api, "dst"), tile(data, api, "data")
    data = fit(data, dst, api)
    v0 = _operand_value(operand0, api)
    v1 = _operand_value(operand1, api) if alu1 != AluOp.NONE else None
    floats = dst.isa_dtype.is_float and data.isa_dtype.is_float
    if alu1 == AluOp.NONE and not isinstance(v0, NkiTensor):
        d, s = common_shape([dst, data])
        candidates = VECTOR_ENGINES + ((Engine.SCALAR,) if alu0 in (AluOp.ADD, AluOp.MULTIPLY) and floats else ())
        eng = _engine(engine, candidates, [dst, data])
        _check_engine(eng, [dst, data], api)
        trace.emit(Opcode.TENSOR_SCALAR, eng, [(dst.storage, d), (data.storage, s)], api, alu=alu0, imm0=v0,
                   reverse=bool(reverse0))
        return
    if not floats or alu0 not in ALU2_OPS or (alu1 != AluOp.NONE and alu1 not in ALU2_OPS):
        # integer or comparison/bitwise ops: one TENSOR_TENSOR / TENSOR_SCALAR per op
        if alu1 == AluOp.NONE:
            _binary_with(dst, data, alu0, v0, reverse0, engine, api)
            return
        mid = _scratch(dst.shape, DType.F32 if floats else data.isa_dtype, name="tensor_scalar_mid")
        _binary_with(mid, data, alu0, v0, reverse0, engine, api)
        _binary_with(dst, mid, alu1, v1, reverse1, engine, api)
        return
    c0 = v0 if isinstance(v0, NkiTensor) else _const_column(v0, dst.partitions)
    if alu1 == AluOp.NONE:
        a, b = (c0, data) if reverse0 else (data, c0)
        _alu2(dst, a, b, a, alu0, AluOp.NONE, engine, api)
        return
    c1 = v1 if isinstance(v1, NkiTensor) else _const_column(v1, dst.partitions)
    a, b = (c0, data) if reverse0 else (data, c0)
    if reverse1 and alu1 not in COMMUTATIVE:
        mid = _scratch(dst.shape, DType.F32, name="tensor_scalar_mid")
        _alu2(mid, a, b, a, alu0, AluOp.NONE, engine, api)
        _alu2(dst, c1, mid, c1, alu1, AluOp.NONE, engine, api)
        return
    _alu2(dst, a, b, c1, alu0, alu1, engine, api)


def _binary_with(dst, data, alu, value, reverse, engine, api):
    trace = current()
    if isinstance(value, NkiTensor):
        a, b = (value, data) if reverse else (data, value)
        a, b = fit(a, dst, api), fit(b, dst, api)
        d, x, y = common_shape([dst, a, b])
        eng = _engine(engine, VECTOR_ENGINES, [dst, a, b])
        _check_engine(eng, [dst, a, b], api)
        trace.emit(Opcode.TENSOR_TENSOR, eng, [(dst.storage, d), (a.storage, x), (b.storage, y)], api, alu=alu)
        return
    d, s = common_shape([dst, fit(data, dst, api)])
    eng = _engine(engine, VECTOR_ENGINES, [dst, data])
    _check_engine(eng, [dst, data], api)
    trace.emit(Opcode.TENSOR_SCALAR, eng, [(dst.storage, d), (data.storage, s)], api, alu=alu, imm0=value,
               reverse=bool(reverse))


def _alu2(dst, a, b, c, alu, alu1, engine, api):
    trace = current()
    a, b, c = fit(a, dst, api), fit(b, dst, api), fit(c, dst, api)
    d, x, y, z = common_shape([dst, a, b, c])
    eng = _engine(engine, VECTOR_ENGINES, [dst, a, b, c])
    if eng not in VECTOR_ENGINES:
        eng = Engine.VECTOR
    _check_engine(eng, [dst, a, b, c], api)
    trace.emit(Opcode.TENSOR_ALU2, eng, [(dst.storage, d), (a.storage, x), (b.storage, y), (c.storage, z)], api,
               alu=alu, alu1=alu1)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, engine=None,
                         mask=None, api: str = "nisa.scalar_tensor_tensor") -> None:
    """dst = (data <op0> operand0) <op1> operand1, operand1 a full tile: one TENSOR_ALU2."""
    alu0, alu1 = lookup(op0, ALU, "op0", api), lookup(op1, ALU, "op1", api)
    views = apply_mask(mask, [dst, data, operand1], api)
    if views is None:
        return
    dst, data, operand1 = views
    dst, data, t1 = tile(dst, api, "dst"), tile(data, api, "data"), tile(operand1, api, "operand1")
    v0 = _operand_value(operand0, api)
    c0 = v0 if isinstance(v0, NkiTensor) else _const_column(v0, dst.partitions)
    a, b = (c0, data) if reverse0 else (data, c0)
    if reverse1 and alu1 not in COMMUTATIVE:
        mid = _scratch(dst.shape, DType.F32, name="stt_mid")
        _alu2(mid, a, b, a, alu0, AluOp.NONE, engine, api)
        _alu2(dst, t1, mid, t1, alu1, AluOp.NONE, engine, api)
        return
    _alu2(dst, a, b, t1, alu0, alu1, engine, api)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, mask=None,
                       api: str = "nisa.tensor_tensor_scan") -> None:
    """dst[:, i] = (data0[:, i] <op0> dst[:, i-1]) <op1> data1[:, i] along the free elements, dst[:, -1] being
    ``initial`` (a number, or a [P, 1] tile): one TENSOR_TENSOR_SCAN on the Vector engine, its state in fp32."""
    alu0, alu1 = lookup(op0, ALU, "op0", api), lookup(op1, ALU, "op1", api)
    for alu, rev, name in ((alu0, reverse0, "reverse0"), (alu1, reverse1, "reverse1")):
        if rev and alu not in COMMUTATIVE:
            fail(f"{name}=True with {alu.name.lower()}: the scan's reversed operand order is not emulated", api=api,
                 unsupported=True, hint="a commutative op (add, multiply, max, min) needs no reversal")
    views = apply_mask(mask, [dst, data0, data1], api)
    if views is None:
        return
    dst, data0, data1 = views
    dst, data0, data1 = tile(dst, api, "dst"), tile(data0, api, "data0"), tile(data1, api, "data1")
    if data0.shape != dst.shape or data1.shape != dst.shape:
        fail(f"data0 {list(data0.shape)} and data1 {list(data1.shape)} must have the result's shape "
             f"{list(dst.shape)}", api=api)
    if not all(x.isa_dtype.is_float for x in (dst, data0, data1)) or alu0 not in ALU2_OPS or alu1 not in ALU2_OPS:
        fail("the scan computes on float tiles with arithmetic ops (add, subtract, multiply, divide, max, min, pow)",
             api=api, unsupported=True)
    if data0.space == Space.PSUM and data1.space == Space.PSUM:
        fail("both data tiles are in PSUM; at most one may be", api=api, hint="copy one to SBUF first")
    if isinstance(initial, NkiTensor):
        init = tile(initial, api, "initial")
        if init.free_size != 1 or init.partitions not in (1, dst.partitions):
            fail(f"initial must be a number or a [{dst.partitions}, 1] tile, got {list(init.shape)}", api=api)
        if init.partitions == 1 and dst.partitions > 1:
            fail("initial must have the data's partitions", api=api, hint=f"give a [{dst.partitions}, 1] tile")
        if init.isa_dtype != DType.F32 or init.space != Space.SBUF:
            staged = _scratch((dst.partitions, 1), DType.F32, name="scan_initial")
            copy(staged, init, api=api)
            init = staged
    else:
        init = _const_column(float(_operand_value(initial, api)), dst.partitions)
    d, x, y = common_shape([dst, data0, data1])
    current().emit(Opcode.TENSOR_TENSOR_SCAN, Engine.VECTOR,
                   [(dst.storage, d), (data0.storage, x), (data1.storage, y), (init.storage, init.access())], api,
                   alu=alu0, alu1=alu1)


def activation(dst: NkiTensor, op, data: NkiTensor, bias=None, scale=1.0, reduce_res: NkiTensor | None = None,
               reduce_op=None, mask=None, api: str = "nisa.activation") -> None:
    """dst = op(data * scale + bias) on the Scalar engine, and with ``reduce_res`` its row sums in the same pass
    (ACTIVATE_BIAS_REDUCE, whose bias is an fp32 [P, 1] SBUF tile: a number or another tile is put in one). A
    [P, 1] ``scale`` tile is the operand of one ACTIVATE_SCALED (its bias a tile as above); with ``reduce_res`` it is
    applied by a Vector multiply into an fp32 tile first (the same fp32 product)."""
    trace = current()
    func = lookup(op, ACT, "activation op", api)
    if reduce_op is not None and lookup(reduce_op, REDUCE, "reduce_op", api) != AluOp.ADD:
        fail("the Scalar engine's reduction adds (reduce_op=nl.add)", api=api, unsupported=True)
    views = apply_mask(mask, [dst, data], api)
    if views is None:
        return
    dst, data = views
    dst, data = tile(dst, api, "dst"), fit(tile(data, api, "data"), tile(dst, api, "dst"), api)
    if isinstance(scale, NkiTensor) and reduce_res is None:
        d, s = common_shape([dst, data])
        if len(d.dims) != 2:
            fail(f"an activation with a scale tile takes 2-D tiles (contiguous free dims), got {list(dst.shape)}",
                 api=api, hint="reshape the tiles to [P, F]")
        m, b = (_per_partition(v, api, name, dst.partitions) for v, name in ((scale, "scale"), (bias, "bias")))
        trace.emit(Opcode.ACTIVATE_SCALED, Engine.SCALAR, [(dst.storage, d), (data.storage, s), (m.storage, m.access()),
                                                           (b.storage, b.access())], api, func=func)
        return
    if isinstance(scale, NkiTensor):
        scaled = _scratch(dst.shape, DType.F32, name="activation_scaled")
        tensor_tensor(scaled, data, scale, AluOp.MULTIPLY, api=api)
        data, scale = scaled, 1.0
    scale = float(scale)
    if reduce_res is None and not isinstance(bias, NkiTensor):
        d, s = common_shape([dst, data])
        trace.emit(Opcode.ACTIVATE, Engine.SCALAR, [(dst.storage, d), (data.storage, s)], api, func=func,
                   imm0=scale, imm1=float(bias or 0.0))
        return
    b = _per_partition(bias, api, "bias", dst.partitions)
    rows = reduce_res
    direct = (rows is not None and rows.space == Space.SBUF and rows.isa_dtype == DType.F32
              and tile(rows, api, "reduce_res").free_size == 1)
    row_sum = tile(rows, api, "reduce_res") if direct else _scratch((dst.partitions, 1), DType.F32, name="row_sum")
    d, s = common_shape([dst, data])
    if len(d.dims) != 2:
        fail(f"an activation with a bias tile or a reduction takes 2-D tiles (contiguous free dims), got "
             f"{list(dst.shape)}", api=api, hint="reshape the tiles to [P, F]")
    trace.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR,
               [(dst.storage, d), (row_sum.storage, row_sum.access()), (data.storage, s), (b.storage, b.access())], api,
               func=func, imm0=scale)
    if rows is not None and not direct:
        copy(rows, row_sum, api=api)


def _per_partition(value, api: str, name: str, partitions: int = 0):
    """An activation's fp32 [P, 1] SBUF tile for `value`: a [P, 1] tile (copied into one when of another dtype or
    space), or a number (a constant column of `partitions`)."""
    if not isinstance(value, NkiTensor):
        return _const_column(float(value or 0.0), partitions)
    t = tile(value, api, name)
    if t.free_size != 1 or partitions and t.partitions != partitions:
        fail(f"{name} must be a number or a [P, 1] tile, P = {partitions}, got {list(t.shape)}", api=api)
    if t.isa_dtype != DType.F32 or t.space != Space.SBUF:
        staged = _scratch((t.partitions, 1), DType.F32, name=f"{name}_fp32")
        copy(staged, t, api=api)
        t = staged
    return t


def tensor_reduce(dst: NkiTensor, op, data: NkiTensor, axis, negate: bool = False, engine: Engine | None = None,
                  mask=None, api: str = "nisa.tensor_reduce") -> None:
    """dst = the reduction of data over its free axes ``axis`` (Vector/GpSimd, fp32); ``negate`` by a second step
    from an fp32 tile (the same single rounding). The instruction reduces the innermost dim of its access pattern:
    the reduced axes are moved last (an access pattern's free dims reorder at no cost: the NKI samples' pooling
    reduces axes [2, 4] of a 5-D view), merged into one dim where their strides allow, else reduced innermost
    first into an fp32 tile, one axis an instruction."""
    alu = lookup(op, REDUCE, "reduction op", api)
    views = apply_mask(mask, [dst, data], api)
    if views is None:
        return
    dst, data = views
    dst, data = tile(dst, api, "dst"), tile(data, api, "data")
    axes = sorted({a + data.ndim if a < 0 else a for a in (axis if isinstance(axis, (tuple, list)) else (axis,))})
    if 0 in axes:
        fail("the partition axis cannot be reduced by tensor_reduce", api=api,
             hint="transpose first (nisa.nc_transpose), or use a matmul by a ones column")
    trailing = list(range(data.ndim - len(axes), data.ndim))
    if axes != trailing:
        data = data.permute([a for a in range(data.ndim) if a not in axes] + axes)
    kept = data.shape[:data.ndim - len(axes)]
    reduced = int(np.prod(data.shape[data.ndim - len(axes):]))
    src = data
    if len(axes) > 1:
        if not _mergeable(data.dims[data.ndim - len(axes):]):  # the innermost axis first, then the others
            partial = _scratch(data.shape[:-1], DType.F32, name="reduce_partial")
            tensor_reduce(partial, op, data, data.ndim - 1, engine=engine, api=api)
            tensor_reduce(dst, op, partial, trailing[:-1], negate=negate, engine=engine, api=api)
            return
        inner = data.dims[-1][0]
        src = data._with(dims=data.dims[:data.ndim - len(axes)] + ((inner, reduced),))
    if dst.size != int(np.prod(kept)):
        fail(f"dst {list(dst.shape)} does not hold the reduction of {list(data.shape)} over axes {axes}", api=api)
    out_shape = kept + (1,)
    trace = current()
    target = dst if not negate else _scratch(dst.shape, DType.F32, name="reduce_negated")
    out = _reshape_ap(target, out_shape, api)
    eng = _engine(engine, VECTOR_ENGINES, [dst, data])
    _check_engine(eng, [dst, data], api)
    trace.emit(Opcode.TENSOR_REDUCE, eng, [(target.storage, out), (src.storage, src.access())], api, alu=alu)
    if negate:
        tensor_scalar(dst, target, AluOp.MULTIPLY, -1.0, engine=engine, api=api)


def _mergeable(dims) -> bool:
    for (so, no), (si, ni) in zip(dims, dims[1:]):
        if no != 1 and so != si * ni:
            return False
    return True


def _reshape_ap(t: NkiTensor, shape, api: str):
    """``t``'s access pattern with the same elements in ``shape`` (t contiguous per partition, or already so)."""
    import dataclasses

    ap = t.access()
    if ap.shape == tuple(shape):
        return ap
    try:
        r = t.reshape(shape)
    except Exception:
        fail(f"tile {list(t.shape)} cannot be read as {list(shape)}", api=api)
    return dataclasses.replace(r.access())


def select(dst: NkiTensor, predicate, on_true, on_false, mask=None, api: str = "nl.where") -> None:
    """dst = predicate ? on_true : on_false (Vector); numbers become constant tiles read with stride 0."""
    views = apply_mask(mask, [dst, predicate, on_true, on_false], api)
    if views is None:
        return
    dst, predicate, on_true, on_false = views
    dst = tile(dst, api, "dst")
    ops_ = []
    for x in (predicate, on_true, on_false):
        if isinstance(x, NkiTensor):
            ops_.append(fit(tile(x, api), dst, api))
        else:
            const = _const_column(float(x), dst.partitions)
            if dst.isa_dtype != DType.F32:
                fail("select with a number and a non-fp32 destination", api=api, unsupported=True,
                     hint="pass tiles, or select into an fp32 tile")
            ops_.append(fit(const, dst, api))
    aps = common_shape([dst, *ops_])
    eng = _engine(None, (Engine.VECTOR,), [dst, *ops_])
    current().emit(Opcode.SELECT, eng, [(x.storage, ap) for x, ap in zip([dst, *ops_], aps)], api)


def iota_affine(dst: NkiTensor, const: int, partition_coef: int, free_coefs: list, api: str) -> None:
    """dst[p, f...] = const + partition_coef * p + sum(free_coefs[i] * f_i), computed on GpSimd in int32: IOTA makes
    const + partition_coef * p + (row-major free index), which is the value when the free coefficients are those
    of the row-major index; a single free axis with another coefficient is scaled by a second step."""
    trace = current()
    dst = tile(dst, api, "dst")
    shape = dst.free_shape
    row_major = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    sizes_gt1 = [i for i, s in enumerate(shape) if s > 1]
    coefs = [c for i, c in enumerate(free_coefs) if i in sizes_gt1]
    rm = [row_major[i] for i in sizes_gt1]
    if coefs == rm:
        trace.emit(Opcode.IOTA, Engine.GPSIMD, [dst], api, imm0=float(const), imm1=float(partition_coef))
        return
    if all(c == 0 for c in coefs):
        column = _scratch((dst.partitions, 1), dst.isa_dtype, name="iota_column")
        trace.emit(Opcode.IOTA, Engine.GPSIMD, [column], api, imm0=float(const), imm1=float(partition_coef))
        copy(dst, column, engine=Engine.GPSIMD, api=api)
        return
    scale = None
    if len(coefs) == 1 or all(c == coefs[-1] * r // rm[-1] for c, r in zip(coefs, rm)):
        scale = coefs[-1] // rm[-1] if rm[-1] and coefs[-1] % rm[-1] == 0 else None
    if scale is None or not all(c == scale * r for c, r in zip(coefs, rm)):
        fail(f"an iota / affine_select pattern with free coefficients {free_coefs} over {list(shape)}", api=api,
             unsupported=True, hint="use patterns affine in the row-major index of the tile's free elements")
    # values = const + pc * p + scale * flat  =  scale * (flat + (const + pc * p) / scale) when divisible, else in 2 steps
    flat = _scratch(dst.shape, DType.I32, name="iota_flat")
    trace.emit(Opcode.IOTA, Engine.GPSIMD, [flat], api, imm0=0.0, imm1=0.0)
    column = _scratch((dst.partitions, 1), DType.I32, name="iota_column")
    trace.emit(Opcode.IOTA, Engine.GPSIMD, [column], api, imm0=float(const), imm1=float(partition_coef))
    scaled = _scratch(dst.shape, DType.I32, name="iota_scaled")
    d, s = common_shape([scaled, flat])
    trace.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, [(scaled.storage, d), (flat.storage, s)], api,
               alu=AluOp.MULTIPLY, imm0=float(scale))
    _binary_with(dst, scaled, AluOp.ADD, column, False, Engine.GPSIMD, api)


def affine_predicate(pred: Predicate, shape, api: str) -> NkiTensor:
    """A uint8 tile of ``shape`` holding 1 where ``pred`` (nl.arange comparisons over the tile's axes) holds: per
    atom an iota of its affine value (GpSimd) compared with 0; atoms after the first combined by AND."""
    result_tile = None
    for affine, op in pred.atoms:
        if any(v.ndim != len(shape) for v in affine.terms):
            fail("a predicate's nl.arange vectors are placed for another tile rank", api=api)
        pc = sum(c for v, c in affine.terms.items() if v.axis == 0)
        free = [sum(c for v, c in affine.terms.items() if v.axis == i) for i in range(1, len(shape))]
        values = _scratch(shape, DType.I32, name="predicate_iota")
        iota_affine(values, affine.const, pc, free, api)
        mask = _scratch(shape, DType.U8, name="predicate")
        alu = {"<": AluOp.LT, "<=": AluOp.LE, ">": AluOp.GT, ">=": AluOp.GE, "==": AluOp.EQ, "!=": AluOp.NE}[op]
        _binary_with(mask, values, alu, 0.0, False, Engine.GPSIMD, api)
        if result_tile is None:
            result_tile = mask
        else:
            _binary_with(result_tile, result_tile, AluOp.AND, mask, False, Engine.GPSIMD, api)
    return result_tile


def reduce_shape(shape: tuple, axes, keepdims: bool) -> tuple:
    axes = {a + len(shape) if a < 0 else a for a in (axes if isinstance(axes, (tuple, list)) else (axes,))}
    kept = tuple(1 if i in axes else s for i, s in enumerate(shape) if keepdims or i not in axes)
    return kept if len(kept) >= 2 else kept + (1,)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["assign", "dma", "load", "store", "matmul", "transpose", "copy", "memset", "tensor_tensor",
           "tensor_scalar", "activation", "tensor_reduce", "select", "iota_affine", "affine_predicate", "result",
           "Result", "math", "ActFunc"]
