"""Saved `torch.export` programs (`.pt2`): load them safely and import their graph.

The graph of an ExportedProgram already has parameters, buffers and constants lifted to
placeholders; this module keeps them that way and returns their values beside the graph, so the
compiler can store them in the NEFF as weights.
"""
from __future__ import annotations

import os
import warnings
import zipfile

from neuronc.errors import ModelLoadError, NeuronCompileError
from neuronc.frontend.pt2_archive import read_exported_program
from neuronc.frontend.torch_import import ImportedGraph, decomposition_table, import_fx, stablehlo_text
from neuronc.frontend.tensors import to_numpy


def load_exported_program(path):
    """Load a `.pt2` file written by `torch.export.save`, with an error a user can act on, never running
    code from the file (see pt2_archive)."""
    import torch

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"no such file: {path}", hint="check the path; save a model with torch.export.save(ep, path)")
    if os.path.isdir(path) or not zipfile.is_zipfile(path):
        raise ModelLoadError(
            f"{path} is not a saved ExportedProgram (a .pt2 file is a zip archive written by torch.export.save)",
            hint="create it with: ep = torch.export.export(model, example_inputs); torch.export.save(ep, path)",
        )
    try:
        program = read_exported_program(path)
    except zipfile.BadZipFile as err:
        raise ModelLoadError(f"{path} is a damaged zip archive ({err})",
                             hint="the file may be truncated; save it again with torch.export.save") from None
    if not isinstance(program, torch.export.ExportedProgram):
        raise ModelLoadError(f"{path} holds a {type(program).__name__}, not an ExportedProgram")
    return program


def decompose(program):
    with warnings.catch_warnings():  # torch.export's own deprecation noise, not the user's concern
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        program = program.run_decompositions(decomposition_table())
    _drop_baked_inputs(program)
    return program


def is_baked_input(spec) -> bool:
    """An argument torch.export specialised to its value (a bool, int, float, string or None, e.g.
    ``use_cache=False``): the graph holds the value, so it is no input of the compiled program."""
    from torch.export.graph_signature import ConstantArgument, InputKind

    return spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument)


def _drop_baked_inputs(program) -> None:
    """In place: the placeholders of baked arguments leave the graph (torch-mlir would make them scalar
    arguments of the module, which no NEFF input can be)."""
    names = {spec.arg.name for spec in program.graph_signature.input_specs if is_baked_input(spec)}
    graph = program.graph_module.graph
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        if node.users:
            raise NeuronCompileError(f"the program reads its constant argument {node.name!r} as a value",
                                     hint="pass it as a tensor, or leave it out of the exported inputs")
        graph.erase_node(node)
    if names:
        program.graph_module.recompile()


def exported_stablehlo(program, name: str = "main") -> str:
    """The StableHLO module of an ExportedProgram, as text."""
    return stablehlo_text(decompose(program).graph_module, name)


def check_inference_only(program) -> None:
    """.pt2 programs are compiled for inference: refuse one that updates its own state."""
    from torch.export.graph_signature import OutputKind

    specs = program.graph_signature.output_specs
    tokens = [s for s in specs if s.kind == OutputKind.TOKEN]
    if tokens:
        from neuronc.frontend.torch_import import node_locations

        where = node_locations(program.graph_module)
        effects = [f"{n.args[1]} at {where.get(n.name, '?')}" for n in program.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "__name__", "") == "with_effects"]
        raise NeuronCompileError(
            "this program has side effects that torch.export orders with tokens (e.g. linalg's error checks "
            "in torch.linalg.cholesky/inv, or prints); neuronc compiles pure tensor programs",
            problems=effects,
            hint="keep that computation outside the exported model, or use the op's unchecked form",
        )
    mutations = [s for s in specs if s.kind != OutputKind.USER_OUTPUT]
    if mutations:
        raise NeuronCompileError(
            "this program mutates its state (e.g. batch-norm statistics in training mode); neuronc "
            "compiles inference programs from .pt2 files",
            problems=[f"{s.kind.name.lower()}: {s.target}" for s in mutations],
            hint="call model.eval() before torch.export.export",
        )


def import_exported_program(program, name: str = "main"):
    """Returns (ImportedGraph, weights) where weights maps a placeholder name to a numpy array."""
    from torch.export.graph_signature import InputKind

    program = decompose(program)
    check_inference_only(program)
    signature = program.graph_signature
    params, weights = [], {}
    state = dict(program.state_dict)
    state.update(program.constants)
    for spec in signature.input_specs:
        placeholder = spec.arg.name
        if is_baked_input(spec):
            continue
        if spec.kind == InputKind.USER_INPUT:
            params.append((placeholder, "input"))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            params.append((spec.target, "weight"))
            distinct, shape = distinct_elements(state[spec.target])
            if shape is not None:
                broadcast_placeholder(program.graph_module, placeholder, shape, distinct.shape)
            weights[spec.target] = to_numpy(distinct)
        else:
            raise NeuronCompileError(f"unsupported input kind {spec.kind.name} ({placeholder})")
    imported: ImportedGraph = import_fx(program.graph_module, params, name)
    return imported, weights


def distinct_elements(tensor):
    """(the distinct elements of ``tensor``, the shape to broadcast them to) when its strides repeat elements
    (stride 0, as ``expand`` makes), else (``tensor``, None): a 1 x 4 buffer expanded to 2^30 x 4 stays 16
    bytes, in the host's memory and in the NEFF, and becomes a broadcast in the graph."""
    repeated = [size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride())]
    if not any(repeated):
        return tensor, None
    index = tuple(slice(0, 1) if r else slice(None) for r in repeated)
    return tensor.detach()[index], tuple(tensor.shape)


def broadcast_placeholder(gm, name: str, shape: tuple, stored_shape) -> None:
    """In place: placeholder ``name`` holds ``stored_shape`` and its users read it broadcast to ``shape``."""
    import torch

    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)
    val = placeholder.meta["val"]
    with gm.graph.inserting_after(placeholder):
        broadcast = gm.graph.call_function(torch.ops.aten.expand.default, (placeholder, list(shape)))
    placeholder.replace_all_uses_with(broadcast, delete_user_cb=lambda user: user is not broadcast)
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    with val.fake_mode:
        stored = torch.empty(tuple(stored_shape), dtype=val.dtype)
        placeholder.meta["val"], broadcast.meta["val"] = stored, stored.expand(shape)
    for node in (placeholder, broadcast):  # torch-mlir types a node by its tensor_meta first
        node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
    gm.recompile()
