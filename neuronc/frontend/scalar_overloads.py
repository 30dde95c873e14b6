"""An ATen op reached with a Python number where its schema says Tensor, and the overload that takes one.

``x % 5`` reaches a backend as ``remainder.Tensor(x, 5)``: ``remainder.Scalar`` wraps the 5 in a 0-d "wrapped
number" tensor and calls the Tensor overload, and PyTorch hands a wrapped number to a Python kernel as a Python
number. Called again from Python, a few ops (add, sub, mul, div) take a number there; the rest (remainder, fmod,
pow, the bitwise ops...) refuse it. The same op's overload with a Scalar in that place computes the same result
with the wrapped number's type promotion, so meta kernels, traces and the CPU fallback call that one instead."""

import torch

_NUMBERS = (bool, int, float)
_found: dict = {}  # (op, the places holding numbers) -> the overload to call


def _numbers_in_tensor_places(op, args, kwargs) -> tuple:
    places = []
    for i, argument in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        if type(value) in _NUMBERS and isinstance(argument.type, torch.TensorType):
            places.append(argument.name)
    return tuple(places)


def _takes_numbers_at(candidate, op, places: tuple) -> bool:
    mine, theirs = op._schema, candidate._schema
    if len(mine.arguments) != len(theirs.arguments) or len(mine.returns) != len(theirs.returns):
        return False
    for a, b in zip(mine.arguments, theirs.arguments):
        if a.name != b.name or a.kwarg_only != b.kwarg_only:
            return False
        if a.name in places:
            if not isinstance(b.type, torch.NumberType):
                return False
        elif str(a.type) != str(b.type):
            return False
    return True


def scalar_overload(op, args: tuple, kwargs: dict):
    """``op``, or the overload of the same ATen op taking a Scalar wherever ``args``/``kwargs`` hold a Python
    number in a Tensor place (``remainder.Tensor(x, 5)`` -> ``remainder.Scalar``); ``op`` when there is none."""
    if not isinstance(op, torch._ops.OpOverload):
        return op
    places = _numbers_in_tensor_places(op, args, kwargs)
    if not places:
        return op
    key = (op, places)
    if key not in _found:
        packet = op.overloadpacket
        candidates = (getattr(packet, name) for name in packet.overloads())
        _found[key] = next((c for c in candidates if c is not op and _takes_numbers_at(c, op, places)), op)
    return _found[key]
