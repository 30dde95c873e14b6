"""`torch.compile(model, backend="neuron")`: Dynamo graphs, through AOTAutograd, onto the NeuronCore.

Registered through the `torch_dynamo_backends` entry point, so no import of neuronc is needed.
AOTAutograd lifts parameters to graph inputs and applies the frontend's ATen decompositions; each
resulting graph is compiled to a NEFF, loaded on an emulated NeuronCore, and wrapped in a callable
that takes and returns CPU tensors.

neuronc compiles one program per input shape (as the Neuron toolchain does): graphs with dynamic
shapes (`dynamic=True`, `mark_dynamic`) are refused with a message saying how to pad or bucket,
and Dynamo's automatic dynamic shapes are switched off when this backend is first used, so a new
input shape is a recompilation (counted: `compile_count()`, and a log line on the "neuronc"
logger) rather than a shape-generic graph.
"""
from __future__ import annotations

import logging

from neuronc.compiler import CompileOptions, compile_fx
from neuronc.errors import NeuronCompileError

log = logging.getLogger("neuronc")


class NeffFunction:
    """A compiled graph: CPU tensors in, run on the emulated device, CPU tensors out."""

    def __init__(self, compiled, options: CompileOptions):
        from runtime import NeuronCore

        self.compiled = compiled
        self.program = NeuronCore(options.target).load(compiled.neff)
        self.last_run = None

    def __call__(self, *args):
        from neuronc.frontend.tensors import from_numpy, to_numpy

        result = self.program.run([to_numpy(a) for a in args])
        self.last_run = result
        outputs = [from_numpy(o) for o in result.outputs]
        return tuple(None if i is None else outputs[i] for i in self.compiled.output_layout)


def _refuse_dynamic_shapes(gm) -> None:
    import torch

    symbolic = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (
                isinstance(value, torch.Tensor) and any(not isinstance(d, int) for d in value.shape)):
            symbolic.append(node.name)
    if symbolic:
        raise NeuronCompileError(
            "neuronc compiles one program per input shape, and this graph has dynamic shapes "
            f"(inputs {', '.join(symbolic)})",
            hint="remove dynamic=True / torch._dynamo.mark_dynamic; pad or bucket inputs to a few fixed "
            "shapes instead: each new shape is compiled once, then served from the compile cache",
        )


def compile_count() -> int:
    """How many graphs the backend has compiled (or taken from the compile cache) in this process."""
    return len(compiled_graphs)


def neuron_backend(gm, example_inputs, options: dict | None = None):
    import torch._dynamo.config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from neuronc.frontend.torch_import import decomposition_table

    compile_options = CompileOptions.from_dict(options)
    _refuse_dynamic_shapes(gm)
    torch._dynamo.config.automatic_dynamic_shapes = False  # a new shape recompiles, see the docstring

    def compile_graph(graph_module, inputs):
        compiled = compile_fx(graph_module, compile_options)
        neff = compiled.neff
        function = NeffFunction(compiled, compile_options)
        compiled_graphs.append(function)
        shapes = ", ".join(str(tuple(i.shape)) for i in inputs if hasattr(i, "shape"))
        log.info("neuronc: compilation #%d (%s) for %s: %d kernels, estimated %.1f us%s; inputs %s",
                 compile_count(), compile_options.name, compile_options.target, len(neff.kernels),
                 neff.estimated_ns / 1e3, " (from the compile cache)" if compiled.cache_hit else "", shapes)
        return make_boxed_func(function)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph,
                        decompositions=decomposition_table())(gm, example_inputs)


compiled_graphs: list = []  # every NeffFunction made in this process, newest last (for tests and tools)
