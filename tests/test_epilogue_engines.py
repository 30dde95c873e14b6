"""The GELU backward's matmul epilogue (`grad @ W` times the exact GELU's derivative) spread over the engines
(codegen/matmul.py, codegen/elementwise.StepBalancer): its biased multiply may run on the Vector or GpSimd
engine as one TENSOR_ALU2 reading constant columns, its erf and exp tables load once a group of tiles, and the
derivative (the steps not reading the accumulator) is computed ahead of the accumulator's steps; the bits stay
-O0's (each op its own kernel) and match eager."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.codegen.elementwise import scaled_products, table_order
from neuronc.codegen.emitter import Emitter
from neuronc.codegen.matmul import early_steps, matmul
from neuronc.instruction_cost import activation_table
from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.isa import ActFunc, AluOp, Engine, Opcode, Space
from neuronc.neff.program import DebugLoc
from neuronc.passes.memory_plan import plan_memory
from neuronc.targets import get_target
from tests.conftest import assert_matches_eager, compiled_outputs, o2_with_o0_bits


class MatmulGeluBackward(nn.Module):
    def forward(self, grad, w, x):  # AOTAutograd's bf16 GELU backward after the gradient's matmul
        xf = x.float()
        cdf = (torch.erf(xf * 0.7071067811865476) + 1.0) * 0.5
        pdf = torch.exp(xf * xf * -0.5) * 0.3989422804014327
        return ((grad @ w).float() * (cdf + xf * pdf)).to(torch.bfloat16)


def _inputs():
    torch.manual_seed(0)
    grad = torch.randn(512, 256).to(torch.bfloat16)
    w = (torch.randn(256, 1024) * 0.1).to(torch.bfloat16)
    x = (torch.randn(512, 1024) * 3).to(torch.bfloat16)
    x[0, :5] = torch.tensor([-0.0, 0.0, 1e-38, -30.0, 30.0])  # signed zeros, a subnormal erf, erf = -1 and 1
    return grad, w, x


def _instructions(compiled):
    return [i for stream in compiled.neff.streams.values() for i in stream]


def _body():
    graph = parse("""
graph @main(%0, %1) {
  %0 = parameter() : 4x8xf32 {index = 0, name = "acc", kind = "input"}
  %1 = parameter() : 4x8xf32 {index = 1, name = "x", kind = "input"}
  %2 = fused(%0, %1) : 4x8xbf16 {
      body = (
          convert(in0) : bf16, erf(in1) : f32 {scale = 0.7071}, multiply(s1, 0.5) : f32 {bias = 0.5},
          multiply(in1, in1) : f32, exp(s3) : f32 {scale = -0.5}, multiply(s4, 0.3989) : f32,
          multiply(in1, s5) : f32, add(s2, s6) : f32, multiply(s0, s7) : bf16),
      views = (none, none)}
  return %2
}""")
    (node,) = [n for n in graph.nodes() if n.op is Op.FUSED]
    return node.attrs["body"]


def test_the_gelu_backward_epilogue_has_the_bits_of_o0_and_matches_eager():
    inputs = _inputs()
    compiled, (out,) = o2_with_o0_bits(MatmulGeluBackward(), inputs)
    assert [n.op for n in compiled.graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE)] == [Op.MATMUL]
    assert_matches_eager(out, MatmulGeluBackward()(*inputs))


def test_the_biased_multiply_may_run_off_the_scalar_engine_as_one_alu2_of_constant_columns():
    compiled, _ = compiled_outputs(MatmulGeluBackward(), _inputs())
    alu2 = [i for i in _instructions(compiled) if i.opcode is Opcode.TENSOR_ALU2 and i.alu1 is AluOp.ADD]
    assert alu2 and all(i.engine in (Engine.VECTOR, Engine.GPSIMD) and i.alu is AluOp.MULTIPLY for i in alu2)
    scale, bias = alu2[0].operands[2], alu2[0].operands[3]
    assert all(stride == 0 for stride, _ in scale.dims[1:] + bias.dims[1:])  # one value a partition, held


def test_x_times_exp_times_a_constant_is_one_alu2_a_tile():
    compiled, _ = compiled_outputs(MatmulGeluBackward(), _inputs())
    products = [i for i in _instructions(compiled) if i.opcode is Opcode.TENSOR_ALU2 and i.alu1 is AluOp.MULTIPLY]
    constant = [i for i in _instructions(compiled) if i.opcode is Opcode.TENSOR_SCALAR]
    assert len(products) == 8 and not constant  # 8 output tiles; no `exp * 0.3989` step of its own
    assert all(i.alu is AluOp.MULTIPLY and all(s == 0 for s, _ in i.operands[2].dims[1:]) for i in products)


def test_scaled_products_pairs_a_constant_multiply_with_its_only_reader():
    body = _body()
    ((reader, (inner, step)),) = scaled_products(body).items()
    assert (reader, inner) == (6, 5)
    assert step.args == (("step", 4), ("input", 1)) and step.attrs == {"scale": body[5].args[1][1]}


def test_the_erf_and_exp_tables_load_once_a_group_of_tiles():
    compiled, _ = compiled_outputs(MatmulGeluBackward(), _inputs())
    tables = [t for t in map(activation_table, compiled.neff.streams[(Engine.SCALAR, 0)]) if t is not None]
    loads = sum(1 for before, table in zip([None, *tables], tables) if before != table)
    tiles = tables.count(ActFunc.ERF)  # each output tile computes erf once
    assert tiles == 8 and tables.count(ActFunc.EXP) == tiles
    assert loads <= tiles // 2 + 1  # groups of two tiles: one load a group (two, erf then exp, in body order)


def test_the_derivative_is_the_early_part_and_the_table_order_starts_with_the_loaded_table():
    body, slots = _body(), [0, 1, 1, 2, 2, 2, 2, 2, None]  # kernel_plans.assign_slots of this body
    derivative = [1, 2, 3, 4, 5, 6, 7]
    assert early_steps(body, slots) == derivative
    order = table_order(body, slots, ActFunc.EXP, derivative, [[]], [0, 8])
    assert sorted(order) == derivative and order.index(4) < order.index(1)  # exp's table loaded: exp first
    assert table_order(body, slots, ActFunc.ERF, derivative, [[]], [0, 8]) == derivative


def test_early_steps_are_none_when_computing_them_first_would_overwrite_a_live_slot():
    body = _body()
    assert early_steps(body, [0, 0, 1, 1, 1, 1, 1, 1, None]) == []  # erf would overwrite the rounded accumulator


def test_the_derivative_is_emitted_for_four_tiles_at_once_ahead_of_their_accumulators_steps():
    # 8 output tiles, epilogues in groups of 2 with the next group waiting: the derivative (erf, exp, ...) of the 4
    # tiles in flight is emitted at once, every other flush, before the first of them reads its accumulator
    compiled, _ = compiled_outputs(MatmulGeluBackward(), _inputs())
    (node,) = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    em = Emitter(get_target("trn2"))
    em.begin_kernel("matmul", ("matmul",), DebugLoc())
    matmul(em, node, plan_memory(compiled.graph))
    order = "".join("e" if i.func is ActFunc.ERF else "a" for i in em.instructions
                    if i.func is ActFunc.ERF or (i.opcode is not Opcode.MATMUL and any(
                        ap.space is Space.PSUM for ap in i.operands[1:])))  # erf, or a read of an accumulator
    assert order == "eeee" "aaaa" "eeee" "aaaa"  # (was "eee" "aa" "ee" "aa" "ee" "aa" "e" "aa")
