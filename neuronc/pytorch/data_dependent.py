"""Graphs whose sizes depend on tensor data (`nonzero`, `masked_select`, `x[mask]`, `.item()`, `tensor_split` by a
tensor), run on the device in stages.

Dynamo captures these ops with unbacked sizes (a size known only once the data is); a NEFF has static shapes. So,
as a compiler for a static-shape device does, the graph is traced again with each such op in a bounded form
(`frontend/bounded_outputs.py`: the result padded to the input's size, plus the count), which leaves one place
where a size is born: a read of one number from a tensor (`aten._local_scalar_dense`, what `.item()` is). The graph
is split there: the head (everything that does not depend on a read value) is one static program; the host reads
the values (a device -> host read of one integer each, as `.item()` does); the tail is specialised on those values
and compiled per distinct value, by `dynamic_shapes.PerShapeGraphs` (the machinery that compiles graphs with
symbolic sizes per concrete signature), split again if it reads more. Outputs of the tail that are slices of its
inputs (a bounded result cut to its count) are taken on the host as views, without a program: a graph that ends in
`nonzero` compiles once whatever the count.

Nothing runs on the CPU: the head and the tails are NEFFs. Distinct values are capped as shapes are
(``TORCH_NEURONX_MAX_SHAPES_PER_GRAPH``); beyond it a tail is an error when the CPU fallback is disabled, else it
runs eagerly with one warning.
"""
from __future__ import annotations

import torch
from torch import fx

from neuronc.errors import NeuronCompileError
from neuronc.pytorch.dynamic_shapes import MAX_SHAPES_VARIABLE, PerShapeGraphs

aten = torch.ops.aten
READ = aten._local_scalar_dense.default  # a number read from a tensor: where a data-dependent size is born
HOST_VIEWS = (aten.slice.Tensor, aten.narrow.default)  # a tail output cut from an input: taken on the host


def has_unknown_sizes(gm: fx.GraphModule) -> bool:
    """Whether an AOTAutograd graph has sizes or values that depend on tensor data (unbacked symbols), in its
    body or in its inputs (a backward graph takes the forward's data-dependent sizes)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    values = (n.meta.get("val") for n in gm.graph.nodes)
    return any(free_unbacked_symbols(val) for val in values
               if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))
               or (isinstance(val, torch.Tensor) and not _concrete(val)))


def _concrete(tensor: torch.Tensor) -> bool:
    """Whether a tensor's sizes, strides and offset are all ints (a strided tensor's: the only places
    free_unbacked_symbols looks for a symbol in a tensor), so it has no symbol; asked first, as it is about 4x
    cheaper (a layer of HF GPT-2: 0.3 ms against 1 ms)."""
    return (tensor.layout is torch.strided and all(type(s) is int for s in tensor.size())
            and all(type(s) is int for s in tensor.stride()) and type(tensor.storage_offset()) is int)


def data_dependent_graph(gm: fx.GraphModule, compile_static) -> PerShapeGraphs:
    """A callable of ``gm``'s arguments that runs it in stages (see the module docstring); ``compile_static``
    compiles a graph of static shapes to a callable of a list of its arguments (the backend's boxed path)."""
    return _per_value(gm, compile_static, "graph with data-dependent sizes")


def _per_value(gm, compile_static, name: str) -> PerShapeGraphs:
    def compile_concrete(concrete_gm, tensors):
        from neuronc.pytorch.partition import fallback_disabled

        try:
            traced = _retrace(concrete_gm, tensors)
        except Exception as err:  # noqa: BLE001 - a graph torch cannot trace again: as before this module
            if fallback_disabled():
                raise NeuronCompileError(f"this graph's data-dependent sizes could not be put in bounded form "
                                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                                         hint="compute the value outside the compiled region") from err
            whole = compile_static(concrete_gm)  # the static path's CPU fallback of the ops it cannot compile
            return lambda *args: whole(list(args))
        return _stages(traced, tensors, compile_static)

    graphs = PerShapeGraphs(gm, compile_concrete, graph_name=name)
    graphs.beyond_limit = _beyond_limit(graphs)
    return graphs


def _beyond_limit(graphs: PerShapeGraphs):
    def run(args):
        from neuronc.pytorch.partition import fallback_disabled

        if fallback_disabled():
            raise NeuronCompileError(
                f"a {graphs.graph_name} has met {graphs.limit} distinct values of its data-dependent sizes, each "
                "compiled to its own program", problems=[f"values read: {len(graphs.programs)} signatures"],
                hint=f"raise {MAX_SHAPES_VARIABLE}, compute the size outside the compiled region, or use a fixed "
                     "bound (torch.nonzero_static, a mask multiplied in instead of selected)")
        return graphs.eagerly(args)
    return run


def _fake_inputs(mode, tensors) -> list:
    """Fake tensors of ``tensors``' shapes, strides and dtypes, on the CPU (the compiler needs no more)."""
    with mode:
        return [torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu") for t in tensors]


def _retrace(gm: fx.GraphModule, tensors) -> fx.GraphModule:
    """``gm`` (its scalar arguments inlined) traced again on its concrete input shapes, with the ops whose result
    size depends on data in bounded form: every size is then static except those computed from a READ."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from neuronc.frontend.bounded_outputs import BOUNDED_FORMS
    from neuronc.frontend.torch_import import decomposition_table

    table = decomposition_table()
    for op, bounded in BOUNDED_FORMS.items():
        table[op] = _first_of(bounded, table.get(op))
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = _fake_inputs(mode, tensors)
    with mode, fx_traceback.preserve_node_meta():  # the user's source lines stay on the nodes, for errors
        traced = make_fx(fx.Interpreter(gm).run, decomposition_table=table)(*fakes)
    _drop_checks(traced)
    _empties_made_anew(traced)
    return traced


def _empties_made_anew(gm: fx.GraphModule) -> None:
    """In place: every empty tensor the graph uses (a count of 0 cuts a bounded result to nothing) is made by an
    op of no input, so that no slice or gather to nothing is left to compile: it holds no value to compute."""
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if (node.op not in ("placeholder", "call_function") or not isinstance(val, torch.Tensor)
                or not isinstance(val.numel(), int) or val.numel() != 0 or not node.users
                or node.target is aten.full.default):
            continue
        with gm.graph.inserting_after(node):
            empty = gm.graph.call_function(aten.full.default, (list(val.shape), 0),
                                           {"dtype": val.dtype, "device": torch.device("cpu")})
        empty.meta["val"] = val
        node.replace_all_uses_with(empty, delete_user_cb=lambda user, made=empty: user is not made)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _first_of(rule, then):
    """A decomposition trying ``rule``, then ``then`` (the table's own), then the op itself."""
    def decompose(*args, **kwargs):
        result = rule(*args, **kwargs)
        if result is NotImplemented and then is not None:
            result = then(*args, **kwargs)
        return result
    return decompose


def _drop_checks(gm: fx.GraphModule) -> None:
    """In place: remove the run-time checks of sizes (`_assert_scalar`, the size facts `torch._check` records:
    a count's bounds, which hold by construction) and the scalar arithmetic only they used. torch-mlir cannot
    lower them; a user's own `torch._check` on a read value is dropped with them (not enforced)."""
    checks = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and (node.target in checks or (
                not node.users and node.target is not READ and not isinstance(node.meta.get("val"), torch.Tensor)
                and _is_scalar_function(node.target))):
            gm.graph.erase_node(node)
    gm.recompile()


def _is_scalar_function(target) -> bool:
    return getattr(target, "__module__", None) == "_operator" or target in (
        aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default)


def _stages(gm: fx.GraphModule, tensors, compile_static):
    """A callable of ``tensors``-like arguments running ``gm`` (static inputs): one static program when nothing
    is read, else head, reads and a tail compiled per read value."""
    reads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is READ]
    if not reads:
        return _static_with_host_views(gm, compile_static)
    dependent = set()
    for node in gm.graph.nodes:
        if node.target is READ or any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    dependent.discard(next(n for n in gm.graph.nodes if n.op == "output"))
    first_reads = [n for n in reads if n.args[0] not in dependent]
    head_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n not in dependent]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    tail_needs = [n for n in head_nodes if any(u in dependent or u is output for u in n.users)]
    read_sources = list(dict.fromkeys(n.args[0] for n in first_reads))
    head = _subgraph(gm, head_nodes, [*read_sources, *tail_needs])
    head_program = _static_with_host_views(head, compile_static)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tail_args = [p for p in placeholders if any(u in dependent or u is output for u in p.users)]
    tail = _tail(gm, first_reads, tail_needs, tail_args, dependent, output)
    tail_graphs = _per_value(tail, compile_static, "graph with data-dependent sizes")
    positions = {p: i for i, p in enumerate(placeholders)}
    source_index = {s: i for i, s in enumerate(read_sources)}

    def run(*args):
        computed = head_program(*args)
        values = [computed[source_index[r.args[0]]].item() for r in first_reads]  # the device -> host reads
        return tail_graphs(*values, *computed[len(read_sources):], *(args[positions[p]] for p in tail_args))
    return run


def _subgraph(gm, nodes, outputs) -> fx.GraphModule:
    """The graph of ``gm``'s placeholders and ``nodes``, returning ``outputs``."""
    graph = fx.Graph()
    env = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph)


def _tail(gm, reads, computed, arguments, dependent, output) -> fx.GraphModule:
    """The nodes depending on a read, taking (read values, head values, gm's own arguments) in that order."""
    graph = fx.Graph()
    env = {}
    for n, read in enumerate(reads):
        env[read] = graph.placeholder(f"read_{n}")
        env[read].meta["val"] = read.meta.get("val")
    for n, node in enumerate(computed):
        env[node] = graph.placeholder(f"head_{n}")
        env[node].meta["val"] = node.meta.get("val")
    for node in arguments:
        env[node] = graph.node_copy(node)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and any(u in dependent for u in node.users):
            env[node] = graph.node_copy(node)
    for node in gm.graph.nodes:
        if node in dependent and node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(fx.map_arg(output.args[0], env.__getitem__))
    return fx.GraphModule(gm, graph)


def _static_with_host_views(gm: fx.GraphModule, compile_static):
    """``gm`` compiled (a graph of static shapes), except its outputs that are slices of its arguments or
    constants, made on the host (views of the argument, no compute); no program if nothing else is left."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    single = not isinstance(values, (tuple, list))
    values = [values] if single else list(values)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    on_host = {i: _host_view(v, placeholders) for i, v in enumerate(values)}
    on_host = {i: view for i, view in on_host.items() if view is not None}
    device_outputs = [v for i, v in enumerate(values) if i not in on_host]
    program = None
    if device_outputs:
        output.args = (tuple(device_outputs),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        program = compile_static(gm)

    def run(*args):
        computed = iter(program(list(args)) if program is not None else ())
        results = [on_host[i](args) if i in on_host else next(computed) for i in range(len(values))]
        return results[0] if single else tuple(results)
    return run


def _host_view(value, placeholders):
    """A function of the arguments making ``value`` on the host, if it is a constant, an argument, a chain of
    slices of one (a view) or empty (an allocation); else None."""
    if not isinstance(value, fx.Node):
        return lambda args: value
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(val.numel(), int) and val.numel() == 0:  # nothing to compute (a count of 0): an empty tensor
        shape, dtype = tuple(val.shape), val.dtype
        return lambda args: torch.empty(shape, dtype=dtype, device=_device_of(args))
    if value.op == "placeholder":
        index = placeholders.index(value)
        return lambda args: args[index]
    if value.op == "call_function" and value.target in HOST_VIEWS and all(
            not isinstance(a, fx.Node) for a in value.args[1:]):
        source = _host_view(value.args[0], placeholders)
        if source is None or not isinstance(value.args[0], fx.Node):
            return None
        target, rest = value.target, value.args[1:]
        return lambda args: target(source(args), *rest)
    return None


def _device_of(args) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
