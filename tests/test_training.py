"""Training through torch.compile: AOTAutograd's backward graph is compiled and runs on the
emulated device too, and the gradients match eager; a GPT-2-style model trains with AdamW step for
step like eager, in fp32 and under bf16 autocast."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from neuronc.pytorch import backend
from tests import zoo
from tests.conftest import TOLERANCES


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer_block"])
def test_gradients_of_a_compiled_model_match_eager(name):
    model, inputs = zoo.build(name)
    model.train()
    reference = copy.deepcopy(model)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(*inputs).pow(2).mean().backward()
    reference(*inputs).pow(2).mean().backward()
    forward, backward = backend.compiled_graphs[before:]  # both graphs went to the device
    assert forward.last_run is not None and backward.last_run is not None
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=pname)


def _adamw_losses(model, forward, idx, targets, steps, autocast):
    """The loss of every step of an AdamW loop over `model` run by `forward`, and the gradients after the
    first step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], None
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(idx, targets)
        loss.backward()
        if first_grads is None:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), first_grads


@pytest.mark.slow("20 AdamW steps of a 2-layer GPT-2 (bf16 ~36 s): the only check that compiled forward and backward "
                  "graphs stay equal to eager step for step through an optimiser, in fp32 and under bf16 autocast")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_gpt2_trains_with_adamw_like_eager_step_for_step(autocast):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zoo.GPT2(layers=2).train()
    reference = copy.deepcopy(model)
    idx, targets = torch.randint(0, 128, (4, 64)), torch.randint(0, 128, (4, 64))
    before = backend.compile_count()
    losses, grads = _adamw_losses(model, torch.compile(model, backend="neuron"), idx, targets, 20, autocast)
    expected_losses, expected_grads = _adamw_losses(reference, reference, idx, targets, 20,
                                                   autocast)
    assert backend.compile_count() - before == 2  # one forward and one backward graph, compiled once for 20 steps
    forward, backward = backend.compiled_graphs[-2:]
    assert forward.last_run is not None and backward.last_run is not None
    tolerance = TOLERANCES[torch.bfloat16 if autocast else torch.float32]
    torch.testing.assert_close(losses, expected_losses, **tolerance)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=name)


class GroupNormUpsample(torch.nn.Module):
    """The diffusion-UNet pieces: nearest upsampling, convolution, GroupNorm, SiLU."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 4)

    def forward(self, x):
        return F.silu(self.norm(self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))))


def test_gradients_through_group_norm_and_nearest_upsampling_match_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = GroupNormUpsample(), torch.randn(2, 4, 5, 5)
    reference = copy.deepcopy(model)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    forward, backward = backend.compiled_graphs[before:]  # both graphs went to the device, not eager
    assert forward.last_run is not None and backward.last_run is not None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=name)


class SdpaAttention(torch.nn.Module):
    """Self-attention through F.scaled_dot_product_attention (HF models' default): on CPU tensors it is the
    flash kernel, whose backward AOTAutograd records as one op."""

    def __init__(self, heads=4, kv_heads=4, width=32):
        super().__init__()
        self.heads, self.kv_heads, self.head = heads, kv_heads, width // heads
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head)

    def forward(self, x, mask=None, is_causal=False):
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.heads, self.head).transpose(1, 2)
        k, v = (t.view(batch, seq, self.kv_heads, self.head).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=self.kv_heads != self.heads)


@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask", "grouped_query"])
def test_gradients_through_scaled_dot_product_attention_match_eager(variant):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = SdpaAttention(kv_heads=2 if variant == "grouped_query" else 4), torch.randn(2, 8, 32)
    kwargs = {"causal": {"is_causal": True}, "bool_mask": {"mask": torch.rand(2, 1, 8, 8) > 0.3},
              "float_mask": {"mask": torch.randn(8, 8)}}.get(variant, {})
    reference = copy.deepcopy(model)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(x, **kwargs).pow(2).mean().backward()
    reference(x, **kwargs).pow(2).mean().backward()
    forward, backward = backend.compiled_graphs[before:]
    assert forward.last_run is not None and backward.last_run is not None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=name)


class WithGraphBreaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # as a print or an unsupported call would
        if h.sum() > 0:  # data-dependent Python control flow
            h = h * 2
        return self.b(h)


def test_a_model_with_graph_breaks_still_trains_on_the_device():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = WithGraphBreaks(), torch.randn(3, 8)
    reference = copy.deepcopy(model)
    before = backend.compile_count()
    torch.compile(model, backend="neuron")(x).sum().backward()
    reference(x).sum().backward()
    assert backend.compile_count() - before >= 4  # forward and backward of the graphs on each side of the break
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32])


def test_fullgraph_true_reports_the_graph_break_as_usual():
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(WithGraphBreaks(), backend="neuron", fullgraph=True)(torch.randn(3, 8))


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, nesterov=True, foreach=True),
], ids=["adamw", "sgd-nesterov"])
def test_a_compiled_optimizer_step_runs_whole_on_the_device_like_eager(make_optimizer):
    # torch.compile(optimizer.step) traces the multi-tensor (_foreach_*) kernels; each is one elementwise op per
    # parameter on the device (a CPU fallback would fail the device_graphs_stay_whole guard)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    step = torch.compile(optimizer.step, backend="neuron")
    x = torch.randn(4, 6)
    before = backend.compile_count()
    for _ in range(3):
        for m, opt, run in ((model, optimizer, step), (reference, reference_optimizer, reference_optimizer.step)):
            m(x).square().mean().backward()
            run()
            opt.zero_grad()
    assert backend.compile_count() > before
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("name, fn", [("tanh", torch.tanh), ("elu", F.elu), ("leaky_relu", F.leaky_relu),
                                      ("log_softmax", lambda t: t.log_softmax(-1))])
def test_bf16_activation_gradients_match_eager_bit_for_bit(name, fn):
    """tanh's bf16 backward, (1 - y * y) * dy with y widened to fp32, read the widened y twice in one step and
    emitted the second read from a tile nothing wrote (the load check refused the program); elu, leaky_relu and
    log_softmax compute in fp32 as eager's kernels do."""
    g = torch.Generator().manual_seed(0)
    x0, w = (torch.randn(16, 128, generator=g) * 2).bfloat16(), torch.randn(16, 128, generator=g).bfloat16()

    def loss(x):
        return (fn(x) * w).sum()

    eager, compiled = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    loss(eager).backward()
    torch._dynamo.reset()
    torch.compile(loss, backend="neuron")(compiled).backward()
    assert torch.equal(compiled.grad, eager.grad), name
