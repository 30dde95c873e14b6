"""The frontend: FX graphs and ExportedPrograms reach the graph IR through torch-mlir, with weights
as arguments, source locations kept, every unsupported op reported, and torch-mlir's crashes and
hangs contained in a child process."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from neuronc.compiler import compile_exported
from neuronc.errors import FrontendCrashError, NeuronCompileError
from neuronc.frontend.exported import import_exported_program
from neuronc.frontend.isolate import run_isolated
from neuronc.ir import Op
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_matches_eager, line_of


class Unsupported(torch.nn.Module):
    def forward(self, x):
        a = torch.fft.rfft(x).abs()  # SPEC: unsupported by torch-mlir
        b = torch.igammac(x * 1.5, x.abs())  # SPEC: unsupported by torch-mlir, used twice (tan, used here before,
        c = torch.igammac(x * 2.5, x.abs())  # compiles since issue 21's part 9)
        return a.sum() + b + c


class ZeroDimVariance(torch.nn.Module):
    def forward(self, x):
        return torch.var(x, correction=0)  # torch-mlir 20261001 segfaults on this 0-d reduction


class ZeroDimSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, 0)  # torch-mlir 20261001 never returns on this one


def _export(model, *inputs):
    return torch.export.export(model, inputs)


def test_parameters_and_buffers_are_function_arguments_not_constants():
    model, inputs = zoo.build("cnn")
    imported, weights = import_exported_program(_export(model, *inputs))
    state = dict(model.state_dict())
    assert set(weights) == set(state)  # every parameter and buffer, num_batches_tracked included
    assert "dense_resource" not in imported.stablehlo
    header = next(line for line in imported.stablehlo.splitlines() if "func.func @main" in line)
    assert header.count("%arg") == len(state) + len(inputs)
    kinds = [p.attrs["kind"] for p in imported.graph.params]
    assert kinds.count("weight") == len(state) and kinds.count("input") == len(inputs)


def test_source_locations_survive_into_the_ir_and_the_neff_debug_info():
    model, inputs = zoo.build("mlp")
    neff = compile_exported(_export(model, *inputs)).neff
    zoo_file = os.path.abspath(zoo.__file__)
    places = {(d.file, d.module_path) for d in neff.debug_locs}
    assert (zoo_file, "fc1") in places and (zoo_file, "fc3") in places
    lines = {d.line for d in neff.debug_locs if d.file == zoo_file}
    with open(zoo_file) as source:
        text = source.read().splitlines()
    assert any("self.fc1(x)" in text[line - 1] for line in lines)
    assert all(k.debug >= 0 for k in neff.kernels)


def test_every_unsupported_op_is_listed_with_its_source_line():
    with pytest.raises(NeuronCompileError) as caught:
        compile_exported(_export(Unsupported(), torch.randn(4, 8)))
    err = caught.value
    assert len(err.problems) == 3, err.problems  # rfft, abs of a complex tensor, igammac; not just the first
    text = str(err)
    assert "aten.fft_rfft.default: torch-mlir cannot lower it" in text
    assert f"test_frontend.py:{line_of(__file__, 'torch.fft.rfft(x)')}" in text
    assert "aten.igammac.default: torch-mlir cannot lower it to StableHLO; 2 use(s)" in text
    assert f"test_frontend.py:{line_of(__file__, 'x * 1.5')}" in text
    assert "hint:" in text


def test_a_segfault_in_torch_mlir_does_not_take_down_the_process(monkeypatch):
    from neuronc.frontend import torch_import

    # the 0-d variance crashes torch-mlir unless it is rewritten first (issue 21): keep the crash to test containment
    monkeypatch.setattr(torch_import, "unsqueeze_scalar_reductions", lambda gm: None)
    with pytest.raises(FrontendCrashError, match="crashed \\(killed by SIGSEGV\\); your process was not affected"):
        compile_exported(_export(ZeroDimVariance(), torch.tensor(3.0)))


def test_a_hang_in_torch_mlir_is_stopped_after_the_timeout(monkeypatch):
    monkeypatch.setenv("NEURONC_FRONTEND_TIMEOUT", "5")
    with pytest.raises(FrontendCrashError, match="did not finish within 5 s"):
        compile_exported(_export(ZeroDimSoftmax(), torch.tensor(3.0)))


def test_an_isolated_call_returns_values_and_reraises_exceptions():
    assert run_isolated(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        run_isolated(lambda: 1 / 0)
    with pytest.raises(FrontendCrashError, match="SIGABRT"):
        run_isolated(lambda: os.kill(os.getpid(), signal.SIGABRT))


def test_an_isolated_call_may_run_torch_ops_after_the_caller_used_its_thread_pool(monkeypatch):
    # a parallel ATen op in the caller starts OpenMP's threads; the forked child has none of them, and its own
    # first parallel region waited for them forever (JAX's LAPACK lowering builds a triangle mask with triu)
    monkeypatch.setenv("NEURONC_FRONTEND_TIMEOUT", "20")
    torch.ones(16, 64, 64).triu(1)
    assert run_isolated(lambda: int(torch.ones(16, 64, 64).triu(1).sum())) == 16 * 64 * 63 // 2


def test_dynamic_shapes_are_rejected_with_a_way_out():
    model, (x,) = zoo.build("mlp")
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    with pytest.raises(NeuronCompileError, match="dynamic shapes") as caught:
        compile_exported(program)
    assert "pad or bucket" in str(caught.value)


def test_float64_constants_of_decompositions_are_computed_in_fp32():
    model, inputs = zoo.build("transformer_block")  # layer-norm's variance decomposes through f64
    compiled = compile_exported(_export(model, *inputs))
    assert all(n.dtype.name != "F64" for n in compiled.graph.nodes())
    assert not any(n.op in (Op.CONVOLUTION, Op.DOT_GENERAL, Op.REDUCE) for n in compiled.graph.nodes())


class Casts(torch.nn.Module):
    def forward(self, x):
        return (x.int() * 3).to(torch.float32) + x.to(torch.float16).float()


def test_casts_in_an_exported_program_compile_without_torch_exports_metadata_checks():
    x = torch.randn(4, 8) * 10
    neff = compile_exported(_export(Casts(), x)).neff
    assert_matches_eager(torch.from_numpy(run_neff(neff, [x.numpy()]).outputs[0]), Casts()(x))


class Cholesky(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.cholesky(x.T @ x + torch.eye(4))  # SPEC: an effect (its error check) ordered by a token


def test_a_program_with_side_effect_tokens_is_refused_naming_the_op_and_line():
    with pytest.raises(NeuronCompileError, match="side effects that torch.export orders with tokens") as caught:
        compile_exported(_export(Cholesky(), torch.randn(6, 4)))
    problem = caught.value.problems[0]
    assert "_linalg_check_errors" in problem and f"test_frontend.py:{line_of(__file__, 'SPEC: an effect')}" in problem


def test_the_foreach_decompositions_cover_every_functional_foreach_overload_of_the_schemas():
    """decompositions._foreach_decompositions lists the ops from the dispatcher's names: the same overloads as
    every parsed schema of ATen gives (functional ones, whose per-tensor op exists), each decomposed."""
    from neuronc.frontend import decompositions

    aten = torch.ops.aten
    expected = set()
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.removeprefix("aten::")
        if schema.name.startswith("aten::_foreach_") and not name.endswith("_") and \
                not schema.overload_name.endswith("out"):
            base = name.removeprefix("_foreach_")
            if base in decompositions._FOREACH_TARGETS or hasattr(aten, base):
                expected.add(getattr(getattr(aten, name), schema.overload_name or "default"))
    table = decompositions._foreach_decompositions()
    assert set(table) == expected and len(expected) > 50
    assert aten._foreach_add.Scalar in table and aten._foreach_add_.Scalar not in table
    assert all(key in decompositions.OWN for key in table)


def _three_layer_fx():
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=3, heads=2, context=32).eval()
    return torch.export.export(model, (torch.randint(0, 64, (1, 32)),)).graph_module


def test_each_fx_nodes_location_is_the_innermost_frame_outside_torch_of_its_own_trace_and_its_own_module():
    """node_locations parses each distinct stack trace and module path once; every node's location is still its
    own: the innermost frame of its trace outside torch, its innermost module as the user names it, its op."""
    import re

    from neuronc.frontend import torch_import

    gm = _three_layer_fx()
    torch_dir = os.path.dirname(torch.__file__)
    expected = {}
    for node in gm.graph.nodes:
        frames = [(f, int(line)) for f, line, _ in torch_import._FRAME.findall(node.meta.get("stack_trace") or "")
                  if not f.startswith(torch_dir)]
        stack = node.meta.get("nn_module_stack") or {}
        path = re.sub(r"^L\['self'\]\.?|^L__self___?", "", str(list(stack.values())[-1][0])) if stack else ""
        expected[node.name] = (*(frames[-1] if frames else ("", 0)), path, torch_import.op_name(node))
    found = {name: (d.file, d.line, d.module_path, d.op) for name, d in torch_import.node_locations(gm).items()}
    assert found == expected
    traces = [n.meta.get("stack_trace") for n in gm.graph.nodes if n.meta.get("stack_trace")]
    assert len(set(traces)) < len(traces)  # the layers repeat their traces
    assert {"blocks.0.attn", "blocks.2.attn"} <= {path for _, _, path, _ in found.values()}


def test_a_graph_of_fixed_shapes_is_checked_without_its_source_locations(monkeypatch):
    """check_static_shapes makes the locations only to name a data-dependent value (its error message)."""
    from neuronc.frontend import torch_import

    gm = _three_layer_fx()
    made = []
    monkeypatch.setattr(torch_import, "node_locations", lambda g: made.append(g) or {})
    torch_import.check_static_shapes(gm)
    assert made == []
