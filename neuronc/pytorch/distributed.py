"""The "neuron" backend of torch.distributed: collectives over `neuron` tensors between processes.

PyTorch routes every collective of a device to the c10d ``Backend`` registered for it on the group (DDP's
reducer, DTensor and DeviceMesh, FSDP2, the functional collectives of compiled graphs). The backend of
``init_process_group("neuron")`` is a C++ ``c10d::Backend`` (``csrc/neuron_c10d.cpp``) that forwards each call
to a :class:`NeuronCollectives` here, registered for the ``neuron`` and ``cpu`` devices, so groups get their
names, DeviceMesh its sub-groups, and the functional collectives a group to resolve.

A collective on `neuron` tensors
* checks that every rank of the group called the same collective on tensors of the same shapes and dtypes (a
  small exchange before it): when they do not, every rank raises :class:`CollectiveMismatchError` naming what
  each rank passed, instead of hanging or corrupting memory;
* runs the work queued on the tensors' devices (the collective reads what they hold), then moves the bytes
  through a gloo group over host views of the device memory (the emulated HBM is host memory, so gloo writes
  the results in place). A rank that died or a collective that does not complete within the group's timeout
  raises :class:`CollectiveError` on the ranks that are left;
* lasts, on the emulated timeline, what the interconnect model says (:func:`neuronc.collective_cost.
  collective_ns`), on the device's collective stream, which first waits for the current stream (the
  collective's inputs). The Work's ``wait()`` (``async_op=False`` calls it) makes the current stream wait for
  the collective's end, as a CUDA stream waits for NCCL's: work issued between the call and the wait overlaps
  with the transfer on the emulated clock (DDP's bucket all-reduces with the rest of the backward pass).
CPU tensors pass straight to gloo, so one ``init_process_group("neuron")`` serves both devices.

The backend is registered at ``import torch`` (:mod:`neuronc.pytorch.autoload`); this module is imported when
a group is made.
"""
from __future__ import annotations

import hashlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future

from neuronc.collective_cost import collective_ns, p2p_ns
from neuronc.errors import CollectiveError, CollectiveMismatchError, NeuronDeviceError
from neuronc.isa import CollectiveOp
from neuronc.pytorch import device_memory, queues, shim
from neuronc.pytorch.collective_streams import collective_streams, occupy
from neuronc.pytorch.device_memory import host_alias
from neuronc.targets import get_target

_DESCRIPTION_BYTES = 512  # what each rank tells the others about a collective it is about to run


def create(store, rank: int, size: int, timeout: timedelta):
    """The creator torch.distributed calls for backend "neuron": a c10d Backend over :class:`NeuronCollectives`."""
    collectives = NeuronCollectives(store, rank, size, timeout)
    return shim.load_c10d().make_backend(collectives, rank, size, timeout.total_seconds())


# ---- tensors -----------------------------------------------------------------------------------------------

def _flat(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from _flat(t)
        else:
            yield t


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(tensors))


def _signature(tensors) -> str:
    """The dtypes and shapes of ``tensors`` (not their devices: rank 0 may use neuron:0 and rank 1 neuron:1)."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in _flat(tensors)) or "nothing"


def _devices(tensors) -> list:
    return sorted({t.device.index for t in _flat(tensors) if t.device.type == "neuron"})


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor aliasing ``tensor``'s bytes (itself on the CPU)."""
    return host_alias(tensor) if tensor.device.type == "neuron" else tensor


def _hosts(tensors):
    return [_hosts(t) if isinstance(t, (list, tuple)) else _host(t) for t in tensors]


def _reduce_op_name(opts) -> str:
    op = opts.reduceOp
    return str(getattr(op, "op", op)).rpartition(".")[2]


# ---- the backend -------------------------------------------------------------------------------------------

class NeuronCollectives:
    """The collectives of one group of the "neuron" backend (what its C++ c10d Backend calls). Each method
    takes what torch.distributed's Backend method of that name takes, and returns a Work."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.group_name = ""  # set by PyTorch through the Backend (setGroupUid)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.target = get_target(device_memory.target())
        self.broken = None  # the failure that left the group unusable

    # -- collectives -------------------------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        what = f"all_reduce {_reduce_op_name(opts)} of {_signature(tensors)}"
        return self._run(what, CollectiveOp.ALL_REDUCE, tensors, _nbytes(tensors),
                         lambda: self._reduce(self.gloo.allreduce, tensors, opts))

    def allreduce_coalesced(self, tensors, opts):
        what = f"all_reduce_coalesced {_reduce_op_name(opts)} of {_signature(tensors)}"
        return self._run(what, CollectiveOp.ALL_REDUCE, tensors, _nbytes(tensors),
                         lambda: self._reduce(self.gloo.allreduce_coalesced, tensors, opts))

    def broadcast(self, tensors, opts):
        what = f"broadcast from rank {opts.rootRank} of {_signature(tensors)}"
        return self._run(what, CollectiveOp.BROADCAST, tensors, _nbytes(tensors),
                         lambda: self.gloo.broadcast(_hosts(tensors), opts))

    def reduce(self, tensors, opts):
        what = f"reduce {_reduce_op_name(opts)} to rank {opts.rootRank} of {_signature(tensors)}"
        return self._run(what, CollectiveOp.REDUCE, tensors, _nbytes(tensors),
                         lambda: self._reduce(self.gloo.reduce, tensors, opts))

    def allgather(self, outputs, inputs, opts):
        what = f"all_gather of {_signature(inputs)} into {len(outputs[0]) if outputs else 0} tensors"
        return self._run(what, CollectiveOp.ALL_GATHER, outputs, _nbytes(outputs), lambda: self.gloo.allgather(
            _hosts(outputs), _hosts(inputs), opts), inputs=inputs)

    def all_gather_single(self, output, input, opts):
        what = f"all_gather_into_tensor of {_signature([input])} into {_signature([output])}"
        return self._run(what, CollectiveOp.ALL_GATHER, [output], _nbytes([output]),
                         lambda: self.gloo._allgather_base(_host(output), _host(input), opts), inputs=[input])

    def allgather_coalesced(self, outputs, inputs, opts):
        what = f"all_gather_coalesced of {_signature(inputs)}"
        return self._run(what, CollectiveOp.ALL_GATHER, outputs, _nbytes(outputs),
                         lambda: self.gloo.allgather_coalesced(_hosts(outputs), _hosts(inputs), opts), inputs=inputs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        what = f"all_gather_into_tensor_coalesced of {_signature(inputs)} into {_signature(outputs)}"
        return self._run(what, CollectiveOp.ALL_GATHER, outputs, _nbytes(outputs),
                         lambda: self._each(self.gloo._allgather_base, outputs, inputs, opts), inputs=inputs)

    def gather(self, outputs, inputs, opts):
        what = f"gather to rank {opts.rootRank} of {_signature(inputs)}"
        return self._run(what, CollectiveOp.ALL_GATHER, outputs, _nbytes(inputs) * self.size,
                         lambda: self.gloo.gather(_hosts(outputs), _hosts(inputs), opts), inputs=inputs)

    def scatter(self, outputs, inputs, opts):
        what = f"scatter from rank {opts.rootRank} into {_signature(outputs)}"
        return self._run(what, CollectiveOp.ALL_GATHER, outputs, _nbytes(outputs) * self.size,
                         lambda: self.gloo.scatter(_hosts(outputs), _hosts(inputs), opts), inputs=inputs)

    def reduce_scatter(self, outputs, inputs, opts):
        what = f"reduce_scatter {_reduce_op_name(opts)} into {_signature(outputs)}"
        return self._run(what, CollectiveOp.REDUCE_SCATTER, outputs, _nbytes(inputs),
                         lambda: self._reduce(self.gloo.reduce_scatter, outputs, opts, inputs), inputs=inputs)

    def reduce_scatter_single(self, output, input, opts):
        what = f"reduce_scatter_tensor {_reduce_op_name(opts)} of {_signature([input])} into {_signature([output])}"
        return self._run(what, CollectiveOp.REDUCE_SCATTER, [output], _nbytes([input]),
                         lambda: self._reduce(self.gloo._reduce_scatter_base, [output], opts, [input], single=True),
                         inputs=[input])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        what = f"reduce_scatter_tensor_coalesced {_reduce_op_name(opts)} into {_signature(outputs)}"

        def run():
            for output, input in zip(outputs, inputs):
                self._reduce(self.gloo._reduce_scatter_base, [output], opts, [input], single=True)

        return self._run(what, CollectiveOp.REDUCE_SCATTER, outputs, _nbytes(inputs), run, inputs=inputs)

    def alltoall(self, outputs, inputs, opts):
        what = f"all_to_all of {len(inputs)} tensors of {str(inputs[0].dtype) if inputs else ''}"
        return self._run(what, CollectiveOp.ALL_TO_ALL, outputs, _nbytes(inputs),
                         lambda: self.gloo.alltoall(_hosts(outputs), _hosts(inputs), opts), inputs=inputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        what = f"all_to_all_single of {input.dtype}"  # the ranks' sizes may differ
        return self._run(what, CollectiveOp.ALL_TO_ALL, [output], _nbytes([input]), lambda: self.gloo.alltoall_base(
            _host(output), _host(input), output_splits, input_splits, opts), inputs=[input])

    def barrier(self, opts):
        return self._run("barrier", CollectiveOp.BARRIER, [], 0, lambda: self.gloo.barrier(opts))

    def send(self, tensors, dst: int, tag: int):
        return self._p2p(f"send of {_signature(tensors)} to rank {dst}", tensors,
                         lambda: self.gloo.send(_hosts(tensors), dst, tag))

    def recv(self, tensors, src: int, tag: int):
        return self._p2p(f"recv of {_signature(tensors)} from rank {src}", tensors,
                         lambda: self.gloo.recv(_hosts(tensors), src, tag))

    def recv_anysource(self, tensors, tag: int):
        return self._p2p(f"recv of {_signature(tensors)} from any rank", tensors,
                         lambda: self.gloo.recv_anysource(_hosts(tensors), tag))

    # -- how they run ------------------------------------------------------------------------------------

    def _run(self, what: str, op: CollectiveOp, outputs, nbytes: int, move, inputs=()) -> dist.Work:
        """Check that the ranks agree on ``what``, run the devices' queued work, ``move()`` the bytes through
        gloo, and charge the collective's time; a finished Work whose result is ``outputs``."""
        tensors = [*_flat(outputs), *_flat(inputs)]
        self._check_usable(what)
        self._check_contiguous(tensors)
        self._agree(what)
        devices = _devices(tensors)
        for i in devices:
            queues.synchronize(i)
        work = move()  # a gloo Work, or None when move() waited itself
        if work is not None:
            self._wait(work, what)
        if not devices:
            future = torch.futures.Future()
            future.set_result(outputs)
            return _create_work_from_future(future)
        future = torch.futures.Future(devices=[torch.device("neuron", i) for i in devices])
        with collective_streams(devices):
            occupy(devices, collective_ns(op, nbytes, self.size, self.target), f"{what} (rank {self.rank} of "
                    f"{self.size})")
            future.set_result(outputs)
        return _create_work_from_future(future)

    def _p2p(self, what: str, tensors, move) -> dist.Work:
        """A message: sent or received asynchronously by gloo; its wait() waits for it. Its time (one hop)
        is charged on the collective stream at the call."""
        self._check_usable(what)
        self._check_contiguous(tensors)
        devices = _devices(tensors)
        for i in devices:
            queues.synchronize(i)
        work = move()
        if not devices:
            return work
        ends = []
        with collective_streams(devices):
            occupy(devices, p2p_ns(_nbytes(tensors), same_chip=self.size <= self.target.cores_per_chip,
                                    target=self.target), f"{what} (rank {self.rank})")
            for i in devices:
                end = torch.Event(device=torch.device("neuron", i))
                end.record(torch.accelerator.current_stream(i))
                ends.append((i, end))
        return _MessageWork(self, work, ends, what)

    def _reduce(self, gloo_op, tensors, opts, inputs=None, single: bool = False) -> None:
        """A reduction through gloo; AVG (which gloo lacks) as a SUM divided by the group's size."""
        average = getattr(opts.reduceOp, "op", opts.reduceOp) == dist.ReduceOp.AVG
        if average:  # the same options (a reduce's root among them) with SUM
            summed = type(opts)()
            for field in ("rootRank", "rootTensor", "timeout", "asyncOp"):
                if hasattr(opts, field):
                    setattr(summed, field, getattr(opts, field))
            summed.reduceOp = dist.ReduceOp.SUM
            opts = summed
        hosts = _hosts(tensors)
        if inputs is None:
            work = gloo_op(hosts, opts)
        elif single:
            work = gloo_op(hosts[0], _host(inputs[0]), opts)
        else:
            work = gloo_op(hosts, _hosts(inputs), opts)
        self._wait(work, "")
        if average:
            for t in _flat(hosts):
                t.div_(self.size)

    def _each(self, gloo_op, outputs, inputs, opts) -> None:
        for output, input in zip(outputs, inputs):
            self._wait(gloo_op(_host(output), _host(input), opts), "")

    def _agree(self, what: str) -> None:
        """Every rank learns what the others are about to run; all raise if that differs."""
        data = what.encode()
        if len(data) > _DESCRIPTION_BYTES:
            data = data[:_DESCRIPTION_BYTES - 20] + b" #" + hashlib.sha256(data).hexdigest()[:18].encode()
        mine = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8, device="cpu")  # not the default device
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.zeros(self.size * _DESCRIPTION_BYTES, dtype=torch.uint8, device="cpu")
        self._wait(self.gloo._allgather_base(every, mine, AllgatherOptions()), what)
        said = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every.view(self.size, -1).tolist()]
        if any(s != said[0] for s in said):
            ranks = "; ".join(f"rank {r}: {s}" for r, s in enumerate(said))
            caller = queues.caller()
            raise CollectiveMismatchError(
                f"the ranks of process group {self.group_name!r} called different collectives ({ranks})",
                hint="every rank of a group must call the same collectives in the same order, on tensors of the "
                "same shapes and dtypes", location=f"{caller[0]}:{caller[1]}" if caller else "")

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            self.broken = self.broken or f"{type(e).__name__}: {e}".splitlines()[0]
            raise self._failure(what, self.broken) from e

    def _failure(self, what: str, cause: str) -> CollectiveError:
        caller = queues.caller()
        return CollectiveError(
            f"{what or 'a collective'} of process group {self.group_name!r} (rank {self.rank} of {self.size}) "
            f"failed: {cause}",
            hint="another rank died or left, or did not reach this collective within the group's timeout "
            f"({self.timeout.total_seconds():g} s); the group cannot be used any more: destroy it "
            "(dist.destroy_process_group()) and restart the job",
            location=f"{caller[0]}:{caller[1]}" if caller else "")

    def _check_usable(self, what: str) -> None:
        if self.broken:
            raise self._failure(what, f"an earlier collective of the group failed ({self.broken})")

    @staticmethod
    def _check_contiguous(tensors) -> None:
        for t in tensors:
            if t.device.type == "neuron" and not t.is_contiguous():
                caller = queues.caller()
                raise NeuronDeviceError(
                    f"a collective over a non-contiguous neuron tensor of shape {list(t.shape)}",
                    hint="call .contiguous() on it first (gloo moves dense bytes)",
                    location=f"{caller[0]}:{caller[1]}" if caller else "")


# torch.compile must not trace these: the C++ Backend calls them while a compiled function runs (FSDP2's hooks,
# DDP's reducer), and Dynamo would try to compile their gloo calls into a graph.
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
              "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "alltoall", "all_to_all_single", "barrier",
              "send", "recv", "recv_anysource"):
    setattr(NeuronCollectives, _name, torch.compiler.disable(getattr(NeuronCollectives, _name)))


class _MessageWork(dist.Work):
    """A send or receive in flight: wait() waits for gloo, then makes the current streams wait for the
    message's end on the emulated clock."""

    def __init__(self, collectives: NeuronCollectives, work, ends: list, what: str):
        super().__init__()
        self._collectives, self._work, self._ends, self._what = collectives, work, ends, what

    @torch.compiler.disable
    def wait(self, timeout: timedelta | None = None) -> bool:
        self._collectives._wait(self._work, self._what)
        for index, end in self._ends:
            torch.accelerator.current_stream(index).wait_event(end)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()
