"""The kernel library written in the NKI-compatible language (neuronc.nki.library) against eager PyTorch."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neuronc.isa import DESTINATIONS, Engine, Opcode, Space
from neuronc.nki.library import flash_attention_backward, flash_attention_forward, moe_combine, moe_dispatch, rmsnorm
from neuronc.tolerances import TOLERANCES


def as_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def randn(*shape, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_eager(dtype):
    x, w = randn(200, 384, dtype=dtype), randn(384, dtype=dtype, seed=1)
    out = as_torch(rmsnorm(as_numpy(x), as_numpy(w), 1e-6))
    expected = F.rms_norm(x.float(), (384,), w.float(), 1e-6).to(dtype)  # fp32 reference rounded once
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def reference_attention(q, k, v, causal):
    q, k, v = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    return q, k, v, F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_forward_and_backward_match_eager(causal, dtype):
    heads, seq, dim = 2, 256, 64
    q, k, v, grad = (randn(heads, seq, dim, dtype=dtype, seed=s) for s in range(4))
    out, lse = flash_attention_forward(*(as_numpy(x) for x in (q, k, v)), causal=causal)
    rq, rk, rv, expected = reference_attention(q, k, v, causal)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(as_torch(out), expected.detach().to(dtype), **tolerance)
    scores = (rq @ rk.transpose(-1, -2)) / dim ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(torch.from_numpy(lse), torch.logsumexp(scores, -1).detach(), **TOLERANCES[torch.float32]
                               if dtype == torch.float32 else tolerance)
    expected.backward(grad.float())
    grads = flash_attention_backward(*(as_numpy(x) for x in (q, k, v)), out, as_numpy(grad), lse, causal=causal)
    for got, want in zip(grads, (rq, rk, rv)):
        torch.testing.assert_close(as_torch(got), want.grad.to(dtype), **tolerance)



@pytest.mark.parametrize("heads, seq, dim, dtype", [
    (1, 256, 128, torch.bfloat16),  # q, k, v, dO transposed on the Tensor engine (d > 64), dQ summed in PSUM
    (1, 640, 128, torch.float32),  # fp32 transposes over two PSUM banks; dQ summed in SBUF (5 x 128 fp32 > a bank)
    (1, 1152, 64, torch.bfloat16),  # transposed by DMA; dQ summed in SBUF (9 x 64 fp32 > a bank)
])
def test_flash_attention_backward_matches_eager_on_each_of_its_transpose_and_dq_paths(heads, seq, dim, dtype):
    q, k, v, grad = (randn(heads, seq, dim, dtype=dtype, seed=s) for s in range(4))
    out, lse = flash_attention_forward(*(as_numpy(x) for x in (q, k, v)), causal=True)
    rq, rk, rv, expected = reference_attention(q, k, v, True)
    expected.backward(grad.float())
    grads = flash_attention_backward(*(as_numpy(x) for x in (q, k, v)), out, as_numpy(grad), lse, causal=True)
    for got, want in zip(grads, (rq, rk, rv)):
        torch.testing.assert_close(as_torch(got), want.grad.to(dtype), **TOLERANCES[dtype])


def _traced_backward(heads, seq, dim):
    q = np.zeros((heads, seq, dim), ml_dtypes.bfloat16)
    return flash_attention_backward.trace(q, q, q, q, q, np.zeros((heads, seq), np.float32))


def test_the_flash_backward_moves_each_heads_rows_and_gradients_by_whole_heads():
    """A head's O rows are one load, its dq, dk, dv one store each (a transfer may be cut into two partition
    slices on two queues), not one DMA per 128-row tile."""
    heads, tiles = 2, 4
    traced = _traced_backward(heads, tiles * 128, 64)
    dmas = [e for e in traced.instrs if e.engine == Engine.DMA]
    for storage in [traced.inputs[3]] + traced.outputs:
        touching = [e for e in dmas if any(s.id == storage.id for s, _ in e.operands)]
        assert 0 < len(touching) <= 2 * heads, (storage.name, len(touching))


def test_the_flash_backward_sums_dq_in_psum_where_a_head_fits_one_bank():
    """At seq 512, d 64 a head's dQ ([128, 4, 64] fp32, 1 KiB a partition) accumulates in PSUM over the key tiles:
    no elementwise instruction adds each block's dS K to an SBUF sum."""
    traced = _traced_backward(2, 512, 64)
    adds = [e for e in traced.instrs if e.opcode == Opcode.TENSOR_TENSOR
            and any(s.space == Space.PSUM for s, _ in e.operands)]
    assert not adds, len(adds)



def test_the_flash_forward_matches_eager_over_several_key_blocks():
    """At seq 640 the last query tile's keys come in two blocks (512 + 128): its output is rescaled by the running
    max of the first block, kept negated."""
    q, k, v = (randn(1, 640, 64, dtype=torch.bfloat16, seed=s) for s in range(3))
    out, lse = flash_attention_forward(*(as_numpy(x) for x in (q, k, v)), causal=True)
    rq, rk, _, expected = reference_attention(q, k, v, True)
    torch.testing.assert_close(as_torch(out), expected.detach().to(torch.bfloat16), **TOLERANCES[torch.bfloat16])
    scores = (rq @ rk.transpose(-1, -2)) / 64 ** 0.5
    scores = scores.masked_fill(torch.ones(640, 640, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(torch.from_numpy(lse), torch.logsumexp(scores, -1).detach(),
                               **TOLERANCES[torch.bfloat16])


def test_the_flash_forward_computes_each_exps_bias_straight_from_the_blocks_max():
    """The exp's bias (minus the running max) is one instruction after the block's max reduction, on every key
    block (seq 640: one block, then two for the last query tile), not a max and then its negation."""
    q = np.zeros((1, 640, 64), ml_dtypes.bfloat16)
    traced = flash_attention_forward.trace(q, q, q, causal=True)
    writes = {e.opcode: DESTINATIONS.get(e.opcode, 1) for e in traced.instrs}
    writer = {s.id: e for e in traced.instrs for s, _ in e.operands[:writes[e.opcode]]}
    maxima = {s.id for e in traced.instrs if e.opcode == Opcode.TENSOR_REDUCE for s, _ in e.operands[:1]}
    exps = [e for e in traced.instrs if e.opcode == Opcode.ACTIVATE_BIAS_REDUCE  # of the scores, not a rescaling
            and any(s.space == Space.PSUM for s, _ in e.operands)]
    assert len(exps) == 6  # 5 query tiles, the last over two key blocks
    for e in exps:
        sources = [writer[s.id] for s, _ in e.operands[writes[e.opcode]:] if s.id in writer]
        assert any(any(s.id in maxima for s, _ in w.operands[writes[w.opcode]:]) for w in sources), e


SOFT_CAP = (("div", (("score",), ("imm", 10.0))), ("tanh", (("step", 0),)), ("mul", (("step", 1), ("imm", 10.0))))
ALIBI = (("sub", (("kv",), ("q",))), ("add", (("h",), ("imm", 1.0))), ("mul", (("step", 1), ("imm", -4.0))),
         ("exp2", (("step", 2),)), ("mul", (("step", 0), ("step", 3))), ("add", (("score",), ("step", 4))))


def soft_cap(score, h, q, kv):
    return torch.tanh(score / 10.0) * 10.0


def alibi(score, h, q, kv):
    return score + (kv - q) * torch.exp2(-(h + 1) * 4.0)


def block_table(mask: np.ndarray) -> tuple:
    """HIDDEN / PARTLY / KEPT per 128 x 128 block of a keep-mask."""
    tiles = mask.shape[0] // 128
    cells = mask.reshape(tiles, 128, tiles, 128)
    return tuple(tuple(2 if cells[i, :, j].all() else 1 if cells[i, :, j].any() else 0 for j in range(tiles))
                 for i in range(tiles))


@pytest.mark.parametrize("name,steps,score_mod,masked,dtype", [
    ("soft cap, window, rows with no key", SOFT_CAP, soft_cap, True, torch.float32),
    ("alibi, no mask", ALIBI, alibi, False, torch.bfloat16)])
def test_flash_attention_with_a_score_mod_and_a_mask_matches_eager(name, steps, score_mod, masked, dtype):
    heads, seq, dim = 2, 256, 32
    q, k, v, grad = (randn(heads, seq, dim, dtype=dtype, seed=s) for s in range(4))
    qi, ki = torch.arange(seq).view(seq, 1), torch.arange(seq).view(1, seq)
    mask = (qi >= ki) & (qi - ki < 64) & (qi >= 16)  # a sliding window; queries 0-15 see no key
    options = dict(causal=False, score_mod=steps, heads=heads)
    if masked:
        options.update(mask=mask.numpy(), blocks=block_table(mask.numpy()))
        assert options["blocks"] == ((1, 0), (1, 1))  # the hidden block is skipped
    out, lse = flash_attention_forward(*(as_numpy(x) for x in (q, k, v)), **options)
    rq, rk, rv = (x.float().clone().requires_grad_() for x in (q, k, v))
    scores = score_mod(rq @ rk.transpose(-1, -2) / dim ** 0.5, torch.arange(heads).view(heads, 1, 1), qi, ki)
    if masked:
        scores = scores.masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ rv  # flex_attention: a row with no key is 0
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(as_torch(out), expected.detach().to(dtype), **tolerance)
    torch.testing.assert_close(torch.from_numpy(lse), torch.logsumexp(scores, -1).detach(), **tolerance)
    expected.backward(grad.float())
    grads = flash_attention_backward(*(as_numpy(x) for x in (q, k, v)), out, as_numpy(grad), lse, **options)
    for got, want in zip(grads, (rq, rk, rv)):
        torch.testing.assert_close(as_torch(got), want.grad.to(dtype), **tolerance)


def routing(tokens: int, slots: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, tokens, slots).astype(np.int32)  # tokens repeat across slots


def test_moe_dispatch_gathers_each_slots_token():
    x = randn(300, 96)
    slots = routing(300, 4 * 80)
    out = moe_dispatch(x.numpy(), slots)
    torch.testing.assert_close(torch.from_numpy(out), x[torch.from_numpy(slots).long()], rtol=0, atol=0)


def test_moe_combine_adds_each_slots_gated_output_to_its_token():
    tokens, slots = 300, 4 * 80
    expert_out, gates, index = randn(slots, 96), torch.rand(slots), routing(tokens, slots, seed=1)
    y = moe_combine(expert_out.numpy(), index, gates.numpy(), tokens)
    expected = torch.zeros(tokens, 96).index_add(0, torch.from_numpy(index).long(), expert_out * gates[:, None])
    torch.testing.assert_close(torch.from_numpy(y), expected, **TOLERANCES[torch.float32])


# score + slope[h] * (kv - q) + bias[h, q, kv]: a per-head slope (a column term) and a bias grid (a [seq, seq] term)
TERMS = (("sub", (("kv",), ("q",))), ("mul", (("term", 0), ("step", 0))), ("add", (("score",), ("step", 1))),
         ("add", (("step", 2), ("term", 1))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_time_terms_of_a_score_mod_and_their_gradients_match_eager(dtype):
    heads, seq, dim = 2, 256, 32
    q, k, v, grad = (randn(heads, seq, dim, dtype=dtype, seed=s) for s in range(4))
    slopes = torch.tensor([0.5, 0.0625]).view(1, heads, 1, 1)  # ALiBi's slopes
    bias = randn(1, heads, seq, seq, seed=5) * 0.5
    terms = (slopes.expand(1, heads, seq, 1).contiguous().numpy(), bias.numpy())
    qi, ki = torch.arange(seq).view(seq, 1), torch.arange(seq).view(1, seq)
    mask = (qi >= ki) & (qi - ki < 160)
    options = dict(causal=False, score_mod=TERMS, mask=mask.numpy(), blocks=block_table(mask.numpy()), heads=heads,
                   terms=terms)
    out, lse = flash_attention_forward(*(as_numpy(x) for x in (q, k, v)), **options)
    rq, rk, rv = (x.float().clone().requires_grad_() for x in (q, k, v))
    rs, rb = slopes[0].clone().requires_grad_(), bias[0].clone().requires_grad_()
    scores = rq @ rk.transpose(-1, -2) / dim ** 0.5 + rs * (ki - qi) + rb
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ rv
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(as_torch(out), expected.detach().to(dtype), **tolerance)
    expected.backward(grad.float())
    grads = flash_attention_backward(*(as_numpy(x) for x in (q, k, v)), out, as_numpy(grad), lse, **options,
                                     term_grads=(0, 1))
    for got, want in zip(grads, (rq, rk, rv)):
        torch.testing.assert_close(as_torch(got), want.grad.to(dtype), **tolerance)
    slope_rows, bias_grid = grads[3:]  # dY * dy/dterm: row sums for the column, the grid for the [seq, seq] term
    assert slope_rows.shape == (heads, seq) and bias_grid.shape == (heads, seq, seq)
    torch.testing.assert_close(torch.from_numpy(slope_rows).sum(1), rs.grad.flatten(), **tolerance)
    torch.testing.assert_close(torch.from_numpy(bias_grid), rb.grad, **tolerance)
