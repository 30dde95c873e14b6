"""One meaning of a FlexAttention score_mod's steps for both kernels that run them (neuronc/score_mod_steps.py)."""
from __future__ import annotations

import math

import torch

from neuronc.codegen import score_mod as compiler_kernel
from neuronc.frontend.flex_attention import _STEP_OPS
from neuronc.nki.library import score_steps as library_kernels
from neuronc.score_mod_steps import BINARY, OPS, UNARY, number


def test_both_kernels_have_an_instruction_for_every_step_and_no_other():
    for kernel in (compiler_kernel, library_kernels):
        assert set(kernel._UNARY) == set(UNARY)
        assert set(kernel._BINARY) == set(BINARY)


def test_every_step_the_frontend_makes_has_a_meaning():
    assert set(_STEP_OPS.values()) <= OPS


def test_a_folded_step_is_a_float_as_torch_computes_it_in_fp32():
    x, y = 1.5, -2.0
    for op, torch_op in (("add", torch.add), ("max", torch.maximum), ("min", torch.minimum), ("lt", torch.lt),
                         ("ge", torch.ge), ("eq", torch.eq), ("pow", torch.pow)):
        got = number(op, x, y)
        assert type(got) is float
        assert math.isclose(got, torch_op(torch.tensor(x), torch.tensor(y)).float().item(), rel_tol=1e-6)
    for op, torch_op in (("exp2", torch.exp2), ("sigmoid", torch.sigmoid), ("sign", torch.sign),
                         ("floor", torch.floor), ("rsqrt", torch.rsqrt)):
        got = number(op, 2.7)
        assert type(got) is float
        assert math.isclose(got, torch_op(torch.tensor(2.7, dtype=torch.float64)).item(), rel_tol=1e-12)
    assert number("where", 0.0, 1.0, 2.0) == 2.0 and number("where", 1.0, 1.0, 2.0) == 1.0
