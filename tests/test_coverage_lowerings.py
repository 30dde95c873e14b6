"""neuronc's lowerings of ops OpInfo's whole run named "cannot be compiled" (issue 21; frontend/coverage_lowerings.py,
float_semantics.nextafter, torch's own decomposition of _batch_norm_with_update), each against eager on CPU, strictly
on the device. One graph computes every op (one compile for the module); each test checks its own outputs."""
from __future__ import annotations

import math

import pytest
import torch

from neuronc.tolerances import TOLERANCES
from tests.conftest import run_compiled

_generator = torch.Generator().manual_seed(0)
_A = torch.randn(6, 7, generator=_generator) * 3
_B = torch.randn(6, 7, generator=_generator) * 3
_SPECIAL = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 3e38, 1e-45, -1e-45, 1e-38, 2.5])
_MASK = torch.tensor([True, False, True, True, False, False])
_SCATTER_INDEX = torch.tensor([[0, 1, 2, 0, 1, 2, 0], [2, 2, 2, 1, 1, 0, 0]])
_BN_INPUT = torch.randn(4, 3, 5, generator=_generator)
_IMAGE = torch.randn(2, 3, 10, 20, generator=_generator)
_BN_WEIGHT, _BN_BIAS = torch.rand(3, generator=_generator), torch.randn(3, generator=_generator)
_RUNNING_MEAN, _RUNNING_VAR = torch.randn(3, generator=_generator), torch.rand(3, generator=_generator)


def _every_op(a, b, special, mask, scatter_index, bn_input, bn_weight, bn_bias, running_mean, running_var, image):
    """Every lowering under test, by name; `special` holds the IEEE edge cases (zeros of both signs, infinities,
    NaN, the largest finite and smallest subnormal magnitudes)."""
    pairs_x = special.repeat_interleave(special.numel())
    pairs_y = special.repeat(special.numel())
    batch_norm = torch.ops.aten._batch_norm_with_update(bn_input, bn_weight, bn_bias, running_mean, running_var,
                                                        0.1, 1e-5)
    return {
        "hypot": torch.hypot(a, b),
        "hypot_special": torch.hypot(pairs_x, pairs_y),
        "dist_2": torch.dist(a, b),
        "dist_3": torch.dist(a, b[0], 3),
        "dist_inf": torch.dist(a, b, math.inf),
        "dist_0": torch.dist(a.round(), b.round(), 0),
        "nextafter": torch.nextafter(a, b),
        "nextafter_special": torch.nextafter(pairs_x, pairs_y),
        "tan": torch.tan(a),
        "vector_norm_0d": torch.linalg.vector_norm(a[1, 1], 3.0),
        "vector_norm_0d_keepdim": torch.linalg.vector_norm(a[1, 2], 0.0, keepdim=True),
        "empty_like": torch.empty_like(a).shape,
        "cumsum_0d": torch.cumsum(a[0, 0], 0),
        "roll_by_zero": torch.roll(a, 0, 0),
        "roll_by_a_turn": torch.roll(a, 7, 1),
        "narrow_zero_length": torch.narrow_copy(a, 1, 0, 0),
        "index_put_row": a.index_put((mask,), b[0]),
        "index_put_row_accumulate": a.index_put((mask,), b[0], accumulate=True),
        "scatter_add": a.scatter(0, scatter_index, b, reduce="add"),
        "scatter_multiply": a.scatter(0, scatter_index, b, reduce="multiply"),
        "scatter_value_add": a.scatter(1, scatter_index, 2.5, reduce="add"),
        "batch_norm_with_update": batch_norm,
        "resize_antialiased_down": torch.nn.functional.interpolate(image, (3, 7), mode="bilinear", antialias=True),
        "resize_antialiased_up_corners": torch.nn.functional.interpolate(image, (17, 9), mode="bilinear",
                                                                         align_corners=True, antialias=True),
        "resize_antialiased_scales": torch.nn.functional.interpolate(image, scale_factor=(1.7, 0.9), mode="bilinear",
                                                                     antialias=True),
        "batch_norm_running_stats": (running_mean, running_var),
    }


def _inputs():
    return (_A, _B, _SPECIAL, _MASK, _SCATTER_INDEX, _BN_INPUT, _BN_WEIGHT, _BN_BIAS,
            _RUNNING_MEAN, _RUNNING_VAR, _IMAGE)


@pytest.fixture(scope="module")
def compiled_and_eager():
    """(compiled outputs, eager outputs): one compile, strictly on the device (what strictly_on_the_device sets,
    for the module's one compile)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
        got = run_compiled(_every_op, *[t.clone() for t in _inputs()])
    return got, _every_op(*[t.clone() for t in _inputs()])


EXACT = {"nextafter", "nextafter_special", "cumsum_0d", "roll_by_zero", "roll_by_a_turn", "narrow_zero_length",
         "index_put_row", "empty_like"}


@pytest.mark.parametrize("name", [
    "hypot", "hypot_special", "dist_2", "dist_3", "dist_inf", "dist_0", "nextafter", "nextafter_special", "tan",
    "vector_norm_0d", "vector_norm_0d_keepdim",
    "empty_like", "cumsum_0d", "roll_by_zero", "roll_by_a_turn", "narrow_zero_length", "index_put_row",
    "index_put_row_accumulate", "scatter_add", "scatter_multiply", "scatter_value_add", "batch_norm_with_update",
    "batch_norm_running_stats", "resize_antialiased_down", "resize_antialiased_up_corners",
    "resize_antialiased_scales"])
def test_matches_eager(compiled_and_eager, name):
    got, want = compiled_and_eager[0][name], compiled_and_eager[1][name]
    if name == "empty_like":
        assert got == want
        return
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{g.dtype}{list(g.shape)} != eager {w.dtype}{list(w.shape)}"
        if name in EXACT:  # bit for bit: a step of one ulp is the whole point
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)) if g.is_floating_point() else torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, equal_nan=True, **TOLERANCES[w.dtype])


_SQUARE = torch.randn(3, 5, 5, generator=_generator)
_RIGHT_SIDES = torch.randn(3, 5, 2, generator=_generator)


def _linalg_ops(square, right_sides):
    """triangular_solve's forms; the triangular matrices get a dominant diagonal (a well-conditioned solve), their
    other triangle is ignored."""
    triangular = square + 6 * torch.eye(5)
    return {
        "triangular_solve_upper": torch.triangular_solve(right_sides, triangular),
        "triangular_solve_lower_transposed": torch.triangular_solve(right_sides, triangular, upper=False,
                                                                    transpose=True),
        "triangular_solve_unit_broadcast": torch.triangular_solve(right_sides, triangular[0], unitriangular=True),
    }


@pytest.fixture(scope="module")
def linalg_compiled_and_eager():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
        got = run_compiled(_linalg_ops, _SQUARE, _RIGHT_SIDES)
    return got, _linalg_ops(_SQUARE, _RIGHT_SIDES)


@pytest.mark.parametrize("name", ["triangular_solve_upper",
                                  "triangular_solve_lower_transposed", "triangular_solve_unit_broadcast"])
def test_linalg_matches_eager(linalg_compiled_and_eager, name):
    got, want = linalg_compiled_and_eager[0][name], linalg_compiled_and_eager[1][name]
    got, want = (tuple(got), tuple(want)) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOLERANCES[w.dtype])


@pytest.mark.parametrize("name", ["hypot", "nextafter", "tan"])
def test_eager_neuron_tensors_run_the_same_lowerings_on_the_device(neuron, strictly_on_the_device, name):
    """Eager mode (ops on neuron tensors, one at a time) decomposes with the same table: these ops run on the
    device, not on the CPU fallback (disabled here), and match eager on CPU."""
    op = {"hypot": torch.hypot, "nextafter": torch.nextafter, "tan": lambda a, b: torch.tan(a)}[name]
    got = op(_A.to("neuron"), _B.to("neuron")).cpu()
    want = op(_A, _B)
    if name == "nextafter":
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    else:
        torch.testing.assert_close(got, want, **TOLERANCES[want.dtype])
