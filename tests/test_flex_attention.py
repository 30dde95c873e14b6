"""FlexAttention under torch.compile(backend="neuron"): score_mods and block masks against eager, fp32 and bf16,
forward and backward; the forward of a static mask is one flash-attention kernel, the score_mod inside it."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from neuronc.ir import Op
from neuronc.pytorch.backend import compiled_graphs
from neuronc.tolerances import TOLERANCES

B, H, S, D = 1, 2, 256, 32
DOCUMENTS = torch.tensor([0] * 100 + [1] * 60 + [2] * 96)  # three packed documents


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 64)


def prefix_lm(b, h, q, kv):
    return (kv < 48) | (q >= kv)


def document(b, h, q, kv):
    return DOCUMENTS[q] == DOCUMENTS[kv]


def relative_bias(score, b, h, q, kv):
    return score + (q - kv) * 0.05


def alibi(score, b, h, q, kv):
    return score + (kv - q) * torch.exp2(-(h + 1) * 8.0 / H)


def soft_cap(score, b, h, q, kv):
    return torch.tanh(score / 10.0) * 10.0


def clamped(score, b, h, q, kv):
    return torch.clamp(score, -1.0, 1.0)


def floored(score, b, h, q, kv):
    return torch.maximum(score, torch.tensor(-0.5))


def qkv(dtype, device="cpu", seed=0):
    torch.manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, dtype=dtype).to(device) for _ in range(3))


def expected(q, k, v, score_mod, mask_mod):
    """Eager flex_attention on CPU, in fp32 on the same (rounded) inputs, rounded once to the inputs' dtype."""
    mask = create_block_mask(mask_mod, B, H, S, S, device="cpu") if mask_mod else None
    out = flex_attention(*(x.cpu().float() for x in (q, k, v)), score_mod=score_mod, block_mask=mask)
    return out.to(q.dtype)


def compiled_attention(score_mod, mask_mod, device="cpu"):
    mask = create_block_mask(mask_mod, B, H, S, S, device=device) if mask_mod else None
    return torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask),
                         backend="neuron")


def last_kernels() -> list:
    return [k.ops for k in compiled_graphs[-1].compiled.neff.kernels]


@pytest.mark.parametrize("score_mod,mask_mod", [
    (None, causal), (relative_bias, causal), (alibi, sliding_window), (soft_cap, None), (None, prefix_lm),
    (relative_bias, document), (clamped, sliding_window), (floored, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_forward_matches_eager(score_mod, mask_mod, dtype):
    torch._dynamo.reset()
    q, k, v = qkv(dtype)
    out = compiled_attention(score_mod, mask_mod)(q, k, v)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected(q, k, v, score_mod, mask_mod), **TOLERANCES[dtype])


@pytest.mark.parametrize("score_mod,mask_mod", [(relative_bias, causal), (soft_cap, sliding_window),
                                                (clamped, causal), (floored, None)])
def test_a_static_mask_and_score_mod_run_as_one_flash_kernel(score_mod, mask_mod):
    torch._dynamo.reset()
    q, k, v = qkv(torch.float32)
    compiled_attention(score_mod, mask_mod)(q, k, v)
    assert [ops[0] for ops in last_kernels()] == ["flex_attention"]


def test_a_causal_block_mask_is_the_built_in_causal_mask():
    torch._dynamo.reset()
    q, k, v = qkv(torch.float32)
    compiled_attention(None, causal)(q, k, v)
    (kernel,) = [n for n in compiled_graphs[-1].compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert kernel.attrs["mask"] == "causal" and kernel.attrs["causal_offset"] == 0


def test_a_document_mask_is_computed_by_the_graph_and_read_by_the_flash_kernel():
    torch._dynamo.reset()
    q, k, v = qkv(torch.float32)
    compiled_attention(None, document)(q, k, v)
    kernels = [ops[0] for ops in last_kernels()]
    assert kernels[-1] == "flex_attention" and kernels.count("flex_attention") == 1 and "matmul" not in kernels
    (kernel,) = [n for n in compiled_graphs[-1].compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert kernel.attrs["mask"] == "select" and kernel.inputs[3].op is not Op.CONSTANT


@pytest.mark.parametrize("score_mod,mask_mod,dtype", [
    (relative_bias, causal, torch.float32), (relative_bias, causal, torch.bfloat16),
    (soft_cap, sliding_window, torch.float32), (soft_cap, sliding_window, torch.bfloat16),
    (alibi, prefix_lm, torch.float32), (clamped, causal, torch.float32), (clamped, causal, torch.bfloat16),
    (floored, sliding_window, torch.float32)])
def test_training_with_a_score_mod_and_a_mask_runs_the_flash_kernels(score_mod, mask_mod, dtype):
    torch._dynamo.reset()
    assert_trains_like_eager(compiled_attention(score_mod, mask_mod, device="neuron"), qkv(dtype), score_mod, mask_mod,
                             dtype)
    assert_ran_the_flash_kernels()


@pytest.mark.parametrize("mask_mod,dtype", [(causal, torch.float32), (causal, torch.bfloat16), (None, torch.float32)])
def test_training_without_a_score_mod_runs_the_flash_forward_and_backward_kernels(mask_mod, dtype):
    torch._dynamo.reset()
    assert_trains_like_eager(compiled_attention(None, mask_mod, device="neuron"), qkv(dtype), None, mask_mod, dtype)
    assert_ran_the_flash_kernels()


def assert_ran_the_flash_kernels():
    """The last forward and backward graphs ran the library's flash kernels, no dense scores (no matmul)."""
    forward, backward = ([k.ops[0] for k in graph.compiled.neff.kernels] for graph in compiled_graphs[-2:])
    assert "nki:flash_attention_forward" in forward and "matmul" not in forward
    assert "nki:flash_attention_backward" in backward and "matmul" not in backward


def assert_trains_like_eager(run, inputs, score_mod, mask_mod, dtype):
    """`run` of `inputs` moved to `neuron`, output and gradients of q, k, v, against flex_attention_dense on the CPU
    in fp32, within `dtype`'s tolerance. Returns the output's gradient it drew."""
    grad = torch.randn(B, H, S, D, dtype=dtype)
    device_inputs = [x.to("neuron").requires_grad_() for x in inputs]
    out = run(*device_inputs)
    out.backward(grad.to("neuron"))
    reference = [x.float().requires_grad_() for x in inputs]
    eager_out = flex_attention_dense(*reference, score_mod, mask_mod)
    eager_out.backward(grad.float())
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu(), eager_out.detach().to(dtype), **tolerance)
    for got, want in zip(device_inputs, reference):
        torch.testing.assert_close(got.grad.cpu(), want.grad.to(dtype), **tolerance)
    return grad


def documents_on(device):
    """The document mask reading its ids on the queries' device (as a CUDA user's mask reads a CUDA tensor)."""
    ids = DOCUMENTS.to(device)

    def document_mask(b, h, q, kv):
        return ids[q] == ids[kv]

    return document_mask


def gqa_qkv(dtype, kv_heads: int, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, H, S, D, dtype=dtype)
    return q, torch.randn(B, kv_heads, S, D, dtype=dtype), torch.randn(B, kv_heads, S, D, dtype=dtype)


@pytest.mark.parametrize("score_mod,mask_mod,dtype", [(None, causal, torch.float32),
                                                       (alibi, sliding_window, torch.float32),
                                                       (alibi, sliding_window, torch.bfloat16)])
def test_gqa_runs_as_one_flash_kernel_matching_eager(score_mod, mask_mod, dtype):
    torch._dynamo.reset()
    q, k, v = gqa_qkv(dtype, kv_heads=1)
    mask = create_block_mask(mask_mod, B, H, S, S, device="cpu")
    out = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                                       enable_gqa=True), backend="neuron")(q, k, v)
    assert [ops[0] for ops in last_kernels()] == ["flex_attention"]
    want = flex_attention(q.float(), k.float(), v.float(), score_mod=score_mod, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, want.to(dtype), **TOLERANCES[dtype])


@pytest.mark.parametrize("gqa,mask_mod", [(True, causal), (False, document)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_and_document_masks_train_on_neuron_tensors(gqa, mask_mod, dtype):
    torch._dynamo.reset()
    inputs = gqa_qkv(dtype, kv_heads=1 if gqa else H)
    device_mask = documents_on("neuron") if mask_mod is document else mask_mod
    mask = create_block_mask(device_mask, B, H, S, S, device="neuron")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa), backend="neuron")
    assert_trains_like_eager(run, inputs, None, mask_mod, dtype)
    assert_ran_the_flash_kernels()  # a document mask: computed by the graph, read by the kernels


def flex_attention_dense(q, k, v, score_mod, mask_mod):
    """flex_attention's math on CPU with autograd (eager flex_attention has no CPU backward): the scores, the
    score_mod and mask_mod applied elementwise, softmax, @ v; GQA's K/V heads repeated for their query heads."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    idx = torch.arange(S)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    qi, ki = idx.view(1, 1, S, 1), idx.view(1, 1, 1, S)
    scores = q @ k.transpose(-2, -1) * D ** -0.5
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    return torch.softmax(scores, -1) @ v


def learned_bias(table):
    """A relative-position bias learned per head: ``table[h, q - kv + S - 1]``, a tensor the score_mod captures."""
    def score_mod(score, b, h, q, kv):
        return score + table[h, q - kv + S - 1]

    return score_mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_learned_bias_table_trains_with_its_gradient(dtype):
    torch._dynamo.reset()
    torch.manual_seed(1)
    table = torch.randn(H, 2 * S - 1).to(dtype)
    device_table = table.to("neuron").requires_grad_()
    reference_table = table.float().requires_grad_()
    inputs = qkv(dtype)
    mask = create_block_mask(causal, B, H, S, S, device="neuron")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=learned_bias(device_table), block_mask=mask),
                        backend="neuron")
    grad = assert_trains_like_eager(run, inputs, learned_bias(reference_table), causal, dtype)
    assert_ran_the_flash_kernels()
    got, want = device_table.grad.cpu(), reference_table.grad
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    else:  # each entry sums dS over a diagonal (cancelling terms): held to eager bf16's own error on the same inputs
        eager_table = table.clone().requires_grad_()
        eager_inputs = [x.clone().requires_grad_() for x in inputs]
        flex_attention_dense(*eager_inputs, learned_bias(eager_table), causal).backward(grad)
        eager_error = (eager_table.grad.float() - want).abs().max()
        assert (got.float() - want).abs().max() <= eager_error


def alibi_slopes(slopes):
    """ALiBi with its per-head slopes a tensor the score_mod captures (``slopes[h]``), as models hold them."""
    def score_mod(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    return score_mod


def slopes_and_table(dtype):
    torch.manual_seed(1)
    return torch.tensor([0.5, 0.0625]).to(dtype), (torch.randn(H, 2 * S - 1) * 0.5).to(dtype)


def library_kernel():
    (kernel,) = [n for n in compiled_graphs[-1].compiled.graph.nodes() if n.op is Op.CUSTOM_KERNEL]
    return kernel


@pytest.mark.parametrize("reads", ["slopes", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_score_mod_reading_tensors_runs_in_the_flash_kernel(reads, dtype):
    torch._dynamo.reset()
    slopes, table = slopes_and_table(dtype)
    score_mod = alibi_slopes(slopes) if reads == "slopes" else learned_bias(table)
    q, k, v = qkv(dtype)
    out = compiled_attention(score_mod, sliding_window)(q, k, v)
    kernels = [ops[0] for ops in last_kernels()]
    assert "nki:flash_attention_forward" in kernels and "matmul" not in kernels
    torch.testing.assert_close(out, expected(q, k, v, score_mod, sliding_window), **TOLERANCES[dtype])


def test_per_head_slopes_are_read_as_a_column_and_a_relative_bias_table_as_itself():
    torch._dynamo.reset()
    slopes, table = slopes_and_table(torch.float32)
    compiled_attention(alibi_slopes(slopes), causal)(*qkv(torch.float32))
    # slopes[h]: one value per head, read as a [1, H, S, 1] column or (passes/kernel_views.py) through that
    # broadcasting view of the slopes themselves; never an [H, S, S] grid
    assert library_kernel().inputs[-1].size in (H * S, H)
    torch._dynamo.reset()
    compiled_attention(learned_bias(table), causal)(*qkv(torch.float32))
    assert library_kernel().inputs[-1].shape == (H, 2 * S - 1)  # table[h, q - kv + S - 1]: no [H, S, S] grid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_slopes_train_with_their_gradient_in_the_flash_kernels(dtype):
    torch._dynamo.reset()
    slopes, _ = slopes_and_table(dtype)
    device_slopes = slopes.to("neuron").requires_grad_()
    reference_slopes = slopes.float().requires_grad_()
    mask = create_block_mask(sliding_window, B, H, S, S, device="neuron")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=alibi_slopes(device_slopes),
                                                       block_mask=mask), backend="neuron")
    assert_trains_like_eager(run, qkv(dtype), alibi_slopes(reference_slopes), sliding_window, dtype)
    assert_ran_the_flash_kernels()
    torch.testing.assert_close(device_slopes.grad.cpu(), reference_slopes.grad.to(dtype), **TOLERANCES[dtype])


WINDOWS = torch.tensor([32, 96])  # a sliding window per head


def documents_and_windows_on(device):
    """A mask_mod reading tensors and the head: each head's own window within each document."""
    ids, windows = DOCUMENTS.to(device), WINDOWS.to(device)

    def per_head_mask(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv) & (q - kv < windows[h])

    return per_head_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_per_head_run_time_mask_runs_in_the_flash_kernel(dtype):
    torch._dynamo.reset()
    q, k, v = qkv(dtype)
    mask_mod = documents_and_windows_on("cpu")
    out = compiled_attention(None, mask_mod)(q, k, v)
    kernels = [ops[0] for ops in last_kernels()]
    assert "nki:flash_attention_forward" in kernels and "matmul" not in kernels
    assert library_kernel().inputs[3].shape == (1, H, S, S)  # the mask, per head
    torch.testing.assert_close(out, expected(q, k, v, None, mask_mod), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_per_head_run_time_mask_trains_in_the_flash_kernels(dtype):
    torch._dynamo.reset()
    mask = create_block_mask(documents_and_windows_on("neuron"), B, H, S, S, device="neuron")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), backend="neuron")
    assert_trains_like_eager(run, qkv(dtype), None, documents_and_windows_on("cpu"), dtype)
    assert_ran_the_flash_kernels()
