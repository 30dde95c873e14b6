"""What `neuronc inspect` and the Python API report: device time, MFU, HBM traffic and bandwidth,
per-engine busy fractions and kernels; `neuronc profile` writes the trace and the report."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.compiler import compile_exported
from neuronc.neff import save
from neuronc.targets import get_target
from runtime import NeuronCore
from runtime.metrics import summarize
from tests.test_codegen import Linear


@pytest.fixture(scope="module")
def linear_neff(tmp_path_factory):
    torch.manual_seed(0)
    model, x = Linear(k=300, n=700).eval(), torch.randn(200, 300)
    neff = compile_exported(torch.export.export(model, (x,))).neff
    path = tmp_path_factory.mktemp("linear") / "linear.neff"
    save(neff, path)
    return neff, path, x


def test_flops_count_every_matmul_exactly_once(linear_neff):
    neff, _, _ = linear_neff
    summary = summarize(neff, NeuronCore(neff.target).load(neff).time())
    assert summary["flops"] == 2 * 200 * 300 * 700


def test_mfu_is_the_matmul_time_at_peak_over_the_device_time(linear_neff):
    neff, _, _ = linear_neff
    timeline = NeuronCore(neff.target).load(neff).time()
    summary = summarize(neff, timeline)
    peak_ns = 2 * 200 * 300 * 700 / (get_target("trn2").matmul_tflops_fp32 * 1e3)
    assert summary["mfu"] == pytest.approx(peak_ns / timeline.estimated_ns)
    assert 0 < summary["mfu"] < 1
    assert summary["hbm_bytes"] >= (200 * 300 + 300 * 700 + 700 + 200 * 700) * 4  # each tensor moved at least once
    assert 0 < summary["hbm_bandwidth_utilisation"] <= 1
    assert set(summary["engines"]) >= {"tensor", "vector", "dma"}
    assert all(0 <= f <= 1 for f in summary["engines"].values())


def test_timing_without_inputs_equals_the_timeline_of_a_real_run(linear_neff):
    neff, _, x = linear_neff
    program = NeuronCore(neff.target).load(neff)
    assert program.time().estimated_ns == program.run([x.numpy()]).timeline.estimated_ns


def test_inspect_json_has_the_keys_scripts_read(linear_neff):
    _, path, _ = linear_neff
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    for key in ("estimated_time_us", "flops", "hbm_bytes", "mfu", "engines", "kernels", "tensors"):
        assert key in summary
    assert summary["kernels"][0]["busy_us"] >= summary["kernels"][-1]["busy_us"]
    assert "tests/test_codegen.py" in summary["kernels"][0]["source"]


def test_a_kernels_span_lies_within_the_programs_time(linear_neff):
    _, path, _ = linear_neff
    summary = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    for kernel in summary["kernels"]:
        assert 0 < kernel["span_us"] <= summary["estimated_time_us"]


def test_profile_writes_a_trace_and_a_report(linear_neff, tmp_path):
    _, path, x = linear_neff
    import numpy as np

    np.save(tmp_path / "x.npy", x.numpy())
    trace, html = tmp_path / "trace.json", tmp_path / "report.html"
    result = CliRunner().invoke(main, ["profile", str(path), "--input", str(tmp_path / "x.npy"),
                                       "-o", str(trace), "--html", str(html)])
    assert result.exit_code == 0, result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e["name"] == "MATMUL" for e in events)
    assert "<svg" in html.read_text()
