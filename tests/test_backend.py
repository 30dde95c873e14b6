"""torch.compile integration: the "neuron" backend is found through its entry point (no neuronc
import), takes options, and really runs the graph on the emulated device."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from neuronc.errors import NeuronCompileError, NeuronConfigError
from neuronc.pytorch import backend
from tests import zoo
from tests.conftest import OnDevice, assert_matches_eager, line_of


def _run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_backend_and_default_backend_work_without_importing_neuronc():
    out = _run_python("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
        x = torch.randn(3, 8)
        assert "neuronc.compiler" not in sys.modules  # the device autoload imports only what registers it
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


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), torch.randn(4, 16)


def test_parameters_are_read_in_place_not_copied_at_each_call(fresh_dynamo):
    model, x = _mlp()
    compiled = torch.compile(model, backend="neuron")
    with torch.no_grad():
        compiled(x)
    program = backend.compiled_graphs[-1].program
    inputs = program._plan.inputs  # the arrays the program reads its inputs from
    for p in model.parameters():
        assert sum(np.shares_memory(a, p.detach().numpy()) for a in inputs) == 1
    assert not any(np.shares_memory(a, x.numpy()) for a in inputs)  # the data input is copied in


@pytest.mark.parametrize("change", ["no_grad add_", "through .data", "optimizer step", "new Parameter",
                                    "new .data tensor"])
def test_a_parameter_changed_between_calls_gives_eagers_result_on_the_next_call(change, fresh_dynamo):
    model, x = _mlp()
    compiled = torch.compile(model, backend="neuron")
    compiled(x).sum().backward()
    if change == "no_grad add_":
        with torch.no_grad():
            model[0].weight.add_(1)
    elif change == "through .data":
        model[2].bias.data.mul_(-3)  # .data: no version bump
    elif change == "optimizer step":
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    elif change == "new Parameter":
        model[2].weight = torch.nn.Parameter(torch.randn(8, 32))
    else:
        model[0].weight.data = torch.randn(32, 16)

    assert_matches_eager(compiled(x), model(x))


def test_parameters_in_new_memory_at_every_call_are_copied_in_after_a_few_rebindings(fresh_dynamo):
    model, x = _mlp()
    compiled = torch.compile(model, backend="neuron")
    with torch.no_grad():
        for _ in range(backend.REBINDS_BEFORE_COPYING + 2):
            model[0].weight.data = torch.randn(32, 16)
            assert_matches_eager(compiled(x), model(x))
    program = backend.compiled_graphs[-1].program
    assert not any(np.shares_memory(a, model[0].weight.detach().numpy()) for a in program._plan.inputs)


def test_a_scalar_result_keeps_its_zero_dimensional_shape():
    x = torch.randn(3, 4)
    out = OnDevice(lambda x: (x * x).sum())(x)
    assert out.shape == () and torch.allclose(out, (x * x).sum())


def test_unknown_compile_options_are_refused_by_name():
    model, inputs = zoo.build("mlp")
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="neuron", options={"tagret": "trn2"})(*inputs)
    raised = getattr(caught.value, "inner_exception", caught.value)  # Dynamo wraps backend errors
    assert isinstance(raised, NeuronConfigError)
    assert "tagret" in str(caught.value)


def test_torch_compile_modes_choose_the_optimisation_level(fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    with torch.no_grad():
        assert_matches_eager(torch.compile(model, backend="neuron", mode="max-autotune")(x), model(x))
    assert backend.compiled_graphs[-1].options.opt_level == 3
    assert backend._options_for_mode("reduce-overhead", {"target": "trn1"}) == {"target": "trn1"}
    assert backend._options_for_mode("max-autotune", {"opt_level": 1}) == {"opt_level": 1}  # options win


def test_an_unknown_compile_mode_is_refused_with_the_known_ones(fresh_dynamo):
    model, inputs = zoo.build("mlp")
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="neuron", mode="fastest")(*inputs)
    assert isinstance(getattr(caught.value, "inner_exception", caught.value), NeuronConfigError)
    assert "fastest" in str(caught.value) and "max-autotune" in str(caught.value)


def test_neuron_cc_flags_set_target_and_level(monkeypatch):
    from neuronc.compiler import CompileOptions

    monkeypatch.setenv("NEURON_CC_FLAGS", "--target trn3 -O1")
    assert CompileOptions.from_dict({}) == CompileOptions(target="trn3", opt_level=1)
    assert CompileOptions.from_dict({"target": "trn1"}).target == "trn1"  # options win over the flags


def test_a_new_input_shape_recompiles_and_is_counted(caplog, fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    compiled = OnDevice(model)
    before = backend.compile_count()
    with torch.no_grad(), caplog.at_level("INFO", logger="neuronc"):
        for batch in (8, 4, 4):
            assert_matches_eager(compiled(x[:batch]), model(x[:batch]))
    assert backend.compile_count() == before + 2  # 8, then 4; the second 4 reuses its program
    assert "compilation #" in caplog.text


def test_a_value_read_from_tensor_data_runs_on_the_device_in_stages(fresh_dynamo, monkeypatch):
    # nn.TransformerEncoder checks whether a mask is causal with bool((mask == causal).all()); under fullgraph=True
    # Dynamo captures that as an unbacked symbol, which is no dynamic shape the user asked for: the value is read
    # back from the device and the rest specialised on it (neuronc/pytorch/data_dependent.py)
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        assert_matches_eager(OnDevice(lambda x: encoder(x, mask=causal))(x), encoder(x, mask=causal))


def test_a_data_dependent_size_with_no_bounded_form_is_refused_as_such_not_as_a_dynamic_shape(fresh_dynamo,
                                                                                                monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    with pytest.raises(Exception) as caught:
        torch.compile(lambda x: torch.unique(x) * 2, backend="neuron", fullgraph=True)(torch.tensor([1.0, 2.0, 2.0]))  # here
    raised = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(raised, NeuronCompileError), raised
    assert "turns tensor data into a Python value" in str(raised) and "dynamic=True" not in str(raised)
    assert f"test_backend.py:{line_of(__file__, 'torch.tensor([1.0, 2.0, 2.0]))  # here')}" in str(raised)


def test_debug_dir_keeps_every_compilation(tmp_path, monkeypatch, fresh_dynamo):
    monkeypatch.setenv("TORCH_NEURONX_DEBUG_DIR", str(tmp_path))
    model, inputs = zoo.build("mlp")
    with torch.no_grad():
        torch.compile(model, backend="neuron")(*inputs)
    (folder,) = tmp_path.iterdir()
    names = {p.name for p in folder.iterdir()}
    assert names == {"INDEX", "fx_graph.txt", "stablehlo.mlir", "optimized_ir.txt", "model.neff"}
    index = (folder / "INDEX").read_text().splitlines()
    assert len(index) == 4 and all(": " in line for line in index)
    assert "stablehlo.dot_general" in (folder / "stablehlo.mlir").read_text()
    assert "def forward" in (folder / "fx_graph.txt").read_text()  # the copy's code, made to be kept


def test_the_graph_compiled_gets_no_python_code_made(monkeypatch, fresh_dynamo):
    """The copy of the FX graph the backend compiles is a lazy graph module, and no step of the compile reads its
    code (TORCH_NEURONX_DEBUG_DIR unset): no Python code is made for it (7 ms per layer of HF GPT-2)."""
    from torch import fx

    from neuronc.pytorch import partition

    monkeypatch.delenv("TORCH_NEURONX_DEBUG_DIR", raising=False)
    inside, made = [], []
    python_code, compile_or_partition = fx.Graph.python_code, partition.compile_or_partition

    def counted(graph, *args, **kwargs):
        if inside:
            made.append(graph)
        return python_code(graph, *args, **kwargs)

    def marked(*args, **kwargs):
        inside.append(True)
        try:
            return compile_or_partition(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(fx.Graph, "python_code", counted)
    monkeypatch.setattr(partition, "compile_or_partition", marked)
    model, inputs = zoo.build("mlp")
    with torch.no_grad():
        out = torch.compile(model, backend="neuron")(*inputs)
        assert_matches_eager(out, model(*inputs))
    assert len(backend.compiled_graphs) >= 1 and made == []


def test_a_compiled_function_that_saves_and_restores_the_rng_state_runs():
    """torch.testing's freeze_rng_state (every random OpInfo sample) reads and sets the neuron device's generator
    state under no_dispatch(); traced by Dynamo, that was an AssertionError inside the compiled function."""
    from torch.testing._utils import freeze_rng_state

    def reseeded(x):
        with freeze_rng_state():
            torch.manual_seed(0)
            return x * 2

    x = torch.arange(3.0)
    assert torch.equal(torch.compile(reseeded, backend="neuron")(x), reseeded(x))  # a graph break here is fine
