"""The `neuronc` command line: compile saved PyTorch programs to NEFF files, run and inspect them.

`neuronc --help` is the map of the tool. Every failure is printed as the typed error's message
(cause, PyTorch source line, what to do) with a non-zero exit, never as a traceback.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import click

from neuronc import __version__
from neuronc.errors import NeuronError
from neuronc.targets import DEFAULT_TARGET, TARGETS


def _friendly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NeuronError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="neuronc")
def main():
    """neuronc: compile PyTorch programs for an (emulated) Trainium NeuronCore.

    \b
    Typical use:
      neuronc compile model.pt2 -o model.neff     # a torch.export.save'd program -> NEFF
      neuronc run model.neff --input x.npy        # execute it on the emulated device
      neuronc inspect model.neff                  # what is inside, and how long it takes
      neuronc hlo model.pt2                       # the StableHLO the frontend produces
    """


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="NEFF file to write [default: MODEL with .neff]")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="Trainium generation to compile for.")
@click.option("-O", "opt_level", type=click.IntRange(0, 3), default=2, show_default=True,
              help="Optimisation level: -O0/-O1 one kernel per op, -O2 default, -O3 searches longer.")
@_friendly
def compile(model, output, target, opt_level):  # noqa: A001 - the subcommand's name
    """Compile a saved ExportedProgram (.pt2, from torch.export.save) to a NEFF file."""
    from neuronc.compiler import CompileOptions, compile_exported
    from neuronc.neff import save

    output = output or os.path.splitext(model)[0] + ".neff"
    name = os.path.splitext(os.path.basename(model))[0]
    compiled = compile_exported(model, CompileOptions(target=target, opt_level=opt_level, name=name))
    save(compiled.neff, output)
    neff = compiled.neff
    counts = ", ".join(f"{e.name.lower()} {n}" for e, n in sorted(neff.instruction_count().items()))
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in compiled.seconds.items())
    click.echo(f"wrote {output} ({os.path.getsize(output)} bytes) for {target} at -O{opt_level}")
    click.echo(f"  kernels: {len(neff.kernels)}; instructions: {counts}")
    click.echo(f"  estimated device time: {neff.estimated_ns / 1e3:.1f} us")
    click.echo(f"  compile time: {stages}")


@main.command()
@click.argument("neff_file", type=click.Path(dir_okay=False))
@click.option("-i", "--input", "inputs", multiple=True, type=click.Path(dir_okay=False),
              help="An input as a .npy file; repeat in the program's input order.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the outputs to this .npz file.")
@click.option("--target", type=click.Choice(sorted(TARGETS)), default=None,
              help="Device to run on [default: the NEFF's target].")
@_friendly
def run(neff_file, inputs, output, target):
    """Run a NEFF on the emulated NeuronCore."""
    import numpy as np

    from neuronc.errors import InputMismatchError
    from neuronc.neff import load
    from runtime import run_neff

    neff = load(neff_file)
    arrays = []
    for path in inputs:
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as err:
            raise InputMismatchError(f"cannot read input {path}: {err}", hint="inputs are .npy files written by numpy.save") from None
    result = run_neff(neff, arrays, target=target)
    for entry, value in zip(neff.outputs(), result.outputs):
        click.echo(f"{entry.name}: shape {tuple(value.shape)} {value.dtype}, "
                   f"mean {float(np.mean(value.astype(np.float64))):.6g}")
    click.echo(f"estimated device time: {result.timeline.estimated_ns / 1e3:.1f} us")
    if output:
        np.savez(output, **{e.name: v for e, v in zip(neff.outputs(), result.outputs)})
        click.echo(f"wrote {output}")


@main.command()
@click.argument("neff_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@_friendly
def inspect(neff_file, as_json):
    """Show a NEFF's header, tensor table, instruction counts and estimated time."""
    from neuronc.neff import load

    neff = load(neff_file)
    summary = {
        "name": neff.name,
        "target": neff.target,
        "format_version": f"{neff.format_major}.{neff.format_minor}",
        "compiler_version": neff.compiler_version,
        "content_hash": neff.content_hash,
        "hbm_bytes": neff.hbm_size,
        "estimated_time_us": neff.estimated_ns / 1e3,
        "instructions": {e.name.lower(): n for e, n in sorted(neff.instruction_count().items())},
        "streams": len(neff.streams),
        "kernels": len(neff.kernels),
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
    click.echo(f"  HBM {neff.hbm_size} bytes; estimated device time {summary['estimated_time_us']:.1f} us")
    click.echo("instructions per engine:")
    for engine, count in summary["instructions"].items():
        click.echo(f"  {engine:<8} {count}")
    click.echo(f"tensors ({len(neff.tensors)}):")
    for t in summary["tensors"]:
        if t["kind"] != "scratch":
            click.echo(f"  {t['kind']:<8} {t['name']:<32} {t['dtype']:<5} {str(tuple(t['shape'])):<20} @ {t['hbm_offset']}")
    scratch = [t for t in summary["tensors"] if t["kind"] == "scratch"]
    click.echo(f"  scratch  {len(scratch)} intermediates, {sum(t['bytes'] for t in scratch)} bytes")


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@_friendly
def hlo(model):
    """Print the StableHLO module the frontend makes of a saved ExportedProgram."""
    from neuronc.frontend.exported import exported_stablehlo, load_exported_program

    click.echo(exported_stablehlo(load_exported_program(model)))


if __name__ == "__main__":
    main()
