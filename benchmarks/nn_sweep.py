"""The bigger sweep of `torch.nn` modules on the `neuron` device (tests/test_nn_sweep.py runs the small one):
every module of tests/nn_modules.py with inputs --scale times larger, forward and backward eagerly on the
device and on the CPU. Prints per module the largest difference of outputs and of gradients (relative to the
largest gradient), the wall seconds of the device run (first call: it compiles each op at these shapes), the
new programs and the ops that ran on the CPU. Not a test: nothing is asserted.

    .venv/bin/python -m benchmarks.nn_sweep [--scale 4] [--modules Conv2d,LSTM]
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

from tests import nn_modules


def _run(module, inputs, device):
    inputs = [x.detach().clone().to(device) for x in inputs]
    is_loss = isinstance(module, torch.nn.modules.loss._Loss)
    for i, x in enumerate(inputs):
        if x.is_floating_point() and (i == 0 or not is_loss):
            x.requires_grad_()
    outputs = [o for o in torch.utils._pytree.tree_leaves(module(*inputs)) if isinstance(o, torch.Tensor)]
    floats = [o for o in outputs if o.is_floating_point()]
    generator = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=generator).to(device)).sum() for o in floats)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    grads = [x.grad for x in inputs if x.grad is not None] + [p.grad for p in module.parameters() if p.grad is not None]
    return [o.detach().cpu() for o in outputs], [g.cpu() for g in grads]


def main() -> None:
    from neuronc.pytorch import eager

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--modules", default="")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    names = options.modules.split(",") if options.modules else sorted(nn_modules.MODULES)
    print(f"{'module':30} {'outputs':>9} {'gradients':>10} {'device s':>9} {'programs':>9}  on the CPU")
    for name in names:
        torch.manual_seed(0)
        module, inputs = nn_modules.MODULES[name](options.scale)
        if name in nn_modules.RANDOM:
            module.eval()
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
            with torch.device("neuron"):
                on_device = nn_modules.MODULES[name](options.scale)[0]
            with torch.no_grad():
                module(*inputs)
                on_device(*(x.to("neuron") for x in inputs))
            on_device.load_state_dict(module.state_dict())
        else:
            on_device = copy.deepcopy(module).to("neuron")
        reference = module.module if isinstance(module, torch.nn.DataParallel) else module
        expected, expected_grads = _run(reference, inputs, "cpu")
        fallbacks, programs = dict(eager.fallback_calls), len(eager.programs)
        start = time.perf_counter()
        got, grads = _run(on_device, inputs, "neuron")
        seconds = time.perf_counter() - start
        out_err = max([(g.double() - e.double()).abs().max().item() for g, e in zip(got, expected) if e.numel()] or [0])
        scale = max([g.abs().max().item() for g in expected_grads] + [1e-3])
        grad_err = max([((g - e).abs().max() / scale).item() for g, e in zip(grads, expected_grads)] or [0])
        on_cpu = sorted(op for op, calls in eager.fallback_calls.items() if calls != fallbacks.get(op))
        print(f"{name:30} {out_err:9.1e} {grad_err:10.1e} {seconds:9.2f} {len(eager.programs) - programs:9d}  "
              f"{', '.join(on_cpu)}")


if __name__ == "__main__":
    main()
