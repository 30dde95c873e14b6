"""A training forward saves no view of a parameter (frontend/saved_views.py): the backward remakes `W.t()` from
the parameter, and an input the forward graph returns (a parameter saved for the backward) is handed back as the
argument itself, not copied by the program (compile_fx's inputs_returned_as_given)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from neuronc.compiler import compile_fx
from neuronc.pytorch import backend
from tests.conftest import TOLERANCES


def _two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 32))


def test_a_linear_forward_returns_its_weights_as_given_and_no_transposed_copy():
    model = _two_linears()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 64)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    forward, _ = backend.compiled_graphs[before:]
    shapes = [tuple(t.shape) for t in forward.compiled.neff.outputs()]
    assert (64, 96) not in shapes and (96, 32) not in shapes  # no W.t() written by the program
    assert (96, 64) not in shapes and (32, 96) not in shapes  # nor a copy of W
    returned = [i for i in forward.compiled.output_layout if isinstance(i, tuple)]
    assert len(returned) >= 2  # both weights handed back as the arguments they are
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=name)


def test_compile_fx_returns_an_input_output_as_the_argument_only_when_asked():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, y: (x + y, y), tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 8))
    copied = compile_fx(copy.deepcopy(gm))
    given = compile_fx(copy.deepcopy(gm), inputs_returned_as_given=True)
    assert len(copied.neff.outputs()) == 2
    assert len(given.neff.outputs()) == 1
    assert given.output_layout == [0, ("input", 1)]


def test_the_heads_split_out_of_a_qkv_projection_are_saved_as_the_projection():
    """q, k and v, split out of one projection and transposed into heads for SDPA, are all read by the backward:
    the forward saves the projection (as many bytes) and the backward remakes the three views, so the forward
    program writes no [batch, heads, seq, d] copy of q, k or v; gradients stay eager's."""
    from tests.zoo import SdpaCausalSelfAttention

    torch.manual_seed(0)
    model = SdpaCausalSelfAttention(128, 2)
    reference = copy.deepcopy(model)
    x = torch.randn(1, 128, 128)
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    forward, _ = backend.compiled_graphs[before:]
    shapes = [tuple(t.shape) for t in forward.compiled.neff.outputs()]
    assert shapes.count((1, 2, 128, 64)) == 1, shapes  # the attention's output alone, no q, k, v
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCES[torch.float32], msg=name)
