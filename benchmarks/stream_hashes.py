"""A fingerprint of every program the compiler makes: the hash of each NEFF's instruction streams.

For refactorings that must not change what the compiler emits (issue 17: kernel plans as data, IR text):
compile every model of the zoo (tests/zoo.py) and the cases of benchmarks/roofline.py at each -O level and
print one line per (case, level) with a hash of its instruction streams (every field of every instruction,
stream by stream) and the estimated time. Run it on main and on a branch and diff the two outputs; a line
that differs is a changed program, to be measured (benchmarks/roofline.py) and explained. Nothing is asserted.

    python -m benchmarks.stream_hashes [--cases mlp,gpt2_block,...] [--levels 0,2] [--full] > hashes.txt

The roofline cases run at their --quick shapes unless --full (minutes more). The persistent compile cache
is bypassed: each program is compiled by this checkout's code.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import time

import torch

from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend.exported import import_exported_program


def stream_hash(neff) -> str:
    """sha1 of the instruction streams, stream by stream in a fixed order, each instruction's every field."""
    digest = hashlib.sha1()
    for key in sorted(neff.streams, key=repr):
        digest.update(repr(key).encode())
        for inst in neff.streams[key]:
            digest.update(repr(inst).encode())
    return digest.hexdigest()[:16]


def _cases(full: bool) -> dict:
    """{name: (model, inputs)}: the zoo's models, then the roofline's cases (in their dtypes)."""
    from benchmarks import roofline
    from tests import zoo

    cases = {f"zoo/{name}": zoo.build(name) for name in zoo.ZOO}
    for name, (model, inputs, dtype) in roofline._cases(quick=not full).items():
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        cases[f"roofline/{name}"] = (model.eval().to(dtype), inputs)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated subset (names as printed, or without prefix)")
    parser.add_argument("--levels", default="0,1,2,3", help="comma-separated -O levels")
    parser.add_argument("--full", action="store_true", help="the roofline cases at their full shapes")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    wanted = {c for c in args.cases.split(",") if c}
    for name, (model, inputs) in _cases(args.full).items():
        if wanted and name not in wanted and name.split("/", 1)[1] not in wanted:
            continue
        with torch.no_grad():
            imported, weights = import_exported_program(torch.export.export(model, inputs), "main")
        for param in imported.graph.params:
            if param.attrs["kind"] == "weight":
                param.attrs["data"] = weights[param.attrs["name"]]
        for level in levels:
            start = time.perf_counter()
            graph = copy.deepcopy(imported.graph)
            neff = compile_graph(graph, CompileOptions(opt_level=level, name="main")).neff
            count = sum(len(stream) for stream in neff.streams.values())
            print(f"{name:<24} -O{level} {stream_hash(neff)} {count:>9} instructions "
                  f"{neff.estimated_ns / 1e3:>12.3f} us  (compiled in {time.perf_counter() - start:.1f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
