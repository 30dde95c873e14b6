"""Special functions torch-mlir cannot lower, compiled with neuronc's own lowerings
(frontend/special_decompositions.py: erfcx, log_ndtr through it, ndtri), against eager PyTorch on CPU at the fp32
tolerance over wide ranges with every branch point, strictly on the device (found by benchmarks/opinfo.py,
issue 21)."""
from __future__ import annotations

import math

import pytest
import torch

from neuronc.tolerances import TOLERANCES
from tests.conftest import run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")


def _matches_eager(fn, *inputs):
    """fn compiled (checked to run on the device) against eager, output by output, NaN where eager has NaN."""
    got, want = run_compiled(fn, *inputs), fn(*inputs)
    for g, w in zip(*(out if isinstance(out, tuple) else (out,) for out in (got, want)), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True, **TOLERANCES[w.dtype])


F32 = torch.finfo(torch.float32)


def _reals():
    """Signs, zeros, infinities, NaN, ATen's branch points (50, 5e7, -6.1, -26.7, -1 for log_ndtr), overflow of
    exp(x^2) near -9.4, and 30 decades each side."""
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, F32.max, -F32.max, F32.tiny, 1e-3, -1e-3, 49.9, 50.1, 5e7,
               6e7, -6.0, -6.2, -9.3, -9.5, -26.6, -26.8, -1.0, -1.01, -0.99, 1.0]
    grid = torch.logspace(-30, 30, 61)
    return torch.cat([torch.tensor(special), grid, -torch.logspace(-30, 1.5, 64),
                      torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4])


@pytest.mark.parametrize("name", ["erfcx", "log_ndtr"])
def test_erfcx_and_log_ndtr_match_eager_over_wide_ranges(name):
    _matches_eager(getattr(torch.special, name), _reals())


def test_ndtri_matches_eager_in_every_branch():
    """The central rational, both tails (below and above exp(-32) of either end), subnormal probabilities, the
    ends (+-inf) and outside [0, 1] (NaN)."""
    ends = [0.0, 1.0, -0.1, 1.1, math.nan, 0.5, 1e-38, 1e-45, 1 - 6e-8, 0.1353, 0.1354, 0.8646, 0.8647, 1e-14, 1e-20]
    y = torch.cat([torch.tensor(ends), torch.rand(64, generator=torch.Generator().manual_seed(0)),
                   torch.logspace(-37, 0, 60)])
    _matches_eager(torch.special.ndtri, y)


def test_erfinv_matches_eager_in_both_branches_and_at_the_ends():
    """The central rational (|y| <= 0.7) and the tail's, both Newton steps, +-1 (+-inf), past +-1 (NaN)."""
    ends = [1.0, -1.0, 1.5, -1.5, math.nan, 0.0, -0.0, 0.7, -0.7, 0.70001, 0.69999, 0.999, -0.999, 0.99, 1e-30]
    y = torch.cat([torch.tensor(ends), torch.rand(64, generator=torch.Generator().manual_seed(0)) * 2 - 1])
    _matches_eager(torch.erfinv, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i0_matches_eager_over_wide_ranges(dtype):
    _matches_eager(torch.i0, _reals().clamp(-100, 100).to(dtype))


def _airy_and_zeta(x, s, q):
    return torch.special.airy_ai(x), torch.special.zeta(s, q), torch.special.zeta(s, 2.5)


def test_airy_ai_and_zeta_match_eager_in_every_branch():
    """One program. airy_ai: the asymptotic forms below -2.09 and from 2.09, the series between (its stopping test
    per element), 0 past 103.892, NaN at +-inf. zeta(s, q): x = 1 (inf), x < 1 and fractional x with q <= 0
    (NaN), q a non-positive integer (inf), negative q down to -22.9 (the direct sum over 32 terms), q past 9 (the
    direct sum stopping at its first negligible term), infinities and NaN, and a Python number for q."""
    specials = [math.inf, -math.inf, math.nan, 0.0, -0.0, -2.09, -2.0899, 2.09, 2.0899, 8.3203353, 103.8, 103.9, 1e30,
                -1e30]
    x = torch.cat([torch.tensor(specials), torch.linspace(-30, 30, 601)])
    s = torch.tensor([1.0, 1.0001, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 20.0, 50.0, 0.5, -1.0, math.inf, math.nan])
    q = torch.tensor([0.0, -0.0, -1.0, -2.5, -8.3, -15.5, -22.9, 0.001, 0.1, 0.5, 1.0, 3.6, 9.0, 9.5, 100.0, 1e4,
                      1e10, math.inf, math.nan, -19.9, -7.25, 2.25, 17.0])
    _matches_eager(_airy_and_zeta, x, s[:, None], q)


def test_zeta_is_nan_past_its_unrolled_direct_sum():
    """The documented limit: ATen's direct sum runs ~9 - q steps; unrolled to 32, q <= -23 with an integer x gives
    NaN (the decomposition itself, run eagerly: no compile)."""
    from neuronc.frontend.special_decompositions import _zeta

    got = _zeta(torch.tensor([2.0, 3.0, 2.0]), torch.tensor([-22.9, -23.5, -30.5]))
    assert torch.isfinite(got[0]) and torch.isnan(got[1:]).all()
