"""Grouped-query attention, in every form models write it, is one flash-attention kernel (passes/attention.py) that
reads each K/V head where it lies, once per group of query heads: K and V repeated per group by repeat_interleave
(the zoo's LlamaBlock), by Hugging Face's `repeat_kv` (expand + reshape), or left to scaled_dot_product_attention's
enable_gqa; in fp32 and bf16; causal, with a boolean or an additive mask; and Hugging Face's LlamaModel through
torch.compile. Outputs match eager PyTorch on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc.instruction_cost import hbm_bytes
from neuronc.ir import Op
from neuronc.isa import Engine
from tests.conftest import assert_matches_eager, compile_and_run

BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 100, 32
GROUP = HEADS // KV_HEADS
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """Hugging Face's form (transformers' modeling_llama.repeat_kv): a new axis expanded, then merged."""
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv_heads, n, seq, dim).reshape(batch, kv_heads * n, seq, dim)


class GroupedQueryAttention(nn.Module):
    def __init__(self, form: str, causal: bool = True):
        super().__init__()
        self.form, self.causal = form, causal

    def forward(self, q, k, v, mask=None):
        n = q.shape[1] // k.shape[1]
        if self.form == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=True)
        if self.form == "repeat_interleave":
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        else:
            k, v = repeat_kv(k, n), repeat_kv(v, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)


def _qkv(dtype):
    torch.manual_seed(0)
    return tuple((torch.randn(BATCH, heads, SEQ, DIM) * 1.5).to(dtype) for heads in (HEADS, KV_HEADS, KV_HEADS))


def _the_attention(compiled, mask_shape: tuple | None = None):
    """The one ATTENTION node, the last kernel; before it, only kernels of `mask_shape` (SDPA's decomposition turns
    a boolean mask into an additive one first, at the mask's own [batch, 1, Sq, Sk] size)."""
    kernels = [n for n in compiled.graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE, Op.CONSTANT)]
    *preparation, attention = kernels
    assert attention.op is Op.ATTENTION  # no K/V repeat, no scores, no softmax of their own
    assert all(n.shape == mask_shape for n in preparation)
    assert len(compiled.neff.kernels) == len(kernels)
    assert attention.attrs["batch_shape"] == (BATCH, KV_HEADS, GROUP)  # query head h reads K/V head h // GROUP
    return attention


def _hbm_bytes(neff) -> int:
    return sum(hbm_bytes(i) for (engine, _), stream in neff.streams.items() if engine == Engine.DMA for i in stream)


def _nbytes(*tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


@DTYPES
@pytest.mark.parametrize("form", ["repeat_interleave", "repeat_kv", "enable_gqa"])
def test_every_gqa_form_is_one_kernel_reading_each_kv_head_once_and_matches_eager(form, dtype):
    model, inputs = GroupedQueryAttention(form), _qkv(dtype)
    compiled, out = compile_and_run(model, inputs)
    assert _the_attention(compiled).attrs["mask"] == "causal"
    # Q, K and V read and the output written once each: K and V are repeated neither in HBM nor by the loads
    assert _hbm_bytes(compiled.neff) == _nbytes(*inputs, out)
    assert_matches_eager(out, model(*inputs))


@DTYPES
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_gqa_attention_with_a_mask_over_its_heads_is_one_kernel_and_matches_eager(kind, dtype):
    """The mask as Hugging Face gives it, [batch, 1, Sq, Sk], broadcast over the heads."""
    inputs = _qkv(dtype)
    torch.manual_seed(1)
    keep = torch.rand(BATCH, 1, SEQ, SEQ) > 0.3
    keep[..., 0] = True  # no fully masked row
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(keep.shape), -torch.inf).to(dtype)
    model = GroupedQueryAttention("repeat_kv", causal=False)
    compiled, out = compile_and_run(model, (*inputs, mask))
    attention = _the_attention(compiled, mask.shape)
    assert attention.attrs["mask"] == "add"
    assert attention.inputs[3].shape == mask.shape  # read by every head of a batch where it lies
    assert_matches_eager(out, model(*inputs, mask))


@DTYPES
def test_hugging_face_llamas_grouped_query_attention_is_the_flash_kernel_through_torch_compile(dtype):
    """transformers' LlamaModel (its SDPA attention, GQA 4/2 heads, RoPE), built from a small config (no download),
    compiled by torch.compile(backend="neuron"): its attention is one flash-attention kernel."""
    from transformers import LlamaConfig, LlamaModel

    from neuronc.pytorch import backend

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaModel(config).eval().to(dtype)
    ids = torch.randint(0, 128, (BATCH, 64))
    torch._dynamo.reset()
    first = len(backend.compiled_graphs)
    with torch.no_grad():
        want = model(ids).last_hidden_state
        got = torch.compile(model, backend="neuron", fullgraph=True)(ids).last_hidden_state
    (graph,) = backend.compiled_graphs[first:]
    kinds = [kernel.name.rsplit("_", 1)[0] for kernel in graph.compiled.neff.kernels]
    assert kinds.count("attention") == 1 and "reduce_last" not in kinds
    torch._dynamo.reset()
    assert_matches_eager(got, want)
