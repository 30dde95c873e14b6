"""Deep graphs: nothing in the pipeline recurses once per node of a chain, so how deep a model is never decides
whether it compiles. A graph crosses the frontend child's pipe and is copied as a flat table; a 1,000-block MLP
compiles and matches eager."""
from __future__ import annotations

import contextlib
import copy
import pickle
import sys

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuronc import ir, ir_text
from neuronc.compiler import compile_fx
from neuronc.frontend.isolate import run_isolated
from neuronc.ir import Op
from neuronc.isa import DType
from runtime import run_neff
from tests.conftest import assert_matches_eager

SHALLOW_LIMIT = 200  # Python frames allowed while a 5,000-node chain is pickled, copied or printed


@contextlib.contextmanager
def recursion_limit(limit: int):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def chain(length: int) -> ir.Graph:
    """x -> tanh -> tanh -> ... (length nodes), with an attribute naming a node of the chain."""
    x = ir.node(Op.PARAMETER, (), (4,), DType.F32, index=0, name="x", kind="input")
    node = x
    for _ in range(length):
        node = ir.node(Op.TANH, (node,), (4,), DType.F32)
    node.attrs["first"] = x  # nodes may sit in attributes too: they must point into the copy
    return ir.Graph([x], [node])


def test_a_deep_graph_pickles_and_copies_without_recursing_per_node():
    graph = chain(5000)
    text = ir_text.to_text(graph)
    with recursion_limit(SHALLOW_LIMIT):
        back = pickle.loads(pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL))
        copied = copy.deepcopy(graph)
    for other in (back, copied):
        assert ir_text.to_text(other) == text
        assert other.outputs[0].attrs["first"] is other.params[0]
        assert {n.id for n in other.nodes()} == {n.id for n in graph.nodes()}
        assert [n.origin for n in other.nodes()] == [n.origin for n in graph.nodes()]


def test_a_deep_graph_comes_back_from_the_frontend_child():
    with recursion_limit(SHALLOW_LIMIT):
        graph = run_isolated(chain, 5000)
    assert len(graph.nodes()) == 5001
    assert ir_text.to_text(graph) == ir_text.to_text(chain(5000))  # (the text numbers nodes by position)


def deep_mlp(blocks: int, width: int):
    """(FX graph of `blocks` x (Linear(width, width), Tanh) with the weights as inputs, its inputs, the model)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(blocks) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    weights = [p.detach() for p in model.parameters()]

    def forward(x, *params):
        for k in range(blocks):
            x = torch.tanh(torch.nn.functional.linear(x, params[2 * k], params[2 * k + 1]))
        return (x,)

    x = torch.randn(2, width)
    return make_fx(forward)(x, *weights), [x, *weights], model


def test_a_thousand_block_mlp_compiles_and_matches_eager(monkeypatch):
    monkeypatch.setenv("NEURONC_VERIFY_IR", "0")  # 19 verifications of a 4,000-node graph: a minute, for nothing
    # this test is about (the verifier's walks are the passes' walks: Graph.nodes())
    gm, inputs, model = deep_mlp(1000, 4)
    compiled = compile_fx(gm)
    outputs = run_neff(compiled.neff, [t.numpy() for t in inputs]).outputs
    with torch.no_grad():
        expected = model(inputs[0])
    assert_matches_eager(torch.from_numpy(np.asarray(outputs[0])), expected)
