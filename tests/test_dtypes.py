"""Low-precision models: the zoo in bf16 and fp16 (storage through ml_dtypes, matmuls accumulated in
fp32 in PSUM, conversions rounding to nearest even) matches eager PyTorch within that dtype's
tolerance, against an fp32 reference computed from the same rounded weights, or is no less accurate
than eager itself in that dtype (Inductor's accuracy check; tests/conftest.py assert_as_accurate_as_eager)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from neuronc.frontend.tensors import from_numpy, to_numpy
from tests import zoo
from tests.conftest import OnDevice, assert_as_accurate_as_eager, compile_module, run_program


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_in_low_precision_matches_eager(name, dtype):
    model, inputs = zoo.build(name)
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)  # ids and masks stay
    outs = run_program(compile_module(model, inputs).neff, inputs)
    assert_as_accurate_as_eager(outs, model, inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_at_O0_through_torch_compile_matches_eager(dtype):
    """-O0 (one kernel per op, no fusion) in bf16 and fp16, through torch.compile: the graph ran on the device."""
    model, (x,) = zoo.build("transformer_block")
    model, x = model.to(dtype), x.to(dtype)
    compiled = OnDevice(model, options={"opt_level": 0})
    with torch.no_grad():
        out = compiled(x)
    assert {g.options.opt_level for g in compiled.graphs} == {0}  # compiled at -O0, not the default -O2
    assert_as_accurate_as_eager([out], model, (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_at_O0_through_the_cli_matches_eager(dtype, cli, saved_program, tmp_path):
    model, (x,) = zoo.build("transformer_block")
    model, x = model.to(dtype), x.to(dtype)
    neff = tmp_path / "block.neff"
    compiled = cli("compile", saved_program(model, (x,)), "-o", neff, "-O0")
    assert compiled.exit_code == 0 and "at -O0" in compiled.output, compiled.output
    np.save(tmp_path / "x.npy", to_numpy(x))  # ml_dtypes' bfloat16 for bf16
    ran = cli("run", neff, "--input", tmp_path / "x.npy", "--output", tmp_path / "out.npz")
    assert ran.exit_code == 0, ran.output
    with np.load(tmp_path / "out.npz", allow_pickle=False) as outputs:
        out = from_numpy(outputs["output0"].view(to_numpy(x).dtype))  # numpy stores bf16 as raw bytes ('|V2')
    assert_as_accurate_as_eager([out], model, (x,))
