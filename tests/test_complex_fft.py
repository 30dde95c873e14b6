"""Complex numbers as pairs of reals (frontend/complex_pairs.py) and FFTs as DFT matmuls (frontend/fft.py),
compiled strictly on the device and held to eager PyTorch on CPU at the fp32 tolerance (a complex64 result
compared as its fp32 parts)."""
from __future__ import annotations

import pytest
import torch

from neuronc.errors import NeuronCompileError
from neuronc.frontend import complex_pairs, fft
from neuronc.tolerances import TOLERANCES

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")

FP32 = TOLERANCES[torch.float32]


def _real(t):
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _matches_eager(fn, *inputs):
    """Each output has eager's shape and dtype (complex ones included) and its values within fp32's tolerance."""
    torch._dynamo.reset()
    got = torch.compile(fn, backend="neuron", fullgraph=True)(*inputs)
    want = fn(*inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{g.dtype}{list(g.shape)} != eager {w.dtype}{list(w.shape)}"
        torch.testing.assert_close(_real(g), _real(w), **FP32)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


NORMS = (None, "ortho", "forward")


@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"])
def test_one_dimensional_transforms_in_every_norm(name):
    transform = getattr(torch.fft, name)
    _matches_eager(lambda x: tuple(transform(x, norm=norm) for norm in NORMS), _randn(3, 7))


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "hfft"])
def test_a_length_pads_or_trims_the_signal(name):
    transform = getattr(torch.fft, name)
    _matches_eager(lambda x: (transform(x, n=4, dim=0), transform(x, n=10, dim=0)), _randn(6, 3))


@pytest.mark.parametrize("name", ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"])
def test_two_dimensional_transforms(name):
    transform = getattr(torch.fft, name)
    _matches_eager(lambda x: (transform(x), transform(x, norm="ortho", dim=(0, 2))), _randn(4, 5, 6))


@pytest.mark.parametrize("name", ["fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"])
def test_n_dimensional_transforms_with_sizes(name):
    transform = getattr(torch.fft, name)
    _matches_eager(lambda x: (transform(x), transform(x, s=(3, 8), dim=(0, 2))), _randn(4, 5, 6))


def test_complex_inputs_and_outputs_cross_the_boundary_as_views():
    z, w = _randn(4, 6, dtype=torch.complex64), _randn(4, 6, dtype=torch.complex64, seed=1)
    _matches_eager(lambda a, b: (a * b + a.conj(), a / b, torch.fft.ifft(a) - 2j * b), z, w)


def test_complex_device_tensors_stay_on_the_device(neuron):
    z, x = _randn(4, 6, dtype=torch.complex64), _randn(4, 8, seed=1)
    fn = lambda a, b: (a * 2 + torch.fft.fft(b).sum(), torch.fft.rfft(b).abs())  # noqa: E731 - the program under test
    torch._dynamo.reset()
    got = torch.compile(fn, backend="neuron", fullgraph=True)(z.to(neuron), x.to(neuron))
    for g, w in zip(got, fn(z, x)):
        assert g.device == neuron and g.dtype == w.dtype
        torch.testing.assert_close(_real(g.cpu()), _real(w), **FP32)


def test_a_conjugated_input_is_read_conjugated():
    z = _randn(5, dtype=torch.complex64).conj()
    assert z.is_conj()
    _matches_eager(lambda a: a * (1 + 1j), z)


def test_parts_magnitudes_and_phases():
    x, y = _randn(3, 8), _randn(3, 8, seed=1)
    _matches_eager(lambda a, b: (torch.complex(a, b).abs(), torch.complex(a, b).angle(), torch.complex(a, b).exp(),
                                 torch.complex(a, b).sgn(), torch.polar(a.abs(), b).real,
                                 torch.view_as_real(torch.view_as_complex(torch.stack([a, b], -1)) * 3),
                                 torch.fft.fft(a).imag), x, y)


def test_logarithms_roots_and_powers():
    """Across the branch cut (negative reals with an imaginary part of +0 and -0), at 0, tiny and random values;
    powers by integers, a half, a real, a complex number and a complex tensor, and of a real base and a number."""
    z = _randn(3, 8, dtype=torch.complex64)
    z[0, :6] = torch.tensor([0, -4, 4, 1e-3, -1e-3 + 1e-7j, 2j], dtype=torch.complex64)
    z[0, 6] = complex(-4.0, -0.0)
    w = _randn(3, 8, dtype=torch.complex64, seed=1)
    _matches_eager(lambda a, b: (torch.log(a), torch.sqrt(a), a ** 2, a ** 3, a ** 0.5, a ** 0, a[1:] ** 1.7,
                                 a[1:] ** (0.5 + 1j), a[1:] ** b[1:], 2.0 ** a, a.real[1:] ** b[1:]), z, w)


def test_the_phase_of_a_negative_real_bin_is_pi_as_eager():
    """Bin 0 of a signal summing below zero: pocketfft's imaginary part is +0, so eager's angle is +pi."""
    _matches_eager(lambda x: torch.fft.rfft(x).angle(), -_randn(2, 8).abs())


def test_a_spectral_filter_round_trips():
    """FNet/FNO-style: rfft, multiply the bins by complex weights, irfft back."""
    x, weights = _randn(2, 16), _randn(9, dtype=torch.complex64, seed=1)
    _matches_eager(lambda a, w: torch.fft.irfft(torch.fft.rfft(a) * w, n=16), x, weights)


def test_a_short_time_fourier_transform():
    """stft's frames (unfold), window and rfft; its squeeze of a complex value is decomposed as the graph's own."""
    window = torch.hann_window(16)
    _matches_eager(lambda x: torch.stft(x, 16, hop_length=4, window=window, return_complex=True), _randn(2, 64))


def test_shifts_and_views_of_complex_values():
    _matches_eager(lambda x: (torch.fft.fftshift(torch.fft.fft2(x)), torch.fft.fft(x).transpose(0, 1)[1:, ::2],
                              torch.cat([torch.fft.fft(x), torch.fft.ifft(x)], -1).reshape(-1)), _randn(4, 6))


def test_the_gradient_of_a_spectrum_matches_eager():
    x, weights = _randn(3, 8), _randn(3, 5, 2, seed=1)

    def loss(t):
        return (torch.view_as_real(torch.fft.rfft(t, norm="ortho")) * weights).sum()

    def gradient(fn):
        t = x.clone().requires_grad_(True)
        fn(t).backward()
        return t.grad

    torch._dynamo.reset()
    torch.testing.assert_close(gradient(torch.compile(loss, backend="neuron")), gradient(loss), **FP32)


def _refusal(fn, *inputs) -> NeuronCompileError:
    """The NeuronCompileError torch.compile's backend raised (Dynamo wraps it)."""
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        torch.compile(fn, backend="neuron", fullgraph=True)(*inputs)
    assert isinstance(caught.value.inner_exception, NeuronCompileError)
    return caught.value.inner_exception


@pytest.mark.parametrize("n", [fft.MAX_LENGTH + 1, 257])  # past the limit; a prime past one matmul's length
def test_a_transform_the_limits_exclude_is_refused_by_name(n):
    err = _refusal(torch.fft.rfft, _randn(n))
    assert f"a real FFT of length {n}" in str(err) and "CPU" in str(err)


@pytest.mark.cpu_fallback
def test_with_the_fallback_a_refused_length_runs_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION")
    _matches_eager(lambda x: torch.fft.rfft(x * 2), _randn(2, fft.MAX_LENGTH + 1))


def test_a_length_that_factors_is_split_into_short_dfts():
    """512 = 16 * 16 * 2 and 240 = 16 * 15: three and two stages of twiddled DFTs, like eager's."""
    _matches_eager(lambda x, y: (torch.fft.fft(x), torch.fft.irfft(torch.fft.rfft(y), n=240)),
                   _randn(2, 512), _randn(2, 240, seed=1))


def _error(got, x, transform):
    return (got.double() - _real(transform(x.double()))).abs().max().item()


@pytest.mark.parametrize("name", ["fft", "ifft", "rfft"])
def test_dft_error_at_the_longest_length(name):
    """At MAX_LENGTH, the DFTs (applied on the host in fp32) are off float64 by less than twice eager's own
    error, and at one matmul's longest (a prime length) within fp32's tolerance of eager on every value."""
    forward, transform = name != "ifft", getattr(torch.fft, name)
    norm = fft.NORM_NONE if forward else fft.NORM_N

    def ours(x):
        if name == "rfft":
            return fft.r2c(x, [1], norm, onesided=True)
        return fft.c2c(torch.stack([x, torch.zeros_like(x)], -1), [1], norm, forward)

    x = _randn(64, fft.MAX_LENGTH)
    assert _error(ours(x), x, transform) < 2 * _error(_real(transform(x)), x, transform)
    prime = _randn(64, 251)
    torch.testing.assert_close(ours(prime), _real(transform(prime)), **FP32)


def test_a_graph_without_complex_values_is_left_alone():
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: x * 2, tracing_mode="fake")(torch.ones(3))
    assert complex_pairs.as_real_pairs(gm) is None


def test_a_complex_op_without_a_pair_rule_is_still_refused_strictly():
    assert "aten.sin.default" in str(_refusal(torch.sin, _randn(4, dtype=torch.complex64)))
