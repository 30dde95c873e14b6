"""Render the HTML profile of a zoo model to a PNG with headless Chromium, to look at it without a desktop.

Compiles a model of tests/zoo.py (default: the transformer block), runs it on the emulated
NeuronCore, writes ``report.html`` and ``trace.json`` (open it at https://ui.perfetto.dev) into
the output directory, and screenshots the report to ``report.png``:

    .venv/bin/python -m benchmarks.render_report [--model transformer_block] [--out demo_out/profile]
                                                 [--width 1400] [--height 900]   (from the repo root)

or screenshot an existing report:

    .venv/bin/python -m benchmarks.render_report --html path/report.html [--png path/report.png]

Needs Chromium (Debian: ``apt-get install -y chromium``, as root). It runs with a throw-away
profile and every background network feature off; the report itself loads nothing.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

CHROMIUM = "/usr/bin/chromium"


def screenshot(html_path, png_path, width: int = 1400, height: int = 900, chromium: str = CHROMIUM,
               timeout_s: float = 120) -> pathlib.Path:
    """Load ``html_path`` in headless Chromium and save a ``width`` x ``height`` screenshot to ``png_path``."""
    html_path, png_path = pathlib.Path(html_path).resolve(), pathlib.Path(png_path).resolve()
    png_path.unlink(missing_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png_path}",
               f"--window-size={width},{height}", html_path.as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if not png_path.exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return png_path


def profile_zoo_model(name: str, out_dir) -> pathlib.Path:
    """Compile and run zoo model ``name``; write report.html and trace.json to ``out_dir``. Returns the report."""
    import torch

    from neuronc.compiler import compile_exported
    from runtime import run_neff
    from runtime.report import write_html_report
    from runtime.trace import write_chrome_trace
    from tests import zoo

    model, inputs = zoo.build(name)
    neff = compile_exported(torch.export.export(model, inputs)).neff
    timeline = run_neff(neff, [x.numpy() for x in inputs]).timeline
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(neff, timeline, out_dir / "trace.json")
    write_html_report(neff, timeline, out_dir / "report.html")
    return out_dir / "report.html"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer_block", help="a model of tests/zoo.py")
    parser.add_argument("--out", default="demo_out/profile", help="directory for report.html, trace.json, report.png")
    parser.add_argument("--html", help="screenshot this existing report instead of profiling a model")
    parser.add_argument("--png", help="where to save the screenshot (default: next to the report)")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)

    if not os.access(CHROMIUM, os.X_OK):
        print(f"{CHROMIUM} not found; install it with: apt-get install -y chromium", file=sys.stderr)
        return 1
    html = pathlib.Path(args.html) if args.html else profile_zoo_model(args.model, args.out)
    png = screenshot(html, args.png or html.with_suffix(".png"), args.width, args.height)
    print(f"report:     {html}\nscreenshot: {png}")
    if not args.html:
        print(f"trace:      {html.parent / 'trace.json'}  (open at https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
