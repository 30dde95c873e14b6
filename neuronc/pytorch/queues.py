"""The per-stream queues of the `neuron` device: ops are queued when PyTorch calls them and run at
synchronisation points, in emulated device-time order.

Each launch is stamped by the C++ shim with its stream and its start on that stream's emulated clock
(the stream's previous work, raised by event waits and by the device's last synchronisation). A
synchronisation point — ``torch.accelerator.synchronize()``, a stream's or an event's ``synchronize`` or
``query``, reading device memory from the host (``.cpu()``, ``.item()``, printing, the CPU fallback) —
runs every launch queued on the device in order of start time (ties in the order they were queued).
So work on one stream runs in order, and across streams only as their clocks say: a consumer on a stream
that did not wait for the producer's event starts before the producer did, and reads what the memory
held before. Each launch runs whole at its start (reads its inputs, writes its outputs); the host then
counts as having waited for all of it, so nothing queued later starts earlier (``neuron_shim.settle``).

A launch that fails raises :class:`~neuronc.errors.QueuedOpError` at the synchronisation point, naming the
op, its stream and the line of user code that queued it; the launches queued after it on the device are
dropped (what they would have written keeps its old values), as a CUDA error poisons its queue.
``QUEUE_DEPTH`` queued launches on a device run them as a synchronisation would (a full launch queue).
With adaptive eager on, consecutive ops of a stream run as one NEFF (:mod:`neuronc.pytorch.adaptive`).
"""
from __future__ import annotations

import itertools
import operator
import os
import sys

import torch

from neuronc.errors import QueuedOpError
from neuronc.pytorch import adaptive, profiler
from runtime.core import quiet_numerics

QUEUE_DEPTH = 1024
_queues: dict = {}  # device index -> [(start ns, sequence number, function, arguments, context)]
_sequence = itertools.count()
_order = operator.itemgetter(0, 1)
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # torch, neuronc


def enqueue(device: int, duration_ns: float, function, arguments: tuple, what) -> None:
    """Queue ``function(*arguments)`` on the current stream of ``device``, lasting ``duration_ns`` of
    device time. ``what`` names it in an error (an op, or a string)."""
    start, stream, correlation = _launch(device, duration_ns)
    if correlation >= 0:  # a torch.profiler trace records device activities
        profiler.record(device, stream, start, duration_ns, what, function, arguments, correlation)
    queue = _queues.get(device)
    if queue is None:
        queue = _queues[device] = []
    queue.append((start, next(_sequence), function, arguments, (what, stream, caller())))
    if len(queue) >= QUEUE_DEPTH:
        synchronize(device)


def synchronize(device: int) -> None:
    """Run the launches queued on ``device`` in emulated-time order; raise the first failure."""
    queue = _queues.get(device)
    if queue:
        _queues[device] = []
        queue.sort(key=_order)
        if adaptive.ENABLED:
            queue = adaptive.batch(queue, device)
        with quiet_numerics():  # once for the whole queue rather than once per launch
            for start, _, function, arguments, context in queue:
                try:
                    function(*arguments)
                except Exception as e:
                    _shim().settle(device)
                    raise _failure(device, start, context, e) from e
    _shim().settle(device)


def resize(tensor: torch.Tensor, shape) -> None:
    """Resize a device tensor in place. A resize may move its storage's bytes to new memory, so the work queued
    on its device runs first (a synchronisation point). A storage of no bytes (a new empty output: every
    ``torch.arange(..., device=...)`` makes one) has nothing to move, and the queue is left to run later; the
    device's clocks still settle as that synchronisation settles them (the clocks move when work is queued, not
    when it runs), so what is queued afterwards starts where it would have. Under adaptive eager a
    synchronisation also ends a batch: there it stays one."""
    device = tensor.device.index
    if tensor.untyped_storage().nbytes() or adaptive.ENABLED:
        synchronize(device)
    else:
        _shim().settle(device)
    tensor.resize_(shape)


def synchronize_all() -> None:
    for device in list(_queues):
        synchronize(device)


def pending(device: int) -> int:
    """How many launches wait on ``device`` (for tests and tools)."""
    return len(_queues.get(device, ()))


def _launch(device: int, duration_ns: float) -> tuple:
    global _launch
    _launch = _shim().launch
    return _launch(device, duration_ns)


def _shim():
    return sys.modules["neuron_shim"]


_internal_files: dict = {}  # file name -> whether it is torch's or neuronc's (asked once per file)


def caller():
    """(file, line) of the innermost frame outside torch and neuronc: the user code that queued the op (or
    called the API that asks)."""
    frame = sys._getframe(2)
    internal = _internal_files
    while frame is not None:
        name = frame.f_code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal[name] = name.startswith(_INTERNAL)
        if not inside:
            return (name, frame.f_lineno)
        frame = frame.f_back
    return None


def _failure(device: int, start: float, context: tuple, error: Exception) -> QueuedOpError:
    what, stream, caller = context
    cause = getattr(error, "message", None) or f"{type(error).__name__}: {error}"
    return QueuedOpError(
        f"{what} queued on stream {stream} of neuron:{device} failed when it ran (emulated start "
        f"{start / 1e3:.1f} us): {cause}",
        hint="the error surfaced at this synchronisation point, not where the op was called; the ops queued "
        "after it on the device did not run",
        location=f"{caller[0]}:{caller[1]}" if caller else "",
    )
