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
import time

import numpy as np

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.frontend.isolate import run_isolated
from neuronc.frontend.mislowered import refuse_mislowered
from neuronc.neff.program import DebugLoc

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclasses.dataclass
class ImportedGraph:
    graph: ir.Graph
    stablehlo: str  # the StableHLO module, as text (large constants elided)
    fingerprint: str  # sha256 of the complete module, constants and source locations included
    seconds: dict = dataclasses.field(default_factory=dict)  # time per import stage (see compiler.Compiled)


def decomposition_table(training: bool = False) -> dict:
    """ATen decompositions applied before import: torch-mlir's own table (core ATen and more), plus
    torch's decompositions of ops that torch-mlir cannot lower to StableHLO, plus neuronc's own. ``training``: the
    table for graphs AOTAutograd traces with their backward, where SDPA stays whole for the flash kernels
    (sdpa_training.py)."""
    import torch

    from neuronc.frontend import (bounded_outputs, coverage_lowerings, decompositions, float_semantics,
                                  linalg_decompositions, norm_training, sdpa_training, special_decompositions)
    from torch._decomp import get_decompositions
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    aten = torch.ops.aten
    table = dict(get_decomposition_table())
    table.update(get_decompositions([
        aten.max_pool2d_with_indices_backward,  # CNN training (the forward is neuronc's own)
        aten.native_group_norm, aten.native_group_norm_backward,
        aten.upsample_nearest2d, aten._unsafe_index,
        # found by benchmarks/opinfo.py's whole run: torch's own decompositions, not in torch-mlir's table
        aten.view_copy, aten.permute_copy, aten.narrow_copy, aten.as_strided_copy, aten.unbind_copy,
    ]))
    decompositions.merge_into(table, decompositions.OWN)
    table.update(linalg_decompositions.OWN)
    table.update(special_decompositions.OWN)
    table.update(float_semantics.OWN)
    table.update(bounded_outputs.OWN)
    table.update(coverage_lowerings.OWN)
    table.update(decompositions.defined_elsewhere())
    table.update(decompositions.defined_after_import())
    if training:
        table.update(sdpa_training.kept_in_training(table))
        table.update(norm_training.recomputed_in_backward(table))
    return table


def drop_assertions(gm) -> None:
    """In place: remove torch.export's run-time checks of tensor metadata (a `.to(dtype)` leaves one), which
    check what static shapes and dtypes already guarantee and which torch-mlir cannot lower."""
    import torch

    checks = {torch.ops.aten._assert_tensor_metadata.default}
    dropped = [node for node in gm.graph.nodes if node.target in checks and not node.users]
    for node in dropped:
        gm.graph.erase_node(node)
    if dropped:
        gm.recompile()


def float_comparison_scalars(gm) -> None:
    """In place: a float tensor compared with a Python integer (`x <= 0`: aten.le.Scalar(x, 0)) is compared with
    that number as a float, the value eager compares (the scalar takes the tensor's dtype). torch-mlir folds the
    integer form wrongly on a constant tensor: `torch.full((), 2.5) <= 0` was folded to true (and `> 0` to false),
    a silent wrong result; the float form folds right."""
    import torch

    aten = torch.ops.aten
    comparisons = {aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.eq.Scalar, aten.ne.Scalar}
    changed = False
    for node in gm.graph.nodes:
        if node.target not in comparisons or len(node.args) < 2:
            continue
        value, scalar = node.args[0].meta.get("val"), node.args[1]
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and isinstance(scalar, int)
                and not isinstance(scalar, bool)):
            rounded = float(torch.tensor(scalar, dtype=value.dtype))  # once, to the tensor's dtype
            node.args = (node.args[0], rounded, *node.args[2:])
            changed = True
    if changed:
        gm.recompile()


def wrap_negative_indices(gm) -> None:
    """In place: before each advanced-indexing op (x[i], x[i] = v and their backward), map negative indices
    i to i + size as eager PyTorch does (torch-mlir's lowering reads them as out of bounds)."""
    import torch

    aten = torch.ops.aten
    indexing = {aten.index.Tensor, aten.index_put.default, aten._unsafe_index.Tensor, aten._unsafe_index_put.default}
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in indexing:
            continue
        source, indices = node.args[0], list(node.args[1])
        for dim, index in enumerate(indices):
            if index is None or index.meta["val"].dtype in (torch.bool, torch.uint8):
                continue
            size = source.meta["val"].shape[dim]
            with gm.graph.inserting_before(node):
                negative = gm.graph.call_function(aten.lt.Scalar, (index, 0))
                shifted = gm.graph.call_function(aten.add.Tensor, (index, size))
                wrapped = gm.graph.call_function(aten.where.self, (negative, shifted, index))
            val = index.meta["val"]
            with val.fake_mode:
                metas = (val < 0, val + size, torch.where(val < 0, val + size, val))
            for new, meta in zip((negative, shifted, wrapped), metas):
                new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}, val=meta)
            indices[dim] = wrapped
            changed = True
        node.args = (source, indices, *node.args[2:])
    if changed:
        gm.recompile()


def unsqueeze_scalar_reductions(gm) -> None:
    """In place: a reduction over a dim of a 0-d tensor (`x.sum(0, keepdim=True)` of a scalar, which crashes
    torch-mlir) reduces the same value as a 1-element vector instead, with keepdim off: eager treats a 0-d
    tensor as one element, and the result is 0-d either way."""
    import torch
    from torch import fx as torch_fx

    changed = False
    for node in list(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not node.args or not isinstance(node.args[0], torch_fx.Node):
            continue
        arguments = _ArgumentsByName(node, schema)
        if arguments.names[:1] != ["self"] or "dim" not in arguments.names or "keepdim" not in arguments.names:
            continue
        value = node.args[0].meta.get("val")
        dim = arguments.get("dim")
        if not isinstance(value, torch.Tensor) or value.dim() != 0 or (isinstance(dim, (list, tuple)) and len(dim) > 1):
            continue
        with gm.graph.inserting_before(node):
            vector = gm.graph.call_function(torch.ops.aten.unsqueeze.default, (node.args[0], 0))
        with value.fake_mode:
            vector.meta["val"] = value.unsqueeze(0)
        arguments.put("self", vector)
        if isinstance(dim, int):
            arguments.put("dim", 0)
        elif isinstance(dim, (list, tuple)) and dim:
            arguments.put("dim", [0])
        arguments.put("keepdim", False)
        node.args, node.kwargs = tuple(arguments.args), arguments.kwargs
        changed = True
    if changed:
        gm.recompile()


class _ArgumentsByName:
    """A call's arguments read and replaced by their schema names, wherever they were passed."""

    def __init__(self, node, schema):
        self.schema, self.names = schema, [a.name for a in schema.arguments]
        self.args, self.kwargs = list(node.args), dict(node.kwargs)

    def get(self, name):
        i = self.names.index(name)
        return self.args[i] if i < len(self.args) else self.kwargs.get(name, self.schema.arguments[i].default_value)

    def put(self, name, value) -> None:
        i = self.names.index(name)
        if i < len(self.args):
            self.args[i] = value
        else:
            self.kwargs[name] = value


def node_locations(gm) -> dict:
    """FX node name -> DebugLoc of the user's PyTorch line that created it."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    locations = {}
    # (each a function of its text alone, found once per distinct text: a model's repeated layers repeat them)
    frames: dict = {}  # stack trace -> (file, line) of its innermost frame outside torch itself
    paths: dict = {}  # the innermost module's path as recorded -> as printed
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        where = frames.get(trace)
        if where is None:
            file, line = "", 0
            for f, ln, _fn in _FRAME.findall(trace):
                if not f.startswith(torch_dir):
                    file, line = f, int(ln)  # the innermost frame outside torch itself
            where = frames[trace] = (file, line)
        stack = node.meta.get("nn_module_stack")
        path = str(list(stack.values())[-1][0]) if stack else None
        if path not in paths:
            paths[path] = "" if path is None else _printed_path(path)
        locations[node.name] = DebugLoc(file=where[0], line=where[1], module_path=paths[path], op=op_name(node))
    return locations


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return _printed_path(str(list(stack.values())[-1][0]))


def _printed_path(path: str) -> str:
    """A module path as Dynamo records it ("L['self'].h.0.attn"), as the user writes it ("h.0.attn")."""
    return re.sub(r"^L\['self'\]\.?|^L__self___?", "", path)


def op_name(node) -> str:
    if node.op != "call_function":
        return node.op
    if hasattr(node.target, "_schema"):  # an ATen OpOverload: "aten.addmm.default"
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def check_static_shapes(gm) -> None:
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    dynamic, data_dependent = [], []
    locations = None  # made for the first data-dependent value (a graph of fixed shapes never needs them)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
            found = f"{node.name}: shape {tuple(val.shape)}"
        elif isinstance(val, torch.SymInt | torch.SymBool | torch.SymFloat):
            found = f"{node.name}: symbolic value {val}"
        else:
            continue
        if free_unbacked_symbols(val):
            locations = locations or node_locations(gm)
            data_dependent.append(f"{found} at {locations.get(node.name, '?')}")
        else:
            dynamic.append(found)
    if data_dependent:
        raise NeuronCompileError(
            "this graph turns tensor data into a Python value or a shape (`.item()`, `bool(tensor)`, `.tolist()`, "
            "`nonzero`): a NeuronCore program has fixed shapes and does not stop for the host",
            problems=data_dependent[:10],
            hint="compute the value outside the compiled region (under torch.compile, unless "
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1, that part of the graph runs on the CPU instead)",
        )
    if dynamic:
        raise NeuronCompileError(
            "neuronc compiles one program per input shape, but this graph has dynamic shapes",
            problems=dynamic[:10],
            hint="drop dynamic=True / mark_dynamic / dynamic_shapes; pad or bucket inputs to a few "
            "fixed shapes instead (each shape is compiled once and cached)",
        )


def drop_opaque_values(gm, inputs_returned_as_given: bool = False) -> tuple:
    """Remove, in place, the placeholders holding no tensor nor number (the device-mesh or process-group objects a
    graph of DTensors is given, which torch-mlir cannot type), and the outputs that return them (AOTAutograd saves
    them for the backward graph). With ``inputs_returned_as_given``, also the outputs that return a tensor input
    as it is (a forward graph saving a parameter for its backward): the caller hands back the argument itself, as
    eager does, where the program would copy it. Returns (per original placeholder, whether the program still
    takes it; per original output position returning one, the position among the placeholders of the argument it
    returns)."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    opaque = {n for n in placeholders if n.meta.get("val") is not None
              and not isinstance(n.meta["val"], (torch.Tensor, int, float, bool, torch.SymInt))}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    given = {v for v in values if v in placeholders and v not in opaque} if inputs_returned_as_given else set()
    if not opaque and not given:
        return [True] * len(placeholders), {}
    passed = {i: placeholders.index(v) for i, v in enumerate(values) if v in opaque or v in given}
    output.args = (tuple(v for v in values if v not in opaque and v not in given),)
    for node in opaque:
        if node.users:
            raise NeuronCompileError(f"graph input {node.name} is a {type(node.meta['val']).__name__}, which an op "
                                     "of the graph reads", hint="keep that op outside the compiled region")
        gm.graph.erase_node(node)
    gm.recompile()
    return [n not in opaque for n in placeholders], passed


def placeholders_first(gm) -> None:
    """In place: every placeholder before the first computing node, in their order (the graph's arguments keep
    theirs). A partitioned graph's pieces interleave them with compute; inputs the compiler adds after the last
    placeholder (collective arrivals, random draws) must come before every use."""
    nodes = list(gm.graph.nodes)
    first_compute = next((n for n in nodes if n.op != "placeholder"), None)
    if first_compute is None:
        return
    for node in nodes[nodes.index(first_compute):]:
        if node.op == "placeholder":
            first_compute.prepend(node)


def new_last_placeholder(graph, name: str):
    """A new placeholder after every other: the graph's last input (compile_fx puts the placeholders first)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(next(iter(graph.nodes))):
        return graph.placeholder(name)


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
    """Import a stateless FX graph whose placeholders are `params`: a list of (name, kind). Custom ops whose body
    is an NKI kernel are cut out for torch-mlir and come back as custom kernels (frontend/kernel_calls.py)."""
    from neuronc.frontend import (control_flow, exact_fmod, flex_attention, kernel_calls, repeated_layers,
                                  sdpa_training)

    check_static_shapes(gm)
    control_flow.inline_conditionals(gm)
    refuse_mislowered(gm)
    locations = node_locations(gm)
    outputs = len(_output_values(gm))
    cut = kernel_calls.GraphCut(gm)
    kernel_calls.cut_kernel_calls(cut, locations)
    flex_attention.cut_flex_attention(cut, locations)
    sdpa_training.cut_for_training(cut, locations)
    exact_fmod.cut_float_fmod(cut, locations)
    sites = cut.finish()
    if flex_attention.decompose_flex_attention(gm):  # what was not cut: as ATen ops
        locations = node_locations(gm)
    if sites:
        extra = [n.name for n in gm.graph.nodes if n.op == "placeholder"][len(params):]
        params = list(params) + [(p, "input") for p in extra]
    layers = repeated_layers.find_layers(gm) if os.environ.get("NEURONC_WHOLE_IMPORT") != "1" else None
    if layers is None:
        imported = run_isolated(_import_in_child, gm, params, locations, name)
    else:
        imported = run_isolated(_import_layers_in_child, gm, params, locations, name, layers)
        if isinstance(imported, _LayersImported):
            imported = _assembled(imported, gm, layers, params) or run_isolated(_import_in_child, gm, params,
                                                                                 locations, name)
    if sites:
        imported.graph = kernel_calls.stitch(imported.graph, sites, len(params) - len(extra), outputs)
        imported.fingerprint = hashlib.sha256((imported.fingerprint + kernel_calls.fingerprint(sites)).encode()
                                              ).hexdigest()
    imported.graph.renumbered()
    return imported


def _output_values(gm) -> tuple:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)


def stablehlo_text(gm, name: str = "main") -> str:
    """Only the StableHLO of a graph (for `neuronc hlo`), whether or not neuronc can compile it."""
    from neuronc.frontend import control_flow, flex_attention

    check_static_shapes(gm)
    control_flow.inline_conditionals(gm)
    flex_attention.decompose_flex_attention(gm)
    locations = node_locations(gm)
    return run_isolated(_text_in_child, gm, locations, name)


def _text_in_child(gm, locations, name) -> str:
    try:
        return lower(gm, name).operation.get_asm(large_elements_limit=16)
    except Exception as err:  # noqa: BLE001 - diagnosed op by op
        raise _diagnose(gm, locations, err) from None


def lower(gm, name: str, context=None):
    """torch-mlir: FX graph -> StableHLO module (simplified) with func @name, node names in the locations. `context`:
    an MLIR context to make it in (repeated_layers' skeleton and layer share one: torch-mlir's context costs
    ~0.01 s; one module each, as a module of both functions lowers the second differently)."""
    from torch_mlir import fx, ir as mlir, passmanager
    from torch_mlir.compiler_utils import OutputType
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    from neuronc.frontend.index_put_rows import index_puts_as_rows

    if context is None:
        context = mlir.Context()
        torch_d.register_dialect(context)
    importer = FxImporter(context=context, hooks=_dense_literals())
    drop_assertions(gm)
    float_comparison_scalars(gm)
    wrap_negative_indices(gm)
    index_puts_as_rows(gm)
    unsqueeze_scalar_reductions(gm)
    _tag_locations_with_node_names(importer, context)
    importer.import_stateless_graph(gm.graph, func_name=name)
    # what fx.stateless_fx_import runs after its import (it also makes a context of its own, unused: ~0.01 s)
    module = fx._module_lowering(False, False, OutputType.STABLEHLO, importer.module)
    with module.context:
        passmanager.PassManager.parse(
            "builtin.module(func.func(stablehlo-aggressive-simplification), canonicalize)"
        ).run(module.operation)
    return module


def _import_in_child(gm, params, locations, name) -> ImportedGraph:
    from neuronc.frontend.stablehlo_import import import_module

    seconds, start = {}, time.perf_counter()
    try:
        module = lower(gm, name)
        seconds["import/torch-mlir"] = time.perf_counter() - start
        graph = import_module(module, params, locations, name, semantics="pytorch")
        seconds["import/stablehlo->ir"] = time.perf_counter() - start - seconds["import/torch-mlir"]
    except Exception as err:  # noqa: BLE001 - diagnosed op by op below
        raise _diagnose(gm, locations, err) from None
    start = time.perf_counter()
    complete = module.operation.get_asm(enable_debug_info=True).encode()
    text, fingerprint = module.operation.get_asm(large_elements_limit=16), hashlib.sha256(complete).hexdigest()
    seconds["import/fingerprint"] = time.perf_counter() - start
    return ImportedGraph(graph, text, fingerprint, seconds)


@dataclasses.dataclass
class _LayersImported:
    """What the child returns for a stack of repeated layers: the skeleton's and one layer's IR, with the locations
    their nodes hold (one pickle: the same objects), assembled into the whole graph by the caller. The whole graph
    would pickle node by node, there and back (~2 ms a layer at HF GPT-2's)."""

    skeleton: ir.Graph
    layer: ir.Graph
    locations: dict
    stablehlo: str
    fingerprint: str
    seconds: dict


def _import_layers_in_child(gm, params, locations, name, layers) -> "_LayersImported | ImportedGraph":
    """The skeleton and one layer of the repeated layers lowered and imported (repeated_layers.py); the whole graph
    imported if that fails (the whole import then says why, op by op)."""
    from neuronc.frontend import repeated_layers
    from neuronc.frontend.stablehlo_import import import_module

    seconds, start = {}, time.perf_counter()
    try:
        parts = repeated_layers.split(gm, layers)
        skeleton_module = lower(parts.skeleton, name)
        layer_module = lower(parts.layer, name, skeleton_module.context)
        seconds["import/torch-mlir"] = time.perf_counter() - start
        taken = set(parts.edge.skeleton_inputs)
        inputs = [param for param, p in zip(params, parts.edge.placeholders) if p in taken]
        extra = [(n.name, "input") for n in parts.skeleton.graph.nodes if n.op == "placeholder"][len(inputs):]
        skeleton = import_module(skeleton_module, inputs + extra, locations, name, semantics="pytorch")
        slots = [(n.name, "input") for n in parts.layer.graph.nodes if n.op == "placeholder"]
        layer = import_module(layer_module, slots, locations, name, semantics="pytorch")
        seconds["import/stablehlo->ir"] = time.perf_counter() - start - seconds["import/torch-mlir"]
    except Exception:  # noqa: BLE001 - the whole graph's import reports what fails
        return _import_in_child(gm, params, locations, name)
    start = time.perf_counter()
    modules = (skeleton_module, layer_module)
    complete = b"".join(m.operation.get_asm(enable_debug_info=True).encode() for m in modules)
    complete += repeated_layers.fingerprint_text(layers, locations).encode()
    text = (skeleton_module.operation.get_asm(large_elements_limit=16)
            + f"\n// one copy of the {len(layers.copies)} repeated layers, instantiated per layer in the IR"
            + " (frontend/repeated_layers.py):\n" + layer_module.operation.get_asm(large_elements_limit=16))
    seconds["import/fingerprint"] = time.perf_counter() - start
    return _LayersImported(skeleton, layer, locations, text, hashlib.sha256(complete).hexdigest(), seconds)


def _assembled(parts: _LayersImported, gm, layers, params: list) -> ImportedGraph | None:
    """The whole graph from the child's skeleton and layer (repeated_layers.assemble), or None if that fails: the
    outputs gm has now (with the operands of the ops cut out for torch-mlir, which are stitched back after), its nodes
    taking ids from where they were (renumbered by the caller, as a graph made in the child is)."""
    from neuronc.frontend import repeated_layers

    start, first = time.perf_counter(), ir.next_id()
    try:
        graph = repeated_layers.assemble(parts.skeleton, parts.layer, layers, repeated_layers.boundary(gm, layers),
                                         parts.locations, len(_output_values(gm)), params)
    except Exception:  # noqa: BLE001 - the whole graph's import reports what fails
        return None
    finally:
        ir.rewind_ids(first)
    parts.seconds["import/stablehlo->ir"] += time.perf_counter() - start
    return ImportedGraph(graph, parts.stablehlo, parts.fingerprint, parts.seconds)


def _dense_literal_types() -> dict:
    import torch

    return {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
            torch.uint8: np.uint8}


def _dense_literals():
    """Importer hooks that inline the FX graph's tensor constants (e.g. index tables made by a
    decomposition) as dense elements, which the StableHLO importer reads; torch-mlir's default is a
    dense_resource blob, whose bytes the MLIR python bindings do not expose."""
    from torch_mlir import ir as mlir
    from torch_mlir.extras.fx_importer import FxImporterHooks

    class DenseLiterals(FxImporterHooks):
        def resolve_literal(self, gni, literal, info):
            import torch

            numpy_type = _dense_literal_types().get(literal.dtype) if isinstance(literal, torch.Tensor) else None
            if numpy_type is None:
                return None
            # tolist(): the literal may be a FakeTensor's constant, which refuses .numpy()
            array = np.array(literal.tolist(), numpy_type).reshape(tuple(literal.shape))
            value = mlir.DenseElementsAttr.get(array, type=gni._cc.dtype_to_type(literal.dtype), shape=list(array.shape))
            vtensor = gni._cc.tensor_to_vtensor_type(literal)
            return mlir.Operation.create("torch.vtensor.literal", results=[vtensor], attributes={"value": value}).result

    return DenseLiterals()


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
        return NeuronCompileError(
            "the graph could not be imported, although each of its ops compiles alone "
            f"({type(err).__name__}: {first})",
            hint="a defect of neuronc's import of this combination of ops: please report it with the program "
            "(`neuronc hlo` shows the StableHLO the frontend makes)",
        )
    return NeuronCompileError(
        f"{len(problems)} op(s) of this graph cannot be compiled for the NeuronCore",
        problems=problems,
        hint="rewrite these ops with supported ones, or keep that code outside the compiled region "
        "(torch.compiler.disable)",
    )
