"""Shared fixtures: the zoo, the per-dtype tolerance table, and the comparison with eager PyTorch."""
from __future__ import annotations

import copy
import functools

import hypothesis
import numpy as np
import pytest
import torch

from neuronc.tolerances import TOLERANCES  # the one table (bf16/fp16 against an fp32 reference)
from tests import zoo

pytest_plugins = ["tests.fallback_listing", "pytester"]  # the RMSE fallback's uses listed; pytester: a run in a test

# No Hypothesis deadline (its default is 200 ms per example): a time limit is a timing assertion, and the machines
# running the suite are shared and noisy. Every property test inherits it (tests/test_suite_rules.py).
hypothesis.settings.register_profile("neuronc", deadline=None)
hypothesis.settings.load_profile("neuronc")

LOW_PRECISION = (torch.bfloat16, torch.float16)


def assert_matches_eager(actual, expected, tolerance: torch.dtype | None = None):
    """Each output has eager's shape and dtype and is within the tolerance of its dtype, or of
    `tolerance` when it was computed in a narrower type than it is stored in."""
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
        assert got.shape == want.shape, f"shape {tuple(got.shape)} != eager {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"dtype {got.dtype} != eager {want.dtype}"
        torch.testing.assert_close(got.detach(), want.detach(), **TOLERANCES[tolerance or want.dtype])


class OnDevice:
    """``torch.compile(fn, backend="neuron", fullgraph=True)`` for tests that compare its outputs with eager's. Each
    call checks that a graph neuronc compiled ran on the emulated device: otherwise a graph break or Dynamo's
    recompile limit (past it Dynamo runs the function eagerly) would compare eager with eager and pass. Dynamo's
    caches are reset first, so that what earlier tests compiled (and their recompile counts) plays no part."""

    def __init__(self, fn, **kwargs):
        from neuronc.pytorch import backend

        torch._dynamo.reset()
        self._backend, self._compiled = backend, torch.compile(fn, backend="neuron", fullgraph=True, **kwargs)
        self._first = len(backend.compiled_graphs)

    @property
    def graphs(self) -> list:
        """The NeffFunctions compiled for this function so far (forward, then backward graphs)."""
        return self._backend.compiled_graphs[self._first:]

    def __call__(self, *args, **kwargs):
        runs = {id(g): g.last_run for g in self.graphs}
        out = self._compiled(*args, **kwargs)
        assert any(g.last_run is not None and g.last_run is not runs.get(id(g)) for g in self.graphs), \
            "no graph compiled by neuronc ran on the device: the call ran eagerly"
        return out  # a graph run in part on the CPU fails the test in device_graphs_stay_whole


def compile_module(model, inputs, **options):
    """``model`` exported with ``inputs`` and compiled by neuronc's own entry (no Dynamo), at -O2 unless
    ``options`` (CompileOptions' fields) say otherwise."""
    from neuronc.compiler import CompileOptions, compile_exported

    return compile_exported(torch.export.export(model, tuple(inputs)), CompileOptions(**{"opt_level": 2, **options}))


def run_program(neff, inputs) -> list:
    """The outputs, as tensors, of a NEFF run on the emulated device with ``inputs``."""
    from neuronc.frontend.tensors import from_numpy, to_numpy
    from runtime import run_neff

    return [from_numpy(out) for out in run_neff(neff, [to_numpy(x) for x in inputs]).outputs]


def compiled_outputs(model, inputs, **options):
    """(the program of :func:`compile_module`, every output of it run on ``inputs``): what a test comparing a
    pass's -O2 program with the -O0 one (each op its own kernel) runs at each level."""
    compiled = compile_module(model, inputs, **options)
    return compiled, run_program(compiled.neff, inputs)


def o2_with_o0_bits(model, inputs, **options):
    """:func:`compiled_outputs` at -O2, every output asserted bit for bit the -O0 program's (each op a kernel of
    its own): what a -O2 pass that only moves work between kernels and engines must keep."""
    optimised, outputs = compiled_outputs(model, inputs, **options)
    _, baseline = compiled_outputs(model, inputs, **{**options, "opt_level": 0})
    assert len(outputs) == len(baseline)
    for n, (value, base) in enumerate(zip(outputs, baseline)):
        assert torch.equal(value, base), f"output {n}: -O2's bits differ from -O0's"
    return optimised, outputs


def compile_and_run(model, inputs, **options):
    """(the compiled program, its first output) of ``model`` on ``inputs``: :func:`compile_module`, then run."""
    compiled = compile_module(model, inputs, **options)
    return compiled, run_program(compiled.neff, inputs)[0]


def run_compiled(fn, *inputs):
    """``fn(*inputs)`` compiled whole by a fresh Dynamo, checked to have run on the device (:class:`OnDevice`)."""
    return OnDevice(fn)(*inputs)


def _fp32_reference(model, inputs):
    """(outputs as eager runs the model, outputs of the same rounded weights and inputs run in fp32)."""
    low = {t.dtype for t in [*model.parameters(), *model.buffers(), *inputs] if t.dtype in LOW_PRECISION}
    with torch.no_grad():
        as_run = model(*inputs)
        if not low:
            return as_run, as_run
        reference = copy.deepcopy(model).float()(*[x.float() if x.dtype in low else x for x in inputs])
    return as_run, reference


def _outputs(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def eager_reference(model, inputs):
    """The golden of a model run in its own dtype, computed by eager PyTorch on CPU.

    For a bf16/fp16 model this is what Inductor's tests do (`reference_in_float`): the same weights
    and inputs, already rounded to the low-precision type, upcast to fp32 and run in fp32; each
    floating-point output is then rounded once to the type eager gives it in low precision. The
    error measured is the compiled program's alone, not eager bf16's as well."""
    as_run, reference = _fp32_reference(model, inputs)
    rounded = [ref.to(run.dtype) for ref, run in zip(_outputs(reference), _outputs(as_run))]
    return type(as_run)(rounded) if isinstance(as_run, (tuple, list)) else rounded[0]


def _rmse(a, b) -> float:
    return torch.sqrt(torch.mean((a.double() - b.double()) ** 2)).item()


EAGER_ERROR_MULTIPLIER = 3.0  # torch._dynamo.utils.same's multiplier for fp16/bf16 results


def assert_as_accurate_as_eager(actual, model, inputs):
    """A low-precision model's outputs are right when each is within its dtype's tolerance of the fp32
    reference (eager_reference), or, where low precision alone misses that row, no less accurate than
    eager PyTorch in the same dtype: the accuracy check of Inductor's tests (torch._dynamo.utils.same
    with a high-precision reference), RMSE against the fp32 reference at most 3x eager's, + atol/10.
    Each output passing by that second rule is listed at the end of the run (tests/fallback_listing.py)."""
    as_run, reference = _fp32_reference(model, inputs)
    actual = _outputs(actual)
    assert len(actual) == len(_outputs(as_run))
    for index, (got, eager, ref) in enumerate(zip(actual, _outputs(as_run), _outputs(reference))):
        assert got.shape == eager.shape and got.dtype == eager.dtype, (got.shape, got.dtype, eager.shape, eager.dtype)
        tolerance = TOLERANCES[eager.dtype]
        try:
            torch.testing.assert_close(got, ref.to(eager.dtype), **tolerance)
        except AssertionError as outside:
            if eager.dtype not in LOW_PRECISION:
                raise
            ours, eagers = _rmse(got, ref), _rmse(eager, ref)
            if ours > EAGER_ERROR_MULTIPLIER * eagers + tolerance["atol"] / 10:
                raise AssertionError(f"RMSE against the fp32 reference {ours:.3g} > {EAGER_ERROR_MULTIPLIER} x "
                                     f"eager {eager.dtype}'s {eagers:.3g}\n{outside}") from None
            mismatched = (~torch.isclose(got.double(), ref.to(eager.dtype).double(), **tolerance)).sum().item()
            from tests import fallback_listing

            fallback_listing.record(
                f"{type(model).__name__} output {index} {list(got.shape)} {str(eager.dtype).removeprefix('torch.')}: "
                f"{mismatched} of {got.numel()} elements outside the tolerance; RMSE {ours:.3g}, eager's {eagers:.3g} "
                f"(limit {EAGER_ERROR_MULTIPLIER:g}x + {tolerance['atol'] / 10:g})")


def require_tool(tool: str, install: str) -> None:
    """Skip the test when a system tool (`make system-tools` installs them) is missing, except in CI
    (CI=true), where a missing tool fails it: CI must run every test, not stay green without them."""
    import os
    import shutil

    if shutil.which(tool) is not None and os.access(shutil.which(tool), os.X_OK):
        return
    why = f"{tool} is not installed ({install})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}: in CI every test runs; `make system-tools` installs it")
    pytest.skip(why)


def line_of(path, marker: str) -> int:
    """The number of the first line of a source file that contains `marker`."""
    with open(path) as source:
        return next(i for i, line in enumerate(source, 1) if marker in line)


@pytest.fixture(params=sorted(zoo.ZOO))
def zoo_model(request):
    """(name, model, inputs, eager outputs) for each model of the zoo."""
    model, inputs = zoo.build(request.param)
    with torch.no_grad():
        expected = model(*inputs)
    return request.param, model, inputs, expected


@pytest.fixture
def saved_program(tmp_path):
    """Save a model's ExportedProgram to a .pt2 file; returns the path."""

    def save(model, inputs, name="model"):
        path = tmp_path / f"{name}.pt2"
        torch.export.save(torch.export.export(model, inputs), str(path))
        return path

    return save


@pytest.fixture(autouse=True, scope="session")
def no_compile_cache():
    """Tests compile for real unless they opt into a cache of their own (see test_cache.py). Session-wide, so that
    module-scoped fixtures, set up before any function-scoped one, do not read the user's cache either (a hit has
    no graph to inspect)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEURON_CC_FLAGS", "--no_cache")
        patch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
        yield


@pytest.fixture
def strictly_on_the_device(monkeypatch):
    """No CPU fallback (neuronc.pytorch.partition): a lowering that stops compiling fails the test instead of
    its op running quietly on the CPU. Test files of compiled ops use it for every test:
    ``pytestmark = pytest.mark.usefixtures("strictly_on_the_device")``."""
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")


@pytest.fixture
def fresh_dynamo():
    """Forget graphs Dynamo compiled in earlier tests (it would reuse them for the same code)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def neuron():
    """neuron:0, the `neuron` device initialised (shim loaded, eager kernels registered)."""
    torch.neuron._lazy_init()
    return torch.device("neuron", 0)


@pytest.fixture
def lowered_only(neuron, monkeypatch):
    """What runs under it is lowered: no op is traced through torch-mlir, none falls back to the CPU. It starts
    with no program compiled in this process, so that what an earlier test compiled cannot answer for it."""
    from neuronc.pytorch import eager

    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    monkeypatch.setattr(eager, "programs", {})
    traced = eager.compile_stats["traced"]
    yield neuron
    assert eager.compile_stats["traced"] == traced


def run_ranks(args: list, ranks: int, timeout: float, env: dict | None = None) -> list:
    """Run ``python *args`` as the ``ranks`` processes of one torch.distributed job on this host (loopback, a port
    the OS gives, the environment torchrun sets), and return each rank's last line of output, parsed as JSON, in
    rank order. A rank that fails fails the test with its error output; a job that outlives ``timeout`` seconds
    is killed (every rank) and fails it too."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        rank_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
        procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__))))
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errors = [p.communicate()[1][-1500:] for p in procs]
        pytest.fail(f"the {ranks} ranks did not finish within {timeout} s:\n" + "\n".join(errors))
    results = []
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def import_keeping_stablehlo(program) -> tuple:
    """(ImportedGraph, weights, the StableHLO module text it was imported from, in full: constants not elided) of
    an ExportedProgram. The import runs in a forked child (frontend/isolate.py), so the text comes back through a
    file; its hash is the fingerprint the compiler computed, i.e. it is the module neuronc compiles. The graph is
    imported whole (``NEURONC_WHOLE_IMPORT=1``): repeated layers are otherwise lowered as two modules, skeleton and
    one layer (frontend/repeated_layers.py), whose IR and NEFF tests/test_repeated_layers.py holds equal to this."""
    import hashlib
    import pathlib
    import tempfile

    from neuronc.frontend import torch_import
    from neuronc.frontend.exported import import_exported_program

    real_lower = torch_import.lower
    with tempfile.TemporaryDirectory() as directory, pytest.MonkeyPatch.context() as patch:
        path = pathlib.Path(directory) / "module.mlir"

        def lower(gm, name):
            module = real_lower(gm, name)
            path.write_text(module.operation.get_asm(enable_debug_info=True))
            return module

        patch.setattr(torch_import, "lower", lower)
        patch.setenv("NEURONC_WHOLE_IMPORT", "1")
        imported, weights = import_exported_program(program, "main")
        text = path.read_text()
    assert hashlib.sha256(text.encode()).hexdigest() == imported.fingerprint
    return imported, weights, text


@functools.cache
def _imported_zoo(name: str) -> tuple:
    model, inputs = zoo.build(name)
    imported, weights, text = import_keeping_stablehlo(torch.export.export(model, inputs))
    for array in weights.values():  # shared by every test of the process: a pass writing one in place must fail
        array.setflags(write=False)
    return imported.graph, weights, text


def imported_zoo(name: str) -> tuple:
    """(graph, weights by name) torch-mlir and the importer make of a zoo model, once per test process: copy the
    graph before changing it (zoo_graph does)."""
    return _imported_zoo(name)[:2]


def zoo_stablehlo(name: str) -> str:
    """The StableHLO module text, in full, that imported_zoo's graph of a zoo model was imported from."""
    return _imported_zoo(name)[2]


def zoo_graph(name: str):
    """A fresh copy of imported_zoo's graph of a zoo model, its weights attached as compile_exported attaches them:
    for tests of what the compiler makes of a zoo model (compile_graph), not of torch.export or the import, which
    then cost their ~2-5 CPU s once per test process instead of once per test."""
    graph, weights = imported_zoo(name)
    graph = copy.deepcopy(graph)
    for param in graph.params:
        if param.attrs["kind"] == "weight":
            param.attrs["data"] = weights[param.attrs["name"]]
    return graph


@pytest.fixture(autouse=True)
def device_graphs_stay_whole(request):
    """A compiled graph that falls back to the CPU in part (neuronc/pytorch/partition.py) fails the test, unless
    it is marked `cpu_fallback`: a regression in a lowering cannot pass a test by running on the CPU."""
    from neuronc.pytorch import partition

    before = partition.partitioned_graphs
    yield
    if request.node.get_closest_marker("cpu_fallback") is None:
        assert partition.partitioned_graphs == before, "a compiled graph ran in part on the CPU (partition fallback)"


@pytest.fixture(autouse=True)
def verified_ir(monkeypatch):
    """Every compilation in the tests verifies its graph after each pass (neuronc/ir_verifier.py)."""
    monkeypatch.setenv("NEURONC_VERIFY_IR", "1")


def ir(text: str):
    """The graph of IR text (neuronc/ir_text.py), checked by the verifier."""
    from neuronc import ir_text, ir_verifier

    graph = ir_text.parse(text)
    ir_verifier.verify(graph)
    return graph


def canonical(text: str) -> str:
    """IR text as the printer writes it (whitespace, comments and line breaks normalised)."""
    from neuronc import ir_text

    return ir_text.to_text(ir_text.parse(text))


def run_pass(pass_, text: str, **context) -> str:
    """A pass tested as MLIR's and IREE's are: IR text in, IR text out; the result verified."""
    from neuronc import ir_text, ir_verifier
    from neuronc.passes.context import PassContext

    result = pass_(ir(text), PassContext(**context))
    ir_verifier.verify(result, pass_.__name__)
    return ir_text.to_text(result)


@pytest.fixture
def cli():
    """Run the `neuronc` command line in-process: cli("compile", path, ...) -> click's Result. A command
    may fail, but only with its own error message and exit code, never a traceback."""
    from click.testing import CliRunner

    from neuronc.cli import main

    runner = CliRunner()

    def invoke(*args):
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output
        return result

    return invoke
