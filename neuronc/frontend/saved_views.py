"""Views of a training graph's inputs are remade in the backward, not saved by the forward.

AOTAutograd's default partitioner saves every forward value the backward reads. For `x @ W.t()` that is `W.t()`,
a view of the parameter: the forward graph returns it, and a compiled program's output is a tensor of its own, so
the forward materialised the transpose of each weight (a strided copy, 20-30 us each for GPT-2's [768, 3072]
weights) only for the backward to transpose it back. The parameter itself is already at hand in the backward
(a graph input); re-applying the view there is free on the host and, in a compiled backward, a layout the
compiler folds into whatever reads it (`permute(permute(W))` is `W`). Inductor's min-cut partitioner recomputes
views for the same reason; this keeps the default partitioner's other choices (which values are saved).

The same goes for the pieces of a split that the backward reads every one of: attention's q, k and v, split out of
the QKV projection and transposed into heads. Saved, each was a strided copy the forward wrote (a program's output
is a tensor of its own); the projection saved instead is as many bytes, and the views remade in the backward are
layouts its readers fold in (the flash kernels read them through their views: passes/kernel_views.py).
"""
from __future__ import annotations

VIEW_OPS = ("permute", "t", "transpose", "view", "_unsafe_view", "unsqueeze", "squeeze", "expand", "alias",
            "split_with_sizes")  # a split's pieces: `getitem`s of it


def _is_input(node) -> bool:
    """A joint graph's primal (a forward input: parameter, buffer or argument), not a tangent."""
    return node.op == "placeholder" and "tangents" not in str(node.target)


def _is_view_op(node) -> bool:
    import operator

    if node.op == "call_function" and node.target is operator.getitem:
        return _is_view_op(node.args[0])
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and packet is not None and packet.__name__ in VIEW_OPS


def _is_split(node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and packet is not None and packet.__name__ == "split_with_sizes"


def _read_in_backward(node, in_backward) -> bool:
    """Whether a backward node reads ``node``, directly or through views."""
    return any(in_backward(u) or (_is_view_op(u) and _read_in_backward(u, in_backward)) for u in node.users)


def _backward_start(graph):
    """The first node of the backward part, as the default partitioner places them: after the last node tagged
    forward or forward input (None: the graph has no backward)."""
    nodes = list(graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n.meta.get("partitioner_tag") == "is_forward" or _is_input(n)),
               default=-1)
    return nodes[last + 1] if last + 1 < len(nodes) and nodes[last + 1].op != "output" else None


def remake_input_views_in_backward(joint_module):
    """In place on AOTAutograd's joint graph, before partitioning: each view (chain) of a forward input, or of a
    split whose every piece a backward node reads, that a backward node reads is copied into the backward, at its
    start, so the forward does not return it. Returns the module."""
    graph = joint_module.graph
    start = _backward_start(graph)
    if start is None:
        return joint_module
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_backward = order[start]

    def in_backward(node):
        return node.op != "output" and order.get(node, first_backward) >= first_backward

    input_views = set()
    for node in graph.nodes:
        if order[node] >= first_backward:
            break
        if _is_view_op(node) and node.args and (_is_input(node.args[0]) or node.args[0] in input_views):
            input_views.add(node)
        elif _is_split(node) and len(node.users) == len(node.args[1]) and \
                all(_read_in_backward(piece, in_backward) for piece in node.users):
            input_views.add(node)  # every piece saved: the split's source is saved instead, as many bytes
    remade: dict = {}

    def remade_view(view, before):
        if view not in remade:
            source = view.args[0]
            base = remade_view(source, before) if source in input_views else source
            with graph.inserting_before(before):
                copy = graph.call_function(view.target, (base, *view.args[1:]), dict(view.kwargs))
            copy.meta = {k: v for k, v in view.meta.items() if k != "partitioner_tag"}
            remade[view] = copy
        return remade[view]

    for view in sorted(input_views, key=order.get):
        readers = sorted((u for u in view.users if u.op != "output" and order.get(u, first_backward) >= first_backward),
                         key=order.get)
        if not readers:
            continue
        copy = remade_view(view, start)  # (views of one split are read in any order)
        for reader in readers:
            reader.replace_input_with(view, copy)
    if remade:
        graph.lint()
        joint_module.recompile()
    return joint_module


def default_partition_remaking_input_views(joint_module, joint_inputs, **kwargs):
    """AOTAutograd's default partition of the joint graph after `remake_input_views_in_backward`."""
    from torch._functorch.partitioners import default_partition

    return default_partition(remake_input_views_in_backward(joint_module), joint_inputs, **kwargs)
