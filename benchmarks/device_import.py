"""What the `neuron` device's autoload adds to `import torch`.

Times `python -c "import torch"` in fresh processes, alternating with the autoload on (the default)
and off (TORCH_DEVICE_BACKEND_AUTOLOAD=0), and prints the medians and their ratio. The autoload loads
the C++ shim if it is built (`make install` builds it), so build it first for the usual figure.
On a busy machine the two medians are noisy; the in-process time of the autoload alone is the steadier figure.

    .venv/bin/python -m benchmarks.device_import [--runs 15]   (from the repo root)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def import_seconds(autoload: bool) -> float:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1" if autoload else "0"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
    return time.perf_counter() - start


REGISTER_ONLY = """
import time, torch
start = time.perf_counter()
from neuronc.pytorch.autoload import register
register()
print(time.perf_counter() - start)
"""


def register_seconds() -> float:
    """The autoload's own cost, timed inside a process that imported torch without it (less noisy)."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", REGISTER_ONLY], env=env, check=True, capture_output=True, text=True)
    return float(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    import_seconds(True)  # warm the file cache
    times = {True: [], False: []}
    for _ in range(runs):
        for autoload in (False, True):
            times[autoload].append(import_seconds(autoload))
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    print(f"import torch, median of {runs} fresh processes:")
    print(f"  without the neuron autoload: {without * 1e3:7.1f} ms")
    print(f"  with the neuron autoload:    {with_ * 1e3:7.1f} ms")
    print(f"  ratio with/without: {with_ / without:.3f}  (+{(with_ - without) * 1e3:.1f} ms)")
    register = statistics.median(register_seconds() for _ in range(runs))
    print(f"  the autoload itself, timed in-process: {register * 1e3:.1f} ms = {register / without:.3f} of import torch")


if __name__ == "__main__":
    main()
