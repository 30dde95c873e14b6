"""Export a run's timeline as a Chrome trace, so it can be explored in Perfetto or chrome://tracing.

The emulator already knows when every instruction ran on which stream (:class:`~runtime.timeline.Timeline`);
this module only translates that into the Chrome trace event format: one track per engine and per
DMA queue, one complete ("X") event per executed instruction, with the kernel and the PyTorch
source line it came from in the event's args. Open the file at https://ui.perfetto.dev.

    result = run_neff(neff, inputs)
    write_chrome_trace(neff, result.timeline, "model.trace.json")

Names and lane order are shared with the HTML report (:mod:`runtime.report`).
"""
from __future__ import annotations

import json

from neuronc.atomic_file import write_atomically
from neuronc.isa import Engine
from neuronc.neff.program import Neff
from runtime.timeline import Timeline

ENGINE_NAMES = {Engine.TENSOR: "Tensor", Engine.VECTOR: "Vector", Engine.SCALAR: "Scalar", Engine.GPSIMD: "GpSimd",
                Engine.COLLECTIVE: "Collective"}

_PID = 1  # one process: the NeuronCore that ran the program


def stream_name(stream: tuple) -> str:
    """Display name of an (Engine, queue) stream: "Tensor", ..., "DMA queue 3"."""
    engine, queue = Engine(stream[0]), stream[1]
    return f"DMA queue {queue}" if engine == Engine.DMA else ENGINE_NAMES[engine]


def streams_of(neff: Neff, timeline: Timeline) -> list:
    """Every stream of the program or the run, in display order: compute engines, then DMA queues."""
    keys = {(Engine(e), q) for e, q in neff.streams} | {(Engine(e.stream[0]), e.stream[1]) for e in timeline.events}
    return sorted(keys)


def kernel_of(neff: Neff, index: int):
    """The KernelInfo at ``index`` of the kernel table, or None."""
    return neff.kernels[index] if 0 <= index < len(neff.kernels) else None


def debug_loc_of(neff: Neff, index: int):
    """The DebugLoc at ``index`` of the debug table, or None."""
    return neff.debug_locs[index] if 0 <= index < len(neff.debug_locs) else None


def source_line(loc) -> str:
    """"file:line" of a DebugLoc, or "" when it has no file."""
    return f"{loc.file}:{loc.line}" if loc is not None and loc.file else ""


def event_args(neff: Neff, event) -> dict:
    """What one instruction was for: its kernel, the kernel's ops, and the PyTorch source it came from."""
    args = {"stream": stream_name(event.stream), "index": event.index}
    kernel = kernel_of(neff, event.kernel)
    if kernel is not None:
        args["kernel"] = kernel.name
        args["ops"] = list(kernel.ops)
    # The instruction's own location is the most precise; fall back to its kernel's.
    loc = debug_loc_of(neff, event.debug)
    if loc is None and kernel is not None:
        loc = debug_loc_of(neff, kernel.debug)
    if loc is not None:
        args["source"] = source_line(loc)
        args["module"] = loc.module_path
        args["op"] = loc.op
    return args


def chrome_trace(neff: Neff, timeline: Timeline) -> dict:
    """The Chrome trace event document (a JSON-ready dict) of one run of ``neff``."""
    streams = streams_of(neff, timeline)
    tid = {stream: n + 1 for n, stream in enumerate(streams)}
    events = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"{neff.name} ({neff.target})"}},
        {"ph": "M", "pid": _PID, "name": "process_sort_index", "args": {"sort_index": 0}},
    ]
    for stream in streams:
        events.append({"ph": "M", "pid": _PID, "tid": tid[stream], "name": "thread_name",
                       "args": {"name": stream_name(stream)}})
        events.append({"ph": "M", "pid": _PID, "tid": tid[stream], "name": "thread_sort_index",
                       "args": {"sort_index": tid[stream]}})
    for e in sorted(timeline.events, key=lambda e: (e.start_ns, tid[e.stream])):
        events.append({
            "ph": "X", "pid": _PID, "tid": tid[e.stream],
            "name": e.opcode.name,
            "cat": Engine(e.stream[0]).name.lower(),
            "ts": e.start_ns / 1000.0,  # the format counts microseconds
            "dur": (e.end_ns - e.start_ns) / 1000.0,
            "args": event_args(neff, e),
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "metadata": {
            "neff": neff.name,
            "target": neff.target,
            "compiler_version": neff.compiler_version,
            "content_hash": neff.content_hash,
            "estimated_ns": timeline.estimated_ns,
            "hbm_bytes": timeline.hbm_bytes,
            "instructions": len(timeline.events),
        },
    }


def write_chrome_trace(neff: Neff, timeline: Timeline, path) -> None:
    """Write :func:`chrome_trace` as JSON to ``path`` (atomically)."""
    write_atomically(path, json.dumps(chrome_trace(neff, timeline)))
