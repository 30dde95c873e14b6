"""tile_matmuls searches a tiling once per distinct `choice_key` (passes/tiling.py): a model's repeated layers price
their matmuls once, and every matmul gets the tiling its own search would give. Likewise a norm prologue's tiling
and size, once per node but for its locations (`_once_per_prologue`)."""
from __future__ import annotations

import itertools

import pytest
import torch

from neuronc import ir
from neuronc.compiler import CompileOptions, compile_exported, compile_fx
from neuronc.neff import encode
from neuronc.passes import tiling
from neuronc.targets import get_target
from tests import zoo
from tests.test_repeated_layers import gpt2, gpt2_neff


def _compiled_counting(monkeypatch, dtype):
    """(compiled, [(node, its tiling) for every matmul tiled by a search], number of searches)."""
    searches, tiled = [], []
    choose, planned = tiling.choose, tiling.planned

    def counting_choose(node, target, wide=False, timed=None):
        searches.append(node)
        return choose(node, target, wide, timed)

    def noting_planned(node, t):
        tiled.append((node, t))
        return planned(node, t)

    monkeypatch.setattr(tiling, "choose", counting_choose)
    monkeypatch.setattr(tiling, "planned", noting_planned)
    compiled = compile_fx(gpt2(dtype), CompileOptions(opt_level=2, name="gpt2_3_layers"))
    return compiled, tiled, len(searches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_layers_search_each_distinct_matmul_once(monkeypatch, dtype):
    compiled, tiled, searches = _compiled_counting(monkeypatch, dtype)
    keys = {tiling.choice_key(node) for node, _ in tiled}
    assert len(tiled) >= 6  # three layers' projections at least
    assert searches == len(keys) < len(tiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_matmul_gets_the_tiling_its_own_search_gives(monkeypatch, dtype):
    _, tiled, _ = _compiled_counting(monkeypatch, dtype)
    target = get_target(CompileOptions().target)
    for node, chosen in tiled:
        assert chosen == tiling.choose(node, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_neff_is_the_one_searched_matmul_by_matmul(monkeypatch, dtype):
    once = gpt2_neff(monkeypatch, dtype)
    monkeypatch.setattr(tiling, "_choose_once_per_key", lambda: lambda node, t: tiling.choose(node, t))
    assert gpt2_neff(monkeypatch, dtype) == once



def prologued_gpt2():
    """A 3-layer bf16 GPT-2 wide enough that each layer norm folds into its matmul (passes/norm_prologue.py),
    exported: each node located at its own layer's source."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=256, width=128, layers=3, heads=4, context=128).eval().to(torch.bfloat16)
    return torch.export.export(model, (torch.randint(0, 256, (1, 128)),))


def _compiled(monkeypatch) -> bytes:
    """prologued_gpt2 compiled at -O2 to NEFF bytes, node ids counted from 0 (they name the NEFF's tensors)."""
    monkeypatch.setattr(ir, "_ids", itertools.count())
    return encode(compile_exported(prologued_gpt2(), CompileOptions(opt_level=2)).neff)


def _prologues_tiled(monkeypatch):
    """([every prologued node planned], [(node, target) of every prologue tiling asked for], number of searches),
    the memo emptied first."""
    searches, planned, asked = [], [], []
    search, prologue_planned, once = tiling._prologue_search, tiling.prologue_planned, tiling._once_per_prologue

    def counting_search(node, target):
        searches.append(node)
        return search(node, target)

    def noting_planned(node, target):
        planned.append(node)
        return prologue_planned(node, target)

    def noting_asked(make, node, target):
        if make is counting_search:
            asked.append((node, target))
        return once(make, node, target)

    monkeypatch.setattr(tiling, "_PROLOGUES", {})
    monkeypatch.setattr(tiling, "_prologue_search", counting_search)
    monkeypatch.setattr(tiling, "prologue_planned", noting_planned)
    monkeypatch.setattr(tiling, "_once_per_prologue", noting_asked)
    _compiled(monkeypatch)
    return planned, asked, len(searches)


def test_repeated_layers_tile_each_distinct_norm_prologue_once(monkeypatch):
    planned, asked, searches = _prologues_tiled(monkeypatch)
    key = tiling._prologue_key
    keys = {key(tiling._prologue_search, node, target) for node, target in asked}
    assert len(planned) >= 6  # three layers' two norms at least
    assert len({key(tiling._prologue_search, node, target) for node, target in asked if node in planned}) < len(planned)
    assert searches == len(keys) < len(asked)


def test_every_norm_prologue_gets_the_tiling_and_size_its_own_search_gives(monkeypatch):
    planned, _, _ = _prologues_tiled(monkeypatch)
    target = get_target(CompileOptions().target)
    assert len({node.attrs["prologue"].loc.key() for node in planned}) == len(planned)  # each at its own norm
    for node in planned:
        fresh = tiling._prologue_search(node, target)
        assert fresh is not None
        assert tiling.prologue_tiling(node, target) == fresh
        assert tiling.prologue_sbuf_bytes(node, target) == tiling._prologue_bytes(node, fresh)


def test_the_neff_is_the_one_tiled_prologue_by_prologue(monkeypatch):
    monkeypatch.setattr(tiling, "_PROLOGUES", {})
    once = _compiled(monkeypatch)
    monkeypatch.setattr(tiling, "_once_per_prologue", lambda make, node, target: make(node, target))
    assert _compiled(monkeypatch) == once
