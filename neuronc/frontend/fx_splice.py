"""Splicing a graph traced by make_fx into an FX graph in place of one node (a higher-order op's replacement).

The frontend replaces the higher-order ops torch-mlir cannot lower (FlexAttention's, `torch.cond`) by ATen graphs
traced from their implementation under the graph's fake tensors; these helpers copy such a traced graph into the
graph being compiled, located at the replaced node's source line.
"""
from __future__ import annotations

import operator


def real_constant(tensor):
    """A constant made while tracing under the graph's fake mode (torch.tensor(-inf)), as a real CPU tensor: fake
    tensor mode keeps the value of such small constants."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor):
        if tensor.constant is None:
            raise AssertionError("a constant of a traced graph without a value")
        tensor = tensor.constant
    return tensor.cpu()  # made on the tensors' device (a `neuron` one): the compiler reads its value


def replace_with_traced(gm, node, traced, feeds) -> None:
    """Copy ``traced``'s nodes into ``gm`` before ``node``, its placeholders bound to ``feeds``, point each
    ``getitem(node, i)`` at its i-th output, and erase ``node``."""
    results = insert_traced(gm, node, traced, feeds)
    graph = gm.graph
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] < len(results) and results[user.args[1]] is not None:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise AssertionError(f"unexpected use of {node.name}'s outputs: {list(node.users)}")
    graph.erase_node(node)


def drop_replaced_subgraphs(gm) -> None:
    """After replacing nodes: the graph checked and recompiled, and the subgraph modules no node reads any more
    (the replaced higher-order ops' branches, score_mods and mask_mods) deleted."""
    gm.graph.lint()
    gm.recompile()
    for name, _ in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
            delattr(gm, name)


def insert_traced(gm, node, traced, feeds) -> list:
    """Copy ``traced``'s nodes into ``gm`` before ``node``, its placeholders bound to ``feeds``: its outputs."""
    env = {}
    placeholders = iter(feeds)
    graph = gm.graph
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                results = n.args[0]
            elif n.op == "get_attr":  # a tensor constant of the traced implementation
                name = f"_traced_{node.name}_{n.target}"
                gm.register_buffer(name, real_constant(getattr(traced, n.target)))
                env[n] = graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = graph.node_copy(n, lambda x: env[x])
                device = env[n].kwargs.get("device")
                if device is not None and getattr(device, "type", "cpu") != "cpu":  # only shapes and dtypes matter
                    env[n].kwargs = {**env[n].kwargs, "device": type(device)("cpu")}
                for key in ("stack_trace", "nn_module_stack"):  # located at the user's call of the replaced op
                    if key in node.meta:
                        env[n].meta[key] = node.meta[key]
    return [env[r] if r is not None else None for r in results]
