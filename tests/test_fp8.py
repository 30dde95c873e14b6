"""fp8 as PyTorch computes it, compiled and on the `neuron` device, with no CPU fallback: a conversion to
float8_e4m3fn saturates (passes/legalize.py `_saturated_e4m3`), and torch._scaled_mm, the fp8 matmul with
tensor-wise or row-wise fp32 scales (frontend/decompositions.py `_scaled_mm`), gives the Tensor engine its fp8
operands as fp8 and matches eager PyTorch on the CPU."""
from __future__ import annotations

import pytest
import torch

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from neuronc.isa import DType
from runtime import run_neff
from tests.conftest import assert_matches_eager, run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")

FP8_STEP = dict(rtol=2**-3, atol=2**-9)  # one step of float8_e4m3fn (3 mantissa bits): the result's rounding


def _operands(rowwise: bool):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 32, generator=g) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(48, 32, generator=g) * 3).to(torch.float8_e4m3fn).T  # column-major, as _scaled_mm wants
    if rowwise:
        return a, b, torch.rand(64, 1, generator=g) + 0.5, torch.rand(1, 48, generator=g) + 0.5
    return a, b, torch.tensor(0.75), torch.tensor(1.5)


def _eager(fn, *args, **kwargs):
    """`fn` in eager on the CPU through PyTorch's own kernels: with oneDNN, a tensor-wise `_scaled_mm` to fp8 on an
    AVX-512 machine converts past 448 to NaN where PyTorch's kernel (and the row-wise path, which never takes
    oneDNN) saturates to +-448, so the golden would depend on the CPU."""
    with torch.backends.mkldnn.flags(enabled=False):
        return fn(*args, **kwargs)


def _assert_matches(got, want):
    if want.dtype == torch.float8_e4m3fn:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), **FP8_STEP)
    else:
        assert_matches_eager(got, want)


KEYWORDS = {
    "bf16": dict(out_dtype=torch.bfloat16),
    "fp32_bias": dict(out_dtype=torch.float32, bias=torch.linspace(-2, 2, 48)),
    "fp8": dict(),
    "fp8_scale_result": dict(out_dtype=torch.float8_e4m3fn, scale_result=torch.tensor(4.0)),
    "fp8_saturated": dict(out_dtype=torch.float8_e4m3fn, scale_result=torch.tensor(0.25)),  # past 448: +-448
}


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out", sorted(KEYWORDS))
def test_scaled_mm_compiles_and_matches_eager(fresh_dynamo, rowwise, out):
    kwargs = KEYWORDS[out]
    fn = lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb, **kwargs)  # noqa: E731
    inputs = _operands(rowwise)
    _assert_matches(run_compiled(fn, *inputs), _eager(fn, *inputs))


def test_scaled_mm_multiplies_fp8_operands_on_the_tensor_engine(monkeypatch):
    class Scaled(torch.nn.Module):
        def forward(self, a, b, sa, sb):
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

    monkeypatch.setenv("NEURON_CC_FLAGS", "--no_cache")
    inputs = _operands(rowwise=True)
    compiled = compile_exported(torch.export.export(Scaled(), inputs), CompileOptions.from_dict({}))
    matmuls = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert matmuls and {x.dtype for n in matmuls for x in n.inputs[:2]} == {DType.F8E4M3}
    got = run_neff(compiled.neff, [to_numpy(x.contiguous()) for x in inputs]).outputs[0]
    assert_matches_eager(from_numpy(got), Scaled()(*inputs))


@pytest.mark.parametrize("out", sorted(KEYWORDS))
def test_scaled_mm_on_the_device_matches_eager(neuron, out):
    kwargs, inputs = KEYWORDS[out], _operands(rowwise=True)
    want = _eager(torch._scaled_mm, *inputs, **kwargs)
    got = torch._scaled_mm(*(x.to(neuron) for x in inputs), **{k: v.to(neuron) if isinstance(v, torch.Tensor) else v
                                                                for k, v in kwargs.items()})
    _assert_matches(got.cpu(), want)


PAST_THE_RANGE = torch.tensor([1000.0, -1e6, 460.0, 470.0, float("inf"), float("-inf"), float("nan"), 3.3, -1e-3])


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_a_conversion_to_e4m3_saturates_as_pytorch_does(fresh_dynamo, source):
    fn = lambda x: x.to(source).to(torch.float8_e4m3fn)  # noqa: E731
    got, want = run_compiled(fn, PAST_THE_RANGE), fn(PAST_THE_RANGE)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0, equal_nan=True)  # +-448, NaN kept


def test_a_conversion_to_e4m3_on_the_device_saturates(neuron):
    got = PAST_THE_RANGE.to(neuron).to(torch.float8_e4m3fn).cpu()
    torch.testing.assert_close(got.float(), PAST_THE_RANGE.to(torch.float8_e4m3fn).float(), rtol=0, atol=0,
                               equal_nan=True)


def test_a_copy_to_e4m3_on_another_core_saturates(neuron):
    target = torch.empty(PAST_THE_RANGE.shape, dtype=torch.float8_e4m3fn, device="neuron:1")
    target.copy_(PAST_THE_RANGE.to(neuron))
    torch.testing.assert_close(target.cpu().float(), PAST_THE_RANGE.to(torch.float8_e4m3fn).float(), rtol=0, atol=0,
                               equal_nan=True)


def test_a_constant_converted_to_e4m3_saturates(fresh_dynamo):
    fn = lambda x: x + torch.full((3,), 1000.0).to(torch.float8_e4m3fn).float()  # noqa: E731
    x = torch.zeros(3)
    assert_matches_eager(run_compiled(fn, x), fn(x))  # 448, as eager


def test_a_jax_conversion_to_e4m3_keeps_xlas_nan_past_the_range():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import neuronc.jax

    def fn(x):
        return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)

    x = jnp.asarray(PAST_THE_RANGE.numpy())
    got, want = neuronc.jax.jit(fn)(x), jax.jit(fn)(x)
    assert np.isnan(np.asarray(want)[0])  # XLA does not saturate: the golden is jax.jit's
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
