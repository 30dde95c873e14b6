"""torch.compile's new NEFFs go into the compile cache after their first load, which settles the estimate the stored
header holds (codegen.generate leaves it pending): a cold compile with the cache on simulates the program once, in
the load, not a second time in the store."""
from __future__ import annotations

import itertools

import torch

from neuronc import ir
from neuronc.compiler import compile_fx
from neuronc.neff import encode
from neuronc.pytorch import backend
from runtime import NeuronCore
from runtime.core import access_check_id
from tests import zoo
from tests.test_cache import cache_dir  # noqa: F401 - the fixture
from tests.test_estimate_on_read import simulations  # noqa: F401 - the fixture
from tests.test_repeated_layers import mlp_stack



def test_torch_compile_stores_its_neff_after_the_first_load_without_simulating_it_again(cache_dir, simulations):  # noqa: F811
    model, inputs = zoo.build("mlp")
    with torch.no_grad():
        torch.compile(model, backend="neuron")(*inputs)
    compiled = backend.compiled_graphs[-1].compiled
    assert not compiled.cache_hit and compiled.pending_store is None
    assert simulations == []  # the load's schedule gave the estimate the store wrote
    cache, key = compiled.cache_entry
    assert cache.get(key).estimated_ns == compiled.neff.estimated_ns > 0
    assert cache.checked_by(key) == access_check_id()  # the load's check, in the same write


def test_a_store_that_waits_for_the_load_writes_the_bytes_a_store_at_compile_writes(cache_dir, monkeypatch):  # noqa: F811
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors: the same in both
    compiled = compile_fx(mlp_stack(torch.float32, blocks=2), store_after_load=True)
    cache, key = compiled.pending_store
    assert compiled.cache_entry is None and cache.get(key) is None  # nothing stored by the compile
    NeuronCore(compiled.neff.target).load(compiled.neff)
    compiled.loaded("a check")
    assert compiled.pending_store is None and compiled.cache_entry[1] == key
    assert cache.checked_by(key) == "a check"
    after_load = encode(cache.get(key))
    cache.remove(key)
    monkeypatch.setattr(ir, "_ids", itertools.count())
    at_compile = compile_fx(mlp_stack(torch.float32, blocks=2))  # the default: stored while compiling
    assert not at_compile.cache_hit and at_compile.cache_entry[1] == key
    assert encode(cache.get(key)) == after_load
