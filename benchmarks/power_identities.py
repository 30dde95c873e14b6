"""Which multiplies give numpy's float32 power bit for bit, over every float32 input: the identity the emulator's
TENSOR_SCALAR POW kernel relies on (runtime.semantics: POW by 2 computed as x * x), to check again when numpy
changes. The instruction's meaning is numpy's float32 ``power`` as the semantics call it (a fresh contiguous fp32
array and a 0-d fp32 exponent), which is not the C library's powf on every machine.

    .venv/bin/python -m benchmarks.power_identities [--cube-sample 200000]

Prints, for x ** 2, how many of the 2**32 inputs differ from x * x (NaN payloads included; ~10 s); for x ** 3, how
many of a sample differ from the fp64 product x * x * x rounded once to fp32 (the whole range would take ~5 min).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

F32 = np.float32
CHUNK = 1 << 24


def square_differences() -> int:
    """Inputs among all 2**32 float32 values whose np.power(x, 2) bits differ from np.multiply(x, x)'s."""
    two, base = np.asarray(2.0, F32), np.arange(CHUNK, dtype=np.uint32)
    bits, power, product = np.empty(CHUNK, np.uint32), np.empty(CHUNK, F32), np.empty(CHUNK, F32)
    differ = 0
    for chunk in range((1 << 32) // CHUNK):
        np.add(base, np.uint32(chunk * CHUNK), out=bits)
        x = bits.view(F32)
        np.power(x, two, out=power)
        np.multiply(x, x, out=product)
        differ += int(np.count_nonzero(power.view(np.uint32) != product.view(np.uint32)))
    return differ


def cube_differences(n: int) -> int:
    """Of ``n`` random float32 bit patterns, how many np.power(x, 3) differs on from the fp64 cube rounded to fp32."""
    x = np.random.default_rng(0).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    wide = x.astype(np.float64)
    cube = (wide * wide * wide).astype(F32)
    return int(np.count_nonzero(np.power(x, np.asarray(3.0, F32)).view(np.uint32) != cube.view(np.uint32)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cube-sample", type=int, default=200_000)
    options = parser.parse_args()
    with np.errstate(all="ignore"):
        start = time.process_time()
        print(f"x ** 2 vs x * x: {square_differences()} of 2**32 float32 inputs differ "
              f"({time.process_time() - start:.0f} s CPU)")
        print(f"x ** 3 vs fp64 x * x * x rounded to fp32: {cube_differences(options.cube_sample)} of "
              f"{options.cube_sample} random float32 inputs differ")


if __name__ == "__main__":
    main()
