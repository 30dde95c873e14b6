"""A pytest plugin listing every use of the RMSE fallback of the low-precision tests, so that it cannot spread unnoticed.

`conftest.assert_as_accurate_as_eager` accepts a bf16/fp16 output outside its dtype's tolerance of the fp32 reference
when it is no less accurate than eager PyTorch in the same dtype. Each time it does, `record` puts the output's line
in the running test's `user_properties`; they travel on the test's report, from a pytest-xdist worker to the
controller too, and the end of the session lists them all ("RMSE fallback" in the terminal summary).
"""
from __future__ import annotations

import pytest

PROPERTY = "rmse_fallback"
_running: list = []  # the test item being run (setup, call and teardown)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def record(line: str) -> None:
    """Note a use of the fallback (`line` says which model and output, and by how much) on the running test."""
    if not _running:
        raise RuntimeError("the RMSE fallback was used outside a test: its use could not be listed")
    _running[-1].user_properties.append((PROPERTY, line))


def pytest_terminal_summary(terminalreporter):
    recorded: dict = {}  # test -> its properties, from its last report (each report copies them all so far)
    for reports in terminalreporter.stats.values():
        for report in reports:
            properties = getattr(report, "user_properties", None)
            if properties and len(properties) >= len(recorded.get(report.nodeid, ())):
                recorded[report.nodeid] = properties
    uses = [(nodeid, line) for nodeid, properties in sorted(recorded.items()) for key, line in properties
            if key == PROPERTY]
    if not uses:
        return
    terminalreporter.section(f"RMSE fallback: {len(uses)} output(s) outside their dtype's tolerance, accepted as no "
                             "less accurate than eager in that dtype (conftest.assert_as_accurate_as_eager)")
    for nodeid, line in uses:
        terminalreporter.write_line(f"{nodeid}: {line}")
