"""Dynamic shapes under `torch.compile(backend="neuron")`: one static program per concrete input signature.

A NEFF has fixed shapes: every access pattern's sizes are immediates and the ISA has no size registers
(docs/performance.md, issue 20 part 4). A graph Dynamo traced with symbolic sizes (`dynamic=True`,
`torch._dynamo.mark_dynamic`, or Dynamo's automatic dynamic shapes after an input changed shape) is therefore
not compiled as it is. As static-shape backends do (torch_xla traces each new shape), the backend returns a
:class:`ShapeSpecialisedGraph`: at each call it reads the concrete sizes of its inputs (the SymInt arguments
Dynamo passes are plain ints by then), and the first time it meets a signature it compiles the graph for it —
the same Dynamo graph re-traced through AOTAutograd with the call's own tensors and ints as example inputs, so
each symbol becomes the size it is bound to — then keeps that program in memory and runs it; the compile cache
on disk is keyed on the specialised graph as for any static graph.

Every specialisation holds a program (and, for training, its backward), so their number per graph is bounded:
``TORCH_NEURONX_MAX_SHAPES_PER_GRAPH`` (default :data:`DEFAULT_MAX_SHAPES`), or ``options={"max_shapes": n}``
of `torch.compile`. Beyond it, a call at a new signature runs the graph eagerly (as Dynamo does past its own
``recompile_limit``): its ops run on its tensors' device, `neuron` tensors through the eager device, CPU
tensors on the CPU; one warning per graph names the limit and how to change it.
"""
from __future__ import annotations

import os
import warnings
import weakref

from neuronc.errors import NeuronConfigError

MAX_SHAPES_ENV = "TORCH_NEURONX_MAX_SHAPES_PER_GRAPH"
DEFAULT_MAX_SHAPES = 64  # a choice: a 32-token generate meets ~33 key lengths; memory grows with each program


graphs: list = []  # weak references to every ShapeSpecialisedGraph of this process, newest last (for tests, tools)


def symbolic_inputs(gm) -> list:
    """The names of ``gm``'s placeholders whose value is symbolic: a SymInt (or SymFloat, SymBool) argument, or a
    tensor with a symbolic size or stride."""
    import torch

    symbolic = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool) or (
                isinstance(value, torch.Tensor) and not _is_static(value)):
            symbolic.append(node.name)
    return symbolic


def _is_static(tensor) -> bool:
    return all(isinstance(d, int) for d in (*tensor.shape, *tensor.stride()))


def max_shapes(option=None) -> int:
    """The limit on specialisations per graph: torch.compile's ``options["max_shapes"]`` (``option``), else the
    environment's, else the default."""
    given = option if option is not None else os.environ.get(MAX_SHAPES_ENV) or DEFAULT_MAX_SHAPES
    try:
        limit = int(given)
    except (TypeError, ValueError):
        limit = 0
    if limit < 1:
        raise NeuronConfigError(f"the limit on shapes compiled per graph must be a positive integer, not {given!r}",
                                hint=f'set {MAX_SHAPES_ENV}=<n> or torch.compile(..., options={{"max_shapes": n}}) '
                                "with n >= 1")
    return limit


def scalar_positions(gm) -> frozenset:
    """The positions among ``gm``'s arguments of the Python numbers it is given: the sizes Dynamo passes as SymInt
    (or SymFloat) placeholders, and the floats it wraps in 0-d tensors under dynamic shapes (``specialize_float``
    off: a module's ``eps``, a float argument), which the graph only reads back with ``.item()``. A specialised
    program is compiled for their values."""
    import torch

    positions = set()
    for position, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool | int | float | bool):
            positions.add(position)
        elif getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False) and node.users and all(
                user.op == "call_method" and user.target == "item" for user in node.users):
            positions.add(position)
    return frozenset(positions)


def signature(args, scalars: frozenset) -> tuple:
    """What a specialised program depends on: each tensor's shape, strides, dtype, device and whether it requires
    grad; the value of each Python number (at ``scalars``, the sizes Dynamo passes as ints and its wrapped
    floats)."""
    import torch

    return tuple(_number(a) if n in scalars else
                 (tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                 else (type(a), a) for n, a in enumerate(args))


def _number(value) -> tuple:
    import torch

    value = value.item() if isinstance(value, torch.Tensor) else value
    return type(value), value


class ShapeSpecialisedGraph:
    """A Dynamo graph with symbolic sizes, compiled once per concrete input signature by ``compile_static(gm,
    example_inputs)`` (the backend's static path), at most ``limit`` times."""

    def __init__(self, gm, compile_static, limit: int):
        self.graph_module, self.compile_static, self.limit = gm, compile_static, limit
        self.scalars = scalar_positions(gm)
        self.programs: dict = {}  # signature -> the compiled callable
        self.eager_calls = 0  # calls past the limit, run eagerly
        self._warned = False
        graphs.append(weakref.ref(self))

    def __call__(self, *args):
        key = signature(args, self.scalars)
        program = self.programs.get(key)
        if program is None:
            if len(self.programs) >= self.limit:
                return self._run_eagerly(args)
            program = self.programs[key] = self._specialise(args, key)
        return program(*args)

    def _specialise(self, args, key: tuple):
        """The graph compiled for the sizes of ``args``: its Python numbers (the sizes Dynamo passes as SymInt
        placeholders) replaced by their values, then traced anew by AOTAutograd under a fake mode of its own
        without symbolic shapes, so each size is the int it is now. Returns a callable taking all of ``args``."""
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        values = {n: key[n][1] for n in self.scalars}
        graph_module = with_numbers_bound(self.graph_module, values)
        kept = [n for n in range(len(args)) if n not in values]
        with tracing(TracingContext(FakeTensorMode())):  # AOTAutograd records the static inputs in it
            program = self.compile_static(graph_module, [args[n] for n in kept])
        if not values:
            return program
        return lambda *given: program(*[given[n] for n in kept])

    def _run_eagerly(self, args):
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"neuronc: a graph compiled with dynamic shapes met more than {self.limit} input shapes (the limit "
                f"{MAX_SHAPES_ENV}, default {DEFAULT_MAX_SHAPES}); calls at further new shapes run eagerly, op by "
                f"op, on the tensors' device. Raise it with {MAX_SHAPES_ENV}=<n> or torch.compile(..., "
                'options={"max_shapes": n}), or pad or bucket inputs to fewer shapes', stacklevel=2)
        self.eager_calls += 1
        return self.graph_module(*args)


def with_numbers_bound(gm, values: dict):
    """A copy of ``gm`` without the placeholders at the positions of ``values`` (position -> number): each use of
    one is its number instead (a wrapped float's ``.item()`` too)."""
    from torch import fx

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for copied, node in zip(placeholders, (n for n in gm.graph.nodes if n.op == "placeholder")):
        if hasattr(node, "_dynamo_source"):  # where Dynamo found it (a parameter, ...), as AOTAutograd reads it
            copied._dynamo_source = node._dynamo_source
    bound = {placeholders[n]: value for n, value in values.items()}
    for node, value in list(bound.items()):  # a wrapped float is read by .item() calls: they are its value
        for user in [u for u in node.users if u.op == "call_method" and u.target == "item"]:
            bound[user] = value
    for node in graph.nodes:
        if node not in bound:
            node.args = fx.node.map_arg(node.args, lambda n: bound.get(n, n))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda n: bound.get(n, n))
    for node in reversed(graph.nodes):
        if node in bound:
            graph.erase_node(node)
    module = fx.GraphModule(gm, graph)
    module.meta = dict(gm.meta)  # with Dynamo's markings, by which AOTAutograd finds the parameters (resident)
    if hasattr(gm, "_param_name_to_source"):
        module._param_name_to_source = gm._param_name_to_source
    return module
