"""Repeated layers synchronised once (issue 24): a period of the program that repeats the one before it takes that
period's waits when its boundary state proves them the same (neuronc/codegen/sync_replay.py). The NEFF is the one the
sync pass makes instruction by instruction, byte for byte, in this very tree; a period whose boundary differs is
computed one by one."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

from neuronc import compiler, ir
from neuronc.codegen import generate, sync_replay
from neuronc.codegen.sync import insert_waits
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.isa import AccessPattern, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff import encode
from neuronc.neff.program import TensorEntry, TensorKind
from neuronc.targets import get_target
from tests import zoo


@pytest.fixture
def replays(monkeypatch):
    """The outcome of every replay attempted: True where a period took the one before's waits."""
    outcomes = []
    replay = sync_replay._replay

    def counting(*args):
        result = replay(*args)
        outcomes.append(result is not None)
        return result

    monkeypatch.setattr(sync_replay, "_replay", counting)
    return outcomes


def _neff_bytes(exported, monkeypatch, replay: bool, options: CompileOptions | None = None) -> bytes:
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors: the same in both
    monkeypatch.setattr(compiler, "generate", functools.partial(generate, replay=replay))
    return encode(compile_exported(exported, options or CompileOptions()).neff)


def test_a_gpt2_makes_the_same_neff_with_replay_attempted(replays, monkeypatch):
    """Five layers: a period of two layers (an odd number of kernels per layer) repeats once after the first. On this
    small model the boundary check refuses it, rightly: the first period writes scratch no earlier instruction
    touched, the second writes cells the first period used, so its writes must wait for the first period's accesses
    where the first period's waited for nothing (the HF GPT-2 of the benchmark replays every period it attempts). One
    dtype: bf16 (a one-layer period) is the MLP's case below."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=5, heads=2, context=32).eval()
    exported = torch.export.export(model, (torch.randint(0, 64, (1, 32)),))
    replayed = _neff_bytes(exported, monkeypatch, True)
    assert replays  # a repeated period was found and its replay attempted
    assert replayed == _neff_bytes(exported, monkeypatch, False)


@pytest.fixture
def compared(monkeypatch):
    """(cells of the profile, cells whose boundary state was compared) of every replay: fewer where the period before
    was itself replayed and the cell's state is the one it wrote (sync_replay._unproved)."""
    counts = []
    unproved = sync_replay._unproved

    def counting(profile, *args):
        checked = unproved(profile, *args)
        counts.append((len(profile["cells"]), len(profile["cells"]) if checked is None else len(checked)))
        return checked

    monkeypatch.setattr(sync_replay, "_unproved", counting)
    return counts


@pytest.mark.parametrize(("dtype", "blocks", "level", "replayed"), [
    (torch.float32, 12, 0, 3),  # three periods in a row replayed: the later ones through the first one's profile
    (torch.bfloat16, 8, 0, 0),
    (torch.float32, 8, 2, 0),  # prefetch on; DMA queues turn round robin, so no period sees the same queues' counts
])
def test_an_mlp_stack_makes_the_same_neff_with_its_blocks_synchronised_once(dtype, blocks, level, replayed, replays,
                                                                            monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(64, 64), nn.Tanh())]).eval().to(dtype)
    exported = torch.export.export(model, (torch.randn(32, 64, dtype=dtype),))
    bytes_replayed = _neff_bytes(exported, monkeypatch, True, CompileOptions(opt_level=level))
    assert replays  # a period was found and its replay attempted
    assert sum(replays) >= replayed
    assert bytes_replayed == _neff_bytes(exported, monkeypatch, False, CompileOptions(opt_level=level))


def _copy(queue: int, kernel: int, dst: AccessPattern, src: AccessPattern) -> Instruction:
    return Instruction(Opcode.DMA_COPY, Engine.DMA, (dst, src), queue=queue, kernel=kernel)


def _rows(first: int, rows: int = 64) -> AccessPattern:
    """`rows` rows of a [1024, 64] fp32 HBM tensor from row `first`."""
    return AccessPattern(Space.HBM, DType.F32, first * 64 * 4, ((64, rows), (1, 64)))


SBUF_TILE = AccessPattern(Space.SBUF, DType.F32, 0, ((1, 64), (1, 64)))
PERIODS = 5


def _program(earlier_write: bool) -> tuple:
    """(instructions, repeats): five periods of one load (queue 0, rows 0, 64, ..., 256) and one store (queue 1, rows
    512, 576, ...) through one SBUF tile, after an access of queue 5: with `earlier_write`, a write of rows 128-191,
    which only the third period reads (its load must wait for it, the second period's load did not, and the fourth's
    does not); else a load of rows 0-319 (the periods' inputs, only read: nothing to wait for). The second period is
    not the first's replay either way: its load overwrites the tile the first period's store read (a wait the first
    period's load did not have); from the third on, each load waits for the store before it alike."""
    other = AccessPattern(Space.SBUF, DType.F32, 65536, ((1, 320), (1, 64)))
    first = [_copy(5, 0, _rows(128), other) if earlier_write else _copy(5, 0, other, _rows(0, 320))]
    periods = [[_copy(0, 1 + k, SBUF_TILE, _rows(64 * k)), _copy(1, 1 + k, _rows(512 + 64 * k), SBUF_TILE)]
               for k in range(PERIODS)]
    instructions = first + [inst for period in periods for inst in period]
    repeats = {id(inst): ("layer", row) for period in periods for row, inst in enumerate(period)}
    return instructions, repeats


TENSORS = [TensorEntry("x", TensorKind.SCRATCH, DType.F32, (1024, 64), 0)]


def waits_as_one_by_one(program: tuple, same_program: tuple) -> list:
    """Two copies of (instructions, repeats): the first's waits inserted one instruction by one, the second's with
    its periods replayed where proved; asserts both got the same waits; returns the second's instructions."""
    alone, _ = program
    insert_waits(alone, TENSORS, get_target("trn2"))
    instructions, repeats = same_program
    insert_waits(instructions, TENSORS, get_target("trn2"), repeats=repeats)
    assert [inst.waits for inst in instructions] == [inst.waits for inst in alone]
    return instructions


@pytest.mark.parametrize("earlier_write", [False, True])
def test_a_period_takes_the_waits_of_the_one_before_only_when_its_boundary_gives_the_same(earlier_write, replays):
    instructions = waits_as_one_by_one(_program(earlier_write), _program(earlier_write))
    # periods 2-5: the second never; the third and fourth not when the earlier write is live in one of each pair
    assert replays == ([False, False, False, True] if earlier_write else [False, True, True, True])
    assert Wait(Engine.DMA, 1, 1) in instructions[3].waits  # the second load waits for the first store's read
    assert (Wait(Engine.DMA, 5, 1) in instructions[5].waits) == earlier_write


def _chain(earlier_write: bool) -> tuple:
    """(instructions, repeats): five periods, each loading the rows the one before stored (rows 64k -> SBUF -> rows
    64(k + 1), queues 0 and 1: a residual stream, where each period starts from the state its predecessor wrote)
    and an input of its own (rows 512 + 64k, queue 2, into a second tile). With `earlier_write`, queue 5 writes the
    fourth period's own input before them all: a state no predecessor wrote, which induction must not assume."""
    other = AccessPattern(Space.SBUF, DType.F32, 65536, ((1, 64), (1, 64)))
    spare = AccessPattern(Space.SBUF, DType.F32, 131072, ((1, 64), (1, 64)))
    first = [_copy(5, 0, _rows(512 + 64 * 3), spare)] if earlier_write else []
    periods = [[_copy(0, 1 + k, SBUF_TILE, _rows(64 * k)), _copy(2, 1 + k, other, _rows(512 + 64 * k)),
                _copy(1, 1 + k, _rows(64 * (k + 1)), SBUF_TILE)] for k in range(PERIODS)]
    instructions = first + [inst for period in periods for inst in period]
    return instructions, {id(inst): ("layer", row) for period in periods for row, inst in enumerate(period)}


@pytest.mark.parametrize("earlier_write", [False, True])
def test_a_period_replayed_after_a_replayed_period_compares_only_the_cells_its_predecessor_wrote_by_induction(
        earlier_write, replays, compared):
    """Induction: once a period was replayed, the next one's boundary is proved by comparing only the cells its
    predecessor did not write (the load of the rows the predecessor stored and the tile it wrote are not compared;
    the period's own input is), and the waits stay those of the one-by-one pass. The second period is refused (its
    load overwrites the tile the first period's store read: a wait the first period's load did not have), so the
    third compares every cell and the fourth inherits: with the earlier write to its own input, the fourth is
    refused (its load must wait for queue 5) and so is the fifth (whose predecessor had that wait)."""
    waits_as_one_by_one(_chain(earlier_write), _chain(earlier_write))
    assert replays == ([False, True, False, False] if earlier_write else [False, True, True, True])
    assert [checked < cells for cells, checked in compared] == [False, False, True, not earlier_write]
    assert all(checked > 0 for _, checked in compared)  # the period's own input is always compared


def test_an_mlp_stack_replayed_by_induction_makes_the_same_neff(replays, compared, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(64, 64), nn.Tanh())]).eval()
    exported = torch.export.export(model, (torch.randn(32, 64),))
    bytes_replayed = _neff_bytes(exported, monkeypatch, True, CompileOptions(opt_level=0))
    assert sum(replays) >= 3
    assert any(checked < cells for cells, checked in compared)
    assert bytes_replayed == _neff_bytes(exported, monkeypatch, False, CompileOptions(opt_level=0))
