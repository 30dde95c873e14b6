"""FX graphs -> StableHLO (torch-mlir's FX importer) -> neuronc graph IR.

Both entry points of the compiler end here: `torch.compile` hands over AOTAutograd graphs and the
CLI hands over the graph of a `torch.export` ExportedProgram. Parameters and buffers stay
placeholders, so they reach StableHLO as function arguments rather than baked-in constants.

The torch-mlir part runs in a forked child (`isolate.py`): if it crashes, the user's process lives.
Every FX node's source location (file, line, module path) is recorded here and keyed by the node's
name, which the importer writes into the MLIR location of every op it creates from the node; the
StableHLO importer reads it back, so locations survive into the IR and the NEFF's debug info.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.frontend.isolate import run_isolated
from neuronc.neff.program import DebugLoc

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclasses.dataclass
class ImportedGraph:
    graph: ir.Graph
    stablehlo: str  # the StableHLO module, as text (large constants elided)
    fingerprint: str  # sha256 of the complete module, constants and source locations included


def decomposition_table() -> dict:
    """ATen decompositions applied before import: torch-mlir's own table (core ATen and more), and
    ours for what torch-mlir lowers wrongly and PyTorch's table cannot help with (its remainder
    decomposes to prims.remainder, which torch-mlir does not lower)."""
    import torch
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    table = get_decomposition_table()
    for overload in (torch.ops.aten.remainder.Tensor, torch.ops.aten.remainder.Scalar):
        table[overload] = _python_remainder
    return table


def _python_remainder(a, b):
    """torch.remainder is Python's modulo (the divisor's sign); torch-mlir lowers it to
    stablehlo.remainder, C's fmod (the dividend's sign). fmod, moved into the divisor's sign."""
    import torch

    divisor_negative = b < 0
    if not isinstance(b, torch.Tensor):  # torch-mlir lowers fmod.Tensor, not fmod.Scalar
        b = torch.scalar_tensor(b, dtype=a.dtype)
    r = torch.fmod(a, b)
    return torch.where((r != 0) & ((r < 0) != divisor_negative), r + b, r)


def node_locations(gm) -> dict:
    """FX node name -> DebugLoc of the user's PyTorch line that created it."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    locations = {}
    for node in gm.graph.nodes:
        file, line = "", 0
        for f, ln, _fn in _FRAME.findall(node.meta.get("stack_trace") or ""):
            if not f.startswith(torch_dir):
                file, line = f, int(ln)  # the innermost frame outside torch itself
        locations[node.name] = DebugLoc(file=file, line=line, module_path=_module_path(node), op=op_name(node))
    return locations


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return re.sub(r"^L\['self'\]\.?|^L__self___?", "", str(path))


def op_name(node) -> str:
    if node.op != "call_function":
        return node.op
    if hasattr(node.target, "_schema"):  # an ATen OpOverload: "aten.addmm.default"
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def check_static_shapes(gm) -> None:
    import torch

    dynamic = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
            dynamic.append(f"{node.name}: shape {tuple(val.shape)}")
        elif isinstance(val, torch.SymInt):
            dynamic.append(f"{node.name}: symbolic integer {val}")
    if dynamic:
        raise NeuronCompileError(
            "neuronc compiles one program per input shape, but this graph has dynamic shapes",
            problems=dynamic[:10],
            hint="drop dynamic=True / mark_dynamic / dynamic_shapes; pad or bucket inputs to a few "
            "fixed shapes instead (each shape is compiled once and cached)",
        )


def drop_none_outputs(gm) -> list:
    """Remove None outputs (AOTAutograd's gradients of inputs that need none) in place, which
    torch-mlir cannot return. Returns, per original output, its index among the kept ones or None."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    layout, kept = [], []
    for value in values:
        layout.append(None if value is None else len(kept))
        if value is not None:
            kept.append(value)
    if len(kept) != len(values):
        output.args = (tuple(kept),)
        gm.recompile()
    return layout


def import_fx(gm, params: list, name: str = "main") -> ImportedGraph:
    """Import a stateless FX graph whose placeholders are `params`: a list of (name, kind)."""
    check_static_shapes(gm)
    locations = node_locations(gm)
    imported = run_isolated(_import_in_child, gm, params, locations, name)
    imported.graph.renumbered()
    return imported


def stablehlo_text(gm, name: str = "main") -> str:
    """Only the StableHLO of a graph (for `neuronc hlo`), whether or not neuronc can compile it."""
    check_static_shapes(gm)
    locations = node_locations(gm)
    return run_isolated(_text_in_child, gm, locations, name)


def _text_in_child(gm, locations, name) -> str:
    try:
        return lower(gm, name).operation.get_asm(large_elements_limit=16)
    except Exception as err:  # noqa: BLE001 - diagnosed op by op
        raise _diagnose(gm, locations, err) from None


def lower(gm, name: str):
    """torch-mlir: FX graph -> StableHLO module (simplified), with node names in the locations."""
    from torch_mlir import fx, ir as mlir, passmanager
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    context = mlir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    _tag_locations_with_node_names(importer, context)
    module = fx.stateless_fx_import(gm, output_type="stablehlo", fx_importer=importer, model_name=name)
    with module.context:
        passmanager.PassManager.parse(
            "builtin.module(func.func(stablehlo-aggressive-simplification), canonicalize)"
        ).run(module.operation)
    return module


def _import_in_child(gm, params, locations, name) -> ImportedGraph:
    from neuronc.frontend.stablehlo_import import import_module

    try:
        module = lower(gm, name)
        graph = import_module(module, params, locations, name)
    except Exception as err:  # noqa: BLE001 - diagnosed op by op below
        raise _diagnose(gm, locations, err) from None
    complete = module.operation.get_asm(enable_debug_info=True).encode()
    return ImportedGraph(graph, module.operation.get_asm(large_elements_limit=16), hashlib.sha256(complete).hexdigest())


def _tag_locations_with_node_names(importer, context) -> None:
    """Wrap the importer's location of each FX node in a NameLoc carrying the node's name.

    torch-mlir derives locations in `ContextCache.get_node_location` (a slotted class); the
    importer's cache is switched to a subclass that adds the name around torch-mlir's location."""
    from torch_mlir import ir as mlir

    base = type(importer._cc)

    class NamedLocations(base):
        __slots__ = ()

        def get_node_location(self, node):
            loc = base.get_node_location(self, node) or mlir.Location.unknown(context=context)
            return mlir.Location.name(node.name, childLoc=loc, context=context)

    importer._cc.__class__ = NamedLocations


def _diagnose(gm, locations: dict, err: Exception) -> NeuronCompileError:
    """torch-mlir stops at its first failure; probe each distinct op alone to list all of them."""
    from neuronc.frontend.op_probe import unsupported_ops

    problems = [str(op) for op in unsupported_ops(gm, locations)]
    if not problems:
        if isinstance(err, NeuronCompileError):
            return err
        first = str(err).strip().splitlines()[0][:500] if str(err).strip() else type(err).__name__
        problems = [f"{type(err).__name__}: {first}"]
    return NeuronCompileError(
        f"{len(problems)} op(s) of this graph cannot be compiled for the NeuronCore",
        problems=problems,
        hint="rewrite these ops with supported ones, or keep that code outside the compiled region "
        "(torch.compiler.disable)",
    )
