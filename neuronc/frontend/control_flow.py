"""`torch.cond` in FX graphs: both branches computed, the results selected by the predicate.

Dynamo and torch.export capture ``torch.cond(pred, true_fn, false_fn, operands)`` as the ``cond`` higher-order op,
each branch a subgraph; torch-mlir lowers neither. A NEFF's instruction streams are static (the NeuronCore's
engines do not branch on data), so each cond is replaced in the FX graph by both branches' ATen ops and one
``aten.where`` per result, as XLA's conditional-to-select does. torch.cond's branches may not mutate their inputs
or anything else, so computing the branch not taken changes no value, only time. A JAX ``lax.cond`` becomes the
same select in the StableHLO importer.
"""
from __future__ import annotations


def inline_conditionals(gm) -> bool:
    """In place: every ``cond`` of ``gm`` (and of its branches) replaced by both branches and a select per result.
    Returns whether there was one."""
    import torch

    cond = torch.ops.higher_order.cond
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is cond]
    if not nodes:
        return False
    from neuronc.frontend import fx_splice

    for node in nodes:
        fx_splice.replace_with_traced(gm, node, *_selected_branches(gm, node))
    fx_splice.drop_replaced_subgraphs(gm)
    return True


def _selected_branches(gm, node):
    """(both branches and a torch.where per result, traced by make_fx; the FX nodes feeding its placeholders)."""
    import torch
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    pred, true_branch, false_branch, operands = node.args
    branches = [getattr(gm, branch.target) for branch in (true_branch, false_branch)]
    for branch in branches:  # a cond inside a branch first
        inline_conditionals(branch)
    feeds = [pred, *operands]

    def selected(p, *xs):
        taken, other = (branch(*xs) for branch in branches)
        return tuple(torch.where(p, a, b) for a, b in zip(taken, other))

    fakes = [n.meta["val"] for n in feeds]
    with detect_fake_mode(fakes):
        traced = make_fx(selected, decomposition_table=decomposition_table())(*fakes)
    return traced, feeds
