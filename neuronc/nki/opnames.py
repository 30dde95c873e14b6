"""Which instruction-set operation an NKI ``op=`` argument names: ``nl.add``, ``np.add``, ``np.exp``, ``nl.max``,
``'add'``... An op is recognised by its name (numpy ufuncs and functions, and the ``nl.*`` functions, which
carry the NKI name), so kernels may pass either library's functions, as NKI kernels do."""
from __future__ import annotations

from neuronc.isa import ActFunc, AluOp

ALU = {
    "add": AluOp.ADD, "subtract": AluOp.SUBTRACT, "multiply": AluOp.MULTIPLY, "divide": AluOp.DIVIDE,
    "true_divide": AluOp.DIVIDE, "maximum": AluOp.MAX, "minimum": AluOp.MIN, "max": AluOp.MAX, "amax": AluOp.MAX,
    "min": AluOp.MIN, "amin": AluOp.MIN, "power": AluOp.POW, "pow": AluOp.POW, "equal": AluOp.EQ,
    "not_equal": AluOp.NE, "less": AluOp.LT, "less_equal": AluOp.LE, "greater": AluOp.GT,
    "greater_equal": AluOp.GE, "bitwise_and": AluOp.AND, "bitwise_or": AluOp.OR, "bitwise_xor": AluOp.XOR,
    "logical_and": AluOp.AND, "logical_or": AluOp.OR, "logical_xor": AluOp.XOR, "fmod": AluOp.REMAINDER,
    "remainder": AluOp.REMAINDER, "mod": AluOp.REMAINDER, "arctan2": AluOp.ATAN2, "bypass": AluOp.NONE,
    "sum": AluOp.ADD,
}

ACT = {
    "exp": ActFunc.EXP, "log": ActFunc.LOG, "tanh": ActFunc.TANH, "sqrt": ActFunc.SQRT, "rsqrt": ActFunc.RSQRT,
    "relu": ActFunc.RELU, "sigmoid": ActFunc.SIGMOID, "erf": ActFunc.ERF, "gelu": ActFunc.GELU, "abs": ActFunc.ABS,
    "absolute": ActFunc.ABS, "negative": ActFunc.NEG, "square": ActFunc.SQUARE, "sin": ActFunc.SIN,
    "cos": ActFunc.COS, "sign": ActFunc.SIGN, "reciprocal": ActFunc.RECIPROCAL, "floor": ActFunc.FLOOR,
    "ceil": ActFunc.CEIL, "copy": ActFunc.IDENTITY, "identity": ActFunc.IDENTITY, "bypass": ActFunc.IDENTITY,
    "log1p": ActFunc.LOG1P, "expm1": ActFunc.EXPM1, "rint": ActFunc.ROUND, "logical_not": ActFunc.NOT,
}

REDUCE = {"add": AluOp.ADD, "sum": AluOp.ADD, "max": AluOp.MAX, "amax": AluOp.MAX, "maximum": AluOp.MAX,
          "min": AluOp.MIN, "amin": AluOp.MIN, "minimum": AluOp.MIN}

ARITHMETIC = frozenset({AluOp.ADD, AluOp.SUBTRACT, AluOp.MULTIPLY, AluOp.DIVIDE, AluOp.MAX, AluOp.MIN, AluOp.POW})
COMMUTATIVE = frozenset({AluOp.ADD, AluOp.MULTIPLY, AluOp.MAX, AluOp.MIN, AluOp.EQ, AluOp.NE, AluOp.AND, AluOp.OR,
                         AluOp.XOR})


def name_of(op) -> str:
    if isinstance(op, str):
        return op
    if isinstance(op, (AluOp, ActFunc)):
        return op.name.lower()
    name = getattr(op, "nki_name", None) or getattr(op, "__name__", None)
    if name is None:
        raise ValueError(op)
    return name


def lookup(op, table: dict, what: str, api: str):
    from neuronc.nki.trace import fail

    if isinstance(op, AluOp) and table is not ACT:
        return op
    if isinstance(op, ActFunc) and table is ACT:
        return op
    try:
        name = name_of(op)
    except ValueError:
        name = None
    if name not in table:
        fail(f"{what} {op!r} is not supported", api=api, unsupported=True,
             hint=f"supported: {', '.join(sorted(table))}")
    return table[name]
