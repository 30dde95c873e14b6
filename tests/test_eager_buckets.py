"""Shape buckets for eager ops (neuronc/frontend/aten_buckets.py, neuronc.pytorch.eager.BucketedProgram): an op at
a new size runs the program of its bucket on padded operands and keeps the leading slice. Exact padding: each case
runs at two sizes of one bucket with buckets on, and again with them off (every size its own program): the bits
must be the same, and both match CPU eager; NaN and inf among the data, integer and bool dtypes, bf16. Reordering
padding (a matmul, a softmax or a float sum along a size that changed): the values of CPU eager, the same bits
at every call of a size, and none of it under NEURON_EAGER_BUCKETS=exact or deterministic algorithms."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuronc.frontend import aten_buckets
from neuronc.pytorch import eager
from tests.conftest import TOLERANCES, assert_matches_eager


@pytest.fixture
def fresh(neuron, monkeypatch):
    """No program compiled by earlier tests, none from the disk cache, no op on the CPU; no looped programs (an
    elementwise op's new row count runs its looped program before buckets are asked: tests/test_eager_loops.py)."""
    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    monkeypatch.setenv(eager.LOOPS_ENV, "0")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    monkeypatch.setattr(eager, "programs", {})
    monkeypatch.setattr(eager, "sizes_met", {})
    return monkeypatch


def _special(*shape, dtype=torch.float32):
    x = torch.randn(*shape)
    flat = x.view(-1)
    flat[0], flat[-1] = float("nan"), float("inf")
    if flat.numel() > 2:
        flat[1] = float("-inf")
    return x.to(dtype)


CASES = {
    # name: (fn, inputs at size n); every case is bucketed at n = 5 and 7 (bucket 8)
    "mul_scalar_nan_inf": (lambda a: a * 0.5 + 1.0, lambda n: (_special(n, 3),)),
    "add_broadcast_int32": (lambda a, b: a + b, lambda n: (torch.randint(-9, 9, (n, 1), dtype=torch.int32),
                                                           torch.randint(-9, 9, (n, 4), dtype=torch.int32))),
    "floor_divide_int64": (lambda a, b: a // b, lambda n: (torch.randint(-20, 20, (2, n)),
                                                           torch.randint(1, 5, (2, n)))),
    "where_isneginf": (lambda a: torch.where(torch.isneginf(a), torch.zeros(()), a).exp(), lambda n: (_special(2, n),)),
    "bf16_tanh": (lambda a: torch.tanh(a) * a, lambda n: (_special(n, 6, dtype=torch.bfloat16),)),
    "exp_last_dim": (lambda a: a.exp() - a.log1p(), lambda n: (_special(3, 2 * n + 3),)),
    "softmax_rows": (lambda a: a.softmax(-1), lambda n: (_special(n, 6),)),
    "log_softmax_dim0": (lambda a: a.log_softmax(0), lambda n: (torch.randn(6, n),)),
    "layer_norm_rows": (lambda a, w, b: F.layer_norm(a, (8,), w, b), lambda n: (torch.randn(2, n, 8), torch.randn(8),
                                                                                 torch.randn(8))),
    "sum_rows": (lambda a: a.sum(-1), lambda n: (_special(n, 5),)),
    "mean_keepdim": (lambda a: a.mean(1, keepdim=True), lambda n: (torch.randn(n, 6),)),
    "amax_ints": (lambda a: a.amax(0), lambda n: (torch.randint(-50, 50, (3, n)),)),
    "all_over_keys": (lambda a: torch.isneginf(a).all(-1, keepdim=True), lambda n: (
        torch.where(torch.rand(1, 4, 1, n) > 0.3, float("-inf"), 1.0),)),
    "any_bool": (lambda a: a.any(-1), lambda n: (torch.rand(3, n) > 0.8,)),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


def _on_device(fn, inputs, device):
    return fn(*[x.to(device) for x in inputs]).cpu()


@pytest.mark.parametrize("name", list(CASES))
def test_a_bucketed_op_has_the_bits_of_its_own_program(fresh, neuron, name):
    fn, make = CASES[name]
    torch.manual_seed(0)
    fresh.setenv(eager.BUCKETS_ENV, "1")
    _on_device(fn, make(3), neuron)  # the ops' first size: their own programs (an op is bucketed from its second)
    for n in (5, 7):
        inputs = make(n)
        fresh.setenv(eager.BUCKETS_ENV, "1")
        served = eager.compile_stats["bucketed"]
        bucketed = _on_device(fn, inputs, neuron)
        assert eager.compile_stats["bucketed"] > served, "no op of the case was served by a bucket"
        fresh.setenv(eager.BUCKETS_ENV, "0")
        eager.programs.clear()
        own = _on_device(fn, inputs, neuron)
        eager.programs.clear()
        assert torch.equal(_bits(bucketed), _bits(own)), f"n={n}: the bucketed result's bits differ"
        expected = fn(*inputs)
        assert bucketed.shape == expected.shape and bucketed.dtype == expected.dtype
        torch.testing.assert_close(bucketed, expected, equal_nan=True, **TOLERANCES[expected.dtype])


def test_sizes_of_one_bucket_share_its_program(fresh, neuron):
    fresh.setenv(eager.BUCKETS_ENV, "1")
    lowered = eager.compile_stats["lowered"]
    for n in (3, 5, 6, 7, 8):
        x = torch.randn(n, 4)
        assert_matches_eager(torch.relu(x.to(neuron)).cpu(), torch.relu(x))
    assert eager.compile_stats["lowered"] - lowered == 2  # relu at [3, 4] (its first), at [8, 4]: 5, 6, 7 pad to it
    entries = [e for e in eager.programs.values() if isinstance(e, eager.BucketedProgram)]
    assert sorted(e.outputs[0][0] for e in entries) == [(5, 4), (6, 4), (7, 4)]
    assert all(e.program is entries[0].program for e in entries)


def test_a_reduction_over_a_fixed_size_is_not_padded_over_it(fresh, neuron):
    """A sum or softmax whose rows change but whose reduced size does not pads the rows only: its bits are its own
    program's (the cases above), and its program reads the reduced size as it is."""
    fresh.setenv(eager.BUCKETS_ENV, "1")
    for fn in (lambda a: a.sum(-1), lambda a: a.softmax(-1)):
        fn(torch.randn(2, 5).to(neuron))
        x = torch.randn(3, 5)
        assert_matches_eager(fn(x.to(neuron)).cpu(), fn(x))
    inner = [e.inner for e in eager.programs.values() if isinstance(e, eager.BucketedProgram)]
    assert len(inner) == 2
    assert all(tuple(e.program.neff.inputs()[0].shape) == (4, 5) for e in inner)  # rows 3 -> 4, the 5 summed kept


def _decode_step(q, keys, values):
    """One token of generate()'s attention, as eager runs it: ``q @ K^T`` (the key length as the result's
    columns), softmax over it, ``probs @ V`` (the key length as the contraction)."""
    return (q @ keys.transpose(1, 2)).softmax(-1) @ values


def _keys(length, dtype=torch.float32):
    keys, values = torch.randn(4, length, 16), torch.randn(4, length, 16)
    keys[0, -1, :] = 50.0  # a key that takes nearly all of batch 0's attention ...
    values[1, 0, 0], values[2, -1, 3] = float("inf"), -0.0  # ... an inf and a signed zero among the values
    return keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_growing_key_length_is_served_by_its_bucket_with_eagers_values(fresh, neuron, dtype):
    """generate()'s per-token matmuls and softmax along the key length: one program per bucket, not per length;
    the padded terms are identities (-0.0 products, exp(-inf) = +0), so the values are CPU eager's."""
    fresh.setenv(eager.BUCKETS_ENV, "1")
    torch.manual_seed(0)
    q = torch.randn(4, 1, 16).to(dtype)
    _decode_step(*(x.to(neuron) for x in (q, *_keys(9, dtype)))).cpu()  # the first length: own programs
    served, lowered = eager.compile_stats["bucketed"], eager.compile_stats["lowered"]
    for length in range(10, 17):
        keys, values = _keys(length, dtype)
        got = _decode_step(q.to(neuron), keys.to(neuron), values.to(neuron)).cpu()
        expected = _decode_step(q.float(), keys.float(), values.float())
        torch.testing.assert_close(got.float(), expected, equal_nan=True, **TOLERANCES[dtype])
    assert eager.compile_stats["bucketed"] - served >= 3 * 6  # both matmuls and the softmax at 10..15 (16: its own)
    assert eager.compile_stats["lowered"] - lowered <= 4  # their programs at bucket 16 (and the transpose's copy)


def test_reordering_padding_keeps_infinities_nans_and_signed_zeros(fresh, neuron):
    fresh.setenv(eager.BUCKETS_ENV, "1")
    cases = [
        (lambda a: a.softmax(-1), lambda n: torch.full((2, n), float("-inf"))),  # a row of only -inf: NaN
        (lambda a: a.log_softmax(-1), lambda n: _special(3, n)),
        (lambda a: a.sum(-1), lambda n: torch.full((2, n), -0.0)),  # signed zeros: the sign eager gives
        (lambda a, b: a @ b, lambda n: (torch.full((2, n), -0.0), torch.full((n, 3), 1.0))),
        (lambda a, b: a @ b, lambda n: (_special(3, n), torch.randn(n, 2))),
    ]
    for fn, make in cases:
        first = make(4)
        fn(*(x.to(neuron) for x in (first if isinstance(first, tuple) else (first,)))).cpu()
        inputs = make(5)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        served = eager.compile_stats["bucketed"]
        got = fn(*(x.to(neuron) for x in inputs)).cpu()
        assert eager.compile_stats["bucketed"] == served + 1
        expected = fn(*inputs)
        torch.testing.assert_close(got, expected, equal_nan=True, **TOLERANCES[torch.float32])
        assert torch.equal(torch.signbit(got), torch.signbit(expected)) or expected.isnan().any()


def test_a_size_served_twice_gives_the_same_bits(fresh, neuron):
    fresh.setenv(eager.BUCKETS_ENV, "1")
    torch.manual_seed(2)
    q = torch.randn(4, 1, 16)
    _decode_step(*(x.to(neuron) for x in (q, *_keys(9))))
    keys, values = _keys(13)
    runs = [_decode_step(q.to(neuron), keys.to(neuron), values.to(neuron)).cpu() for _ in range(2)]
    assert torch.equal(_bits(runs[0]), _bits(runs[1]))


@pytest.mark.parametrize("exact", ["mode", "deterministic"])
def test_exact_mode_and_deterministic_algorithms_never_reorder_a_sum(fresh, neuron, exact):
    """With reordering an op's last bits at a size depend on whether it met another size first; either switch
    keeps every bucketed result its own program's, bit for bit: the key length compiles per length again."""
    fresh.setenv(eager.BUCKETS_ENV, "exact" if exact == "mode" else "1")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(exact == "deterministic")
    try:
        q = torch.randn(4, 1, 16)
        _decode_step(*(x.to(neuron) for x in (q, *_keys(9))))
        served = eager.compile_stats["bucketed"]
        for length in (10, 11):
            keys, values = _keys(length)
            assert_matches_eager(_decode_step(q.to(neuron), keys.to(neuron), values.to(neuron)).cpu(),
                                 _decode_step(q, keys, values))
        assert eager.compile_stats["bucketed"] == served
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_matmuls_and_float_sums_pad_only_the_sizes_that_changed():
    a, b = torch.randn(2, 5, 8), torch.randn(2, 8, 7)
    aten = torch.ops.aten
    assert aten_buckets.plan(aten.bmm.default, (a, b), {}) is None  # no reordering allowed: not bucketed
    assert aten_buckets.plan(aten.bmm.default, (a, b), {}, first=(a.shape, b.shape)) is None  # nothing changed
    assert aten_buckets.plan(aten.bmm.default, (a, b), {}, first=((2, 5, 4), (2, 4, 7))) is None  # 8: its bucket
    a, b = torch.randn(2, 5, 6), torch.randn(2, 6, 7)
    pads = aten_buckets.plan(aten.bmm.default, (a, b), {}, first=((2, 5, 4), (2, 4, 7)))
    assert pads == {0: aten_buckets.Pad((2, 5, 8), ((2, 0.0),)), 1: aten_buckets.Pad((2, 8, 7), ((1, -0.0),))}
    assert str(pads[1].fills[0][1]) == "-0.0"
    x = torch.randn(3, 6)
    assert aten_buckets.plan(aten.sum.dim_IntList, (x, [-1]), {}) == {0: aten_buckets.Pad((4, 6), ((0, "edge"),))}
    assert aten_buckets.plan(aten.sum.dim_IntList, (x, [-1]), {}, first=((3, 5), None)) == {
        0: aten_buckets.Pad((4, 8), ((0, "edge"), (1, -0.0)))}
    assert aten_buckets.plan(aten.mean.dim, (x, [-1]), {}, first=((3, 5), None)) == {
        0: aten_buckets.Pad((4, 6), ((0, "edge"),))}  # a mean divides by the count: never padded over it


def test_an_unknown_bucket_mode_is_refused(fresh, neuron):
    from neuronc.errors import NeuronConfigError

    fresh.setenv(eager.BUCKETS_ENV, "yes")
    with pytest.raises(NeuronConfigError, match="NEURON_EAGER_BUCKETS"):
        (torch.randn(3, 2).to(neuron) + 1.0).cpu()


@pytest.mark.parametrize("rows", [129, 200])
def test_rows_beyond_one_tile(fresh, neuron, rows):
    """Past 128 rows (one tile's partitions) the bucket's program has more tiles than the op's own."""
    torch.manual_seed(1)
    x = _special(rows, 12)
    for fn in (lambda a: a.softmax(-1), lambda a: a * 3.0 - 1.0, lambda a: a.sum(-1)):
        fresh.setenv(eager.BUCKETS_ENV, "1")
        _on_device(fn, (torch.randn(2, 12),), neuron)
        served = eager.compile_stats["bucketed"]
        bucketed = _on_device(fn, (x,), neuron)
        assert eager.compile_stats["bucketed"] > served
        fresh.setenv(eager.BUCKETS_ENV, "0")
        eager.programs.clear()
        own = _on_device(fn, (x,), neuron)
        eager.programs.clear()
        assert torch.equal(_bits(bucketed), _bits(own))
        torch.testing.assert_close(bucketed, fn(x), equal_nan=True, **TOLERANCES[torch.float32])


def test_in_place_and_out_forms_write_only_the_real_part(fresh, neuron):
    fresh.setenv(eager.BUCKETS_ENV, "1")
    (torch.randn(2, 3).to(neuron).mul_(2.0) + 1.0).cpu()  # the first size of mul and add
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    dx = x.to(neuron)
    dx.mul_(y.to(neuron))
    out = torch.empty(5, 3).to(neuron)
    torch.add(dx, 1.0, out=out)
    assert_matches_eager(out.cpu(), x * y + 1.0)
    assert_matches_eager(dx.cpu(), x * y)
    assert any(isinstance(e, eager.BucketedProgram) for e in eager.programs.values())


def test_the_timeline_counts_the_padded_work(fresh, neuron):
    """The device runs the bucket's program, so a launch lasts its duration (the padded work), plus the DMA
    of each padded operand's buffer and of the result's slice: nothing discounted for the rows not wanted."""
    from neuronc.instruction_cost import copy_ns
    from neuronc.pytorch.device_memory import core

    fresh.setenv(eager.BUCKETS_ENV, "1")
    (torch.randn(4, 64).to(neuron) * 2.0).cpu()
    x = torch.randn(5, 64)
    (x.to(neuron) * 2.0).cpu()
    entry = next(e for e in eager.programs.values() if isinstance(e, eager.BucketedProgram))
    target = core(0).target
    assert entry.duration_ns == pytest.approx(entry.inner.duration_ns + copy_ns(8 * 64 * 4, target)
                                              + copy_ns(5 * 64 * 4, target))


def test_an_op_at_one_size_only_runs_its_own_program(fresh, neuron):
    """A model's fixed widths are not padded: an op is bucketed only once it has met a second size."""
    fresh.setenv(eager.BUCKETS_ENV, "1")
    for _ in range(2):
        (torch.randn(5, 3).to(neuron) + 1.0).cpu()
    assert not any(isinstance(e, eager.BucketedProgram) for e in eager.programs.values())


def test_switched_off_every_size_compiles_its_own_program(fresh, neuron):
    fresh.setenv(eager.BUCKETS_ENV, "0")
    for n in (5, 6):
        (torch.randn(n, 3).to(neuron) + 1.0).cpu()
    assert not any(isinstance(e, eager.BucketedProgram) for e in eager.programs.values())
    assert len(eager.programs) == 2


def test_the_ladder():
    assert [aten_buckets.bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [0, 1, 2, 4, 8, 8, 16, 1024]


def _meta_ops_called(fn) -> tuple:
    """(``fn()``, the ATen ops dispatched while it ran)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    called = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        result = fn()
    return result, called


REDUCTIONS = [  # (op, dims argument, keepdim as a positional argument or None, input dtype)
    (torch.ops.aten.all.dim, -1, True, torch.bool), (torch.ops.aten.all.dim, 0, None, torch.float32),
    (torch.ops.aten.all.dims, [0, 2], False, torch.uint8), (torch.ops.aten.any.dim, 1, False, torch.bool),
    (torch.ops.aten.any.dims, [-1, 1], True, torch.int64), (torch.ops.aten.any.dims, [2], None, torch.bfloat16),
]


@pytest.mark.parametrize("op, dims, keepdim, dtype", REDUCTIONS)
def test_all_and_any_results_without_their_meta_kernel_are_the_meta_kernels(op, dims, keepdim, dtype):
    """The bucketed path's result shape of ``all``/``any`` (aten_lowering.reduction_meta): the first call of a kind
    runs the meta kernel; later calls at other sizes do not (all's is Python, 0.5 ms), and give its shape and
    dtype."""
    from neuronc.frontend.aten_lowering import _reduction_results, reduction_meta

    _reduction_results.clear()
    extra = () if keepdim is None else (keepdim,)
    for sizes in ((2, 3, 5), (4, 1, 9), (1, 7, 17), (3, 0, 2)):
        x = torch.empty(sizes, dtype=dtype, device="meta")
        expected = op(x, dims, *extra)
        got, called = _meta_ops_called(lambda: reduction_meta(op, (x, dims, *extra), {}))  # noqa: B023
        assert (got.shape, got.dtype, got.device) == (expected.shape, expected.dtype, expected.device)
        assert (op in called) == (sizes == (2, 3, 5)), f"{sizes}: the meta kernel ran {called.count(op)} times"


def test_all_and_any_calls_the_rule_does_not_know_are_left_to_the_meta_kernel():
    from neuronc.frontend.aten_lowering import reduction_meta

    x = torch.empty(2, 3, dtype=torch.bool, device="meta")
    aten = torch.ops.aten
    assert reduction_meta(aten.all.default, (x,), {}) is None  # every dim
    assert reduction_meta(aten.all.dims, (x, []), {}) is None  # an empty list: every dim too
    assert reduction_meta(aten.all.dim, (x, 2), {}) is None  # out of range: the meta kernel's error
    assert reduction_meta(aten.all.dim, (torch.empty((), dtype=torch.bool, device="meta"), 0), {}) is None
    assert reduction_meta(aten.sum.dim_IntList, (x, [0]), {}) is None  # not all/any
