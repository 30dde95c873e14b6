"""A program's estimated time (the cost model's simulation of its schedule) is computed when first read, or taken
from its first load's schedule: no -O0 to -O2 decision reads it, and either way the numbers are those computing it
gives (the NEFF's header, its kernels', a pickled copy's)."""
from __future__ import annotations

import pickle

import pytest

import neuronc.codegen
from neuronc.compiler import CompileOptions, compile_graph
from neuronc.neff import decode, encode
from neuronc.stream_timing import estimate_streams
from neuronc.targets import get_target
from runtime import NeuronCore
from tests.conftest import zoo_graph


@pytest.fixture
def simulations(monkeypatch) -> list:
    """The estimates codegen's NEFFs compute (one entry per simulation run)."""
    runs = []

    def counted(*args, **kwargs):
        runs.append(args)
        return estimate_streams(*args, **kwargs)

    monkeypatch.setattr(neuronc.codegen, "estimate_streams", counted)
    return runs


def _compiled(opt_level: int = 2):
    return compile_graph(zoo_graph("mlp"), CompileOptions(opt_level=opt_level))


def _computed(neff) -> tuple:
    """(makespan, [each kernel's ns]) of the cost model run on the NEFF's streams here."""
    makespan, kernel_ns = estimate_streams(neff.streams, get_target(neff.target))
    return makespan, [kernel_ns.get(index, 0.0) for index in range(len(neff.kernels))]


def _read(neff) -> tuple:
    return neff.estimated_ns, [kernel.estimated_ns for kernel in neff.kernels]


def test_an_O2_compile_leaves_the_estimate_to_its_first_reader(simulations):
    neff = _compiled().neff
    assert simulations == [] and neff.pending_estimate() is not None
    makespan, kernels = _read(neff)
    assert len(simulations) == 1 and neff.pending_estimate() is None
    assert makespan > 0 and (makespan, kernels) == _computed(neff)
    assert _read(neff) == (makespan, kernels) and len(simulations) == 1  # kept, not simulated again
    decoded = decode(encode(neff))
    assert _read(decoded) == (makespan, kernels)


def test_a_load_settles_the_estimate_from_its_schedule_without_simulating_it_again(simulations):
    neff = _compiled().neff
    program = NeuronCore(neff.target).load(neff)
    assert neff.pending_estimate() is None and simulations == []
    assert _read(neff) == _computed(neff)
    assert neff.estimated_ns == program.time().estimated_ns


def test_a_pickled_neff_carries_the_estimates_numbers(simulations):
    neff = _compiled().neff
    copied = pickle.loads(pickle.dumps(neff))
    assert type(copied.estimated_ns) is float and copied.pending_estimate() is None
    assert _read(copied) == _read(neff) == _computed(neff)


def test_O3_computes_the_estimate_while_compiling_as_its_placement_reads_it(simulations):
    compiled = _compiled(opt_level=3)
    assert compiled.neff.pending_estimate() is None and compiled.seconds["codegen/estimate"] > 0
    assert "codegen/estimate" not in _compiled(opt_level=2).seconds  # -O2 computes none while compiling
