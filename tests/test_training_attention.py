"""F.scaled_dot_product_attention in training through torch.compile(backend="neuron"): kept whole through AOTAutograd
and run as the NKI library's flash forward and backward kernels (frontend/sdpa_training.py), its gradients against
eager CPU autograd (bf16: the fp32 math on the same rounded inputs, rounded once), causal, masked and grouped-query."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from neuronc.pytorch import backend
from neuronc.tolerances import TOLERANCES
from tests.conftest import OnDevice
from tests.zoo import SdpaCausalSelfAttention, TransformerBlock

B, H, S, D = 1, 2, 256, 32


def assert_ran_the_flash_kernels(graphs, other_matmuls=False):
    """The forward and backward graphs ran the library's flash kernels and, unless the model has ``other_matmuls``,
    made no S x S scores (no matmul)."""
    forward, backward = ([k.ops[0] for k in graph.compiled.neff.kernels] for graph in graphs[-2:])
    assert "nki:flash_attention_forward" in forward and (other_matmuls or "matmul" not in forward), forward
    assert "nki:flash_attention_backward" in backward and (other_matmuls or "matmul" not in backward), backward


def masks() -> dict:
    torch.manual_seed(1)
    keep = torch.rand(B, 1, S, S) > 0.4
    keep |= torch.eye(S, dtype=torch.bool)  # every query sees a key
    additive = torch.randn(S, S)
    additive[:, S // 2:] = -torch.inf  # -inf entries: whole key blocks masked for every row
    additive[:, 0] = 0.0
    return {"causal": dict(is_causal=True), "bool_mask": dict(attn_mask=keep),
            "float_mask": dict(attn_mask=additive), "plain": {}}


def gradients(q, k, v, kwargs, dtype, compiled=None):
    """(q, k, v) gradients of sum(out * weights): eager fp32 on the rounded inputs (rounded once to ``dtype``), or
    through ``compiled``."""
    inputs = [t.to(dtype).detach() for t in (q, k, v)]
    if compiled is None:
        inputs = [t.float() for t in inputs]
    for t in inputs:
        t.requires_grad_(True)
    kw = {key: value.to(torch.float32 if compiled is None else dtype)
          if isinstance(value, torch.Tensor) and value.is_floating_point() else value for key, value in kwargs.items()}
    out = (compiled or F.scaled_dot_product_attention)(*inputs, **kw, enable_gqa=k.shape[1] != q.shape[1])
    torch.manual_seed(2)
    (out.float() * torch.randn(out.shape)).sum().backward()
    return [out.detach().to(dtype)] + [t.grad.to(dtype) for t in inputs]


@pytest.mark.parametrize("form,dtype,kv_heads", [
    ("causal", torch.float32, H), ("causal", torch.bfloat16, H), ("bool_mask", torch.float32, H),
    ("float_mask", torch.float32, H), ("bool_mask", torch.bfloat16, H), ("plain", torch.float32, 1)])
def test_sdpa_trains_in_the_flash_kernels_like_eager(form, dtype, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D)
    k, v = (torch.randn(B, kv_heads, S, D) for _ in range(2))
    kwargs = masks()[form]
    compiled = OnDevice(lambda *args, **kw: F.scaled_dot_product_attention(*args, **kw))
    got = gradients(q, k, v, kwargs, dtype, compiled)
    want = gradients(q, k, v, kwargs, dtype)
    for name, g, w in zip(("out", "q", "k", "v"), got, want):
        torch.testing.assert_close(g, w, **TOLERANCES[dtype], msg=name)
    assert_ran_the_flash_kernels(compiled.graphs)


def gradients_like_eager(model, x) -> OnDevice:
    """One backward of mean(model(x)^2) compiled and eager: every parameter's gradient equal; the compiled model."""
    reference = copy.deepcopy(model)
    compiled = OnDevice(model)
    compiled(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, **TOLERANCES[torch.float32], msg=name)
    return compiled


def test_a_gpt2_style_block_trains_with_the_flash_kernels_like_eager():
    torch.manual_seed(0)
    model, x = TransformerBlock(64, 2, attention=SdpaCausalSelfAttention), torch.randn(2, 128, 64)
    assert_ran_the_flash_kernels(gradients_like_eager(model, x).graphs, other_matmuls=True)


def test_inference_keeps_the_decomposed_form():
    """Under no_grad SDPA is decomposed as before (the attention pass makes it the compiler's flash kernel)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    compiled = OnDevice(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with torch.no_grad():
        compiled(q, k, v)
    kernels = [k_.ops[0] for k_ in backend.compiled_graphs[-1].compiled.neff.kernels]
    assert "nki:flash_attention_forward" not in kernels


def test_attention_written_out_trains_in_the_flash_kernels_like_eager():
    """The zoo's GPT-2 block writes its attention as matmul, scale, masked_fill(~tril, -inf), softmax, matmul: in a
    training graph that chain becomes SDPA (is_causal) and takes the flash kernels; its gradients stay eager's."""
    torch.manual_seed(0)
    model, x = TransformerBlock(64, 2), torch.randn(1, 128, 64)
    assert_ran_the_flash_kernels(gradients_like_eager(model, x).graphs, other_matmuls=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_trains_with_one_row_wise_forward_kernel_like_eager(dtype):
    """The training forward of a layer-norm saves no statistics (the backward recomputes them,
    frontend/norm_training.py), so it is one row-wise kernel; its gradients stay eager's (bf16: the fp32 math on
    the same rounded values, rounded once; the weight's and bias's, sums of 256 bf16 products, are checked in fp32
    only: in bf16 they miss that reference by as much with or without this change, and eager bf16 by more)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(96, eps=1e-3)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x, weights = torch.randn(256, 96).to(dtype), torch.randn(256, 96)
    compiled_norm, reference = copy.deepcopy(norm).to(dtype), copy.deepcopy(norm).to(dtype).float()
    compiled = OnDevice(compiled_norm)
    got_x, want_x = x.clone().requires_grad_(True), x.float().requires_grad_(True)
    (compiled(got_x).float() * weights).sum().backward()
    (reference(want_x) * weights).sum().backward()
    torch.testing.assert_close(got_x.grad, want_x.grad.to(dtype), **TOLERANCES[dtype], msg="x")
    for (name, p), r in zip(compiled_norm.named_parameters(), reference.parameters()):
        if dtype == torch.float32:
            torch.testing.assert_close(p.grad, r.grad, **TOLERANCES[dtype], msg=name)
    forward = [k.name.rsplit("_", 1)[0] for k in compiled.graphs[-2].compiled.neff.kernels]
    assert "rowwise" in forward and "reduce_last" not in forward, forward
