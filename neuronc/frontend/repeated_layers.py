"""Repeated layers imported once: a stack of identical blocks (GPT-2's 12 decoder layers) lowered through torch-mlir
and StableHLO -> IR for one copy, then instantiated per layer with that layer's own inputs.

The import is the largest per-layer item of a compile (issue 24): torch-mlir and the StableHLO importer walk every
op of every layer. Here the FX graph is cut into the part before the stack (prefix), the copies, and the part after
(suffix). The test is structural: the copies are consecutive runs of nodes with the same ops, targets, constant
arguments, shapes and dtypes, each reading only graph inputs (its weights), values of the prefix, and values of the
copy just before it; only the last copy's values may be read after the stack. Module metadata is not consulted
except to choose, among equally good cut points, the one where a module of a ModuleList starts. Anything else (no
repetition, a mutating or higher-order op in a copy, a side output read later) is no `Layers`: the caller imports
the whole graph.

Two modules are lowered: the skeleton (prefix + suffix: every original placeholder, one extra placeholder per value
of the last copy the suffix reads, and the prefix's values the copies read as extra outputs) and one copy (its
inputs as placeholders, the values later read as outputs). The IR copy is instantiated per layer (linear, no
recursion), its constants shared as the whole module's canonicalisation shares equal constants, each node located
at its own layer's FX node.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

from neuronc import ir
from neuronc.ir import Op

_MIN_PERIOD = 2  # nodes per copy: a "layer" of one op is not worth its two lowerings
# A stated choice (measured, not hardware): the FX nodes a stack must repeat beyond its first copy to be lowered apart.
# The second lowering costs about 0.03-0.05 s of torch-mlir's fixed work per module (HF GPT-2, docs/performance.md
# issue 24 part 12) against about 0.7 ms per FX node imported, so below ~50 nodes it costs more than it saves (and
# a batch norm's two unsqueezed weights are no layer).
_MIN_REPEATED_NODES = 64
_PERIOD_CANDIDATES = 24  # most frequent distances between equal nodes tried as the period


@dataclasses.dataclass
class Layers:
    """A stack of `len(copies)` copies of the same FX nodes, and how each is wired."""

    copies: list  # per copy, its FX nodes in graph order (copy 0's are the template)
    sources: list  # per copy, per input slot of the template: the FX node it reads (placeholder, prefix or previous copy)
    exports: list  # template indices of the values a copy hands on (to the next copy or the suffix)
    suffix_reads: list  # template indices of the last copy's values read after the stack


def find_layers(gm) -> Layers | None:
    """The longest stack of repeated layers in `gm`'s graph (at least two copies), or None."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op not in ("placeholder", "output")]
    if len(compute) < 2 * _MIN_PERIOD or any(n.op != "call_function" for n in compute):
        return None
    signature_ids: dict = {}
    signature = _Signatures()
    codes = np.array([signature_ids.setdefault(signature(n), len(signature_ids)) for n in compute], np.int64)
    run = _longest_periodic_run(codes)
    if run is None:
        return None
    start, end, period = run
    position = {n: i for i, n in enumerate(compute)}
    crossing = _values_crossing(compute, position)
    cuts = sorted(range(start, start + period),
                  key=lambda q: (crossing[q], not _starts_module(compute, q), q))
    for q in cuts[:3]:
        count = (end - q) // period
        if count < 2 or (count - 1) * period < _MIN_REPEATED_NODES:
            continue
        layers = _wired(compute, position, q, period, count)
        if layers is not None:
            return layers
    return None


def _signature(node) -> tuple:
    """What must agree between two copies of a node: op, target, every non-node argument, result shapes and dtypes."""
    return (str(node.target), _pattern(node.args), _pattern(tuple(sorted(node.kwargs.items()))),
            _value_type(node.meta.get("val")))


class _Signatures:
    """_signature of each node of one graph, the same tuples made with less Python: each target's text made once (a
    layer's nodes call the targets of the layer before it, and `str` of an ATen op is a Python call), the pattern of
    empty kwargs made once, and torch imported once instead of at every _pattern and _value_type call."""

    NO_KWARGS = ("tuple", ())  # _pattern(tuple(sorted({}.items())))

    def __init__(self):
        import torch

        self.node_type, self.tensor_type = torch.fx.Node, torch.Tensor
        self.texts: dict = {}  # id(target) -> (target, its text): the target held, so that its id names nothing else

    def __call__(self, node) -> tuple:
        kept = self.texts.get(id(node.target))
        if kept is None:
            kept = self.texts[id(node.target)] = (node.target, str(node.target))
        kwargs = node.kwargs
        return (kept[1], self.pattern(node.args),
                self.pattern(tuple(sorted(kwargs.items()))) if kwargs else self.NO_KWARGS,
                self.value_type(node.meta.get("val")))

    def pattern(self, value):
        """_pattern(value)."""
        if isinstance(value, self.node_type):
            return "%"
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(self.pattern(v) for v in value))
        return repr(value)

    def value_type(self, value):
        """_value_type(value)."""
        if isinstance(value, self.tensor_type):
            return tuple(value.shape), str(value.dtype)
        if isinstance(value, (tuple, list)):
            return tuple(self.value_type(v) for v in value)
        return type(value).__name__


def _pattern(value):
    import torch

    if isinstance(value, torch.fx.Node):
        return "%"
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_pattern(v) for v in value))
    return repr(value)


def _value_type(value):
    import torch

    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_value_type(v) for v in value)
    return type(value).__name__


def _longest_periodic_run(codes: np.ndarray) -> tuple | None:
    """(start, end, period) of the longest stretch where codes[i] == codes[i + period] (ties: the shorter period),
    covering at least two periods; the periods tried are the commonest distances between equal codes."""
    order = np.argsort(codes, kind="stable")
    gaps = np.diff(order)
    same = codes[order[1:]] == codes[order[:-1]]
    distances, counts = np.unique(gaps[same & (gaps >= _MIN_PERIOD)], return_counts=True)
    best = None
    for period in distances[np.argsort(-counts, kind="stable")][:_PERIOD_CANDIDATES].tolist():
        if 2 * period > len(codes):
            continue
        equal = np.concatenate(([False], codes[:-period] == codes[period:], [False]))
        edges = np.flatnonzero(np.diff(equal.astype(np.int8)))
        starts, ends = edges[::2], edges[1::2]
        k = int(np.argmax(ends - starts))
        length = int(ends[k] - starts[k])
        if length < period:
            continue
        key = (length + period, -period)
        if best is None or key > best[0]:
            best = (key, (int(starts[k]), int(ends[k]) + period, period))
    return None if best is None else best[1]


def _values_crossing(compute: list, position: dict) -> np.ndarray:
    """Per position q: how many computed values made before q are read at or after q (placeholders not counted)."""
    ends = np.zeros(len(compute) + 1, np.int64)
    for a, node in enumerate(compute):
        last = max((position.get(u, len(compute)) for u in node.users), default=a)
        if last > a:  # crosses the cuts before a + 1 ... last
            ends[a + 1] += 1
            ends[min(last + 1, len(compute))] -= 1
    return np.cumsum(ends)[:len(compute)]


_LIST_ITEM = re.compile(r"^(.*?\.\d+)(\.|$)")


def _starts_module(compute: list, q: int) -> bool:
    """Whether node q is the first of an item of a module list (`blocks.3`): the metadata's hint, a tie-breaker."""
    from neuronc.frontend.torch_import import _module_path

    here = _LIST_ITEM.match(_module_path(compute[q]))
    return q > 0 and here is not None and not _module_path(compute[q - 1]).startswith(here.group(1) + ".") \
        and _module_path(compute[q - 1]) != here.group(1)


def _inputs(node) -> list:
    import torch

    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _wired(compute: list, position: dict, q: int, period: int, count: int) -> Layers | None:
    """Layers starting at position q, if every copy reads what the template reads, copy for copy; else None."""
    copies = [compute[q + k * period:q + (k + 1) * period] for k in range(count)]
    if any(not _pure(n) for n in copies[0]):
        return None
    copy_of = {n: (k, i) for k, nodes in enumerate(copies) for i, n in enumerate(nodes)}
    slots: dict = {}  # copy 0's external input -> its slot
    for n in copies[0]:
        for a in _inputs(n):
            if a not in copy_of:
                slots.setdefault(a, len(slots))
    sources = [list(slots)]
    exports = set()
    for k in range(1, count):
        read: dict = {}  # slot -> what copy k reads there
        for t, n in zip(copies[0], copies[k]):
            for a0, a in zip(_inputs(t), _inputs(n)):
                if a0 in copy_of:  # inside the template: the same node of this copy
                    if copy_of.get(a) != (k, copy_of[a0][1]):
                        return None
                    continue
                if _value_type(a.meta.get("val")) != _value_type(a0.meta.get("val")):
                    return None
                where = copy_of.get(a)
                if where is not None:
                    if where[0] != k - 1:  # a value of an earlier copy than the one before: read later
                        return None
                    exports.add(where[1])
                elif a.op != "placeholder" and position[a] >= q:
                    return None
                if read.setdefault(slots[a0], a) is not a:
                    return None
        sources.append([read[s] for s in range(len(slots))])
    suffix_reads = set()
    for k, nodes in enumerate(copies):
        for i, n in enumerate(nodes):
            for user in n.users:
                at = copy_of.get(user)
                if at is None and k == count - 1:
                    suffix_reads.add(i)
                elif at is None or at[0] not in (k, k + 1):
                    return None
    for k in range(1, count):  # each copy reads its predecessor's values at the same positions as the others
        read = {copy_of[a][1] for a in sources[k] if copy_of.get(a, (-1,))[0] == k - 1}
        if read != {copy_of[a][1] for a in sources[1] if copy_of.get(a, (-1,))[0] == 0}:
            return None
    return Layers(copies, sources, sorted(exports | suffix_reads), sorted(suffix_reads))


def _pure(node) -> bool:
    """An op without side effects whose result is a value: ATen ops that mutate nothing, and getitem."""
    import operator

    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable


@dataclasses.dataclass
class Boundary:
    """Where the stack meets the rest of the graph: what `assemble` joins the two imported graphs by."""

    placeholders: list  # the original graph's placeholders, in order
    skeleton_inputs: list  # those the skeleton takes: all but the ones only the copies read (the layers' weights)
    prefix_outputs: list  # FX nodes the skeleton returns after the original outputs (the copies read them)
    suffix: list  # the FX nodes after the copies


def boundary(gm, layers: Layers) -> Boundary:
    """The stack's boundary in `gm` (the same FX nodes in the process that imports and the one that assembles)."""
    in_copies = {n for nodes in layers.copies for n in nodes}
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    return Boundary(placeholders, [p for p in placeholders if not p.users or any(u not in in_copies for u in p.users)],
                    list(dict.fromkeys(a for sources in layers.sources for a in sources
                                       if a.op != "placeholder" and a not in in_copies)),
                    [n for n in nodes[nodes.index(layers.copies[-1][-1]) + 1:] if n.op != "output"])


@dataclasses.dataclass
class SplitGraphs:
    """The two FX graphs lowered instead of the whole one."""

    skeleton: object  # GraphModule (a lazy one: see split): prefix + suffix
    layer: object  # GraphModule (lazy): one copy
    edge: Boundary


def split(gm, layers: Layers) -> SplitGraphs:
    """The skeleton and the template copy as FX graph modules (gm itself is not changed). They are only lowered, and
    torch-mlir reads a module's graph, never its Python code: so they are torch's lazy graph modules, which generate
    that code only when it is read or the module called (the code of both cost 29 ms at HF GPT-2's 12 layers, every
    bit of it per-layer growth: one layer is imported whole; issue 24)."""
    import torch
    from torch.fx._lazy_graph_module import _LazyGraphModule

    in_copies = {n for nodes in layers.copies for n in nodes}
    last = layers.copies[-1]
    edge = boundary(gm, layers)
    prefix_outputs = edge.prefix_outputs

    skeleton = torch.fx.Graph()
    env: dict = {}
    for n in edge.skeleton_inputs:  # (a function argument costs torch-mlir and the importer: ~1 ms a layer of GPT-2)
        env[n] = skeleton.node_copy(n, env.__getitem__)
    for i in layers.suffix_reads:  # the last copy's values, as inputs of the suffix
        stand_in = skeleton.placeholder(f"{last[i].name}_from_layers")
        stand_in.meta = dict(last[i].meta)
        env[last[i]] = stand_in
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in in_copies:
            continue
        if n.op == "output":
            values = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            skeleton.output(tuple(torch.fx.node.map_arg(tuple(values) + tuple(prefix_outputs), env.__getitem__)))
            continue
        env[n] = skeleton.node_copy(n, env.__getitem__)

    layer = torch.fx.Graph()
    env = {}
    for s, a in enumerate(layers.sources[0]):
        env[a] = layer.placeholder(f"layer_input_{s}")
        env[a].meta = dict(a.meta)
    for n in layers.copies[0]:
        env[n] = layer.node_copy(n, env.__getitem__)
    layer.output(tuple(env[layers.copies[0][i]] for i in layers.exports))
    return SplitGraphs(_LazyGraphModule(gm, skeleton), _LazyGraphModule(gm, layer), edge)



def assemble(skeleton: ir.Graph, layer: ir.Graph, layers: Layers, edge: Boundary, locations: dict,
             outputs: int, params: list) -> ir.Graph:
    """The IR of the whole graph from the skeleton's and the template copy's: the copy instantiated per layer with
    its own inputs and source locations, the last copy's values put in place of the skeleton's stand-ins.
    `outputs`: how many outputs the original graph has (the skeleton's further outputs are the prefix's values);
    `locations`: the DebugLoc objects the two graphs' nodes hold (a copy's nodes are located by identity); `params`:
    (name, kind) of each placeholder, as the whole graph's import takes them."""
    param_of = dict(zip(edge.skeleton_inputs, skeleton.params))
    slot_of = {a: s for sources in layers.sources for s, a in enumerate(sources) if a.op == "placeholder"}
    for index, p in enumerate(edge.placeholders):  # each graph input as the whole graph's import makes it
        if p in param_of:  # (named and kinded by the skeleton's import: numbered among the skeleton's inputs)
            param_of[p].attrs["index"] = index
        else:  # read by the copies alone: typed as the layer's import typed it
            slot, (name, kind) = layer.params[slot_of[p]], params[index]
            param_of[p] = ir.node(Op.PARAMETER, [], slot.shape, slot.dtype, None, index=index, name=name, kind=kind)
    prefix_value = dict(zip(edge.prefix_outputs, skeleton.outputs[outputs:]))
    copy_of = {n: (k, i) for k, nodes in enumerate(layers.copies) for i, n in enumerate(nodes)}
    export_position = {i: e for e, i in enumerate(layers.exports)}

    def value_of(a, handed_on: list) -> ir.Node:
        if a.op == "placeholder":
            return param_of[a]
        if a in copy_of:
            return handed_on[export_position[copy_of[a][1]]]
        return prefix_value[a]

    template = layer.nodes()
    slots = layer.params
    same_for_all = {slots[s]: value_of(a, []) for s, a in enumerate(layers.sources[0])
                    if all(sources[s] is a for sources in layers.sources) and a not in copy_of}
    suffix_locs = {id(locations[n.name]) for n in edge.suffix}
    common = _CommonValues(skeleton, suffix_locs)
    shared = common.of_template(template, same_for_all)
    template_index = {id(locations[n.name]): i for i, n in enumerate(layers.copies[0])}
    handed_on: list = []  # the previous copy's exported IR values
    for k, nodes in enumerate(layers.copies):
        inputs = [value_of(a, handed_on) for a in layers.sources[k]]
        loc_of = [locations[n.name] for n in nodes]
        made: dict = {}
        for t in template:
            if t in shared:
                made[t] = shared[t]
            elif t.op is Op.PARAMETER:
                made[t] = inputs[t.attrs["index"]]
            else:
                new = object.__new__(ir.Node)
                new.__dict__.update(t.__dict__)
                new.inputs = tuple(made[i] for i in t.inputs)
                new.attrs, new.id, new.origin = dict(t.attrs), next(ir._ids), -1
                i = template_index.get(id(t.loc))
                new.loc = t.loc if i is None else loc_of[i]
                made[t] = new
        handed_on = [made[o] for o in layer.outputs]
    first_stand_in = len(edge.skeleton_inputs)
    replaced = {skeleton.params[first_stand_in + j]: handed_on[export_position[i]]
                for j, i in enumerate(layers.suffix_reads)}
    whole = skeleton.rewrite(lambda node, inputs: replaced.get(node) or common.suffix_node(node, inputs))
    for node in whole.nodes():
        node.origin = -1  # value numbers of neither module are the whole module's (`neuronc bisect` compiles whole)
    return ir.Graph([param_of[p] for p in edge.placeholders], whole.outputs[:outputs], whole.name)


class _CommonValues:
    """The values every copy computes alike (from constants and from inputs all copies read), one node each, as
    MLIR's CSE leaves them in the whole module: the first in program order kept, with its location (the prefix's,
    else the first copy's, else the suffix's)."""

    def __init__(self, skeleton: ir.Graph, suffix_locs: set):
        self.by_key: dict = {}
        self.suffix_locs = suffix_locs  # the suffix's nodes are keyed after the copies (suffix_node)
        for node in skeleton.nodes():
            if node.op is not Op.PARAMETER and id(node.loc) not in suffix_locs:
                self.by_key.setdefault(_key(node, node.inputs), node)

    def of_template(self, template: list, same_for_all: dict) -> dict:
        """Template node -> the one node every copy uses, for the template's nodes that read only constants and the
        inputs every copy is given alike (`same_for_all`: template parameter -> that input)."""
        shared = dict(same_for_all)
        for t in template:
            if t.op is Op.PARAMETER or not all(i in shared for i in t.inputs):
                continue
            inputs = tuple(shared[i] for i in t.inputs)
            key = _key(t, inputs)
            kept = self.by_key.get(key)
            if kept is None:
                kept = self.by_key[key] = t if inputs == t.inputs else ir.with_inputs(t, inputs)
            shared[t] = kept
        return shared

    def suffix_node(self, node: ir.Node, inputs: tuple) -> ir.Node | None:
        """For Graph.rewrite of the skeleton: a node of the suffix that a copy (or the suffix) computed before, else
        None."""
        if node.op is Op.PARAMETER or id(node.loc) not in self.suffix_locs:
            return None
        key = _key(node, inputs)
        kept = self.by_key.get(key)
        if kept is None:
            self.by_key[key] = ir.with_inputs(node, inputs)
            return self.by_key[key]
        return kept


def _key(node: ir.Node, inputs: tuple) -> tuple:
    return node.op, tuple(map(id, inputs)), node.shape, node.dtype, tuple(
        (name, _hashable(value)) for name, value in sorted(node.attrs.items()))


def _hashable(value):
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype.str, value.tobytes()
    if isinstance(value, (tuple, list)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _hashable(v)) for k, v in sorted(value.items()))
    return repr(value)


def fingerprint_text(layers: Layers, locations: dict) -> str:
    """What the two modules' text does not say: how the copies are wired and where each copy's nodes are."""
    index = {n: i for i, n in enumerate(itertools.chain.from_iterable(layers.copies))}
    wiring = [[(a.name if a not in index else index[a]) for a in sources] for sources in layers.sources]
    where = [locations[n.name].key() for nodes in layers.copies[1:] for n in nodes]
    return repr((len(layers.copies), layers.exports, layers.suffix_reads, wiring, where))
