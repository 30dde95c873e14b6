"""Ops beyond the first zoo, each checked against eager: embedding lookups (gather), reversal,
transposed convolution (kernel layouts other than [o, i, spatial]), Python-style remainder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from neuronc.compiler import compile_exported
from neuronc.errors import NeuronRuntimeError
from runtime import run_neff
from tests.conftest import assert_matches_eager


class TokenAndPosition(torch.nn.Module):
    def __init__(self, vocab=300, width=200, positions=16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))


@pytest.fixture(scope="module")
def embedding():
    torch.manual_seed(0)
    model, idx = TokenAndPosition().eval(), torch.randint(0, 300, (3, 16))
    return compile_exported(torch.export.export(model, (idx,))).neff, model, idx


def test_embedding_lookups_match_eager(embedding):
    neff, model, idx = embedding
    out = run_neff(neff, [idx.numpy()]).outputs[0]
    assert_matches_eager(torch.from_numpy(out), model(idx).detach())


def test_an_index_out_of_range_is_an_error_naming_the_lookup(embedding):
    neff, _, idx = embedding
    bad = idx.numpy().copy()
    bad[1, 3] = 300
    with pytest.raises(NeuronRuntimeError, match="300") as caught:
        run_neff(neff, [bad])
    assert "DMA_GATHER" in str(caught.value) and "test_ops.py" in str(caught.value)


def test_torch_compile_of_an_embedding_matches_eager():
    torch.manual_seed(1)
    model, idx = TokenAndPosition(vocab=50, width=8).eval(), torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert_matches_eager(torch.compile(model, backend="neuron")(idx), model(idx))
    assert np.all(idx.numpy() < 50)


class Flip(torch.nn.Module):
    def forward(self, x):
        return torch.flip(x, [0, 2]) * 2


class UpConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return self.up(x)


@pytest.mark.parametrize("model, shape", [(Flip(), (3, 4, 5)), (UpConv(), (2, 4, 5, 5))], ids=["flip", "conv_transpose"])
def test_reversal_and_transposed_convolution_match_eager(model, shape):
    torch.manual_seed(2)
    x = torch.randn(*shape)
    neff = compile_exported(torch.export.export(model.eval(), (x,))).neff
    out = run_neff(neff, [x.numpy()]).outputs[0]
    assert_matches_eager(torch.from_numpy(out), model(x).detach())


@pytest.mark.parametrize("divisor", [0.7, -0.7, 3, -3, "tensor"], ids=["f", "f-neg", "int", "int-neg", "tensor"])
def test_remainder_takes_the_divisor_sign_as_python_and_torch_do(divisor):
    torch.manual_seed(3)
    integer = isinstance(divisor, int)
    x = torch.randint(-9, 10, (4, 8)) if integer else torch.randn(4, 8) * 3
    args = (x, torch.randn(4, 8)) if divisor == "tensor" else (x,)
    fn = (lambda a, b: torch.remainder(a, b)) if divisor == "tensor" else (lambda a: a % divisor)
    model = Lambda(fn)
    neff = compile_exported(torch.export.export(model, args)).neff
    out = run_neff(neff, [a.numpy() for a in args]).outputs[0]
    assert_matches_eager(torch.from_numpy(out), model(*args))


class Lambda(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)
