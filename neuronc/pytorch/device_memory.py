"""The memory of `neuron` tensors: bytes in the HBM of an emulated NeuronCore, one core per device.

The C++ shim's allocator asks :func:`allocate` for every storage PyTorch makes on ``neuron:i``; the
bytes are reserved on core *i*'s HBM allocator (the runtime's, so the capacity of the target and its
``DeviceOutOfMemoryError`` apply) and held in a numpy byte array that PyTorch then owns through the
returned owner object. Ops read and write tensors through :func:`array_of`, a strided numpy view of
those bytes: there is no other copy of a device tensor.
"""
from __future__ import annotations

import weakref

import ml_dtypes
import numpy as np
import torch

from neuronc.cc_flags import cc_flags, flag_value
from runtime import NeuronCore
from runtime.memory import allocate_hbm

_cores: dict = {}  # device index -> NeuronCore
_buffers: dict = {}  # data pointer of a storage -> its bytes

NUMPY_DTYPES = {
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64), torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2), torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
_BITCAST = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def target() -> str:
    """The NeuronCore generation the device emulates: `--target` of NEURON_CC_FLAGS, else trn2."""
    return flag_value(cc_flags(), "target") or "trn2"


def core(index: int) -> NeuronCore:
    """The emulated NeuronCore behind ``neuron:index`` (made on first use)."""
    if index not in _cores:
        _cores[index] = NeuronCore(target())
    return _cores[index]


class DeviceBuffer:
    """The bytes of one storage; dropping the last reference gives them back to the core."""

    __slots__ = ("bytes", "__weakref__")

    def __init__(self, array: np.ndarray):
        self.bytes = array


def _release(hbm, handle: int, pointer: int) -> None:
    hbm.free(handle)
    _buffers.pop(pointer, None)


def allocate(index: int, nbytes: int) -> tuple:
    """(data pointer, owner) of ``nbytes`` fresh bytes of core ``index``'s HBM (read as NaN until written)."""
    hbm = core(index).hbm
    handle = hbm.reserve(f"a neuron:{index} tensor storage of {nbytes} bytes", nbytes)
    array = allocate_hbm(nbytes)
    pointer = array.ctypes.data
    _buffers[pointer] = array
    owner = DeviceBuffer(array)
    weakref.finalize(owner, _release, hbm, handle, pointer)
    return pointer, owner


def array_of(tensor: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a `neuron` tensor's elements, in its device memory."""
    dtype = NUMPY_DTYPES[tensor.dtype]
    pointer = tensor.data_ptr()
    if pointer == 0:  # no elements
        return np.empty(tuple(tensor.shape), dtype)
    itemsize = dtype.itemsize
    offset = tensor.storage_offset() * itemsize
    return np.ndarray(tensor.shape, dtype, buffer=_buffers[pointer - offset], offset=offset,
                      strides=[s * itemsize for s in tensor.stride()])


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
