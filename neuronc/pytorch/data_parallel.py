"""`torch.nn.DataParallel` over the `neuron:i` of one process.

DataParallel moves tensors between devices with `torch.nn.parallel.comm` (scatter, broadcast_coalesced,
gather), whose kernels PyTorch builds only for CUDA (`torch._C._scatter`...: absent from a CPU build). For
`neuron` tensors those three are done here with copies between the devices (`Tensor.to`, which the device
runs as DMA); anything else goes to PyTorch's own. `reduce_add` and `reduce_add_coalesced` (the backward of a
broadcast) already work on any device.
"""
from __future__ import annotations

import torch

_installed: list = []


def _is_neuron(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "neuron"


def _device(index) -> torch.device:
    if isinstance(index, torch.device):
        return index
    return torch.device("neuron", int(index)) if int(index) >= 0 else torch.device("cpu")


def install() -> None:
    """Route comm's scatter, broadcast_coalesced and gather of `neuron` tensors through device copies."""
    if _installed:
        return
    from torch.nn.parallel import comm

    scatter, broadcast_coalesced, gather = comm.scatter, comm.broadcast_coalesced, comm.gather

    def neuron_scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
        if not _is_neuron(tensor) and not (devices and all(_device(d).type == "neuron" for d in devices)):
            return scatter(tensor, devices, chunk_sizes, dim, streams, out=out)
        if out is not None:
            chunks = tensor.split([o.shape[dim] for o in out], dim)
            return tuple(o.copy_(c) for o, c in zip(out, chunks))
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
        return tuple(c.to(_device(d)).contiguous() for c, d in zip(chunks, devices))

    def neuron_broadcast_coalesced(tensors, devices, buffer_size=10485760):
        if not any(_is_neuron(t) for t in tensors):
            return broadcast_coalesced(tensors, devices, buffer_size)
        targets = [_device(d) for d in devices]
        return [list(tensors) if target == tensors[0].device else [t.to(target) for t in tensors]
                for target in targets]

    def neuron_gather(tensors, dim=0, destination=None, *, out=None):
        if not any(_is_neuron(t) for t in tensors):
            return gather(tensors, dim, destination, out=out)
        if out is not None:
            return out.copy_(torch.cat([t.to(out.device) for t in tensors], dim))
        target = _device(destination) if destination is not None else tensors[0].device
        return torch.cat([t.to(target) for t in tensors], dim)

    comm.scatter, comm.broadcast_coalesced, comm.gather = neuron_scatter, neuron_broadcast_coalesced, neuron_gather
    _installed.append((scatter, broadcast_coalesced, gather))
