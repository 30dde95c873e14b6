"""torch.compile(backend="neuron") with dynamic shapes: a graph traced with symbolic sizes (dynamic=True,
mark_dynamic, Dynamo's automatic dynamic shapes) runs compiled at each call's concrete sizes, one program per
signature, equal to eager; past a limit per graph it runs eagerly with one warning."""
from __future__ import annotations

import warnings

import pytest
import torch

from neuronc.errors import NeuronConfigError
from neuronc.pytorch import backend, dynamic_shapes
from tests import zoo
from tests.conftest import OnDevice, assert_matches_eager


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def newest_graph() -> dynamic_shapes.ShapeSpecialisedGraph:
    return dynamic_shapes.graphs[-1]()


def rows(batch: int, width: int = 32):
    """A new tensor (not a slice of one: Dynamo guards a view on its base's size too)."""
    return torch.randn(batch, width)


def matches_eager(compiled, model, *inputs) -> None:
    assert_matches_eager(compiled(*inputs), model(*inputs))


def small_block():
    torch.manual_seed(0)
    return zoo.TransformerBlock(width=32, heads=2).eval()


def test_dynamic_true_compiles_an_mlp_once_per_batch_size_and_matches_eager(fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    compiled = OnDevice(model, dynamic=True)
    before, graphs = backend.compile_count(), len(dynamic_shapes.graphs)
    with torch.no_grad():
        for batch in (8, 3, 5, 3, 8):
            matches_eager(compiled, model, rows(batch))
    assert len(dynamic_shapes.graphs) == graphs + 1  # one Dynamo graph with a symbolic batch size...
    assert backend.compile_count() - before == 3  # ...compiled once for each of the three sizes
    sizes = [value for key in newest_graph().programs for kind, *value in key if kind is int]  # Dynamo's s0
    assert sorted(sizes) == [[3], [5], [8]]
    assert len(backend.compiled_graphs[-1].resident) == 6  # the parameters are read in place, as when static


def test_dynamic_true_runs_a_transformer_block_at_three_batch_sizes_and_three_sequence_lengths(fresh_dynamo):
    model = small_block()
    compiled = OnDevice(model, dynamic=True)
    before = backend.compile_count()
    shapes = [(2, 16), (3, 16), (5, 16), (2, 8), (2, 24)]  # batch 2, 3, 5 at 16 tokens; 8, 16, 24 tokens at batch 2
    with torch.no_grad():
        for batch, seq in shapes:
            x = torch.randn(batch, seq, 32)
            assert_matches_eager(compiled(x), model(x))
    assert backend.compile_count() - before == len(shapes)
    assert len(newest_graph().programs) == len(shapes)


def test_a_size_marked_dynamic_is_specialised_per_call(fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    compiled = OnDevice(model)
    x = x.clone()
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        assert_matches_eager(compiled(x), model(x))
        graph = newest_graph()
        smaller = rows(5)
        assert_matches_eager(compiled(smaller), model(smaller))
    assert newest_graph() is graph and len(graph.programs) == 2


def test_automatic_dynamic_shapes_serve_every_later_shape_from_one_graph(fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    compiled = OnDevice(model)
    graphs = len(dynamic_shapes.graphs)
    with torch.no_grad():
        for batch in (8, 4, 6, 2, 7):  # Dynamo makes the batch symbolic when it meets a second size
            matches_eager(compiled, model, rows(batch))
    assert len(dynamic_shapes.graphs) == graphs + 1
    assert len(newest_graph().programs) == 4  # 4, 6, 2, 7; 8 was the first, static, graph


def test_sizes_passed_as_python_ints_and_read_from_shapes_are_used_in_ops(fresh_dynamo):
    def fn(x, n):
        flat = torch.relu(x).view(x.shape[0], -1)  # a view to a symbolic size
        return flat[:, :n] * torch.arange(n, dtype=x.dtype) + x.new_ones(x.shape[0], 1) * x.shape[1]

    compiled = OnDevice(fn, dynamic=True)
    for batch, width, n in [(2, 3, 4), (5, 3, 7), (4, 2, 3)]:
        x = torch.randn(batch, width, 4)
        assert_matches_eager(compiled(x, n), fn(x, n))
    assert len(newest_graph().programs) == 3


def test_training_with_dynamic_true_matches_eager_gradients(fresh_dynamo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    compiled = OnDevice(model, dynamic=True)
    before = backend.compile_count()
    for batch in (6, 3, 9):
        x, target = torch.randn(batch, 16), torch.randn(batch, 4)
        model.zero_grad(), reference.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        expected = torch.nn.functional.mse_loss(reference(x), target)
        loss.backward(), expected.backward()
        assert_matches_eager(loss, expected)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert_matches_eager(ours.grad, theirs.grad)
    assert backend.compile_count() - before == 6  # a forward and a backward program per batch size


def test_past_the_limit_new_shapes_run_eagerly_with_one_warning(fresh_dynamo, monkeypatch):
    monkeypatch.setenv(dynamic_shapes.MAX_SHAPES_ENV, "2")
    model, (x,) = zoo.build("mlp")
    compiled = torch.compile(model, backend="neuron", dynamic=True)
    with torch.no_grad():
        for batch in (8, 4):
            matches_eager(compiled, model, rows(batch))
        before = backend.compile_count()
        with pytest.warns(UserWarning, match=f"more than 2 input shapes.*{dynamic_shapes.MAX_SHAPES_ENV}"):
            matches_eager(compiled, model, rows(6))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per graph
            matches_eager(compiled, model, rows(5))
            matches_eager(compiled, model, rows(4))  # a shape within the limit stays compiled
    graph = newest_graph()
    assert backend.compile_count() == before and len(graph.programs) == 2 and graph.eager_calls == 2


def test_the_limit_can_be_given_as_a_compile_option(fresh_dynamo):
    model, (x,) = zoo.build("mlp")
    compiled = torch.compile(model, backend="neuron", dynamic=True, options={"max_shapes": 1})
    with torch.no_grad(), pytest.warns(UserWarning, match="more than 1 input shapes"):
        for batch in (8, 4):
            matches_eager(compiled, model, rows(batch))
    assert len(newest_graph().programs) == 1


@pytest.mark.parametrize("limit", ["0", "many"])
def test_a_limit_that_is_not_a_positive_integer_is_refused(limit, fresh_dynamo, monkeypatch):
    monkeypatch.setenv(dynamic_shapes.MAX_SHAPES_ENV, limit)
    model, (x,) = zoo.build("mlp")
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="neuron", dynamic=True)(x)
    raised = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(raised, NeuronConfigError) and dynamic_shapes.MAX_SHAPES_ENV in str(raised)


def test_dynamic_shapes_run_on_neuron_tensors(fresh_dynamo):
    model, _ = zoo.build("mlp")
    on_device, _ = zoo.build("mlp")
    compiled = OnDevice(on_device.to("neuron"), dynamic=True)
    with torch.no_grad():
        for batch in (3, 6):
            x = rows(batch)
            out = compiled(x.to("neuron"))
            assert out.device.type == "neuron"
            assert_matches_eager(out.cpu(), model(x))
    assert len(newest_graph().programs) == 2
