"""Discrete Fourier transforms (ATen's `_fft_r2c`, `_fft_c2r`, `_fft_c2c`) as matmuls by cos/sin matrices.

The NeuronCore has no FFT and no complex type. A complex tensor travels through the graph as a real tensor with a
trailing dimension of 2, (real, imaginary) interleaved, as `torch.view_as_real` lays it out
(`complex_pairs.py`); along one transformed dimension of length n such a tensor is, once that dimension is moved
last and merged with the pair dimension, a row of 2n reals, and the DFT along it is one matmul by a real
[2n, 2n] matrix of cos and sin (a direct DFT, as IREE lowers `mhlo.fft` and as TPUs compute small FFTs: the
Tensor engine does n^2 multiply-adds at once where an FFT's n log n steps would be many small elementwise
kernels). A multi-dimensional transform is one matmul per dimension. The normalisation (`norm`: 0 none,
1 1/sqrt(n), 2 1/n, ATen's fft_norm_mode) is folded into each dimension's matrix.

The matrices are computed in float64 on the host (angles from the exact integer j*k mod n) and rounded once to
the compute dtype. The direct sum's rounding error grows with n (about sqrt(n) eps |x| per bin where pocketfft's
grows with log n); a length past `MAX_LENGTH` is refused (`NeuronCompileError`): its matrix would be too large
a constant for the NEFF and its error no longer within fp32's comparison tolerance of eager's FFT.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from neuronc.errors import NeuronCompileError

# Longest transformed dimension: a c2c matrix of (2 * 1024)^2 fp32 is 16 MiB in the NEFF, and the direct sum's
# error at that length was measured (tests/test_fft.py::test_dft_error_at_the_longest_length) within fp32's
# rtol 1e-4 / atol 1e-5 of eager on unit-variance inputs.
MAX_LENGTH = 1024

NORM_NONE, NORM_SQRT, NORM_N = 0, 1, 2  # ATen's fft_norm_mode


def _scale(n: int, norm: int) -> float:
    return {NORM_NONE: 1.0, NORM_SQRT: 1.0 / np.sqrt(n), NORM_N: 1.0 / n}[norm]


def _check_length(n: int, what: str) -> None:
    if n > MAX_LENGTH:
        raise NeuronCompileError(
            f"{what} of length {n}: neuronc computes a DFT as a matmul by an n x n cos/sin matrix, up to "
            f"n = {MAX_LENGTH} (the matrix's size and the direct sum's rounding error grow with n). Way out: "
            "run this FFT on the CPU (torch.compile's default CPU fallback, i.e. without "
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1), or split the transform into shorter ones.")


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


def _pairs_along(x: torch.Tensor, dim: int, matrix: torch.Tensor) -> torch.Tensor:
    """A pair tensor [..., 2]: the DFT of its complex dim `dim` (moved last, merged with the pairs) by `matrix`."""
    moved = x.movedim(dim, -2)
    rows = moved.reshape(*moved.shape[:-2], -1)
    out = torch.matmul(rows, matrix)
    return out.reshape(*moved.shape[:-2], -1, 2).movedim(-2, dim)


def c2c(pairs: torch.Tensor, dims, norm: int, forward: bool) -> torch.Tensor:
    """aten._fft_c2c on a pair tensor (complex dims = pairs.dim() - 1)."""
    for dim in dims:
        n = pairs.shape[dim]
        _check_length(n, "a complex FFT")
        matrix = _constant(_c2c_matrix(n, forward, _scale(n, norm)), pairs.dtype)
        pairs = _pairs_along(pairs, dim, matrix)
    return pairs


def r2c(x: torch.Tensor, dims, norm: int, onesided: bool) -> torch.Tensor:
    """aten._fft_r2c: the last of `dims` real-to-complex (its first n // 2 + 1 bins if onesided), the others
    complex-to-complex forward."""
    *rest, last = dims
    n = x.shape[last]
    _check_length(n, "a real FFT")
    bins = n // 2 + 1 if onesided else n
    matrix = _constant(_r2c_matrix(n, bins, _scale(n, norm)), x.dtype)
    moved = x.movedim(last, -1)
    pairs = torch.matmul(moved, matrix).reshape(*moved.shape[:-1], bins, 2)
    return c2c(_real_bins_exact(pairs, n).movedim(-2, last), rest, norm, forward=True)


def _real_bins_exact(pairs: torch.Tensor, n: int) -> torch.Tensor:
    """The imaginary parts of bin 0 and (n even) bin n / 2 of a real signal's spectrum as +0, as pocketfft
    writes them: the matmul sums x_j * 0 terms, which is -0 when every x_j is negative, and angle() of a
    negative real with imaginary -0 is -pi where eager's is pi."""
    bins = pairs.shape[-2]
    k = torch.arange(bins, device=pairs.device)
    exact = ((k == 0) | (2 * k == n))[:, None] & (torch.arange(2, device=pairs.device) == 1)
    return torch.where(exact, torch.zeros((), dtype=pairs.dtype), pairs)


def c2r(pairs: torch.Tensor, dims, norm: int, last_dim_size: int) -> torch.Tensor:
    """aten._fft_c2r: the dims but the last complex-to-complex backward, the last a one-sided spectrum of
    n // 2 + 1 bins to `last_dim_size` = n reals."""
    *rest, last = dims
    pairs = c2c(pairs, rest, norm, forward=False)
    n, bins = last_dim_size, pairs.shape[last]
    _check_length(n, "an inverse real FFT")
    if bins != n // 2 + 1:
        raise NeuronCompileError(f"an inverse real FFT of {bins} bins to {n} values: ATen gives n // 2 + 1 bins")
    matrix = _constant(_c2r_matrix(bins, n, _scale(n, norm)), pairs.dtype)
    moved = pairs.movedim(last, -2)
    rows = moved.reshape(*moved.shape[:-2], -1)
    return torch.matmul(rows, matrix).movedim(-1, last)
