"""The cyclic garbage collector's share of the CPU time of eager ops at new shapes (issue 20).

A 5-op chain, ``(x * 2.0).relu().softmax(-1).exp() + x``, runs at ``--shapes`` new row counts on the `neuron`
device, each call a new program (compile, load, first run); every collection in that time is timed through
``gc.callbacks``. ``--freeze`` first moves every object alive after start-up to the collector's permanent
generation (``gc.freeze()``), to show what the full collections cost is made of: torch's heap rescanned.
Run with ``NEURON_CC_FLAGS=--no_cache`` so that every program is compiled.

    NEURON_CC_FLAGS=--no_cache .venv/bin/python -m benchmarks.eager_gc [--shapes 28] [--freeze]
"""
from __future__ import annotations

import argparse
import gc
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=28)
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() after start-up")
    options = parser.parse_args()
    from neuronc.pytorch import eager

    x = torch.randn(4, 16).to("neuron")
    (x * 2.0).relu().softmax(-1).exp() + x  # imports and the first compiles, not measured
    torch.accelerator.synchronize()
    heap = len(gc.get_objects())
    if options.freeze:
        gc.collect()
        gc.freeze()
    before = len(eager.programs)
    collections, started = [], []

    def timed(phase, info):
        if phase == "start":
            started[:] = [time.process_time()]
        else:
            collections.append((info["generation"], time.process_time() - started[0]))

    gc.callbacks.append(timed)
    start = time.process_time()
    try:
        for rows in range(5, 5 + options.shapes):
            x = torch.randn(rows, 16).to("neuron")
            (x * 2.0).relu().softmax(-1).exp() + x
        torch.accelerator.synchronize()
    finally:
        gc.callbacks.remove(timed)
    total = time.process_time() - start
    collected = sum(seconds for _, seconds in collections)
    print(f"{len(eager.programs) - before} new programs, {total:.2f} s CPU, of which the collector {collected:.3f} s "
          f"({100 * collected / total:.0f}%); tracked objects at the start {heap}{' (then frozen)' if options.freeze else ''}")
    for generation in (0, 1, 2):
        times = [seconds for g, seconds in collections if g == generation]
        print(f"  generation {generation}: {len(times)} collections, {sum(times) * 1e3:.1f} ms "
              f"({', '.join(f'{t * 1e3:.1f}' for t in times[:6])}{' ...' if len(times) > 6 else ''})")


if __name__ == "__main__":
    main()
