"""Ops whose output size depends on tensor data (nonzero, masked_select, x[mask], tensor_split by a tensor) under
torch.compile, strictly on the device (neuronc/pytorch/data_dependent.py, frontend/bounded_outputs.py): the bounded
form on the device, the count read back, the rest specialised per count; goldens from eager on CPU."""
from __future__ import annotations

import pytest
import torch

from neuronc.errors import NeuronCompileError
from neuronc.pytorch import backend
from tests.conftest import OnDevice, assert_matches_eager

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")


def _with_zeros(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    return x * (torch.rand(*shape, generator=generator) > 0.5)


def test_nonzero_static_pads_and_truncates_as_eager(fresh_dynamo):
    x = _with_zeros(3, 5)
    count = int((x != 0).sum())
    compiled = OnDevice(lambda x: (torch.nonzero_static(x, size=15, fill_value=-1),
                                   torch.nonzero_static(x, size=count - 2, fill_value=7)))
    assert_matches_eager(compiled(x), (torch.nonzero_static(x, size=15, fill_value=-1),
                                       torch.nonzero_static(x, size=count - 2, fill_value=7)))


def test_masked_select_and_nonzero_as_outputs_compile_once_whatever_the_count(fresh_dynamo):
    def fn(x):
        return torch.masked_select(x, x > 0), torch.argwhere(x)

    compiled = OnDevice(fn)
    before = backend.compile_count()
    for seed in range(3):  # three different counts: the outputs are cut from the bounded result on the host
        x = _with_zeros(4, 6, seed=seed)
        assert_matches_eager(compiled(x), fn(x))
    assert backend.compile_count() - before == 1


def test_a_boolean_index_in_the_middle_of_a_graph_then_more_device_ops(fresh_dynamo):
    def fn(x, w):
        picked = x[x.sum(1) > 0]  # rows: a data-dependent count
        return (picked @ w).relu().sum(0) + x.mean()

    compiled = OnDevice(fn)
    w = torch.randn(5, 3)
    for seed in (0, 1):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(seed))
        assert_matches_eager(compiled(x, w), fn(x, w))


def test_tensor_split_by_a_tensor_of_indices(fresh_dynamo):
    def fn(x, at):
        return tuple(part * 2 for part in torch.tensor_split(x, at, 0))

    x, at = torch.randn(6, 3), torch.tensor([1, 4])
    assert_matches_eager(OnDevice(fn)(x, at), fn(x, at))


def test_past_the_cap_of_distinct_counts_a_clear_error(fresh_dynamo, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_MAX_SHAPES_PER_GRAPH", "1")

    def fn(x):
        return x[x > 0].exp().sum()

    compiled = OnDevice(fn)
    x = torch.tensor([1.0, -1.0, 2.0, -3.0])
    assert_matches_eager(compiled(x), fn(x))
    with pytest.raises(Exception) as raised:
        compiled(torch.tensor([1.0, 1.0, 2.0, -3.0]))  # another count: a second tail program, past the cap
    error = raised.value
    while error is not None and not isinstance(error, NeuronCompileError):
        error = error.__cause__ or error.__context__
    assert error is not None and "TORCH_NEURONX_MAX_SHAPES_PER_GRAPH" in str(error)


def test_gradient_through_masked_select(fresh_dynamo):
    def fn(x):
        return (torch.masked_select(x, x > 0) ** 2).sum()

    x = _with_zeros(4, 5)
    eager, compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    fn(eager).backward()
    OnDevice(fn)(compiled).backward()
    assert_matches_eager(compiled.grad, eager.grad)


def test_take_with_a_0d_index_is_a_gather_not_a_host_read(fresh_dynamo):
    def fn(x, i):
        return torch.take(x, i) * 2

    x = torch.randn(3, 4)
    assert_matches_eager(OnDevice(fn)(x, torch.tensor(5)), fn(x, torch.tensor(5)))


def test_a_size_read_from_a_tensor_with_item(fresh_dynamo):
    def fn(x, n):
        return x.narrow(0, 0, n.item()) * 2

    compiled, x = OnDevice(fn), torch.randn(6, 3)
    for n in (torch.tensor(2), torch.tensor(5)):
        assert_matches_eager(compiled(x, n), fn(x, n))


def test_a_count_of_zero_then_a_reduction(fresh_dynamo):
    def fn(x):
        return x[x > 100].sum() + x[x > 0].mean()

    x = torch.randn(6, 3)
    assert_matches_eager(OnDevice(fn)(x), fn(x))


def test_on_neuron_tensors_the_results_stay_on_the_device(fresh_dynamo, neuron):
    def fn(x):
        return torch.masked_select(x, x > 0) * 2, x[x > 100].sum()

    x = _with_zeros(4, 5)
    got = OnDevice(fn)(x.to(neuron))
    assert all(g.device == neuron for g in got)
    assert_matches_eager([g.cpu() for g in got], fn(x))


def test_a_graph_of_fixed_shapes_is_judged_without_looking_for_symbols(monkeypatch):
    """has_unknown_sizes looks for unbacked symbols only in values that may hold one: a strided tensor of int sizes,
    strides and offset holds none (free_unbacked_symbols would find none in it, at about 4x the cost)."""
    from torch.fx.experimental import proxy_tensor, symbolic_shapes

    from neuronc.pytorch import data_dependent

    looked = []
    free = symbolic_shapes.free_unbacked_symbols
    monkeypatch.setattr(symbolic_shapes, "free_unbacked_symbols", lambda val: looked.append(val) or free(val))
    x = torch.randn(4, 6)
    fixed = proxy_tensor.make_fx(lambda x: (x.t() @ x)[1:, ::2].relu().sum(0), tracing_mode="fake")(x)
    assert not data_dependent.has_unknown_sizes(fixed) and looked == []
    symbolic = proxy_tensor.make_fx(lambda x: x.sum(0) * x.shape[0], tracing_mode="symbolic")(x)
    assert not data_dependent.has_unknown_sizes(symbolic) and looked  # backed symbols only: looked at, none unbacked
