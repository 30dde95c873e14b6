"""Repeated layers imported once (frontend/repeated_layers.py): the same IR and NEFF as the whole graph's import,
each layer located at its own source, and the whole import for anything that is not a clean stack of copies."""
from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuronc import ir, ir_text
from neuronc.compiler import CompileOptions, compile_fx
from neuronc.frontend import repeated_layers
from neuronc.frontend.torch_import import decomposition_table, import_fx
from neuronc.neff import encode
from tests import zoo


def traced(model, *inputs):
    """(FX graph with the weights as inputs, its params list), as AOTAutograd hands the import a forward graph."""
    names, weights = zip(*model.named_parameters())

    def forward(*args):
        state = dict(zip(names, args[:len(weights)]))
        return (torch.func.functional_call(model, state, args[len(weights):]),)

    with torch.no_grad():
        gm = make_fx(forward, decomposition_table=decomposition_table())(*weights, *inputs)
    return gm


def gpt2(dtype):
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=32, layers=3, heads=2, context=16).eval().to(dtype)
    return traced(model, torch.randint(0, 64, (1, 16)))


def gpt2_neff(monkeypatch, dtype) -> bytes:
    """gpt2(dtype) compiled at -O2 to NEFF bytes, node ids counted from 0 (they name the NEFF's tensors): two
    compiles of it in one test give the same bytes unless what they compile differs."""
    monkeypatch.setattr(ir, "_ids", itertools.count())
    return encode(compile_fx(gpt2(dtype), CompileOptions(opt_level=2, name="gpt2_3_layers")).neff)


def mlp_stack(dtype, blocks=12, width=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(blocks) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    return traced(model.to(dtype), torch.randn(4, width, dtype=dtype))


def imported_text(gm, monkeypatch, whole: bool) -> str:
    monkeypatch.setattr(ir, "_ids", itertools.count())
    monkeypatch.setenv("NEURONC_WHOLE_IMPORT", "1" if whole else "0")
    params = [(n.name, "input") for n in gm.graph.nodes if n.op == "placeholder"]
    imported = import_fx(gm, params)
    assert imported.stablehlo.count("func.func @main") == (1 if whole else 2)  # the skeleton's and the layer's
    return ir_text.to_text(imported.graph)


def without_constant_locations(text: str) -> str:
    """The IR text with the source location of each constant dropped (the one documented difference)."""
    text = re.sub(r"\{\n\s+value", "{value", text)
    return re.sub(r"(= constant\(\)[^\n]*?\})  loc\([^\n]*\)", r"\1", text)


def compiled_neff(gm, monkeypatch, whole: bool) -> bytes:
    from neuronc.passes import rowwise_schedule

    monkeypatch.setattr(rowwise_schedule, "_CHOSEN", {})  # no schedule remembered from the other compile
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors
    monkeypatch.setenv("NEURONC_WHOLE_IMPORT", "1" if whole else "0")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")  # the two imports' fingerprints differ: both compiled
    compiled = compile_fx(copy.deepcopy(gm))
    assert compiled.stablehlo.count("func.func @main") == (1 if whole else 2)  # which import it was
    return encode(compiled.neff)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [gpt2, mlp_stack], ids=["gpt2", "mlp"])
def test_the_layers_imported_once_give_the_whole_imports_ir(model, dtype, monkeypatch):
    gm = model(dtype)
    assert repeated_layers.find_layers(gm) is not None
    whole = imported_text(gm, monkeypatch, whole=True)
    once = imported_text(gm, monkeypatch, whole=False)
    assert without_constant_locations(once) == without_constant_locations(whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [gpt2, mlp_stack], ids=["gpt2", "mlp"])
def test_the_layers_imported_once_make_the_same_neff(model, dtype, monkeypatch):
    gm = model(dtype)
    assert compiled_neff(gm, monkeypatch, whole=False) == compiled_neff(gm, monkeypatch, whole=True)


def test_each_layer_is_located_at_its_own_module():
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=32, layers=3, heads=2, context=16).eval()
    exported = torch.export.export(model, (torch.randint(0, 64, (1, 16)),)).run_decompositions(decomposition_table())
    graph_module = exported.graph_module
    layers = repeated_layers.find_layers(graph_module)
    assert layers is not None and len(layers.copies) == 3
    params = [(n.name, "input") for n in graph_module.graph.nodes if n.op == "placeholder"]
    paths = {n.loc.module_path for n in import_fx(graph_module, params).graph.nodes()}
    for k in range(3):
        assert any(p.startswith(f"blocks.{k}.") for p in paths), k


def test_a_graph_without_repetition_is_imported_whole():
    torch.manual_seed(0)
    assert repeated_layers.find_layers(traced(zoo.MLP().eval(), torch.randn(2, 32))) is None


BLOCKS = 40  # x (matmul, tanh, mul): well above the smallest stack worth lowering apart


def tanh_stack(scale=lambda k: 2.0, after=lambda x, values: x, mutate=False):
    """make_fx's graph of BLOCKS blocks x = tanh(x @ w_k) * scale(k) (in place if `mutate`), then after(x, values)."""
    def forward(x, *weights):
        values = []
        for k, w in enumerate(weights):
            x = torch.tanh(x @ w)
            x = x.mul_(scale(k)) if mutate else x * scale(k)
            values.append(x)
        return (after(x, values),)

    return make_fx(forward, pre_dispatch=mutate)(*(torch.randn(8, 8) for _ in range(BLOCKS + 1)))


def test_a_stack_followed_by_an_op_cut_out_for_torch_mlir_imports_as_the_whole_graph(monkeypatch):
    """An op cut out of the graph before torch-mlir (a float fmod: frontend/exact_fmod.py) adds outputs to the graph
    the stack is found in (the cut op's operands), which the assembled graph keeps for the op to be stitched back."""
    gm = tanh_stack(after=lambda x, values: torch.fmod(x, x.detach() * 0.0 + 0.7))
    assert any(n.target is torch.ops.aten.fmod.Tensor for n in gm.graph.nodes)
    assert repeated_layers.find_layers(gm) is not None
    whole = imported_text(copy.deepcopy(gm), monkeypatch, whole=True)
    once = imported_text(copy.deepcopy(gm), monkeypatch, whole=False)
    assert "fmod" in whole and without_constant_locations(once) == without_constant_locations(whole)


def test_blocks_that_repeat_are_found_with_their_weights_wired_per_copy():
    gm = tanh_stack()
    layers = repeated_layers.find_layers(gm)
    assert layers is not None and len(layers.copies) == BLOCKS
    weights = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
    assert [[a for a in sources if a in weights] for sources in layers.sources] == [[w] for w in weights]


def test_a_stack_too_short_to_pay_for_a_second_lowering_is_imported_whole():
    def forward(x, *weights):
        for w in weights:
            x = torch.tanh(x @ w) * 2.0
        return (x,)

    assert repeated_layers.find_layers(make_fx(forward)(*(torch.randn(8, 8) for _ in range(4)))) is None


def test_a_layer_that_differs_in_an_attribute_is_not_a_copy():
    assert repeated_layers.find_layers(tanh_stack(scale=lambda k: 1.0 + k)) is None  # every block's constant differs
    gm = tanh_stack(scale=lambda k: 3.0 if k == BLOCKS - 1 else 2.0)  # the last block's differs
    layers = repeated_layers.find_layers(gm)
    last_scale = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert last_scale.args[1] == 3.0
    assert layers is not None and all(last_scale not in nodes for nodes in layers.copies)


def test_a_side_output_read_later_falls_back_to_the_whole_import():
    gm = tanh_stack(after=lambda x, values: x + values[0])  # the first block's value read after the last
    assert repeated_layers.find_layers(gm) is None


def test_a_block_that_mutates_is_imported_whole():
    gm = tanh_stack(mutate=True)
    assert any(getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable for n in gm.graph.nodes)
    assert repeated_layers.find_layers(gm) is None


def test_the_split_parts_generate_no_python_code_until_it_is_read(monkeypatch):
    """torch-mlir lowers a module's graph: the skeleton and the layer of the split are lowered only, so they generate
    no Python code (the code of both was 29 ms at HF GPT-2's 12 layers, issue 24), and give it when it is read."""
    gm = gpt2(torch.float32)
    layers = repeated_layers.find_layers(gm)
    made = []
    python_code = torch.fx.Graph.python_code
    monkeypatch.setattr(torch.fx.Graph, "python_code", lambda self, *a, **k: made.append(self) or python_code(self, *a, **k))
    parts = repeated_layers.split(gm, layers)
    assert made == []
    for part in (parts.skeleton, parts.layer):
        assert part.code == torch.fx.GraphModule(gm, part.graph).code and part.graph in made


def test_the_node_signatures_are_made_with_each_targets_text_taken_once():
    """find_layers' signatures (_Signatures) are _signature's tuples, each target's text taken once per graph."""
    for gm in (gpt2(torch.float32), gpt2(torch.bfloat16), mlp_stack(torch.float32)):
        compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        signature = repeated_layers._Signatures()
        assert [signature(n) for n in compute] == [repeated_layers._signature(n) for n in compute]

    texts = []

    class Target:
        __name__ = "target"  # (FX names a node after its target)

        def __call__(self, *args):
            return args[0]

        def __str__(self):
            texts.append(self)
            return "target"

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    one, other = Target(), Target()
    for _ in range(4):
        x = graph.call_function(one, (x, 2))
        x = graph.call_function(other, (x,), {"k": [1.5, x]})
    graph.output(x)
    signature = repeated_layers._Signatures()
    signatures = [signature(n) for n in graph.nodes if n.op == "call_function"]
    assert signatures[0] == ("target", ("tuple", ("%", "2")), ("tuple", ()), "NoneType")
    assert signatures[1] == ("target", ("tuple", ("%",)), ("tuple", (("tuple", ("'k'", ("immutable_list", ("1.5", "%")))),)),
                             "NoneType")
    assert signatures[2:] == signatures[:2] * 3 and texts == [one, other]
