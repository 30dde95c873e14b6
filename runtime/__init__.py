"""The emulated Trainium NeuronCore: runs a NEFF with real numerics and estimates its device timeline.

A :class:`NeuronCore` of a target (trn1/trn2/trn3) holds SBUF and PSUM and accounts its HBM;
``core.load(neff)`` reserves the program's HBM (``DeviceOutOfMemoryError`` when it does not fit),
checks every instruction against the ISA (:mod:`neuronc.isa`) and the target's rules, schedules the
streams and refuses reads of memory nothing wrote and races; ``LoadedProgram.run(inputs)`` executes
the engine and DMA streams in simulated-time order and returns the outputs with a :class:`Timeline`,
``LoadedProgram.time()`` the same timeline without running. ``run_neff`` does it all at once::

    result = run_neff(neff, [x])           # or run_neff("model.neff", [x], target="trn1")
    result.outputs[0], result.timeline.estimated_ns
    run_neff(neff, numerics=False).timeline  # times only: no inputs needed

The runtime knows NEFF and the ISA, nothing about PyTorch.
"""
from runtime.core import LoadedProgram, NeuronCore, RunResult, run_neff
from runtime.timeline import Event, Timeline

__all__ = ["Event", "LoadedProgram", "NeuronCore", "RunResult", "Timeline", "run_neff"]
