"""A compiled graph with ops the NeuronCore cannot run still runs (issue 21): its device subgraphs become NEFFs and
the other ops run on the CPU between them, one warning per op; TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1 turns that
into the error listing every such op (neuronc.pytorch.partition)."""
from __future__ import annotations

import warnings

import pytest
import torch

from neuronc.errors import NeuronCompileError
from neuronc.pytorch import backend, partition
from tests.conftest import assert_matches_eager

# neither torch-mlir nor neuronc lowers these (linalg_eig, igammac: ATen iterates to convergence, up to 2000 steps):
# they stand for any op the device cannot run
NO_DEVICE_OPS = ("aten.linalg_eig", "aten.igammac")


def program(a, b):
    x = torch.sin(a) @ b
    return x.relu() + 1, torch.igammac(torch.full_like(x, 2.0), x.abs()) * 2, torch.linalg.eigvals(x).real.exp()


@pytest.fixture
def inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 4, generator=generator)


@pytest.mark.cpu_fallback
def test_unsupported_ops_run_on_the_cpu_between_device_subgraphs(inputs, monkeypatch, fresh_dynamo):
    monkeypatch.delenv(partition.FALLBACK_ENV, raising=False)
    monkeypatch.setattr(partition, "warned", {})
    first, partitioned = len(backend.compiled_graphs), partition.partitioned_graphs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(program, backend="neuron", fullgraph=True)(*inputs)
    assert_matches_eager(got, program(*inputs))
    assert partition.partitioned_graphs == partitioned + 1
    device_parts = backend.compiled_graphs[first:]
    assert device_parts and all(g.last_run is not None for g in device_parts)  # the matmul & co ran as NEFFs
    messages = [str(w.message) for w in caught if "runs on the CPU in this compiled graph" in str(w.message)]
    for op in NO_DEVICE_OPS:
        assert sum(op in m for m in messages) == 1, messages  # one warning per op, naming it


@pytest.mark.cpu_fallback
def test_the_fallback_trains(inputs, monkeypatch, fresh_dynamo):
    monkeypatch.delenv(partition.FALLBACK_ENV, raising=False)
    loss = lambda a, b: sum(o.sum() for o in program(a, b))  # noqa: E731 - the program under test

    def gradients(fn):
        a, b = (t.clone().requires_grad_(True) for t in inputs)
        fn(a, b).backward()
        return a.grad, b.grad

    assert_matches_eager(gradients(torch.compile(loss, backend="neuron")), gradients(loss))


def test_with_fallback_disabled_every_unsupported_op_is_listed(inputs, monkeypatch, fresh_dynamo):
    monkeypatch.setenv(partition.FALLBACK_ENV, "1")
    with pytest.raises(Exception) as caught:
        torch.compile(program, backend="neuron", fullgraph=True)(*inputs)
    raised = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(raised, NeuronCompileError), raised
    assert all(any(p.startswith(op) for p in raised.problems) for op in NO_DEVICE_OPS), raised.problems


def test_a_functional_collective_is_a_device_op_judged_by_the_collective_rules_not_torch_mlir():
    """torch-mlir lowers no collective, so probing one through it sent every collective of a partitioned graph (and
    its wait) to the CPU; the compiler cuts them out before torch-mlir and makes collective instructions of them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import compiled_apart
    from neuronc.frontend.op_probe import node_verdicts

    functional = torch.ops._c10d_functional

    def program(x, reduction):
        return functional.wait_tensor(functional.all_reduce(x * 2, reduction, "a-group")) + 1

    def verdicts_of(reduction):  # as the partition fallback asks
        return node_verdicts(make_fx(lambda x: program(x, reduction), tracing_mode="fake")(torch.ones(4)),
                             own=compiled_apart)

    verdicts = verdicts_of("sum")
    assert verdicts == {"mul": "", "all_reduce": "", "wait_tensor": "", "add": ""}
    refused = verdicts_of("xor")
    assert "'xor' cannot be compiled" in refused["all_reduce"] and refused["wait_tensor"] == refused["all_reduce"]


def test_a_device_piece_waiting_for_a_collective_an_earlier_piece_ran_takes_its_input_as_arrived(inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import CompileOptions, compile_fx
    from neuronc.pytorch.backend import NeffFunction

    piece = make_fx(lambda x: torch.ops._c10d_functional.wait_tensor(x) * 2)(inputs[0])
    compiled = compile_fx(piece)
    assert compiled.collective_groups == []  # nothing left to communicate: the wait was for another piece's
    (got,) = NeffFunction(compiled, CompileOptions())(inputs[0])
    torch.testing.assert_close(got, inputs[0] * 2)
