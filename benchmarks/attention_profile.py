"""Where the attention kernel's time goes: issue 4's causal self-attention (12 heads x 64, bf16) at several
sequence lengths, on trn2, from the cost model (the emulator's clock).

For each length and head dim: the -O2 estimate, the roofline bound (the FLOPs of the unfused model, full QK^T and
PV, at the bf16 peak, or its minimal HBM traffic), the efficiency, the same against the causal bound (half the
FLOPs, TRAINIUM.md's convention, or the minimal HBM traffic), and each engine's busy time (DMA summed over its
queues and divided by their count), with the opcodes costing most. Nothing is asserted.

    python -m benchmarks.attention_profile [--seq 512,2048] [--head-dims 64] [--heads 12]
"""
from __future__ import annotations

import argparse
import collections

import torch

from benchmarks.roofline import Attention
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import Engine, Opcode
from neuronc.targets import get_target


def profile(heads: int, seq: int, head_dim: int = 64) -> None:
    target = get_target("trn2")
    inputs = tuple(torch.randn(1, heads, seq, head_dim).to(torch.bfloat16) for _ in range(3))
    neff = compile_exported(torch.export.export(Attention().eval(), inputs), CompileOptions(opt_level=2)).neff
    flops = 2 * 2 * heads * seq * seq * head_dim  # the model's QK^T and PV, as unfused -O0 computes them
    least_bytes = sum(t.nbytes for t in neff.tensors if t.kind.name in ("INPUT", "OUTPUT", "WEIGHT", "CONSTANT"))
    bound_ns = max(flops / (target.matmul_tflops_bf16 * 1e3), least_bytes / target.hbm_gbps)
    causal_ns = max(flops / 2 / (target.matmul_tflops_bf16 * 1e3), least_bytes / target.hbm_gbps)
    busy, by_opcode = collections.Counter(), collections.Counter()
    for (engine, _), stream in neff.streams.items():
        for inst in stream:
            ns = instruction_cost_ns(inst, target)
            name = Engine(engine).name
            busy[name] += ns / (target.dma_queues if engine == Engine.DMA else 1)
            by_opcode[f"{name.lower()} {Opcode(inst.opcode).name}"] += ns
    print(f"seq {seq}, head dim {head_dim}: {neff.estimated_ns / 1e3:.1f} us, bound {bound_ns / 1e3:.1f} us, "
          f"efficiency {bound_ns / neff.estimated_ns:.3f}; causal bound {causal_ns / 1e3:.1f} us, "
          f"efficiency {causal_ns / neff.estimated_ns:.3f}")
    print("  busy us: " + ", ".join(f"{name.lower()} {ns / 1e3:.1f}" for name, ns in sorted(busy.items())))
    print("  most time: " + ", ".join(f"{name} {ns / 1e3:.1f}" for name, ns in by_opcode.most_common(6)
                                      if not name.startswith("dma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="512,2048", help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", default="64", help="comma-separated head dims")
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args()
    for seq in (int(s) for s in args.seq.split(",")):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            profile(args.heads, seq, head_dim)


if __name__ == "__main__":
    main()
