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


def _same_floats(got, want):
    """Equal values (NaN where eager has NaN) and the same sign at every number, zeros included."""
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1.3e-6, atol=0)
    numbers = ~torch.isnan(want)
    assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers]))


SIGNED = torch.tensor([0.0, -0.0, 0.5, -0.5, 2.5, -2.5, 1e-30, -1e-30, math.inf, -math.inf, math.nan])


@pytest.mark.parametrize("name", ["neg", "sqrt", "rsqrt", "floor", "ceil", "trunc", "round", "frac", "tanh", "expm1",
                                  "log1p", "sin", "abs"])
def test_a_function_of_negative_zero_keeps_eagers_sign(name):
    """-(+0.0) is -0.0 and sqrt, floor, trunc... of -0.0 are -0.0, rsqrt(-0.0) is -inf: the device's negation was
    0 - x, its activations added a +0.0 bias, torch-mlir's trunc is sign(x) * floor(|x|)."""
    fn = getattr(torch, name)
    _same_floats(run_compiled(fn, SIGNED), fn(SIGNED))


INTEGER_DIVIDENDS = [2**31 - 1, -2**31, 2**24 + 1, -(2**24 + 3), 7, -7, 0, 5, 123456789]
INTEGER_DIVISORS = [2, 3, 2, 2, -2, 2, 3, -5, -10]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name, fn", [
    ("a // b", lambda a, b: a // b),
    ("div floor", lambda a, b: torch.div(a, b, rounding_mode="floor")),
    ("a // 3", lambda a, b: a // 3),
])
def test_integer_floor_division_is_exact_past_two_to_the_24(dtype, name, fn):
    """torch-mlir divides integers through float64, which the device computes in fp32: (2**31 - 1) // 2 was 2**30."""
    a, b = torch.tensor(INTEGER_DIVIDENDS, dtype=dtype), torch.tensor(INTEGER_DIVISORS, dtype=dtype)
    assert torch.equal(run_compiled(fn, a, b), fn(a, b)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_floor_division_is_pytorchs_at_corrections_infinities_and_zero_divisors(dtype):
    """Eager's 1.0 // 0.1 is 9.0 (not floor(1 / 0.1)), inf // 0.5 NaN, 1.5 // 0.0 inf, 0.0 // -3.0 -0.0."""
    a = torch.tensor([1.0, math.inf, -math.inf, 1.5, -1.5, 0.0, -0.0, 7.0, -7.25, math.nan, 3.0, 0.3], dtype=dtype)
    b = torch.tensor([0.1, 0.5, 2.0, 0.0, 0.0, -3.0, 3.0, -2.0, 0.5, 1.0, -0.0, 0.1], dtype=dtype)
    _same_floats(run_compiled(lambda x, y: x // y, a, b), a // b)


def test_an_op_on_constants_a_lowering_makes_is_folded():
    """The median of a constant tensor: legalize's sort negates its constant keys, a kernel with no tile to read
    (codegen raised AttributeError)."""
    x = torch.tensor([4.0, 1.0, 3.0, 2.0])
    fn = lambda t: torch.tensor([4.0, 1.0, 3.0, 2.0]).median() + t  # noqa: E731
    assert torch.equal(run_compiled(fn, x), fn(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8])
def test_integer_abs_is_exact_and_wraps_at_the_minimum_as_eager(dtype):
    """|2**24 + 1| was 2**24: ABS is a Scalar-engine function, computed in fp32."""
    info = torch.iinfo(dtype)
    values = [info.min, info.max, -1, 0, 7] + ([2**24 + 1, -(2**24 + 3)] if info.bits >= 32 else [-100])
    x = torch.tensor(values, dtype=dtype)
    assert torch.equal(run_compiled(torch.abs, x), torch.abs(x))


def _numbers_with_16_bit_tensors(t):
    """Eager keeps a number in fp32 for x * c and x / c (its result rounded once) and rounds it to x's dtype for
    x + c and c - x."""
    return t * 0.1, t / 0.3, t + 0.1, 0.3 - t, (t * 0.7 + 0.2) / 1.3, t * 1e5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_numbers_meet_16_bit_tensors_as_in_eager_bit_for_bit(dtype):
    """torch-mlir rounded every number to the tensor's dtype: bf16 x * 0.1 differed from eager in a fifth of the
    elements, x / 0.3 in half, and fp16 x * 1e5 was x * inf (NaN at 0)."""
    x = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[0] = 0.0
    for got, want in zip(run_compiled(_numbers_with_16_bit_tensors, x), _numbers_with_16_bit_tensors(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, fn", [
    ("a // b", lambda a, b: a // b),
    ("trunc(a / b)", lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    ("a // 0.7", lambda a, b: a // 0.7),
    ("trunc(a / 3.3)", lambda a, b: torch.div(a, 3.3, rounding_mode="trunc")),
])
def test_floor_and_trunc_division_match_eager_bit_for_bit(dtype, name, fn):
    """Eager rounds each step of a 16-bit tensor division to its dtype (the quotient before it is floored), but
    computes a 16-bit tensor over a number in fp32; 0 / -2 truncated is -0.0 (torch-mlir's trunc gave +0.0)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, generator=g) * 3000, torch.randn(256, generator=g) * 3
    a[:6], b[:6] = torch.tensor([0.0, -0.0, 2047.0, math.inf, 1.5, 7.0]), torch.tensor([-2.0, 3.0, 0.999, 0.5, 0.0, -0.0])
    a, b = a.to(dtype), b.to(dtype)
    _same_floats(run_compiled(fn, a, b), fn(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, fn", [
    ("elu", torch.nn.functional.elu),
    ("leaky_relu", lambda t: torch.nn.functional.leaky_relu(t, 0.1)),
    ("logaddexp", lambda t: torch.logaddexp(t, t * 0.5)),
    ("log_softmax", lambda t: t.log_softmax(-1)),
])
def test_16_bit_activations_are_computed_in_fp32_and_rounded_once_as_in_eager(dtype, name, fn):
    """torch-mlir computed them in several steps each rounded to the 16-bit dtype: 9-18% of the elements differed
    from eager (log_softmax: eager keeps the sum and its log in the input's dtype; so does neuronc now)."""
    x = (torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    assert torch.equal(run_compiled(fn, x), fn(x)), name


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_bf16_gelu_differs_from_eager_only_where_fp32_functions_do(approximate):
    """GELU in fp32, rounded once: 44% of the elements differed from eager when each step was rounded to bf16; the
    few left differ by one step or below 1e-6 (the far negative tail), where numpy's fp32 erf or tanh is not glibc's."""
    x = (torch.randn(2048, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    got, want = run_compiled(lambda t: torch.nn.functional.gelu(t, approximate=approximate), x), \
        torch.nn.functional.gelu(x, approximate=approximate)
    differ = got != want
    assert differ.float().mean() < 0.03
    torch.testing.assert_close(got[differ], want[differ], rtol=2**-7, atol=1e-6)  # one bf16 step, or below 1e-6


_UNIT = torch.rand(1024, generator=torch.Generator().manual_seed(1)) * 1.98 - 0.99


@pytest.mark.parametrize("name, fn, x", [
    ("log10", torch.log10, _UNIT.abs() * 5 + 0.01),
    ("log2", torch.log2, _UNIT.abs() * 5 + 0.01),
    ("asin", torch.asin, _UNIT),
    ("acosh", torch.acosh, _UNIT.abs() * 5 + 1),
    ("atanh", torch.atanh, _UNIT),
    ("logaddexp2", lambda t: torch.logaddexp2(t, t * 0.5), _UNIT * 4),
    ("cumprod", lambda t: (t.view(32, 32) * 0.1 + 1).cumprod(-1), _UNIT),
    ("logcumsumexp", lambda t: t.view(32, 32).logcumsumexp(-1), _UNIT * 4),
])
def test_16_bit_math_functions_and_scans_round_once_as_in_eager(name, fn, x):
    """torch-mlir computes log10 as log(x) / log(10), asin through atan2, ... each step rounded to bf16 (27-47% of
    the elements differed from eager); the scans multiplied or added in bf16 (cumprod: 70%)."""
    x = x.bfloat16()
    assert torch.equal(run_compiled(fn, x), fn(x)), name


@pytest.mark.parametrize("exponent", [3, -2, 2, 0.5, 1.5])
def test_bf16_powers_by_a_number_are_eagers_bit_for_bit(exponent):
    """Eager's bf16 x ** 3 and x ** -2 are x * x * x and 1 / (x * x), each step rounded to bf16 (a fifth to a quarter
    of the elements differed when the power was rounded once); other exponents round once."""
    x = (torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    fn = lambda t: t ** exponent  # noqa: E731
    _same_floats(run_compiled(fn, x), fn(x))
