"""The IEEE float semantics torch-mlir gets wrong or cannot lower (issue 21, found by `benchmarks.opinfo`):
`frexp` and `nextafter` (no lowering: read from the fp32 bits with a bitcast), `angle` of a real tensor (no lowering), a float tensor compared equal with itself, and `trunc`'s sign of
-0.0.

**A silent wrong result, fixed here**: torch-mlir folds `aten.eq.Tensor(x, x)` to true, which is wrong for floats
(NaN == NaN is false): compiled, `x == x` was true at NaN, and so were `torch.isfinite(NaN)` (torch decomposes it
as `(x == x) * (|x| != inf)`) and `torch.isclose(x, x)` at NaN. The self-comparison is written as `~isnan(x)`
(torch-mlir lowers `ne(x, x)` correctly) before torch-mlir sees it; `mislowered.py` refuses the form should
one reach it. Registered like decompositions.OWN (torch_import and aten_lowering merge `OWN` after it); tested
against eager in tests/test_float_semantics.py.
"""
from __future__ import annotations

import math

import torch

from neuronc.isa import E4M3_MAX

aten = torch.ops.aten


def _eq(a, b):
    """a == b; for a float tensor compared with itself, not-NaN (torch-mlir folds that form to true)."""
    if a is b and a.is_floating_point():
        return torch.logical_not(torch.isnan(a))
    return NotImplemented


_F32_EXPONENT_FIELD = 0x7F800000
_F32_HALF_EXPONENT = 126 << 23  # the biased exponent of [0.5, 1)
_SUBNORMAL_SCALE = 25  # 2^25 makes the smallest fp32 subnormal (2^-149) normal


def _frexp(x):
    """(mantissa, exponent) with x = mantissa * 2^exponent, |mantissa| in [0.5, 1), as std::frexp: read from
    the fp32 bits (a bitcast; exact): the exponent field minus 126, the mantissa the bits with that field set to
    126. A subnormal is first scaled by 2^25 (exact). 0, -0, +-inf and NaN give themselves and exponent 0, as
    eager. bf16/fp16 are exact in fp32, and so is their mantissa once rounded back."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    bits = aten.view.dtype(x32, torch.int32)
    subnormal = torch.bitwise_and(bits, _F32_EXPONENT_FIELD) == 0
    scaled = torch.where(subnormal, x32 * float(2 ** _SUBNORMAL_SCALE), x32)
    bits = aten.view.dtype(scaled, torch.int32)
    field = torch.bitwise_and(torch.bitwise_right_shift(bits, 23), 0xFF)
    exponent = field - 126 - torch.where(subnormal, _SUBNORMAL_SCALE, 0).to(torch.int32)
    mantissa_bits = torch.bitwise_or(torch.bitwise_and(bits, ~_F32_EXPONENT_FIELD),
                                     torch.full_like(bits, _F32_HALF_EXPONENT))  # bitwise_or.Scalar: no lowering
    mantissa = aten.view.dtype(mantissa_bits, torch.float32)
    special = (x32 == 0.0) | ~torch.isfinite(x32)
    mantissa = torch.where(special, x32, mantissa).to(dtype)
    exponent = torch.where(special, torch.zeros_like(exponent), exponent).to(torch.int32)
    return mantissa, exponent


_F32_SIGN_BIT = -0x80000000  # int32's sign bit: a float's sign


def _nextafter(x, y):
    """The fp32 after x in y's direction, as std::nextafter, from the bits (a bitcast; exact): a finite nonzero x
    moves one step of its int32 bit pattern, up in magnitude when y lies beyond x away from zero, down otherwise;
    from +-0 the step is the smallest subnormal with y's sign; y itself when x == y (so -0 towards +0 is +0); NaN
    if either is. Other dtypes stay refusals."""
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        return NotImplemented
    x, y = torch.broadcast_tensors(x, y)
    bits = aten.view.dtype(x, torch.int32)
    away_from_zero = (y > x) == (x > 0)
    stepped = bits + torch.where(away_from_zero, 1, -1).to(torch.int32)
    smallest_towards_y = torch.bitwise_or(torch.bitwise_and(aten.view.dtype(y, torch.int32),
                                                            torch.full_like(bits, _F32_SIGN_BIT)),
                                          torch.ones_like(bits))
    stepped = torch.where(x == 0, smallest_towards_y, stepped)
    result = aten.view.dtype(stepped, torch.float32)
    result = torch.where(x == y, y, result)
    return torch.where(torch.isnan(x) | torch.isnan(y), x + y, result)


def _angle(x):
    """torch.angle of a real tensor (torch-mlir lowers none): pi below 0 (-inf too), 0 from there (-0 too), NaN
    at NaN; integers give float32, as eager. A complex tensor is complex_pairs.py's."""
    if x.is_complex():
        return NotImplemented
    out = x if x.is_floating_point() else x.to(torch.float32)
    angle = torch.where(out < 0, torch.full_like(out, math.pi), torch.zeros_like(out))
    return torch.where(torch.isnan(out), out, angle)


def _trunc(x):
    """trunc toward zero keeping a zero's sign: torch-mlir lowers it as sign(x) * floor(|x|), whose sign is +0.0
    at -0.0 (eager's trunc(-0.0) is -0.0, and frac(-0.0) then +0.0). An integer's trunc is left to torch-mlir."""
    if not x.is_floating_point():
        return NotImplemented
    return torch.where(x < 0, torch.ceil(x), torch.floor(x))


def _to_copy(x, **kwargs):
    """torch's decomposition of ``_to_copy`` (a convert_element_type), after a clamp when the conversion is to
    float8_e4m3fn: PyTorch's saturates there (a value past +-448, infinities included, becomes +-448, NaN stays
    NaN), StableHLO's convert (and XLA's, which JAX programs keep) gives NaN. clamp keeps a NaN."""
    from torch._decomp import decomposition_table

    dtype = kwargs.get("dtype")
    if dtype == torch.float8_e4m3fn and x.is_floating_point() and x.dtype != dtype:
        x = torch.clamp(x, -E4M3_MAX, E4M3_MAX)
    return decomposition_table[aten._to_copy.default](x, **kwargs)


OWN = {
    aten._to_copy.default: _to_copy,
    aten.trunc.default: _trunc,
    aten.angle.default: _angle,
    aten.frexp.Tensor: _frexp,
    aten.nextafter.default: _nextafter,
    aten.eq.Tensor: _eq,
}
