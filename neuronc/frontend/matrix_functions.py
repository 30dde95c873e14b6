"""The matrix exponential (`linalg_matrix_exp`, torch.matrix_exp), which torch-mlir cannot lower: scaling and
squaring as ATen's CPU kernel (mexp_impl, after Bader, Blanes and Casas 2019) does it for float32, with a fixed
polynomial instead of ATen's degree chosen from the norm.

A matrix's 1-norm sets s = ceil(log2(norm / theta)) (0 at most), with ATen's float32 theta for its highest degree
(18): exp(A) = exp(A / 2^s)^(2^s), and ||A / 2^s|| <= theta, where a degree-18 Taylor polynomial (Horner's rule)
is within 1e-8 of the exponential (theta^19 / 19!). ATen picks a lower degree for smaller norms; both are
accurate to fp32's rounding there. The IR has no loop, so the squarings are MAX_SQUARINGS unrolled matrix
products, each applied where s asks for it (per matrix of a batch, as ATen's mask over s's maximum); a 1-norm
that would need more (above theta * 2^MAX_SQUARINGS) gives NaN rather than a wrong matrix.
Registered like decompositions.OWN (torch_import merges `OWN`); tested against eager in
tests/test_coverage_lowerings.py.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

THETA_18_FLOAT32 = 3.010066362817634  # ATen's thetas_float[5] (LinearAlgebra.cpp, mexp): degree 18's bound
TAYLOR_DEGREE = 18  # (theta^19 / 19!) ~ 1e-8: below fp32's rounding relative to exp(A)
MAX_SQUARINGS = 64  # 1-norms up to theta * 2^64 ~ 5.6e19; fp32's largest would need 127 unrolled products


def _matrix_exp(a):
    if not a.is_floating_point() or a.dtype == torch.float64:
        return NotImplemented
    n = a.shape[-1]
    if n == 0 or a.numel() == 0:
        return a.clone()
    work = a.to(torch.float32)
    norm = work.abs().sum(-2).amax(-1)  # the 1-norm: the largest column sum, per matrix
    squarings = torch.clamp(torch.ceil(torch.log2(norm / THETA_18_FLOAT32)), min=0.0)
    too_large = squarings > MAX_SQUARINGS
    scaled = work * torch.exp2(-torch.clamp(squarings, max=MAX_SQUARINGS))[..., None, None]
    identity = torch.eye(n, dtype=work.dtype, device=work.device).expand(work.shape)
    result = identity
    for k in range(TAYLOR_DEGREE, 0, -1):  # I + X (I + X/2 (I + ... (I + X/18)))
        result = identity + (scaled @ result) / float(k)
    for step in range(MAX_SQUARINGS):
        result = torch.where((squarings > step)[..., None, None], result @ result, result)
    result = torch.where(too_large[..., None, None], torch.full_like(result, math.nan), result)
    return result.to(a.dtype)


OWN = {
    aten.linalg_matrix_exp.default: _matrix_exp,
}
