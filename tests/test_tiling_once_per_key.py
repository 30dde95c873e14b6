"""tile_matmuls searches a tiling once per distinct `choice_key` (passes/tiling.py): a model's repeated layers price
their matmuls once, and every matmul gets the tiling its own search would give."""
from __future__ import annotations


import pytest
import torch

from neuronc.compiler import CompileOptions, compile_fx
from neuronc.passes import tiling
from neuronc.targets import get_target
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
