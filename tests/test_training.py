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
