"""Per-op launch overhead of a cached eager op on the `neuron` device, against the same op on CPU eager.

Each op is run once (compiled to a NEFF and cached), then called many times on small tensors so the
time is overhead. On the device an op call only queues the launch on the current stream (PyTorch
dispatch, the signature lookup, new output tensors, the queue entry): that is the launch overhead the
issue's goal (< 20 us per op) is about, printed as ``launch us``. The queued launches then run on the
emulated NeuronCore at ``torch.accelerator.synchronize()`` (``run us``: copying operands into the
program's HBM, its instructions as numpy calls, the outputs written to the tensors); ``total us`` is the
sum, the host time per op of a loop that synchronises. Ratios are against CPU eager. Each figure is the
best over chunks of ops (as ``timeit`` reports the best run): the machine may be shared. On a machine
loaded by other work, ``--clock cpu`` times the process's own CPU time (``time.process_time``) instead of
the wall clock, which the other processes do not inflate.

    .venv/bin/python -m benchmarks.eager_overhead [--repeat 2000] [--clock cpu]   (from the repo root)
"""
from __future__ import annotations

import argparse
import time

import torch

CASES = {
    "add (8x8)": lambda a, b: torch.add(a, b),
    "mul by scalar (8x8)": lambda a, b: a * 0.5,
    "relu (8x8)": lambda a, b: torch.relu(a),
    "mm (8x8 @ 8x8)": lambda a, b: a @ b,
    "add_ in place (8x8)": lambda a, b: a.add_(b),
    "uniform_ (8x8)": lambda a, b: a.uniform_(),  # a random op: the RNG program (neuronc/codegen/rng.py)
}
CHUNK = 500  # launches queued between synchronisations (below the queue depth, so none runs early)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def cpu_us(fn, a, b, repeat: int) -> float:
    fn(a, b)
    best = float("inf")
    for _ in range(max(1, repeat // CHUNK)):
        start = clock()
        for _ in range(CHUNK):
            fn(a, b)
        best = min(best, (clock() - start) / CHUNK * 1e6)
    return best


def neuron_us(fn, a, b, repeat: int) -> tuple:
    """(launch, run) microseconds per op."""
    fn(a, b)
    torch.accelerator.synchronize()
    launch = run = float("inf")
    for _ in range(max(1, repeat // CHUNK)):
        start = clock()
        for _ in range(CHUNK):
            fn(a, b)
        queued = clock()
        torch.accelerator.synchronize()
        launch = min(launch, (queued - start) / CHUNK * 1e6)
        run = min(run, (clock() - queued) / CHUNK * 1e6)
    return launch, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU time (for a machine shared with other work)")
    options = parser.parse_args()
    global clock
    repeat, clock = options.repeat, CLOCKS[options.clock]
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    da, db = a.to("neuron"), b.to("neuron")
    print(f"{'op':22} {'cpu us':>7} {'launch us':>10} {'run us':>7} {'total us':>9} {'launch/cpu':>11} "
          f"{'total/cpu':>10}")
    for name, fn in CASES.items():
        cpu = cpu_us(fn, a, b, repeat)
        launch, run = neuron_us(fn, da, db, repeat)
        print(f"{name:22} {cpu:7.1f} {launch:10.1f} {run:7.1f} {launch + run:9.1f} {launch / cpu:11.1f} "
              f"{(launch + run) / cpu:10.1f}")


if __name__ == "__main__":
    main()
