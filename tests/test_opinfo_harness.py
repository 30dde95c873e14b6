"""benchmarks/opinfo.py's own behaviour: a sample that runs away is counted as failing and the run goes on."""
import pytest

from benchmarks import opinfo


def _spin(*args, **kwargs):
    while True:
        sum(range(1000))


def test_a_sample_past_its_cpu_time_is_stopped():
    with pytest.raises(opinfo.SampleTimeout), opinfo.cpu_time_limit(0.05):
        _spin()


def test_a_stopped_sample_is_recorded_as_failing_and_the_next_is_measured(monkeypatch):
    from torch.testing._internal.common_methods_invocations import op_db

    (op,) = [o for o in op_db if o.name == "add" and not o.variant_test_name]
    outcomes = iter([_spin, lambda *args, **kwargs: ("pass", [], "")])
    monkeypatch.setattr(opinfo, "check_sample", lambda *args, **kwargs: next(outcomes)(*args, **kwargs))
    records = opinfo.measure([op], ["neuron"], ["fp32"], 2, backward=False, verbose=False, timeout=0.05)
    assert [r["outcome"] for r in records] == ["SampleTimeout", "pass"]
