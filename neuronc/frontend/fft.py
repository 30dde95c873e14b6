"""Discrete Fourier transforms (ATen's `_fft_r2c`, `_fft_c2r`, `_fft_c2c`) as matmuls by cos/sin matrices.

The NeuronCore has no FFT and no complex type. A complex tensor travels through the graph as a real tensor with a
trailing dimension of 2, (real, imaginary) interleaved, as `torch.view_as_real` lays it out
(`complex_pairs.py`); along one transformed dimension of length n such a tensor is, once that dimension is moved
last and merged with the pair dimension, a row of 2n reals, and the DFT along it is one matmul by a real
[2n, 2n] matrix of cos and sin (a direct DFT, as IREE lowers `mhlo.fft` and as TPUs compute small FFTs: the
Tensor engine does n^2 multiply-adds at once where an FFT's n log n steps would be many small elementwise
kernels). A length past RADIX is split in two factors (the four-step FFT: DFTs of the first, a twiddle product,
DFTs of the second, split again if long), which keeps each sum short: the direct sum's fp32 error grows with
sqrt(n), past pocketfft's log n. A multi-dimensional transform is one such DFT per dimension. The normalisation
(`norm`: 0 none, 1 1/sqrt(n), 2 1/n, ATen's fft_norm_mode) is folded into each dimension's last matrix.

The matrices are computed in float64 on the host (angles from the exact integer j*k mod n) and rounded once to
the compute dtype. A length past `MAX_LENGTH`, or one that does not factor (see `_computable`), is refused with a
`NeuronCompileError` saying why and the way out.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from neuronc.errors import NeuronCompileError

# A length up to RADIX is one matmul by its [2n, 2n] matrix; a longer one is split n = n1 * n2, n1 the largest
# divisor up to RADIX, into DFTs of n1 and (recursively) of n2 (the four-step FFT): its error grows with the
# number of stages, where one matmul's grows with sqrt(n) (the fp32 sums, not the matrices' rounding).
RADIX = 16
# Longest length one matmul computes when it has no divisor up to RADIX (a prime). `python -m
# benchmarks.fft_accuracy --direct`: one matmul within rtol 1e-4 / atol 1e-5 of eager on every value at n = 256,
# not at 512 (4 of 262,144 values off; its error 3.4x pocketfft's).
DIRECT_MAX = 256
# Longest transformed dimension. `python -m benchmarks.fft_accuracy` (docs/performance.md, issue 21 part 6): with
# the split, error from float64 1.3-2.0x eager's from n = 256 to 16384, every value within that tolerance of eager
# up to 1024, 16 of 262,144 off at 2048 (where eager's own values leave that tolerance of float64 too). Longer
# lengths, and lengths whose factor left after taking out divisors up to RADIX exceeds DIRECT_MAX, are refused.
MAX_LENGTH = 1024

NORM_NONE, NORM_SQRT, NORM_N = 0, 1, 2  # ATen's fft_norm_mode


def _scale(n: int, norm: int) -> float:
    return {NORM_NONE: 1.0, NORM_SQRT: 1.0 / np.sqrt(n), NORM_N: 1.0 / n}[norm]


def _factors(n: int) -> tuple[int, int] | None:
    """n = n1 * n2, n1 the largest divisor of n up to RADIX (None for n up to RADIX, or with no such divisor)."""
    if n <= RADIX:
        return None
    n1 = next((d for d in range(RADIX, 1, -1) if n % d == 0), None)
    return (n1, n // n1) if n1 else None


def _computable(n: int) -> bool:
    split = _factors(n)
    return _computable(split[1]) if split else n <= DIRECT_MAX


def _check_length(n: int, what: str) -> None:
    if n > MAX_LENGTH or not _computable(n):
        raise NeuronCompileError(
            f"{what} of length {n}: neuronc computes a DFT as matmuls by cos/sin matrices, split into factors up "
            f"to {RADIX} and one other factor up to {DIRECT_MAX}, for n up to {MAX_LENGTH} (past these its rounding "
            "error was not measured within fp32's tolerance of eager's FFT). Way out: run this FFT on the CPU "
            "(torch.compile's default CPU fallback, i.e. without TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1), or "
            f"pad the signal to a length that factors (a power of two up to {MAX_LENGTH}).")


def _cos_sin(rows: int, cols: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi j k / n for j < rows, k < cols, in float64, from the exact integer j k mod n."""
    turns = np.outer(np.arange(rows, dtype=np.int64), np.arange(cols, dtype=np.int64)) % n
    angle = 2.0 * np.pi * turns / n
    return np.cos(angle), np.sin(angle)


@functools.lru_cache(maxsize=64)
def _c2c_matrix(n: int, forward: bool, scale: float) -> np.ndarray:
    """[2n, 2n]: a row of n interleaved (re, im) pairs times it is their DFT (sign -1 forward, +1 backward)."""
    cos, sin = _cos_sin(n, n, n)
    s = -1.0 if forward else 1.0  # X_k = sum_j x_j (cos + i s sin)
    m = np.empty((2 * n, 2 * n))
    m[0::2, 0::2], m[0::2, 1::2] = cos, s * sin      # from re_j: re_k += re_j cos, im_k += s re_j sin
    m[1::2, 0::2], m[1::2, 1::2] = -s * sin, cos     # from im_j: re_k -= s im_j sin, im_k += im_j cos
    return m * scale


@functools.lru_cache(maxsize=64)
def _r2c_matrix(n: int, bins: int, scale: float) -> np.ndarray:
    """[n, 2 bins]: n reals times it are their first `bins` DFT bins, interleaved (re, im)."""
    cos, sin = _cos_sin(n, bins, n)
    m = np.empty((n, 2 * bins))
    m[:, 0::2], m[:, 1::2] = cos, -sin
    return m * scale


@functools.lru_cache(maxsize=64)
def _c2r_matrix(bins: int, n: int, scale: float) -> np.ndarray:
    """[2 bins, n]: the one-sided spectrum of `bins` = n // 2 + 1 interleaved pairs times it is the real signal
    of length n whose spectrum is Hermitian: x_j = sum_k w_k (re_k cos - im_k sin), w_k = 2 but for the bin 0
    and (n even) the bin n / 2, whose imaginary parts are ignored as pocketfft ignores them (their sin is 0)."""
    cos, sin = _cos_sin(bins, n, n)
    weight = np.full((bins, 1), 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[n // 2] = 1.0
    m = np.empty((2 * bins, n))
    m[0::2], m[1::2] = weight * cos, -weight * sin
    return m * scale


def _constant(matrix: np.ndarray, dtype) -> torch.Tensor:
    return torch.tensor(matrix, dtype=torch.float64).to(dtype)


@functools.lru_cache(maxsize=64)
def _twiddles(n1: int, n2: int, forward: bool) -> np.ndarray:
    """[n1, n2, 2]: W_n^(k1 j2) = cos + i s sin of 2 pi k1 j2 / n, n = n1 n2, the four-step FFT's middle factor."""
    cos, sin = _cos_sin(n1, n2, n1 * n2)
    return np.stack([cos, (-1.0 if forward else 1.0) * sin], -1)


def _dft_rows(p: torch.Tensor, forward: bool, scale: float) -> torch.Tensor:
    """The DFT of a pair tensor [..., n, 2] along its complex dim -1: one matmul by the [2n, 2n] matrix, or for
    n = n1 n2 (`_factors`; j = n2 j1 + j2, k = k1 + n1 k2) DFTs over j1, a twiddle product, DFTs over j2 (split
    again if long), the result read k2-major."""
    n = int(p.shape[-2])
    split = _factors(n)
    if split is None:
        matrix = _constant(_c2c_matrix(n, forward, scale), p.dtype)
        return torch.matmul(p.reshape(*p.shape[:-2], 2 * n), matrix).reshape(p.shape)
    n1, n2 = split
    q = _dft_rows(p.reshape(*p.shape[:-2], n1, n2, 2).transpose(-3, -2), forward, 1.0)  # [..., j2, k1, 2]
    twiddle = _constant(_twiddles(n1, n2, forward), p.dtype).transpose(0, 1)  # [j2, k1, 2]
    re = q[..., 0] * twiddle[..., 0] - q[..., 1] * twiddle[..., 1]
    im = q[..., 0] * twiddle[..., 1] + q[..., 1] * twiddle[..., 0]
    q = torch.stack([re, im], -1).transpose(-3, -2)  # [..., k1, j2, 2]
    out = _dft_rows(q, forward, scale)  # [..., k1, k2, 2]
    return out.transpose(-3, -2).reshape(p.shape)


def _pairs_along(pairs: torch.Tensor, dim: int, forward: bool, scale: float) -> torch.Tensor:
    moved = pairs.movedim(dim, -2)
    return _dft_rows(moved, forward, scale).movedim(-2, dim)


def _complex_dims(dims, rank: int) -> list:
    return [d % rank for d in dims]


def c2c(pairs: torch.Tensor, dims, norm: int, forward: bool) -> torch.Tensor:
    """aten._fft_c2c on a pair tensor (complex dims = pairs.dim() - 1)."""
    for dim in _complex_dims(dims, pairs.dim() - 1):
        n = int(pairs.shape[dim])  # int(): a backward graph's sizes may come as (static) SymInts
        _check_length(n, "a complex FFT")
        pairs = _pairs_along(pairs, dim, forward, _scale(n, norm))
    return pairs


def r2c(x: torch.Tensor, dims, norm: int, onesided: bool) -> torch.Tensor:
    """aten._fft_r2c: the last of `dims` real-to-complex (its first n // 2 + 1 bins if onesided), the others
    complex-to-complex forward."""
    *rest, last = _complex_dims(dims, x.dim())
    n = int(x.shape[last])
    _check_length(n, "a real FFT")
    bins = n // 2 + 1 if onesided else n
    moved = x.movedim(last, -1)
    if _factors(n) is None:
        matrix = _constant(_r2c_matrix(n, bins, _scale(n, norm)), x.dtype)
        pairs = torch.matmul(moved, matrix).reshape(*moved.shape[:-1], bins, 2)
    else:  # as a complex signal of zero imaginary part
        pairs = _dft_rows(torch.stack([moved, torch.zeros_like(moved)], -1), True, _scale(n, norm))[..., :bins, :]
    return c2c(_real_bins_exact(pairs, n).movedim(-2, last), rest, norm, forward=True)


def _real_bins_exact(pairs: torch.Tensor, n: int) -> torch.Tensor:
    """The imaginary parts of bin 0 and (n even) bin n / 2 of a real signal's spectrum as +0, as pocketfft
    writes them: the matmul sums x_j * 0 terms, which is -0 when every x_j is negative, and angle() of a
    negative real with imaginary -0 is -pi where eager's is pi. (c2r ignores them, as pocketfft does.)"""
    bins = pairs.shape[-2]
    k = torch.arange(bins, device=pairs.device)
    exact = ((k == 0) | (2 * k == n))[:, None] & (torch.arange(2, device=pairs.device) == 1)
    return torch.where(exact, torch.zeros((), dtype=pairs.dtype), pairs)


def c2r(pairs: torch.Tensor, dims, norm: int, last_dim_size: int) -> torch.Tensor:
    """aten._fft_c2r: the dims but the last complex-to-complex backward, the last a one-sided spectrum of
    n // 2 + 1 bins to `last_dim_size` = n reals."""
    *rest, last = _complex_dims(dims, pairs.dim() - 1)
    pairs = c2c(pairs, rest, norm, forward=False)
    n, bins = int(last_dim_size), int(pairs.shape[last])
    _check_length(n, "an inverse real FFT")
    if bins != n // 2 + 1:
        raise NeuronCompileError(f"an inverse real FFT of {bins} bins to {n} values: ATen gives n // 2 + 1 bins")
    moved = pairs.movedim(last, -2)
    if _factors(n) is None:
        matrix = _constant(_c2r_matrix(bins, n, _scale(n, norm)), pairs.dtype)
        signal = torch.matmul(moved.reshape(*moved.shape[:-2], -1), matrix)
    else:  # the whole Hermitian spectrum (bins n - k conjugates of bins k), then the real part of its inverse
        moved = _real_bins_exact(moved, n)
        mirror = moved[..., 1:n - bins + 1, :].flip(-2) * torch.tensor([1.0, -1.0], dtype=moved.dtype)
        signal = _dft_rows(torch.cat([moved, mirror], -2), False, _scale(n, norm))[..., 0]
    return signal.movedim(-1, last)
