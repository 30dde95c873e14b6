"""A new eager op's compile skips what cannot change its program (neuronc/passes/gates.py: passes whose ops the
graph lacks; codegen's cost estimate, taken from the load's schedule instead), and its NEFF is byte for byte the
NEFF of the whole pipeline with codegen's estimate."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from neuronc.compiler import compile_graph
from neuronc.neff.writer import encode
from neuronc.passes import gates, pipeline
from neuronc.passes.context import PassContext
from neuronc.pytorch import eager
from neuronc.targets import get_target


def _bytes(neff) -> bytes:
    """The NEFF's encoding with its scratch and constant tensors' names (made of the graph's node numbers, which
    each compile in a process advances: two compiles of one graph differ there alone) numbered in order instead."""
    tensors = [dataclasses.replace(t, name=re.sub(r"^(t|const)\d+", rf"\g<1>#{i}", t.name))
               for i, t in enumerate(neff.tensors)]
    return encode(dataclasses.replace(neff, tensors=tensors, content_hash=""))


def _ops_on_the_device():
    """A range of ops at shapes of their own: elementwise, matmuls with epilogues, row-wise and plain reductions,
    attention's pieces, a convolution, sorts and gathers, integer and bf16 dtypes."""
    x, w, b = torch.randn(5, 12), torch.randn(7, 12), torch.randn(7)
    img, kernel = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    q, k = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 5, 8)
    ints = torch.randint(-9, 9, (6, 5))
    on = [t.to("neuron") for t in (x, w, b, img, kernel, q, k, ints)]
    x, w, b, img, kernel, q, k, ints = on
    results = [
        x + 1.5, x * x, F.gelu(x), F.linear(x, w, b), x @ w.t(), F.relu(F.linear(x, w)), x.softmax(-1),
        F.layer_norm(x, (12,)), x.sum(0), x.mean(1), x.amax(-1), (x * 2).exp().sum(-1), q @ k.transpose(-1, -2),
        F.conv2d(img, kernel, padding=1), F.conv2d(img, kernel, bias=torch.randn(4).to("neuron")), x.sort(-1)[0],
        x.topk(3, -1)[1], x.index_select(0, torch.tensor([0, 3, 3]).to("neuron")), x.gather(1, ints[:5, :4].abs()),
        ints // 3, ints.to(torch.bfloat16) * 0.5, x.t().contiguous(), torch.cumsum(x, 1), x.argmax(-1),
    ]
    torch.accelerator.synchronize()
    return [r.cpu() for r in results]


@pytest.fixture(scope="module")
def eager_compiles():
    """(the lowered graph, its options, the NEFF eager made of it) for every program the ops above compiled."""
    torch.neuron._lazy_init()
    made = []
    compile_lowered = eager._compile_lowered
    mp = pytest.MonkeyPatch()

    def recording(lowered, options):
        compiled = compile_lowered(lowered, options)
        made.append((lowered.graph, options, compiled.neff))
        return compiled

    mp.setattr(eager, "programs", {})
    mp.setattr(eager, "_compile_lowered", recording)
    mp.setenv("NEURON_CC_FLAGS", "--no_cache")
    try:
        _ops_on_the_device()
    finally:
        mp.undo()
    assert len(made) >= 20
    return made


def test_an_eager_program_is_the_neff_of_the_whole_pipeline_with_codegens_estimate(eager_compiles, monkeypatch):
    monkeypatch.setattr(gates, "ENABLED", False)
    for graph, options, neff in eager_compiles:
        whole = compile_graph(graph, options).neff
        assert neff.estimated_ns == whole.estimated_ns > 0
        assert [k.estimated_ns for k in neff.kernels] == [k.estimated_ns for k in whole.kernels]
        assert _bytes(neff) == _bytes(whole), graph.name


def test_gated_passes_leave_the_graphs_they_skip_unchanged(eager_compiles):
    """Each gated pass run anyway on every graph its gate skips (as it meets it in the pipeline) changes nothing."""
    skipped = 0
    for graph, options, _ in eager_compiles:
        ctx = PassContext(get_target(options.target), options.opt_level, options.cast)
        for step in pipeline.passes_for(options.opt_level):
            if gates.gated(step.__name__) and not gates.may_change(step.__name__, gates.Summary(graph)):
                skipped += 1
                assert step(graph, ctx).nodes() == graph.nodes(), (step.__name__, graph.name)
            graph = step(graph, ctx)
    assert skipped > 5 * len(eager_compiles)


def test_a_one_op_graph_skips_the_passes_for_ops_it_lacks(monkeypatch):
    torch.neuron._lazy_init()
    ran = []

    def spy(step):
        def run(graph, ctx):
            ran.append(step.__name__)
            return step(graph, ctx)
        run.__name__ = step.__name__
        return run

    monkeypatch.setitem(pipeline.PIPELINES, 2, [spy(step) for step in pipeline.PIPELINES[2]])
    monkeypatch.setattr(eager, "programs", {})
    x = torch.randn(3, 11)
    assert torch.equal((x.to("neuron") + 2.5).cpu(), x + 2.5)
    assert "legalize" in ran and "tile_matmuls" in ran
    assert not {"fuse_attention", "fuse_conv_epilogues", "top_k_of_sorts", "chain_matmuls"} & set(ran)
