"""FlexAttention's estimated device time against the built-in attention paths, side by side in one run.

Each program is captured as torch.compile(backend="neuron") captures it (Dynamo, AOTAutograd's forward graph)
and compiled by neuronc at -O2 for trn2; the figure is the NEFF's estimated device time (nothing is run).

* causal: flex_attention with a causal block_mask against the compiler's built-in causal path (softmax of
  masked_fill(~tril) scores @ v, which the attention pass fuses into its flash kernel with the on-chip causal
  mask: benchmarks/kernels.py's case) at seq 2048 (issue 19: within 10% of its time); and, for information,
  scaled_dot_product_attention(is_causal=True);
* sliding window: flex_attention with a sliding-window block_mask (window 256) at seq 1024..4096, against the
  same program without a mask: the windowed time should grow with the sequence (queries), not with its square;
* document mask (per-token document ids the graph takes) and GQA (2 key/value heads), for information: the flash
  kernel against the same program without a mask / with every head's K and V, and the document mask against the
  dense lowering of the same mask (written to read the head index, compiled with
  `frontend.flex_attention.LIBRARY_KERNELS_FOR_TRAINING` off, which keeps it out of the flash kernels);
* training (forward and backward graphs): the flash kernels (the NKI library's forward with the log-sum-exp and
  its backward) against the dense forward and backward of the same program (compiled with
  `frontend.flex_attention.LIBRARY_KERNELS_FOR_TRAINING` off), time and the NEFFs' HBM sizes, for a causal mask,
  relative position bias + causal, ALiBi + sliding window, soft-capping, prefix-LM and a document mask, and
  score_mods reading tensors the score_mod captures (ALiBi's slopes as a tensor, a learned relative-bias table with
  its gradient);
* score_mods reading tensors in inference: the library's flash forward (the reads computed by the graph, read per
  block) against the dense lowering of the same program, time and HBM.

Nothing is asserted: it prints measurements.

    python -m benchmarks.flex_attention [--heads 8] [--dim 64] [--dtype bf16] [--quick] [--training-only]
                                        [--reads-only] [--case NAME]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import neuronc.frontend.flex_attention as flex_frontend
from neuronc.compiler import CompileOptions, compile_fx


class _Captured(Exception):
    pass


def compiled_ns(fn, inputs) -> tuple:
    """(estimated ns, kernel count) of ``fn``'s forward graph as the neuron backend compiles it."""
    neff = compiled_neff(fn, inputs)
    return neff.estimated_ns, len(neff.kernels)


def compiled_neff(fn, inputs):
    """The NEFF of ``fn``'s forward graph as the neuron backend compiles it."""
    from torch._dynamo.backends.common import aot_autograd

    from neuronc.frontend.torch_import import decomposition_table

    graphs = {}

    def capture(gm, example_inputs):
        graphs["fw"] = gm
        raise _Captured

    def backend(gm, example_inputs):
        return aot_autograd(fw_compiler=capture, decompositions=decomposition_table())(gm, example_inputs)

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend)(*inputs)
    except Exception as e:  # Dynamo wraps the capture's exception
        if "fw" not in graphs:
            raise e
    return compile_fx(graphs["fw"], CompileOptions(opt_level=2)).neff


def training_ns(fn, inputs) -> tuple:
    """(estimated ns, HBM bytes) of ``fn``'s forward and backward graphs, summed, as the neuron backend compiles
    them (nothing is run but the forward graph, op by op on `neuron` tensors, to reach the backward)."""
    from torch._dynamo.backends.common import aot_autograd

    from neuronc.frontend.torch_import import decomposition_table

    graphs = {}

    def forward(gm, example_inputs):
        graphs["fw"] = gm
        return gm

    def backward(gm, example_inputs):
        graphs["bw"] = gm
        raise _Captured

    import neuronc.pytorch  # noqa: F401 - the `neuron` device: flex_attention refuses a backward on CPU tensors

    torch._dynamo.reset()
    inputs = [x.to("neuron").requires_grad_() for x in inputs]
    try:
        out = torch.compile(fn, backend=aot_autograd(fw_compiler=forward, bw_compiler=backward,
                                                     decompositions=decomposition_table()))(*inputs)
        out.sum().backward()
    except Exception as e:  # Dynamo wraps the capture's exception
        if "bw" not in graphs:
            raise e
    neffs = [compile_fx(graphs[g], CompileOptions(opt_level=2)).neff for g in ("fw", "bw")]
    return sum(n.estimated_ns for n in neffs), sum(n.hbm_size for n in neffs)


def _flex(mask_mod, seq: int, gqa: bool = False, score_mod=None, device: str = "cpu"):
    mask = create_block_mask(mask_mod, None, None, seq, seq, device=device) if mask_mod else None
    return lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)


def _documents(seq: int, per_head: bool = False):
    """Four documents of seq / 4 tokens; ``per_head``: the same mask written to read the head index (with the
    library kernels off, the dense lowering: the peer)."""
    ids = torch.arange(seq) * 4 // seq

    def document(b, h, q, kv):
        return ids[q] == ids[kv]

    def document_per_head(b, h, q, kv):
        return (ids[q] == ids[kv]) & (h >= 0)

    return document_per_head if per_head else document


def _builtin_causal(q, k, v):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


def _causal(b, h, q, kv):
    return q >= kv


def _window(width: int):
    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv < width)

    return sliding_window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="seq 512 for causal, 512..1024 for the window")
    parser.add_argument("--training-only", action="store_true", help="only the training comparison")
    parser.add_argument("--case", default="", help="only the training cases whose name contains this")
    parser.add_argument("--reads-only", action="store_true",
                        help="only the score_mods reading captured tensors (inference, then training)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    def qkv(seq):
        return tuple(torch.randn(1, args.heads, seq, args.dim, dtype=dtype) for _ in range(3))

    print(f"trn2, -O2, batch 1, {args.heads} heads, head dim {args.dim}, {args.dtype}; estimated device time")
    if args.reads_only:
        reads(args, qkv)
        args.case = args.case or "tensor"
        training(args, qkv)
        return
    if not args.training_only:
        inference(args, qkv)
        reads(args, qkv)
    training(args, qkv)


def inference(args, qkv) -> None:
    causal_seq = 512 if args.quick else 2048
    print(f"\ncausal at seq {causal_seq}")
    builtin, builtin_kernels = compiled_ns(_builtin_causal, qkv(causal_seq))
    sdpa, sdpa_kernels = compiled_ns(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     qkv(causal_seq))
    flex, kernels = compiled_ns(_flex(_causal, causal_seq), qkv(causal_seq))
    print(f"  {'built-in causal (masked_fill tril)':<36} {builtin / 1e3:>10.1f} us  ({builtin_kernels} kernel(s))")
    print(f"  {'sdpa(is_causal=True)':<36} {sdpa / 1e3:>10.1f} us  ({sdpa_kernels} kernel(s))")
    print(f"  {'flex_attention, causal block_mask':<36} {flex / 1e3:>10.1f} us  ({kernels} kernel(s))")
    print(f"  flex / built-in causal: {flex / builtin:.3f}   flex / sdpa: {flex / sdpa:.3f}")

    print(f"\nsliding window {args.window}")
    print(f"  {'seq':>6} {'window us':>10} {'us per 1k queries':>18} {'no mask us':>11} {'window / no mask':>17}")
    for seq in ((512, 1024) if args.quick else (1024, 2048, 4096)):
        windowed, _ = compiled_ns(_flex(_window(args.window), seq), qkv(seq))
        full, _ = compiled_ns(_flex(None, seq), qkv(seq))
        print(f"  {seq:>6} {windowed / 1e3:>10.1f} {windowed / 1e3 / (seq / 1024):>18.1f} {full / 1e3:>11.1f} "
              f"{windowed / full:>17.3f}")

    seq = causal_seq
    print(f"\nat seq {seq}")
    full, full_kernels = compiled_ns(_flex(None, seq), qkv(seq))
    documents, doc_kernels = compiled_ns(_flex(_documents(seq), seq), qkv(seq))
    flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = False  # else a mask reading the head runs the library's kernel
    try:
        dense, dense_kernels = compiled_ns(_flex(_documents(seq, per_head=True), seq), qkv(seq))
    finally:
        flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = True
    q, k, v = qkv(seq)
    gqa, gqa_kernels = compiled_ns(_flex(None, seq, gqa=True), (q, k[:, :2], v[:, :2]))
    print(f"  {'flex_attention, no mask':<36} {full / 1e3:>10.1f} us  ({full_kernels} kernel(s))")
    print(f"  {'document mask (4 documents, ids)':<36} {documents / 1e3:>10.1f} us  ({doc_kernels} kernel(s))"
          f"  / no mask: {documents / full:.3f}")
    print(f"  {'document mask, dense lowering':<36} {dense / 1e3:>10.1f} us  ({dense_kernels} kernel(s))"
          f"  flash / dense: {documents / dense:.3f}")
    print(f"  {'GQA, 2 key/value heads, no mask':<36} {gqa / 1e3:>10.1f} us  ({gqa_kernels} kernel(s))"
          f"  / no mask: {gqa / full:.3f}")



def reads(args, qkv) -> None:
    """Score_mods reading captured tensors in inference: the flash path against the dense lowering."""
    seq = 512 if args.quick else 2048
    print(f"\nscore_mods reading tensors, causal, seq {seq}: flash (library forward, the tensors' reads computed by the "
          f"graph) vs dense lowering")
    print(f"  {'case':<36} {'flash us':>10} {'dense us':>10} {'time':>6} {'flash MiB':>10} {'dense MiB':>10} "
          f"{'HBM':>6}")
    slopes, table = _captured_tensors(args.heads, seq, "cpu", qkv(seq)[0].dtype)
    for name, score_mod in (("ALiBi, slopes a tensor", _alibi_slopes(slopes)),
                            ("learned bias table", _bias_table(table, seq))):
        flash = compiled_neff(_flex(_causal, seq, score_mod=score_mod), qkv(seq))
        flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = False
        try:
            dense = compiled_neff(_flex(_causal, seq, score_mod=score_mod), qkv(seq))
        finally:
            flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = True
        print(f"  {name:<36} {flash.estimated_ns / 1e3:>10.1f} {dense.estimated_ns / 1e3:>10.1f} "
              f"{flash.estimated_ns / dense.estimated_ns:>6.3f} {flash.hbm_size / 2**20:>10.1f} "
              f"{dense.hbm_size / 2**20:>10.1f} {flash.hbm_size / dense.hbm_size:>6.3f}")


def _captured_tensors(heads: int, seq: int, device: str, dtype) -> tuple:
    """ALiBi's per-head slopes (2^(-8 (h + 1) / heads)) and a learned relative-bias table [heads, 2 seq - 1], in
    the model's dtype."""
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads).to(dtype).to(device)
    table = (torch.randn(heads, 2 * seq - 1) * 0.5).to(dtype).to(device)
    return slopes, table


def _alibi_slopes(slopes):
    def alibi_slopes(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    return alibi_slopes


def _bias_table(table, seq: int):
    def bias_table(score, b, h, q, kv):
        return score + table[h, q - kv + seq - 1]

    return bias_table



def training(args, qkv) -> None:
    seq = 512 if args.quick else 1024
    print(f"\ntraining (forward + backward graphs), seq {seq}: flash kernels (library fwd + bwd) vs dense lowering")
    print(f"  {'case':<28} {'flash us':>10} {'dense us':>10} {'time':>6} {'flash MiB':>10} {'dense MiB':>10} "
          f"{'HBM':>6}")
    for name, score_mod, mask_mod in training_cases(seq, args.heads, args.window, qkv(seq)[0].dtype):
        if args.case not in name:
            continue
        flash, flash_hbm = training_ns(_flex(mask_mod, seq, score_mod=score_mod, device="neuron"), qkv(seq))
        flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = False
        try:
            dense, dense_hbm = training_ns(_flex(mask_mod, seq, score_mod=score_mod, device="neuron"), qkv(seq))
        finally:
            flex_frontend.LIBRARY_KERNELS_FOR_TRAINING = True
        print(f"  {name:<28} {flash / 1e3:>10.1f} {dense / 1e3:>10.1f} {flash / dense:>6.3f} "
              f"{flash_hbm / 2**20:>10.1f} {dense_hbm / 2**20:>10.1f} {flash_hbm / dense_hbm:>6.3f}")


def training_cases(seq: int, heads: int, window: int, dtype=torch.bfloat16) -> list:
    """(name, score_mod, mask_mod) of the training comparison."""
    def relative_bias(score, b, h, q, kv):
        return score + (q - kv) * 0.05

    def alibi(score, b, h, q, kv):
        return score + (kv - q) * torch.exp2(-(h + 1) * 8.0 / heads)

    def soft_cap(score, b, h, q, kv):
        return torch.tanh(score / 20.0) * 20.0

    def clamp(score, b, h, q, kv):
        return torch.clamp(score, -5.0, 5.0)

    def every_key(b, h, q, kv):  # block_mask=None's noop mask is built in the graph with ops compile_fx refuses
        return q >= 0

    def prefix_lm(b, h, q, kv):
        return (kv < seq // 4) | (q >= kv)

    import neuronc.pytorch  # noqa: F401 - the `neuron` device

    ids = torch.arange(seq) * 4 // seq
    documents = ids.to("neuron")

    def document(b, h, q, kv):
        return documents[q] == documents[kv]

    slopes, table = _captured_tensors(heads, seq, "neuron", dtype)
    table.requires_grad_()  # learned: its gradient is part of the backward

    return [("causal", None, _causal), ("relative bias + causal", relative_bias, _causal),
            ("ALiBi slopes tensor + causal", _alibi_slopes(slopes), _causal),
            ("bias table tensor (learned) + causal", _bias_table(table, seq), _causal),
            (f"ALiBi + window {window}", alibi, _window(window)), ("soft cap, no mask", soft_cap, every_key),
            ("prefix-LM", None, prefix_lm), ("document mask (4, ids)", None, document),
            ("clamp +-5 + causal", clamp, _causal)]


if __name__ == "__main__":
    main()
