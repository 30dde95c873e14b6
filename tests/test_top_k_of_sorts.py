"""torch.compile's top-k (torch-mlir: a sort of the whole row, then slices of its first k) compiled as a TOPK of k
(passes/top_k.py), against eager PyTorch on CPU."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuronc import ir
from neuronc.compiler import CompileOptions, compile_fx
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.passes.top_k import top_k_of_sorts
from tests.conftest import run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")

K = 8


def _distinct_keys(dtype):
    """Rows of distinct values (integers, exact in bf16) with a NaN, +inf and -inf: eager's top-k order is defined."""
    g = torch.Generator().manual_seed(21)
    x = torch.stack([torch.randperm(200, generator=g) - 100 for _ in range(6)]).to(dtype)
    x[0, 5], x[1, 7], x[2, 3], x[3, 150] = float("nan"), float("inf"), float("-inf"), -0.0
    return x


def _tied_keys(dtype):
    """Rows of four values (ties everywhere), NaN among them, and one row all NaN."""
    x = torch.randint(0, 4, (6, 200), generator=torch.Generator().manual_seed(22)).to(dtype)
    x[x == 3] = float("nan")
    x[1] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("largest", [True, False])
def test_compiled_topk_of_distinct_keys_equals_eager(dtype, largest):
    x = _distinct_keys(dtype)
    got, want = run_compiled(lambda t: torch.topk(t, K, largest=largest), x), torch.topk(x, K, largest=largest)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("largest", [True, False])
def test_compiled_topk_keeps_ties_in_input_order(dtype, largest):
    # eager's values; at ties eager's CPU top-k (a heap or nth_element, comparing values only) orders indices as
    # its partition leaves them, so the indices are checked against eager's stable sort, which keeps input order
    x = _tied_keys(dtype)
    got = run_compiled(lambda t: torch.topk(t, K, largest=largest), x)
    torch.testing.assert_close(got.values, torch.topk(x, K, largest=largest).values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got.indices, torch.sort(x, descending=largest, stable=True).indices[:, :K])


def test_compiled_topk_along_the_first_dim_equals_the_stable_sorts_first_k():
    x = _tied_keys(torch.float32).T.contiguous()
    got = run_compiled(lambda t: torch.topk(t, K, dim=0), x)
    want = torch.sort(x, dim=0, descending=True, stable=True)
    assert torch.equal(got.indices, want.indices[:K])
    torch.testing.assert_close(got.values, want.values[:K], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("largest", [True, False])
def test_a_compiled_topk_sorts_no_whole_row(dtype, largest):
    # before: a TOPK of the 1024 keys (fp32: two whole-row digit passes), then a slice of the first 8
    x = torch.randn(4, 1024).to(dtype)
    graph = compile_fx(make_fx(lambda t: torch.topk(t, K, largest=largest))(x), CompileOptions()).graph
    topks = [n for n in graph.nodes() if n.op is Op.TOPK]
    assert topks and all(n.attrs["k"] == K for n in topks)


def _sort_then(read):
    """The importer's graph of a sort of [4, 32] along dim 1 (TOPK positions, values gathered, indices converted),
    its outputs `read(values, indices)`."""
    x = ir.node(Op.PARAMETER, [], (4, 32), DType.F32, index=0, name="x", kind="input")
    positions = ir.node(Op.TOPK, [x], (4, 32), DType.I32, dimension=1, k=32, descending=True)
    values = ir.node(Op.GATHER, [x, positions], (4, 32), DType.F32, window_dims=(), dropped_dims=(1,),
                     operand_batching_dims=(0,), indices_batching_dims=(0,), index_map=(1,), index_vector_dim=2,
                     window=(1, 1))
    indices = ir.node(Op.CONVERT, [positions], (4, 32), DType.I64)
    return top_k_of_sorts(ir.Graph([x], list(read(values, indices))), None)


def _slice(x, start, limit):
    return ir.node(Op.SLICE, [x], (4, limit - start), x.dtype, start=(0, start), limit=(4, limit), strides=(1, 1))


def _topk_ks(graph):
    return sorted(n.attrs["k"] for n in graph.nodes() if n.op is Op.TOPK)


def test_slices_of_the_first_positions_narrow_the_sort_to_the_largest_k_read():
    graph = _sort_then(lambda v, i: (_slice(v, 0, 5), _slice(i, 0, 3), _slice(v, 0, 2)))
    assert _topk_ks(graph) == [5]
    assert [o.shape for o in graph.outputs] == [(4, 5), (4, 3), (4, 2)]


@pytest.mark.parametrize("read", [
    lambda v, i: (_slice(v, 0, 5), v),  # the whole sort is an output
    lambda v, i: (_slice(v, 1, 5),),  # not the first positions
    lambda v, i: (_slice(i, 0, 5), ir.node(Op.NEGATE, [v], v.shape, v.dtype)),  # the values read whole
])
def test_a_sort_read_beyond_its_first_positions_stays_whole(read):
    assert _topk_ks(_sort_then(read)) == [32]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool])
def test_an_ascending_sort_and_smallest_k_of_narrow_integers_equal_eager(dtype):
    # an ascending order is the descending order of the negation: negating a uint8 wraps, int8's -128 is its own
    info = torch.iinfo(dtype) if dtype is not torch.bool else None
    x = torch.tensor([[3, 0, 1, 0, 2, 1, 0, 3], [1, 0, 0, 1, 1, 0, 2, 2]]) if info is None else \
        torch.tensor([[3, 0, info.max, 1, info.min, 2, -1 if info.min else 7, 5]] * 2)
    x = x.to(dtype)

    def ordered(x):
        return torch.sort(x, dim=-1, stable=True), torch.sort(x, dim=0, stable=True).values, \
            torch.topk(x.to(torch.int32) if dtype is torch.bool else x, 3, largest=False, sorted=True).values

    got, want = run_compiled(ordered, x), ordered(x)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(g, w), (g, w)
