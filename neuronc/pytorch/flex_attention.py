"""FlexAttention on `neuron` tensors.

``torch.nn.attention.flex_attention`` checks its tensors' device against the devices PyTorch ships kernels for
(CUDA, CPU, XPU, HPU, MPS) and refuses others before anything runs. On `neuron` tensors its higher-order op runs
PyTorch's dense implementation eagerly (op by op on the device), and under ``torch.compile(backend="neuron")`` it
is lowered by the compiler (neuronc/frontend/flex_attention.py), forward and backward. ``allow_neuron_devices``
(called when the device initialises) lets `neuron` tensors, and their gradients, through that check; every other
device is checked as before.
"""
from __future__ import annotations


def allow_neuron_devices() -> None:
    import torch.nn.attention.flex_attention as flex

    checked = flex._validate_device
    if getattr(checked, "allows_neuron", False):
        return

    def _validate_device(query, key, value):
        if query.device.type == "neuron":
            return None
        return checked(query, key, value)

    _validate_device.allows_neuron = True
    flex._validate_device = _validate_device
