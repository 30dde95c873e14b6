"""Which ops of an FX graph cannot be compiled, found by compiling each distinct use alone.

torch-mlir stops at the first op it cannot lower, and the compiler at the first it cannot
legalise; a user wants all of them at once, with their source lines. Each distinct use of an op
(the op, its operands' dtypes and ranks, its other arguments) becomes a graph of its own, which is
lowered, imported and, when the caller passes its backend as `accept`, run through the passes and
codegen. All probes run in one child process; if one crashes it, each probe gets a child of its
own, so that a crash is a verdict about one op. An op the caller compiles apart from torch-mlir is not probed: its
verdict is the caller's (`own`; compile_fx's collectives and random draws, `compiler.compiled_apart`). Used by the
compile errors of the frontend, the partition fallback and `neuronc check`.
"""
from __future__ import annotations

import dataclasses
import operator

from neuronc.errors import FrontendCrashError, NeuronCompileError
from neuronc.frontend.isolate import run_isolated
from neuronc.frontend.torch_import import lower, op_name
from neuronc.neff.program import DebugLoc


@dataclasses.dataclass
class UnsupportedOp:
    """An op of a graph that cannot be compiled: its name, why, and the user's line of each use."""

    op: str  # e.g. "aten.sort.default"
    why: str
    places: list  # DebugLoc of each use, in graph order

    def __str__(self) -> str:
        return f"{self.op}: {self.why}; {len(self.places)} use(s), first at {where(self.places[0])}"


def where(loc: DebugLoc) -> str:
    """`file:line in module.path` of a PyTorch source location."""
    return f"{loc.file}:{loc.line}" + (f" in {loc.module_path}" if loc.module_path else "")


def unsupported_ops(gm, locations: dict, accept=None) -> list:
    """Every op of the graph that cannot be compiled, as UnsupportedOp records.

    Each distinct use (op, operand dtypes and ranks, other arguments) is probed alone: lowered by
    torch-mlir, imported, and handed to `accept(graph)` (the compiler's passes and codegen, which
    raise NeuronCompileError for what they cannot do) when one is given. The frontend itself only
    knows the import, so `accept` is how the backend's own rules decide what is supported."""
    why = node_verdicts(gm, accept)
    failures: dict = {}
    for node in gm.graph.nodes:
        if why.get(node.name):
            name = op_name(node)
            failures.setdefault(name, UnsupportedOp(name, why[node.name], [])).places.append(locations[node.name])
    return list(failures.values())


def node_verdicts(gm, accept=None, own=None) -> dict:
    """node name -> why it cannot be compiled ("" if it can), for every op of the graph (see unsupported_ops).
    ``own(node)``, when given, is the caller's verdict on an op it compiles apart from torch-mlir (None for the
    others, which are probed)."""
    try:  # all probes in one child process; if one crashes it, again with a child for each
        return run_isolated(_verdicts, gm, accept, _probe, own, what="probing each op alone")
    except FrontendCrashError:
        return _verdicts(gm, accept, _probe_isolated, own)


def _verdicts(gm, accept, probe, own) -> dict:
    """node name -> why it cannot be compiled ("" if it can); one probe per distinct signature."""
    by_signature: dict = {}
    why = {}
    for node in gm.graph.nodes:
        verdict = own(node) if own is not None else None
        if verdict is not None:
            why[node.name] = verdict
        elif node.op == "call_function" and node.target is not operator.getitem and not _valueless(node):
            key = _signature(node)
            if key not in by_signature:
                by_signature[key] = probe(node, accept)
            why[node.name] = by_signature[key]
    return why


def _valueless(node) -> bool:
    """An op that returns nothing (an assertion on metadata): there is nothing to compile."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.returns


def _signature(node) -> tuple:
    """What decides whether a use of an op compiles: the op, its operands' dtypes and ranks, and
    its other arguments (shapes of views, dims of reductions, ...)."""
    import torch
    from torch import fx as torch_fx

    def describe(a):
        if isinstance(a, torch_fx.Node):
            val = a.meta.get("val")
            return ("tensor", str(val.dtype), val.dim()) if isinstance(val, torch.Tensor) else ("value", a.name)
        return repr(a)

    return (node.target, repr(torch_fx.node.map_aggregate(node.args, describe)),
            repr(torch_fx.node.map_aggregate(node.kwargs, describe)))


def _probe(node, accept=None, probe_nodes=None) -> str:
    """Why this node cannot be compiled ("" if it can).

    A node whose value means nothing alone (`empty_strided`, whose contents its readers define)
    is probed again together with the nodes that read it: it is supported if that compiles."""
    probe_nodes = probe_nodes or _probe_in_child
    why = probe_nodes([node], accept)
    users = [u for u in node.users if u.op == "call_function"]
    if why and users and len(users) == len(node.users):
        if not probe_nodes([node, *users], accept):
            return ""
    return why


def _probe_isolated(node, accept) -> str:
    """_probe, with each compilation in a child process of its own: a crash is a verdict."""
    def isolated(nodes, accept):
        try:
            return run_isolated(_probe_in_child, nodes, accept, what="compiling it alone")
        except FrontendCrashError as err:
            return err.message.split(";")[0]

    return _probe(node, accept, isolated)


def _probe_in_child(nodes: list, accept) -> str:
    from neuronc.frontend.stablehlo_import import import_module

    gm, count = _subgraph(nodes)
    try:
        module = lower(gm, "probe")
    except Exception:  # noqa: BLE001 - any failure means torch-mlir cannot lower it
        from neuronc.frontend.linalg_decompositions import NOT_BUILT
        return NOT_BUILT.get(str(nodes[0].target), "torch-mlir cannot lower it to StableHLO")
    try:
        graph = import_module(module, [(f"in{i}", "input") for i in range(count)], {}, "probe", semantics="pytorch")
    except NeuronCompileError as err:
        if not err.problems:
            return err.message
        return f"neuronc has no kernel yet for {', '.join(sorted({p.split(' ')[0] for p in err.problems}))}"
    except Exception as err:  # noqa: BLE001 - e.g. an element type the NeuronCore lacks
        return f"neuronc cannot import it ({err})"
    if accept is None:
        return ""
    try:
        accept(graph.renumbered())
    except NeuronCompileError as err:
        return err.message
    except Exception as err:  # noqa: BLE001 - a pass or kernel that fails on it is a missing lowering
        return f"neuronc fails on it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return ""


def _subgraph(nodes: list):
    """A GraphModule computing `nodes` (in graph order) from placeholders for everything else they
    read, returning the values no node of the set reads. Returns (module, placeholder count)."""
    import torch
    from torch import fx as torch_fx

    graph = torch_fx.Graph()
    mapping: dict = {}

    def arg(a):
        if isinstance(a, torch_fx.Node) and a not in mapping:
            placeholder = graph.placeholder(f"in{sum(n.op == 'placeholder' for n in graph.nodes)}")
            placeholder.meta = dict(a.meta)
            mapping[a] = placeholder
        return mapping[a] if isinstance(a, torch_fx.Node) else a

    for node in nodes:
        new = graph.call_function(node.target, torch_fx.node.map_aggregate(node.args, arg),
                                  torch_fx.node.map_aggregate(node.kwargs, arg))
        new.meta = dict(node.meta)
        mapping[node] = new
    outputs = []
    for node in nodes:
        if any(user in nodes for user in node.users):
            continue
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            for i, v in enumerate(val):
                if isinstance(v, torch.Tensor):
                    item = graph.call_function(operator.getitem, (mapping[node], i))
                    item.meta = {"val": v}
                    outputs.append(item)
        else:
            outputs.append(mapping[node])
    graph.output(tuple(outputs))
    count = sum(n.op == "placeholder" for n in graph.nodes)
    return torch_fx.GraphModule({}, graph), count
