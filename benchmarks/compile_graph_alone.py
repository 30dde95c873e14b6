"""neuronc's passes + codegen (`compile_graph`) timed alone, on an imported graph saved once (issue 24).

The stage times of `benchmarks.compile_time` come with Dynamo, AOTAutograd and the torch-mlir import around them and
move by 20% or more between runs on a shared machine; timing `compile_graph` on the same imported graph in fresh
processes isolates neuronc's own whole-program steps (passes, kernels, hazard grid, prefetch, sync, estimate).

    .venv/bin/python -m benchmarks.compile_graph_alone save FILE -- --model hf --mask --dtypes fp32 --seq 128 \
        --layers 12 --timing-only --cpu --backends neuron
        (runs benchmarks.compile_time with those arguments and pickles the graph and options of its last
        `compile_graph` call into FILE: one dtype per FILE)
    .venv/bin/python -m benchmarks.compile_graph_alone time FILE [--profile OUT] [--json]
        (one compile in this process, CPU seconds: the stages, the NEFF's sha256 prefix and estimated ns; with
        --json one line of JSON: every `Compiled.seconds` entry, "own", "sha", "estimated_ns", "instructions")

Run `time` in several fresh processes, alternating the trees compared (PYTHONPATH=<tree>), and take medians:
`python -m benchmarks.compile_ratio --graphs DIR` does that for 1 and 12 layers.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pickle
import sys

STAGES = ("codegen/kernels", "codegen/hazard grid", "codegen/prefetch", "codegen/sync", "codegen/estimate")


def save(path: str, benchmark_args: list) -> None:
    """benchmarks.compile_time run with `benchmark_args`, its last compile_graph's (graph, options) kept in `path`."""
    from benchmarks import compile_time
    from neuronc import compiler

    compile_graph = compiler.compile_graph

    def saving(graph, options, *args, **kwargs):
        with open(path, "wb") as f:
            pickle.dump((graph, options), f)
        return compile_graph(graph, options, *args, **kwargs)

    compiler.compile_graph = saving
    sys.argv = [sys.argv[0], *benchmark_args]
    compile_time.main()


def time_alone(path: str, profile: str | None, as_json: bool = False) -> None:
    """Compiles the saved graph once and prints CPU seconds per stage, the NEFF's sha256 prefix and its estimate."""
    import time

    from benchmarks.hooks import cpu_clock
    from neuronc import compiler
    from neuronc.neff import encode

    with open(path, "rb") as f:
        graph, options = pickle.load(f)
    profiler = cProfile.Profile() if profile else None
    with compiler.collector_paused(), cpu_clock():
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        compiled = compiler.compile_graph(graph, options)
        if profiler:
            profiler.disable()
        total = time.perf_counter() - start
    if profiler:
        profiler.dump_stats(profile)
    seconds = compiled.seconds
    passes = sum(v for k, v in seconds.items() if k.startswith("pass/"))
    sha = hashlib.sha256(encode(compiled.neff)).hexdigest()[:12]
    instructions = sum(len(s) for s in compiled.neff.streams.values())
    if as_json:
        print(json.dumps(dict(seconds, own=sum(v for k, v in seconds.items() if "/" not in k), sha=sha,
                              estimated_ns=compiled.neff.estimated_ns, instructions=instructions,
                              profiled=profiler is not None)))
        return
    print(f"total {total:.3f} passes {passes:.3f} "
          + " ".join(f"{k.split('/')[1].replace(' ', '_')} {seconds.get(k, 0.0):.3f}" for k in STAGES)
          + f" sha {sha} estimated_ns {compiled.neff.estimated_ns!r} instructions {instructions}"
          + (" (profiled: not comparable)" if profiler else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save", help="run benchmarks.compile_time and keep its imported graph")
    saving.add_argument("file")
    saving.add_argument("benchmark_args", nargs=argparse.REMAINDER, help="-- then benchmarks.compile_time's arguments")
    timing = commands.add_parser("time", help="compile a saved graph once, CPU seconds per stage")
    timing.add_argument("file")
    timing.add_argument("--profile", metavar="OUT", help="cProfile the compile into OUT (times then inflated)")
    timing.add_argument("--json", action="store_true", help="one line of JSON instead of the text line")
    args = parser.parse_args()
    if args.command == "save":
        save(args.file, [a for a in args.benchmark_args if a != "--"])
    else:
        time_alone(args.file, args.profile, args.json)


if __name__ == "__main__":
    main()
