"""Affine index expressions of `nl.arange` / `nl.mgrid`, and the predicates made by comparing them.

NKI kernels name the elements of a tile by index vectors: ``nl.arange(128)[:, None]`` is the tile's axis 0
(its partitions), ``nl.arange(512)[None, :]`` its axis 1, and ``t[i * 128 + ix, iy]`` a tile of ``t``. Here an
index vector is a :class:`Var` (a size and the tile axis it runs along) and an index an :class:`Affine`, a
constant plus integer multiples of vars. Comparing two affines gives a :class:`Predicate`, a conjunction of
``affine <op> 0`` atoms: a mask (``mask=(i * 128 + ix < rows)``), which restricts each var's range, or the
predicate of ``nisa.affine_select``, evaluated on chip by an iota.
"""
from __future__ import annotations

import itertools
import operator

from neuronc.errors import KernelError

_ids = itertools.count()


class Var:
    """One index vector: values 0 .. size - 1 along axis ``axis`` of an ``ndim``-axis tile."""

    __slots__ = ("size", "axis", "ndim", "id")

    def __init__(self, size: int, axis: int, ndim: int):
        self.size, self.axis, self.ndim, self.id = int(size), axis, ndim, next(_ids)

    def __repr__(self) -> str:
        return f"i{self.id}[axis {self.axis} of {self.ndim}, {self.size}]"


def _control_flow(_self):
    raise KernelError("an nl.arange / nl.mgrid index is used in Python control flow (if/while/bool)",
                      hint="index vectors are not known while the kernel is traced; compare loop counters "
                      "(Python ints) instead, or pass the comparison as a mask= / affine_select predicate")


class Affine:
    """const + sum(coef * var) over the index vectors ``terms`` ({Var: coef})."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict, const: int = 0):
        self.terms = {v: c for v, c in terms.items() if c}
        self.const = const

    @staticmethod
    def of(value) -> "Affine":
        if isinstance(value, Affine):
            return value
        if isinstance(value, Arange):
            return value.as_affine()
        if isinstance(value, (int,)) or hasattr(value, "__index__"):
            return Affine({}, int(value))
        raise KernelError(f"an index expression mixes nl.arange with {type(value).__name__} {value!r}",
                          hint="index expressions are integers plus integer multiples of nl.arange vectors")

    @property
    def vars(self) -> tuple:
        return tuple(self.terms)

    def __add__(self, other):
        other = Affine.of(other)
        terms = dict(self.terms)
        for v, c in other.terms.items():
            terms[v] = terms.get(v, 0) + c
        return Affine(terms, self.const + other.const)

    __radd__ = __add__

    def __neg__(self):
        return Affine({v: -c for v, c in self.terms.items()}, -self.const)

    def __sub__(self, other):
        return self + (-Affine.of(other))

    def __rsub__(self, other):
        return Affine.of(other) + (-self)

    def __mul__(self, other):
        if isinstance(other, (Affine, Arange)):
            raise KernelError("a product of two nl.arange index vectors is not an affine index",
                              hint="multiply index vectors by integers only")
        k = int(other)
        return Affine({v: c * k for v, c in self.terms.items()}, self.const * k)

    __rmul__ = __mul__

    def _compare(self, other, op: str) -> "Predicate":
        return Predicate(((self - Affine.of(other), op),))

    def __lt__(self, other):
        return self._compare(other, "<")

    def __le__(self, other):
        return self._compare(other, "<=")

    def __gt__(self, other):
        return self._compare(other, ">")

    def __ge__(self, other):
        return self._compare(other, ">=")

    def __eq__(self, other):  # noqa: D105 - a predicate, as numpy arrays compare
        return self._compare(other, "==")

    def __ne__(self, other):
        return self._compare(other, "!=")

    __hash__ = object.__hash__
    __bool__ = _control_flow

    def __repr__(self) -> str:
        return " + ".join([f"{c}*{v!r}" for v, c in self.terms.items()] + [str(self.const)])


class Arange:
    """``nl.arange(start, stop)``: a 1-D index vector until it is placed on an axis (``[:, None]``)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = int(start), int(stop)
        if self.stop <= self.start:
            raise KernelError(f"nl.arange({start}, {stop}) is empty")

    def __getitem__(self, key) -> Affine:
        key = key if isinstance(key, tuple) else (key,)
        slices = [i for i, k in enumerate(key) if isinstance(k, slice)]
        if len(slices) != 1 or any(k is not None for i, k in enumerate(key) if i != slices[0]):
            raise KernelError(f"nl.arange(...)[{key}]: place an index vector with one ':' and None elsewhere, "
                              f"e.g. [:, None] (axis 0) or [None, :] (axis 1)")
        if key[slices[0]] != slice(None):
            raise KernelError("nl.arange(...)[...] takes a bare ':' for the vector's axis")
        return Affine({Var(self.stop - self.start, slices[0], len(key)): 1}, self.start)

    def as_affine(self) -> Affine:
        return Affine({Var(self.stop - self.start, 0, 1): 1}, self.start)

    def __getattr__(self, name):  # arithmetic on a bare arange: a 1-D index
        if name.startswith("__") and hasattr(Affine, name):
            return getattr(self.as_affine(), name)
        raise AttributeError(name)

    def __add__(self, o):
        return self.as_affine() + o

    __radd__ = __add__

    def __sub__(self, o):
        return self.as_affine() - o

    def __rsub__(self, o):
        return o - self.as_affine()

    def __mul__(self, o):
        return self.as_affine() * o

    __rmul__ = __mul__

    def __lt__(self, o):
        return self.as_affine() < o

    def __le__(self, o):
        return self.as_affine() <= o

    def __gt__(self, o):
        return self.as_affine() > o

    def __ge__(self, o):
        return self.as_affine() >= o

    __bool__ = _control_flow


class _MGrid:
    """``nl.mgrid[0:128, 0:512]``: one index per axis, as numpy's mgrid."""

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        out = []
        for axis, s in enumerate(key):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise KernelError("nl.mgrid takes unit-step slices, e.g. nl.mgrid[0:128, 0:512]")
            start, stop = s.start or 0, s.stop
            out.append(Affine({Var(stop - start, axis, len(key)): 1}, start))
        return tuple(out) if len(out) > 1 else out[0]


mgrid = _MGrid()

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}
_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


class Predicate:
    """A conjunction of ``affine <op> 0`` atoms (``&`` joins two)."""

    __slots__ = ("atoms",)

    def __init__(self, atoms: tuple):
        self.atoms = tuple(atoms)

    def __and__(self, other):
        if other is True:
            return self
        if other is False:
            return False
        if not isinstance(other, Predicate):
            raise KernelError(f"a mask combines a predicate with {other!r}; use & between comparisons")
        return Predicate(self.atoms + other.atoms)

    __rand__ = __and__

    def __or__(self, other):
        raise KernelError("a mask or predicate with '|' is not supported", hint="use a conjunction (&) of comparisons")

    __ror__ = __or__
    __bool__ = _control_flow

    @property
    def vars(self) -> tuple:
        return tuple(dict.fromkeys(v for a, _ in self.atoms for v in a.terms))

    def ranges(self) -> dict:
        """{Var: (lo, hi)}: the values of each var the predicate keeps, when each atom bounds one var.
        Raises when an atom relates two vars (that is affine_select's job, not a mask's)."""
        bounds: dict = {}
        for affine, op in self.atoms:
            if not affine.terms:
                if not _OPS[op](affine.const, 0):
                    return {None: (0, 0)}  # always false: nothing kept
                continue
            if len(affine.terms) != 1:
                raise KernelError("a mask compares two nl.arange vectors; masks bound one index vector at a time",
                                  hint="use nisa.affine_select for predicates across axes (e.g. causal masks)")
            (v, c), = affine.terms.items()
            lo, hi = bounds.get(v, (0, v.size))
            # c * x + k <op> 0
            k = affine.const
            if c < 0:
                c, k, op = -c, -k, _FLIPPED[op]
            # x <op> -k / c
            if op in ("<", "<="):
                limit = (-k - (1 if op == "<" else 0)) // c  # largest x with c*x + k <op> 0
                hi = min(hi, limit + 1)
            elif op in (">", ">="):
                limit = -((k - (1 if op == ">" else 0)) // c)  # smallest x with c*x + k <op> 0
                lo = max(lo, limit)
            elif op == "==":
                if (-k) % c:
                    hi = lo
                else:
                    lo, hi = max(lo, -k // c), min(hi, -k // c + 1)
            else:
                raise KernelError("a mask with != is not a range", hint="use <, <=, >, >= or ==")
            bounds[v] = (lo, max(lo, hi))
        return bounds

    def __repr__(self) -> str:
        return " & ".join(f"({a!r} {op} 0)" for a, op in self.atoms)
