"""Integer matrix products are exact: narrow ones on the Tensor engine in pieces whose fp32 sums stay exact, wide
ones in wrapping integer arithmetic, as PyTorch's CPU kernels and XLA compute them (passes/integer_matmul.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import neuronc.jax
from neuronc.compiler import CompileOptions, compile_exported
from neuronc.ir import Op
from runtime import run_neff
from tests.test_ops import Fn

_g = torch.Generator().manual_seed(5)


def _compiled(fn, *args, opt_level=2):
    return compile_exported(torch.export.export(Fn(fn), args), CompileOptions(opt_level=opt_level))


def _run(compiled, *args):
    return torch.from_numpy(run_neff(compiled.neff, [a.numpy() for a in args]).outputs[0])


@pytest.mark.parametrize("opt_level", [0, 2])
def test_an_int8_product_past_the_exact_fp32_range_sums_on_the_tensor_engine_in_exact_pieces(opt_level):
    # every product is (-128)^2 = 2^14: a sum over 2,100 of them is past 2^24, so it needs three pieces
    a = torch.full((16, 2100), -128, dtype=torch.int8)
    a[0, :7] = 127
    b = torch.randint(-128, 128, (2100, 24), generator=_g, dtype=torch.int8)
    b[:, 0] = -128
    compiled = _compiled(torch._int_mm, a, b, opt_level=opt_level)
    assert torch.equal(_run(compiled, a, b), torch._int_mm(a, b))
    matmuls = [n for n in compiled.graph.nodes() if n.op is Op.MATMUL]
    assert len(matmuls) == 3 and all(n.inputs[0].dtype.name == "BF16" for n in matmuls)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_a_wide_integer_product_wraps_as_pytorch_computes_it(dtype):
    info = torch.iinfo(dtype)
    a = torch.randint(info.min // 4, info.max // 4, (3, 5, 7), generator=_g, dtype=dtype)
    b = torch.randint(info.min // 4, info.max // 4, (3, 7, 4), generator=_g, dtype=dtype)
    compiled = _compiled(torch.bmm, a, b)
    assert torch.equal(_run(compiled, a, b), torch.bmm(a, b))


def test_a_narrow_integer_product_under_torch_compile_matches_eager():
    a, b = torch.randint(-9, 9, (6, 40), generator=_g), torch.randint(-9, 9, (40, 5), generator=_g)
    assert torch.equal(torch.compile(lambda a, b: a @ b, backend="neuron")(a, b), a @ b)


def test_jax_integer_products_with_a_preferred_type_match_jax():
    def products(a, b, u):
        return (jnp.matmul(a, b, preferred_element_type=jnp.int32), jnp.matmul(u, u.T, preferred_element_type=jnp.int32),
                jnp.matmul(a, b), jnp.matmul(a, b, preferred_element_type=jnp.float32))

    rng = np.random.default_rng(0)
    a, b = rng.integers(-128, 128, (8, 300), dtype=np.int8), rng.integers(-128, 128, (300, 6), dtype=np.int8)
    u = rng.integers(0, 256, (5, 700), dtype=np.uint8)  # 255^2 x 700 is past 2^24: three pieces
    for got, want in zip(neuronc.jax.jit(products)(a, b, u), jax.jit(products)(a, b, u)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
