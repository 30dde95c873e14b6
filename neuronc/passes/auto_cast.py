"""Auto-cast: fp32 work done in a narrower float type, as neuronx-cc's `--auto-cast` and
`--auto-cast-type` do it, traded for speed (the Tensor engine is several times faster in bf16/fp16/fp8).

    --auto-cast none      every op in the dtype the model gives it (neuronc's default)
    --auto-cast matmult   fp32 matmuls and convolutions, the Tensor engine's work, read their
                          operands cast to the narrower type; they still accumulate in fp32 PSUM and
                          give an fp32 result, so the rest of the graph is untouched
    --auto-cast all       every fp32 op computes in the narrower type; the program's fp32 inputs
                          and outputs keep their type, cast on the way in and out
    --auto-cast-type bf16 | fp16 | fp8_e4m3    the narrower type (default bf16)
    --auto-cast fp64-to-fp32    a program taking or returning float64 is accepted: the NeuronCore has no
                          float64, so the program computes in fp32 and its float64 inputs and outputs are
                          fp32 in the NEFF; the host casts at the boundary (passes/canonicalize.py demote_f64,
                          pytorch/backend.py). Without it such a program is refused.

`fp64-to-fp32` is about the program's interface, the modes about its fp32 work: the two combine, written
`--auto-cast matmult,fp64-to-fp32` (or `all,fp64-to-fp32`: the float64 work, now fp32, narrows too).

Ops already in bf16/fp16, integer and boolean ops, and bitcasts (which read the bytes of their operand's own
width) are never changed. The pass runs after canonicalize (fp64 is gone by then) and before legalize, on
DOT_GENERAL and CONVOLUTION.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from neuronc import ir
from neuronc.errors import NeuronConfigError
from neuronc.ir import Op
from neuronc.isa import DType

if TYPE_CHECKING:
    from neuronc.passes.context import PassContext

MODES = ("none", "matmult", "all")
FP64_TO_FP32 = "fp64-to-fp32"
# every --auto-cast value accepted: a mode, fp64-to-fp32, or a narrowing mode and fp64-to-fp32 together
VALUES = MODES + (FP64_TO_FP32,) + tuple(f"{mode},{FP64_TO_FP32}" for mode in MODES if mode != "none")
CAST_TYPES = {"bf16": DType.BF16, "fp16": DType.F16, "fp8_e4m3": DType.F8E4M3}
MATMULT_OPS = {Op.DOT_GENERAL, Op.CONVOLUTION}


@dataclasses.dataclass(frozen=True)
class AutoCast:
    """The options: which ops (`mode`) compute in which narrower type (`cast_type`), and whether float64 inputs
    and outputs are accepted as fp32 ones (`fp64`)."""

    mode: str = "none"
    cast_type: str = "bf16"
    fp64: bool = False

    @classmethod
    def from_option(cls, value: str, cast_type: str = "bf16") -> "AutoCast":
        """From the --auto-cast value as given (`matmult`, `fp64-to-fp32`, `all,fp64-to-fp32`, ...)."""
        if value not in VALUES:
            raise NeuronConfigError(f"unknown --auto-cast mode {value!r}", hint=f"use one of {', '.join(VALUES)}")
        modes = [part for part in value.split(",") if part != FP64_TO_FP32]
        return cls(modes[0] if modes else "none", cast_type, fp64=FP64_TO_FP32 in value.split(","))

    def __post_init__(self):
        if self.mode not in MODES:
            raise NeuronConfigError(f"unknown --auto-cast mode {self.mode!r}", hint=f"use one of {', '.join(MODES)}")
        if self.cast_type not in CAST_TYPES:
            raise NeuronConfigError(f"unknown --auto-cast-type {self.cast_type!r}",
                                    hint=f"use one of {', '.join(CAST_TYPES)}")


def auto_cast(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """The pass: the auto-cast `ctx.cast` asks for (nothing for --auto-cast none)."""
    narrow = CAST_TYPES[ctx.cast.cast_type]
    if ctx.cast.mode == "matmult":
        return cast_matmults(graph, narrow)
    if ctx.cast.mode == "all":
        return cast_all(graph, narrow)
    return graph


def convert(x: ir.Node, dtype: DType) -> ir.Node:
    return ir.node(Op.CONVERT, [x], x.shape, dtype, x.loc)


def cast_matmults(graph: ir.Graph, narrow: DType) -> ir.Graph:
    def cast(node, inputs):
        if node.op in MATMULT_OPS and node.dtype is DType.F32 and all(x.dtype is DType.F32 for x in inputs):
            return ir.node(node.op, [convert(x, narrow) for x in inputs], node.shape, node.dtype, node.loc, **node.attrs)
        return None

    return graph.rewrite(cast)


def cast_all(graph: ir.Graph, narrow: DType) -> ir.Graph:
    new: dict = {}
    for node in graph.nodes():
        if node.op is Op.PARAMETER:
            new[node] = convert(node, narrow) if node.dtype is DType.F32 else node
            continue
        inputs = [new[x] for x in node.inputs]
        if node.op is Op.BITCAST:  # reads the bytes of its operand's own width: fp32 in, fp32 out, cast around it
            operand = convert(inputs[0], DType.F32) if node.inputs[0].dtype is DType.F32 else inputs[0]
            bitcast = ir.node(node.op, [operand], node.shape, node.dtype, node.loc, **node.attrs)
            new[node] = convert(bitcast, narrow) if node.dtype is DType.F32 else bitcast
            continue
        dtype = narrow if node.dtype is DType.F32 else node.dtype
        attrs = dict(node.attrs)
        if node.op is Op.CONSTANT and dtype is not node.dtype:
            attrs["value"] = np.asarray(attrs["value"]).astype(narrow.numpy)
        new[node] = ir.node(node.op, inputs, node.shape, dtype, node.loc, **attrs)
    outputs = [convert(new[o], DType.F32) if o.dtype is DType.F32 else new[o] for o in graph.outputs]
    return ir.Graph(graph.params, outputs, graph.name)
