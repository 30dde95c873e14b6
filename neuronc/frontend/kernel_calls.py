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
    """A kernel call cut out of the graph: which extra outputs feed its inputs, which extra inputs its outputs."""

    op: str
    traced: object  # neuronc.nki.TracedKernel
    inputs: list  # per kernel input: index among the extra outputs
    outputs: list  # per kernel output: index among the extra placeholders (None: nobody reads it)
    loc: DebugLoc


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


def cut_kernel_calls(gm, locations: dict) -> list:
    """In place: cut every call of a custom op whose body is an NKI kernel out of ``gm`` (see the module docstring).
    Returns the CallSites in graph order; the extra placeholders and outputs follow the graph's own."""
    import torch

    sites, extra_outputs, extra_placeholders = [], [], []
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in list(graph.nodes):
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
        tensor_args = [a for a in list(call.args) + list(call.kwargs.values()) if isinstance(a, torch.Tensor)]
        for fake in tensor_args:
            source = _position_of(fake, args, kwargs, node)
            if source is None:
                raise NeuronCompileError(f"custom op {opdef._qualname} calls its NKI kernel on a tensor that is not "
                                         f"one of its arguments", location=where,
                                         hint="compute the kernel's inputs outside the custom op")
            extra_outputs.append(source)
            inputs.append(len(extra_outputs) - 1)
        # the kernel's outputs: new placeholders, after the last placeholder
        fake_mode = next((a.fake_mode for a in tensor_args if hasattr(a, "fake_mode")), None)
        outputs = []
        users = _output_users(node, len(traced.outputs))
        anchor = (extra_placeholders or placeholders or [next(iter(graph.nodes))])[-1]
        for index, storage in enumerate(traced.outputs):
            if not users[index]:
                outputs.append(None)
                continue
            with graph.inserting_after(anchor):
                placeholder = graph.placeholder(f"{node.name}_nki_out{index}")
            anchor = placeholder
            with fake_mode if fake_mode is not None else _null():
                placeholder.meta["val"] = torch.empty(tuple(storage.shape), dtype=torch_dtype(storage.dtype))
            for user in users[index]:
                user.replace_all_uses_with(placeholder)
            extra_placeholders.append(placeholder)
            outputs.append(len(extra_placeholders) - 1)
        for getter in [u for u in node.users if u.target is operator.getitem]:
            graph.erase_node(getter)
        graph.erase_node(node)
        sites.append(CallSite(opdef._qualname, traced, inputs, outputs, locations.get(node.name, DebugLoc())))
    if sites:
        output = next(n for n in graph.nodes if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        output.args = (tuple(values) + tuple(extra_outputs),)
        gm.recompile()
    return sites


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
    are the FX graph's own, the rest the cut's; each site becomes a CUSTOM_KERNEL node."""
    from neuronc.ir import Op
    from neuronc.nki.kernel import register

    extra_params = list(graph.params[params:])
    for site in sites:
        current = graph.outputs
        inputs = [current[outputs + i] for i in site.inputs]
        traced = site.traced
        for storage, value in zip(traced.inputs, inputs):
            if tuple(storage.shape) != tuple(value.shape) or storage.dtype != value.dtype:
                raise NeuronCompileError(f"NKI kernel {traced.name} traced for {storage.dtype.name}"
                                         f"{list(storage.shape)} meets {value.dtype.name}{list(value.shape)}",
                                         location=str(site.loc))
        specs = tuple((tuple(s.shape), s.dtype) for s in traced.outputs)
        first, *_ = specs
        loc = dataclasses.replace(site.loc, op=f"nki:{traced.name}")
        scratch = tuple((tuple(s.shape), s.dtype) for s in traced.scratch)
        kernel = ir.node(Op.CUSTOM_KERNEL, inputs, first[0], first[1], loc, kernel=register(traced), outputs=specs,
                         scratch=scratch)
        made = [kernel] + [ir.node(Op.KERNEL_OUTPUT, [kernel], shape, dtype, loc, index=i)
                           for i, (shape, dtype) in enumerate(specs[1:], 1)]
        replace = {extra_params[k]: made[i] for i, k in enumerate(site.outputs) if k is not None}
        rewritten = graph.rewrite(lambda node, _inputs, replace=replace: replace.get(node))
        graph = ir.Graph([p for p in rewritten.params if p.op is Op.PARAMETER], rewritten.outputs, graph.name)
        extra_params = [replace.get(p, p) for p in extra_params]
    return ir.Graph([p for p in graph.params if p.op is Op.PARAMETER][:params], graph.outputs[:outputs], graph.name)


def fingerprint(sites: list) -> str:
    """What the StableHLO of a cut graph does not say: each kernel's instructions and where they came from."""
    digest = hashlib.sha256()
    for site in sites:
        traced = site.traced
        digest.update(repr((site.op, site.inputs, site.outputs)).encode())
        for e in traced.instrs:
            digest.update(repr((e.opcode, e.engine, e.queue, sorted(e.fields.items()),
                                [(s.name, s.space, s.base, ap) for s, ap in e.operands])).encode())
        digest.update(repr([(s.name, s.shape, s.dtype) for s in traced.inputs + traced.outputs + traced.scratch]).encode())
        digest.update(repr(traced.debug_locs).encode())
    return digest.hexdigest()
