"""neuronc's own lowerings of special functions and float-format ops torch-mlir cannot lower (issue 21, found by
`benchmarks.opinfo`): the scaled complementary error function `special_erfcx` (torch's decomposition of
`special_log_ndtr` reaches it), the inverse normal CDF `special_ndtri`, `frexp`, the Airy function `special_airy_ai`
and the Hurwitz zeta function `special_zeta` (their loops unrolled, ATen's stopping tests applied per element).
Decompositions into elementwise ops, bit operations and bitcasts, registered like decompositions.OWN (torch_import
and aten_lowering merge `OWN` here after it). Each follows ATen's CPU kernel's branches (Math.h) and is tested
against eager in tests/test_special_functions.py.
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


# ATen's airy_ai_forward (Cephes airy.c, Ai only), coefficients highest degree first (its loops' order).
_AIRY_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
            1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
            1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AIRY_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
            1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
            1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AIRY_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
             -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
             -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AIRY_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
             9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
             4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AIRY_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
             9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
             5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
             8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AIRY_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
             5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
             4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
             4.91834570062930015649e-09)
_AIRY_NEGATIVE_EDGE, _AIRY_POSITIVE_EDGE, _AIRY_ZERO_PAST = -2.09, 2.09, 103.892  # ATen's branch points
_AIRY_SERIES_TERMS = 16  # ATen's series loop stops at fp32 epsilon; on (-2.09, 2.09) it takes at most 10 steps
_FP32_EPSILON = 1.1920928955078125e-07


def _airy_ai(x):
    """ATen's airy_ai_forward, every branch computed and the one ATen takes selected: below -2.09 the asymptotic
    form with sin/cos of 2/3 (-x)^(3/2) + pi/4 and two rationals in z^2 (z its reciprocal); from 2.09 up
    exp(-zeta) times a rational in 1/zeta; between, the Maclaurin series f, g of Ai, its loop unrolled with ATen's
    stopping test applied per element (|term / f| <= epsilon stops the sums: the same terms are added); NaN at
    +-inf, 0 past 103.892."""
    minus = torch.where(x < _AIRY_NEGATIVE_EDGE, -x, torch.ones_like(x))  # -x where that branch is taken
    reach = -2.0 * -minus * torch.sqrt(minus) / 3.0
    z = 1.0 / reach
    z2 = z * z
    phase = reach + 0.25 * math.pi
    negative = (0.564189583547756286948 / torch.sqrt(torch.sqrt(minus))
                * (torch.sin(phase) * (1.0 + z2 * _horner(_AIRY_AFN, z2) / _horner(_AIRY_AFD, z2))
                   - torch.cos(phase) * (z * _horner(_AIRY_AGN, z2) / _horner(_AIRY_AGD, z2))))
    plus = torch.where(x >= _AIRY_POSITIVE_EDGE, x, torch.ones_like(x))
    zeta = 2.0 * plus * torch.sqrt(plus) / 3.0
    inverse = 1.0 / zeta
    positive = (0.564189583547756286948 * (_horner(_AIRY_AN, inverse) / _horner(_AIRY_AD, inverse))
                / (2.0 * torch.sqrt(torch.sqrt(plus)) * torch.exp(zeta)))
    f, g, m, n = torch.ones_like(x), x, torch.ones_like(x), x
    z3 = x * x * x
    running = torch.ones_like(x, dtype=torch.bool)
    k = 1.0
    for _ in range(_AIRY_SERIES_TERMS):
        m = m * z3 / (k + 1.0)
        n = n * z3 / (k + 2.0)
        m = m / (k + 2.0)
        f = torch.where(running, f + m, f)
        n = n / (k + 3.0)
        g = torch.where(running, g + n, g)
        k += 3.0
        running = running & (torch.abs(m / f) > _FP32_EPSILON)
    series = 0.355028053887817239260 * f - 0.258819403792806798405 * g
    result = torch.where(x < _AIRY_NEGATIVE_EDGE, negative, torch.where(x >= _AIRY_POSITIVE_EDGE, positive, series))
    result = torch.where(x > _AIRY_ZERO_PAST, torch.zeros_like(x), result)
    return torch.where(torch.isinf(x), torch.full_like(x, math.nan), result)


# ATen's zeta (Cephes zeta.c): Euler-Maclaurin's Bernoulli denominators, its machine epsilon (double's: ATen sums
# in double on the CPU and stops there; in fp32 the terms past it are below fp32's resolution anyway).
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15, 1.8152105401943546773e17,
           -7.1661652561756670113e18)
_ZETA_MACHEP = 1.11022302462515654042e-16
_ZETA_MIN_TERMS, _ZETA_DIRECT_UNTIL = 9, 9.0  # ATen sums (q + i)^-x for at least 9 terms and while q + i <= 9
_ZETA_DIRECT_TERMS = 32  # unrolled: every q > -23; ATen's loop runs about 9 - q steps, unbounded as q -> -inf


def _power_of_real(base, exponent):
    """base^exponent where a negative base meets an integer exponent (the only negative bases zeta reaches):
    |base|^exponent, negated for odd exponents."""
    magnitude = torch.pow(torch.abs(base), exponent)
    odd = (exponent - 2.0 * torch.floor(exponent / 2.0)) == 1.0
    return torch.where((base < 0) & odd, -magnitude, magnitude)


def _zeta(x, q):
    """ATen's Hurwitz zeta(x, q) = sum over n >= 0 of (q + n)^-x: its direct sum (at least 9 terms, on while
    q + n <= 9) and its 12 Euler-Maclaurin terms, each loop unrolled with ATen's stopping tests applied per element
    (a term below 1.1e-16 of the sum ends it, as in ATen). inf at x = 1 and at
    q a non-positive integer, NaN for x < 1 and for q <= 0 with a fractional x. A documented limit: ATen's direct
    sum runs ~9 - q steps, unbounded for q -> -inf; it is unrolled to 32 terms, so q <= -23 (with an integer x)
    gives NaN, not ATen's value."""
    x, q = torch.broadcast_tensors(x, q)
    s = _power_of_real(q, -x)
    a, b, w = q, torch.zeros_like(q), q
    running = torch.ones_like(q, dtype=torch.bool)
    converged = torch.zeros_like(q, dtype=torch.bool)  # ATen returned the direct sum: its last term negligible
    for i in range(_ZETA_DIRECT_TERMS):
        if i >= _ZETA_MIN_TERMS:
            running = running & (a <= _ZETA_DIRECT_UNTIL)
        a = a + 1.0
        term = _power_of_real(a, -x)
        s = torch.where(running, s + term, s)
        b = torch.where(running, term, b)
        w = torch.where(running, a, w)
        negligible = running & (-_ZETA_MACHEP * s < term) & (term < _ZETA_MACHEP * s)
        converged = converged | negligible
        running = running & ~negligible
    unfinished = running & (a <= _ZETA_DIRECT_UNTIL)  # ATen's loop would go on: beyond the unrolled terms
    direct = s
    s = s + b * w / (x - 1.0)
    s = s - 0.5 * b
    product = b  # a * b of ATen's loop, kept as one running product (a alone overflows for large x)
    k = 0.0
    running = torch.ones_like(q, dtype=torch.bool)
    for denominator in _ZETA_A:
        product = product * (x + k) / w
        t = product / denominator
        s = torch.where(running, s + t, s)
        running = running & ~(torch.abs(t / s) < _ZETA_MACHEP)
        k += 1.0
        product = product * (x + k) / w
        k += 1.0
    s = torch.where(converged, direct, torch.where(unfinished, torch.full_like(s, math.nan), s))
    non_positive = q <= 0
    s = torch.where(non_positive & (x != torch.floor(x)), torch.full_like(s, math.nan), s)
    s = torch.where(non_positive & (q == torch.floor(q)), torch.full_like(s, math.inf), s)
    s = torch.where(x < 1.0, torch.full_like(s, math.nan), s)
    return torch.where(x == 1.0, torch.full_like(s, math.inf), s)


def _zeta_tensors(x, q):
    """special_zeta of any overload: a Python number becomes a tensor of the other operand's dtype (fp32 for
    integers: zeta is a float function)."""
    like = x if isinstance(x, torch.Tensor) else q
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    x, q = (torch.as_tensor(v, dtype=dtype, device=like.device) if not isinstance(v, torch.Tensor) else v.to(dtype)
            for v in (x, q))
    if dtype == torch.float64:
        return NotImplemented
    return _in_fp32(_zeta)(x, q)


OWN = {
    aten.special_zeta.default: _zeta_tensors,
    aten.special_zeta.self_scalar: _zeta_tensors,
    aten.special_zeta.other_scalar: _zeta_tensors,
    aten.special_airy_ai.default: _in_fp32(_airy_ai),
    aten.special_erfcx.default: _in_fp32(_erfcx),
    aten.special_ndtri.default: _in_fp32(_ndtri),
    aten.erfinv.default: _in_fp32(_erfinv),
    aten.i0.default: _in_fp32(_modified_bessel_i0),  # torch.i0 is ATen's calc_i0, modified_bessel_i0's Cephes series
}
