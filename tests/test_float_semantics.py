"""IEEE float semantics under torch.compile, strictly on the device, against eager PyTorch on CPU
(frontend/float_semantics.py, issue 21): frexp read from the bits, and a float tensor compared with itself,
which torch-mlir folded to true (wrong at NaN: x == x, isfinite and isclose were silently wrong)."""
from __future__ import annotations

import math

import pytest
import torch

from neuronc.errors import NeuronCompileError
from tests.conftest import run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")


F32 = torch.finfo(torch.float32)
SPECIALS = [0.0, -0.0, 1.0, -1.5, 3.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, F32.max, -F32.max, F32.tiny,
            0.5, 0.75, -1e30, 6e-39]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frexp_splits_normals_subnormals_and_specials_exactly(dtype):
    x = torch.cat([torch.tensor(SPECIALS), torch.randn(32, generator=torch.Generator().manual_seed(0)) * 1e3])
    x = x.to(dtype)
    (mantissa, exponent), (want_m, want_e) = run_compiled(torch.frexp, x), torch.frexp(x)
    assert mantissa.dtype == dtype and exponent.dtype == torch.int32
    torch.testing.assert_close(mantissa, want_m, equal_nan=True, rtol=0, atol=0)  # exact, -0 included
    numbers = ~torch.isnan(want_m)  # a NaN's sign bit is no value (eager's bf16 NaN here is +, its input's -)
    assert torch.equal(torch.signbit(mantissa[numbers]), torch.signbit(want_m[numbers]))
    assert torch.equal(exponent, want_e)


@pytest.mark.parametrize("name, fn", [
    ("x == x", lambda t: t == t),
    ("isfinite", torch.isfinite),
    ("isclose(x, x)", lambda t: torch.isclose(t, t)),
    ("eq(x, x) & x > 0", lambda t: torch.eq(t, t) & (t > 0)),
])
def test_a_float_compared_with_itself_is_false_at_nan(name, fn):
    x = torch.tensor([0.0, 1.0, math.inf, -math.inf, math.nan, -math.nan])
    assert torch.equal(run_compiled(fn, x), fn(x)), name


def test_integers_compared_with_themselves_and_two_tensors_still_compile():
    i = torch.arange(-3, 3)
    assert torch.equal(run_compiled(lambda t: t == t, i), i == i)
    a, b = torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1.0, math.nan, 3.0])
    assert torch.equal(run_compiled(torch.eq, a, b), torch.eq(a, b))


def _constants_compared_with_integers(x):
    """Each comparison of a constant float tensor with a Python integer picks x or -x: torch-mlir folded the
    integer forms of <, <=, >, >= against 0 wrongly (2.5 <= 0 was true)."""
    picks = []
    for value in (2.5, -2.5, 0.5):
        constant = torch.full((), value)
        for compared in (constant <= 0, constant < 0, constant >= 0, constant > 0, constant == 0, constant != 0,
                         constant <= 3, constant > -3):
            picks.append(torch.where(compared, -x, x))
    return torch.stack(picks)


def test_a_constant_float_compared_with_an_integer_folds_as_eager():
    x = torch.tensor([1.0, 2.0, -3.0])
    assert torch.equal(run_compiled(_constants_compared_with_integers, x), _constants_compared_with_integers(x))


def test_the_self_comparison_is_refused_if_it_reaches_torch_mlir_undecomposed():
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.mislowered import refuse_mislowered

    gm = make_fx(lambda t: torch.ops.aten.eq.Tensor(t, t))(torch.randn(3))
    with pytest.raises(NeuronCompileError, match="folded to true"):
        refuse_mislowered(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_angle_of_a_real_tensor_is_pi_below_zero_and_nan_at_nan(dtype):
    values = [1.0, -1.0, 0.0, -0.0, math.nan, -math.inf, math.inf] if dtype.is_floating_point else [-2, 0, 3]
    x = torch.tensor(values, dtype=dtype)
    got, want = run_compiled(torch.angle, x), torch.angle(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, equal_nan=True)
