"""The emulated Trainium NeuronCore: runs a NEFF with real numerics and estimates its device timeline.

A :class:`NeuronCore` of a target (trn1/trn2/trn3) holds SBUF and PSUM; ``core.load(neff)`` lays a
program out in its HBM and checks every instruction against the ISA (:mod:`neuronc.isa`) and the
target's rules; ``LoadedProgram.run(inputs)`` executes the engine and DMA streams in simulated-time
order and returns the outputs with a :class:`Timeline`. ``run_neff`` does all three at once::

    result = run_neff(neff, [x])           # or run_neff("model.neff", [x], target="trn1")
    result.outputs[0], result.timeline.estimated_ns

The runtime knows NEFF and the ISA, nothing about PyTorch.
"""
from runtime.core import LoadedProgram, NeuronCore, RunResult, run_neff
from runtime.timeline import Event, Timeline

__all__ = ["Event", "LoadedProgram", "NeuronCore", "RunResult", "Timeline", "run_neff"]
