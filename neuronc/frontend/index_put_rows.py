"""x[:, ..., idx] = v along one inner dim, as a scatter of whole rows of a 2-D table: what torch-mlir lowers well.

torch-mlir lowers an index_put whose indices start with Nones (Hugging Face's static KV cache: ``k.index_copy_(2,
pos, k_new)`` is an index_put at ``[None, None, pos]``) by spelling out every element's full coordinates: an index
vector per element (a concatenate and a view per coordinate), a bounds check and a linear offset per element, and
a scatter of single elements. Seen as the table ``x.reshape(R * S, W)`` (R the product of the dims before the
indexed one, S its size, W the product of those after it), the same update writes the whole rows ``r * S + i``,
W elements each: an index_put at a leading index, which lowers to a scatter of rows (passes/indexing.py).

An index outside [0, S) (negative ones are already wrapped, torch_import.wrap_negative_indices) must not land in
another row block: its rows become R * S, past the table's end, which the scatter refuses at run time as it
refuses any index out of bounds (eager PyTorch raises too).
"""
from __future__ import annotations

import math


def index_puts_as_rows(gm) -> None:
    """In place: every index_put of one 1-D index at an inner dim, with values of the indexed shape, as the same
    index_put on the rows of a 2-D table."""
    import torch

    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.target in (aten.index_put.default, aten._unsafe_index_put.default) and _one_inner_index(node):
            _as_rows(gm.graph, node)
            changed = True
    if changed:
        gm.recompile()


def _one_inner_index(node) -> bool:
    import torch

    x, indices, values = node.args[:3]
    shape, dims = tuple(x.meta["val"].shape), [d for d, i in enumerate(indices) if i is not None]
    if len(dims) != 1 or dims[0] == 0:  # at dim 0 it already is a scatter of rows
        return False
    index = indices[dims[0]].meta["val"]
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        return False
    d = dims[0]
    return tuple(values.meta["val"].shape) == shape[:d] + (index.shape[0],) + shape[d + 1:]


def _as_rows(graph, node) -> None:
    import torch

    aten = torch.ops.aten
    x, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    shape = tuple(x.meta["val"].shape)
    d = next(d for d, i in enumerate(indices) if i is not None)
    index = indices[d]
    blocks, size, width = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:])
    count = index.meta["val"].shape[0]
    fake = x.meta["val"].fake_mode

    def call(target, *args, **kwargs):
        new = graph.call_function(target, args, kwargs)  # a factory op's device: the host's (torch-mlir's)
        arg_vals, kwarg_vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        if "dtype" in kwargs:  # its value on the device of the values it meets (a `neuron` graph's)
            kwarg_vals = {**kwarg_vals, "device": index.meta["val"].device}
        with fake:
            new.meta["val"] = target(*arg_vals, **kwarg_vals)
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        return new

    with graph.inserting_before(node):
        inside = call(aten.bitwise_and.Tensor, call(aten.ge.Scalar, index, 0), call(aten.lt.Scalar, index, size))
        past_end = call(aten.scalar_tensor.default, blocks * size, dtype=index.meta["val"].dtype)
        checked = call(aten.where.self, inside, index, past_end)
        starts = call(aten.arange.start_step, 0, blocks * size, size, dtype=index.meta["val"].dtype)
        rows = call(aten.add.Tensor, call(aten.unsqueeze.default, starts, 1), call(aten.unsqueeze.default, checked, 0))
        table = call(aten.reshape.default, x, [blocks * size, width])
        put = call(node.target, table, [call(aten.reshape.default, rows, [blocks * count])],
                   call(aten.reshape.default, values, [blocks * count, width]), accumulate)
        result = call(aten.reshape.default, put, list(shape))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
