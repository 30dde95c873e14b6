"""The emulator's fast kernels (runtime.semantics.kernel: calls on scratch arrays bound at load) compute bit for bit
what the ISA's semantics (runtime.semantics.SEMANTICS, numpy on fresh arrays) compute, on many values: special
ones (NaN with payloads and signs, infinities, -0.0, denormals), random bit patterns and values in the functions'
working ranges, for the kernels made for speed: GELU and ERF (ACTIVATE and ACTIVATE_BIAS_REDUCE), the top-8
instructions, DMA_GATHER and DMA_SCATTER, shifts and powers by an immediate and TENSOR_ALU2. Each instruction
runs both ways on two copies of the same memories (SBUF with rows as far apart as the emulated core has them,
PSUM, HBM); every byte must agree, and an instruction one way refuses must be refused alike."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, row_major_dims
from neuronc.targets import get_target
from runtime.memory import _partition_rows, view
from runtime.semantics import ALU2_OPS, SEMANTICS, Scratch, check, kernel, store_all

RNG = np.random.default_rng(16)
TARGET = get_target("trn2")
HBM_BYTES = 1 << 14

SPECIAL_BITS = np.array([
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000,  # +-0, +-1, +-inf
    0x7FC00000, 0xFFC00000, 0x7FC00123, 0xFFD00001, 0x7F800001, 0xFF812345,  # quiet and signalling NaNs, payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,  # denormals, the smallest normal
    0x40800000, 0xC0800000, 0x40800001, 0x407FFFFF, 0x7F7FFFFF, 0xFF7FFFFF,  # +-4 (erf's clamp) and beside, +-max
], np.uint32)


def _f32_values(n: int) -> np.ndarray:
    """``n`` float32 values: the specials, random bit patterns, and values where erf and GELU are not flat."""
    parts = [SPECIAL_BITS.view(np.float32), RNG.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32),
             (RNG.standard_normal(n) * 3).astype(np.float32), RNG.uniform(-6, 6, n).astype(np.float32),
             (RNG.standard_normal(n) * 1e-3).astype(np.float32), (RNG.standard_normal(n) * 1e-39).astype(np.float32)]
    values = np.concatenate(parts)
    return RNG.permutation(values)[:n] if n < len(values) else np.resize(values, n)


_MEMORIES = [{Space.SBUF: _partition_rows(TARGET.partitions, 16384), Space.PSUM: _partition_rows(TARGET.partitions, 2048),
               Space.HBM: np.zeros(HBM_BYTES, np.uint8)} for _ in range(2)]


def _memories() -> tuple:
    """Two sets of small SBUF and PSUM, rows apart as OnChip has them (a row's bytes, then a pad), and HBM, all
    0xFF (made once: fresh ones cost their page faults on every instruction)."""
    for memories in _MEMORIES:
        for memory in memories.values():
            memory.fill(0xFF)
    return tuple(_MEMORIES)


def tile(shape, dtype=DType.F32, *, space=Space.SBUF, partition=0, offset=0) -> AccessPattern:
    """A contiguous on-chip tile: ``shape[0]`` partitions from ``partition``, the rest row-major."""
    return AccessPattern(space, dtype, offset, ((1, shape[0]),) + row_major_dims(shape[1:]), partition)


def table(shape, dtype=DType.F32, offset=0) -> AccessPattern:
    return AccessPattern(Space.HBM, dtype, offset, row_major_dims(shape))


def _fill(memories: dict, instr: Instruction, values) -> None:
    """Each operand's bytes from ``values(ap)`` (an array of its shape and dtype), in operand order (so where
    operands overlap, the later one's values stand)."""
    for ap in instr.operands:
        view(memories[ap.space], ap)[...] = values(ap)


def _agree(instr: Instruction, values) -> None:
    """``instr`` run by its bound kernel and by ``store_all(dsts, SEMANTICS[opcode](...))`` on copies of the same
    memories: every byte of every memory equal (or both refuse with the same error type)."""
    check(instr, TARGET)
    ours, reference = _memories()
    _fill(ours, instr, values)
    for space, memory in reference.items():
        memory[...] = ours[space]
    views = [view(ours[ap.space], ap) for ap in instr.operands]
    expected = [view(reference[ap.space], ap) for ap in instr.operands]
    calls = kernel(instr, *views, new=Scratch())
    with np.errstate(all="ignore"):
        try:
            store_all(tuple(expected[:len(instr.writes)]), SEMANTICS[instr.opcode](instr, *expected))
        except Exception as e:  # noqa: BLE001 - the kernel must refuse alike
            with pytest.raises(type(e)):
                for call in calls:
                    call()
            return
        for call in calls:
            call()
    for space in ours:
        if not np.array_equal(ours[space], reference[space]):  # (the full comparison only to say where)
            np.testing.assert_array_equal(ours[space], reference[space], err_msg=f"{space.name} after {instr}")


def _random(ap: AccessPattern) -> np.ndarray:
    """Values for an operand: floats from _f32_values (rounded to its dtype), integers as random bit patterns."""
    n = int(np.prod(ap.shape))
    dtype = ap.dtype.numpy
    if ap.dtype.is_float:
        with np.errstate(invalid="ignore"):  # NaN to bf16 says so
            return _f32_values(n).astype(dtype).reshape(ap.shape)
    return RNG.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(ap.shape)


@pytest.mark.parametrize("func", [ActFunc.GELU, ActFunc.ERF], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(1, 64), (4, 8), (128, 96)], ids=str)
def test_erf_and_gelu_activations_are_bit_exact(func, shape):
    for dst_dtype, src_dtype in ((DType.F32, DType.F32), (DType.BF16, DType.F32), (DType.F32, DType.BF16)):
        for scale, bias in ((1.0, 0.0), (-0.5, 0.25), (1.0, -0.0), (3.0, 1e-40)):
            src = tile(shape, src_dtype, space=Space.PSUM)
            dst = tile(shape, dst_dtype, partition=128 - shape[0], offset=4096)
            _agree(Instruction(Opcode.ACTIVATE, Engine.SCALAR, (dst, src), func=func, imm0=scale, imm1=bias), _random)
            in_place = dataclasses.replace(src, space=Space.SBUF, dtype=dst_dtype)  # dst over its own source
            _agree(Instruction(Opcode.ACTIVATE, Engine.SCALAR, (in_place, dataclasses.replace(in_place)), func=func,
                               imm0=scale, imm1=bias), _random)


def test_every_activation_is_bit_exact_on_large_and_one_row_tiles():
    for func in ActFunc:
        for shape, dst_dtype in (((128, 72), DType.F32), ((1, 64), DType.BF16)):
            src, dst = tile(shape, DType.F32, space=Space.PSUM), tile(shape, dst_dtype, offset=4096)
            _agree(Instruction(Opcode.ACTIVATE, Engine.SCALAR, (dst, src), func=func, imm0=-1.5, imm1=-0.0), _random)


@pytest.mark.parametrize("func", [ActFunc.GELU, ActFunc.ERF, ActFunc.EXP, ActFunc.TANH, ActFunc.SQUARE,
                                  ActFunc.IDENTITY, ActFunc.SIGMOID, ActFunc.RELU], ids=lambda f: f.name)
def test_activate_bias_reduce_is_bit_exact(func):
    for dst_dtype, shape in ((DType.F32, (8, 64)), (DType.BF16, (128, 40)), (DType.F32, (1, 512))):
        p = shape[0]
        dst, src = tile(shape, dst_dtype, offset=8192), tile(shape, DType.F32, space=Space.PSUM)
        row_sum, bias = tile((p, 1), offset=0), tile((p, 1), offset=64)
        _agree(Instruction(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, (dst, row_sum, src, bias), func=func,
                           imm0=-0.75), _random)
        in_place = dataclasses.replace(src, space=Space.SBUF, offset=8192)  # over its source, in SBUF
        _agree(Instruction(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, (in_place, row_sum, in_place, bias), func=func,
                           imm0=1.0), _random)


def _rows_with_repeats(ap: AccessPattern) -> np.ndarray:
    """Rows drawn from a few values (many repeats, NaNs, both zeros), so the top-8 instructions meet duplicates."""
    pool = np.array([0.0, -0.0, 1.0, -1.0, np.nan, 2.5, np.inf, 7.0, -np.inf, 1e-40], np.float32)
    weights = np.array([4, 4, 12, 2, 2, 3, 1, 2, 1, 1], float)
    return RNG.choice(pool, ap.shape, p=weights / weights.sum()).astype(ap.dtype.numpy)


def _top8_values(src_values: np.ndarray, rows: int) -> np.ndarray:
    """Per row, 8 values: some from the row (repeats included, so a value takes its occurrences in turn), some not."""
    out = np.empty((rows, 8), np.float32)
    for r in range(rows):
        from_row = RNG.choice(src_values[r].astype(np.float32), 6)
        out[r] = np.concatenate([from_row, RNG.choice(np.array([1.0, np.nan, 3.25, -0.0], np.float32), 2)])
        RNG.shuffle(out[r])
    return out


@pytest.mark.parametrize("shape", [(1, 32), (2, 16), (16, 8), (4, 300)], ids=str)  # 300: counts past 255 of one value
def test_top8_instructions_are_bit_exact(shape):
    rows, n = shape
    for src_dtype, out_dtype in ((DType.F32, DType.F32), (DType.BF16, DType.BF16), (DType.F32, DType.BF16),
                                 (DType.I32, DType.F32)):
        src = tile(shape, src_dtype, offset=0)
        values = tile((rows, 8), DType.F32, offset=4096)
        data = {}

        def fill(ap, data=data, src=src):
            if ap == src:
                data["src"] = (RNG.integers(-3, 4, ap.shape).astype(ap.dtype.numpy) if not ap.dtype.is_float
                               else _rows_with_repeats(ap))
                return data["src"]
            if ap.shape == (rows, 8) and ap.dtype == DType.F32 and ap.offset == 4096:
                return _top8_values(data["src"], rows)
            return _random(ap)

        found, replaced = tile((rows, 8), DType.I32, offset=8192), tile(shape, out_dtype, offset=12288)
        best = tile((rows, 8), out_dtype, offset=8192)
        for repeat in range(3):
            _agree(Instruction(Opcode.FIND_INDEX8, Engine.VECTOR, (found, src, values)), fill)
            for narrow in (DType.I16, DType.U8):  # -1 for "not found" stored as a conversion stores it
                _agree(Instruction(Opcode.FIND_INDEX8, Engine.VECTOR, (dataclasses.replace(found, dtype=narrow), src,
                                                                       values)), fill)
            _agree(Instruction(Opcode.MATCH_REPLACE8, Engine.GPSIMD, (replaced, src, values), imm0=-5.5), fill)
            _agree(Instruction(Opcode.MAX8, Engine.VECTOR, (best, src)), fill)
        if src_dtype == out_dtype:  # replacing in place
            _agree(Instruction(Opcode.MATCH_REPLACE8, Engine.VECTOR, (src, src, values), imm0=-0.0), fill)


def test_a_value_repeated_more_than_255_times_is_found_at_its_own_occurrences():
    """The running counts must not wrap: the ninth 1.0 of the values must not also match the 265th 1.0 of a row."""
    src, values = tile((1, 600), offset=0), tile((1, 8), offset=4096)
    out = tile((1, 600), offset=8192)

    def fill(ap):
        return np.ones(ap.shape, np.float32)

    _agree(Instruction(Opcode.MATCH_REPLACE8, Engine.VECTOR, (out, src, values), imm0=0.0), fill)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.I32, DType.I64], ids=lambda d: d.name)
def test_dma_gather_is_bit_exact_and_refuses_indices_outside_alike(dtype):
    rows, width = 16, 40
    source, dst = table((rows, width), dtype), tile((8, width), dtype, offset=1024)
    for index_dtype in (DType.I32, DType.I64):
        indices = tile((8, 1), index_dtype, offset=0)
        instr = Instruction(Opcode.DMA_GATHER, Engine.DMA, (dst, source, indices))
        for bad in (None, -1, rows, 2**31 - 1):
            def fill(ap, bad=bad, indices=indices):
                if ap != indices:
                    return _random(ap)
                chosen = RNG.integers(0, rows, ap.shape)
                if bad is not None:
                    chosen[RNG.integers(0, 8), 0] = bad
                return chosen.astype(ap.dtype.numpy)

            _agree(instr, fill)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.I32, DType.BOOL], ids=lambda d: d.name)
@pytest.mark.parametrize("alu", [AluOp.NONE, AluOp.ADD], ids=lambda a: a.name)
def test_dma_scatter_is_bit_exact_and_refuses_indices_outside_alike(dtype, alu):
    """Repeated rows included: the last one written stands, or (ADD) all of them accumulate."""
    rows, width = 16, 24
    target, src = table((rows, width), dtype), tile((8, width), dtype, offset=1024)
    for index_dtype in (DType.I32, DType.I64):
        indices = tile((8, 1), index_dtype, offset=0)
        instr = Instruction(Opcode.DMA_SCATTER, Engine.DMA, (target, src, indices), alu=alu)
        for bad in (None, -1, rows, 2**31 - 1):
            def fill(ap, bad=bad, indices=indices):
                if ap != indices:
                    return _random(ap)
                chosen = RNG.integers(0, 4, ap.shape)  # 8 rows among 4: repeats
                if bad is not None:
                    chosen[RNG.integers(0, 8), 0] = bad
                return chosen.astype(ap.dtype.numpy)

            _agree(instr, fill)


def test_a_scatter_writes_its_rows_without_copying_its_table():
    """A scatter of 4 rows into a table of 4096 (the KV cache's update) allocates nothing near the table's size."""
    import tracemalloc

    rows, width = 4096, 32
    target, src, indices = table((rows, width)), tile((4, width), offset=1024), tile((4, 1), DType.I32)
    hbm = np.zeros(rows * width * 4, np.uint8)
    sbuf = _partition_rows(TARGET.partitions, 2048)
    view(sbuf, indices)[...] = np.array([[3], [7], [4000], [7]], np.int32)
    view(sbuf, src)[...] = np.arange(4 * width, dtype=np.float32).reshape(4, width)
    instr = Instruction(Opcode.DMA_SCATTER, Engine.DMA, (target, src, indices))
    calls = kernel(instr, view(hbm, target), view(sbuf, src), view(sbuf, indices), new=Scratch())
    tracemalloc.start()
    try:
        for call in calls:
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < rows * width * 4 // 8
    written = view(hbm, target)
    np.testing.assert_array_equal(written[[3, 4000, 7]], view(sbuf, src)[[0, 2, 3]])
    assert not written[[0, 5, 4095]].any()


SHIFTS = (AluOp.SHIFT_LEFT, AluOp.SHIFT_RIGHT_LOGICAL, AluOp.SHIFT_RIGHT_ARITHMETIC)


@pytest.mark.parametrize("dtypes", [(DType.I32, DType.I32), (DType.I64, DType.I64), (DType.U8, DType.U8),
                                    (DType.I32, DType.I64), (DType.F32, DType.I16), (DType.U32, DType.BOOL)],
                         ids=lambda d: "-".join(x.name for x in d))
def test_shifts_by_an_immediate_are_bit_exact(dtypes):
    dst_dtype, src_dtype = dtypes
    src, dst = tile((32, 3), src_dtype, offset=0), tile((32, 3), dst_dtype, offset=256)
    for alu in SHIFTS:
        for amount in (0, 1, 7, 8, 31, 32, 63, 64, -1, 1e10):
            for reverse in (False, True):
                _agree(Instruction(Opcode.TENSOR_SCALAR, Engine.GPSIMD, (dst, src), alu=alu, imm0=amount,
                                   reverse=reverse), _random)
            if dst_dtype == src_dtype:
                _agree(Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (src, src), alu=alu, imm0=amount), _random)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -2.0])
def test_tensor_scalar_powers_are_bit_exact(exponent):
    """x ** 2 is computed as x * x (numpy's fp32 power by 2 gives its bits: benchmarks/power_identities.py); every
    exponent gives the semantics' bits, rounded to the destination's dtype, and in place."""
    for shape in ((1, 128), (16, 24)):
        for dst_dtype, src_dtype in ((DType.F32, DType.F32), (DType.BF16, DType.F32), (DType.F32, DType.BF16)):
            src, dst = tile(shape, src_dtype, offset=0), tile(shape, dst_dtype, offset=4096)
            _agree(Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (dst, src), alu=AluOp.POW, imm0=exponent), _random)
        in_place = tile(shape, DType.F32, offset=0)
        _agree(Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (in_place, in_place), alu=AluOp.POW, imm0=exponent),
               _random)


def test_a_square_is_a_multiply_not_a_call_of_numpys_power(monkeypatch):
    """The RMS norm's x ** 2 (a TENSOR_SCALAR POW by 2 in Llama's decode graph) runs as one multiply into its
    destination, not through the semantics' power of a copy."""
    import runtime.semantics

    src, dst = tile((1, 128), offset=0), tile((1, 128), offset=4096)
    memories, _ = _memories()
    view(memories[Space.SBUF], src)[...] = _random(src)
    calls = kernel(Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (dst, src), alu=AluOp.POW, imm0=2.0),
                   view(memories[Space.SBUF], dst), view(memories[Space.SBUF], src), new=Scratch())

    def power(*args):
        raise AssertionError("numpy's power was called")

    monkeypatch.setitem(runtime.semantics.ALU, AluOp.POW, power)
    monkeypatch.setattr(runtime.semantics.np, "power", power)
    x = view(memories[Space.SBUF], src)
    with np.errstate(all="ignore"):  # the random values overflow and hold NaNs, as the device computes them
        for call in calls:
            call()
        np.testing.assert_array_equal(view(memories[Space.SBUF], dst), x * x)


def test_tensor_alu2_is_bit_exact():
    shape = (16, 24)
    for dst_dtype, src_dtype in ((DType.F32, DType.F32), (DType.BF16, DType.F32), (DType.F32, DType.BF16)):
        a, c = tile(shape, src_dtype, offset=0), tile(shape, DType.F32, offset=512)
        b = AccessPattern(Space.SBUF, DType.F32, 1024, ((1, shape[0]), (0, shape[1])))  # one value per partition
        dst = tile(shape, dst_dtype, offset=2048)
        for alu in sorted(ALU2_OPS):
            for alu1 in (AluOp.NONE, *sorted(ALU2_OPS)):
                _agree(Instruction(Opcode.TENSOR_ALU2, Engine.VECTOR, (dst, a, b, c), alu=alu, alu1=alu1), _random)
        in_place = dataclasses.replace(a, dtype=dst_dtype)
        _agree(Instruction(Opcode.TENSOR_ALU2, Engine.GPSIMD, (in_place, in_place, b, c), alu=AluOp.SUBTRACT,
                           alu1=AluOp.MULTIPLY), _random)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("k,m,n", [(32, 1, 64), (64, 1, 32), (128, 1, 512), (128, 8, 40), (3, 128, 7)], ids=str)
def test_matmuls_are_bit_exact(k, m, n, dtype):
    """A one-partition result is written by the matmul itself, others through a product array; either way the bits
    of the semantics' fresh product (specials included), overwritten or accumulated, at any column of a bank."""
    for accumulate in (False, True):
        for column in sorted({0, 512 - n}):  # a bank holds 512 fp32 columns
            dst = tile((m, n), space=Space.PSUM, offset=column * 4)
            stationary, moving = tile((k, m), dtype), tile((k, n), dtype, offset=4096)
            _agree(Instruction(Opcode.MATMUL, Engine.TENSOR, (dst, stationary, moving), accumulate=accumulate),
                   _random)


def test_a_bf16_matmul_rounds_each_exact_sum_once_whatever_its_tile_shape():
    """numpy's fp32 matmul adds in an order that depends on M and N and on the host's BLAS, so -O0's and -O2's
    tilings of one matmul could differ in the last bits. The Tensor engine's sums of 16-bit products are each the
    exact sum rounded once to fp32 (math.fsum's), for the whole tile and for any slice of it."""
    stationary = RNG.standard_normal((128, 128)).astype(DType.BF16.numpy)
    moving = RNG.standard_normal((128, 512)).astype(DType.BF16.numpy)

    def product(s, m):
        instr = Instruction(Opcode.MATMUL, Engine.TENSOR, (tile((s.shape[1], m.shape[1]), space=Space.PSUM),
                                                           tile(s.shape, DType.BF16), tile(m.shape, DType.BF16)))
        return SEMANTICS[Opcode.MATMUL](instr, np.zeros((s.shape[1], m.shape[1]), np.float32), s, m)

    whole = product(stationary, moving)
    s64, m64 = stationary.astype(np.float64), moving.astype(np.float64)
    exact = np.array([[math.fsum(s64[:, i] * m64[:, j]) for j in range(512)] for i in range(128)]).astype(np.float32)
    np.testing.assert_array_equal(whole.view(np.uint32), exact.view(np.uint32))
    for n in (1, 7, 256, 500):
        np.testing.assert_array_equal(product(stationary, moving[:, :n]).view(np.uint32), exact[:, :n].view(np.uint32))
    for m in (1, 3, 64, 100):
        np.testing.assert_array_equal(product(stationary[:, :m], moving).view(np.uint32), exact[:m].view(np.uint32))
