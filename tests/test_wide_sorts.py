"""Sorts, top-k, kthvalue and median of rows wider than the TOPK kernel's tile (passes/wide_sorts.py), compiled
strictly on the device, values and indices against eager PyTorch on CPU."""
from __future__ import annotations

import pytest
import torch

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.context import PassContext
from neuronc.passes.wide_sorts import split_wide_sorts
from neuronc.placement import tile_free_elements
from neuronc.targets import get_target
from tests.conftest import run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")

WIDE = tile_free_elements(get_target()) + 300  # wider than the TOPK kernel's tile (3584 fp32 values on trn2)


def _equal(got, want):
    """Equal element for element (NaN where eager's is), dtype and shape too."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def _float_keys(dtype, n=WIDE):
    """Two rows of n keys: ties everywhere (few distinct values) with NaN, +-inf, -0 and 0 among them."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randint(-20, 20, (2, n), generator=g).float() / 4).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0]).to(dtype)
    x[:, ::7] = specials[torch.randint(0, 5, (2, len(range(0, n, 7))), generator=g)]
    return x


def _int_keys(n=WIDE):
    g = torch.Generator().manual_seed(22)
    x = torch.randint(-(2 ** 31), 2 ** 31 - 1, (2, n), generator=g, dtype=torch.int64).to(torch.int32)
    x[:, ::5] = torch.randint(-3, 3, (2, len(range(0, n, 5))), generator=g, dtype=torch.int32)  # ties
    x[0, :4] = torch.tensor([-(2 ** 31), 2 ** 31 - 1, 16777217, 16777216], dtype=torch.int32)
    return x


def _sorts(t):
    ascending = torch.sort(t, dim=1, stable=True)
    descending = torch.sort(t, dim=1, descending=True, stable=True)
    return ascending.values, ascending.indices, descending.values, descending.indices, torch.argsort(t, dim=1,
                                                                                                      stable=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wide_sort_of_floats_is_eagers_stable_sort_with_nan_inf_and_zeros(dtype):
    x = _float_keys(dtype)
    for got, want in zip(run_compiled(_sorts, x), _sorts(x)):
        _equal(got, want)


def test_a_wide_sort_of_int32_keys_past_fp32s_significand_is_eagers_stable_sort():
    x = _int_keys()
    for got, want in zip(run_compiled(_sorts, x), _sorts(x)):
        _equal(got, want)


def test_a_sort_of_8000_values_as_opinfo_samples_it():
    x = torch.randn(8000, generator=torch.Generator().manual_seed(23))
    x[::97] = x[1]  # ties
    x[5], x[17] = float("nan"), -0.0
    for got, want in zip(run_compiled(lambda t: torch.sort(t, stable=True), x), torch.sort(x, stable=True)):
        _equal(got, want)
    _equal(run_compiled(torch.msort, x), torch.msort(x))


def _top_ks(t):
    largest, smallest = torch.topk(t, 8, dim=1), torch.topk(t, 300, dim=1, largest=False)
    return largest.values, largest.indices, smallest.values, smallest.indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_a_top_k_of_a_wide_row_of_distinct_keys_equals_eager(dtype):
    g = torch.Generator().manual_seed(24)
    v = torch.stack([torch.randperm(8000, generator=g) for _ in range(3)])
    if dtype is torch.bfloat16:  # 8000 distinct bf16 values: significand 128 + v % 128, exponent v // 128
        x = ((128 + v % 128).float() * 2.0 ** (v // 128 - 30)).to(dtype)
    else:
        x = (v - 4000).to(dtype)
    if dtype.is_floating_point:
        x[0, 4000], x[1, 7999], x[2, 0] = float("nan"), float("inf"), float("-inf")
    for got, want in zip(run_compiled(_top_ks, x), _top_ks(x)):
        _equal(got, want)


def test_a_top_k_of_a_wide_row_keeps_ties_in_input_order():
    # eager's CPU top-k orders tied indices as its partition leaves them (not input order); its values are
    # checked, and the indices against eager's stable sort's first k, which a top-k of ties can only match
    x = _float_keys(torch.float32, 8000)
    got = run_compiled(_top_ks, x)
    for g_values, w_values in zip(got[0::2], _top_ks(x)[0::2]):
        _equal(g_values, w_values)
    _equal(got[1], torch.sort(x, dim=1, descending=True, stable=True).indices[:, :8])
    _equal(got[3], torch.sort(x, dim=1, stable=True).indices[:, :300])


def test_kthvalue_and_median_of_wide_rows_equal_eager():
    x = torch.randn(2, WIDE, generator=torch.Generator().manual_seed(25))
    x[1, 100] = float("nan")  # median of a row with NaN: its first NaN

    def ranks(t):
        k, m = torch.kthvalue(t, 1234, dim=1), torch.median(t, dim=1)
        return k.values, k.indices, m.values, m.indices

    for got, want in zip(run_compiled(ranks, x), ranks(x)):
        _equal(got, want)


def _wide_topk_graph(n, k):
    p = ir.node(Op.PARAMETER, [], (4, n), DType.F32, index=0, name="x", kind="input")
    top = ir.node(Op.TOPK, [p], (4, k), DType.I32, dimension=1, k=k, descending=True)
    return ir.Graph([p], [top])


@pytest.mark.parametrize("k", [8, 8000])
def test_no_topk_wider_than_a_tile_is_left(k):
    ctx = PassContext()
    graph = split_wide_sorts(_wide_topk_graph(8000, k), ctx)
    widths = [node.inputs[0].shape[node.attrs["dimension"]] for node in graph.nodes() if node.op is Op.TOPK]
    assert all(w <= tile_free_elements(ctx.target) for w in widths)
    assert (len(widths) >= 2) if k == 8 else (widths == [])  # chunks and a merge; a count uses no TOPK


def test_a_wide_sort_of_64_bit_keys_is_refused_with_the_way_out():
    p = ir.node(Op.PARAMETER, [], (1, 8000), DType.I64, index=0, name="x", kind="input")
    top = ir.node(Op.TOPK, [p], (1, 8000), DType.I32, dimension=1, k=8000, descending=True)
    with pytest.raises(NeuronCompileError, match="rows wider than a tile"):
        split_wide_sorts(ir.Graph([p], [top]), PassContext())
