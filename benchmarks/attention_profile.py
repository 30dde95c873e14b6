"""Where the attention kernel's time goes: issue 4's causal self-attention (12 heads x 64, bf16) at several
sequence lengths, on trn2, from the cost model (the emulator's clock).

For each length and head dim: the -O2 estimate, the roofline bound (the FLOPs of the unfused model, full QK^T and
PV, at the bf16 peak, or its minimal HBM traffic), the efficiency, the same against the causal bound (half the
FLOPs, TRAINIUM.md's convention, or the minimal HBM traffic), and each engine's busy time (DMA summed over its
queues and divided by their count), with the opcodes costing most. Nothing is asserted.

With ``--floor``, also the least time any flash-attention schedule can take on the cost model (:func:`floor_ns`)
and so the best efficiency against the causal bound that the documented engine rates allow.

    python -m benchmarks.attention_profile [--seq 512,2048] [--head-dims 64] [--heads 12] [--floor]
"""
from __future__ import annotations

import argparse
import collections
import logging

import torch

from benchmarks.roofline import Attention
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.instruction_cost import dma_transfer_ns, engine_pass_ns, instruction_cost_ns, matmul_pass_ns
from neuronc.isa import Engine, Opcode
from neuronc.targets import Target, get_target

log = logging.getLogger(__name__)


def floor_ns(heads: int, seq: int, head_dim: int, least_bytes: int, target: Target) -> float:
    """The least time of causal attention over 128 x 128 score blocks on ``target``'s documented costs
    (instruction_cost's rules), whatever the schedule: each engine's unavoidable work per block, with the
    choices a kernel has placed by a linear program, and no engine ever idle.

    Per block of scores the diagonal needs (the blocks on it computed whole: a 128-row block is the Tensor
    engine's unit, and narrower matmuls cost as many cycles): S = QK^T and O += P V on the Tensor engine; the
    row max of S, which must read S in fp32 PSUM (the engines that can: Vector, one pass; or Scalar copying it to
    SBUF for GpSimd's max, which cannot read PSUM; Scalar has no max reduction), because without it exp overflows;
    exp(S - max) on the Scalar engine (the only one with activation functions); P^T for the PV matmul, either a
    Tensor-engine transpose evacuated from PSUM by Vector (performance mode) or Scalar, or a DMA transpose SBUF ->
    SBUF on the queues. The queues also move Q, K, V and O once (``least_bytes``), and HBM bounds those bytes."""
    from scipy.optimize import linprog

    tiles = seq // target.partitions
    blocks = heads * tiles * (tiles + 1) // 2
    p = target.partitions
    tensor = matmul_pass_ns(p, False, target) + matmul_pass_ns(head_dim, False, target)
    transpose = matmul_pass_ns(p, False, target)
    exp = engine_pass_ns(Engine.SCALAR, p, 1, target)
    max_vector = engine_pass_ns(Engine.VECTOR, p, 1, target)  # fp32 from PSUM: no performance mode
    copy_scalar = engine_pass_ns(Engine.SCALAR, p, 1, target)
    max_gpsimd = engine_pass_ns(Engine.GPSIMD, p, 1, target)
    evacuate_vector = engine_pass_ns(Engine.VECTOR, p, 1, target, speedup=2.0)  # bf16 PSUM -> SBUF copy
    evacuate_scalar = engine_pass_ns(Engine.SCALAR, p, 1, target)
    dma_transpose = p * p * 2 / (target.dma_gbps_per_queue * target.dma_transpose_sbuf_fraction) / target.dma_queues
    loads = dma_transfer_ns(least_bytes, True, target) / blocks / target.dma_queues
    # variables: a (share of maxes on Vector), t (share of P^T on the Tensor engine), v, s (of those evacuated by
    # Vector, Scalar), T (ns per block); minimise T
    rows = [
        [0, transpose, 0, 0, -1],                  # Tensor: tensor + t * transpose <= T
        [-copy_scalar, 0, 0, evacuate_scalar, -1],  # Scalar: exp + (1 - a) copy + s evacuate <= T
        [max_vector, 0, evacuate_vector, 0, -1],   # Vector
        [-max_gpsimd, 0, 0, 0, -1],                # GpSimd: (1 - a) max
        [0, -dma_transpose, 0, 0, -1],             # queues: (1 - t) DMA transposes + the loads
    ]
    limits = [-tensor, -(exp + copy_scalar), 0, -max_gpsimd, -(dma_transpose + loads)]
    best = linprog([0, 0, 0, 0, 1], A_ub=rows, b_ub=limits, A_eq=[[0, 1, -1, -1, 0]], b_eq=[0],
                   bounds=[(0, 1)] * 4 + [(0, None)])
    log.debug("attention floor: a %.3f, t %.3f, v %.3f, s %.3f; %.1f ns a block", *best.x)
    return max(blocks * best.x[4], least_bytes / target.hbm_sustained_gbps)


def profile(heads: int, seq: int, head_dim: int = 64, floor: bool = False) -> None:
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
    if floor:
        least = floor_ns(heads, seq, head_dim, least_bytes, target)
        print(f"  floor {least / 1e3:.1f} us: at best efficiency {bound_ns / least:.3f}, causal {causal_ns / least:.3f}")
    print("  busy us: " + ", ".join(f"{name.lower()} {ns / 1e3:.1f}" for name, ns in sorted(busy.items())))
    print("  most time: " + ", ".join(f"{name} {ns / 1e3:.1f}" for name, ns in by_opcode.most_common(6)
                                      if not name.startswith("dma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="512,2048", help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", default="64", help="comma-separated head dims")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--floor", action="store_true", help="also the least time the engines' costs allow")
    args = parser.parse_args()
    for seq in (int(s) for s in args.seq.split(",")):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            profile(args.heads, seq, head_dim, args.floor)


if __name__ == "__main__":
    main()
