"""The `neuron` device: tensors on emulated NeuronCores through the `torch.backends` autoload (no
import of neuronc), eager ops compiled per signature, CPU fallback, torch.accelerator, streams, events."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from neuronc.errors import (DeviceOutOfMemoryError, FallbackDisabledError, NeuronConfigError, NeuronDeviceError,
                            QueuedOpError)
from neuronc.pytorch import eager, queues
from neuronc.pytorch.device_memory import array_of, core
from tests import zoo
from tests.conftest import assert_matches_eager


def _run_python(code: str, **env) -> str:
    import os

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ---- registration ----------------------------------------------------------------------------------

def test_to_neuron_needs_no_import_and_behaves_like_a_device(tmp_path):
    out = _run_python(f"""
        import io, sys, torch
        assert "neuronc.compiler" not in sys.modules and "torch_mlir" not in sys.modules  # autoload stays cheap
        x = torch.randn(4, 4)
        x[0, 2] = 3.3276e-04  # printed in scientific notation: the device's suffix goes on a line of its own
        y = x.to("neuron")
        assert y.device == torch.device("neuron", 0) and str(y.device) == "neuron:0", y.device
        assert y.is_neuron and torch.equal(y.cpu(), x)
        assert (y.cpu().numpy() == x.numpy()).all()
        # the same text but for the device (where PyTorch breaks the lines depends on the values' format)
        assert repr(y).split() == (repr(x)[:-1] + ", device='neuron:0')").split(), repr(y)
        model = torch.nn.Linear(4, 2).to("neuron")
        torch.save({{k: v.cpu() for k, v in model.state_dict().items()}}, {str(tmp_path / "sd.pt")!r})
        loaded = torch.load({str(tmp_path / "sd.pt")!r})
        assert torch.equal(loaded["weight"], model.weight.cpu())
        print("ok")
    """)
    assert out.strip() == "ok"


def test_torch_device_backend_autoload_0_leaves_the_device_unregistered():
    """PyTorch's switch (README): with TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import torch` runs no backend's entry point:
    no `torch.neuron`, no "neuron" device, no neuronc module imported."""
    out = _run_python("""
        import sys, torch
        print(hasattr(torch, "neuron"), any(name.startswith("neuronc") for name in sys.modules))
        try:
            torch.zeros(1).to("neuron")
        except RuntimeError as refused:
            print("refused" if "neuron" in str(refused) else refused)
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.split() == ["False", "False", "refused"]


@pytest.fixture
def no_garbage_collection():
    """What earlier tests dropped (programs, cached storage) goes back to the core now, not in the middle of a
    test that counts a core's bytes."""
    import gc

    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_device_tensor_bytes_are_the_cores_hbm(neuron, no_garbage_collection):
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    hbm = core(0).hbm
    before = hbm.in_use
    x = torch.zeros(256, 64, device=neuron)
    assert hbm.in_use - before == 256 * 64 * 4
    torch.accelerator.synchronize()  # the queued zero-fill runs
    array_of(x)[3, 5] = 7.0  # the tensor is that memory: no copy on the side
    assert x.cpu()[3, 5].item() == 7.0
    del x  # its bytes wait in the allocator's cache for the next storage of that size ...
    assert hbm.in_use - before == 256 * 64 * 4 and torch.accelerator.memory_reserved() >= 256 * 64 * 4
    y = torch.empty(256, 64, device=neuron)
    assert hbm.in_use - before == 256 * 64 * 4  # ... which reuses them
    del y
    torch.accelerator.empty_cache()  # ... until the cache gives them back to the core
    assert hbm.in_use == before


def test_freed_storage_is_reused_on_its_own_stream_only(neuron):
    x = torch.empty(123, device=neuron)
    pointer = x.data_ptr()
    del x
    y = torch.empty(123, device=neuron)
    assert y.data_ptr() == pointer  # the cached buffer, without asking the core
    del y
    other = torch.Stream(device="neuron")
    with torch.neuron.stream(other):
        z = torch.empty(123, device=neuron)
    assert z.data_ptr() != pointer  # queued work on the first stream may still read it
    w = torch.empty(123, device=neuron)
    assert w.data_ptr() == pointer
    reserved = torch.accelerator.memory_reserved()
    w.record_stream(other)  # read on another stream: never reused, given back to the core when freed
    del w
    assert torch.accelerator.memory_reserved() == reserved - 123 * 4


def test_out_of_device_memory_is_a_typed_error(neuron):
    with pytest.raises(DeviceOutOfMemoryError, match="HBM"):
        torch.empty(core(0).hbm.capacity // 4 + 1, dtype=torch.float32, device=neuron)


def test_views_alias_device_memory(neuron):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(neuron)
    column = x.t()[1]
    x.zero_()
    assert torch.equal(column.cpu(), torch.zeros(3))
    assert torch.equal(x[1:, ::2].cpu(), torch.zeros(2, 2))


# ---- eager ops ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda a, b: a + b * 2.5,
    lambda a, b: torch.relu(a) @ b.t(),
    lambda a, b: torch.softmax(a, dim=-1),
    lambda a, b: (a * b).sum(dim=0),
], ids=["add_mul", "relu_matmul", "softmax", "sum"])
def test_eager_ops_match_cpu(neuron, fn):
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    assert_matches_eager(fn(a.to(neuron), b.to(neuron)).cpu(), fn(a, b))


def test_a_bf16_layer_norm_rounds_once_as_the_cpus_does(neuron):
    """native_layer_norm is one program on the device, statistics and affine in fp32 and one rounding: PyTorch's
    composite kernel for other devices rounds the normalised value to bf16 before weight and bias (up to 3 ulp
    off; it made bf16 training 1.3-6x less accurate than the CPU's), and the CPU's kernel does not."""
    torch.manual_seed(0)
    x, weight, bias = (torch.randn(64, 48) * 2 + 0.5).bfloat16(), (torch.randn(48) * 0.1 + 1).bfloat16(), \
        (torch.randn(48) * 0.1).bfloat16()
    out, mean, rstd = torch.ops.aten.native_layer_norm(x.to(neuron), [48], weight.to(neuron), bias.to(neuron), 1e-5)
    assert torch.equal(out.cpu(), torch.nn.functional.layer_norm(x, (48,), weight, bias))
    assert torch.equal(out.cpu(), torch.nn.functional.layer_norm(x.float(), (48,), weight.float(), bias.float())
                       .bfloat16())
    assert mean.dtype == rstd.dtype == torch.float32  # as CUDA keeps them (the CPU rounds them to bf16)
    torch.testing.assert_close(mean.cpu().squeeze(1), x.float().mean(1))


def test_second_call_of_a_signature_is_a_cache_lookup(neuron, monkeypatch):
    monkeypatch.setenv(eager.BUCKETS_ENV, "0")  # with shape buckets a new shape may reuse its bucket's program
    a = torch.randn(3, 5).to(neuron)
    torch.sub(a, a)
    compiled = len(eager.programs)
    [entry] = eager.compiled_for(torch.ops.aten.sub.Tensor, (3, 5))
    launches = entry.launches
    torch.sub(a, a)
    assert len(eager.programs) == compiled and entry.launches == launches + 1
    torch.sub(torch.randn(4, 5).to(neuron), a[:1])  # a new shape is a new program
    assert len(eager.programs) == compiled + 1


def test_in_place_and_out_ops_write_device_memory(neuron):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    x = a.to(neuron)
    x.mul_(b.to(neuron))
    out = torch.empty(4, 4, device=neuron)
    torch.add(x, 1.0, out=out)
    assert_matches_eager((x.cpu(), out.cpu()), (a * b, a * b + 1.0))


def test_unsupported_op_falls_back_to_cpu_with_one_warning(neuron):
    x = torch.tensor([0.0, 1.5, 0.0, -2.0]).to(neuron)
    eager.fallen_back.pop("aten.nonzero.default", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = torch.nonzero(x), torch.nonzero(x)
    assert [str(w.message) for w in caught if "aten.nonzero" in str(w.message)].__len__() == 1
    assert first.device == neuron and torch.equal(second.cpu(), torch.tensor([[1], [3]]))


def test_disabled_fallback_raises_an_error_naming_the_op(neuron, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    with pytest.raises(FallbackDisabledError, match="aten.nonzero"):
        torch.nonzero(torch.ones(3).to(neuron))


def test_a_module_moved_to_the_device_keeps_its_parameters_and_tied_weights(neuron):
    """As on CUDA: `.to()` moves each Parameter in place (PyTorch does that only between tensors it deems
    shallow-copy compatible), so an optimizer made before the move and a weight shared by two modules still
    see one Parameter."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=32, width=16, layers=1, heads=2, context=8)
    assert model.head.weight is model.tokens.weight
    parameters = list(model.parameters())
    model.to(neuron)
    assert model.head.weight is model.tokens.weight and model.head.weight.device == neuron
    assert [id(p) for p in model.parameters()] == [id(p) for p in parameters]
    model.to("cpu")
    assert model.head.weight is model.tokens.weight and model.head.weight.device.type == "cpu"


def test_tensors_on_two_devices_do_not_mix(neuron):
    with pytest.raises(RuntimeError, match="neuron:0 and neuron:1"):  # a RuntimeError naming both, as on CUDA
        torch.ones(2, device="neuron:0") + torch.ones(2, device="neuron:1")


def test_mlp_trains_with_adamw_on_the_device_as_on_cpu(neuron):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    on_device = copy.deepcopy(model).to(neuron)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    losses = []
    for m, data, target in ((model, x, y), (on_device, x.to(neuron), y.to(neuron))):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(m(data), target)
            loss.backward()
            optimizer.step()
        losses.append(loss.detach().cpu())
    assert all(p.device == neuron for p in on_device.parameters())
    assert_matches_eager(losses[1], losses[0])
    assert_matches_eager([p.detach().cpu() for p in on_device.parameters()], list(model.parameters()))


def test_a_training_loop_compiles_only_in_its_first_step(neuron):
    """AdamW's step sizes change every step; as runtime inputs of the programs they compile nothing new."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    on_device = copy.deepcopy(model).to(neuron)
    x = torch.randn(4, 6)
    compiled_after_step = []
    for m, data in ((model, x), (on_device, x.to(neuron))):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            m(data).square().mean().backward()
            optimizer.step()
            compiled_after_step.append(len(eager.programs))
    device_counts = compiled_after_step[3:]
    assert device_counts[0] == device_counts[1] == device_counts[2]
    assert_matches_eager([p.detach().cpu() for p in on_device.parameters()], list(model.parameters()))


def test_gpt2_trains_on_the_device_as_on_cpu(neuron):
    """The zoo's GPT-2 (tied embedding and head, attention, cross-entropy) trains for a few AdamW steps with
    every op on the NeuronCore, and the losses and parameters match the same loop on the CPU.

    The gradient of attention's key bias is zero in exact arithmetic (softmax ignores a per-row shift): what
    autograd computes is rounding noise, ~1e-11, which AdamW with eps=1e-8 would blow up to a full step
    of a different sign on each machine; eps=1e-6 keeps the comparison about the computation."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=32, width=16, layers=1, heads=2, context=8)
    on_device = copy.deepcopy(model).to(neuron)
    tokens, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    fallbacks, losses, compiled = sum(eager.fallback_calls.values()), [], []
    for m, where in ((model, torch.device("cpu")), (on_device, neuron)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6)
        for _ in range(3):
            optimizer.zero_grad()
            with where:  # GPT2.forward makes its positions with torch.arange
                loss = m(tokens.to(where), targets.to(where))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().cpu())
            compiled.append(len(eager.programs))
    assert sum(eager.fallback_calls.values()) == fallbacks  # nothing ran on the CPU
    assert compiled[3] == compiled[4] == compiled[5]  # steps 2 and 3 compile nothing
    assert all(p.device == neuron for p in on_device.parameters())
    assert_matches_eager(losses[3:], losses[:3])
    assert_matches_eager([p.detach().cpu() for p in on_device.parameters()], list(model.parameters()))


def test_python_numbers_are_runtime_inputs_not_part_of_the_signature(neuron):
    a, b, c = torch.randn(5), torch.randn(5), torch.rand(5) + 0.5
    da, db, dc = a.to(neuron), b.to(neuron), c.to(neuron)
    torch.addcdiv(da, db, dc, value=0.5).mul(3.0)
    compiled = len(eager.programs)
    for value, factor in ((-0.25, 1.5), (2.0, -7.0)):
        result = torch.addcdiv(da, db, dc, value=value).mul(factor)
        assert_matches_eager(result.cpu(), torch.addcdiv(a, b, c, value=value).mul(factor))
    assert len(eager.programs) == compiled


@pytest.mark.parametrize("optimizer, options", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=True, maximize=True)),
], ids=["adamw", "adam-amsgrad-maximize-tensor-lr"])
def test_fused_adam_steps_run_as_one_device_program_and_match_the_cpu_fused_step(no_fallback, optimizer, options):
    from neuronc.pytorch import fused_optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    on_device = copy.deepcopy(model).to(no_fallback)
    x = torch.randn(5, 4)
    compiled = len(fused_optim._programs)
    steps = []
    for m, data in ((model, x), (on_device, x.to(no_fallback))):
        steps.append(optimizer(m.parameters(), fused=True, **options))
        for _ in range(3):
            steps[-1].zero_grad()
            m(data).pow(2).sum().backward()
            steps[-1].step()
    assert len(fused_optim._programs) == compiled + 1  # one program for the parameter list, run each step
    assert_matches_eager([p.detach().cpu() for p in on_device.parameters()], list(model.parameters()))
    on_cpu, on_neuron = (list(s.state.values()) for s in steps)
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if options.get("amsgrad") else ("exp_avg", "exp_avg_sq")
    for name in names:
        assert_matches_eager([state[name].cpu() for state in on_neuron], [state[name] for state in on_cpu])


def test_a_fused_step_unscales_amp_gradients_and_skips_a_step_that_overflowed(no_fallback):
    """GradScaler's grad_scale and found_inf reach the fused step: the device program divides the gradients by
    the scale and leaves parameters and state alone when found_inf is set, as the CPU fused step does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    on_device = copy.deepcopy(model).to(no_fallback)
    x = torch.randn(5, 4)
    for m, data, where in ((model, x, "cpu"), (on_device, x.to(no_fallback), no_fallback)):
        step = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1.0, fused=True)  # eps: not
        for overflowed in (0.0, 1.0, 0.0):  # scale-invariant, so an unscaled gradient would show
            step.zero_grad()
            (m(data).pow(2).sum() * 4).backward()
            step.grad_scale, step.found_inf = torch.tensor(4.0, device=where), torch.tensor(overflowed, device=where)
            step.step()
    assert_matches_eager([p.detach().cpu() for p in on_device.parameters()], list(model.parameters()))


def test_grad_scaler_unscales_backs_off_and_grows_on_the_device_as_on_the_cpu(neuron):
    """GradScaler's unscale and update ops run on the device (no gradient copied to the host): an overflowing step
    is skipped and backs the scale off, two clean steps grow it, as with the CPU's kernels."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    runs = [(model, "cpu"), (copy.deepcopy(model).to(neuron), "neuron")]
    x = torch.randn(5, 6)
    amp_ops = ("aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default")
    on_the_cpu = [eager.fallback_calls[name] for name in amp_ops]
    for m, where in runs:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(where, init_scale=2.0 ** 10, growth_interval=2)
        m.scales = []
        for factor in (1.0, float("inf"), 1.0, 1.0, 1.0):
            (scaler.scale(m(x.to(where)).pow(2).mean() * factor)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            m.scales.append((scaler.get_scale(), int(scaler._growth_tracker.item())))
    (cpu, _), (device, _) = runs
    assert device.scales == cpu.scales == [(1024.0, 1), (512.0, 0), (512.0, 1), (1024.0, 0), (1024.0, 1)]
    assert_matches_eager([p.detach().cpu() for p in device.parameters()], list(cpu.parameters()))
    assert [eager.fallback_calls[name] for name in amp_ops] == on_the_cpu


# ---- autocast and random numbers ---------------------------------------------------------------------

def test_autocast_runs_matmuls_in_bfloat16_and_softmax_in_float32(neuron):
    a, b, w = torch.randn(4, 8), torch.randn(8, 8), torch.randn(3, 8)
    with torch.autocast("neuron"):  # bfloat16 unless dtype= says otherwise
        product = a.to(neuron) @ b.to(neuron)
        probabilities = torch.softmax(product, dim=-1)
        projected = torch.nn.functional.linear(a.to(neuron), w.to(neuron))
    expected = a.bfloat16() @ b.bfloat16()
    assert_matches_eager(product.cpu(), expected)
    assert_matches_eager(probabilities.cpu(), torch.softmax(expected.float(), dim=-1))
    assert_matches_eager(projected.cpu(), torch.nn.functional.linear(a.bfloat16(), w.bfloat16()))
    with torch.autocast("neuron", dtype=torch.bfloat16, enabled=False):
        assert (a.to(neuron) @ b.to(neuron)).dtype == torch.float32


def test_manual_seed_makes_device_random_tensors_reproducible(neuron):
    torch.manual_seed(7)
    first = torch.randn(3, 4, device=neuron), torch.rand(5, device="neuron:1")
    torch.manual_seed(7)
    again = torch.randn(3, 4, device=neuron), torch.rand(5, device="neuron:1")
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(first, again))
    torch.manual_seed(7)
    torch.neuron.manual_seed(8)  # reseeds the current device (neuron:0) only
    assert not torch.equal(torch.randn(3, 4, device=neuron).cpu(), first[0].cpu())
    assert torch.equal(torch.rand(5, device="neuron:1").cpu(), first[1].cpu())


def test_a_device_generator_gives_reproducible_random_tensors(neuron):
    generator = torch.Generator(device="neuron")
    assert generator.device == neuron
    generator.manual_seed(11)
    first = torch.rand(6, device=neuron, generator=generator)
    state = generator.get_state()
    second = torch.rand(6, device=neuron, generator=generator)
    generator.set_state(state)
    assert torch.equal(torch.rand(6, device=neuron, generator=generator).cpu(), second.cpu())
    generator.manual_seed(11)
    assert torch.equal(torch.rand(6, device=neuron, generator=generator).cpu(), first.cpu())
    assert not torch.equal(first.cpu(), second.cpu())
    with pytest.raises(RuntimeError, match="16 bytes"):
        generator.set_state(torch.zeros(5, dtype=torch.uint8))


@pytest.fixture
def no_fallback(neuron, monkeypatch):
    """What runs under it must run on the device: the CPU fallback raises."""
    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    return neuron


def test_random_ops_draw_on_the_device_from_its_generator_state(no_fallback):
    generator = torch.Generator(device="neuron").manual_seed(5)
    before = generator.get_offset()
    x = torch.empty(10, device=no_fallback)
    for draw in (lambda: x.uniform_(-2, 3, generator=generator), lambda: x.normal_(1, 2, generator=generator),
                 lambda: x.bernoulli_(0.5, generator=generator), lambda: x.random_(0, 7, generator=generator)):
        draw()
    torch.nn.functional.dropout(x, 0.5)
    torch.randint(0, 9, (4,), device=no_fallback), torch.bernoulli(torch.rand(3, device=no_fallback))
    # uniform, bernoulli and random_ draw one number an element, normal two; each launch takes whole blocks of 4
    assert generator.get_offset() - before == 12 + 20 + 12 + 12


def test_a_draw_depends_on_the_seed_and_the_element_only(no_fallback):
    """Element e of a draw is number offset + e of the seed's stream, however the program tiles it; the next
    draw continues the stream."""
    torch.manual_seed(3)
    long = torch.rand(200_000, device=no_fallback).cpu()  # tiles of 128 x 1024 and a tail
    torch.manual_seed(3)
    short = torch.rand(1000, device=no_fallback).cpu()
    following = torch.rand(1000, device=no_fallback).cpu()
    assert torch.equal(short, long[:1000]) and torch.equal(following, long[1000:2000])


def test_uniform_draws_are_uniform_and_independent(no_fallback):
    n = 1 << 16
    torch.manual_seed(0)
    u, v = torch.rand(n, device=no_fallback).cpu().double(), torch.rand(n, device=no_fallback).cpu().double()
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.006 and abs(u.std() - 12 ** -0.5) < 0.004  # 5 standard errors
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert (counts - n / 16).abs().max() < 5 * (n / 16) ** 0.5
    for a, b in ((u, v), (u[:-1], u[1:])):  # two draws, and neighbours within one
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02
    low = torch.rand(n, dtype=torch.bfloat16, device=no_fallback).cpu()
    assert low.max() < 1 and len(low.unique()) > 200  # bf16 draws keep its 8 bits: never rounded up to 1


def test_normal_draws_have_the_mean_std_and_shape_asked_for(no_fallback):
    n = 1 << 16
    torch.manual_seed(1)
    z = torch.randn(n, device=no_fallback).cpu().double()
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.015
    assert abs((z.abs() < 1).double().mean() - 0.6827) < 0.01 and abs((z.abs() < 2).double().mean() - 0.9545) < 0.006
    scaled = torch.empty(n, device=no_fallback).normal_(3.0, 0.5).cpu().double()
    assert abs(scaled.mean() - 3) < 0.01 and abs(scaled.std() - 0.5) < 0.008


def test_randperm_draws_reproducible_uniform_permutations_on_the_device(no_fallback):
    torch.manual_seed(4)
    first = torch.randperm(50, device=no_fallback).cpu()
    torch.manual_seed(4)
    assert torch.equal(torch.randperm(50, device=no_fallback).cpu(), first)
    assert sorted(first.tolist()) == list(range(50)) and first.dtype == torch.int64
    leading = torch.stack([torch.randperm(8, device=no_fallback) for _ in range(400)]).cpu()[:, 0]
    assert ((torch.bincount(leading, minlength=8) - 50).abs() < 5 * 50 ** 0.5).all()  # each value leads 1/8 of them


def test_integer_bernoulli_and_dropout_draws(no_fallback):
    n = 1 << 15
    torch.manual_seed(2)
    r = torch.randint(-3, 5, (n,), device=no_fallback).cpu()
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 4
    assert (torch.bincount(r + 3) - n / 8).abs().max() < 5 * (n / 8) ** 0.5
    p = torch.tensor([0.0, 1.0, 0.25]).repeat_interleave(n // 4).to(no_fallback)
    b = torch.bernoulli(p).cpu()
    quarter = n // 4
    assert b[:quarter].sum() == 0 and b[quarter:2 * quarter].sum() == quarter
    assert abs(b[2 * quarter:].mean() - 0.25) < 5 * (0.25 * 0.75 / quarter) ** 0.5
    x = torch.randn(n)
    out, mask = torch.ops.aten.native_dropout(x.to(no_fallback), 0.3, True)
    assert mask.dtype == torch.bool and abs(mask.cpu().double().mean() - 0.7) < 5 * (0.21 / n) ** 0.5
    assert_matches_eager(out.cpu(), x * mask.cpu() * (1 / 0.7))


# ---- torch.accelerator ---------------------------------------------------------------------------------

def test_accelerator_sees_the_neuron_device(neuron):
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == 2 == torch.neuron.device_count()
    assert torch.accelerator.is_available()


def test_visible_cores_set_the_device_count():
    out = _run_python("""
        import torch
        print(torch.accelerator.device_count(), torch.ones(1, device="neuron:3").device)
    """, NEURON_RT_VISIBLE_CORES="0-3")
    assert out.split() == ["4", "neuron:3"]


def test_set_device_index_selects_the_default_device(neuron):
    try:
        torch.accelerator.set_device_index(1)
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(2, device="neuron").device == torch.device("neuron", 1)
    finally:
        torch.accelerator.set_device_index(0)


def test_a_checkpoint_of_device_tensors_loads_back_onto_their_cores(neuron, tmp_path):
    x, y = torch.randn(4, 5).to("neuron:1"), torch.arange(3).to("neuron:0")
    torch.save({"x": x, "y": y}, tmp_path / "ckpt.pt")
    back = torch.load(tmp_path / "ckpt.pt")  # torch.load switches devices with torch.neuron.device
    assert back["x"].device == torch.device("neuron", 1) and back["y"].device == torch.device("neuron", 0)
    assert torch.equal(back["x"].cpu(), x.cpu()) and torch.equal(back["y"].cpu(), y.cpu())
    assert torch.load(tmp_path / "ckpt.pt", map_location="cpu")["x"].device == torch.device("cpu")


def test_the_device_module_answers_what_device_agnostic_code_asks(neuron):
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
        with torch.neuron.device_of(torch.ones(1, device="neuron:0")):
            assert torch.empty(1, device="neuron").device == torch.device("neuron", 0)
        assert torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 0
    free, total = torch.neuron.mem_get_info(1)
    assert total == core(1).hbm.capacity == torch.neuron.get_device_properties(1).total_memory and 0 < free <= total
    assert "NeuronCore" in torch.neuron.get_device_name() and torch.get_device_module("neuron").is_bf16_supported()
    with pytest.raises(NeuronConfigError, match="not a neuron device"):
        torch.neuron.device("cpu")


def test_each_core_has_its_own_memory_and_statistics(neuron, no_garbage_collection):
    import gc

    (torch.ones(1024, device="neuron:1") * 3.0).cpu()  # compiled first: a first compile's lazy imports leave cycles
    gc.collect()
    torch.accelerator.synchronize()
    base0, base1 = torch.accelerator.memory_allocated(0), torch.accelerator.memory_allocated(1)
    torch.accelerator.reset_peak_memory_stats(1)
    x = torch.ones(1024, device="neuron:1")
    assert torch.accelerator.memory_allocated(1) == base1 + 4096 and torch.accelerator.memory_allocated(0) == base0
    assert core(1) is not core(0) and core(1).hbm.in_use >= 4096
    y = x * 3.0  # computed on core 1
    assert y.device == torch.device("neuron", 1) and torch.equal(y.cpu(), torch.full((1024,), 3.0))
    del x, y
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_allocated(1) == base1
    assert torch.accelerator.max_memory_allocated(1) >= base1 + 2 * 4096
    stats = torch.accelerator.memory_stats(1)
    assert stats["allocated_bytes.all.current"] == base1 and stats["allocation.all.allocated"] >= 2


# ---- streams and events ----------------------------------------------------------------------------------

def _work(x):
    return (x @ x).relu()


def test_events_time_work_on_a_stream_from_the_emulated_timeline(neuron):
    x = torch.randn(64, 64).to(neuron)
    _work(x)  # compile first: a cached launch advances the stream by its program's estimated time
    stream = torch.Stream(device="neuron")
    assert stream.device == neuron
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    with torch.neuron.stream(stream):
        assert torch.accelerator.current_stream() == stream
        start.record()
        _work(x)
        end.record()
    assert torch.accelerator.current_stream() != stream
    end.synchronize()
    assert start.query() and end.query() and stream.query()
    [mm], [relu] = (eager.compiled_for(op, (64, 64)) for op in (torch.ops.aten.mm.default, torch.ops.aten.relu.default))
    expected_ms = (mm.duration_ns + relu.duration_ns) / 1e6
    assert start.elapsed_time(end) == pytest.approx(expected_ms)


def test_the_profiler_gives_each_op_the_device_time_it_added_to_its_stream(neuron):
    x = torch.randn(64, 64).to(neuron)
    _work(x)  # compiled: the profiled launches are lookups
    with torch.autograd.profiler.profile(use_device="neuron", use_kineto=False) as prof:
        _work(x).view(-1)
    torch.accelerator.synchronize()
    device_us = {e.key: e.self_device_time_total for e in prof.key_averages()}
    [mm], [relu] = (eager.compiled_for(op, (64, 64)) for op in (torch.ops.aten.mm.default, torch.ops.aten.relu.default))
    # PyTorch's profiler keeps whole microseconds of a device interval
    assert abs(device_us["aten::mm"] - mm.duration_ns / 1e3) < 1
    assert abs(device_us["aten::relu"] - relu.duration_ns / 1e3) < 1
    assert device_us["aten::view"] == 0  # metadata only: nothing ran on the core


def _timed(work) -> float:
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e6  # ns


def test_copies_last_the_dma_time_of_their_bytes_on_the_stream(neuron):
    """Host to device, device to device and device to host: one DMA issue and the bytes over every DMA queue,
    at most the HBM bandwidth (targets.py)."""
    target = core(0).target
    bytes_per_ns = min(target.dma_queues * target.dma_gbps_per_queue, target.hbm_sustained_gbps)
    for rows in (64, 256):
        host = torch.randn(rows, 256)
        nbytes = host.numel() * 4
        on_device = torch.empty(rows, 256, device=neuron)
        times = [_timed(lambda: on_device.copy_(host)), _timed(lambda: torch.empty_like(on_device).copy_(on_device)),  # noqa: B023
                 _timed(lambda: on_device.cpu())]  # noqa: B023 - each lambda is called in this iteration
        assert times == pytest.approx([target.dma_fixed_ns + nbytes / bytes_per_ns] * 3)


def test_a_missing_wait_shows_on_the_timeline(neuron):
    x = torch.randn(64, 64).to(neuron)
    _work(x)
    producer, consumer = torch.Stream(device="neuron"), torch.Stream(device="neuron")

    def consumer_start_vs_producer_end(wait: bool) -> float:
        with torch.neuron.stream(producer):
            _work(x)
            produced = torch.Event(enable_timing=True)
            produced.record()
        if wait:
            consumer.wait_event(produced)
        consumed = torch.Event(enable_timing=True)
        with torch.neuron.stream(consumer):
            consumed.record()
            _work(x)
        return produced.elapsed_time(consumed)

    assert consumer_start_vs_producer_end(wait=False) < 0  # the consumer starts before the producer is done
    assert consumer_start_vs_producer_end(wait=True) >= 0


def test_ops_are_queued_and_run_at_a_synchronization_point(neuron):
    x = torch.ones(4, device=neuron)
    torch.accelerator.synchronize()
    y = x * 3.0
    assert queues.pending(0) >= 1  # queued, not run
    torch.accelerator.synchronize()
    assert queues.pending(0) == 0
    assert torch.equal(y.cpu(), torch.full((4,), 3.0))


def test_a_full_launch_queue_runs_as_a_synchronization_would(neuron):
    """A device queues at most QUEUE_DEPTH (1024) launches, as a NeuronCore's launch queue holds a bounded number:
    the launch that fills the queue runs it, in order, without any synchronisation asked for."""
    x = torch.zeros(4, device=neuron)
    x.add_(1.0)  # compiled now, launched once
    torch.accelerator.synchronize()
    waiting = []
    for _ in range(queues.QUEUE_DEPTH):
        x.add_(1.0)
        waiting.append(queues.pending(0))
    assert waiting == [*range(1, queues.QUEUE_DEPTH), 0]  # one launch per add_; the last one ran them all
    assert torch.equal(x.cpu(), torch.full((4,), queues.QUEUE_DEPTH + 1.0))


def test_a_new_tensor_holds_the_uninitialised_pattern_until_written(neuron):
    """Device memory nobody wrote reads as NaN (bytes 0xFF), as the emulated core's does: a kernel that reads an
    output it did not write shows it. (A block the caching allocator hands out again keeps what it held, as on any
    device: emptying the cache first makes the next storage a new one.)"""
    held = torch.randn(5, 3, device=neuron)
    del held  # its block, written, goes back to the cache
    torch.accelerator.empty_cache()
    fresh = torch.empty(5, 3, device=neuron)
    assert torch.isnan(fresh.cpu()).all()
    assert torch.equal(fresh.view(torch.int32).cpu(), torch.full((5, 3), -1, dtype=torch.int32))


def test_a_zero_dim_cpu_operand_is_read_when_the_op_is_queued(neuron):
    """A 0-d CPU tensor mixed with device tensors is read when the op is called, not when the launch runs: the
    host may change it meanwhile."""
    x = torch.ones(3, device=neuron)
    scale = torch.tensor(2.0)
    y = x * scale  # queued
    scale.fill_(5.0)
    assert torch.equal(y.cpu(), torch.full((3,), 2.0))


def test_indexing_takes_cpu_index_tensors_as_cudas_does_and_other_ops_refuse_them(neuron):
    """``x[torch.tensor([2, 0])]`` on a device tensor reads and writes through CPU indices (CUDA moves them);
    scatter_add's CPU index is an error naming the fix, as on CUDA."""
    x, i = torch.arange(12.0).view(3, 4), torch.tensor([2, 0])
    d = x.to(neuron)
    assert torch.equal(d[i].cpu(), x[i]) and torch.equal(d[:, i].cpu(), x[:, i])
    d[i] = 5.0
    x[i] = 5.0
    assert torch.equal(d.cpu(), x)
    d.index_put_((i,), torch.ones(2, 4, device=neuron), accumulate=True)
    x.index_put_((i,), torch.ones(2, 4), accumulate=True)
    assert torch.equal(d.cpu(), x)
    with pytest.raises(NeuronDeviceError, match=r"move it with \.to"):
        torch.zeros(3, device=neuron).scatter_add(0, i, torch.ones(2, device=neuron))


def test_a_new_range_leaves_the_queue_to_run_later(neuron):
    """``torch.arange(..., device=...)`` resizes the empty tensor PyTorch made for it: no bytes to move, so what is
    queued is not run for it (generate() makes ~7 ranges a token)."""
    x = torch.ones(4, device=neuron)
    x * 3.0  # compiled
    torch.accelerator.synchronize()
    y = x * 3.0
    r = torch.arange(2, 7, device=neuron)
    assert queues.pending(0) >= 2  # the product and the range's copy wait
    assert torch.equal(r.cpu(), torch.arange(2, 7)) and torch.equal(y.cpu(), torch.full((4,), 3.0))


@pytest.mark.parametrize("make", [
    lambda device: torch.eye(3, device=device),
    lambda device: torch.eye(2, 4, dtype=torch.int32, device=device),
    lambda device: torch.linspace(-3, 7, 11, device=device),
    lambda device: torch.linspace(-3, 7, 11, dtype=torch.int64, device=device),
    lambda device: torch.logspace(0, 3, 4, base=2.0, dtype=torch.bfloat16, device=device),
], ids=["eye", "eye int32", "linspace", "linspace int64", "logspace bf16"])
def test_a_factory_of_numbers_is_made_on_the_host_without_the_fallbacks_warning(make, neuron, monkeypatch):
    """eye, linspace and logspace are constants, as arange is: no CPU fallback (it is off here), CPU's values."""
    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    made, expected = make(neuron).cpu(), make("cpu")
    assert made.dtype == expected.dtype and torch.equal(made, expected)


@pytest.mark.parametrize("make", [
    lambda device: torch.tril_indices(3, 4, 1, device=device),
    lambda device: torch.triu_indices(4, 3, device=device),
    lambda device: torch.kaiser_window(5, device=device),
    lambda device: torch.kaiser_window(6, False, 8.0, device=device),
], ids=["tril_indices", "triu_indices", "kaiser_window", "kaiser_window beta"])
def test_a_factory_pytorch_has_no_device_kernel_for_is_made_on_the_host(make, neuron, monkeypatch):
    """kaiser_window calls a CPU-only stub (PyTorch's internal assert before), tril_indices has no tensor to
    dispatch on (the fallback recursed, asked to make it on `neuron` again)."""
    monkeypatch.setenv(eager.FALLBACK_ENV, "1")
    made, expected = make(neuron), make("cpu")
    assert made.device == neuron and made.dtype == expected.dtype and torch.equal(made.cpu(), expected)


def test_the_cpu_fallback_makes_a_factorys_result_on_the_cpu_and_copies_it_to_the_device_named(neuron):
    made = eager.cpu_fallback(torch.ops.aten.tril_indices.default, (3, 3), {"device": neuron}, "a test")
    assert made.device == neuron and torch.equal(made.cpu(), torch.tril_indices(3, 3))


def test_a_resize_that_moves_bytes_runs_the_queue_first(neuron):
    """``out=`` of another shape than its result, whose storage holds bytes: the resize moves them, so the work
    queued before it runs first."""
    out = torch.zeros(2, device=neuron)
    torch.accelerator.synchronize()
    out.fill_(5.0)  # queued
    torch.arange(3, out=out)
    assert queues.pending(0) == 1  # only the range's copy: the fill ran before the resize
    assert torch.equal(out.cpu(), torch.arange(3.0))


def test_a_new_range_starts_where_a_synchronization_would_start_it(neuron):
    """Not running the queue for a range keeps the timeline: the streams' clocks settle as at a synchronisation,
    so the range's copy on one stream starts after the work queued on another."""
    x = torch.randn(64, 64).to(neuron)
    _work(x), torch.arange(3, device=neuron)  # compiled, and the range's copy timed once
    torch.accelerator.synchronize()
    other = torch.Stream(device="neuron")

    def after_the_other_stream(synchronize: bool) -> float:
        with torch.neuron.stream(other):
            _work(x)
            busy = torch.Event(enable_timing=True)
            busy.record()
        if synchronize:
            torch.accelerator.synchronize()
        torch.arange(3, device=neuron)
        made = torch.Event(enable_timing=True)
        made.record()
        made.synchronize()
        return busy.elapsed_time(made)

    # the same instant, up to the rounding of clocks read at different absolute times (1e-18 ms seen alone)
    queued, settled = after_the_other_stream(synchronize=False), after_the_other_stream(synchronize=True)
    assert queued == pytest.approx(settled, rel=1e-12) and settled > 0


def test_a_cached_program_reads_a_broadcast_operand_when_it_runs_not_when_it_is_queued(neuron):
    """A program is cached by its operands' shapes and dtypes, not their strides: the program compiled for two
    dense operands is launched again with an expanded (stride 0) view of a tensor that a queued launch writes.
    It reads that view when it runs, after the writer. (Branch eager3-pieces flattened such a view with a numpy
    reshape when the op was queued: a silent copy of bytes not written yet, the NaN gradients of CosineSimilarity.)"""
    a, b = torch.randn(3, 5), torch.randn(3, 1)
    dense = a.to(neuron)
    dense * dense  # the (3, 5) * (3, 5) program, compiled with dense operands
    torch.accelerator.synchronize()
    column = b.to(neuron) + 1.0  # queued, not run yet
    product = column.expand(3, 5) * dense  # the same signature, one operand a broadcast view
    assert queues.pending(0) >= 3  # the copy, the add and the product wait
    assert torch.equal(product.cpu(), (b + 1.0).expand(3, 5) * a)


def test_a_missing_wait_reads_the_old_data(neuron):
    """The consumer on one stream reads a buffer the producer on another writes later in emulated time:
    without a wait on the producer's event it reads what the buffer held before."""
    x = torch.randn(64, 64).to(neuron)
    buffer = torch.zeros(4, device=neuron)
    _work(x), buffer.add_(1.0), buffer * 2.0  # compiled before the streams time them
    torch.accelerator.synchronize()  # the copy and fill above take time on the default stream: let them end
    producer, consumer = torch.Stream(device="neuron"), torch.Stream(device="neuron")

    def consumed(wait: bool) -> torch.Tensor:
        buffer.zero_()
        with torch.neuron.stream(producer):
            _work(x)  # keeps the producer busy ...
            buffer.add_(1.0)  # ... so this write happens later on the emulated clock
            written = torch.Event()
            written.record()
        if wait:
            consumer.wait_event(written)
        with torch.neuron.stream(consumer):
            seen = buffer * 2.0
        return seen.cpu()

    assert torch.equal(consumed(wait=False), torch.zeros(4))
    assert torch.equal(consumed(wait=True), torch.full((4,), 2.0))
    assert torch.equal(buffer.cpu(), torch.ones(4))


def test_an_error_surfaces_at_the_next_synchronization_naming_the_op(neuron):
    base = torch.tensor([2, 3], dtype=torch.int32).to(neuron)
    exponent = torch.tensor([-1, 2], dtype=torch.int32).to(neuron)
    powers = torch.pow(base, exponent)  # integers to negative powers: the NeuronCore refuses, when it runs
    line = sys._getframe().f_lineno - 1
    with pytest.raises(QueuedOpError, match="aten.pow") as raised:
        powers.cpu()
    assert f"test_device.py:{line}" in str(raised.value) and "Integers to negative" in str(raised.value)
    assert torch.equal((base * 2).cpu(), torch.tensor([4, 6], dtype=torch.int32))  # the device goes on


# ---- torch.compile on device memory ----------------------------------------------------------------

def test_compiled_model_on_the_device_runs_on_device_memory_without_host_copies(neuron):
    from neuronc.pytorch import backend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    on_device = copy.deepcopy(model).to(neuron)
    compiled = torch.compile(on_device, backend="neuron")
    x = torch.randn(5, 8)
    data = x.to(neuron)
    torch.accelerator.synchronize()
    transfers, graphs = dict(eager.host_transfers), len(backend.compiled_graphs)
    out = compiled(data)
    out.square().sum().backward()
    torch.accelerator.synchronize()
    assert eager.host_transfers == transfers  # parameters, activations and gradients never left the device
    forward, backward = backend.compiled_graphs[graphs:]
    assert forward.device_launches == backward.device_launches == 1 and out.device == neuron
    for graph in (forward, backward):  # the timeline of the run, as for CPU tensors
        assert graph.last_run.timeline.estimated_ns == pytest.approx(graph.on_device[0][1])
    assert (forward.last_run.outputs[0] == out.detach().cpu().numpy()).all()
    assert "program" not in vars(forward)  # no NEFF was loaded for host tensors
    model(x).square().sum().backward()
    assert_matches_eager(out.detach().cpu(), model(x).detach())
    assert_matches_eager([p.grad.cpu() for p in on_device.parameters()], [p.grad for p in model.parameters()])


def _compiled_on_device(neuron):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    on_device = copy.deepcopy(model).to(neuron)
    return model, on_device, torch.compile(on_device, backend="neuron")


def _called_once(compiled, neuron) -> tuple:
    """(x, x on the device) once ``compiled`` ran on them (its graph compiled and loaded, the launch done)."""
    x = torch.randn(5, 8)
    data = x.to(neuron)
    with torch.no_grad():
        compiled(data)
    torch.accelerator.synchronize()
    return x, data


def test_a_compiled_graph_reads_the_parameters_device_memory_in_place(neuron, fresh_dynamo):
    from neuronc.pytorch import backend

    model, on_device, compiled = _compiled_on_device(neuron)
    _, data = _called_once(compiled, neuron)
    (program, _), = backend.compiled_graphs[-1].on_device.values()
    inputs = program._plan.inputs  # the arrays the program reads its inputs from
    for p in on_device.parameters():  # no copy of them into the program's memory at each call
        assert sum(np.shares_memory(a, array_of(p)) for a in inputs) == 1
    assert not any(np.shares_memory(a, array_of(data)) for a in inputs)  # the data input is copied in


def test_a_parameter_changed_between_queued_compiled_calls_is_read_as_each_call_was_queued(neuron, fresh_dynamo):
    """A launch reads the parameters it was queued with: in place (``add_``) changes what it reads, as on a
    stream; a parameter in new memory (``.data = ...``) is what the next call reads, not the one queued before."""
    model, on_device, compiled = _compiled_on_device(neuron)
    x, data = _called_once(compiled, neuron)
    with torch.no_grad():
        old = compiled(data)  # queued, not run
        new_weight = torch.randn(4, 16)
        on_device[2].weight.data = new_weight.to(neuron)
        new = compiled(data)
        on_device[0].bias.add_(1)  # queued after those two: read by the third call only
        after = compiled(data)
        expected_old = model(x)
        model[2].weight.data = new_weight
        expected_new = model(x)
        model[0].bias.add_(1)
        expected_after = model(x)
    assert queues.pending(0) >= 4  # the three calls and the add_ wait for the synchronisation below
    assert_matches_eager([old.cpu(), new.cpu(), after.cpu()], [expected_old, expected_new, expected_after])


def test_a_compiled_graphs_last_run_is_its_latest_launch_on_the_device(neuron, fresh_dynamo):
    from neuronc.pytorch import backend

    model, on_device, compiled = _compiled_on_device(neuron)
    with torch.no_grad():
        compiled(torch.randn(5, 8).to(neuron))
        second = compiled(torch.randn(5, 8).to(neuron))
        torch.accelerator.synchronize()
    graph = backend.compiled_graphs[-1]
    run = graph.last_run  # (made when asked: most launches never are)

    assert graph.last_run is run
    assert (run.outputs[0] == second.cpu().numpy()).all()
    assert run.timeline.estimated_ns == pytest.approx(graph.on_device[0][1])


# ---- pinned host memory, complex tensors ---------------------------------------------------------------

def test_pinned_host_memory_is_registered_for_the_device(neuron):
    x = torch.randn(5, 3)
    pinned = x.pin_memory()
    assert not x.is_pinned() and pinned.is_pinned() and pinned[1:].is_pinned() and torch.equal(pinned, x)
    assert torch.empty(4, pin_memory=True).is_pinned()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.arange(5)), batch_size=2,
                                         pin_memory=True)
    for features, labels in loader:
        assert features.is_pinned() and labels.is_pinned()
        assert torch.equal(features.to(neuron, non_blocking=True).cpu(), features)


def test_a_non_blocking_copy_from_pinned_memory_reads_it_when_it_runs(neuron):
    """As on CUDA: the host must not change pinned memory before the copy ran; pageable memory is copied at once."""
    pinned, pageable = torch.zeros(4).pin_memory(), torch.zeros(4)
    from_pinned, from_pageable = pinned.to(neuron, non_blocking=True), pageable.to(neuron, non_blocking=True)
    pinned += 1
    pageable += 1
    assert torch.equal(from_pinned.cpu(), torch.ones(4)) and torch.equal(from_pageable.cpu(), torch.zeros(4))


def test_complex_tensors_live_on_the_device_and_their_ops_run_on_the_cpu(neuron, monkeypatch):
    z = torch.randn(3, 2, dtype=torch.complex64)
    on_device = z.to(neuron)
    monkeypatch.setattr(eager, "fallen_back", {})  # warned afresh, whatever an earlier test multiplied
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        product = (on_device * on_device).cpu()
    assert torch.equal(product, z * z) and any("complex64" in str(w.message) for w in caught)
    pairs = torch.view_as_real(on_device)  # views, as on the CPU
    assert pairs.data_ptr() == on_device.data_ptr() and torch.equal(pairs.cpu(), torch.view_as_real(z))
    assert torch.equal(torch.view_as_complex(pairs[1:]).cpu(), z[1:])


def test_repeat_and_unfold_view_device_memory(neuron):
    x = torch.randn(2, 3)
    assert torch.equal(x.to(neuron).repeat(2, 1, 2).cpu(), x.repeat(2, 1, 2))
    on_device = x.to(neuron)
    windows = on_device.unfold(1, 2, 1)
    assert windows.data_ptr() == on_device.data_ptr() and windows.stride() == x.unfold(1, 2, 1).stride()
    assert torch.equal(windows.cpu(), x.unfold(1, 2, 1))


def test_data_parallel_splits_the_batch_over_the_cores(neuron):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    parallel = torch.nn.DataParallel(copy.deepcopy(model)).to(neuron)
    assert parallel.device_ids == [0, 1]
    x = torch.randn(6, 4)
    out = parallel(x.to(neuron))
    out.square().sum().backward()
    model(x).square().sum().backward()
    assert out.device == neuron
    assert_matches_eager(out.detach().cpu(), model(x).detach())
    assert_matches_eager(parallel.module.weight.grad.cpu(), model.weight.grad)


def test_cat_and_clone_move_bytes_without_a_program_for_each_new_shape(neuron):
    a, b, c = torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 5, dtype=torch.bfloat16)
    before = len(eager.programs)
    assert torch.equal(torch.cat([a.to(neuron), b.to(neuron)]).cpu(), torch.cat([a, b]))
    assert torch.equal(torch.cat([a.to(neuron), b[:1].to(neuron)]).cpu(), torch.cat([a, b[:1]]))
    assert torch.equal(torch.cat([c.to(neuron), c.to(neuron)], -1).cpu(), torch.cat([c, c], -1))
    transposed = a.to(neuron).t()
    assert transposed.clone().stride() == a.t().clone().stride()  # preserve_format keeps a dense layout
    assert transposed.clone(memory_format=torch.contiguous_format).is_contiguous()
    assert torch.equal(transposed.clone().cpu(), a.t())
    assert len(eager.programs) == before
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([a.to(neuron), c.float().to(neuron)])
    mixed = torch.cat([a.to(neuron), b.half().to(neuron)])  # type promotion: an op like any other
    assert torch.equal(mixed.cpu(), torch.cat([a, b.half()]))
    assert torch.equal(torch.cat([a.to(neuron), b.to(neuron)]).cpu(), torch.cat([a, b]))
    assert len(eager.programs) == before + 1  # cat keeps its own kernel after the mixed call
