"""Where a row-wise kernel's time goes: the GPT-2-small block's layer-norm (512 tokens x 768, bf16, four row
tiles: latency-bound) and issue 4's memory-bound normalisations over (4096, 4096) fp32, on trn2, from the cost
model (the emulator's clock).

For each case: the -O2 estimate, the roofline bound (its minimal HBM traffic at the HBM bandwidth), the
efficiency, each engine's busy time (DMA summed over its queues and divided by their count), the schedule the
pass priced cheapest (passes/rowwise_schedule.py) and the passes over the row one row tile makes (an instruction
over part of the columns, a cut tail's half, counts its share). Nothing is asserted.

    python -m benchmarks.rowwise_profile [--cases gpt2_layernorm,layernorm,softmax,rmsnorm]
"""
from __future__ import annotations

import argparse
import collections

import torch
import torch.nn as nn

from benchmarks.roofline import Norm
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import Engine
from neuronc.targets import get_target

CASES = {
    "gpt2_layernorm": (lambda: nn.LayerNorm(768), (512, 768), torch.bfloat16),
    "layernorm": (lambda: Norm("layernorm", 4096), (4096, 4096), torch.float32),
    "softmax": (lambda: Norm("softmax", 4096), (4096, 4096), torch.float32),
    "rmsnorm": (lambda: Norm("rmsnorm", 4096), (4096, 4096), torch.float32),
}


def profile(name: str) -> None:
    make, shape, dtype = CASES[name]
    target = get_target("trn2")
    x = torch.randn(*shape).to(dtype)
    compiled = compile_exported(torch.export.export(make().to(dtype).eval(), (x,)), CompileOptions(opt_level=2))
    neff = compiled.neff
    least_bytes = sum(t.nbytes for t in neff.tensors if t.kind.name in ("INPUT", "OUTPUT", "WEIGHT", "CONSTANT"))
    bound_ns = least_bytes / target.hbm_gbps
    busy = collections.Counter()
    row_passes = 0.0
    for (engine, _), stream in neff.streams.items():
        for inst in stream:
            busy[Engine(engine).name.lower()] += instruction_cost_ns(inst, target) / (
                target.dma_queues if engine == Engine.DMA else 1)
            columns = max(ap.free_elements for ap in inst.operands)
            if engine != Engine.DMA and inst.dst.partitions == target.partitions and columns > 1:
                row_passes += columns / shape[1]
    print(f"{name} {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')}: {neff.estimated_ns / 1e3:.1f} us, "
          f"bound {bound_ns / 1e3:.1f} us, efficiency {bound_ns / neff.estimated_ns:.2f}")
    print("  busy us: " + ", ".join(f"{engine} {ns / 1e3:.1f}" for engine, ns in sorted(busy.items())))
    tiles = shape[0] // target.partitions
    (schedule,) = [n.attrs["schedule"] for n in compiled.graph.nodes() if "schedule" in n.attrs]
    print(f"  {schedule}")
    print(f"  passes over the row per row tile: {row_passes / tiles:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    for name in parser.parse_args().cases.split(","):
        profile(name)


if __name__ == "__main__":
    main()
