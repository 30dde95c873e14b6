"""Every `torch.nn` module (tests/nn_modules.py) runs eagerly on the `neuron` device, forward and backward, and
gives what it gives on the CPU. Ops the device cannot run go to the CPU with one warning, never a
NotImplementedError; which modules still need that is listed in nn_modules.ON_THE_CPU, and a module that
needs it without being listed fails."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

from neuronc.pytorch import eager
from tests import nn_modules
from tests.conftest import assert_matches_eager


def test_the_sweep_lists_every_torch_nn_module():
    modules = {name for name, value in vars(torch.nn).items()
               if inspect.isclass(value) and issubclass(value, torch.nn.Module)}
    assert modules - set(nn_modules.MODULES) - set(nn_modules.NOT_SWEPT) == set()


def _leaves(value) -> list:
    return [x for x in torch.utils._pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _run(module, inputs, device):
    """(outputs, gradients of the inputs and parameters) of a weighted sum of the module's float outputs."""
    inputs = [x.detach().clone().to(device) for x in inputs]
    is_loss = isinstance(module, torch.nn.modules.loss._Loss)
    for i, x in enumerate(inputs):
        if x.is_floating_point() and (i == 0 or not is_loss):
            x.requires_grad_()
    outputs = _leaves(module(*inputs))
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=generator).to(device) for o in outputs if o.is_floating_point()]
    loss = sum((o * w).sum() for o, w in zip((o for o in outputs if o.is_floating_point()), weights))
    if loss.requires_grad:
        loss.backward()
    grads = [x.grad for x in inputs if x.grad is not None] + [p.grad for p in module.parameters() if p.grad is not None]
    return [o.detach().cpu() for o in outputs], [g.cpu() for g in grads]


@pytest.mark.parametrize("name", sorted(nn_modules.MODULES))
def test_a_torch_nn_module_runs_on_the_device_as_on_the_cpu(neuron, name):
    torch.manual_seed(0)
    module, inputs = nn_modules.MODULES[name](1)
    if name in nn_modules.RANDOM:
        module.eval()  # the device draws its own random numbers
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
        with torch.device(neuron):  # made on the device (see the README: .to() would lose its lazy parameters)
            on_device = nn_modules.MODULES[name](1)[0]
        with torch.no_grad():
            module(*inputs)
            on_device(*(x.to(neuron) for x in inputs))  # materialised on the device
        on_device.load_state_dict(module.state_dict())
    else:
        on_device = copy.deepcopy(module).to(neuron)
    fallbacks = dict(eager.fallback_calls)
    reference = module.module if isinstance(module, torch.nn.DataParallel) else module  # DataParallel needs devices
    expected, expected_grads = _run(reference, inputs, "cpu")
    got, grads = _run(on_device, inputs, neuron)
    assert_matches_eager(got, expected)
    scale = max([g.abs().max().item() for g in expected_grads] + [1e-3])  # zero-in-exact-arithmetic gradients
    assert len(grads) == len(expected_grads)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g / scale, e / scale, rtol=1e-4, atol=1e-5)
    assert_matches_eager([b.cpu() for b in on_device.buffers()], list(reference.buffers()))
    on_the_cpu = {op for op, calls in eager.fallback_calls.items() if calls != fallbacks.get(op)}
    assert on_the_cpu <= set(nn_modules.ON_THE_CPU.get(name, {})), on_the_cpu
