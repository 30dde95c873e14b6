"""ATen ops lowered straight to the graph IR, without torch-mlir: how the `neuron` device compiles an eager op.

torch-mlir's route (make_fx, the FX importer in a forked child, StableHLO, the IR importer) costs 0.1-1 s per op;
an eager op meets a new shape at every new batch or sequence length. Here an op is lowered by a rule of its own,
written against the IR's public constructors (``ir.node``), in well under a millisecond. An op without a rule is
decomposed by PyTorch's decomposition table (``torch._decomp``) into ops that have one; an op neither covers
raises :class:`NotLowered`, and the caller takes torch-mlir's route.

The lowering runs on :class:`IRTensor`, a tensor subclass that holds an IR node and dispatches every ATen op to
a rule (``__torch_dispatch__``): a rule receives the op's arguments with IRTensors for tensors and the meta
tensors of its results (shapes and dtypes, computed by PyTorch's own meta kernels), and returns an IR node per
result. Python numbers the caller makes runtime inputs (see ``neuronc.pytorch.eager.SCALAR_FORMS``) are 0-d
parameters, :class:`RuntimeScalar`; every other number is a constant. Tensors made inside a decomposition
(``torch.zeros(...)``, ``torch.tensor(...)``) are real CPU tensors: constants of the graph (one value: a splat).

Numerics follow eager PyTorch on the CPU: a bf16/fp16 op computes in fp32 and rounds its result once (PyTorch's
"opmath"), type promotion is PyTorch's (the result dtypes come from its meta kernels, a comparison's operand
dtype from ``torch.result_type``), integer division truncates only where PyTorch's does.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from neuronc import ir
from neuronc.frontend.decompositions import adaptive_max_pool
from neuronc.frontend.scalar_overloads import scalar_overload
from neuronc.frontend.tensors import dtype_of
from neuronc.ir import Op
from neuronc.isa import DType
from neuronc.neff.program import DebugLoc

aten = torch.ops.aten
prims = torch.ops.prims

LOW_PRECISION = (DType.BF16, DType.F16)


class NotLowered(Exception):
    """The op (or one its decomposition reaches) has no rule here: the caller compiles it another way."""


class RuntimeScalar:
    """A Python number that is a runtime input of the program: a 0-d PARAMETER of fp32 (a float) or int64."""

    __slots__ = ("node", "kind")

    def __init__(self, node: ir.Node, kind: type):
        self.node, self.kind = node, kind

    def example(self):
        return self.kind(1)


class IRTensor(torch.Tensor):
    """A tensor whose value is an IR node; every ATen op on it is lowered to IR by the current lowering."""

    node: ir.Node
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, node: ir.Node, meta: torch.Tensor):
        tensor = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(), dtype=meta.dtype,
                                                     device="cpu", storage_offset=meta.storage_offset())
        tensor.node = node
        return tensor

    def __repr__(self):
        return f"IRTensor({self.node!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _current().dispatch(func, args, kwargs or {})


_state = threading.local()


def _current() -> "Lowering":
    lowering = getattr(_state, "lowering", None)
    if lowering is None:
        raise NotLowered("an IRTensor outside a lowering")
    return lowering


def _meta(x):
    """The meta tensor standing for an IRTensor (its shape, strides and dtype) in a meta kernel's call."""
    if isinstance(x, IRTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, RuntimeScalar):
        return x.example()
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return x


def _on_meta(func, args, kwargs):
    """``func`` called on the meta tensors standing for ``args``/``kwargs`` (through its Scalar overload where a
    number stands in a Tensor place: frontend/scalar_overloads.py)."""
    metas = tree_map(_meta, args), tree_map(_meta, kwargs)
    return scalar_overload(func, *metas)(*metas[0], **metas[1])


def _meta_results(func, args, kwargs):
    """``func``'s results as meta tensors (PyTorch's meta kernels: shapes, strides, dtypes)."""
    if torch.Tag.pointwise in func.tags:
        known = pointwise_meta(func, args, kwargs)
        if known is not None:
            return known
    if func is aten.native_layer_norm.default and isinstance(args[0], IRTensor):  # its meta kernel: 2 ms
        x, axis = args[0], args[0].dim() - len(args[1])
        statistics = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        stat_shape = (*x.shape[:axis], *([1] * len(args[1])))
        return (torch.empty(x.shape, dtype=x.dtype, device="meta"),
                torch.empty(stat_shape, dtype=statistics, device="meta"),
                torch.empty(stat_shape, dtype=statistics, device="meta"))
    try:
        return _on_meta(func, args, kwargs)
    except NotLowered:
        raise
    except Exception as e:  # no meta kernel, or arguments it refuses
        if func in OWN_DECOMPOSITIONS:  # ours run on meta tensors too (the RNN cells have no meta kernel)
            try:
                return _on_meta(OWN_DECOMPOSITIONS[func], args, kwargs)
            except Exception:  # noqa: BLE001 - reported below
                pass
        raise NotLowered(f"{func} has no meta kernel for these arguments: {type(e).__name__}: {e}") from None


_pointwise_dtypes: dict = {}  # (op, dtypes and kinds of its arguments) -> its result dtype, or None


def pointwise_meta(func, args, kwargs):
    """The result of a pointwise op without its meta kernel (many are Python, 0.1-1 ms a call): the arguments'
    broadcast shape, and the dtype its meta kernel gave for the same argument types (type promotion depends on
    dtypes, on which tensors are 0-d and on the kinds of numbers, never on sizes). None when unknown."""
    key, shapes = [func], []
    for name, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            shapes.append(value.shape)
            key.append((name, value.dtype, value.dim() == 0))
        elif isinstance(value, RuntimeScalar):
            key.append((name, value.kind))
        elif value is None or isinstance(value, (bool, int, float, str)):
            key.append((name, type(value), value if isinstance(value, (bool, str)) or value is None else None))
        else:
            return None
    key = tuple(key)
    if key not in _pointwise_dtypes:
        try:
            result = _on_meta(func, args, kwargs)
        except Exception:  # noqa: BLE001 - the full meta call reports it
            return None
        plain = isinstance(result, torch.Tensor) and tuple(result.shape) == tuple(torch.broadcast_shapes(*shapes))
        _pointwise_dtypes[key] = result.dtype if plain else None
        return result
    dtype = _pointwise_dtypes[key]
    return None if dtype is None else torch.empty(torch.broadcast_shapes(*shapes), dtype=dtype, device="meta")


# ops(self, dim, keepdim=False) reducing over dim (an int or a list) whose meta kernel is Python (all's: 0.5 ms)
_REDUCING_OVER_DIMS = frozenset((aten.all.dim, aten.all.dims, aten.any.dim, aten.any.dims))
_reduction_results: dict = {}  # (op, dtype, rank, dims, keepdim) -> its result's dtype, or None


def reduction_meta(func, args, kwargs):
    """The result of ``all``/``any`` over ``dim`` without its meta kernel, as :func:`pointwise_meta` for
    pointwise ops: the input's shape without the reduced dims (kept as 1 with ``keepdim``), the dtype its meta
    kernel gave for the same input dtype, rank, dims and ``keepdim`` (sizes change neither). The first call of
    each such key runs the meta kernel and keeps the key only when the shape rule gave its shape. None when
    unknown (the caller calls the meta kernel)."""
    if func not in _REDUCING_OVER_DIMS or not args or not isinstance(args[0], torch.Tensor) or len(args) > 3 or \
            set(kwargs) - {"dim", "keepdim"}:
        return None
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dims = [dim] if type(dim) is int else list(dim) if isinstance(dim, (list, tuple)) else None
    rank = x.dim()
    if not dims or type(keepdim) is not bool or rank == 0 or any(type(d) is not int or not -rank <= d < rank
                                                                     for d in dims):
        return None
    dims = tuple(d % rank for d in dims)
    shape = tuple(1 if i in dims else n for i, n in enumerate(x.shape) if keepdim or i not in dims)
    key = (func, x.dtype, rank, dims, keepdim)
    if key not in _reduction_results:
        try:
            result = _on_meta(func, args, kwargs)
        except Exception:  # noqa: BLE001 - the full meta call reports it
            return None
        plain = isinstance(result, torch.Tensor) and tuple(result.shape) == shape
        _reduction_results[key] = result.dtype if plain else None
        return result
    dtype = _reduction_results[key]
    return None if dtype is None else torch.empty(shape, dtype=dtype, device="meta")


class Lowering:
    """One graph being built: its parameters, and the dispatch of ops on IRTensors to rules."""

    def __init__(self, name: str):
        self.params: list = []
        self.loc = DebugLoc(op=name)
        self.depth = 0
        self.current = ""  # the op a rule is lowering, "aten::add.Tensor" (rules shared by several ops ask)
        self.inputs: dict = {}  # id of an input's IRTensor -> its parameter's index
        self.keep: list = []  # those IRTensors (their ids stay theirs)
        self.mutated: dict = {}  # parameter index -> the IRTensor holding the input's new value

    # -- leaves ---------------------------------------------------------------------------------------

    def parameter(self, shape, dtype: DType) -> ir.Node:
        node = ir.node(Op.PARAMETER, [], shape, dtype, self.loc, index=len(self.params),
                       name=f"arg{len(self.params)}", kind="input")
        self.params.append(node)
        return node

    def tensor_input(self, example: torch.Tensor) -> IRTensor:
        node = self.parameter(tuple(example.shape), _dtype(example.dtype))
        tensor = IRTensor(node, torch.empty(example.shape, dtype=example.dtype, device="meta"))
        self.inputs[id(tensor)] = len(self.params) - 1
        self.keep.append(tensor)
        return tensor

    def scalar_input(self, value) -> RuntimeScalar:
        kind = float if isinstance(value, float) else int
        return RuntimeScalar(self.parameter((), DType.F32 if kind is float else DType.I64), kind)

    # -- dispatch -------------------------------------------------------------------------------------

    def dispatch(self, func, args, kwargs):
        """Lower ``func`` on these arguments (IRTensors among them); the results as IRTensors."""
        if func in _VIEW_OF_SELF:  # detach, alias, lift_fresh: the same value
            return args[0]
        if func._schema.is_mutable:
            return self.mutate(func, args, kwargs)
        out_meta = _meta_results(func, args, kwargs)
        nodes = self.apply(func, args, kwargs, out_meta)
        return wrap(nodes, out_meta)

    def mutate(self, func, args, kwargs):
        """An in-place op inside a decomposition (batch norm's update of its running statistics): its functional
        form computes the new value, which the tensor takes; a mutated input of the op being lowered becomes an
        output of the graph, written back into the input's memory (``Lowered.mutated``). Only whole tensors:
        a view would not pass the new value to its base."""
        target = args[0] if args else None
        if not isinstance(target, IRTensor):
            raise NotLowered(f"{func} mutates something other than a tensor being lowered")
        if func is aten.copy_.default:
            source = args[1]
            value = self.node(source, _dtype(target.dtype), tuple(target.shape))
        else:
            name = func._schema.name.split("::")[1]
            functional = getattr(getattr(aten, name.rstrip("_"), None), func._overloadname, None)
            if not name.endswith("_") or functional is None or functional._schema.is_mutable:
                raise NotLowered(f"{func} mutates its arguments")
            value = self.node(self.dispatch(functional, args, kwargs), _dtype(target.dtype))
        target.node = value
        if id(target) in self.inputs:
            self.mutated[self.inputs[id(target)]] = target
        return target

    def apply(self, func, args, kwargs, out_meta):
        """The IR node(s) of ``func``'s results (in the order of its flat results)."""
        rule = RULES.get(func)
        if rule is not None:
            self.current = f"{func._schema.name}.{func._overloadname}"
            return rule(self, out_meta, *args, **kwargs)
        decomposition = _decompositions().get(func)
        if decomposition is None and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            decomposition = func.decompose  # a composite op called by name inside a decomposition
        if decomposition is None:
            raise NotLowered(f"no rule or decomposition for {func}")
        if any(isinstance(x, RuntimeScalar) for x in tree_flatten((args, kwargs))[0]):
            raise NotLowered(f"{func} with runtime numbers has no rule of its own")
        self.depth += 1
        if self.depth > 20:
            raise NotLowered(f"{func}: decompositions nest too deep")
        try:
            result = decomposition(*args, **kwargs)
        finally:
            self.depth -= 1
        if result is NotImplemented:
            raise NotLowered(f"{func}'s decomposition does not take these arguments")
        flat = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor) or x is None]
        return tuple(self.node(x) for x in flat if x is not None)

    # -- values ---------------------------------------------------------------------------------------

    def node(self, x, dtype: DType | None = None, shape=None) -> ir.Node:
        """``x`` (IRTensor, RuntimeScalar, CPU tensor or number) as an IR node, converted to ``dtype`` and
        broadcast to ``shape`` (numpy rules) when given."""
        if isinstance(x, IRTensor):
            node = x.node
        elif isinstance(x, RuntimeScalar):
            node = x.node
        elif isinstance(x, torch.Tensor):
            node = self.constant_tensor(x)
        elif isinstance(x, (bool, int, float)):
            kind = dtype if dtype is not None else (
                DType.BOOL if isinstance(x, bool) else DType.I64 if isinstance(x, int) else DType.F32)
            return self.splat(x, kind, shape if shape is not None else ())
        else:
            raise NotLowered(f"an argument of type {type(x).__name__}")
        if dtype is not None:
            node = self.convert(node, dtype)
        if shape is not None:
            node = self.broadcast(node, shape)
        return node

    def constant_tensor(self, x: torch.Tensor) -> ir.Node:
        if x.device.type != "cpu":
            raise NotLowered(f"a {x.device} tensor inside a lowering")
        dtype = _dtype(x.dtype)
        array = _numpy(x)
        flat = array.reshape(-1)
        if flat.size and (flat == flat[0]).all() and not (dtype.is_float and np.isnan(flat[0])):
            return self.splat(flat[0].item(), dtype, tuple(x.shape))
        if flat.size > 1 << 16:
            raise NotLowered("a large constant tensor")
        return ir.node(Op.CONSTANT, [], tuple(x.shape), dtype, self.loc, value=np.array(array, dtype.numpy))

    def splat(self, value, dtype: DType, shape=()) -> ir.Node:
        if dtype.is_float:
            value = float(value)
        elif dtype == DType.BOOL:
            value = bool(value)
        else:
            value = int(value)
        return ir.node(Op.CONSTANT, [], tuple(shape), dtype, self.loc, value=np.array(value, dtype.numpy))

    def convert(self, node: ir.Node, dtype: DType) -> ir.Node:
        if node.dtype == dtype:
            return node
        if node.op is Op.CONSTANT and node.attrs["value"].ndim == 0:
            return self.splat(node.attrs["value"].item(), dtype, node.shape)
        return ir.node(Op.CONVERT, [node], node.shape, dtype, self.loc)

    def broadcast(self, node: ir.Node, shape) -> ir.Node:
        shape = tuple(shape)
        if node.shape == shape:
            return node
        if node.op is Op.CONSTANT and node.attrs["value"].ndim == 0:
            return ir.node(Op.CONSTANT, [], shape, node.dtype, self.loc, value=node.attrs["value"])
        offset = len(shape) - len(node.shape)
        if offset < 0 or any(s not in (1, t) for s, t in zip(node.shape, shape[offset:])):
            raise NotLowered(f"cannot broadcast {node.shape} to {shape}")
        return ir.node(Op.BROADCAST_IN_DIM, [node], shape, node.dtype, self.loc,
                       dims=tuple(range(offset, len(shape))))

    def op(self, which: Op, inputs, shape, dtype: DType, /, **attrs) -> ir.Node:
        return ir.node(which, inputs, shape, dtype, self.loc, **attrs)

    def reshape(self, node: ir.Node, shape) -> ir.Node:
        shape = tuple(int(s) for s in shape)
        return node if node.shape == shape else self.op(Op.RESHAPE, [node], shape, node.dtype)

    def transpose(self, node: ir.Node, perm) -> ir.Node:
        perm = tuple(perm)
        if perm == tuple(range(len(perm))):
            return node
        return self.op(Op.TRANSPOSE, [node], [node.shape[p] for p in perm], node.dtype, perm=perm)

    def reduce(self, node: ir.Node, dims, kind: str, dtype: DType | None = None) -> ir.Node:
        """``node`` reduced over ``dims`` (the kept dims in order), in ``dtype`` (default: its own)."""
        dtype = node.dtype if dtype is None else dtype
        node = self.convert(node, dtype)
        dims = tuple(sorted(set(dims)))
        shape = tuple(s for d, s in enumerate(node.shape) if d not in dims)
        if not dims:
            return node
        init = self.splat(_REDUCE_INIT[kind](dtype), dtype)
        return self.op(Op.REDUCE, [node, init], shape, dtype, dims=dims, kind=kind)

    def iota(self, shape, dimension: int, dtype: DType = DType.I64) -> ir.Node:
        return self.op(Op.IOTA, [], shape, dtype, dimension=dimension)

    def select(self, pred: ir.Node, on_true: ir.Node, on_false: ir.Node) -> ir.Node:
        return self.op(Op.SELECT, [pred, on_true, on_false], on_true.shape, on_true.dtype)

    def compare(self, a: ir.Node, b: ir.Node, direction: str) -> ir.Node:
        return self.op(Op.COMPARE, [a, b], a.shape, DType.BOOL, direction=direction)


def _dtype(torch_dtype) -> DType:
    try:
        return dtype_of(torch_dtype)
    except KeyError:
        raise NotLowered(f"dtype {torch_dtype}") from None


def _numpy(x: torch.Tensor) -> np.ndarray:
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(DType.BF16.numpy)
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.view(torch.uint8).numpy().view(_dtype(x.dtype).numpy)
    return x.numpy()


def wrap(nodes, out_meta):
    """The op's result structure (as ``out_meta``), each meta tensor replaced by an IRTensor of its node."""
    nodes = nodes if isinstance(nodes, (tuple, list)) else (nodes,)
    nodes = [n for n in nodes if n is not None]
    flat, spec = tree_flatten(out_meta)
    tensors = [m for m in flat if isinstance(m, torch.Tensor)]
    if len(nodes) != len(tensors):
        raise NotLowered(f"a rule gave {len(nodes)} results for {len(tensors)}")
    made, remaining = [], iter(nodes)
    for meta in flat:
        if not isinstance(meta, torch.Tensor):
            made.append(meta)
            continue
        node = next(remaining)
        if node.shape != tuple(meta.shape) or node.dtype != _dtype(meta.dtype):
            raise NotLowered(f"a rule made {node.shape} {node.dtype.name} where PyTorch makes "
                             f"{tuple(meta.shape)} {meta.dtype}")
        made.append(IRTensor(node, meta))
    return tree_unflatten(made, spec)


# ---- the entry point ---------------------------------------------------------------------------------

class Lowered:
    """An op lowered for one signature: the graph (parameters in operand order, outputs in the order of the
    op's flat results, the empty ones left out), the result's structure, the (shape, dtype) of each flat result
    that is a tensor and
    the positions of those that are None (a backward op's gradients nobody asked for); then the operands the op
    mutates (batch norm's running statistics), whose new values are the graph's last outputs."""

    def __init__(self, graph: ir.Graph, out_spec, outputs: list, nones: tuple = (), mutated: list = (),
                 empty: tuple = ()):
        self.graph, self.out_spec, self.outputs, self.nones = graph, out_spec, outputs, nones
        self.mutated = list(mutated)  # operand indices whose new values are the graph's last outputs, in order
        self.empty = empty  # which tensor results are empty: no output of the graph (nothing to compute)


def lower(op, args: tuple, kwargs: dict, runtime: frozenset = frozenset(), name: str = "") -> Lowered:
    """Lower one ATen op called with ``args``/``kwargs`` (tensors: examples of the operands' shape and dtype;
    the numbers at the positions or names in ``runtime``: runtime inputs). The graph's parameters are the
    tensors and runtime numbers in the order of the arguments, then the keyword arguments (nested lists in
    order), which is the order of ``neuronc.pytorch.eager._signature``'s operands."""
    lowering = Lowering(name or str(op))

    def inputs(values):
        items = values.items() if isinstance(values, dict) else enumerate(values)
        done = {}
        for where, value in items:
            if isinstance(value, torch.Tensor):
                done[where] = lowering.tensor_input(value)
            elif type(value) in (int, float) and where in runtime:
                done[where] = lowering.scalar_input(value)
            elif isinstance(value, (list, tuple)):
                done[where] = type(value)(lowering.tensor_input(v) if isinstance(v, torch.Tensor) else v
                                          for v in value)
            else:
                done[where] = value
        return done if isinstance(values, dict) else tuple(done[i] for i in range(len(values)))

    lowered_args, lowered_kwargs = inputs(args), inputs(kwargs)
    out_meta = _meta_results(op, lowered_args, lowered_kwargs)
    flat, spec = tree_flatten(out_meta)
    if not any(isinstance(m, torch.Tensor) for m in flat) or \
            not all(isinstance(m, torch.Tensor) or m is None for m in flat):
        raise NotLowered("results that are not tensors")
    if all(m.numel() == 0 for m in flat if m is not None):
        raise NotLowered("only empty results")
    previous = getattr(_state, "lowering", None)
    _state.lowering = lowering
    try:
        nodes = lowering.apply(op, _wrapped_numbers(op, lowered_args), lowered_kwargs, out_meta)
        results = tree_flatten(wrap(nodes, out_meta))[0]
    finally:
        _state.lowering = previous
    outputs = [r.node for r in results if r is not None and r.numel() > 0]
    mutated = sorted(lowering.mutated.items())
    graph = ir.Graph(lowering.params, outputs + [t.node for _, t in mutated], name or "eager")
    tensors = [m for m in flat if m is not None]
    return Lowered(graph, spec, [(tuple(m.shape), m.dtype) for m in tensors],
                   tuple(i for i, m in enumerate(flat) if m is None), [index for index, _ in mutated],
                   tuple(i for i, m in enumerate(tensors) if m.numel() == 0))


def lower_function(fn, examples: list, name: str = "graph") -> ir.Graph:
    """The graph of ``fn`` (a function of tensors made of ATen ops, returning a tuple of tensors) on tensors of
    the examples' shapes and dtypes: each op lowered by its rule, so one graph holds them all (adaptive eager's
    batches of queued ops)."""
    lowering = Lowering(name)
    inputs = [lowering.tensor_input(x) for x in examples]
    previous = getattr(_state, "lowering", None)
    _state.lowering = lowering
    try:
        results = fn(*inputs)
        outputs = [lowering.node(r) for r in results]
    finally:
        _state.lowering = previous
    if lowering.mutated:
        raise NotLowered("a function that mutates its inputs")
    return ir.Graph(lowering.params, outputs, name)


def _wrapped_numbers(op, args: tuple) -> tuple:
    """Runtime numbers where the schema takes a Tensor become 0-d IRTensors (PyTorch's wrapped numbers), so
    that a decomposition can compute with them; those at Scalar positions stay RuntimeScalars for the rules."""
    schema = op._schema.arguments
    done = list(args)
    for i, value in enumerate(args):
        if isinstance(value, RuntimeScalar) and i < len(schema) and _is_tensor_type(schema[i].type):
            dtype = torch.float32 if value.kind is float else torch.int64
            done[i] = IRTensor(value.node, torch.empty((), dtype=dtype, device="meta"))
            done[i].wrapped_number = True
    return tuple(done)


def _is_number(value) -> bool:
    """A Python number (as given, a runtime input, or wrapped as a 0-d tensor)."""
    return isinstance(value, (bool, int, float, RuntimeScalar)) or getattr(value, "wrapped_number", False)


def _division_dtype(dtype: DType, divisor) -> DType:
    """What eager's floor and truncating divisions compute in: a float tensor's own dtype, each step rounded to it
    (its vectorized kernel rounds a 16-bit quotient before flooring it), but fp32 with the number as given for a
    16-bit tensor over a number; integers as they are."""
    return _opmath(dtype) if not dtype.is_float or _is_number(divisor) else dtype


def _is_tensor_type(kind) -> bool:
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


# ops whose torch decomposition disagrees with eager PyTorch (so torch-mlir's route, which uses it, would too):
# they run on the CPU
UNTRUSTED = {
    aten.multilabel_margin_loss_forward.default: "torch 2.13's decomposition of it disagrees with eager PyTorch",
}


def refused(op) -> str:
    """Why ``op`` must not be compiled at all (it runs on the CPU), or ""."""
    return UNTRUSTED.get(op, "")


@functools.cache
def _decompositions() -> dict:
    from torch._decomp import decomposition_table

    from neuronc.frontend import decompositions, float_semantics, linalg_decompositions, special_decompositions

    table = dict(decomposition_table)
    decompositions.merge_into(table, decompositions.OWN)
    table.update(linalg_decompositions.OWN)
    table.update(special_decompositions.OWN)
    table.update(float_semantics.OWN)
    table.update(OWN_DECOMPOSITIONS)
    for op in UNTRUSTED:
        table.pop(op, None)
    return table


# ---- rules ----------------------------------------------------------------------------------------------

RULES: dict = {}
OWN_DECOMPOSITIONS: dict = {}
_VIEW_OF_SELF = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}


def rule(*ops):
    def register(fn):
        for op in ops:
            RULES[op] = fn
        return fn
    return register


def _out(meta):
    """(shape, DType) of a meta result."""
    return tuple(meta.shape), _dtype(meta.dtype)


def _opmath(dtype: DType) -> DType:
    """The dtype PyTorch computes an op of ``dtype`` in: fp32 for 16- and 8-bit floats."""
    return DType.F32 if dtype.is_float and dtype != DType.F64 else dtype


_REDUCE_INIT = {
    "add": lambda d: 0, "mul": lambda d: 1,
    "max": lambda d: -math.inf if d.is_float else (False if d == DType.BOOL else np.iinfo(d.numpy).min),
    "min": lambda d: math.inf if d.is_float else (True if d == DType.BOOL else np.iinfo(d.numpy).max),
    "and": lambda d: True, "or": lambda d: False,
}


# -- elementwise -------------------------------------------------------------------------------------------

_UNARY = {
    aten.neg.default: Op.NEGATE, aten.abs.default: Op.ABS, aten.exp.default: Op.EXP, aten.expm1.default: Op.EXPM1,
    aten.log.default: Op.LOG, aten.log1p.default: Op.LOG1P, aten.sqrt.default: Op.SQRT, aten.rsqrt.default: Op.RSQRT,
    aten.tanh.default: Op.TANH, aten.sigmoid.default: Op.LOGISTIC, aten.sin.default: Op.SIN,
    aten.cos.default: Op.COS, aten.sign.default: Op.SIGN, aten.floor.default: Op.FLOOR, aten.ceil.default: Op.CEIL,
    aten.round.default: Op.ROUND, aten.erf.default: Op.ERF,
}


def _unary(kind):
    def lower_unary(lw, meta, x):
        shape, dtype = _out(meta)
        if kind in (Op.FLOOR, Op.CEIL, Op.ROUND) and not dtype.is_float:
            return lw.node(x, dtype)
        if kind is Op.ABS and dtype == DType.BOOL or kind is Op.SIGN and dtype == DType.BOOL:
            return lw.node(x, dtype)
        compute = _opmath(dtype)
        value = lw.op(kind, [lw.node(x, compute)], shape, compute)
        if kind is Op.SIGN and compute.is_float:  # PyTorch's sign of NaN is 0 ((0 < x) - (x < 0)); SIGN's is NaN
            nan = lw.compare(lw.node(x, compute), lw.node(x, compute), "NE")
            value = lw.select(nan, lw.splat(0.0, compute, shape), value)
        return lw.convert(value, dtype)
    return lower_unary


for _aten_op, _ir_op in _UNARY.items():
    RULES[_aten_op] = _unary(_ir_op)


@rule(aten.reciprocal.default)
def _reciprocal(lw, meta, x):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    return lw.convert(lw.op(Op.DIVIDE, [lw.splat(1.0, compute, shape), lw.node(x, compute)], shape, compute), dtype)


@rule(aten.relu.default)
def _relu(lw, meta, x):
    shape, dtype = _out(meta)
    return lw.op(Op.MAXIMUM, [lw.node(x), lw.splat(0, dtype, shape)], shape, dtype)


@rule(aten.silu.default)
def _silu(lw, meta, x):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    value = lw.node(x, compute)
    return lw.convert(lw.op(Op.MULTIPLY, [value, lw.op(Op.LOGISTIC, [value], shape, compute)], shape, compute), dtype)


@rule(aten.gelu.default)
def _gelu(lw, meta, x, approximate="none"):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    value = lw.node(x, compute)
    if approximate == "none":
        return lw.convert(lw.op(Op.GELU, [value], shape, compute), dtype)
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    cube = lw.op(Op.MULTIPLY, [lw.op(Op.MULTIPLY, [value, value], shape, compute), value], shape, compute)
    inner = lw.op(Op.ADD, [value, lw.op(Op.MULTIPLY, [cube, lw.splat(0.044715, compute, shape)], shape, compute)],
                  shape, compute)
    scaled = lw.op(Op.MULTIPLY, [inner, lw.splat(math.sqrt(2 / math.pi), compute, shape)], shape, compute)
    one_plus = lw.op(Op.ADD, [lw.op(Op.TANH, [scaled], shape, compute), lw.splat(1.0, compute, shape)], shape,
                     compute)
    half = lw.op(Op.MULTIPLY, [value, lw.splat(0.5, compute, shape)], shape, compute)
    return lw.convert(lw.op(Op.MULTIPLY, [half, one_plus], shape, compute), dtype)


@rule(aten.bitwise_not.default, aten.logical_not.default)
def _not(lw, meta, x):
    shape, dtype = _out(meta)
    if dtype == DType.BOOL:
        return lw.op(Op.NOT, [lw.node(x, DType.BOOL)], shape, dtype)
    if dtype.is_float:
        raise NotLowered("bitwise_not of floats")
    return lw.op(Op.NOT, [lw.node(x, dtype)], shape, dtype)


def _binary_operands(lw, shape, compute, a, b):
    return lw.node(a, compute, shape), lw.node(b, compute, shape)


def _added_operands(lw, shape, dtype, compute, a, b):
    """The operands of an add or subtract of a bf16 or fp16 result: each cast to that dtype first, as eager's
    TensorIterator casts them (a number included: its mul and div keep a number in fp32, its add rounds it)."""
    if dtype not in LOW_PRECISION:
        return _binary_operands(lw, shape, compute, a, b)
    return tuple(lw.convert(lw.node(v, dtype, shape), compute) for v in (a, b))


def _arithmetic(kind):
    def lower_binary(lw, meta, a, b):
        shape, dtype = _out(meta)
        compute = _opmath(dtype)
        x, y = _binary_operands(lw, shape, compute, a, b)
        return lw.convert(lw.op(kind, [x, y], shape, compute), dtype)
    return lower_binary


for _aten_op, _ir_op in {
    aten.mul.Tensor: Op.MULTIPLY, aten.mul.Scalar: Op.MULTIPLY, aten.maximum.default: Op.MAXIMUM,
    aten.minimum.default: Op.MINIMUM, aten.atan2.default: Op.ATAN2, aten.fmod.Tensor: Op.REMAINDER,
    aten.fmod.Scalar: Op.REMAINDER,
}.items():
    RULES[_aten_op] = _arithmetic(_ir_op)


def _logical(kind):
    def lower_logical(lw, meta, a, b):
        shape, dtype = _out(meta)
        if dtype.is_float:
            raise NotLowered("bitwise ops on floats")
        x, y = lw.node(a, dtype, shape), lw.node(b, dtype, shape)
        return lw.op(kind, [x, y], shape, dtype)
    return lower_logical


for _aten_op, _ir_op in {
    aten.bitwise_and.Tensor: Op.AND, aten.bitwise_or.Tensor: Op.OR, aten.bitwise_xor.Tensor: Op.XOR,
    aten.bitwise_and.Scalar: Op.AND, aten.bitwise_or.Scalar: Op.OR, aten.bitwise_xor.Scalar: Op.XOR,
    aten.__and__.Tensor: Op.AND, aten.__or__.Tensor: Op.OR, aten.__xor__.Tensor: Op.XOR,
    aten.__and__.Scalar: Op.AND, aten.__or__.Scalar: Op.OR, aten.__xor__.Scalar: Op.XOR,
}.items():
    RULES[_aten_op] = _logical(_ir_op)


@rule(aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default)
def _logical_op(lw, meta, a, b):
    shape, _ = _out(meta)
    kind = {"logical_and": Op.AND, "logical_or": Op.OR, "logical_xor": Op.XOR}[_current_name(lw)]
    x, y = (_truth(lw, v, shape) for v in (a, b))
    return lw.op(kind, [x, y], shape, DType.BOOL)


def _current_name(lw) -> str:
    return lw.current.split("::")[-1].split(".")[0]


def _truth(lw, value, shape) -> ir.Node:
    node = lw.node(value)
    if node.dtype == DType.BOOL:
        return lw.broadcast(node, shape)
    return lw.broadcast(lw.compare(node, lw.splat(0, node.dtype, node.shape), "NE"), shape)


def _scaled(lw, value, alpha, compute, shape):
    """value * alpha (alpha a number or a RuntimeScalar); value itself for the number 1."""
    if alpha is None or (not isinstance(alpha, RuntimeScalar) and alpha == 1):
        return value
    return lw.op(Op.MULTIPLY, [value, lw.node(alpha, compute, shape)], shape, compute)


@rule(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_sub(lw, meta, a, b, alpha=1):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    if dtype == DType.BOOL:  # add of booleans is or
        return lw.op(Op.OR, [lw.node(a, dtype, shape), lw.node(b, dtype, shape)], shape, dtype)
    x, y = _added_operands(lw, shape, dtype, compute, a, b)
    kind = Op.ADD if lw.current.startswith("aten::add") else Op.SUBTRACT
    return lw.convert(lw.op(kind, [x, _scaled(lw, y, alpha, compute, shape)], shape, compute), dtype)


@rule(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(lw, meta, a, b, alpha=1):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    x, y = _added_operands(lw, shape, dtype, compute, a, b)
    return lw.convert(lw.op(Op.SUBTRACT, [y, _scaled(lw, x, alpha, compute, shape)], shape, compute), dtype)


@rule(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(lw, meta, a, b, rounding_mode=None):
    shape, dtype = _out(meta)
    if rounding_mode is None:
        compute = _opmath(dtype)
        x, y = _binary_operands(lw, shape, compute, a, b)
        return lw.convert(lw.op(Op.DIVIDE, [x, y], shape, compute), dtype)
    compute = _division_dtype(dtype, b)
    x, y = _binary_operands(lw, shape, compute, a, b)
    if rounding_mode == "trunc":
        if not compute.is_float:
            return lw.convert(lw.op(Op.DIVIDE, [x, y], shape, compute), dtype)
        quotient = lw.op(Op.DIVIDE, [x, y], shape, compute)
        negative = lw.compare(quotient, lw.splat(0, compute, shape), "LT")
        truncated = lw.select(negative, lw.op(Op.CEIL, [quotient], shape, compute),
                              lw.op(Op.FLOOR, [quotient], shape, compute))
        return lw.convert(truncated, dtype)
    return lw.convert(_floor_divide(lw, x, y, shape, compute), dtype)


def _floor_divide(lw, x, y, shape, compute):
    """PyTorch's floor division: integers rounded toward -inf; floats as its CPU kernel (div_floor_floating), each
    step in `compute`."""
    zero = lw.splat(0, compute, shape)
    remainder = lw.op(Op.REMAINDER, [x, y], shape, compute)
    signs_differ = lw.op(Op.XOR, [lw.compare(remainder, zero, "LT"), lw.compare(y, zero, "LT")], shape, DType.BOOL)
    adjust = lw.op(Op.AND, [lw.compare(remainder, zero, "NE"), signs_differ], shape, DType.BOOL)
    if not compute.is_float:
        truncated = lw.op(Op.DIVIDE, [x, y], shape, compute)
        return lw.select(adjust, lw.op(Op.SUBTRACT, [truncated, lw.splat(1, compute, shape)], shape, compute),
                         truncated)
    divided = lw.op(Op.DIVIDE, [lw.op(Op.SUBTRACT, [x, remainder], shape, compute), y], shape, compute)
    divided = lw.select(adjust, lw.op(Op.SUBTRACT, [divided, lw.splat(1.0, compute, shape)], shape, compute), divided)
    floored = lw.op(Op.FLOOR, [divided], shape, compute)
    rounds_up = lw.compare(lw.op(Op.SUBTRACT, [divided, floored], shape, compute), lw.splat(0.5, compute, shape), "GT")
    result = lw.select(rounds_up, lw.op(Op.ADD, [floored, lw.splat(1.0, compute, shape)], shape, compute), floored)
    plain = lw.op(Op.DIVIDE, [x, y], shape, compute)  # a zero remainder: copysign(0, x / y) in PyTorch
    zero_result = lw.compare(divided, zero, "EQ")
    result = lw.select(zero_result, lw.op(Op.MULTIPLY, [plain, zero], shape, compute), result)
    return lw.select(lw.compare(y, zero, "EQ"), plain, result)  # by zero: x / y (+-inf, NaN), as PyTorch


@rule(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide_rule(lw, meta, a, b):
    shape, dtype = _out(meta)
    compute = _division_dtype(dtype, b)
    x, y = _binary_operands(lw, shape, compute, a, b)
    return lw.convert(_floor_divide(lw, x, y, shape, compute), dtype)


@rule(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def _remainder(lw, meta, a, b):
    """Python's modulo (the divisor's sign): fmod, moved into the divisor's sign."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    x, y = _binary_operands(lw, shape, compute, a, b)
    zero = lw.splat(0, compute, shape)
    r = lw.op(Op.REMAINDER, [x, y], shape, compute)
    differs = lw.op(Op.AND, [lw.compare(r, zero, "NE"), lw.op(Op.XOR, [lw.compare(r, zero, "LT"),
                                                                       lw.compare(y, zero, "LT")], shape, DType.BOOL)],
                    shape, DType.BOOL)
    return lw.convert(lw.select(differs, lw.op(Op.ADD, [r, y], shape, compute), r), dtype)


@rule(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(lw, meta, a, b):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    base = lw.node(a, compute, shape)
    if isinstance(b, (int, float)) and not isinstance(b, bool) and compute.is_float:
        special = {2: Op.MULTIPLY, 0.5: Op.SQRT, -0.5: Op.RSQRT}
        if b == 2:
            return lw.convert(lw.op(Op.MULTIPLY, [base, base], shape, compute), dtype)
        if b == 3 or (b == -2 and dtype == DType.BF16):
            square = lw.op(Op.MULTIPLY, [base, base], shape, compute)
            if dtype == DType.BF16:  # eager's bf16 x * x * x and 1 / (x * x) round each step to bf16
                square = lw.convert(lw.convert(square, dtype), compute)
            power = lw.op(Op.MULTIPLY, [square, base], shape, compute) if b == 3 else \
                lw.op(Op.DIVIDE, [lw.splat(1.0, compute, shape), square], shape, compute)
            return lw.convert(power, dtype)
        if b in special:
            return lw.convert(lw.op(special[b], [base], shape, compute), dtype)
        if b == 1:
            return lw.convert(base, dtype)
        if b == -1:
            return lw.convert(lw.op(Op.DIVIDE, [lw.splat(1.0, compute, shape), base], shape, compute), dtype)
    exponent = lw.node(b, compute, shape)
    return lw.convert(lw.op(Op.POWER, [base, exponent], shape, compute), dtype)


_COMPARISONS = {"eq": "EQ", "ne": "NE", "lt": "LT", "le": "LE", "gt": "GT", "ge": "GE"}


@rule(*(getattr(getattr(aten, name), overload) for name in _COMPARISONS for overload in ("Tensor", "Scalar")))
def _compare(lw, meta, a, b):
    shape, _ = _out(meta)
    common = _dtype(torch.result_type(_promotable(a), _promotable(b)))
    x, y = lw.node(a, common, shape), lw.node(b, common, shape)
    return lw.compare(x, y, _COMPARISONS[_current_name(lw)])


def _promotable(x):
    """What ``torch.result_type`` takes for a lowering's argument."""
    if isinstance(x, IRTensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, RuntimeScalar):
        return x.example()
    return x


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(lw, meta, condition, a, b):
    shape, dtype = _out(meta)
    return lw.select(lw.node(condition, DType.BOOL, shape), lw.node(a, dtype, shape), lw.node(b, dtype, shape))


@rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(lw, meta, x, mask, value):
    shape, dtype = _out(meta)
    return lw.select(lw.node(mask, DType.BOOL, shape), lw.node(value, dtype, shape), lw.node(x, dtype, shape))


@rule(aten.clamp.default, aten.clamp.Tensor)
def _clamp(lw, meta, x, min=None, max=None):  # noqa: A002 (the schema's names)
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    value = lw.node(x, compute, shape)
    if min is not None:
        value = lw.op(Op.MAXIMUM, [value, lw.node(min, compute, shape)], shape, compute)
    if max is not None:
        value = lw.op(Op.MINIMUM, [value, lw.node(max, compute, shape)], shape, compute)
    return lw.convert(value, dtype)


@rule(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(lw, meta, x, bound):
    return _clamp(lw, meta, x, min=bound)


@rule(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(lw, meta, x, bound):
    return _clamp(lw, meta, x, max=bound)


@rule(aten.addcmul.default, aten.addcdiv.default)
def _addc(lw, meta, x, tensor1, tensor2, value=1):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    base, t1, t2 = (lw.node(v, compute, shape) for v in (x, tensor1, tensor2))
    kind = Op.MULTIPLY if lw.current.startswith("aten::addcmul") else Op.DIVIDE
    # as PyTorch's CPU kernels round: self + value * tensor1 (*|/) tensor2, left to right
    term = lw.op(kind, [_scaled(lw, t1, value, compute, shape), t2], shape, compute)
    return lw.convert(lw.op(Op.ADD, [base, term], shape, compute), dtype)


@rule(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(lw, meta, start, end, weight):
    """PyTorch's lerp: start + w (end - start) for |w| < 0.5, else end - (end - start)(1 - w)."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    s, e, w = lw.node(start, compute, shape), lw.node(end, compute, shape), lw.node(weight, compute, shape)
    diff = lw.op(Op.SUBTRACT, [e, s], shape, compute)
    low = lw.op(Op.ADD, [s, lw.op(Op.MULTIPLY, [w, diff], shape, compute)], shape, compute)
    one_minus = lw.op(Op.SUBTRACT, [lw.splat(1.0, compute, shape), w], shape, compute)
    high = lw.op(Op.SUBTRACT, [e, lw.op(Op.MULTIPLY, [diff, one_minus], shape, compute)], shape, compute)
    small = lw.compare(lw.op(Op.ABS, [w], shape, compute), lw.splat(0.5, compute, shape), "LT")
    return lw.convert(lw.select(small, low, high), dtype)


@rule(aten.threshold_backward.default)
def _threshold_backward(lw, meta, grad, x, threshold):
    shape, dtype = _out(meta)
    below = lw.compare(lw.node(x, _dtype(x.dtype), shape), lw.node(threshold, _dtype(x.dtype), shape), "LE")
    return lw.select(below, lw.splat(0, dtype, shape), lw.node(grad, dtype, shape))


@rule(aten.sigmoid_backward.default)
def _sigmoid_backward(lw, meta, grad, y):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    g, s = lw.node(grad, compute, shape), lw.node(y, compute, shape)
    one_minus = lw.op(Op.SUBTRACT, [lw.splat(1.0, compute, shape), s], shape, compute)
    return lw.convert(lw.op(Op.MULTIPLY, [g, lw.op(Op.MULTIPLY, [one_minus, s], shape, compute)], shape, compute),
                      dtype)


@rule(aten.tanh_backward.default)
def _tanh_backward(lw, meta, grad, y):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    g, t = lw.node(grad, compute, shape), lw.node(y, compute, shape)
    one_minus = lw.op(Op.SUBTRACT, [lw.splat(1.0, compute, shape), lw.op(Op.MULTIPLY, [t, t], shape, compute)],
                      shape, compute)
    return lw.convert(lw.op(Op.MULTIPLY, [g, one_minus], shape, compute), dtype)


@rule(aten.silu_backward.default)
def _silu_backward(lw, meta, grad, x):
    """grad * s (1 + x (1 - s)), s = sigmoid(x)."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    g, v = lw.node(grad, compute, shape), lw.node(x, compute, shape)
    s = lw.op(Op.LOGISTIC, [v], shape, compute)
    one = lw.splat(1.0, compute, shape)
    inner = lw.op(Op.ADD, [one, lw.op(Op.MULTIPLY, [v, lw.op(Op.SUBTRACT, [one, s], shape, compute)], shape, compute)],
                  shape, compute)
    return lw.convert(lw.op(Op.MULTIPLY, [g, lw.op(Op.MULTIPLY, [s, inner], shape, compute)], shape, compute), dtype)


# -- conversions, copies and factories -------------------------------------------------------------------

@rule(aten.clone.default, aten.contiguous.default, aten._to_copy.default, prims.convert_element_type.default,
      aten.to.dtype, aten._unsafe_view.default, aten.view.default, aten.reshape.default, aten._reshape_copy.default,
      aten.view_copy.default, aten.lift_fresh_copy.default)
def _copy(lw, meta, x, *args, **kwargs):
    shape, dtype = _out(meta)
    return lw.reshape(lw.node(x, dtype), shape)


@rule(aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default, aten.scalar_tensor.default,
      aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
      aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
      aten.empty_strided.default, aten.new_empty_strided.default, aten.fill.Scalar, prims.full.default)
def _factory(lw, meta, *args, **kwargs):
    shape, dtype = _out(meta)
    name = _current_name(lw)
    if name in ("ones", "ones_like", "new_ones"):
        value = 1
    elif name in ("full", "full_like", "fill"):  # (size or self, fill_value)
        value = args[1]
    elif name == "new_full":  # (self, size, fill_value)
        value = args[2]
    elif name == "scalar_tensor":
        value = args[0]
    else:
        value = 0
    if isinstance(value, RuntimeScalar):
        return lw.node(value, dtype, shape)
    if isinstance(value, torch.Tensor):
        raise NotLowered("a factory filled from a tensor")
    return lw.splat(value, dtype, shape)


@rule(aten.fill.Tensor)
def _fill_tensor(lw, meta, x, value):
    shape, dtype = _out(meta)
    return lw.node(value, dtype, shape)


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, prims.iota.default)
def _arange(lw, meta, *args, **kwargs):
    shape, dtype = _out(meta)
    name = _current_name(lw)
    if name == "iota":
        start, step = kwargs.get("start", 0), kwargs.get("step", 1)
    elif lw.current.endswith(".start_step"):
        start, step = args[0], args[2] if len(args) > 2 else kwargs.get("step", 1)
    elif lw.current.endswith(".start"):
        start, step = args[0], 1
    else:
        start, step = 0, 1
    if any(isinstance(v, (RuntimeScalar, torch.Tensor)) for v in (start, step)):
        raise NotLowered("arange with tensor bounds")
    compute = DType.F32 if dtype.is_float or any(isinstance(v, float) for v in (start, step)) else DType.I64
    counts = lw.iota(shape, 0, compute)
    value = lw.op(Op.ADD, [lw.op(Op.MULTIPLY, [counts, lw.splat(step, compute, shape)], shape, compute),
                           lw.splat(start, compute, shape)], shape, compute)
    return lw.convert(value, dtype)


# -- views as values ----------------------------------------------------------------------------------------

@rule(aten.permute.default, prims.transpose.default)
def _permute(lw, meta, x, dims):
    return lw.transpose(lw.node(x), [d % max(1, x.dim()) for d in dims])


@rule(aten.transpose.int)
def _transpose(lw, meta, x, a, b):
    rank = max(1, x.dim())
    perm = list(range(x.dim()))
    if perm:
        perm[a % rank], perm[b % rank] = perm[b % rank], perm[a % rank]
    return lw.transpose(lw.node(x), perm)


@rule(aten.t.default, aten.numpy_T.default)
def _t(lw, meta, x):
    return lw.transpose(lw.node(x), list(reversed(range(x.dim()))))


@rule(aten.expand.default, aten.expand_copy.default)
def _expand(lw, meta, x, size, implicit=False):
    shape, _ = _out(meta)
    return lw.broadcast(lw.node(x), shape)


@rule(prims.broadcast_in_dim.default)
def _broadcast_in_dim(lw, meta, x, shape, dims):
    return lw.op(Op.BROADCAST_IN_DIM, [lw.node(x)], tuple(shape), _dtype(x.dtype), dims=tuple(dims))


@rule(aten.as_strided.default)
def _as_strided(lw, meta, x, size, stride, storage_offset=None):
    """A strided view of a value's dense buffer (what adaptive eager reads a result through)."""
    if not x.is_contiguous() or x.storage_offset():
        raise NotLowered("as_strided of a value that is not a whole dense tensor")
    shape, dtype = _out(meta)
    return lw.op(Op.VIEW, [lw.node(x)], shape, dtype, offset=int(storage_offset or 0),
                 strides=tuple(int(s) for s in stride))


@rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, prims.squeeze.default,
      aten.squeeze_copy.dim, aten.unsqueeze_copy.default, aten.flatten.using_ints, aten.unflatten.int,
      prims.collapse_view.default, prims.split_dim.default)
def _reshape_view(lw, meta, x, *args):
    shape, _ = _out(meta)
    return lw.reshape(lw.node(x), shape)


@rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(lw, meta, x, dim=0, start=None, end=None, step=1):
    shape, _ = _out(meta)
    dim %= max(1, x.dim())
    size = x.shape[dim]
    start = 0 if start is None else start
    start = max(0, min(size, start + size if start < 0 else start))
    begin = [0] * x.dim()
    limit = list(x.shape)
    strides = [1] * x.dim()
    begin[dim] = start
    limit[dim] = min(size, start + (shape[dim] - 1) * step + 1) if shape[dim] else start
    strides[dim] = step
    if shape[dim] == 0:
        raise NotLowered("an empty slice")
    return lw.op(Op.SLICE, [lw.node(x)], shape, _dtype(x.dtype), start=tuple(begin), limit=tuple(limit),
                 strides=tuple(strides))


@rule(aten.select.int, aten.select_copy.int)
def _select(lw, meta, x, dim, index):
    shape, dtype = _out(meta)
    dim %= x.dim()
    index = index + x.shape[dim] if index < 0 else index
    begin, limit = [0] * x.dim(), list(x.shape)
    begin[dim], limit[dim] = index, index + 1
    sliced = lw.op(Op.SLICE, [lw.node(x)], tuple(limit[d] - begin[d] for d in range(x.dim())), dtype,
                   start=tuple(begin), limit=tuple(limit), strides=(1,) * x.dim())
    return lw.reshape(sliced, shape)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
      aten.tensor_split.sections)
def _split(lw, meta, x, *args, **kwargs):
    name = _current_name(lw)
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) if name != "unbind" else (args[0] if args else 0)
    dim %= x.dim()
    nodes, offset = [], 0
    for part in meta:
        length = part.shape[dim] if name != "unbind" else 1
        begin, limit = [0] * x.dim(), list(x.shape)
        begin[dim], limit[dim] = offset, offset + length
        if length == 0:
            raise NotLowered("an empty split")
        piece = lw.op(Op.SLICE, [lw.node(x)], tuple(limit[d] - begin[d] for d in range(x.dim())), _dtype(x.dtype),
                      start=tuple(begin), limit=tuple(limit), strides=(1,) * x.dim())
        nodes.append(lw.reshape(piece, part.shape))
        offset += length
    return tuple(nodes)


@rule(aten.cat.default)
def _cat(lw, meta, tensors, dim=0):
    shape, dtype = _out(meta)
    parts = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0) and t.numel() > 0]
    if not parts:
        raise NotLowered("a concatenation of empty tensors")
    dim %= len(shape)
    nodes = [lw.node(t, dtype) for t in parts]
    if len(nodes) == 1:
        return lw.reshape(nodes[0], shape)
    return lw.op(Op.CONCATENATE, nodes, shape, dtype, dimension=dim)


@rule(aten.stack.default)
def _stack(lw, meta, tensors, dim=0):
    shape, dtype = _out(meta)
    dim %= len(shape)
    pieces = []
    for t in tensors:
        piece_shape = list(t.shape)
        piece_shape.insert(dim, 1)
        pieces.append(lw.reshape(lw.node(t, dtype), piece_shape))
    if len(pieces) == 1:
        return pieces[0]
    return lw.op(Op.CONCATENATE, pieces, shape, dtype, dimension=dim)


@rule(aten.constant_pad_nd.default)
def _constant_pad(lw, meta, x, pad, value=0):
    shape, dtype = _out(meta)
    rank = x.dim()
    low, high = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        low[rank - 1 - i], high[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    return lw.op(Op.PAD, [lw.node(x), lw.splat(value, dtype)], shape, dtype, low=tuple(low), high=tuple(high),
                 interior=(0,) * rank)


@rule(aten.flip.default)
def _flip(lw, meta, x, dims):
    return lw.op(Op.REVERSE, [lw.node(x)], tuple(x.shape), _dtype(x.dtype), dims=tuple(d % x.dim() for d in dims))


@rule(aten.repeat.default)
def _repeat(lw, meta, x, repeats):
    shape, dtype = _out(meta)
    node = lw.node(x)
    lead = len(repeats) - x.dim()
    source = [1] * lead + list(x.shape)
    interleaved, spread = [], []
    for r, s in zip(repeats, source):
        interleaved += [1, s]
        spread += [r, s]
    node = lw.reshape(node, interleaved)
    node = lw.broadcast(node, spread)
    return lw.reshape(node, shape)


@rule(aten.slice_backward.default)
def _slice_backward(lw, meta, grad, input_sizes, dim, start, end, step):
    shape, dtype = _out(meta)
    dim %= len(shape)
    size = shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    start = max(0, min(size, start))
    length = grad.shape[dim]
    low, high, interior = [0] * len(shape), [0] * len(shape), [0] * len(shape)
    low[dim], interior[dim] = start, step - 1
    high[dim] = size - start - (length - 1) * step - 1 if length else size - start
    return lw.op(Op.PAD, [lw.node(grad, dtype), lw.splat(0, dtype)], shape, dtype, low=tuple(low), high=tuple(high),
                 interior=tuple(interior))


@rule(aten.select_backward.default)
def _select_backward(lw, meta, grad, input_sizes, dim, index):
    shape, dtype = _out(meta)
    dim %= len(shape)
    index = index + shape[dim] if index < 0 else index
    expanded = list(grad.shape)
    expanded.insert(dim, 1)
    low, high = [0] * len(shape), [0] * len(shape)
    low[dim], high[dim] = index, shape[dim] - index - 1
    return lw.op(Op.PAD, [lw.reshape(lw.node(grad, dtype), expanded), lw.splat(0, dtype)], shape, dtype,
                 low=tuple(low), high=tuple(high), interior=(0,) * len(shape))


@rule(aten.tril.default, aten.triu.default)
def _triangle(lw, meta, x, diagonal=0):
    shape, dtype = _out(meta)
    rows, cols = lw.iota(shape, len(shape) - 2), lw.iota(shape, len(shape) - 1)
    shifted = lw.op(Op.ADD, [rows, lw.splat(diagonal, DType.I64, shape)], shape, DType.I64)
    keep = lw.compare(cols, shifted, "LE" if _current_name(lw) == "tril" else "GE")
    return lw.select(keep, lw.node(x), lw.splat(0, dtype, shape))


# -- reductions -------------------------------------------------------------------------------------------------

def _dims(x, dim) -> tuple:
    rank = x.dim()
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return tuple(sorted({d % max(1, rank) for d in dims})) if rank else ()


def _reduced(lw, node, dims, kind, compute, shape):
    """``node`` reduced over ``dims`` in ``compute``, reshaped to ``shape`` (keepdim or not)."""
    return lw.reshape(lw.reduce(node, dims, kind, compute), shape)


@rule(aten.sum.dim_IntList, aten.sum.default, prims.sum.default)
def _sum(lw, meta, x, dim=None, keepdim=False, *, dtype=None, output_dtype=None):
    shape, out = _out(meta)
    compute = _opmath(out)
    if compute == DType.BOOL:
        compute = DType.I64
    return lw.convert(_reduced(lw, lw.node(x, compute), _dims(x, dim), "add", compute, shape), out)


@rule(aten.mean.dim, aten.mean.default)
def _mean(lw, meta, x, dim=None, keepdim=False, *, dtype=None):
    shape, out = _out(meta)
    compute = _opmath(out)
    dims = _dims(x, dim)
    count = int(np.prod([x.shape[d] for d in dims], dtype=np.int64))
    total = _reduced(lw, lw.node(x, compute), dims, "add", compute, shape)
    return lw.convert(lw.op(Op.DIVIDE, [total, lw.splat(count, compute, shape)], shape, compute), out)


@rule(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _extreme(lw, meta, x, dim=None, keepdim=False):
    shape, dtype = _out(meta)
    kind = "max" if _current_name(lw) in ("amax", "max") else "min"
    if dtype == DType.BOOL:
        kind = "or" if kind == "max" else "and"
    return _reduced(lw, lw.node(x), _dims(x, dim), kind, dtype, shape)


@rule(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any_all(lw, meta, x, dim=None, keepdim=False):
    shape, dtype = _out(meta)
    truth = _truth(lw, x, tuple(x.shape))
    as_int = lw.convert(truth, DType.I32)
    kind = "max" if _current_name(lw) == "any" else "min"
    return lw.convert(_reduced(lw, as_int, _dims(x, dim), kind, DType.I32, shape), dtype)


def _arg_extreme(lw, x, dim, keepdim, kind):
    """(values, first index) of the max or min of x along dim (all dims, flattened, for None)."""
    node = lw.node(x)
    if dim is None or x.dim() == 0:
        node = lw.reshape(node, (max(1, x.numel()),))
        dim = 0
    dim %= max(1, len(node.shape))
    dtype = node.dtype
    best = lw.reduce(node, (dim,), kind)
    kept = tuple(d for d in range(len(node.shape)) if d != dim)
    spread = lw.op(Op.BROADCAST_IN_DIM, [best], node.shape, dtype, dims=kept)
    holds = lw.compare(node, spread, "EQ")
    if dtype.is_float:  # a NaN is the max (and min) in PyTorch, and the first one is returned
        holds = lw.op(Op.OR, [holds, lw.compare(node, node, "NE")], node.shape, DType.BOOL)
    positions = lw.iota(node.shape, dim)
    candidates = lw.select(holds, positions, lw.splat(node.shape[dim], DType.I64, node.shape))
    index = lw.reduce(candidates, (dim,), "min")
    if dtype.is_float:
        has_nan = lw.reduce(lw.convert(lw.compare(node, node, "NE"), DType.I32), (dim,), "max")
        best = lw.select(lw.compare(has_nan, lw.splat(0, DType.I32, has_nan.shape), "NE"),
                         lw.splat(math.nan, dtype, best.shape), best)
    return best, index


@rule(aten.argmax.default, aten.argmin.default)
def _argmax(lw, meta, x, dim=None, keepdim=False):
    shape, _ = _out(meta)
    _, index = _arg_extreme(lw, x, dim, keepdim, "max" if _current_name(lw) == "argmax" else "min")
    return lw.reshape(index, shape)


@rule(aten.max.dim, aten.min.dim)
def _max_dim(lw, meta, x, dim, keepdim=False):
    (shape, _), (index_shape, _) = _out(meta[0]), _out(meta[1])
    best, index = _arg_extreme(lw, x, dim, keepdim, "max" if _current_name(lw) == "max" else "min")
    return lw.reshape(best, shape), lw.reshape(index, index_shape)


def _variance(lw, node, dims, correction, shape):
    compute = node.dtype
    count = int(np.prod([node.shape[d] for d in dims], dtype=np.int64))
    kept = tuple(d for d in range(len(node.shape)) if d not in dims)
    total = lw.reduce(node, dims, "add")
    mean = lw.op(Op.DIVIDE, [total, lw.splat(count, compute, total.shape)], total.shape, compute)
    spread = lw.op(Op.BROADCAST_IN_DIM, [mean], node.shape, compute, dims=kept)
    centered = lw.op(Op.SUBTRACT, [node, spread], node.shape, compute)
    squares = lw.reduce(lw.op(Op.MULTIPLY, [centered, centered], node.shape, compute), dims, "add")
    divisor = max(0, count - correction)
    variance = lw.op(Op.DIVIDE, [squares, lw.splat(divisor, compute, squares.shape)], squares.shape, compute)
    return lw.reshape(variance, shape), lw.reshape(mean, shape)


def _correction(correction, unbiased=None):
    if correction is None:
        return 1 if unbiased is None or unbiased else 0
    return correction


@rule(aten.var.correction, aten.var_mean.correction, aten.std.correction)
def _var(lw, meta, x, dim=None, *, correction=None, keepdim=False):
    metas = meta if isinstance(meta, tuple) else (meta,)
    shape, dtype = _out(metas[0])
    compute = _opmath(dtype)
    variance, mean = _variance(lw, lw.node(x, compute), _dims(x, dim), _correction(correction), shape)
    if _current_name(lw) == "std":
        variance = lw.op(Op.SQRT, [variance], shape, compute)
    if _current_name(lw) == "var_mean":
        return lw.convert(variance, dtype), lw.convert(mean, dtype)
    return lw.convert(variance, dtype)


@rule(aten.cumsum.default)
def _cumsum(lw, meta, x, dim, *, dtype=None):
    shape, out = _out(meta)
    compute = _opmath(out)
    if compute == DType.BOOL:
        compute = DType.I64
    dim %= max(1, x.dim())
    n = shape[dim] if shape else 1
    window = [1] * len(shape)
    window[dim] = n
    padding = [(0, 0)] * len(shape)
    padding[dim] = (n - 1, 0)
    value = lw.op(Op.REDUCE_WINDOW, [lw.node(x, compute), lw.splat(0, compute)], shape, compute,
                  window=tuple(window), strides=(1,) * len(shape), padding=tuple(padding), kind="add")
    return lw.convert(value, out)


# -- matrix products -------------------------------------------------------------------------------------------

def _dot(lw, a, b, out_shape, dtype, lhs_batch, rhs_batch, lhs_contract, rhs_contract):
    """A DOT_GENERAL in fp32 (operands widened from 16-bit floats, which the canonicalisation multiplies in
    their own type, exactly) with the result rounded to ``dtype``, as PyTorch's CPU matmuls accumulate."""
    if not dtype.is_float:
        raise NotLowered("an integer matrix product")
    compute = _opmath(dtype)
    product = lw.op(Op.DOT_GENERAL, [lw.node(a, compute), lw.node(b, compute)], out_shape, compute,
                    lhs_batch=tuple(lhs_batch), rhs_batch=tuple(rhs_batch), lhs_contract=tuple(lhs_contract),
                    rhs_contract=tuple(rhs_contract))
    return product


def _contraction(*dims):
    """The rule of a matrix product whose dims are (lhs_batch, rhs_batch, lhs_contract, rhs_contract)."""
    def lower(lw, meta, a, b):
        shape, dtype = _out(meta)
        return lw.convert(_dot(lw, a, b, shape, dtype, *dims), dtype)
    return lower


for _aten_op, _contracted in {aten.mm.default: ((), (), (1,), (0,)), aten.bmm.default: ((0,), (0,), (2,), (1,)),
                        aten.mv.default: ((), (), (1,), (0,)), aten.dot.default: ((), (), (0,), (0,))}.items():
    RULES[_aten_op] = _contraction(*_contracted)


@rule(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(lw, meta, bias, a, b, *, beta=1, alpha=1):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    name = _current_name(lw)
    dims = {"addmm": ((), (), (1,), (0,)), "baddbmm": ((0,), (0,), (2,), (1,)), "addmv": ((), (), (1,), (0,))}[name]
    product = _scaled(lw, _dot(lw, a, b, shape, dtype, *dims), alpha, compute, shape)
    if not isinstance(beta, RuntimeScalar) and beta == 0:
        return lw.convert(product, dtype)
    base = _scaled(lw, lw.node(bias, compute, shape), beta, compute, shape)
    return lw.convert(lw.op(Op.ADD, [product, base], shape, compute), dtype)


# -- normalisations --------------------------------------------------------------------------------------------

@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(lw, meta, x, dim, half_to_float):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    node = lw.node(x, compute)
    dim %= max(1, x.dim())
    if not x.dim():
        node = lw.reshape(node, (1,))
    kept = tuple(d for d in range(len(node.shape)) if d != dim)
    spread = lambda v: lw.op(Op.BROADCAST_IN_DIM, [v], node.shape, compute, dims=kept)  # noqa: E731
    shifted = lw.op(Op.SUBTRACT, [node, spread(lw.reduce(node, (dim,), "max"))], node.shape, compute)
    exps = lw.op(Op.EXP, [shifted], node.shape, compute)
    total = lw.reduce(exps, (dim,), "add")
    if _current_name(lw) == "_softmax":
        result = lw.op(Op.DIVIDE, [exps, spread(total)], node.shape, compute)
    else:
        result = lw.op(Op.SUBTRACT, [shifted, spread(lw.op(Op.LOG, [total], total.shape, compute))], node.shape,
                       compute)
    return lw.convert(lw.reshape(result, shape), dtype)


@rule(aten.native_layer_norm.default)
def _layer_norm(lw, meta, x, normalized_shape, weight, bias, eps):
    """(out, mean, rstd) as PyTorch computes them: statistics in fp32 over the last dims."""
    (shape, dtype), (stat_shape, stat_dtype) = _out(meta[0]), _out(meta[1])
    compute = _opmath(dtype)
    node = lw.node(x, compute)
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    kept = tuple(d for d in range(x.dim()) if d not in dims)
    variance, mean = _variance(lw, node, dims, 0, tuple(shape[d] for d in kept))
    spread = lambda v: lw.op(Op.BROADCAST_IN_DIM, [v], shape, compute, dims=kept)  # noqa: E731
    rstd = lw.op(Op.RSQRT, [lw.op(Op.ADD, [variance, lw.splat(eps, compute, variance.shape)], variance.shape,
                                  compute)], variance.shape, compute)
    out = lw.op(Op.MULTIPLY, [lw.op(Op.SUBTRACT, [node, spread(mean)], shape, compute), spread(rstd)], shape,
                compute)
    if weight is not None:
        out = lw.op(Op.MULTIPLY, [out, lw.node(weight, compute, shape)], shape, compute)
    if bias is not None:
        out = lw.op(Op.ADD, [out, lw.node(bias, compute, shape)], shape, compute)
    return (lw.convert(out, dtype), lw.convert(lw.reshape(mean, stat_shape), stat_dtype),
            lw.convert(lw.reshape(rstd, stat_shape), stat_dtype))


# -- indexing ------------------------------------------------------------------------------------------------

def _wrapped(lw, index: ir.Node, size: int) -> ir.Node:
    """Negative indices counted from the end, as eager PyTorch reads them."""
    index = lw.convert(index, DType.I64)
    negative = lw.compare(index, lw.splat(0, DType.I64, index.shape), "LT")
    return lw.select(negative, lw.op(Op.ADD, [index, lw.splat(size, DType.I64, index.shape)], index.shape, DType.I64),
                     index)


@rule(aten.embedding.default)
def _embedding(lw, meta, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    shape, dtype = _out(meta)
    rank = indices.dim()
    return lw.op(Op.GATHER, [lw.node(weight), lw.convert(lw.node(indices), DType.I64)], shape, dtype,
                 window_dims=(rank,), dropped_dims=(0,), operand_batching_dims=(), indices_batching_dims=(),
                 index_map=(0,), index_vector_dim=rank, window=(1, weight.shape[1]))


@rule(aten.index_select.default)
def _index_select(lw, meta, x, dim, index):
    shape, dtype = _out(meta)
    if x.dim() == 0:  # x's one element, where the index is one 0 or -1 (PyTorch refuses more values)
        if index.numel() != 1:
            raise NotLowered("an index_select of a 0-d tensor at more than one index")
        return lw.broadcast(lw.node(x), shape)
    dim %= max(1, x.dim())
    window = list(x.shape)
    window[dim] = 1
    indices = _wrapped(lw, lw.node(index), x.shape[dim])
    if index.dim() == 0:
        indices = lw.reshape(indices, (1,))
    return lw.op(Op.GATHER, [lw.node(x), indices], shape, dtype,
                 window_dims=tuple(d for d in range(len(shape)) if d != dim), dropped_dims=(dim,),
                 operand_batching_dims=(), indices_batching_dims=(), index_map=(dim,), index_vector_dim=1,
                 window=tuple(window))


def _aligned_index(lw, x, dim, index):
    """x sliced to index's sizes on the other dims, and index with negatives wrapped (torch.gather/scatter)."""
    node = lw.node(x)
    if any(index.shape[d] != x.shape[d] for d in range(x.dim()) if d != dim):
        limit = [index.shape[d] if d != dim else x.shape[d] for d in range(x.dim())]
        node = lw.op(Op.SLICE, [node], tuple(limit), node.dtype, start=(0,) * x.dim(), limit=tuple(limit),
                     strides=(1,) * x.dim())
    return node, _wrapped(lw, lw.node(index), x.shape[dim])


@rule(aten.gather.default)
def _gather(lw, meta, x, dim, index, sparse_grad=False):
    shape, dtype = _out(meta)
    dim %= max(1, x.dim())
    rank = x.dim()
    others = tuple(d for d in range(rank) if d != dim)
    node = lw.node(x)
    if any(index.shape[d] > x.shape[d] for d in others):
        raise NotLowered("a gather index larger than the input")
    if any(index.shape[d] != x.shape[d] for d in others):
        limit = [index.shape[d] if d != dim else x.shape[d] for d in range(rank)]
        node = lw.op(Op.SLICE, [node], tuple(limit), node.dtype, start=(0,) * rank, limit=tuple(limit),
                     strides=(1,) * rank)
    indices = _wrapped(lw, lw.node(index), x.shape[dim])
    return lw.op(Op.GATHER, [node, indices], shape, dtype, window_dims=(), dropped_dims=(dim,),
                 operand_batching_dims=others, indices_batching_dims=others, index_map=(dim,), index_vector_dim=rank,
                 window=(1,) * rank)


def _scatter_node(lw, base, dim, index, updates, combine, shape, dtype):
    rank = len(shape)
    others = tuple(d for d in range(rank) if d != dim)
    if tuple(index.shape) != tuple(updates.shape) and tuple(index.shape) != tuple(shape):
        raise NotLowered("a scatter whose index and source differ in shape")
    indices = _wrapped(lw, lw.node(index), shape[dim])
    source = lw.node(updates, dtype)
    if any(index.shape[d] != shape[d] for d in others):
        raise NotLowered("a scatter over part of the other dims")
    return lw.op(Op.SCATTER, [base, indices, source], shape, dtype, window_dims=(), dropped_dims=(dim,),
                 operand_batching_dims=others, indices_batching_dims=others, index_map=(dim,), index_vector_dim=rank,
                 window=(1,) * rank, combine=combine)


@rule(aten.scatter.src, aten.scatter_add.default, aten.scatter.value)
def _scatter(lw, meta, x, dim, index, src):
    shape, dtype = _out(meta)
    dim %= max(1, x.dim())
    if not isinstance(src, torch.Tensor):
        src = torch.full(tuple(index.shape), src, dtype=x.dtype)
    combine = "add" if _current_name(lw) == "scatter_add" else "replace"  # repeated indices: the last write wins
    return _scatter_node(lw, lw.node(x), dim, index, src, combine, shape, dtype)


@rule(aten.index_add.default)
def _index_add(lw, meta, x, dim, index, source, *, alpha=1):
    shape, dtype = _out(meta)
    if x.dim() == 0:  # one element: the index is one 0 (or -1) and the source one value
        added = _scaled(lw, lw.reshape(lw.node(source, dtype), ()), alpha, dtype, ())
        return lw.op(Op.ADD, [lw.node(x), added], shape, dtype)
    dim %= max(1, x.dim())
    compute = dtype
    updates = _scaled(lw, lw.node(source, compute), alpha, compute, tuple(source.shape))
    window = list(shape)
    window[dim] = 1
    return lw.op(Op.SCATTER, [lw.node(x), _wrapped(lw, lw.node(index), shape[dim]), updates], shape, dtype,
                 window_dims=tuple(d for d in range(len(shape)) if d != dim), dropped_dims=(dim,),
                 operand_batching_dims=(), indices_batching_dims=(), index_map=(dim,), index_vector_dim=1,
                 window=tuple(window), combine="add")


def _index_vectors(lw, x, indices):
    """(indexed dims, [N..., k] int64 index vectors broadcast together, the broadcast shape) of x[indices]."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    for d in dims:
        if indices[d].dtype in (torch.bool, torch.uint8):
            raise NotLowered("a boolean mask index")
    batch = tuple(torch.broadcast_shapes(*(tuple(indices[d].shape) for d in dims)))
    vectors = [lw.reshape(lw.broadcast(_wrapped(lw, lw.node(indices[d]), x.shape[d]), batch), batch + (1,))
               for d in dims]
    stacked = vectors[0] if len(vectors) == 1 else lw.op(Op.CONCATENATE, vectors, batch + (len(dims),), DType.I64,
                                                          dimension=len(batch))
    return dims, stacked, batch


@rule(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(lw, meta, x, indices):
    shape, dtype = _out(meta)
    indices = list(indices) + [None] * (x.dim() - len(indices))
    dims, vectors, batch = _index_vectors(lw, x, indices)
    rest = [d for d in range(x.dim()) if d not in dims]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    start = dims[0] if adjacent else 0
    # result: x's other dims in order, with the batch dims at `start`
    window_dims = tuple(d if i < start else d + len(batch) for i, d in enumerate(range(len(rest))))
    window = tuple(1 if d in dims else x.shape[d] for d in range(x.dim()))
    return lw.op(Op.GATHER, [lw.node(x), vectors], shape, dtype, window_dims=window_dims, dropped_dims=tuple(dims),
                 operand_batching_dims=(), indices_batching_dims=(), index_map=tuple(dims),
                 index_vector_dim=len(batch), window=window)


@rule(aten.index_put.default, aten._unsafe_index_put.default, aten._index_put_impl.default)
def _index_put(lw, meta, x, indices, values, accumulate=False, unsafe=False):
    """x[indices] = values (+= with accumulate). With repeated indices and no accumulation PyTorch leaves which
    write wins undefined; here the last does."""
    shape, dtype = _out(meta)
    indices = list(indices) + [None] * (x.dim() - len(indices))
    dims, vectors, batch = _index_vectors(lw, x, indices)
    rest = [d for d in range(x.dim()) if d not in dims]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    start = dims[0] if adjacent else 0
    update_shape = [x.shape[d] for d in rest]
    update_shape[start:start] = batch
    window_dims = tuple(d if i < start else d + len(batch) for i, d in enumerate(range(len(rest))))
    window = tuple(1 if d in dims else x.shape[d] for d in range(x.dim()))
    updates = lw.node(values, dtype, tuple(update_shape))
    return lw.op(Op.SCATTER, [lw.node(x), vectors, updates], shape, dtype, window_dims=window_dims,
                 dropped_dims=tuple(dims), operand_batching_dims=(), indices_batching_dims=(), index_map=tuple(dims),
                 index_vector_dim=len(batch), window=window, combine="add" if accumulate else "replace")


@rule(aten.topk.default)
def _topk(lw, meta, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    shape, dtype = _out(meta[0])
    dim %= max(1, x.dim())
    node = lw.node(x)
    positions = lw.op(Op.TOPK, [node], shape, DType.I32, dimension=dim, k=k, descending=largest)
    return _take_along(lw, node, positions, dim, shape, dtype), lw.convert(positions, DType.I64)


@rule(aten.sort.default, aten.sort.stable)
def _sort(lw, meta, x, *args, **kwargs):
    (shape, dtype), _ = _out(meta[0]), _out(meta[1])
    if lw.current.endswith("sort.stable"):
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    dim %= max(1, x.dim())
    node = lw.node(x)
    positions = lw.op(Op.TOPK, [node], shape, DType.I32, dimension=dim, k=shape[dim], descending=descending)
    return _take_along(lw, node, positions, dim, shape, dtype), lw.convert(positions, DType.I64)


def _take_along(lw, node, positions, dim, shape, dtype):
    rank = len(shape)
    others = tuple(d for d in range(rank) if d != dim)
    return lw.op(Op.GATHER, [node, positions], shape, dtype, window_dims=(), dropped_dims=(dim,),
                 operand_batching_dims=others, indices_batching_dims=others, index_map=(dim,), index_vector_dim=rank,
                 window=(1,) * rank)


@rule(aten.upsample_nearest2d_backward.default, aten.upsample_nearest1d_backward.default,
      aten.upsample_nearest3d_backward.default)
def _upsample_nearest_backward(lw, meta, grad, output_size, input_size, *scales):
    """Each input element's gradient: the sum of the block of outputs it was copied to (whole-number scales)."""
    shape, dtype = _out(meta)
    spatial = len(output_size)
    factors = [o // i for o, i in zip(output_size, input_size[-spatial:])]
    if any(o != f * i for o, f, i in zip(output_size, factors, input_size[-spatial:])) or any(
            s is not None and s != f for s, f in zip(scales, factors)):
        raise NotLowered("nearest upsampling by a scale that is not a whole number")
    compute = _opmath(dtype)
    blocks = list(shape[:-spatial])
    for size, factor in zip(input_size[-spatial:], factors):
        blocks += [size, factor]
    node = lw.reshape(lw.node(grad, compute), blocks)
    lead = len(shape) - spatial
    summed = lw.reduce(node, [lead + 2 * i + 1 for i in range(spatial)], "add")
    return lw.convert(lw.reshape(summed, shape), dtype)


def _pool_windows(x_shape, out_shape, spatial, kernel_size, stride, padding):
    """(lead dims, kernel, stride, padding, the high padding the windows reach) of an N-d pooling."""
    kernel = _spread(kernel_size, spatial)
    stride = _spread(stride, spatial) if stride else kernel
    padding = _spread(padding, spatial)
    lead = len(x_shape) - spatial
    high = [(o - 1) * s + k - i - p for o, s, k, i, p in zip(out_shape[lead:], stride, kernel, x_shape[lead:], padding)]
    return lead, kernel, stride, padding, high


def _avg_divisor(lw, x_shape, out_shape, spatial, kernel, stride, padding, high, lead, ceil_mode, count_include_pad,
                 divisor_override, compute):
    """What each window's sum is divided by: the override, the window's size, or how many of its elements are in
    the input (or in the input and its padding, for ceil_mode's last windows)."""
    attrs = dict(window=(1,) * lead + kernel, strides=(1,) * lead + stride,
                 padding=((0, 0),) * lead + tuple(zip(padding, high)), kind="add")
    if divisor_override:
        return lw.splat(divisor_override, compute, out_shape)
    if count_include_pad and not ceil_mode:
        return lw.splat(int(np.prod(kernel)), compute, out_shape)
    if not count_include_pad:
        ones = lw.splat(1.0, compute, tuple(x_shape))
        return lw.op(Op.REDUCE_WINDOW, [ones, lw.splat(0.0, compute)], out_shape, compute, **attrs)
    extra = [max(0, h - p) for h, p in zip(high, padding)]
    counted = lw.splat(1.0, compute, tuple(x_shape[:lead]) + tuple(i + 2 * p for i, p in zip(x_shape[lead:], padding)))
    ones = lw.op(Op.PAD, [counted, lw.splat(0.0, compute)],
                 tuple(counted.shape[:lead]) + tuple(c + e for c, e in zip(counted.shape[lead:], extra)), compute,
                 low=(0,) * len(x_shape), high=(0,) * lead + tuple(extra), interior=(0,) * len(x_shape))
    return lw.op(Op.REDUCE_WINDOW, [ones, lw.splat(0.0, compute)], out_shape, compute,
                 **dict(attrs, padding=((0, 0),) * len(x_shape)))


@rule(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(lw, meta, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    """Window sums (REDUCE_WINDOW) divided by the window's size, or by how many of its elements are not padding."""
    shape, dtype = _out(meta)
    spatial = 2 if lw.current.startswith("aten::avg_pool2d") else 3
    lead, kernel, stride, padding, high = _pool_windows(x.shape, shape, spatial, kernel_size, stride, padding)
    compute = _opmath(dtype)
    sums = lw.op(Op.REDUCE_WINDOW, [lw.node(x, compute), lw.splat(0.0, compute)], shape, compute,
                 window=(1,) * lead + kernel, strides=(1,) * lead + stride,
                 padding=((0, 0),) * lead + tuple(zip(padding, high)), kind="add")
    divisor = _avg_divisor(lw, tuple(x.shape), shape, spatial, kernel, stride, padding, high, lead, ceil_mode,
                           count_include_pad, divisor_override, compute)
    return lw.convert(lw.op(Op.DIVIDE, [sums, divisor], shape, compute), dtype)


@rule(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward(lw, meta, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    """Each input element gathers grad / divisor of every window holding it: the windows' values spread back by
    the stride (interior padding), summed over a window, and cut to the input."""
    shape, dtype = _out(meta)
    spatial = 2 if lw.current.startswith("aten::avg_pool2d") else 3
    out_shape = tuple(grad.shape)
    lead, kernel, stride, padding, high = _pool_windows(shape, out_shape, spatial, kernel_size, stride, padding)
    compute = _opmath(dtype)
    divisor = _avg_divisor(lw, shape, out_shape, spatial, kernel, stride, padding, high, lead, ceil_mode,
                           count_include_pad, divisor_override, compute)
    share = lw.op(Op.DIVIDE, [lw.node(grad, compute), divisor], out_shape, compute)
    spread_shape = tuple(out_shape[:lead]) + tuple((o - 1) * s + 1 + 2 * (k - 1)
                                                   for o, s, k in zip(out_shape[lead:], stride, kernel))
    spread = lw.op(Op.PAD, [share, lw.splat(0.0, compute)], spread_shape, compute,
                   low=(0,) * lead + tuple(k - 1 for k in kernel), high=(0,) * lead + tuple(k - 1 for k in kernel),
                   interior=(0,) * lead + tuple(s - 1 for s in stride))
    summed_shape = tuple(out_shape[:lead]) + tuple((o - 1) * s + k for o, s, k in zip(out_shape[lead:], stride, kernel))
    summed = lw.op(Op.REDUCE_WINDOW, [spread, lw.splat(0.0, compute)], summed_shape, compute,
                   window=(1,) * lead + kernel, strides=(1,) * len(shape), padding=((0, 0),) * len(shape), kind="add")
    # position j of the sums is input element j - padding; elements no window reaches get nothing
    extra = [max(0, p + i - t) for p, i, t in zip(padding, shape[lead:], summed_shape[lead:])]
    if any(extra):
        summed = lw.op(Op.PAD, [summed, lw.splat(0.0, compute)],
                       tuple(summed_shape[:lead]) + tuple(t + e for t, e in zip(summed_shape[lead:], extra)), compute,
                       low=(0,) * len(shape), high=(0,) * lead + tuple(extra), interior=(0,) * len(shape))
    cut = lw.op(Op.SLICE, [summed], shape, compute, start=(0,) * lead + tuple(padding),
                limit=tuple(shape[:lead]) + tuple(p + i for p, i in zip(padding, shape[lead:])),
                strides=(1,) * len(shape))
    return lw.convert(cut, dtype)


def _along(lw, node: ir.Node, dim: int, matrix: np.ndarray) -> ir.Node:
    """``node`` with dim ``dim`` (size n) replaced by ``matrix @ it`` (matrix: [m, n], a constant)."""
    m, n = matrix.shape
    constant = ir.node(Op.CONSTANT, [], (m, n), node.dtype, lw.loc, value=matrix.astype(node.dtype.numpy))
    rank = len(node.shape)
    product_shape = tuple(s for d, s in enumerate(node.shape) if d != dim) + (m,)
    product = lw.op(Op.DOT_GENERAL, [node, constant], product_shape, node.dtype, lhs_batch=(), rhs_batch=(),
                    lhs_contract=(dim,), rhs_contract=(1,))
    perm = list(range(rank - 1))
    perm.insert(dim, rank - 1)
    return lw.transpose(product, perm)


def _adaptive_windows(size: int, out: int) -> np.ndarray:
    """[out, size]: 1 where output o's adaptive window [floor(o size / out), ceil((o + 1) size / out)) holds i."""
    windows = np.zeros((out, size), np.float64)
    for o in range(out):
        windows[o, (o * size) // out: -(-((o + 1) * size) // out)] = 1.0
    return windows


@rule(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool(lw, meta, x, output_size):
    """The mean over each adaptive window, dim by dim: a product with a constant [out, in] matrix of 1 / count."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    node = lw.node(x, compute)
    lead = x.dim() - len(output_size)
    for i, out in enumerate(output_size):
        windows = _adaptive_windows(x.shape[lead + i], out)
        node = _along(lw, node, lead + i, windows / windows.sum(1, keepdims=True))
    return lw.convert(node, dtype)


@rule(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool_backward(lw, meta, grad, x):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    node = lw.node(grad, compute)
    spatial = 2 if "2d" in lw.current else 3
    lead = len(shape) - spatial
    for i in range(spatial):
        windows = _adaptive_windows(shape[lead + i], grad.shape[lead + i])
        node = _along(lw, node, lead + i, (windows / windows.sum(1, keepdims=True)).T)
    return lw.convert(node, dtype)


@rule(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default,
      aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default)
def _max_pool_backward(lw, meta, grad, x, *args):
    """Each output's gradient added at the input position its index names (indices count within the image)."""
    shape, dtype = _out(meta)
    indices = args[-1]
    spatial = 2 if "2d" in lw.current else 3
    lead = len(shape) - spatial
    compute = _opmath(dtype)
    positions = int(np.prod(shape[lead:]))
    flat_shape = tuple(shape[:lead]) + (positions,)
    outputs = int(np.prod(grad.shape[lead:]))
    g = lw.reshape(lw.node(grad, compute), tuple(grad.shape[:lead]) + (outputs,))
    i = lw.reshape(lw.convert(lw.node(indices), DType.I64), tuple(grad.shape[:lead]) + (outputs,))
    others = tuple(range(lead))
    base = lw.splat(0.0, compute, flat_shape)
    scattered = lw.op(Op.SCATTER, [base, i, g], flat_shape, compute, window_dims=(), dropped_dims=(lead,),
                      operand_batching_dims=others, indices_batching_dims=others, index_map=(lead,),
                      index_vector_dim=lead + 1, window=(1,) * (lead + 1), combine="add")
    return lw.convert(lw.reshape(scattered, shape), dtype)


def _linear_weights(size: int, out: int, align_corners: bool, scale) -> np.ndarray:
    """[out, size]: PyTorch's linear interpolation weights (upsample_*linear: area_pixel_compute_source_index)."""
    weights = np.zeros((out, size), np.float64)
    for o in range(out):
        if align_corners:
            source = o * (size - 1) / (out - 1) if out > 1 else 0.0
        else:
            ratio = (1.0 / scale) if scale else size / out
            source = max(0.0, (o + 0.5) * ratio - 0.5)
        low = min(int(np.floor(source)), size - 1)
        high = min(low + 1, size - 1)
        frac = source - low
        weights[o, low] += 1.0 - frac
        weights[o, high] += frac
    return weights


@rule(aten.upsample_bilinear2d_backward.default, aten.upsample_linear1d_backward.default,
      aten.upsample_trilinear3d_backward.default)
def _upsample_linear_backward(lw, meta, grad, output_size, input_size, align_corners, *scales):
    """Linear upsampling is a product with an interpolation matrix per spatial dim; its gradient, with their
    transposes."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    node = lw.node(grad, compute)
    spatial = len(output_size)
    lead = len(shape) - spatial
    for i in range(spatial):
        scale = scales[i] if i < len(scales) else None
        weights = _linear_weights(shape[lead + i], output_size[i], align_corners, scale)
        node = _along(lw, node, lead + i, weights.T)
    return lw.convert(node, dtype)


@rule(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
      aten.replication_pad3d_backward.default)
def _replication_pad_backward(lw, meta, grad, x, padding):
    """Each padded position copies the nearest input element: its gradient goes back there (a 0/1 matrix per dim)."""
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    node = lw.node(grad, compute)
    spatial = len(padding) // 2
    for i in range(spatial):
        dim = len(shape) - 1 - i
        before = padding[2 * i]
        size, out = shape[dim], grad.shape[dim]
        copies = np.zeros((size, out))
        for o in range(out):
            copies[min(max(o - before, 0), size - 1), o] = 1.0
        node = _along(lw, node, dim, copies)
    return lw.convert(node, dtype)


@rule(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def _shrink_backward(lw, meta, grad, x, lambd):
    shape, dtype = _out(meta)
    value = lw.node(x, _dtype(x.dtype), shape)
    outside = lw.compare(lw.op(Op.ABS, [value], shape, value.dtype), lw.splat(lambd, value.dtype, shape), "GT")
    return lw.select(outside, lw.node(grad, dtype, shape), lw.splat(0, dtype, shape))


# -- convolution ----------------------------------------------------------------------------------------------

@rule(aten.convolution.default, aten.convolution_overrideable.default)
def _convolution(lw, meta, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    shape, dtype = _out(meta)
    compute = _opmath(dtype)
    spatial = x.dim() - 2
    if spatial < 1:
        raise NotLowered("a convolution without spatial dims")
    node, w = lw.node(x, compute), lw.node(weight, compute)
    stride, padding, dilation = (_spread(v, spatial) for v in (stride, padding, dilation))
    if not transposed:
        conv = lw.op(Op.CONVOLUTION, [node, w], shape, compute, strides=stride,
                     padding=tuple((p, p) for p in padding), lhs_dilation=(1,) * spatial, rhs_dilation=dilation,
                     groups=groups)
    else:
        # a transposed convolution: the input dilated by the stride, the kernel flipped with in/out swapped
        output_padding = _spread(output_padding, spatial)
        kernel = weight.shape[2:]
        cin, cout_g = weight.shape[0], weight.shape[1]
        w = lw.reshape(w, (groups, cin // groups, cout_g, *kernel))
        w = lw.transpose(w, (0, 2, 1, *range(3, 3 + spatial)))
        w = lw.reshape(w, (groups * cout_g, cin // groups, *kernel))
        w = lw.op(Op.REVERSE, [w], w.shape, compute, dims=tuple(range(2, 2 + spatial)))
        pads = tuple((d * (k - 1) - p, d * (k - 1) - p + op)
                     for d, k, p, op in zip(dilation, kernel, padding, output_padding))
        if any(lo < 0 or hi < 0 for lo, hi in pads):
            raise NotLowered("a transposed convolution with more padding than kernel")
        conv = lw.op(Op.CONVOLUTION, [node, w], shape, compute, strides=(1,) * spatial, padding=pads,
                     lhs_dilation=stride, rhs_dilation=dilation, groups=groups)
    if bias is not None:
        conv = lw.op(Op.ADD, [conv, lw.op(Op.BROADCAST_IN_DIM, [lw.node(bias, compute)], shape, compute, dims=(1,))],
                     shape, compute)
    return lw.convert(conv, dtype)


def _spread(value, n) -> tuple:
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value * n if len(value) == 1 else value


# -- prims (what torch._refs decompositions reach) ---------------------------------------------------------

for _prim, _aten_op in {
    prims.add.default: aten.add.Tensor, prims.sub.default: aten.sub.Tensor, prims.mul.default: aten.mul.Tensor,
    prims.div.default: aten.div.Tensor, prims.maximum.default: aten.maximum.default,
    prims.minimum.default: aten.minimum.default, prims.neg.default: aten.neg.default, prims.abs.default: aten.abs.default,
    prims.exp.default: aten.exp.default, prims.expm1.default: aten.expm1.default, prims.log.default: aten.log.default,
    prims.log1p.default: aten.log1p.default, prims.sqrt.default: aten.sqrt.default,
    prims.rsqrt.default: aten.rsqrt.default, prims.tanh.default: aten.tanh.default, prims.sin.default: aten.sin.default,
    prims.cos.default: aten.cos.default, prims.sign.default: aten.sign.default, prims.floor.default: aten.floor.default,
    prims.ceil.default: aten.ceil.default, prims.erf.default: aten.erf.default, prims.atan2.default: aten.atan2.default,
    prims.pow.default: aten.pow.Tensor_Tensor, prims.fmod.default: aten.fmod.Tensor,
    prims.bitwise_and.default: aten.bitwise_and.Tensor, prims.bitwise_or.default: aten.bitwise_or.Tensor,
    prims.bitwise_xor.default: aten.bitwise_xor.Tensor, prims.bitwise_not.default: aten.bitwise_not.default,
    prims.where.default: aten.where.self, prims.eq.default: aten.eq.Tensor, prims.ne.default: aten.ne.Tensor,
    prims.lt.default: aten.lt.Tensor, prims.le.default: aten.le.Tensor, prims.gt.default: aten.gt.Tensor,
    prims.ge.default: aten.ge.Tensor, prims.amax.default: aten.amax.default, prims.amin.default: aten.amin.default,
}.items():
    RULES[_prim] = (lambda fn, name: lambda lw, meta, *a, **k: _as(lw, name, fn, meta, *a, **k))(
        RULES[_aten_op], f"{_aten_op._schema.name}.{_aten_op._overloadname}")


def _as(lw, name, fn, meta, *args, **kwargs):
    """A prim lowered by the rule of its ATen op (rules that serve several ops look at ``lw.current``)."""
    lw.current = name
    return fn(lw, meta, *args, **kwargs)


def _formula(build):
    """A unary op computed in fp32 from other IR ops: ``build(lw, x, shape, dtype) -> node``."""
    def lower_formula(lw, meta, x):
        shape, dtype = _out(meta)
        compute = _opmath(dtype)
        return lw.convert(build(lw, lw.node(x, compute, shape), shape, compute), dtype)
    return lower_formula


def _scale(lw, x, factor, shape, dtype):
    return lw.op(Op.MULTIPLY, [x, lw.splat(factor, dtype, shape)], shape, dtype)


def _trunc(lw, x, shape, dtype):
    if not dtype.is_float:
        return x
    negative = lw.compare(x, lw.splat(0.0, dtype, shape), "LT")
    return lw.select(negative, lw.op(Op.CEIL, [x], shape, dtype), lw.op(Op.FLOOR, [x], shape, dtype))


def _exp_pair(lw, x, shape, dtype, kind):
    grows = lw.op(Op.EXP, [x], shape, dtype)
    decays = lw.op(Op.EXP, [lw.op(Op.NEGATE, [x], shape, dtype)], shape, dtype)
    return _scale(lw, lw.op(kind, [grows, decays], shape, dtype), 0.5, shape, dtype)


def _complement_root(lw, x, shape, dtype):
    """sqrt(1 - x^2)"""
    one_minus = lw.op(Op.SUBTRACT, [lw.splat(1.0, dtype, shape), lw.op(Op.MULTIPLY, [x, x], shape, dtype)], shape,
                      dtype)
    return lw.op(Op.SQRT, [one_minus], shape, dtype)


for _ops, _build in {
    (aten.trunc.default, prims.trunc.default): _trunc,
    (aten.log2.default, prims.log2.default): lambda lw, x, s, d: _scale(lw, lw.op(Op.LOG, [x], s, d), 1 / math.log(2), s, d),
    (aten.log10.default, prims.log10.default):
        lambda lw, x, s, d: _scale(lw, lw.op(Op.LOG, [x], s, d), 1 / math.log(10), s, d),
    (aten.exp2.default, prims.exp2.default): lambda lw, x, s, d: lw.op(Op.EXP, [_scale(lw, x, math.log(2), s, d)], s, d),
    (aten.sinh.default, prims.sinh.default): lambda lw, x, s, d: _exp_pair(lw, x, s, d, Op.SUBTRACT),
    (aten.cosh.default, prims.cosh.default): lambda lw, x, s, d: _exp_pair(lw, x, s, d, Op.ADD),
    (aten.tan.default, prims.tan.default):
        lambda lw, x, s, d: lw.op(Op.DIVIDE, [lw.op(Op.SIN, [x], s, d), lw.op(Op.COS, [x], s, d)], s, d),
    (aten.atan.default, prims.atan.default): lambda lw, x, s, d: lw.op(Op.ATAN2, [x, lw.splat(1.0, d, s)], s, d),
    (aten.asin.default, prims.asin.default):
        lambda lw, x, s, d: lw.op(Op.ATAN2, [x, _complement_root(lw, x, s, d)], s, d),
    (aten.acos.default, prims.acos.default):
        lambda lw, x, s, d: lw.op(Op.ATAN2, [_complement_root(lw, x, s, d), x], s, d),
}.items():
    for _op in _ops:
        RULES[_op] = _formula(_build)


# ---- decompositions of our own ---------------------------------------------------------------------------------

def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """The LSTM cell PyTorch calls on an accelerator: (hy, cy, workspace), the workspace holding the gates after
    their activations (input, forget, cell, output) for the backward."""
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_cy_total = (grad_cy if grad_cy is not None else torch.zeros_like(cy))
    if grad_hy is not None:
        grad_cy_total = grad_cy_total + grad_hy * o * (1 - tanh_cy * tanh_cy)
        grad_o = grad_hy * tanh_cy * o * (1 - o)
    else:
        grad_o = torch.zeros_like(o)
    grad_i = grad_cy_total * g * i * (1 - i)
    grad_f = grad_cy_total * cx * f * (1 - f)
    grad_g = grad_cy_total * i * (1 - g * g)
    grad_gates = torch.cat([grad_i, grad_f, grad_g, grad_o], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cy_total * f, grad_bias


def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """The GRU cell PyTorch calls on an accelerator: (hy, workspace)."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    ir_, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    reset = (ir_ + hr).sigmoid()
    update = (ii + hi).sigmoid()
    new = (in_ + reset * hn).tanh()
    hy = new + update * (hx - new)
    return hy, torch.cat([reset, update, new, hx, hn], 1)


def _gru_cell_backward(grad_hy, workspace, has_bias):
    reset, update, new, hx, hn = workspace.chunk(5, 1)
    grad_hx = grad_hy * update
    grad_new = grad_hy * (1 - update)
    grad_update = grad_hy * (hx - new)
    grad_in = grad_new * (1 - new * new)
    grad_hn = grad_in * reset
    grad_reset = grad_in * hn
    grad_ir = grad_reset * reset * (1 - reset)
    grad_ii = grad_update * update * (1 - update)
    grad_input_gates = torch.cat([grad_ir, grad_ii, grad_in], 1)
    grad_hidden_gates = torch.cat([grad_ir, grad_ii, grad_hn], 1)
    grad_input_bias = grad_input_gates.sum(0) if has_bias else None
    grad_hidden_bias = grad_hidden_gates.sum(0) if has_bias else None
    return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias


def _convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask):
    """(grad_input, grad_weight, grad_bias) of a convolution, as convolutions and matrix products: the input's
    gradient is the transposed convolution of the output's gradient with the same weights (the plain one, for a
    transposed convolution); the weights' gradient, without groups, a convolution of the input (channels as the
    batch) with the output's gradient (images as the channels), whose stride is the forward's dilation and
    dilation the forward's stride; with groups, or transposed, one batched matrix product per kernel tap."""
    spatial = x.dim() - 2
    stride, padding, dilation = (_spread(v, spatial) for v in (stride, padding, dilation))
    kernel = weight.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution.default(grad, weight, None, stride, padding, dilation, False,
                                                  [0] * spatial, groups)
        else:
            produced = [(o - 1) * s - 2 * p + d * (k - 1) + 1
                        for o, s, p, d, k in zip(grad.shape[2:], stride, padding, dilation, kernel)]
            extra = [size - made for size, made in zip(x.shape[2:], produced)]
            grad_input = aten.convolution.default(grad, weight, None, stride, padding, dilation, True, extra, groups)
    if output_mask[1]:
        if transposed:  # the weight gradient of the plain convolution from grad (the input) to x (the output)
            grad_weight = _weight_gradient(grad, x, tuple(weight.shape), stride, padding, dilation, groups)
        elif groups == 1:
            xs, gs = x.transpose(0, 1), grad.transpose(0, 1)  # [C, N, ...], [O, N, ...]
            full = aten.convolution.default(xs, gs, None, dilation, padding, stride, False, [0] * spatial, 1)
            grad_weight = full[(slice(None), slice(None), *(slice(0, k) for k in kernel))].transpose(0, 1)
        else:
            grad_weight = _weight_gradient(x, grad, tuple(weight.shape), stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad.sum([0, *range(2, grad.dim())])
    return grad_input, grad_weight, grad_bias


def _weight_gradient(x, grad, weight_shape, stride, padding, dilation, groups):
    """dL/dw of y = conv(x, w) (w: [O, C / groups, k...]): per kernel tap, the strided window of the padded
    input that the tap multiplies, contracted with grad over images and positions, group by group (a bmm)."""
    n = x.shape[0]
    out_channels, per_group_in, kernel = weight_shape[0], weight_shape[1], weight_shape[2:]
    per_group_out = out_channels // groups
    taps = int(np.prod(kernel))
    if taps > 64:
        raise NotLowered("the weight gradient of a convolution with a large kernel")
    pads = []
    for p in reversed(padding):
        pads += [p, p]
    padded = aten.constant_pad_nd.default(x, pads, 0.0) if any(padding) else x
    positions = int(np.prod(grad.shape[2:]))
    g = grad.reshape(n, groups, per_group_out, positions).permute(1, 2, 0, 3).reshape(
        groups, per_group_out, n * positions)
    columns = []
    for tap in np.ndindex(*kernel):
        window = padded[(slice(None), slice(None), *(
            slice(k * d, k * d + s * (o - 1) + 1, s) for k, d, s, o in zip(tap, dilation, stride, grad.shape[2:])))]
        w = window.reshape(n, groups, per_group_in, positions).permute(1, 0, 3, 2).reshape(
            groups, n * positions, per_group_in)
        columns.append(aten.bmm.default(g, w))  # [groups, out per group, in per group]
    stacked = torch.stack(columns, -1)  # [groups, Og, Cg, taps]
    return stacked.reshape(out_channels, per_group_in, *kernel)


OWN_DECOMPOSITIONS.update({
    aten.adaptive_max_pool2d.default: adaptive_max_pool,
    aten.adaptive_max_pool3d.default: adaptive_max_pool,
    aten.convolution_backward.default: _convolution_backward,
    aten._thnn_fused_lstm_cell.default: _lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_cell_backward,
    aten._thnn_fused_gru_cell.default: _gru_cell,
    aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward,
})
