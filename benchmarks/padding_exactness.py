"""Would padding the key length keep the bits of generate()'s per-token ops? (issue 20, part 10)

A cold eager generate would compile, per new key length L, the two attention products and the softmax. Exact
shape buckets (neuronc/frontend/aten_buckets.py) need the padded program's real part to equal the exact-shape
program's bit for bit; these three are served by reordering buckets instead (the same terms, regrouped: part 12),
except under ``NEURON_EAGER_BUCKETS=exact``. This measures how often the bits differ, for the three ops at
decode shapes ([heads, 1, L]), each L against its bucket L' (the next power of two, or the next multiple of
--step), with every size compiled as its own program (buckets off):
  q @ K^T   the key length as the result's columns; K^T's extra columns random (any value: a column of the result
            reads only its own column of K^T);
  P @ V     the key length as the contraction; P's extra columns and V's extra rows zero (exact in value: 0 * 0
            adds +0);
  softmax   over the key length, padded with -inf (exp gives +0); also rows with -inf lanes and a row of only
            -inf (NaN in eager), compared NaN for NaN.
Prints, per op, the lengths whose real part differs in some bit. The emulator's fp32 matmul is numpy's BLAS, so
the figures depend on the OpenBLAS kernel numpy runs (printed; ``OPENBLAS_CORETYPE=Haswell`` forces another).

    .venv/bin/python -m benchmarks.padding_exactness [--lengths 2:130] [--step 0]
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["NEURON_EAGER_BUCKETS"] = "0"  # every size its own program: the exact-shape results compared
os.environ.setdefault("NEURON_CC_FLAGS", "--no_cache")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import glob  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

HEADS, HEAD_DIM = 4, 32


def blas_core() -> str:
    """The kernel set numpy's OpenBLAS chose for this CPU (DYNAMIC_ARCH builds pick it at load)."""
    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            getter = getattr(ctypes.CDLL(path), name, None)
            if getter is not None:
                getter.restype = ctypes.c_char_p
                return getter().decode()
    return "unknown"


def padded_to(n: int, step: int) -> int:
    if step:
        return -(-n // step) * step
    return n if n <= 1 else 1 << (n - 1).bit_length()


def on_neuron(fn, *inputs) -> torch.Tensor:
    return fn(*[x.to("neuron") for x in inputs]).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def differs(L: int, Lp: int) -> dict:
    """{op: whether the exact-shape program at L and the one at Lp (padded operands, real part) differ}."""
    extra = Lp - L
    q, kt = torch.randn(HEADS, 1, HEAD_DIM), torch.randn(HEADS, HEAD_DIM, L)
    p, v = torch.rand(HEADS, 1, L), torch.randn(HEADS, L, HEAD_DIM)
    scores = torch.randn(HEADS, 1, L) * 3
    masked = scores.clone()
    masked[0, 0, L // 2:] = float("-inf")
    masked[1] = float("-inf")  # eager: NaN
    minus_inf = torch.full((HEADS, 1, extra), float("-inf"))
    softmax = lambda x: torch.softmax(x, -1)  # noqa: E731
    return {
        "q @ K^T": not same_bits(on_neuron(torch.bmm, q, kt),
                                 on_neuron(torch.bmm, q, torch.cat([kt, torch.randn(HEADS, HEAD_DIM, extra)], -1))[
                                     ..., :L]),
        "P @ V": not same_bits(on_neuron(torch.bmm, p, v),
                               on_neuron(torch.bmm, torch.cat([p, torch.zeros(HEADS, 1, extra)], -1),
                                         torch.cat([v, torch.zeros(HEADS, extra, HEAD_DIM)], 1))),
        "softmax": not same_bits(on_neuron(softmax, scores),
                                 on_neuron(softmax, torch.cat([scores, minus_inf], -1))[..., :L]),
        "softmax, masked rows": not same_bits(on_neuron(softmax, masked),
                                              on_neuron(softmax, torch.cat([masked, minus_inf], -1))[..., :L]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2:130", help="key lengths, start:stop")
    parser.add_argument("--step", type=int, default=0, help="pad to a multiple of this (0: the next power of two)")
    options = parser.parse_args()
    import neuronc.pytorch  # noqa: F401  (the neuron device)

    torch.manual_seed(0)
    start, stop = map(int, options.lengths.split(":"))
    lengths = [L for L in range(start, stop) if padded_to(L, options.step) != L]
    found = {}
    for L in lengths:
        for op, bad in differs(L, padded_to(L, options.step)).items():
            found.setdefault(op, [])
            if bad:
                found[op].append(L)
    ladder = f"multiples of {options.step}" if options.step else "powers of two"
    print(f"OpenBLAS core {blas_core()}; {len(lengths)} key lengths in [{start}, {stop}) padded to {ladder}")
    for op, bad in found.items():
        print(f"  {op:22} {len(bad):4} differ  {bad}")


if __name__ == "__main__":
    main()
