"""The NKI-library kernels (neuronc.nki.library) against the compiler's own fusion of the same op, same shapes.

For each case: the estimated device time on trn2 of the kernel (traced and timed as a program of its own) and of
the program neuronc compiles from the PyTorch code of the same op at -O2, each against the roofline bound
max(FLOPs / peak, minimal HBM bytes / HBM bandwidth) as benchmarks/roofline.py computes it (FLOPs of the model: a
causal attention counts its unmasked half; minimal bytes: inputs and outputs once). Nothing is asserted: it
prints measurements, side by side, from one run.

    python -m benchmarks.kernels [--cases rmsnorm,attention_fwd,...] [--quick]
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn as nn

from neuronc.compiler import CompileOptions, compile_exported, compile_fx
from neuronc.nki.library import flash_attention_backward, flash_attention_forward, moe_combine, moe_dispatch, rmsnorm
from neuronc.targets import get_target


class RmsNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class CausalAttention(nn.Module):
    """The compiler's causal attention (benchmarks/roofline.py's case): q, k, v [batch, heads, seq, dim]."""

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


class Dispatch(nn.Module):
    def forward(self, x, slots):
        return x[slots]


class Combine(nn.Module):
    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens

    def forward(self, expert_out, slots, gates):
        return torch.zeros(self.tokens, expert_out.shape[1]).index_add(0, slots, expert_out * gates[:, None])


def _compiled_ns(model, inputs) -> float:
    program = torch.export.export(model.eval(), inputs)
    return compile_exported(program, CompileOptions(opt_level=2)).neff.estimated_ns


def _attention_backward_ns(heads: int, seq: int, dim: int) -> float:
    """The backward graph AOTAutograd makes of the causal attention, compiled by neuronc."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    graphs = {}

    def capture(name):
        def compiler(gm, inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    fn = aot_function(CausalAttention().forward, fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    q, k, v = (torch.randn(1, heads, seq, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn(q, k, v).sum().backward()
    return compile_fx(graphs["bw"], CompileOptions(opt_level=2)).neff.estimated_ns


def _kernel_ns(kernel, *args, **kwargs) -> float:
    return kernel.trace(*args, **kwargs).to_neff().estimated_ns


def _bound_ns(flops: float, nbytes: int, target, dtype_peak: float) -> float:
    return max(flops / (dtype_peak * 1e3), nbytes / target.hbm_gbps)


def _cases(quick: bool) -> dict:
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    rows = 1024 if quick else 4096
    seq = 512 if quick else 2048
    heads, dim = 12, 64
    tokens, width, experts, capacity = (512, 768, 8, 128) if quick else (2048, 2048, 8, 512)
    return {
        "rmsnorm": dict(rows=rows, width=rows),
        "attention_fwd": dict(heads=heads, seq=seq, dim=dim, dtype=bf16),
        "attention_bwd": dict(heads=heads, seq=seq, dim=dim, dtype=bf16),
        "moe_dispatch": dict(tokens=tokens, width=width, slots=experts * capacity),
        "moe_combine": dict(tokens=tokens, width=width, slots=experts * capacity),
    }


def measure(name: str, c: dict, target) -> tuple:
    """(kernel ns, compiler ns, bound ns)."""
    peak_fp32, peak_bf16 = target.matmul_tflops_fp32, target.matmul_tflops_bf16
    if name == "rmsnorm":
        rows, width = c["rows"], c["width"]
        x, w = np.empty((rows, width), np.float32), np.empty(width, np.float32)
        mine = _kernel_ns(rmsnorm, x, w, 1e-6)
        theirs = _compiled_ns(RmsNorm(width), (torch.randn(rows, width),))
        return mine, theirs, _bound_ns(0, (2 * rows * width + width) * 4, target, peak_fp32)
    if name.startswith("attention"):
        h, s, d = c["heads"], c["seq"], c["dim"]
        q = np.empty((h, s, d), c["dtype"])
        io = 2 * q.nbytes
        if name == "attention_fwd":
            mine = _kernel_ns(flash_attention_forward, q, q, q)
            theirs = _compiled_ns(CausalAttention().to(torch.bfloat16),
                                  tuple(torch.randn(1, h, s, d, dtype=torch.bfloat16) for _ in range(3)))
            return mine, theirs, _bound_ns(2 * h * s * s * d, 4 * io, target, peak_bf16)
        lse = np.empty((h, s), np.float32)
        mine = _kernel_ns(flash_attention_backward, q, q, q, q, q, lse)
        theirs = _attention_backward_ns(h, s, d)
        return mine, theirs, _bound_ns(5 * h * s * s * d, 8 * io, target, peak_bf16)
    tokens, width, slots = c["tokens"], c["width"], c["slots"]
    index = np.random.default_rng(0).integers(0, tokens, slots).astype(np.int32)
    if name == "moe_dispatch":
        x = np.empty((tokens, width), np.float32)
        mine = _kernel_ns(moe_dispatch, x, index)
        theirs = _compiled_ns(Dispatch(), (torch.randn(tokens, width), torch.from_numpy(index).long()))
        return mine, theirs, _bound_ns(0, (2 * slots * width) * 4 + slots * 4, target, peak_fp32)
    out = np.empty((slots, width), np.float32)
    gates = np.empty(slots, np.float32)
    mine = _kernel_ns(moe_combine, out, index, gates, tokens)
    theirs = _compiled_ns(Combine(tokens), (torch.randn(slots, width), torch.from_numpy(index).long(),
                                            torch.rand(slots)))
    return mine, theirs, _bound_ns(0, (slots * width + tokens * width) * 4 + slots * 8, target, peak_fp32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args()
    target = get_target("trn2")
    cases = _cases(args.quick)
    chosen = [c for c in args.cases.split(",") if c] or list(cases)
    print(f"target trn2; estimated times from the cost model; {'quick shapes' if args.quick else 'full shapes'}")
    print(f"{'case':<15} {'shape':<34} {'NKI us':>9} {'eff':>6} {'compiler us':>12} {'eff':>6} {'NKI/compiler':>13} "
          f"{'s':>6}")
    for name in chosen:
        start = time.perf_counter()
        mine, theirs, bound = measure(name, cases[name], target)
        shape = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in cases[name].items() if k != "dtype")
        print(f"{name:<15} {shape:<34} {mine / 1e3:>9.1f} {bound / mine:>6.3f} {theirs / 1e3:>12.1f} "
              f"{bound / theirs:>6.3f} {mine / theirs:>13.2f} {time.perf_counter() - start:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
