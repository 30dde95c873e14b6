"""Elementwise kernels move what they compute on and no more, without false orderings.

They cut a dense tensor into blocks of whole rows: a partition's share of the flattened tensor is
a multiple of a row (or a divisor of a long one), so the DMAs moving slices of partitions side by side on several
queues touch no row in common and the hazard tracking (codegen/sync.py, HBM by rows and bytes within a row) does
not order them one after another. A bf16 exact GELU as AOTAutograd hands it over (erf in fp32 between bf16 steps,
a [512, 3072] MLP activation) was 233 us, its transfers in a chain. And an operand that is one value per row
repeated along it (a layer-norm backward's mean and rstd in (x - mean) * rstd) is loaded as one value a
partition and read with stride 0, not as a block of copies. The numbers are eager PyTorch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuronc.codegen.blocks import blocks
from neuronc.isa import Engine, Space
from tests.conftest import assert_matches_eager, compile_and_run, compile_module


@pytest.mark.parametrize("shape, max_free, share", [((512, 3072), 3584, 3072), ((512, 768), 3584, 3072),
                                                    ((64, 5000), 3584, 2500), ((200, 96), 3584, 150)])
def test_a_partitions_share_of_a_dense_tensor_is_whole_rows(shape, max_free, share):
    strides = [(shape[1], 1), (shape[1], 1)]
    cut = list(blocks(shape, strides, max_free, 128))
    assert {b.free_elements for b in cut} == {share}
    assert sum(b.partitions * b.free_elements for b in cut) == shape[0] * shape[1]


class DecomposedGelu(nn.Module):
    def forward(self, x):
        erf = torch.erf((x * 0.70710678).float()).to(torch.bfloat16)
        return (x * 0.5) * (erf + 1)


def test_the_transfers_of_a_bf16_gelu_are_not_ordered_by_false_hazards():
    torch.manual_seed(0)
    x = torch.randn(512, 3072).to(torch.bfloat16)
    compiled, out = compile_and_run(DecomposedGelu(), (x,))
    assert_matches_eager(out, DecomposedGelu()(x))
    row_bytes = 3072 * 2
    dmas = [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA for i in stream]
    for dma in dmas:
        hbm = dma.dst if dma.dst.space == Space.HBM else dma.srcs[0]
        assert hbm.offset % row_bytes == 0 and hbm.num_elements % 3072 == 0  # whole rows
        assert not any(w.engine == Engine.DMA for w in dma.waits)  # no transfer waits for another queue's


class Normalised(nn.Module):
    def forward(self, x, mean, rstd):
        return (x - mean) * rstd


def test_a_per_row_operand_is_loaded_once_a_row():
    torch.manual_seed(0)
    x, mean, rstd = torch.randn(1, 300, 768), torch.randn(1, 300, 1), torch.rand(1, 300, 1)
    compiled, out = compile_and_run(Normalised(), (x, mean, rstd))
    assert_matches_eager(out, Normalised()(x, mean, rstd))
    loads = [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA for i in stream
             if i.srcs[0].space == Space.HBM]
    assert sum(i.srcs[0].num_elements for i in loads) == x.numel() + 2 * 300


def test_the_next_blocks_loads_are_issued_before_this_blocks_store(monkeypatch, no_compile_cache):
    """On the in-order DMA queues a load issued after a store waits for it, and the store waits for the block's
    steps: the loads of block n + 1 go ahead of block n's store."""
    from neuronc.codegen.emitter import Emitter

    issued = []
    dma = Emitter.dma

    def recording(self, dst, src, **kwargs):
        issued.append("store" if dst.space == Space.HBM else "load")
        return dma(self, dst, src, **kwargs)

    monkeypatch.setattr(Emitter, "dma", recording)
    x, mean, rstd = torch.randn(1, 512, 768), torch.randn(1, 512, 1), torch.rand(1, 512, 1)  # four blocks
    compile_module(Normalised(), (x, mean, rstd))
    blocks_of_rows = 4  # [128, 768] each
    loads_per_block, rest = divmod(issued.count("load"), blocks_of_rows)
    assert rest == 0 and loads_per_block > 0
    assert issued.index("store") == 2 * loads_per_block  # the first two blocks' loads precede the first store
