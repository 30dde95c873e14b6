"""The neuronc graph IR: typed tensors, one closed op enum, source locations on every node.

The frontend imports StableHLO into this IR; every pass maps a `Graph` to a `Graph`; codegen
lowers it to instructions. Nodes are immutable by convention: a pass builds new nodes rather than
editing old ones (use `Graph.rewrite`).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import operator
from typing import Callable, Iterable, NamedTuple

import numpy as np

from neuronc import op_facts
from neuronc.isa import DType
from neuronc.neff.program import DebugLoc


# The ops of the IR, one per entry of the op-facts table (neuronc/op_facts.py says what each takes, computes
# and is computed by), in the table's order: Op.ADD, Op.MATMUL, ... `op_facts.BY_NAME[op.name]` is its entry.
Op = enum.Enum("Op", [fact.name for fact in op_facts.FACTS], module=__name__, qualname="Op")
# An op hashes as the object it is (object.__hash__, in C) instead of as its name (Enum.__hash__, a Python call at every
# dict or set lookup: a few thousand per layer of a model in the passes). Both vary between processes (str hashes
# are salted), so no result may depend on the order of a set of ops (tests/test_graph_order.py checks a NEFF).
Op.__hash__ = object.__hash__


def facts(op: Op) -> op_facts.OpFact:
    """The op-facts table's entry of `op`."""
    return op_facts.BY_NAME[op.name]


def _ops(kind: str) -> frozenset:
    return frozenset(Op[fact.name] for fact in op_facts.FACTS if fact.kind == kind)


UNARY = _ops("unary")
BINARY = _ops("binary")
TERNARY = _ops("ternary")
ELEMENTWISE = UNARY | BINARY | TERNARY

_ids = itertools.count()


def next_id() -> int:
    """The id the next new node gets (none is taken)."""
    global _ids
    upcoming = next(_ids)
    _ids = itertools.count(upcoming)
    return upcoming


def rewind_ids(to: int) -> None:
    """Ids from `to` again, for a caller that renumbers (Graph.renumbered) the nodes made since, as a graph made in
    another process is: they take the ids they would have taken there."""
    global _ids
    _ids = itertools.count(to)


def skip_ids(n: int) -> None:
    """Takes the next `n` ids unused: what a memo's hit does for the nodes the work it replaces made, so that every
    later node keeps its id (the ids name kernels and buffers in the NEFF)."""
    global _ids
    _ids = itertools.count(next_id() + n)


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
    origin: int = -1  # the number of the StableHLO value this node computes (the importer's numbering), or -1;
    # inherited by the node that replaces it in `Graph.rewrite`: how `neuronc bisect` finds a kernel's value

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def scalar(self) -> float | int | bool | None:
        """The value of a constant stored as one scalar (a splat or a 0-d constant), else None."""
        if self.op is Op.CONSTANT and self.attrs["value"].ndim == 0:
            return self.attrs["value"].item()
        return None

    @property
    def is_splat(self) -> bool:
        return self.op is Op.CONSTANT and self.attrs["value"].ndim == 0 and self.shape != ()

    def __repr__(self) -> str:
        """The node's line of IR text (neuronc/ir_text.py), nodes named by their display ids, long arrays elided."""
        from neuronc import ir_text

        return ir_text.node_text(self)


def with_inputs(node: Node, inputs: tuple) -> Node:
    """`node` itself when `inputs` are its own, else `dataclasses.replace(node, inputs=inputs, id=next(_ids))` (the
    same fields, its attrs dict shared), without replace's field-by-field __init__: Graph.rewrite copies every node
    downstream of a change, in every pass, and passes that keep their own map of rewritten nodes do the same."""
    if inputs == node.inputs:
        return node
    new = object.__new__(Node)
    new.__dict__.update(node.__dict__)
    new.inputs, new.id = inputs, next(_ids)
    return new


_INPUTS = operator.attrgetter("inputs")


@dataclasses.dataclass
class Graph:
    params: list  # PARAMETER nodes, in call order
    outputs: list  # nodes whose values the program returns, in order
    name: str = "main"

    def nodes(self) -> list:
        """Every node reachable from the outputs (plus all params), in a topological order: each output's inputs
        depth first, an input before its readers, first input first (the order a recursive post-order walk gives).
        Nodes are keyed by identity: `id` is only a display name.

        The order is a function of the params, the outputs and the inputs of the nodes it lists, so it is kept with
        them and given again (a new list) while they are the same objects: checked at every call (list and tuple
        equality of nodes is identity), so an edit of any of them, against the IR's convention, makes a fresh walk.
        Passes walk the graph they were given, and most walk a graph walked before."""
        kept = self.__dict__.get("_kept")
        if kept is not None:
            params, outputs, order, inputs = kept
            if params == self.params and outputs == self.outputs and inputs == list(map(_INPUTS, order)):
                return list(order)
        order = self._walk()
        self._kept = (list(self.params), list(self.outputs), order, list(map(_INPUTS, order)))
        return list(order)

    def _walk(self) -> list:
        """The order of `nodes`, walked."""
        order, seen = list(self.params), set(self.params)
        append, add = order.append, seen.add
        for root in self.outputs:
            if root in seen:
                continue
            add(root)
            stack = [(root, iter(root.inputs))]  # a node and the inputs it has yet to visit: no recursion
            push, pop = stack.append, stack.pop
            while stack:
                node, rest = stack[-1]
                for i in rest:
                    if i not in seen:
                        add(i)
                        push((i, iter(i.inputs)))
                        break
                else:
                    pop()
                    append(node)
        return order

    def rewrite(self, fn: Callable[[Node, tuple], Node | None]) -> "Graph":
        """Rebuild the graph bottom-up. `fn(node, new_inputs)` returns a replacement or None to keep
        the node (with its inputs replaced)."""
        new: dict = {}
        kept = True  # every node its own replacement: the new graph's order is this one's
        for node in self.nodes():
            inputs = tuple(map(new.__getitem__, node.inputs))
            replacement = fn(node, inputs)
            if replacement is None:
                replacement = with_inputs(node, inputs)
            elif replacement.origin < 0:
                replacement.origin = node.origin  # it computes node's value
            new[node] = replacement
            if replacement is not node:
                kept = False
        graph = Graph([new[p] for p in self.params], [new[o] for o in self.outputs], self.name)
        if kept and "_kept" in self.__dict__:
            graph._kept = self._kept  # (checked against the new graph at its first walk, as any kept order)
        return graph

    def unchanged(self) -> "Graph":
        """A new graph of the same params, outputs and name (what a rewrite that replaces nothing makes), its order
        kept."""
        graph = Graph(list(self.params), list(self.outputs), self.name)
        if "_kept" in self.__dict__:
            graph._kept = self._kept
        return graph

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

    def __reduce__(self):
        """Pickle (and deepcopy) as a flat table of nodes: pickling the nodes as they are would recurse once per
        node of a chain (a node's inputs inside its state) and exceed Python's recursion limit on deep graphs."""
        return _graph_from_table, _graph_table(self)

    def __str__(self) -> str:
        """The graph as IR text (neuronc/ir_text.py), arrays of more than 16 elements elided."""
        from neuronc import ir_text

        return ir_text.to_text(self, elide_arrays_over=16)


class _NodeRef(NamedTuple):
    """A node, in a pickled graph's table, named by its row."""

    row: int


def _graph_table(graph: Graph) -> tuple:
    """(rows, param rows, output rows, name): one row per node, its inputs and any node among its attributes
    named by their rows (a node only an attribute refers to gets a row too)."""
    order = graph.nodes()
    row = {n: i for i, n in enumerate(order)}

    def flat(value):
        if isinstance(value, Node):
            if value not in row:
                row[value] = len(order)
                order.append(value)
            return _NodeRef(row[value])
        return _map_attr(value, flat)

    rows = []
    k = 0
    while k < len(order):  # order grows while attributes name nodes outside the graph
        n = order[k]
        for i in n.inputs:
            if i not in row:
                row[i] = len(order)
                order.append(i)
        attrs = {key: flat(v) for key, v in n.attrs.items()}
        rows.append((n.op, tuple(row[i] for i in n.inputs), n.shape, n.dtype, attrs, n.loc, n.id, n.origin))
        k += 1
    return rows, [row[p] for p in graph.params], [row[o] for o in graph.outputs], graph.name


def _graph_from_table(rows: list, params: list, outputs: list, name: str) -> Graph:
    nodes = [Node(op, (), shape, dtype, attrs, loc, id_, origin) for op, _, shape, dtype, attrs, loc, id_, origin in rows]

    def resolve(value):
        return nodes[value.row] if isinstance(value, _NodeRef) else _map_attr(value, resolve)

    for n, (_, inputs, *_rest) in zip(nodes, rows):
        n.inputs = tuple(nodes[i] for i in inputs)
        n.attrs = {key: resolve(v) for key, v in n.attrs.items()}
    return Graph([nodes[i] for i in params], [nodes[i] for i in outputs], name)


def _map_attr(value, fn):
    """`value` with fn applied to each item of its containers (tuples, lists, dicts, named tuples, Steps); leaves
    (arrays, numbers, plans) as they are. Attributes nest a few levels, never once per node of a graph."""
    if isinstance(value, Step):
        return value._replace(attrs={k: fn(v) for k, v in value.attrs.items()}) if value.attrs else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(v) for v in value))
    if isinstance(value, (tuple, list)):
        mapped = [fn(v) for v in value]
        return mapped if isinstance(value, list) else value if all(a is b for a, b in zip(mapped, value)) else tuple(mapped)
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    return value


def depends_on(x: Node, target: Node, limit: int = 4096) -> bool:
    """Whether `x` is `target` or reads it, directly or not (walked up to `limit` nodes; past it, assumed so)."""
    seen, stack = set(), [x]
    while stack:
        y = stack.pop()
        if y is target:
            return True
        if y in seen:
            continue
        seen.add(y)
        if len(seen) > limit:
            return True
        stack.extend(y.inputs)
    return False


def unreshaped(node: Node) -> Node:
    """The value a chain of RESHAPEs (aliases of the same bytes) starts from."""
    while node.op is Op.RESHAPE:
        node = node.inputs[0]
    return node


def node(op: Op, inputs: Iterable[Node], shape: Iterable[int], dtype: DType, loc: DebugLoc | None = None,
         **attrs) -> Node:
    """A new node (shape as ints, inputs as a tuple), its attributes given by keyword."""
    return Node(op, tuple(inputs), tuple(int(s) for s in shape), dtype, attrs, loc or DebugLoc())


def splat(value, shape: Iterable[int], dtype: DType, loc: DebugLoc | None = None) -> Node:
    """A CONSTANT of `shape` holding `value` everywhere (a 0-d value: the splat form every pass reads)."""
    return node(Op.CONSTANT, [], shape, dtype, loc, value=np.array(value, dtype.numpy))
