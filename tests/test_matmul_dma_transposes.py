"""A matmul operand read across its rows (A of x @ W^T: A^T's strips [K, rows]; B = W^T of a weight stored [out, in])
is a strided load at half a queue's rate, far down the payload curve. Where the tiling's price says so
(MatmulTiling.transposes) its strips load instead as DMA transposes, K tile by K tile, each a row tile of columns
(one SBUF hazard cell: the chunks of a K tile run side by side on their queues; trn2's [128, 16] units of a 2-byte
type at 0.9 of a queue's rate). Only how the operand reaches SBUF changes: the bits stay -O0's and match eager."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from neuronc.ir import Op
from neuronc.passes import tiling
from neuronc.targets import get_target
from neuronc.isa import Engine, Opcode
from tests.conftest import (assert_as_accurate_as_eager, assert_matches_eager, compile_module, o2_with_o0_bits,
                            run_program)


class Linear(nn.Module):
    def forward(self, x, w):
        return x @ w.t()


def _transposes(compiled) -> list:
    return [i for stream in compiled.neff.streams.values() for i in stream
            if i.engine is Engine.DMA and i.opcode is Opcode.DMA_TRANSPOSE]


def test_a_bf16_linear_loads_its_transposed_strips_as_dma_transposes_of_k_tiles_a_row_tile_at_a_time_with_o0s_bits():
    torch.manual_seed(0)
    x, w = torch.randn(512, 768).to(torch.bfloat16), torch.randn(2304, 768).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(Linear(), (x, w))
    assert_matches_eager(out, Linear()(x, w))
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert matmul.attrs["plan"].tiling.transposes  # the price chose them
    transposes = _transposes(compiled)
    assert transposes
    for instr in transposes:
        dst, src = instr.operands
        assert dst.partitions == 128 and src.dims[-1] == (1, 128)  # a whole K tile, contiguous in HBM
        assert dst.free_elements == 128  # a row tile of columns each: one SBUF hazard cell (256 bytes) of bf16
        # the chunks of a K tile share an SBUF page, not a hazard cell: none waits for another DMA (tracked by
        # pages, each would wait for the one before on its page, one queue at a time)
        assert not [w for w in instr.waits if w.engine is Engine.DMA]


def test_a_strip_of_three_row_tiles_loads_as_dma_transposes():
    """384 tokens: A's resident strip is 384 columns a K tile, three hazard cells and not whole SBUF pages (the
    transposes of two strips sharing a page would wait for each other); the price takes them for A and B (W given
    at run time, stored [out, in]); -O0's bits."""
    torch.manual_seed(0)
    x, w = torch.randn(384, 768).to(torch.bfloat16), torch.randn(1024, 768).to(torch.bfloat16)
    compiled, (out,) = o2_with_o0_bits(Linear(), (x, w))
    assert_matches_eager(out, Linear()(x, w))
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    tiling_ = matmul.attrs["plan"].tiling
    assert tiling_.resident == "a" and tiling_.block == 3 and "a" in tiling_.transposes
    assert len([i for i in _transposes(compiled) if i.operands[0].partitions == 128]) >= 6 * 3  # A's: 6 K tiles x 3


def test_fp32_operands_keep_their_strided_loads():
    torch.manual_seed(0)  # small integers: every fp32 sum exact whatever its order
    x, w = torch.randint(-4, 5, (512, 768)).float(), torch.randint(-4, 5, (1024, 768)).float()
    compiled, (out,) = o2_with_o0_bits(Linear(), (x, w))
    assert_matches_eager(out, Linear()(x, w))
    assert not _transposes(compiled)  # DMA transposes move 2-byte types only


class NormLinear(nn.Module):
    """A layer-norm read by x @ W^T, W given at run time (a training graph's weight: not stored transposed)."""

    def forward(self, x, w):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)) @ w.t()


def test_a_norm_prologues_matmul_may_load_w_by_dma_transposes_priced_with_the_bits_of_strided_loads(monkeypatch):
    """A matmul whose A a norm makes on chip (passes/norm_prologue.py) still loads B = W^T; its tiling search
    (tiling._prologue_search) may load B's strips as DMA transposes too, kept where `price` says they are cheaper.
    Taken (their price halved here, to force them), the kernel transposes W by DMA and gives the bits of the same
    kernel loading W^T strided, and eager's values."""
    torch.manual_seed(0)
    x, w = torch.randn(512, 768).to(torch.bfloat16), (torch.randn(3072, 768) * 0.05).to(torch.bfloat16)
    monkeypatch.setattr(tiling, "_PROLOGUES", {})  # the prologue tilings made once per key: made again here
    priced = compile_module(NormLinear(), (x, w), opt_level=2)
    (matmul,) = [n for n in priced.graph.nodes() if n.op is Op.MATMUL]
    chosen = matmul.attrs["plan"].matmul.tiling
    _, stage = tiling.prologue_stages(matmul)
    other = dataclasses.replace(chosen, transposes="" if chosen.transposes else "b")
    trn2 = get_target("trn2")
    assert tiling.price(stage, chosen, trn2) <= tiling.price(stage, other, trn2)

    price = tiling.price
    monkeypatch.setattr(tiling, "price", lambda node, t, *args, **kw: price(node, t, *args, **kw) / (2 if t.transposes
                                                                                                    else 1))
    monkeypatch.setattr(tiling, "_PROLOGUES", {})
    compiled = compile_module(NormLinear(), (x, w), opt_level=2)
    (matmul,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert matmul.attrs.get("prologue") is not None and matmul.attrs["plan"].matmul.tiling.transposes == "b"
    assert _transposes(compiled)
    (out,) = run_program(compiled.neff, (x, w))
    monkeypatch.setattr(tiling, "price", price)
    monkeypatch.setattr(tiling, "_transpose_options", lambda node, target: [])
    monkeypatch.setattr(tiling, "_PROLOGUES", {})
    strided = compile_module(NormLinear(), (x, w), opt_level=2)
    (plain,) = [n for n in strided.graph.nodes() if n.op is Op.MATMUL]
    assert plain.attrs.get("prologue") is not None and not _transposes(strided)
    (theirs,) = run_program(strided.neff, (x, w))
    assert torch.equal(out.view(torch.int16), theirs.view(torch.int16))
    assert_as_accurate_as_eager([out], NormLinear(), (x, w))
