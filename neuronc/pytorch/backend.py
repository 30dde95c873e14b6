"""`torch.compile(model, backend="neuron")`: Dynamo graphs, through AOTAutograd, onto the NeuronCore.

Registered through the `torch_dynamo_backends` entry point, so no import of neuronc is needed.
AOTAutograd lifts parameters to graph inputs and applies the frontend's ATen decompositions; each
resulting graph is compiled to a NEFF and wrapped in a callable. Given CPU tensors, it runs the NEFF on
an emulated NeuronCore of its own and returns CPU tensors. Given `neuron` tensors (a model moved with
``.to("neuron")``), it runs the NEFF on the core of their device, directly on their device memory: the
program is loaded on that core, the launch is queued on the current stream like an eager op, and its
outputs are new device tensors; nothing goes through the host.

neuronc compiles one program per input shape (as the Neuron toolchain does): a graph Dynamo traced with
dynamic shapes (`dynamic=True`, `mark_dynamic`, or automatic dynamic shapes after a second shape) is
compiled per concrete signature when it runs (`dynamic_shapes.py`), so each new input shape is a compilation
(counted: `compile_count()`, and a log line on the "neuronc" logger), never a shape-generic program.

`torch.compile(mode=...)` is accepted: "max-autotune" (and "-no-cudagraphs") compiles at -O3, where the
priced passes try their alternatives; "reduce-overhead" is the default level, since a graph is already one
NEFF launch (what CUDA graphs buy inductor). `options={"opt_level": ...}` wins over a mode.
"""
from __future__ import annotations

import functools
import logging
import weakref

import numpy as np

from neuronc.compiler import CompileOptions, compile_fx
from neuronc.errors import NeuronCompileError, NeuronConfigError
from neuronc.isa import DType

log = logging.getLogger("neuronc")


# A rebinding rebuilds the program's calls (about a first run's work); a caller that hands in parameters in new
# memory at every call would pay that each time, so after this many rebindings they are copied in per call instead.
# A choice: a few (a load_state_dict into new tensors, a .data swap) keep them resident.
REBINDS_BEFORE_COPYING = 3


class NeffFunction:
    """A compiled graph: CPU tensors in and out through a core of its own, or `neuron` tensors in and out
    on their device's memory."""

    def __init__(self, compiled, options: CompileOptions, static_inputs: frozenset = frozenset()):
        self.compiled, self.options = compiled, options
        self._last_run = self._last_launch = None  # the RunResult of the last call, or the launch to make it of
        self.on_device: dict = {}  # neuron device index -> (LoadedProgram, estimated ns)
        self.device_launches = 0
        # Positions among the program's inputs of the graph's parameters and buffers (AOTAutograd's static
        # inputs), which stay resident on the CPU path: read in place from the tensors' own memory.
        mask = compiled.input_mask
        kept = [i for i, k in enumerate(mask) if k] if mask is not None else range(max(static_inputs, default=-1) + 1)
        self.resident = tuple(n for n, i in enumerate(kept) if i in static_inputs)
        self._bindings: dict = {}  # program -> (what its bound arrays were made from, {position: array})
        self.rebinds = 0  # times a resident parameter was found in other memory than at the call before
        self.input_entries = compiled.neff.inputs()  # their dtypes: a float64 argument of an fp32 input is cast

    @property
    def last_run(self):
        """The RunResult of the last call (its outputs as numpy arrays, and the timeline); for a launch on `neuron`
        tensors made when first asked, since most launches are never asked about (a generate's every token)."""
        if self._last_launch is not None:
            self._last_run, self._last_launch = _device_run(*self._last_launch), None
        return self._last_run

    @functools.cached_property
    def output_specs(self) -> list:
        """(shape, torch dtype) of each of the NEFF's outputs, in its output order: what a launch on `neuron`
        tensors makes."""
        from neuronc.frontend.tensors import torch_dtype

        return [(tuple(t.shape), torch_dtype(t.dtype)) for t in self.compiled.neff.outputs()]

    @functools.cached_property
    def program(self):
        """The NEFF loaded on a core of its own (its HBM accounted alone), for CPU tensors; the cores of all
        such programs share one SBUF and PSUM per target (their runs take turns)."""
        from runtime import NeuronCore

        return self._with_transport(_load(self.compiled, NeuronCore(self.options.target,
                                                                     on_chip=_host_on_chip(self.options.target))))

    def _with_transport(self, program):
        """``program``, given the process groups its collective instructions name (if it has any)."""
        if self.compiled.collective_groups:
            from neuronc.pytorch.collective_transport import ProcessGroupTransport

            program.transport = ProcessGroupTransport(self.compiled.collective_groups)
        return program

    def __call__(self, *args):
        given = args
        if self.compiled.input_mask is not None:  # arguments the program does not take (a device mesh object)
            args = [a for a, kept in zip(args, self.compiled.input_mask) if kept]
        device = next((a.device.index for a in args if getattr(a, "is_neuron", False)), None)
        if self.compiled.random_draws:
            args = [*args, _generator_state(device, self.compiled.random_draws)]
        if device is not None:
            return self._arrange(self._run_on_device(device, args), given)
        from neuronc.frontend.tensors import from_numpy, to_numpy

        program = self.program
        resident = self._resident_arrays(program, args, None) if self.resident else {}
        program.bind_inputs(resident)  # (at once when they are bound already)
        entries = self.input_entries
        result = program.run([None if n in resident else _narrowed(to_numpy(a, copy=False), entries[n])
                              if n < len(entries) else to_numpy(a, copy=False) for n, a in enumerate(args)])
        self._last_run, self._last_launch = result, None
        outputs = [o.astype(np.float64) if i in self.compiled.float64_outputs else o
                   for i, o in enumerate(result.outputs)]
        return self._arrange([from_numpy(o, copy=False) for o in outputs], given)  # run's own copies

    def _resident_arrays(self, program, args, device: int | None) -> dict:
        """The parameters and buffers among ``args`` that ``program`` reads in place (runtime's ``bind_inputs``),
        position -> array: on the CPU path the tensors' own memory, on ``neuron:device`` their device memory. No
        conversion and no copy per call, and any change made to them in place between calls (an optimizer step,
        ``p.data.copy_``) is what the next call reads. Made again only when one of them is another tensor or
        memory than last time (``p.data = ...``, a new parameter). A tensor whose memory the program cannot read
        as it is (not contiguous, on another device, another shape or dtype) is copied in at each call instead."""
        keys = [(a.data_ptr(), a.dtype, a.device, a.is_contiguous()) if hasattr(a, "data_ptr") else None
                for a in [args[n] for n in self.resident]]  # (lists: a generator costs more, at every call)
        known = self._bindings.get(program)
        if known is None or known[0] != keys:
            self.rebinds += known is not None
            arrays = {} if self.rebinds > REBINDS_BEFORE_COPYING else {
                n: array for n, key in zip(self.resident, keys)
                if key is not None and (array := _readable(args[n], key, device, self.input_entries[n])) is not None}
            known = self._bindings[program] = (keys, arrays)
        return known[1]

    def _arrange(self, outputs: list, args) -> tuple:
        """The graph's outputs from the program's (output_layout: an index, None, or an argument returned)."""
        return tuple(None if i is None else args[i[1]] if isinstance(i, tuple) else outputs[i]
                     for i in self.compiled.output_layout)

    def _run_on_device(self, device: int, args) -> tuple:
        from neuronc.pytorch import eager
        from neuronc.pytorch.device_memory import core

        if device not in self.on_device:
            program = self._with_transport(_load(self.compiled, core(device)))
            self.on_device[device] = (program, program.time().estimated_ns)
        program, duration_ns = self.on_device[device]
        bound = self._resident_arrays(program, args, device) if self.resident else {}
        outputs = eager.launch_graph(program, duration_ns, args, device, f"compiled graph {self.compiled.neff.name}",
                                     self.output_specs, bound)
        self.device_launches += 1
        self._last_launch = (program, outputs)
        return outputs


def _readable(tensor, key: tuple, device: int | None, entry):
    """A numpy array a program can read ``tensor`` from in place (C-contiguous, of its input ``entry``'s shape
    and dtype), or None: a CPU tensor's own memory on the CPU path (float64 is cast per call), a `neuron`
    tensor's device memory on ``neuron:device``."""
    _, dtype, where, contiguous = key
    if not contiguous or str(dtype) == "torch.float64" or where.type != ("cpu" if device is None else "neuron") \
            or (device is not None and where.index != device):
        return None
    if device is None:
        from neuronc.frontend.tensors import to_numpy

        return to_numpy(tensor, copy=False)
    from neuronc.pytorch.device_memory import array_of

    array = array_of(tensor)
    return array if array.shape == tuple(entry.shape) and array.dtype == entry.dtype.numpy else None


def _narrowed(array, entry):
    """A float64 argument of an fp32 NEFF input (compiled with --auto-cast fp64-to-fp32) cast to fp32 on the host;
    any other array as it is (the runtime checks it)."""
    if array is not None and getattr(array, "dtype", None) == np.float64 and entry.dtype is DType.F32:
        return array.astype(np.float32)
    return array


def _static_inputs() -> frozenset:
    """The positions of the forward graph's parameters and buffers among its inputs, as AOTAutograd records them
    (what inductor's CUDA graphs treat as static); empty when it does not say."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return frozenset(getattr(metadata, "static_input_indices", None) or ())


def _generator_state(device: int | None, count: int):
    """The state (seed, offset) a graph with random ops draws from (frontend/random_draws.py), int64[2]: on a
    `neuron` device its generator's, moved past the ``count`` numbers the graph draws (as eager random ops move
    it); for CPU tensors a fresh seed drawn from torch's default CPU generator (as inductor seeds its random ops),
    so ``torch.manual_seed`` makes a call's numbers reproducible either way."""
    import torch

    if device is not None:
        from neuronc.pytorch.random_ops import generator_state

        return generator_state(None, device, count)
    seed = torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64)
    return torch.stack([seed, torch.zeros((), dtype=torch.int64)])


def _device_run(program, outputs):
    """The RunResult of a launch on device tensors: the program's timeline (it depends on nothing but the program),
    and numpy views of the output tensors' device memory, which hold the outputs once the launch ran (at the next
    synchronisation)."""
    from runtime import RunResult

    from neuronc.pytorch.device_memory import array_of

    return RunResult([array_of(o) for o in outputs], program.time())


@functools.cache
def _host_on_chip(target: str):
    from runtime.memory import OnChip
    from neuronc.targets import get_target

    return OnChip(get_target(target))


def _load(compiled, core):
    """``compiled``'s NEFF loaded on ``core``. The runtime's access check (races, reads of unwritten memory:
    most of the load time of a large program) is skipped when the NEFF's cache entry says it passed it,
    and a check passed now is recorded there, so a warm process loads at once; a new NEFF is stored in the
    cache now (compile_fx's ``store_after_load``), with the estimate this load settled."""
    custom = frozenset(n for n, k in enumerate(compiled.neff.kernels) if k.ops[:1] and k.ops[0].startswith("nki:"))
    program = core.load(compiled.neff, checked_by=compiled.checked_by(), undefined_on_chip=custom)  # NKI: tiles undefined
    compiled.loaded(program.checked_now)
    return program


def _devices_to_host(gm) -> None:
    """In place: factory ops of a graph traced on `neuron` tensors name that device (``scalar_tensor(0.0,
    device=neuron)``), and a CPU tensor moved to it is a ``device_put`` (HF's static cache moves its lengths);
    the compiler only needs shapes and dtypes, and torch-mlir knows no `neuron` device."""
    import torch

    for node in list(gm.graph.nodes):
        if node.target is torch.ops.prims.device_put.default:  # a tensor moved to a device: the same values
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "neuron":
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    gm.recompile()


class CompiledGraphs:
    """The graphs the backend compiled in this process, in order, without keeping them alive.

    ``len()`` counts every compilation (or compile-cache hit); ``[i]`` (and slices) give the i-th graph's
    :class:`NeffFunction` while Dynamo still uses it. Dynamo's caches own the compiled graphs: once it drops
    them (``torch._dynamo.reset()``, a model garbage-collected), their programs and memory go too, however
    many graphs a long-running process compiles."""

    def __init__(self):
        self._refs: list = []

    def append(self, function: NeffFunction) -> None:
        self._refs.append(weakref.ref(function))

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._alive(i) for i in range(*index.indices(len(self._refs)))]
        return self._alive(range(len(self._refs))[index])

    def __iter__(self):
        return (f for f in (ref() for ref in self._refs) if f is not None)

    def _alive(self, i: int) -> NeffFunction:
        function = self._refs[i]()
        if function is None:
            raise LookupError(f"compiled graph #{i} was freed (Dynamo no longer uses it); keep a reference to "
                              "the compiled model, or read compiled_graphs right after the call")
        return function


def compile_count() -> int:
    """How many graphs the backend has compiled (or taken from the compile cache) in this process."""
    return len(compiled_graphs)


@functools.cache
def _dynamo_skips_neuronc() -> None:
    """Dynamo must not trace neuronc's own Python (the device's eager kernels, the process group's collectives):
    PyTorch calls it from C++ while a compiled function runs its eager parts (FSDP2's hooks, DDP's reducer,
    a graph break), and Dynamo would try to compile it into graphs."""
    import torch._dynamo.trace_rules as rules

    rules.add("neuronc")
    rules.add("runtime")


MODE_OPT_LEVELS = {"reduce-overhead": None, "max-autotune": 3, "max-autotune-no-cudagraphs": 3}  # None: unchanged


def _options_for_mode(mode: str | None, options: dict | None) -> dict | None:
    """torch.compile's `mode` as compile options (see the module docstring)."""
    if mode is None:
        return options
    if mode not in MODE_OPT_LEVELS:
        raise NeuronConfigError(f"unknown torch.compile mode {mode!r} for the neuron backend",
                                hint=f"use one of: default, {', '.join(MODE_OPT_LEVELS)}; or options={{'opt_level': 0..3}}")
    level = MODE_OPT_LEVELS[mode]
    return {"opt_level": level, **(options or {})} if level is not None else options


def neuron_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    from neuronc.pytorch.dynamic_shapes import PerShapeGraphs, has_symbolic_shapes

    _dynamo_skips_neuronc()
    if has_symbolic_shapes(gm):  # compiled per concrete signature when it runs, by the static path below
        return PerShapeGraphs(gm, functools.partial(_static_backend, options=options, mode=mode))
    return _static_backend(gm, example_inputs, options, mode)


def _static_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """AOTAutograd and a NEFF per forward and backward graph, for a graph of static shapes."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from neuronc.frontend.complex_pairs import as_real_pairs
    from neuronc.frontend.saved_views import default_partition_remaking_input_views
    from neuronc.frontend.torch_import import decomposition_table
    from neuronc.pytorch import data_dependent, host_checks
    from neuronc.pytorch.partition import compile_or_partition, fallback_disabled

    compile_options = CompileOptions.from_dict(_options_for_mode(mode, options))

    def compile_graph(graph_module, inputs, static_inputs=frozenset()):
        if data_dependent.has_unknown_sizes(graph_module):  # run in stages, each a static program
            return make_boxed_func(data_dependent.data_dependent_graph(graph_module, compile_static))
        return compile_static(graph_module, static_inputs)

    def compile_static(graph_module, static_inputs=frozenset()):  # also each stage of a data-dependent graph
        _devices_to_host(graph_module)
        whole = functools.partial(compile_one, static_inputs=static_inputs)  # parameters read in place
        checks = host_checks.defer(graph_module)  # e.g. linalg's singular-matrix error: made after the run
        try:  # complex values as pairs of reals (None: no complex value, or an op no pair rule covers)
            paired = as_real_pairs(graph_module)
        except NeuronCompileError:  # a pair rule's refusal (an FFT too long): the CPU runs it, if it may
            if fallback_disabled():
                raise
            paired = None
        if paired is not None:
            real, boundary = paired
            function = boundary.wrap(compile_or_partition(real, compile_options, whole, compile_one))
        else:
            function = compile_or_partition(graph_module, compile_options, whole, compile_one)
        return make_boxed_func(host_checks.after(function, checks))

    def compile_forward(graph_module, inputs):
        return compile_graph(graph_module, inputs, _static_inputs())

    def compile_one(graph_module, static_inputs=frozenset()):
        compiled = compile_fx(graph_module, compile_options, inputs_returned_as_given=True, store_after_load=True)
        neff = compiled.neff
        function = NeffFunction(compiled, compile_options, static_inputs)
        compiled_graphs.append(function)
        inputs = [n.meta.get("val") for n in graph_module.graph.nodes if n.op == "placeholder"]
        shapes = ", ".join(str(tuple(i.shape)) for i in inputs if hasattr(i, "shape"))
        if log.isEnabledFor(logging.INFO):  # the estimate is computed when read (else the first load settles it)
            log.info("neuronc: compilation #%d (%s) for %s: %d kernels, estimated %.1f us%s; inputs %s",
                     compile_count(), compile_options.name, compile_options.target, len(neff.kernels),
                     neff.estimated_ns / 1e3, " (from the compile cache)" if compiled.cache_hit else "", shapes)
        return function

    import torch

    from neuronc.frontend.sdpa_training import explicit_attention_as_sdpa

    training = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)
    if training:  # attention written out becomes SDPA, which the training table keeps for the flash kernels
        explicit_attention_as_sdpa(gm)
    return aot_autograd(fw_compiler=compile_forward, bw_compiler=compile_graph,
                        decompositions=decomposition_table(training),
                        partition_fn=default_partition_remaking_input_views)(gm, example_inputs)


compiled_graphs = CompiledGraphs()  # every NeffFunction made in this process, newest last (for tests and tools)
