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
