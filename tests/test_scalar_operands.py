"""A Python number where an op's schema says Tensor (``x % 5`` reaches the device as ``remainder.Tensor(x, 5)``):
the op runs on the `neuron` device with CPU eager's values and dtype, not an error about the number's type."""
from __future__ import annotations

import pytest
import torch

from neuronc.frontend.scalar_overloads import scalar_overload

aten = torch.ops.aten

ON_THE_DEVICE = {  # each is lowered to the IR: it neither falls back nor is traced
    "int % 5": lambda i, f: i % 5,
    "int % -3": lambda i, f: i % -3,
    "7 % int": lambda i, f: 7 % i,
    "float % 2.5": lambda i, f: f % 2.5,
    "int % 2.5 (a float result)": lambda i, f: i % 2.5,
    "int32 % 5 (stays int32)": lambda i, f: i.int() % 5,
    "fmod by 5": lambda i, f: i.fmod(5),
    "in-place remainder_ by 2.5": lambda i, f: f.clone().remainder_(2.5),
    "int & 3": lambda i, f: i & 3,
    "int16 ^ 5 (stays int16)": lambda i, f: i.short() ^ 5,
}

ANYWHERE = {  # on the device or on the CPU with the fallback's warning, never an error
    "copysign by -1.0": lambda i, f: torch.copysign(f, -1.0),
    "xlogy by 2.0": lambda i, f: torch.xlogy(f.abs(), 2.0),
    "in-place bitwise_and_ by 6": lambda i, f: i.clone().bitwise_and_(6),
}


@pytest.fixture
def operands():
    torch.manual_seed(0)
    ints = torch.randint(-20, 20, (4, 6))
    ints[ints == 0] = 3
    return ints, torch.randn(4, 6) * 4


def _assert_same(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if expected.is_floating_point():
        torch.testing.assert_close(got, expected)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ON_THE_DEVICE)
def test_a_number_in_a_tensor_place_runs_lowered_on_the_device(name, operands, lowered_only):
    i, f = operands
    fn = ON_THE_DEVICE[name]
    _assert_same(fn(i.to(lowered_only), f.to(lowered_only)).cpu(), fn(i, f))


@pytest.mark.parametrize("name", ANYWHERE)
def test_a_number_in_a_tensor_place_gives_eagers_result(name, operands, neuron):
    i, f = operands
    fn = ANYWHERE[name]
    _assert_same(fn(i.to(neuron), f.to(neuron)).cpu(), fn(i, f))


def test_the_overload_taking_the_number_as_a_scalar_is_found_by_the_numbers_place():
    x = torch.ones(2)
    assert scalar_overload(aten.remainder.Tensor, (x, 5), {}) is aten.remainder.Scalar
    assert scalar_overload(aten.remainder.Tensor, (5, x), {}) is aten.remainder.Scalar_Tensor
    assert scalar_overload(aten.remainder.Tensor_out, (x, 5), {"out": x}) is aten.remainder.Scalar_out
    assert scalar_overload(aten.pow.Tensor_Tensor, (x, 2), {}) is aten.pow.Tensor_Scalar
    assert scalar_overload(aten.remainder.Tensor, (x, x), {}) is aten.remainder.Tensor  # no number: itself


def test_an_op_with_no_scalar_overload_is_left_as_it_is():
    x = torch.ones(2)
    assert scalar_overload(aten.atan2.default, (x, 2.0), {}) is aten.atan2.default
