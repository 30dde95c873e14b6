"""`torch.compile(model, backend="neuron")`: Dynamo graphs, through AOTAutograd, onto the NeuronCore.

Registered through the `torch_dynamo_backends` entry point, so no import of neuronc is needed.
AOTAutograd lifts parameters to graph inputs and applies the frontend's ATen decompositions; each
resulting graph is compiled to a NEFF, loaded on an emulated NeuronCore, and wrapped in a callable
that takes and returns CPU tensors.
"""
from __future__ import annotations

import logging

from neuronc.compiler import CompileOptions, compile_fx

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


def neuron_backend(gm, example_inputs, options: dict | None = None):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from neuronc.frontend.torch_import import decomposition_table

    compile_options = CompileOptions.from_dict(options)

    def compile_graph(graph_module, inputs):
        compiled = compile_fx(graph_module, compile_options)
        neff = compiled.neff
        log.info("neuronc: compiled %s for %s: %d kernels, estimated %.1f us",
                 compile_options.name, compile_options.target, len(neff.kernels), neff.estimated_ns / 1e3)
        function = NeffFunction(compiled, compile_options)
        compiled_graphs.append(function)
        return make_boxed_func(function)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph,
                        decompositions=decomposition_table())(gm, example_inputs)


compiled_graphs: list = []  # every NeffFunction made in this process, newest last (for tests and tools)
