"""FlexAttention's score_mod inside the flash-attention kernel: its elementwise steps applied to a block of logits.

A score_mod is a function of (score, b, h, q_idx, kv_idx): its steps (frontend/flex_attention.py, attrs
``score_mod`` of the plan) are evaluated per key block on the block's fp32 logits [queries, keys]. Values are kept
in the cheapest form that holds them: a number (b and h are known per batch-head, so are their functions), a column
(one value per query row: functions of q_idx), an affine function a * kv_idx + column (kv_idx is the block's ramp
of key positions, so q_idx - kv_idx costs nothing until it meets a tile), or a tile. Only steps on tiles cost a
pass over the block: an activation (Scalar), an ALU op with a number or a column (one pass, the column held per
partition), or with another tile; an affine value becomes a tile in one Scalar pass (the ramp scaled, the column
as the activation's bias). Every step computes in fp32, as the dense implementation does.
"""
from __future__ import annotations

import dataclasses
import math

from neuronc.codegen.access import broadcast_columns, tile_at
from neuronc.errors import NeuronCompileError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Opcode
from neuronc.score_mod_steps import last_uses, number

_UNARY = {"exp": (ActFunc.EXP, 1.0), "exp2": (ActFunc.EXP, math.log(2.0)), "log": (ActFunc.LOG, 1.0),
          "tanh": (ActFunc.TANH, 1.0), "sqrt": (ActFunc.SQRT, 1.0), "rsqrt": (ActFunc.RSQRT, 1.0),
          "sigmoid": (ActFunc.SIGMOID, 1.0), "abs": (ActFunc.ABS, 1.0), "neg": (ActFunc.NEG, 1.0),
          "reciprocal": (ActFunc.RECIPROCAL, 1.0), "floor": (ActFunc.FLOOR, 1.0), "ceil": (ActFunc.CEIL, 1.0),
          "sign": (ActFunc.SIGN, 1.0)}
_BINARY = {"add": AluOp.ADD, "sub": AluOp.SUBTRACT, "mul": AluOp.MULTIPLY, "div": AluOp.DIVIDE, "max": AluOp.MAX,
           "min": AluOp.MIN, "pow": AluOp.POW, "lt": AluOp.LT, "le": AluOp.LE, "gt": AluOp.GT, "ge": AluOp.GE,
           "eq": AluOp.EQ, "ne": AluOp.NE}
_ALU2 = frozenset({AluOp.ADD, AluOp.SUBTRACT, AluOp.MULTIPLY, AluOp.DIVIDE, AluOp.MAX, AluOp.MIN, AluOp.POW})


@dataclasses.dataclass
class _Column:
    ap: AccessPattern  # [qt, 1] fp32


@dataclasses.dataclass
class _Affine:
    a: float  # a * kv_idx + rest
    rest: object  # float or _Column


@dataclasses.dataclass
class _Tile:
    ap: AccessPattern  # [qt, kb] fp32


class ScoreMod:
    """The steps of one kernel's score_mod, applied block by block (``apply``)."""

    def __init__(self, kernel, steps: tuple, q_tile: int, block: int):
        self.kernel, self.steps, self.em, self.engines = kernel, steps, kernel.em, kernel.engines
        self.tiles = [kernel.pools["flex"].next() for _ in range(kernel.pools["flex"].bufs)]
        self.columns = [kernel.pools["flex_column"].next() for _ in range(kernel.pools["flex_column"].bufs)]
        self.last = last_uses(steps)
        em = self.em
        self.kv_ramp = kernel.pools["kv_ramp"].next().ap(q_tile, block)
        em.emit(Opcode.IOTA, Engine.GPSIMD, self.kv_ramp, imm0=0.0, imm1=0.0)  # key position within the block
        self.q_ramp = kernel.pools["q_ramp"].next().ap(q_tile, 1)
        em.emit(Opcode.IOTA, Engine.GPSIMD, self.q_ramp, imm0=0.0, imm1=1.0)  # query row within the tile

    # slots --------------------------------------------------------------------------------------------
    def _take(self, free: list, what: str):
        if not free:
            raise NeuronCompileError(f"a flex_attention score_mod holds more {what} at once than the kernel keeps "
                                     f"({len(self.tiles)} tiles)", hint="simplify the score_mod")
        return free.pop(0)

    def apply(self, logits: AccessPattern, b: int, h: int, q0: int, qt: int, k0: int, kb: int) -> None:
        """logits [qt, kb] (fp32, scale * Q K^T) := score_mod(logits, b, h, q_idx, kv_idx)."""
        self.qt, self.kb, self.k0 = qt, kb, k0
        self.free_tiles, self.free_columns = list(self.tiles), list(self.columns)
        self.owner: dict = {}  # step -> the slot its value holds (released after its last use)
        leaves = {"score": _Tile(logits), "b": float(b), "h": float(h), "kv": _Affine(1.0, float(k0)),
                  "q": None}
        self.leaves = leaves
        self.q0 = q0
        values = {}
        final = len(self.steps) - 1
        for j, (op, args) in enumerate(self.steps):
            operands = [self._arg(arg, values) for arg in args]
            values[j] = self._step(op, operands, logits if j == final else None)
            for arg in args:
                if arg[0] == "step" and self.last.get(arg[1]) == j:
                    self._release(arg[1])
            if isinstance(values[j], (_Tile, _Column)) and j != final:
                self.owner[j] = values[j]
        result = values[final] if self.steps else leaves["score"]
        if not (isinstance(result, _Tile) and result.ap == logits):
            self._store(logits, result)

    def _release(self, j: int) -> None:
        value = self.owner.pop(j, None)
        if isinstance(value, _Tile):
            self.free_tiles.append(next(t for t in self.tiles if t.offset == value.ap.offset))
        elif isinstance(value, _Column):
            self.free_columns.append(next(c for c in self.columns if c.offset == value.ap.offset))

    def _arg(self, arg: tuple, values: dict):
        kind = arg[0]
        if kind == "imm":
            return float(arg[1])
        if kind == "step":
            return values[arg[1]]
        if kind == "q":  # q_idx: the tile's first row plus the partition, made once per block
            if self.leaves["q"] is None:
                self.leaves["q"] = column = self._new_column()
                self.engines.emit(Opcode.TENSOR_SCALAR, column.ap, tile_at(self.q_ramp, 0, self.qt, 1),
                                  alu=AluOp.ADD, imm0=float(self.q0))
            return self.leaves["q"]
        if kind == "values":
            return arg[1]
        return self.leaves[kind]

    def _new_tile(self, dst: AccessPattern | None = None) -> _Tile:
        if dst is not None:
            return _Tile(dst)
        return _Tile(self._take(self.free_tiles, "tiles").ap(self.qt, self.kb))

    def _new_column(self) -> _Column:
        return _Column(self._take(self.free_columns, "columns").ap(self.qt, 1))

    # values -------------------------------------------------------------------------------------------
    def _step(self, op: str, operands: list, dst):
        if op == "table":
            values, index = operands
            return float(values[int(index)])
        if op == "where":
            return self._where(*operands, dst)
        if op in _UNARY:
            return self._unary(op, operands[0], dst)
        if op not in _BINARY:
            raise NeuronCompileError(f"flex_attention score_mod step {op} is not supported in the kernel")
        x, y = operands
        if isinstance(x, float) and isinstance(y, float):
            return number(op, x, y)
        if op in ("add", "sub") and all(isinstance(v, (float, _Column, _Affine)) for v in (x, y)) \
                and any(isinstance(v, _Affine) for v in (x, y)):
            return self._affine_sum(x, y, op == "sub")
        if op in ("mul", "div") and isinstance(x, _Affine) and isinstance(y, float):
            f = y if op == "mul" else 1.0 / y
            return _Affine(x.a * f, self._scaled(x.rest, f))
        if op == "mul" and isinstance(y, _Affine) and isinstance(x, float):
            return _Affine(y.a * x, self._scaled(y.rest, x))
        if isinstance(x, _Affine):
            x = self._materialise(x)
        if isinstance(y, _Affine):
            y = self._materialise(y)
        if not isinstance(x, _Tile) and not isinstance(y, _Tile):
            return self._column_binary(op, x, y)
        return self._tile_binary(op, x, y, dst)

    def _scaled(self, rest, f: float):
        if isinstance(rest, float):
            return rest * f
        column = self._new_column()
        self.engines.emit(Opcode.TENSOR_SCALAR, column.ap, rest.ap, alu=AluOp.MULTIPLY, imm0=f)
        return column

    def _affine_sum(self, x, y, subtract: bool):
        def parts(v):
            return (v.a, v.rest) if isinstance(v, _Affine) else (0.0, v)

        (ax, rx), (ay, ry) = parts(x), parts(y)
        sign = -1.0 if subtract else 1.0
        return _Affine(ax + sign * ay, self._column_sum(rx, ry, sign))

    def _column_sum(self, x, y, sign: float):
        if isinstance(x, float) and isinstance(y, float):
            return x + sign * y
        out = self._new_column()
        if isinstance(y, float):
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, x.ap, alu=AluOp.ADD, imm0=sign * y)
        elif isinstance(x, float):
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, y.ap, alu=AluOp.MULTIPLY, imm0=sign)
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, out.ap, alu=AluOp.ADD, imm0=x)
        else:
            self.engines.emit(Opcode.TENSOR_TENSOR, out.ap, x.ap, y.ap,
                              alu=AluOp.SUBTRACT if sign < 0 else AluOp.ADD)
        return out

    def _column_binary(self, op: str, x, y):
        out = self._new_column()
        alu = _BINARY[op]
        if isinstance(y, float):
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, x.ap, alu=alu, imm0=y)
        elif isinstance(x, float):
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, y.ap, alu=alu, imm0=x, reverse=True)
        else:
            self.engines.emit(Opcode.TENSOR_TENSOR, out.ap, x.ap, y.ap, alu=alu)
        return out

    def _materialise(self, v: _Affine, dst=None) -> _Tile:
        """a * kv_idx + rest as a tile: one Scalar pass over the key ramp (the key block's first key folded in)."""
        out = self._new_tile(dst)
        ramp = tile_at(self.kv_ramp, 0, self.qt, self.kb)
        if isinstance(v.rest, float):
            self.engines.activate(Opcode.ACTIVATE, out.ap, ramp, func=ActFunc.IDENTITY, imm0=v.a,
                                  imm1=v.rest + v.a * self.k0)
            return out
        bias = self._column_sum(v.rest, v.a * self.k0, 1.0)
        rowsum = self._new_column()
        self.engines.activate(Opcode.ACTIVATE_BIAS_REDUCE, out.ap, rowsum.ap, ramp, bias.ap, func=ActFunc.IDENTITY,
                              imm0=v.a)
        return out

    def _unary(self, op: str, x, dst):
        if isinstance(x, float):
            return number(op, x)
        if op == "neg" and isinstance(x, _Affine):
            return _Affine(-x.a, self._scaled(x.rest, -1.0) if not isinstance(x.rest, float) else -x.rest)
        func, scale = _UNARY[op]
        if isinstance(x, _Column):
            out = self._new_column()
            self.engines.activate(Opcode.ACTIVATE, out.ap, x.ap, func=func, imm0=scale, imm1=0.0)
            return out
        if isinstance(x, _Affine):
            x = self._materialise(x)
        out = self._new_tile(dst)
        self.engines.activate(Opcode.ACTIVATE, out.ap, x.ap, func=func, imm0=scale, imm1=0.0)
        return out

    def _tile_binary(self, op: str, x, y, dst) -> _Tile:
        alu = _BINARY[op]
        out = self._new_tile(dst)
        if isinstance(x, float) or isinstance(y, float):
            tile, value, reverse = (y, x, True) if isinstance(x, float) else (x, y, False)
            self.engines.emit(Opcode.TENSOR_SCALAR, out.ap, tile.ap, alu=alu, imm0=value, reverse=reverse)
            return out
        column = next((v for v in (x, y) if isinstance(v, _Column)), None)
        if column is not None and alu in _ALU2:  # a value per row, held for the pass
            held = broadcast_columns(column.ap, self.kb)
            a, b = (held, y.ap) if x is column else (x.ap, held)
            self.engines.emit(Opcode.TENSOR_ALU2, out.ap, a, b, a, alu=alu, alu1=AluOp.NONE)
            return out
        a = broadcast_columns(x.ap, self.kb) if isinstance(x, _Column) else x.ap
        b = broadcast_columns(y.ap, self.kb) if isinstance(y, _Column) else y.ap
        self.engines.emit(Opcode.TENSOR_TENSOR, out.ap, a, b, alu=alu)
        return out

    def _as_tile(self, v) -> AccessPattern:
        if isinstance(v, _Tile):
            return v.ap
        if isinstance(v, _Column):
            return broadcast_columns(v.ap, self.kb)
        if isinstance(v, _Affine):
            return self._materialise(v).ap
        column = self._new_column()
        self.engines.emit(Opcode.MEMSET, column.ap, imm0=float(v))
        return broadcast_columns(column.ap, self.kb)

    def _where(self, cond, x, y, dst) -> _Tile:
        out = self._new_tile(dst)
        self.engines.emit(Opcode.SELECT, out.ap, self._as_tile(cond), self._as_tile(x), self._as_tile(y),
                          on=Engine.VECTOR)
        return out

    def _store(self, logits: AccessPattern, value) -> None:
        if isinstance(value, _Affine):
            self._materialise(value, logits)
        elif isinstance(value, _Tile):
            self.engines.emit(Opcode.TENSOR_COPY, logits, value.ap)
        else:
            src = self._as_tile(value)
            self.engines.emit(Opcode.TENSOR_COPY, logits, src)


__all__ = ["ScoreMod", "DType"]
