"""A matmul whose result is read by an elementwise kernel and by others (passes/shared_epilogues.py): in a training
graph an MLP's pre-activation h is saved for the backward and read by the GELU. The matmul computes the GELU as its
epilogue and stores h from SBUF as its second output: h is written once and never loaded back, and both saved
tensors keep the bits of the two kernels they replace."""
from __future__ import annotations

import copy

import torch

from benchmarks.roofline import _aot_graphs
from neuronc.compiler import CompileOptions, compile_fx
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from neuronc.isa import Engine, Space
from neuronc.neff.program import TensorKind
from neuronc.passes import pipeline
from neuronc.passes.shared_epilogues import fuse_shared_epilogues
from runtime import run_neff
from tests.conftest import TOLERANCES


def _forward():
    """AOTAutograd's forward graph of a bf16 Linear -> GELU -> Linear (it saves h and gelu(h)) and its inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    model = model.to(torch.bfloat16)
    x = torch.randn(1, 256, 128).to(torch.bfloat16)
    forward, _ = _aot_graphs(model, (x,), True)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n.meta["val"].shape, generator=generator).to(n.meta["val"].dtype) for n in placeholders]
    return forward, inputs


def _run(graph, inputs):
    compiled = compile_fx(copy.deepcopy(graph), CompileOptions(opt_level=2), inputs_returned_as_given=True)
    outputs = run_neff(compiled.neff, [to_numpy(t) for t in inputs]).outputs
    return compiled, [None if i is None or isinstance(i, tuple) else from_numpy(outputs[i])
                      for i in compiled.output_layout]


def _loaded_outputs(neff, shape) -> tuple:
    """(the program's outputs of `shape`, those of them some DMA reads)."""
    entries = [t for t in neff.tensors if t.kind is TensorKind.OUTPUT and tuple(t.shape)[-2:] == shape]
    read = set()
    for (engine, _), stream in neff.streams.items():
        for inst in stream if engine is Engine.DMA else ():
            src = inst.operands[1]
            if src.space is Space.HBM:
                read.update(t.name for t in entries if t.offset <= src.offset < t.offset + t.nbytes)
    return {t.name for t in entries}, read


def test_a_saved_pre_activation_is_stored_by_its_matmul_and_never_loaded_with_the_bits_of_two_kernels(monkeypatch):
    forward, inputs = _forward()
    compiled, out = _run(forward, inputs)
    kernels = [n for n in compiled.graph.nodes() if n.op in (Op.MATMUL, Op.FUSED)]
    assert [n.op for n in kernels] == [Op.MATMUL, Op.MATMUL]  # no GELU kernel of its own
    first = kernels[0].attrs["plan"]
    assert first.stored_step == 0 and first.epilogue[1].op is Op.GELU
    outputs, loaded = _loaded_outputs(compiled.neff, (256, 512))
    assert len(outputs) == 2 and len(loaded) == 1  # h and gelu(h) saved; only gelu(h) read (by the second matmul)

    monkeypatch.setitem(pipeline.PIPELINES, 2, [p for p in pipeline.O2 if p is not fuse_shared_epilogues])
    separate, baseline = _run(forward, inputs)
    assert Op.FUSED in {n.op for n in separate.graph.nodes()}  # the GELU a kernel of its own without the pass
    eager = forward(*inputs)
    for mine, theirs, expected in zip(out, baseline, eager):
        if mine is not None:
            assert torch.equal(mine, theirs)
            torch.testing.assert_close(mine, expected, **TOLERANCES[torch.bfloat16])
