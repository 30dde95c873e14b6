"""Graph.nodes: the topological order every pass walks is a recursive post-order walk's (an input before its
readers, the first input first, each output's inputs depth first), made without recursion."""
from __future__ import annotations

import random
import sys

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType
from tests.conftest import zoo_graph


def _post_order(graph: ir.Graph) -> list:
    """The specification, recursively: params first, then each output's unseen inputs in order, then the output."""
    order, seen = list(graph.params), set(graph.params)

    def visit(node):
        seen.add(node)
        for i in node.inputs:
            if i not in seen:
                visit(i)
        order.append(node)

    for root in graph.outputs:
        if root not in seen:
            visit(root)
    return order


def _random_graph(seed: int) -> ir.Graph:
    rng = random.Random(seed)
    params = [ir.node(Op.PARAMETER, [], (4,), DType.F32, index=k) for k in range(3)]
    made = list(params)
    for _ in range(40):  # each node reads one to three earlier nodes, repeats and shared inputs included
        made.append(ir.node(Op.ADD if rng.random() < 0.5 else Op.MAXIMUM,
                            [rng.choice(made) for _ in range(2)], (4,), DType.F32))
    outputs = [rng.choice(made[3:]) for _ in range(4)]  # an output may also be another's input, or repeat
    return ir.Graph(params, outputs)


def test_nodes_are_the_recursive_post_order_on_random_graphs():
    for seed in range(50):
        graph = _random_graph(seed)
        assert [n.id for n in graph.nodes()] == [n.id for n in _post_order(graph)]


def test_nodes_are_the_recursive_post_order_on_an_imported_model():
    graph = zoo_graph("gpt2")
    expected = _post_order(graph)
    assert len(expected) > 100
    assert [n.id for n in graph.nodes()] == [n.id for n in expected]


def test_a_chain_deeper_than_the_recursion_limit_is_walked():
    x = ir.node(Op.PARAMETER, [], (1,), DType.F32, index=0)
    chain = [x]
    for _ in range(sys.getrecursionlimit() * 2):
        chain.append(ir.node(Op.NEGATE, [chain[-1]], (1,), DType.F32))
    assert ir.Graph([x], [chain[-1]]).nodes() == chain


def _counting_walks(monkeypatch) -> list:
    walks = []
    walk = ir.Graph._walk

    def counted(self):
        walks.append(self)
        return walk(self)

    monkeypatch.setattr(ir.Graph, "_walk", counted)
    return walks


def test_a_graph_walked_again_gives_its_kept_order_without_walking(monkeypatch):
    walks = _counting_walks(monkeypatch)
    graph = _random_graph(0)
    first = graph.nodes()
    first.append("a caller's own list")  # each call returns a list of its own
    again = graph.nodes()
    assert again == _post_order(graph)
    assert len(walks) == 1


def test_a_rewrite_that_replaces_nothing_gives_the_new_graph_the_kept_order(monkeypatch):
    walks = _counting_walks(monkeypatch)
    graph = _random_graph(1)
    same = graph.rewrite(lambda node, inputs: None)
    assert same is not graph and same.nodes() == graph.nodes() == _post_order(graph)
    assert len(walks) == 1
    changed = graph.rewrite(lambda node, inputs: ir.node(Op.NEGATE, [node], node.shape, node.dtype)
                            if node is graph.outputs[0] else None)
    assert [n.id for n in changed.nodes()] == [n.id for n in _post_order(changed)]
    assert len(walks) == 2  # graph's walk kept; the graph of a rewrite that replaced a node is walked


def test_an_edit_of_a_nodes_inputs_or_of_the_outputs_makes_a_fresh_walk():
    """The IR's nodes are immutable by convention; an edit against it still gives the edited graph's order."""
    for seed in range(20):
        graph = _random_graph(seed)
        graph.nodes()
        reader = next(n for n in reversed(graph.nodes()) if n.inputs)
        reader.inputs = (graph.params[2], *reader.inputs[1:])  # the same length, another node
        assert [n.id for n in graph.nodes()] == [n.id for n in _post_order(graph)]
        extra = ir.node(Op.NEGATE, [graph.params[0]], (4,), DType.F32)
        graph.outputs.append(extra)
        assert [n.id for n in graph.nodes()] == [n.id for n in _post_order(graph)]
        graph.params.pop()
        assert [n.id for n in graph.nodes()] == [n.id for n in _post_order(graph)]


def test_an_op_hashes_as_the_object_it_is():
    """Op.__hash__ is object's (in C), not Enum's hash of the name (a Python call at every dict or set lookup)."""
    assert ir.Op.__hash__ is object.__hash__
    assert {op: op.name for op in ir.Op}[ir.Op.MATMUL] == "MATMUL" and ir.Op["ADD"] is ir.Op.ADD


def test_a_compiled_neff_does_not_depend_on_the_hash_seed(tmp_path):
    """Ops hash by address and strings by a salted hash, both different in each process: the NEFF of a model
    compiled under two hash seeds is the same, byte for byte (so no result depends on the order of a set)."""
    import os
    import pathlib
    import pickle
    import subprocess

    from neuronc.compiler import CompileOptions

    path = tmp_path / "graph.pkl"
    path.write_bytes(pickle.dumps((zoo_graph("transformer_block"), CompileOptions(auto_cast="matmult"))))
    script = ("import hashlib, pickle, sys; from neuronc.compiler import compile_graph; from neuronc.neff import encode; "
              "graph, options = pickle.load(open(sys.argv[1], 'rb')); "
              "print(hashlib.sha256(encode(compile_graph(graph, options).neff)).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                              cwd=pathlib.Path(__file__).parents[1],
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
               for seed in ("1", "2")}
    assert len(digests) == 1 and len(next(iter(digests))) == 64
