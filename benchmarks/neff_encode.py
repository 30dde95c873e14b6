"""NEFF encode time (`neuronc.neff.encode`), paid at every cold compile with the cache on and at every NEFF save
(issue 24): the writer's layout.Writer path against flatbuffers' Builder path it replaces, on saved graphs.

    .venv/bin/python -m benchmarks.compile_graph_alone save FILE -- --model hf --mask --dtypes fp32 --seq 128 \
        --layers 12 --timing-only --cpu --backends neuron
    .venv/bin/python -m benchmarks.neff_encode FILE [FILE ...]

Each graph is compiled once; then `encode` runs `--repeat` times per path, alternating, and the minimum CPU
seconds (and wall seconds) of each are printed, with whether the two paths' bytes are equal.
"""
from __future__ import annotations

import argparse
import functools
import pickle
import time


def _min_seconds(function, repeat: int) -> tuple:
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        function()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return min(cpu), min(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="graphs saved by benchmarks.compile_graph_alone save")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from neuronc import compiler
    from neuronc.neff import writer

    fast = writer._encode_program
    for path in args.files:
        with open(path, "rb") as f:
            graph, options = pickle.load(f)
        with compiler.collector_paused():
            neff = compiler.compile_graph(graph, options).neff
        neff.estimated_ns  # settle a pending estimate outside the timings  # noqa: B018
        results = {}
        for _ in range(args.repeat):
            for name, program in (("builder", writer._encode_program_with_builder), ("writer", fast)):
                writer._encode_program = program
                try:
                    seconds = _min_seconds(functools.partial(writer.encode, neff), 1)
                finally:
                    writer._encode_program = fast
                best = results.get(name, (float("inf"), float("inf")))
                results[name] = tuple(min(a, b) for a, b in zip(best, seconds))
        same = writer._encode_program_with_builder(neff) == writer._encode_program_fast(neff)
        instructions = sum(len(s) for s in neff.streams.values())
        print(f"{path}: {instructions} instructions, {len(writer.encode(neff))} bytes, same bytes {same}; "
              f"encode min of {args.repeat}: builder {results['builder'][0]:.3f} s CPU ({results['builder'][1]:.3f} "
              f"wall), writer {results['writer'][0]:.3f} s CPU ({results['writer'][1]:.3f} wall), "
              f"{results['builder'][0] / results['writer'][0]:.1f}x", flush=True)


if __name__ == "__main__":
    main()
