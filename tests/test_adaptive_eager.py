"""Adaptive eager (`torch.neuron.set_adaptive_eager`, `TORCH_NEURONX_ADAPTIVE_EAGER=1`): the ops queued
between two synchronisations run as one NEFF, and give what plain eager on the device gives, bit for bit,
forward and backward, on the zoo's training loops."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import zoo
from tests.conftest import assert_matches_eager


@pytest.fixture
def adaptive_eager(neuron):
    from neuronc.pytorch import adaptive

    torch.accelerator.synchronize()
    torch.neuron.set_adaptive_eager(True)
    try:
        yield adaptive.stats
    finally:
        torch.neuron.set_adaptive_eager(False)


def _chain(a, b, c):
    hidden = torch.relu(a @ b) * 0.5 + c
    return torch.softmax(hidden, dim=-1)


def test_adaptive_eager_runs_queued_ops_as_one_neff_and_matches_cpu(adaptive_eager, neuron):
    a, b, c = torch.randn(6, 8), torch.randn(8, 8), torch.randn(6, 8)
    before = dict(adaptive_eager)
    result = _chain(a.to(neuron), b.to(neuron), c.to(neuron))
    assert_matches_eager(result.cpu(), _chain(a, b, c))
    assert adaptive_eager["batches"] == before.get("batches", 0) + 1
    assert adaptive_eager["batched ops"] - before.get("batched ops", 0) >= 4  # mm, relu, mul, add, softmax
    assert adaptive_eager["results not written"] > before.get("results not written", 0)  # dropped intermediates


def test_printing_ends_an_adaptive_batch(adaptive_eager, neuron, capsys):
    x = torch.randn(4, 4).to(neuron)
    torch.accelerator.synchronize()
    before = adaptive_eager["batches"]
    y = (x * 2.0).relu()
    print(y)  # a synchronisation point: the ops queued so far run, as one batch
    z = (y + 1.0).tanh()
    assert_matches_eager(z.cpu(), ((x.cpu() * 2.0).relu() + 1.0).tanh())
    assert adaptive_eager["batches"] == before + 2
    assert "tensor(" in capsys.readouterr().out


def test_adaptive_eager_is_off_under_deterministic_algorithms(adaptive_eager, neuron):
    a, b, c = torch.randn(6, 8), torch.randn(8, 8), torch.randn(6, 8)
    before = adaptive_eager["batches"]
    torch.use_deterministic_algorithms(True)
    try:
        result = _chain(a.to(neuron), b.to(neuron), c.to(neuron)).cpu()
    finally:
        torch.use_deterministic_algorithms(False)
    assert adaptive_eager["batches"] == before
    assert_matches_eager(result, _chain(a, b, c))


@pytest.mark.parametrize("loss", [
    lambda x, w: (x @ w).pow(2).mean(),
    lambda x, w: torch.relu(x @ w).sum(),
], ids=["pow_mean", "relu_sum"])
def test_a_result_only_autograd_keeps_is_still_written(adaptive_eager, neuron, loss):
    """The backward reads what the forward saved (and ``.grad`` holds what it accumulates) through tensors of
    their own over the same storage: a batch writes every result whose storage is alive, not only those
    whose own tensor object is."""
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    on_cpu = w.clone().requires_grad_()
    loss(x, on_cpu).backward()
    on_device = w.to(neuron).requires_grad_()
    before = adaptive_eager["batches"]
    value = loss(x.to(neuron), on_device)
    value.backward()
    assert_matches_eager((value.detach().cpu(), on_device.grad.cpu()), (loss(x, w), on_cpu.grad))
    assert adaptive_eager["batches"] >= before + 2  # the forward, and the backward


def _train(model, inputs, device, steps: int = 2):
    """Losses, gradients and parameters of ``steps`` AdamW steps of ``model`` (a copy) on ``device``."""
    model = copy.deepcopy(model).to(device).train()
    if isinstance(model, zoo.GPT2):
        model.head.weight = model.tokens.weight  # .to("neuron") makes new Parameters: tie them again
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.device(device):  # GPT2.forward makes its positions with torch.arange
            loss = model(*(x.to(device) for x in inputs)).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    return losses, [p.grad.cpu() for p in model.parameters()], [p.detach().cpu() for p in model.parameters()]


TRAINING = {
    "mlp": lambda: (zoo.MLP(width_in=8, hidden=16, classes=4), (torch.randn(4, 8),)),
    "transformer_block": lambda: (zoo.TransformerBlock(width=16, heads=2), (torch.randn(2, 8, 16),)),
    "gpt2": lambda: (zoo.GPT2(vocab=32, width=16, layers=1, heads=2, context=8), (torch.randint(0, 32, (2, 8)),)),
}


@pytest.mark.parametrize("name", sorted(TRAINING))
def test_adaptive_eager_trains_bit_for_bit_as_plain_eager(neuron, name):
    """Forward, backward and AdamW steps of the zoo's models: adaptive eager batches them and gives plain
    eager's losses, gradients and parameters exactly, and its losses match the CPU's within the fp32
    tolerance. (Not the gradients: attention's key bias has a gradient of zero in exact arithmetic, so what
    autograd computes is rounding noise, different on each device, which AdamW then turns into a step.)"""
    from neuronc.pytorch import adaptive

    torch.manual_seed(0)
    model, inputs = TRAINING[name]()
    expected = _train(model, inputs, "cpu")
    plain = _train(model, inputs, neuron)
    torch.neuron.set_adaptive_eager(True)
    try:
        before = dict(adaptive.stats)
        batched = _train(model, inputs, neuron)
    finally:
        torch.neuron.set_adaptive_eager(False)
    assert adaptive.stats["batches"] > before.get("batches", 0)
    assert adaptive.stats["results not written"] > before.get("results not written", 0)
    for got, want in zip(batched, plain):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert_matches_eager(plain[0], expected[0])


def test_the_environment_variable_turns_adaptive_eager_on_and_its_backward_is_plain_eagers():
    """TORCH_NEURONX_ADAPTIVE_EAGER=1 is read when neuronc's device module is imported, hence a process of its own.
    There, a small MLP's forward and backward run as batches, and give the loss and gradients plain eager gives in
    the same process (adaptive eager switched off), bit for bit; the batched backward is the one measured."""
    code = textwrap.dedent("""
        import json
        import torch
        from neuronc.pytorch import adaptive
        from tests import zoo

        torch.manual_seed(0)
        model, x = zoo.MLP(width_in=8, hidden=16, classes=4), torch.randn(4, 8)

        def step():
            on_device = zoo.MLP(width_in=8, hidden=16, classes=4).to("neuron")
            on_device.load_state_dict(model.state_dict())
            loss = on_device(x.to("neuron")).pow(2).mean()
            torch.accelerator.synchronize()
            before = adaptive.stats.get("batches", 0)
            loss.backward()
            grads = [p.grad.cpu() for p in on_device.parameters()]  # the backward's batch runs here
            return loss.detach().cpu(), grads, adaptive.stats.get("batches", 0) - before

        enabled = adaptive.ENABLED
        batched_loss, batched_grads, batches = step()
        torch.neuron.set_adaptive_eager(False)
        plain_loss, plain_grads, plain_batches = step()
        print(json.dumps({"enabled": enabled, "backward batches": batches, "plain backward batches": plain_batches,
                          "same loss": torch.equal(batched_loss, plain_loss),
                          "same gradients": [torch.equal(b, p) for b, p in zip(batched_grads, plain_grads)]}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          env={**os.environ, "TORCH_NEURONX_ADAPTIVE_EAGER": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["enabled"] is True
    assert result["backward batches"] >= 1 and result["plain backward batches"] == 0
    assert result["same loss"] is True
    assert result["same gradients"] == [True] * 6  # 3 layers' weights and biases
