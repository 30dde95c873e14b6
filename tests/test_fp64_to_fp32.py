"""`--auto-cast fp64-to-fp32`: the NeuronCore has no float64, so a program taking or returning float64 is refused
unless this flag accepts it; with it the program computes in fp32 on the device, its float64 inputs and outputs
cast at the boundary by the host, and the user gets float64 tensors.

A float64 result computed in fp32 is compared with eager PyTorch in float64 with the fp32 row of
neuronc/tolerances.py (`tolerance=torch.float32`): fp32 is what the device computes in, so fp32's tolerance is the
most one may ask, and eager float64 is the reference the user's model was written against."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.errors import NeuronCompileError, NeuronConfigError
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.auto_cast import AutoCast
from tests.conftest import OnDevice, assert_matches_eager

FLAG = "--auto-cast fp64-to-fp32"


class Float64Model(torch.nn.Module):
    """A small float64 model: a linear layer, a transcendental, a reduction."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 8).double()

    def forward(self, x, y):
        h = torch.tanh(self.linear(x)) * y
        return h, h.sum(dim=1)


def inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(4, 16, dtype=torch.float64, generator=generator),
            torch.randn(4, 8, dtype=torch.float64, generator=generator))


@pytest.fixture
def strict(monkeypatch):
    """No CPU fallback: a refusal is an error, not ops quietly run by the CPU."""
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")


def test_a_float64_model_compiled_with_the_flag_returns_float64_within_fp32_tolerance_of_eager_float64(strict):
    model, args = Float64Model(), inputs()
    compiled = OnDevice(model, options={"auto_cast": "fp64-to-fp32"})
    got = compiled(*args)
    with torch.no_grad():
        want = model(*args)
    assert [g.dtype for g in got] == [torch.float64, torch.float64]
    assert_matches_eager(got, want, tolerance=torch.float32)
    neff = compiled.graphs[-1].compiled.neff
    assert {t.dtype for t in neff.inputs()} == {DType.F32}  # the device's interface is fp32
    assert {t.dtype for t in neff.outputs()} == {DType.F32}
    assert not torch.equal(got[0], want[0])  # computed in fp32 indeed, not a float64 path


def test_without_the_flag_a_float64_program_is_refused_naming_the_flag(strict):
    with pytest.raises(NeuronCompileError) as raised:
        compile_exported(torch.export.export(Float64Model(), inputs()), CompileOptions.from_dict({}))
    assert "float64" in str(raised.value)
    assert "--auto-cast fp64-to-fp32" in str(raised.value)


def test_the_flag_in_neuron_cc_flags_accepts_float64(monkeypatch, strict):
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--no_cache {FLAG}")
    model, args = Float64Model(), inputs()
    got = OnDevice(model)(*args)
    with torch.no_grad():
        assert_matches_eager(got, model(*args), tolerance=torch.float32)


def test_double_and_int64_float64_conversions_inside_a_graph_compile_under_the_flag(strict):
    def conversions(x, n):
        wide = x.double() * 3  # OpInfo's `double`
        counted = n.to(torch.float64) / 7  # int64 -> float64
        return wide, counted, (wide * 10).to(torch.int64)  # float64 -> int64

    x = torch.tensor([[0.25, -1.5, 2.0], [3.75, -0.5, 1.25]])
    n = torch.tensor([[1, -14, 700], [3, 21, -9]])
    got = OnDevice(conversions, options={"auto_cast": "fp64-to-fp32"})(x, n)
    assert_matches_eager(got, conversions(x, n), tolerance=torch.float32)


def test_without_the_flag_double_is_refused_naming_the_flag(strict):
    with pytest.raises(Exception, match="fp64-to-fp32"):
        OnDevice(lambda x: x.double() + 1)(torch.ones(3))


def test_the_flag_combines_with_a_narrowing_mode(strict):
    cast = AutoCast.from_option("matmult,fp64-to-fp32", "bf16")
    assert (cast.mode, cast.fp64) == ("matmult", True)
    assert (AutoCast.from_option("fp64-to-fp32").mode, AutoCast.from_option("matmult").fp64) == ("none", False)
    model, args = Float64Model(), inputs()
    compiled = compile_exported(torch.export.export(model, args),
                                CompileOptions(auto_cast="matmult,fp64-to-fp32"))
    multiplied = {x.dtype for n in compiled.graph.nodes() if n.op is Op.MATMUL for x in n.inputs[:2]}
    assert multiplied == {DType.BF16}
    with pytest.raises(NeuronConfigError, match="fp64-to-fp32"):
        AutoCast.from_option("fp64-to-fp32,bogus")


def test_the_cli_refuses_a_float64_program_naming_the_flag_and_compiles_it_with_the_flag(strict, tmp_path):
    model, args = Float64Model(), inputs()
    pt2, neff = tmp_path / "f64.pt2", tmp_path / "f64.neff"
    torch.export.save(torch.export.export(model, args), str(pt2))
    refused = CliRunner().invoke(main, ["compile", str(pt2), "-o", str(neff)])
    assert refused.exit_code == 1 and "--auto-cast fp64-to-fp32" in refused.output
    assert not neff.exists()

    done = CliRunner().invoke(main, ["compile", str(pt2), "-o", str(neff), "--auto-cast", "fp64-to-fp32"])
    assert done.exit_code == 0, done.output
    shown = json.loads(CliRunner().invoke(main, ["inspect", str(neff), "--json"]).output)
    assert [t["dtype"] for t in shown["tensors"] if t["kind"] in ("input", "output")] == ["f32"] * 4

    for i, a in enumerate(args):  # the user's float64 data, cast by `neuronc run`
        np.save(tmp_path / f"x{i}.npy", a.numpy())
    ran = CliRunner().invoke(main, ["run", str(neff), "-i", str(tmp_path / "x0.npy"), "-i", str(tmp_path / "x1.npy"),
                                    "-o", str(tmp_path / "out.npz")])
    assert ran.exit_code == 0, ran.output
    assert "float64" in ran.output and "cast to float32" in ran.output
    with np.load(tmp_path / "out.npz") as out:
        got = [torch.from_numpy(out[name]) for name in out.files]
    with torch.no_grad():
        want = model(*args)
    assert [g.dtype for g in got] == [torch.float32] * 2  # the NEFF's outputs, as it declares them
    assert_matches_eager([g.double() for g in got], want, tolerance=torch.float32)


def test_a_float64_model_trains_under_the_flag_with_float64_gradients_within_fp32_tolerance(strict):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    OnDevice(model, options={"auto_cast": "fp64-to-fp32"})(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert_matches_eager(got, [p.grad for p in model.parameters()], tolerance=torch.float32)
