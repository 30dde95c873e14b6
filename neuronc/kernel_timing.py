"""One planned kernel, emitted alone and timed by the emulator's own stream simulation.

The tiling passes (passes/tiling.py for matmuls and chains, passes/conv.py for convolutions) choose among
candidate plans of a kernel. An analytic formula re-implementing codegen's schedule drifts from what codegen
emits (issue 16: matmul candidates at 0.86-2.04 of their emulated time). So a candidate is priced by what it
is: its node, with the candidate's plan attached, compiled as a program of one kernel (its operands made
program inputs, as `neuronc check` probes a node alone, its source locations blank), through the memory plan
and codegen as the compiler runs them (sync waits, prefetch), and timed by `stream_timing`
(`Neff.estimated_ns`: the emulator's clock).

Passes never import codegen: the compiler hands this to them through `PassContext.kernel_time`. Repeated layers
ask for the same kernels: prices are kept by the kernel's IR text (a bounded table per process).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

from neuronc import ir, ir_text
from neuronc.codegen import generate
from neuronc.neff.program import DebugLoc
from neuronc.passes.memory_plan import plan_memory
from neuronc.targets import Target

CACHED_PRICES = 4096  # kernels whose price is kept per process (a key is one kernel's IR text: a few KiB)
ELIDED = 16  # arrays printed in a key only up to this many elements: values do not change a kernel's time

_prices: OrderedDict = OrderedDict()  # key -> ((emulated ns, instructions), the ids emitting it took)


def _unlocated(value):
    """`value` (an attribute) with every source location in it blank: a location names no time, and two layers'
    kernels differ only by theirs."""
    if isinstance(value, DebugLoc):
        return DebugLoc()
    if isinstance(value, ir.Node) or isinstance(value, type):
        return value
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _unlocated(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*map(_unlocated, value))
    if isinstance(value, (tuple, list)):
        return type(value)(map(_unlocated, value))
    if isinstance(value, dict):
        return {k: _unlocated(v) for k, v in value.items()}
    return value


def alone(node: ir.Node) -> ir.Graph:
    """A program computing `node` alone: its operands other than constants become inputs (a weight's values and
    name make no time), and of its attributes only its kernel plan (and its outputs' types, for a kernel storing a
    second output: the memory plan places it), source locations blank (codegen emits a planned kernel from its
    plan: neuronc/plans.py)."""
    params, inputs = {}, []
    for x in node.inputs:
        if x.op is ir.Op.CONSTANT:
            inputs.append(x)
            continue
        if x not in params:
            params[x] = ir.node(ir.Op.PARAMETER, [], x.shape, x.dtype, None, index=len(params),
                                name=f"in{len(params)}", kind="input")
        inputs.append(params[x])
    attrs = {"plan": _unlocated(node.attrs["plan"])}
    if "outputs" in node.attrs:
        attrs["outputs"] = node.attrs["outputs"]
    kernel = ir.Node(node.op, tuple(inputs), node.shape, node.dtype, attrs)
    return ir.Graph(list(params.values()), [kernel], "priced")


def kernel_time(node: ir.Node, target: Target, prefetch: bool = True) -> tuple:
    """(emulated ns, instructions) of `node`'s kernel (its plan attached, as codegen emits it) compiled alone on
    `target`: the emulator's clock of that program (stream_timing), and how many instructions it took."""
    graph = alone(node)
    try:
        key = (ir_text.to_text(graph, elide_arrays_over=ELIDED), target.name, prefetch)
    except (TypeError, ValueError):  # an attribute the IR text cannot print: priced without the table
        key = None
    if key is not None and key in _prices:
        # a hit takes the ids the emission took (ir.skip_ids: they name the NEFF's tensors), so that a program
        # compiles to the same bytes whether its kernels were priced before in this process or not
        _prices.move_to_end(key)
        priced, ids = _prices[key]
        ir.skip_ids(ids)
        return priced
    start = ir.next_id()
    neff = generate(graph, plan_memory(graph), target, "priced", prefetch=prefetch, reuse=False)
    priced = (neff.estimated_ns, sum(len(stream) for stream in neff.streams.values()))
    if key is not None:
        _prices[key] = priced, ir.next_id() - start
        if len(_prices) > CACHED_PRICES:
            _prices.popitem(last=False)
    return priced
