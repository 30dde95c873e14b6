"""Rewrites as named rules run to a fixed point (as tinygrad's pattern matcher and MLIR's greedy rewrite driver).

A rule is a function `(node, inputs) -> replacement or None`, registered with the ops it looks at (`@rule(Op.ADD)`):
`node` is the node as it was, `inputs` its operands as already rewritten, and the replacement a node (a new one or
an existing one, such as an operand) computing the same values. `rewrite(graph, rules, ctx)` offers every node,
operands first, to the rules of its op in order; a replacement is offered to the rules again, and sweeps repeat
until no rule fires. So a pass that simplifies need not be run twice, nor ordered against the others: rules compose.
`ctx.fired` counts the rules that fired, by name (the tests read it).

A rule must be a function of its node and operands (their operands and attributes: the IR's nodes are immutable)
that makes no node when it returns None; every rule of canonicalize and legalize, the driver's users, was read for
it. Then a sweep after the first is known before it is made up to its first firing: a node the previous sweep
offered with its own operands and kept as it was ("settled") gets no rule again while it has its own operands, and
every node has them until a rule fires. So each later sweep first offers the other nodes, in order, their own
operands; if none fires (the last sweep, which proves the fixed point), the graph is kept without a walk that
rebuilds it; else the sweep is made, taking the first firing's replacement as found (the same rule calls, in the
same order, so the same new nodes and ids).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Iterable

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node, Op

if TYPE_CHECKING:
    from neuronc.passes.context import PassContext

MAX_SWEEPS = 32  # a rule set still changing the graph after this many sweeps loops: a bug in its rules
MAX_REWRITES_PER_NODE = 16


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    ops: frozenset  # the ops it may fire on (every op when empty)
    fn: Callable[[Node, tuple], Node | None]

    def __call__(self, node: Node, inputs: tuple) -> Node | None:
        return self.fn(node, inputs)


def rule(*ops: Op, name: str | None = None) -> Callable[[Callable], Rule]:
    """Decorator: the function as a Rule firing on `ops` (on every op if none), named after it."""
    return lambda fn: Rule(name or fn.__name__, frozenset(ops), fn)


def rewrite(graph: ir.Graph, rules: Iterable[Rule], ctx: PassContext | None = None) -> ir.Graph:
    """`graph` with `rules` applied until none fires (see the module's docstring)."""
    rules = tuple(rules)
    by_op = _rules_by_op(rules)
    settled = None
    for _ in range(MAX_SWEEPS):
        fired: list = []
        graph, settled = _sweep(graph, by_op, fired, settled)
        if ctx is not None:
            ctx.fired.update(fired)
        if not fired:
            return graph
    raise NeuronCompileError(f"the rewrite rules {', '.join(r.name for r in rules)} still change the graph after "
                             f"{MAX_SWEEPS} sweeps", hint="a neuronc bug (two rules undo each other): please report it")


@functools.lru_cache(maxsize=64)
def _rules_by_op(rules: tuple) -> dict:
    """Per op, the rules that may fire on it (made once per rule set: a pass runs on every eager op's graph)."""
    return {op: [r for r in rules if not r.ops or op in r.ops] for op in Op}


def _sweep(graph: ir.Graph, by_op: dict, fired: list, settled: set | None) -> tuple:
    """(the graph swept once, the nodes this sweep offered with their own operands and kept as they were). With
    `settled` (the previous sweep's such nodes), the sweep is first checked on the others (see the module's
    docstring)."""
    kept: set = set()

    def offer(node: Node, inputs: tuple) -> Node | None:
        own = inputs == node.inputs  # (a tuple's == of nodes is identity)
        replacement = None
        for _ in range(MAX_REWRITES_PER_NODE):
            for r in by_op[node.op]:
                result = r.fn(node, inputs)
                if result is not None and result is not node:
                    fired.append(r.name)
                    replacement = node = result
                    inputs = result.inputs
                    break
            else:
                if replacement is None and own:
                    kept.add(node)
                return replacement
        return replacement

    if settled is None:
        return graph.rewrite(offer), kept
    first = None  # (the first node a rule fires on, its replacement)
    for node in graph.nodes():
        if node not in settled:
            replacement = offer(node, node.inputs)
            if replacement is not None:
                first = node, replacement
                break
    if first is None:  # no rule fires: the sweep would keep every node
        return graph.unchanged(), settled | kept
    known = settled | kept

    def apply(node: Node, inputs: tuple) -> Node | None:
        if node is first[0] and inputs == node.inputs:  # (every node before it was kept: its own operands)
            return first[1]
        if node in known and inputs == node.inputs:
            kept.add(node)
            return None
        return offer(node, inputs)

    return graph.rewrite(apply), kept
