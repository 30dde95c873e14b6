"""StableHLO (a live MLIR module, through the MLIR python bindings) -> neuronc graph IR.

One converter per StableHLO op name, in a registry. Every op the backend cannot handle is
collected, with the source line it came from, and reported in one `NeuronCompileError`,
so a user sees all missing ops at once instead of one per compile.

Source lines come from the FX graph (torch-mlir names each op's location after its FX node), or,
for a module from elsewhere (JAX, a .mlir file), from the MLIR locations themselves. Every result
of every op gets a number (`values`, in program order), and the node computing it carries that
number as its `origin`, which `neuronc bisect` follows through the passes to the NEFF's kernels.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from typing import NamedTuple

import numpy as np

from neuronc import ir, op_facts
from neuronc.errors import NeuronCompileError
from neuronc.frontend import rng_bit_generator, stablehlo_expansions
from neuronc.isa import DType
from neuronc.ir import Op
from neuronc.neff.program import DebugLoc

_ELEMENT_TYPES = {
    "f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16, "f64": DType.F64,
    "f8E4M3FN": DType.F8E4M3, "f8E5M2": DType.F8E5M2,
    "i1": DType.BOOL, "i8": DType.I8, "i16": DType.I16, "i32": DType.I32, "i64": DType.I64,
    "ui8": DType.U8, "ui16": DType.U16, "ui32": DType.U32, "ui64": DType.U64,
}

# StableHLO / CHLO ops imported one to one as an IR op without attributes (the op-facts table lists them).
_SIMPLE = {name: Op[fact.name] for fact in op_facts.FACTS for name in fact.stablehlo}

_REDUCERS = {
    "stablehlo.add": "add", "stablehlo.maximum": "max", "stablehlo.minimum": "min",
    "stablehlo.multiply": "mul", "stablehlo.and": "and", "stablehlo.or": "or",
}


def tensor_type(mlir_type: object) -> tuple:
    """(shape, DType) of an MLIR ranked tensor type."""
    from torch_mlir import ir as mlir

    t = mlir.RankedTensorType(mlir_type)
    element = str(t.element_type)
    if element not in _ELEMENT_TYPES:
        raise _Unsupported(f"element type {element}")
    return tuple(t.shape), _ELEMENT_TYPES[element]


class _Unsupported(Exception):
    pass


def _ints(attr) -> list:
    from torch_mlir import ir as mlir

    return [int(v) for v in mlir.DenseI64ArrayAttr(attr)]


def _int(attr) -> int:
    from torch_mlir import ir as mlir

    return int(mlir.IntegerAttr(attr).value)


def _dense(attr, shape, dtype: DType) -> np.ndarray:
    """A dense elements attribute as numpy; a splat comes back 0-d (broadcast by the consumer)."""
    from torch_mlir import ir as mlir

    dense = mlir.DenseElementsAttr(attr)
    if dense.is_splat:
        text = str(dense.get_splat_value())
        return np.array(_parse_scalar(text.split(":")[0].strip(), dtype), dtype=dtype.numpy)
    if dtype == DType.BOOL:
        values = [bool(v) for v in mlir.DenseIntElementsAttr(attr)]
        return np.array(values, dtype=np.bool_).reshape(shape)
    return np.array(attr, copy=True).astype(dtype.numpy).reshape(shape)


def _parse_scalar(text: str, dtype: DType):
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("0x"):
        bits = int(text, 16)
        width = dtype.itemsize
        raw = bits.to_bytes(width, "little")
        return np.frombuffer(raw, dtype=dtype.numpy)[0]
    return float(text) if dtype.is_float else int(text)


def _region_reducer(op) -> str:
    body = list(op.regions[0].blocks[0].operations)
    if len(body) != 2 or body[0].operation.name not in _REDUCERS:
        raise _Unsupported("a reduction whose body is not a single add/max/min/mul/and/or")
    return _REDUCERS[body[0].operation.name]


_LOC_NAME = re.compile(r'loc\("([^"]+)"[()]')
_FILE_LINE = re.compile(r'"([^"]+)":(\d+):\d+')
_SCOPE = re.compile(r'"([^"]*)"\(')


def mlir_location(op) -> DebugLoc:
    """The source line an MLIR location names: its innermost `"file":line:col` (a JAX program's line; JAX
    leaves out its own frames), with the name around it (JAX's name stack, e.g. "jit(f)/dot_general")."""
    text = str(op.location)
    where, scope = _FILE_LINE.search(text), _SCOPE.search(text)
    return DebugLoc(file=where.group(1) if where else "", line=int(where.group(2)) if where else 0,
                    module_path=scope.group(1) if scope else "", op=op.name)


def location_of(op, locations: dict | None) -> DebugLoc:
    """Where an op came from: its FX node's line (`locations`: FX node name -> DebugLoc), or with no
    FX graph (None), the line its MLIR location names."""
    if locations is None:
        return mlir_location(op)
    match = _LOC_NAME.search(str(op.location))
    if match and match.group(1) in locations:
        return locations[match.group(1)]
    return DebugLoc()


def values(block) -> list:
    """Every result of every op of a function's body, in program order: the value numbers of `Node.origin`."""
    return [result for op in block.operations if op.operation.name != "func.return" for result in op.results]


class UnsupportedUse(NamedTuple):
    """An op the importer cannot convert: its name, why, and where it is."""

    op: str
    why: str
    loc: DebugLoc

    def __str__(self) -> str:
        return f"{self.op} ({self.why}) at {self.loc}"


class _Importer:
    def __init__(self, locations: dict | None, numbers: dict, semantics: str):
        self.locations = locations  # FX node name -> DebugLoc; None: read the MLIR locations
        self.converters = _CONVERTERS if semantics == "pytorch" else {**_CONVERTERS, **_STABLEHLO_CONVERTERS}
        self.semantics = semantics
        self.numbers = numbers  # MLIR value -> its number
        self.values: dict = {}
        self.problems: list = []  # of UnsupportedUse
        self.unrolling = 0  # how many loops the op being imported is inside
        self.scalars_as = None  # the shape a reduction body's 0-d values take when it is applied elementwise

    def loc(self, op) -> DebugLoc:
        return location_of(op, self.locations)

    def convert(self, op) -> None:
        name = op.name
        loc = self.loc(op)
        try:
            inputs = [self.values[v] for v in op.operands]
        except KeyError:  # an operand of an op already reported
            self._stand_ins(op, loc)
            return
        try:
            shape, dtype = tensor_type(op.results[0].type)
            if self.scalars_as is not None and shape == () and name not in _LEAVES:
                shape = self.scalars_as
            converter = self.converters.get(name)
            if name in _CONTROL_FLOW:
                nodes = _CONTROL_FLOW[name](self, op, inputs, loc)
            elif converter is None and name in _SIMPLE:
                nodes = ir.node(_SIMPLE[name], inputs, shape, dtype, loc)
            elif converter is None:
                raise _Unsupported("no lowering")
            else:
                nodes = converter(op, inputs, shape, dtype, loc)
            nodes = nodes if isinstance(nodes, tuple) else (nodes,)
            if len(nodes) != len(op.results):
                raise _Unsupported(f"{len(op.results)} results")
        except _Unsupported as why:
            self.problems.append(UnsupportedUse(name, str(why), loc))
            self._stand_ins(op, loc)
            return
        if self.unrolling:  # a loop's counter stays a constant, so its condition can be evaluated
            nodes = tuple(_folded(node) for node in nodes)
        self.values.update(zip(op.results, nodes))
        for result, node in zip(op.results, nodes):
            if node.origin < 0:  # not an operand passed through (an identity); ops inside a loop have no number
                node.origin = self.numbers.get(result, -1)

    def _stand_ins(self, op, loc) -> None:
        """Zero constants for an op's results, so the walk goes on and finds every problem."""
        for result in op.results:
            shape, dtype = _safe_type(result)
            self.values[result] = ir.node(Op.CONSTANT, [], shape, dtype, loc, value=np.zeros((), dtype.numpy))

    def import_block(self, block, arguments: list) -> list:
        """The nodes a region's block returns, its arguments standing for `arguments` (a region may also use
        values from around it)."""
        self.values.update(zip(block.arguments, arguments))
        for op in block.operations:
            op = op.operation
            if op.name == "stablehlo.return":
                return [self.values[v] for v in op.operands]
            self.convert(op)
        raise _Unsupported("a region without stablehlo.return")

    def unrolled_while(self, op, inputs, loc):
        """stablehlo.while (JAX's scan, fori_loop, while_loop) unrolled: the condition imported with the
        carried values, then the body, until the condition is a constant false. The NeuronCore runs static
        instruction streams, so a loop whose trip count depends on the data cannot be compiled."""
        cond, body = (region.blocks[0] for region in op.regions)
        body_ops = sum(1 for _ in body.operations)
        carried, problems, trips = list(inputs), len(self.problems), 0
        self.unrolling += 1
        try:
            while True:
                (go,) = self.import_block(cond, carried)
                if go.scalar is None:
                    raise _Unsupported("a loop whose trip count depends on the data; neuronc unrolls loops whose "
                                       "count is known when compiling (scan, fori_loop with constant bounds)")
                if not go.scalar:
                    return tuple(carried)
                trips += 1
                if trips * body_ops > MAX_UNROLLED_OPS:
                    raise _Unsupported(f"a loop of more than {MAX_UNROLLED_OPS // max(body_ops, 1)} iterations of "
                                       f"{body_ops} ops: unrolled, it would pass {MAX_UNROLLED_OPS} ops")
                carried = self.import_block(body, carried)
                if len(self.problems) > problems:  # the body's unsupported ops, reported once
                    return tuple(carried)
        finally:
            self.unrolling -= 1

    def selected_case(self, op, inputs, loc):
        """stablehlo.case (JAX's cond and switch): every branch computed, the result selected by the index (an
        index out of range takes the last branch), as XLA's conditional-to-select does. StableHLO ops have no
        side effects, so the branches not taken change no value, only time. A constant index imports its
        branch alone."""
        (index,) = inputs
        count = len(op.regions)
        k = index.scalar
        if k is not None:
            return tuple(self.import_block(op.regions[k if 0 <= k < count else count - 1].blocks[0], []))
        branches = [self.import_block(region.blocks[0], []) for region in op.regions]
        results = list(branches[-1])
        for k in reversed(range(count - 1)):
            k_node = ir.node(Op.CONSTANT, [], (), index.dtype, loc, value=np.array(k, index.dtype.numpy))
            taken = ir.node(Op.COMPARE, [index, k_node], (), DType.BOOL, loc, direction="EQ")
            results = [r if b is r else ir.node(Op.SELECT, [_spread(taken, b.shape, loc), b, r], b.shape, b.dtype, loc)
                       for b, r in zip(branches[k], results)]
        return tuple(results)

    def window_reduction(self, op, inputs, loc):
        """stablehlo.reduce_window: a single add/max/min/... body is one REDUCE_WINDOW; any other body (JAX's
        cumlogsumexp, the pair of a max-pool's JVP, several operands, dilations) is applied window offset by window offset:
        each operand padded with its initial value, its strided slice at each offset (row-major) combined into
        the running values by the body, imported once per offset (as a loop's body is: at most
        MAX_UNROLLED_OPS ops in all). The initial value first, then the window in order, as XLA's CPU reduces."""
        count = len(inputs) // 2
        shape, dtype = tensor_type(op.results[0].type)
        body = op.regions[0].blocks[0]
        rank = len(inputs[0].shape)
        window, strides = tuple(_ints(op.attributes["window_dimensions"])), _window_attr(op, "window_strides", rank, 1)
        base, spread = _window_attr(op, "base_dilations", rank, 1), _window_attr(op, "window_dilations", rank, 1)
        dilated = any(d != 1 for d in base + spread)
        stepwise = self.semantics == "stablehlo" and dtype in _ROUNDED_EACH_STEP and \
            math.prod(window) <= _STEPWISE_WINDOW  # XLA's CPU rounds a 16-bit window's sum after every element
        if count == 1 and not dilated and not stepwise and len(list(body.operations)) == 2 and \
                list(body.operations)[0].operation.name in _REDUCERS:
            return _reduce_window(op, inputs, shape, dtype, loc)
        offsets = [tuple(o * d for o, d in zip(offset, spread))  # a dilated window's elements lie `spread` apart
                   for offset in itertools.product(*(range(w) for w in window))]
        if len(offsets) * sum(1 for _ in body.operations) > MAX_UNROLLED_OPS:
            raise _Unsupported(f"a window of {len(offsets)} elements reduced by a body of several ops")
        padding = _padding(op, rank)  # of the base dilated by `base` (its holes hold the initial value too)
        padded_shape = tuple((n - 1) * b + 1 + lo + hi for n, b, (lo, hi) in zip(inputs[0].shape, base, padding))
        padded = [x if padded_shape == x.shape else ir.node(
            Op.PAD, [x, init], padded_shape, x.dtype, loc, low=tuple(lo for lo, _ in padding),
            high=tuple(hi for _, hi in padding), interior=tuple(b - 1 for b in base))
            for x, init in zip(inputs[:count], inputs[count:])]
        out = tuple(tensor_type(result.type)[0] for result in op.results)
        running = [ir.node(Op.BROADCAST_IN_DIM, [init], o, init.dtype, loc, dims=()) for init, o in
                   zip(inputs[count:], out)]
        outer, self.scalars_as = self.scalars_as, out[0]
        try:
            for offset in offsets:
                limit = tuple(o + (n - 1) * s + 1 for o, n, s in zip(offset, out[0], strides))
                values = [ir.node(Op.SLICE, [x], out[0], x.dtype, loc, start=offset, limit=limit, strides=strides)
                          for x in padded]
                running = self.import_block(body, running + values)
        finally:
            self.scalars_as = outer
        return tuple(running)


# A stated choice (the docs are silent, it is not hardware): how many ops a loop may unroll to. Compile time grows
# with it; past it the loop is refused with the count, rather than compiled for minutes.
MAX_UNROLLED_OPS = 200_000
_ROUNDED_EACH_STEP = (DType.BF16, DType.F16)
_STEPWISE_WINDOW = 64  # a stated choice: larger 16-bit windows (long running sums) keep the one-kernel reduction
_LEAVES = ("stablehlo.constant", "arith.constant")  # 0-d constants stay 0-d in a body applied elementwise
_FOLDED_MAX_ELEMENTS = 64  # inside a loop, results this small computed from constants are folded (counters, indices)

_CONTROL_FLOW = {"stablehlo.while": _Importer.unrolled_while, "stablehlo.case": _Importer.selected_case,
                 "stablehlo.reduce_window": _Importer.window_reduction}


def _folded(node: ir.Node) -> ir.Node:
    """`node` evaluated if its inputs are constants and it is small (a loop counter and what is computed from it)."""
    from neuronc.passes.canonicalize import fold_constant

    if node.size > _FOLDED_MAX_ELEMENTS:
        return node
    return fold_constant(node, node.inputs) or node


def _spread(x: ir.Node, shape: tuple, loc) -> ir.Node:
    """A 0-d value broadcast to `shape`."""
    return x if tuple(shape) == () else ir.node(Op.BROADCAST_IN_DIM, [x], shape, x.dtype, loc, dims=())


def _safe_type(value):
    try:
        return tensor_type(value.type)
    except Exception:  # noqa: BLE001 - only used to keep walking after an unsupported op
        return (), DType.F32


def _constant(op, inputs, shape, dtype, loc):
    return ir.node(Op.CONSTANT, [], shape, dtype, loc, value=_dense(op.attributes["value"], shape, dtype))


def _broadcast(op, inputs, shape, dtype, loc):
    return ir.node(Op.BROADCAST_IN_DIM, inputs, shape, dtype, loc, dims=tuple(_ints(op.attributes["broadcast_dimensions"])))


def _transpose(op, inputs, shape, dtype, loc):
    return ir.node(Op.TRANSPOSE, inputs, shape, dtype, loc, perm=tuple(_ints(op.attributes["permutation"])))


def _slice(op, inputs, shape, dtype, loc):
    a = op.attributes
    return ir.node(Op.SLICE, inputs, shape, dtype, loc, start=tuple(_ints(a["start_indices"])),
                   limit=tuple(_ints(a["limit_indices"])), strides=tuple(_ints(a["strides"])))


def _concatenate(op, inputs, shape, dtype, loc):
    return ir.node(Op.CONCATENATE, inputs, shape, dtype, loc, dimension=_int(op.attributes["dimension"]))


def _pad(op, inputs, shape, dtype, loc):
    a = op.attributes
    return ir.node(Op.PAD, inputs, shape, dtype, loc, low=tuple(_ints(a["edge_padding_low"])),
                   high=tuple(_ints(a["edge_padding_high"])), interior=tuple(_ints(a["interior_padding"])))


def _reverse(op, inputs, shape, dtype, loc):
    return ir.node(Op.REVERSE, inputs, shape, dtype, loc, dims=tuple(_ints(op.attributes["dimensions"])))


def _bitcast(op, inputs, shape, dtype, loc):
    (x,) = inputs
    if x.dtype.itemsize == dtype.itemsize:
        return ir.node(Op.BITCAST, inputs, shape, dtype, loc)
    result = stablehlo_expansions.bitcast_of_another_width(x, shape, dtype, loc)  # a dimension of parts added/dropped
    if result is None:
        raise _Unsupported(f"a bitcast of {x.dtype.name.lower()} to {dtype.name.lower()}, of another width")
    return result


def _iota(op, inputs, shape, dtype, loc):
    return ir.node(Op.IOTA, [], shape, dtype, loc, dimension=_int(op.attributes["iota_dimension"]))


def _direction(compare) -> str | None:
    """EQ, NE, LT, LE, GT or GE of a stablehlo.compare (None for no compare)."""
    if compare is None:
        return None
    return re.search(r"comparison_direction (\w+)", str(compare.attributes["comparison_direction"])).group(1)


def _compare(op, inputs, shape, dtype, loc):
    direction = _direction(op)
    return ir.node(Op.COMPARE, inputs, shape, dtype, loc, direction=direction)


def _reduce(op, inputs, shape, dtype, loc):
    dims = tuple(_ints(op.attributes["dimensions"]))
    if len(inputs) > 2:
        kinds = _separate_reducers(op)
        if kinds is None and len(inputs) == 4:
            return _arg_reduce(op, inputs, dims, loc)
        if kinds is None:
            raise _Unsupported("a reduction of several values whose results depend on each other")
        count = len(kinds)
        return tuple(ir.node(Op.REDUCE, [x, init], tensor_type(result.type)[0], x.dtype, loc, dims=dims, kind=kind)
                     for x, init, result, kind in zip(inputs[:count], inputs[count:], op.results, kinds))
    kind = _region_reducer(op)
    return ir.node(Op.REDUCE, inputs, shape, dtype, loc, dims=dims, kind=kind)


def _separate_reducers(op) -> list | None:
    """For a reduction of several operands whose body reduces each on its own (result i is one add/max/... of
    accumulator i and value i), each one's kind; else None (argmax's body mixes them)."""
    block = op.regions[0].blocks[0]
    count = len(block.arguments) // 2
    body = [o.operation for o in block.operations]
    returned = list(body[-1].operands) if body and body[-1].name == "stablehlo.return" else []
    kinds = []
    for i, value in enumerate(returned):
        producer = _defining_op(value)
        if producer is None or producer.name not in _REDUCERS or \
                set(producer.operands) != {block.arguments[i], block.arguments[count + i]}:
            return None
        kinds.append(_REDUCERS[producer.name])
    return kinds if len(kinds) == count and len(body) == count + 1 else None


_ARG_REDUCERS = {"GE": "max", "GT": "max", "LE": "min", "LT": "min"}
_SWAPPED = {"GE": "LE", "GT": "LT", "LE": "GE", "LT": "GT"}


def _arg_reduce(op, inputs, dims, loc):
    """argmax/argmin: a reduction of (values, indices) pairs whose body keeps the larger (smaller) value and,
    on a tie, the smaller index. As IR: the max (min) of the values, then the smallest index holding it."""
    x, indices, init, _ = inputs
    block = op.regions[0].blocks[0]
    acc, current = block.arguments[0], block.arguments[2]
    compare = next((o.operation for o in block.operations if o.operation.name == "stablehlo.compare"), None)
    direction = _direction(compare)
    if direction not in _ARG_REDUCERS or indices.dtype.is_float:
        raise _Unsupported("a reduction of several values that is not argmax/argmin")
    if list(compare.operands) == [current, acc]:
        direction = _SWAPPED[direction]
    elif list(compare.operands) != [acc, current]:
        raise _Unsupported("a reduction of several values that is not argmax/argmin")
    kind = _ARG_REDUCERS[direction]
    kept = tuple(d for d in range(len(x.shape)) if d not in dims)
    reduced_shape = tuple(x.shape[d] for d in kept)
    best = ir.node(Op.REDUCE, [x, init], reduced_shape, x.dtype, loc, dims=dims, kind=kind)
    spread = ir.node(Op.BROADCAST_IN_DIM, [best], x.shape, x.dtype, loc, dims=kept)
    holds = ir.node(Op.COMPARE, [x, spread], x.shape, DType.BOOL, loc, direction="EQ")
    if x.dtype.is_float:  # a NaN is the max (and min) in PyTorch, the first one's index returned; the REDUCE
        # gives NaN there, which equals nothing
        nan = ir.node(Op.COMPARE, [x, x], x.shape, DType.BOOL, loc, direction="NE")
        holds = ir.node(Op.OR, [holds, nan], x.shape, DType.BOOL, loc)
    last = np.array(np.prod([x.shape[d] for d in dims]), indices.dtype.numpy)  # past every index
    never = ir.node(Op.CONSTANT, [], x.shape, indices.dtype, loc, value=last)
    candidates = ir.node(Op.SELECT, [holds, indices, never], x.shape, indices.dtype, loc)
    no_index = ir.node(Op.CONSTANT, [], (), indices.dtype, loc, value=last)
    index = ir.node(Op.REDUCE, [candidates, no_index], reduced_shape, indices.dtype, loc, dims=dims, kind="min")
    return best, index


def _window_attr(op, key, rank, default):
    return tuple(_ints(op.attributes[key])) if key in op.attributes else (default,) * rank


def _padding(op, rank):
    if "padding" not in op.attributes:
        return ((0, 0),) * rank
    pads = _dense(op.attributes["padding"], (rank, 2), DType.I64)
    pads = np.broadcast_to(pads, (rank, 2))
    return tuple((int(lo), int(hi)) for lo, hi in pads)


def _reduce_window(op, inputs, shape, dtype, loc):
    rank = len(inputs[0].shape)
    if any(d != 1 for d in _window_attr(op, "base_dilations", rank, 1) + _window_attr(op, "window_dilations", rank, 1)):
        raise _Unsupported("dilated pooling windows")
    return ir.node(Op.REDUCE_WINDOW, inputs, shape, dtype, loc,
                   window=tuple(_ints(op.attributes["window_dimensions"])),
                   strides=_window_attr(op, "window_strides", rank, 1),
                   padding=_padding(op, rank), kind=_region_reducer(op))


def _select_and_scatter(op, inputs, shape, dtype, loc):
    """JAX's max/min-pooling gradient: a select body of one comparison of its two arguments, a scatter body of
    one addition (frontend/select_and_scatter.py)."""
    from neuronc.frontend.select_and_scatter import select_and_scatter

    operand, source, init = inputs
    select_block, scatter_block = (region.blocks[0] for region in op.regions)
    body = [o.operation for o in select_block.operations]
    compare = body[0] if len(body) == 2 and body[0].name == "stablehlo.compare" else None
    direction = _direction(compare)
    if compare is not None and list(compare.operands) == list(select_block.arguments)[::-1]:
        direction = _SWAPPED.get(direction, direction)
    elif compare is None or list(compare.operands) != list(select_block.arguments):
        raise _Unsupported("a select that is not one comparison of the chosen and the next value")
    if _scatter_combine(op, region=1) != "add":
        raise _Unsupported("a scatter body that is not an addition")
    rank = len(operand.shape)
    return select_and_scatter(operand, source, init, direction, tuple(_ints(op.attributes["window_dimensions"])),
                              _window_attr(op, "window_strides", rank, 1), _padding(op, rank), loc)


_DOT_KEYS = ("lhs_batching_dimensions", "rhs_batching_dimensions", "lhs_contracting_dimensions", "rhs_contracting_dimensions")


def _dot_general(op, inputs, shape, dtype, loc):
    text = str(op.attributes["dot_dimension_numbers"])
    dims = {}
    for key in _DOT_KEYS:
        match = re.search(key + r" = \[([0-9, ]*)\]", text)
        dims[key] = tuple(int(v) for v in match.group(1).split(",") if v.strip()) if match else ()
    return ir.node(Op.DOT_GENERAL, inputs, shape, dtype, loc, lhs_batch=dims[_DOT_KEYS[0]],
                   rhs_batch=dims[_DOT_KEYS[1]], lhs_contract=dims[_DOT_KEYS[2]], rhs_contract=dims[_DOT_KEYS[3]])


def _layout_perm(labels: list, first: str, second: str) -> list:
    """Permutation taking a tensor laid out as `labels` to [first, second, 0, 1, ...]."""
    spatial = sorted((label for label in labels if label.isdigit()), key=int)
    return [labels.index(label) for label in [first, second, *spatial]]


def _transposed(x, perm, loc):
    if perm == list(range(len(perm))):
        return x
    return ir.node(Op.TRANSPOSE, [x], [x.shape[p] for p in perm], x.dtype, loc, perm=tuple(perm))


def _convolution(op, inputs, shape, dtype, loc):
    """Any layout: operands are transposed to [b, f, spatial...] x [o, i, spatial...] first."""
    a = op.attributes
    match = re.search(r"\[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]", str(a["dimension_numbers"]))
    if match is None:
        raise _Unsupported(f"convolution layout {a['dimension_numbers']}")
    lhs, rhs, out = ([label.strip() for label in group.split(",")] for group in match.groups())
    if "batch_group_count" in a and _int(a["batch_group_count"]) != 1:
        raise _Unsupported("batch_group_count != 1")
    spatial = len(shape) - 2
    x = _transposed(inputs[0], _layout_perm(lhs, "b", "f"), loc)
    w = _transposed(inputs[1], _layout_perm(rhs, "o", "i"), loc)
    out_perm = _layout_perm(out, "b", "f")  # canonical dim k is result dim out_perm[k]
    canonical = [shape[p] for p in out_perm]
    conv = ir.node(Op.CONVOLUTION, [x, w], canonical, dtype, loc,
                   strides=_window_attr(op, "window_strides", spatial, 1),
                   padding=_padding(op, spatial),
                   lhs_dilation=_window_attr(op, "lhs_dilation", spatial, 1),
                   rhs_dilation=_window_attr(op, "rhs_dilation", spatial, 1),
                   groups=_int(a["feature_group_count"]) if "feature_group_count" in a else 1)
    inverse = [out_perm.index(k) for k in range(len(shape))]
    return _transposed(conv, inverse, loc)


def _dimension_numbers(attr) -> dict:
    """The fields of a #stablehlo.gather<...> / #stablehlo.scatter<...> attribute (absent lists are empty)."""
    text = str(attr)
    fields = {name: tuple(int(v) for v in values.split(",") if v.strip())
              for name, values in re.findall(r"(\w+) = \[([0-9, ]*)\]", text)}
    vector_dim = re.search(r"index_vector_dim = (\d+)", text)
    fields["index_vector_dim"] = int(vector_dim.group(1)) if vector_dim else 0
    return fields


def _gather(op, inputs, shape, dtype, loc, bounds: str = "checked"):
    f = _dimension_numbers(op.attributes["dimension_numbers"])
    return ir.node(Op.GATHER, inputs, shape, dtype, loc, **_bounds(bounds), window_dims=f.get("offset_dims", ()),
                   dropped_dims=f.get("collapsed_slice_dims", ()),
                   operand_batching_dims=f.get("operand_batching_dims", ()),
                   indices_batching_dims=f.get("start_indices_batching_dims", ()),
                   index_map=f.get("start_index_map", ()), index_vector_dim=f["index_vector_dim"],
                   window=tuple(_ints(op.attributes["slice_sizes"])))


def _bounds(bounds: str) -> dict:
    """A gather's or scatter's `bounds` attribute: absent for PyTorch's (an index outside the operand is an error
    at run time, passes/indexing.py), "clamp" for StableHLO's gather, "drop" for its scatter."""
    return {} if bounds == "checked" else {"bounds": bounds}


def _clamped_starts(operand, starts, sizes, loc) -> list:
    """Each start index clamped to [0, dim - size], as stablehlo.dynamic_slice and dynamic_update_slice clamp
    them: ints for constant indices, else I32 nodes."""
    clamped = []
    for start, dim, size in zip(starts, operand.shape, sizes):
        if start.scalar is not None:
            clamped.append(min(max(int(start.scalar), 0), dim - size))
            continue
        if start.dtype != DType.I32:
            start = ir.node(Op.CONVERT, [start], (), DType.I32, loc)
        low, high = (ir.node(Op.CONSTANT, [], (), DType.I32, loc, value=np.array(v, np.int32)) for v in (0, dim - size))
        clamped.append(ir.node(Op.CLAMP, [low, start, high], (), DType.I32, loc))
    return clamped


def _index_vector(starts: list, loc) -> ir.Node:
    """Start indices (ints or 0-d I32 nodes) as one [rank] I32 vector, a gather's or scatter's index."""
    pieces = [ir.node(Op.CONSTANT, [], (1,), DType.I32, loc, value=np.array([s], np.int32)) if isinstance(s, int)
              else ir.node(Op.RESHAPE, [s], (1,), DType.I32, loc) for s in starts]
    return pieces[0] if len(pieces) == 1 else ir.node(Op.CONCATENATE, pieces, (len(pieces),), DType.I32, loc,
                                                      dimension=0)


def _dynamic_slice(op, inputs, shape, dtype, loc):
    """A window at run-time start indices: a slice when they are constants (an unrolled loop's counter),
    else a gather of one window."""
    operand, *starts = inputs
    sizes = tuple(_ints(op.attributes["slice_sizes"]))
    starts = _clamped_starts(operand, starts, sizes, loc)
    if all(isinstance(s, int) for s in starts):
        return ir.node(Op.SLICE, [operand], shape, dtype, loc, start=tuple(starts),
                       limit=tuple(s + n for s, n in zip(starts, sizes)), strides=(1,) * len(sizes))
    rank = len(sizes)
    return ir.node(Op.GATHER, [operand, _index_vector(starts, loc)], shape, dtype, loc, window_dims=tuple(range(rank)),
                   dropped_dims=(), operand_batching_dims=(), indices_batching_dims=(), index_map=tuple(range(rank)),
                   index_vector_dim=0, window=sizes)


def _dynamic_update_slice(op, inputs, shape, dtype, loc):
    """A window written at run-time start indices: for constant ones, the operand's pieces around the update
    concatenated dim by dim; else a scatter replacing one window."""
    operand, update, *starts = inputs
    starts = _clamped_starts(operand, starts, update.shape, loc)
    if all(isinstance(s, int) for s in starts):
        return _pasted(operand, update, starts, 0, loc)
    rank = len(shape)
    return ir.node(Op.SCATTER, [operand, _index_vector(starts, loc), update], shape, dtype, loc,
                   window_dims=tuple(range(rank)), dropped_dims=(), operand_batching_dims=(), indices_batching_dims=(),
                   index_map=tuple(range(rank)), index_vector_dim=0, window=update.shape, combine="replace")


def _pasted(operand, update, starts: list, dim: int, loc):
    """`operand` with `update` written at `starts`, from dim `dim` on: along it, the operand before the window,
    the window (pasted recursively over the next dims, one level per dim of the tensor), the operand after it."""
    if dim == len(operand.shape):
        return update
    rank, start, length = len(operand.shape), starts[dim], update.shape[dim]
    if length == operand.shape[dim]:
        return _pasted(operand, update, starts, dim + 1, loc)

    def part(lo, hi):
        bounds = list(operand.shape)
        bounds[dim] = hi - lo
        return ir.node(Op.SLICE, [operand], bounds, operand.dtype, loc, start=tuple(lo if d == dim else 0
                       for d in range(rank)), limit=tuple(hi if d == dim else n for d, n in enumerate(operand.shape)),
                       strides=(1,) * rank)

    window = _pasted(part(start, start + length), update, starts, dim + 1, loc)
    pieces = [p for p in (part(0, start) if start else None, window,
                          part(start + length, operand.shape[dim]) if start + length < operand.shape[dim] else None)
              if p is not None]
    return ir.node(Op.CONCATENATE, pieces, operand.shape, operand.dtype, loc, dimension=dim)


_COMBINES = {"stablehlo.add": "add", "stablehlo.maximum": "max", "stablehlo.minimum": "min",
             "stablehlo.multiply": "mul"}


def _scatter_combine(op, region: int = 0) -> str:
    """"replace" for a body that returns the update, else "add", "max", "min" or "mul" for one that returns that op
    of the current value and the update."""
    block = op.regions[region].blocks[0]
    body = [o.operation for o in block.operations]
    update = block.arguments[1]
    if len(body) == 1 and body[0].operands[0] == update:
        return "replace"
    if len(body) == 2 and body[0].name in _COMBINES and body[1].operands[0] == body[0].results[0] \
            and set(body[0].operands) == set(block.arguments[:2]):
        return _COMBINES[body[0].name]
    raise _Unsupported("a scatter whose update is not a replacement, a sum, a max, a min or a product")


def _scatter(op, inputs, shape, dtype, loc, bounds: str = "checked"):
    if len(inputs) != 3:
        raise _Unsupported(f"a scatter of {len(inputs) // 2} operands at once")
    operand, _, updates = inputs
    f = _dimension_numbers(op.attributes["scatter_dimension_numbers"])
    dropped, batching = f.get("inserted_window_dims", ()), f.get("input_batching_dims", ())
    window_sizes = iter(updates.shape[d] for d in f.get("update_window_dims", ()))
    window = tuple(1 if d in dropped or d in batching else next(window_sizes) for d in range(len(operand.shape)))
    return ir.node(Op.SCATTER, inputs, shape, dtype, loc, **_bounds(bounds), window_dims=f.get("update_window_dims", ()),
                   dropped_dims=dropped, operand_batching_dims=batching,
                   indices_batching_dims=f.get("scatter_indices_batching_dims", ()),
                   index_map=f.get("scatter_dims_to_operand_dims", ()), index_vector_dim=f["index_vector_dim"],
                   window=window, combine=_scatter_combine(op))


def _counts_along(x, dimension: int) -> bool:
    """Whether x is 0, 1, 2, ... along `dimension` (an iota, maybe broadcast), whatever the other dims."""
    if x.op is Op.BROADCAST_IN_DIM and x.inputs[0].op is Op.IOTA:
        return x.attrs["dims"][x.inputs[0].attrs["dimension"]] == dimension
    return x.op is Op.IOTA and x.attrs["dimension"] == dimension


def _defining_op(value):
    """The op computing an MLIR value (None for a block argument)."""
    from torch_mlir import ir as mlir

    owner = value.owner
    return None if isinstance(owner, mlir.Block) else getattr(owner, "operation", owner)


def _sort_key(value):
    """The comparator argument a compared value is, through JAX's canonicalisation of float keys (-0 made 0 and
    every NaN one NaN: selects of a constant, whose other operand is the key); None if it is something else. The
    TOPK sort compares -0 and 0 as equal too; NaN keys are its documented limit (README)."""
    op = _defining_op(value)
    while op is not None and op.name == "stablehlo.select":
        chosen = _defining_op(op.operands[1])
        if chosen is None or chosen.name != "stablehlo.constant":
            return None
        value = op.operands[2]
        op = _defining_op(value)
    return value if op is None else None


def _sort(op, inputs, shape, dtype, loc):
    """A sort along one dimension keyed by the first operand (GT: descending, LT: ascending), the other
    operands carried along: TOPK positions of the whole row, then each operand taken at those positions."""
    block = op.regions[0].blocks[0]
    body = [o.operation for o in block.operations]
    compare = _defining_op(body[-1].operands[0]) if body[-1].name == "stablehlo.return" else None
    compare = compare if compare is not None and compare.name == "stablehlo.compare" else None
    direction = _direction(compare)
    if direction not in ("GT", "LT") or [_sort_key(v) for v in compare.operands] != list(block.arguments[:2]):
        raise _Unsupported("a sort whose comparator is not one > or < of the first operand")
    dimension = _int(op.attributes["dimension"])
    keys = inputs[0]
    positions = ir.node(Op.TOPK, [keys], keys.shape, DType.I32, loc, dimension=dimension, k=keys.shape[dimension],
                        descending=direction == "GT")
    return tuple(_taken_at(x, positions, dimension, loc) for x in inputs)


def _taken_at(x, positions, dimension: int, loc):
    """x at TOPK `positions` along `dimension` (a gather of one element per position), or the positions themselves
    when x counts 0, 1, 2, ... along it (the indices carried along with the values)."""
    if _counts_along(x, dimension):
        return ir.node(Op.CONVERT, [positions], positions.shape, x.dtype, loc)
    rank = len(x.shape)
    others = tuple(d for d in range(rank) if d != dimension)
    return ir.node(Op.GATHER, [x, positions], positions.shape, x.dtype, loc, window_dims=(), dropped_dims=(dimension,),
                   operand_batching_dims=others, indices_batching_dims=others, index_map=(dimension,),
                   index_vector_dim=rank, window=(1,) * rank)


_COMPOSITES = {"chlo.erf": Op.ERF}  # composites computed as one op; the others were inlined (stablehlo_program.py)


def _composite(op, inputs, shape, dtype, loc):
    """JAX's `stablehlo.composite "chlo.erf"` (an erf with its polynomial as the decomposition) as one ERF."""
    composite = str(op.attributes["name"]).strip('"')
    if composite not in _COMPOSITES:
        raise _Unsupported(f"composite {composite}")
    return ir.node(_COMPOSITES[composite], inputs, shape, dtype, loc)


def _optimization_barrier(op, inputs, shape, dtype, loc):
    """JAX's rematerialisation fence: its results are its operands (neuronc does not rematerialise)."""
    return tuple(inputs)


def _is_finite(op, inputs, shape, dtype, loc):
    """|x| < inf: false for +-inf and NaN (JAX's logsumexp asks)."""
    (x,) = inputs
    magnitude = ir.node(Op.ABS, [x], x.shape, x.dtype, loc)
    inf = ir.node(Op.CONSTANT, [], x.shape, x.dtype, loc, value=np.array(np.inf, x.dtype.numpy))
    return ir.node(Op.COMPARE, [magnitude, inf], shape, DType.BOOL, loc, direction="LT")


def _custom_call(op, inputs, shape, dtype, loc):
    target = str(op.attributes["call_target_name"]).strip('"')
    if target == "Sharding" and len(inputs) == 1:
        return inputs[0]  # XLA's layout request (JAX puts one on each typed PRNG key): on one core, its operand
    if target == "ApproxTopK":
        return _approx_top_k(op, inputs, loc)
    if target.startswith("lapack_"):
        return _lapack(op, target, inputs, loc)
    raise _Unsupported(f"custom call {op.attributes['call_target_name']}, a kernel of another backend")


def _lapack(op, target, inputs, loc):
    """JAX's LAPACK calls (jnp.linalg on CPU) lowered with neuronc's own linear algebra (lapack_calls.py, which
    imports torch: only for a program that has one)."""
    from neuronc.frontend import lapack_calls

    if not lapack_calls.is_lapack(target):
        raise _Unsupported(f"custom call {target}, a kernel of another backend")
    why = lapack_calls.refusal(target, inputs)
    if why is not None:
        raise _Unsupported(why)
    names = [op.attributes[i].name for i in range(len(op.attributes))]
    config = " ".join(str(op.attributes[n]) for n in ("backend_config", "mhlo.backend_config") if n in names)
    layouts = str(op.attributes["operand_layouts"]) if "operand_layouts" in names else ""
    frontend = str(op.attributes["mhlo.frontend_attributes"]) if "mhlo.frontend_attributes" in names else ""
    batch_dims = re.search(r'num_batch_dims = "(\d+)"', frontend)
    batch_dims = int(batch_dims.group(1)) if batch_dims else len(inputs[0].shape) - 2
    why = lapack_calls.layout_refusal(target, layouts, batch_dims, inputs)
    if why is not None:
        raise _Unsupported(why)
    from neuronc.frontend.aten_lowering import NotLowered

    try:
        return lapack_calls.lowered(target, config, inputs, [tensor_type(r.type) for r in op.results], loc)
    except NotLowered as why:
        raise _Unsupported(f"custom call {target} on these shapes: {why}") from None


def _approx_top_k(op, inputs, loc):
    """`lax.approx_max_k` / `approx_min_k` as XLA's CPU computes it (`aggregate_to_topk`: its fallback is the exact
    top k): the k first of the operand along the reduction dim, and the second operand (the positions' iota) at
    them. JAX names the comparator function top_k_gt_... (max) or top_k_lt_... (min)."""
    names = [op.attributes[i].name for i in range(len(op.attributes))]
    config = " ".join(str(op.attributes[n]) for n in ("backend_config", "mhlo.backend_config") if n in names)
    fields = dict(re.findall(r"(\w+) = ([\w.\-]+)", config))
    comparator = re.search(r"top_k_(gt|lt)_", str(op.attributes["called_computations"]))
    if fields.get("aggregate_to_topk") != "true" or comparator is None or len(inputs) != 4:
        raise _Unsupported("an approximate top-k other than JAX's aggregated one")
    x, positions_in = inputs[:2]
    dimension, k = int(fields["reduction_dim"]), int(fields["top_k"])
    shape = tuple(k if d == dimension else n for d, n in enumerate(x.shape))
    positions = ir.node(Op.TOPK, [x], shape, DType.I32, loc, dimension=dimension, k=k,
                        descending=comparator.group(1) == "gt")
    return _taken_at(x, positions, dimension, loc), _taken_at(positions_in, positions, dimension, loc)


def _reduce_precision(op, inputs, shape, dtype, loc):
    """`lax.reduce_precision`: the format's exponent_bits and mantissa_bits attributes."""
    result = stablehlo_expansions.reduce_precision(inputs[0], _int(op.attributes["exponent_bits"]),
                                                   _int(op.attributes["mantissa_bits"]), loc)
    if result is None:
        raise _Unsupported(f"a reduce_precision of {inputs[0].dtype.name.lower()}")
    return result


def _rng_bit_generator(op, inputs, shape, dtype, loc):
    """(new state, bits) as XLA's CPU computes them (frontend/rng_bit_generator.py); `shape`/`dtype` are the state's."""
    (state,) = inputs
    algorithm = re.search(r"rng_algorithm\s*<?\s*(\w+)", str(op.attributes["rng_algorithm"]))
    algorithm = algorithm.group(1) if algorithm else str(op.attributes["rng_algorithm"])
    bits_shape, bits_dtype = tensor_type(op.results[1].type)
    why = rng_bit_generator.refusal(state, algorithm, bits_shape, bits_dtype)
    if why is not None:
        raise _Unsupported(why)
    return rng_bit_generator.rng_bit_generator(state, algorithm, bits_shape, bits_dtype, loc)


def _expanded(expansion):
    """A converter of an op stablehlo_expansions writes with other ops."""
    def convert(op, inputs, shape, dtype, loc):
        return expansion(*inputs, loc)
    return convert


_CONVERTERS = {
    "stablehlo.reduce_precision": _reduce_precision,
    "stablehlo.rng_bit_generator": _rng_bit_generator,
    "stablehlo.tan": _expanded(stablehlo_expansions.tan),
    "stablehlo.cbrt": _expanded(stablehlo_expansions.cbrt),
    "stablehlo.round_nearest_afz": _expanded(stablehlo_expansions.round_half_away_from_zero),
    "stablehlo.popcnt": _expanded(stablehlo_expansions.population_count),
    "stablehlo.count_leading_zeros": _expanded(stablehlo_expansions.count_leading_zeros),
    "stablehlo.composite": _composite,
    "stablehlo.optimization_barrier": _optimization_barrier,
    "stablehlo.custom_call": _custom_call,
    "stablehlo.is_finite": _is_finite,
    "stablehlo.constant": _constant,
    "arith.constant": _constant,
    "stablehlo.broadcast_in_dim": _broadcast,
    "stablehlo.transpose": _transpose,
    "stablehlo.slice": _slice,
    "stablehlo.concatenate": _concatenate,
    "stablehlo.pad": _pad,
    "stablehlo.iota": _iota,
    "stablehlo.reverse": _reverse,
    "stablehlo.bitcast_convert": _bitcast,
    "stablehlo.compare": _compare,
    "stablehlo.reduce": _reduce,
    "stablehlo.dot_general": _dot_general,
    "stablehlo.convolution": _convolution,
    "stablehlo.gather": _gather,
    "stablehlo.dynamic_slice": _dynamic_slice,
    "stablehlo.dynamic_update_slice": _dynamic_update_slice,
    "stablehlo.scatter": _scatter,
    "stablehlo.select_and_scatter": _select_and_scatter,
    "stablehlo.sort": _sort,
}


def _saturating_convert(op, inputs, shape, dtype, loc):
    """XLA's float-to-integer conversion (LLVM's fptosi.sat / fptoui.sat): NaN gives 0, values past the integer
    type's range its minimum or maximum; the IR's CONVERT truncates in range and, past it, gives what PyTorch's CPU
    kernels give (x86's conversion), which a JAX program's golden does not."""
    (x,) = inputs
    if not x.dtype.is_float or dtype.is_float or dtype is DType.BOOL:
        return ir.node(Op.CONVERT, inputs, shape, dtype, loc)
    wide = x.dtype if x.dtype in (DType.F32, DType.F64) else DType.F32  # every narrower float is exact in fp32
    x = x if wide is x.dtype else ir.node(Op.CONVERT, [x], shape, wide, loc)
    info = np.iinfo(dtype.numpy)

    def constant(value, of):
        return ir.splat(value, shape, of, loc)

    past = float(info.max) + 1  # a power of two: exact in every float type
    below = np.nextafter(np.array(past, wide.numpy), np.array(0, wide.numpy))  # the largest float under it
    clamped = ir.node(Op.CLAMP, [constant(float(info.min), wide), x, constant(below, wide)], shape, wide, loc)
    result = ir.node(Op.CONVERT, [clamped], shape, dtype, loc)
    over = ir.node(Op.COMPARE, [x, constant(past, wide)], shape, DType.BOOL, loc, direction="GE")
    result = ir.node(Op.SELECT, [over, constant(info.max, dtype), result], shape, dtype, loc)
    nan = ir.node(Op.COMPARE, [x, x], shape, DType.BOOL, loc, direction="NE")
    return ir.node(Op.SELECT, [nan, constant(0, dtype), result], shape, dtype, loc)


# What a program from JAX or a StableHLO file means where PyTorch's programs (through torch-mlir) mean otherwise:
# StableHLO's gather clamps its start indices and its scatter drops updates outside the operand (JAX's default
# indexing relies on both), XLA's float-to-integer conversion saturates, and sign(-0.0) is -0.0.
_STABLEHLO_CONVERTERS = {
    "stablehlo.gather": functools.partial(_gather, bounds="clamp"),
    "stablehlo.scatter": functools.partial(_scatter, bounds="drop"),
    "stablehlo.convert": _saturating_convert,
    "stablehlo.sign": _expanded(stablehlo_expansions.sign),
}


def supported_stablehlo_ops() -> list:
    return sorted(set(_SIMPLE) | set(_CONVERTERS) | set(_CONTROL_FLOW))


def main_function(module):
    """The module's entry point: func @main (else its first function)."""
    functions = [op.operation for op in module.body.operations if op.operation.name == "func.func"]
    if not functions:
        raise NeuronCompileError("this StableHLO module has no function", hint="a program is a module with func @main")
    return next((f for f in functions if str(f.attributes["sym_name"]) == '"main"'), functions[0])


def import_module(module, params: list, locations: dict | None, name: str = "main", *, semantics: str) -> ir.Graph:
    """Convert func @main of a StableHLO module. `params` gives (name, kind) for each argument; `locations`
    maps FX node names to their source lines (None: source lines are read from the MLIR locations);
    `semantics` is "pytorch" for a module torch-mlir made (PyTorch's meaning where StableHLO's differs: an
    index out of bounds is an error) or "stablehlo" (JAX, a StableHLO file: `_STABLEHLO_CONVERTERS`)."""
    graph, problems = convert_module(module, params, locations, name, semantics=semantics)
    if problems:
        raise unsupported_error(problems)
    return graph


def convert_module(module, params: list, locations: dict | None, name: str = "main", *, semantics: str) -> tuple:
    """(graph, problems): import_module's graph, with a zero constant standing in for the results of each op
    it cannot convert, and those ops as UnsupportedUse records (for `neuronc check`, which probes the rest)."""
    block = main_function(module).regions[0].blocks[0]
    if semantics not in ("pytorch", "stablehlo"):
        raise ValueError(f"unknown semantics {semantics!r}")
    importer = _Importer(locations, {value: number for number, value in enumerate(values(block))}, semantics)
    graph_params = []
    for index, arg in enumerate(block.arguments):
        try:
            shape, dtype = tensor_type(arg.type)
        except _Unsupported as why:
            raise NeuronCompileError(f"input {params[index][0]} has an unsupported {why}") from None
        pname, kind = params[index]
        node = ir.node(Op.PARAMETER, [], shape, dtype, None, index=index, name=pname, kind=kind)
        importer.values[arg] = node
        graph_params.append(node)
    outputs = []
    for op in block.operations:
        op = op.operation
        if op.name == "func.return":
            outputs = [importer.values[v] for v in op.operands]
            continue
        importer.convert(op)
    return ir.Graph(graph_params, outputs, name), importer.problems


def unsupported_error(problems: list) -> NeuronCompileError:
    error = NeuronCompileError(
        f"{len(problems)} op(s) in this graph cannot be compiled for the NeuronCore yet",
        problems=[str(p) for p in problems],
        hint="rewrite these ops with supported ones (see `neuronc check`), or keep that part of "
        "the model outside the compiled region (torch.compiler.disable, or outside the jitted function)",
    )
    error.unsupported = list(problems)  # UnsupportedUse records, for `neuronc check`
    return error
