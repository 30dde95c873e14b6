"""A one-file HTML profile of a run: where the device time went, readable in any browser, offline.

The Chrome trace (:mod:`runtime.trace`) is for digging in with Perfetto; this page is the summary
to glance at or attach to a bug: the program's headline numbers, a picture of every engine and
DMA queue over time, how busy each engine was, and the kernels (with their PyTorch source lines)
that cost the most. It is self-contained: inline CSS and SVG, no scripts, fonts or network.

    result = run_neff(neff, inputs)
    write_html_report(neff, result.timeline, "model.html")

Every string that comes from the NEFF (names, ops, file paths) went through user code, so all of
it is escaped with :func:`html.escape`.
"""
from __future__ import annotations

import dataclasses
import math
from html import escape

from neuronc.atomic_file import write_atomically
from neuronc.isa import Engine
from neuronc.neff.program import Neff
from runtime.timeline import Timeline
from runtime.trace import ENGINE_NAMES, debug_loc_of, kernel_of, source_line, stream_name, streams_of

# Drawing choices (SVG user units, which are CSS pixels at the page's natural width).
SVG_WIDTH = 1280
LABEL_WIDTH = 96  # left column holding the lane names
RIGHT_MARGIN = 16
LANE_HEIGHT = 16
LANE_GAP = 4
GROUP_GAP = 10  # extra space between the compute engines and the DMA queues
AXIS_HEIGHT = 28
MERGE_PX = 1.0  # busy intervals of a lane closer than this are drawn as one rectangle
MIN_RECT_PX = 1.0  # a very short instruction is still drawn this wide, so it stays visible
TARGET_TICKS = 8
TOP_KERNELS = 15

COLOURS = {  # per engine; the Tableau 10 palette, readable for most colour-vision deficiencies
    Engine.TENSOR: "#4e79a7",
    Engine.VECTOR: "#f28e2b",
    Engine.SCALAR: "#59a14f",
    Engine.GPSIMD: "#b07aa1",
    Engine.DMA: "#76b7b2",
    Engine.COLLECTIVE: "#e15759",
}

_CSS = """
:root { --fg: #1f2328; --muted: #656d76; --line: #d0d7de; --bg: #ffffff; --panel: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1340px; margin: 0 auto; padding: 20px 24px 32px; }
header { display: flex; align-items: baseline; gap: 12px; flex-wrap: wrap; }
h1 { font-size: 22px; margin: 0; }
h2 { font-size: 16px; margin: 26px 0 8px; }
.tag { font-size: 12px; padding: 2px 8px; border-radius: 10px; background: #ddf4ff; color: #0969da; }
.muted { color: var(--muted); }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin-top: 14px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
        padding: 8px 14px; min-width: 150px; }
.card .label { font-size: 12px; color: var(--muted); }
.card .value { font-size: 20px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .sub { font-size: 12px; color: var(--muted); }
.legend { display: flex; gap: 16px; font-size: 12px; color: var(--muted); margin-bottom: 4px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 5px; vertical-align: -1px; }
svg { display: block; width: 100%; height: auto; border: 1px solid var(--line); border-radius: 8px; background: #fff; }
svg text { font: 11px system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; fill: var(--fg); }
svg .axis text { fill: var(--muted); }
.bars { display: grid; grid-template-columns: 80px 1fr 60px; gap: 6px 12px; align-items: center; max-width: 720px; }
.bar { height: 14px; background: var(--panel); border: 1px solid var(--line); border-radius: 4px; overflow: hidden; }
.bar > div { height: 100%; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-size: 12px; color: var(--muted); font-weight: 600; background: var(--panel); }
td.num, th.num { text-align: right; }
td code { font-size: 12px; }
.share { display: flex; align-items: center; gap: 8px; justify-content: flex-end; }
.share .bar { width: 80px; height: 10px; }
.note { font-size: 12px; color: var(--muted); margin: 6px 0 0; }
"""


def fmt_time(ns: float) -> str:
    """A duration in the unit that reads best: ns, µs or ms."""
    if ns < 1e3:
        return f"{ns:,.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:,.2f} µs"
    return f"{ns / 1e6:,.3f} ms"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} B"


def nice_step(span: float, ticks: int = TARGET_TICKS) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about ``ticks`` ticks over ``span``."""
    raw = span / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


@dataclasses.dataclass
class KernelTime:
    """Where one kernel's instructions fell in the timeline."""

    index: int
    first_ns: float = math.inf
    last_ns: float = 0.0
    busy_ns: float = 0.0  # sum of its instructions' durations over all streams
    instructions: int = 0
    engines: set = dataclasses.field(default_factory=set)

    @property
    def span_ns(self) -> float:
        return self.last_ns - self.first_ns


def kernel_times(timeline: Timeline) -> list:
    """One :class:`KernelTime` per kernel that ran, most busy time first (instructions of no kernel left out)."""
    times: dict = {}
    for e in timeline.events:
        if e.kernel < 0:
            continue
        k = times.setdefault(e.kernel, KernelTime(e.kernel))
        k.first_ns, k.last_ns = min(k.first_ns, e.start_ns), max(k.last_ns, e.end_ns)
        k.busy_ns += e.end_ns - e.start_ns
        k.instructions += 1
        k.engines.add(Engine(e.stream[0]))
    return sorted(times.values(), key=lambda k: (-k.busy_ns, k.index))


# -- the page ---------------------------------------------------------------------------------------


def html_report(neff: Neff, timeline: Timeline) -> str:
    """The self-contained HTML profile of one run of ``neff``."""
    title = f"{neff.name} on {neff.target}"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)} — neuronc profile</title>",
        f"<style>{_CSS}</style>",
        "</head><body><main>",
        _header(neff, timeline),
        "<h2>Engine timeline</h2>",
        _legend(),
        timeline_svg(neff, timeline),
        "<h2>Engine busy fraction</h2>",
        _busy_bars(timeline),
        "<h2>Top kernels by busy time</h2>",
        _kernel_table(neff, timeline),
        "</main></body></html>",
    ])


def write_html_report(neff: Neff, timeline: Timeline, path) -> None:
    """Write :func:`html_report` to ``path`` (atomically)."""
    write_atomically(path, html_report(neff, timeline))


def _header(neff: Neff, timeline: Timeline) -> str:
    counts: dict = {}
    for e in timeline.events:
        engine = Engine(e.stream[0])
        counts[engine] = counts.get(engine, 0) + 1
    per_engine = " · ".join(f"{_engine_label(engine)} {counts[engine]:,}" for engine in sorted(counts))
    queues = len({e.stream for e in timeline.events if e.stream[0] == Engine.DMA})
    cards = [
        ("Estimated device time", fmt_time(timeline.estimated_ns), f"{timeline.estimated_ns:,.0f} ns"),
        ("Instructions", f"{len(timeline.events):,}", per_engine),
        ("HBM bytes moved", fmt_bytes(timeline.hbm_bytes),
         f"{timeline.hbm_bytes:,} B over {_plural(queues, 'DMA queue')}"),
        ("Kernels", f"{len(neff.kernels):,}", _plural(len(neff.debug_locs), "source location")),
    ]
    card_html = "".join(
        f'<div class="card"><div class="label">{escape(label)}</div><div class="value">{escape(value)}</div>'
        f'<div class="sub">{escape(sub)}</div></div>'
        for label, value, sub in cards
    )
    version = f" · neuronc {escape(neff.compiler_version)}" if neff.compiler_version else ""
    return (
        f'<header><h1>{escape(neff.name)}</h1><span class="tag">{escape(neff.target)}</span>'
        f'<span class="muted">emulated NeuronCore profile{version}</span></header>'
        f'<div class="cards">{card_html}</div>'
    )


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _engine_label(engine: Engine) -> str:
    return "DMA" if engine == Engine.DMA else ENGINE_NAMES[engine]


def _legend() -> str:
    items = "".join(
        f'<span><span class="swatch" style="background:{COLOURS[engine]}"></span>{_engine_label(engine)}</span>'
        for engine in Engine
    )
    return f'<div class="legend">{items}<span>· hover a rectangle for its instructions</span></div>'


def timeline_svg(neff: Neff, timeline: Timeline) -> str:
    """Inline SVG: one lane per stream, busy intervals as rectangles, an x axis in microseconds."""
    streams = streams_of(neff, timeline)
    makespan = timeline.estimated_ns or 1.0
    plot_w = SVG_WIDTH - LABEL_WIDTH - RIGHT_MARGIN
    tops, y = [], LANE_GAP
    for n, stream in enumerate(streams):
        if n and stream[0] != streams[n - 1][0] and Engine.DMA in (stream[0], streams[n - 1][0]):
            y += GROUP_GAP
        tops.append(y)
        y += LANE_HEIGHT + LANE_GAP
    height = y + AXIS_HEIGHT
    plot_bottom = height - AXIS_HEIGHT

    def x(ns: float) -> float:
        return LABEL_WIDTH + ns / makespan * plot_w

    by_stream: dict = {stream: [] for stream in streams}
    for e in timeline.events:
        by_stream[(Engine(e.stream[0]), e.stream[1])].append(e)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {SVG_WIDTH} {height}" '
             f'role="img" aria-label="engine timeline">',
             '<style>.lane rect { shape-rendering: crispEdges; }</style>']
    # Gridlines and the axis go under the lanes.
    step = nice_step(makespan / 1e3)
    parts.append('<g class="axis">')
    tick = 0.0
    while tick <= makespan / 1e3 + step * 1e-9:
        tx = x(tick * 1e3)
        parts.append(f'<line x1="{tx:.1f}" y1="0" x2="{tx:.1f}" y2="{plot_bottom}" stroke="#eaeef2"/>')
        parts.append(f'<line x1="{tx:.1f}" y1="{plot_bottom}" x2="{tx:.1f}" y2="{plot_bottom + 4}" stroke="#8c959f"/>')
        anchor = "end" if tx > SVG_WIDTH - RIGHT_MARGIN - 20 else "middle"
        parts.append(f'<text x="{tx:.1f}" y="{plot_bottom + 16}" text-anchor="{anchor}">{tick:g}</text>')
        tick += step
    parts.append(f'<line x1="{LABEL_WIDTH}" y1="{plot_bottom}" x2="{LABEL_WIDTH + plot_w}" y2="{plot_bottom}" '
                 'stroke="#8c959f"/>')
    parts.append(f'<text x="{LABEL_WIDTH - 8}" y="{plot_bottom + 16}" text-anchor="end">µs</text></g>')

    for lane, (stream, top) in enumerate(zip(streams, tops)):
        if lane % 2:
            parts.append(f'<rect x="0" y="{top - LANE_GAP / 2}" width="{SVG_WIDTH}" '
                         f'height="{LANE_HEIGHT + LANE_GAP}" fill="#f6f8fa"/>')
        parts.append(f'<g class="lane" data-stream="{escape(stream_name(stream))}">')
        parts.append(f'<text x="{LABEL_WIDTH - 8}" y="{top + LANE_HEIGHT - 4}" text-anchor="end">'
                     f'{escape(stream_name(stream))}</text>')
        colour = COLOURS[stream[0]]
        for x0, x1, group in _merged(sorted(by_stream[stream], key=lambda e: e.start_ns), x):
            parts.append(f'<rect x="{x0:.2f}" y="{top}" width="{max(x1 - x0, MIN_RECT_PX):.2f}" '
                         f'height="{LANE_HEIGHT}" fill="{colour}">'
                         f'<title>{escape(_tooltip(neff, stream, group))}</title></rect>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _merged(events: list, x) -> list:
    """(x0, x1, events) per rectangle: consecutive events of a lane closer than MERGE_PX share one."""
    rects = []
    for e in events:
        x0, x1 = x(e.start_ns), x(e.end_ns)
        if rects and x0 - rects[-1][1] < MERGE_PX:
            rects[-1][1] = max(rects[-1][1], x1)
            rects[-1][2].append(e)
        else:
            rects.append([x0, x1, [e]])
    return rects


def _tooltip(neff: Neff, stream: tuple, events: list) -> str:
    start, end = events[0].start_ns, max(e.end_ns for e in events)
    when = f"{start / 1e3:,.3f}–{end / 1e3:,.3f} µs"
    if len(events) == 1:
        e = events[0]
        kernel = kernel_of(neff, e.kernel)
        lines = [f"{e.opcode.name} #{e.index} on {stream_name(stream)}", f"{when} ({fmt_time(end - start)})"]
        if kernel is not None:
            lines.append(f"kernel {kernel.name} ({', '.join(kernel.ops)})")
        loc = debug_loc_of(neff, e.debug)
        if loc is not None:
            lines.append(str(loc))
        return "\n".join(lines)
    names = []
    for e in events:
        kernel = kernel_of(neff, e.kernel)
        if kernel is not None and kernel.name not in names:
            names.append(kernel.name)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    busy = sum(e.end_ns - e.start_ns for e in events)
    return (f"{len(events)} instructions on {stream_name(stream)}\n{when}, busy {fmt_time(busy)}\n"
            f"kernels: {shown or '-'}")


def _busy_bars(timeline: Timeline) -> str:
    fractions = timeline.busy_fraction()
    rows = []
    for engine in sorted(fractions):
        pct = 100 * fractions[engine]
        rows.append(
            f'<div>{_engine_label(engine)}</div>'
            f'<div class="bar"><div style="width:{pct:.2f}%;background:{COLOURS[engine]}"></div></div>'
            f'<div class="num">{pct:.1f}%</div>'
        )
    queues = len({e.stream for e in timeline.events if e.stream[0] == Engine.DMA})
    note = (f'<p class="note">Share of the estimated device time during which at least one stream of the engine '
            f"was executing; for DMA, any of its {_plural(queues, 'queue')}.</p>") if rows else ""
    return f'<div class="bars">{"".join(rows)}</div>{note}'


def _kernel_table(neff: Neff, timeline: Timeline) -> str:
    times = kernel_times(timeline)
    total_busy = sum(k.busy_ns for k in times) or 1.0
    top_busy = times[0].busy_ns if times and times[0].busy_ns else 1.0
    rows = []
    for rank, k in enumerate(times[:TOP_KERNELS], 1):
        kernel = kernel_of(neff, k.index)
        name, ops = (kernel.name, ", ".join(kernel.ops)) if kernel else (f"#{k.index}", "")
        loc = debug_loc_of(neff, kernel.debug) if kernel else None
        where = escape(source_line(loc)) if loc else '<span class="muted">unknown</span>'
        detail = " · ".join(escape(s) for s in (loc.module_path, loc.op) if s) if loc else ""
        share = 100 * k.busy_ns / total_busy
        engines = ", ".join(_engine_label(e) for e in sorted(k.engines))
        rows.append(
            f"<tr><td class=\"num\">{rank}</td><td><code>{escape(name)}</code></td><td>{escape(ops)}</td>"
            f"<td><code>{where}</code><div class=\"muted\">{detail}</div></td>"
            f"<td>{engines}</td><td class=\"num\">{k.instructions:,}</td>"
            f"<td class=\"num\">{k.span_ns / 1e3:,.2f}</td><td class=\"num\">{k.busy_ns / 1e3:,.2f}</td>"
            f'<td class="num"><div class="share"><div class="bar"><div style="width:{100 * k.busy_ns / top_busy:.2f}%;'
            f'background:#4e79a7"></div></div>{share:.1f}%</div></td></tr>'
        )
    head = ('<tr><th class="num">#</th><th>Kernel</th><th>Ops</th><th>Source</th><th>Engines</th>'
            '<th class="num">Instr.</th><th class="num">Span (µs)</th><th class="num">Busy (µs)</th>'
            '<th class="num">Share of busy time</th></tr>')
    shown = f"top {min(TOP_KERNELS, len(times))} of {len(times)}" if times else "no kernels ran"
    note = (f'<p class="note">{shown}. Busy: the kernel\'s instructions\' durations summed over all streams; '
            "share: of all kernels' busy time. Span: from its first instruction's start to its last one's end "
            "(kernels overlap, so spans do not add up). Bars are relative to the top kernel.</p>")
    return f'<table id="top-kernels"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>{note}'
