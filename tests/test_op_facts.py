"""The op-facts table is the one source of what each op is: every elementwise op it lists compiles (alone, at
-O0 and -O2) to instructions computing exactly its numpy semantics on the emulated core, a constant folded
with it is what the device computes, and the importer, codegen and the runtime read their tables from it.
A new entry is tested here without a line of its own."""
from __future__ import annotations

import numpy as np
import pytest

from neuronc import ir_text, op_facts
from neuronc.codegen import elementwise
from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend import stablehlo_import
from neuronc.ir import Op, facts
from neuronc.isa import ActFunc, AluOp, DType
from neuronc.passes.canonicalize import canonicalize
from neuronc.passes.context import PassContext
from runtime import run_neff
from runtime import semantics

ELEMENTWISE = [f for f in op_facts.FACTS if f.elementwise]
POSITIVE = {"LOG", "LOG1P", "SQRT", "RSQRT", "POWER"}  # defined (and compared) on positive inputs
INTEGER = {"NOT", "AND", "OR", "XOR", "SHIFT_LEFT", "SHIFT_RIGHT_LOGICAL", "SHIFT_RIGHT_ARITHMETIC"}  # on int32


def operand_dtypes(fact) -> tuple:
    """(operand dtypes, result dtype) an op is checked with."""
    if fact.name in INTEGER:
        return (DType.I32,) * fact.arity, DType.I32
    if fact.name == "SELECT":
        return (DType.BOOL, DType.F32, DType.F32), DType.F32
    if fact.name == "COMPARE":
        return (DType.F32, DType.F32), DType.BOOL
    if fact.name == "CONVERT":
        return (DType.F32,), DType.BF16
    return (DType.F32,) * fact.arity, DType.F32


def operand(dtype: DType, positive: bool, rng) -> np.ndarray:
    if dtype is DType.BOOL:
        return rng.random((16, 24)) < 0.5
    if dtype is DType.I32:
        return rng.integers(-1000, 1000, (16, 24)).astype(np.int32)
    low = 0.1 if positive else -3.0
    return rng.uniform(low, 3.0, (16, 24)).astype(np.float32)


def one_op_graph(fact, dtypes, result) -> str:
    params = "\n".join(f'  %{i} = parameter() : 16x24x{d.name.lower()} {{index = {i}, name = "x{i}", kind = "input"}}'
                       for i, d in enumerate(dtypes))
    attrs = ' {direction = "LT"}' if fact.name == "COMPARE" else ""
    operands = ", ".join(f"%{i}" for i in range(len(dtypes)))
    refs = ", ".join(f"%{i}" for i in range(len(dtypes)))
    return (f"graph @f({refs}) {{\n{params}\n  %{len(dtypes)} = {fact.name.lower()}({operands}) : "
            f"16x24x{result.name.lower()}{attrs}\n  return %{len(dtypes)}\n}}\n")


def semantics_of(fact, values, result) -> np.ndarray:
    """What the table says the op computes: its numpy semantics, on fp32 for floats, rounded to the result."""
    with np.errstate(all="ignore"):
        if fact.name == "COMPARE":
            return fact.numpy(*values, "LT")
        return np.asarray(fact.semantics(*values)).astype(result.numpy)


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("fact", ELEMENTWISE, ids=lambda f: f.name.lower())
def test_every_elementwise_op_computes_its_numpy_semantics_on_the_device(fact, level):
    dtypes, result = operand_dtypes(fact)
    rng = np.random.default_rng(7)
    values = [operand(d, fact.name in POSITIVE, rng) for d in dtypes]
    if fact.name == "CLAMP":
        values = [np.minimum(values[0], values[2]), values[1], np.maximum(values[0], values[2])]
    graph = ir_text.parse(one_op_graph(fact, dtypes, result))
    neff = compile_graph(graph, CompileOptions(opt_level=level)).neff
    got = run_neff(neff, values).outputs[0]
    expected = semantics_of(fact, values, result)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fact", [f for f in ELEMENTWISE if f.activation is not None], ids=lambda f: f.name.lower())
def test_a_folded_constant_is_what_the_device_computes(fact):
    values = operand(DType.F32, fact.name in POSITIVE, np.random.default_rng(3))[:2, :4]
    text = ", ".join(repr(float(v)) for v in values.reshape(-1))
    folded = canonicalize(ir_text.parse(f"""
        graph @f() {{
          %0 = constant() : 2x4xf32 {{value = array<2x4xf32>[{text}]}}
          %1 = {fact.name.lower()}(%0) : 2x4xf32
          return %1
        }}"""), PassContext())
    (constant,) = folded.nodes()
    assert constant.op is Op.CONSTANT
    device = run_neff(compile_graph(ir_text.parse(one_op_graph(fact, (DType.F32,), DType.F32).replace(
        "16x24", "2x4")), CompileOptions(opt_level=0)).neff, [values]).outputs[0]
    np.testing.assert_array_equal(np.broadcast_to(constant.attrs["value"], (2, 4)), device)


def test_shifts_by_the_width_or_more_are_stablehlos_zero_or_sign_fill():
    u = np.array([1, 2 ** 31, 2 ** 32 - 1, 6], np.uint32)
    amounts = np.array([31, 1, 32, 40], np.uint32)
    np.testing.assert_array_equal(op_facts.shift_left(u, amounts), np.array([2 ** 31, 0, 0, 0], np.uint32))
    np.testing.assert_array_equal(op_facts.shift_right_logical(u, amounts), np.array([0, 2 ** 30, 0, 0], np.uint32))
    i = np.array([-8, -8, 8, -1, 5], np.int32)
    by = np.array([1, 40, 32, -1, 1], np.int32)
    np.testing.assert_array_equal(op_facts.shift_right_arithmetic(i, by), np.array([-4, -1, 0, -1, 2], np.int32))
    np.testing.assert_array_equal(op_facts.shift_right_logical(i, by), np.array([2 ** 31 - 4, 0, 0, 0, 2], np.int32))


def test_the_importer_codegen_and_runtime_read_the_table():
    assert stablehlo_import._SIMPLE == {name: Op[f.name] for f in op_facts.FACTS for name in f.stablehlo}
    assert stablehlo_import._SIMPLE["stablehlo.exponential"] is Op.EXP and len(stablehlo_import._SIMPLE) == len(
        {name for f in op_facts.FACTS for name in f.stablehlo})  # no StableHLO name is listed for two ops
    assert elementwise.ACTIVATIONS == {Op[f.name]: f.activation for f in op_facts.FACTS if f.activation}
    assert elementwise.ALU == {Op[f.name]: f.alu for f in op_facts.FACTS if f.alu}
    assert semantics.ACTIVATIONS is op_facts.SCALAR_FUNCTIONS and semantics.ALU is op_facts.ALU_FUNCTIONS
    assert set(op_facts.SCALAR_FUNCTIONS) == set(ActFunc) and set(op_facts.ALU_FUNCTIONS) == set(AluOp)
    assert [op.name for op in Op] == [f.name for f in op_facts.FACTS] and facts(Op.GELU).activation is ActFunc.GELU
