"""NKI kernels as PyTorch custom ops: eager on `neuron` tensors, one kernel of a torch.compile graph's NEFF (no
graph break), and training through a torch.autograd.Function with a backward kernel."""
from __future__ import annotations

import pytest
import torch

import neuronc.nki as nki
import neuronc.nki.language as nl
from neuronc.errors import NeuronCompileError
from neuronc.pytorch.backend import compiled_graphs
from tests.conftest import assert_matches_eager


@nki.jit
def add_kernel(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.load(a) + nl.load(b))
    return out


@nki.jit
def sum_and_max_kernel(a):
    """Two outputs: row sums and row maxima."""
    total = nl.ndarray((a.shape[0], 1), dtype=a.dtype, buffer=nl.shared_hbm)
    top = nl.ndarray((a.shape[0], 1), dtype=a.dtype, buffer=nl.shared_hbm)
    x = nl.load(a)
    nl.store(total, nl.sum(x, axis=1, keepdims=True))
    nl.store(top, nl.max(x, axis=1, keepdims=True))
    return total, top


@nki.jit
def square_kernel(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nl.store(out, t * t)
    return out


@nki.jit
def square_backward_kernel(x, grad):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.load(x) * nl.load(grad) * 2.0)
    return out


@torch.library.custom_op("nkitest::add", mutates_args=())
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return add_kernel(a, b)


add.register_fake(lambda a, b: torch.empty_like(a))


@torch.library.custom_op("nkitest::sum_and_max", mutates_args=())
def sum_and_max(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return sum_and_max_kernel(a)


sum_and_max.register_fake(lambda a: (a.new_empty((a.shape[0], 1)), a.new_empty((a.shape[0], 1))))


@torch.library.custom_op("nkitest::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return square_kernel(x)


square.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("nkitest::square_backward", mutates_args=())
def square_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return square_backward_kernel(x, grad)


square_backward.register_fake(lambda x, grad: torch.empty_like(x))


@torch.library.custom_op("nkitest::add_then_scale", mutates_args=())
def add_then_scale(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return add_kernel(a, b) * 2


add_then_scale.register_fake(lambda a, b: torch.empty_like(a))


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return square(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return square_backward(x, grad)


def inputs(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape), torch.randn(*shape)


def test_a_kernel_op_runs_eagerly_on_neuron_tensors_in_their_device_memory():
    a, b = inputs(128, 64)
    out = add(a.to("neuron"), b.to("neuron"))
    assert out.device.type == "neuron"
    assert_matches_eager(out.cpu(), a + b)


def test_a_kernel_op_runs_on_cpu_tensors_through_an_emulated_core():
    a, b = inputs(128, 64)
    assert_matches_eager(add(a, b), a + b)


def model(x, y):
    return torch.tanh(add(torch.relu(x) * 2, y)) + 1


def eager_model(x, y):
    return torch.tanh(torch.relu(x) * 2 + y) + 1


def test_a_kernel_op_in_a_compiled_graph_is_one_kernel_of_its_neff():
    x, y = inputs(128, 64)
    before = len(compiled_graphs)
    out = torch.compile(model, backend="neuron")(x, y)
    assert_matches_eager(out, eager_model(x, y))
    assert len(compiled_graphs) == before + 1  # one graph: no break around the custom op
    ops = [kernel.ops for kernel in compiled_graphs[-1].compiled.neff.kernels]
    assert ("nki:add_kernel",) in ops and len(ops) >= 3  # between the compiler's own kernels


def test_a_compiled_graph_with_a_kernel_op_runs_on_neuron_tensors():
    x, y = inputs(128, 64)
    out = torch.compile(model, backend="neuron")(x.to("neuron"), y.to("neuron"))
    assert out.device.type == "neuron"
    assert_matches_eager(out.cpu(), eager_model(x, y))


def test_a_kernel_with_two_outputs_in_a_compiled_graph():
    x, _ = inputs(128, 96)

    def f(a):
        total, top = sum_and_max(a * 3)
        return total - top

    assert_matches_eager(torch.compile(f, backend="neuron")(x), (x * 3).sum(1, keepdim=True) - (x * 3).amax(1, keepdim=True))


def test_an_unused_second_output_still_has_memory_to_be_written():
    x, _ = inputs(128, 96)

    def f(a):
        total, _top = sum_and_max(a + 1)
        return total * 2

    assert_matches_eager(torch.compile(f, backend="neuron")(x), (x + 1).sum(1, keepdim=True) * 2)


def test_an_autograd_function_with_a_backward_kernel_trains_under_compile():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64)

    def loss_of(inp):
        return Square.apply(linear(inp)).mean()

    loss_of(x).backward()
    expected = [p.grad.clone() for p in linear.parameters()]
    linear.zero_grad()
    loss = torch.compile(loss_of, backend="neuron")(x)
    loss.backward()
    assert_matches_eager(loss, torch.nn.functional.linear(x, linear.weight, linear.bias).square().mean())
    for p, want in zip(linear.parameters(), expected):
        assert_matches_eager(p.grad, want)
    kernels = [k.ops for g in compiled_graphs[-2:] for k in g.compiled.neff.kernels]
    assert ("nki:square_kernel",) in kernels and ("nki:square_backward_kernel",) in kernels


def test_a_custom_op_doing_more_than_calling_its_kernel_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")  # else it runs on the CPU (partition.py)
    x, y = inputs(128, 64)
    with pytest.raises(Exception) as e:
        torch.compile(lambda a, b: add_then_scale(a, b) + 1, backend="neuron")(x, y)
    error = e.value if isinstance(e.value, NeuronCompileError) else e.value.__cause__ or e.value
    assert "custom op nkitest::add_then_scale cannot be compiled: its body failed on fake tensors after calling NKI " \
        "kernel add_kernel" in str(error)
    assert "must call one @nki.jit kernel on its arguments and return that kernel's outputs" in str(error)


@nki.jit
def add_into_kernel(a, out):
    """The older NKI style: the result written into an argument."""
    nl.store(out, nl.load(a) + 1.0)


def test_a_kernel_writing_its_argument_updates_the_neuron_tensor_in_place():
    a = torch.rand(128, 32)
    out = torch.zeros(128, 32, device="neuron")
    add_into_kernel(a.to("neuron"), out)
    torch.testing.assert_close(out.cpu(), a + 1.0)


@nki.jit
def masked_square_kernel(x):
    """As the AWS RMSNorm sample: a masked load of the last partial row tile, the whole tile squared, the loaded
    rows stored."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows = nl.arange(128)[:, None]
    cols = nl.arange(x.shape[1])[None, :]
    t = nl.load(x[rows, cols], mask=rows < x.shape[0])
    nl.store(out[rows, cols], value=t * t, mask=rows < x.shape[0])
    return out


@torch.library.custom_op("nkitest::masked_square", mutates_args=())
def masked_square(x: torch.Tensor) -> torch.Tensor:
    return masked_square_kernel(x)


masked_square.register_fake(lambda x: torch.empty_like(x))


def test_a_kernel_computing_on_a_partly_loaded_tile_runs_in_a_compiled_graph():
    x, y = inputs(100, 64)
    out = torch.compile(lambda a, b: masked_square(a + b) - 1, backend="neuron")(x, y)
    assert_matches_eager(out, (x + y) ** 2 - 1)
