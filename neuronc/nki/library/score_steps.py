"""FlexAttention's score_mod inside the NKI library's flash kernels: its steps evaluated on a block of logits, and
(for the backward) their derivative with respect to the score.

A score_mod arrives as the steps of `neuronc.frontend.flex_attention.score_steps`: ((op, args), ...), each arg
("score",), ("b",), ("h",), ("q",), ("kv",), ("imm", x), ("step", j), ("term", i) or ("table", (("values", xs),
("b",)|("h",))). A term is a value the graph computed from tensors the score_mod reads at run time (a learned bias
table's entry, a per-head slope): the kernel hands the block its tile ([rows, keys] fp32) or column ([rows, 1]: a
value per query row, e.g. per head), read from HBM.
Within one kernel block the batch and head are known numbers (the kernels unroll their loops), so they and the
table lookups are folded at trace time; the query and key positions are iota tiles; everything else is an fp32
[rows, keys] tile, one instruction per step, as the dense implementation computes in fp32.

The backward needs dy/dscore of the whole score_mod (the chain rule through it: dS = dY * y'), carried forward
alongside each value (forward-mode: a derivative is None where the value does not depend on the score); a term whose
tensor has a gradient needs dy/dterm as well, carried the same way beside it (one derivative per seed). Steps
without a derivative here (pow with a tensor exponent) raise `Unsupported`, and the frontend keeps the dense
lowering for them.
"""
from __future__ import annotations

import math

import neuronc.nki.isa as nisa
import neuronc.nki.language as nl
from neuronc.score_mod_steps import number

F32 = nl.float32
LN2 = math.log(2.0)

_BINARY = {"add": nl.add, "sub": nl.subtract, "mul": nl.multiply, "div": nl.divide, "max": nl.maximum,
           "min": nl.minimum, "pow": nl.power, "lt": nl.less, "le": nl.less_equal, "gt": nl.greater,
           "ge": nl.greater_equal, "eq": nl.equal, "ne": nl.not_equal}
_UNARY = {"exp": (nl.exp, 1.0), "exp2": (nl.exp, LN2), "log": (nl.log, 1.0), "tanh": (nl.tanh, 1.0),
          "sqrt": (nl.sqrt, 1.0), "rsqrt": (nl.rsqrt, 1.0), "sigmoid": (nl.sigmoid, 1.0), "abs": (nl.abs, 1.0),
          "neg": (nl.negative, 1.0), "reciprocal": (nl.reciprocal, 1.0), "floor": (nl.floor, 1.0),
          "ceil": (nl.ceil, 1.0), "sign": (nl.sign, 1.0)}
_CONSTANT_DERIVATIVE = {"floor", "ceil", "sign", "lt", "le", "gt", "ge", "eq", "ne"}  # zero wherever defined
_DIFFERENTIABLE = {"add", "sub", "mul", "div", "neg", "exp", "exp2", "log", "tanh", "sigmoid", "sqrt", "rsqrt",
                   "reciprocal", "abs", "where", "table", "pow", "max", "min"} | _CONSTANT_DERIVATIVE


class Unsupported(Exception):
    """A score_mod step the library kernels cannot differentiate (the frontend keeps the dense lowering)."""


def check_differentiable(steps: tuple) -> None:
    """Raises Unsupported unless every step's derivative is known here (pow only with a number exponent)."""
    for op, args in steps:
        if op not in _DIFFERENTIABLE:
            raise Unsupported(op)
        if op == "pow" and args[1][0] != "imm":
            raise Unsupported("pow with a tensor exponent")


class Block:
    """The score_mod's steps on one block of logits: rows [q0, q0 + rows), keys [k0, k0 + keys), batch b, head h."""

    def __init__(self, rows: int, keys: int, q0: int, k0: int, b: int, h: int, terms: tuple = ()):
        self.rows, self.keys, self.q0, self.k0, self.b, self.h = rows, keys, q0, k0, b, h
        self.terms = terms  # the block's run-time terms: fp32 tiles [rows, keys] or columns [rows, 1]

    def tile(self, keys: int | None = None):
        return nl.ndarray((self.rows, self.keys if keys is None else keys), dtype=F32, buffer=nl.sbuf)

    def is_column(self, x) -> bool:
        return not isinstance(x, float) and x.shape[1] == 1 and self.keys != 1

    def full(self, x):
        """A number or a column as a tile (a score_mod whose result ignores the score)."""
        if isinstance(x, float):
            t = self.tile()
            nisa.memset(dst=t, value=x)
            return t
        if self.is_column(x):
            t = self.full(0.0)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=x)
            return t
        return x

    def apply(self, steps: tuple, score, derivative: bool = False, terms_wrt: tuple = ()):
        """(score_mod(score) as an fp32 tile, its derivative with respect to score: a tile, a number, or None for
        zero; None also when ``derivative`` is False). With ``terms_wrt`` (term indices), a third item: the
        derivatives with respect to those terms, each a tile, a column, a number or None."""
        seeds = (("score",),) + tuple(("term", i) for i in terms_wrt)
        values: list = []
        grads: list = []  # per step, its derivative per seed

        def arg(a):
            kind = a[0]
            if kind in ("score", "term"):
                value = score if kind == "score" else self.terms[a[1]]
                return value, [1.0 if tuple(a) == seed else None for seed in seeds]
            none = [None] * len(seeds)
            if kind == "imm":
                return float(a[1]), none
            if kind == "step":
                return values[a[1]], grads[a[1]]
            if kind == "b":
                return float(self.b), none
            if kind == "h":
                return float(self.h), none
            if kind == "q":
                t = self.tile()
                nisa.iota(dst=t, pattern=[[0, self.keys]], offset=self.q0, channel_multiplier=1)
                return t, none
            if kind == "kv":
                t = self.tile()
                nisa.iota(dst=t, pattern=[[1, self.keys]], offset=self.k0, channel_multiplier=0)
                return t, none
            raise Unsupported(kind)

        for op, args in steps:
            if op == "table":
                (_, xs), where = args
                index = self.b if where == ("b",) else self.h
                values.append(float(xs[index]))
                grads.append([None] * len(seeds))
                continue
            operands = [arg(a) for a in args]
            xs = [v for v, _ in operands]
            value = self._value(op, xs)
            values.append(value)
            wanted = seeds if derivative else ()
            grads.append([self._derivative(op, xs, [d[s] for _, d in operands], value) for s in range(len(wanted))]
                         + [None] * (len(seeds) - len(wanted)))
        result = (self.full(values[-1]), grads[-1][0])
        return result + (grads[-1][1:],) if terms_wrt else result

    # values ---------------------------------------------------------------------------------------------

    def _value(self, op, xs):
        if op == "where":
            cond, a, b = xs
            if isinstance(cond, float):
                return a if cond else b
            return self._select(cond, a, b)
        if op in _UNARY:
            (x,) = xs
            if isinstance(x, float):
                return number(op, x)
            fn, scale = _UNARY[op]
            t = self.tile(x.shape[1])
            nisa.activation(dst=t, op=fn, data=x, scale=scale)
            return t
        if op not in _BINARY:
            raise Unsupported(op)
        return self.binary(op, *xs)

    def _select(self, cond, a, b):
        """where(cond, a, b) of tiles, columns and numbers (columns widened to tiles when a tile is among them)."""
        if self.is_column(cond) and all(isinstance(x, float) or self.is_column(x) for x in (a, b)):
            return nl.where(cond, a, b, dtype=F32)
        return nl.where(self.full(cond), self._wide(a), self._wide(b), dtype=F32)

    def _wide(self, x):
        """A column as a tile (numbers and tiles as they are)."""
        return self.full(x) if self.is_column(x) else x

    def binary(self, op, a, b):
        if isinstance(a, float) and isinstance(b, float):
            return number(op, a, b)
        fn = _BINARY[op]
        if not isinstance(a, float) and not isinstance(b, float) and self.is_column(a) != self.is_column(b):
            t = self.tile()  # a tile and a column: the column is the pass's per-row operand
            if self.is_column(b):
                nisa.tensor_scalar(dst=t, data=a, op0=fn, operand0=b)
            else:
                nisa.tensor_scalar(dst=t, data=b, op0=fn, operand0=a, reverse0=True)
            return t
        t = self.tile((b if isinstance(a, float) else a).shape[1])
        if isinstance(b, float):
            nisa.tensor_scalar(dst=t, data=a, op0=fn, operand0=b)
        elif isinstance(a, float):
            nisa.tensor_scalar(dst=t, data=b, op0=fn, operand0=a, reverse0=True)
        else:
            nisa.tensor_tensor(dst=t, data1=a, data2=b, op=fn)
        return t

    # derivatives (None: zero) ---------------------------------------------------------------------------

    def _mul(self, a, b):
        if a is None or b is None:
            return None
        return self.binary("mul", a, b)

    def _add(self, a, b, op="add"):
        if b is None:
            return a
        if a is None:
            return b if op == "add" else self.binary("mul", b, -1.0)
        return self.binary(op, a, b)

    def _derivative(self, op, xs, dxs, value):
        if all(d is None for d in dxs) or op in _CONSTANT_DERIVATIVE:
            return None
        if op in ("add", "sub"):
            return self._add(dxs[0], dxs[1], op)
        if op == "mul":
            return self._add(self._mul(dxs[0], xs[1]), self._mul(xs[0], dxs[1]))
        if op == "div":  # (da - y db) / b
            numerator = self._add(dxs[0], self._mul(value, dxs[1]), "sub")
            return self.binary("div", numerator, xs[1])
        if op in ("max", "min"):  # torch.maximum's: the larger operand's derivative, their mean at a tie
            a, b = xs
            picked = self.binary("gt" if op == "max" else "lt", a, b)
            weight = self.binary("add", picked, self.binary("mul", self.binary("eq", a, b), 0.5))  # of a's
            return self._add(self._mul(dxs[0], weight), self._mul(dxs[1], self.binary("sub", 1.0, weight)))
        if op == "where":
            cond = xs[0]
            da, db = (0.0 if d is None else d for d in dxs[1:])
            if isinstance(cond, float):
                return dxs[1] if cond else dxs[2]
            if isinstance(da, float) and isinstance(db, float) and da == db:
                return da
            return self._select(cond, da, db)
        (dx,) = dxs[:1]
        x = xs[0]
        if op == "neg":
            return self.binary("mul", dx, -1.0)
        if op == "exp":
            return self._mul(value, dx)
        if op == "exp2":
            return self._mul(self.binary("mul", value, LN2), dx)
        if op == "log":
            return self.binary("div", dx, x)
        if op == "tanh":  # 1 - y^2
            return self._mul(self.binary("sub", 1.0, self.binary("mul", value, value)), dx)
        if op == "sigmoid":  # y (1 - y)
            return self._mul(self.binary("mul", value, self.binary("sub", 1.0, value)), dx)
        if op == "sqrt":  # 0.5 / y
            return self._mul(self.binary("div", 0.5, value), dx)
        if op == "rsqrt":  # -0.5 y^3
            cube = self.binary("mul", self.binary("mul", value, value), value)
            return self._mul(self.binary("mul", cube, -0.5), dx)
        if op == "reciprocal":  # -y^2
            return self._mul(self.binary("mul", self.binary("mul", value, value), -1.0), dx)
        if op == "abs":
            return self._mul(self._value("sign", [x]), dx)
        if op == "pow":  # n x^(n-1), n a number
            n = xs[1]
            if not isinstance(n, float) or dxs[1] is not None:
                raise Unsupported("pow with a tensor exponent")
            return self._mul(self.binary("mul", self.binary("pow", x, n - 1.0), n), dx)
        raise Unsupported(op)
