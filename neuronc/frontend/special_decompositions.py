"""neuronc's own lowerings of special functions and float-format ops torch-mlir cannot lower (issue 21, found by
`benchmarks.opinfo`): the scaled complementary error function `special_erfcx` (torch's decomposition of
`special_log_ndtr` reaches it), the inverse normal CDF `special_ndtri`, and `frexp`. Decompositions into elementwise ops, bit
operations and bitcasts, registered like decompositions.OWN (torch_import and aten_lowering merge `OWN` here after
it). Each follows ATen's CPU kernel's branches (Math.h) and is tested against eager in tests/test_special_functions.py.
"""
from __future__ import annotations

import math

import torch

from neuronc.frontend.decompositions import _ERFC_COEFFICIENTS, _horner, _in_fp32, _modified_bessel_i0

aten = torch.ops.aten


def _erfcx_of_nonnegative(z):
    """exp(z^2) erfc(z) for z >= 0: Numerical Recipes' erfcc fit is erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2)
    (fractional error < 1.2e-7 for every z >= 0), so erfcx(z) = t exp(P(t)) exactly, with no exp(z^2) to overflow.
    At z -> inf it tends to 2/z exp(-1.26551223) = 1 / (sqrt(pi) z), erfcx's asymptote; 0 at +inf."""
    t = 1.0 / (1.0 + 0.5 * z)
    return t * torch.exp(_horner(_ERFC_COEFFICIENTS[::-1], t))


def _erfcx(x):
    """ATen's calc_erfcx: the value above for x >= 0; for x < 0, 2 exp(x^2) - erfcx(-x) (inf once exp(x^2)
    overflows, and below -26.7 as ATen); NaN stays NaN."""
    positive = _erfcx_of_nonnegative(torch.abs(x))
    negative = 2.0 * torch.exp(x * x) - positive
    negative = torch.where(x < -26.7, torch.full_like(x, math.inf), negative)
    return torch.where(x >= 0, positive, torch.where(torch.isnan(x), x, negative))


# Cephes ndtri (ATen's calc_ndtri): rational approximations, coefficients highest degree first (polevl's order).
_NDTRI_P0 = (-5.99633501014107895267E1, 9.80010754185999661536E1, -5.66762857469070293439E1,
             1.39312609387279679503E1, -1.23916583867381258016E0)
_NDTRI_Q0 = (1.0, 1.95448858338141759834E0, 4.67627912898881538453E0, 8.63602421390890590575E1,
             -2.25462687854119370527E2, 2.00260212380060660359E2, -8.20372256168333339912E1,
             1.59056225126211695515E1, -1.18331621121330003142E0)
_NDTRI_P1 = (4.05544892305962419923E0, 3.15251094599893866154E1, 5.71628192246421288162E1,
             4.40805073893200834700E1, 1.46849561928858024014E1, 2.18663306850790267539E0,
             -1.40256079171354495875E-1, -3.50424626827848203418E-2, -8.57456785154685413611E-4)
_NDTRI_Q1 = (1.0, 1.57799883256466749731E1, 4.53907635128879210584E1, 4.13172038254672030440E1,
             1.50425385692907503408E1, 2.50464946208309415979E0, -1.42182922854787788574E-1,
             -3.80806407691578277194E-2, -9.33259480895457427372E-4)
_NDTRI_P2 = (3.23774891776946035970E0, 6.91522889068984211695E0, 3.93881025292474443415E0,
             1.33303460815807542389E0, 2.01485389549179081538E-1, 1.23716634817820021358E-2,
             3.01581553508235416007E-4, 2.65806974686737550832E-6, 6.23974539184983293730E-9)
_NDTRI_Q2 = (1.0, 6.02427039364742014255E0, 3.67983563856160859403E0, 1.37702099489081330271E0,
             2.16236993594496635890E-1, 1.34204006088543189037E-2, 3.28014464682127739104E-4,
             2.89247864745380683936E-6, 6.79019408009981274425E-9)
_EXP_MINUS_2 = 0.13533528323661269189


def _ndtri(y0):
    """ATen's calc_ndtri, every branch computed and the one ATen takes selected: the central rational in
    (y - 0.5) for exp(-2) < y < 1 - exp(-2), else x = sqrt(-2 log y) (y or 1 - y) and a rational in 1 / x
    (one for x < 8, one past); -inf at 0, inf at 1, NaN outside [0, 1] (and for NaN)."""
    upper = y0 > 1.0 - _EXP_MINUS_2
    y = torch.where(upper, 1.0 - y0, y0)
    central = y0 - 0.5
    c2 = central * central
    middle = (central + central * (c2 * _horner(_NDTRI_P0, c2) / _horner(_NDTRI_Q0, c2))) * 2.50662827463100050242
    # the tail: y kept at most exp(-2) where the central branch is taken (no sqrt of a negative there)
    tail_y = torch.where(y > _EXP_MINUS_2, torch.full_like(y, _EXP_MINUS_2), y)
    x = torch.sqrt(-2.0 * torch.log(tail_y))
    x0 = x - torch.log(x) / x
    z = 1.0 / x
    x1 = torch.where(x < 8.0, z * _horner(_NDTRI_P1, z) / _horner(_NDTRI_Q1, z),
                     z * _horner(_NDTRI_P2, z) / _horner(_NDTRI_Q2, z))
    tail = torch.where(upper, x0 - x1, x1 - x0)
    result = torch.where(y > _EXP_MINUS_2, middle, tail)
    result = torch.where(y0 == 0.0, torch.full_like(y0, -math.inf), result)
    result = torch.where(y0 == 1.0, torch.full_like(y0, math.inf), result)
    outside = (y0 < 0.0) | (y0 > 1.0) | torch.isnan(y0)
    return torch.where(outside, torch.full_like(y0, math.nan), result)


# ATen's calc_erfinv (Pavlis' rational approximation, lowest degree first here, then two Newton steps on erf).
_ERFINV_A = (0.886226899, -1.645349621, 0.914624893, -0.140543331)
_ERFINV_B = (-2.118377725, 1.442710462, -0.329097515, 0.012229801)
_ERFINV_C = (-1.970840454, -1.624906493, 3.429567803, 1.641345311)
_ERFINV_D = (3.543889200, 1.637067800)


def _erfinv(y):
    """ATen's calc_erfinv: a rational in y^2 for |y| <= 0.7, one in sqrt(-log((1 - |y|) / 2)) past it (the
    sign of y), then two Newton steps x -= (erf(x) - y) / (2 / sqrt(pi) exp(-x^2)); +-inf at +-1, NaN past."""
    magnitude = torch.abs(y)
    z = y * y
    central = y * _horner(_ERFINV_A[::-1], z) / (_horner(_ERFINV_B[::-1], z) * z + 1.0)
    # the tail's log kept finite where the central branch is taken (|y| <= 0.7)
    w = torch.sqrt(-torch.log((1.0 - torch.where(magnitude > 0.7, magnitude, 0.7)) / 2.0))
    tail = torch.copysign(_horner(_ERFINV_C[::-1], w), y) / (_horner(_ERFINV_D[::-1], w) * w + 1.0)
    x = torch.where(magnitude <= 0.7, central, tail)
    for _ in range(2):
        x = x - (torch.erf(x) - y) / ((2.0 / math.sqrt(math.pi)) * torch.exp(-x * x))
    x = torch.where(magnitude == 1.0, torch.copysign(torch.full_like(y, math.inf), y), x)
    return torch.where(magnitude > 1.0, torch.full_like(y, math.nan), x)


OWN = {
    aten.special_erfcx.default: _in_fp32(_erfcx),
    aten.special_ndtri.default: _in_fp32(_ndtri),
    aten.erfinv.default: _in_fp32(_erfinv),
    aten.i0.default: _in_fp32(_modified_bessel_i0),  # torch.i0 is ATen's calc_i0, modified_bessel_i0's Cephes series
}
