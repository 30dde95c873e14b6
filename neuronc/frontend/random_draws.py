"""Random ops of an FX graph (dropout, rand, randn, randint, bernoulli, uniform, normal) as draws of the device's
random-number generator, fed by the generator's state at run time.

torch-mlir has no lowering for random ops, so before the import :func:`cut_random_ops` rewrites each one into
elementwise ATen ops on uniform draws in [0, 1), and each draw becomes an extra placeholder of the graph (after
its own): dropout is ``mask = u < 1 - p; out = x * mask / (1 - p)``, normal is Box-Muller on two draws,
bernoulli ``u < p``, randint ``low + floor(u * span)`` (the recipes of neuronc/codegen/rng.py, as eager `neuron`
tensors draw). After the import :func:`splice_draws` replaces each draw's parameter by an ``Op.RANDOM`` node
reading ONE new parameter, the generator state ``(seed, offset)`` (int64[2], the NEFF's last input): draw i is
elements ``offset + first_i ...`` of the seed's stream, the draws of a graph numbered one after the other, so a
graph reserves ``Draws.count`` numbers per call. The seed and offset are inputs, not constants: each call draws
new numbers without a recompile, and ``torch.manual_seed`` makes a call reproducible
(neuronc/pytorch/backend.py gives the state: a `neuron` device's generator advanced by ``count``, as eager ops
advance it; for CPU tensors, a seed drawn from torch's default CPU generator).

This is inductor's design (``replace_random.py``: random ops become ``inductor_random`` of a seed input) with the
device's counter-based generator: AOTAutograd saves dropout's mask for the backward graph, so the backward
never draws again and its gradient uses the forward's mask.

Activation checkpointing recomputes instead of saving: AOTAutograd wraps the forward's random op in
``run_and_save_rng_state(op, *args)`` -> (state, op's outputs) and the backward's in
``run_with_rng_state(state, op, *args)``, which must draw the same numbers. Here the forward's op is drawn as
usual and its saved state is ``[seed, offset + first]`` (int64[2], computed on the device from the graph's
state); the backward's op draws from that saved state (one of its inputs) from element 0, and reserves nothing
of the generator. The state only travels between neuronc's own forward and backward graphs, so its format is
neuronc's, not torch's CPU generator state (uint8[5056]) that AOTAutograd's fake values describe.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

from neuronc import ir
from neuronc.frontend.tensors import torch_dtypes
from neuronc.frontend.torch_import import new_last_placeholder
from neuronc.isa import DType
from neuronc.neff.program import DebugLoc

STATE_NAME = "rng_state"
SAVED_STATE_NAME = "rng_state_in"  # the graph's state as an FX placeholder, when a saved state is computed from it
MAX_INTEGER_SPAN = 2 ** 24  # what an fp32 uniform resolves exactly (codegen/rng.py's MAX_INTEGER_SPAN)


@dataclasses.dataclass(frozen=True)
class Draw:
    """One uniform draw in [0, 1): the placeholder standing for it, its shape and dtype, its first element number."""

    name: str
    shape: tuple
    dtype: DType
    first: int
    loc: DebugLoc
    state: str | None = None  # a saved state's placeholder it replays (run_with_rng_state), or None: the graph's


@dataclasses.dataclass
class Draws:
    draws: list
    state_input: str | None = None  # the placeholder of the graph's state, if saved states are computed from it

    @property
    def count(self) -> int:
        """Numbers of the generator's stream one call of the graph uses."""
        return sum(math.prod(d.shape) for d in self.draws if d.state is None)

    def fingerprint(self) -> str:
        return repr([(d.shape, d.dtype.name, d.first, d.state) for d in self.draws])


def _float_dtypes():
    import torch

    return (torch.float32, torch.bfloat16, torch.float16)


def _recipe(node):
    """(recipe, arguments) of a random op the device draws, or None (left as it is: an op the graph cannot
    compile, which the partitioner runs on the CPU)."""
    import torch

    if node.op != "call_function" or node.kwargs.get("generator") is not None:
        return None
    aten = torch.ops.aten
    val = node.meta.get("val")
    t = node.target
    if t is aten.native_dropout.default:
        x, p, train = (list(node.args) + [None])[:3]
        if train is False or not isinstance(p, (int, float)) or not 0 < p < 1 or val[0].dtype not in _float_dtypes():
            return None
        return "dropout", (x, float(p))
    if not isinstance(val, torch.Tensor):
        return None
    floating = val.dtype in _float_dtypes()
    if t in (aten.rand.default, aten.rand_like.default):
        return ("uniform", (0.0, 1.0)) if floating else None
    if t is aten.uniform.default:
        args = list(node.args[1:]) + [node.kwargs.get("from", 0.0), node.kwargs.get("to", 1.0)][len(node.args) - 1:]
        return ("uniform", (float(args[0]), float(args[1]))) if floating else None
    if t in (aten.randn.default, aten.randn_like.default):
        return ("normal", (0.0, 1.0)) if floating else None
    if t is aten.normal_functional.default:
        args = list(node.args[1:]) + [node.kwargs.get("mean", 0.0), node.kwargs.get("std", 1.0)][len(node.args) - 1:]
        return ("normal", (float(args[0]), float(args[1]))) if floating else None
    if t in (aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.normal.float_float):
        mean = node.args[0] if node.args else node.kwargs.get("mean", 0.0)
        std = node.args[1] if len(node.args) > 1 else node.kwargs.get("std", 1.0)
        return ("normal", (mean, std)) if floating else None
    if t is aten.bernoulli.p:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return ("bernoulli", (float(p),)) if isinstance(p, (int, float)) else None
    if t is aten.bernoulli.default:
        return ("bernoulli", (node.args[0],)) if node.args[0].meta["val"].dtype in _float_dtypes() else None
    bounds = None
    if t is aten.randint.low:  # (low, high, size)
        bounds = node.args[0], node.args[1]
    elif t is aten.randint.default:  # (high, size)
        bounds = 0, node.args[0]
    elif t is aten.randint_like.low_dtype:  # (x, low, high)
        bounds = node.args[1], node.args[2]
    elif t is aten.randint_like.default:  # (x, high)
        bounds = 0, node.args[1]
    if bounds is not None:
        low, high = bounds
        if not all(isinstance(b, int) for b in bounds) or not 0 < high - low <= MAX_INTEGER_SPAN:
            return None
        return "integers", (low, high)
    return None


def _rng_wrappers() -> tuple:
    import torch

    return torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state


def _wrapped(node):
    """(saved state or None, a stand-in node of the random op) of a run_and_save_rng_state /
    run_with_rng_state node (see the module docstring), or None for any other node."""
    import types

    import torch

    saving, replaying = _rng_wrappers()
    if node.op != "call_function" or node.target not in (saving, replaying):
        return None
    state, (op, *args) = (None, node.args) if node.target is saving else (node.args[0], node.args[1:])
    kwargs = dict(node.kwargs)

    def fake(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    if not isinstance(op, torch._ops.OpOverload):
        return None
    fake_args = [fake(a) for a in args]
    modes = [v.fake_mode for v in fake_args if hasattr(v, "fake_mode")]
    if not modes:
        return None
    with modes[0]:
        val = op(*fake_args, **kwargs)
    return state, types.SimpleNamespace(op="call_function", target=op, args=tuple(args), kwargs=kwargs,
                                        meta={"val": val}, name=node.name, users={})


def _found(node):
    """(recipe, arguments, saved state or None, wrapper or None) of a random op the device draws, or None."""
    wrapped = _wrapped(node)
    if wrapped is not None:
        state, inner = wrapped
        found = _recipe(inner)
        return None if found is None else (*found, state, inner)
    found = _recipe(node)
    return None if found is None else (*found, None, None)


def is_random(node) -> bool:
    """Whether the node is a random op that :func:`cut_random_ops` turns into device draws."""
    return _found(node) is not None


def has_random_ops(gm) -> bool:
    """Whether any node of `gm` is a random op (is_random), asked only of the nodes that call one of the targets
    _recipe and _wrapped name: is_random is False for every other node (each of them returns None unless the node's
    target is one of those objects; `is` and a tuple's `in` compare these targets by identity)."""
    _, ids = _random_targets()
    return any(is_random(n) for n in gm.graph.nodes if n.op == "call_function" and id(n.target) in ids)


@functools.cache
def _random_targets() -> tuple:
    """(the targets _recipe and _wrapped compare a node's with, the set of their ids): looked up once (an ATen op's
    lookup costs about 0.5 us, and is_random made about 30 per node)."""
    import torch

    aten = torch.ops.aten
    targets = (aten.native_dropout.default, aten.rand.default, aten.rand_like.default, aten.uniform.default,
               aten.randn.default, aten.randn_like.default, aten.normal_functional.default, aten.normal.Tensor_float,
               aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.normal.float_float, aten.bernoulli.p,
               aten.bernoulli.default, aten.randint.low, aten.randint.default, aten.randint_like.low_dtype,
               aten.randint_like.default, *_rng_wrappers())
    return targets, frozenset(map(id, targets))


class _Builder:
    """Inserts ATen ops (their fake values computed) before a node, and draw placeholders after the graph's own."""

    def __init__(self, gm, fake_mode, locations: dict):
        self.gm, self.graph, self.fake_mode, self.locations = gm, gm.graph, fake_mode, locations
        self.draws: list = []
        self.first = 0
        self.replayed = None  # (saved state's placeholder name, next element) while emitting a run_with_rng_state
        self.own_state = None  # the graph's state as an FX placeholder, once a saved state needs it

    def draw(self, at, shape: tuple, dtype) -> object:
        import torch

        placeholder = new_last_placeholder(self.graph, f"rng_draw{len(self.draws)}")
        val = at.meta["val"]
        device = (val[0] if isinstance(val, (tuple, list)) else val).device  # the graph's (neuron or CPU)
        with self.fake_mode:
            placeholder.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        loc = self.locations.get(at.name, DebugLoc(op=str(at.target)))
        if self.replayed is not None:
            state, first = self.replayed
            self.draws.append(Draw(placeholder.name, tuple(shape), torch_dtypes()[dtype], first, loc, state))
            self.replayed = state, first + math.prod(shape)
        else:
            self.draws.append(Draw(placeholder.name, tuple(shape), torch_dtypes()[dtype], self.first, loc))
            self.first += math.prod(shape)
        return placeholder

    def saved_state(self, device):
        """The state a run_and_save_rng_state saves before its op draws: [seed, offset + first], int64[2]."""
        import torch

        if self.own_state is None:
            self.own_state = new_last_placeholder(self.graph, SAVED_STATE_NAME)
            with self.fake_mode:
                self.own_state.meta["val"] = torch.empty((2,), dtype=torch.int64, device=device)
        aten = torch.ops.aten
        seed = self.call(aten.slice.Tensor, self.own_state, 0, 0, 1)
        offset = self.call(aten.slice.Tensor, self.own_state, 0, 1, 2)
        return self.call(aten.cat.default, [seed, self.call(aten.add.Tensor, offset, self.first)])

    def call(self, target, *args):
        import torch.fx

        def fake(a):
            if isinstance(a, (list, tuple)):
                return [fake(e) for e in a]
            return a.meta["val"] if isinstance(a, torch.fx.Node) else a

        node = self.graph.call_function(target, args)
        with self.fake_mode:
            node.meta["val"] = target(*[fake(a) for a in args])
        return node


def _fake_mode(gm):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    for n in gm.graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
                return v.fake_mode
    return FakeTensorMode()


def _emit(b: _Builder, node, recipe: str, args: tuple):
    """The values replacing ``node`` (one per output), computed from fresh draws (see the module docstring)."""
    import torch

    aten, prims = torch.ops.aten, torch.ops.prims
    val = node.meta["val"]
    f32 = torch.float32
    if recipe == "dropout":
        x, p = args
        shape = tuple(x.meta["val"].shape)
        mask = b.call(aten.lt.Scalar, b.draw(node, shape, f32), 1.0 - p)
        out = b.call(aten.mul.Tensor, b.call(aten.mul.Tensor, x, mask), 1.0 / (1.0 - p))
        return out, mask
    shape, dtype = tuple(val.shape), val.dtype
    if recipe == "uniform":  # drawn with the output's precision, so that no draw rounds up to 1
        low, high = args
        u = b.draw(node, shape, dtype)
        if (low, high) == (0.0, 1.0):
            return (u,)
        return (b.call(aten.add.Tensor, b.call(aten.mul.Tensor, u, high - low), low),)
    if recipe == "normal":  # Box-Muller: sqrt(-2 log(1 - u1)) * cos(2 pi u2) * std + mean
        mean, std = args
        u1, u2 = b.draw(node, shape, f32), b.draw(node, shape, f32)
        one_minus = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, u1, -1.0), 1.0)
        radius = b.call(aten.sqrt.default, b.call(aten.mul.Tensor, b.call(aten.log.default, one_minus), -2.0))
        z = b.call(aten.mul.Tensor, radius, b.call(aten.cos.default, b.call(aten.mul.Tensor, u2, 2.0 * math.pi)))
        if not (isinstance(std, float) and std == 1.0):
            z = b.call(aten.mul.Tensor, z, std)
        if not (isinstance(mean, float) and mean == 0.0):
            z = b.call(aten.add.Tensor, z, mean)
        return (b.call(prims.convert_element_type.default, z, dtype) if dtype != f32 else z,)
    if recipe == "bernoulli":
        (p,) = args
        u = b.draw(node, shape, f32)
        hit = b.call(aten.lt.Tensor if isinstance(p, torch.fx.Node) else aten.lt.Scalar, u, p)
        return (b.call(prims.convert_element_type.default, hit, dtype),)
    if recipe == "integers":  # low + floor(u * span), clamped below span against rounding up
        low, high = args
        span = high - low
        scaled = b.call(aten.floor.default, b.call(aten.mul.Tensor, b.draw(node, shape, f32), float(span)))
        whole = b.call(aten.clamp_max.default, scaled, float(span - 1))
        if low:
            whole = b.call(aten.add.Tensor, whole, float(low))
        return (b.call(prims.convert_element_type.default, whole, dtype),)
    raise AssertionError(recipe)


def cut_random_ops(gm, locations: dict) -> Draws:
    """In place: every random op of ``gm`` the device draws, as elementwise ops on draw placeholders (see the
    module docstring). Returns the draws, in the order of their placeholders."""
    b = _Builder(gm, _fake_mode(gm), locations)
    for node in list(gm.graph.nodes):
        found = _found(node)
        if found is None:
            continue
        recipe, args, state, inner = found
        if inner is not None:
            _cut_wrapped(b, gm, node, recipe, args, state, inner)
            continue
        with gm.graph.inserting_before(node):
            values = _emit(b, node, recipe, args)
        _replace_outputs(gm, node, values)
        gm.graph.erase_node(node)
    if b.draws:
        gm.graph.lint()
        gm.recompile()
    return Draws(b.draws, None if b.own_state is None else b.own_state.name)


def _replace_outputs(gm, node, values) -> None:
    """``node``'s uses replaced by ``values`` (its getitems', or its own if it has one output)."""
    getters = [u for u in node.users if u.target is operator.getitem]
    if getters:
        for g in getters:
            g.replace_all_uses_with(values[g.args[1]])
            gm.graph.erase_node(g)
    else:
        node.replace_all_uses_with(values[0])


def _cut_wrapped(b: _Builder, gm, node, recipe: str, args: tuple, state, inner) -> None:
    """A run_and_save_rng_state (state None) or run_with_rng_state node as draws (see the module docstring)."""
    import torch

    val = inner.meta["val"]
    device = (val[0] if isinstance(val, (tuple, list)) else val).device
    with gm.graph.inserting_before(node):
        if state is None:
            saved = b.saved_state(device)
        else:  # the saved state: neuronc's int64[2], whatever AOTAutograd's fake value says
            with b.fake_mode:
                state.meta["val"] = torch.empty((2,), dtype=torch.int64, device=device)
            b.replayed = state.name, 0
        values = _emit(b, inner, recipe, args)
        b.replayed = None
    values = values if isinstance(val, (tuple, list)) else values[0]
    if state is None:  # (state, op's outputs)
        for g in [u for u in node.users if u.target is operator.getitem]:
            if g.args[1] == 0:
                g.replace_all_uses_with(saved)
            elif isinstance(values, tuple):
                _replace_outputs(gm, g, values)
            else:
                g.replace_all_uses_with(values)
            gm.graph.erase_node(g)
    else:
        _replace_outputs(gm, node, values if isinstance(values, tuple) else (values,))
    gm.graph.erase_node(node)


def splice_draws(graph: ir.Graph, draws: Draws) -> ir.Graph:
    """The imported graph with each draw's parameter replaced by a RANDOM node of the generator state, a new
    last parameter (int64[2]: seed, offset)."""
    if not draws.draws:
        return graph
    by_name = {d.name: d for d in draws.draws}
    own = draws.count > 0 or draws.state_input is not None
    kept = [p for p in graph.params if p.attrs["name"] not in by_name and p.attrs["name"] != draws.state_input]
    state = ir.node(ir.Op.PARAMETER, [], (2,), DType.I64, None, index=len(kept), name=STATE_NAME, kind="input")
    renumbered = {p: i for i, p in enumerate(kept)}
    saved = {}  # a saved state's parameter (run_with_rng_state's), by name

    def replace(node, inputs):
        if node.op is not ir.Op.PARAMETER:
            return None
        name = node.attrs["name"]
        if name == draws.state_input:
            return state
        draw = by_name.get(name)
        if draw is not None:
            source = state if draw.state is None else saved[draw.state]
            return ir.node(ir.Op.RANDOM, [source], draw.shape, draw.dtype, draw.loc, first=draw.first)
        if node.attrs["index"] != renumbered[node]:
            node = dataclasses.replace(node, attrs={**node.attrs, "index": renumbered[node]}, id=next(ir._ids))
        saved[name] = node
        return node

    rewritten = graph.rewrite(replace)
    params = [p for p in rewritten.params if p.op is ir.Op.PARAMETER and p is not state] + ([state] if own else [])
    return ir.Graph(params, rewritten.outputs, graph.name)
