"""The matrix exponential (`linalg_matrix_exp`, torch.matrix_exp), which torch-mlir cannot lower: scaling and
squaring as ATen's CPU kernel (mexp_impl, after Bader, Blanes and Casas 2019) does it for float32, always with its
highest-degree polynomial (ATen picks a lower degree for 1-norms below 1.46).

A matrix's 1-norm sets s = ceil(log2(norm / theta)) (0 at most), with ATen's float32 theta for its highest degree
(18): exp(A) = exp(A / 2^s)^(2^s), and ||A / 2^s|| <= theta, where ATen's degree-18 polynomial (its coefficients
and its order of operations, so that the rounding, amplified by the squarings, is eager's) is accurate to fp32.
Below 1.46 ATen uses lower degrees; both are accurate to fp32's rounding there, with no squaring to amplify it. The IR has no loop, so the squarings are MAX_SQUARINGS unrolled matrix
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
MAX_SQUARINGS = 64  # 1-norms up to theta * 2^64 ~ 5.6e19; fp32's largest would need 127 unrolled products

# ATen's compute_T18 (Bader, Blanes and Casas' degree-18 polynomial in 5 products): row i combines I, A, A^2, A^3, A^6.
T18_COEFFICIENTS = (
    (0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0),
    (0.0, 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04),
    (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05),
    (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05),
    (0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05),
)


def _taylor_18(a):
    """ATen's compute_T18, operation for operation: the powers I, A, A^2, A A^2 (A^3), A^3 A^3 (A^6), five linear
    combinations B0..B4 of them, A9 = B0 B4 + B3, and B1 + (B2 + A9) A9."""
    identity = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand(a.shape)
    square = a @ a
    cube = a @ square
    sixth = cube @ cube
    powers = (identity, a, square, cube, sixth)
    combined = []
    for row in T18_COEFFICIENTS:
        total = None
        for coefficient, power in zip(row, powers):
            term = power * coefficient
            total = term if total is None else total + term
        combined.append(total)
    ninth = combined[3] + combined[0] @ combined[4]
    return combined[1] + (combined[2] + ninth) @ ninth


def _matrix_exp(a):
    if not a.is_floating_point() or a.dtype == torch.float64:
        return NotImplemented
    if a.shape[-1] == 0 or a.numel() == 0:
        return a.clone()
    if a.shape[-1] == 1:
        return torch.exp(a)  # ATen's own special case
    work = a.to(torch.float32)
    norm = work.abs().sum(-2).amax(-1)  # the 1-norm: the largest column sum, per matrix
    squarings = torch.clamp(torch.ceil(torch.log2(norm / THETA_18_FLOAT32)), min=0.0)
    too_large = squarings > MAX_SQUARINGS
    scaled = work / torch.exp2(torch.clamp(squarings, max=MAX_SQUARINGS))[..., None, None]
    result = _taylor_18(scaled)
    for step in range(MAX_SQUARINGS):
        result = torch.where((squarings > step)[..., None, None], result @ result, result)
    result = torch.where(too_large[..., None, None], torch.full_like(result, math.nan), result)
    return result.to(a.dtype)


OWN = {
    aten.linalg_matrix_exp.default: _matrix_exp,
}
