"""The memories of one emulated NeuronCore as raw bytes, and the one place where an access pattern
becomes a numpy view of them.

HBM is a flat byte array sized by the program; SBUF and PSUM are ``partitions x bytes`` arrays sized
by the target. Instructions never copy memory to read it: every operand is a strided numpy view
over these bytes, so a write through one view is seen by every other. Fresh memory is filled with
0xFF bytes, which read as NaN in f32/bf16/f16 (like the NKI simulator), so a program that reads
memory it never wrote shows it in its outputs.
"""
from __future__ import annotations

import numpy as np

from neuronc.errors import DeviceOutOfMemoryError, NeuronRuntimeError
from neuronc.isa import AccessPattern, Space
from neuronc.targets import Target

UNINITIALISED = 0xFF  # byte pattern of memory nobody wrote: NaN for f32, bf16 and f16


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def allocate_hbm(neff, target: Target) -> np.ndarray:
    """The program's HBM, after checking it fits in the target's HBM per NeuronCore."""
    if neff.hbm_size > target.hbm_bytes:
        largest = sorted(neff.tensors, key=lambda t: t.nbytes, reverse=True)[:5]
        uses = ", ".join(f"{t.name} ({t.kind.name.lower()}, {_mib(t.nbytes)})" for t in largest)
        raise DeviceOutOfMemoryError(
            f"program {neff.name!r} needs {neff.hbm_size} bytes ({_mib(neff.hbm_size)}) of HBM, "
            f"but a {target.name} NeuronCore has {target.hbm_bytes} bytes ({_mib(target.hbm_bytes)}); "
            f"largest tensors: {uses}",
            hint="use a smaller batch or model, cast weights to bf16, or pick a target with more HBM",
        )
    return np.full(neff.hbm_size, UNINITIALISED, np.uint8)


def allocate_on_chip(target: Target) -> tuple:
    """Fresh (SBUF, PSUM) of ``target``."""
    sbuf = np.full((target.partitions, target.sbuf_bytes_per_partition), UNINITIALISED, np.uint8)
    psum = np.full((target.partitions, target.psum_bytes_per_partition), UNINITIALISED, np.uint8)
    return sbuf, psum


def free_byte_span(ap: AccessPattern, dims: tuple) -> tuple:
    """Bytes [lo, hi) addressed by ``dims`` of ``ap`` relative to ``ap.offset``."""
    lo = hi = 0
    for stride, size in dims:
        reach = (size - 1) * stride * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    return ap.offset + lo, ap.offset + hi + ap.dtype.itemsize


class Memory:
    """The bytes one loaded program sees: its own HBM plus its core's SBUF and PSUM."""

    def __init__(self, hbm: np.ndarray, sbuf: np.ndarray, psum: np.ndarray):
        self.arrays = {Space.HBM: hbm, Space.SBUF: sbuf, Space.PSUM: psum}

    def view(self, ap: AccessPattern) -> np.ndarray:
        """A writable numpy view of the elements ``ap`` addresses; raises if any byte is outside."""
        memory = self.arrays[ap.space]
        if not ap.dims or any(size < 1 for _, size in ap.dims):
            raise NeuronRuntimeError(f"{ap.space.name} operand has an empty shape {ap.shape}")
        itemsize = ap.dtype.itemsize
        if ap.space == Space.HBM:
            lo, hi = free_byte_span(ap, ap.dims)
            if lo < 0 or hi > memory.size:
                raise NeuronRuntimeError(
                    f"HBM operand addresses bytes [{lo}, {hi}) outside the program's {memory.size} bytes of HBM"
                )
            strides = tuple(stride * itemsize for stride, _ in ap.dims)
            return np.ndarray(ap.shape, ap.dtype.numpy, buffer=memory, offset=ap.offset, strides=strides)

        partitions, row_bytes = memory.shape
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
                f"{ap.space.name} operand addresses bytes [{lo}, {hi}) of each partition, "
                f"outside [0, {row_bytes})"
            )
        strides = (row_bytes,) + tuple(stride * itemsize for stride, _ in free)
        offset = ap.partition * row_bytes + ap.offset
        return np.ndarray(ap.shape, ap.dtype.numpy, buffer=memory, offset=offset, strides=strides)
