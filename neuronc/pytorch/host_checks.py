"""Checks a compiled graph makes on values it computes, run on the host after its program (issue 21).

torch's linear algebra raises on a singular matrix through `aten._linalg_check_errors(info, api_name,
is_matrix=...)` after `linalg.inv`, `linalg.solve`, `lu_factor` and what builds on them. AOTAutograd threads that
call as an ordered effect (`with_effects(token, _linalg_check_errors, info, ...)`): no device work, but an op no
NEFF can hold, so such a graph ran in two pieces with the check on the CPU between them, and not at all with
the fallback disabled. Here the check leaves the graph before it is compiled: its `info` becomes one more output
of the program, and once the program has run the check is made on the host with torch's own function (its
message is eager's), before any output is returned, and so before AOTAutograd applies the graph's input
mutations. Nothing in a functional graph is observable before its outputs, so the error surfaces where eager's
would; the effect token the check consumed is passed on to whatever followed it. A token no op reads any more
(AOTAutograd passes None for it at run time) is marked opaque, so the program neither takes nor makes it
(`torch_import.drop_opaque_values` returns it as it was given).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

CHECKS = (torch.ops.aten._linalg_check_errors.default,)


class EffectToken:
    """The value of an effect-token placeholder no op reads: not a tensor, so the program does not take it."""

    def __repr__(self) -> str:
        return "EffectToken()"


def _is_deferred_check(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.higher_order.with_effects
            and node.args[1] in CHECKS)


def defer(gm: fx.GraphModule) -> tuple:
    """Remove the graph's deferrable checks, appending the values they read to its outputs; returns each check
    as (op, the arguments after the value, keyword arguments), in graph order."""
    checks, values, tokens = [], [], set()
    for node in list(gm.graph.nodes):
        if not _is_deferred_check(node):
            continue
        token, op, value, *rest = node.args
        for user in list(node.users):  # with_effects returns (token, result); the check's result is None
            if user.target is not operator.getitem or user.args[1] != 0:
                raise AssertionError(f"unexpected use of {op}'s effect: {user.format_node()}")
            user.replace_all_uses_with(token)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        tokens.add(token)
        checks.append((op, tuple(rest), dict(node.kwargs)))
        values.append(value)
    for token in tokens:
        if token.op == "placeholder" and all(user.op == "output" for user in token.users):
            token.meta["val"] = EffectToken()
    if checks:
        output = gm.graph.output_node()
        output.args = (tuple(output.args[0]) + tuple(values),)
        gm.graph.lint()
        gm.recompile()
    return tuple(checks)


def after(function, checks: tuple):
    """``function`` (the compiled graph), making ``checks`` on its last outputs and returning the others."""
    if not checks:
        return function
    count = len(checks)

    def checked(*args):
        outputs = function(*args)
        for (op, rest, kwargs), value in zip(checks, outputs[-count:]):
            op(value.cpu(), *rest, **kwargs)
        return outputs[:-count]

    return checked
