"""An activation step reads its operand's scale and width itself, and rounds its result once.

The Scalar engine's ACTIVATE computes func(scale * x + bias) in fp32 from an operand of any float dtype and
rounds once into its destination's dtype. Bodies from AOTAutograd's bf16 graphs spell around each activation
the steps it does itself: the exact GELU's `convert(x) : f32, erf(...) : f32, convert(...) : bf16` and its
backward's `multiply(x, 0.7071) : f32, erf(...)` and `multiply(x2, -0.5) : f32, exp(...)`, each an instruction
over the whole tile. Three rules fold them, each computing the same bits:
- a widening float convert read only by the activation: the activation reads the narrow value (ACTIVATE
  widens it exactly);
- an fp32 multiply of a float tile by a constant read only by the activation: the activation's scale (the
  same fp32 product; the bias is -0.0, which adds nothing, not even to a zero's sign);
- an fp32 activation read only by a convert to a narrower float: the activation writes that dtype (its fp32
  value rounded once, as the convert rounds it);
- the exact GELU backward's cdf, fp32 `multiply(add(t, 1.0), 0.5)` of an erf or tanh value t (|t| <= 1), the add
  read only by the multiply: one `multiply(t, 0.5) {bias = 0.5}`, an identity ACTIVATE 0.5 * t + 0.5. Same bits:
  t + 1.0 is 0 or at least 2^-24, so halving it rounds nothing; 0.5 * t is exact unless t is subnormal, and then
  0.5 + 0.5 * t rounds to 0.5 as t + 1.0 rounds to 1.0; t = -1 gives +0 both ways.
Applies to elementwise kernels (FUSED) and matmul epilogues, whose codegen emits an activation step as one
ACTIVATE with the step's `scale`; a matmul epilogue's first step is kept (its accumulator step).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from neuronc import ir
from neuronc.ir import Op, Step
from neuronc.isa import DType
from neuronc.passes.context import PassContext


def _is_activation(step: Step) -> bool:
    return ir.facts(step.op).activation is not None and len(step.args) == 1


def _narrower_float(dtype: DType) -> bool:
    return dtype.is_float and dtype.itemsize < DType.F32.itemsize


def _operand_folded(made: Step, activation: Step, dtype_of) -> Step | None:
    """`activation` reading what `made` reads, or None."""
    if made.dtype != DType.F32 or "scale" in activation.attrs:
        return None
    tiles = [a for a in made.args if a[0] != "imm"]
    if len(tiles) != 1 or dtype_of(tiles[0]) is None or not dtype_of(tiles[0]).is_float:
        return None
    if made.op is Op.CONVERT and _narrower_float(dtype_of(tiles[0])):
        return activation._replace(args=(tiles[0],))
    if made.op is Op.MULTIPLY and len(made.args) == 2 and dtype_of(tiles[0]) in (DType.F32, DType.BF16, DType.F16):
        scale = next(float(a[1]) for a in made.args if a[0] == "imm")
        return activation._replace(args=(tiles[0],), attrs={**activation.attrs, "scale": scale})
    return None


def _half_of_one_plus(body: tuple, step: Step, uses: Counter, first: int) -> tuple | None:
    """(index of the add, the folded step) when `step` is fp32 `multiply(add(t, 1.0), 0.5)` of an erf or tanh t
    whose add only it reads; else None."""
    tiles = [a for a in step.args if a[0] == "step"]
    if (step.op is not Op.MULTIPLY or step.dtype != DType.F32 or step.attrs or len(step.args) != 2
            or len(tiles) != 1 or ("imm", 0.5) not in step.args):
        return None
    at = tiles[0][1]
    if at < first or uses[at] != 1:
        return None
    added = body[at]
    if added.op is not Op.ADD or added.dtype != DType.F32 or ("imm", 1.0) not in added.args or added.attrs:
        return None
    tiles = [a for a in added.args if a[0] == "step"]
    if len(tiles) != 1 or len(added.args) != 2:
        return None
    t = body[tiles[0][1]]
    if t.op not in (Op.ERF, Op.TANH) or t.dtype != DType.F32:
        return None
    return at, step._replace(args=(tiles[0], ("imm", 0.5)), attrs={**step.attrs, "bias": 0.5})


def _without(body: tuple, removed: int, at: int, step: Step) -> tuple:
    """`body` with step `removed` gone and step `at` replaced by `step` (its args in the old numbering)."""
    index = {old: new for new, old in enumerate(j for j in range(len(body)) if j != removed)}
    renumbered = []
    for j, old in enumerate(body):
        if j == removed:
            continue
        current = step if j == at else old
        renumbered.append(current._replace(args=tuple((kind, index[ref]) if kind == "step" else (kind, ref)
                                                      for kind, ref in current.args)))
    return tuple(renumbered)


def _fold_once(body: tuple, dtype_of, first: int) -> tuple | None:
    uses = Counter(ref for step in body for kind, ref in step.args if kind == "step")
    for j, step in enumerate(body):
        if (halved := _half_of_one_plus(body, step, uses, first)) is not None:
            return _without(body, halved[0], j, halved[1])
        if not _is_activation(step):
            continue
        kind, ref = step.args[0]
        if kind == "step" and ref >= first and uses[ref] == 1:
            folded = _operand_folded(body[ref], step, dtype_of)
            if folded is not None:
                return _without(body, ref, j, folded)
        if j >= first and step.dtype == DType.F32 and uses[j] == 1:
            reader = next(k for k, s in enumerate(body) if ("step", j) in s.args)
            narrowing = body[reader]
            if narrowing.op is Op.CONVERT and _narrower_float(narrowing.dtype):
                return _without(body, j, reader, step._replace(dtype=narrowing.dtype))
    return None


def folded_body(body: tuple, input_dtypes: dict, keep_first: bool = False) -> tuple:
    """`body` with every fold applied; `input_dtypes` maps a body input's index to its dtype; `keep_first`: the
    first step is not folded away (a matmul epilogue's accumulator step, which codegen may compute with a bias)."""
    def dtype_of(arg):
        kind, ref = arg
        return input_dtypes.get(ref) if kind == "input" else body_now[ref].dtype if kind == "step" else None

    body_now = tuple(body)
    while (folded := _fold_once(body_now, dtype_of, int(keep_first))) is not None:
        body_now = folded
    return body_now


def _input_dtypes(node: ir.Node) -> dict:
    """A FUSED body's input i is node input i; a matmul epilogue's input 0 is the fp32 accumulator and input
    i > 0 the matmul's input i + 1 (after A and B)."""
    if node.op is Op.FUSED:
        return {i: x.dtype for i, x in enumerate(node.inputs)}
    return {0: DType.F32, **{i + 1: x.dtype for i, x in enumerate(node.inputs[2:])}}


def fold_activation_operands(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each FUSED body and matmul epilogue with the activation folds above applied."""
    key = {Op.FUSED: "body", Op.MATMUL: "epilogue"}
    bodies = {}
    for node in graph.nodes():
        if node.op in key and node.attrs.get(key[node.op]):
            body = node.attrs[key[node.op]]
            folded = folded_body(body, _input_dtypes(node), keep_first=node.op is Op.MATMUL)
            if folded != tuple(body):
                bodies[node] = folded
    if not bodies:
        return graph

    def fold(node, inputs):
        if node not in bodies:
            return None
        return dataclasses.replace(node, inputs=inputs, attrs={**node.attrs, key[node.op]: bodies[node]},
                                   id=next(ir._ids))

    return graph.rewrite(fold)
