"""The IR verifier: is a graph well formed? Run between passes in the tests and at -O0 or with a debug folder.

A pass that breaks the IR's rules is a compiler bug; caught right after that pass, it is named with the node it
left ill formed, instead of surfacing kernels later as wrong numbers or a crash in codegen. The rules:

* the graph: its parameters are PARAMETER nodes, numbered in order (attribute index), and every node's
  operands are defined before it (no cycles);
* every node: an op of the IR with the operand count, attributes (names and kinds) and dtype rule of its entry in
  the op-facts table (neuronc/op_facts.py), a shape of non-negative ints; StableHLO-level ops' result shapes
  follow from their operands' (elementwise, reshape, broadcast, transpose, slice, concatenate, pad, reverse,
  reduce, dot_general), a VIEW stays within its operand, a splat or dense constant holds a value of its type;
* the bodies of fused kernels (FUSED and ROWWISE bodies, matmul and convolution epilogues, reduction prologues):
  elementwise steps (and row reductions in a ROWWISE body) of the right arity, each argument an input of the
  kernel, an earlier step or a scalar.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from neuronc import op_facts
from neuronc.errors import NeuronCompileError
from neuronc.ir import Graph, Node, Op, Step, facts
from neuronc.isa import AluOp, CollectiveOp, DType
from neuronc.neff.program import DebugLoc


class IRVerificationError(NeuronCompileError):
    """A pass left the graph ill formed (a compiler bug): lists every rule broken, node by node."""


def verify(graph: Graph, after: str = "") -> None:
    """Raise IRVerificationError listing every rule `graph` breaks; `after` names the pass that made it."""
    found = problems(graph)
    if found:
        where = f" after {after}" if after else ""
        raise IRVerificationError(f"the graph is ill formed{where}: {len(found)} problem(s)", problems=found[:50],
                                  hint="a neuronc bug: please report it with the debug folder "
                                       "(TORCH_NEURONX_DEBUG_DIR) of this compilation")


def problems(graph: Graph) -> list:
    """Every rule `graph` breaks, one line each (empty when it is well formed)."""
    found: list = []
    nodes = graph.nodes()
    number = {n: i for i, n in enumerate(nodes)}
    for i, p in enumerate(graph.params):
        if not isinstance(p, Node) or p.op is not Op.PARAMETER:
            found.append(f"graph parameter {i} is not a parameter node: {p!r}")
        elif p.attrs.get("index") != i:
            found.append(f"graph parameter {i} has index {p.attrs.get('index')!r}")
    for o in graph.outputs:
        if not isinstance(o, Node):
            found.append(f"graph output {o!r} is not a node")
    for n in nodes:
        name = f"%{number[n]} ({n.op.name.lower() if isinstance(n.op, Op) else n.op})"
        for problem in _node_problems(n, number):
            found.append(f"{name}: {problem}")
    return found


def _node_problems(n: Node, number: dict):
    if not isinstance(n.op, Op):
        yield f"op {n.op!r} is not an ir.Op"
        return
    if not isinstance(n.dtype, DType):
        yield f"dtype {n.dtype!r} is not a DType"
        return
    if not isinstance(n.shape, tuple) or not all(isinstance(s, (int, np.integer)) and s >= 0 for s in n.shape):
        yield f"shape {n.shape!r} is not a tuple of non-negative ints"
        return
    if not isinstance(n.attrs, dict):
        yield f"attrs {n.attrs!r} are not a dict"
        return
    if not isinstance(n.loc, DebugLoc):
        yield f"loc {n.loc!r} is not a DebugLoc"
    for i, x in enumerate(n.inputs):
        if not isinstance(x, Node):
            yield f"operand {i} is not a node: {x!r}"
            return
        if number.get(x, len(number)) >= number[n]:
            yield f"operand {i} is not defined before its use"
    fact = facts(n.op)
    yield from _arity(len(n.inputs), fact.arity, "operands")
    yield from _attrs(n.attrs, fact)
    yield from _dtypes(n, fact)
    yield from _shapes(n)
    for key, inputs in _bodies(n):
        yield from (f"{key}: {p}" for p in _body_problems(n.attrs[key], inputs, n.op is Op.ROWWISE))


def _arity(count: int, arity, what: str):
    allowed = (arity,) if isinstance(arity, int) else arity
    if allowed is not None and count not in allowed:
        yield f"{count} {what}, expected {' or '.join(map(str, allowed))}"


# attributes ------------------------------------------------------------------------------------------------------


def _attrs(attrs: dict, fact: op_facts.OpFact):
    spec = {name.rstrip("?"): (kind, not name.endswith("?")) for name, kind in fact.attrs.items()}
    for name, (kind, required) in spec.items():
        if name not in attrs:
            if required:
                yield f"attribute {name} is missing"
            continue
        if not _is_kind(attrs[name], kind):
            yield f"attribute {name} = {attrs[name]!r} is not {_describe(kind)}"
    if not fact.open_attrs:
        for name in attrs:
            if name not in spec and not (name == "plan" and _is_plan(attrs[name])):  # any kernel may carry a plan
                yield f"attribute {name} is not one of {fact.name.lower()}'s ({', '.join(spec) or 'none'})"


def _is_plan(v) -> bool:
    """Whether `v` is a kernel plan: a frozen dataclass of neuronc/plans.py, attached by the pass that planned it."""
    return (dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__dataclass_params__.frozen
            and type(v).__module__ == "neuronc.plans")


def _integer(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_kind(v, kind) -> bool:
    if isinstance(kind, tuple):
        return isinstance(v, str) and v in kind
    if kind == "int":
        return _integer(v)
    if kind == "ints":
        return isinstance(v, (tuple, list)) and all(map(_integer, v))
    if kind == "float":
        return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    if kind == "bool":
        return isinstance(v, (bool, np.bool_))
    if kind == "str":
        return isinstance(v, str)
    if kind == "array":
        return isinstance(v, np.ndarray)
    if kind == "dtype":
        return isinstance(v, DType)
    if kind == "collective":
        return isinstance(v, CollectiveOp)
    if kind == "alu":
        return isinstance(v, AluOp)
    if kind == "pairs":
        return isinstance(v, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2
                                                   and all(map(_integer, p)) for p in v)
    if kind == "steps":
        return isinstance(v, tuple) and all(isinstance(s, Step) for s in v)
    if kind == "views":
        return isinstance(v, tuple) and all(view is None or (isinstance(view, (tuple, list)) and len(view) == 2
                                                             and _integer(view[0]) and _is_kind(view[1], "ints"))
                                            for view in v)
    return True  # "any"


def _describe(kind) -> str:
    return f"one of {', '.join(kind)}" if isinstance(kind, tuple) else f"of kind {kind}"


# dtypes ----------------------------------------------------------------------------------------------------------


def _dtypes(n: Node, fact: op_facts.OpFact):
    dtypes = [x.dtype for x in n.inputs]
    rule = fact.dtype
    if rule == op_facts.SAME and any(d != n.dtype for d in dtypes):
        yield f"operand dtypes {_names(dtypes)} differ from the result's {n.dtype.name.lower()}"
    elif rule == op_facts.PREDICATE:
        if n.dtype != DType.BOOL:
            yield f"result dtype {n.dtype.name.lower()}, expected bool"
        if len(set(dtypes)) > 1:
            yield f"operand dtypes {_names(dtypes)} differ"
    elif rule == op_facts.SELECTS and len(dtypes) == 3:
        if dtypes[0] != DType.BOOL:
            yield f"predicate dtype {dtypes[0].name.lower()}, expected bool"
        if dtypes[1] != n.dtype or dtypes[2] != n.dtype:
            yield f"operand dtypes {_names(dtypes[1:])} differ from the result's {n.dtype.name.lower()}"
    elif rule == op_facts.BITCAST and dtypes and dtypes[0].itemsize != n.dtype.itemsize:
        yield f"bitcasts {dtypes[0].name.lower()} to {n.dtype.name.lower()}, of another width"
    elif rule == op_facts.FIRST and dtypes and dtypes[0] != n.dtype:
        yield f"first operand dtype {dtypes[0].name.lower()} differs from the result's {n.dtype.name.lower()}"
    if n.op is Op.CONSTANT and isinstance(n.attrs.get("value"), np.ndarray):
        value = n.attrs["value"]
        if value.dtype != n.dtype.numpy:
            yield f"value of dtype {value.dtype} in a {n.dtype.name.lower()} constant"
        if value.ndim and value.shape != n.shape:
            yield f"value of shape {value.shape} in a constant of shape {n.shape}"


def _names(dtypes) -> str:
    return "(" + ", ".join(d.name.lower() for d in dtypes) + ")"


# shapes ----------------------------------------------------------------------------------------------------------


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _shapes(n: Node):
    op, a, shape = n.op, n.attrs, n.shape
    inputs = [x.shape for x in n.inputs]
    fact = facts(op)
    expected = None
    if fact.elementwise and inputs:
        scalar_ok = op in (Op.SELECT, Op.CLAMP)  # StableHLO's clamp bounds and select predicate may be scalars
        for i, s in enumerate(inputs):
            if s != shape and not (scalar_ok and s == ()):
                yield f"operand {i} of shape {s}, expected the result's {shape}"
        return
    try:
        if op is Op.RESHAPE and _size(inputs[0]) != _size(shape):
            yield f"reshapes {inputs[0]} ({_size(inputs[0])} elements) to {shape} ({_size(shape)})"
        elif op is Op.TRANSPOSE:
            expected = tuple(inputs[0][p] for p in a["perm"])
        elif op is Op.BROADCAST_IN_DIM:
            dims = a["dims"]
            if len(dims) != len(inputs[0]) or any(
                    s not in (1, shape[d]) for s, d in zip(inputs[0], dims)):
                yield f"cannot broadcast {inputs[0]} to {shape} along dims {tuple(dims)}"
        elif op is Op.SLICE:
            expected = tuple(max(0, -(-(hi - lo) // st)) for lo, hi, st in zip(a["start"], a["limit"], a["strides"]))
        elif op is Op.CONCATENATE:
            d = a["dimension"]
            inputs = a.get("shapes") or inputs  # inputs read through views (passes/view_chains.py)
            expected = inputs[0][:d] + (sum(s[d] for s in inputs),) + inputs[0][d + 1:]
            if any(s[:d] + s[d + 1:] != inputs[0][:d] + inputs[0][d + 1:] for s in inputs):
                yield f"operand shapes {inputs} differ outside dimension {d}"
        elif op is Op.PAD:
            expected = tuple(lo + hi + s + max(0, s - 1) * it
                             for s, lo, hi, it in zip(inputs[0], a["low"], a["high"], a["interior"]))
        elif op in (Op.REVERSE, Op.BITCAST):
            expected = inputs[0]
        elif op is Op.REDUCE:
            expected = tuple(s for d, s in enumerate(inputs[0]) if d not in a["dims"])
        elif op is Op.DOT_GENERAL:
            lhs, rhs = inputs
            lb, lc, rb, rc = a["lhs_batch"], a["lhs_contract"], a["rhs_batch"], a["rhs_contract"]
            if [lhs[d] for d in lb] != [rhs[d] for d in rb] or [lhs[d] for d in lc] != [rhs[d] for d in rc]:
                yield f"batch or contracting dims of {lhs} and {rhs} differ"
            expected = (tuple(lhs[d] for d in lb) + tuple(s for d, s in enumerate(lhs) if d not in (*lb, *lc))
                        + tuple(s for d, s in enumerate(rhs) if d not in (*rb, *rc)))
        elif op is Op.VIEW:
            yield from _view_problems(inputs[0], shape, a["offset"], a["strides"])
        elif op is Op.MATMUL and not a.get("views") and "chain" not in a and "plan" not in a:
            (b, m, k), (b2, k2, nn) = inputs[0], inputs[1]
            if b != b2 or k != k2 or k != a["k"] or shape != (b, m, nn):
                yield f"[B, M, K] x [B, K, N] -> [B, M, N] does not hold for {inputs[0]} x {inputs[1]} -> {shape}"
        if op in (Op.MATMUL, Op.CONV) and "k" in a and a["k"] < 1:  # canonicalize makes such a contraction 0
            yield f"contracts over no elements (k = {a['k']}): its kernel would read a PSUM tile it never wrote"
        if op is Op.RANDOM:
            if inputs[0] != (2,) or n.inputs[0].dtype != DType.I64:
                yield f"draws from a state of {n.inputs[0].dtype.name.lower()}{list(inputs[0])}, expected i64[2] (seed, offset)"
            if not n.dtype.is_float or a["first"] < 0:
                yield f"draws {n.dtype.name.lower()} from element {a['first']}: uniform floats from an element >= 0"
        if op is Op.REDUCE_LAST and "cols" not in a:
            if len(inputs[0]) != 2 or shape != inputs[0][:1]:
                yield f"reduces {inputs[0]} to {shape}, expected [R, C] -> [R]"
    except (KeyError, IndexError, TypeError, ValueError) as why:  # attributes already reported as missing
        yield f"shape rule not checked ({type(why).__name__}: {why})"
        return
    if expected is not None and tuple(expected) != shape:
        yield f"result shape {shape}, expected {tuple(expected)} from operands {inputs}"


def _view_problems(source: tuple, shape: tuple, offset, strides):
    if len(strides) != len(shape):
        yield f"{len(strides)} strides for a view of rank {len(shape)}"
        return
    if _size(shape) == 0:
        return
    low = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    if low < 0 or high >= _size(source):
        yield f"view (offset {offset}, strides {tuple(strides)}) reads elements {low}..{high} of a {_size(source)}-" \
              f"element operand"


# fused bodies ----------------------------------------------------------------------------------------------------


def _bodies(n: Node):
    """(attribute, number of inputs its steps may read) of each body of a kernel node."""
    a = n.attrs
    if n.op in (Op.FUSED, Op.ROWWISE) and isinstance(a.get("body"), tuple):
        yield "body", len(n.inputs)
    if n.op in (Op.MATMUL, Op.CONV) and isinstance(a.get("epilogue"), tuple):
        yield "epilogue", len(n.inputs) - 1  # input 0: the accumulator; input i >= 1: the node's input i + 1
    if n.op is Op.REDUCE_LAST and isinstance(a.get("prologue"), tuple):
        yield "prologue", len(n.inputs)


def _body_problems(body: tuple, inputs: int, rowwise: bool):
    for j, step in enumerate(body):
        if not isinstance(step, Step):
            yield f"step {j} is not an ir.Step: {step!r}"
            continue
        reduction = rowwise and step.op is Op.REDUCE_LAST
        if not (isinstance(step.op, Op) and (facts(step.op).elementwise or reduction)):
            yield f"step {j}: {step.op!r} is not an elementwise op"
            continue
        if not isinstance(step.dtype, DType):
            yield f"step {j}: dtype {step.dtype!r} is not a DType"
        yield from (f"step {j}: {p}" for p in _arity(len(step.args), 1 if reduction else facts(step.op).arity,
                                                        "arguments"))
        if reduction and step.attrs.get("kind") not in op_facts.REDUCTIONS:
            yield f"step {j}: a row reduction of kind {step.attrs.get('kind')!r}"
        if step.op is Op.COMPARE and step.attrs.get("direction") not in op_facts.COMPARISONS:
            yield f"step {j}: a comparison of direction {step.attrs.get('direction')!r}"
        for arg in step.args:
            kind, ref = arg if isinstance(arg, tuple) and len(arg) == 2 else (None, None)
            if kind == "input" and not (_integer(ref) and 0 <= ref < inputs):
                yield f"step {j}: reads input {ref!r} of {inputs}"
            elif kind == "step" and not (_integer(ref) and 0 <= ref < j):
                yield f"step {j}: reads step {ref!r}, not an earlier one"
            elif kind == "imm" and not isinstance(ref, (bool, int, float, np.generic)):
                yield f"step {j}: immediate {ref!r} is not a number"
            elif kind not in ("input", "step", "imm"):
                yield f"step {j}: argument {arg!r} is not (input | step | imm, value)"
