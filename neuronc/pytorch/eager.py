"""Eager execution of ATen ops on `neuron` tensors: one op, one NEFF, run on the tensor's NeuronCore.

Every op PyTorch dispatches to the device and that no composite kernel handles reaches :func:`run_op`
(a boxed fallback on the PrivateUse1 key). The op is traced with its arguments' shapes and dtypes
into a one-op FX graph (``make_fx``, torch-mlir's decompositions), compiled by the same pipeline as
``torch.compile`` (:func:`neuronc.compiler.compile_fx`) to a NEFF and loaded on the core of the
tensors' device; the loaded program is kept in memory under (op, shapes, dtypes, other arguments,
device), so the next call with the same signature is a dictionary lookup and a run. Python scalars are
part of the signature (a new value compiles anew). In-place and ``out=`` ops run their functional form
and write the result into the mutated tensor's memory.

Ops the NeuronCore cannot run (the compiler refuses them, random ops, ops with data-dependent output
shapes or non-tensor results) run on the CPU: arguments copied to the host, results copied back, with
one warning per op. ``TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1`` makes that a
:class:`~neuronc.errors.FallbackDisabledError` naming the op.

Moving bytes (``_copy_from``: host <-> device and device <-> device), ``fill_``/``zero_`` and reading
one element (``.item()``) act on the device memory directly, as DMA and memset would.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings

import numpy as np
import torch

from neuronc.errors import FallbackDisabledError, NeuronDeviceError, NeuronError
from neuronc.pytorch import shim
from neuronc.pytorch.device_memory import array_of, core, host_array, host_tensor

log = logging.getLogger("neuronc")

FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
_libraries: list = []  # the torch.library registrations, kept alive


@dataclasses.dataclass
class EagerProgram:
    """One op compiled for one signature, loaded on one core."""

    program: object  # runtime.LoadedProgram
    layout: list  # per flat output of the op: its NEFF output index
    outputs: list  # per flat output: (shape, dtype)
    out_spec: object  # pytree spec rebuilding the op's result from the flat outputs
    duration_ns: float  # estimated device time of one run
    launches: int = 0


programs: dict = {}  # ((op, signature of args, of kwargs), device) -> EagerProgram, or why it runs on the CPU


def compiled_for(op, first_shape: tuple) -> list:
    """The EagerPrograms of ``op`` whose first argument has ``first_shape`` (for tests and tools)."""
    return [entry for ((functional, args, _), _), entry in programs.items()
            if functional == op and args and args[0][0] == first_shape and isinstance(entry, EagerProgram)]
fallen_back: dict = {}  # op name -> why it ran on the CPU (warned once)


# ---- entry points ----------------------------------------------------------------------------------

def register() -> None:
    """Register the kernels on the PrivateUse1 key (called by ``torch.neuron._lazy_init``)."""
    if _libraries:
        return
    aten = torch.library.Library("aten", "IMPL")
    for name, kernel in DIRECT_KERNELS.items():
        aten.impl(name, kernel, "PrivateUse1")
    every = torch.library.Library("_", "IMPL")
    every.fallback(run_op, "PrivateUse1")
    _libraries.extend([aten, every])
    _print_from_host()


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
    plan = _plans.get(op) or _plan(op)
    if isinstance(plan, str):
        return cpu_fallback(op, args, kwargs, plan)
    functional, writes = plan
    call_kwargs = {k: v for k, v in kwargs.items() if k not in writes.get("out", ())} if kwargs else kwargs
    tensors = []
    key = (functional, _signature(args, tensors), _signature(call_kwargs, tensors) if call_kwargs else ())
    device = _device_of(op, tensors)
    entry = programs.get((key, device))
    if entry is None:
        entry = programs[(key, device)] = _compile(functional, args, call_kwargs, device)
    if isinstance(entry, str):
        return cpu_fallback(op, args, kwargs, entry)
    results = _launch(entry, device, tensors)
    return _write_back(writes, args, kwargs, results, entry)


_plans: dict = {}  # op -> (functional op, what it writes) or the reason it runs on the CPU


def _plan(op):
    reason = _not_compilable(op)
    functional, writes = _functional(op)
    if not reason and functional is None:
        reason = "it mutates its arguments in a way neuronc does not compile"
    _plans[op] = reason or (functional, writes)
    return _plans[op]


def cpu_fallback(op, args, kwargs, reason: str):
    """Run ``op`` on the CPU: device arguments copied to the host, mutated ones and results copied back."""
    name = str(op)
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        raise FallbackDisabledError(f"{name} cannot run on the NeuronCore ({reason}), and CPU fallback is off",
                                    hint=f"unset {FALLBACK_ENV} to run it on the CPU, or avoid the op")
    if name not in fallen_back:
        fallen_back[name] = reason
        warnings.warn(f"neuron: {name} runs on the CPU ({reason}); its arguments are copied to the host and "
                      f"back. Set {FALLBACK_ENV}=1 to make this an error.", stacklevel=3)
    device = _first_device(args, kwargs) or torch.device("neuron", torch.accelerator.current_device_index())
    originals = {}

    def to_host(x):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            host = x.cpu()
            originals[id(host)] = x
            return host
        return x

    host_args, host_kwargs = torch.utils._pytree.tree_map(to_host, (args, kwargs))
    result = op(*host_args, **host_kwargs)
    for i, argument in enumerate(op._schema.arguments):  # mutated arguments: their new bytes go back
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = host_kwargs.get(argument.name) if argument.kwarg_only else (
            host_args[i] if i < len(host_args) else host_kwargs.get(argument.name))
        for host in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(host, torch.Tensor) and id(host) in originals:
                original = originals[id(host)]
                if original.shape != host.shape:
                    original.resize_(host.shape)
                original.copy_(host)

    def to_device(x):
        if isinstance(x, torch.Tensor):
            return originals.get(id(x)) if id(x) in originals else x.to(device)
        return x

    return torch.utils._pytree.tree_map(to_device, result)


# ---- what runs where ---------------------------------------------------------------------------------

def _not_compilable(op) -> str:
    tags = op.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return "random numbers come from the CPU generator"
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on the data"
    for ret in op._schema.returns:
        if not isinstance(ret.type, (torch.TensorType, torch.ListType)) or (
                isinstance(ret.type, torch.ListType) and not isinstance(ret.type.getElementType(), torch.TensorType)):
            return "it returns a value that is not a tensor"
    return ""


_functional_cache: dict = {}


def _functional(op) -> tuple:
    """(the op without mutation, {"self": True} or {"out": names}) — or (None, {}) if there is none."""
    if op in _functional_cache:
        return _functional_cache[op]
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    found = (op, {})
    if written:
        found = (None, {})
        packet_name = schema.name.split("::")[1]
        outs = [a.name for a in written if a.kwarg_only]
        if outs and len(outs) == len(written):
            packet = getattr(torch.ops.aten, packet_name, None)
            wanted = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
            for overload in packet.overloads() if packet else ():
                candidate = getattr(packet, overload)
                if not candidate._schema.is_mutable and \
                        [(a.name, str(a.type)) for a in candidate._schema.arguments] == wanted:
                    found = (candidate, {"out": outs})
                    break
        elif packet_name.endswith("_") and written == [schema.arguments[0]]:
            packet = getattr(torch.ops.aten, packet_name[:-1], None)
            candidate = getattr(packet, op._overloadname, None) if packet else None
            if candidate is not None and not candidate._schema.is_mutable:
                found = (candidate, {"self": True})
    _functional_cache[op] = found
    return found


def _device_of(op, tensors: list) -> int:
    index = None
    for x in tensors:
        if x.device.type == "neuron":
            if index is not None and x.device.index != index:
                raise NeuronDeviceError(f"{op} got tensors on neuron:{index} and {x.device}",
                                        hint="move them to one device with .to(...)")
            index = x.device.index
        elif x.dim() > 0:
            raise NeuronDeviceError(f"{op} got a {x.device} tensor of shape {tuple(x.shape)} with neuron tensors",
                                    hint='move it with .to("neuron") (only 0-d CPU tensors mix with device tensors)')
    return index if index is not None else torch.accelerator.current_device_index()


def _first_device(args, kwargs):
    for x in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            return x.device
    return None


def _signature(value, tensors: list):
    """A hashable description of arguments: tensors by (shape, dtype, device type), the rest by value.
    Appends the tensors met, in order (the program's inputs), to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (value.shape, value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v, tensors) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v, tensors)) for k, v in value.items())
    return (type(value), value)


# ---- compile, launch, write back -------------------------------------------------------------------

def _compile(op, args, kwargs, device: int):
    """An EagerProgram for this signature, or the reason (a string) the op runs on the CPU instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import CompileOptions, compile_fx
    from neuronc.frontend.torch_import import decomposition_table

    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    examples = [torch.zeros(leaves[i].shape, dtype=leaves[i].dtype) for i in positions]
    if not positions:
        return "it has no tensor inputs"
    out_spec = []

    def one_op(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        a, k = torch.utils._pytree.tree_unflatten(filled, spec)
        flat, result_spec = torch.utils._pytree.tree_flatten(op(*a, **k))
        out_spec.append(result_spec)
        return tuple(flat)

    name = str(op).replace(".", "_")
    try:
        gm = make_fx(one_op, decomposition_table=decomposition_table())(*examples)
        expected = one_op(*examples)
        if not expected or not all(isinstance(t, torch.Tensor) for t in expected) or \
                any(t.numel() == 0 for t in expected):
            return "it has empty or non-tensor results"
        compiled = compile_fx(gm, CompileOptions.from_dict({"name": f"eager_{name}"}))
        program = core(device).load(compiled.neff)
    except NeuronError as e:
        return f"neuronc cannot compile it: {e.message}"
    except Exception as e:  # tracing or importing failed: the op stays on the CPU, and the warning says why
        return f"it could not be traced or imported: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    log.info("neuronc: eager %s compiled for %s", op, ", ".join(str(tuple(t.shape)) for t in examples))
    return EagerProgram(program, compiled.output_layout, [(tuple(t.shape), t.dtype) for t in expected],
                        out_spec[-1], program.time().estimated_ns)


def _launch(entry: EagerProgram, device: int, tensors: list) -> list:
    """Run the program on the tensors' memory; returns the flat results as new device tensors."""
    inputs = [array_of(x) if x.device.type == "neuron" else host_array(x) for x in tensors]
    result = entry.program.run(inputs)
    _shim().launch(device, entry.duration_ns)
    entry.launches += 1
    flat = []
    where = torch.device("neuron", device)
    for index, (shape, dtype) in zip(entry.layout, entry.outputs):
        out = torch.empty(shape, dtype=dtype, device=where)
        array_of(out)[...] = result.outputs[index]
        flat.append(out)
    return flat


def _shim():
    return sys.modules[shim.NAME]


def _write_back(writes: dict, args, kwargs, flat: list, entry: EagerProgram):
    if writes.get("self"):
        target = args[0]
        array_of(target)[...] = array_of(flat[0])
        return target
    if writes.get("out"):
        targets = [kwargs[name] for name in writes["out"]]
        for target, value in zip(targets, flat):
            if target.shape != value.shape:
                target.resize_(value.shape)
            array_of(target)[...] = array_of(value)
        return targets[0] if len(targets) == 1 else tuple(targets)
    return torch.utils._pytree.tree_unflatten(flat, entry.out_spec)


# ---- kernels on device memory itself -------------------------------------------------------------------

def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if dst.device.type == "neuron":
        if src.device.type == "neuron":
            array_of(dst)[...] = array_of(src)
        else:
            array_of(dst)[...] = host_array(src.to(dst.dtype))
    else:
        dst.copy_(host_tensor(array_of(src), src.dtype))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return _copy_from(src, dst)


def _local_scalar_dense(tensor: torch.Tensor):
    value = array_of(tensor).reshape(()).item()
    return float(value) if tensor.dtype.is_floating_point else value


def _fill(tensor: torch.Tensor, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.item()
    array_of(tensor)[...] = np.asarray(value).astype(array_of(tensor).dtype)
    return tensor


def _zero(tensor: torch.Tensor) -> torch.Tensor:
    return _fill(tensor, 0)


DIRECT_KERNELS = {
    "_copy_from": _copy_from,
    "_copy_from_and_resize": _copy_from_and_resize,
    "_local_scalar_dense": _local_scalar_dense,
    "fill_.Scalar": _fill,
    "fill_.Tensor": _fill,
    "zero_": _zero,
}
