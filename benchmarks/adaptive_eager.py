"""Adaptive eager against plain eager on the `neuron` device: the zoo's GPT-2-style transformer block,
forward, eager on the device, each iteration ending with a synchronisation (``.cpu()`` of the result).

Plain eager launches one NEFF per op; adaptive eager (``torch.neuron.set_adaptive_eager(True)``) batches
the ops queued between synchronisations into one NEFF per run of functional ops. Both are timed after a
warm-up (their programs compiled), best of the iterations; prints host ms per forward, the estimated device
time of one forward (the programs' timeline estimates: one per op, or per batch), the ratios, the batches
formed and the results a batch did not have to write. numpy's BLAS runs on one thread: on a shared
machine, BLAS threads contending make the emulator's matmuls vary tenfold from one run to the next.

    .venv/bin/python -m benchmarks.adaptive_eager [--iterations 20] [--width 64 --tokens 32]
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported (see the docstring)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from neuronc.pytorch import adaptive  # noqa: E402
from tests import zoo  # noqa: E402


def per_forward_ms(block, x, iterations: int) -> tuple:
    """(best host ms per forward, estimated device us of one forward as its ops were queued, one per op)."""
    with torch.no_grad(), torch.device("neuron"):
        block(x).cpu()  # warm-up: compiles
        best = float("inf")
        for _ in range(iterations):
            start = time.perf_counter()
            block(x).cpu()
            best = min(best, time.perf_counter() - start)
        before, after = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        before.record()
        block(x)
        after.record()
        after.synchronize()
    return best * 1e3, before.elapsed_time(after) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    block = copy.deepcopy(zoo.TransformerBlock(width=options.width, heads=4)).eval().to("neuron")
    x = torch.randn(2, options.tokens, options.width).to("neuron")
    plain, device_us = per_forward_ms(block, x, options.iterations)
    torch.neuron.set_adaptive_eager(True)
    batched_before = dict(adaptive.stats)
    fused, _ = per_forward_ms(block, x, options.iterations)
    torch.neuron.set_adaptive_eager(False)
    per_forward = {k: (v - batched_before.get(k, 0)) / (options.iterations + 2) for k, v in adaptive.stats.items()}
    fused_device_us = device_us - per_forward.get("device ns saved", 0) / 1e3
    print(f"transformer block (width {options.width}, 2x{options.tokens} tokens), forward + sync, best of "
          f"{options.iterations}")
    print(f"  plain eager    {plain:8.2f} ms host   {device_us:8.1f} us estimated device time")
    print(f"  adaptive eager {fused:8.2f} ms host   {fused_device_us:8.1f} us estimated device time")
    print(f"                 (per forward: {per_forward.get('batched ops', 0):.0f} ops in "
          f"{per_forward.get('batches', 0):.0f} NEFFs, {per_forward.get('results not written', 0):.0f} results "
          f"not written)")
    print(f"  speed-up       {plain / fused:8.2f}x host   {device_us / fused_device_us:8.2f}x device")


if __name__ == "__main__":
    main()
