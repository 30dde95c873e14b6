"""FlexAttention in FX graphs: the `flex_attention` / `flex_attention_backward` higher-order ops, as ATen ops.

Dynamo captures ``torch.nn.attention.flex_attention.flex_attention`` as a higher-order op whose ``score_mod`` and
``mask_mod`` are subgraphs, and AOTAutograd's backward graph as ``flex_attention_backward``; torch-mlir lowers
neither. Here each is replaced in the FX graph by the ATen ops of PyTorch's own dense implementation of the op
(``sdpa_dense`` / ``sdpa_dense_backward``, what eager runs on CPU), traced with make_fx through the frontend's
decompositions: the score_mod and mask_mod become elementwise ops over index tensors, the scores a matmul, the
softmax and its backward ordinary ops, all of which neuronc compiles. The forward is then fused by the attention
pass into one flash-attention kernel, the score_mod's steps and the mask inside it (passes/attention.py).
"""
from __future__ import annotations

import operator


def _hops():
    import torch

    hop = torch.ops.higher_order
    return {hop.flex_attention, hop.flex_attention_backward}


def decompose_flex_attention(gm) -> bool:
    """In place: every FlexAttention higher-order op of ``gm`` replaced by its dense ATen implementation. Returns
    whether there was one."""
    import torch.fx

    hops = _hops()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in hops]
    for node in nodes:
        _inline(gm, node, *_dense_graph(gm, node))
    if nodes:
        gm.graph.lint()
        gm.recompile()
        for name, _ in list(gm.named_children()):  # the score_mod / mask_mod subgraphs, now unused
            if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                delattr(gm, name)
    return bool(nodes) and isinstance(gm, torch.fx.GraphModule)


def _dense_graph(gm, node):
    """(the dense implementation of ``node`` traced by make_fx, the FX nodes feeding its placeholders)."""
    import torch
    import torch.fx
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops.flex_attention import sdpa_dense_backward
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.frontend.torch_import import decomposition_table

    feeds: list = []

    def lift(value):
        """Arguments with their tensors replaced by slots of the traced function's inputs."""
        if isinstance(value, torch.fx.Node):
            if value.op == "get_attr":
                return getattr(gm, value.target)
            feeds.append(value)
            return _Slot(len(feeds) - 1)
        if isinstance(value, (tuple, list)):
            return type(value)(lift(v) for v in value)
        return value

    args = lift(node.args)
    impl = _forward if node.target is torch.ops.higher_order.flex_attention else sdpa_dense_backward

    def fill(value, tensors):
        if isinstance(value, _Slot):
            return tensors[value.index]
        if isinstance(value, (tuple, list)):
            return type(value)(fill(v, tensors) for v in value)
        return value

    def dense(*tensors):
        out = impl(*fill(args, tensors))
        return _flat(out)

    fakes = [n.meta["val"] for n in feeds]
    fake_mode = detect_fake_mode(fakes)
    with fake_mode:  # functionalized: the dense backward fills preallocated gradients in place
        traced = make_fx(torch.func.functionalize(dense, remove="mutations"),
                         decomposition_table=decomposition_table())(*fakes)
    return traced, feeds


def _forward(*args):
    """The forward HOP's dense math (sdpa_dense without its final copy into the query's strides: neuronc's
    tensors are dense)."""
    from torch._higher_order_ops.flex_attention import math_attention

    return math_attention(*args)


class _Slot:
    def __init__(self, index: int):
        self.index = index


def _flat(value) -> tuple:
    """The HOP's outputs flattened (the backward's fourth is a tuple of captured buffers' gradients)."""
    out = []
    for v in value:
        if isinstance(v, (tuple, list)):
            out.extend(v)
        else:
            out.append(v)
    return tuple(out)


def _real(tensor):
    """A constant made while tracing under the graph's fake mode (torch.tensor(-inf)), as a real CPU tensor: fake
    tensor mode keeps the value of such small constants."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor):
        if tensor.constant is None:
            raise AssertionError("a FlexAttention constant without a value")
        tensor = tensor.constant
    return tensor.cpu()  # made on the tensors' device (a `neuron` one): the compiler reads its value


def _inline(gm, node, traced, feeds) -> None:
    """Copy ``traced``'s nodes into ``gm`` before ``node``, its placeholders bound to ``feeds``, and point each
    ``getitem(node, i)`` at its i-th output."""
    env = {}
    placeholders = iter(feeds)
    graph = gm.graph
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                results = n.args[0]
            elif n.op == "get_attr":  # a tensor constant of the dense implementation
                name = f"_flex_{node.name}_{n.target}"
                gm.register_buffer(name, _real(getattr(traced, n.target)))
                env[n] = graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = graph.node_copy(n, lambda x: env[x])
                device = env[n].kwargs.get("device")
                if device is not None and getattr(device, "type", "cpu") != "cpu":  # only shapes and dtypes matter
                    env[n].kwargs = {**env[n].kwargs, "device": type(device)("cpu")}
                for key in ("stack_trace", "nn_module_stack"):  # located at the user's flex_attention call
                    if key in node.meta:
                        env[n].meta[key] = node.meta[key]
    results = [env[r] if r is not None else None for r in results]
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] < len(results) and results[user.args[1]] is not None:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise AssertionError(f"unexpected use of {node.name}'s outputs: {list(node.users)}")
    graph.erase_node(node)
