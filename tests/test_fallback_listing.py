"""The RMSE fallback of the low-precision tests (conftest.assert_as_accurate_as_eager) is listed wherever it is used:
on the test's report, and at the end of the run, from pytest-xdist's workers too (tests/fallback_listing.py)."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

from tests.conftest import assert_as_accurate_as_eager
from tests.fallback_listing import PROPERTY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NearlyCancels(torch.nn.Module):
    """x * 1.001 - x: in bf16, x * 1.001 rounds back to x (bf16 keeps 8 bits), so eager bf16 gives 0 where the fp32
    reference gives 0.001 x: eager itself is outside bf16's tolerance, and the fallback is what accepts an output."""

    def forward(self, x):
        return x * 1.001 - x


@pytest.fixture
def cancelling():
    x = torch.linspace(50, 100, 64, dtype=torch.bfloat16)
    model = NearlyCancels()
    with torch.no_grad():
        return model, (x,), model(x)


def _fallbacks(request) -> list:
    return [line for key, line in request.node.user_properties if key == PROPERTY]


def test_an_output_as_accurate_as_eager_but_outside_the_tolerance_is_listed(request, cancelling):
    model, inputs, eager = cancelling
    assert_as_accurate_as_eager([eager], model, inputs)
    line, = _fallbacks(request)
    assert line.startswith("NearlyCancels output 0 [64] bfloat16: 64 of 64 elements outside the tolerance"), line
    request.node.user_properties.remove((PROPERTY, line))  # a use made on purpose: kept out of the run's listing


def test_an_output_within_the_tolerance_is_not_listed(request, cancelling):
    model, (x,), _ = cancelling
    reference = (x.float() * 1.001 - x.float()).to(torch.bfloat16)
    assert_as_accurate_as_eager([reference], model, (x,))
    assert _fallbacks(request) == []


def test_an_output_less_accurate_than_eager_fails_and_is_not_listed(request, cancelling):
    model, inputs, eager = cancelling
    with pytest.raises(AssertionError, match="RMSE against the fp32 reference"):
        assert_as_accurate_as_eager([eager - 1.0], model, inputs)
    assert _fallbacks(request) == []


def test_the_uses_are_listed_at_the_end_of_a_run_under_xdist(pytester, monkeypatch):
    """Two workers run a test each that records a use: the controller's summary lists both, once."""
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(test_uses=textwrap.dedent("""
        from tests import fallback_listing

        def test_one():
            fallback_listing.record("ModelA output 0: first")

        def test_two():
            fallback_listing.record("ModelB output 1: second")
    """))
    result = pytester.runpytest_subprocess("-p", "tests.fallback_listing", "-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert "2 workers" in result.stdout.str()
    result.stdout.fnmatch_lines(["*RMSE fallback: 2 output(s) outside their dtype's tolerance*",
                                 "test_uses.py::test_one: ModelA output 0: first",
                                 "test_uses.py::test_two: ModelB output 1: second"])
    assert result.stdout.str().count("RMSE fallback:") == 1
