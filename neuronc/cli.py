"""The `neuronc` command line: compile saved PyTorch programs to NEFF files, run and inspect them.

`neuronc --help` is the map of the tool. Every failure is printed as the typed error's message
(cause, PyTorch source line, what to do) with a non-zero exit, never as a traceback.
"""
from __future__ import annotations

import bisect
import collections
import functools
import json
import os
import sys

import click

from neuronc import __version__
from neuronc.errors import NeuronConfigError, NeuronError
from neuronc.passes.auto_cast import CAST_TYPES, VALUES
from neuronc.targets import DEFAULT_TARGET, TARGETS


def _friendly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NeuronError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)
        except OSError as err:  # the file system failed under a check that passed (a full disk, ...)
            click.echo(f"error: {err.filename or ''}{': ' if err.filename else ''}{err.strerror or err}", err=True)
            sys.exit(1)

    return wrapper


def _check_output(path: str, suffix: str, option: str) -> None:
    """Refuse, before any work, an output file that could not be written or has the wrong extension."""
    why = None
    folder = os.path.dirname(path) or "."
    if not path.lower().endswith(suffix):
        why, hint = f"{option} must end in {suffix}", f"e.g. {option} {os.path.splitext(path)[0]}{suffix}"
    elif not os.path.exists(folder):
        why, hint = f"the directory {folder} does not exist", f"create it (mkdir -p {folder}) or write elsewhere"
    elif not os.path.isdir(folder):
        why, hint = f"{folder} is not a directory", "write into a directory"
    elif not os.access(folder, os.W_OK):
        why, hint = f"the directory {folder} is not writable", "write elsewhere"
    if why:
        raise NeuronConfigError(f"cannot write {path}: {why}", hint=hint)


def _regular_files(ctx, param, value):
    """A click callback refusing a path that exists but is no regular file: reading a FIFO or a device
    would block, or never end (click already refuses directories)."""
    for path in value if isinstance(value, tuple) else (value,):
        if path is not None and os.path.exists(path) and not os.path.isfile(path):
            raise click.BadParameter(f"{path} is not a regular file")
    return value


def _check_compile_settings() -> dict:
    """The options NEURON_CC_FLAGS sets, once every setting a compilation reads is checked: the flags, the
    compile cache's directory (made if missing), TORCH_NEURONX_DEBUG_DIR, NEURONC_FRONTEND_TIMEOUT."""
    from neuronc import debug_dir
    from neuronc.cache import CompileCache
    from neuronc.cc_flags import compile_flags
    from neuronc.frontend.isolate import timeout_s

    flags = compile_flags()
    CompileCache.from_env()
    debug_dir.check()
    timeout_s()
    return flags


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="neuronc")
def main():
    """neuronc: compile PyTorch programs for an (emulated) Trainium NeuronCore.

    \b
    Typical use:
      neuronc compile model.pt2 -o model.neff     # a torch.export.save'd program -> NEFF
      neuronc run model.neff --input x.npy        # execute it on the emulated device
      neuronc inspect model.neff                  # what is inside, and how long it takes
      neuronc check model.pt2                     # which ops cannot be compiled, and where
      neuronc hlo model.pt2                       # the StableHLO the frontend produces
      neuronc bisect model.pt2 --input x.npy      # the first op the NEFF gets wrong, and which pass
    """


def _compile_options(fn):
    """--target, -O, --auto-cast and --auto-cast-type (as neuronx-cc spells them): what a compilation is for.
    Each one not given comes from NEURON_CC_FLAGS, else its default."""
    fn = click.option("--auto-cast-type", type=click.Choice(list(CAST_TYPES)),
                      help="The narrower type auto-cast uses. [default: bf16]")(fn)
    fn = click.option("--auto-cast", type=click.Choice(list(VALUES)),
                      help="Which fp32 ops compute in --auto-cast-type: none, matmult (matmuls and "
                      "convolutions; fp32 accumulation), all. fp64-to-fp32 (alone, or after a mode and a "
                      "comma: matmult,fp64-to-fp32): accept float64 inputs and outputs, computed in fp32; "
                      "the NEFF takes and returns fp32 for them. [default: none]")(fn)
    fn = click.option("-O", "opt_level", type=click.IntRange(0, 3),
                      help="Optimisation level: -O0/-O1 one kernel per op, -O2 default, -O3 searches longer.")(fn)
    return click.option("--target", type=click.Choice(sorted(TARGETS)),
                        help=f"Trainium generation to compile for. [default: {DEFAULT_TARGET}]")(fn)


def _options(name: str | None = None, **given):
    """CompileOptions from the command line's options, over NEURON_CC_FLAGS, over the defaults; every
    setting a compilation reads is checked first (see _check_compile_settings)."""
    from neuronc.compiler import CompileOptions

    chosen = {**_check_compile_settings(), **{k: v for k, v in given.items() if v is not None}}
    return CompileOptions(**chosen, **({"name": name} if name else {}))


@main.command()
@click.argument("model", type=click.Path(dir_okay=False), callback=_regular_files)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="NEFF file to write [default: MODEL with .neff]")
@_compile_options
@_friendly
def compile(model, output, target, opt_level, auto_cast, auto_cast_type):  # noqa: A001 - the subcommand's name
    """Compile a saved ExportedProgram (.pt2, from torch.export.save), a StableHLO module (.mlir text,
    .mlirbc bytecode) or a serialized jax.export artifact to a NEFF file.

    Options not given are taken from NEURON_CC_FLAGS when it sets them."""
    from neuronc.compiler import compile_file
    from neuronc.neff import save

    output = output or os.path.splitext(model)[0] + ".neff"
    _check_output(output, ".neff", "-o")
    options = _options(os.path.splitext(os.path.basename(model))[0], target=target, opt_level=opt_level,
                       auto_cast=auto_cast, auto_cast_type=auto_cast_type)
    target, opt_level = options.target, options.opt_level
    compiled = compile_file(model, options)
    save(compiled.neff, output)
    neff = compiled.neff
    counts = ", ".join(f"{e.name.lower()} {n}" for e, n in sorted(neff.instruction_count().items()))
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in compiled.seconds.items() if "/" not in k)  # totals
    origin = " (from the compile cache)" if compiled.cache_hit else ""
    click.echo(f"wrote {output} ({os.path.getsize(output)} bytes) for {target} at -O{opt_level}{origin}")
    click.echo(f"  kernels: {len(neff.kernels)}; instructions: {counts}")
    click.echo(f"  estimated device time: {neff.estimated_ns / 1e3:.1f} us")
    click.echo(f"  compile time: {stages}")


def kernel_table(neff, timeline, target=None) -> list:
    """Per kernel: name, ops fused into it, on-chip tile shapes, estimated time (its span on the timeline),
    FLOPs, HBM bytes moved and the least it must move (each tensor it touches once), and its roofline
    lower bound max(FLOPs / peak, least bytes / HBM bandwidth) on the target, with efficiency bound/time."""
    from neuronc.instruction_cost import transfer_bytes
    from neuronc.isa import Engine, Opcode, Space
    from neuronc.targets import get_target
    from runtime.metrics import matmul_flops, peak_tflops

    target = get_target(target or neff.target)
    extents: dict = {}  # HBM region start -> its size; memory planning lets tensors share a start
    for t in neff.tensors:
        extents[t.offset] = max(extents.get(t.offset, 0), t.nbytes)
    starts = sorted(extents)
    rows = [{"name": k.name, "ops": list(k.ops), "tiles": {}, "start": None, "end": 0.0, "flops": 0, "ideal_ns": 0.0,
             "hbm_bytes": 0, "touched": {}} for k in neff.kernels]
    for stream in neff.streams.values():
        for inst in stream:
            if not 0 <= inst.kernel < len(rows):
                continue
            row = rows[inst.kernel]
            if inst.opcode == Opcode.MATMUL:
                flops = matmul_flops(inst)
                row["flops"] += flops
                row["ideal_ns"] += flops / (peak_tflops(target, inst.operands[1].dtype) * 1e3)
            for ap in inst.operands:
                if ap.space == Space.HBM:
                    moved = transfer_bytes(inst)
                    row["hbm_bytes"] += moved
                    index = bisect.bisect_right(starts, ap.offset) - 1
                    if index >= 0:
                        start = starts[index]
                        row["touched"][start] = min(extents[start], row["touched"].get(start, 0) + moved)
                elif inst.engine != Engine.DMA:
                    shape = "x".join(map(str, ap.shape))
                    row["tiles"][shape] = max(row["tiles"].get(shape, 0), ap.num_elements)
    for event in timeline.events:
        if 0 <= event.kernel < len(rows):
            row = rows[event.kernel]
            row["start"] = event.start_ns if row["start"] is None else min(row["start"], event.start_ns)
            row["end"] = max(row["end"], event.end_ns)
    table = []
    for row in rows:
        least = sum(row["touched"].values())
        bound_ns = max(row["ideal_ns"], least / target.hbm_gbps)  # bytes / (GB/s) = ns
        time_ns = row["end"] - (row["start"] or 0.0)
        table.append({
            "name": row["name"], "ops": row["ops"],
            "tiles": sorted(row["tiles"], key=lambda shape: -row["tiles"][shape])[:4],
            "estimated_time_us": time_ns / 1e3, "roofline_us": bound_ns / 1e3,
            "efficiency": bound_ns / time_ns if time_ns else 0.0,
            "flops": row["flops"], "hbm_bytes": row["hbm_bytes"], "min_hbm_bytes": least,
        })
    return table


def _show_kernels(neff, timeline, target, as_json: bool) -> None:
    table = kernel_table(neff, timeline, target)
    if as_json:
        click.echo(json.dumps({"name": neff.name, "target": target or neff.target, "kernels": table}, indent=2))
        return
    click.echo(f"NEFF {neff.name}: {len(table)} kernels on {target or neff.target} "
               f"(time: span on the estimated timeline; bound: max(FLOPs / peak, least HBM bytes / bandwidth))")
    click.echo(f"  {'kernel':<18} {'time us':>9} {'bound us':>9} {'eff':>5} {'HBM/min':>7}  tiles; ops")
    for k in table:
        ratio = k["hbm_bytes"] / k["min_hbm_bytes"] if k["min_hbm_bytes"] else 0.0
        click.echo(f"  {k['name']:<18} {k['estimated_time_us']:>9.2f} {k['roofline_us']:>9.2f} {k['efficiency']:>5.2f} "
                   f"{ratio:>7.2f}  [{', '.join(k['tiles'])}]; {' '.join(k['ops'])}")


@main.command()
@click.argument("model", type=click.Path(dir_okay=False), callback=_regular_files)
@_compile_options
@_friendly
def check(model, target, opt_level, auto_cast, auto_cast_type):
    """List every op of a saved ExportedProgram (.pt2) that cannot be compiled, with its uses and
    source lines; exit 1 if there is any. Each op is compiled alone, nothing is written. Options not
    given are taken from NEURON_CC_FLAGS when it sets them."""
    from neuronc.check import check_program
    from neuronc.frontend.op_probe import where

    options = _options(target=target, opt_level=opt_level, auto_cast=auto_cast, auto_cast_type=auto_cast_type)
    target, opt_level = options.target, options.opt_level
    report = check_program(model, options)
    total = sum(report.uses.values())
    if report.ok:
        click.echo(f"{model}: all {len(report.uses)} distinct ops ({total} uses) compile for {target} at -O{opt_level}")
        return
    click.echo(f"{model}: {len(report.unsupported)} of {len(report.uses)} distinct ops cannot be compiled "
               f"for {target} at -O{opt_level}:")
    for op in report.unsupported:
        click.echo(f"  {op.op} ({len(op.places)} of {report.uses[op.op]} uses): {op.why}")
        for place, count in collections.Counter(where(loc) for loc in op.places).items():
            click.echo(f"      {place}" + (f" ({count}x)" if count > 1 else ""))
    click.echo("hint: rewrite these ops with supported ones, or keep them outside the compiled region "
               "(torch.compiler.disable); README.md lists the supported ops", err=True)
    sys.exit(1)


@main.command()
@click.argument("neff_file", type=click.Path(dir_okay=False), callback=_regular_files)
@click.option("-i", "--input", "inputs", multiple=True, type=click.Path(dir_okay=False), callback=_regular_files,
              help="An input as a .npy file (an .npz file: its arrays, in their order); repeat in the "
              "program's input order.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the outputs to this .npz file.")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=None,
              help="Device to run on [default: the NEFF's target].")
@_friendly
def run(neff_file, inputs, output, target):
    """Run a NEFF on the emulated NeuronCore.

    A float64 array given for a float32 input is cast to float32 (a note says so): a program compiled with
    --auto-cast fp64-to-fp32 takes its float64 inputs as float32 ones. Outputs are written in the NEFF's
    types (float32 for the float64 outputs of such a program)."""
    import numpy as np

    from neuronc.neff import load
    from runtime import NeuronCore

    if output:
        _check_output(output, ".npz", "-o")
    neff = load(neff_file)
    arrays = _load_inputs(inputs, neff)
    result = NeuronCore(target or neff.target).load(neff).run(arrays)
    timeline, outputs = result.timeline, result.outputs
    for entry, value in zip(neff.outputs(), outputs):
        click.echo(f"{entry.name}: shape {tuple(value.shape)} {value.dtype}, "
                   f"mean {float(np.mean(value.astype(np.float64))):.6g}")
    click.echo(f"estimated device time: {timeline.estimated_ns / 1e3:.1f} us")
    if output:
        import io

        from neuronc.atomic_file import write_atomically

        buffer = io.BytesIO()  # np.savez to a file object writes exactly there (to a name, it adds .npz)
        np.savez(buffer, **{e.name: v for e, v in zip(neff.outputs(), outputs)})
        write_atomically(output, buffer.getvalue())
        click.echo(f"wrote {output}")


def _load_inputs(paths, neff) -> list:
    from neuronc.input_files import load_inputs

    notes: list = []
    arrays = load_inputs(paths, neff.inputs(), neff.name, notes)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    return arrays


def _timeline(neff, inputs: tuple, target):
    """The timeline of a run with these .npy inputs, or of a timing-only run when there are none."""
    from runtime import NeuronCore

    arrays = _load_inputs(inputs, neff) if inputs else None
    program = NeuronCore(target or neff.target).load(neff)
    return program.run(arrays).timeline if inputs else program.time()


@main.command()
@click.argument("neff_file", type=click.Path(dir_okay=False), callback=_regular_files)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=None,
              help="Time it on this target [default: the NEFF's target].")
@click.option("--kernels", "per_kernel", is_flag=True,
              help="Show every kernel: the ops fused into it, its tiles, its time and its roofline bound.")
@_friendly
def inspect(neff_file, as_json, target, per_kernel):
    """Show a NEFF's header, tensor table, instruction counts, estimated time, MFU and bandwidth."""
    from neuronc.neff import load
    from runtime.metrics import summarize

    neff = load(neff_file)
    timeline = _timeline(neff, (), target)
    if per_kernel:
        _show_kernels(neff, timeline, target, as_json)
        return
    summary = {
        "format_version": f"{neff.format_major}.{neff.format_minor}",
        "compiler_version": neff.compiler_version,
        "content_hash": neff.content_hash,
        "hbm_size_bytes": neff.hbm_size,
        **summarize(neff, timeline, target),
        "tensors": [
            {"name": t.name, "kind": t.kind.name.lower(), "dtype": t.dtype.name.lower(), "shape": list(t.shape),
             "hbm_offset": t.offset, "bytes": t.nbytes}
            for t in neff.tensors
        ],
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"NEFF {neff.name}: target {neff.target}, format {summary['format_version']}, "
               f"neuronc {neff.compiler_version}")
    click.echo(f"  content hash {neff.content_hash}")
    click.echo(f"  HBM {neff.hbm_size} bytes")
    click.echo(f"estimated device time {summary['estimated_time_us']:.1f} us on {summary['target']}")
    click.echo(f"  {summary['flops']:.4g} FLOPs, MFU {summary['mfu']:.1%}; HBM moved {summary['hbm_bytes']} bytes "
               f"at {summary['hbm_gbps_achieved']:.1f} GB/s ({summary['hbm_bandwidth_utilisation']:.1%} of peak)")
    click.echo("engines (busy fraction, instructions):")
    for engine, count in summary["instructions"].items():
        click.echo(f"  {engine:<8} {summary['engines'].get(engine, 0.0):6.1%} {count:>8}")
    click.echo("top kernels (engine time: every engine's and DMA queue's busy time summed; span: first start to "
               "last end):")
    for kernel in summary["kernels"][:5]:
        click.echo(f"  {kernel['busy_us']:9.2f} us engine time, span {kernel['span_us']:9.2f} us  "
                   f"{kernel['name']:<24} {kernel['source']}")
    click.echo(f"tensors ({len(neff.tensors)}):")
    for t in summary["tensors"]:
        if t["kind"] != "scratch":
            click.echo(f"  {t['kind']:<8} {t['name']:<32} {t['dtype']:<5} {str(tuple(t['shape'])):<20} @ {t['hbm_offset']}")
    scratch = [t for t in summary["tensors"] if t["kind"] == "scratch"]
    click.echo(f"  scratch  {len(scratch)} intermediates, {sum(t['bytes'] for t in scratch)} bytes")


@main.command()
@click.argument("neff_file", type=click.Path(dir_okay=False), callback=_regular_files)
@click.option("-i", "--input", "inputs", multiple=True, type=click.Path(dir_okay=False), callback=_regular_files,
              help="An input as a .npy file, in the program's input order; without inputs the "
              "program is timed without computing numbers.")
@click.option("-o", "--output", "trace", type=click.Path(dir_okay=False), default="trace.json", show_default=True,
              help="Chrome-trace / Perfetto JSON to write (open in ui.perfetto.dev or chrome://tracing).")
@click.option("--html", type=click.Path(dir_okay=False), help="Also write a self-contained HTML report.")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=None,
              help="Device to run on [default: the NEFF's target].")
@_friendly
def profile(neff_file, inputs, trace, html, target):
    """Profile a NEFF on the emulated device: one track per engine and DMA queue."""
    from neuronc.neff import load
    from runtime.metrics import summarize
    from runtime.report import write_html_report
    from runtime.trace import write_chrome_trace

    _check_output(trace, ".json", "-o")
    if html:
        _check_output(html, ".html", "--html")
    neff = load(neff_file)
    timeline = _timeline(neff, inputs, target)
    write_chrome_trace(neff, timeline, trace)
    click.echo(f"wrote {trace} ({len(timeline.events)} events)")
    if html:
        write_html_report(neff, timeline, html)
        click.echo(f"wrote {html}")
    summary = summarize(neff, timeline, target)
    click.echo(f"estimated device time {summary['estimated_time_us']:.1f} us, MFU {summary['mfu']:.1%}, "
               f"HBM {summary['hbm_gbps_achieved']:.1f} GB/s")


@main.command("bisect")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-i", "--input", "inputs", multiple=True, type=click.Path(dir_okay=False),
              help="An input as a .npy file; repeat in the program's input order [default: a .pt2's example inputs].")
@click.option("--reference", type=click.Choice(["xla", "interpreter"]), default="xla", show_default=True,
              help="What computes the expected values: XLA on CPU, or the StableHLO reference interpreter "
              "(slow; small graphs).")
@_compile_options
@_friendly
def bisect_command(model, inputs, reference, target, opt_level, auto_cast, auto_cast_type):
    """Find the first op whose value the NEFF gets wrong, and the compiler pass after which it does.

    Runs the program's StableHLO on the reference executor and the NEFF on the emulated core, compares
    every value the NEFF keeps in HBM (each kernel's output) within its dtype's tolerance, and prints the
    first that differs with its source line, kernel and error, and the pass found by bisecting the
    pipeline. Exits 1 when the program diverges. MODEL: a .pt2, .mlir, .mlirbc or jax.export file."""
    from neuronc.differential import bisect_file

    options = _options(os.path.splitext(os.path.basename(model))[0], target=target, opt_level=opt_level,
                       auto_cast=auto_cast, auto_cast_type=auto_cast_type)
    report = bisect_file(model, inputs, options, reference)
    click.echo(str(report))
    if report.diverges:
        sys.exit(1)


@main.command()
@click.argument("model", type=click.Path(dir_okay=False), callback=_regular_files)
@_friendly
def hlo(model):
    """Print the StableHLO module the frontend makes of a saved ExportedProgram (or of a StableHLO file)."""
    from neuronc.frontend.exported import exported_stablehlo, load_exported_program
    from neuronc.frontend.stablehlo_program import is_stablehlo_file, program_text, read_program

    if is_stablehlo_file(model):
        click.echo(program_text(read_program(model)))
        return
    click.echo(exported_stablehlo(load_exported_program(model)))


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    try:
        size = float(text[: len(text) - len(unit)]) * units[unit]
        if not 0 <= size < 1 << 63:  # refuses nan and inf too
            raise ValueError
        return int(size)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 500M or 2G") from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _the_cache():
    from neuronc.cache import CompileCache

    store = CompileCache.from_env()  # checks the settings, makes the directory
    if store is None:
        raise NeuronError("the compile cache is disabled (--no_cache in NEURON_CC_FLAGS)")
    return store


@main.group()
def cache():
    """The persistent compile cache (NEURON_COMPILE_CACHE_URL, --cache_dir, --no_cache in NEURON_CC_FLAGS)."""


@cache.command("list")
@_friendly
def cache_list():
    """List cached NEFFs, most recently used first, and temporary files (of writers at work, or orphaned
    by writers killed before they finished)."""
    store = _the_cache()
    entries = store.entries()
    click.echo(f"{store.directory}: {len(entries)} entries, {_human(sum(e.size for e in entries))}")
    for e in entries:
        click.echo(f"  {e.key[:16]}  {_human(e.size):>10}  {e.age_s / 3600:7.1f} h old  {e.target}  {e.name}")
    temporary = store.temporary_files()
    orphans, live = [t for t in temporary if t.orphaned], [t for t in temporary if not t.orphaned]
    if orphans:
        click.echo(f"{_count(len(orphans), 'orphaned temporary file')}, {_human(sum(t.size for t in orphans))} "
                   "(left by writers killed before they finished; `neuronc cache clear` or `prune` removes them):")
    _list_temporary(store, orphans)
    if live:
        click.echo(f"{_count(len(live), 'temporary file')} being written, {_human(sum(t.size for t in live))}:")
    _list_temporary(store, live)


def _list_temporary(store, files) -> None:
    for t in files:
        click.echo(f"  {os.path.relpath(t.path, store.directory)}  {_human(t.size):>10}  {t.age_s / 3600:7.1f} h old")


@cache.command("show")
@click.argument("key")
@_friendly
def cache_show(key):
    """Show one entry (a key prefix is enough)."""
    store = _the_cache()
    matches = [e for e in store.entries() if e.key.startswith(key)]
    if len(matches) != 1:
        raise NeuronError(f"{len(matches)} cache entries match {key!r}", hint="`neuronc cache list` shows the keys")
    e = matches[0]
    click.echo(f"key       {e.key}\npath      {e.path}\nsize      {_human(e.size)}\nname      {e.name}\n"
               f"target    {e.target}\nage       {e.age_s / 3600:.1f} h")


def _removed(cleanup) -> str:
    """What a cleanup removed, and the live writers' temporary files it left."""
    size = sum(e.size for e in cleanup.entries) + sum(t.size for t in cleanup.orphans)
    text = (f"removed {len(cleanup.entries)} entries and {_count(len(cleanup.orphans), 'orphaned temporary file')}"
            f" ({_human(size)})")
    if cleanup.being_written:
        text += f"; {_count(len(cleanup.being_written), 'temporary file')} being written, left in place"
    return text


@cache.command("clear")
@_friendly
def cache_clear():
    """Remove every entry and every orphaned temporary file."""
    click.echo(_removed(_the_cache().clear()))


@cache.command("prune")
@click.option("--max-size", required=True, help="Keep the most recently used entries up to this size, e.g. 500M, 2G.")
@_friendly
def cache_prune(max_size):
    """Remove the orphaned temporary files, and the least recently used entries until the cache fits in
    --max-size."""
    click.echo(_removed(_the_cache().prune(_size(max_size))))


if __name__ == "__main__":
    main()
