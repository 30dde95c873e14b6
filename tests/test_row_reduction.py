"""The row reduction kernel (REDUCE_LAST: out[r] = reduce(x[r, :])) moves what it must and no more: a chunk's
load is cut over several DMA queues, a per-row input of its prologue (a mean the variance subtracts) is loaded as
one value a row, not a chunk of copies, and the row tiles' results are stored together at the end; the numbers
are eager PyTorch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.isa import Engine, Space
from tests.conftest import assert_matches_eager, compile_module, run_program


class Variance(nn.Module):
    """The layer-norm backward's recomputed statistics: a row mean, then the mean of squares about it."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        return ((x - mean) ** 2).mean(-1, keepdim=True), mean


@pytest.fixture(scope="module")
def variance():
    torch.manual_seed(0)
    x = torch.randn(300, 768)  # two whole row tiles and a partial one
    compiled = compile_module(Variance(), (x,))
    outputs = run_program(compiled.neff, (x,))
    return x, compiled, outputs


def _dmas(compiled, node) -> list:
    """The DMAs of the kernel computing `node` (the n-th REDUCE_LAST node's kernel is the n-th reduction kernel)."""
    kernels = [k for k, kernel in enumerate(compiled.neff.kernels) if kernel.name.startswith("reduce_last")]
    index = kernels[_reductions(compiled).index(node)]
    return [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA
            for i in stream if i.kernel == index]


def _reductions(compiled) -> list:
    return [n for n in compiled.graph.nodes() if n.op is Op.REDUCE_LAST]


def test_the_statistics_match_eager(variance):
    x, _, outputs = variance
    for out, expected in zip(outputs, Variance()(x)):
        assert_matches_eager(out, expected)


def test_a_per_row_input_is_loaded_once_a_row(variance):
    _, compiled, _ = variance
    squares = [n for n in _reductions(compiled) if n.attrs.get("prologue")]
    assert len(squares) == 1 and any(view[1][1] == 0 for view in squares[0].attrs["views"])  # reads the mean per row
    loads = [i for i in _dmas(compiled, squares[0]) if i.srcs[0].space == Space.HBM]
    x_bytes, mean_bytes = 300 * 768 * 4, 300 * 4
    assert sum(i.srcs[0].num_elements * i.srcs[0].dtype.itemsize for i in loads) == x_bytes + mean_bytes


def test_a_row_tiles_load_is_cut_over_several_queues_and_the_results_stored_at_the_end(variance):
    _, compiled, _ = variance
    plain = [n for n in _reductions(compiled) if not n.attrs.get("prologue")]
    assert len(plain) == 1
    dmas = _dmas(compiled, plain[0])
    loads = [i for i in dmas if i.srcs[0].space == Space.HBM]
    stores = [i for i in dmas if i.dst.space == Space.HBM]
    assert len({i.queue for i in loads}) > 3
    for queue in {i.queue for i in dmas}:  # no store ahead of a load on a queue, where it would hold the load back
        kinds = [i.dst.space == Space.HBM for i in dmas if i.queue == queue]
        assert kinds == sorted(kinds)
    assert sum(i.dst.num_elements for i in stores) == 300
