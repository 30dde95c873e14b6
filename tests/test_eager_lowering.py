"""Eager ops lowered straight to the graph IR (neuronc/frontend/aten_lowering.py): each rule against eager
PyTorch on the CPU, and the zoo's forward and backward on the `neuron` device with no op traced through
torch-mlir and none run on the CPU."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from neuronc.pytorch import eager
from tests import zoo
from tests.conftest import assert_matches_eager


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _positive(*shape):
    return torch.rand(*shape) + 0.5


def _ints(*shape, high=7):
    return torch.randint(-high, high, shape)


CASES = {
    # elementwise, type promotion, Python numbers
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=-2.5), lambda: (_randn(3, 5), _randn(5))),
    "sub_int_float": (lambda a, b: a - b * 1.5, lambda: (_ints(4, 3), _randn(4, 3))),
    "rsub": (lambda a: 2.0 - a, lambda: (_randn(6),)),
    "mul_bf16": (lambda a, b: a * b * 0.3, lambda: (_randn(4, 8, dtype=torch.bfloat16), _randn(4, 8, dtype=torch.bfloat16))),
    "div": (lambda a, b: a / b, lambda: (_randn(5, 4), _positive(5, 4))),
    "div_ints_true": (lambda a, b: a / b, lambda: (_ints(9), torch.tensor([1, 2, 3, -1, -2, -3, 4, 5, 6]))),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), lambda: (_randn(20) * 5, _randn(20))),
    "div_trunc_ints": (lambda a, b: torch.div(a, b, rounding_mode="trunc"),
                       lambda: (_ints(8, high=20), torch.tensor([3, -3, 2, -2, 5, -5, 7, -7]))),
    "floor_divide_ints": (lambda a, b: a // b, lambda: (_ints(8, high=20), torch.tensor([3, -3, 2, -2, 5, -5, 7, -7]))),
    "remainder": (lambda a, b: torch.remainder(a, b), lambda: (_randn(12) * 4, _randn(12))),
    "pow_square_cube": (lambda a: a.pow(2) + a.pow(3) - a.pow(0.5).nan_to_num(0.0), lambda: (_positive(7),)),
    "pow_tensor": (lambda a, b: torch.pow(a, b), lambda: (_positive(6), _randn(6))),
    "unary": (lambda a: torch.exp(a).log1p() + a.sin() * a.cos() - a.tanh() + a.sigmoid() + a.abs().sqrt()
              + a.erf() - a.floor() + a.ceil() + a.round() + a.sign() + a.expm1() + a.neg() + a.reciprocal(),
              lambda: (_randn(4, 6),)),
    "rsqrt": (lambda a: a.rsqrt(), lambda: (_positive(10),)),
    "activations": (lambda a: F.relu(a) + F.gelu(a) + F.gelu(a, approximate="tanh") + F.silu(a) + F.softplus(a)
                    + F.leaky_relu(a, 0.1) + F.elu(a) + F.hardtanh(a) + F.mish(a) + F.hardswish(a), lambda: (_randn(3, 9),)),
    "compare_where": (lambda a, b: torch.where((a > b) & (a != 0.5) | (b <= -1), a, b * 2),
                      lambda: (_randn(4, 4), _randn(4, 4))),
    "compare_int_float": (lambda a, b: (a >= b).int() + (a == 2), lambda: (_ints(10), _randn(10) * 3)),
    "masked_fill": (lambda a, m: a.masked_fill(m, float("-inf")).softmax(-1),
                    lambda: (_randn(2, 4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)).logical_not())),
    "clamp": (lambda a: a.clamp(-0.5, 0.7) + a.clamp(min=0.1) + a.clamp_max(0.2), lambda: (_randn(12),)),
    "addcmul_lerp": (lambda a, b, c: torch.addcmul(a, b, c, value=0.5) + torch.lerp(a, b, 0.3) + torch.lerp(a, b, c),
                     lambda: (_randn(8), _randn(8), torch.rand(8))),
    "bitwise": (lambda a, b: (a & b) | (a ^ b) | ~a, lambda: (_ints(8), _ints(8))),
    "logical": (lambda a, b: torch.logical_and(a > 0, b > 0) ^ torch.logical_not(a > b),
                lambda: (_randn(8), _randn(8))),
    "to_dtype": (lambda a: (a.bfloat16() * 3).to(torch.float16).float() + a.int(), lambda: (_randn(6) * 10,)),
    # reductions
    "sum_mean": (lambda a: a.sum() + a.sum(1, keepdim=True) + a.mean(0) + a.mean((0, 1)), lambda: (_randn(5, 7),)),
    "sum_ints_bool": (lambda a: a.sum(0) + (a > 0).sum(1, keepdim=True), lambda: (_ints(4, 6),)),
    "max_min": (lambda a: a.amax(1) + a.amin(0).sum() + a.max() - a.min(), lambda: (_randn(4, 6),)),
    "max_dim_argmax": (lambda a: (a.max(1).values, a.max(1).indices, a.min(0).indices, a.argmax(), a.argmin(1)),
                       lambda: (_randn(5, 6),)),
    "any_all": (lambda a: (a > 1).any(1).int() + (a > -3).all(0).sum() + (a > 0).any().int(), lambda: (_randn(4, 5),)),
    "var_std": (lambda a: (a.var(1), a.std(0, correction=0), *torch.var_mean(a, 1)), lambda: (_randn(6, 8),)),
    "cumsum": (lambda a: a.cumsum(1) + a.cumsum(0), lambda: (_randn(5, 6),)),
    "norm_logsumexp": (lambda a: torch.linalg.vector_norm(a, dim=1) + torch.logsumexp(a, 1), lambda: (_randn(3, 8),)),
    # matrix products
    "mm_bmm": (lambda a, b: (a @ b, torch.bmm(a.expand(2, 4, 6), b.expand(2, 6, 3)), a @ b[:, 0]),
               lambda: (_randn(4, 6), _randn(6, 3))),
    "linear_bf16": (lambda x, w, b: F.linear(x, w, b), lambda: (_randn(3, 8, dtype=torch.bfloat16),
                                                                 _randn(5, 8, dtype=torch.bfloat16),
                                                                 _randn(5, dtype=torch.bfloat16))),
    "addmm_beta_alpha": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0) + torch.baddbmm(c, a[None], b[None]),
                         lambda: (_randn(4, 3), _randn(4, 5), _randn(5, 3))),
    # normalisations
    "softmax": (lambda a: (a.softmax(-1), a.softmax(0), a.log_softmax(1), a.bfloat16().softmax(-1)),
                lambda: (_randn(4, 9),)),
    "layer_norm": (lambda x, w, b: (F.layer_norm(x, (8,), w, b), F.layer_norm(x, (3, 8)), F.rms_norm(x, (8,), w)),
                   lambda: (_randn(2, 3, 8), _randn(8), _randn(8))),
    "group_batch_norm": (lambda x, w, b: (F.group_norm(x, 2, w, b), F.batch_norm(x, None, None, w, b, training=True)),
                         lambda: (_randn(3, 4, 5, 5), _randn(4), _randn(4))),
    # data movement
    # (a cat of one dtype is DMA, eager._cat: the mixed one promotes, and is lowered)
    "cat_stack_split": (lambda a, b: (torch.cat([a, b, a], 1), torch.cat([a, b.half()], 0), torch.stack([a, b], 0),
                                      *a.split(2, 1), *torch.unbind(b, 0)), lambda: (_randn(3, 5), _randn(3, 5))),
    "views_as_values": (lambda a: (a.transpose(0, 2).contiguous(), a.permute(2, 0, 1).reshape(4, -1) * 1.0, a[:, 1:3, ::2] + 0,
                                   a.select(1, -1) * 2, a.unsqueeze(0).expand(2, 3, 4, 4).sum(0), a.flip(0, 2) + 0),
                        lambda: (_randn(3, 4, 4),)),
    "pad_repeat_tril": (lambda a: (F.pad(a, (1, 2, 0, 1), value=0.5), a.repeat(2, 1, 3), a.tril(), a.triu(1)),
                        lambda: (_randn(4, 4),)),
    "index_select_gather": (lambda a, i, j: (a.index_select(0, i), a.index_select(1, i[1:]), a[j], a[:, j[1:]],
                                             torch.gather(a, 1, i[:, None].expand(3, 2)), a[j, i], a[j[:, None], i]),
                            lambda: (_randn(5, 4), torch.tensor([3, 1, 0]), torch.tensor([4, -1, 0]))),
    "zero_dim_indexing": (lambda s, i, j: (s.argmax(0), s.argmin(0, keepdim=True), s.index_select(0, i),
                                           s.index_select(0, j), s.index_add(0, j, s * 3, alpha=2)),
                          lambda: (_randn(()), torch.tensor([0]), torch.tensor(0))),  # OpInfo's 0-d samples
    "embedding": (lambda w, i: F.embedding(i, w), lambda: (_randn(10, 4), torch.tensor([[1, 2, 9], [0, 0, 3]]))),
    "index_put_scatter": (lambda a, i, v, j: (a.index_put((i,), v, accumulate=True), a.index_add(0, i, v),
                                              torch.scatter_add(a, 0, i[:, None].expand(3, 4), v),
                                              a.index_put((j,), v), torch.scatter(a, 0, j[:, None].expand(3, 4), v)),
                          lambda: (_randn(5, 4), torch.tensor([1, 3, 1]), _randn(3, 4), torch.tensor([0, 2, 4]))),
    "trigonometry": (lambda a: a.trunc() + a.log2() + a.log10() + a.exp2() + a.sinh() + a.cosh() + a.tan()
                     + a.atan() + a.asin() + a.acos(), lambda: (torch.rand(9) * 0.9 + 0.05,)),
    "topk_sort": (lambda a: (*a.topk(3, dim=1), *a.sort(dim=0), *a.sort(dim=1, descending=True, stable=True)),
                  lambda: (_randn(4, 6),)),
    "arange_full": (lambda a: a + torch.arange(a.shape[1], device=a.device) + torch.full_like(a, 2.0)
                    + torch.ones_like(a) + a.new_zeros(a.shape), lambda: (_randn(3, 4),)),
    "binary_cross_entropy": (lambda p, t: (F.binary_cross_entropy(p, t), F.binary_cross_entropy(p, t, reduction="none")),
                             lambda: (torch.rand(4, 5) * 0.98 + 0.01, torch.rand(4, 5))),  # its decomposition's new_full
    "convolutions": (lambda x, w: (F.conv2d(x, w, padding=1), F.conv2d(x, w, stride=2), F.conv1d(x[:, :, 0], w[:, :, 0]),
                                   F.conv_transpose2d(x, w.transpose(0, 1), stride=2, padding=1, output_padding=1),
                                   F.conv2d(x, w[:, :1].repeat(1, 1, 1, 1)[:4], groups=4)),
                     lambda: (_randn(2, 4, 6, 6), _randn(4, 4, 3, 3))),
    "pooling_upsampling": (lambda x: (F.max_pool2d(x, 2), F.avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 1),
                                      F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
                                      F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                                      F.interpolate(x, scale_factor=2, mode="nearest")), lambda: (_randn(2, 3, 4, 4),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_eager_op_is_lowered_and_matches_cpu(lowered_only, name):
    fn, make = CASES[name]
    torch.manual_seed(0)
    inputs = make()
    expected = fn(*inputs)
    lowered = eager.compile_stats["lowered"]
    got = fn(*(x.to(lowered_only) for x in inputs))
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    assert_matches_eager([g.cpu() for g in got], list(expected))
    assert eager.compile_stats["lowered"] > lowered or all(g.numel() == 0 for g in got)


TRAINED = {
    "mlp": lambda: (zoo.MLP(width_in=8, hidden=16, classes=4), (torch.randn(4, 8),)),
    "cnn": lambda: (zoo.SmallCNN(classes=4), (torch.randn(2, 3, 8, 8),)),
    "gpt2": lambda: (zoo.GPT2(vocab=32, width=16, layers=1, heads=2, context=8), (torch.randint(0, 32, (2, 8)),)),
    "llama": lambda: (zoo.Llama(vocab=32, width=16, layers=1), (torch.randint(0, 32, (2, 8)),)),
    "unet": lambda: (zoo.UNetBlock(channels=4, time_dim=8), (torch.randn(2, 4, 4, 4), torch.rand(2) * 100)),
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_the_zoo_trains_on_the_device_with_every_op_lowered(lowered_only, name):
    """Forward and backward (batch norm in training mode, its running statistics included) of small zoo models:
    every op of both lowered straight to the IR, the loss, gradients and buffers as on the CPU."""
    torch.manual_seed(0)
    model, inputs = TRAINED[name]()
    model.train()
    on_device = copy.deepcopy(model).to(lowered_only)
    if isinstance(model, zoo.GPT2):
        on_device.head.weight = on_device.tokens.weight
    expected = model(*inputs).float().pow(2).mean()
    expected.backward()
    with torch.device(lowered_only):
        loss = on_device(*(x.to(lowered_only) for x in inputs)).float().pow(2).mean()
    loss.backward()
    assert_matches_eager(loss.detach().cpu(), expected.detach())
    # a conv bias before a normalisation has a gradient of zero in exact arithmetic: what autograd computes is
    # rounding noise on each device, so gradients are compared on the scale of the model's largest
    scale = max(q.grad.abs().max().item() for q in model.parameters())
    for (pname, p), q in zip(on_device.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.cpu() / scale, q.grad / scale, rtol=1e-4, atol=1e-5, msg=pname)
    assert_matches_eager([b.cpu() for b in on_device.buffers()], list(model.buffers()))


def test_a_new_shape_is_lowered_again_without_torch_mlir(lowered_only):
    x = torch.randn(3, 5)
    programs = len(eager.programs)
    for rows in (3, 4, 7):
        x = torch.randn(rows, 5)
        assert_matches_eager(torch.softmax(x.to(lowered_only) * 2.0, -1).cpu(), torch.softmax(x * 2.0, -1))
    assert len(eager.programs) >= programs + 2 * 2


def test_an_op_without_a_lowering_is_traced_once_then_served_by_the_compile_cache(tmp_path):
    """torch.round with decimals has no lowering (aten.round.decimals has no rule): torch-mlir compiles it, the
    compile cache keeps its NEFF under the op's signature, and a second process loads it without tracing or
    importing anything. (torch.fmax served here until neuronc's own decomposition of it made it a lowered op.)"""
    code = textwrap.dedent("""
        import sys, torch
        from neuronc.pytorch import eager
        x = torch.linspace(-3, 3, 12)
        got = torch.round(x.to("neuron"), decimals=2).cpu()
        torch.testing.assert_close(got, torch.round(x, decimals=2), rtol=1e-4, atol=1e-5)
        print(eager.compile_stats["traced"], eager.compile_stats["disk cache"], "torch_mlir" in sys.modules,
              len(eager.fallen_back))
    """)
    env = {**os.environ, "NEURON_COMPILE_CACHE_URL": str(tmp_path), "NEURON_CC_FLAGS": ""}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[0].stdout.split() == ["1", "0", "True", "0"]  # traced, through torch-mlir
    assert runs[1].stdout.split() == ["0", "1", "False", "0"]  # the cache's NEFF: torch-mlir not even imported


# ---- lowered ops in the compile cache: a second process loads them, and refuses damaged entries ----------

_LOWERED_OPS = textwrap.dedent("""
    import sys, torch
    from neuronc.pytorch import eager
    torch.manual_seed(0)
    x = torch.randn(6, 10, requires_grad=True)
    w, b = torch.randn(10, 4), torch.randn(4)
    d = x.detach().to("neuron").requires_grad_()
    y = torch.softmax(d @ w.to("neuron") * 2.0, -1)        # one result each
    m, s = torch.std_mean(d, dim=0)                         # two results
    out = torch.nn.functional.layer_norm(d, (10,)).sum()    # and a backward whose gradients include Nones
    out.backward()
    bits = b"".join(t.detach().cpu().numpy().tobytes() for t in (y, m, s, out, d.grad))
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(x2, (10,)).sum().backward()
    torch.testing.assert_close(y.cpu(), torch.softmax(x.detach() @ w * 2.0, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d.grad.cpu(), x2.grad, rtol=1e-4, atol=1e-5)
    print(eager.compile_stats["lowered"], eager.compile_stats["disk cache"], bits.hex())
""")


def _run_lowered_ops(cache) -> tuple:
    """(programs lowered and compiled, programs loaded from the cache, the results' bytes) of a new process."""
    env = {**os.environ, "NEURON_COMPILE_CACHE_URL": str(cache), "NEURON_CC_FLAGS": ""}
    run = subprocess.run([sys.executable, "-c", _LOWERED_OPS], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lowered, from_disk, bits = run.stdout.split()
    return int(lowered), int(from_disk), bits


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory):
    """A compile cache filled by one process running lowered ops, with what that process computed."""
    cache = tmp_path_factory.mktemp("eager_cache")
    lowered, from_disk, bits = _run_lowered_ops(cache)
    assert lowered > 0 and from_disk == 0
    return cache, lowered, bits


def test_a_second_process_loads_lowered_ops_from_the_cache_and_gets_the_same_bits(filled_cache, tmp_path):
    cache, lowered, bits = filled_cache
    copy_of = tmp_path / "cache"
    shutil.copytree(cache, copy_of)
    assert _run_lowered_ops(copy_of) == (0, lowered, bits)


def test_a_damaged_cache_entry_is_refused_and_compiled_again(filled_cache, tmp_path):
    """One NEFF with a flipped byte, one sidecar describing other outputs than its NEFF's: both are refused (and
    replaced); the rest load; the results are the same bits."""
    cache, lowered, bits = filled_cache
    copy_of = tmp_path / "cache"
    shutil.copytree(cache, copy_of)
    neffs = sorted(copy_of.glob("*/*.neff"))
    assert len(neffs) == lowered
    data = bytearray(neffs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    neffs[0].write_bytes(bytes(data))
    sidecars = [n.with_name(n.name + ".json") for n in neffs[1:]]
    sidecar, meta = next((s, m) for s in sidecars for m in [json.loads(s.read_text())] if m["extra"]["outputs"][0][0])
    meta["extra"]["outputs"][0][0] = [n + 1 for n in meta["extra"]["outputs"][0][0]]  # (a 0-d output has no dims)
    sidecar.write_text(json.dumps(meta))
    assert _run_lowered_ops(copy_of) == (2, lowered - 2, bits)
    assert _run_lowered_ops(copy_of) == (0, lowered, bits)  # the two entries were stored again


def test_on_the_device_sign_of_nan_is_zero_and_floor_division_by_zero_is_the_quotient(lowered_only):
    """PyTorch's sign(NaN) is 0 (SIGN's is NaN); its floor division by zero is x / y (the device gave NaN)."""
    x = torch.tensor([float("nan"), -0.0, 2.0, -3.0, float("inf")])
    assert torch.equal(torch.sign(x.to(lowered_only)).cpu(), torch.sign(x))
    a = torch.tensor([1.5, -1.5, 3.0, 0.0, 1.0, float("inf")])
    b = torch.tensor([0.0, 0.0, -0.0, 0.0, 0.1, 0.5])
    torch.testing.assert_close((a.to(lowered_only) // b.to(lowered_only)).cpu(), a // b, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_device_16_bit_floor_and_trunc_division_match_eager_bit_for_bit(lowered_only, dtype):
    """Each step in the 16-bit dtype over a tensor (the quotient rounded before it is floored), in fp32 over a
    number, as eager computes them (the device computed both in fp32)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, generator=g) * 3000).to(dtype), (torch.randn(256, generator=g) * 3).to(dtype)
    da, db = a.to(lowered_only), b.to(lowered_only)
    assert torch.equal((da // db).cpu(), a // b)
    assert torch.equal(torch.div(da, db, rounding_mode="trunc").cpu(), torch.div(a, b, rounding_mode="trunc"))
    assert torch.equal((da // 0.7).cpu(), a // 0.7)
    assert torch.equal(torch.div(da, 3.3, rounding_mode="trunc").cpu(), torch.div(a, 3.3, rounding_mode="trunc"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_device_a_number_added_to_a_16_bit_tensor_is_rounded_first_as_in_eager(lowered_only, dtype):
    """Eager's x + c and c - x round c to x's dtype (its x * c keeps c in fp32): the device kept it in fp32."""
    x = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    d = x.to(lowered_only)
    for fn in (lambda t: t + 0.1, lambda t: 0.3 - t, lambda t: (t * 0.7 + 0.2) / 1.3, lambda t: t * 0.1 - 1e-3):
        assert torch.equal(fn(d).cpu(), fn(x))


def test_on_the_device_bf16_cubes_and_inverse_squares_round_each_step_as_in_eager(lowered_only):
    x = (torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    d = x.to(lowered_only)
    assert torch.equal((d ** 3).cpu(), x ** 3)
    assert torch.equal((d ** -2).cpu(), x ** -2)
