"""Per-op launch overhead of a cached eager op on the `neuron` device, against the same op on CPU eager.

Each op is run once (compiled to a NEFF and cached), then timed many times on small tensors so the
time is the overhead: PyTorch dispatch, the signature lookup, copying operands into the program's HBM,
the emulated run, and the result written to a new device tensor. Prints microseconds per op on each
device and the ratio. (The issue's goal is under 20 us per op.)

    .venv/bin/python -m benchmarks.eager_overhead [--repeat 2000]   (from the repo root)
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
}


def per_op_us(fn, a, b, repeat: int) -> float:
    fn(a, b)
    start = time.perf_counter()
    for _ in range(repeat):
        fn(a, b)
    torch.accelerator.synchronize() if a.device.type == "neuron" else None
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    repeat = parser.parse_args().repeat
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    da, db = a.to("neuron"), b.to("neuron")
    print(f"{'op':24} {'cpu us':>9} {'neuron us':>10} {'ratio':>7}")
    for name, fn in CASES.items():
        cpu, neuron = per_op_us(fn, a, b, repeat), per_op_us(fn, da, db, repeat)
        print(f"{name:24} {cpu:9.1f} {neuron:10.1f} {neuron / cpu:7.1f}")


if __name__ == "__main__":
    main()
