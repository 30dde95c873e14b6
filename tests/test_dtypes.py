"""Low-precision models: the zoo in bf16 and fp16 (storage through ml_dtypes, matmuls accumulated in
fp32 in PSUM, conversions rounding to nearest even) matches eager PyTorch within that dtype's
tolerance, against an fp32 reference computed from the same rounded weights (as Inductor's tests do)."""
from __future__ import annotations

import pytest
import torch

from neuronc.compiler import compile_exported
from neuronc.frontend.tensors import from_numpy, to_numpy
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_matches_eager, eager_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_in_low_precision_matches_eager(name, dtype):
    model, inputs = zoo.build(name)
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)  # ids and masks stay
    neff = compile_exported(torch.export.export(model, inputs)).neff
    outs = [from_numpy(out) for out in run_neff(neff, [to_numpy(x) for x in inputs]).outputs]
    assert_matches_eager(outs, eager_reference(model, inputs))
