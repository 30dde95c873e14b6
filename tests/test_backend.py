"""torch.compile integration: the "neuron" backend is found through its entry point (no neuronc
import), takes options, and really runs the graph on the emulated device."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from neuronc.errors import NeuronConfigError
from neuronc.pytorch import backend
from tests import zoo
from tests.conftest import assert_matches_eager


def _run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_backend_and_default_backend_work_without_importing_neuronc():
    out = _run_python("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
        x = torch.randn(3, 8)
        assert "neuronc" not in sys.modules
        with torch.no_grad():
            y = torch.compile(model, backend="neuron")(x)
            torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-5)
            torch.compiler.set_default_backend("neuron")
            class Head(torch.nn.Module):  # Module.compile() of a bare nn.Sequential traces nothing
                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(8, 4)
                def forward(self, x):
                    return torch.softmax(self.fc(x), -1)
            other = Head().eval()
            expected = other(x)
            other.compile()
            torch.testing.assert_close(other(x), expected, rtol=1e-4, atol=1e-5)
        from neuronc.pytorch.backend import compiled_graphs
        print("graphs", len(compiled_graphs))
    """)
    assert "graphs 2" in out


def test_the_compiled_graph_runs_on_the_emulated_device():
    model, inputs = zoo.build("mlp")
    before = len(backend.compiled_graphs)
    compiled = torch.compile(model, backend="neuron", options={"target": "trn1", "opt_level": 1})
    with torch.no_grad():
        out = compiled(*inputs)
        assert_matches_eager(out, model(*inputs))
    function = backend.compiled_graphs[-1]
    assert len(backend.compiled_graphs) == before + 1
    assert function.compiled.neff.target == "trn1"
    assert function.last_run.timeline.estimated_ns > 0  # the device, not eager, produced `out`


def test_unknown_compile_options_are_refused_by_name():
    model, inputs = zoo.build("mlp")
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="neuron", options={"tagret": "trn2"})(*inputs)
    raised = getattr(caught.value, "inner_exception", caught.value)  # Dynamo wraps backend errors
    assert isinstance(raised, NeuronConfigError)
    assert "tagret" in str(caught.value)


def test_neuron_cc_flags_set_target_and_level(monkeypatch):
    from neuronc.compiler import CompileOptions

    monkeypatch.setenv("NEURON_CC_FLAGS", "--target trn3 -O1")
    assert CompileOptions.from_dict({}) == CompileOptions(target="trn3", opt_level=1)
    assert CompileOptions.from_dict({"target": "trn1"}).target == "trn1"  # options win over the flags
