"""Deep graphs: nothing in the pipeline recurses once per node of a chain, so how deep a model is never decides
whether it compiles. A graph crosses the frontend child's pipe and is copied as a flat table; a 1,000-block MLP
compiles and matches eager."""
from __future__ import annotations

import contextlib
import copy
import itertools
import pickle
import sys

import numpy as np
import pytest
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
    """(FX graph of `blocks` x (Linear(width, width), Tanh) with the weights as inputs, its inputs, the model).

    The graph is make_fx's trace of one block, stamped `blocks` times: the nodes make_fx gives for the whole chain
    (t, addmm, tanh per block), without tracing 3,000 ops through the dispatcher one by one (most of the test's time,
    for a graph that is the same)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(blocks) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    weights = [p.detach() for p in model.parameters()]
    x = torch.randn(2, width)
    one = make_fx(lambda x, w, b: (torch.tanh(torch.nn.functional.linear(x, w, b)),))(x, weights[0], weights[1])
    nodes = list(one.graph.nodes)
    (x_in, w_in, b_in), body, (output,) = nodes[:3], nodes[3:-1], nodes[-1:]
    graph = torch.fx.Graph()

    def placeholder(name, like):
        node = graph.placeholder(name)
        node.meta = dict(like.meta)
        return node

    value = placeholder("arg0_1", x_in)  # (make_fx's names)
    params = [placeholder(f"arg{i + 1}_1", (w_in, b_in)[i % 2]) for i in range(2 * blocks)]
    for k in range(blocks):
        env = {x_in: value, w_in: params[2 * k], b_in: params[2 * k + 1]}
        for node in body:
            env[node] = graph.node_copy(node, env.__getitem__)
        value = env[output.args[0][0]]
    graph.output((value,))
    return torch.fx.GraphModule(one, graph), [x, *weights], model


@pytest.mark.slow("the only graph deep enough (4000+ nodes) to catch recursion and quadratic passes in every layer")
def test_a_thousand_block_mlp_compiles_and_matches_eager(monkeypatch):
    monkeypatch.setenv("NEURONC_VERIFY_IR", "0")  # 19 verifications of a 4,000-node graph: a minute, for nothing
    # this test is about (the verifier's walks are the passes' walks: Graph.nodes())
    gm, inputs, model = deep_mlp(1000, 4)
    compiled = compile_fx(gm)
    outputs = run_neff(compiled.neff, [t.numpy() for t in inputs]).outputs
    with torch.no_grad():
        expected = model(inputs[0])
    assert_matches_eager(torch.from_numpy(np.asarray(outputs[0])), expected)


def norm_stack(blocks: int, width: int = 64):
    """(FX graph of `blocks` x (Linear, LayerNorm) with the weights as inputs, its inputs)."""
    from neuronc.frontend.torch_import import decomposition_table

    torch.manual_seed(0)
    weights = [t for _ in range(blocks) for t in (torch.randn(width, width) / 8, torch.randn(width), torch.randn(width))]

    def forward(x, *params):
        for k in range(blocks):
            w, g, b = params[3 * k:3 * k + 3]
            x = torch.nn.functional.layer_norm(x @ w, (width,), g, b)
        return (x,)

    x = torch.randn(32, width)
    return make_fx(forward, decomposition_table=decomposition_table())(x, *weights), [x, *weights]


def test_repeated_layer_norms_share_one_schedule_search_and_make_the_same_neff(monkeypatch):
    from neuronc.neff import encode
    from neuronc.passes import rowwise_schedule

    searches = []
    candidates = rowwise_schedule.candidates
    monkeypatch.setattr(rowwise_schedule, "candidates", lambda *a: searches.append(a) or candidates(*a))
    monkeypatch.setattr(rowwise_schedule, "_CHOSEN", {})
    compile_fx(norm_stack(1)[0])
    per_norm = len(searches)  # each body the pipeline gives a norm (a pass may rebuild it: recomputed_rows) searched once
    assert per_norm >= 1
    searches.clear()
    monkeypatch.setattr(rowwise_schedule, "_CHOSEN", {})
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors: the same in both
    shared = compile_fx(norm_stack(3)[0])
    assert sum(k.startswith("rowwise") or "ROWWISE" in k.upper() for k in _kernel_names(shared.neff)) == 3
    assert len(searches) == per_norm  # three norms: no more searches than one

    def no_key(value):
        raise TypeError("searched every time")

    monkeypatch.setattr(rowwise_schedule, "structural_key", no_key)
    searches.clear()
    monkeypatch.setattr(ir, "_ids", itertools.count())
    alone = compile_fx(norm_stack(3)[0])
    assert len(searches) == 3 * per_norm
    assert encode(shared.neff) == encode(alone.neff)


def _kernel_names(neff) -> list:
    return [k.name for k in neff.kernels]


def test_a_structural_key_tells_apart_what_equality_confuses():
    from neuronc.passes.rowwise_schedule import structural_key

    assert structural_key(("imm", 0.0)) != structural_key(("imm", -0.0))
    assert structural_key(("imm", 1)) != structural_key(("imm", 1.0)) != structural_key(("imm", True))
    assert structural_key(np.float32(0.5)) != structural_key(np.float16(0.5))
    assert structural_key({"a": np.arange(3)}) == structural_key({"a": np.arange(3)})
    assert structural_key({"a": np.arange(3)}) != structural_key({"a": np.arange(3).astype(np.int32)})


def test_a_mask_made_by_a_long_chain_of_constant_ops_is_evaluated_without_recursing():
    from neuronc.passes.attention import _mask_constant

    value = np.array([[0.0, -np.inf], [0.0, 0.0]], np.float32)
    node = ir.node(Op.CONSTANT, (), (2, 2), DType.F32, value=value)
    for _ in range(3000):  # negated an even number of times: the mask itself
        node = ir.node(Op.NEGATE, (node,), (2, 2), DType.F32)
    with recursion_limit(SHALLOW_LIMIT):
        result = _mask_constant(node)
    np.testing.assert_array_equal(result, value)
