"""Differential tests (DESIGN.md "Testing"): for each zoo model, the StableHLO module neuronc compiles is run by a
reference executor and, compiled, by the NEFF on the emulated NeuronCore; their outputs agree within the tolerance of
their dtype. A golden test failing with this one passing points at the frontend (torch-mlir's lowering), with it
failing too at neuronc (importer, passes, codegen, runtime); the reference is held to eager PyTorch on CPU as well.

The reference executor (neuronc/reference.py) is the StableHLO reference interpreter (`eval_module` of the stablehlo
project, through torch-mlir's bindings): it shares no code with XLA or neuronc. It interprets element by element, so
the models whose matmuls and convolutions make it slow run on XLA's CPU backend (jaxlib) instead; REFERENCE says
which, with the interpreter's time on them. The module is the one neuronc compiled, not a second lowering: its text,
kept as torch-mlir made it (constants not elided), has the fingerprint the compiler computed from it.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from neuronc.compiler import CompileOptions, compile_imported
from neuronc.frontend import torch_import
from neuronc.frontend.exported import import_exported_program
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.reference import run_reference
from neuronc.tolerances import tolerance
from runtime import run_neff
from tests import zoo

# The reference of each model: the interpreter unless XLA is much cheaper. CPU seconds of one run of each (the
# interpreter / XLA, compilation included), measured 2026-12-02 by `python -m benchmarks.reference_executors`;
# for comparison, exporting, importing, compiling and running the NEFF take 3-7 s per model.
REFERENCE = {
    "mlp": "interpreter",  # 0.4 / 1.6
    "cnn": "interpreter",  # 0.8 / 2.2
    "bert": "interpreter",  # 2.0 / 3.5
    "moe": "interpreter",  # 0.8 / 1.1
    "recommender": "interpreter",  # 0.2 / 0.6
    "unet": "interpreter",  # 0.7 / 2.0
    "mamba": "interpreter",  # 0.9 / 3.1
    "vit": "interpreter",  # 2.2 / 3.2
    "llama": "xla",  # 11.1 / 2.6
    "resnet": "xla",  # 14.2 / 1.5
    "gpt2": "xla",  # 27.4 / 1.3
    "transformer_block": "xla",  # 44.3 / 1.1
}


def _import_keeping_stablehlo(program, directory):
    """(ImportedGraph, weights, the StableHLO module text it was imported from, in full): the import runs in a
    forked child (frontend/isolate.py), so the text comes back through a file."""
    real_lower, path = torch_import.lower, directory / "module.mlir"

    def lower(gm, name):
        module = real_lower(gm, name)
        path.write_text(module.operation.get_asm(enable_debug_info=True))
        return module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_import, "lower", lower)
        imported, weights = import_exported_program(program)
    text = path.read_text()
    assert hashlib.sha256(text.encode()).hexdigest() == imported.fingerprint  # the module neuronc compiles
    return imported, weights, text


@pytest.fixture(scope="module", params=sorted(zoo.ZOO))
def runs(request, tmp_path_factory):
    """(name, eager's outputs, the reference executor's, the NEFF's) of a zoo model, each as numpy arrays."""
    name = request.param
    model, inputs = zoo.build(name)
    with torch.no_grad():
        eager = model(*inputs)
    imported, weights, module = _import_keeping_stablehlo(torch.export.export(model, inputs),
                                                          tmp_path_factory.mktemp(name))
    user = iter(to_numpy(x) for x in inputs)
    arguments = [weights[p.attrs["name"]] if p.attrs["kind"] == "weight" else next(user) for p in imported.graph.params]
    reference = run_reference(module, arguments, REFERENCE[name])
    for param in imported.graph.params:  # as compile_exported does: the weights are stored in the NEFF
        if param.attrs["kind"] == "weight":
            param.attrs["data"] = weights[param.attrs["name"]]
    neff = compile_imported(imported, CompileOptions(), {}).neff
    on_device = run_neff(neff, [to_numpy(x) for x in inputs]).outputs
    eager = [to_numpy(x) for x in (eager if isinstance(eager, tuple) else (eager,))]
    return name, eager, reference, on_device


def _assert_agree(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
    for index, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}, output {index}: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        where = f"{what}, output {index}"
        torch.testing.assert_close(from_numpy(g), from_numpy(w), **tolerance(w.dtype), msg=lambda m, where=where: f"{where}: {m}")


def test_the_neff_computes_what_the_reference_executor_computes_from_the_same_stablehlo(runs):
    name, _, reference, on_device = runs
    _assert_agree(on_device, reference, f"{name}: the NEFF against {REFERENCE[name]}")


def test_the_reference_executor_computes_what_eager_pytorch_computes(runs):
    """The frontend's half: torch-mlir's StableHLO of the model, run by the reference, gives eager's outputs."""
    name, eager, reference, _ = runs
    _assert_agree(reference, eager, f"{name}: {REFERENCE[name]} against eager PyTorch")
