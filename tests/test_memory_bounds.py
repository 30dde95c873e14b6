"""Host memory follows what a program touches, not what a file declares, and is given back on every
failure: a NEFF declaring gigabytes of HBM, a `.pt2` buffer expanded to gigabytes, a device allocation the
host cannot hold, a process compiling graph after graph. Where the memory really is not there, the error
is neuronc's (DeviceOutOfMemoryError / NeuronCompileError), raised before anything is allocated.

Tests that would try a huge allocation before their fix run in a child with an address-space limit a
little above what it has mapped once torch is imported, so a regression fails instead of eating the
machine's memory."""
from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from neuronc.errors import DeviceOutOfMemoryError, NeuronRuntimeError
from neuronc.isa import Engine, Opcode
from neuronc.neff.program import TensorKind
from neuronc.targets import get_target
from runtime import NeuronCore
from tests.test_runtime import Program, chip, done, hbm

GIB = 2**30
TRN2 = get_target("trn2")

_LIMITED = """
import resource, torch
def _mapped():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
_limit = _mapped() + {headroom}
resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))
"""


def run_limited(code: str, headroom: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a child Python whose address space may grow ``headroom`` bytes past torch's."""
    import os

    script = _LIMITED.format(headroom=headroom) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=os.path.dirname(os.path.dirname(__file__)))


def _far_apart_copy(hbm_size: int):
    """A copy from an input at HBM byte 0 to an output near the end of ``hbm_size`` declared bytes."""
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (4, 8))
    y = p.tensor("y", TensorKind.OUTPUT, (4, 8))
    y.offset = hbm_size - 4096
    tile = chip((4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), tile, queue=1, waits=done(Engine.DMA))
    neff = p.neff()
    neff.hbm_size = hbm_size
    return neff


def test_a_neff_declaring_all_of_hbm_runs_in_host_memory_for_its_tensors_only(tmp_path):
    from neuronc.neff.writer import save

    save(_far_apart_copy(TRN2.hbm_bytes), str(tmp_path / "sparse.neff"))
    result = run_limited(f"""
        import numpy as np
        from runtime import run_neff
        x = np.arange(32, dtype=np.float32).reshape(4, 8)
        out = run_neff({str(tmp_path / "sparse.neff")!r}, [x]).outputs[0]
        print("copied", bool((out == x).all()))
    """, headroom=GIB)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "copied True" in result.stdout


def test_tensors_beyond_the_host_budget_are_refused_before_allocation(monkeypatch):
    monkeypatch.setenv("NEURONC_HOST_MEMORY_BUDGET", "64K")
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (128, 256))  # 128 KiB
    y = p.tensor("y", TensorKind.OUTPUT, (128, 256))
    tile = chip((128, 256))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), tile, queue=1, waits=done(Engine.DMA))
    with pytest.raises(DeviceOutOfMemoryError, match="(?s)budget of 65536 bytes.*NEURONC_HOST_MEMORY_BUDGET"):
        NeuronCore("trn2").load(p.neff()).run([np.zeros((128, 256), np.float32)])  # (the access check's tables, 3/4
        # of the tensors' bytes here, are refused at load already)


def test_an_hbm_operand_outside_every_tensor_is_refused_at_load():
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (4, 8))
    y = p.tensor("y", TensorKind.OUTPUT, (4, 8))
    stray = dataclasses.replace(hbm(x), offset=y.offset + y.nbytes + 64)
    tile = chip((4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, stray)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), tile, queue=1, waits=done(Engine.DMA))
    neff = p.neff()
    neff.hbm_size += 4096
    with pytest.raises(NeuronRuntimeError, match="no tensor of the program holds"):
        NeuronCore("trn2").load(neff)


def test_a_failed_device_allocation_gives_its_hbm_back():
    result = run_limited("""
        import neuronc.pytorch.device
        from neuronc.pytorch.device_memory import core
        kept = torch.ones(4, device="neuron")
        before = core(0).hbm.in_use
        failures = []
        for _ in range(11):  # 11 GiB: the host limit is 1 GiB, trn2's HBM 12 GiB
            try:
                torch.empty(2**30, dtype=torch.uint8, device="neuron")
            except Exception as err:  # noqa: BLE001 - the kind is checked below
                failures.append(type(err).__name__)
        print("failures", sorted(set(failures)), len(failures))
        print("leaked", core(0).hbm.in_use - before)
        print("then", torch.ones(2**20, device="neuron").sum().item())
    """, headroom=GIB)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "failures ['DeviceOutOfMemoryError'] 11" in result.stdout
    assert "leaked 0" in result.stdout
    assert "then 1048576.0" in result.stdout


class _ExpandedBuffer(torch.nn.Module):
    """A 1 x 4 buffer expanded to 2^30 x 4 (16 GiB as a dense fp32 tensor, 16 bytes in its storage)."""

    def __init__(self, rows: int = 8):
        super().__init__()
        self.rows = rows
        self.register_buffer("table", torch.tensor([[1.0, 2.0, 3.0, 4.0]]).expand(2**30, 4))

    def forward(self, x):
        return x + self.table[:self.rows]


class _WholeTable(_ExpandedBuffer):
    def forward(self, x):
        return self.table * x[0]  # a 16 GiB output


@pytest.fixture(scope="module")
def huge_buffer_compiles(tmp_path_factory):
    """The output of one child, limited to 3 GiB past torch's mapping, compiling both programs above: the expanded
    buffer (compiled and run), then the whole table (refused). One child checks both (a second would import torch
    and the compiler again); the second compile has less room, not more, than in a child of its own."""
    paths = {}
    for name, model in (("expanded", _ExpandedBuffer()), ("whole", _WholeTable())):
        paths[name] = tmp_path_factory.mktemp("huge") / f"{name}.pt2"
        torch.export.save(torch.export.export(model, (torch.randn(8, 4),)), str(paths[name]))
    result = run_limited(f"""
        import sys, traceback
        import numpy as np
        from neuronc.compiler import compile_exported
        from neuronc.errors import NeuronCompileError
        from runtime import NeuronCore
        try:
            neff = compile_exported({str(paths["expanded"])!r}).neff
            table = next(t for t in neff.tensors if t.name == "table")
            print("stored", table.shape, table.nbytes)
            x = np.ones((8, 4), np.float32)
            print("out", NeuronCore("trn2").load(neff).run([x]).outputs[0][0].tolist())
            del neff
        except Exception:  # noqa: BLE001 - printed for the test that reads this part
            traceback.print_exc(file=sys.stdout)
        try:
            compile_exported({str(paths["whole"])!r})
        except NeuronCompileError as err:
            print("refused:", err)
    """, headroom=3 * GIB, env={"NEURON_CC_FLAGS": "--no_cache", "NEURONC_VERIFY_IR": "1"})  # (conftest.verified_ir
    # sets it for each test, after module fixtures run)
    return f"exit status {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"


def test_an_expanded_buffer_compiles_to_its_distinct_elements(huge_buffer_compiles):
    assert "stored (1, 4) 16" in huge_buffer_compiles, huge_buffer_compiles
    assert "out [2.0, 3.0, 4.0, 5.0]" in huge_buffer_compiles  # x + table, as eager computes it


def test_a_program_needing_more_hbm_than_the_core_has_is_refused_before_codegen(huge_buffer_compiles):
    assert "refused: the program needs 16.00 GiB of HBM, but a trn2 NeuronCore has 12.00 GiB" in huge_buffer_compiles, \
        huge_buffer_compiles
    assert huge_buffer_compiles.startswith("exit status 0\n")

def test_compiled_graphs_are_not_kept_alive_by_the_backend():
    from neuronc.pytorch import backend

    count = backend.compile_count()
    compiled = torch.compile(torch.sin, backend="neuron")
    compiled(torch.randn(8, 8))
    function = backend.compiled_graphs[-1]
    assert backend.compile_count() == count + 1
    first_core = function.program.core
    torch._dynamo.reset()
    del compiled, function
    gc.collect()
    with pytest.raises(LookupError, match="was freed"):
        backend.compiled_graphs[count]
    assert backend.compile_count() == count + 1  # still counted
    torch.compile(torch.cos, backend="neuron")(torch.randn(8, 8))
    assert backend.compiled_graphs[-1].program.core.on_chip is first_core.on_chip  # one SBUF/PSUM per target
    torch._dynamo.reset()



def _extra_memory_of(monkeypatch, method: str) -> list:
    """The peak extra host memory (bytes, traced) of each call of ``LoadedProgram.<method>``, filled as it runs."""
    import tracemalloc

    from runtime.core import LoadedProgram

    growth, original = [], getattr(LoadedProgram, method)

    def measured(*args):
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            return original(*args)
        finally:
            growth.append(tracemalloc.get_traced_memory()[1] - before)
            tracemalloc.stop()

    monkeypatch.setattr(LoadedProgram, method, measured)
    return growth


def _gigabyte_program(kind: TensorKind, reads_it: bool) -> Program:
    """A copy of a small input into a 1 GiB tensor's first 128 bytes, then (``reads_it``) a read of its last bytes."""
    from neuronc.isa import AccessPattern, Space

    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (4, 8))
    y = p.tensor("y", kind, (2**26, 4))  # 1 GiB of float32
    tile = chip((4, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, hbm(x))
    first_bytes = AccessPattern(Space.HBM, y.dtype, y.offset, ((8, 4), (1, 8)))
    p.emit(Opcode.DMA_COPY, Engine.DMA, first_bytes, tile, queue=1, waits=done(Engine.DMA))
    if reads_it:
        last_bytes = AccessPattern(Space.HBM, y.dtype, y.offset + GIB - 128, ((8, 4), (1, 8)))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((4, 8), offset=4096), last_bytes, queue=2, waits=done(Engine.DMA, 1, 1))
    return p


def test_an_output_nothing_fully_writes_is_refused_in_bounded_extra_memory(monkeypatch):
    """Found by `fuzz_neff --seed 3` (case 4739, an output grown to 1 GiB): the scan for its unwritten bytes made a
    second array the size of the output, a raw MemoryError under an address-space limit instead of the refusal."""
    growth = _extra_memory_of(monkeypatch, "_check_outputs_written")
    with pytest.raises(NeuronRuntimeError, match=r"never writes byte 128 of output 0 \('y'"):
        NeuronCore("trn2").load(_gigabyte_program(TensorKind.OUTPUT, reads_it=False).neff())
    assert growth and growth[0] < 64 * 2**20, growth  # chunks of the scan, not a copy of the output


def test_a_read_of_bytes_nothing_wrote_is_refused_in_bounded_extra_memory(monkeypatch):
    """Found by `fuzz_neff --seed 3` (case 17077, a scratch grown to 1 GiB and read): naming the instruction that
    writes the byte later made a fresh table of marks the size of HBM, a raw MemoryError instead of the refusal."""
    growth = _extra_memory_of(monkeypatch, "_bad_read")
    with pytest.raises(NeuronRuntimeError, match=r"reads HBM byte \d+ \(of scratch 'y'\), which nothing wrote"):
        NeuronCore("trn2").load(_gigabyte_program(TensorKind.SCRATCH, reads_it=True).neff())
    assert growth and growth[0] < 64 * 2**20, growth


def _resident_mib() -> float:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_an_input_read_in_place_from_the_hosts_array_takes_no_host_memory_in_the_programs_hbm():
    """A compiled model's parameters are bound (``bind_inputs``): the program's HBM keeps bytes for them that
    nothing reads, which filling them with 0xFF at the first run made resident (GPT-2 small's training
    forward: 475 MiB beside the parameters themselves)."""
    p = Program()
    x = p.tensor("x", TensorKind.INPUT, (2**26,))  # 256 MiB
    y = p.tensor("y", TensorKind.OUTPUT, (1, 8))
    tile = chip((1, 8))
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, dataclasses.replace(hbm(y), offset=x.offset))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y), tile, queue=1, waits=done(Engine.DMA))
    program = NeuronCore("trn2").load(p.neff())
    parameters = np.arange(2**26, dtype=np.float32)  # resident: written whole
    before = _resident_mib()
    program.bind_inputs({0: parameters})  # (makes the program's HBM)
    out = program.run([None]).outputs[0]
    grown = _resident_mib() - before
    np.testing.assert_array_equal(out, parameters[:8].reshape(1, 8))
    assert grown < 64, f"binding and the first run made {grown:.0f} MiB resident"
