"""Dynamo graphs with dynamic shapes, compiled once per concrete input signature.

A NEFF's instruction streams are fixed at compile time (every access pattern names its sizes), so neuronc makes
one program per input shape, as the Neuron toolchain does. A graph Dynamo traced with symbolic sizes
(`dynamic=True`, `torch._dynamo.mark_dynamic`, or PyTorch's automatic dynamic shapes after a second shape) is
kept whole and specialised when it runs: each new signature (the arguments' shapes, strides, dtypes, devices,
`requires_grad`, and the values of number arguments, floats Dynamo passes as 0-d tensors included) goes through
the static path (AOTAutograd, then the backend's compile of the forward and backward graphs) with those
concrete inputs, and later calls with that signature reuse it. A signature's compile is the same as Dynamo handing the backend a static graph of those
shapes would give, and the compile cache serves a shape compiled before. (Under automatic dynamic shapes the
first shape, compiled from Dynamo's static graph, is compiled again when it comes back: Dynamo tries its newest
graph, the dynamic one, first. With the compile cache on, as by default, that second compile is a cache hit.)

A process that meets unboundedly many shapes (a sequence length growing every step) would compile without end:
after ``TORCH_NEURONX_MAX_SHAPES_PER_GRAPH`` signatures (default 64) a graph runs its further new signatures
eagerly (the Dynamo graph called as PyTorch code, on the device its tensors are on), with one warning saying how
to pad or bucket, as Dynamo itself falls back to eager at its recompile limit.
"""
from __future__ import annotations

import copy
import os
import warnings

DEFAULT_MAX_SHAPES = 64  # a choice: a few dozen buckets of a varying length, not an unbounded stream of shapes
MAX_SHAPES_VARIABLE = "TORCH_NEURONX_MAX_SHAPES_PER_GRAPH"


def has_symbolic_shapes(gm) -> bool:
    """Whether a Dynamo graph takes symbolic sizes (a SymInt argument, a tensor with a symbolic dimension)."""
    import torch

    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (
                isinstance(value, torch.Tensor) and any(not isinstance(d, int) for d in value.shape)):
            return True
    return False


def max_shapes() -> int:
    from neuronc.errors import NeuronConfigError

    text = os.environ.get(MAX_SHAPES_VARIABLE, str(DEFAULT_MAX_SHAPES))
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise NeuronConfigError(f"{MAX_SHAPES_VARIABLE}={text!r} is not a positive whole number",
                                hint=f"set it to how many input shapes a graph may compile (default {DEFAULT_MAX_SHAPES})")
    return limit


def signature(args) -> tuple:
    """What a static program depends on in ``args`` (concrete values, as a call passes them): tensors' shape,
    strides, dtype, device and requires_grad; integers' (and other scalars') values."""
    import torch

    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool)):
            key.append((type(a).__name__, a))
        else:
            key.append(type(a).__name__)
    return tuple(key)


def wrapped_scalars(gm) -> tuple:
    """Positions of the arguments that are Python numbers Dynamo passes as 0-d tensors and reads back with
    ``.item()`` (a float it does not specialise, such as a LayerNorm's ``eps`` under ``dynamic=True``): every use
    of the placeholder is an ``item`` call. A static program takes their values as constants."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, node in enumerate(placeholders)
                 if node.users and all(u.op == "call_method" and u.target == "item" for u in node.users))


def _with_scalars_inlined(gm, args, wrapped: tuple = ()):
    """A copy of ``gm`` with its scalar arguments (the symbolic sizes Dynamo passes as SymInts, and the wrapped
    numbers at positions ``wrapped``) replaced by their values in ``args``, and the positions of the arguments it
    still takes (the tensors)."""
    import torch

    graph = copy.deepcopy(gm.graph)
    kept = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, (node, value) in enumerate(zip(placeholders, args)):
        if i in wrapped:
            for use in list(node.users):
                use.replace_all_uses_with(value.item())
                graph.erase_node(use)
        elif isinstance(value, torch.Tensor):
            kept.append(i)
            continue
        node.replace_all_uses_with(value)  # an FX node argument may be a Python number
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph), kept


class PerShapeGraphs:
    """A Dynamo graph with symbolic sizes, as Dynamo calls it: each call runs the program compiled for its
    arguments' signature, compiling it first when it is new (``compile_static(gm, args)``: the backend's static
    path, which returns a callable of the same arguments)."""

    def __init__(self, gm, compile_static, graph_name: str = "graph"):
        self.gm, self.compile_static, self.graph_name = gm, compile_static, graph_name
        self.wrapped = wrapped_scalars(gm)  # numbers passed as tensors: their values are part of a signature
        self.programs: dict = {}  # signature -> compiled callable
        self.limit = max_shapes()
        self.warned = False
        self.beyond_limit = self.eagerly  # what a new signature past the limit does (a caller may make it an error)

    def __call__(self, *args):
        key = (signature(args), tuple(args[i].item() for i in self.wrapped))
        program = self.programs.get(key)
        if program is None:
            if len(self.programs) >= self.limit:
                return self.beyond_limit(args)
            program = self.programs[key] = self._compile(list(args))
        return program(*args)

    def _compile(self, args):
        import torch
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        gm, kept = _with_scalars_inlined(self.gm, args, self.wrapped)
        # Runs while Dynamo's compiled code runs: Dynamo must not trace the compile itself, and AOTAutograd
        # records what it learns (which inputs are parameters) in a tracing context of static fake tensors
        with tracing(TracingContext(FakeTensorMode())):
            program = torch._dynamo.disable(self.compile_static)(gm, [args[i] for i in kept])
        return lambda *given: program(*(given[i] for i in kept))

    def eagerly(self, args):
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"neuronc: this {self.graph_name} has met {self.limit} input shapes, each compiled to its own program; "
                f"further new shapes run eagerly. Pad or bucket inputs to a few fixed shapes (each is compiled once, "
                f"then served from the compile cache), or raise {MAX_SHAPES_VARIABLE}.", stacklevel=2)
        return self.gm(*args)
