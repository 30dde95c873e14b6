"""torch.compile with dynamic shapes (`dynamic=True`, `mark_dynamic`, automatic dynamic shapes): the graph is
compiled once per concrete input signature when it runs (neuronc/pytorch/dynamic_shapes.py), each against eager."""
from __future__ import annotations

import pytest
import torch

from neuronc.errors import NeuronConfigError
from neuronc.pytorch import backend, dynamic_shapes
from tests import zoo
from tests.conftest import OnDevice, assert_matches_eager


class FoldsItsSizes(torch.nn.Module):
    """Uses its input's sizes as values: a reshape to (b * t, c) and a scale by t."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        b, t, c = x.shape
        y = self.proj(x).reshape(b * t, c).softmax(-1)
        return y.view(b, t, c).sum(1) * t


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_a_dynamic_graph_runs_each_shape_on_the_device_as_eager_does(how, fresh_dynamo):
    model = FoldsItsSizes().eval()
    compiled = OnDevice(model, **({"dynamic": True} if how == "dynamic=True" else {}))
    before = backend.compile_count()
    with torch.no_grad():
        for b, t in [(2, 3), (2, 5), (4, 5), (2, 3)]:
            x = torch.randn(b, t, 8)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            assert_matches_eager(compiled(x), model(x))
    assert backend.compile_count() - before == 3  # one program per signature; (2, 3) again reuses its own


def test_gradients_of_a_dynamic_graph_match_eager_at_every_shape(fresh_dynamo):
    model = FoldsItsSizes()
    compiled = OnDevice(model, dynamic=True)
    for b, t in [(2, 3), (3, 4)]:
        x = torch.randn(b, t, 8, requires_grad=True)
        got = torch.autograd.grad(compiled(x).square().sum(), [x, *model.parameters()])
        want = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
        assert_matches_eager(got, want)


class Normed(torch.nn.Module):
    """A LayerNorm (its float eps) and a Python float argument: under dynamic=True Dynamo passes both floats as
    0-d tensors read back with .item()."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)

    def forward(self, x, scale: float):
        return self.norm(self.proj(x)) * scale


def test_floats_dynamo_passes_as_tensors_are_constants_of_each_program(fresh_dynamo):
    model = Normed().eval()
    compiled = OnDevice(model, dynamic=True)
    with torch.no_grad():
        for rows, scale in [(3, 0.5), (7, 0.5), (7, 2.0)]:
            x = torch.randn(rows, 8)
            assert_matches_eager(compiled(x, scale), model(x, scale))
        model.norm.eps = 10.0  # a new value is a new program, not the first one's constant
        x = torch.randn(7, 8)
        assert_matches_eager(compiled(x, 2.0), model(x, 2.0))


def test_shapes_past_dynamos_recompile_limit_still_run_on_the_device(fresh_dynamo):
    # automatic dynamic shapes (PyTorch's default): from the second shape on Dynamo hands over one dynamic
    # graph, so twelve batch sizes neither hit Dynamo's recompile limit (8) nor fall back to eager
    model, (x,) = zoo.build("mlp")
    compiled = OnDevice(model)
    with torch.no_grad():
        for batch in range(1, 13):
            assert_matches_eager(compiled(x[:batch]), model(x[:batch]))


def test_past_the_shape_limit_new_shapes_run_eagerly_with_one_warning(fresh_dynamo, monkeypatch):
    monkeypatch.setenv(dynamic_shapes.MAX_SHAPES_VARIABLE, "2")
    model = FoldsItsSizes().eval()
    compiled = torch.compile(model, backend="neuron", dynamic=True)
    before = backend.compile_count()
    with torch.no_grad(), pytest.warns(UserWarning, match="met 2 input shapes") as warned:
        for b in (2, 3, 4, 5):
            x = torch.randn(b, 3, 8)
            assert_matches_eager(compiled(x), model(x))
    assert backend.compile_count() - before == 2
    assert sum("input shapes" in str(w.message) for w in warned) == 1
    assert dynamic_shapes.MAX_SHAPES_VARIABLE in str(warned[0].message) and "bucket" in str(warned[0].message)


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_bad_shape_limit_is_refused_naming_the_variable(value, fresh_dynamo, monkeypatch):
    monkeypatch.setenv(dynamic_shapes.MAX_SHAPES_VARIABLE, value)
    with pytest.raises(Exception) as caught:
        torch.compile(FoldsItsSizes(), backend="neuron", dynamic=True)(torch.randn(2, 3, 8))
    raised = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(raised, NeuronConfigError) and dynamic_shapes.MAX_SHAPES_VARIABLE in str(raised)
