"""An elementwise or row-wise op at a new row count (from the third met at its row width) runs its looped program
(neuronc/codegen/row_loops.py, runtime/loops.py): one program for every row count at a row width, no compile and no
load per new count, exact against CPU eager."""
from __future__ import annotations

import collections

import pytest
import torch

from neuronc.errors import NeuronConfigError
from neuronc.pytorch import eager

ROWS = (1, 127, 128, 129, 1000, 2, 64, 300)


@pytest.fixture
def fresh(neuron, monkeypatch):
    """No program or looped program made by earlier tests, none from the disk cache, no op on the CPU."""
    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    monkeypatch.setenv(eager.LOOPS_ENV, "1")
    monkeypatch.setattr(eager, "programs", {})
    monkeypatch.setattr(eager, "sizes_met", {})
    monkeypatch.setattr(eager, "families", {})
    monkeypatch.setattr(eager, "rows_met", {})
    monkeypatch.setattr(eager, "compile_stats", collections.Counter())
    return monkeypatch


def _special(n, c, dtype=torch.float32):
    x = torch.randn(n, c) * 3
    flat = x.view(-1)
    flat[0] = float("nan")
    if flat.numel() > 2:
        flat[1], flat[-1] = float("-inf"), float("inf")
    return x.to(dtype)


CASES = {
    "ones_times_2": (lambda x: x * 2, lambda n: torch.ones(n, 24)),
    "mul_scalar_nan_inf": (lambda x: x * 0.3, lambda n: _special(n, 24)),
    "add": (lambda x, y: x + y, lambda n: (_special(n, 40), torch.randn(n, 40))),
    "relu_bf16": (torch.relu, lambda n: _special(n, 33, torch.bfloat16)),
    "sigmoid_3d": (torch.sigmoid, lambda n: torch.randn(n, 3, 5)),
    "int_floor_divide": (lambda x: torch.floor_divide(x, 3), lambda n: torch.randint(-50, 50, (n, 16), dtype=torch.int32)),
    "where": (lambda c, x, y: torch.where(c, x, y), lambda n: (torch.rand(n, 8) > 0.5, torch.randn(n, 8), torch.randn(n, 8))),
    "one_dim": (lambda x: x * x - 1, lambda n: torch.randn(n)),
    "softmax_rows": (lambda x: torch.softmax(x, -1), lambda n: _special(n, 50)),
    "log_softmax_bf16": (lambda x: torch.log_softmax(x, 1), lambda n: torch.randn(n, 70).bfloat16()),
    "softmax_backward": (lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, torch.float32),
                         lambda n: (torch.randn(n, 40), torch.softmax(torch.randn(n, 40), -1))),
}
OPS = {"one_dim": 2}  # ops of a case (1 unless listed): each gets its looped program
NOT_CPU_BITS = {"sigmoid_3d", "softmax_rows", "log_softmax_bf16", "softmax_backward"}  # the device's exp and sums are
# within tolerance of the CPU's, not their values


def _run(fn, inputs, device):
    return fn(*[x.to(device) for x in inputs]).cpu()


def _bits(x):
    return x if x.dtype == torch.bool else x.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", list(CASES))
def test_every_row_count_runs_one_looped_program_with_its_own_programs_bits(fresh, neuron, name):
    fn, make = CASES[name]
    torch.manual_seed(0)
    cases = {n: make(n) for n in (3, 4, *ROWS)}
    cases = {n: x if isinstance(x, tuple) else (x,) for n, x in cases.items()}
    fresh.setenv(eager.LOOPS_ENV, "0")
    fresh.setenv(eager.BUCKETS_ENV, "0")
    own = {n: _run(fn, x, neuron) for n, x in cases.items()}  # each row count's own program
    fresh.setattr(eager, "programs", {})
    fresh.setattr(eager, "sizes_met", {})
    fresh.setattr(eager, "rows_met", {})
    fresh.setenv(eager.LOOPS_ENV, "1")
    _run(fn, cases[3], neuron)  # the op's first two row counts: their own programs (or their buckets')
    _run(fn, cases[4], neuron)
    looped = eager.compile_stats["looped"]
    for n in ROWS:  # from its third row count on: the looped program
        got = _run(fn, cases[n], neuron)
        expected = fn(*cases[n])
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(_bits(got), _bits(own[n])), n
        # CPU eager's values exactly (a NaN as a NaN: the device's NaN bits are its own), or within fp32 tolerance
        torch.testing.assert_close(got, expected, **({} if name in NOT_CPU_BITS else {"rtol": 0, "atol": 0}),
                                   equal_nan=True)
    ops = OPS.get(name, 1)
    assert eager.compile_stats["looped"] == looped + ops * len(ROWS)
    assert len(eager.families) == ops and not any(isinstance(f, str) for f in eager.families.values())


def test_the_first_two_row_counts_run_their_own_programs_and_the_third_makes_the_looped_program(fresh, neuron):
    (torch.randn(3, 16).to(neuron) * 2).cpu()
    (torch.randn(3, 16).to(neuron) * 2).cpu()
    assert not eager.families and eager.compile_stats["looped"] == 0 and eager.compile_stats["lowered"] == 1
    (torch.randn(5, 16).to(neuron) * 2).cpu()
    assert not eager.families and eager.compile_stats["looped"] == 0
    (torch.randn(7, 16).to(neuron) * 2).cpu()
    assert len(eager.families) == 1 and eager.compile_stats["looped"] == 1


def test_a_new_row_count_compiles_nothing_once_the_looped_program_exists(fresh, neuron):
    for n in (5, 6, 9):  # the third row count makes the looped program: its tile programs compile once
        (torch.randn(n, 16).to(neuron) * 2).cpu()
    compiled = eager.compile_stats["lowered"]
    loads = len(eager.families)
    for n in (7, 100, 555, 1):
        assert torch.equal((torch.full((n, 16), 1.5).to(neuron) * 2).cpu(), torch.full((n, 16), 3.0))
    assert eager.compile_stats["lowered"] == compiled and len(eager.families) == loads


def test_the_looped_launch_lasts_its_iterations_on_the_timeline(fresh, neuron):
    for n in (3, 1, 2):
        (torch.randn(n, 16).to(neuron) * 2).cpu()
    [family] = eager.families.values()
    program = family[0]
    one_tile = program.at((1, 0, 0, 0, 0, 0, 0, 0)).time().estimated_ns
    (torch.randn(300, 16).to(neuron) * 2).cpu()  # 2 tiles of 128, then 32, 8 and 4 rows
    [entry] = [e for key, e in eager.programs.items() if key[0][1] and key[0][1][0][0] == (300, 16)]
    assert entry.duration_ns > 2 * one_tile
    assert entry.duration_ns == program.at((2, 0, 1, 0, 1, 1, 0, 0)).time().estimated_ns


def test_rows_past_the_looped_programs_capacity_compile_for_their_own_shape(fresh, neuron, monkeypatch):
    monkeypatch.setattr(eager, "MAX_TILES", 1)
    for n in (3, 4, 5):
        (torch.randn(n, 8).to(neuron) * 2).cpu()
    looped = eager.compile_stats["looped"]
    x = torch.randn(300, 8)
    assert torch.equal((x.to(neuron) * 2).cpu(), x * 2)
    assert eager.compile_stats["looped"] == looped


def test_loops_off_by_default_keeps_the_per_shape_programs_and_a_bad_value_is_refused(fresh, neuron):
    fresh.delenv(eager.LOOPS_ENV)  # the default: off
    for n in (3, 4, 5):
        (torch.randn(n, 8).to(neuron) * 2).cpu()
    fresh.setenv(eager.LOOPS_ENV, "0")
    for n in (6, 9):
        (torch.randn(n, 8).to(neuron) * 2).cpu()
    assert not eager.families and eager.compile_stats["looped"] == 0
    fresh.setenv(eager.LOOPS_ENV, "yes")
    with pytest.raises(NeuronConfigError, match="NEURON_EAGER_LOOPS"):
        torch.randn(17, 8).to(neuron) * 2


def test_an_op_whose_other_dims_change_at_one_row_count_makes_no_looped_program(fresh, neuron):
    # generate()'s attention: [1, heads, 1, key length], the key length growing at one row count
    for k in range(8, 14):
        x = torch.randn(1, 4, 1, k)
        assert torch.equal((x.to(neuron) * 2).cpu(), x * 2)
    assert not eager.families and eager.compile_stats["looped"] == 0
    for n in (3, 5):  # a second row count at a width met before, then a third: the looped program
        x = torch.randn(n, 4, 1, 13)
        assert torch.equal((x.to(neuron) * 2).cpu(), x * 2)
    assert len(eager.families) == 1 and eager.compile_stats["looped"] == 1


def test_a_softmax_along_the_first_dim_is_not_looped(fresh, neuron):
    for n in (3, 4, 5):
        x = torch.randn(n, 8)
        torch.testing.assert_close(torch.softmax(x.to(neuron), 0).cpu(), torch.softmax(x, 0))
    assert not eager.families


def test_broadcast_operands_are_not_looped(fresh, neuron):
    row = torch.randn(8)
    for n in (3, 4, 5, 6):
        x = torch.randn(n, 8)
        assert torch.equal((x.to(neuron) + row.to(neuron)).cpu(), x + row)
    assert not eager.families
