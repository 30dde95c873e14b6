"""NKI kernels called with torch tensors: PyTorch custom operators whose body is an ``@nki.jit`` kernel.

Write the operator as PyTorch documents custom ops, its body calling the kernel::

    @torch.library.custom_op("mylib::rmsnorm", mutates_args=())
    def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rmsnorm_kernel(x, w)             # an @nki.jit kernel

    @rmsnorm.register_fake
    def _(x, w):
        return torch.empty_like(x)

* eager, on ``neuron`` tensors: the kernel is traced for the tensors' shapes, its program loaded on their
  device's NeuronCore and queued on the current stream like any op, reading and writing their device memory
  (``call_kernel``); on CPU tensors it runs on an emulated core of its own (the arrays copied in and out).
* inside ``torch.compile(backend="neuron")``: the op stays one node of the graph, and the compiler places the
  kernel's instructions in the graph's NEFF beside its own kernels (``neuronc/frontend/kernel_calls.py``).
* training: a ``torch.autograd.Function`` (or ``register_autograd``) whose backward calls a backward kernel op.
"""
from __future__ import annotations

import numpy as np
import torch

from neuronc.errors import KernelError
from neuronc.frontend.tensors import from_numpy, to_numpy, torch_dtype


def call_kernel(kernel, args: tuple, kwargs: dict):
    """Run an ``@nki.jit`` kernel on torch tensors: on their `neuron` device, or on an emulated core for CPU
    tensors. Returns torch tensors on the same device (one, or a tuple as the kernel returns)."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    devices = {(t.device.type, t.device.index) for t in tensors}
    if any(kind == "neuron" for kind, _ in devices):
        if len(devices) > 1:
            raise KernelError(f"kernel {kernel.__name__} is called with tensors on several devices: "
                              f"{sorted(f'{k}:{i}' for k, i in devices)}", hint="move them to one neuron device")
        (_, index), = devices
        return _on_device(kernel, args, kwargs, index)
    if any(t.device.type != "cpu" for t in tensors):
        raise KernelError(f"kernel {kernel.__name__} runs on neuron or CPU tensors, not {sorted(devices)}")
    numpy_args = [to_numpy(a) if isinstance(a, torch.Tensor) else a for a in args]
    numpy_kwargs = {k: to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = kernel.simulate(*numpy_args, **numpy_kwargs)
    traced = kernel.trace(*args, **kwargs)
    for position in traced.written_inputs:  # arguments the kernel writes, as NKI updates them in place
        written = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)][position]
        source = [a for a in numpy_args + list(numpy_kwargs.values()) if isinstance(a, np.ndarray)][position]
        with torch.no_grad():
            written.copy_(from_numpy(source))
    if out is None:
        return None
    return tuple(from_numpy(o) for o in out) if isinstance(out, tuple) else from_numpy(out)


_programs: dict = {}  # (id of a TracedKernel, device) -> (TracedKernel, LoadedProgram, estimated ns)


def _on_device(kernel, args: tuple, kwargs: dict, device: int):
    from neuronc.pytorch import eager, queues
    from neuronc.pytorch.device_memory import core

    traced = kernel.trace(*args, **kwargs)
    key = (id(traced), device)
    if key not in _programs:
        neff = traced.to_neff()
        program = core(device).load(neff, undefined_on_chip=True)  # tiles undefined until written, as in NKI
        _programs[key] = (traced, program, program.time().estimated_ns)
    _, program, duration_ns = _programs[key]
    operands = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    inputs = [eager._view(t) for t in operands]
    where = torch.device("neuron", device)
    outputs = [torch.empty(tuple(s.shape), dtype=torch_dtype(s.dtype), device=where) for s in traced.outputs]
    written = [(position, eager._view(operands[position])) for position in traced.written_inputs]
    queues.enqueue(device, duration_ns, _run, (program, inputs, [eager._view(o) for o in outputs], written),
                   f"NKI kernel {kernel.__name__}")
    if not outputs:
        return None
    return tuple(outputs) if traced.returns_tuple or len(outputs) > 1 else outputs[0]


def _run(program, inputs: list, outputs: list, written: list) -> None:
    """One launch: the kernel on the operands' device memory, and the arguments it writes updated in place (the
    program's last outputs, see TracedKernel.to_neff)."""
    program.run_into(inputs, outputs + [view for _, view in written])
