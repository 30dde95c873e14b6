"""Eager execution of ATen ops on `neuron` tensors: one op, one NEFF, run on the tensor's NeuronCore.

Every op PyTorch dispatches to the device and that no composite kernel handles reaches :func:`run_op`
(a boxed fallback on the PrivateUse1 key). The op is traced with its arguments' shapes and dtypes
into a one-op FX graph (``make_fx``, torch-mlir's decompositions), compiled by the same pipeline as
``torch.compile`` (:func:`neuronc.compiler.compile_fx`) to a NEFF and loaded on the core of the
tensors' device; the loaded program is kept in memory under (op, shapes, dtypes, other arguments,
device), so the next call with the same signature is a dictionary lookup and a launch. A Python number
where the op takes a tensor (``x * 0.9``), or where it takes a Scalar of an op in :data:`SCALAR_FORMS`
(``add``'s alpha, ``addcdiv``'s value, ``lerp``'s weight...), is a runtime input of the program (a 0-d
tensor), keyed by its type only: an optimizer whose step sizes change every step compiles in its first step
only. Other arguments (dims, shapes, flags) are part of the signature. An elementwise or row-wise op met at a
second size runs the program of its shape bucket on padded operands (``BucketedProgram``, the rules in
:mod:`neuronc.frontend.aten_buckets`), and so do a matmul, a softmax or a float sum along a size that changed
since the op was first met (generate()'s key length: the same sum of the same terms, regrouped);
``NEURON_EAGER_BUCKETS=exact`` keeps to bit-exact padding, ``0`` turns buckets off. In-place and ``out=`` ops run their
functional form with the mutated tensor's memory as the program's output.

Launches are queued on the current stream (:mod:`neuronc.pytorch.queues`) and run at the next
synchronisation point; the host pays only for the lookup, the new output tensors and the queueing.

Random ops (``uniform_``, ``normal_``, ``bernoulli_``, dropout, ``random_``, ``randperm``) are drawn on
the device by :mod:`neuronc.pytorch.random_ops`, fused Adam/AdamW steps run as one program
(:mod:`neuronc.pytorch.fused_optim`). Ops the NeuronCore cannot run (the compiler refuses them, other
random ops, ops with data-dependent output shapes or non-tensor results) run on the CPU: arguments
copied to the host, results copied back, with one warning per op. ``TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1`` makes that a
:class:`~neuronc.errors.FallbackDisabledError` naming the op.

Moving bytes (``_copy_from``: host <-> device and device <-> device; ``cat`` and ``clone``, whatever their
sizes) and ``fill_``/``zero_`` act on the device memory directly, as DMA and memset would, queued like ops and
lasting the cost model's DMA time for their bytes (:func:`neuronc.instruction_cost.copy_ns`) on the stream's
clock; reading device memory from the host (``.cpu()``, ``.item()``) is a synchronisation point.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import sys
import warnings

import numpy as np
import torch

from neuronc.errors import FallbackDisabledError, NeuronConfigError, NeuronDeviceError, NeuronError
from neuronc.frontend.scalar_overloads import scalar_overload
from neuronc.instruction_cost import copy_ns  # loaded already with the runtime (device_memory imports it)
from neuronc.isa import E4M3_MAX
from neuronc.pytorch import adaptive, queues, shim
from neuronc.pytorch.device_memory import NUMPY_DTYPES, array_of, core, host_array, host_tensor

log = logging.getLogger("neuronc")

FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
_libraries: list = []  # the torch.library registrations, kept alive
_own_kernels: set = set()  # "name[.overload]" of the ATen ops with a PrivateUse1 kernel of our own


@dataclasses.dataclass
class EagerProgram:
    """One op compiled for one signature, loaded on one core."""

    program: object  # runtime.LoadedProgram
    layout: list  # per flat output of the op: its NEFF output index
    outputs: list  # per flat output that is a tensor: (shape, dtype)
    out_spec: object  # pytree spec rebuilding the op's result from the flat outputs
    duration_ns: float  # estimated device time of one run
    launches: int = 0
    nones: tuple = ()  # positions among the op's flat results of those that are None
    mutated: tuple = ()  # operands the op also writes (batch norm's running statistics): the NEFF's last outputs
    empty: tuple = ()  # which of ``outputs`` are empty tensors, made but not written by the NEFF

    def __post_init__(self):
        self.single = self.out_spec.is_leaf()
        self.permuted = list(self.layout) != list(range(len(self.layout)))
        self.run = self.program.run_into if not self.permuted else self._run_permuted
        # one new tensor, written by the NEFF's one output: the launch's short path (see ``_launch``)
        self.plain = self.single and not self.permuted and not self.mutated and not self.empty and \
            len(self.outputs) == 1

    def arrange(self, flat: list) -> list:
        """The op's flat outputs in the NEFF's output order; a NEFF output two op outputs share goes to the
        first, and the others copy it (see ``_run_permuted``)."""
        ordered = [None] * (max(self.layout) + 1)
        for index, array in zip(self.layout, flat):
            if ordered[index] is None:
                ordered[index] = array
        return [ordered, flat]

    def _run_permuted(self, inputs: list, arranged: list) -> None:
        ordered, flat = arranged
        scratch = [np.empty(tuple(t.shape), t.dtype.numpy) if a is None else a
                   for a, t in zip(ordered, self.program.neff.outputs())]
        self.program.run_into(inputs, scratch)
        for index, array in zip(self.layout, flat):
            if array is not scratch[index]:
                array[...] = scratch[index]


programs: dict = {}  # ((op, signature of args, of kwargs), device) -> EagerProgram, or why it runs on the CPU


def compiled_for(op, first_shape: tuple) -> list:
    """The EagerPrograms of ``op`` whose first argument has ``first_shape`` (for tests and tools)."""
    return [entry for ((functional, args, _), _), entry in programs.items()
            if functional == op and args and isinstance(args[0], tuple) and args[0][0] == first_shape
            and isinstance(entry, EagerProgram)]
fallen_back: dict = {}  # op name -> why it ran on the CPU (warned once)
fallback_calls: collections.Counter = collections.Counter()  # op name -> calls that ran on the CPU
host_transfers: collections.Counter = collections.Counter()  # "to device" / "to host" -> copies through the host


# ---- entry points ----------------------------------------------------------------------------------

def register() -> None:
    """Register the kernels on the PrivateUse1 key (called by ``torch.neuron._lazy_init``)."""
    if _libraries:
        return
    from neuronc.pytorch import amp_ops, fused_optim, random_ops

    aten = torch.library.Library("aten", "IMPL")
    for name, kernel in {**DIRECT_KERNELS, **random_ops.KERNELS, **fused_optim.KERNELS, **amp_ops.KERNELS}.items():
        aten.impl(name, kernel, "PrivateUse1")
        _own_kernels.add(name)
    for name in ONE_PROGRAM:
        aten.impl(name, functools.partial(run_op, getattr(torch.ops.aten, name).default), "PrivateUse1")
        _own_kernels.add(name)
    for key in ("Conjugate", "Negative"):  # _copy_from applies the bits itself (``_assignment``): PyTorch would hand
        aten.impl("_copy_from", torch.library.fallthrough_kernel, key)  # it a resolved clone of a marked dst
    every = torch.library.Library("_", "IMPL")
    every.fallback(run_op, "PrivateUse1")
    _libraries.extend([aten, every])
    _print_from_host()
    from neuronc.pytorch.flex_attention import allow_neuron_devices

    allow_neuron_devices()


def _print_from_host() -> None:
    """Format a device tensor's elements from a host copy, as PyTorch does for XLA, lazy and MTIA tensors:
    printing runs a dozen small ops (masks, min/max, float64 casts) that would each compile a NEFF."""
    import torch._tensor_str as tensor_str

    format_elements = tensor_str._tensor_str

    def from_host(self, indent):
        return format_elements(self.cpu() if self.device.type == "neuron" else self, indent)

    tensor_str._tensor_str = from_host


def run_op(op, *args, **kwargs):
    """Run ``op`` on the NeuronCore of its tensors (compiled on first use), or on the CPU if it cannot."""
    return run_planned(op, _plans.get(op) or _plan(op), *args, **kwargs)


def run_planned(op, plan, *args, **kwargs):
    """``run_op`` with ``op``'s plan already looked up (the kernel PyTorch calls for an op seen before)."""
    if op in _INDEXING:  # (self, indices, ...): CPU index tensors moved to self's device
        args = (args[0], _indices_on(args[0].device, args[1]), *args[2:])
    if plan.__class__ is str:
        return cpu_fallback(op, args, kwargs, plan)
    functional, writes, runtime, defaults = plan
    if kwargs:  # keyword arguments left at their defaults are no part of the signature, nor program inputs
        kwargs = {k: v for k, v in kwargs.items() if not _is_default(defaults, k, v)}
    call_kwargs = {k: v for k, v in kwargs.items() if k not in writes["out"]} if kwargs and writes else kwargs
    operands = []
    key = (functional, _signature(args, runtime, operands),
           _signature(call_kwargs, runtime, operands) if call_kwargs else ())
    inputs = []
    device = _device_of(op, operands, inputs)
    entry = programs.get((key, device))
    if entry is None:
        entry = programs[(key, device)] = _compile(functional, args, call_kwargs, device, runtime)
    if entry.__class__ is str:
        return cpu_fallback(op, args, kwargs, entry)
    return _launch(op, entry, device, operands, inputs, writes, args, kwargs)


# Indexing takes its index tensors from the CPU too, as CUDA's does (`x[torch.tensor([0, 2])]`): moved to x's device.
_INDEXING = frozenset({torch.ops.aten.index.Tensor, torch.ops.aten.index.Tensor_out, torch.ops.aten.index_put.default,
                       torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default})


def _indices_on(device, indices) -> list:
    return [i.to(device) if isinstance(i, torch.Tensor) and i.device != device else i for i in indices]


_plans: dict = {}  # op -> (functional op, what it writes, its runtime-scalar arguments, keyword defaults)
# or why it runs on the CPU
_NO_DEFAULT = object()


def _is_default(defaults: dict, name: str, value) -> bool:
    """Whether ``value`` is the schema's default of keyword argument ``name`` (None, a bool or a number of the
    default's own type): PyTorch passes every keyword argument, ``add``'s ``alpha=1`` included."""
    default = defaults.get(name, _NO_DEFAULT)
    return value is default or (type(value) is type(default) and type(value) in _DEFAULTABLE and value == default)


_DEFAULTABLE = (bool, int, float)


def _keyword_defaults(op) -> dict:
    return {a.name: a.default_value for a in op._schema.arguments if a.kwarg_only and a.has_default_value()}


def _plan(op):
    reason = _not_compilable(op)
    functional, writes = _functional(op)
    if not reason and functional is None:
        reason = "it mutates its arguments in a way neuronc does not compile"
    _plans[op] = reason or (functional, writes, _runtime_scalars(functional), _keyword_defaults(op))
    if not reason:
        _register_direct(op)
        if writes and writes["out"]:
            _plan_siblings(functional)
    return _plans[op]


def _plan_siblings(functional) -> None:
    """Also take the functional and in-place forms of an op PyTorch reached through its ``out=`` form: for a
    structured op (add, mul, mm...) PyTorch makes the output and calls ``out=`` unless the backend has a
    kernel for the form called, and a kernel of our own makes the output with its numpy view in one call."""
    name = functional._schema.name.split("::")[1]
    inplace = getattr(getattr(torch.ops.aten, name + "_", None), functional._overloadname, None)
    for op in (functional, inplace):
        if op is not None and op not in _plans and torch._C._dispatch_has_kernel_for_dispatch_key(
                op._schema.name + ("." + op._overloadname if op._overloadname != "default" else ""),
                "CompositeExplicitAutogradNonFunctional"):
            _plan(op)


def _register_direct(op) -> None:
    """From now on PyTorch calls ``run_op`` for ``op`` as its own PrivateUse1 kernel rather than through the
    boxed fallback, which looks the op up by name on every call (about 5 us of the launch overhead). Not an
    op with a kernel of our own (``cat`` as DMA calls ``run_op`` for the cases it leaves to a program)."""
    name = op._schema.name.split("::")[1] + ("" if op._overloadname == "default" else "." + op._overloadname)
    if name in _own_kernels:
        return
    try:
        _libraries[0].impl(op, functools.partial(run_planned, op, _plans[op]), "PrivateUse1")
    except RuntimeError as e:  # already has a kernel: the fallback keeps serving it
        log.debug("neuronc: %s keeps the fallback kernel: %s", op, e)


def cpu_fallback(op, args, kwargs, reason: str):
    """Run ``op`` on the CPU: device arguments copied to the host, mutated ones and results copied back."""
    name = str(op)
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        raise FallbackDisabledError(f"{name} cannot run on the NeuronCore ({reason}), and CPU fallback is off",
                                    hint=f"unset {FALLBACK_ENV} to run it on the CPU, or avoid the op")
    fallback_calls[name] += 1
    if name not in fallen_back:
        fallen_back[name] = reason
        warnings.warn(f"neuron: {name} runs on the CPU ({reason}); its arguments are copied to the host and "
                      f"back. Set {FALLBACK_ENV}=1 to make this an error.", stacklevel=3)
    device = _device_of_call(args, kwargs)
    originals = {}

    def to_host(x):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            host = x.cpu()
            originals[id(host)] = x
            return host
        if isinstance(x, torch.device) and x.type == "neuron":  # a factory's device=: made on the CPU, copied
            return torch.device("cpu")
        return x

    host_args, host_kwargs = torch.utils._pytree.tree_map(to_host, (args, kwargs))
    host_args, host_kwargs = _draw_from_the_device_generator(op, host_args, host_kwargs, device)
    result = scalar_overload(op, host_args, host_kwargs)(*host_args, **host_kwargs)
    for i, argument in enumerate(op._schema.arguments):  # mutated arguments: their new bytes go back
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = host_kwargs.get(argument.name) if argument.kwarg_only else (
            host_args[i] if i < len(host_args) else host_kwargs.get(argument.name))
        for host in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(host, torch.Tensor) and id(host) in originals:
                original = originals[id(host)]
                if original.shape != host.shape:
                    queues.resize(original, host.shape)
                original.copy_(host)

    def to_device(x):
        if isinstance(x, torch.Tensor):
            return originals.get(id(x)) if id(x) in originals else x.to(device)
        return x

    return torch.utils._pytree.tree_map(to_device, result)


def _draw_from_the_device_generator(op, args: tuple, kwargs: dict, device: torch.device) -> tuple:
    """(args, kwargs) of a random op run on the CPU, drawing from a CPU generator seeded by the next block of
    the device generator's stream (the one it was given, or the device's default): ``torch.manual_seed`` and
    ``torch.Generator(device="neuron")`` apply, and the device generator moves on."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "generator" and "Generator" in str(argument.type):
            positional = not argument.kwarg_only and i < len(args)
            given = args[i] if positional else kwargs.get("generator")
            if given is None or given.device.type == "neuron":
                drawn = torch.Generator().manual_seed(_cpu_seed(given, device.index))
                if positional:
                    args = (*args[:i], drawn, *args[i + 1:])
                else:
                    kwargs = {**kwargs, "generator": drawn}
            break
    return args, kwargs


def _cpu_seed(generator, device: int) -> int:
    """A seed for a CPU generator: the first number of the next block of the device generator's stream."""
    from runtime.semantics import philox_words

    seed, offset = sys.modules[shim.NAME].philox_state(generator, device, 4)
    return int(philox_words(seed, offset, 1)[0] >> np.uint64(1))


# ---- what runs where ---------------------------------------------------------------------------------

def _not_compilable(op) -> str:
    tags = op.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return "the device has no kernel for this random op (see neuronc.pytorch.random_ops)"
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on the data"
    for ret in op._schema.returns:
        if not isinstance(ret.type, (torch.TensorType, torch.ListType)) or (
                isinstance(ret.type, torch.ListType) and not isinstance(ret.type.getElementType(), torch.TensorType)):
            return "it returns a value that is not a tensor"
    return ""


_functional_cache: dict = {}


def _functional(op) -> tuple:
    """(the op without mutation, None or what it writes: {"self": True, "out": ()} or {"self": False, "out":
    names}) — or (None, None) if there is none."""
    if op in _functional_cache:
        return _functional_cache[op]
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    found = (op, None)
    if written:
        found = (None, None)
        packet_name = schema.name.split("::")[1]
        outs = [a.name for a in written if a.kwarg_only]
        if outs and len(outs) == len(written):
            packet = getattr(torch.ops.aten, packet_name, None)
            wanted = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
            for overload in packet.overloads() if packet else ():
                candidate = getattr(packet, overload)
                if not candidate._schema.is_mutable and \
                        [(a.name, str(a.type)) for a in candidate._schema.arguments] == wanted:
                    found = (candidate, {"out": outs, "self": False})
                    break
        elif packet_name.endswith("_") and written == [schema.arguments[0]]:
            packet = getattr(torch.ops.aten, packet_name[:-1], None)
            candidate = getattr(packet, op._overloadname, None) if packet else None
            if candidate is not None and not candidate._schema.is_mutable:
                found = (candidate, {"out": (), "self": True})
    _functional_cache[op] = found
    return found


def _device_of(op, operands: list, inputs: list | None = None) -> int:
    """The index of the device of ``operands``' `neuron` tensors (the current device if none). Appends to
    ``inputs``, when given, what the program reads for each operand: a numpy view of a device tensor's memory,
    a 0-d CPU operand's value now (it may change before the launch runs), a number as it is."""
    index = -1
    for x in operands:
        if isinstance(x, torch.Tensor):
            where = x.get_device()
            if where >= 0:
                if index >= 0 and where != index:
                    raise NeuronDeviceError(f"{op} got tensors on neuron:{index} and {x.device}",
                                            hint="move them to one device with .to(...)")
                index = where
                if inputs is not None:
                    inputs.append(_view(x))
            elif x.dim() > 0:
                raise NeuronDeviceError(
                    f"{op} got a {x.device} tensor of shape {tuple(x.shape)} with neuron tensors",
                    hint='move it with .to("neuron") (only 0-d CPU tensors mix with device tensors)')
            elif inputs is not None:
                inputs.append(_host_scalar(x))
        elif inputs is not None:
            inputs.append(x)
    return index if index >= 0 else torch.accelerator.current_device_index()


def _device_of_call(args, kwargs) -> torch.device:
    """The device of the first `neuron` tensor among the arguments, or the `neuron` device a factory names, or
    the current one."""
    for x in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            return x.device
        if isinstance(x, torch.device) and x.type == "neuron" and x.index is not None:
            return x
    return torch.device("neuron", torch.accelerator.current_device_index())


_NUMBERS = (float, int)  # bool is an int, but a flag: it stays in the signature (type(x) is checked)


def _signature(values, runtime: frozenset, operands: list) -> tuple:
    """A hashable description of the arguments (a tuple, or a dict of keyword arguments): tensors by
    (shape, dtype), runtime scalars (numbers in the ``runtime`` positions or names) by type, the rest by
    (type, value). Appends the program's inputs, tensors and runtime numbers in order, to ``operands``."""
    parts = []
    items = values.items() if isinstance(values, dict) else enumerate(values)
    for where, value in items:
        if isinstance(value, torch.Tensor):
            operands.append(value)
            parts.append((value.shape, value.dtype))
        elif type(value) in _NUMBERS and where in runtime:
            operands.append(value)
            parts.append(type(value))
        elif isinstance(value, (list, tuple)):
            parts.append(_nested(value, operands))
        else:
            parts.append((type(value), value))
    return tuple(parts)


OPERAND = object()  # stands for a tensor operand in the arguments adaptive eager keeps of a queued op


def call_with_operands(op, args, kwargs, runtime: frozenset, operands: list, dtypes: list) -> list:
    """``op``'s flat results with its operands (the tensors and runtime numbers, in ``_signature``'s order)
    replaced by ``operands``, computed as ``_compile`` traces it (SCALAR_FORMS for runtime Scalars) and cast
    to ``dtypes`` (the op's own result types): used to replay queued ops into one graph."""
    replacements = iter(operands)
    scalar_slot = [False]

    def substitute(values):
        items = values.items() if isinstance(values, dict) else enumerate(values)
        done = {}
        for where, value in items:
            if value is OPERAND or isinstance(value, torch.Tensor):
                done[where] = next(replacements)
            elif type(value) in _NUMBERS and where in runtime:
                done[where] = next(replacements)
                scalar_slot[0] |= isinstance(_argument_type(op, where), torch.NumberType)
            elif isinstance(value, (list, tuple)):
                done[where] = type(value)(nested(v) for v in value)
            else:
                done[where] = value
        return done if isinstance(values, dict) else tuple(done[i] for i in range(len(values)))

    def nested(value):
        if value is OPERAND or isinstance(value, torch.Tensor):
            return next(replacements)
        if isinstance(value, (list, tuple)):
            return type(value)(nested(v) for v in value)
        return value

    a, k = substitute(args), substitute(kwargs)
    form = SCALAR_FORMS.get(_schema_name(op)) if scalar_slot[0] else None
    result = form(**dict(zip([x.name for x in op._schema.arguments], a)), **k) if form else op(*a, **k)
    flat = [t for t in torch.utils._pytree.tree_leaves(result) if t is not None]
    return [t.to(d) if t.dtype != d else t for t, d in zip(flat, dtypes)]


def _nested(value, operands: list):
    if isinstance(value, torch.Tensor):
        operands.append(value)
        return (value.shape, value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_nested(v, operands) for v in value)
    return (type(value), value)


# ---- Python numbers as runtime inputs ----------------------------------------------------------------

def _add(self, other, alpha=1):
    return self + other * alpha


def _sub(self, other, alpha=1):
    return self - other * alpha


def _clamp(self, min=None, max=None):  # noqa: A002 (the schema's names)
    return torch.clamp(self, min=min, max=max)


SCALAR_FORMS = {
    # op whose Scalar arguments may be runtime inputs -> the same computation with them as 0-d tensors
    "aten::add.Tensor": _add, "aten::add.Scalar": _add, "aten::sub.Tensor": _sub, "aten::sub.Scalar": _sub,
    "aten::rsub.Tensor": lambda self, other, alpha=1: other - self * alpha,
    "aten::rsub.Scalar": lambda self, other, alpha=1: other - self * alpha,
    "aten::mul.Scalar": lambda self, other: self * other,
    "aten::div.Scalar": lambda self, other: self / other,
    "aten::addcmul": lambda self, tensor1, tensor2, value=1: self + value * tensor1 * tensor2,
    "aten::addcdiv": lambda self, tensor1, tensor2, value=1: self + value * tensor1 / tensor2,
    "aten::lerp.Scalar": lambda self, end, weight: torch.lerp(self, end, weight.to(self.dtype)),
    "aten::clamp": _clamp,
}


def _schema_name(op) -> str:
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _runtime_scalars(op) -> frozenset:
    """The positions and names of ``op``'s arguments where a Python number is a runtime input: the
    Tensor arguments (PyTorch passes ``x * 0.9``'s 0.9 there), and the Scalars of ops in SCALAR_FORMS."""
    form = _schema_name(op) in SCALAR_FORMS
    where = set()
    for i, argument in enumerate(op._schema.arguments):
        kind = argument.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.TensorType) or (form and isinstance(kind, torch.NumberType)):
            where.update((i, argument.name) if not argument.kwarg_only else (argument.name,))
    return frozenset(where)


def _scalar_tensor(value) -> torch.Tensor:
    """The 0-d example a runtime number is traced as: fp32 for a float (the device has no fp64), int64."""
    return torch.tensor(value, dtype=torch.float32 if isinstance(value, float) else torch.int64)


def _with_scalar_tensors(values, runtime: frozenset):
    """``values`` (args tuple or kwargs dict) with the runtime numbers replaced by 0-d tensors."""
    if isinstance(values, dict):
        return {k: _scalar_tensor(v) if type(v) in _NUMBERS and k in runtime else v for k, v in values.items()}
    return tuple(_scalar_tensor(v) if type(v) in _NUMBERS and i in runtime else v for i, v in enumerate(values))


# ---- compile, launch, write back -------------------------------------------------------------------

def _compile(op, args, kwargs, device: int, runtime: frozenset = frozenset()):
    """An EagerProgram for this signature, or the reason (a string) the op runs on the CPU instead: lowered
    straight to the IR (:mod:`neuronc.frontend.aten_lowering`, a millisecond) when it can be, else traced and
    compiled through torch-mlir, whose NEFF is kept in the compile cache under the op's signature."""
    from neuronc.collector import collector_paused

    mode = _buckets_mode()
    first = _first_met(op, args, kwargs, runtime) if not adaptive.ENABLED else None
    if first is not None and _loops_on():
        entry = _row_looped(op, args, kwargs, device, runtime, first)
        if entry is not None:
            return entry
    if first is not None and mode != "0":
        from neuronc.frontend.aten_buckets import plan

        reordering = mode == "1" and not torch.are_deterministic_algorithms_enabled()
        pads = plan(op, args, kwargs, first if reordering else None)
        if pads:
            entry = _bucketed(op, args, kwargs, device, runtime, pads)
            if entry is not None:
                return entry
    options = _options(str(op), os.environ.get("NEURON_CC_FLAGS", ""))
    with collector_paused():
        return _compile_with(op, args, kwargs, device, runtime, options)


# ---- shape buckets: a new size served by the program of its bucket (neuronc/frontend/aten_buckets.py) ------

BUCKETS_ENV = "NEURON_EAGER_BUCKETS"  # "0": off; "exact": bit-exact padding only; "1": also reordering padding
BUCKETS_DEFAULT = "1"
BUCKETS_MODES = ("0", "exact", "1")


def _buckets_mode() -> str:
    mode = os.environ.get(BUCKETS_ENV, BUCKETS_DEFAULT)
    if mode not in BUCKETS_MODES:
        raise NeuronConfigError(f"{BUCKETS_ENV}={mode!r} is not a bucket mode",
                                hint=f"set it to one of {', '.join(BUCKETS_MODES)} (README, Configuration)")
    return mode


sizes_met: dict = {}  # (op, its signature with each tensor's shape replaced by its rank) -> shapes when first met


def _sizes_free(part):
    if isinstance(part, torch.Size):
        return len(part)
    return tuple(_sizes_free(p) for p in part) if isinstance(part, tuple) else part


def _first_met(op, args, kwargs, runtime: frozenset):
    """The shapes of ``args`` (None for a non-tensor) when ``op`` was first compiled for these ranks, dtypes and
    other arguments, or None when this call is the first. Only an op met before at other sizes is bucketed: an
    op whose shapes never change (a model's fixed widths) runs its own program and pays no padding; one whose
    sizes vary (a growing key length, a new batch) pads from its second size on, and reordering padding only
    along the dims that changed."""
    family = (op, _sizes_free(_signature(args, runtime, [])), _sizes_free(_signature(kwargs, runtime, [])))
    first = sizes_met.get(family)
    if first is None:
        sizes_met[family] = tuple(x.shape if isinstance(x, torch.Tensor) else None for x in args)
    return first


@dataclasses.dataclass
class BucketedProgram(EagerProgram):
    """An op at a size run by the program of its bucket: the operands padded (``pads``, per operand in
    ``_signature``'s order: an ``aten_buckets.Pad`` or None), the bucket's program run on them, the leading
    slice of its results written to the op's outputs. Its duration is the bucket program's (the padded
    work) plus a DMA for each padded operand's whole buffer and for each result's slice."""

    inner: EagerProgram = None
    pads: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        self.made = [(tuple(t.shape), t.dtype.numpy) for t in self.inner.program.neff.outputs()]
        self.slices = [tuple(slice(0, n) for n in shape) for shape, _ in self.outputs]
        self.run = self._run_padded

    def _run_padded(self, inputs: list, outputs: list) -> None:
        padded = [x if pad is None else _padded(x, pad) for x, pad in zip(inputs, self.pads)]
        full = [np.empty(shape, dtype) for shape, dtype in self.made]
        self.inner.program.run_into(padded, full)
        for out, result, where in zip(outputs, full, self.slices):
            out[...] = result[where]


def _padded(x: np.ndarray, pad) -> np.ndarray:
    """``x`` in a buffer of ``pad.shape``: at its leading corner, each padded dim's rest filled in turn with the
    copy of its last index ("edge") or the given value (a reduction's identity)."""
    from neuronc.frontend.aten_buckets import EDGE

    buffer = np.empty(pad.shape, x.dtype)
    done = [slice(0, n) for n in x.shape]
    buffer[tuple(done)] = x
    for d, fill in pad.fills:
        n = x.shape[d]
        region = list(done)
        region[d] = slice(n, None)
        if fill == EDGE:
            source = list(done)
            source[d] = slice(n - 1, n)
            buffer[tuple(region)] = buffer[tuple(source)]
        else:
            buffer[tuple(region)] = fill
        done[d] = slice(None)
    return buffer


def _meta(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _bucketed(op, args, kwargs, device: int, runtime: frozenset, pads: dict):
    """A BucketedProgram for this call, its bucket's program compiled (or found) under the padded signature;
    None when the bucket's program cannot serve it (then the op compiles for its own shape)."""
    padded = tuple(torch.empty(pads[i].shape, dtype=x.dtype, device="meta") if i in pads else x
                   for i, x in enumerate(args))
    key = ((op, _signature(padded, runtime, []), _signature(kwargs, runtime, []) if kwargs else ()), device)
    inner = programs.get(key)
    if inner is None:
        inner = programs[key] = _compile(op, padded, kwargs, device, runtime)
    if not isinstance(inner, EagerProgram) or isinstance(inner, BucketedProgram) or inner.permuted or \
            inner.mutated or inner.empty:
        return None
    from neuronc.frontend.aten_lowering import pointwise_meta, reduction_meta

    metas = [_meta(x) for x in args], {k: _meta(v) for k, v in kwargs.items()}
    try:  # a pointwise op's result from its broadcast shape, all/any's from the reduced dims (their meta kernels
        # are Python: 0.1-0.5 ms)
        known = pointwise_meta(op, *metas) if torch.Tag.pointwise in op.tags else reduction_meta(op, *metas)
        real = torch.utils._pytree.tree_leaves(known if known is not None else op(*metas[0], **metas[1]))
    except Exception:  # noqa: BLE001 (no meta kernel: the op compiles for its own shape)
        return None
    real = [t for t in real if t is not None]
    if len(real) != len(inner.outputs) or any(
            t.dtype != dtype or t.dim() != len(shape) or any(n > m for n, m in zip(t.shape, shape))
            for t, (shape, dtype) in zip(real, inner.outputs)):
        return None
    per_operand = []  # as _signature lists the operands: tensors, runtime numbers, tensors in lists
    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            per_operand.append(pads.get(position))
        else:
            found = []
            _signature((value,), frozenset({0}) if position in runtime else frozenset(), found)
            per_operand.extend([None] * len(found))
    found = []
    _signature(kwargs, runtime, found)
    per_operand.extend([None] * len(found))
    target = core(device).target
    moved = sum(copy_ns(int(np.prod(pads[i].shape)) * args[i].element_size(), target) for i in pads) + sum(
        copy_ns(t.numel() * t.element_size(), target) for t in real)
    compile_stats["bucketed"] += 1
    return BucketedProgram(inner.program, list(range(len(real))), [(tuple(t.shape), t.dtype) for t in real],
                           inner.out_spec, inner.duration_ns + moved, nones=inner.nones, inner=inner,
                           pads=tuple(per_operand))


# ---- one program for every row count: hardware loops over tiles (neuronc/codegen/row_loops.py) -------------

LOOPS_ENV = "NEURON_EAGER_LOOPS"  # "1": an elementwise or row-wise op at a new row count runs its looped program;
# "0" (default: on the zoo's ops at batch + 1 .. + 4 making the looped programs costs more CPU than the compiles and
# buckets they replace, docs/performance.md issue 20 part 21)
LOOPS_DEFAULT = "0"
ROW_BLOCKS = (128, 64, 32, 16, 8, 4, 2, 1)  # the tiles' rows: full 128-row tiles, then one of each power of two
LOOP_CAPACITY_BYTES = 1 << 24  # the most bytes of each row-sliced operand a looped program holds (a stated choice:
# its HBM is reserved for the capacity; larger row counts compile for their own shape as before)
MAX_TILES = 31  # full tiles at most (4,095 rows): with the 128 remainders, 4,096 register values for the load to check
families: dict = {}  # (op, signature with the rows left out, device) -> (LoopedProgram, out_spec, dtype), or why not
rows_met: dict = {}  # the same keys, before their looped program is made -> the row counts met at that row width
LOOP_AFTER_ROW_COUNTS = 3  # a looped program is made at the third distinct row count met at a row width (a stated
# choice: making one costs 8 tile compiles and a load proving 4,096 register values, 48-74 ms of CPU, about 15 of an
# op's own compiles; two row counts, a batch and a last partial batch or a prefill and its decode, never pay for it)


def _loops_on() -> bool:
    value = os.environ.get(LOOPS_ENV, LOOPS_DEFAULT)
    if value not in ("0", "1"):
        raise NeuronConfigError(f"{LOOPS_ENV}={value!r} is not 0 or 1", hint="README, Configuration")
    return value == "1"


def _with_rows(values, shape: tuple, rows: int):
    """``values`` (args or kwargs) with each tensor of ``shape`` replaced by a meta tensor of ``rows`` rows."""
    def swap(x):
        if isinstance(x, torch.Tensor) and tuple(x.shape) == shape:
            return torch.empty((rows, *shape[1:]), dtype=x.dtype, device="meta")
        return x
    if isinstance(values, dict):
        return {k: swap(v) for k, v in values.items()}
    return tuple(swap(v) for v in values)


_ROW_WISE = frozenset({"aten::floor_divide"})  # elementwise, not tagged pointwise (as aten_buckets lists it)
# row-wise ops reducing along another dim than the first: schema name -> position of that dim among the arguments
_ALONG_ROWS = {"aten::_softmax": 1, "aten::_log_softmax": 1, "aten::_softmax_backward_data": 2,
               "aten::_log_softmax_backward_data": 2}


def _row_shape(op, args, kwargs):
    """The shape every tensor operand of ``op`` has (the others 0-d) when it is an elementwise op whose result has
    that shape too, so each result row depends on the same rows of the operands alone; else None."""
    name = _schema_name(op)
    if (torch.Tag.pointwise not in op.tags and name not in _ROW_WISE and name not in _ALONG_ROWS) or \
            torch.Tag.nondeterministic_seeded in op.tags or len(op._schema.returns) != 1 or name in ("aten::clone",):
        return None
    tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    shapes = {tuple(x.shape) for x in tensors if x.dim()}
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    if not shape[0]:
        return None
    if name in _ALONG_ROWS:  # a row's result from that row alone: the reduced dim is not the first
        dim = args[_ALONG_ROWS[name]] if len(args) > _ALONG_ROWS[name] else None
        if not isinstance(dim, int) or len(shape) < 2 or dim % len(shape) == 0:
            return None
    from neuronc.frontend.aten_lowering import pointwise_meta

    metas = [_meta(x) for x in args], {k: _meta(v) for k, v in kwargs.items()}
    try:
        result = pointwise_meta(op, *metas)
        result = result if result is not None else op(*metas[0], **metas[1])
    except Exception:  # noqa: BLE001 (no meta kernel: the op compiles for its own shape)
        return None
    return shape if isinstance(result, torch.Tensor) and tuple(result.shape) == shape else None


def _row_looped(op, args, kwargs, device: int, runtime: frozenset, first: tuple = ()):
    """An EagerProgram running this call on ``op``'s looped program (made at the LOOP_AFTER_ROW_COUNTS-th distinct
    row count met at this row width: the op lowered and compiled for tiles of ROW_BLOCKS rows, then loaded once), at
    its row count's register values: no compile, no load. None when the op is not row-wise, has no lowering, the
    rows exceed the capacity, or fewer row counts were met at this row width (``first``: its shapes when first met);
    an op whose other dims change at one row count (generate()'s key length) makes none."""
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in torch.utils._pytree.tree_leaves((args, kwargs))):
        return None  # a bucket's padded signature (_bucketed): its program is the bucket's own
    shape = _row_shape(op, args, kwargs)
    if shape is None:
        return None
    from runtime.loops import registers_for_rows

    key = (op, _signature(_with_rows(args, shape, 1), runtime, []),
           _signature(_with_rows(kwargs, shape, 1), runtime, []) if kwargs else (), device)
    family = families.get(key)
    if family is None:
        seen = rows_met.setdefault(key, set())
        seen.update(s[0] for s in first or () if s is not None and tuple(s[1:]) == shape[1:] and len(s) == len(shape))
        seen.add(shape[0])
        if len(seen) < LOOP_AFTER_ROW_COUNTS:  # its own program (or its bucket's) until then
            return None
        from neuronc.collector import collector_paused

        with collector_paused():
            family = families[key] = _row_family(op, args, kwargs, device, runtime, shape)
    if isinstance(family, str):
        return None
    program, out_spec, dtype = family
    values = registers_for_rows(shape[0], ROW_BLOCKS)
    if values[0] > program.neff.registers[0].hi:
        return None
    launch = program.at(values)
    compile_stats["looped"] += 1
    return EagerProgram(launch, [0], [(shape, dtype)], out_spec, launch.time().estimated_ns)


def _row_family(op, args, kwargs, device: int, runtime: frozenset, shape: tuple):
    """(the looped program of ``op`` on device ``device``, the result's pytree spec, its dtype), or why not."""
    from neuronc.codegen.row_loops import row_program

    row = max(x.element_size() * math.prod(shape[1:]) for x in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(x, torch.Tensor) and x.dim())
    max_tiles = min(MAX_TILES, LOOP_CAPACITY_BYTES // (ROW_BLOCKS[0] * max(row, 1)))
    if max_tiles < 1:
        return "rows too wide for a looped program"
    options = _options(str(op), os.environ.get("NEURON_CC_FLAGS", ""))
    tiles, first = {}, None
    try:
        for block in ROW_BLOCKS:
            lowered = _lower(op, _with_rows(args, shape, block), _with_rows(kwargs, shape, block), runtime)
            if lowered is None or lowered.nones or lowered.mutated or lowered.empty or len(lowered.outputs) != 1:
                return "no single-output lowering"
            first = first or lowered
            tiles[block] = _compile_lowered(lowered, options).neff
        neff = row_program(tiles, ROW_BLOCKS, max_tiles, f"eager_{str(op).replace('.', '_')}_rows")
        compile_stats["loop tiles"] += len(tiles)
        program = core(device).load(neff)
        compile_stats["looped programs"] += 1
    except (NeuronError, ValueError) as e:
        log.info("neuronc: eager %s gets no looped program: %s", op, e)
        return f"no looped program: {e}"
    return program, first.out_spec, first.outputs[0][1]


@functools.lru_cache(maxsize=1024)
def _options(op: str, flags: str):
    """The CompileOptions of ``op``'s programs under NEURON_CC_FLAGS=``flags``: made (flags parsed, target,
    level and auto-cast checked) once per op and flags, not on every new shape."""
    from neuronc.compiler import CompileOptions

    return CompileOptions.from_dict({"name": f"eager_{op.replace('.', '_')}"})


def _compile_with(op, args, kwargs, device: int, runtime: frozenset, options):
    from neuronc.frontend.aten_lowering import refused
    from neuronc.pytorch.device_memory import HOST_ONLY_DTYPES

    if refused(op):
        return refused(op)
    for x in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.dtype in HOST_ONLY_DTYPES:
            return f"the NeuronCore has no {x.dtype} arithmetic"
    cache, key = _disk_cache(op, args, kwargs, runtime, options)
    if cache is not None:
        entry = _from_disk(cache, key, device)
        if entry is not None:
            compile_stats["disk cache"] += 1
            return entry
    lowered = _lower(op, args, kwargs, runtime)
    try:
        if lowered is not None:
            compiled = _compile_lowered(lowered, options)
            outputs, out_spec, how = lowered.outputs, lowered.out_spec, "lowered"
        else:
            found = _traced(op, args, kwargs, runtime, options)
            if isinstance(found, str):
                return found
            compiled, outputs, out_spec = found
            how = "traced"
        program = core(device).load(compiled.neff)
    except NeuronError as e:
        return f"neuronc cannot compile it: {e.message}"
    compile_stats[how] += 1
    if log.isEnabledFor(logging.INFO):
        log.info("neuronc: eager %s compiled (%s) for %s", op, how,
                 ", ".join(str(tuple(t.shape)) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor)))
    entry = EagerProgram(program, compiled.output_layout or list(range(len(outputs))), outputs, out_spec,
                         program.time().estimated_ns, nones=lowered.nones if lowered is not None else (),
                         mutated=tuple(lowered.mutated) if lowered is not None else (),
                         empty=lowered.empty if lowered is not None else ())
    if cache is not None:
        _to_disk(cache, key, compiled.neff, entry)
    return entry


# ---- the compile cache on disk: a signature compiled in an earlier process is loaded, not compiled --------

def _disk_cache(op, args, kwargs, runtime: frozenset, options) -> tuple:
    """(the compile cache, this signature's key in it), or (None, None) when the cache is off. The key holds
    the op, the signature (shapes, dtypes, the other arguments' values, which numbers are runtime inputs), the
    compile options, and (:func:`neuronc.cache.cache_key`) the versions and source of neuronc and torch."""
    from neuronc.cache import CompileCache, cache_key

    cache = CompileCache.from_env()
    if cache is None:
        return None, None
    signature = repr((_schema_name(op), _signature(args, runtime, []), _signature(kwargs, runtime, []),
                      sorted(map(str, runtime))))
    return cache, cache_key("eager op " + signature, {**dataclasses.asdict(options), "form": "eager"})


def _to_disk(cache, key: str, neff, entry: EagerProgram) -> None:
    """Store ``entry``'s NEFF with what rebuilds the op's results from its outputs, and the access check the
    load just ran on it (a later process loads it without that check). Not a NEFF whose outputs the op's
    results use in another order (a traced graph's): rare, and compiled again."""
    if entry.permuted:
        return
    try:
        out_spec = torch.utils._pytree.treespec_dumps(entry.out_spec)
    except Exception:  # a result structure pytree cannot write (none of ATen's): compiled again next time
        return
    extra = {"outputs": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in entry.outputs],
             "out_spec": out_spec, "nones": list(entry.nones), "mutated": list(entry.mutated),
             "empty": list(entry.empty)}
    _writer().submit(_store, cache, key, neff, extra, entry.program.checked_now)


@functools.cache
def _writer():
    """One thread storing compiled ops in the cache (encode, checksum, atomic writes with their fsyncs) while
    the op runs: off the op's path. Python waits for what it holds at exit."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuronc-eager-cache")


def _store(cache, key: str, neff, extra: dict, checked_by) -> None:
    try:
        cache.put(key, neff, extra, checked_by=checked_by)
    except Exception as e:  # noqa: BLE001 (a store that fails loses nothing but the next process's time)
        log.warning("neuronc: cannot store eager program %s in the compile cache (%s: %s)", neff.name,
                    type(e).__name__, e)


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _from_disk(cache, key: str, device: int):
    """The EagerProgram of ``key``'s entry, loaded on ``device``; None when there is none or it does not hold
    what it should (a damaged NEFF is refused by ``cache.read``; a sidecar that does not describe the NEFF's
    outputs is removed here): the op is then compiled again. The sidecar is data: dtypes are looked up by
    name among torch's, the result structure is pytree's JSON."""
    neff, meta = cache.read(key, touch=False)
    if neff is None:
        return None
    try:
        extra = meta["extra"]
        outputs = [(tuple(int(n) for n in shape), _DTYPES[dtype]) for shape, dtype in extra["outputs"]]
        empty, mutated = tuple(int(i) for i in extra["empty"]), tuple(int(i) for i in extra["mutated"])
        nones, out_spec = tuple(int(i) for i in extra["nones"]), torch.utils._pytree.treespec_loads(extra["out_spec"])
        written = [(s, d) for i, (s, d) in enumerate(outputs) if i not in empty]
        from neuronc.frontend.tensors import torch_dtype

        made = [(tuple(t.shape), torch_dtype(t.dtype)) for t in neff.outputs()]
        if made[:len(written)] != written or len(made) != len(written) + len(mutated) or \
                out_spec.num_leaves != len(outputs) + len(nones):
            raise ValueError("the outputs it describes are not the NEFF's")
    except Exception as e:  # noqa: BLE001 (whatever is wrong with the sidecar, the entry is not used)
        log.warning("neuronc: the compile cache's entry %s does not describe its NEFF (%s); compiling again",
                    key[:12], e)
        cache.remove(key)
        return None
    try:
        program = core(device).load(neff, checked_by=meta.get("access_checked_by"))
    except NeuronError as e:
        log.warning("neuronc: the compile cache's entry %s does not load (%s); compiling again", key[:12], e.message)
        cache.remove(key)
        return None
    _writer().submit(cache.touch, key, meta)
    return EagerProgram(program, list(range(len(outputs))), outputs, out_spec,
                        program.time().estimated_ns, nones=nones, mutated=mutated, empty=empty)


compile_stats: collections.Counter = collections.Counter()  # "lowered" / "traced": programs made each way


def _lower(op, args, kwargs, runtime: frozenset):
    """The op lowered straight to the IR, or None when it has no lowering (logged)."""
    from neuronc.frontend.aten_lowering import NotLowered, lower

    try:
        return lower(op, args, kwargs, runtime, f"eager_{op}")
    except NotLowered as why:
        log.debug("neuronc: eager %s is traced through torch-mlir: %s", op, why)
    except Exception as e:  # a rule that failed: the op still runs, traced, and the log says which rule
        log.warning("neuronc: lowering eager %s failed (%s: %s); it is traced through torch-mlir instead", op,
                    type(e).__name__, e)
    return None


def _compile_lowered(lowered, options):
    """The lowered op compiled; its NEFF's estimate is settled by the load that follows (the runtime's schedule is
    the simulation the estimate runs: neff.program.PendingEstimate), paid once instead of twice per new program."""
    from neuronc.compiler import compile_graph

    compiled = compile_graph(lowered.graph, options)
    compiled.output_layout = list(range(len(lowered.outputs)))
    return compiled


def _traced(op, args, kwargs, runtime: frozenset, options):
    """(Compiled, [(shape, dtype)] of the flat results, their pytree spec) of the op traced by make_fx and
    compiled through torch-mlir; or the reason it cannot be. The compile cache keeps the NEFF under the op's
    signature, so a later process neither traces nor imports it again."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import compile_fx
    from neuronc.frontend.torch_import import decomposition_table

    def example(x):
        return torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    real = torch.utils._pytree.tree_map(example, (args, kwargs))  # with its numbers: the op's result types
    traced = (_with_scalar_tensors(args, runtime), _with_scalar_tensors(kwargs, runtime))
    leaves, spec = torch.utils._pytree.tree_flatten(traced)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    examples = [example(leaves[i]) for i in positions]
    if not positions:
        return "it has no tensor inputs"
    form = SCALAR_FORMS.get(_schema_name(op)) if any(
        type(v) in _NUMBERS and k in runtime and isinstance(_argument_type(op, k), torch.NumberType)
        for k, v in [*enumerate(args), *kwargs.items()]) else None
    names = [a.name for a in op._schema.arguments]
    out_spec, dtypes = [], []

    def one_op(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        a, k = torch.utils._pytree.tree_unflatten(filled, spec)
        result = form(**dict(zip(names, a)), **k) if form else op(*a, **k)
        flat, result_spec = torch.utils._pytree.tree_flatten(result)
        out_spec.append(result_spec)
        return tuple(t.to(d) if dtypes and t.dtype != d else t for t, d in zip(flat, dtypes or flat))

    try:
        result = scalar_overload(op, *real)(*real[0], **real[1])
        expected = torch.utils._pytree.tree_leaves(result)
        if not expected or not all(isinstance(t, torch.Tensor) for t in expected) or \
                any(t.numel() == 0 for t in expected):
            return "it has empty or non-tensor results"
        dtypes.extend(t.dtype for t in expected)
        outputs = [(tuple(t.shape), t.dtype) for t in expected]
        gm = make_fx(one_op, decomposition_table=decomposition_table())(*examples)
        compiled = compile_fx(gm, options)
    except NeuronError as e:
        return f"neuronc cannot compile it: {e.message}"
    except Exception as e:  # tracing or importing failed: the op stays on the CPU, and the warning says why
        return f"it could not be traced or imported: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return compiled, outputs, out_spec[-1]


def _argument_type(op, where):
    arguments = op._schema.arguments
    argument = arguments[where] if isinstance(where, int) else next(a for a in arguments if a.name == where)
    kind = argument.type
    return kind.getElementType() if isinstance(kind, torch.OptionalType) else kind



def _launch(op, entry: EagerProgram, device: int, operands: list, inputs: list, writes, args, kwargs):
    """Queue the program on the current stream of ``device``, reading ``inputs`` (the operands' memory, see
    ``_device_of``); returns its results (new device tensors, or the tensors it writes)."""
    if writes is None and entry.plain and not adaptive.ENABLED:  # most ops: one new tensor, nothing else to do
        result, view = _empty_with_view(*entry.outputs[0], device)
        queues.enqueue(device, entry.duration_ns, entry.run, (inputs, [view]), op)
        entry.launches += 1
        return result
    if writes is None:  # new tensors, made with their numpy views in one call
        made = [_empty_with_view(shape, dtype, device) for shape, dtype in entry.outputs]
        flat, outputs = [t for t, _ in made], [v for _, v in made]
        if entry.single:
            result = flat[0]
        else:
            leaves = list(flat)
            for position in entry.nones:
                leaves.insert(position, None)
            result = torch.utils._pytree.tree_unflatten(leaves, entry.out_spec)
    elif writes["self"]:
        flat = [args[0]]
        result = args[0]
    else:
        flat = [kwargs[name] for name in writes["out"]]
        for target, (shape, _) in zip(flat, entry.outputs):
            if tuple(target.shape) != shape:
                queues.resize(target, shape)
        result = flat[0] if len(flat) == 1 else tuple(flat)
    if writes is not None:
        outputs = [_view(t) for t in flat]
    flat_outputs = outputs
    if entry.permuted:
        outputs = entry.arrange(outputs)
    if entry.empty:
        outputs = [v for i, v in enumerate(outputs) if i not in entry.empty]
    if entry.mutated:  # written in place after the program read them
        outputs = outputs + [_view(operands[i]) for i in entry.mutated]
    if adaptive.ENABLED and not entry.mutated and not entry.empty and (writes is None or all(t.is_contiguous() for t in flat)):
        functional, _, runtime, _ = _plans[op]
        call_kwargs = {k: v for k, v in kwargs.items() if k not in writes["out"]} if writes else kwargs
        launch = adaptive.Launch(entry, functional, runtime, args, call_kwargs, operands, inputs, outputs,
                                 flat_outputs, flat)
        queues.enqueue(device, entry.duration_ns, launch, (), op)
    else:
        queues.enqueue(device, entry.duration_ns, entry.run, (inputs, outputs), op)
    entry.launches += 1
    return result


def launch_graph(program, duration_ns: float, args, device: int, what: str, outputs: list,
                 bound: dict | None = None) -> list:
    """Queue a loaded program (a torch.compile graph) on ``device``'s current stream, on the device memory of
    ``args``; returns its outputs, new device tensors of ``outputs`` ((shape, torch dtype) each, in the NEFF's
    output order). ``bound``: the inputs it reads in place (position -> array of their device memory: a model's
    parameters), bound when it runs."""
    bound = bound or {}
    inputs = [None if n in bound else (_view(_by_value(x)) if not x.is_cpu else _host_scalar(x))
              if isinstance(x, torch.Tensor) else x for n, x in enumerate(args)]
    made = [_empty_with_view(shape, dtype, device) for shape, dtype in outputs]
    queues.enqueue(device, duration_ns, program.run_into, (inputs, [view for _, view in made], bound), what)
    return [tensor for tensor, _ in made]


def _by_value(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy with its values as bytes when it is a lazy conj() or negative view (a program reads bytes)."""
    return x.resolve_conj().resolve_neg() if x.is_conj() or x.is_neg() else x


def _host_scalar(x: torch.Tensor) -> np.ndarray:
    """A 0-d CPU operand's value now, as a 0-d array of its dtype (``x * 0.5``'s wrapped 0.5): one ``item`` and one
    small array, cheaper than a numpy view of the tensor and its copy (bf16 and fp8 values are exact in
    ml_dtypes' types). A CPU operand of more elements (a tensor the op takes on the host) is copied whole."""
    if x.dim():
        return host_array(x).copy()
    return np.array(x.item(), NUMPY_DTYPES[x.dtype])


def _view(tensor):
    global _view
    _view = sys.modules[shim.NAME].view
    return _view(tensor)


def _empty_with_view(shape, dtype, device: int):
    global _empty_with_view
    _empty_with_view = sys.modules[shim.NAME].empty_with_view
    return _empty_with_view(shape, dtype, device)


# ---- kernels on device memory itself -------------------------------------------------------------------

_E4M3 = NUMPY_DTYPES[torch.float8_e4m3fn]


def _assign(dst: np.ndarray, src) -> None:
    if dst.dtype == _E4M3 and src.dtype != _E4M3:  # PyTorch's conversion saturates (isa.E4M3_MAX), numpy's does not
        src = np.clip(src.astype(np.float32), -E4M3_MAX, E4M3_MAX)
    dst[...] = src


def _assign_flipped(dst: np.ndarray, src, conjugate: bool, negate: bool) -> None:
    """``dst = src`` with the imaginary parts' signs flipped (``conjugate``) or every sign (``negate``): the
    bytes of a copy between tensors whose conjugate or negative bits differ (PyTorch's lazy conj() and its
    negative views mark the tensor, not its bytes)."""
    dst[...] = src
    if conjugate:
        np.conjugate(dst, out=dst)
    if negate:
        np.negative(dst, out=dst)


def _assignment(dst: torch.Tensor, dst_view: np.ndarray, src: torch.Tensor, data) -> tuple:
    """(function, arguments) of the queued copy of ``data`` (``src``'s bytes) into ``dst_view`` (``dst``'s): a plain
    assignment, or one flipping the signs their conjugate or negative bits differ by."""
    conjugate, negate = src.is_conj() != dst.is_conj(), src.is_neg() != dst.is_neg()
    if conjugate or negate:
        return _assign_flipped, (dst_view, data, conjugate, negate)
    return _assign, (dst_view, data)


def _copy_ns(device: int, tensor: torch.Tensor) -> float:
    """The emulated duration of moving ``tensor``'s bytes to or from ``device``'s HBM (the cost model's DMA)."""
    return copy_ns(tensor.numel() * tensor.element_size(), core(device).target)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if dst.device.type == "neuron":
        device = dst.device.index
        if src.device.type == "neuron" and src.device.index != device:
            queues.synchronize(src.device.index)  # from one core to another: both run what they queued
            queues.synchronize(device)
            copy, arguments = _assignment(dst, array_of(dst), src, array_of(src))
            copy(*arguments)
        elif src.device.type == "neuron":
            queues.enqueue(device, _copy_ns(device, dst), *_assignment(dst, _view(dst), src, _view(src)),
                           "copy_ (device to device)")
        else:  # the host's bytes are taken now (the tensor may change before the copy runs) unless they are pinned
            host_transfers["to device"] += 1  # and the copy non-blocking: then, as on CUDA, read when it runs
            src = src.resolve_conj().resolve_neg()  # its values as bytes (no copy unless it has either bit)
            pinned = non_blocking and src.dtype == dst.dtype and sys.modules[shim.NAME].is_pinned(src)
            data = host_array(src) if pinned else np.array(host_array(src.to(dst.dtype)), copy=True)
            queues.enqueue(device, _copy_ns(device, dst), *_assignment(dst, _view(dst), src, data),  # dst's own bits
                           "copy_ (host to device)")
    else:
        host_transfers["to host"] += 1
        device = src.device.index
        staged = np.empty(tuple(src.shape), NUMPY_DTYPES[src.dtype])
        queues.synchronize(device)  # the host waits for every stream: the copy reads what they wrote
        queues.enqueue(device, _copy_ns(device, src), _assign, (staged, _view(src)), "copy_ (device to host)")
        queues.synchronize(device)
        host = host_tensor(staged, src.dtype)  # src's bytes: marked with its bits, the CPU's copy_ applies them
        dst.copy_(host.conj() if src.is_conj() else host._neg_view() if src.is_neg() else host)
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        if dst.device.type == "neuron":
            queues.resize(dst, src.shape)
        else:
            dst.resize_(src.shape)
    return _copy_from(src, dst)


def _local_scalar_dense(tensor: torch.Tensor):
    queues.synchronize(tensor.device.index)
    value = array_of(tensor).reshape(()).item()
    return float(value) if tensor.dtype.is_floating_point else value


def _fill(tensor: torch.Tensor, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.item()
    target = _view(tensor)
    queues.enqueue(tensor.device.index, _copy_ns(tensor.device.index, tensor), _assign,
                   (target, np.asarray(value).astype(target.dtype)), "fill_")
    return tensor


def _zero(tensor: torch.Tensor) -> torch.Tensor:
    return _fill(tensor, 0)


def _made_on_the_host(factory, name: str):
    """A factory op whose values depend only on its numbers (arange, eye, linspace, logspace): a constant, made
    on the host and copied into the device memory (as a NEFF's constants are)."""
    def kernel(*args, out: torch.Tensor) -> torch.Tensor:
        values = factory(*args, dtype=out.dtype)
        if out.shape != values.shape:
            queues.resize(out, values.shape)
        queues.enqueue(out.device.index, _copy_ns(out.device.index, out), _assign, (_view(out), host_array(values)),
                       name)
        return out
    return kernel


def _factory_on_the_host(name: str):
    """A factory op whose new tensor's values depend only on its numbers and which PyTorch cannot run for a
    backend without its kernel (kaiser_window calls a CPU/CUDA-only stub; tril_indices has no tensor to
    dispatch on): made on the host and copied to the device it names."""
    base, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, base), overload or "default")

    def kernel(*args, **kwargs):
        device = _device_of_call(args, kwargs)
        return op(*args, **{**kwargs, "device": torch.device("cpu")}).to(device)
    return kernel


def _convolution(*args):
    """``convolution_overrideable``, which PyTorch calls for a convolution on an accelerator it has no kernel
    of its own for: the same arguments as ``convolution``, run as that op."""
    return run_op(torch.ops.aten.convolution.default, *args)


def _convolution_backward(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask):
    """``convolution_backward_overrideable``: ``convolution_backward``, given the bias's size."""
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return run_op(torch.ops.aten.convolution_backward.default, grad, x, weight, bias_sizes, stride, padding,
                  dilation, transposed, output_padding, groups, output_mask)


def _moved(device: int, out: torch.Tensor, function, arguments: tuple, what: str) -> torch.Tensor:
    """Queue a move of bytes into ``out`` (a new tensor) lasting the DMA time of its bytes."""
    queues.enqueue(device, _copy_ns(device, out), function, arguments, what)
    return out


def _concatenate(out: np.ndarray, parts: list, dim: int) -> None:
    np.concatenate(parts, axis=dim, out=out)


def _cat(tensors, dim: int = 0):
    """torch.cat of device tensors of one dtype as DMA into the new tensor: no program to compile, whatever the
    sizes (a KV cache grows by one row every token). Others (mixed dtypes, CPU tensors) are an op like any."""
    parts = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    devices = {t.device for t in tensors}
    if not parts or len(devices) != 1 or next(iter(devices)).type != "neuron" or \
            len({t.dtype for t in tensors}) != 1 or len({t.dim() for t in parts}) != 1:
        return run_op(torch.ops.aten.cat.default, tensors, dim)
    dim %= parts[0].dim()
    shape = list(parts[0].shape)
    if any(list(t.shape[:dim]) + list(t.shape[dim + 1:]) != shape[:dim] + shape[dim + 1:] for t in parts):
        torch.cat([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors], dim)  # PyTorch's error
    shape[dim] = sum(t.shape[dim] for t in parts)
    device = parts[0].device.index
    out, view = _empty_with_view(tuple(shape), parts[0].dtype, device)
    return _moved(device, out, _concatenate, (view, [_view(t) for t in parts], dim), "cat")


def _clone(x: torch.Tensor, *, memory_format=None) -> torch.Tensor:
    """A copy of a device tensor as DMA: no program to compile for a new shape or stride."""
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format) or x.device.type != "neuron":
        return run_op(torch.ops.aten.clone.default, x, memory_format=memory_format)
    out = torch.empty_like(x, memory_format=memory_format or torch.preserve_format)  # a dense tensor's strides
    return _moved(x.device.index, out, *_assignment(out, _view(out), x, _view(x)), "clone")  # x's values, no bit


# ---- views PyTorch has no generic kernel for (the others reach the shim's as_strided) ---------------------

def _unfold(x: torch.Tensor, dimension: int, size: int, step: int) -> torch.Tensor:
    """The windows of ``size`` elements every ``step`` along ``dimension``, as a view (Tensor.repeat uses it)."""
    dimension %= max(1, x.dim())
    shape, strides = list(x.shape), list(x.stride())
    count = (shape[dimension] - size) // step + 1 if x.dim() else 1
    if x.dim():
        shape[dimension], strides[dimension] = count, strides[dimension] * step
    return x.as_strided([*shape, size], [*strides, x.stride(dimension) if x.dim() else 1], x.storage_offset())


_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _storage_as(x: torch.Tensor, dtype) -> torch.Tensor:
    """All of ``x``'s storage, as a 1-D tensor of ``dtype`` (a view)."""
    whole = x.as_strided([x.untyped_storage().nbytes() // x.element_size()], [1], 0)
    return whole.view(dtype)


def _view_as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor's (real, imaginary) pairs, as a view."""
    if x.dtype not in _REAL:
        raise RuntimeError(f"view_as_real is only supported for complex tensors, not {x.dtype}")
    return _storage_as(x, _REAL[x.dtype]).as_strided([*x.shape, 2], [2 * s for s in x.stride()] + [1],
                                                     2 * x.storage_offset())


def _view_as_complex(x: torch.Tensor) -> torch.Tensor:
    """A float tensor of (real, imaginary) pairs in its last dim, as a complex view."""
    complex_of = {v: k for k, v in _REAL.items()}
    if x.dtype not in complex_of or x.dim() == 0 or x.shape[-1] != 2 or x.stride(-1) != 1:
        raise RuntimeError("view_as_complex needs a float tensor whose last dim has size 2 and stride 1")
    if any(s % 2 for s in x.stride()[:-1]) or x.storage_offset() % 2:
        raise RuntimeError("view_as_complex needs strides and an offset that are whole complex numbers")
    return _storage_as(x, complex_of[x.dtype]).as_strided(list(x.shape[:-1]), [s // 2 for s in x.stride()[:-1]],
                                                          x.storage_offset() // 2)


# Ops PyTorch would run on a PrivateUse1 device through their CompositeExplicitAutograd kernel, a chain of smaller
# ops that rounds between them where the CPU's own kernel computes in fp32 and rounds once: each is one program
# (its lowering rule) instead. native_layer_norm's composite normalises with native_batch_norm, rounds to the
# input's type, then applies weight and bias with addcmul: bf16 layer norms were up to 3 ulp off (the CPU's 1).
ONE_PROGRAM = ("native_layer_norm",)

DIRECT_KERNELS = {
    "cat": _cat,
    "clone": _clone,
    "unfold": _unfold,
    "view_as_real": _view_as_real,
    "view_as_complex": _view_as_complex,
    "convolution_overrideable": _convolution,
    "convolution_backward_overrideable": _convolution_backward,
    "arange.start_out": _made_on_the_host(torch.arange, "arange"),
    "eye.out": _made_on_the_host(torch.eye, "eye"),
    "eye.m_out": _made_on_the_host(torch.eye, "eye"),
    "linspace.out": _made_on_the_host(torch.linspace, "linspace"),
    "logspace.out": _made_on_the_host(torch.logspace, "logspace"),
    "kaiser_window": _factory_on_the_host("kaiser_window"),
    "kaiser_window.periodic": _factory_on_the_host("kaiser_window.periodic"),
    "kaiser_window.beta": _factory_on_the_host("kaiser_window.beta"),
    "tril_indices": _factory_on_the_host("tril_indices"),
    "triu_indices": _factory_on_the_host("triu_indices"),
    "_copy_from": _copy_from,
    "_copy_from_and_resize": _copy_from_and_resize,
    "_local_scalar_dense": _local_scalar_dense,
    "fill_.Scalar": _fill,
    "fill_.Tensor": _fill,
    "zero_": _zero,
}
