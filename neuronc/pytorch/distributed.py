"""The "neuron" backend of torch.distributed: collectives over `neuron` tensors between processes.

Each process (a rank) drives its own emulated NeuronCores. A collective first runs the work queued on the
tensors' device (it reads what they hold), then moves the bytes through a gloo group over host views of the
device memory (the emulated HBM is host memory, so gloo writes the results in place), and lasts, on the
current stream's emulated clock, the DMA time of the bytes a ring algorithm moves per rank
(:func:`neuronc.instruction_cost.copy_ns`: the ranks are taken as cores whose traffic crosses their HBM).
CPU tensors pass straight to gloo, so one ``init_process_group("neuron")`` serves both devices, and
DistributedDataParallel over a model on `neuron` averages its gradient buckets through it.

The backend is registered at ``import torch`` (:mod:`neuronc.pytorch.autoload`); this module is imported
when a group is made.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from neuronc.errors import NeuronDeviceError
from neuronc.instruction_cost import copy_ns
from neuronc.pytorch import device_memory, queues
from neuronc.pytorch.device_memory import host_alias
from neuronc.targets import get_target

def create(store, rank: int, size: int, timeout) -> "NeuronProcessGroup":
    """The creator torch.distributed calls for backend "neuron"."""
    return NeuronProcessGroup(store, rank, size, timeout)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor aliasing ``tensor``'s bytes (itself on the CPU), after its device's queued work ran."""
    if tensor.device.type != "neuron":
        return tensor
    if not tensor.is_contiguous():
        caller = queues.caller()
        raise NeuronDeviceError(f"a collective over a non-contiguous neuron tensor of shape {list(tensor.shape)}",
                                hint="call .contiguous() on it first (gloo moves dense bytes)",
                                location=f"{caller[0]}:{caller[1]}" if caller else "")
    queues.synchronize(tensor.device.index)
    return host_alias(tensor)


def _hosts(tensors):
    return [_hosts(t) if isinstance(t, (list, tuple)) else _host(t) for t in tensors]


def _flat(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from _flat(t)
        else:
            yield t


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(tensors))


class NeuronProcessGroup(dist.ProcessGroup):
    """Collectives of torch.distributed over gloo, with `neuron` tensors moved through host views and timed
    on the emulated stream clock. Each method takes and returns what torch.distributed's ProcessGroup does."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 (torch.distributed's name)
        return "neuron"

    def _run(self, name: str, tensors, ring_bytes: float, *args):
        """gloo's `name` over host views of `tensors` (the collective's arguments, outputs first), waited
        for; `ring_bytes` each rank moves, charged to the streams of the neuron devices involved. Returns a
        finished Work whose result is the output tensors as given (DDP reads its buckets from it)."""
        getattr(self._gloo, name)(*_hosts(tensors), *args).wait()
        devices = {t.device.index for t in _flat(tensors) if t.device.type == "neuron"}
        for index in devices:
            duration = copy_ns(int(ring_bytes), get_target(device_memory.target()))
            queues.enqueue(index, duration, _nothing, (), f"a {name} of {self.size()} ranks")
        future = torch.futures.Future()
        future.set_result(tensors[0])
        return _create_work_from_future(future)

    def _share(self) -> float:
        """The part of a tensor a ring step moves: (n - 1) / n of it."""
        return (self.size() - 1) / self.size()

    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", [tensors], 2 * self._share() * _nbytes(tensors), opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._run("allreduce_coalesced", [tensors], 2 * self._share() * _nbytes(tensors),
                         opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", [tensors], _nbytes(tensors), opts or dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):
        return self._run("reduce", [tensors], self._share() * _nbytes(tensors), opts or dist.ReduceOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._run("allgather", [outputs, inputs], self._share() * _nbytes(outputs),
                         opts or dist.AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._run("_allgather_base", [output, input], self._share() * _nbytes([output]),
                         opts or dist.AllgatherOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._run("reduce_scatter", [outputs, inputs], self._share() * _nbytes(inputs),
                         opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run("_reduce_scatter_base", [output, input], self._share() * _nbytes([input]),
                         opts or dist.ReduceScatterOptions())

    def gather(self, outputs, inputs, opts=None):
        return self._run("gather", [outputs, inputs], self._share() * _nbytes(outputs or inputs),
                         opts or dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self._run("scatter", [outputs, inputs], self._share() * _nbytes(inputs or outputs),
                         opts or dist.ScatterOptions())

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("alltoall", [outputs, inputs], self._share() * _nbytes(inputs), opts or dist.AllToAllOptions())

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._run("alltoall_base", [output, input], self._share() * _nbytes([input]), output_split_sizes,
                         input_split_sizes, opts or dist.AllToAllOptions())

    def send(self, tensors, dst: int, tag: int = 0):
        return self._run("send", [tensors], _nbytes(tensors), dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._run("recv", [tensors], _nbytes(tensors), src, tag)

    # the names C++ callers (DDP's reducer) use for the single-tensor forms
    _allgather_base, _reduce_scatter_base, alltoall_base = all_gather_single, reduce_scatter_single, all_to_all_single

    def barrier(self, opts=None):
        return self._gloo.barrier(opts or dist.BarrierOptions())


def _nothing() -> None:
    """A collective's launch: its bytes moved when it was called; the launch only holds its time."""
