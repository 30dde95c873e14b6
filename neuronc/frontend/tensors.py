"""Conversions between torch tensors and numpy arrays, bf16 and fp8 included (through ml_dtypes)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from neuronc.isa import DType


def torch_dtypes() -> dict:
    """torch dtype -> DType, for every dtype the device and the compiler handle."""
    import torch

    return {
        torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16,
        torch.float8_e4m3fn: DType.F8E4M3, torch.float8_e5m2: DType.F8E5M2, torch.float64: DType.F64,
        torch.int8: DType.I8, torch.int16: DType.I16, torch.int32: DType.I32, torch.int64: DType.I64,
        torch.uint8: DType.U8, torch.bool: DType.BOOL,
    }


def dtype_of(torch_dtype) -> DType:
    return torch_dtypes()[torch_dtype]


def torch_dtype(dtype: DType):
    return {v: k for k, v in torch_dtypes().items()}[dtype]


_BITCAST = {DType.BF16: "int16", DType.F8E4M3: "uint8", DType.F8E5M2: "uint8"}


def to_numpy(tensor, copy: bool = True) -> np.ndarray:
    """``tensor``'s values as a C-contiguous numpy array (CPU); ``copy=False``: sharing the tensor's memory
    when it is a contiguous CPU tensor (a caller that only reads it, right away)."""
    import torch

    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()  # values, not a lazy view's bytes
    dtype = dtype_of(tensor.dtype)
    if dtype in _BITCAST:
        array = tensor.view(getattr(torch, _BITCAST[dtype])).numpy().view(dtype.numpy)
    else:
        array = tensor.numpy()
    return array.copy() if copy else array


def from_numpy(array: np.ndarray, copy: bool = True):
    """A CPU tensor of ``array``'s values; ``copy=False``: sharing a C-contiguous array's memory (an array
    the caller owns and no longer uses)."""
    import torch

    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray alone makes a 0-d array 1-d
    if copy:
        array = array.copy()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if array.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        target = torch.float8_e4m3fn if array.dtype == ml_dtypes.float8_e4m3fn else torch.float8_e5m2
        return torch.from_numpy(array.view(np.uint8)).view(target)
    return torch.from_numpy(array)
