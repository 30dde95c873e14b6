"""NEURON_CC_FLAGS: every flag neuronc accepts is read, and anything else (an unknown flag, a bad value, a
missing value) is refused with the valid choices, by the command line, torch.compile and the compile cache
alike, as neuronx-cc refuses them; never ignored."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from neuronc.cache import cache_settings
from neuronc.cc_flags import cc_flags, compile_flags
from neuronc.cli import main
from neuronc.compiler import CompileOptions
from neuronc.errors import NeuronConfigError
from tests import zoo

BAD = "--target trn9 -O7 --bogus"


def test_every_accepted_spelling_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--target=trn1 --optlevel 3 --auto-cast=matmult --auto-cast-type fp16 "
                                          f"--cache_dir {tmp_path}")
    assert compile_flags() == {"target": "trn1", "opt_level": 3, "auto_cast": "matmult", "auto_cast_type": "fp16"}
    assert cache_settings() == (True, str(tmp_path))
    for flags, level in (("-O1", 1), ("-O 0", 0), ("--optlevel=2 -O3", 3)):  # the last one given wins
        monkeypatch.setenv("NEURON_CC_FLAGS", flags)
        assert compile_flags() == {"opt_level": level}
    monkeypatch.setenv("NEURON_CC_FLAGS", "  ")
    assert compile_flags() == {} and cc_flags() == []


def test_unknown_flags_and_bad_values_are_all_refused_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", BAD)
    with pytest.raises(NeuronConfigError) as raised:
        compile_flags()
    message = str(raised.value)
    assert "NEURON_CC_FLAGS" in message
    assert "--target trn9: unknown target; valid: trn1, trn2, trn3" in message
    assert "-O7: unknown optimisation level; valid: 0, 1, 2, 3" in message
    assert "--bogus: unknown flag" in message
    for flag in ("--target", "-O", "--optlevel", "--auto-cast", "--auto-cast-type", "--cache_dir", "--no_cache"):
        assert flag in raised.value.hint


@pytest.mark.parametrize("flags, problem", [
    ("--auto-cast sometimes", "--auto-cast sometimes: unknown mode; valid: none, matmult, all, fp64-to-fp32, "
                              "matmult,fp64-to-fp32, all,fp64-to-fp32"),
    ("--auto-cast-type fp4", "--auto-cast-type fp4: unknown type; valid: bf16, fp16, fp8_e4m3"),
    ("--target", "--target needs a value"),
    ("--cache_dir --no_cache", "--cache_dir needs a value"),
    ("--no_cache=yes", "--no_cache takes no value"),
    ("-O", "-O needs a value"),
    ("--target 'trn1", "unbalanced quotes"),
])
def test_a_bad_or_missing_value_is_refused(monkeypatch, flags, problem):
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    with pytest.raises(NeuronConfigError, match="NEURON_CC_FLAGS") as raised:
        cc_flags()
    assert problem in str(raised.value)


def test_the_compile_cache_refuses_bad_flags_too(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir /tmp/x {BAD}")
    with pytest.raises(NeuronConfigError, match="trn9"):
        cache_settings()


def test_torch_compile_refuses_bad_flags(monkeypatch, fresh_dynamo):
    """(fresh_dynamo: a graph Dynamo compiled for an earlier test's MLP, whose guards this one may pass, would run
    without calling the backend at all.)"""
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--no_cache {BAD}")
    model, inputs = zoo.build("mlp")
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="neuron")(*inputs)
    raised = getattr(caught.value, "inner_exception", caught.value)  # Dynamo wraps backend errors
    assert isinstance(raised, NeuronConfigError) and "--bogus: unknown flag" in str(raised)


@pytest.mark.parametrize("command", ["compile", "check"])
def test_the_command_line_refuses_bad_flags_before_any_work(monkeypatch, saved_program, tmp_path, command):
    def work(*args, **kwargs):
        raise AssertionError("compiled although NEURON_CC_FLAGS is bad")

    monkeypatch.setattr("neuronc.compiler.compile_exported", work)
    monkeypatch.setattr("neuronc.check.check_program", work)
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--no_cache {BAD}")
    pt2 = saved_program(*zoo.build("mlp"))
    result = CliRunner().invoke(main, [command, str(pt2), *(["-o", str(tmp_path / "m.neff")] * (command == "compile"))])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "error: NEURON_CC_FLAGS" in result.output and "--target trn9: unknown target" in result.output
    assert not (tmp_path / "m.neff").exists()


def test_the_command_line_compiles_with_the_flags_and_its_own_options_win(monkeypatch, saved_program, tmp_path):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache --target trn1 -O1")
    pt2 = saved_program(*zoo.build("mlp"))
    runner = CliRunner()
    from_flags = runner.invoke(main, ["compile", str(pt2), "-o", str(tmp_path / "a.neff")])
    assert from_flags.exit_code == 0 and "for trn1 at -O1" in from_flags.output
    from_options = runner.invoke(main, ["compile", str(pt2), "-o", str(tmp_path / "b.neff"), "--target", "trn3"])
    assert from_options.exit_code == 0 and "for trn3 at -O1" in from_options.output


def test_options_of_torch_compile_are_checked_like_the_flags():
    with pytest.raises(NeuronConfigError, match="unknown target 'trn9'"):
        CompileOptions.from_dict({"target": "trn9"})
    with pytest.raises(NeuronConfigError, match="unknown optimisation level 7"):
        CompileOptions.from_dict({"opt_level": 7})
