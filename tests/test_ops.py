"""Ops beyond the first zoo, each checked against eager: embedding lookups and general gathers,
scatters (index_put, scatter_add, the backward of an embedding and of a cross-entropy), argmax/argmin,
sort and top-k, embedding bags, reversal, transposed convolution (kernel layouts other than [o, i, spatial]),
Python-style remainder."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neuronc.compiler import compile_exported
from neuronc.errors import NeuronCompileError, NeuronRuntimeError
from neuronc.ir import Op
from runtime import run_neff
from tests.conftest import OnDevice, assert_matches_eager


class TokenAndPosition(torch.nn.Module):
    def __init__(self, vocab=300, width=200, positions=16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))


@pytest.fixture(scope="module")
def embedding():
    torch.manual_seed(0)
    model, idx = TokenAndPosition().eval(), torch.randint(0, 300, (3, 16))
    return compile_exported(torch.export.export(model, (idx,))).neff, model, idx


def test_embedding_lookups_match_eager(embedding):
    neff, model, idx = embedding
    out = run_neff(neff, [idx.numpy()]).outputs[0]
    assert_matches_eager(torch.from_numpy(out), model(idx).detach())


def test_an_index_out_of_range_is_an_error_naming_the_lookup(embedding):
    neff, _, idx = embedding
    bad = idx.numpy().copy()
    bad[1, 3] = 300
    with pytest.raises(NeuronRuntimeError, match="300") as caught:
        run_neff(neff, [bad])
    assert "DMA_GATHER" in str(caught.value) and "test_ops.py" in str(caught.value)


def test_torch_compile_of_an_embedding_matches_eager():
    torch.manual_seed(1)
    model, idx = TokenAndPosition(vocab=50, width=8).eval(), torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert_matches_eager(OnDevice(model)(idx), model(idx))


class Flip(torch.nn.Module):
    def forward(self, x):
        return torch.flip(x, [0, 2]) * 2


class UpConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return self.up(x)


@pytest.mark.parametrize("model, shape", [(Flip(), (3, 4, 5)), (UpConv(), (2, 4, 5, 5))], ids=["flip", "conv_transpose"])
def test_reversal_and_transposed_convolution_match_eager(model, shape):
    torch.manual_seed(2)
    x = torch.randn(*shape)
    neff = compile_exported(torch.export.export(model.eval(), (x,))).neff
    out = run_neff(neff, [x.numpy()]).outputs[0]
    assert_matches_eager(torch.from_numpy(out), model(x).detach())


@pytest.mark.parametrize("divisor", [0.7, -0.7, 3, -3, "tensor"], ids=["f", "f-neg", "int", "int-neg", "tensor"])
def test_remainder_takes_the_divisor_sign_as_python_and_torch_do(divisor):
    torch.manual_seed(3)
    integer = isinstance(divisor, int)
    x = torch.randint(-9, 10, (4, 8)) if integer else torch.randn(4, 8) * 3
    args = (x, torch.randn(4, 8)) if divisor == "tensor" else (x,)
    fn = (lambda a, b: torch.remainder(a, b)) if divisor == "tensor" else (lambda a: a % divisor)
    assert_matches_eager(_compiled_outputs(fn, *args), fn(*args))


def test_integer_shifts_match_eager_including_amounts_of_the_width_and_more():
    x = torch.tensor([[1, -8, 123456, -7, 2 ** 20, 5, -1, 3]], dtype=torch.int32).repeat(3, 1)
    amounts = torch.tensor([0, 1, 3, 31, 4, 2, 32, 40], dtype=torch.int32)

    def shifts(x, s):
        return x << s, x >> s, x << 3, x >> 2, torch.bitwise_right_shift(-x, s)

    assert_matches_eager(_compiled_outputs(shifts, x, amounts), shifts(x, amounts))


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _compiled_outputs(fn, *args):
    neff = compile_exported(torch.export.export(Fn(fn), args)).neff
    return [torch.from_numpy(out) for out in run_neff(neff, [a.numpy() for a in args]).outputs]


_g = torch.Generator().manual_seed(3)
_x, _targets = torch.randn(4, 10, generator=_g), torch.tensor([1, 3, 0, 9])
INDEXING = {
    "take_along_dim": (lambda x, t: torch.gather(x, 1, t[:, None]), _x, _targets),
    "gather_middle_dim": (lambda x, i: torch.gather(x, 1, i), torch.randn(2, 6, 5, generator=_g),
                          torch.randint(0, 6, (2, 3, 5), generator=_g)),
    "index_select_columns": (lambda x, t: x.index_select(1, t), _x, _targets),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), _x, _targets),
    "cross_entropy_backward": (lambda x, t: torch.ops.aten.nll_loss_backward(
        torch.tensor(0.5), F.log_softmax(x, -1), t, None, 1, -100, torch.tensor(4.0)), _x, _targets),
    "embedding_backward_repeated_rows": (lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 10, -1, False),
                                         torch.randn(2, 3, 8, generator=_g), torch.tensor([[1, 2, 1], [0, 9, 1]])),
    "index_put": (lambda x, t, v: torch.index_put(x, (t,), v), torch.zeros(10, 3), _targets,
                  torch.randn(4, 3, generator=_g)),
    "index_put_accumulate": (lambda x, t, v: torch.index_put(x, (t,), v, accumulate=True), torch.ones(10, 3),
                             torch.tensor([1, 1, 2, 1]), torch.randn(4, 3, generator=_g)),
    "index_copy_inner_dim": (lambda c, p, k: c.index_copy(2, p, k), torch.randn(1, 4, 9, 5, generator=_g),
                             torch.tensor([6, 0]), torch.randn(1, 4, 2, 5, generator=_g)),
    "index_put_inner_dim_accumulate": (lambda c, p, v: torch.ops.aten.index_put(c, [None, p], v, True),
                                       torch.randn(3, 7, 2, generator=_g), torch.tensor([2, 2, 0]),
                                       torch.randn(3, 3, 2, generator=_g)),
    "scatter_add_columns": (lambda t, v: torch.zeros(4, 10).scatter_add(1, t[:, None], v), _targets,
                            torch.randn(4, 1, generator=_g)),
    "scatter_middle_dim": (lambda x, i, v: x.scatter(1, i, v), torch.randn(2, 6, 5, generator=_g),
                           torch.tensor([[[0, 1, 2, 3, 4]], [[5, 4, 3, 2, 1]]]), torch.randn(2, 1, 5, generator=_g)),
    "index_with_negative_indices": (lambda w, i: w[i] * 2, torch.randn(10, 3, generator=_g), torch.tensor([1, 4, -1])),
    "take_with_negative_indices": (lambda x, i: torch.take(x, i), _x, torch.tensor([0, -1, 5, -40])),
    "upsample_nearest": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), torch.randn(2, 3, 4, 5, generator=_g)),
    "max_pool_with_indices": (lambda x: F.max_pool2d(x, 2, return_indices=True), torch.randn(2, 3, 6, 6, generator=_g)),
    "max_pool_padded_strided_dilated": (lambda x: F.max_pool2d(x, 3, stride=2, padding=1, dilation=(1, 2),
                                                               return_indices=True), torch.randn(2, 3, 9, 11, generator=_g)),
    "argmax_last": (lambda x: x.argmax(-1), _x),
    "argmin_first": (lambda x: x.argmin(0), _x),
    "max_with_indices": (lambda x: x.max(-1), _x),
}


_ties = torch.randint(-100, 100, (5, 37), generator=_g)
SORTING = {
    "topk_last_dim": (lambda x: torch.topk(x, 3, dim=-1), _x),
    "topk_of_rows_with_minus_infinity": (lambda x: torch.topk(x, 4), torch.tensor(
        [[1.0, -math.inf, 3.0, -math.inf, 0.5, 2.0, -1.0, -2.0, 5.0]])),
    "topk_over_several_row_tiles": (lambda x: torch.topk(x, 20), torch.randn(300, 257, generator=_g)),
    "sort_ascending": (lambda x: torch.sort(x, dim=-1), _x),
    "sort_descending_first_dim": (lambda x: torch.sort(x, dim=0, descending=True), _x),
    "sort_rows_shorter_than_eight": (lambda x: torch.sort(x), torch.randn(3, 5, generator=_g)),
    "stable_sort_of_integers_with_ties": (lambda x: torch.sort(x, stable=True), _ties),
    "stable_descending_sort_with_ties": (lambda x: torch.sort(x, stable=True, descending=True), _ties),
    "argsort": (lambda x: torch.argsort(x, dim=-1), _x),
}


_table, _ids = torch.randn(20, 6, generator=_g), torch.tensor([3, 7, 7, 0, 19, 5, 2, 11])
_offsets = torch.tensor([0, 3, 3, 5])  # the second bag is empty
EMBEDDING_BAGS = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "per_sample_weights": dict(mode="sum", per_sample_weights=torch.rand(8, generator=_g)),
    "padding_idx": dict(mode="mean", padding_idx=7),
    "include_last_offset": dict(mode="sum", include_last_offset=True),
}


@pytest.mark.parametrize("name", sorted(EMBEDDING_BAGS))
def test_embedding_bags_match_eager(name):
    kwargs = EMBEDDING_BAGS[name]
    weights = kwargs.pop("per_sample_weights", None)
    args = (_table, _ids, _offsets) if weights is None else (_table, _ids, _offsets, weights)

    def bag(table, ids, offsets, weights=None):
        return F.embedding_bag(ids, table, offsets, per_sample_weights=weights, **kwargs)

    assert_matches_eager(_compiled_outputs(bag, *args), bag(*args))


@pytest.mark.parametrize("name", sorted(SORTING))
def test_sort_and_topk_match_eager(name):
    fn, *args = SORTING[name]
    assert_matches_eager(_compiled_outputs(fn, *args), fn(*args))


def test_a_sort_of_rows_wider_than_a_tile_is_refused_with_the_limit():
    with pytest.raises(NeuronCompileError, match=r"sort or top-k over rows of 200000 values: at most \d+ fit") as caught:
        compile_exported(torch.export.export(Fn(lambda x: torch.sort(x).values), (torch.randn(2, 200_000),)))
    assert "test_ops.py" in str(caught.value)


@pytest.mark.parametrize("name", sorted(INDEXING))
def test_indexing_ops_match_eager(name):
    fn, *args = INDEXING[name]
    assert_matches_eager(_compiled_outputs(fn, *args), fn(*args))


def test_argmax_picks_the_first_of_equal_values_like_eager():
    x = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    assert_matches_eager(_compiled_outputs(lambda x: x.argmax(-1), x), x.argmax(-1))


def test_a_gather_index_outside_the_operand_is_an_error_naming_the_line():
    neff = compile_exported(torch.export.export(Fn(lambda x, t: torch.gather(x, 1, t[:, None])), (_x, _targets))).neff
    with pytest.raises(NeuronRuntimeError, match="outside the table's 40 rows") as caught:
        run_neff(neff, [_x.numpy(), np.array([1, 3, 10, 9])])  # column 10 of a 10-column row: not the next row
    assert "test_ops.py" in str(caught.value)


def _static_cache_update(cache, position, new):
    return cache.index_copy(2, position, new)  # Hugging Face's static KV cache: an index_put at [None, None, pos]


_cache, _new = torch.randn(1, 4, 39, 32, generator=_g), torch.randn(1, 4, 1, 32, generator=_g)


def test_an_index_put_at_an_inner_dim_scatters_whole_rows_of_the_dims_after_it():
    compiled = compile_exported(torch.export.export(Fn(_static_cache_update), (_cache, torch.tensor([5]), _new)))
    scatters = [n for n in compiled.graph.nodes() if n.op is Op.SCATTER_ROWS]
    assert [n.shape for n in scatters] == [(4 * 39, 32)]  # a row of 32 per head, not 128 single elements
    out = run_neff(compiled.neff, [_cache.numpy(), np.array([5]), _new.numpy()]).outputs[0]
    assert torch.equal(torch.from_numpy(out), _static_cache_update(_cache, torch.tensor([5]), _new))


def test_an_inner_index_past_its_dim_is_an_error_not_a_write_into_the_next_block():
    neff = compile_exported(torch.export.export(Fn(_static_cache_update), (_cache, torch.tensor([5]), _new))).neff
    for position in (39, -40):  # row 39 of head 0 would be row 0 of head 1
        with pytest.raises(NeuronRuntimeError, match="outside the table's 156 rows"):
            run_neff(neff, [_cache.numpy(), np.array([position]), _new.numpy()])


def test_an_integer_clamp_with_only_a_lower_bound_keeps_large_values():
    # its upper bound is the largest int64, which a float64 immediate rounds up to 2**63: it must saturate
    x = torch.tensor([-5, 0, 3, 2**40])
    assert_matches_eager(_compiled_outputs(lambda x: x.clamp(min=1), x), x.clamp(min=1))


def _compiled_with_gradient(fn, x):
    """fn(x) and d(sum(fn(x) * w))/dx, compiled (torch.compile, backend neuron) and eager."""
    w = torch.randn(fn(x).shape, generator=torch.Generator().manual_seed(5))
    results, compiled = [], OnDevice(fn)
    for run in (compiled, fn):
        leaf = x.detach().clone().requires_grad_()
        out = run(leaf)
        (out * w).sum().backward()
        results.append((out.detach(), leaf.grad))
    assert len(compiled.graphs) == 2 and all(g.last_run is not None for g in compiled.graphs)  # backward ran too
    return results


# Pooling forms torch-mlir lowers to wrong numbers (divisor_override ignored; ceil_mode's last window padded on
# both sides) or not at all (avg_pool3d, max_pool3d backward): OpInfo's samples of them, on neuronc's own rules.
POOLING = {
    "avg_pool3d_divisor_override": (lambda x: F.avg_pool3d(x, 2, stride=1, padding=1, ceil_mode=True,
                                                           count_include_pad=False, divisor_override=2), (1, 2, 4, 4, 4)),
    "avg_pool3d_ceil_clipped_divisor": (lambda x: F.avg_pool3d(x, (2, 3, 4), stride=(1, 2, 2), padding=(0, 1, 2),
                                                               ceil_mode=True), (1, 2, 5, 5, 5)),
    "avg_pool2d_ceil_without_padding_counted": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True,
                                                                       count_include_pad=False), (1, 3, 8, 8)),
    "max_pool3d_ceil": (lambda x: F.max_pool3d(x, 3, stride=2, ceil_mode=True), (1, 2, 3, 6, 5)),
    "max_pool3d_dilated_padded": (lambda x: F.max_pool3d(x, 3, stride=2, padding=1, dilation=(1, 2, 1)),
                                  (1, 2, 4, 7, 5)),
}


@pytest.mark.parametrize("name", sorted(POOLING))
def test_pooling_forms_match_eager_forward_and_backward(name):
    fn, shape = POOLING[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 3
    (out, grad), (want, want_grad) = _compiled_with_gradient(fn, x)
    assert_matches_eager(out, want)
    assert_matches_eager(grad, want_grad)


def test_logcumsumexp_of_large_values_is_finite_as_in_eager():
    """torch-mlir lowers logcumsumexp as log(cumsum(exp(x))): inf for x above ~88 in float32."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2)) * 1e3
    x[0, 0] = float("-inf")
    fn = OnDevice(lambda t: torch.logcumsumexp(t, 1))
    out, want = fn(x), torch.logcumsumexp(x, 1)
    assert torch.isfinite(want[:, 1:]).all()
    assert_matches_eager(out, want)


@pytest.mark.parametrize("fn", [lambda x: torch.zeros_like(x), lambda x: torch.full_like(x, 2.0) + x],
                         ids=["zeros_like", "full_like_plus"])
def test_filling_an_empty_tensor_compiles_and_returns_it_empty(fn):
    x = torch.randn(0, 3)
    out = OnDevice(fn)(x)
    assert out.shape == (0, 3) and out.dtype == torch.float32


MISLOWERED = {**{name: POOLING[name] for name in ("avg_pool3d_divisor_override", "avg_pool3d_ceil_clipped_divisor",
                                                  "avg_pool2d_ceil_without_padding_counted", "max_pool3d_ceil")},
              "logcumsumexp": (lambda x: torch.logcumsumexp(x, 1), (5, 6))}


@pytest.mark.parametrize("name", sorted(MISLOWERED))
def test_a_form_torch_mlir_lowers_wrongly_is_refused_unless_decomposed(name):
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.mislowered import refuse_mislowered
    from neuronc.frontend.torch_import import decomposition_table

    fn, shape = MISLOWERED[name]
    x = torch.randn(shape)
    refuse_mislowered(make_fx(fn, decomposition_table=decomposition_table())(x))  # neuronc's own rule: no refusal
    with pytest.raises(NeuronCompileError, match="wrong results through torch-mlir"):
        refuse_mislowered(make_fx(fn)(x))


def test_compiling_an_undecomposed_graph_with_a_mislowered_form_is_an_error_not_wrong_numbers():
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import compile_fx

    gm = make_fx(lambda x: F.avg_pool3d(x, 2, stride=1, divisor_override=3))(torch.randn(1, 1, 3, 3, 3))
    with pytest.raises(NeuronCompileError, match="divisor_override is ignored"):
        compile_fx(gm)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


SLICE_SCATTERS = {
    "rotate_half": _rotate_half,  # RoPE: its backward writes each half's gradient into a slice
    "strided": lambda x: torch.slice_scatter(x, x[:, 1:7:3] * 2, 1, 1, 7, 3),
    "negative_bounds": lambda x: torch.slice_scatter(x, x[:, -5:-1].exp(), 1, -5, -1),
}


@pytest.mark.parametrize("name", sorted(SLICE_SCATTERS))
def test_slice_scatter_and_the_backward_of_slices_match_eager(name):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    (out, grad), (want, want_grad) = _compiled_with_gradient(SLICE_SCATTERS[name], x)
    assert_matches_eager(out, want)
    assert_matches_eager(grad, want_grad)
