"""The fp32 error of neuronc's DFT matmuls (neuronc/frontend/fft.py) against eager's FFT (pocketfft), by length.

The matrices fft.py puts in the graph are applied on the host in fp32 (torch's CPU matmul: fp32 sums, as the
Tensor engine's PSUM accumulates), to batches of unit-variance rows, and compared with `torch.fft.fft` in fp32 and
in float64. It prints, per length: values outside fp32's tolerance of eager (rtol 1e-4, atol 1e-5), eager's own
values outside that tolerance of float64, and the largest error from float64, ours over eager's. Lengths past
fft.MAX_LENGTH are measured too (the limit is lifted for the run): they are what the limit was chosen from.

    python -m benchmarks.fft_accuracy [--lengths 512 1024 4096] [--direct]

--direct measures one matmul per length (no split into factors), as fft.py did before the four-step split.
"""
from __future__ import annotations

import argparse

import torch

from neuronc.frontend import fft

RTOL, ATOL = 1e-4, 1e-5
BATCHES = 4
VALUES_PER_BATCH = 32768  # rows per batch: this many samples over the length (at least 4 rows)


def measure(n: int, generator) -> tuple:
    off = eager_off = total = 0
    ratio = 0.0
    rows = max(4, VALUES_PER_BATCH // n)
    for _ in range(BATCHES):
        x = torch.randn(rows, n, generator=generator)
        ours = fft.r2c(x, [1], fft.NORM_NONE, onesided=False)
        eager = torch.view_as_real(torch.fft.fft(x))
        exact = torch.view_as_real(torch.fft.fft(x.double()))
        off += (~torch.isclose(ours, eager, rtol=RTOL, atol=ATOL)).sum().item()
        eager_off += (~torch.isclose(eager.double(), exact, rtol=RTOL, atol=ATOL)).sum().item()
        total += eager.numel()
        ratio = max(ratio, (ours.double() - exact).abs().max().item() / (eager.double() - exact).abs().max().item())
    return off, eager_off, total, ratio


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 768, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--direct", action="store_true", help="one matmul per length, no split")
    args = parser.parse_args(argv)
    fft.MAX_LENGTH = max(args.lengths)
    if args.direct:
        fft.RADIX = fft.DIRECT_MAX = max(args.lengths)
    generator = torch.Generator().manual_seed(0)
    print(f"{'n':>6}  {'ours off eager':>18}  {'eager off float64':>17}  error from float64, ours / eager's")
    for n in args.lengths:
        off, eager_off, total, ratio = measure(n, generator)
        print(f"{n:>6}  {off:>7} / {total:<8}  {eager_off:>17}  {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
