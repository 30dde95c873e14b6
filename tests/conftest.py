"""Shared fixtures: the zoo, the per-dtype tolerance table, and the comparison with eager PyTorch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from neuronc.tolerances import TOLERANCES  # the one table (bf16/fp16 against an fp32 reference)
from tests import zoo

LOW_PRECISION = (torch.bfloat16, torch.float16)


def assert_matches_eager(actual, expected, tolerance: torch.dtype | None = None):
    """Each output has eager's shape and dtype and is within the tolerance of its dtype, or of
    `tolerance` when it was computed in a narrower type than it is stored in."""
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
        assert got.shape == want.shape, f"shape {tuple(got.shape)} != eager {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"dtype {got.dtype} != eager {want.dtype}"
        torch.testing.assert_close(got.detach(), want.detach(), **TOLERANCES[tolerance or want.dtype])


def eager_reference(model, inputs):
    """The golden of a model run in its own dtype, computed by eager PyTorch on CPU.

    For a bf16/fp16 model this is what Inductor's tests do (`reference_in_float`): the same weights
    and inputs, already rounded to the low-precision type, upcast to fp32 and run in fp32; each
    floating-point output is then rounded once to the type eager gives it in low precision. The
    error measured is the compiled program's alone, not eager bf16's as well."""
    low = {t.dtype for t in [*model.parameters(), *model.buffers(), *inputs] if t.dtype in LOW_PRECISION}
    with torch.no_grad():
        if not low:
            return model(*inputs)
        as_run = model(*inputs)
        reference = copy.deepcopy(model).float()(*[x.float() if x.dtype in low else x for x in inputs])
    pairs = zip(reference, as_run) if isinstance(as_run, (tuple, list)) else [(reference, as_run)]
    rounded = [ref.to(run.dtype) for ref, run in pairs]
    return type(as_run)(rounded) if isinstance(as_run, (tuple, list)) else rounded[0]


def line_of(path, marker: str) -> int:
    """The number of the first line of a source file that contains `marker`."""
    with open(path) as source:
        return next(i for i, line in enumerate(source, 1) if marker in line)


@pytest.fixture(params=sorted(zoo.ZOO))
def zoo_model(request):
    """(name, model, inputs, eager outputs) for each model of the zoo."""
    model, inputs = zoo.build(request.param)
    with torch.no_grad():
        expected = model(*inputs)
    return request.param, model, inputs, expected


@pytest.fixture
def saved_program(tmp_path):
    """Save a model's ExportedProgram to a .pt2 file; returns the path."""

    def save(model, inputs, name="model"):
        path = tmp_path / f"{name}.pt2"
        torch.export.save(torch.export.export(model, inputs), str(path))
        return path

    return save


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    """Tests compile for real unless they opt into a cache of their own (see test_cache.py)."""
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
