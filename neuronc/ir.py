"""The neuronc graph IR: typed tensors, one closed op enum, source locations on every node.

The frontend imports StableHLO into this IR; every pass maps a `Graph` to a `Graph`; codegen
lowers it to instructions. Nodes are immutable by convention: a pass builds new nodes rather than
editing old ones (use `Graph.rewrite`).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Callable, NamedTuple

import numpy as np

from neuronc.isa import DType
from neuronc.neff.program import DebugLoc


class Op(enum.Enum):
    # leaves
    PARAMETER = enum.auto()  # attrs: index, name, kind ("input" | "weight")
    CONSTANT = enum.auto()  # attrs: value (np.ndarray; a 0-d array for a splat)
    IOTA = enum.auto()  # attrs: dimension
    # elementwise, unary
    NEGATE = enum.auto()
    ABS = enum.auto()
    EXP = enum.auto()
    EXPM1 = enum.auto()
    LOG = enum.auto()
    LOG1P = enum.auto()
    SQRT = enum.auto()
    RSQRT = enum.auto()
    TANH = enum.auto()
    LOGISTIC = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    SIGN = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    ROUND = enum.auto()  # round half to even
    ERF = enum.auto()
    GELU = enum.auto()  # x * (1 + erf(x / sqrt 2)) / 2
    NOT = enum.auto()
    CONVERT = enum.auto()  # to the node's dtype
    # elementwise, binary
    ADD = enum.auto()
    SUBTRACT = enum.auto()
    MULTIPLY = enum.auto()
    DIVIDE = enum.auto()
    REMAINDER = enum.auto()
    POWER = enum.auto()
    MAXIMUM = enum.auto()
    MINIMUM = enum.auto()
    ATAN2 = enum.auto()
    AND = enum.auto()
    OR = enum.auto()
    XOR = enum.auto()
    COMPARE = enum.auto()  # attrs: direction ("EQ" | "NE" | "LT" | "LE" | "GT" | "GE")
    # elementwise, ternary
    SELECT = enum.auto()  # (pred, on_true, on_false)
    CLAMP = enum.auto()  # (min, x, max)
    # data movement
    RESHAPE = enum.auto()
    BROADCAST_IN_DIM = enum.auto()  # attrs: dims (operand dim i -> result dim dims[i])
    TRANSPOSE = enum.auto()  # attrs: perm
    SLICE = enum.auto()  # attrs: start, limit, strides
    CONCATENATE = enum.auto()  # attrs: dimension
    PAD = enum.auto()  # (x, pad_value); attrs: low, high, interior
    REVERSE = enum.auto()  # attrs: dims
    # reductions and contractions
    REDUCE = enum.auto()  # (x, init); attrs: dims, kind ("add" | "max" | "min" | "mul" | "and" | "or")
    REDUCE_WINDOW = enum.auto()  # (x, init); attrs: window, strides, padding, kind
    DOT_GENERAL = enum.auto()  # attrs: lhs_batch, rhs_batch, lhs_contract, rhs_contract
    CONVOLUTION = enum.auto()  # attrs: strides, padding, lhs_dilation, rhs_dilation, groups, layouts
    # StableHLO's gather/scatter, normalised (see passes/indexing.py). attrs: window_dims (result/updates dims of the
    # window), dropped_dims (operand dims without one), operand_batching_dims, indices_batching_dims, index_map
    # (operand dim of each index component), index_vector_dim, window (size per operand dim); SCATTER also
    # combine ("add" | "replace")
    GATHER = enum.auto()  # (operand, indices)
    TOPK = enum.auto()  # x -> int32 positions of its k largest (smallest) along a dim, in order; attrs: dimension, k, descending
    SCATTER = enum.auto()  # (operand, indices, updates)
    # kernel-level ops, produced by the legalize pass
    VIEW = enum.auto()  # copy of a strided view of the operand's dense buffer; attrs: offset, strides
    MATMUL = enum.auto()  # [B, M, K] x [B, K, N] -> [B, M, N]; attrs: k, views (per operand, or None)
    REDUCE_LAST = enum.auto()  # [R, C] -> [R], attrs: kind
    GATHER_ROWS = enum.auto()  # (table [V, W], rows [N]) -> [N, W]
    SCATTER_ROWS = enum.auto()  # (base [V, W], rows [N], updates [N, W]) -> base with rows replaced/added; attrs: combine
    FUSED = enum.auto()  # elementwise ops computed in one kernel; attrs: body (a tuple of Step)
    ROWWISE = enum.auto()  # reductions of [R, C] rows and the elementwise ops around them, one row tile at
    # a time (softmax, layer-norm...); attrs: body (Steps, REDUCE_LAST among them), rows, cols, views, out_strides
    CONV = enum.auto()  # (x [N, C, H, W], w [O, C, KH, KW], epilogue inputs...) -> [N, O, OH, OW], an implicit-GEMM
    # convolution (passes/conv.py); attrs: strides, padding, dilation, tiling, views, epilogue
    ATTENTION = enum.auto()  # (q, k, v[, mask]) -> softmax(mask(scale * q @ k^T)) @ v, one flash-attention
    # kernel (passes/attention.py); attrs: views, scale, mask, causal_offset, fill, masked_when, zero_masked_rows
    # custom kernels (neuronc.nki): a traced kernel called on its inputs, written by the user, placed as it is
    CUSTOM_KERNEL = enum.auto()  # inputs -> the kernel's first output; attrs: kernel (nki TracedKernel), outputs
    # ((shape, dtype) of each output)
    KERNEL_OUTPUT = enum.auto()  # (custom kernel) -> its output number attrs["index"] (>= 1), which the kernel writes


UNARY = {
    Op.NEGATE, Op.ABS, Op.EXP, Op.EXPM1, Op.LOG, Op.LOG1P, Op.SQRT, Op.RSQRT, Op.TANH,
    Op.LOGISTIC, Op.SIN, Op.COS, Op.SIGN, Op.FLOOR, Op.CEIL, Op.ROUND, Op.ERF, Op.GELU, Op.NOT, Op.CONVERT,
}
BINARY = {
    Op.ADD, Op.SUBTRACT, Op.MULTIPLY, Op.DIVIDE, Op.REMAINDER, Op.POWER, Op.MAXIMUM, Op.MINIMUM,
    Op.ATAN2, Op.AND, Op.OR, Op.XOR, Op.COMPARE,
}
TERNARY = {Op.SELECT, Op.CLAMP}
ELEMENTWISE = UNARY | BINARY | TERNARY

_ids = itertools.count()


class Step(NamedTuple):
    """One op of a FUSED body. Each arg is ("input", i): the fused node's i-th input,
    ("step", j): the result of step j, or ("imm", value): a scalar."""

    op: Op
    args: tuple
    dtype: DType
    attrs: dict


def body_of(node: "Node") -> tuple:
    """The steps a node computes: its body if FUSED or ROWWISE, else itself as one step (splats as scalars)."""
    if node.op in (Op.FUSED, Op.ROWWISE):
        return node.attrs["body"]
    args = []
    for i, x in enumerate(node.inputs):
        args.append(("imm", x.scalar) if x.scalar is not None else ("input", i))
    return (Step(node.op, tuple(args), node.dtype, node.attrs),)


@dataclasses.dataclass(eq=False)
class Node:
    op: Op
    inputs: tuple
    shape: tuple
    dtype: DType
    attrs: dict = dataclasses.field(default_factory=dict)
    loc: DebugLoc = dataclasses.field(default_factory=DebugLoc)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def scalar(self):
        """The value of a constant stored as one scalar (a splat or a 0-d constant), else None."""
        if self.op is Op.CONSTANT and self.attrs["value"].ndim == 0:
            return self.attrs["value"].item()
        return None

    @property
    def is_splat(self) -> bool:
        return self.op is Op.CONSTANT and self.attrs["value"].ndim == 0 and self.shape != ()

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"%{self.id} = {self.op.name.lower()}({', '.join(f'%{i.id}' for i in self.inputs)}) : {shape}x{self.dtype.name.lower()}"


@dataclasses.dataclass
class Graph:
    params: list  # PARAMETER nodes, in call order
    outputs: list  # nodes whose values the program returns, in order
    name: str = "main"

    def nodes(self) -> list:
        """Every node reachable from the outputs (plus all params), in a topological order.
        Nodes are keyed by identity: `id` is only a display name."""
        order, seen = list(self.params), set(self.params)
        for root in self.outputs:
            stack = [(root, False)]
            while stack:
                node, expanded = stack.pop()
                if expanded:
                    order.append(node)
                elif node not in seen:
                    seen.add(node)
                    stack.append((node, True))
                    stack.extend((i, False) for i in reversed(node.inputs) if i not in seen)
        return order

    def rewrite(self, fn: Callable[[Node, tuple], Node | None]) -> "Graph":
        """Rebuild the graph bottom-up. `fn(node, new_inputs)` returns a replacement or None to keep
        the node (with its inputs replaced)."""
        new: dict = {}
        for node in self.nodes():
            inputs = tuple(new[i] for i in node.inputs)
            replacement = fn(node, inputs)
            if replacement is None:
                replacement = node if inputs == node.inputs else dataclasses.replace(node, inputs=inputs, id=next(_ids))
            new[node] = replacement
        return Graph([new[p] for p in self.params], [new[o] for o in self.outputs], self.name)

    def consumers(self) -> dict:
        """node -> the set of nodes that read it."""
        readers: dict = {}
        for n in self.nodes():
            for i in n.inputs:
                readers.setdefault(i, set()).add(n)
        return readers

    def renumbered(self) -> "Graph":
        """The same graph with fresh display ids (for graphs built in another process)."""
        for node in self.nodes():
            node.id = next(_ids)
        return self

    def __str__(self) -> str:
        lines = [f"graph {self.name}:"]
        lines += [f"  {n!r}" for n in self.nodes()]
        lines.append("  return " + ", ".join(f"%{o.id}" for o in self.outputs))
        return "\n".join(lines)


def unreshaped(node: Node) -> Node:
    """The value a chain of RESHAPEs (aliases of the same bytes) starts from."""
    while node.op is Op.RESHAPE:
        node = node.inputs[0]
    return node


def node(op: Op, inputs, shape, dtype: DType, loc: DebugLoc | None = None, **attrs) -> Node:
    return Node(op, tuple(inputs), tuple(int(s) for s in shape), dtype, attrs, loc or DebugLoc())
