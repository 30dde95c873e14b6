"""The NKI-compatible kernel language: public NKI samples ported by an import change give eager PyTorch's results
on the emulated NeuronCore; kernels breaking a rule fail at their own source line; the entry points
(simulate_kernel, benchmark, SPMD grids) behave as NKI's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import neuronc.nki as nki
import neuronc.nki.isa as nisa
import neuronc.nki.language as nl
from neuronc.errors import KernelError, KernelUnsupportedError, NeuronRuntimeError
from neuronc.tolerances import TOLERANCES
from tests.conftest import line_of
from tests.nki_samples import (attention_tutorial, average_pool2d, interpolate_bilinear, layernorm, mamba,
                               matmul_tutorial, rmsnorm, sd_attention)

FP32 = TOLERANCES[torch.float32]


def rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).random(shape, dtype=np.float32)


def close(actual, expected, **tolerance):
    torch.testing.assert_close(torch.as_tensor(np.asarray(actual)), expected, **(tolerance or FP32))


# -- public samples --------------------------------------------------------------------------------------------


def test_matmul_tutorial_basic_kernel_matches_eager():
    lhsT, rhs = rand(128, 64), rand(128, 512)
    close(matmul_tutorial.nki_matmul_basic_(lhsT, rhs), torch.from_numpy(lhsT).T @ torch.from_numpy(rhs))


@pytest.mark.parametrize("kernel", ["nki_matmul_tiled_", "nki_matmul_hoist_load_", "nki_matmul_block_free_dimension_"])
def test_matmul_tutorial_tiled_kernels_match_eager(kernel):
    lhsT, rhs = rand(256, 256), rand(256, 1024)
    close(getattr(matmul_tutorial, kernel)(lhsT, rhs), torch.from_numpy(lhsT).T @ torch.from_numpy(rhs))


def test_matmul_tutorial_fully_optimized_kernel_matches_eager():
    lhsT, rhs = rand(512, 512), rand(512, 1024)
    out = matmul_tutorial.nki_matmul_fully_optimized_(lhsT, rhs, TILES_IN_BLOCK_M=2, TILES_IN_BLOCK_N=1,
                                                       TILES_IN_BLOCK_K=2)
    close(out, torch.from_numpy(lhsT).T @ torch.from_numpy(rhs))


def test_rmsnorm_sample_masks_the_last_partial_row_tile():
    a, g = rand(200, 512), rand(512)  # 200 rows: the second tile of 128 is masked to 72 rows
    x = torch.from_numpy(a)
    expected = x * torch.rsqrt(x.square().mean(dim=1, keepdim=True)) * torch.from_numpy(g)
    close(rmsnorm.nki_rmsnorm_kernel(a, g), expected)


@pytest.mark.parametrize("version", ["nki_layernorm_kernel_v1", "nki_layernorm_kernel_v2"])
def test_layernorm_samples_match_eager(version):
    x, gamma, beta = rand(300, 1024), rand(1024), rand(1024)
    expected = F.layer_norm(torch.from_numpy(x), (1024,), torch.from_numpy(gamma), torch.from_numpy(beta), eps=1e-5)
    close(getattr(layernorm, version)(x, 1e-5, gamma, beta), expected)


@pytest.mark.parametrize("version,seq", [("attn_fwd_v1", 128), ("attn_fwd_v2", 128), ("attn_fwd_v3", 512)])
def test_attention_tutorial_softmax_kernels_match_eager(version, seq):
    q, k, v = rand(128, seq, seed=1), rand(128, seq, seed=2), rand(128, seq, seed=3)  # [d_head, seq]
    tq, tk, tv = (torch.from_numpy(t) for t in (q, k, v))
    expected = torch.softmax(tq.T @ tk, dim=-1) @ tv.T
    close(getattr(attention_tutorial, version)(q, k, v), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_sd_attention_sample_matches_sdpa(causal):
    q, k, v = rand(512, 64, seed=1), rand(512, 64, seed=2), rand(512, 64, seed=3)
    expected = F.scaled_dot_product_attention(*(torch.from_numpy(t)[None] for t in (q, k, v)), is_causal=causal,
                                              scale=0.125)[0]
    out = sd_attention.fused_self_attn_for_SD_small_head_size(q, k, v, use_causal_mask=causal, mixed_precision=False)
    close(out, expected)


def test_fused_sd_attention_sample_in_mixed_precision_is_within_bf16_tolerance():
    q, k, v = rand(256, 64, seed=1), rand(256, 64, seed=2), rand(256, 64, seed=3)
    expected = F.scaled_dot_product_attention(*(torch.from_numpy(t)[None] for t in (q, k, v)), scale=0.125)[0]
    out = sd_attention.fused_self_attn_for_SD_small_head_size(q, k, v)
    close(out, expected, **TOLERANCES[torch.bfloat16])


def test_average_pool_tutorial_reduces_axes_2_and_4_of_its_window_view():
    x = rand(128, 32, 48)
    expected = F.avg_pool2d(torch.from_numpy(x)[None], 2)[0]
    close(nki.simulate_kernel(average_pool2d.tensor_avgpool_kernel, x, 2), expected)


def test_bilinear_sample_returns_its_output_reshaped_to_n_c_h_w():
    x = rand(2, 64, 20, 16)  # 128 partitions of (n, c), rows in chunks of 10 overlapping by one
    expected = F.interpolate(torch.from_numpy(x), scale_factor=2, mode="bilinear", align_corners=False)
    close(nki.simulate_kernel(interpolate_bilinear.interpolate_bilinear_2x_fwd, x), expected)


@nki.jit
def _scaled_exp_columns(delta, a):
    """exp(delta * a[:, j]) for each column j of a: a vector A[rows, j] loads as a [rows, 1] column (the Mamba
    tutorial's scale operand)."""
    out = nl.ndarray((a.shape[1], delta.shape[0], delta.shape[1]), dtype=delta.dtype, buffer=nl.shared_hbm)
    d = nl.load(delta)
    for j in nl.affine_range(a.shape[1]):
        column = nl.load(a[0:128, j])
        nl.store(out[j], value=nisa.activation(op=nl.exp, data=d, scale=column))
    return out


def test_a_vector_slice_loads_as_a_column_and_scales_an_activation():
    delta, a = rand(128, 64), -rand(128, 3)
    expected = torch.exp(torch.from_numpy(delta)[None] * torch.from_numpy(a).T[:, :, None])
    close(nki.simulate_kernel(_scaled_exp_columns, delta, a), expected)


def _selective_scan(delta, u, a, b, c) -> torch.Tensor:
    """Mamba's SSM in eager PyTorch (fp32): h[s] = exp(delta[s] * A) * h[s-1] + delta[s] * u[s] * B[s], y[s] = C[s] . h[s],
    per batch, channel and state; the sequential loop the tutorial's kernels scan."""
    d, u, a, b, c = (torch.from_numpy(t) for t in (delta, u, a, b, c))
    decay = torch.exp(d[:, :, None, :] * a[None, :, :, None])  # [batch, channels, state, seq]
    drive = (d * u)[:, :, None, :] * b[:, None, :, :]
    h, ys = torch.zeros(decay.shape[:3]), []
    for s in range(d.shape[-1]):
        h = decay[..., s] * h + drive[..., s]
        ys.append((h * c[:, None, :, s]).sum(-1))
    return torch.stack(ys, -1)


@pytest.mark.parametrize("version, seq, state", [("mamba_v1", 128, 4), ("mamba_v2", 512, 16), ("mamba_v3", 1024, 4)])
def test_mamba_tutorial_kernels_match_an_eager_selective_scan(version, seq, state):
    """v3 scans its 1024 steps in two tiles of 512, the second starting from the first's last state (a tile initial)."""
    rng = np.random.default_rng(seq + state)
    delta, u = 0.1 * rng.random((1, 256, seq), np.float32), rng.standard_normal((1, 256, seq), np.float32)
    a = -rng.random((256, state), np.float32)
    b, c = rng.standard_normal((1, state, seq), np.float32), rng.standard_normal((1, state, seq), np.float32)
    close(getattr(mamba, version)(delta, u, a, b, c), _selective_scan(delta, u, a, b, c))


@nki.jit
def _running_max_of_differences(x, y, start):
    """dst[:, i] = max(x[:, i] - dst[:, i-1], y[:, i]) from a [P, 1] tile, in the dst convention."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    result = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(result, nl.load(x), nl.load(y), nl.load(start), op0=nl.subtract, op1=nl.maximum)
    nl.store(out, value=result)
    return out


def test_tensor_tensor_scan_takes_a_tile_initial_and_any_arithmetic_ops():
    x, y, start = rand(128, 64, seed=1), rand(128, 64, seed=2), rand(128, 1, seed=3)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    r, columns = torch.from_numpy(start)[:, 0], []
    for i in range(64):
        r = torch.maximum(tx[:, i] - r, ty[:, i])
        columns.append(r)
    close(nki.simulate_kernel(_running_max_of_differences, x, y, start), torch.stack(columns, 1))


@nki.jit
def _reversed_scan(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nl.store(out, value=nisa.tensor_tensor_scan(t, t, 0.0, np.subtract, np.add, reverse0=True))
    return out


def test_tensor_tensor_scan_says_a_reversed_non_commutative_op_is_not_emulated():
    with pytest.raises(KernelUnsupportedError, match="reverse0=True with subtract"):
        _reversed_scan(rand(128, 16))


@nki.jit
def _masked_window_max(x):
    """Each row's max over a sliding window of 3 columns, in tiles of 128 rows, the last one masked: the max's result
    is a 2-D tile indexed by no grid, restricted by the mask's partition bound as the window view is."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols - 2), dtype=x.dtype, buffer=nl.shared_hbm)
    for t in nl.affine_range((rows + 127) // 128):
        i_p, i_f = nl.mgrid[0:128, 0:cols]
        tile = nl.load(x[t * 128 + i_p, i_f], mask=(t * 128 + i_p < rows))
        i_p, i_w, i_k = nl.mgrid[0:128, 0:cols - 2, 0:3]
        best = nl.max(tile[i_p, i_w + i_k], axis=[2], mask=(t * 128 + i_p < rows))
        i_p, i_w = nl.mgrid[0:128, 0:cols - 2]
        nl.store(out[t * 128 + i_p, i_w], value=best, mask=(t * 128 + i_p < rows))
    return out


def test_a_masked_reduction_restricts_its_unindexed_result_to_the_masked_partitions():
    x = rand(200, 40)
    close(nki.simulate_kernel(_masked_window_max, x), torch.from_numpy(x).unfold(1, 3, 1).amax(-1))


def test_direct_allocation_is_refused_by_name_and_compiler_directives_are_no_ops():
    with pytest.raises(KernelUnsupportedError, match=r"nki.compiler.sbuf \(direct allocation\)"):
        nki.compiler.sbuf.mod_alloc  # noqa: B018 (the attention performance tutorial's module-level allocator)
    assert nki.compiler.skip_middle_end_transformations(_scaled_exp_columns) is _scaled_exp_columns


# -- entry points -------------------------------------------------------------------------------------------


@nki.jit
def scaled_add(a, b, alpha):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    x = nl.load(a)
    y = nl.load(b)
    nl.store(out, x * alpha + y)
    return out


def test_simulate_kernel_runs_numpy_arrays_and_traces_once_per_signature():
    a, b = rand(128, 256), rand(128, 256, seed=5)
    close(nki.simulate_kernel(scaled_add, a, b, 2.0), torch.from_numpy(a) * 2.0 + torch.from_numpy(b))
    traced = scaled_add.trace(a, b, 2.0)
    scaled_add(a, b, 2.0)
    assert scaled_add.trace(a, b, 2.0) is traced
    assert scaled_add.trace(a, b, 3.0) is not traced  # a Python value is part of the signature


def test_benchmark_reports_the_emulated_device_time():
    bench = nki.benchmark(scaled_add)
    a, b = rand(128, 256), rand(128, 256, seed=5)
    bench(a, b, 2.0)
    latency = bench.benchmark_result.nc_latency
    timeline = scaled_add.last_run.timeline
    assert latency.get_latency_percentile(50) == pytest.approx(timeline.estimated_ns / 1000)
    assert latency.get_latency_percentile(99) == latency.get_latency_percentile(50) > 0


@nki.jit
def rows_by_program(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    tile = nl.load(a[i * 128:(i + 1) * 128, :])
    nl.store(out[i * 128:(i + 1) * 128, :], tile * float(i + 1))
    return out


def test_spmd_grid_programs_share_their_outputs():
    a = rand(384, 64)
    out = rows_by_program[3](a)
    scale = np.repeat(np.arange(1, 4, dtype=np.float32), 128)[:, None]
    close(out, torch.from_numpy(a * scale))


@nki.jit
def bf16_in_fp32_out(a):
    out = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a, dtype=nl.float32)
    nl.store(out, nl.exp(x))
    return out


def test_loads_convert_dtypes_as_nki_dma_does():
    a = torch.rand(128, 64, dtype=torch.bfloat16)
    import ml_dtypes

    out = bf16_in_fp32_out(a.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    close(out, torch.exp(a.float()))


@nki.jit
def writes_its_argument(a, out):
    nl.store(out, nl.load(a) + 1.0)


def test_an_argument_the_kernel_writes_is_updated_in_place():
    a, out = rand(128, 32), np.zeros((128, 32), np.float32)
    writes_its_argument(a, out)
    close(out, torch.from_numpy(a) + 1.0)


# -- rules, at the kernel's own line ------------------------------------------------------------------------


@nki.jit
def moving_too_wide(a):
    out = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    p = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=x[:, 0:128], moving=x)  # MOVING TOO WIDE
    nl.store(out, p)
    return out


def test_a_tile_rule_broken_points_at_the_kernel_line():
    with pytest.raises(KernelError, match="N=1024 exceeds the Tensor engine's limit N<=512") as e:
        moving_too_wide(rand(128, 1024))
    assert e.value.location.startswith(f"{__file__}:{line_of(__file__, '# MOVING TOO WIDE')}")


@nki.jit
def holds_nine_psum_tiles(a):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    tiles = []
    for _ in range(9):
        p = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)  # NINE PSUM TILES
        nisa.nc_matmul(dst=p, stationary=x[:, 0:128], moving=x)
        tiles.append(p)
    acc = nl.zeros((128, 512), dtype=nl.float32)
    for p in tiles:
        acc[...] = nl.add(acc, p)
    nl.store(out, acc)
    return out


def test_more_live_psum_tiles_than_banks_is_an_error_at_the_allocation():
    with pytest.raises(KernelError, match="PSUM is full") as e:
        holds_nine_psum_tiles(rand(128, 512))
    assert e.value.location.startswith(f"{__file__}:{line_of(__file__, '# NINE PSUM TILES')}")
    assert "8 banks" in e.value.hint


@nki.jit
def reads_an_unwritten_tile(a):
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.ndarray((128, 64), dtype=nl.float32)
    nl.store(out, x)  # UNWRITTEN READ
    return out


def test_reading_an_unwritten_tile_is_refused_by_the_runtime_at_the_kernel_line():
    with pytest.raises(NeuronRuntimeError, match="nothing wrote") as e:
        reads_an_unwritten_tile(rand(128, 64))
    assert e.value.location.startswith(f"{__file__}:{line_of(__file__, '# UNWRITTEN READ')}")


@nki.jit
def uses_partition_reduce(a):
    x = nl.load(a)
    y = nl.ndarray((1, 64), dtype=nl.float32)
    nisa.tensor_partition_reduce(y, nl.add, x)


def test_an_api_not_covered_is_named_in_a_clear_error():
    with pytest.raises(KernelUnsupportedError, match="nisa.tensor_partition_reduce: not supported"):
        uses_partition_reduce(rand(128, 64))


def test_apis_outside_a_kernel_say_so():
    with pytest.raises(KernelError, match="outside a kernel"):
        nl.ndarray((128, 4), dtype=nl.float32)


@nki.jit
def branches_on_an_index(a):
    i = nl.arange(128)[:, None]
    if i < 64:
        pass


def test_python_control_flow_on_an_index_vector_is_refused():
    with pytest.raises(KernelError, match="control flow"):
        branches_on_an_index(rand(128, 4))


def _transpose_into_psum_of(dtype_name: str):
    def kernel(x):
        out = nl.ndarray((64, 128), dtype=x.dtype, buffer=nl.shared_hbm)
        tile = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        transposed = nl.ndarray((64, 128), dtype=getattr(nl, dtype_name), buffer=nl.psum)
        nisa.nc_transpose(dst=transposed, data=tile)
        result = nl.ndarray((64, 128), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result, src=transposed)
        nisa.dma_copy(dst=out, src=result)
        return out

    return kernel


@pytest.mark.parametrize("target", ["trn2", "trn1"])
def test_a_bf16_transpose_writes_bf16_psum_on_trn2_and_goes_through_fp32_on_trn1(target):
    import ml_dtypes

    x = rand(128, 64).astype(ml_dtypes.bfloat16)
    kernel = nki.jit(_transpose_into_psum_of("bfloat16"), target=target)
    out = kernel(x)
    np.testing.assert_array_equal(np.asarray(out), x.T)  # a transpose is exact
    copies = [e for e in kernel.trace(x).instrs if e.opcode.name == "TENSOR_COPY"]
    assert len(copies) == (1 if target == "trn2" else 2)  # trn1: PSUM fp32 -> bf16 PSUM tile -> SBUF


@nki.jit
def _normalized_rows(x):
    """(x - mean) * rstd of each row as NKI's layer-norm samples make it: activation(copy, x, scale=rstd, bias=-mean *
    rstd), mean and rstd [128, 1] tiles."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    mean = nl.mean(t, axis=1, keepdims=True)
    rstd = nl.rsqrt(nl.mean(nl.square(t - mean), axis=1, keepdims=True) + 1e-5)
    bias = nl.multiply(nl.negative(mean), rstd)
    nl.store(out, value=nisa.activation(op=nl.copy, data=t, scale=rstd, bias=bias))
    return out


def test_an_activation_with_scale_and_bias_tiles_normalizes_rows_in_one_scaled_activation():
    x = rand(128, 96) * 3 + 1
    wide = torch.from_numpy(x).double()
    expected = (wide - wide.mean(1, keepdim=True)) / torch.sqrt(wide.var(1, unbiased=False, keepdim=True) + 1e-5)
    close(nki.simulate_kernel(_normalized_rows, x), expected.float())
    opcodes = [e.opcode.name for e in _normalized_rows.trace(x).instrs]
    assert opcodes[-2:] == ["ACTIVATE_SCALED", "DMA_COPY"]  # no product of x and rstd in a scratch tile before it
    assert "ACTIVATE_BIAS_REDUCE" not in opcodes
