"""Canonicalisation and legalisation, IR text in, IR text out: each named rule on the smallest graph that shows it,
the rules composing to a fixed point in one run, and the rewrite driver refusing rules that never settle."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.ir import Op
from neuronc.isa import ERF_F32_P, ERF_F32_Q
from neuronc.passes.canonicalize import canonicalize, demote_f64
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import legalize
from neuronc.passes.rewrite import rewrite, rule
from tests.conftest import canonical, ir as parse_ir, run_pass

X = 'parameter() : {} {{index = 0, name = "x", kind = "input"}}'
Y = 'parameter() : {} {{index = 1, name = "y", kind = "input"}}'


# canonicalize ----------------------------------------------------------------------------------------------------


def test_identities_vanish_and_the_rest_stays():
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = constant() : 4xf32 {{value = array<f32>[-0.0]}}
          %2 = add(%0, %1) : 4xf32                 // x + (-0)
          %3 = constant() : 4xf32 {{value = array<f32>[1.0]}}
          %4 = multiply(%3, %2) : 4xf32            // 1 * x
          %5 = divide(%4, %3) : 4xf32              // x / 1
          %6 = subtract(%1, %5) : 4xf32            // -0 - x: not x
          %7 = divide(%3, %6) : 4xf32              // 1 / x: not x
          return %7
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = constant() : 4xf32 {{value = array<f32>[1.0]}}
          %2 = constant() : 4xf32 {{value = array<f32>[-0.0]}}
          %3 = subtract(%2, %0) : 4xf32
          %4 = divide(%1, %3) : 4xf32
          return %4
        }}""")


def test_a_float_plus_positive_zero_stays_and_minus_positive_zero_vanishes():
    """(-0.0) + (+0.0) is +0.0: x + 0.0 is not x for floats (eager's sum of one -0.0 is +0.0), x - 0.0 is;
    for integers both are x."""
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = constant() : 4xf32 {{value = array<f32>[0.0]}}
          %2 = subtract(%0, %1) : 4xf32
          %3 = add(%2, %1) : 4xf32
          return %3
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = constant() : 4xf32 {{value = array<f32>[0.0]}}
          %2 = add(%0, %1) : 4xf32
          return %2
        }}""")
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("4xi32")}
          %1 = constant() : 4xi32 {{value = array<i32>[0]}}
          %2 = add(%0, %1) : 4xi32
          return %2
        }}""") == canonical(f"graph @f(%0) {{\n  %0 = {X.format('4xi32')}\n  return %0\n}}")


def test_no_op_converts_transposes_and_reshapes_vanish_and_reshape_chains_merge():
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = convert(%0) : 2x3xf32
          %2 = transpose(%1) : 2x3xf32 {{perm = (0, 1)}}
          %3 = reshape(%2) : 6xf32
          %4 = reshape(%3) : 3x2xf32
          %5 = exp(%4) : 3x2xf32
          %6 = reshape(%4) : 2x3xf32
          %7 = tanh(%6) : 2x3xf32
          return %5, %7
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = reshape(%0) : 3x2xf32
          %2 = exp(%1) : 3x2xf32
          %3 = tanh(%0) : 2x3xf32
          return %2, %3
        }}""")


def test_a_folded_constant_is_what_the_device_computes():
    """exp of a bf16 constant: computed in fp32 and rounded once to bf16, as the Scalar engine does."""
    x = np.array([0.5, 1.0, -2.0, 3.0], ml_dtypes.bfloat16)
    device = np.exp(x.astype(np.float32)).astype(ml_dtypes.bfloat16)
    values = ", ".join(repr(float(v)) for v in x)
    expected = ", ".join(repr(float(v)) for v in device)
    assert run_pass(canonicalize, f"""
        graph @f() {{
          %0 = constant() : 4xbf16 {{value = array<4xbf16>[{values}]}}
          %1 = exp(%0) : 4xbf16
          return %1
        }}""") == canonical(f"""
        graph @f() {{
          %0 = constant() : 4xbf16 {{value = array<4xbf16>[{expected}]}}
          return %0
        }}""")


def test_folding_an_infinite_value_to_an_integer_is_silent_and_converts_as_the_runtime_copies():
    """T5's relative-position buckets convert log(0) = -inf to int: folded without numpy's RuntimeWarning."""
    with np.errstate(all="ignore"):
        device = np.log(np.float32([0.0, 4.0])).astype(np.int32)  # the runtime's TENSOR_COPY: numpy's cast
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folded = run_pass(canonicalize, """
            graph @f() {
              %0 = constant() : 2xf32 {value = array<2xf32>[0.0, 4.0]}
              %1 = log(%0) : 2xf32
              %2 = convert(%1) : 2xi32
              return %2
            }""")
    assert folded == canonical(f"""
        graph @f() {{
          %0 = constant() : 2xi32 {{value = array<2xi32>[{int(device[0])}, {int(device[1])}]}}
          return %0
        }}""")


def test_folding_a_transposed_splat_keeps_it_a_splat_and_a_constant_of_one_value_becomes_a_splat():
    assert run_pass(canonicalize, """
        graph @f() {
          %0 = constant() : 4x1xf32 {value = array<f32>[-1.0]}
          %1 = transpose(%0) : 1x4xf32 {perm = (1, 0)}
          %2 = reshape(%1) : 2x2xf32
          %3 = constant() : 2x2xf32 {value = array<2x2xf32>[3.0, 3.0, 3.0, 3.0]}
          return %2, %3
        }""") == canonical("""
        graph @f() {
          %0 = constant() : 2x2xf32 {value = array<f32>[-1.0]}
          %1 = constant() : 2x2xf32 {value = array<f32>[3.0]}
          return %0, %1
        }""")


def _gather(rows: str) -> str:
    return f"""
        graph @f(%0) {{
          %0 = parameter() : 8x4xf32 {{index = 0, name = "table", kind = "weight"}}
          %1 = constant() : 3xi32 {{value = array<3xi32>[{rows}]}}
          %2 = gather_rows(%0, %1) : 3x4xf32
          return %2
        }}"""


def test_a_gather_of_consecutive_constant_rows_is_a_slice_of_the_table():
    assert run_pass(canonicalize, _gather("2, 3, 4")) == canonical("""
        graph @f(%0) {
          %0 = parameter() : 8x4xf32 {index = 0, name = "table", kind = "weight"}
          %1 = slice(%0) : 3x4xf32 {start = (2, 0), limit = (5, 4), strides = (1, 1)}
          return %1
        }""")
    assert run_pass(canonicalize, _gather("2, 4, 3")) == canonical(_gather("2, 4, 3"))  # not consecutive
    assert run_pass(canonicalize, _gather("6, 7, 8")) == canonical(_gather("6, 7, 8"))  # row 8 is past the table


def test_a_slice_of_a_broadcast_is_the_broadcast_of_a_slice():
    """The large broadcast is never made: only the two values the slice reads are."""
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = broadcast_in_dim(%0) : 1000x4xf32 {{dims = (1,)}}
          %2 = slice(%1) : 2x2xf32 {{start = (10, 1), limit = (12, 3), strides = (1, 1)}}
          return %2
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = slice(%0) : 2xf32 {{start = (1,), limit = (3,), strides = (1,)}}
          %2 = broadcast_in_dim(%1) : 2x2xf32 {{dims = (1,)}}
          return %2
        }}""")


def test_the_erf_form_of_gelu_is_one_gelu():
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = constant() : 4xf32 {{value = array<f32>[0.5]}}
          %2 = multiply(%0, %1) : 4xf32
          %3 = constant() : 4xf32 {{value = array<f32>[0.7071067811865476]}}
          %4 = multiply(%0, %3) : 4xf32
          %5 = erf(%4) : 4xf32
          %6 = constant() : 4xf32 {{value = array<f32>[1.0]}}
          %7 = add(%5, %6) : 4xf32
          %8 = multiply(%2, %7) : 4xf32
          return %8
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = gelu(%0) : 4xf32
          return %1
        }}""")


def _erf_expansion(p=ERF_F32_P, q=ERF_F32_Q) -> str:
    """XLA's f32 expansion of erf as torch-mlir writes it: x clamped to [-4, 4], x * P(x^2) / Q(x^2) by Horner,
    the result clamped to [-1, 1]."""
    lines, count = [X.format("4xf32")], [0]

    def node(text):
        lines.append(text)
        count[0] += 1
        return f"%{len(lines) - 1}"

    def const(value):
        return node(f"constant() : 4xf32 {{value = array<f32>[{float(value)!r}]}}")

    x = node(f"clamp({const(-4.0)}, %0, {const(4.0)}) : 4xf32")
    x2 = node(f"multiply({x}, {x}) : 4xf32")

    def horner(coefficients):
        acc = node(f"multiply({const(coefficients[0])}, {x2}) : 4xf32")
        for k, c in enumerate(coefficients[1:]):
            acc = node(f"add({acc}, {const(c)}) : 4xf32")
            if k < len(coefficients) - 2:
                acc = node(f"multiply({acc}, {x2}) : 4xf32")
        return acc

    numerator = node(f"multiply({x}, {horner(p)}) : 4xf32")
    erf = node(f"divide({numerator}, {horner(q)}) : 4xf32")
    out = node(f"clamp({const(-1.0)}, {erf}, {const(1.0)}) : 4xf32")
    body = "\n".join(f"  %{i} = {line}" for i, line in enumerate(lines))
    return f"graph @f(%0) {{\n{body}\n  return {out}\n}}"


def test_xla_s_expansion_of_erf_and_its_clamps_are_one_erf():
    assert run_pass(canonicalize, _erf_expansion()) == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = erf(%0) : 4xf32
          return %1
        }}""")
    other = _erf_expansion(p=(1.0,) + ERF_F32_P[1:])  # another polynomial is not erf
    assert "erf(" not in run_pass(canonicalize, other)


def test_a_matmul_of_widened_bf16_operands_reads_them_narrow():
    def dot(a: str, b: str) -> str:
        return f"""
        graph @f(%0, %1) {{
          %0 = {X.format(f"2x3x{a}")}
          %1 = {Y.format(f"3x4x{b}")}
          %2 = convert(%0) : 2x3xf32
          %3 = convert(%1) : 3x4xf32
          %4 = dot_general(%2, %3) : 2x4xf32 {{lhs_batch = (), rhs_batch = (), lhs_contract = (1,), rhs_contract = (0,)}}
          return %4
        }}"""

    assert run_pass(canonicalize, dot("bf16", "bf16")) == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("2x3xbf16")}
          %1 = {Y.format("3x4xbf16")}
          %2 = dot_general(%0, %1) : 2x4xf32 {{lhs_batch = (), rhs_batch = (), lhs_contract = (1,), rhs_contract = (0,)}}
          return %2
        }}""")
    assert run_pass(canonicalize, dot("bf16", "f16")) == canonical(dot("bf16", "f16"))  # two types: fp32 it stays


def test_a_product_over_an_empty_contraction_is_a_zero_splat_and_a_matmul_of_k_0_is_refused():
    assert run_pass(canonicalize, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("2x0xf32")}
          %1 = {Y.format("0x4xf32")}
          %2 = dot_general(%0, %1) : 2x4xf32 {{lhs_batch = (), rhs_batch = (), lhs_contract = (1,), rhs_contract = (0,)}}
          return %2
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("2x0xf32")}
          %1 = {Y.format("0x4xf32")}
          %2 = constant() : 2x4xf32 {{value = array<f32>[0.0]}}
          return %2
        }}""")
    with pytest.raises(NeuronCompileError, match="contracts over no elements"):  # its kernel reads PSUM unwritten
        parse_ir(f"""
            graph @f(%0, %1) {{
              %0 = {X.format("1x2x0xf32")}
              %1 = {Y.format("1x0x4xf32")}
              %2 = matmul(%0, %1) : 1x2x4xf32 {{k = 0}}
              return %2
            }}""")


def test_a_bitcast_of_a_constant_folds_to_its_bytes_and_one_of_another_width_is_refused():
    folded = run_pass(canonicalize, """
        graph @f() {
          %0 = constant() : 2xf32 {value = array<2xf32>[-0.0, 1.0]}
          %1 = bitcast(%0) : 2xi32
          return %1
        }""")
    assert folded == canonical("""
        graph @f() {
          %0 = constant() : 2xi32 {value = array<2xi32>[-2147483648, 1065353216]}
          return %0
        }""")
    with pytest.raises(NeuronCompileError, match="of another width"):
        parse_ir(f"""
            graph @f(%0) {{
              %0 = {X.format("2xf32")}
              %1 = bitcast(%0) : 2xi16
              return %1
            }}""")


def test_float64_is_computed_in_float32_and_a_float64_input_is_refused():
    assert run_pass(demote_f64, f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = convert(%0) : 4xf64
          %2 = constant() : 4xf64 {{value = array<f64>[2.5]}}
          %3 = multiply(%1, %2) : 4xf64
          %4 = convert(%3) : 4xf32
          return %4
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("4xf32")}
          %1 = convert(%0) : 4xf32
          %2 = constant() : 4xf32 {{value = array<f32>[2.5]}}
          %3 = multiply(%1, %2) : 4xf32
          %4 = convert(%3) : 4xf32
          return %4
        }}""")
    with pytest.raises(NeuronCompileError, match="no float64"):
        run_pass(demote_f64, f"graph @f(%0) {{\n  %0 = {X.format('4xf64')}\n  return %0\n}}")


def test_with_fp64_to_fp32_a_float64_input_and_output_become_float32_ones():
    from neuronc.passes.auto_cast import AutoCast

    text = f"graph @f(%0) {{\n  %0 = {X.format('4xf64')}\n  %1 = exp(%0) : 4xf64\n  return %1\n}}"
    assert run_pass(demote_f64, text, cast=AutoCast.from_option("fp64-to-fp32")) == canonical(
        f"graph @f(%0) {{\n  %0 = {X.format('4xf32')}\n  %1 = exp(%0) : 4xf32\n  return %1\n}}")
    with pytest.raises(NeuronCompileError, match="--auto-cast fp64-to-fp32"):
        run_pass(demote_f64, text)


def test_the_rules_compose_to_a_fixed_point_in_one_run():
    """A fold exposes an identity, whose removal exposes a reshape chain: one run, each rule named."""
    ctx = PassContext()
    result = canonicalize(parse_ir(f"""
        graph @f(%0) {{
          %0 = {X.format("6xf32")}
          %1 = reshape(%0) : 2x3xf32
          %2 = constant() : 3xf32 {{value = array<f32>[-0.0]}}
          %3 = broadcast_in_dim(%2) : 2x3xf32 {{dims = (1,)}}
          %4 = add(%1, %3) : 2x3xf32
          %5 = reshape(%4) : 6xf32
          return %5
        }}"""), ctx)
    assert [n.op for n in result.nodes()] == [Op.PARAMETER] and result.outputs == result.params
    assert ctx.fired == {"fold_constant": 1, "drop_identity_operand": 1, "merge_reshapes": 1, "drop_noop_reshape": 1}


def test_a_reduction_over_dims_of_size_one_only_is_a_reshape_of_its_operand():
    """sum(0) of a [1, 3, 4] x, amax over a size-1 dim, a bf16 sum (accumulated in fp32, one element: the element),
    and prod: each reads one element per result, so each is x reshaped (a sum's +0.0 initial value still added: it
    turns -0.0 into eager's +0.0); a reduction over a dim of size 3 stays."""
    assert run_pass(canonicalize, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("1x3x4xf32")}
          %1 = {Y.format("3x1xbf16")}
          %2 = constant() : f32 {{value = array<f32>[0.0]}}
          %3 = reduce(%0, %2) : 3x4xf32 {{dims = (0,), kind = "add"}}
          %4 = constant() : f32 {{value = array<f32>[-inf]}}
          %5 = reduce(%0, %4) : 3x4xf32 {{dims = (0,), kind = "max"}}
          %6 = constant() : bf16 {{value = array<bf16>[0.0]}}
          %7 = reduce(%1, %6) : 3xbf16 {{dims = (1,), kind = "add"}}
          %8 = reduce(%1, %6) : 1xbf16 {{dims = (0,), kind = "add"}}
          %9 = constant() : f32 {{value = array<f32>[1.0]}}
          %10 = reduce(%0, %9) : 3x4xf32 {{dims = (0,), kind = "mul"}}
          return %3, %5, %7, %8, %10
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("1x3x4xf32")}
          %1 = {Y.format("3x1xbf16")}
          %2 = reshape(%0) : 3x4xf32
          %3 = constant() : 3x4xf32 {{value = array<f32>[0.0]}}
          %4 = add(%2, %3) : 3x4xf32
          %5 = reshape(%0) : 3x4xf32
          %6 = reshape(%1) : 3xbf16
          %7 = constant() : 3xbf16 {{value = array<bf16>[0.0]}}
          %8 = add(%6, %7) : 3xbf16
          %9 = constant() : bf16 {{value = array<bf16>[0.0]}}
          %10 = reduce(%1, %9) : 1xbf16 {{dims = (0,), kind = "add"}}
          %11 = reshape(%0) : 3x4xf32
          return %4, %5, %8, %10, %11
        }}""")


def test_a_unit_reduction_with_an_initial_value_not_its_identity_combines_it_with_each_element():
    """sum with init 2 of one element is 2 + x: an elementwise add, not a reduction."""
    assert run_pass(canonicalize, f"""
        graph @f(%0) {{
          %0 = {X.format("1x3xf32")}
          %1 = constant() : f32 {{value = array<f32>[2.0]}}
          %2 = reduce(%0, %1) : 3xf32 {{dims = (0,), kind = "add"}}
          return %2
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("1x3xf32")}
          %1 = reshape(%0) : 3xf32
          %2 = constant() : 3xf32 {{value = array<f32>[2.0]}}
          %3 = add(%1, %2) : 3xf32
          return %3
        }}""")


def test_a_reduction_over_size_one_and_other_dims_drops_the_size_one_dims():
    """sum over (0, 2) of a [1, 3, 4] x is the sum over dim 1 of x as [3, 4]; legalize then reduces its rows in
    place, with no transpose moving the size-1 dim."""
    source = f"""
        graph @f(%0) {{
          %0 = {X.format("1x3x4xf32")}
          %1 = constant() : f32 {{value = array<f32>[0.0]}}
          %2 = reduce(%0, %1) : 3xf32 {{dims = (0, 2), kind = "add"}}
          return %2
        }}"""
    assert run_pass(canonicalize, source) == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("1x3x4xf32")}
          %1 = reshape(%0) : 3x4xf32
          %2 = constant() : f32 {{value = array<f32>[0.0]}}
          %3 = reduce(%1, %2) : 3xf32 {{dims = (1,), kind = "add"}}
          return %3
        }}""")
    assert run_pass(lambda g, ctx: legalize(canonicalize(g, ctx), ctx), source) == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("1x3x4xf32")}
          %1 = reshape(%0) : 3x4xf32
          %2 = reduce_last(%1) : 3xf32 {{kind = "add"}}
          return %2
        }}""")


def test_rules_that_never_settle_are_refused():
    @rule(Op.NEGATE)
    def negate_again(node, inputs):  # a new, equal node every time
        return ir.node(Op.NEGATE, inputs, node.shape, node.dtype, node.loc)

    graph = parse_ir(f"graph @f(%0) {{\n  %0 = {X.format('4xf32')}\n  %1 = negate(%0) : 4xf32\n  return %1\n}}")
    with pytest.raises(NeuronCompileError, match="negate_again still change the graph"):
        rewrite(graph, [negate_again])


# legalize --------------------------------------------------------------------------------------------------------


def test_transposes_slices_and_broadcasts_are_strided_views():
    assert run_pass(legalize, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("4x6xf32")}
          %1 = {Y.format("6xf32")}
          %2 = transpose(%0) : 6x4xf32 {{perm = (1, 0)}}
          %3 = slice(%0) : 2x2xf32 {{start = (1, 2), limit = (3, 6), strides = (1, 2)}}
          %4 = broadcast_in_dim(%1) : 4x6xf32 {{dims = (1,)}}
          return %2, %3, %4
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("4x6xf32")}
          %1 = {Y.format("6xf32")}
          %2 = view(%0) : 6x4xf32 {{offset = 0, strides = (1, 6)}}
          %3 = view(%0) : 2x2xf32 {{offset = 8, strides = (6, 2)}}
          %4 = view(%1) : 4x6xf32 {{offset = 0, strides = (0, 1)}}
          return %2, %3, %4
        }}""")


def test_a_reduction_over_a_leading_dim_reduces_rows_of_the_transpose():
    assert run_pass(legalize, f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = constant() : f32 {{value = array<f32>[0.0]}}
          %2 = reduce(%0, %1) : 3xf32 {{dims = (0,), kind = "add"}}
          return %2
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = view(%0) : 3x2xf32 {{offset = 0, strides = (1, 3)}}
          %2 = reduce_last(%1) : 3xf32 {{kind = "add"}}
          return %2
        }}""")


def test_a_dot_general_is_a_batched_matmul():
    assert run_pass(legalize, f"""
        graph @f(%0, %1) {{
          %0 = {X.format("2x3xf32")}
          %1 = {Y.format("3x4xf32")}
          %2 = dot_general(%0, %1) : 2x4xf32 {{lhs_batch = (), rhs_batch = (), lhs_contract = (1,), rhs_contract = (0,)}}
          return %2
        }}""") == canonical(f"""
        graph @f(%0, %1) {{
          %0 = {X.format("2x3xf32")}
          %1 = {Y.format("3x4xf32")}
          %2 = reshape(%0) : 1x2x3xf32
          %3 = reshape(%1) : 1x3x4xf32
          %4 = matmul(%2, %3) : 1x2x4xf32 {{k = 3}}
          %5 = reshape(%4) : 2x4xf32
          return %5
        }}""")


def test_a_reshape_back_to_its_shape_vanishes_and_an_output_aliasing_an_input_is_copied():
    assert run_pass(legalize, f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = reshape(%0) : 6xf32
          %2 = reshape(%1) : 2x3xf32
          return %2
        }}""") == canonical(f"""
        graph @f(%0) {{
          %0 = {X.format("2x3xf32")}
          %1 = view(%0) : 2x3xf32 {{offset = 0, strides = (3, 1)}}
          return %1
        }}""")


def test_a_select_reads_a_scalar_predicate_broadcast():
    assert run_pass(legalize, """
        graph @f(%0, %1, %2) {
          %0 = parameter() : bool {index = 0, name = "p", kind = "input"}
          %1 = parameter() : 4xf32 {index = 1, name = "a", kind = "input"}
          %2 = parameter() : 4xf32 {index = 2, name = "b", kind = "input"}
          %3 = select(%0, %1, %2) : 4xf32
          return %3
        }""") == canonical("""
        graph @f(%0, %1, %2) {
          %0 = parameter() : bool {index = 0, name = "p", kind = "input"}
          %1 = parameter() : 4xf32 {index = 1, name = "a", kind = "input"}
          %2 = parameter() : 4xf32 {index = 2, name = "b", kind = "input"}
          %3 = view(%0) : 4xbool {offset = 0, strides = (0,)}
          %4 = select(%3, %1, %2) : 4xf32
          return %4
        }""")


def test_legal_ops_are_left_as_they_are():
    legal = """
        graph @f(%0) {
          %0 = parameter() : 3x8xf32 {index = 0, name = "x", kind = "input"}
          %1 = topk(%0) : 3x2xi32 {dimension = 1, k = 2, descending = true}
          %2 = pad(%0) : 3x10xf32 {value = 0.0, low = (0, 1), high = (0, 1), interior = (0, 0)}
          return %1, %2
        }"""
    assert run_pass(legalize, legal) == canonical(legal)


# the driver's sweeps after the first ------------------------------------------------------------------------------


def _rewrite_by_full_sweeps(graph, rules, ctx):
    """The specification of `rewrite`: every sweep offers every node to its op's rules, until a sweep fires none."""
    by_op = {op: [r for r in rules if not r.ops or op in r.ops] for op in Op}
    fired: list = []

    def apply(node, inputs):
        replacement = None
        for _ in range(16):
            for r in by_op[node.op]:
                result = r.fn(node, inputs)
                if result is not None and result is not node:
                    fired.append(r.name)
                    replacement = node = result
                    inputs = result.inputs
                    break
            else:
                return replacement
        return replacement

    while True:
        fired.clear()
        graph = graph.rewrite(apply)
        ctx.fired.update(fired)
        if not fired:
            return graph


def _facts(graph) -> list:
    return [(n.id, n.op, tuple(i.id for i in n.inputs), n.shape, n.dtype) for n in graph.nodes()]


@pytest.mark.parametrize("model", ["gpt2", "cnn", "transformer_block"])
def test_the_driver_makes_the_nodes_ids_and_firings_that_full_sweeps_make(model, monkeypatch):
    import itertools

    from neuronc.passes import canonicalize as canonicalize_module
    from neuronc.passes import legalize as legalize_module

    from tests.conftest import zoo_graph

    results = []
    for driver in (rewrite, _rewrite_by_full_sweeps):
        monkeypatch.setattr(canonicalize_module, "rewrite", driver)
        monkeypatch.setattr(legalize_module, "rewrite", driver)
        graph, ctx = zoo_graph(model), PassContext()  # (imported once per process: then a copy, which takes no id)
        monkeypatch.setattr(ir, "_ids", itertools.count(10**6))  # the ids name kernels and buffers in the NEFF
        for step in (demote_f64, canonicalize, legalize):
            graph = step(graph, ctx)
        results.append((_facts(graph), dict(ctx.fired), ir.next_id()))
    assert results[0] == results[1]
    assert sum(results[0][1].values()) > 0


def test_a_sweep_after_the_first_offers_settled_nodes_to_no_rule():
    """The sweep that proves the fixed point offers its rules only the nodes the sweep before it made."""
    offered = []

    @rule(Op.NEGATE)
    def never(node, inputs):
        offered.append(node)
        return None

    @rule(Op.ADD)
    def add_of_zero_splats(node, inputs):
        if all(i.scalar == 0.0 for i in inputs):
            return ir.splat(0.0, node.shape, node.dtype)
        return None

    from neuronc.isa import DType

    x = ir.node(Op.PARAMETER, [], (4,), DType.F32, index=0)
    chain = [x]
    for _ in range(10):
        chain.append(ir.node(Op.NEGATE, [chain[-1]], (4,), DType.F32))
    zero = ir.node(Op.ADD, [ir.splat(0.0, (4,), DType.F32), ir.splat(0.0, (4,), DType.F32)], (4,), DType.F32)
    total = ir.node(Op.NEGATE, [ir.node(Op.MULTIPLY, [chain[-1], zero], (4,), DType.F32)], (4,), DType.F32)
    ctx = PassContext()
    result = rewrite(ir.Graph([x], [total]), [never, add_of_zero_splats], ctx)
    assert ctx.fired == {"add_of_zero_splats": 1}
    # the first sweep's eleven negations, then only the outer one, which the first sweep copied (its operand changed);
    # offering every node at every sweep offers 22
    assert len(offered) == 12
    assert result.outputs[0].inputs[0].inputs[1].scalar == 0.0
