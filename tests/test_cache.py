"""The compile cache: a second compile of the same graph is a lookup; entries are keyed by what
decides the NEFF; damaged entries are recompiled, never run; failures are not cached; concurrent
compiles leave one valid entry."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from click.testing import CliRunner

from neuronc.atomic_file import ORPHAN_AGE_S
from neuronc.cache import CompileCache, cache_settings
from neuronc.cli import main
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.errors import NeuronCompileError, NeuronConfigError
from neuronc.neff import encode
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


def test_cache_show_of_an_unknown_key_says_none_matches_and_where_the_keys_are(cache_dir):
    compile_exported(_program(seed=0)[0])
    shown = CliRunner().invoke(main, ["cache", "show", "no-such-key"])
    assert shown.exit_code == 1
    assert "0 cache entries match 'no-such-key'" in shown.output and "neuronc cache list" in shown.output
    assert "Traceback" not in shown.output


# A user's second run, as two fresh processes sharing a compile cache: the same script, run twice, first serves
# an inference graph, then trains (forward and backward graphs). Two processes check both facts; the two tests
# below read what each part printed (each test passes alone: the fixture runs the pair for whichever comes first).
SECOND_RUN_SCRIPT = textwrap.dedent("""
    import torch
    from tests import zoo
    from neuronc.pytorch import backend
    from runtime.core import LoadedProgram
    checks, check = [], LoadedProgram._check_accesses
    LoadedProgram._check_accesses = lambda self: checks.append(1) or check(self)
    model, inputs = zoo.build("transformer_block")
    with torch.no_grad():
        out = torch.compile(model, backend="neuron")(*inputs)
    print("hits", [f.compiled.cache_hit for f in backend.compiled_graphs], "access checks", len(checks))
    print("output", out.flatten()[:8].tolist())

    first = backend.compile_count()
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
    trained = backend.compiled_graphs[first:]
    print("graphs", len(trained), "from the cache", sum(f.compiled.cache_hit for f in trained))
""")


@pytest.fixture(scope="module")
def second_run(tmp_path_factory):
    """(the compile cache, the first process's output lines, the second's): the script above run twice."""
    directory = tmp_path_factory.mktemp("second_run") / "cache"
    env = {**os.environ, "NEURON_CC_FLAGS": "", "NEURON_COMPILE_CACHE_URL": str(directory),
           "NEURONC_VERIFY_IR": "1"}  # (set for each test by conftest.verified_ir, after module fixtures run)
    runs = [subprocess.run([sys.executable, "-c", SECOND_RUN_SCRIPT], capture_output=True, text=True, timeout=600,
                           env=env) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    return directory, first, second


@pytest.mark.slow("two fresh Python processes: the only test that the cache serves a new process, as a user's second run")
def test_a_new_process_running_the_same_torch_compile_compiles_nothing_and_checks_nothing_again(second_run):
    _, first, second = second_run
    assert "hits [False] access checks 1" in first and "hits [True] access checks 0" in second
    outputs = [[line for line in run if line.startswith("output")] for run in (first, second)]
    assert len(outputs[0]) == 1 and outputs[0] == outputs[1]  # the same outputs from the trusted load


@pytest.mark.slow("two fresh processes training: the forward and backward graphs, not only inference, come from the cache")
def test_a_second_run_of_a_training_script_compiles_nothing(second_run):
    directory, first, second = second_run
    assert first[-1] == "graphs 2 from the cache 0"  # the forward and the backward graph, compiled
    assert second[-1] == "graphs 2 from the cache 2"  # ... and in the new process, both from the cache
    assert [line for line in first if line.startswith("loss")] == [line for line in second if line.startswith("loss")]
    assert len([line for line in first if line.startswith("loss")]) == 2  # the same losses, step for step
    assert len(CompileCache(str(directory)).entries()) == 3  # the inference graph, the forward and the backward


def test_an_entry_replaced_by_another_models_valid_neff_is_recompiled_not_served(cache_dir):
    program, model, inputs = _program(seed=0)
    compile_exported(program)
    other = compile_exported(_program(seed=1)[0])  # the same graph with other weights: another valid NEFF
    store = CompileCache(str(cache_dir))
    (entry,) = [e for e in store.entries() if e.key != other.cache_entry[1]]
    (other_entry,) = [e for e in store.entries() if e.key == other.cache_entry[1]]
    data = open(other_entry.path, "rb").read()
    open(entry.path, "wb").write(data)  # the other model's NEFF in this entry's place ...
    sidecar = json.load(open(entry.path + ".json"))
    sidecar["sha256"] = hashlib.sha256(data).hexdigest()  # ... with its checksum made to match
    open(entry.path + ".json", "w").write(json.dumps(sidecar))
    again = compile_exported(program)
    assert not again.cache_hit
    out = run_neff(again.neff, [inputs[0].numpy()]).outputs[0]
    torch.testing.assert_close(torch.from_numpy(out), model(*inputs).detach(), rtol=1e-4, atol=1e-5)
    assert open(entry.path, "rb").read() != data  # the entry was recompiled, and is served from now on
    assert compile_exported(program).cache_hit


def test_the_key_inside_an_entry_stays_in_the_cache(cache_dir):
    program = _program()[0]
    compiled = compile_exported(program)
    cached = compile_exported(program)
    assert cached.cache_hit and encode(cached.neff) == encode(compiled.neff)  # what a user saves is the same
    assert compiled.neff.cache_key == cached.neff.cache_key == ""


KILLED_WRITER = """
import os, sys
from neuronc.atomic_file import write_atomically
os.replace = lambda *args: os.kill(os.getpid(), 9)  # killed after writing, before the rename
write_atomically(sys.argv[1], b"half a NEFF")
"""

LIVE_WRITER = """
import os, sys, time
from neuronc.atomic_file import write_atomically
def stall(*args):
    print("writing", flush=True)
    time.sleep(600)
os.replace = stall  # still writing (a large NEFF on a slow disk)
write_atomically(sys.argv[1], b"a NEFF being written")
"""


def _writer(script, path, wait=True):
    """A child process writing `path` with write_atomically; `script` decides how far it gets."""
    child = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    if wait:
        assert child.wait(timeout=60) == -9
    else:
        assert child.stdout.readline() == "writing\n"
    return child


def _temporary_files(directory):
    return sorted(p.name for p in directory.rglob("*.tmp"))


def test_a_killed_writers_temporary_file_is_listed_and_removed_by_clear(cache_dir):
    compile_exported(_program()[0])
    (entry,) = CompileCache(str(cache_dir)).entries()
    _writer(KILLED_WRITER, entry.path)
    (orphan,) = _temporary_files(cache_dir)
    runner = CliRunner()
    listing = runner.invoke(main, ["cache", "list"])
    assert listing.exit_code == 0 and "1 orphaned temporary file" in listing.output and orphan in listing.output
    cleared = runner.invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0, cleared.output
    assert "removed 1 entries and 1 orphaned temporary file" in cleared.output
    assert _temporary_files(cache_dir) == [] and CompileCache(str(cache_dir)).entries() == []


def test_prune_removes_orphaned_temporary_files_too(cache_dir):
    compile_exported(_program()[0])
    (entry,) = CompileCache(str(cache_dir)).entries()
    _writer(KILLED_WRITER, entry.path)
    pruned = CliRunner().invoke(main, ["cache", "prune", "--max-size", "1G"])
    assert pruned.exit_code == 0 and "removed 0 entries" in pruned.output and "1 orphaned" in pruned.output
    assert _temporary_files(cache_dir) == [] and len(CompileCache(str(cache_dir)).entries()) == 1


def test_a_live_writers_temporary_file_is_never_removed(cache_dir):
    compile_exported(_program()[0])
    (entry,) = CompileCache(str(cache_dir)).entries()
    writer = _writer(LIVE_WRITER, entry.path, wait=False)
    try:
        (being_written,) = _temporary_files(cache_dir)
        runner = CliRunner()
        listing = runner.invoke(main, ["cache", "list"])
        assert "1 temporary file being written" in listing.output and being_written in listing.output
        cleared = runner.invoke(main, ["cache", "clear"])
        assert "1 temporary file being written, left in place" in cleared.output
        CompileCache(str(cache_dir)).remove(entry.key)
        compile_exported(_program()[0])  # a store into this shard ages out its orphans, and only them
        assert _temporary_files(cache_dir) == [being_written]
    finally:
        writer.kill()
        writer.wait()
    assert _temporary_files(cache_dir) == [being_written]  # its writer died: now an orphan
    CliRunner().invoke(main, ["cache", "clear"])
    assert _temporary_files(cache_dir) == []


def test_a_store_ages_out_orphaned_temporary_files(cache_dir):
    compile_exported(_program()[0])
    (entry,) = CompileCache(str(cache_dir)).entries()
    _writer(KILLED_WRITER, entry.path)
    shard = os.path.dirname(entry.path)
    # Left by a writer that took no lock (an older neuronc): orphaned once older than ORPHAN_AGE_S
    old, young = os.path.join(shard, "x.neff.0badf00d.tmp"), os.path.join(shard, "y.neff.0badf00d.tmp")
    for path in (old, young):
        open(path, "wb").write(b"part of a NEFF")
    long_ago = time.time() - ORPHAN_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    store = CompileCache(str(cache_dir))
    store.remove(entry.key)
    compile_exported(_program()[0])  # stored into the same shard again
    assert _temporary_files(cache_dir) == ["y.neff.0badf00d.tmp"]


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_directory_that_is_a_file_or_cannot_be_made_is_refused_before_compiling(
        tmp_path, monkeypatch, saved_program, where):
    plain = tmp_path / "plain"
    plain.write_text("not a directory")
    url = plain if where == "a file" else plain / "cache"
    monkeypatch.setenv("NEURON_CC_FLAGS", "")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(url))
    pt2 = saved_program(*zoo.build("mlp"))
    monkeypatch.setattr("neuronc.compiler.compile_exported", _must_not_compile)
    result = CliRunner().invoke(main, ["compile", str(pt2), "-o", str(tmp_path / "m.neff")])
    assert result.exit_code == 1 and not isinstance(result.exception, _Compiled), result.exception
    assert f"NEURON_COMPILE_CACHE_URL={url}" in result.output and "hint:" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "m.neff").exists()
    with pytest.raises(NeuronConfigError, match=str(plain)):
        CompileCache.from_env()


class _Compiled(Exception):
    pass


def _must_not_compile(*args, **kwargs):
    raise _Compiled("compiled although a setting was bad")


def test_a_failed_store_is_a_warning_and_the_compilation_is_not_lost(cache_dir, monkeypatch, caplog):
    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr("neuronc.cache.write_atomically", disk_full)
    program, model, inputs = _program()
    with caplog.at_level("WARNING", logger="neuronc"):
        compiled = compile_exported(program)
    assert "No space left on device" in caplog.text and "compile cache" in caplog.text
    out = run_neff(compiled.neff, [inputs[0].numpy()]).outputs[0]
    torch.testing.assert_close(torch.from_numpy(out), model(*inputs).detach(), rtol=1e-4, atol=1e-5)


def test_an_entrys_key_is_kept_in_its_neff_header():
    from neuronc.neff import decode

    neff = compile_exported(_program()[0]).neff
    neff.cache_key = "ab" * 32
    assert decode(encode(neff)).cache_key == "ab" * 32
    neff.cache_key = ""
    assert decode(encode(neff)).cache_key == ""
