"""Profiling output: the Chrome trace and the HTML report describe exactly the run's timeline, point
at the user's PyTorch source, load nothing from the network, and escape whatever the NEFF says."""
from __future__ import annotations

import inspect
import json
import os
import re
import struct
import zlib

import numpy as np
import pytest

from neuronc.compiler import CompileOptions, compile_graph
from neuronc.isa import AccessPattern, AluOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff.program import DebugLoc, KernelInfo, Neff, TensorEntry, TensorKind
from runtime import Event, Timeline, run_neff
from runtime.report import html_report, write_html_report
from runtime.trace import chrome_trace, stream_name, write_chrome_trace
from tests import zoo
from tests.conftest import require_tool, zoo_graph

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def transformer():
    """(neff, timeline) of one run of the zoo's transformer block."""
    model, inputs = zoo.build("transformer_block")
    neff = compile_graph(zoo_graph("transformer_block"), CompileOptions()).neff
    return neff, run_neff(neff, [x.numpy() for x in inputs]).timeline


def _complete_events(trace: dict) -> list:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _thread_names(trace: dict) -> dict:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def _line_of(function, text: str) -> int:
    """The file line number of the first line of ``function``'s source containing ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(n for n, line in enumerate(lines) if text in line)


# -- Chrome trace -----------------------------------------------------------------------------------


def test_trace_file_is_json_with_one_named_sorted_track_per_stream(transformer, tmp_path):
    neff, timeline = transformer
    path = tmp_path / "run.trace.json"
    write_chrome_trace(neff, timeline, path)
    assert os.listdir(tmp_path) == ["run.trace.json"]  # written via a temporary file, none left behind
    trace = json.loads(path.read_text())

    assert trace["displayTimeUnit"] == "ns"
    assert trace["metadata"]["target"] == neff.target
    names = _thread_names(trace)
    assert sorted(names.values()) == sorted(stream_name(s) for s in neff.streams)
    assert {"Tensor", "Vector", "Scalar", "GpSimd", "DMA queue 0"} <= set(names.values())
    sort_index = {e["tid"]: e["args"]["sort_index"] for e in trace["traceEvents"] if e["name"] == "thread_sort_index"}
    by_position = [names[tid] for tid in sorted(names, key=sort_index.get)]
    assert by_position[:4] == ["Tensor", "Vector", "Scalar", "GpSimd"]
    assert by_position[4:6] == ["DMA queue 0", "DMA queue 1"]
    process = next(e for e in trace["traceEvents"] if e["name"] == "process_name")
    assert neff.name in process["args"]["name"] and neff.target in process["args"]["name"]


def test_trace_has_one_complete_event_per_executed_instruction(transformer):
    neff, timeline = transformer
    trace = chrome_trace(neff, timeline)
    events = _complete_events(trace)
    assert len(events) == len(timeline.events) == sum(len(s) for s in neff.streams.values())
    names = _thread_names(trace)
    executed = {(names[e["tid"]], e["args"]["index"]) for e in events}
    assert executed == {(stream_name(key), i) for key, stream in neff.streams.items() for i in range(len(stream))}
    for e in events:
        instr = next(s for k, s in neff.streams.items() if stream_name(k) == names[e["tid"]])[e["args"]["index"]]
        assert e["name"] == instr.opcode.name


def test_trace_events_name_their_kernel_and_the_zoo_source_line(transformer):
    neff, timeline = transformer
    events = _complete_events(chrome_trace(neff, timeline))
    kernel_names = {k.name for k in neff.kernels}
    assert all(e["args"]["kernel"] in kernel_names for e in events)
    assert all(e["args"]["ops"] for e in events)
    # the output projection is a matmul on the Tensor engine, traced back to its line in tests/zoo.py
    proj = f"{zoo.__file__}:{_line_of(zoo.CausalSelfAttention.forward, 'return self.proj(')}"
    matmuls = [e for e in events if e["args"]["source"] == proj and e["name"] == "MATMUL"]
    assert matmuls and all(e["args"]["module"] == "attn.proj" for e in matmuls)
    assert {"mm" in e["args"]["op"] for e in matmuls} == {True}


def test_trace_timestamps_are_the_timeline_in_microseconds(transformer):
    neff, timeline = transformer
    events = _complete_events(chrome_trace(neff, timeline))
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(timeline.estimated_ns / 1e3, rel=1e-12)
    assert min(e["ts"] for e in events) == 0.0
    got = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    want = sorted((t.start_ns / 1e3, t.end_ns / 1e3) for t in timeline.events)
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- HTML report ------------------------------------------------------------------------------------


def test_report_is_self_contained(transformer, tmp_path):
    neff, timeline = transformer
    write_html_report(neff, timeline, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    lowered = page.lower()
    for external in ('src="http', "<script", "<link", "@import", "url(", "@font-face"):
        assert external not in lowered


def test_report_header_and_timeline_cover_every_stream(transformer):
    neff, timeline = transformer
    page = html_report(neff, timeline)
    assert page.count("<svg") == 1
    lanes = re.findall(r'<g class="lane" data-stream="([^"]+)">', page)
    assert sorted(lanes) == sorted(stream_name(s) for s in neff.streams)
    assert f"{timeline.hbm_bytes:,} B" in page
    assert f"{len(timeline.events):,}" in page
    assert f"Tensor {sum(len(s) for k, s in neff.streams.items() if k[0] == Engine.TENSOR)}" in page


def test_top_kernels_table_lists_the_most_expensive_kernel_first(transformer):
    neff, timeline = transformer
    busy: dict = {}
    for e in timeline.events:
        busy[e.kernel] = busy.get(e.kernel, 0.0) + e.end_ns - e.start_ns
    ranked = sorted(busy, key=busy.get, reverse=True)
    table = html_report(neff, timeline).split('<table id="top-kernels">')[1]
    shown = re.findall(r"<tr><td class=\"num\">\d+</td><td><code>([^<]+)</code>", table)
    assert shown[0] == neff.kernels[ranked[0]].name
    busy_of = {neff.kernels[k].name: busy[k] for k in busy}  # kernels of equal busy time may come in either order
    # (equal up to the order their events' durations were summed in)
    assert [busy_of[name] for name in shown] == pytest.approx([busy[k] for k in ranked[:len(shown)]], rel=1e-12)


def _hostile_program() -> Neff:
    """A tiny DMA -> Vector -> DMA program whose names and debug location are HTML."""
    x = TensorEntry("x", TensorKind.INPUT, DType.F32, (4, 8), 0, 0)
    y = TensorEntry("y", TensorKind.OUTPUT, DType.F32, (4, 8), x.nbytes, 0)
    home = AccessPattern(Space.HBM, DType.F32, 0, ((8, 4), (1, 8)))
    tile = AccessPattern(Space.SBUF, DType.F32, 0, ((1, 4), (1, 8)))
    common = dict(kernel=0, debug=0)
    streams = {
        (Engine.DMA, 0): [Instruction(Opcode.DMA_COPY, Engine.DMA, (tile, home), **common)],
        (Engine.VECTOR, 0): [Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (tile, tile), alu=AluOp.ADD, imm0=1.0,
                                         waits=(Wait(Engine.DMA, 0, 1),), **common)],
        (Engine.DMA, 1): [Instruction(Opcode.DMA_COPY, Engine.DMA, (
            AccessPattern(Space.HBM, DType.F32, x.nbytes, ((8, 4), (1, 8))), tile), queue=1,
            waits=(Wait(Engine.VECTOR, 0, 1),), **common)],
    }
    return Neff("<i>prog</i>", "trn2", [x, y], streams, x.nbytes + y.nbytes,
                debug_locs=[DebugLoc("<script>alert(1)</script>.py", 7, "a&b", '"op"')],
                kernels=[KernelInfo("<b>kern</b>", ("<img src=x>",), 0)])


def test_report_escapes_text_from_the_neff():
    neff = _hostile_program()
    run = run_neff(neff, [np.zeros((4, 8), np.float32)])
    np.testing.assert_array_equal(run.outputs[0], np.ones((4, 8), np.float32))
    page = html_report(neff, run.timeline)
    for raw in ("<script>", "<b>kern</b>", "<img src=x>", "<i>prog</i>", "a&b", '"op"'):
        assert raw not in page
    for escaped in ("&lt;script&gt;alert(1)&lt;/script&gt;.py:7", "&lt;b&gt;kern&lt;/b&gt;",
                    "&lt;img src=x&gt;", "&lt;i&gt;prog&lt;/i&gt;", "a&amp;b", "&quot;op&quot;"):
        assert escaped in page
    args = _complete_events(chrome_trace(neff, run.timeline))[0]["args"]
    assert args["source"] == "<script>alert(1)</script>.py:7" and args["kernel"] == "<b>kern</b>"


def test_timeline_of_many_instructions_stays_small():
    neff = _hostile_program()
    streams = sorted(neff.streams)
    n = 20_000
    events = [Event(streams[i % 3], i // 3, Opcode.DMA_COPY, float(i), i + 0.5, 0, 0) for i in range(n)]
    page = html_report(neff, Timeline(events))
    svg = page[page.index("<svg"):page.index("</svg>")]
    rects = svg.count('<rect x="') - svg.count('fill="#f6f8fa"')  # minus the lane stripes
    assert 3 <= rects <= 3 * 1280  # at most one rectangle per pixel column per lane
    assert len(page) < 2_000_000


# -- rendering ----------------------------------------------------------------------------------------


def _png_pixels(path) -> np.ndarray:
    """Decode an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes) to a (height, width, channels) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, "unsupported PNG flavour"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), np.int32)
    prev = np.zeros(width * bpp, np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: a running sum along the row, per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:  # Up
            row = (line + prev) % 256
        else:  # Average (3) and Paeth (4) depend on the pixel just decoded: one pixel at a time
            row = line.copy()
            for i in range(len(row)):
                a = row[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                if kind == 3:
                    row[i] = (row[i] + (a + b) // 2) % 256
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
        out[y] = prev = row
    return out.reshape(height, width, bpp)


def test_report_renders_in_headless_chromium(transformer, tmp_path):
    from benchmarks.render_report import screenshot

    require_tool(CHROMIUM, "Debian: apt-get install -y chromium")

    neff, timeline = transformer
    write_html_report(neff, timeline, tmp_path / "report.html")
    png = screenshot(tmp_path / "report.html", tmp_path / "report.png", width=800, height=600)
    pixels = _png_pixels(png)
    assert pixels.shape[:2] == (600, 800)
    colours = np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)
    assert len(colours) > 16  # not a blank page: text, lanes and bars in several colours
