"""Process start to the first compiled step of GPT-2-small, with a warm compile cache vs a cold one (issue 6).

Issue 6 asks that the second run of the same script in a new process compile nothing, and for the time from
process start to the first compiled step with a warm cache vs a cold one. This runs a child process that
builds the 12-layer GPT-2-small forward (benchmarks/gpt2_small.py), compiles it with
`torch.compile(backend="neuron")` and calls it once. Children run in turn: cold (an empty cache directory,
NEURON_COMPILE_CACHE_URL), then warm (the directory the cold one filled), twice over with a new directory each
time. It prints, per child, the seconds from its spawn to the end of its first step, where they went inside
the child, and how many graphs it compiled vs took from the cache; then the warm / cold ratio of the means,
and the check that every warm child compiled nothing.

    .venv/bin/python -m benchmarks.cache_warm_start [--dtype bf16] [--layers 12] [--numerics]   (repo root)

By default the emulator only times the program (`LoadedProgram.time()`, as `compile_time --timing-only`): a
full forward of the 12-layer model on the emulator takes minutes, the same minutes warm or cold. `--numerics`
runs it for real.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD_MARK = "warm-start-result: "


def child(dtype: str, layers: int, numerics: bool) -> None:
    """The measured script: everything from `import torch` to the first compiled step's output."""
    import torch

    from benchmarks import gpt2_small
    from benchmarks.hooks import stopwatch, timing_only
    from neuronc.pytorch import backend
    from runtime.core import LoadedProgram, NeuronCore

    imported = time.time()
    model, inputs = gpt2_small.build(dtype, layers)
    built = time.time()
    with (torch.no_grad(), contextlib.nullcontext() if numerics else timing_only(),
          stopwatch(LoadedProgram, "run") as runs, stopwatch(NeuronCore, "load") as loads):
        torch.compile(model, backend="neuron")(*inputs)
    done = time.time()
    compiled = [f.compiled for f in backend.compiled_graphs]
    result = dict(done=done, imports=imported, built=built, load=sum(loads), run=sum(runs), graphs=len(compiled),
                  from_cache=sum(c.cache_hit for c in compiled),
                  neuronc=sum(v for c in compiled for k, v in c.seconds.items() if "/" not in k))
    print(CHILD_MARK + json.dumps(result), flush=True)


def spawn(cache: str, args) -> dict:
    env = {**os.environ, "NEURON_COMPILE_CACHE_URL": cache,
           "NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS", "").replace("--no_cache", "")}
    command = [sys.executable, "-m", "benchmarks.cache_warm_start", "--child", "--dtype", args.dtype,
               "--layers", str(args.layers)] + (["--numerics"] if args.numerics else [])
    start = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith(CHILD_MARK))
    result = json.loads(line[len(CHILD_MARK):])
    for key in ("done", "imports", "built"):
        result[key] -= start  # seconds since the child was spawned
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="cold + warm pairs, each with a new cache")
    parser.add_argument("--numerics", action="store_true", help="run the forward on the emulator for real")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.dtype, args.layers, args.numerics)
        return
    print(f"GPT-2-small forward, {args.layers} layers, {args.dtype}, sequence 512; emulator "
          f"{'runs the forward' if args.numerics else 'times the program only'}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'child':<8}{'first step s':>13}{'import torch':>13}{'build model':>12}{'neuronc':>9}{'NEFF load':>10}"
          f"{'run':>7}{'graphs':>8}{'cached':>8}")
    times: dict = {"cold": [], "warm": []}
    unloaded: dict = {"cold": [], "warm": []}  # the same without the NEFF load (the access check runs cold only)
    warm_compiled = 0
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="neuronc-cache-") as cache:
            for kind in ("cold", "warm"):
                r = spawn(cache, args)
                times[kind].append(r["done"])
                unloaded[kind].append(r["done"] - r["load"])
                if kind == "warm":
                    warm_compiled += r["graphs"] - r["from_cache"]
                print(f"{kind:<8}{r['done']:>13.2f}{r['imports']:>13.2f}{r['built'] - r['imports']:>12.2f}"
                      f"{r['neuronc']:>9.2f}{r['load']:>10.2f}{r['run']:>7.2f}{r['graphs']:>8}{r['from_cache']:>8}")
    cold, warm = (sum(times[k]) / len(times[k]) for k in ("cold", "warm"))
    print(f"process start to first compiled step: cold {cold:.2f} s, warm {warm:.2f} s, warm / cold = {warm / cold:.2f}")
    cold, warm = (sum(unloaded[k]) / len(unloaded[k]) for k in ("cold", "warm"))
    print(f"the same without the NEFF load (the runtime's access check, run cold, recorded for warm): cold {cold:.2f} s, "
          f"warm {warm:.2f} s, "
          f"warm / cold = {warm / cold:.2f}")
    print(f"warm processes compiled {warm_compiled} graph(s): "
          f"{'OK, everything came from the cache' if warm_compiled == 0 else 'NOT OK'}")


if __name__ == "__main__":
    main()
