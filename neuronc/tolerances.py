"""The golden tolerances per dtype: the one table the tests and the supported-op probes hold
compiled results to, against eager PyTorch on CPU (DESIGN.md "Testing"; README "Tests").

A bf16/fp16 result is compared with an fp32 reference rounded once to its dtype (Inductor's
`reference_in_float`), and an fp32 result computed in a narrower type (auto-cast) with the row of
that type.
"""
from __future__ import annotations

import numpy as np
import torch

TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    # integers and booleans: exact
    **{dtype: dict(rtol=0, atol=0) for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                 torch.bool)},
}


def tolerance(dtype) -> dict:
    """The row of a dtype: a torch dtype, or a numpy one (ml_dtypes' bfloat16 included), as JAX arrays and the
    emulator's outputs have."""
    if isinstance(dtype, torch.dtype):
        return TOLERANCES[dtype]
    name = np.dtype(dtype).name
    return TOLERANCES[getattr(torch, "bool" if name == "bool" else name)]
