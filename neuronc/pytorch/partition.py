"""CPU fallback for the ops of a compiled graph the NeuronCore cannot run (issue 21).

`torch.compile(backend="neuron")` first compiles each AOTAutograd graph whole. When that fails with a
NeuronCompileError, every distinct use of an op is probed alone through the real frontend, passes and
codegen (`op_probe.node_verdicts`, as `neuronc check` does); the ops that compile are grouped into the
largest subgraphs PyTorch's capability partitioner finds, each compiled to a NEFF, and the others run
eagerly on the CPU between them, with one warning per op (as the eager device's fallback does).
A device subgraph that still fails to compile as a whole runs on the CPU too (warned), so the graph
never stops on an op and never returns numbers other than eager's for the ops that fell back. An error in
the user's own NKI kernel (KernelError) is raised, never worked around. A functional collective (tensor
parallelism's, compiled DDP's, ...) is a device op like the others (`compiler.compiled_apart`): it stays a
collective instruction in its piece's NEFF, so its time stays on the emulated timeline beside that piece's
compute; only a collective no NEFF can hold runs from the host, through the process group.

``TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1`` keeps today's strict behaviour: the error listing every
op that cannot be compiled. The CLI never partitions: a NEFF holds device work only.
"""
from __future__ import annotations

import logging
import operator
import os
import warnings

import torch
from torch import fx

from neuronc.errors import KernelError, NeuronCompileError

log = logging.getLogger("neuronc")
FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
warned: dict = {}  # op name -> why it runs on the CPU (one warning per op per process)
partitioned_graphs = 0  # graphs of this process that run in part on the CPU (tests assert none did)


def fallback_disabled() -> bool:
    return os.environ.get(FALLBACK_ENV, "") not in ("", "0")


def compile_or_partition(gm: fx.GraphModule, options, compile_whole, compile_part):
    """`compile_whole(gm)` if the graph compiles; else, unless fallback is off, a GraphModule running the
    device subgraphs through `compile_part(submodule)` (a callable returning a tuple) and the rest on the
    CPU. `compile_whole` may change the graph it is given, so it gets a copy."""
    try:
        return compile_whole(_copy(gm))
    except KernelError:  # the user's own NKI kernel is wrong: running it elsewhere would hide that
        raise
    except NeuronCompileError:
        if fallback_disabled():
            raise
        split = partition(gm, options)
        if split is None:
            raise
    return _attach_devices(split, compile_part)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` to compile, as torch's lazy graph module (what Dynamo uses; a private torch API): it generates
    its Python code only when the code is read or the module called. The compile reads the graph, so a graph module
    generated code it never ran, 7 ms per layer of HF GPT-2 (issue 24)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return _LazyGraphModule(gm, graph)


def partition(gm: fx.GraphModule, options):
    """The graph with its device-capable ops fused into `fused_N` submodules, or None when every op
    compiles alone (the failure is not one op's: nothing to fall back)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    from neuronc.compiler import compile_graph, compiled_apart
    from neuronc.frontend import control_flow
    from neuronc.frontend.op_probe import node_verdicts
    from neuronc.frontend.torch_import import op_name

    control_flow.inline_conditionals(gm)  # a cond's branches are device ops like any other
    # the pieces are compiled by compile_fx, which makes collectives and random ops device work of its own
    why = node_verdicts(gm, accept=lambda graph: compile_graph(graph, options), own=compiled_apart)
    cpu = {}
    for node in gm.graph.nodes:
        if why.get(node.name):
            cpu[node.name] = why[node.name]
            _warn(op_name(node), why[node.name])
    if not cpu:
        return None
    global partitioned_graphs
    partitioned_graphs += 1

    class OnDevice(OperatorSupportBase):
        def is_node_supported(self, submodules, node) -> bool:
            if node.op != "call_function":
                return False
            if node.target is operator.getitem:  # a part of a multi-output op: where that op runs
                return self.is_node_supported(submodules, node.args[0])
            return node.name not in cpu

    partitioner = CapabilityBasedPartitioner(gm, OnDevice(), allows_single_node_partition=True)
    return partitioner.fuse_partitions(partitioner.propose_partitions())


class DevicePart(torch.nn.Module):
    """A fused submodule replaced by its compiled program (its outputs arranged as the submodule's)."""

    def __init__(self, function, single: bool):
        super().__init__()
        self.function, self.single = function, single

    def forward(self, *args):
        outputs = self.function(*args)
        return outputs[0] if self.single else tuple(outputs)


def _attach_devices(split: fx.GraphModule, compile_part) -> fx.GraphModule:
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        single = _outputs_as_tuple(sub)
        try:
            function = compile_part(sub)
        except NeuronCompileError as err:  # the subgraph's ops compile alone, not together: it runs on the CPU
            _warn(f"a subgraph of {sum(n.op == 'call_function' for n in sub.graph.nodes)} ops", err.message)
            if single:
                _output_back(sub)
            continue
        setattr(split, node.target, DevicePart(function, single))
    split.recompile()
    log.info("neuronc: graph partitioned: %d device subgraph(s), ops on the CPU: %s",
             sum(isinstance(m, DevicePart) for m in split.children()), ", ".join(sorted(warned)) or "none")
    return split


def _outputs_as_tuple(sub: fx.GraphModule) -> bool:
    """Make the submodule return a tuple (as AOTAutograd's graphs do); True if it returned one value."""
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    value = output.args[0]
    if isinstance(value, (tuple, list)):
        return False
    output.args = ((value,),)
    sub.recompile()
    return True


def _output_back(sub: fx.GraphModule) -> None:
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    output.args = (output.args[0][0],)
    sub.recompile()


def _warn(op: str, why: str) -> None:
    if op not in warned:
        warned[op] = why
        warnings.warn(f"neuronc: {op} runs on the CPU in this compiled graph ({why.splitlines()[0]}). "
                      f"Set {FALLBACK_ENV}=1 to make this an error.", stacklevel=2)
