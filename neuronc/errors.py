"""Typed errors. Each names its cause, where in the user's PyTorch code it came from, and what to do.

Every layer raises one of these rather than a bare exception, so the CLI and the torch.compile
backend can print a message a user can act on instead of a traceback from inside a library.
"""
from __future__ import annotations


class NeuronError(Exception):
    """Base class. ``hint`` says what the user can do about it."""

    def __init__(self, message: str, *, hint: str = "", location: str = ""):
        self.message = message
        self.hint = hint
        self.location = location
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = self.message
        if self.location:
            text += f"\n  at {self.location}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class NeuronConfigError(NeuronError):
    """A bad option or setting (unknown target, bad optimisation level, ...)."""


class NeuronCompileError(NeuronError):
    """The program cannot be compiled. ``problems`` lists every cause found, not just the first."""

    def __init__(self, message: str, *, problems=(), hint: str = "", location: str = ""):
        self.problems = list(problems)
        super().__init__(message, hint=hint, location=location)

    def __str__(self) -> str:
        text = self.message
        if self.location:
            text += f"\n  at {self.location}"
        for problem in self.problems:
            text += f"\n  - {problem}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class FrontendCrashError(NeuronCompileError):
    """The importer (torch-mlir) crashed in its isolated worker process; the user's process lives on."""


class ModelLoadError(NeuronError):
    """A `.pt2` file is missing or is not a saved torch.export ExportedProgram."""


class NeffFormatError(NeuronError):
    """A NEFF file is truncated, corrupted, of a foreign format, or of an unsupported version."""


class NeuronRuntimeError(NeuronError):
    """The emulated device refused to run an instruction (a hardware rule was broken)."""


class DeviceOutOfMemoryError(NeuronRuntimeError):
    """The program needs more device memory than the target has."""


class InputMismatchError(NeuronError):
    """Inputs given to a compiled program do not match its signature (count, shape or dtype)."""


class NeuronDeviceError(NeuronError, RuntimeError):  # a RuntimeError, as PyTorch device errors are
    """The `neuron` device cannot do what was asked (no such core, its C++ shim cannot be built, ...)."""


class FallbackDisabledError(NeuronDeviceError):
    """An op the NeuronCore does not run would fall back to the CPU, and fallback is turned off."""


class QueuedOpError(NeuronDeviceError):
    """An op queued on a `neuron` stream failed when it ran, at the next synchronisation point;
    the message names the op, its stream and the line that queued it (``__cause__`` is the failure)."""


class CollectiveError(NeuronError, RuntimeError):  # a RuntimeError, as torch.distributed's errors are
    """A collective between ranks failed: a rank died or left, or it did not arrive within the process group's
    timeout. The group cannot be used any more."""


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group called different collectives, or the same one on tensors of different shapes or
    dtypes; every rank raises it, naming what each rank passed."""


class KernelError(NeuronCompileError):
    """A custom kernel written in the NKI-compatible kernel language (`neuronc.nki`) breaks a rule of the language
    or of the NeuronCore; ``location`` is the kernel's own source line."""


class KernelUnsupportedError(KernelError):
    """A kernel uses an NKI API (or an argument of one) that neuronc's kernel language does not cover; the
    message names the API."""
