"""What the steps of a FlexAttention score_mod mean: one table for every kernel that runs them.

The frontend turns a score_mod into steps, ((op, args), ...) (`neuronc.frontend.flex_attention.score_steps`); the
compiler's flash-attention kernel (`neuronc/codegen/score_mod.py`) and the NKI library's flash kernels
(`neuronc/nki/library/score_steps.py`) each run them with their own instructions. Both fold a step whose operands
are all numbers (the block's batch and head, constants, table entries) while they generate code, with the meaning
given here: every value is an fp32 number, a comparison is 1.0 or 0.0 (a step's result is a value like any other;
``where`` reads a nonzero condition as true). This module sits below codegen and nki so that both can import it.
"""
from __future__ import annotations

import math
import operator


def _sign(x: float) -> float:
    return float((x > 0) - (x < 0))


UNARY = {"exp": math.exp, "exp2": lambda x: 2.0 ** x, "log": math.log, "tanh": math.tanh, "sqrt": math.sqrt,
         "rsqrt": lambda x: 1.0 / math.sqrt(x), "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "abs": abs,
         "neg": operator.neg, "reciprocal": lambda x: 1.0 / x, "floor": math.floor, "ceil": math.ceil,
         "sign": _sign}
ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv, "max": max,
              "min": min, "pow": operator.pow}
COMPARISONS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
               "ne": operator.ne}
BINARY = {**ARITHMETIC, **COMPARISONS}
OTHER = frozenset({"where", "table"})  # where(cond, a, b); table: a constant buffer's entry at the batch or head
OPS = frozenset(UNARY) | frozenset(BINARY) | OTHER


def number(op: str, *xs: float) -> float:
    """The step ``op`` of numbers, as a number (the kernels' fold of a step whose operands are all known)."""
    if op in UNARY:
        return float(UNARY[op](*xs))
    if op == "where":
        cond, a, b = xs
        return float(a if cond else b)
    return float(BINARY[op](*xs))


def is_identity(steps: tuple) -> bool:
    """Whether the steps leave the score as it is (no score_mod, or the one `score_steps` makes of ``score``)."""
    return steps in ((), (("add", (("score",), ("imm", 0.0))),))


def last_uses(steps: tuple) -> dict:
    """step -> the last step reading it (when a kernel may reuse its value's storage)."""
    last = {}
    for j, (_, args) in enumerate(steps):
        for arg in args:
            if arg[0] == "step":
                last[arg[1]] = j
    return last
