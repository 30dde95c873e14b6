"""How close compiled programs come to the Trainium roofline (issue 4's cases), -O0 against -O2.

For each case: the estimated device time on trn2 (the cost model, the same rules the emulator's
clock uses), the roofline lower bound max(FLOPs / peak, minimal HBM bytes / HBM bandwidth), the
efficiency bound / time, HBM bytes moved against the minimum (inputs + weights + outputs once),
the kernel count, and the -O2 speed-up over -O0. Nothing is asserted: it prints measurements.

    python -m benchmarks.roofline [--cases matmul,softmax,...] [--quick] [--breakdown]

The whole-model cases are one GPT-2-small block and the 12-layer GPT-2-small forward (the zoo's GPT2: width
768, 12 heads, vocabulary 50257, sequence 512, bf16); --quick runs 128 tokens and 2 layers. Two cases go through
`torch.compile` as users run them, measuring the graphs AOTAutograd hands the backend (with the backend's
decompositions): `llama_layer`, the zoo's LlamaBlock at 2048 wide, GQA 16/4 heads, SwiGLU 5632, seq 1024, bf16,
under no_grad (one inference graph); `gpt2_train`, one GPT-2-small block (seq 512, bf16) forward + backward (the
forward and the backward graph; times, bounds and FLOPs summed over both), and `gpt2_train_sdpa`, the same block
with its attention through F.scaled_dot_product_attention(is_causal=True) (Hugging Face GPT-2's default). The
training cases' bound counts the model's FLOPs, those of the -O0 program of its graphs with attention decomposed
(full causal FLOPs, as the other cases), not the flash kernels' matmuls (causal blocks skipped, P recomputed).
--breakdown prints, for each case, where the -O2 program's time goes: each kind of kernel's share of the estimated time.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.instruction_cost import hbm_bytes
from neuronc.isa import Engine, Opcode
from neuronc.passes.cost_model import kernel_spans
from neuronc.targets import get_target
from runtime.metrics import matmul_flops, peak_tflops
from tests.zoo import GPT2, LlamaBlock, SdpaCausalSelfAttention, TransformerBlock


class MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class Mlp(nn.Module):
    def __init__(self, width, hidden, swiglu=False):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=not swiglu)
        self.gate = nn.Linear(width, hidden, bias=False) if swiglu else None
        self.down = nn.Linear(hidden, width, bias=not swiglu)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x) if self.gate is not None else F.gelu(self.up(x))
        return self.down(h)


class Norm(nn.Module):
    def __init__(self, kind, width):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        if self.kind == "softmax":
            return torch.softmax(x, -1)
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


class BasicBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.c2, self.b2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def _cases(quick: bool) -> dict:
    bf16 = torch.bfloat16
    n, tokens, seq = (1024, 128, 256) if quick else (4096, 512, 512)
    return {
        "matmul": (MatMul(), (torch.randn(n, n), torch.randn(n, n)), bf16),
        "gpt2_mlp": (Mlp(768, 3072), (torch.randn(tokens, 768),), bf16),
        "swiglu_mlp": (Mlp(2048, 5632, swiglu=True), (torch.randn(tokens, 2048),), bf16),
        "softmax": (Norm("softmax", n), (torch.randn(n, n),), torch.float32),
        "layernorm": (Norm("layernorm", n), (torch.randn(n, n),), torch.float32),
        "rmsnorm": (Norm("rmsnorm", n), (torch.randn(n, n),), torch.float32),
        "attention": (Attention(), tuple(torch.randn(1, 12, seq, 64) for _ in range(3)), bf16),
        "resnet_block": (BasicBlock(64), (torch.randn(2 if quick else 8, 64, 56, 56),), torch.float32),
        "gpt2_block": (TransformerBlock(768, 12), (torch.randn(1, tokens, 768),), bf16),
        "llama_layer": (LlamaBlock(512 if quick else 2048, 16, 4, 1408 if quick else 5632),
                        (torch.randn(1, 256 if quick else 1024, 512 if quick else 2048),), bf16),
        "gpt2_train": (TransformerBlock(768, 12), (torch.randn(1, tokens, 768),), bf16),
        "gpt2_train_sdpa": (TransformerBlock(768, 12, attention=SdpaCausalSelfAttention),
                            (torch.randn(1, tokens, 768),), bf16),
        "gpt2": (GPT2(vocab=50257, width=768, layers=2 if quick else 12, heads=12, context=1024),
                 (torch.randint(0, 50257, (1, tokens)),), bf16),
    }


def _minimal_bytes(neff) -> int:
    """Inputs, outputs, weights and constants, each once: a tied weight (GPT-2's token embedding and LM head)
    that the program holds twice, with the same values, counts once."""
    seen, total = set(), 0
    for t in neff.tensors:
        if t.kind.name not in ("INPUT", "OUTPUT", "WEIGHT", "CONSTANT"):
            continue
        key = (t.dtype, tuple(t.shape), hashlib.sha1(t.data.tobytes()).digest()) if t.data is not None else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def _measure(neff, target, model_ideal_ns=None) -> dict:
    """Measurements of one program; `model_ideal_ns`, the Tensor-engine time of the model's own FLOPs (the
    -O0 program's matmuls), replaces this program's when given: a kernel that skips masked blocks or adds
    transposes changes the FLOPs it executes, not the model's."""
    flops, ideal_ns, hbm = 0, 0.0, 0
    for (engine, _), stream in neff.streams.items():
        for inst in stream:
            if inst.opcode == Opcode.MATMUL:
                f = matmul_flops(inst)
                flops += f
                ideal_ns += f / (peak_tflops(target, inst.operands[1].dtype) * 1e3)
            elif engine == Engine.DMA:
                hbm += hbm_bytes(inst)
    minimum = _minimal_bytes(neff)
    ideal_ns = ideal_ns if model_ideal_ns is None else model_ideal_ns
    bound_ns = max(ideal_ns, minimum / target.hbm_gbps)  # bytes / (GB/s) = ns
    return {"time_us": neff.estimated_ns / 1e3, "bound_us": bound_ns / 1e3,
            "efficiency": bound_ns / neff.estimated_ns if neff.estimated_ns else 0.0,
            "hbm_ratio": hbm / minimum if minimum else 0.0, "kernels": len(neff.kernels), "flops": flops,
            "ideal_ns": ideal_ns}


# through torch.compile; True: forward + backward
COMPILED_CASES = {"llama_layer": False, "gpt2_train": True, "gpt2_train_sdpa": True}


def _aot_graphs(model, inputs, train: bool, flash: bool = True) -> list:
    """The FX graphs AOTAutograd hands a backend for `model(*inputs)` (and its backward when `train`), with the
    neuron backend's decompositions, as `torch.compile(model, backend="neuron")` would compile them; the graphs
    themselves run eagerly on the CPU here (only their compiled programs are measured). ``flash`` False: training
    graphs with attention decomposed into its dense ops (the model's own FLOPs, for the bound)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from neuronc.frontend.saved_views import default_partition_remaking_input_views
    from neuronc.frontend.sdpa_training import explicit_attention_as_sdpa
    from neuronc.frontend.torch_import import decomposition_table

    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    aot = aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=decomposition_table(train and flash),
                       partition_fn=default_partition_remaking_input_views)

    def backend(gm, example_inputs):  # as the neuron backend's _static_backend does
        if train and flash:
            explicit_attention_as_sdpa(gm)
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    if train:
        for p in model.parameters():
            p.requires_grad_(True)
        x = inputs[0].clone().requires_grad_(True)
        compiled(x).float().sum().backward()
    else:
        with torch.no_grad():
            compiled(*inputs)
    return graphs


def _measure_compiled(name, model, inputs, train, target) -> dict:
    """-O0 and -O2 of each AOTAutograd graph, measured as `_measure` does, summed over the graphs."""
    import copy

    from neuronc.compiler import compile_fx

    graphs = _aot_graphs(model, inputs, train)
    model_ideal = [None] * len(graphs)
    if train:  # the flash kernels' matmuls are not the model's FLOPs: those of its dense attention's -O0 program
        dense = _aot_graphs(model, inputs, train, flash=False)
        model_ideal = [_measure(compile_fx(gm, CompileOptions(opt_level=0, name=f"{name}_dense_{i}"),
                                           inputs_returned_as_given=True).neff,
                                target)["ideal_ns"] for i, gm in enumerate(dense)]
    results = {}
    for level in (0, 2):
        start = time.perf_counter()
        parts = []
        for i, gm in enumerate(graphs):
            neff = compile_fx(copy.deepcopy(gm), CompileOptions(opt_level=level, name=f"{name}_{i}"),
                              inputs_returned_as_given=True).neff
            ideal = model_ideal[i] if model_ideal[i] is not None else results[0]["parts"][i][1]["ideal_ns"] \
                if level else None
            parts.append((neff, _measure(neff, target, ideal)))
        time_us = sum(m["time_us"] for _, m in parts)
        bound_us = sum(m["bound_us"] for _, m in parts)
        moved = sum(m["hbm_ratio"] * _minimal_bytes(n) for n, m in parts)
        results[level] = {"time_us": time_us, "bound_us": bound_us, "efficiency": bound_us / time_us,
                          "hbm_ratio": moved / sum(_minimal_bytes(n) for n, _ in parts),
                          "kernels": sum(m["kernels"] for _, m in parts), "parts": parts,
                          "compile_s": time.perf_counter() - start}
    return results


def breakdown(neff, target) -> list:
    """[(kind of kernel, count, us)] of a program, largest first: what each kernel adds to the program's end
    time, in program order (its end past the latest end of the kernels before it). Kernels overlap (and
    prefetch their loads during the previous one), so this splits the estimated time exactly: shares sum to 1."""
    kinds: dict = {}
    reached = 0.0
    for index, (_, end) in sorted(kernel_spans(neff.streams, target).items()):
        kind = neff.kernels[index].name.rsplit("_", 1)[0] if 0 <= index < len(neff.kernels) else "(none)"
        count, ns = kinds.get(kind, (0, 0.0))
        kinds[kind] = (count + 1, ns + max(0.0, end - reached))
        reached = max(reached, end)
    return sorted(((kind, count, ns / 1e3) for kind, (count, ns) in kinds.items()), key=lambda k: -k[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a minute instead of many)")
    parser.add_argument("--breakdown", action="store_true", help="where each case's -O2 time goes, by kernel kind")
    args = parser.parse_args()
    target = get_target("trn2")
    cases = _cases(args.quick)
    chosen = [c for c in args.cases.split(",") if c] or list(cases)
    print(f"target trn2; estimated times from the cost model; {'quick shapes' if args.quick else 'issue 4 shapes'}")
    print(f"{'case':<14} {'O2 us':>10} {'bound us':>10} {'eff':>6} {'HBM/min':>8} {'kernels':>8} "
          f"{'O0 us':>10} {'O2/O0 speed-up':>15} {'compile s':>10}")
    for name in chosen:
        model, inputs, dtype = cases[name]
        model = model.eval().to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)  # token ids stay integers
        if name in COMPILED_CASES:
            results = _measure_compiled(name, model, inputs, COMPILED_CASES[name], target)
            neffs = [n for n, _ in results[2]["parts"]]
        else:
            program = torch.export.export(model, inputs)
            results = {}
            for level in (0, 2):
                start = time.perf_counter()
                neff = compile_exported(program, CompileOptions(opt_level=level, name=name)).neff
                model_ideal = results[0]["ideal_ns"] if level else None
                results[level] = _measure(neff, target, model_ideal) | {"compile_s": time.perf_counter() - start}
            neffs = [neff]
        o2, o0 = results[2], results[0]
        print(f"{name:<14} {o2['time_us']:>10.1f} {o2['bound_us']:>10.1f} {o2['efficiency']:>6.3f} "
              f"{o2['hbm_ratio']:>8.2f} {o2['kernels']:>8} {o0['time_us']:>10.1f} "
              f"{o0['time_us'] / o2['time_us']:>15.2f} {o2['compile_s']:>10.1f}", flush=True)
        if args.breakdown:
            for neff in neffs:
                shares = ", ".join(f"{kind} x{count} {us:.1f} us ({us * 1e3 / neff.estimated_ns:.0%})"
                                   for kind, count, us in breakdown(neff, target))
                print(f"{'':<14} where the time goes: {shares}", flush=True)


if __name__ == "__main__":
    main()
