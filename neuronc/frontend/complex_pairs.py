"""Complex numbers as pairs of reals: a graph with complex tensors rewritten into one without any.

The NeuronCore has no complex type (nor has neuronc's graph IR, nor torch-mlir's StableHLO lowering of most complex
ATen ops). As tt-mlir does for StableHLO's complex types and as XLA's TPU backend does inside, a complex tensor of
shape S is held as a real tensor of shape S + [2], (real, imaginary) interleaved: exactly `torch.view_as_real`'s
layout, so at the graph's boundary a complex input is passed as its real view and a complex output is returned as
`torch.view_as_complex` of the real result (host-side views, no copy: `Boundary`).

Inside, `as_real_pairs` re-traces the ATen graph (make_fx, node metadata and source lines kept) through an
interpreter that runs every node touching a complex value by a pair rule of `RULES`: arithmetic (add, sub, mul,
div, neg, conj, abs, angle, exp, log, sqrt, pow, sgn, reciprocal), parts and views (real, imag, view_as_real, view_as_complex,
complex, polar), data movement (view, permute, slice, cat, ...: the op on the pair tensor with its dims counted
among the complex ones), matmuls, reductions (sum, mean) and the FFTs (`fft.py`). Every other node is run as it
is. A graph with a complex op no rule covers is left as it was: compiled as before (strictly: the error naming
that op; with the CPU fallback, that op on the CPU).
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from neuronc.frontend import fft

aten = torch.ops.aten
prims = torch.ops.prims

REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


class Pair:
    """A complex value held as a real tensor `t` of shape [..., 2] (view_as_real's layout)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    @property
    def re(self):
        return self.t[..., 0]

    @property
    def im(self):
        return self.t[..., 1]

    @property
    def rank(self) -> int:
        return self.t.dim() - 1

    @classmethod
    def of(cls, re, im) -> Pair:
        re, im = torch.broadcast_tensors(torch.as_tensor(re), torch.as_tensor(im))
        return cls(torch.stack([re, im], -1))


class Unsupported(Exception):
    """A node touching a complex value that no pair rule covers (the graph is then left as it was)."""


def _is_complex(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _parts(x) -> tuple:
    """(real, imaginary) of an operand: a Pair, a real tensor or a Python number (imaginary None when zero)."""
    if isinstance(x, Pair):
        return x.re, x.im
    if isinstance(x, complex):
        return x.real, x.imag
    return x, None


def _add(a, b, alpha=1):
    (ar, ai), (br, bi) = _parts(a), _parts(b)
    if alpha != 1:
        br, bi = br * alpha, None if bi is None else bi * alpha
    im = ai if bi is None else bi if ai is None else ai + bi
    return Pair.of(ar + br, 0.0 * ar if im is None else im)


def _sub(a, b, alpha=1):
    return _add(a, _neg(b) if isinstance(b, Pair) else -b, alpha)


def _mul(a, b):
    (ar, ai), (br, bi) = _parts(a), _parts(b)
    if ai is None and bi is None:
        return ar * br
    if ai is None:
        return Pair.of(ar * br, ar * bi)
    if bi is None:
        return Pair.of(ar * br, ai * br)
    return Pair.of(ar * br - ai * bi, ar * bi + ai * br)


def _reciprocal(b):
    """conj(b) / |b|^2, the textbook formula: |b|^2 overflows past |b| ~ 1.8e19 (fp32) and underflows below
    ~1e-19, where eager's scaled (Smith's) division does not."""
    br, bi = _parts(b)
    if bi is None:
        return 1.0 / br
    scale = br * br + bi * bi
    return Pair.of(br / scale, -bi / scale)


def _div(a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise Unsupported("complex division with a rounding mode")
    (br, bi) = _parts(b)
    if bi is None:
        ar, ai = _parts(a)
        return Pair.of(ar / br, ai / br)
    return _mul(a, _reciprocal(b))


def _neg(a):
    return Pair(-a.t)


def _conj(a):
    return Pair.of(a.re, -a.im)


def _abs(a):
    """sqrt(re^2 + im^2): as eager's hypot within fp32's rounding, but inf past |a| ~ 1.8e19."""
    return torch.sqrt(a.re * a.re + a.im * a.im)


def _angle(a):
    return torch.atan2(a.im, a.re)


def _exp(a):
    magnitude = torch.exp(a.re)
    return Pair.of(magnitude * torch.cos(a.im), magnitude * torch.sin(a.im))


def _log(a):
    """log|a| + i angle(a); log|a| overflows past |a| ~ 1.8e19 as _abs does."""
    return Pair.of(torch.log(_abs(a)), _angle(a))


def _sqrt(a):
    """The principal root without cancellation: t = sqrt((|a| + |re|) / 2) is the part of the larger magnitude,
    the other is |im| / 2t (0 at a = 0); the imaginary part takes im's sign (-0 included, as eager)."""
    t = torch.sqrt((_abs(a) + a.re.abs()) * 0.5)
    other = torch.where(t == 0, 0.0, a.im.abs() / (t + t))
    return Pair.of(torch.where(a.re >= 0, t, other), torch.copysign(torch.where(a.re >= 0, other, t), a.im))


def _log_of(x):
    """log of an operand of pow as (real, imaginary): a Pair, a real tensor (angle pi below 0) or a number."""
    if isinstance(x, Pair):
        return _log(x).re, _log(x).im
    if isinstance(x, (int, float, complex)):
        value = complex(x)
        return (math.log(abs(value)) if value else -math.inf), math.atan2(value.imag, value.real)
    return torch.log(x.abs()), torch.where(x < 0, math.pi, 0.0)


def _pow(a, b):
    """a ** b: small integer powers of a complex base by multiplication (as eager's square and cube), a half by
    _sqrt, else exp(b log a); a base of 0 gives 1 at b = 0 and 0 for a positive real b, as eager."""
    if isinstance(a, Pair) and isinstance(b, (int, float)) and float(b).is_integer() and 1 <= b <= 4:
        result = a
        for _ in range(int(b) - 1):
            result = _mul(result, a)
        return result
    if isinstance(a, Pair) and isinstance(b, (int, float)) and b == 0.5:
        return _sqrt(a)
    result = _exp(_mul(Pair.of(*_log_of(a)), b))
    if isinstance(a, Pair) and isinstance(b, (int, float)) and b == 0:
        return Pair.of(torch.ones_like(a.re), torch.zeros_like(a.re))
    if isinstance(a, Pair) and isinstance(b, (int, float)) and b > 0:  # exp(b log 0) is NaN from 0 * nan
        zero = (a.re == 0) & (a.im == 0)
        return Pair(torch.where(zero.unsqueeze(-1), 0.0, result.t))
    return result


def _sgn(a):
    magnitude = _abs(a)
    safe = torch.where(magnitude == 0, 1.0, magnitude)
    return Pair.of(a.re / safe, a.im / safe)  # 0 at 0, as eager


def _polar(magnitude, angle):
    return Pair.of(magnitude * torch.cos(angle), magnitude * torch.sin(angle))


def _to(x, dtype=None, **_):
    """_to_copy / convert_element_type: real -> complex gains a zero imaginary part, complex -> real keeps the
    real part (as eager, which warns), complex -> complex converts both."""
    if isinstance(x, Pair):
        if dtype is None or dtype.is_complex:
            return Pair(x.t.to(REAL_OF[dtype]) if dtype is not None else x.t.clone())
        return x.re.to(dtype)
    real = x.to(REAL_OF[dtype])
    return Pair.of(real, torch.zeros_like(real))


def _same(a, *_, **__):
    return a


def _eq(a, b):
    (ar, ai), (br, bi) = _parts(a), _parts(b)
    return (ar == br) & (ai == (0.0 if bi is None else bi))


def _ne(a, b):
    return ~_eq(a, b)


def _where(condition, a, b):
    (ar, ai), (br, bi) = _parts(a), _parts(b)
    return Pair.of(torch.where(condition, ar, br), torch.where(condition, 0.0 if ai is None else ai,
                                                               0.0 if bi is None else bi))


def _matmul(op):
    def product(a, b):
        (ar, ai), (br, bi) = _parts(a), _parts(b)
        re = op(ar, br) if ai is None or bi is None else op(ar, br) - op(ai, bi)
        im = (op(ar, bi) if ai is None else op(ai, br) if bi is None else op(ar, bi) + op(ai, br))
        return Pair.of(re, im)
    return product


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _dims(dims, rank: int) -> list:
    dims = [dims] if isinstance(dims, int) else dims
    return [_dim(d, rank) for d in dims]


def _reduction(op):
    def reduce(a, dim=None, keepdim=False, *, dtype=None):
        dims = list(range(a.rank)) if dim is None or dim == [] else _dims(dim, a.rank)
        return Pair(op(a.t, dims, keepdim))
    return reduce


def _structural(rule):
    """A data-movement op on the pair tensor, the dims of its arguments counted among the complex dims."""
    def apply(a, *args, **kwargs):
        return Pair(rule(a.t, a.rank, *args, **kwargs))
    return apply


def _cat(tensors, dim=0):
    pairs = [t if isinstance(t, Pair) else Pair.of(t, torch.zeros_like(t)) for t in tensors]
    return Pair(torch.cat([p.t for p in pairs], _dim(dim, pairs[0].rank)))


def _stack(tensors, dim=0):
    pairs = [t if isinstance(t, Pair) else Pair.of(t, torch.zeros_like(t)) for t in tensors]
    return Pair(torch.stack([p.t for p in pairs], _dim(dim, pairs[0].rank + 1)))


def _split(op):
    def split(a, sizes, dim=0):
        return [Pair(t) for t in op(a.t, sizes, _dim(dim, a.rank))]
    return split


def _unbind(a, dim=0):
    return [Pair(t) for t in torch.unbind(a.t, _dim(dim, a.rank))]


def _index(a, indices):
    return Pair(aten.index.Tensor(a.t, list(indices)))


def _pad(a, pad, value=0.0):
    if isinstance(value, complex) and value.imag:
        raise Unsupported("complex padding value")
    re, im = aten.constant_pad_nd(a.re, pad, value.real if isinstance(value, complex) else value), \
        aten.constant_pad_nd(a.im, pad, 0.0)
    return Pair.of(re, im)


def _full_like(a, value, **kwargs):
    value = complex(value)
    kwargs = {k: v for k, v in kwargs.items() if k in ("device", "pin_memory")}
    return Pair.of(torch.full_like(a.re, value.real, **kwargs), torch.full_like(a.re, value.imag, **kwargs))


def _copy(destination, source, non_blocking=False):
    """aten.copy (functional copy_): `source` in the destination's shape and dtype."""
    if not isinstance(destination, Pair):
        return _parts(source)[0].expand_as(destination).to(destination.dtype)
    re, im = _parts(source)
    source = Pair.of(re, torch.zeros_like(torch.as_tensor(re)) if im is None else im)
    return Pair(source.t.to(destination.t.dtype).expand_as(destination.t).clone())


def _filled(size, value, dtype) -> Pair:
    """A complex tensor of one value, made as its two real parts."""
    value, real = complex(value), REAL_OF[dtype]
    return Pair.of(torch.full(size, value.real, dtype=real), torch.full(size, value.imag, dtype=real))


def _scalar_tensor(value, *, dtype=None, **_):
    return _filled((), value, dtype)


def _full(size, value, *, dtype=None, **_):
    return _filled(size, value, dtype)


def _fft_r2c(x, dim, normalization, onesided):
    return Pair(fft.r2c(x, dim, normalization, onesided))


def _fft_c2r(a, dim, normalization, last_dim_size):
    return fft.c2r(a.t, dim, normalization, last_dim_size)


def _fft_c2c(a, dim, normalization, forward):
    return Pair(fft.c2c(a.t, dim, normalization, forward))


RULES = {
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: _sub, aten.sub.Scalar: _sub,
    aten.mul.Tensor: _mul, aten.mul.Scalar: _mul,
    aten.div.Tensor: _div, aten.div.Scalar: _div, aten.div.Tensor_mode: _div,
    aten.reciprocal.default: _reciprocal,
    aten.neg.default: _neg,
    aten._conj.default: _conj, aten.conj.default: _conj,
    aten.conj_physical.default: _conj, aten._conj_physical.default: _conj,
    aten.resolve_conj.default: _same, aten.resolve_neg.default: _same,
    aten.clone.default: _same, aten.alias.default: _same, aten.detach.default: _same,
    aten.lift_fresh_copy.default: _same, aten.contiguous.default: _same,
    aten.abs.default: _abs,
    aten.angle.default: _angle,
    aten.exp.default: _exp,
    aten.log.default: _log, aten.sqrt.default: _sqrt,
    aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _pow, aten.pow.Scalar: _pow,
    aten.sgn.default: _sgn,
    aten.real.default: lambda a: a.re,
    aten.imag.default: lambda a: a.im,
    aten.view_as_real.default: lambda a: a.t,
    aten.view_as_complex.default: Pair,
    aten.complex.default: Pair.of,
    aten.polar.default: _polar,
    aten._to_copy.default: _to,
    prims.convert_element_type.default: lambda x, dtype: _to(x, dtype),
    aten.eq.Tensor: _eq, aten.eq.Scalar: _eq, aten.ne.Tensor: _ne, aten.ne.Scalar: _ne,
    aten.where.self: _where,
    aten.mm.default: _matmul(torch.mm), aten.bmm.default: _matmul(torch.bmm),
    aten.sum.dim_IntList: _reduction(lambda t, d, k: torch.sum(t, d, k)),
    aten.sum.default: _reduction(lambda t, d, k: torch.sum(t, d, k)),
    aten.mean.dim: _reduction(lambda t, d, k: torch.mean(t, d, k)),
    aten.mean.default: _reduction(lambda t, d, k: torch.mean(t, d, k)),
    aten.view.default: _structural(lambda t, r, shape: t.reshape(*shape, 2)),
    aten._unsafe_view.default: _structural(lambda t, r, shape: t.reshape(*shape, 2)),
    aten.reshape.default: _structural(lambda t, r, shape: t.reshape(*shape, 2)),
    aten.expand.default: _structural(lambda t, r, shape, implicit=False: t.expand(*shape, 2)),
    aten.permute.default: _structural(lambda t, r, dims: t.permute(*_dims(dims, r), r)),
    aten.transpose.int: _structural(lambda t, r, d0, d1: t.transpose(_dim(d0, r), _dim(d1, r))),
    aten.t.default: _structural(lambda t, r: t.transpose(0, 1) if r == 2 else t),
    aten.select.int: _structural(lambda t, r, d, i: t.select(_dim(d, r), i)),
    aten.slice.Tensor: _structural(lambda t, r, d=0, start=None, end=None, step=1:
                                   aten.slice.Tensor(t, _dim(d, r), start, end, step)),
    aten.unsqueeze.default: _structural(lambda t, r, d: t.unsqueeze(_dim(d, r + 1))),
    aten.squeeze.dim: _structural(lambda t, r, d: t.squeeze(_dim(d, r))),
    aten.squeeze.dims: _structural(lambda t, r, dims: t.squeeze(tuple(_dims(dims, r)))),
    prims.squeeze.default: _structural(lambda t, r, dims: t.squeeze(tuple(_dims(dims, r)))),
    aten.squeeze.default: _structural(lambda t, r: t.squeeze(tuple(d for d in range(r) if t.shape[d] == 1))),
    aten.flip.default: _structural(lambda t, r, dims: t.flip(_dims(dims, r))),
    aten.roll.default: _structural(lambda t, r, shifts, dims=(): t.roll(shifts, _dims(dims, r)) if dims
                                   else t.flatten(0, -2).roll(shifts, 0).reshape(t.shape)),
    aten.index.Tensor: _index,
    aten.constant_pad_nd.default: _pad,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.split.Tensor: _split(torch.split), aten.split_with_sizes.default: _split(torch.split),
    aten.unbind.int: _unbind,
    aten.full_like.default: _full_like,
    aten.copy.default: _copy,
    aten.scalar_tensor.default: _scalar_tensor,
    aten.full.default: _full,
    aten.zeros.default: lambda size, **kw: _full(size, 0.0, **kw),
    aten.ones.default: lambda size, **kw: _full(size, 1.0, **kw),
    aten.zeros_like.default: lambda a, **kw: _full_like(a, 0.0, **kw),
    aten.ones_like.default: lambda a, **kw: _full_like(a, 1.0, **kw),
    aten._fft_r2c.default: _fft_r2c,
    aten._fft_c2r.default: _fft_c2r,
    aten._fft_c2c.default: _fft_c2c,
}


class _PairInterpreter(fx.Interpreter):
    """Runs the graph with complex values as Pairs: each node touching one by its rule, the others as they are."""

    def call_function(self, target, args, kwargs):
        touches = any(isinstance(v, Pair) for v in _leaves((args, kwargs))) or \
            any(_is_complex(v) for v in _leaves(self.current_node.meta.get("val")))
        if target is operator.getitem and isinstance(args[0], (list, tuple)):
            return super().call_function(target, args, kwargs)
        if not touches:
            return super().call_function(target, args, kwargs)
        rule = RULES.get(target)
        if rule is None:
            raise Unsupported(f"{target} on complex values")
        return rule(*args, **kwargs)

    def run_node(self, n):
        self.current_node = n
        return super().run_node(n)


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Which inputs and (flattened) outputs of the rewritten graph are complex values held as pairs."""
    complex_inputs: tuple
    complex_outputs: tuple

    def wrap(self, function):
        """`function` (the compiled real graph) called with complex inputs as their real views and returning
        complex outputs as complex views of its real results."""
        def call(*args):
            args = [torch.view_as_real(a.resolve_conj()) if flag else a
                    for a, flag in zip(args, self.complex_inputs)]
            outputs = function(*args)
            return type(outputs)(torch.view_as_complex(o) if flag else o
                                 for o, flag in zip(outputs, self.complex_outputs))
        return call


def has_complex(gm: fx.GraphModule) -> bool:
    return any(_is_complex(v) for n in gm.graph.nodes for v in _leaves(n.meta.get("val")))


def as_real_pairs(gm: fx.GraphModule):
    """(real graph, Boundary) for a graph with complex values, or None when it has none or holds a complex op
    no pair rule covers (`Unsupported`)."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    if not has_complex(gm):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in placeholders]
    complex_inputs = tuple(_is_complex(v) for v in values)
    examples = [torch.empty(*map(int, v.shape), 2, dtype=REAL_OF[v.dtype]) if flag
                else torch.empty(tuple(map(int, v.shape)), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                for v, flag in zip(values, complex_inputs)]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    complex_outputs = tuple(isinstance(a, fx.Node) and _is_complex(a.meta.get("val")) for a in output.args[0])

    def run(*args):
        inputs = [Pair(a) if flag else a for a, flag in zip(args, complex_inputs)]
        results = _PairInterpreter(gm).run(*inputs)
        return type(results)(r.t if isinstance(r, Pair) else r for r in results)

    try:  # outside Dynamo's tracing context, whose fake mode would give the inputs symbolic sizes; the ops the
        # rules emit decomposed as the graph's own were (squeeze.dims, which torch-mlir does not lower)
        with torch._guards.tracing(None), fx_traceback.preserve_node_meta():
            real = make_fx(run, decomposition_table=decomposition_table(), tracing_mode="fake")(*examples)
    except Unsupported:
        return None
    if has_complex(real):
        return None
    return real, Boundary(complex_inputs, complex_outputs)
