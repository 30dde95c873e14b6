"""Golden outputs: every zoo model, compiled and run on the emulated NeuronCore, matches eager
PyTorch on CPU, through torch.compile and through the CLI."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.compiler import CompileOptions, compile_graph
from runtime import run_neff
from tests import zoo
from tests.conftest import OnDevice, assert_matches_eager, zoo_graph


def test_torch_compile_matches_eager(zoo_model):
    _, model, inputs, expected = zoo_model
    compiled = OnDevice(model)
    with torch.no_grad():
        assert_matches_eager(compiled(*inputs), expected)


def test_cli_compile_and_run_matches_eager(zoo_model, saved_program, tmp_path):
    name, model, inputs, expected = zoo_model
    pt2 = saved_program(model, inputs, name)
    neff = tmp_path / f"{name}.neff"
    runner = CliRunner()
    result = runner.invoke(main, ["compile", str(pt2), "-o", str(neff)])
    assert result.exit_code == 0, result.output
    input_args = []
    for i, x in enumerate(inputs):
        np.save(tmp_path / f"x{i}.npy", x.numpy())  # int64 ids and bool masks too
        input_args += ["--input", str(tmp_path / f"x{i}.npy")]
    out = tmp_path / "out.npz"
    result = runner.invoke(main, ["run", str(neff), *input_args, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "estimated device time" in result.output
    with np.load(out, allow_pickle=False) as outputs:
        assert_matches_eager([torch.from_numpy(outputs[f"output{i}"]) for i in range(len(outputs))], expected)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_a_zoo_model_compiled_for_each_target_matches_eager_there(target):
    """The import is the same for every target: the graph the session imported once (conftest.zoo_graph)."""
    model, inputs = zoo.build("transformer_block")
    with torch.no_grad():
        expected = model(*inputs)
    compiled = compile_graph(zoo_graph("transformer_block"), CompileOptions(target=target))
    assert compiled.neff.target == target
    outputs = run_neff(compiled.neff, [x.numpy() for x in inputs], target=target).outputs
    assert_matches_eager([torch.from_numpy(out) for out in outputs], expected)
