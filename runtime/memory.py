"""The memories of one emulated NeuronCore: the accounting of its HBM, its on-chip SBUF and PSUM as
raw bytes, and the one place where an access pattern becomes a numpy view of bytes.

HBM is accounted per core (:class:`HbmAllocator`, the target's ``hbm_bytes``) and each loaded program
keeps the bytes of its tensors in a host array of its own (:class:`HbmLayout`: host memory follows what
a program can touch, not the size its NEFF declares); SBUF and PSUM are ``partitions x bytes`` arrays
sized by the target, shared by the programs loaded on the core. Instructions never copy memory to read it: every operand is a strided numpy view over these
bytes, so a write through one view is seen by every other. Fresh memory is filled with 0xFF bytes,
which read as NaN in f32/bf16/f16 (like the NKI simulator); in HBM, the bytes of tensors the host writes
before any read (inputs, weights, constants) are not (``allocate_hbm``).
"""
from __future__ import annotations

import bisect
import itertools
import math
import threading

import numpy as np

from neuronc.errors import DeviceOutOfMemoryError, NeuronRuntimeError
from neuronc.host_memory import HOST_BUDGET_VARIABLE, host_memory_budget
from neuronc.isa import AccessPattern, Space
from neuronc.targets import TARGETS, Target

UNINITIALISED = 0xFF  # byte pattern of memory nobody wrote: NaN for f32, bf16 and f16
HOST_ALIGNMENT = 64  # bytes: a tensor keeps its HBM address modulo this in host memory (so every element
# alignment, and every granule of the access checks, stays what the NEFF has); a host choice, not hardware's


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: bytes below a KiB, else KiB/MiB/GiB with one decimal."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _exact(nbytes: int) -> str:
    """``nbytes`` exactly, and for people when large."""
    return f"{nbytes} bytes" if nbytes < 2**10 else f"{nbytes} bytes ({size_text(nbytes)})"


class HbmAllocator:
    """The HBM of one NeuronCore: which loaded program holds how many bytes, out of the target's capacity.

    Programs keep their bytes in numpy arrays of their own; this only accounts for them, so running out
    is reported the way a device would (and before the host tries to allocate gigabytes)."""

    def __init__(self, target: Target):
        self.target = target
        self.capacity = target.hbm_bytes
        self.allocations: dict = {}  # handle -> (program name, bytes), in order of loading
        self.in_use = self.peak = 0
        self._handles = itertools.count()

    def allocate(self, neff) -> int:
        """Reserve ``neff.hbm_size`` bytes for program ``neff``; returns the handle to free them with."""
        if neff.hbm_size > self.capacity - self.in_use:
            raise self._out_of_memory(neff)
        handle = next(self._handles)
        self.allocations[handle] = (neff.name, neff.hbm_size)
        self.in_use += neff.hbm_size
        self.peak = max(self.peak, self.in_use)
        return handle

    def reserve(self, name: str, nbytes: int) -> int:
        """Reserve ``nbytes`` for a buffer of the host's choosing (a `neuron` device tensor's storage);
        returns the handle to free it with. Counts against the same capacity as loaded programs."""
        if nbytes > self.capacity - self.in_use:
            loaded = ", ".join(f"{n!r} ({size_text(b)})" for n, b in self.allocations.values()) or "nothing"
            raise DeviceOutOfMemoryError(
                f"{name} needs {_exact(nbytes)} of HBM, but the {self.target.name} NeuronCore has "
                f"{_exact(self.capacity)}, {_exact(self.capacity - self.in_use)} free (in use: {loaded})",
                hint="free tensors you no longer need (del, then torch.accelerator.empty_cache()), use a smaller "
                "batch, or spread the work over more NeuronCores (neuron:1, ...)",
            )
        handle = next(self._handles)
        self.allocations[handle] = (name, nbytes)
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return handle

    def free(self, handle: int) -> None:
        """Give back the bytes of ``handle`` (freeing twice is harmless)."""
        _, nbytes = self.allocations.pop(handle, (None, 0))
        self.in_use -= nbytes

    def _out_of_memory(self, neff) -> DeviceOutOfMemoryError:
        free = self.capacity - self.in_use
        loaded = ", ".join(f"{name!r} ({size_text(n)})" for name, n in self.allocations.values())
        in_use = f"{_exact(self.in_use)} in use by {loaded}" if loaded else "none in use"
        largest = sorted(neff.tensors, key=lambda t: t.nbytes, reverse=True)[:5]
        tensors = ", ".join(f"{t.name} ({t.kind.name.lower()}, {size_text(t.nbytes)})" for t in largest)
        bigger = sorted((t for t in TARGETS.values() if t.hbm_bytes > self.capacity and t.hbm_bytes >= neff.hbm_size),
                        key=lambda t: t.hbm_bytes)
        ways = ["unload programs you no longer need (LoadedProgram.unload())"] if loaded else []
        if bigger:
            more = ", ".join(f"{t.name} has {size_text(t.hbm_bytes)}" for t in bigger)
            ways.append(f"use a target with more HBM per NeuronCore ({more})")
        ways.append("use a smaller batch (or cast the weights to bf16)")
        return DeviceOutOfMemoryError(
            f"program {neff.name!r} needs {_exact(neff.hbm_size)} of HBM, but the {self.target.name} NeuronCore "
            f"has {_exact(self.capacity)}, {_exact(free)} free ({in_use}); "
            f"largest tensors of {neff.name!r}: {tensors}",
            hint="; ".join(ways),
        )


class HbmLayout:
    """Where the HBM bytes of a program live on the host.

    A NEFF declares ``hbm_size`` bytes of HBM, but its instructions may only touch the bytes of its tensor
    entries (an operand outside them is refused at load), so only those get host memory: the tensors'
    extents, merged where they overlap or touch, are packed one after another into one host array, each
    keeping its address modulo ``HOST_ALIGNMENT``. HBM addresses stay the NEFF's everywhere else (errors,
    timelines, overlap checks); only views and access-check tables translate them, here."""

    def __init__(self, tensors):
        merged: list = []
        for lo, hi in sorted((t.offset, t.offset + t.nbytes) for t in tensors if t.nbytes > 0):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts, self.ends, self.host_starts = [], [], []
        host = 0
        for lo, hi in merged:
            host += (lo - host) % HOST_ALIGNMENT
            self.starts.append(lo)
            self.ends.append(hi)
            self.host_starts.append(host)
            host += hi - lo
        self.size = host  # host bytes

    def host(self, lo: int, hi: int) -> int | None:
        """The host offset of HBM bytes [lo, hi), or None unless one tensor extent holds them all."""
        i = bisect.bisect_right(self.starts, lo) - 1
        if i < 0 or hi > self.ends[i]:
            return None
        return self.host_starts[i] + lo - self.starts[i]

    def hbm(self, host: int) -> int:
        """The HBM address of host byte ``host``."""
        i = bisect.bisect_right(self.host_starts, host) - 1
        return self.starts[i] + host - self.host_starts[i]

    def check(self, ap: AccessPattern) -> int:
        """The host offset of HBM operand ``ap``; raises unless one tensor extent holds every byte it addresses."""
        lo, hi = free_byte_span(ap, ap.dims)
        host = self.host(lo, hi) if ap.dims and all(size >= 1 for _, size in ap.dims) else None
        if host is None:
            raise NeuronRuntimeError(
                f"HBM operand addresses bytes [{lo}, {hi}), which no tensor of the program holds",
                hint="every HBM access must stay inside one tensor entry (input, output, weight, constant or "
                "scratch) of the NEFF's tensor table")
        return host + ap.offset - lo


def allocate_hbm(layout: HbmLayout, name: str = "program", fresh=()) -> np.ndarray:
    """A program's own HBM bytes (those ``layout`` gives host memory); refused with ``DeviceOutOfMemoryError``
    before any allocation when they exceed the host budget or the host has not got them.

    Only the ``fresh`` spans ((HBM offset, bytes): the tensors nothing but the program writes, its outputs and
    scratch) are filled with UNINITIALISED here. The others' bytes are the host's to write before anything
    reads them (weights and constants at once, inputs at every run) and take no host memory until written:
    an input read in place from the host's own array (``LoadedProgram.bind_inputs``, a compiled model's
    parameters) never takes any."""
    budget = host_memory_budget()
    if layout.size > budget:
        raise DeviceOutOfMemoryError(
            f"emulating {name!r} needs {_exact(layout.size)} of host memory for its tensors, more than the "
            f"emulator's budget of {_exact(budget)}",
            hint=f"raise the budget ({HOST_BUDGET_VARIABLE}=16G) on a machine with that much memory, or use a "
            "smaller batch")
    try:
        hbm = np.empty(layout.size, np.uint8)  # (pages of a large one are the kernel's until touched)
    except MemoryError:
        raise DeviceOutOfMemoryError(
            f"the host could not allocate {_exact(layout.size)} to emulate the HBM of {name!r}",
            hint="free memory on the host (other processes, unloaded programs), or use a smaller batch") from None
    for offset, nbytes in fresh:
        if nbytes:
            host = layout.host(offset, offset + nbytes)
            hbm[host:host + nbytes] = UNINITIALISED
    return hbm


class OnChip:
    """The SBUF and PSUM of a NeuronCore of ``target``, fresh. Emulated cores made with the same one
    (``NeuronCore(target, on_chip=...)``) share its bytes instead of each holding its own (tens of MiB),
    and their runs take turns (``lock``): a program's on-chip state does not outlive its run."""

    def __init__(self, target: Target):
        self.target = target
        self.sbuf = _partition_rows(target.partitions, target.sbuf_bytes_per_partition)
        self.psum = _partition_rows(target.partitions, target.psum_bytes_per_partition)
        self.lock = threading.Lock()


ROW_PAD = 64  # bytes between the end of a partition's row and the next one's start in host memory; a host choice


def _partition_rows(partitions: int, nbytes: int) -> np.ndarray:
    """``partitions x nbytes`` uninitialised bytes whose rows lie ``nbytes + ROW_PAD`` apart in host memory.

    A row of SBUF (192 KiB) or PSUM (16 KiB) is a multiple of 4 KiB: without the pad, the same byte of every
    partition would fall in the same set of the host CPU's caches, and a tile across many partitions (most
    instructions touch 64 or 128) would evict itself. Views take the rows' distance from the array's strides."""
    return np.full((partitions, nbytes + ROW_PAD), UNINITIALISED, np.uint8)[:, :nbytes]


def free_byte_span(ap: AccessPattern, dims: tuple) -> tuple:
    """Bytes [lo, hi) addressed by ``dims`` of ``ap`` relative to ``ap.offset``."""
    lo = hi = 0
    itemsize = ap.dtype.itemsize
    for stride, size in dims:
        reach = (size - 1) * stride * itemsize
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return ap.offset + lo, ap.offset + hi + itemsize


def extent(ap: AccessPattern) -> tuple:
    """(first partition, end partition, first byte, end byte): a box that holds every byte ``ap`` addresses
    (on chip the bytes are per partition; HBM is one partition)."""
    if ap.space == Space.HBM:
        return (0, 1) + free_byte_span(ap, ap.dims)
    return (ap.partition, ap.partition + ap.dims[0][1]) + free_byte_span(ap, ap.dims[1:])


def overlaps(a: tuple, b: tuple) -> bool:
    """Whether two (space, extent) pairs may share a byte (conservative: boxes, not exact strides)."""
    (space_a, (p0, p1, lo, hi)), (space_b, (q0, q1, lo2, hi2)) = a, b
    return space_a == space_b and p0 < q1 and q0 < p1 and lo < hi2 and lo2 < hi


def check_bounds(ap: AccessPattern, memory_shape: tuple) -> None:
    """Raise unless every byte ``ap`` addresses lies in a memory of ``memory_shape`` (bytes, or partitions x bytes)."""
    if not ap.dims or any(size < 1 for _, size in ap.dims):
        raise NeuronRuntimeError(f"{ap.space.name} operand has an empty shape {ap.shape}")
    if ap.space == Space.HBM:
        lo, hi = free_byte_span(ap, ap.dims)
        if lo < 0 or hi > memory_shape[0]:
            raise NeuronRuntimeError(
                f"HBM operand addresses bytes [{lo}, {hi}) outside the program's {memory_shape[0]} bytes of HBM"
            )
        return
    partitions, row_bytes = memory_shape
    (partition_stride, partition_size), free = ap.dims[0], ap.dims[1:]
    if partition_stride != 1:
        raise NeuronRuntimeError(
            f"{ap.space.name} operand has partition stride {partition_stride}; on chip it must be 1"
        )
    if ap.partition < 0 or ap.partition + partition_size > partitions:
        raise NeuronRuntimeError(
            f"{ap.space.name} operand covers partitions [{ap.partition}, {ap.partition + partition_size}) "
            f"outside [0, {partitions})"
        )
    lo, hi = free_byte_span(ap, free)
    if lo < 0 or hi > row_bytes:
        raise NeuronRuntimeError(
            f"{ap.space.name} operand addresses bytes [{lo}, {hi}) of each partition, outside [0, {row_bytes})"
        )


def view(memory: np.ndarray, ap: AccessPattern, layout: HbmLayout | None = None,
         whole: tuple | None = None) -> np.ndarray:
    """A writable numpy view of the elements ``ap`` addresses in ``memory`` (checked with ``check_bounds``;
    in HBM, with ``layout.check`` when the memory holds only a program's tensors). ``whole``: on chip, the
    ``contiguous_whole`` of ``memory`` when the caller has it already (it costs more than the rest of a view)."""
    itemsize = ap.dtype.itemsize
    if ap.space == Space.HBM:
        offset = ap.offset if layout is None else layout.check(ap)
        strides = tuple(stride * itemsize for stride, _ in ap.dims)
    else:
        row_bytes = memory.strides[0]
        offset = ap.partition * row_bytes + ap.offset
        strides = (row_bytes,) + tuple(stride * itemsize for stride, _ in ap.dims[1:])
        if not memory.flags.c_contiguous:  # rows apart by more than their bytes (OnChip): a view of the whole
            memory, start = whole or contiguous_whole(memory)
            offset += start
    return np.ndarray(ap.shape, ap.dtype.numpy, buffer=memory, offset=offset, strides=strides)


def contiguous_whole(memory: np.ndarray) -> tuple:
    """(the array ``memory`` is a view of, the byte offset of ``memory``'s first byte in it): a buffer that a
    view with ``memory``'s row strides can be made on when ``memory`` itself is not contiguous (OnChip's rows)."""
    base = memory.base
    return base, memory.__array_interface__["data"][0] - base.__array_interface__["data"][0]


class Columns:
    """The bytes of a partition that a program's on-chip operands address, each stretch with a granule of its own.
    The access check keeps its tables for these bytes only, not for the partition's whole row: a small program's
    few tiles may lie anywhere in a row of 192 KiB, and tables as wide as the row cost their allocation and page
    faults on every load.

    The operands' extents, merged where they overlap (sharing a byte; extents that only touch stay apart), are
    the stretches; every operand lies in one, and each stretch's granule is the largest that the operands inside it
    are aligned to (:func:`granule`), as :class:`HbmRegions` has it in HBM: a stretch only ever addressed as fp32
    keeps one entry per 4 bytes even when a byte-sized mask in another needs one per byte. A stretch's entries are
    those of its granules [lo // granule, hi // granule), one stretch after another in each partition's row of the
    table (``size`` entries per partition)."""

    def __init__(self, aps):
        merged: list = []  # [lo, hi, granule]
        distinct = {id(ap): ap for ap in aps}.values()  # (each pattern object once: no hash of its fields)
        for lo, hi, g in sorted({(*free_byte_span(ap, ap.dims[1:]), granule((ap,))) for ap in distinct}):
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
                merged[-1][2] = math.gcd(merged[-1][2], g)
            else:
                merged.append([lo, hi, g])
        self.starts, self.ends, self.granules, self.firsts = [], [], [], []
        entries = 0
        for lo, hi, g in merged:  # (an operand's extent is aligned to its granule, so a stretch's to its own)
            self.starts.append(lo)
            self.ends.append(hi)
            self.granules.append(g)
            self.firsts.append(entries - lo // g)  # the entry of byte b is firsts[i] + b // g
            entries += (hi - lo) // g
        self.size = entries  # entries per partition, all stretches

    def find(self, lo: int, hi: int) -> int:
        """The number of the stretch holding per-partition bytes [lo, hi)."""
        i = bisect.bisect_right(self.starts, lo) - 1
        if i < 0 or hi > self.ends[i]:
            raise NeuronRuntimeError(f"bytes [{lo}, {hi}) of a partition are outside the program's on-chip operands",
                                     hint="an internal error of the access check: please report it")
        return i


class HbmRegions:
    """The HBM bytes the access check keeps tables for, each region with a granule of its own.

    Only outputs and scratch tensors are ever written by a program (neff.rules), so only their bytes need
    tables: a read of an input, weight or constant is ordered with everything. Their extents, merged where
    they overlap (scratch entries may share bytes), are the regions; every HBM operand of the program lies in
    one tensor entry, so in at most one region, and each region's granule is the largest that the operands
    inside it and its tensors' bounds are aligned to (:func:`granule`): a region of fp32 tensors keeps one
    entry per 4 bytes even when a byte-sized mask elsewhere needs one per byte. ``regions`` are
    (lo, hi, granule) triples, disjoint and sorted; a region's entries are those of its granules
    [lo // granule, ceil(hi / granule)), one after another in the table."""

    def __init__(self, regions):
        self.starts, self.ends, self.granules, self.firsts = [], [], [], []
        entries = 0
        for lo, hi, g in regions:
            self.starts.append(lo)
            self.ends.append(hi)
            self.granules.append(g)
            self.firsts.append(entries - lo // g)  # the entry of HBM byte b is firsts[i] + b // g
            entries += -(-hi // g) - lo // g
        self.size = entries  # entries, all regions

    def find(self, lo: int, hi: int) -> int:
        """The number of the region holding HBM bytes [lo, hi)."""
        i = bisect.bisect_right(self.starts, lo) - 1
        if i < 0 or hi > self.ends[i]:
            raise NeuronRuntimeError(f"HBM bytes [{lo}, {hi}) are outside the outputs and scratch tensors the "
                                     f"access check keeps tables for",
                                     hint="an internal error of the access check: please report it")
        return i


def hbm_regions(volatile, aps) -> HbmRegions:
    """The :class:`HbmRegions` of a program whose output and scratch tensors are ``volatile`` and whose HBM
    operands are ``aps``: each region's granule from the operands inside it and its tensors' bounds."""
    merged: list = []  # [lo, hi, the bounds of its tensors]
    for t in sorted((t for t in volatile if t.nbytes > 0), key=lambda t: t.offset):
        if merged and t.offset < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t.offset + t.nbytes)
            merged[-1][2] += (t.offset, t.offset + t.nbytes)
        else:
            merged.append([t.offset, t.offset + t.nbytes, [t.offset, t.offset + t.nbytes]])
    inside: list = [[] for _ in merged]
    starts = [lo for lo, _, _ in merged]
    for ap in aps:
        lo, hi = free_byte_span(ap, ap.dims)
        i = bisect.bisect_right(starts, lo) - 1
        if i >= 0 and hi <= merged[i][1]:
            inside[i].append(ap)
    return HbmRegions((lo, hi, granule(aps_inside, bounds)) for (lo, hi, bounds), aps_inside in zip(merged, inside))


class Cells:
    """A table with one entry per granule of a memory's bytes (on chip: per partition), to keep facts about
    them (who wrote them last) at the finest grain the program's operands use.

    A granule is the largest number of bytes every operand of a region (in HBM) or stretch (on chip) is aligned
    to (:func:`granule`), so the entries an operand covers form a strided view like the operand itself: ``of(ap)``.
    ``layout`` says which bytes have entries, at which granule: in HBM an :class:`HbmRegions`, on chip a
    :class:`Columns`; addresses stay the memory's."""

    def __init__(self, partitions: int, dtype, layout: HbmRegions | Columns):
        self.layout = layout
        self._views: dict = {}  # access pattern -> its entries (of): a program reuses its tiles' patterns
        self.table = np.zeros(layout.size if isinstance(layout, HbmRegions) else (partitions, layout.size), dtype)

    def _entry(self, lo: int, hi: int) -> tuple:
        """(the entry of byte ``lo``, the granule there) for bytes [lo, hi), which one region or span holds."""
        i = self.layout.find(lo, hi)
        g = self.layout.granules[i]
        return self.layout.firsts[i] + lo // g, g

    def granule_at(self, byte: int) -> int:
        """The bytes per entry at ``byte``."""
        return self._entry(byte, byte + 1)[1]

    def span(self, offset: int, nbytes: int) -> np.ndarray:
        """The entries of HBM bytes [offset, offset + nbytes) (one tensor's)."""
        first, g = self._entry(offset, offset + nbytes)
        return self.table[first:first + nbytes // g]

    def of(self, ap: AccessPattern) -> np.ndarray:
        """The entries of the bytes ``ap`` addresses: ``ap.shape`` plus a last dim over each element's granules.
        Made once per pattern (a view of the table, which never moves): the access check asks for each operand."""
        entries = self._views.get(ap)
        if entries is None:
            entries = self._views[ap] = self._of(ap)
        return entries

    def _of(self, ap: AccessPattern) -> np.ndarray:
        cell = self.table.itemsize
        dims = ap.dims if ap.space == Space.HBM else ap.dims[1:]
        lo, hi = free_byte_span(ap, dims)
        first, g = self._entry(lo, hi)
        strides = tuple(stride * ap.dtype.itemsize // g * cell for stride, _ in dims) + (cell,)
        offset = (first + (ap.offset - lo) // g) * cell
        if ap.space != Space.HBM:
            strides, offset = (self.table.strides[0],) + strides, offset + ap.partition * self.table.strides[0]
        return np.ndarray(ap.shape + (ap.dtype.itemsize // g,), self.table.dtype, buffer=self.table,
                          offset=offset, strides=strides)

    def at(self, partition: int, byte: int):
        """The entry of ``byte`` (of ``partition``, on chip)."""
        entry, _ = self._entry(byte, byte + 1)
        if self.table.ndim == 1:
            return self.table[entry]
        return self.table[partition, entry]

    def locate(self, ap: AccessPattern, index: tuple) -> tuple:
        """(partition, first byte) of the granule at ``index`` of ``of(ap)`` (partition 0 in HBM)."""
        dims = ap.dims if ap.space == Space.HBM else ap.dims[1:]
        free = index if ap.space == Space.HBM else index[1:]
        byte = ap.offset + sum(i * stride * ap.dtype.itemsize for i, (stride, _) in zip(free, dims))
        partition = 0 if ap.space == Space.HBM else ap.partition + index[0]
        return partition, byte + index[-1] * self.granule_at(byte)


def granule(aps, boundaries=()) -> int:
    """The most bytes that every one of ``aps`` (and every offset in ``boundaries``) is aligned to."""
    g = 0
    for ap in aps:
        g = math.gcd(g, ap.dtype.itemsize, ap.offset)
        for stride, size in ap.dims[0 if ap.space == Space.HBM else 1:]:
            if size > 1:
                g = math.gcd(g, stride * ap.dtype.itemsize)
    for b in boundaries:
        g = math.gcd(g, b)
    return g or 1


class Memory:
    """The bytes one loaded program sees: its own HBM (its tensors', placed by ``layout``) plus its core's
    SBUF and PSUM.

    ``bound`` pairs tensor entries (read-only ones: inputs) with C-contiguous host arrays of their shape and
    dtype that stand in for their bytes: views of such a tensor's HBM are views of the host's array, so a
    program reads it in place (see ``LoadedProgram.bind_inputs``)."""

    def __init__(self, hbm: np.ndarray, sbuf: np.ndarray, psum: np.ndarray, layout: HbmLayout | None = None,
                 bound: list | None = None):
        self.arrays = {Space.HBM: hbm, Space.SBUF: sbuf, Space.PSUM: psum}
        self.wholes = {space: contiguous_whole(a) for space, a in ((Space.SBUF, sbuf), (Space.PSUM, psum))
                       if not a.flags.c_contiguous}  # found once, not for each of a program's views
        self.layout = layout
        self.bind(bound or [])

    def bind(self, bound: list) -> None:
        """Bind the tensor entries of ``bound`` ((entry, host array) pairs) in place of any bound before; views made
        before keep the bytes they were made on."""
        self.bound = {}  # host offset of the tensor's first byte -> (its end, the host array's bytes)
        for t, array in bound:
            if t.nbytes:
                start = self._host(t)
                self.bound[start] = (start + t.nbytes, array.reshape(-1).view(np.uint8))

    def view(self, ap: AccessPattern, checked: bool = False) -> np.ndarray:
        """A writable numpy view of the elements ``ap`` addresses; raises if any byte is outside (unless
        ``checked``: the caller has checked ``ap`` with ``check_bounds`` against these memories' shapes)."""
        memory = self.arrays[ap.space]
        if not checked and (ap.space != Space.HBM or self.layout is None):
            check_bounds(ap, memory.shape)
        if ap.space == Space.HBM and self.bound:
            bound = self._bound_view(ap)
            if bound is not None:
                return bound
        return view(memory, ap, self.layout, self.wholes.get(ap.space))

    def _bound_view(self, ap: AccessPattern) -> np.ndarray | None:
        """``ap``'s view in a bound tensor's host array, or None when it addresses no bound tensor's bytes
        (an HBM operand lies inside one tensor entry: the load checks it)."""
        lo, hi = free_byte_span(ap, ap.dims)
        host = self.layout.check(ap) if self.layout is not None else ap.offset
        first = host - (ap.offset - lo)
        for start, (end, array) in self.bound.items():
            if start <= first and first + (hi - lo) <= end:
                return np.ndarray(ap.shape, ap.dtype.numpy, buffer=array, offset=host - start,
                                  strides=tuple(stride * ap.dtype.itemsize for stride, _ in ap.dims))
        return None

    def tensor(self, t) -> np.ndarray:
        """The elements of tensor entry ``t`` of the program, in its HBM (or the host array bound to it)."""
        start = self._host(t)
        if start in self.bound and t.nbytes:
            return np.ndarray(tuple(t.shape), t.dtype.numpy, buffer=self.bound[start][1])
        return np.ndarray(tuple(t.shape), t.dtype.numpy, buffer=self.arrays[Space.HBM], offset=start)

    def tensor_bytes(self, t) -> np.ndarray:
        """The bytes of tensor entry ``t`` of the program, in its HBM."""
        offset = self._host(t)
        return self.arrays[Space.HBM][offset:offset + t.nbytes]

    def _host(self, t) -> int:
        if self.layout is None:
            return t.offset
        return self.layout.host(t.offset, t.offset + t.nbytes) if t.nbytes else 0
