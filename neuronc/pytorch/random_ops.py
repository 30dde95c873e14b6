"""Random ops on `neuron` tensors, drawn on the emulated device by the GpSimd engine's RNG instruction.

A `neuron` generator is a counter-based generator's state, ``(seed, offset)`` (the C++ shim's
``NeuronGeneratorImpl``, as CUDA's Philox generator): each op reserves the span of the seed's stream it
draws (``philox_state``, which moves the offset past it) and queues a program
(:mod:`neuronc.codegen.rng`, one per recipe, parameters, shape and dtypes, kept like the eager
programs) that computes its tensor from that span. So ``torch.manual_seed`` and
``torch.Generator(device="neuron")`` give the same tensors again, the values do not depend on when the
launch runs, and two ops never share numbers. The values are not those of the CPU generator (CUDA's are
not either).

``randperm`` sorts a uniform draw on the device. Cases a recipe does not cover (float64 tensors, integer spans beyond what an fp32 draw resolves) go to
the CPU fallback, which draws from a CPU generator seeded from the device generator's stream.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from neuronc.isa import DType
from neuronc.pytorch import eager, queues, shim
from neuronc.pytorch.device_memory import core, host_array, target

_programs: dict = {}  # (recipe, params, shape, dtype, input dtype, device) -> (LoadedProgram, duration ns)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _dtype(torch_dtype) -> DType:
    from neuronc.frontend.tensors import torch_dtypes

    return torch_dtypes()[torch_dtype]


def _program(recipe: str, params: tuple, shape: tuple, dtype, input_dtype, device: int):
    key = (recipe, params, shape, dtype, input_dtype, device)
    entry = _programs.get(key)
    if entry is None:
        from neuronc.codegen.rng import random_program
        from neuronc.targets import get_target

        neff = random_program(recipe, params, shape, _dtype(dtype), get_target(target()),
                              _dtype(input_dtype) if input_dtype is not None else None)
        program = core(device).load(neff)
        entry = _programs[key] = (program, program.time().estimated_ns)
    return entry


def generator_state(generator, device: int, count: int) -> np.ndarray:
    seed, offset = sys.modules[shim.NAME].philox_state(generator, device, count)
    return np.array([seed, offset], np.uint64).view(np.int64)


def _launch(recipe: str, params: tuple, out: torch.Tensor, generator, x=None, mask=None) -> None:
    from neuronc.codegen.rng import RECIPES

    device = out.device.index
    shape = tuple(out.shape)
    program, duration = _program(recipe, params, shape, out.dtype, None if x is None else x.dtype, device)
    state = generator_state(generator, device, RECIPES[recipe].draws * math.prod(shape))
    inputs = [state] + ([] if x is None else [eager._view(x) if x.device.type == "neuron" else host_array(x).copy()])
    outputs = [eager._view(out)] + ([] if mask is None else [eager._view(mask)])
    queues.enqueue(device, duration, program.run_into, (inputs, outputs), f"random {recipe}")


def _on_cpu(op, args, kwargs, reason: str):
    return eager.cpu_fallback(op, args, kwargs, reason)


def _float_draw(recipe: str, op):
    """The in-place kernel of ``op`` (uniform_(from, to) or normal_(mean, std)): the recipe's draw into floats."""

    def kernel(self, a=0.0, b=1.0, *, generator=None):
        if self.dtype not in _FLOATS:
            return _on_cpu(op, (self, a, b), {"generator": generator},
                           f"the device draws {recipe} {', '.join(map(str, _FLOATS))}, not {self.dtype}")
        if self.numel():
            _launch(recipe, (float(a), float(b)), self, generator)
        return self

    return kernel


def _bernoulli_float(self, p=0.5, *, generator=None):
    if self.dtype not in _FLOATS + _INTEGERS + (torch.bool,):
        return _on_cpu(torch.ops.aten.bernoulli_.float, (self, p), {"generator": generator},
                       f"the device draws bernoulli into floats, integers and bools, not {self.dtype}")
    if self.numel():
        _launch("bernoulli", (float(p),), self, generator)
    return self


def _bernoulli_tensor(self, p, *, generator=None):
    if self.dtype not in _FLOATS + _INTEGERS + (torch.bool,) or p.dtype not in _FLOATS:
        return _on_cpu(torch.ops.aten.bernoulli_.Tensor, (self, p), {"generator": generator},
                       f"the device draws bernoulli of {p.dtype} probabilities into {self.dtype} only on the CPU")
    if self.numel():
        _launch("bernoulli_tensor", (), self, generator, x=p.expand(self.shape))
    return self


def _bernoulli(self, *, generator=None):
    return _bernoulli_tensor(torch.empty_like(self), self, generator=generator)


def _native_dropout(x, p, train):
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p >= 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    if x.dtype not in _FLOATS:
        return _on_cpu(torch.ops.aten.native_dropout.default, (x, p, train), {},
                       f"the device drops out {', '.join(map(str, _FLOATS))}, not {x.dtype}")
    out, mask = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
    if x.numel():
        _launch("dropout", (float(p),), out, None, x=x, mask=mask)
    return out, mask


def _integers(op, args: tuple, low: int, high: int | None, generator):
    """random_ in [low, high) on ``args[0]``: on the device when an fp32 draw resolves the span."""
    from neuronc.codegen.rng import MAX_INTEGER_SPAN

    self = args[0]
    if high is None:  # up to the largest value of the dtype (floats: of their exact integers)
        high = 2 ** (torch.finfo(self.dtype).nmant + 1) + 1 if self.dtype.is_floating_point else \
            torch.iinfo(self.dtype).max + 1
    span = high - low
    if self.dtype not in _FLOATS + _INTEGERS or not 0 < span <= MAX_INTEGER_SPAN:
        return _on_cpu(op, args, {"generator": generator},
                       f"the device draws integers in spans of 1 to {MAX_INTEGER_SPAN} into floats and integers")
    if self.numel():
        _launch("integers", (int(low), int(span)), self, generator)
    return self


def _random_from(self, from_, to=None, *, generator=None):
    return _integers(getattr(torch.ops.aten.random_, "from"), (self, from_, to), int(from_),
                     None if to is None else int(to), generator)


def _random_to(self, to, *, generator=None):
    return _integers(torch.ops.aten.random_.to, (self, to), 0, int(to), generator)


def _random(self, *, generator=None):
    return _integers(torch.ops.aten.random_.default, (self,), 0, None, generator)


def _randperm(n, *, generator=None, out):
    """The order that sorts n uniform draws (a stable sort on the device: ties, rare with 24-bit draws, keep
    their order). A sort longer than a tile holds runs on the CPU, with the fallback's warning naming it."""
    if out.dtype not in _INTEGERS + _FLOATS:
        return _on_cpu(torch.ops.aten.randperm.generator_out, (n,), {"generator": generator, "out": out},
                       f"the device draws permutations into integers and floats, not {out.dtype}")
    keys = torch.empty(n, device=out.device)
    if n:
        _launch("uniform", (0.0, 1.0), keys, generator)
    if out.shape != (n,):
        queues.resize(out, (n,))
    return out.copy_(torch.argsort(keys, stable=True))


def _randperm_out(n, *, out):
    return _randperm(n, out=out)


KERNELS = {
    "uniform_": _float_draw("uniform", torch.ops.aten.uniform_.default),
    "normal_": _float_draw("normal", torch.ops.aten.normal_.default),
    "bernoulli_.float": _bernoulli_float,
    "bernoulli_.Tensor": _bernoulli_tensor,
    "bernoulli": _bernoulli,
    "native_dropout": _native_dropout,
    "random_.from": _random_from,
    "random_.to": _random_to,
    "random_": _random,
    "randperm.generator_out": _randperm,
    "randperm.out": _randperm_out,
}
