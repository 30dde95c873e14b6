"""Device rows of `torch.profiler` for the `neuron` device: what each launch runs, on the emulated timeline.

`torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])` takes PyTorch's
Kineto path. The C++ shim registers a Kineto activity profiler for PrivateUse1 (PyTorch's
`REGISTER_PRIVATEUSE1_PROFILER`, torch/csrc/profiler/standalone/privateuse1_profiler.h): while a trace records,
the shim's `launch` returns the correlation id of the ATen op queueing the launch, and
:func:`record` gives the shim the launch's activities: each kernel of its program with its emulated start and
end on the stream (the program's timeline, `LoadedProgram.time()`, shifted to the launch's start), or one copy
or fill. The shim turns them into Kineto activities linked to their op, so `key_averages()` counts their device
time under the op and the exported Chrome trace shows them on a row per device and stream, with flow arrows from
the op; a `record_function` range spans the launches queued inside it on the same rows.
"""
from __future__ import annotations

import sys
import weakref

from neuronc.pytorch import shim

_kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LoadedProgram -> [(name, start, end)]


def record(device: int, stream: int, start_ns: float, duration_ns: float, what, function, arguments: tuple,
           correlation: int) -> None:
    """Give the trace the activities of one launch queued by the op of ``correlation`` (0: none)."""
    module = sys.modules[shim.NAME]
    name = str(what)
    launch = module.record_launch(f"neuron launch ({name})", correlation)
    program = _program_of(function)
    if program is None:
        kind = "memcpy" if "copy" in name else "memset" if name in ("fill_", "arange") else "kernel"
        module.record_activity(name, kind, device, stream, correlation, start_ns, start_ns + duration_ns, launch)
        return
    for kernel, begin, end in kernels(program):
        module.record_activity(kernel, "kernel", device, stream, correlation, start_ns + begin, start_ns + end, launch)


def kernels(program) -> list:
    """(name, start, end) of each kernel of a loaded program on its timeline (ns from the program's start):
    from its first instruction's start to its last one's end, named "<program>/<kernel>"."""
    found = _kernels.get(program)
    if found is None:
        table = program.neff.kernels
        spans: dict = {}
        for event in program.time().events:
            key = event.kernel
            begin, end = spans.get(key, (event.start_ns, event.end_ns))
            spans[key] = (min(begin, event.start_ns), max(end, event.end_ns))
        name = program.neff.name
        found = [(f"{name}/{table[k].name}" if 0 <= k < len(table) else name, begin, end)
                 for k, (begin, end) in sorted(spans.items(), key=lambda item: item[1])]
        _kernels[program] = found
    return found


def _program_of(function):
    """The LoadedProgram a queued function runs, if any (a program's run_into, an EagerProgram's run, a batch)."""
    owner = getattr(function, "__self__", None)
    for candidate in (owner, getattr(owner, "program", None), getattr(function, "entry", None)):
        if candidate is not None and hasattr(candidate, "neff") and hasattr(candidate, "time"):
            return candidate
        program = getattr(candidate, "program", None)
        if program is not None and hasattr(program, "neff"):
            return program
    return None
