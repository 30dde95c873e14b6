"""The memory plan's scratch slots: a tensor reuses a dead tenant's bytes only where the sync pass can track the
slot exactly, that is, where every tenant has the same row width (codegen.sync tracks a slot of one row width by
rows by bytes of a row, one of mixed widths only by bytes)."""
from __future__ import annotations

from neuronc.passes.memory_plan import plan_memory
from tests.conftest import ir

# a chain of exps of [8, 12] fp32 (48-byte rows), then the same bytes as [12, 8] (32-byte rows): by the time the
# [12, 8] tensors are made the first [8, 12] tensors' slots are dead and cooled (memory_plan.COOLING)
CHAIN = """
    graph @f(%0) {
      %0 = parameter() : 8x12xf32 {index = 0, name = "x", kind = "input"}
      %1 = exp(%0) : 8x12xf32
      %2 = exp(%1) : 8x12xf32
      %3 = exp(%2) : 8x12xf32
      %4 = exp(%3) : 8x12xf32
      %5 = exp(%4) : 8x12xf32
      %6 = exp(%5) : 8x12xf32
      %7 = reshape(%6) : 12x8xf32
      %8 = exp(%7) : 12x8xf32
      %9 = exp(%8) : 12x8xf32
      %10 = reshape(%9) : 8x12xf32
      %11 = exp(%10) : 8x12xf32
      %12 = exp(%11) : 8x12xf32
      return %12
    }"""


def _offsets():
    graph = ir(CHAIN)
    plan = plan_memory(graph)
    nodes = graph.nodes()
    return [plan.placement[n].offset if n in plan.placement else None for n in nodes], nodes


def test_a_tensor_of_another_row_width_does_not_reuse_a_dead_tensors_slot():
    offsets, nodes = _offsets()
    wide = {offsets[i] for i, n in enumerate(nodes[:7]) if n.op.name == "EXP"}
    narrow = {offsets[i] for i, n in enumerate(nodes) if n.op.name == "EXP" and n.shape == (12, 8)}
    assert narrow and not narrow & wide


def test_a_tensor_of_the_same_row_width_reuses_a_dead_tensors_slot():
    offsets, nodes = _offsets()
    first = {offsets[i] for i, n in enumerate(nodes[:7]) if n.op.name == "EXP"}
    assert offsets[nodes.index(next(n for n in nodes[10:] if n.op.name == "EXP"))] in first
