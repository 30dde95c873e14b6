"""ATen forms that torch-mlir lowers to StableHLO computing other numbers than eager PyTorch.

A wrong lowering is the worst failure a compiler can have: the program compiles, runs and returns wrong
numbers, silently. benchmarks/opinfo.py found these (each against eager on OpInfo's samples); neuronc's
own decompositions (decompositions.py) rewrite each of them before torch-mlir sees it. Should a graph still
hold one when it reaches torch-mlir (an FX graph traced without neuronc's decomposition table, a table
changed by mistake), it is refused here with the reason, never compiled to wrong numbers. A new wrong
lowering found is added to both: its decomposition, and its form here.
"""
from __future__ import annotations

from neuronc.errors import NeuronCompileError


def _arg(node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _avg_pool_form(node) -> str | None:
    if _arg(node, 6, "divisor_override", None) is not None:
        return "divisor_override is ignored (the window is divided by its size)"
    if _arg(node, 4, "ceil_mode", False):
        return "ceil_mode's last window is divided by another count than eager's"
    return None


def _max_pool3d_form(node) -> str | None:
    if _arg(node, 5, "ceil_mode", False):
        return "ceil_mode pads both sides of the input, which shifts every window"
    return None


def _self_equality_form(node) -> str | None:
    a, b = node.args[0], node.args[1]
    value = a.meta.get("val") if hasattr(a, "meta") else None
    if a is b and value is not None and value.is_floating_point():
        return "x == x of a float tensor is folded to true, which it is not at NaN"
    return None


def _forms() -> dict:
    import torch

    aten = torch.ops.aten
    return {
        aten.avg_pool2d.default: _avg_pool_form,
        aten.avg_pool3d.default: _avg_pool_form,
        aten.max_pool3d_with_indices.default: _max_pool3d_form,
        aten.eq.Tensor: _self_equality_form,
        aten.logcumsumexp.default: lambda node: "log(cumsum(exp(x))) overflows to inf for x above ~88 (float32)",
    }


def refuse_mislowered(gm) -> None:
    """Raise NeuronCompileError naming every node of `gm` whose form torch-mlir lowers wrongly."""
    forms = _forms()
    problems = []
    for node in gm.graph.nodes:
        check = forms.get(node.target) if node.op == "call_function" else None
        why = check(node) if check else None
        if why:
            problems.append(f"{node.target} ({node.name}): torch-mlir's lowering is wrong here: {why}")
    if problems:
        raise NeuronCompileError(
            f"{len(problems)} op(s) of this graph would compile to wrong results through torch-mlir",
            problems=problems,
            hint="trace the graph with neuronc's decompositions (torch.compile(backend='neuron') and "
            "`neuronc compile` do: neuronc.frontend.torch_import.decomposition_table()), which rewrite these "
            "forms into ops lowered correctly",
        )
