"""The `neuronc` command line: help that maps the tool, and a clear error (no traceback, non-zero
exit, nothing half-written) for every bad input."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.neff.program import FORMAT_MAJOR, FORMAT_MINOR
from tests import zoo
from tests import test_frontend
from tests.conftest import line_of
from tests.test_frontend import Unsupported


@pytest.fixture(scope="module")
def mlp_neff(tmp_path_factory):
    """A compiled MLP: (neff path, input array)."""
    tmp = tmp_path_factory.mktemp("mlp")
    model, inputs = zoo.build("mlp")
    torch.export.save(torch.export.export(model, inputs), str(tmp / "mlp.pt2"))
    result = CliRunner().invoke(main, ["compile", str(tmp / "mlp.pt2"), "-o", str(tmp / "mlp.neff")])
    assert result.exit_code == 0, result.output
    return tmp / "mlp.neff", inputs[0].numpy()


def test_help_lists_every_subcommand(cli):
    result = cli("--help")
    assert result.exit_code == 0
    for command in ("compile", "run", "inspect", "hlo"):
        assert command in result.output
        sub = cli(command, "--help")
        assert sub.exit_code == 0 and "Usage: main " + command in sub.output.replace("neuronc", "main")


def test_compile_takes_target_and_optimisation_level(cli, mlp_neff, tmp_path):
    model, inputs = zoo.build("mlp")
    pt2 = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, inputs), str(pt2))
    result = cli("compile", pt2, "-o", tmp_path / "m.neff", "--target", "trn1", "-O0")
    assert result.exit_code == 0, result.output
    assert "for trn1 at -O0" in result.output
    inspected = json.loads(cli("inspect", tmp_path / "m.neff", "--json").output)
    assert inspected["target"] == "trn1"


def test_inspect_shows_header_tensor_table_instruction_counts_and_time(cli, mlp_neff):
    neff, _ = mlp_neff
    result = cli("inspect", neff)
    assert result.exit_code == 0, result.output
    for expected in ("target trn2", f"format {FORMAT_MAJOR}.{FORMAT_MINOR}", "content hash", "estimated device time", "MFU",
                     "engines (busy fraction, instructions)", "top kernels", "tensor", "dma", "input",
                     "output0", "weight", "fc1.weight"):
        assert expected in result.output
    summary = json.loads(cli("inspect", neff, "--json").output)
    assert summary["estimated_time_us"] > 0 and summary["instructions"]["tensor"] > 0


def test_hlo_prints_the_stablehlo_module(cli, tmp_path):
    model, inputs = zoo.build("mlp")
    torch.export.save(torch.export.export(model, inputs), str(tmp_path / "m.pt2"))
    result = cli("hlo", tmp_path / "m.pt2")
    assert result.exit_code == 0
    assert "stablehlo.dot_general" in result.output and "func.func @main" in result.output


def test_missing_model_names_the_path(cli, tmp_path):
    result = cli("compile", tmp_path / "nope.pt2")
    assert result.exit_code == 1
    assert f"no such file: {tmp_path / 'nope.pt2'}" in result.output


@pytest.mark.parametrize("command", ["compile", "check"])
@pytest.mark.parametrize("content", ["text", "state_dict"])
def test_a_file_that_is_not_an_exported_program_is_refused(cli, tmp_path, content, command):
    path = tmp_path / "bad.pt2"
    if content == "text":
        path.write_text("not a model")
    else:  # a zip archive too, but written by torch.save
        torch.save(zoo.build("mlp")[0].state_dict(), str(path))
    result = cli(command, path, *(["-o", tmp_path / "bad.neff"] if command == "compile" else []))
    assert result.exit_code == 1
    assert str(path) in result.output and "ExportedProgram" in result.output
    assert not (tmp_path / "bad.neff").exists()


def test_a_failed_compile_leaves_no_neff_behind(cli, tmp_path):
    pt2 = tmp_path / "unsupported.pt2"
    torch.export.save(torch.export.export(Unsupported(), (torch.randn(4, 8),)), str(pt2))
    result = cli("compile", pt2, "-o", tmp_path / "out.neff")
    assert result.exit_code == 1
    assert "3 op(s) of this graph cannot be compiled" in result.output
    assert list(tmp_path.iterdir()) == [pt2]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "empty", "zip"])
def test_run_and_inspect_refuse_a_damaged_or_foreign_neff(cli, mlp_neff, tmp_path, damage):
    neff, x = mlp_neff
    data = bytearray(neff.read_bytes())
    bad = tmp_path / "bad.neff"
    if damage == "truncated":
        bad.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flipped":
        data[len(data) // 3] ^= 0xFF
        bad.write_bytes(bytes(data))
    elif damage == "foreign":
        bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        with zipfile.ZipFile(bad, "w") as archive:
            archive.writestr("a.txt", "hello")
    np.save(tmp_path / "x.npy", x)
    for args in (("inspect", bad), ("run", bad, "--input", tmp_path / "x.npy")):
        result = cli(*args)
        assert result.exit_code == 1
        assert f"error: {bad}" in result.output and "hint:" in result.output


def test_run_with_a_wrong_input_shape_says_what_was_expected(cli, mlp_neff, tmp_path):
    neff, x = mlp_neff
    np.save(tmp_path / "x.npy", np.zeros((3, 3), np.float32))
    result = cli("run", neff, "--input", tmp_path / "x.npy")
    assert result.exit_code == 1
    expected = ", ".join(map(str, x.shape))
    assert "[3, 3]" in result.output and f"[{expected}]" in result.output


def test_inspect_kernels_shows_each_kernels_ops_tiles_time_and_roofline(cli, mlp_neff):
    neff, _ = mlp_neff
    table = json.loads(cli("inspect", neff, "--kernels", "--json").output)["kernels"]
    assert len(table) == 4  # three linear layers and the softmax
    softmax = table[-1]
    assert softmax["name"].startswith("rowwise") and softmax["ops"].count("reduce_last") == 2
    assert "exp" in softmax["ops"] and "divide" in softmax["ops"]
    assert softmax["tiles"] and all(int(shape.split("x")[0]) <= 128 for shape in softmax["tiles"])
    for kernel in table:
        assert kernel["roofline_us"] > 0 and kernel["estimated_time_us"] > 0
        assert kernel["min_hbm_bytes"] <= kernel["hbm_bytes"]
    assert table[0]["flops"] == 2 * 8 * 32 * 128  # fc1: [8, 32] @ [32, 128]
    text = cli("inspect", neff, "--kernels").output
    assert "bound us" in text and softmax["name"] in text and "reduce_last" in text
def test_inspect_kernels_handles_tensors_that_share_scratch_memory(cli, saved_program, tmp_path):
    from tests.test_passes import _Chain  # forty intermediates in a few reused HBM slots

    neff = tmp_path / "chain.neff"
    assert cli("compile", saved_program(_Chain(), (torch.randn(256, 256),)), "-o", neff, "-O0").exit_code == 0
    result = cli("inspect", neff, "--kernels", "--json")
    assert result.exit_code == 0, result.output
    table = json.loads(result.output)["kernels"]
    assert len(table) >= 40
    for kernel in table:  # a [256, 256] fp32 operand is read and one written, each at least once
        assert 2 * 256 * 256 * 4 <= kernel["min_hbm_bytes"] <= kernel["hbm_bytes"]


def test_check_accepts_a_model_whose_every_op_compiles(cli, saved_program):
    model, inputs = zoo.build("mlp")
    result = cli("check", saved_program(model, inputs))
    assert result.exit_code == 0, result.output
    assert "distinct ops" in result.output and "compile for trn2 at -O2" in result.output


def test_check_lists_every_unsupported_op_with_its_uses_and_source_lines(cli, saved_program):
    result = cli("check", saved_program(Unsupported(), (torch.randn(4, 8),)))
    assert result.exit_code == 1
    assert "3 of 6 distinct ops cannot be compiled" in result.output
    assert "aten.igammac.default (2 of 2 uses): torch-mlir cannot lower it" in result.output
    assert "aten.fft_rfft.default (1 of 1 uses): torch-mlir cannot lower it" in result.output
    for marker in ("torch.fft.rfft(x)", "x * 1.5", "x * 2.5"):
        assert f"test_frontend.py:{line_of(test_frontend.__file__, marker)}" in result.output


class CrashesTorchMlir(torch.nn.Module):
    def forward(self, x):
        return torch.var(x, correction=0) + torch.tanh(x)  # SPEC: torch-mlir segfaults on var of a 0-d tensor


def test_check_survives_a_torch_mlir_crash_and_names_the_op_that_crashed(cli, saved_program, monkeypatch):
    """torch-mlir segfaults on one op (tests/test_frontend.py): `neuronc check` runs in the same process, so the
    crash must stay in a child; the op is named with its line, and the ops that compile are not listed."""
    from neuronc.frontend import torch_import

    # neuronc rewrites a 0-d reduction before torch-mlir sees it (issue 21): switched off to keep the crash
    monkeypatch.setattr(torch_import, "unsqueeze_scalar_reductions", lambda gm: None)
    result = cli("check", saved_program(CrashesTorchMlir(), (torch.tensor(3.0),)))
    assert result.exit_code == 1
    assert "aten.var.correction (1 of 1 uses): compiling it alone crashed (killed by SIGSEGV)" in result.output
    assert f"test_cli.py:{line_of(__file__, 'segfaults on var of a 0-d')}" in result.output
    assert "aten.tanh" not in result.output and "aten.add" not in result.output


class _Worked(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Compiling or running anything fails the test: a bad argument must be refused before any work."""
    def work(*args, **kwargs):
        raise _Worked("the command started working although an argument was bad")

    monkeypatch.setattr("neuronc.compiler.compile_exported", work)
    monkeypatch.setattr("runtime.NeuronCore", work)


def _commands_writing(mlp_neff, tmp_path, written: dict) -> list:
    """Each command that writes a file, writing the file `written[kind]` (kinds: neff, npz, json, html)."""
    neff, x = mlp_neff
    np.save(tmp_path / "x.npy", x)
    pt2 = neff.with_suffix(".pt2")
    return [
        ("compile", pt2, "-o", written["neff"]),
        ("run", neff, "--input", tmp_path / "x.npy", "-o", written["npz"]),
        ("profile", neff, "-o", written["json"]),
        ("profile", neff, "-o", tmp_path / "trace.json", "--html", written["html"]),
    ]


@pytest.mark.parametrize("which", range(4))
def test_an_output_into_a_missing_directory_is_refused_before_any_work(cli, mlp_neff, tmp_path, no_work, which):
    missing = tmp_path / "no" / "such" / "dir"
    args = _commands_writing(mlp_neff, tmp_path, {kind: missing / f"out.{kind}" for kind in
                                                  ("neff", "npz", "json", "html")})[which]
    result = cli(*args)
    assert result.exit_code == 1, result.output
    assert f"error: cannot write {args[-1]}: the directory {missing} does not exist" in result.output
    assert "hint: create it" in result.output and not missing.parent.parent.exists()


@pytest.mark.parametrize("which, suffix", [(0, ".neff"), (1, ".npz"), (2, ".json"), (3, ".html")])
def test_an_output_with_the_wrong_extension_is_refused_before_any_work(cli, mlp_neff, tmp_path, no_work, which,
                                                                       suffix):
    wrong = {"neff": mlp_neff[0].with_suffix(".pt2"),  # would overwrite the model compiled
             "npz": tmp_path / "out.txt", "json": tmp_path / "trace.html", "html": tmp_path / "report.json"}
    args = _commands_writing(mlp_neff, tmp_path, wrong)[which]
    result = cli(*args)
    assert result.exit_code == 1, result.output
    assert f"error: cannot write {args[-1]}: " in result.output and f"must end in {suffix}" in result.output
    assert not (tmp_path / "out.txt.npz").exists() and not (tmp_path / "out.txt").exists()


class _Payload:
    """Unpickling it would create `marker`: what a crafted input file runs if it is ever unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_an_input_holding_python_objects_is_refused_without_unpickling_it(cli, mlp_neff, tmp_path, kind):
    neff, _ = mlp_neff
    marker = tmp_path / "payload-ran"
    objects = np.array([_Payload(str(marker))], dtype=object)
    path = tmp_path / f"crafted.{kind}"
    if kind == "npy":
        np.save(path, objects, allow_pickle=True)
    else:
        np.savez(path, x=objects)
    result = cli("run", neff, "--input", path)
    assert result.exit_code == 1
    assert f"error: cannot read input {path}" in result.output and "Python objects" in result.output
    assert not marker.exists()


def test_an_npz_input_gives_its_arrays_in_order(cli, mlp_neff, tmp_path):
    neff, x = mlp_neff
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "inputs.npz", x=x)
    for source, out in ((tmp_path / "x.npy", "a.npz"), (tmp_path / "inputs.npz", "b.npz")):
        assert cli("run", neff, "--input", source, "-o", tmp_path / out).exit_code == 0
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        np.testing.assert_array_equal(a["output0"], b["output0"])


@pytest.mark.parametrize("content", [b"1.0, 2.0\n", b""])
def test_an_input_that_is_not_a_numpy_file_says_so(cli, mlp_neff, tmp_path, content):
    neff, _ = mlp_neff
    (tmp_path / "x.csv").write_bytes(content)
    result = cli("run", neff, "--input", tmp_path / "x.csv")
    assert result.exit_code == 1
    assert f"cannot read input {tmp_path / 'x.csv'}: not a .npy or .npz file" in result.output


@pytest.mark.parametrize("variable, value", [("TORCH_NEURONX_DEBUG_DIR", "{file}"),
                                             ("TORCH_NEURONX_DEBUG_DIR", "{file}/debug"),
                                             ("NEURONC_FRONTEND_TIMEOUT", "ten minutes"),
                                             ("NEURONC_FRONTEND_TIMEOUT", "-1")])
def test_a_bad_setting_is_refused_before_compiling(cli, mlp_neff, tmp_path, monkeypatch, no_work, variable, value):
    plain = tmp_path / "plain"
    plain.write_text("a file")
    monkeypatch.setenv(variable, value.format(file=plain))
    result = cli("compile", mlp_neff[0].with_suffix(".pt2"), "-o", tmp_path / "m.neff")
    assert result.exit_code == 1, result.output
    assert f"error: {variable}={value.format(file=plain)}" in result.output and "hint:" in result.output


def test_an_input_declaring_a_huge_array_is_refused_before_its_data_is_read(cli, mlp_neff, tmp_path):
    neff, x = mlp_neff
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:  # 4 TB declared in a file of a few hundred bytes
        np.lib.format.write_array_header_1_0(file, {"descr": "<f4", "fortran_order": False,
                                                    "shape": (10**6, 10**6)})
        file.write(bytes(64))
    result = cli("run", neff, "--input", path)
    assert result.exit_code == 1
    expected = ", ".join(map(str, x.shape))
    assert f"must be float32[{expected}], got float32[1000000, 1000000] from {path}" in result.output


@pytest.mark.parametrize("command", ["compile", "inspect", "run --input"])
def test_a_fifo_given_as_a_file_is_refused_instead_of_blocking(mlp_neff, tmp_path, command):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = [str(mlp_neff[0]), "--input", str(fifo)] if command == "run --input" else [str(fifo)]
    done = subprocess.run([sys.executable, "-m", "neuronc.cli", command.split()[0], *args], capture_output=True,
                          text=True, timeout=120)  # a regression blocks on open(): the timeout fails the test
    assert done.returncode == 2 and f"{fifo} is not a regular file" in done.stderr


def test_profile_without_inputs_times_the_program_as_it_does_with_them(cli, mlp_neff, tmp_path):
    neff, x = mlp_neff
    np.save(tmp_path / "x.npy", x)
    timed = cli("profile", neff, "-o", tmp_path / "timed.json")
    computed = cli("profile", neff, "--input", tmp_path / "x.npy", "-o", tmp_path / "computed.json")
    assert timed.exit_code == 0 and computed.exit_code == 0, timed.output + computed.output
    estimate = [line for line in timed.output.splitlines() if line.startswith("estimated device time")]
    assert estimate and estimate == [line for line in computed.output.splitlines()
                                     if line.startswith("estimated device time")]
    assert json.loads((tmp_path / "timed.json").read_text())["traceEvents"]  # the engines' tracks were written


@pytest.mark.parametrize("command", ["compile", "run", "profile"])
def test_an_unknown_target_is_refused_with_the_choices(cli, mlp_neff, tmp_path, command):
    neff, _ = mlp_neff
    given = tmp_path / "m.pt2" if command == "compile" else neff
    given.touch()
    result = cli(command, given, "--target", "trn9")
    assert result.exit_code == 2  # a usage error, before any work
    assert "trn9" in result.output and all(t in result.output for t in ("trn1", "trn2", "trn3"))


@dataclasses.dataclass
class _ModelOutput:
    """Stands for transformers' ModelOutput: a dataclass output registered as a pytree node by its library."""
    logits: torch.Tensor
    hidden: torch.Tensor


class _HuggingFaceStyle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, input_ids, use_cache=True):
        hidden = torch.tanh(input_ids)
        return _ModelOutput(logits=self.proj(hidden) if not use_cache else hidden.sum(), hidden=hidden)


def test_a_program_with_library_output_classes_and_constant_arguments_compiles_and_runs(cli, tmp_path):
    # A Hugging Face model exported with kwargs: its output class is a pytree node only its library registers
    # (the CLI does not import it), and use_cache=False is baked into the graph, not a NEFF input.
    from torch.utils import _pytree

    x = torch.randn(3, 8)
    model = _HuggingFaceStyle()
    torch.export.register_dataclass(_ModelOutput, serialized_type_name="somelibrary.ModelOutput")
    try:
        torch.export.save(torch.export.export(model, (), {"input_ids": x, "use_cache": False}), str(tmp_path / "m.pt2"))
    finally:
        _pytree._deregister_pytree_node(_ModelOutput)
    np.save(tmp_path / "x.npy", x.numpy())
    compiled = cli("compile", tmp_path / "m.pt2", "-o", tmp_path / "m.neff")
    assert compiled.exit_code == 0, compiled.output
    ran = cli("run", tmp_path / "m.neff", "--input", tmp_path / "x.npy", "--output", tmp_path / "out.npz")
    assert ran.exit_code == 0, ran.output
    outputs = np.load(tmp_path / "out.npz")
    expected = model(x, use_cache=False)
    assert sorted(outputs) == ["output0", "output1"]
    np.testing.assert_allclose(outputs["output0"], expected.logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["output1"], expected.hidden.numpy(), rtol=1e-5, atol=1e-6)
