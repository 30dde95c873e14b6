"""Low-precision models: the zoo in bf16 and fp16 (storage through ml_dtypes, matmuls accumulated in
fp32 in PSUM, conversions rounding to nearest even) matches eager PyTorch within that dtype's
tolerance, against an fp32 reference computed from the same rounded weights, or is no less accurate
than eager itself in that dtype (Inductor's accuracy check; tests/conftest.py assert_as_accurate_as_eager)."""
from __future__ import annotations

import pytest
import torch

from neuronc.compiler import compile_exported
from neuronc.frontend.tensors import from_numpy, to_numpy
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_as_accurate_as_eager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_in_low_precision_matches_eager(name, dtype):
    model, inputs = zoo.build(name)
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)  # ids and masks stay
    neff = compile_exported(torch.export.export(model, inputs)).neff
    outs = [from_numpy(out) for out in run_neff(neff, [to_numpy(x) for x in inputs]).outputs]
    assert_as_accurate_as_eager(outs, model, inputs)
