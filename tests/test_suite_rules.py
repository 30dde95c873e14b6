"""The suite's own safeguards can fail (issue 23; docs/testing.md lists what covers each of its items): a golden test
whose graph ran eagerly fails, a tool missing in CI fails rather than skips, and no property test carries a time
limit."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import OnDevice, require_tool


def test_on_device_fails_a_call_whose_compiled_graph_ran_eagerly(monkeypatch):
    """What a graph break or Dynamo's recompile limit does (the function runs eagerly, neuronc's program does not):
    here the backend compiles the graph, then hands Dynamo the eager graph instead of the NEFF."""
    from neuronc.pytorch import partition

    kept = []  # compiled_graphs holds its functions weakly: keep this one, as Dynamo would keep the NEFF's

    def compile_then_run_eagerly(graph_module, options, compile_one, _):
        kept.append(compile_one(graph_module))
        return graph_module

    monkeypatch.setattr(partition, "compile_or_partition", compile_then_run_eagerly)
    compiled = OnDevice(lambda x: x * 2.0 + 1.0)
    with pytest.raises(AssertionError, match="ran eagerly"):
        compiled(torch.ones(4))
    assert len(compiled.graphs) == 1  # it was compiled: only running it on the device was missing


def test_on_device_passes_a_call_that_ran_on_the_device():
    x = torch.arange(4.0)
    assert torch.equal(OnDevice(lambda x: x * 2.0 + 1.0)(x), x * 2.0 + 1.0)


def _outcome(tool: str):
    """What require_tool raised for `tool` (pytest's skip and fail are exceptions; a skip caught here cannot skip
    this test, which must fail if require_tool skips where it should fail)."""
    with pytest.raises(BaseException) as raised:
        require_tool(tool, "nowhere")
    return raised


def test_a_tool_missing_in_ci_fails_the_test(monkeypatch):
    monkeypatch.setenv("CI", "true")
    raised = _outcome("neuronc-no-such-tool")
    assert raised.type is pytest.fail.Exception and "in CI every test runs" in str(raised.value), raised


def test_a_tool_missing_outside_ci_skips_the_test(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    raised = _outcome("neuronc-no-such-tool")
    assert raised.type is pytest.skip.Exception and "not installed" in str(raised.value), raised


def test_a_tool_that_is_installed_lets_the_test_run_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require_tool("python3", "the interpreter")  # returns: nothing to skip or fail


def test_property_tests_have_no_time_limit_unless_one_is_given():
    """Hypothesis's default deadline (200 ms per example) is a timing assertion on a shared machine: conftest loads
    a profile without it, so a new @given test that sets no deadline has none either."""
    from hypothesis import settings

    assert settings.default.deadline is None
    assert settings(max_examples=5).deadline is None  # a test's own settings inherit it
