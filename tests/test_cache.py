"""The compile cache: a second compile of the same graph is a lookup; entries are keyed by what
decides the NEFF; damaged entries are recompiled, never run; failures are not cached; concurrent
compiles leave one valid entry."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from neuronc.cache import CompileCache, cache_settings
from neuronc.cli import main
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.errors import NeuronCompileError
from runtime import run_neff
from tests import zoo
from tests.test_frontend import Unsupported


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("NEURON_CC_FLAGS", "")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(directory))
    return directory


def _program(seed=0):
    model, inputs = zoo.build("mlp", seed=seed)
    return torch.export.export(model, inputs), model, inputs


def test_the_second_compile_of_a_graph_is_a_cache_hit(cache_dir):
    program, model, inputs = _program()
    first = compile_exported(program)
    second = compile_exported(program)
    assert not first.cache_hit and second.cache_hit
    assert len(CompileCache(str(cache_dir)).entries()) == 1
    out = run_neff(second.neff, [inputs[0].numpy()]).outputs[0]
    torch.testing.assert_close(torch.from_numpy(out), model(*inputs).detach(), rtol=1e-4, atol=1e-5)


def test_weights_and_options_are_part_of_the_key(cache_dir):
    compile_exported(_program(seed=0)[0])
    assert not compile_exported(_program(seed=1)[0]).cache_hit  # same graph, other weights
    assert not compile_exported(_program(seed=0)[0], CompileOptions(target="trn1")).cache_hit
    assert compile_exported(_program(seed=1)[0]).cache_hit
    assert len(CompileCache(str(cache_dir)).entries()) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_entry_is_discarded_and_recompiled(cache_dir, damage):
    program, model, inputs = _program()
    compile_exported(program)
    (entry,) = CompileCache(str(cache_dir)).entries()
    data = bytearray(open(entry.path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:
        data = b""
    open(entry.path, "wb").write(bytes(data))
    again = compile_exported(program)
    assert not again.cache_hit
    out = run_neff(again.neff, [inputs[0].numpy()]).outputs[0]
    torch.testing.assert_close(torch.from_numpy(out), model(*inputs).detach(), rtol=1e-4, atol=1e-5)
    assert compile_exported(program).cache_hit  # the recompiled entry replaced the damaged one


def test_a_failed_compile_is_not_cached(cache_dir):
    program = torch.export.export(Unsupported(), (torch.randn(4, 8),))
    for _ in range(2):
        with pytest.raises(NeuronCompileError):
            compile_exported(program)
    assert CompileCache(str(cache_dir)).entries() == []


def test_concurrent_compiles_of_one_graph_both_succeed_and_leave_one_entry(cache_dir, tmp_path):
    program, _, inputs = _program()
    torch.export.save(program, str(tmp_path / "m.pt2"))
    script = textwrap.dedent(f"""
        from neuronc.compiler import compile_exported
        compile_exported({str(tmp_path / "m.pt2")!r})
    """)
    workers = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [w.wait(timeout=600) for w in workers] == [0, 0]
    entries = CompileCache(str(cache_dir)).entries()
    assert len(entries) == 1
    assert CompileCache(str(cache_dir)).get(entries[0].key) is not None  # valid, loadable


def test_cache_location_follows_the_neuron_conventions(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "a"))
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir={tmp_path / 'b'}")
    assert cache_settings() == (True, str(tmp_path / "a"))
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL")
    assert cache_settings() == (True, str(tmp_path / "b"))
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_settings() == (True, str(tmp_path / "xdg" / "neuronc"))
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    assert cache_settings() == (False, None)


def test_cache_commands_list_show_prune_and_clear(cache_dir):
    compile_exported(_program(seed=0)[0])
    compile_exported(_program(seed=1)[0])
    runner = CliRunner()
    listing = runner.invoke(main, ["cache", "list"])
    assert listing.exit_code == 0 and "2 entries" in listing.output
    key = CompileCache(str(cache_dir)).entries()[0].key
    shown = runner.invoke(main, ["cache", "show", key[:10]])
    assert shown.exit_code == 0 and key in shown.output
    pruned = runner.invoke(main, ["cache", "prune", "--max-size", "1"])
    assert pruned.exit_code == 0 and "removed 2 entries" in pruned.output
    compile_exported(_program(seed=0)[0])
    cleared = runner.invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 entries" in cleared.output
    assert CompileCache(str(cache_dir)).entries() == []


def test_a_new_process_running_the_same_torch_compile_compiles_nothing_and_checks_nothing_again(cache_dir):
    script = textwrap.dedent("""
        import torch
        from tests import zoo
        from neuronc.pytorch.backend import compiled_graphs
        from runtime.core import LoadedProgram
        checks, check = [], LoadedProgram._check_accesses
        LoadedProgram._check_accesses = lambda self: checks.append(1) or check(self)
        model, inputs = zoo.build("transformer_block")
        with torch.no_grad():
            out = torch.compile(model, backend="neuron")(*inputs)
        print("hits", [f.compiled.cache_hit for f in compiled_graphs], "access checks", len(checks))
        print("output", out.flatten()[:8].tolist())
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    assert "hits [False] access checks 1" in first and "hits [True] access checks 0" in second
    assert first[-1] == second[-1]  # the same outputs from the trusted load


TRAINING_SCRIPT = textwrap.dedent("""
    import torch
    from tests import zoo
    from neuronc.pytorch import backend
    torch.manual_seed(0)
    model = zoo.GPT2(layers=1).train()
    step = torch.compile(model, backend="neuron")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    for _ in range(2):
        loss = step(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print("loss", loss.item())
    print("graphs", backend.compile_count(), "from the cache", sum(f.compiled.cache_hit for f in backend.compiled_graphs))
""")


def test_a_second_run_of_a_training_script_compiles_nothing(cache_dir):
    runs = [subprocess.run([sys.executable, "-c", TRAINING_SCRIPT], capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    assert first[-1] == "graphs 2 from the cache 0"  # the forward and the backward graph, compiled
    assert second[-1] == "graphs 2 from the cache 2"  # ... and in the new process, both from the cache
    assert first[:-1] == second[:-1]  # the same losses, step for step
    assert len(CompileCache(str(cache_dir)).entries()) == 2
