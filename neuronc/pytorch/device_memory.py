"""The memory of `neuron` tensors: bytes in the HBM of an emulated NeuronCore, one core per device.

The C++ shim's allocator calls :func:`reserve` for every storage PyTorch makes on ``neuron:i``: the
bytes are accounted on core *i*'s HBM (the runtime's allocator, so the capacity of the target and its
``DeviceOutOfMemoryError`` apply) and held in a numpy byte array the shim makes; :func:`release` gives
them back when PyTorch frees the storage. Ops read and write tensors through :func:`array_of`, a
strided numpy view of those bytes made by the shim in one call: there is no other copy of a device
tensor. Work still queued on a stream holds views of the bytes, so they outlive the free until it ran.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from neuronc.cc_flags import cc_flags, flag_value
from neuronc.errors import DeviceOutOfMemoryError
from neuronc.frontend.tensors import torch_dtypes
from runtime import NeuronCore
from runtime.memory import UNINITIALISED

_cores: dict = {}  # device index -> NeuronCore

NUMPY_DTYPES = {t: np.dtype(d.numpy) for t, d in torch_dtypes().items()}  # the one torch <-> DType table
# dtypes device tensors may hold, though the compiler has none for them: ops on them run on the CPU
HOST_ONLY_DTYPES = {torch.complex64: np.dtype(np.complex64), torch.complex128: np.dtype(np.complex128),
                    torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32),
                    torch.uint64: np.dtype(np.uint64)}
NUMPY_DTYPES.update(HOST_ONLY_DTYPES)
_BITCAST = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def target() -> str:
    """The NeuronCore generation the device emulates: `--target` of NEURON_CC_FLAGS, else trn2."""
    return flag_value(cc_flags(), "target") or "trn2"


def core(index: int) -> NeuronCore:
    """The emulated NeuronCore behind ``neuron:index`` (made on first use)."""
    if index not in _cores:
        _cores[index] = NeuronCore(target())
    return _cores[index]


def reserve(index: int, nbytes: int) -> tuple:
    """Account ``nbytes`` of a new storage on core ``index``'s HBM and make the host bytes holding them:
    (the handle to release them with, the bytes, uninitialised). Reserves nothing when either fails."""
    hbm = core(index).hbm
    handle = hbm.reserve(f"a neuron:{index} tensor storage of {nbytes} bytes", nbytes)
    try:
        held = np.empty(nbytes, np.uint8)
        held.fill(UNINITIALISED)  # np.full's Python wrapper costs ~1 us more: every eager op makes its output here
        return handle, held
    except MemoryError:
        hbm.free(handle)
        raise DeviceOutOfMemoryError(
            f"the host could not allocate the {nbytes} bytes of a neuron:{index} tensor storage",
            hint="free tensors you no longer need (del, then torch.accelerator.empty_cache()), free memory on the "
            "host, or use a smaller batch") from None


def release(index: int, handle: int) -> None:
    core(index).hbm.free(handle)


def array_of(tensor: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a `neuron` tensor's elements, in its device memory (queued work not run:
    see :func:`neuronc.pytorch.queues.synchronize`)."""
    return _view(tensor)


def _view(tensor):
    global _view
    _view = sys.modules["neuron_shim"].view  # the shim is loaded before any tensor exists
    return _view(tensor)


def host_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over a contiguous `neuron` tensor's bytes (no copy; bf16 and fp8 through their bits)."""
    array = array_of(tensor)
    if tensor.dtype in _BITCAST:
        return torch.from_numpy(array.view(NUMPY_DTYPES[_BITCAST[tensor.dtype]])).view(tensor.dtype)
    return torch.from_numpy(array)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 and fp8 through ml_dtypes)."""
    tensor = tensor.detach()
    if tensor.dtype in _BITCAST:
        return tensor.view(_BITCAST[tensor.dtype]).numpy().view(NUMPY_DTYPES[tensor.dtype])
    return tensor.numpy()


def host_tensor(array: np.ndarray, dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` holding ``array`` (copied)."""
    array = np.array(array, NUMPY_DTYPES[dtype], order="C")  # a copy, 0-d stays 0-d
    if dtype in _BITCAST:
        return torch.from_numpy(array.view(NUMPY_DTYPES[_BITCAST[dtype]])).view(dtype)
    return torch.from_numpy(array)
