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
