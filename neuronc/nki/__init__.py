"""An NKI-compatible kernel language for the emulated NeuronCore.

Kernels are Python functions decorated with ``@nki.jit``, written against the public names of the Neuron Kernel
Interface (``nki.language`` as ``nl``, ``nki.isa`` as ``nisa``), so a kernel from the public NKI samples runs here
with its imports changed::

    import neuronc.nki as nki
    import neuronc.nki.language as nl
    import neuronc.nki.isa as nisa

    @nki.jit
    def add(a, b):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a) + nl.load(b))
        return out

    c = add(a_np, b_np)                      # numpy in: simulated on the emulated NeuronCore, numpy out
    nki.simulate_kernel(add, a_np, b_np)     # the same, as NKI spells it
    bench = nki.benchmark(add); bench(a_np, b_np)
    bench.benchmark_result.nc_latency.get_latency_percentile(50)   # emulated device time, us

A kernel is traced (its Python runs once per argument shapes, loops unrolled) into the instructions the compiler
itself emits (:mod:`neuronc.isa`), checked by the same rules, and run by the emulator with its numerics and
timeline. Called with ``torch`` tensors it runs as a PyTorch operator (``neuronc.pytorch.custom_kernels``).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import threading

import numpy as np

from neuronc.errors import KernelError
from neuronc.nki import compiler, isa, language  # noqa: F401 (nki.compiler / nki.isa / nki.language, as NKI has them)
from neuronc.nki.dtypes import isa_dtype
from neuronc.nki.kernel import TracedKernel, as_numpy
from neuronc.nki.tensor import NkiTensor
from neuronc.nki.trace import Trace
from neuronc.targets import get_target

__all__ = ["jit", "simulate_kernel", "simulate", "benchmark", "baremetal", "Kernel", "TracedKernel", "isa",
           "language", "tensor"]

tensor = NkiTensor
DEFAULT_TARGET = "trn2"
_TARGET_NAMES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3",
                 "gen4": "trn3"}


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("torch") and hasattr(x, "shape") and \
        hasattr(x, "dtype") and type(x).__name__ in ("Tensor", "Parameter", "FakeTensor", "FunctionalTensor")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "device")


def _is_arrays(x) -> bool:
    """A tuple of arrays: one argument holding several HBM inputs (a kernel's variable number of operands)."""
    return isinstance(x, tuple) and bool(x) and all(_is_array(a) for a in x)


def _signature(x):
    if _is_array(x):
        return ("array", tuple(x.shape), str(x.dtype))
    if _is_arrays(x):
        return ("arrays", tuple(_signature(a) for a in x))
    try:
        hash(x)
        return ("value", x)
    except TypeError:
        return ("object", id(x))


class Kernel:
    """A kernel function: traced per argument signature (and launch grid), run on the emulated NeuronCore."""

    def __init__(self, fn, grid: tuple = (), target: str | None = None, **options):
        self.fn, self.grid, self.target_name, self.options = fn, tuple(grid), target, options
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self._traced: dict = {}
        self._loaded: dict = {}
        self.last_run = None  # the runtime's RunResult of the latest simulation (outputs, timeline)
        self.last_neff = None

    def __getitem__(self, grid) -> "Kernel":
        """``kernel[b, h](...)``: an SPMD launch of b x h programs (nl.program_id tells each its place)."""
        grid = grid if isinstance(grid, tuple) else (grid,)
        k = Kernel(self.fn, tuple(int(g) for g in grid), self.target_name, **self.options)
        k._traced, k._loaded = self._traced, self._loaded
        return k

    @property
    def target(self):
        name = self.target_name or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or DEFAULT_TARGET
        return get_target(_TARGET_NAMES.get(name, name))

    # -- tracing --------------------------------------------------------------------------------------------
    def trace(self, *args, **kwargs) -> TracedKernel:
        """The kernel traced for these arguments' shapes and dtypes (arrays) and values (everything else)."""
        target = self.target
        key = (self.grid, target.name, tuple(_signature(a) for a in args),
               tuple(sorted((k, _signature(v)) for k, v in kwargs.items())))
        if key not in self._traced:
            self._traced[key] = self._trace(target, args, kwargs)
        return self._traced[key]

    def _trace(self, target, args, kwargs) -> TracedKernel:
        trace = Trace(target, self.__name__)
        trace.grid_shape = self.grid
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as e:
            raise KernelError(f"kernel {self.__name__}: {e}") from None
        inputs = []
        with trace:
            def as_hbm(name, value):
                if _is_arrays(value):
                    return tuple(as_hbm(f"{name}[{i}]", v) for i, v in enumerate(value))
                if not _is_array(value):
                    return value
                t = trace.hbm_tensor(tuple(value.shape), isa_dtype(_dtype_of(value)), "input", name)
                t.storage.index = len(inputs)
                inputs.append(t.storage)
                return t

            targs = {name: as_hbm(name, value) for name, value in bound.arguments.items()}
            bound.arguments.update(targs)
            returned = None
            for pid in (np.ndindex(*self.grid) if self.grid else [()]):
                trace.start_program(tuple(int(i) for i in pid))
                value = self.fn(*bound.args, **bound.kwargs)
                if returned is None:
                    returned = value
            trace.flush()
        outputs = []
        for t in (returned if isinstance(returned, (tuple, list)) else (() if returned is None else (returned,))):
            if not isinstance(t, NkiTensor) or t.space.name != "HBM":
                raise KernelError(f"kernel {self.__name__} returns {t!r}; a kernel returns HBM tensors "
                                  f"(nl.ndarray(..., buffer=nl.shared_hbm))")
            if t.storage.kind == "input":
                raise KernelError(f"kernel {self.__name__} returns one of its arguments",
                                  hint="return a new nl.shared_hbm tensor; arguments the kernel writes are "
                                  "updated in place")
            t.storage.kind = "output"
            if t.shape != tuple(t.storage.shape) and t.offset == 0 and t.size == int(np.prod(t.storage.shape)) \
                    and t._contiguous_free():  # a reshape of the whole tensor (the bilinear sample's [n, c, h, w])
                t.storage.shape = t.shape
            outputs.append(t.storage)
        traced = TracedKernel.from_trace(trace, inputs, outputs)
        traced.returns_tuple = isinstance(returned, (tuple, list))
        return traced

    # -- running ------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        calls = getattr(_recording, "calls", None)
        if calls is not None:  # a compiler is finding the kernel a framework op calls (see recording_calls)
            return calls.record(self, args, kwargs)
        if any(_is_torch(a) for a in list(args) + list(kwargs.values())):
            return _framework_call("torch")(self, args, kwargs)
        return self.simulate(*args, **kwargs)

    def simulate(self, *args, **kwargs):
        """Run on the emulated NeuronCore with numpy arrays: the outputs (one array, or a tuple), arguments the
        kernel writes updated in place."""
        from runtime import NeuronCore

        traced = self.trace(*args, **kwargs)
        key = id(traced)
        if key not in self._loaded:
            neff = traced.to_neff()
            self._loaded[key] = (neff, NeuronCore(traced.target).load(neff, undefined_on_chip=True))
        neff, program = self._loaded[key]
        flat = [x for a in list(args) + [kwargs[k] for k in kwargs] for x in (a if _is_arrays(a) else (a,))]
        arrays = [as_numpy(a) for a in flat if _is_array(a)]
        result = program.run(arrays)
        self.last_run, self.last_neff = result, neff
        outs = result.outputs[:len(traced.outputs)]
        for position, value in zip(traced.written_inputs, result.outputs[len(traced.outputs):]):
            if arrays[position].flags.writeable:  # arguments the kernel writes, updated in place
                np.copyto(arrays[position], value, casting="no")
        if traced.returns_tuple or len(outs) > 1:
            return tuple(outs)
        return outs[0] if outs else None


# The framework integrations, named here and imported only when a kernel is called with that framework's tensors
# (the integration sits above this package: NKI's jit likewise detects the framework by its arguments).
FRAMEWORKS = {"torch": "neuronc.pytorch.custom_kernels:call_kernel"}


def _framework_call(name: str):
    import importlib

    module, function = FRAMEWORKS[name].split(":")
    return getattr(importlib.import_module(module), function)


class KernelCall:
    """One kernel call seen while recording: the kernel, its arguments, what it returned (placeholders)."""

    def __init__(self, kernel: "Kernel", args: tuple, kwargs: dict, traced: TracedKernel, returned):
        self.kernel, self.args, self.kwargs, self.traced, self.returned = kernel, args, kwargs, traced, returned


class KernelOutput:
    """A placeholder for one output of a recorded kernel call (shape and dtype of the traced kernel's output)."""

    def __init__(self, call_index: int, index: int, shape: tuple, dtype):
        self.call_index, self.index, self.shape, self.dtype = call_index, index, shape, dtype


class _Calls(list):
    def record(self, kernel: "Kernel", args: tuple, kwargs: dict):
        traced = kernel.trace(*args, **kwargs)
        outs = tuple(KernelOutput(len(self), i, tuple(s.shape), s.dtype) for i, s in enumerate(traced.outputs))
        returned = outs if traced.returns_tuple or len(outs) != 1 else outs[0]
        self.append(KernelCall(kernel, args, kwargs, traced, returned))
        return returned


_recording = threading.local()


@contextlib.contextmanager
def recording_calls():
    """Within it, calling a kernel traces it and records the call instead of running it; the block gets the list
    of :class:`KernelCall`. A compiler uses it to find which kernel a framework's custom op calls."""
    previous = getattr(_recording, "calls", None)
    _recording.calls = _Calls()
    try:
        yield _recording.calls
    finally:
        _recording.calls = previous


def _dtype_of(value):
    if isinstance(value, np.ndarray):
        return value.dtype
    return value.dtype  # torch dtype, handled by isa_dtype


def jit(fn=None, mode: str = "auto", **options):
    """``@nki.jit`` (or ``@nki.jit(target="trn1")``): a :class:`Kernel`."""
    if fn is None:
        return lambda f: Kernel(f, **{k: v for k, v in options.items() if k == "target"})
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **{k: v for k, v in options.items() if k == "target"})


def simulate_kernel(kernel, *args, **kwargs):
    """``nki.simulate_kernel(kernel, *arrays)``: run on the emulated NeuronCore, numpy in and out."""
    return jit(kernel).simulate(*args, **kwargs)


def simulate(kernel):
    """``nki.simulate(kernel)(*arrays)``."""
    k = jit(kernel)
    return k.simulate


baremetal = simulate


class _Latency:
    def __init__(self, ns: float):
        self.ns = ns

    def get_latency_percentile(self, percentile: int) -> float:
        """Microseconds: the emulated device time, the same at every percentile (the emulator is
        deterministic)."""
        return self.ns / 1000.0


class _BenchmarkResult:
    def __init__(self, ns: float, timeline):
        self.nc_latency = _Latency(ns)
        self.timeline = timeline


class BenchmarkKernel:
    """``nki.benchmark(kernel)``: calling it runs the kernel once on the emulated NeuronCore; afterwards
    ``benchmark_result.nc_latency.get_latency_percentile(50)`` is its estimated device time in us."""

    def __init__(self, kernel, **options):
        self.kernel, self.options = jit(kernel), options
        self.benchmark_result = None

    def __getitem__(self, grid):
        return BenchmarkKernel(self.kernel[grid], **self.options)

    def __call__(self, *args, **kwargs):
        out = self.kernel.simulate(*args, **kwargs)
        timeline = self.kernel.last_run.timeline
        self.benchmark_result = _BenchmarkResult(timeline.estimated_ns, timeline)
        return out


def benchmark(kernel=None, **options):
    if kernel is None:
        return lambda k: BenchmarkKernel(k, **options)
    return BenchmarkKernel(kernel, **options)
