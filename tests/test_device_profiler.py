"""`torch.profiler` on the `neuron` device (the shim's Kineto plugin, neuronc/pytorch/profiler.py): device rows of
each launch's kernels with their emulated durations, linked to the op that queued them, in key_averages() and in
the exported Chrome trace; record_function ranges on the device rows too."""
from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from neuronc.pytorch import eager, profiler


def _work(x):
    return (x @ x).relu()


@pytest.fixture
def profiled(neuron, tmp_path):
    """(the profile of _work on a 64x64 device tensor inside record_function("block") and a copy back, its trace)"""
    x = torch.randn(64, 64).to(neuron)
    _work(x).cpu()  # compiled: the profiled launches are lookups
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        with record_function("block"):
            y = _work(x)
        y.cpu()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return prof, json.loads(path.read_text())["traceEvents"]


def _programs():
    [mm], [relu] = (eager.compiled_for(op, (64, 64)) for op in (torch.ops.aten.mm.default, torch.ops.aten.relu.default))
    return mm, relu


def test_key_averages_give_each_op_the_device_time_of_its_kernels(profiled):
    prof, _ = profiled
    rows = {e.key: e for e in prof.key_averages()}
    mm, relu = _programs()
    for op, program in (("aten::mm", mm), ("aten::relu", relu)):
        assert rows[op].self_device_time_total == pytest.approx(program.duration_ns / 1e3, abs=0.01)
        for name, begin, end in profiler.kernels(program.program):  # a row per kernel too, on the device
            assert rows[name].device_type == torch.autograd.DeviceType.PrivateUse1
            assert rows[name].device_time_total == pytest.approx((end - begin) / 1e3, abs=0.01)


def test_the_chrome_trace_has_device_rows_linked_to_the_ops(profiled):
    _, events = profiled
    ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    mm, relu = _programs()
    expected = [name for program in (mm, relu) for name, _, _ in profiler.kernels(program.program)]
    assert [k["name"] for k in kernels] == expected
    assert {ops[k["args"]["External id"]]["name"] for k in kernels} == {"aten::mm", "aten::relu"}
    stream = torch.accelerator.current_stream().stream_id
    assert all(k["pid"] == 0 and k["tid"] == stream for k in kernels)  # neuron:0, its current stream
    assert kernels[1]["ts"] >= kernels[0]["ts"] + kernels[0]["dur"] - 0.01  # in order on the stream
    [copy] = [e for e in events if e.get("cat") == "gpu_memcpy"]
    assert ops[copy["args"]["External id"]]["name"] == "aten::_copy_from"
    flows = {(e["id"], e["ph"]) for e in events if e.get("cat") == "ac2g"}
    assert len(flows) == 2 * 3 and {ph for _, ph in flows} == {"s", "f"}  # host launch -> device, per launch
    [annotation] = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    assert annotation["name"] == "block" and annotation["tid"] == stream
    assert annotation["ts"] <= kernels[0]["ts"] and annotation["ts"] + annotation["dur"] >= \
        kernels[-1]["ts"] + kernels[-1]["dur"] - 0.01


def test_launches_on_another_stream_are_on_its_row(neuron):
    x = torch.randn(64, 64).to(neuron)
    _work(x).cpu()
    side = torch.Stream(device="neuron")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        with torch.neuron.stream(side):
            _work(x)
        torch.accelerator.synchronize()
    streams = {e.device_resource_id for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1}
    assert streams == {side.stream_id}


def test_nothing_is_recorded_without_a_trace(neuron):
    import sys

    from neuronc.pytorch import shim

    x = torch.randn(8, 8).to(neuron)
    assert sys.modules[shim.NAME].launch(0, 0.0)[2] == -1  # no correlation: queues.enqueue records nothing
    _work(x).cpu()
