"""The IR as text: every graph prints with all its attributes, plans, types and locations and parses back to the
same graph (generated graphs, every attribute value a pass may attach, every zoo graph after every pass); a
compilation interrupted by a print and a parse after every pass makes the same program; bad text is refused
with its line and column, and parsing never runs code."""
from __future__ import annotations

import copy
import inspect
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from neuronc import ir, ir_text, ir_verifier, plans
from neuronc.codegen import generate
from neuronc.ir import Op, Step
from neuronc.isa import DType, Engine
from neuronc.neff.program import DebugLoc
from neuronc.passes.context import PassContext
from neuronc.passes.memory_plan import plan_memory
from neuronc.passes.pipeline import passes_for
from neuronc.targets import get_target
from tests import zoo
from tests.conftest import canonical, imported_zoo


def same(a, b, number_a=None, number_b=None) -> bool:
    """Deep equality of attribute values: same types, arrays bit for bit, floats equal (NaN to NaN, -0.0 apart
    from 0.0), nodes at the same positions of their graphs."""
    if isinstance(a, ir.Node) or isinstance(b, ir.Node):
        return isinstance(a, ir.Node) and isinstance(b, ir.Node) and number_a[a] == number_b[b]
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) or (isinstance(a, np.generic) and DType.from_numpy(a.dtype).is_float):
        a, b = float(a), float(b)  # (bf16 and fp8 scalars are numpy scalars but not np.floating)
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y, number_a, number_b) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k], number_a, number_b) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f), number_a, number_b) for f in a.__dataclass_fields__)
    return a == b


def assert_round_trips(graph: ir.Graph) -> None:
    text = ir_text.to_text(graph)
    back = ir_text.parse(text)
    assert ir_text.to_text(back) == text
    old, new = graph.nodes(), back.nodes()
    assert len(old) == len(new) and back.name == graph.name
    number_a, number_b = {n: i for i, n in enumerate(old)}, {n: i for i, n in enumerate(new)}
    assert [number_b[p] for p in back.params] == [number_a[p] for p in graph.params]
    assert [number_b[o] for o in back.outputs] == [number_a[o] for o in graph.outputs]
    for a, b in zip(old, new):
        assert (a.op, a.shape, a.dtype, a.loc) == (b.op, b.shape, b.dtype, b.loc)
        assert [number_a[x] for x in a.inputs] == [number_b[x] for x in b.inputs]
        assert same(a.attrs, b.attrs, number_a, number_b), (a.attrs, b.attrs)


# generated graphs ----------------------------------------------------------------------------------------------

SHAPES = [(), (1,), (4,), (2, 3), (3, 2), (2, 1, 3)]
FLOATS = [DType.F32, DType.BF16, DType.F16]
UNARY_FLOAT = sorted((op for op in ir.UNARY if op not in (Op.NOT, Op.CONVERT)), key=lambda op: op.name)
ARITHMETIC = [Op.ADD, Op.SUBTRACT, Op.MULTIPLY, Op.DIVIDE, Op.MAXIMUM, Op.MINIMUM, Op.POWER]


def arrays(dtype: DType, shape: tuple):
    """Arrays of `dtype` with any bits (NaNs, infinities, subnormals for floats)."""
    count = int(np.prod(shape, dtype=np.int64))
    return st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize).map(
        lambda raw: np.frombuffer(raw, dtype.numpy).copy().reshape(shape) if dtype != DType.BOOL
        else (np.frombuffer(raw, np.uint8) % 2).astype(np.bool_).reshape(shape))


locs = st.one_of(st.just(DebugLoc()), st.builds(DebugLoc, st.text(max_size=12), st.integers(0, 10_000),
                                                st.text(max_size=8), st.text(max_size=8)))


@st.composite
def graphs(draw):
    """A well-formed graph of parameters, constants, elementwise ops (alone and fused), comparisons, selects,
    converts, reshapes, transposes and broadcasts, with source locations."""
    nodes, params = [], []
    for index in range(draw(st.integers(1, 3))):
        shape, dtype = draw(st.sampled_from(SHAPES)), draw(st.sampled_from(FLOATS + [DType.I32]))
        params.append(ir.node(Op.PARAMETER, [], shape, dtype, draw(locs), index=index, name=f"p{index}",
                              kind=draw(st.sampled_from(["input", "weight"]))))
    nodes += params
    for _ in range(draw(st.integers(1, 12))):
        x = draw(st.sampled_from(nodes))
        loc = draw(locs)
        kind = draw(st.sampled_from(["unary", "binary", "compare", "select", "convert", "reshape", "transpose",
                                     "broadcast", "constant", "fused"]))
        if kind == "constant":
            dtype = draw(st.sampled_from(list(DType)))
            value = draw(arrays(dtype, () if draw(st.booleans()) else x.shape))
            nodes.append(ir.node(Op.CONSTANT, [], x.shape, dtype, loc, value=value))
        elif kind == "unary" and x.dtype.is_float:
            nodes.append(ir.node(draw(st.sampled_from(UNARY_FLOAT)), [x], x.shape, x.dtype, loc))
        elif kind in ("binary", "compare", "select"):
            y = draw(st.sampled_from([n for n in nodes if (n.shape, n.dtype) == (x.shape, x.dtype)]))
            if kind == "binary":
                nodes.append(ir.node(draw(st.sampled_from(ARITHMETIC)), [x, y], x.shape, x.dtype, loc))
            else:
                direction = draw(st.sampled_from(["EQ", "NE", "LT", "LE", "GT", "GE"]))
                predicate = ir.node(Op.COMPARE, [x, y], x.shape, DType.BOOL, loc, direction=direction)
                nodes.append(predicate if kind == "compare" else ir.node(Op.SELECT, [predicate, x, y], x.shape,
                                                                         x.dtype, loc))
        elif kind == "convert":
            nodes.append(ir.node(Op.CONVERT, [x], x.shape, draw(st.sampled_from(list(DType))), loc))
        elif kind == "reshape":
            nodes.append(ir.node(Op.RESHAPE, [x], (x.size,), x.dtype, loc))
        elif kind == "transpose" and len(x.shape) > 1:
            perm = tuple(draw(st.permutations(range(len(x.shape)))))
            nodes.append(ir.node(Op.TRANSPOSE, [x], [x.shape[p] for p in perm], x.dtype, loc, perm=perm))
        elif kind == "broadcast":
            nodes.append(ir.node(Op.BROADCAST_IN_DIM, [x], (2, *x.shape), x.dtype, loc,
                                 dims=tuple(range(1, len(x.shape) + 1))))
        elif kind == "fused" and x.dtype.is_float:
            ins = [x] + draw(st.lists(st.sampled_from([n for n in nodes if (n.shape, n.dtype) == (x.shape, x.dtype)]),
                                      max_size=2))
            steps = []
            for j in range(draw(st.integers(1, 5))):
                refs = [("input", i) for i in range(len(ins))] + [("step", k) for k in range(j)]
                a = draw(st.sampled_from(refs))
                b = draw(st.one_of(st.sampled_from(refs), st.floats(-1e3, 1e3).map(lambda v: ("imm", v))))
                op = draw(st.sampled_from(ARITHMETIC))
                steps.append(Step(op, (a, b), x.dtype, {}))
            nodes.append(ir.node(Op.FUSED, ins, x.shape, x.dtype, loc, body=tuple(steps),
                                 views=(None,) * len(ins)))
    outputs = draw(st.lists(st.sampled_from(nodes[len(params):] or params), min_size=1, max_size=3))
    return ir.Graph(params, outputs, draw(st.sampled_from(["main", "f", "block.0", "a b"])))


@settings(max_examples=100, deadline=None)
@given(graphs())
def test_a_generated_graph_parses_back_from_its_text(graph):
    assert ir_verifier.problems(graph) == []
    assert_round_trips(graph)
    assert ir_verifier.problems(ir_text.parse(ir_text.to_text(graph))) == []


# every attribute value a pass may attach -----------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10), st.sampled_from(list(DType) + list(Op) + list(Engine)),
    st.sampled_from(FLOATS + [DType.I32, DType.I64, DType.U8, DType.BOOL, DType.F8E4M3]).flatmap(
        lambda d: st.sampled_from(SHAPES + [(5, 7)]).flatmap(lambda s: arrays(d, s))),
    st.sampled_from([DType.F32, DType.BF16, DType.I64, DType.BOOL]).flatmap(
        lambda d: arrays(d, ()).map(lambda a: a[()])),  # numpy scalars
    st.builds(plans.View, st.integers(0, 100), st.tuples(st.integers(-9, 9), st.integers(0, 9))),
    st.builds(plans.PoolSpec, st.text(max_size=5), st.sampled_from(FLOATS), st.integers(1, 512), st.integers(1, 4)),
    st.builds(plans.MatmulTiling, st.sampled_from(["a", "b", "none"]), st.integers(1, 4), st.just(128),
              st.just(512), st.just(128), st.integers(2, 4), st.booleans()),
    st.builds(Step, st.sampled_from(ARITHMETIC), st.tuples(st.just(("input", 0)), st.tuples(
        st.just("imm"), st.floats(allow_nan=False))), st.sampled_from(FLOATS), st.just({})),
)
attribute_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5)), inner, max_size=3)), max_leaves=12)


def test_a_wide_unsigned_constant_parses_back_exactly():
    """Integers past int64's range read back as themselves, not through float64 (hypothesis found 2^63 + 256)."""
    p = ir.node(Op.PARAMETER, [], (2,), DType.U64, None, index=0, name="p0", kind="input")
    value = np.array([0, 2 ** 63 + 256], dtype=np.uint64)
    assert_round_trips(ir.Graph([p], [ir.node(Op.CONSTANT, [], (2,), DType.U64, None, value=value)], "main"))


def test_an_attribute_key_spelled_like_a_number_parses_back():
    """`inf` and `nan` are numbers to the parser, so as keys they are quoted (hypothesis found {'inf': None})."""
    p = ir.node(Op.PARAMETER, [], (2,), DType.F32, None, index=0, name="p0", kind="input")
    assert_round_trips(ir.Graph([p], [ir.node(Op.NEGATE, [p], (2,), DType.F32, None, inf=None, nan=1)], "main"))


NODE_PARAMETERS = set(inspect.signature(ir.node).parameters) - {"attrs"}  # ir.node's own keywords, not attributes


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z_]\w{0,8}", fullmatch=True).filter(lambda k: k not in NODE_PARAMETERS),
                       attribute_values, max_size=4))
def test_every_kind_of_attribute_value_parses_back_to_an_equal_value(attrs):
    x = ir.node(Op.PARAMETER, [], (4,), DType.F32, index=0, name="x", kind="input")
    kernel = ir.node(Op.ATTENTION, [x, x], (4,), DType.F32, **attrs)  # an op that takes any attributes
    assert_round_trips(ir.Graph([x], [kernel]))


def test_a_node_in_an_attribute_is_printed_as_its_reference():
    x = ir.node(Op.PARAMETER, [], (4,), DType.F32, index=0, name="x", kind="input")
    kernel = ir.node(Op.ATTENTION, [x], (4,), DType.F32, mask_node=x, scale=np.float32(0.125))
    text = ir_text.to_text(ir.Graph([x], [kernel]))
    assert "mask_node = %0" in text and "scale = scalar<f32>(0.125)" in text
    assert_round_trips(ir.Graph([x], [kernel]))


# the zoo, after every pass ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_zoo_graph_parses_back_after_every_pass(name, level):
    graph, ctx = copy.deepcopy(imported_zoo(name)[0]), PassContext(opt_level=level)
    assert_round_trips(graph)
    for step in passes_for(level):
        graph = step(graph, ctx)
        assert_round_trips(graph)


def _program(graph: ir.Graph, level: int):
    """The NEFF codegen makes of an optimised graph (as compile_graph does after the passes)."""
    return generate(graph, plan_memory(graph), get_target(), "main", {}, prefetch=level >= 2)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "moe"])
def test_a_compilation_printed_and_parsed_after_every_pass_makes_the_same_program(name):
    """Nothing a later pass or codegen reads is lost in the text: every attribute and plan is in it."""
    graph, weights = imported_zoo(name)
    graph = copy.deepcopy(graph)
    for p in graph.params:
        if p.attrs["kind"] == "weight":
            p.attrs["data"] = weights[p.attrs["name"]]
    for level in (0, 2):
        direct, through_text = copy.deepcopy(graph), ir_text.parse(ir_text.to_text(graph))
        ctx = PassContext(opt_level=level)
        for step in passes_for(level):
            direct = step(direct, ctx)
            through_text = ir_text.parse(ir_text.to_text(step(through_text, ctx)))
        expected, got = _program(direct, level), _program(through_text, level)
        assert got.streams == expected.streams
        assert [(t.kind, t.shape, t.offset, None if t.data is None else t.data.tobytes()) for t in got.tensors] == \
            [(t.kind, t.shape, t.offset, None if t.data is None else t.data.tobytes()) for t in expected.tensors]


# what the text says and refuses ---------------------------------------------------------------------------------

LAYER = """
graph @layer(%0, %1) {
  %0 = parameter() : 8x32xbf16 {index = 0, name = "x", kind = "input"}    // a comment
  %1 = parameter() : 32xbf16 {index = 1, name = "bias", kind = "weight"}
  %2 = broadcast_in_dim(%1) : 8x32xbf16 {dims = (1,)}  loc("model.py", 12, "fc1", "aten.add.Tensor")
  %3 = add(%0, %2) : 8x32xbf16
  %4 = constant() : 8x32xbf16 {value = array<bf16>[0.5]}
  %5 = multiply(%3, %4) : 8x32xbf16
  return %5
}
"""


def test_the_text_shows_types_attributes_and_locations():
    graph = ir_text.parse(LAYER)
    broadcast = graph.nodes()[2]
    assert broadcast.op is Op.BROADCAST_IN_DIM and broadcast.attrs == {"dims": (1,)}
    assert broadcast.loc == DebugLoc("model.py", 12, "fc1", "aten.add.Tensor")
    assert graph.outputs[0].inputs[1].scalar == 0.5 and graph.outputs[0].inputs[1].attrs["value"].dtype == \
        ml_dtypes.bfloat16
    assert canonical(LAYER) == ir_text.to_text(graph)
    assert 'loc("model.py", 12, "fc1", "aten.add.Tensor")' in canonical(LAYER)


def test_a_plan_prints_field_by_field():
    tiling = plans.MatmulTiling("a", 2, 128, 512, 128, 3, True)
    x = ir.node(Op.PARAMETER, [], (1, 4, 4), DType.F32, index=0, name="x", kind="input")
    matmul = ir.node(Op.MATMUL, [x, x], (1, 4, 4), DType.F32, k=4, tiling=tiling)
    text = ir_text.to_text(ir.Graph([x], [matmul]))  # a long attribute wraps after its opening parenthesis
    assert "tiling = MatmulTiling(" in text
    assert ('resident="a", block=2, tile_m=128, tile_n=512, tile_k=128, stream_bufs=3, streamed_first=true, '
            'transposes="")') in text
    assert repr(matmul).startswith(f"%{matmul.id} = matmul(%{x.id}, %{x.id}) : 1x4x4xf32 {{k = 4, tiling = ")


@pytest.mark.parametrize("text,says", [
    ("graph @f() {\n  %1 = exp(%0) : 4xf32\n  return %1\n}", "line 2, column 14: %0 is used before it is defined"),
    ("graph @f() {\n  %0 = frobnicate() : f32\n  return %0\n}", "no op 'frobnicate'"),
    ("graph @f() {\n  %0 = constant() : 2xf32 {value = array<2xf32>[1.0]}\n  return %0\n}",
     "1 values do not make a 2xf32 array"),
    ("graph @f() {\n  %0 = constant() : 2xf32 {value = array<2xf32>...}\n  return %0\n}", "elided"),
    ("graph @f() {\n  %0 = constant() : 2xq7 {}\n  return %0\n}", "expected a type"),
    ('graph @f() {\n  %0 = constant() : f32 {value = __import__("os").system("true")}\n  return %0\n}',
     "unknown name '__import__'"),
    ("graph @f() {\n  %0 = constant() : f32 {value = MemoryPlan(tensors=[], placement={}, hbm_size=0)}\n"
     "  return %0\n}", "unknown name 'MemoryPlan'"),
    ("graph @f() {\n  %0 = constant() : f32 {value = View(offset=0)}\n  return %0\n}", "cannot make a View"),
])
def test_bad_text_is_refused_with_where_and_why(text, says):
    with pytest.raises(ir_text.IRParseError, match=None) as refused:
        ir_text.parse(text)
    assert says in str(refused.value)


def test_a_weight_too_long_to_read_is_elided_only_when_asked():
    x = ir.node(Op.PARAMETER, [], (64, 64), DType.F32, index=0, name="w", kind="weight",
                data=np.ones((64, 64), np.float32))
    graph = ir.Graph([x], [ir.node(Op.EXP, [x], x.shape, x.dtype)])
    assert "data = array<64x64xf32>..." in ir_text.to_text(graph, elide_arrays_over=64)
    assert "data = array<64x64xf32>0x0000803f" in ir_text.to_text(graph)
