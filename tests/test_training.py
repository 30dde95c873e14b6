"""Training through torch.compile: AOTAutograd's backward graph is compiled and runs on the
emulated device too, and the gradients match eager."""
from __future__ import annotations

import copy

import pytest
import torch

from neuronc.pytorch import backend
from tests import zoo
from tests.conftest import TOLERANCES


@pytest.mark.parametrize("name", ["mlp", "transformer_block"])
def test_gradients_of_a_compiled_model_match_eager(name):
    model, inputs = zoo.build(name)
    model.train()
    reference = copy.deepcopy(model)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(*inputs).pow(2).mean().backward()
    reference(*inputs).pow(2).mean().backward()
    forward, backward = backend.compiled_graphs[before:]  # both graphs went to the device
    assert forward.last_run is not None and backward.last_run is not None
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=pname)


class WithGraphBreaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # as a print or an unsupported call would
        if h.sum() > 0:  # data-dependent Python control flow
            h = h * 2
        return self.b(h)


def test_a_model_with_graph_breaks_still_trains_on_the_device():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = WithGraphBreaks(), torch.randn(3, 8)
    reference = copy.deepcopy(model)
    before = backend.compile_count()
    torch.compile(model, backend="neuron")(x).sum().backward()
    reference(x).sum().backward()
    assert backend.compile_count() - before >= 4  # forward and backward of the graphs on each side of the break
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32])


def test_fullgraph_true_reports_the_graph_break_as_usual():
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(WithGraphBreaks(), backend="neuron", fullgraph=True)(torch.randn(3, 8))
