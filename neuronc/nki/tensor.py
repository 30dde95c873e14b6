"""Tensors of a kernel: storage in HBM, SBUF or PSUM, and views of it (slices, index tiles, reshapes).

A :class:`Storage` is one allocation: an HBM tensor (a kernel argument, an output, a scratch buffer) or an
on-chip buffer of ``partitions x bytes`` whose address is chosen after tracing (``alloc.py``). An
:class:`NkiTensor` is a view of a storage: an element offset and ``(stride, size)`` dims, as an access
pattern of the instruction set (:mod:`neuronc.isa`). On chip one dim is the partition dim (NKI's ``par_dim``;
dim 0 unless the shape says otherwise); dims before it are block dims (each block a tile of its own), dims
after it the free dims, strides counted in elements of each partition. Indexing follows NKI: integers,
slices, ``nl.ds``, ``...``, and affine expressions of ``nl.arange`` (index tiles, which may map the tile's
axes to any dims of an HBM tensor, e.g. to read it transposed).

Arithmetic operators on tiles (``a + b``, ``x * 2.0``) are those of ``nl.add`` etc., defined in
``language.py`` and attached here.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from neuronc.errors import KernelError, KernelUnsupportedError
from neuronc.isa import AccessPattern, DType, Space, row_major_dims
from neuronc.nki import dtypes
from neuronc.nki.index import Affine, Arange

_ids = itertools.count()


class Buffer:
    """NKI's memory names (``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``)."""

    def __init__(self, name: str, space: Space):
        self.name, self.space = name, space

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", Space.SBUF)
psum = Buffer("psum", Space.PSUM)
shared_hbm = Buffer("shared_hbm", Space.HBM)
private_hbm = Buffer("private_hbm", Space.HBM)
hbm = Buffer("hbm", Space.HBM)


def buffer_space(buffer) -> Space:
    if buffer is None:
        return Space.SBUF
    if isinstance(buffer, Buffer):
        return buffer.space
    if isinstance(buffer, str) and buffer in ("sbuf", "psum", "hbm", "shared_hbm", "private_hbm"):
        return {"sbuf": Space.SBUF, "psum": Space.PSUM}.get(buffer, Space.HBM)
    raise KernelUnsupportedError(f"buffer={buffer!r}: neuronc.nki places tensors in nl.sbuf, nl.psum or HBM "
                                 f"(nl.hbm, nl.shared_hbm, nl.private_hbm)")


class Storage:
    """One allocation. HBM: a tensor of ``shape`` (``kind`` input, output or scratch). On chip: ``partitions`` x
    ``nbytes`` bytes per partition at an address chosen after tracing (``base``); ``first``/``last`` are the
    positions of the first and last instruction touching it."""

    def __init__(self, space: Space, dtype: DType, name: str, *, shape=None, partitions: int = 0, nbytes: int = 0,
                 kind: str = "scratch", loc=None):
        self.id = next(_ids)
        self.space, self.dtype, self.name, self.loc = space, dtype, name, loc
        self.shape, self.partitions, self.nbytes, self.kind = shape, partitions, nbytes, kind
        self.base = None
        self.first = self.last = None
        self.zero_pending = False  # nl.zeros in PSUM: a memset made only if a matmul does not overwrite it first
        self.matmul_written = []  # PSUM: boxes (offset, end, p0, p1) written by matmuls, for accumulate=None
        self.index = -1  # HBM inputs/outputs: position among them

    @property
    def hbm_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<{self.space.name} {self.name}>"


class DynSlice:
    """``nl.ds(start, size)``: the slice start:start+size."""

    def __init__(self, start, size):
        self.start, self.size = start, size


def _is_index_expr(k) -> bool:
    return isinstance(k, (Affine, Arange))


class NkiTensor:
    """A view of a :class:`Storage` (see the module docstring)."""

    __array_priority__ = 1000  # numpy scalars on the left defer to our operators

    def __init__(self, storage: Storage, dtype: DType, offset: int, dims: tuple, pdim: int | None = None,
                 partition: int = 0, vars: tuple | None = None):
        self.storage, self._dtype, self.offset, self.dims = storage, dtype, int(offset), tuple(dims)
        self.pdim, self.partition = pdim, partition
        self.vars = vars if vars is not None else (None,) * len(self.dims)  # the arange var of each dim, if any

    # -- what a tensor is -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(size for _, size in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return self._dtype.numpy

    @property
    def isa_dtype(self) -> DType:
        return self._dtype

    @property
    def itemsize(self) -> int:
        return self._dtype.itemsize

    @property
    def space(self) -> Space:
        return self.storage.space

    @property
    def buffer(self) -> Buffer:
        return {Space.SBUF: sbuf, Space.PSUM: psum}.get(self.space, shared_hbm)

    @property
    def on_chip(self) -> bool:
        return self.space != Space.HBM

    @property
    def partitions(self) -> int:
        """The partition count of an on-chip tile (its partition dim's size)."""
        return self.dims[self.pdim][1]

    @property
    def free_shape(self) -> tuple:
        return self.shape[self.pdim + 1:] if self.on_chip else self.shape[1:]

    @property
    def free_size(self) -> int:
        return int(np.prod(self.free_shape, dtype=np.int64))

    def __repr__(self) -> str:
        return f"NkiTensor({self.storage.name}, {self.space.name}, {self._dtype.name}{list(self.shape)})"

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        raise KernelError("iterating over a tensor is not supported", hint="index it with integers or slices")

    def __bool__(self):
        raise KernelError("a tensor's value is not known while the kernel is traced (used in if/while/bool)",
                          hint="compute a mask or select on chip (nl.where, nisa.affine_select)")

    def _with(self, **changes) -> "NkiTensor":
        t = NkiTensor(self.storage, self._dtype, self.offset, self.dims, self.pdim, self.partition, self.vars)
        for k, v in changes.items():
            setattr(t, k, v)
        if "dims" in changes and "vars" not in changes:
            t.vars = (None,) * len(t.dims)
        return t

    # -- as an access pattern -------------------------------------------------------------------------
    def tile(self) -> "NkiTensor":
        """This view as one tile: on chip, its block dims (all of size 1) dropped, the partition dim first."""
        if not self.on_chip or self.pdim == 0:
            return self
        blocks = self.shape[:self.pdim]
        if any(b != 1 for b in blocks):
            raise KernelError(f"a tensor of shape {list(self.shape)} with block dims {list(blocks)} before its "
                              f"partition dim is used as one tile",
                              hint="index the block dims (t[i]) to pick one tile")
        return self._with(dims=self.dims[self.pdim:], pdim=0, vars=self.vars[self.pdim:])

    def access(self) -> AccessPattern:
        """The access pattern of this view, relative to its storage (on chip: its base address is added later)."""
        self._check_bounds()
        t = self.tile()
        dims = t.dims
        if t.on_chip:
            (_, p), free = dims[0], dims[1:]
            dims = ((1, p), *(free or ((1, 1),)))
        elif not dims:
            dims = ((1, 1),)
        return AccessPattern(t.space, t._dtype, t.offset * t.itemsize, tuple(dims), t.partition if t.on_chip else 0)

    def _check_bounds(self) -> None:
        """Every element the view names lies in its storage (index tiles may reach outside until masked)."""
        lo = hi = self.offset
        for i, (stride, size) in enumerate(self.dims):
            if self.on_chip and i == self.pdim:
                continue
            reach = stride * (size - 1)
            lo, hi = lo + min(reach, 0), hi + max(reach, 0)
        if self.on_chip:
            elements = self.storage.nbytes // self.storage.dtype.itemsize * self.storage.dtype.itemsize // self.itemsize
            p0, p1 = self.partition, self.partition + self.dims[self.pdim][1]
            ok = lo >= 0 and hi < elements and p0 >= 0 and p1 <= self.storage.partitions
        else:
            elements = self.storage.hbm_bytes // self.itemsize
            ok = lo >= 0 and hi < elements
        if not ok:
            from neuronc.nki.trace import fail

            fail(f"a view of {self.storage.name} {list(self.shape)} reaches outside it (elements [{lo}, {hi}] of "
                 f"{elements}{'' if not self.on_chip else f', partitions [{p0}, {p1})'})",
                 hint="mask the out-of-range part (mask=...) or fix the index")

    def ap(self, pattern, offset: int | None = None, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None):
        """NKI's explicit access pattern: ``pattern`` [[stride, count], ...] over this tensor's elements from its
        offset (plus ``offset``); with ``vector_offset`` (an SBUF [P, 1] integer tile, HBM tensors only) dim
        ``indirect_dim`` is indexed per partition: an indirect DMA's gather source or scatter destination."""
        from neuronc.nki.trace import fail

        if scalar_offset is not None:
            fail("scalar_offset (a run-time offset) is not supported", api="NkiTensor.ap", unsupported=True)
        view = self._with(offset=self.offset + (offset or 0), dims=tuple((int(st), int(n)) for st, n in pattern),
                          _dtype=dtypes.isa_dtype(dtype) if dtype is not None else self._dtype)
        if vector_offset is None:
            return view
        if self.on_chip or indirect_dim != 0:
            fail("vector_offset indexes dim 0 of an HBM tensor", api="NkiTensor.ap", unsupported=True)
        return Indirect(view, vector_offset)

    # -- indexing -------------------------------------------------------------------------------------
    def __getitem__(self, key) -> "NkiTensor":
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1:]
        if len(key) > self.ndim:
            raise KernelError(f"{len(key)} indices for a tensor of {self.ndim} dims {list(self.shape)}")
        if key and isinstance(key[0], NkiTensor) and key[0].on_chip and not self.on_chip:
            return self._indirect(key)
        if any(_is_index_expr(k) for k in key):
            return self._index_tile(key)
        key = key + (slice(None),) * (self.ndim - len(key))
        view = self
        for dim in reversed(range(len(key))):  # right to left: selecting a dim does not move those before it
            view = view._index_dim(dim, key[dim])
        return view._at_least_2d()

    def _indirect(self, key) -> "Indirect":
        """``t[idx, ...]`` with an SBUF tile of row numbers: row idx[p] of t for each partition p (the rest of the
        key selects within the rows)."""
        index, rest = key[0], key[1:]
        rows = self[(0, *rest)] if rest else self[0]
        stride = self.dims[0]
        dims = ((stride[0], index.tile().partitions),) + rows.dims
        return Indirect(NkiTensor(self.storage, self._dtype, rows.offset, dims), index)

    def _at_least_2d(self) -> "NkiTensor":
        if self.on_chip and self.ndim - self.pdim < 2:
            return self._with(dims=self.dims + ((1, 1),), vars=self.vars + (None,))
        return self

    def _index_dim(self, dim: int, k) -> "NkiTensor":
        stride, size = self.dims[dim]
        if isinstance(k, DynSlice):
            k = slice(k.start, k.start + k.size)
        if isinstance(k, slice):
            start, stop, step = k.indices(size)
            if k.start is not None and not isinstance(k.start, (int, np.integer)):
                raise KernelUnsupportedError("a slice with a non-integer start", hint="slice with Python ints")
            n = max(0, -(-(stop - start) // step))
            if n == 0:
                raise KernelError(f"the slice {k} of dim {dim} (size {size}) is empty")
            if self.on_chip and dim == self.pdim:
                if step != 1:
                    raise KernelError("a slice of the partition dim with a step: partitions are contiguous",
                                      hint="slice partitions with step 1")
                dims = self.dims[:dim] + ((stride, n),) + self.dims[dim + 1:]
                return self._with(dims=dims, partition=self.partition + start)
            dims = self.dims[:dim] + ((stride * step, n),) + self.dims[dim + 1:]
            return self._with(offset=self.offset + start * stride, dims=dims)
        if isinstance(k, (int, np.integer)):
            i = int(k) + size if k < 0 else int(k)
            if not 0 <= i < size:
                raise KernelError(f"index {k} is out of range for dim {dim} of size {size} (shape {list(self.shape)})")
            if self.on_chip and dim == self.pdim:
                return self._with(dims=self.dims[:dim] + ((stride, 1),) + self.dims[dim + 1:],
                                  partition=self.partition + i)
            dims = self.dims[:dim] + self.dims[dim + 1:]
            pdim = self.pdim - 1 if self.on_chip and dim < self.pdim else self.pdim
            return self._with(offset=self.offset + i * stride, dims=dims, pdim=pdim,
                              vars=self.vars[:dim] + self.vars[dim + 1:])
        if k is None:
            raise KernelUnsupportedError("indexing with None (a new axis)", hint="use t.expand_dims(axis) / reshape")
        raise KernelUnsupportedError(f"index {k!r} of type {type(k).__name__}",
                                     hint="index with ints, slices, nl.ds, ... or nl.arange expressions")

    def _index_tile(self, key) -> "NkiTensor":
        """A tile named by affine index expressions: its axes are those of the nl.arange vectors."""
        if len(key) != self.ndim:
            raise KernelError(f"an index tile of a {self.ndim}-dim tensor needs {self.ndim} indices, got {len(key)}")
        exprs = []
        for k in key:
            if isinstance(k, (slice, DynSlice)) or k is Ellipsis:
                raise KernelUnsupportedError("an index mixing slices with nl.arange expressions",
                                             hint="use nl.arange for every sliced dim, or slices only")
            exprs.append(Affine.of(k))
        vars_ = list(dict.fromkeys(v for e in exprs for v in e.terms))
        ndim = {v.ndim for v in vars_}
        if len(ndim) != 1:
            raise KernelError("an index tile mixes nl.arange vectors placed for different tile ranks "
                              "(e.g. [:, None] with [None, :, None])")
        ndim = ndim.pop()
        axes: dict = {}
        for v in vars_:
            if v.axis in axes and axes[v.axis] is not v:
                raise KernelError(f"two different nl.arange vectors run along tile axis {v.axis} of one index",
                                  hint="use one vector per axis")
            axes[v.axis] = v
        offset, partition = self.offset, self.partition
        dims = []
        for axis in range(ndim):
            v = axes.get(axis)
            stride = 0
            for dim, e in enumerate(exprs):
                if v is not None and v in e.terms:
                    stride += e.terms[v] * self.dims[dim][0]
            dims.append((stride, v.size if v is not None else 1))
        for dim, e in enumerate(exprs):
            lo = e.const + sum(min(0, c * (v.size - 1)) for v, c in e.terms.items())
            hi = e.const + sum(max(0, c * (v.size - 1)) for v, c in e.terms.items())
            if self.on_chip and dim == self.pdim and (lo < 0 or hi >= self.dims[dim][1]):
                raise KernelError(f"an index of the partition dim reaches [{lo}, {hi}], outside its size "
                                  f"{self.dims[dim][1]} (shape {list(self.shape)})")
            if self.on_chip and dim == self.pdim:
                partition += e.const
            else:
                offset += e.const * self.dims[dim][0]
        if not self.on_chip:
            return NkiTensor(self.storage, self._dtype, offset, dims, None, 0, tuple(axes.get(a) for a in range(ndim)))
        # on chip: tile axis 0 must be the partition dim, indexed by one vector with coefficient 1
        pe = exprs[self.pdim]
        pv = axes.get(0)
        ok = (pv is None and not pe.terms) or (pe.terms == {pv: 1})
        if not ok or any(pv in e.terms for d, e in enumerate(exprs) if d != self.pdim):
            raise KernelError("an on-chip index tile must index the partition dim by tile axis 0 alone "
                              "(e.g. t[nl.arange(128)[:, None], ...])",
                              hint="partitions cannot be read with a stride or moved to a free axis; transpose "
                              "with nisa.nc_transpose instead")
        for dim in range(self.pdim):
            if exprs[dim].terms:
                raise KernelError("an index tile varies a block dim (before the partition dim)",
                                  hint="index block dims with integers")
        dims[0] = (1, dims[0][1])
        return NkiTensor(self.storage, self._dtype, offset, dims, 0, partition, tuple(axes.get(a) for a in range(ndim)))

    # -- views ------------------------------------------------------------------------------------------
    def _contiguous_free(self) -> bool:
        expect = 1
        start = (self.pdim + 1) if self.on_chip else 0
        for stride, size in reversed(self.dims[start:]):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    def reshape(self, shape) -> "NkiTensor":
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if int(np.prod(shape)) != self.size:
            raise KernelError(f"cannot reshape {list(self.shape)} to {list(shape)}: {self.size} elements")
        if not self.on_chip:
            if not self._contiguous_free():
                raise KernelError(f"reshape of a strided HBM view {list(self.shape)}", hint="reshape the whole tensor")
            return NkiTensor(self.storage, self._dtype, self.offset, row_major_dims(shape), None, 0)
        t = self.tile()
        if shape[0] != t.partitions or not t._contiguous_free():
            raise KernelError(f"reshape of a tile {list(self.shape)} to {list(shape)}: the partition dim must stay "
                              f"and the free dims be contiguous")
        free = row_major_dims(shape[1:])
        return NkiTensor(t.storage, t._dtype, t.offset, ((1, shape[0]), *free), 0, t.partition)

    def broadcast_to(self, shape) -> "NkiTensor":
        from neuronc.nki import ops  # partition broadcasts are computed (a matmul by ones), not views

        shape = tuple(int(s) for s in shape)
        if len(shape) != self.ndim:
            raise KernelError(f"broadcast_to {list(shape)} from {list(self.shape)}: keep the rank")
        t = self
        if t.on_chip:
            t = t.tile()
            if shape[0] != t.partitions:
                if t.partitions != 1:
                    raise KernelError(f"broadcast_to {list(shape)}: partition dim {t.partitions} is not 1")
                t = ops.broadcast_partitions(t, shape[0])
        dims = []
        for (stride, size), want in zip(t.dims, shape):
            if size == want:
                dims.append((stride, size))
            elif size == 1:
                dims.append((0, want))
            else:
                raise KernelError(f"broadcast_to {list(shape)} from {list(self.shape)}: dim of size {size}")
        return t._with(dims=tuple(dims))

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        shape = list(self.shape)
        shape[dim] = size
        return self.broadcast_to(tuple(shape))

    def expand_dims(self, axis: int) -> "NkiTensor":
        axis = axis + self.ndim + 1 if axis < 0 else axis
        if self.on_chip and axis <= self.pdim:
            raise KernelError("expand_dims before the partition dim")
        return self._with(dims=self.dims[:axis] + ((1, 1),) + self.dims[axis:],
                          vars=self.vars[:axis] + (None,) + self.vars[axis:])

    expand_dim = expand_dims

    def permute(self, dims) -> "NkiTensor":
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise KernelError(f"permute{dims} of a {self.ndim}-dim tensor")
        if self.on_chip and dims[self.pdim] != self.pdim:
            raise KernelError("permute moves the partition dim", hint="transpose with nisa.nc_transpose")
        return self._with(dims=tuple(self.dims[d] for d in dims), vars=tuple(self.vars[d] for d in dims))

    def view(self, dtype) -> "NkiTensor":
        new = dtypes.isa_dtype(dtype)
        if new.itemsize != self.itemsize:
            raise KernelUnsupportedError("view() to a dtype of another size", hint="use a dtype of the same width")
        return self._with(_dtype=new)

    def astype(self, dtype) -> "NkiTensor":
        from neuronc.nki import ops

        return ops.copy(self, dtype=dtype)

    def assert_shape(self, shape):
        if tuple(shape) != self.shape:
            raise KernelError(f"shape {list(self.shape)} is not the expected {list(shape)}")
        return self

    # -- writes -----------------------------------------------------------------------------------------
    def __setitem__(self, key, value):
        from neuronc.nki import ops

        ops.assign(self[key], value)


class Indirect:
    """Rows of an HBM tensor picked per partition by a tile of row numbers (``t[idx, :]``, ``t.ap(...,
    vector_offset=idx)``): the source of a gather or the destination of a scatter (an indirect DMA). ``view``'s dim 0
    is (row stride, one row per partition); its offset is row 0's."""

    def __init__(self, view: NkiTensor, index: NkiTensor):
        self.view, self.index = view, index

    @property
    def shape(self) -> tuple:
        return self.view.shape

    @property
    def dtype(self):
        return self.view.dtype

    def table(self) -> AccessPattern:
        """The access pattern of every row (dims[0] bounding the rows), as DMA_GATHER / DMA_SCATTER take it."""
        stride = self.view.dims[0][0]
        rows = self.view.storage.hbm_bytes // self.view.itemsize // max(1, stride)
        base = self.view.offset % stride if stride else self.view.offset
        row0 = self.view.offset // stride if stride else 0
        dims = ((stride, rows - row0),) + self.view.dims[1:]
        return AccessPattern(Space.HBM, self.view.isa_dtype, (row0 * stride + base) * self.view.itemsize, dims)


def par_dim(size: int) -> "ParDim":
    """``nl.par_dim(n)``: marks the partition dim in a shape (dims before it are block dims)."""
    return ParDim(size)


class ParDim(int):
    def __new__(cls, size):
        return super().__new__(cls, int(size))


def new_onchip(space: Space, shape, dtype: DType, name: str, loc) -> NkiTensor:
    """A fresh on-chip tensor of ``shape`` (its ``par_dim`` marks the partition dim, else dim 0)."""
    shape = tuple(shape)
    pdims = [i for i, s in enumerate(shape) if isinstance(s, ParDim)]
    if len(pdims) > 1:
        raise KernelError(f"shape {shape} marks {len(pdims)} partition dims")
    pdim = pdims[0] if pdims else 0
    shape = tuple(int(s) for s in shape)
    if len(shape) - pdim < 2:  # a [P] tile is [P, 1]
        shape = shape + (1,)
    if any(s < 1 for s in shape):
        raise KernelError(f"shape {list(shape)} has an empty dim")
    blocks, (p, *free) = shape[:pdim], shape[pdim:]
    free_elements = int(np.prod(free, dtype=np.int64))
    nbytes = int(np.prod(blocks, dtype=np.int64)) * free_elements * dtype.itemsize
    storage = Storage(space, dtype, name, partitions=p, nbytes=nbytes, loc=loc)
    dims = []
    stride = free_elements
    block_dims = []
    for b in reversed(blocks):
        block_dims.append((stride, b))
        stride *= b
    dims = tuple(reversed(block_dims)) + ((1, p),) + row_major_dims(free)
    return NkiTensor(storage, dtype, 0, dims, pdim, 0)


def new_hbm(shape, dtype: DType, name: str, kind: str, loc) -> NkiTensor:
    shape = tuple(int(s) for s in shape)
    storage = Storage(Space.HBM, dtype, name, shape=shape, kind=kind, loc=loc)
    return NkiTensor(storage, dtype, 0, row_major_dims(shape))


def common_shape(views: list) -> list:
    """The views as access patterns of one common shape (for instructions whose operands must agree):
    each view's dims split where another's dims have boundaries, then dims contiguous in every view merged.
    On-chip views keep the partition dim first. Raises when no common shape exists."""
    aps = [v.access() if isinstance(v, NkiTensor) else v for v in views]
    total = {ap.num_elements for ap in aps}
    if len(total) != 1:
        raise KernelError("operands have different element counts: " + ", ".join(str(list(ap.shape)) for ap in aps))
    if len({ap.shape for ap in aps}) == 1:
        return aps
    cuts = set()
    for ap in aps:
        extent = 1
        for _, size in reversed(ap.dims):
            extent *= size
            cuts.add(extent)
    cuts = sorted(cuts)
    refined = [_refine(ap.dims, cuts) for ap in aps]
    if any(r is None for r in refined) or len({tuple(s for _, s in r) for r in refined}) != 1:
        raise KernelError("operands' shapes cannot be matched element by element: " +
                          ", ".join(str(list(ap.shape)) for ap in aps),
                          hint="give operands the same shape, or reshape contiguous tiles")
    # partition dims must line up: each on-chip operand's first refined dim must be its partition dim
    for ap, r in zip(aps, refined):
        if ap.space != Space.HBM and r[0][1] != ap.partitions:
            raise KernelError(f"operand {list(ap.shape)} would spread its partitions over several dims of "
                              f"the other operands ({', '.join(str(list(a.shape)) for a in aps)})",
                              hint="operands must have the same number of partitions")
    merged = _merge(refined, [ap.space != Space.HBM for ap in aps])
    import dataclasses

    return [dataclasses.replace(ap, dims=tuple(d)) for ap, d in zip(aps, merged)]


def _refine(dims, cuts):
    out, extent = [], 1
    for stride, size in reversed(dims):
        remaining, cur = size, extent
        for c in cuts:
            if extent < c < extent * size:
                if c % cur or remaining % (c // cur):
                    return None
                f = c // cur
                out.append((stride * (cur // extent), f))
                remaining //= f
                cur = c
        out.append((stride * (cur // extent), remaining))
        extent *= size
    return list(reversed(out))


def _merge(refined: list, on_chip: list) -> list:
    n = len(refined[0])
    keep = [list(r) for r in refined]
    i = n - 1
    while i > 0:
        if i == 1 and any(on_chip):
            break  # never merge into an on-chip partition dim
        mergeable = all(r[i - 1][0] == r[i][0] * r[i][1] or r[i - 1][1] == 1 for r in keep)
        if mergeable:
            for r in keep:
                (_, no), (si, ni) = r[i - 1], r[i]
                r[i - 1:i + 1] = [(si, no * ni)]
        i -= 1
    return keep


def nelems(shape) -> int:
    return int(math.prod(shape))
