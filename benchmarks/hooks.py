"""Hooks the compile-time benchmarks put on the runtime: timing its calls, or skipping its numerics."""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def stopwatch(cls, method: str):
    """Times every call of `cls.method` while active; yields the list of seconds, in call order."""
    original, spent = getattr(cls, method), []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(cls, method, timed)
    try:
        yield spent
    finally:
        setattr(cls, method, original)


@contextlib.contextmanager
def timing_only():
    """While active, a loaded program's `run` only times it (`LoadedProgram.time()`) and returns zeros: for
    measuring the compile when a full forward on the emulator would take too long. Outputs are not checked."""
    import numpy as np

    from runtime.core import LoadedProgram, RunResult

    original = LoadedProgram.run

    def run(self, inputs):
        outputs = [np.zeros(t.shape, t.dtype.numpy) for t in self.neff.outputs()]
        return RunResult(outputs, self.time())

    LoadedProgram.run = run
    try:
        yield
    finally:
        LoadedProgram.run = original


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children (the forked torch-mlir import
    runs in one), all threads counted."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def cpu_clock():
    """While active, `time.perf_counter` reads CPU seconds (`cpu_seconds`): every stage time the compiler records
    (`Compiled.seconds`) and every time a benchmark takes with it is then CPU time, which the load of a shared
    machine does not inflate as it does wall time. In a forked child it reads the child's own CPU time."""
    original = time.perf_counter
    time.perf_counter = cpu_seconds
    try:
        yield
    finally:
        time.perf_counter = original
