"""What the reference executors of the differential tests (tests/test_differential.py) cost on each zoo model: CPU
seconds of one run by the StableHLO interpreter and by XLA on CPU (its compilation included), side by side, and of
the steps the test takes besides (export, torch-mlir import, neuronc compile, the NEFF's run). CPU time, of this
process and of the forked children the interpreter and the import run in, so that a busy machine does not change
the figures much. The table REFERENCE of the test is chosen from these.

    .venv/bin/python -m benchmarks.reference_executors [--models mlp gpt2] [--skip-interpreter gpt2]
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

import torch

from neuronc.compiler import CompileOptions, compile_imported
from neuronc.frontend.tensors import to_numpy
from neuronc.reference import run_reference
from runtime import run_neff
from tests import zoo
from tests.test_differential import _import_keeping_stablehlo


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(name: str, interpreter: bool) -> dict:
    seconds, start = {}, cpu_seconds()

    def step(what: str) -> None:
        nonlocal start
        seconds[what], start = cpu_seconds() - start, cpu_seconds()

    model, inputs = zoo.build(name)
    program = torch.export.export(model, inputs)
    step("export")
    imported, weights, module = _import_keeping_stablehlo(program, Path(tempfile.mkdtemp()))
    step("import")
    user = iter(to_numpy(x) for x in inputs)
    arguments = [weights[p.attrs["name"]] if p.attrs["kind"] == "weight" else next(user) for p in imported.graph.params]
    run_reference(module, arguments, "xla")
    step("xla")
    if interpreter:
        run_reference(module, arguments, "interpreter")
        step("interpreter")
    for param in imported.graph.params:
        if param.attrs["kind"] == "weight":
            param.attrs["data"] = weights[param.attrs["name"]]
    neff = compile_imported(imported, CompileOptions(), {}).neff
    step("compile")
    run_neff(neff, [to_numpy(x) for x in inputs])
    step("run")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=sorted(zoo.ZOO))
    parser.add_argument("--skip-interpreter", nargs="*", default=[], help="models not to interpret (minutes each)")
    args = parser.parse_args()
    os.environ["NEURON_CC_FLAGS"] = "--no_cache"  # as in the tests
    measure("mlp", interpreter=True)  # the first use of each library is not any model's cost
    print(f"{'model':<18} {'interpreter':>11} {'xla':>6} {'ratio':>6}   {'export':>6} {'import':>6} {'compile':>7} "
          f"{'run':>6}  (CPU seconds)")
    for name in args.models:
        s = measure(name, interpreter=name not in args.skip_interpreter)
        interpreted = f"{s['interpreter']:>11.1f}" if "interpreter" in s else f"{'-':>11}"
        ratio = f"{s['interpreter'] / s['xla']:>6.2f}" if "interpreter" in s else f"{'-':>6}"
        print(f"{name:<18} {interpreted} {s['xla']:>6.1f} {ratio}   {s['export']:>6.1f} {s['import']:>6.1f} "
              f"{s['compile']:>7.1f} {s['run']:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
