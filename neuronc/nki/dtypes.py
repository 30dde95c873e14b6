"""The data types a kernel names (``nl.float32``, ``np.float32``, ``nl.bfloat16``, ``'bfloat16'``, torch dtypes) as
the instruction set's :class:`~neuronc.isa.DType`, and the numpy dtype a kernel sees as ``tensor.dtype``."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from neuronc.errors import KernelUnsupportedError
from neuronc.isa import DType

# The numpy dtypes the nl.* names stand for (NKI kernels compare them with np.float32 and with each other).
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e4m3fn = float8_e4m3
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
bool_ = np.dtype(np.bool_)
tfloat32 = float32  # the Tensor engine's tf32 inputs are fp32 values here (fp32 rate, fp32 accumulation)

_BY_NAME = {"float32": float32, "fp32": float32, "bfloat16": bfloat16, "bf16": bfloat16, "float16": float16,
            "fp16": float16, "float8_e4m3": float8_e4m3, "float8_e4m3fn": float8_e4m3, "float8_e5m2": float8_e5m2,
            "int8": int8, "int16": int16, "int32": int32, "uint8": uint8, "bool": bool_, "bool_": bool_,
            "tfloat32": tfloat32, "int64": np.dtype(np.int64), "float64": np.dtype(np.float64),
            "uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


def numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype of anything a kernel may pass as a dtype."""
    if isinstance(dtype, str):
        if dtype not in _BY_NAME:
            raise KernelUnsupportedError(f"dtype {dtype!r} is not supported by neuronc.nki",
                                         hint=f"supported: {', '.join(sorted(_BY_NAME))}")
        return _BY_NAME[dtype]
    if type(dtype).__module__.startswith("torch"):  # torch.float32 -> "float32"
        name = str(dtype).rsplit(".", 1)[-1]
        return numpy_dtype({"float8_e4m3fn": "float8_e4m3"}.get(name, name))
    try:
        return np.dtype(dtype)
    except TypeError:
        raise KernelUnsupportedError(f"{dtype!r} is not a dtype neuronc.nki knows") from None


def isa_dtype(dtype) -> DType:
    if isinstance(dtype, DType):
        return dtype
    try:
        return DType.from_numpy(numpy_dtype(dtype))
    except ValueError:
        raise KernelUnsupportedError(f"dtype {dtype} is not one the emulated NeuronCore has") from None


class finfo:
    """``nl.finfo(dtype)`` / ``nl.fp32``: the range of a float type (``nl.fp32.min`` is the most negative
    finite fp32, the stand-in for -inf NKI kernels use in masks)."""

    def __init__(self, dtype):
        info = ml_dtypes.finfo(numpy_dtype(dtype))
        self.min, self.max, self.eps, self.tiny = float(info.min), float(info.max), float(info.eps), float(info.tiny)
        self.bits, self.dtype = info.bits, numpy_dtype(dtype)


fp32 = finfo(float32)
bf16 = finfo(bfloat16)
fp16 = finfo(float16)
