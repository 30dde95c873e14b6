"""Resident memory of a process that recompiles again and again (a long training job, a notebook).

Each round resets Dynamo (`torch._dynamo.reset()`), compiles an 8x8 `sin` with the backend and calls it
once, as a process meeting new shapes or new models does. What the backend keeps of earlier graphs shows
as growth of the resident set. The peer is PyTorch's `aot_eager` backend (the same Dynamo + AOTAutograd
path, no compiler behind it), run the same way in its own child process, side by side.

    .venv/bin/python -m benchmarks.recompile_memory [--rounds 1000]

Target (issue 15): growth over 1000 recompiles <= 200 MB. neuronc's compile cache is left on (a repeat of
one graph is what a cache-warm process sees; the graph is recompiled by Dynamo, AOTAutograd and imported
by torch-mlir every round, then served from the cache, loaded and run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

WARMUP = 10  # rounds before the first reading: imports, first-use caches, the compile cache's entry


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def rounds_of(backend: str, rounds: int) -> dict:
    """In this process: RSS before and after ``rounds`` recompiles with ``backend``."""
    import torch

    def once():
        torch._dynamo.reset()
        torch.compile(torch.sin, backend=backend)(torch.randn(8, 8))

    for _ in range(WARMUP):
        once()
    before = rss_bytes()
    for _ in range(rounds):
        once()
    torch._dynamo.reset()
    return {"backend": backend, "rounds": rounds, "before": before, "after": rss_bytes()}


def measure(backend: str, rounds: int) -> dict:
    child = subprocess.run([sys.executable, "-m", "benchmarks.recompile_memory", "--child", backend,
                            "--rounds", str(rounds)], capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(rounds_of(args.child, args.rounds)))
        return
    results = [measure(backend, args.rounds) for backend in ("neuron", "aot_eager")]
    print(f"{'backend':<10} {'rounds':>6} {'RSS before':>11} {'RSS after':>10} {'growth':>9} {'per round':>10}")
    for r in results:
        growth = r["after"] - r["before"]
        print(f"{r['backend']:<10} {r['rounds']:>6} {r['before'] / 2**20:>8.0f} MB {r['after'] / 2**20:>7.0f} MB "
              f"{growth / 2**20:>6.1f} MB {growth / r['rounds'] / 1024:>7.1f} KB")
    ours, peer = (r["after"] - r["before"] for r in results)
    print(f"neuronc growth {ours / 2**20:.1f} MB (target <= 200 MB); aot_eager's {peer / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
