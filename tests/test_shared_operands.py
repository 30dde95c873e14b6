"""A program's instructions share their tiles' access patterns: the load checks each distinct operand once, the
first run makes one view per distinct pattern, and neither changes what is computed or what is refused."""
from __future__ import annotations

import numpy as np
import pytest

import runtime.core
from neuronc.errors import NeuronRuntimeError
from neuronc.isa import AluOp, Engine, Opcode
from neuronc.neff.program import TensorKind
from runtime import NeuronCore
from runtime.memory import Memory
from tests.test_runtime import Program, chip, done, hbm, uniform


def _doubled_three_times():
    """x -> tile; tile *= 2 three times in place (one pattern for all four operands of the three); tile -> y."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (4, 8)), p.tensor("y", TensorKind.OUTPUT, (4, 8))
    tile = chip((4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x_t))
    for n in range(3):
        p.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, chip((4, 8)), chip((4, 8)), alu=AluOp.MULTIPLY, imm0=2.0,
               waits=done(Engine.DMA) if n == 0 else ())
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), tile, queue=1, waits=done(Engine.VECTOR, 3))
    return p.neff()


def test_the_first_run_makes_one_view_per_distinct_operand_pattern(monkeypatch):
    made = []
    memory_view = Memory.view
    monkeypatch.setattr(Memory, "view", lambda self, ap, *args, **kw: made.append(ap) or memory_view(self, ap,
                                                                                                   *args, **kw))
    x = uniform(-1, 1)
    out = NeuronCore("trn2").load(_doubled_three_times()).run([x]).outputs[0]
    np.testing.assert_array_equal(out, x * 8)
    assert len(made) == 3  # hbm(x), the tile (eight operands), hbm(y)


def test_the_load_checks_each_distinct_operand_once(monkeypatch):
    checked = []
    check_bounds = runtime.core.check_bounds
    monkeypatch.setattr(runtime.core, "check_bounds", lambda ap, shape: checked.append(ap) or check_bounds(ap, shape))
    NeuronCore("trn2").load(_doubled_three_times())
    assert len(checked) == 3


def test_a_pattern_read_from_an_input_is_still_refused_as_a_destination():
    """The input's pattern passes as a source first; the same pattern written is checked again, and refused."""
    p = Program()
    x_t, y_t = p.tensor("x", TensorKind.INPUT, (4, 8)), p.tensor("y", TensorKind.OUTPUT, (4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 8)), hbm(x_t))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(x_t), chip((4, 8)), queue=1, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((4, 8)), queue=2, waits=done(Engine.DMA))
    with pytest.raises(NeuronRuntimeError, match=r"DMA_COPY #0 on DMA queue 1.*operand 0 writes HBM bytes \[0, 128\) "
                                                 r"of input 'x', which is read-only"):
        NeuronCore("trn2").load(p.neff())
