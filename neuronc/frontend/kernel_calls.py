"""Custom ops whose body is an NKI kernel, in FX graphs: cut out before torch-mlir, put back as kernels after.

torch-mlir lowers ATen ops to StableHLO; a custom op (``torch.library.custom_op``) is opaque to it. For each call
of a custom op whose body calls an ``@nki.jit`` kernel (found by running the body on the node's fake tensors
while ``neuronc.nki.recording_calls`` is on: the kernel is traced and the call recorded, nothing runs), the FX
graph is cut (:func:`cut_kernel_calls`): the kernel's inputs become extra graph outputs and its outputs extra
graph inputs, so torch-mlir sees only ATen ops. Once the StableHLO is imported, :func:`stitch` joins the graph
again: each call becomes an ``Op.CUSTOM_KERNEL`` node reading the values that fed the extra outputs, and the
extra inputs become that node's outputs (``Op.KERNEL_OUTPUT`` for the second and later). The compiler's passes
see one graph, and the kernel is scheduled with the compiler's own kernels in one NEFF.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.frontend.tensors import torch_dtype
from neuronc.neff.program import DebugLoc


@dataclasses.dataclass
class CallSite:
    """An op cut out of the graph: which extra outputs feed its inputs, which extra inputs stand for its outputs,
    and how it comes back (``build``: its IR inputs -> one IR node per output)."""

    inputs: list  # per input: index among the extra outputs
    outputs: list  # per output: index among the extra placeholders (None: nobody reads it)
    build: object  # callable(list of ir.Node) -> list of ir.Node
    fingerprint: str  # what the StableHLO of the cut graph does not say about it
    loc: DebugLoc


class GraphCut:
    """Cuts ops out of an FX graph for torch-mlir: each op's inputs become extra outputs of the graph, its outputs
    extra placeholders (after the graph's own), until ``stitch`` joins the imported graph again."""

    def __init__(self, gm):
        self.gm, self.sites, self.extra_outputs, self.extra_placeholders = gm, [], [], []
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def cut(self, node, inputs: list, outputs: list, build, fingerprint: str, loc: DebugLoc) -> None:
        """Cut ``node`` (its value, or the getitems of its tuple value) out; ``outputs``: (shape, DType) per output."""
        import torch

        graph = self.gm.graph
        first = len(self.extra_outputs)
        self.extra_outputs.extend(inputs)
        fake_mode = next((n.meta["val"].fake_mode for n in inputs if hasattr(n.meta.get("val"), "fake_mode")), None)
        users = _output_users(node, len(outputs))
        anchor = (self.extra_placeholders or self.placeholders or [next(iter(graph.nodes))])[-1]
        slots = []
        for index, (shape, dtype) in enumerate(outputs):
            if not users[index]:
                slots.append(None)
                continue
            with graph.inserting_after(anchor):
                placeholder = graph.placeholder(f"{node.name}_out{index}")
            anchor = placeholder
            with fake_mode if fake_mode is not None else _null():
                placeholder.meta["val"] = torch.empty(tuple(shape), dtype=torch_dtype(dtype))
            for user in users[index]:
                user.replace_all_uses_with(placeholder)
            self.extra_placeholders.append(placeholder)
            slots.append(len(self.extra_placeholders) - 1)
        for getter in [u for u in node.users if u.target is operator.getitem]:
            graph.erase_node(getter)
        graph.erase_node(node)
        self.sites.append(CallSite(list(range(first, len(self.extra_outputs))), slots, build, fingerprint, loc))

    def finish(self) -> list:
        """The sites, after the extra outputs are added to the graph's output (in place)."""
        if self.sites:
            output = next(n for n in self.gm.graph.nodes if n.op == "output")
            values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
            output.args = (tuple(values) + tuple(self.extra_outputs),)
            self.gm.recompile()
        return self.sites


def _opdef(node):
    import torch
    from torch._library.custom_ops import _maybe_get_opdef

    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return _maybe_get_opdef(node.target)


def _fake(value):
    import torch.fx

    if isinstance(value, torch.fx.Node):
        return value.meta["val"]
    if isinstance(value, (list, tuple)):
        return type(value)(_fake(v) for v in value)
    return value


def _record(node, opdef, where: str):
    """The one kernel call the custom op's body makes on the node's fake tensors; None when the body calls no NKI
    kernel (not a kernel op: left to torch-mlir)."""
    import neuronc.nki as nki

    body = opdef._backend_fns.get("neuron") or opdef._init_fn
    args, kwargs = _fake(node.args), {k: _fake(v) for k, v in node.kwargs.items()}
    with nki.recording_calls() as calls:
        try:
            returned = body(*args, **kwargs)
            failure = None
        except NeuronCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - reported below if the body called a kernel
            failure = e
    if not calls:
        return None
    if failure is not None:
        raise NeuronCompileError(
            f"custom op {opdef._qualname} cannot be compiled: its body failed on fake tensors after calling NKI kernel "
            f"{calls[0].kernel.__name__} ({type(failure).__name__}: "
            f"{str(failure).splitlines()[0][:200] if str(failure) else ''})", location=where,
            hint="inside torch.compile(backend='neuron') a custom op's body must call one @nki.jit kernel on its "
            "arguments and return that kernel's outputs")
    if len(calls) != 1:
        raise NeuronCompileError(
            f"custom op {opdef._qualname} calls {len(calls)} NKI kernels; neuronc compiles custom ops whose body calls "
            f"exactly one @nki.jit kernel", location=where,
            hint="make each kernel a custom op of its own, or run this op outside the compiled region")
    call = calls[0]
    outs = call.returned if isinstance(call.returned, tuple) else (call.returned,)
    got = returned if isinstance(returned, (tuple, list)) else (returned,)
    if len(got) != len(outs) or any(a is not b for a, b in zip(got, outs)):
        raise NeuronCompileError(
            f"custom op {opdef._qualname} returns something other than its NKI kernel's outputs", location=where,
            hint="return the kernel's outputs as they are (reshape or compute on them outside the custom op)")
    return call, args, kwargs


_TORCH_NAMESPACES = frozenset({"prims", "aten", "prim", "_c10d_functional", "c10d_functional", "quantized"})


def _position_of(fake, args, kwargs, node):
    """The FX node whose value is the fake tensor ``fake`` among the custom op's arguments."""
    import torch.fx

    flat_fake, flat_nodes = [], []
    for f, n in zip(list(args) + list(kwargs.values()), list(node.args) + list(node.kwargs.values())):
        if isinstance(n, (list, tuple)):
            flat_fake.extend(f)
            flat_nodes.extend(n)
        else:
            flat_fake.append(f)
            flat_nodes.append(n)
    for f, n in zip(flat_fake, flat_nodes):
        if f is fake and isinstance(n, torch.fx.Node):
            return n
    return None


def cut_kernel_calls(cut: GraphCut, locations: dict) -> None:
    """Cut every call of a custom op whose body is an NKI kernel out of the graph (see the module docstring)."""
    import torch

    for node in list(cut.gm.graph.nodes):
        opdef = _opdef(node)
        if opdef is None or opdef._namespace in _TORCH_NAMESPACES:
            continue
        where = str(locations.get(node.name, DebugLoc(op=str(node.target))))
        recorded = _record(node, opdef, where)
        if recorded is None:
            continue
        call, args, kwargs = recorded
        if "!" in str(node.target._schema):
            raise NeuronCompileError(f"custom op {opdef._qualname} mutates its arguments; neuronc compiles custom "
                                     f"kernels that return new tensors", location=where,
                                     hint="declare mutates_args=() and return the result")
        traced = call.traced
        if traced.written_inputs:
            raise NeuronCompileError(f"the NKI kernel {traced.name} of custom op {opdef._qualname} writes its "
                                     f"arguments; inside a compiled graph kernels return new tensors", location=where)
        inputs = []
        for fake in [a for a in list(call.args) + list(call.kwargs.values()) if isinstance(a, torch.Tensor)]:
            source = _position_of(fake, args, kwargs, node)
            if source is None:
                raise NeuronCompileError(f"custom op {opdef._qualname} calls its NKI kernel on a tensor that is not "
                                         f"one of its arguments", location=where,
                                         hint="compute the kernel's inputs outside the custom op")
            inputs.append(source)
        loc = locations.get(node.name, DebugLoc())
        cut.cut(node, inputs, [(tuple(s.shape), s.dtype) for s in traced.outputs],
                lambda values, traced=traced, loc=loc: _kernel_nodes(traced, values, loc),
                _fingerprint(opdef._qualname, traced), loc)


def _kernel_nodes(traced, inputs: list, site_loc: DebugLoc) -> list:
    """The CUSTOM_KERNEL node of a traced kernel on ``inputs``, and a KERNEL_OUTPUT per further output."""
    from neuronc.ir import Op
    from neuronc.nki.kernel import register

    for storage, value in zip(traced.inputs, inputs):
        if tuple(storage.shape) != tuple(value.shape) or storage.dtype != value.dtype:
            raise NeuronCompileError(f"NKI kernel {traced.name} traced for {storage.dtype.name}"
                                     f"{list(storage.shape)} meets {value.dtype.name}{list(value.shape)}",
                                     location=str(site_loc))
    specs = tuple((tuple(s.shape), s.dtype) for s in traced.outputs)
    loc = dataclasses.replace(site_loc, op=f"nki:{traced.name}")
    scratch = tuple((tuple(s.shape), s.dtype) for s in traced.scratch)
    kernel = ir.node(Op.CUSTOM_KERNEL, inputs, specs[0][0], specs[0][1], loc, kernel=register(traced), outputs=specs,
                     scratch=scratch)
    return [kernel] + [ir.node(Op.KERNEL_OUTPUT, [kernel], shape, dtype, loc, index=i)
                       for i, (shape, dtype) in enumerate(specs[1:], 1)]


def _output_users(node, count: int) -> list:
    """Per kernel output, the FX nodes standing for it: getitem nodes of a tuple result, or the node itself."""
    getters = [u for u in node.users if u.target is operator.getitem]
    if getters:
        users = [[] for _ in range(count)]
        for g in getters:
            users[g.args[1]].append(g)
        return users
    return [[node] if node.users else []] + [[] for _ in range(count - 1)]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stitch(graph: ir.Graph, sites: list, params: int, outputs: int) -> ir.Graph:
    """The imported graph of a cut FX graph, joined again: the first ``params`` parameters and ``outputs`` outputs
    are the FX graph's own, the rest the cut's; each site's op is built on the values that fed it."""
    from neuronc.ir import Op

    extra_params = list(graph.params[params:])
    for site in sites:
        made = site.build([graph.outputs[outputs + i] for i in site.inputs])
        replace = {extra_params[k]: made[i] for i, k in enumerate(site.outputs) if k is not None}
        rewritten = graph.rewrite(lambda node, _inputs, replace=replace: replace.get(node))
        graph = ir.Graph([p for p in rewritten.params if p.op is Op.PARAMETER], rewritten.outputs, graph.name)
        extra_params = [replace.get(p, p) for p in extra_params]
    return ir.Graph([p for p in graph.params if p.op is Op.PARAMETER][:params], graph.outputs[:outputs], graph.name)


def _fingerprint(op: str, traced) -> str:
    """A kernel call's part of the compile-cache key: its instructions and where they came from."""
    digest = hashlib.sha256(op.encode())
    for e in traced.instrs:
        digest.update(repr((e.opcode, e.engine, e.queue, sorted(e.fields.items()),
                            [(s.name, s.space, s.base, ap) for s, ap in e.operands])).encode())
    digest.update(repr([(s.name, s.shape, s.dtype) for s in traced.inputs + traced.outputs + traced.scratch]).encode())
    digest.update(repr(traced.debug_locs).encode())
    return digest.hexdigest()


def fingerprint(sites: list) -> str:
    return hashlib.sha256("".join(site.fingerprint for site in sites).encode()).hexdigest()
