"""The fused Adam and AdamW steps (``torch.optim.Adam/AdamW(..., fused=True)``) on `neuron` tensors.

PyTorch calls ``_fused_adam_`` / ``_fused_adamw_`` once per device and dtype with the whole parameter list.
Here that call is one program: the update of every parameter, traced from :func:`adam_step` (the math of
PyTorch's fused kernels, in fp32) and compiled by the same pipeline as any eager op, cached by the
parameters' shapes and dtypes and the flags (amsgrad, maximize). The hyperparameters (lr, betas, weight
decay, eps) are runtime inputs, so a learning-rate schedule does not recompile; the step counts are read
from their device tensors by the program. The parameters and the optimizer state are written in place.
AMP's ``grad_scale`` and ``found_inf`` (set by ``GradScaler``) are inputs of the program too: gradients are
unscaled by the first, and a nonzero second leaves everything as it was.
"""
from __future__ import annotations

import torch

from neuronc.pytorch import eager, queues

_programs: dict = {}  # (op, shapes and dtypes, flags, device) -> EagerProgram, or why it runs on the CPU
HYPERPARAMETERS = ("lr", "beta1", "beta2", "weight_decay", "eps")


def adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
              *, decoupled: bool, amsgrad: bool, maximize: bool, grad_scale=None, found_inf=None):
    """The new (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) of one Adam(W) step, as PyTorch's fused kernels
    compute it: in fp32, bias corrections from each parameter's step count; with AMP's ``grad_scale`` the
    gradients are unscaled first, and where ``found_inf`` is nonzero nothing changes."""
    new_params, new_avgs, new_sqs, new_maxes = [], [], [], []
    for i, (param, grad, exp_avg, exp_avg_sq, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        p, g, m, v = (t.float() for t in (param, grad, exp_avg, exp_avg_sq))
        step = step.float()
        if grad_scale is not None:
            g = g / grad_scale
        if maximize:
            g = -g
        if weight_decay is not None:
            if decoupled:
                p = p - lr * weight_decay * p
            else:
                g = g + weight_decay * p
        m = m + (1 - beta1) * (g - m)  # lerp(m, g, 1 - beta1)
        v = v * beta2 + (1 - beta2) * g * g
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
        if amsgrad:
            biggest = torch.maximum(max_exp_avg_sqs[i].float(), v)
            new_maxes.append(biggest.to(max_exp_avg_sqs[i].dtype))
            v_hat = biggest
        else:
            v_hat = v
        denom = torch.sqrt(v_hat) / bias_correction2_sqrt + eps
        p = p - (lr / bias_correction1) * m / denom
        new_params.append(p.to(param.dtype))
        new_avgs.append(m.to(exp_avg.dtype))
        new_sqs.append(v.to(exp_avg_sq.dtype))
    if found_inf is not None:  # an overflowing step changes nothing
        skip = found_inf != 0
        new_params, new_avgs, new_sqs, new_maxes = (
            [torch.where(skip, old, new) for old, new in zip(olds, news)]
            for olds, news in ((params, new_params), (exp_avgs, new_avgs), (exp_avg_sqs, new_sqs),
                               (max_exp_avg_sqs, new_maxes)))
    return new_params, new_avgs, new_sqs, new_maxes


def _fused(op, decoupled: bool):
    def kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
               weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        args = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
        flags = dict(amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        if not params:
            return None
        lists = (params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if amsgrad else []), state_steps)
        device = eager._device_of(op, [t for group in lists for t in group])
        with_decay = weight_decay != 0
        amp = tuple(t for t in (grad_scale, found_inf) if t is not None)
        key = (op, tuple(tuple((tuple(t.shape), t.dtype) for t in group) for group in lists), amsgrad, maximize,
               with_decay, isinstance(lr, torch.Tensor), grad_scale is not None, found_inf is not None,
               tuple((tuple(t.shape), t.dtype) for t in amp), device)
        entry = _programs.get(key)
        if entry is None:
            entry = _programs[key] = _compile(lists, decoupled, amsgrad, maximize, with_decay, lr, grad_scale,
                                              found_inf, device)
        if isinstance(entry, str):
            return eager.cpu_fallback(op, args, {**hyper, **flags}, entry)
        scalars = [*amp, lr if isinstance(lr, torch.Tensor) else float(lr), float(beta1), float(beta2),
                   *([float(weight_decay)] if with_decay else []), float(eps)]
        inputs = [eager._view(t) for group in lists for t in group] + [
            eager._view(s) if isinstance(s, torch.Tensor) and not s.is_cpu else
            (eager.host_array(s).copy() if isinstance(s, torch.Tensor) else s) for s in scalars]
        written = [t for group in (params, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if amsgrad else []))
                   for t in group]
        outputs = [eager._view(t) for t in written]
        queues.enqueue(device, entry.duration_ns, entry.run, (inputs, entry.arrange(outputs) if entry.permuted
                                                              else outputs), op)
        entry.launches += 1
        return None

    return kernel


def _compile(lists, decoupled: bool, amsgrad: bool, maximize: bool, with_decay: bool, lr, grad_scale, found_inf,
             device: int):
    """An EagerProgram updating every tensor of ``lists`` at once, or why the step runs on the CPU."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import CompileOptions, compile_fx
    from neuronc.errors import NeuronError
    from neuronc.frontend.torch_import import decomposition_table
    from neuronc.pytorch.device_memory import core

    sizes = [len(group) for group in lists]
    examples = [torch.zeros(t.shape, dtype=t.dtype) for group in lists for t in group]
    def like(t):
        return torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else torch.tensor(0.0)

    amp = [like(t) for t in (grad_scale, found_inf) if t is not None]
    scalars = [*amp, like(lr)] + [torch.tensor(0.0) for _ in range(3 if with_decay else 2)] + [torch.tensor(0.0)]

    def step(*tensors):
        groups, at = [], 0
        for size in sizes:
            groups.append(list(tensors[at:at + size]))
            at += size
        params, grads, exp_avgs, exp_avg_sqs, *rest = groups
        maxes, steps = (rest[0], rest[1]) if amsgrad else ([], rest[0])
        rest = list(tensors[at:])
        scale = rest.pop(0) if grad_scale is not None else None
        inf = rest.pop(0) if found_inf is not None else None
        lr_, beta1, beta2, *decay, eps = rest
        new = adam_step(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr_, beta1, beta2,
                        decay[0] if decay else None, eps, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
                        grad_scale=scale, found_inf=inf)
        return tuple(t for group in new for t in group)

    try:
        gm = make_fx(step, decomposition_table=decomposition_table())(*examples, *scalars)
        compiled = compile_fx(gm, CompileOptions.from_dict({"name": "eager_fused_adam"}))
        program = core(device).load(compiled.neff)
    except NeuronError as e:
        return f"neuronc cannot compile it: {e.message}"
    outputs = [(tuple(t.shape), t.dtype) for group in (lists[0], lists[2], lists[3], *(lists[4:5] if amsgrad else []))
               for t in group]
    return eager.EagerProgram(program, compiled.output_layout, outputs, torch.utils._pytree.tree_flatten(())[1],
                              program.time().estimated_ns)


KERNELS = {
    "_fused_adam_": _fused(torch.ops.aten._fused_adam_.default, decoupled=False),
    "_fused_adam_.tensor_lr": _fused(torch.ops.aten._fused_adam_.tensor_lr, decoupled=False),
    "_fused_adamw_": _fused(torch.ops.aten._fused_adamw_.default, decoupled=True),
    "_fused_adamw_.tensor_lr": _fused(torch.ops.aten._fused_adamw_.tensor_lr, decoupled=True),
}
