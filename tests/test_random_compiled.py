"""Random ops inside compiled graphs (frontend/random_draws.py): drawn on the device from the generator state, a
run-time input of the NEFF, so the graphs stay whole, each call draws anew and torch.manual_seed repeats a call."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from neuronc.pytorch import backend, partition

P = 0.1


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="neuron")


def _dropout_matmul(x, w):
    return F.dropout(x @ w, P, training=True)


def test_dropout_mlp_trains_compiled_with_its_graphs_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(P), nn.ReLU(), nn.Linear(64, 64)).train()
    compiled = _compiled(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    compiles, partitioned = backend.compile_count(), partition.partitioned_graphs
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = F.mse_loss(compiled(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert backend.compile_count() - compiles == 2  # one forward and one backward NEFF, no CPU pieces between
    assert partition.partitioned_graphs == partitioned
    assert losses[-1] < losses[0]


def test_dropout_gradient_uses_the_mask_of_its_forward():
    torch.manual_seed(1)
    x, w = torch.randn(16, 32), torch.randn(32, 48, requires_grad=True)
    out = _compiled(_dropout_matmul)(x, w)
    grad = torch.randn_like(out)
    out.backward(grad)
    full = (x @ w).detach()
    kept = out.detach() != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(out.detach()[kept], full[kept] / (1 - P))
    torch.testing.assert_close(w.grad, x.T @ (grad * kept / (1 - P)))


def _mask(fn, x):
    return fn(x) != 0


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu_tensors", "neuron_tensors"])
def test_each_call_draws_anew_and_manual_seed_repeats_a_call(on_device, request):
    device = request.getfixturevalue("neuron") if on_device else torch.device("cpu")
    fn = _compiled(lambda x: F.dropout(x, 0.5, training=True))
    x = torch.rand(64, 64).add(0.5).to(device)
    first, second = _mask(fn, x).cpu(), _mask(fn, x).cpu()
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    again = _mask(fn, x).cpu()
    torch.manual_seed(7)
    assert torch.equal(_mask(fn, x).cpu(), again)
    assert backend.compiled_graphs[-1].compiled.random_draws == x.numel()


def test_drop_rate_is_p_within_five_sigma():
    n = 100_000
    torch.manual_seed(2)
    out = _compiled(lambda x: F.dropout(x, P, training=True))(torch.ones(100, 1000))
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - P) < 5 * math.sqrt(P * (1 - P) / n)
    torch.testing.assert_close(out[out != 0], torch.full_like(out[out != 0], 1 / (1 - P)))


def test_rand_is_uniform_in_zero_one():
    n = 256 * 512
    torch.manual_seed(3)
    u = _compiled(lambda: torch.rand(256, 512))()
    assert u.shape == (256, 512) and u.dtype == torch.float32
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # the variance of (u - 1/2)^2 is 1/180
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - n / 10).abs().max() < 5 * math.sqrt(n / 10 * 0.9)


def test_bf16_rand_never_rounds_up_to_one():
    torch.manual_seed(4)
    u = _compiled(lambda: torch.rand(128, 1024, dtype=torch.bfloat16))()
    assert u.dtype == torch.bfloat16 and u.min() >= 0 and u.max() < 1
    assert len(u.unique()) == 256  # bf16 in [0, 1) with 8 random bits: every value drawn


def test_randn_like_has_mean_zero_and_variance_one():
    n = 256 * 512
    torch.manual_seed(5)
    z = _compiled(lambda x: torch.randn_like(x) * 2.0 + 3.0)(torch.empty(256, 512))
    assert z.shape == (256, 512) and z.dtype == torch.float32 and torch.isfinite(z).all()
    assert abs(z.mean().item() - 3.0) < 5 * 2.0 / math.sqrt(n)
    assert abs(z.var().item() - 4.0) < 5 * 4.0 * math.sqrt(2 / n)
    assert abs(((z - 3.0).abs() < 2.0).float().mean().item() - 0.6827) < 0.01  # one sigma holds 68.27%


def test_randint_bernoulli_and_uniform_in_one_graph():
    torch.manual_seed(6)

    def draws(p):
        return (torch.randint(3, 10, (64, 128)), torch.bernoulli(p), torch.empty(64, 128).uniform_(-2.0, 5.0))

    p = torch.linspace(0, 1, 128).expand(64, 128).contiguous()
    integers, hits, uniform = _compiled(draws)(p)
    assert integers.dtype == torch.int64 and integers.min() == 3 and integers.max() == 9
    assert len(integers.unique()) == 7
    assert hits.dtype == torch.float32 and set(hits.unique().tolist()) <= {0.0, 1.0}
    assert hits[:, 0].sum() == 0 and hits[:, -1].sum() == 64  # p = 0 never hits, p = 1 always does
    assert abs(hits.mean().item() - 0.5) < 5 * math.sqrt(0.25 / hits.numel())
    assert uniform.min() >= -2.0 and uniform.max() < 5.0 and abs(uniform.mean().item() - 1.5) < 0.1


def test_compiled_dropout_on_neuron_tensors_draws_what_eager_draws(neuron):
    x = torch.rand(48, 80).add(0.5).to(neuron)
    torch.manual_seed(11)
    eager = F.dropout(x, P, training=True)
    torch.manual_seed(11)
    compiled = _compiled(lambda t: F.dropout(t, P, training=True))(x)
    assert torch.equal(compiled.cpu() != 0, eager.cpu() != 0)
    torch.testing.assert_close(compiled.cpu(), eager.cpu())


def test_dropout2d_drops_whole_channels():
    torch.manual_seed(8)
    x = torch.rand(8, 16, 4, 4).add(0.5)
    out = _compiled(nn.Dropout2d(0.5).train())(x)
    dropped = (out == 0).flatten(2)
    assert (dropped.all(-1) == dropped.any(-1)).all()  # a channel is dropped whole or kept whole
    assert 0 < dropped.all(-1).float().mean() < 1
    kept = ~dropped.all(-1)
    torch.testing.assert_close(out.flatten(2)[kept], x.flatten(2)[kept] * 2)



@pytest.mark.parametrize("on_device", [False, True], ids=["cpu_tensors", "neuron_tensors"])
def test_checkpointed_dropout_backward_redraws_the_forward_mask_on_the_device(on_device, request, monkeypatch):
    """Activation checkpointing recomputes the block in the backward graph (run_with_rng_state): its dropout
    must draw the forward's mask (run_and_save_rng_state's saved state), on the device, without a CPU piece.
    Another dropout drawn first puts the block's draw at a later element of the stream than the first."""
    from torch.utils.checkpoint import checkpoint

    device = request.getfixturevalue("neuron") if on_device else torch.device("cpu")
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    torch.manual_seed(2)
    block = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Dropout(0.5)).train().to(device)

    def fn(x, y):
        noise = F.dropout(y, 0.5, training=True)
        return checkpoint(block, x, use_reentrant=False), noise

    x = torch.randn(16, 32).to(device).requires_grad_()
    y = torch.rand(16, 48).add(0.5).to(device)
    compiles, partitioned = backend.compile_count(), partition.partitioned_graphs
    out, noise = _compiled(fn)(x, y)
    grad = torch.randn(out.shape).to(device)
    out.backward(grad)
    assert backend.compile_count() - compiles == 2  # one forward and one backward NEFF, no CPU pieces between
    assert partition.partitioned_graphs == partitioned
    assert 0 < (noise != 0).float().mean().item() < 1

    out, grad = out.detach().cpu(), grad.cpu()
    kept = out != 0  # dropped, or cut by the ReLU (whose gradient is 0 there too)
    assert 0.1 < kept.float().mean() < 0.4  # about half of ReLU's half kept
    x_eager = x.detach().cpu().requires_grad_()
    w_eager = block[0].weight.detach().cpu().requires_grad_()
    b_eager = block[0].bias.detach().cpu().requires_grad_()
    eager = F.relu(x_eager @ w_eager.T + b_eager) * kept / 0.5
    eager.backward(grad)
    torch.testing.assert_close(out, eager.detach())
    torch.testing.assert_close(x.grad.cpu(), x_eager.grad)
    torch.testing.assert_close(block[0].weight.grad.cpu(), w_eager.grad)
    torch.testing.assert_close(block[0].bias.grad.cpu(), b_eager.grad)


def test_random_ops_are_looked_for_only_among_the_nodes_calling_a_random_target(monkeypatch):
    """has_random_ops asks is_random only of the nodes whose target _recipe or _wrapped compares with; every other
    node is not random. Each ATen op named in those two functions is one of the targets."""
    import inspect
    import re

    from neuronc.frontend import random_draws

    targets, ids = random_draws._random_targets()
    named = set(re.findall(r"aten\.(\w+)\.(\w+)", inspect.getsource(random_draws._recipe)))
    assert len(named) >= 17
    assert all(id(getattr(getattr(torch.ops.aten, op), overload)) in ids for op, overload in named)
    assert all(id(wrapper) in ids for wrapper in random_draws._rng_wrappers())

    asked = []
    is_random = random_draws.is_random
    monkeypatch.setattr(random_draws, "is_random", lambda node: asked.append(node.target) or is_random(node))

    def plain(x, w):
        return torch.relu(x @ w).sum(-1)

    def drawing(x, w):
        return F.dropout(x @ w, 0.5, training=True) + torch.rand_like(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for fn, random in ((plain, False), (drawing, True)):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(x, w)
        asked.clear()
        assert random_draws.has_random_ops(gm) is random
        assert all(id(target) in ids for target in asked) and len(asked) == random
