"""Repeated layers imported once (frontend/repeated_layers.py): the same IR and NEFF as the whole graph's import,
each layer located at its own source, and the whole import for anything that is not a clean stack of copies."""
from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuronc import ir, ir_text
from neuronc.compiler import compile_fx
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


def mlp_stack(dtype, blocks=4, width=16):
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
    return encode(compile_fx(gm).neff)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", [gpt2, mlp_stack], ids=["gpt2", "mlp"])
def test_the_layers_imported_once_give_the_whole_imports_ir(model, dtype, monkeypatch):
    gm = model(dtype)
    assert repeated_layers.find_layers(gm) is not None
    whole = imported_text(gm, monkeypatch, whole=True)
    once = imported_text(gm, monkeypatch, whole=False)
    assert without_constant_locations(once) == without_constant_locations(whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_mlp_stack_imported_once_makes_the_same_neff(dtype, monkeypatch):
    gm = mlp_stack(dtype)
    assert compiled_neff(gm, monkeypatch, whole=False) == compiled_neff(gm, monkeypatch, whole=True)


def test_gpt2_bf16_imported_once_makes_the_same_neff(monkeypatch):
    gm = gpt2(torch.bfloat16)
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


def test_a_layer_that_differs_in_an_attribute_is_not_a_copy():
    def forward(x, w0, w1, w2):
        x = torch.tanh(x @ w0) * 2.0
        x = torch.tanh(x @ w1) * 3.0  # the constant differs: no copy of the block before
        return (torch.tanh(x @ w2) * 4.0,)

    gm = make_fx(forward)(*(torch.randn(8, 8) for _ in range(4)))
    assert repeated_layers.find_layers(gm) is None


def test_a_side_output_read_later_falls_back_to_the_whole_import():
    def forward(x, w0, w1, w2):
        first = torch.tanh(x @ w0)
        x = torch.tanh(first @ w1)
        x = torch.tanh(x @ w2)
        return (x + first,)  # the first block's value read after the third

    gm = make_fx(forward)(*(torch.randn(8, 8) for _ in range(4)))
    assert repeated_layers.find_layers(gm) is None


def test_a_block_that_mutates_is_imported_whole():
    def forward(x, w0, w1, w2):
        for w in (w0, w1, w2):
            x = torch.tanh(x @ w)
            x.mul_(2.0)
        return (x,)

    gm = make_fx(forward, pre_dispatch=True)(*(torch.randn(8, 8) for _ in range(4)))
    assert any(getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable for n in gm.graph.nodes)
    assert repeated_layers.find_layers(gm) is None


def test_blocks_that_repeat_are_found_with_their_weights_wired_per_copy():
    def forward(x, w0, w1, w2):
        for w in (w0, w1, w2):
            x = torch.tanh(x @ w) * 2.0
        return (x,)

    gm = make_fx(forward)(*(torch.randn(8, 8) for _ in range(4)))
    layers = repeated_layers.find_layers(gm)
    assert layers is not None and len(layers.copies) == 3
    weights = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
    assert [[a for a in sources if a in weights] for sources in layers.sources] == [[w] for w in weights]
