"""Rewrites as named rules run to a fixed point (as tinygrad's pattern matcher and MLIR's greedy rewrite driver).

A rule is a function `(node, inputs) -> replacement or None`, registered with the ops it looks at (`@rule(Op.ADD)`):
`node` is the node as it was, `inputs` its operands as already rewritten, and the replacement a node (a new one or
an existing one, such as an operand) computing the same values. `rewrite(graph, rules, ctx)` offers every node,
operands first, to the rules of its op in order; a replacement is offered to the rules again, and sweeps repeat
until no rule fires. So a pass that simplifies need not be run twice, nor ordered against the others: rules compose.
`ctx.fired` counts the rules that fired, by name (the tests read it).
"""
from __future__ import annotations

import dataclasses
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
    rules = list(rules)
    by_op = {op: [r for r in rules if not r.ops or op in r.ops] for op in Op}
    for _ in range(MAX_SWEEPS):
        fired: list = []
        graph = _sweep(graph, by_op, fired)
        if ctx is not None:
            ctx.fired.update(fired)
        if not fired:
            return graph
    raise NeuronCompileError(f"the rewrite rules {', '.join(r.name for r in rules)} still change the graph after "
                             f"{MAX_SWEEPS} sweeps", hint="a neuronc bug (two rules undo each other): please report it")


def _sweep(graph: ir.Graph, by_op: dict, fired: list) -> ir.Graph:
    def apply(node: Node, inputs: tuple) -> Node | None:
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
                return replacement
        return replacement

    return graph.rewrite(apply)
