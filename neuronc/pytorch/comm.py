"""`torch.neuron.comm`: collectives between the NeuronCores of one process (``neuron:0``, ``neuron:1``, ...), as
``torch.cuda.comm`` and NCCL's single-process API offer for GPUs, without a process group.

Each function takes one tensor per core (all of one shape and dtype, each on a different `neuron` device), runs
the work queued on those devices, computes what the collective engine's instruction of the same name computes
(:func:`runtime.collectives.combine`: reductions in fp32, rounded once) directly in the cores' memory, and lasts
the interconnect model's time for that many cores (:func:`neuronc.collective_cost.collective_ns`) on each
device's collective stream; the current streams wait for it, as after a blocking collective.

    a, b = x.to("neuron:0"), y.to("neuron:1")
    torch.neuron.comm.all_reduce([a, b])          # a and b both hold x + y
    torch.neuron.comm.all_gather([a, b])          # [cat(a, b) on neuron:0, cat(a, b) on neuron:1]
"""
from __future__ import annotations

import torch

from neuronc.collective_cost import collective_ns
from neuronc.errors import NeuronDeviceError
from neuronc.isa import AluOp, CollectiveOp
from neuronc.pytorch import device_memory, queues
from neuronc.pytorch.collective_streams import collective_streams, occupy
from neuronc.targets import get_target

_OPS = {"sum": AluOp.ADD, "max": AluOp.MAX, "min": AluOp.MIN, "product": AluOp.MULTIPLY}


def all_reduce(tensors: list, op: str = "sum") -> list:
    """Every tensor becomes the reduction (``sum``, ``max``, ``min``, ``product``) of them all, in place."""
    return _run(CollectiveOp.ALL_REDUCE, tensors, tensors, _reduction(op))


def all_gather(tensors: list) -> list:
    """On each tensor's core, the tensors concatenated along their first dimension (new tensors)."""
    outputs = [t.new_empty((len(tensors) * t.shape[0], *t.shape[1:]) if t.dim() else (len(tensors),))
               for t in tensors]
    return _run(CollectiveOp.ALL_GATHER, outputs, tensors, AluOp.NONE)


def reduce_scatter(tensors: list, op: str = "sum") -> list:
    """On core i, the i-th slice (first dimension) of the reduction of the tensors (new tensors)."""
    first = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
    if first % max(len(tensors), 1):
        raise NeuronDeviceError(f"reduce_scatter over {len(tensors)} cores of tensors of {first} rows",
                                hint="the first dimension must divide evenly among the cores")
    outputs = [t.new_empty((first // len(tensors), *t.shape[1:])) for t in tensors]
    return _run(CollectiveOp.REDUCE_SCATTER, outputs, tensors, _reduction(op))


def all_to_all(tensors: list) -> list:
    """On core i, the i-th slices (first dimension) of every tensor, concatenated in core order (new tensors)."""
    outputs = [torch.empty_like(t) for t in tensors]
    return _run(CollectiveOp.ALL_TO_ALL, outputs, tensors, AluOp.NONE)


def broadcast(tensor: torch.Tensor, devices: list) -> list:
    """Copies of ``tensor`` on each of ``devices`` (``tensor`` itself on its own)."""
    return [tensor if torch.device(d) == tensor.device else tensor.to(d) for d in devices]


def _reduction(op: str) -> AluOp:
    if op not in _OPS:
        raise NeuronDeviceError(f"unknown reduction {op!r}", hint=f"use one of {', '.join(_OPS)}")
    return _OPS[op]


def _check(tensors: list) -> list:
    devices = [t.device for t in tensors]
    if any(d.type != "neuron" for d in devices) or len({d.index for d in devices}) != len(devices):
        raise NeuronDeviceError(f"a collective between cores takes one neuron tensor per core, got tensors on "
                                f"{', '.join(map(str, devices))}", hint="move each tensor to its own neuron:i")
    if len({(t.dtype, tuple(t.shape)) for t in tensors}) != 1:
        what = ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors)
        raise NeuronDeviceError(f"a collective between cores takes tensors of one shape and dtype, got {what}")
    if not all(t.is_contiguous() for t in tensors):
        raise NeuronDeviceError("a collective between cores over non-contiguous tensors",
                                hint="call .contiguous() on them first")
    return [d.index for d in devices]


def _run(op: CollectiveOp, outputs: list, inputs: list, reduce: AluOp) -> list:
    from runtime.collectives import combine

    devices = _check(inputs)
    for index in devices:
        queues.synchronize(index)
    sources = [device_memory.array_of(t).reshape(-1).copy() for t in inputs]  # before any output is written
    for rank, out in enumerate(outputs):
        combine(op, rank, sources, reduce, device_memory.array_of(out).reshape(-1))
    nbytes = max(_bytes(outputs[0]), _bytes(inputs[0]))
    duration = collective_ns(op, nbytes, len(inputs), get_target(device_memory.target()))
    ends = []
    with collective_streams(devices):
        occupy(devices, duration, f"{op.name.lower()} between cores {devices}")
        for index in devices:
            end = torch.Event(device=torch.device("neuron", index))
            end.record(torch.accelerator.current_stream(index))
            ends.append(end)
    for index, end in zip(devices, ends):
        torch.accelerator.current_stream(index).wait_event(end)
    return outputs


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
