"""The `torch.backends` entry point: makes ``"neuron"`` a PyTorch device at every ``import torch``.

It must stay cheap (DESIGN.md): rename PrivateUse1, register ``torch.neuron`` and the generated
``Tensor.neuron()`` methods, the "neuron" backend of torch.distributed, and, when the C++ shim is already built, load it so that
``torch.accelerator`` sees the device at once. The runtime, the compiler and torch-mlir are imported
on first use (``torch.neuron._lazy_init``). ``python -m benchmarks.device_import`` measures the cost.
"""
from __future__ import annotations


def register() -> None:
    import torch

    from neuronc.pytorch import device, shim

    torch.utils.rename_privateuse1_backend("neuron")
    torch._register_device_module("neuron", device)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    torch.set_autocast_dtype("neuron", torch.bfloat16)  # the NeuronCore's native low precision
    if torch.distributed.is_available():
        torch.distributed.Backend.register_backend("neuron", _distributed_group, devices=["cpu", "neuron"])
    built = shim.load_built()
    if built is not None:
        device._init_shim(built)


def _distributed_group(store, rank, size, timeout):
    """The process group of backend "neuron" (neuronc.pytorch.distributed, imported when one is made)."""
    from neuronc.pytorch import distributed

    return distributed.create(store, rank, size, timeout)
