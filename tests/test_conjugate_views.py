"""PyTorch's lazy ``conj()`` and negative views mark a tensor, not its bytes: on the `neuron` device their values
are read (clone, copies, ops) and written (in-place ops on a marked view) as on the CPU. Before, the device copied
the bytes as they lay: ``torch.fft.ifft`` of a real signal (an r2c transform, then ``conj()``) gave the
conjugate, and in-place ops on a marked view were lost."""
from __future__ import annotations

import pytest
import torch

READS = {
    "conj() to the host": lambda z, w, x: z.conj(),
    "resolve_conj": lambda z, w, x: z.conj().resolve_conj(),
    "conj() times one": lambda z, w, x: z.conj() * 1,
    "conj() in a matmul": lambda z, w, x: z.conj() @ w,
    "mH @ z": lambda z, w, x: z.mH @ z,
    "imag of conj() (a negative view), cloned": lambda z, w, x: torch.imag(z.conj()).clone(),
    "cat of conj()": lambda z, w, x: torch.cat([z.conj(), z]),
    "ifft of a real signal": lambda z, w, x: torch.fft.ifft(x),
    "ihfft": lambda z, w, x: torch.fft.ihfft(x),
    "conj() of a host tensor to the device": None,
}

WRITES = {
    "add_": lambda v, z: v.add_(1),
    "mul_ by 2j": lambda v, z: v.mul_(2j),
    "copy_ from the device": lambda v, z: v.copy_(z.to(v.device)),
    "copy_ from the host": lambda v, z: v.copy_(z),
    "copy_ from a conj() view": lambda v, z: v.copy_(z.to(v.device).conj()),
}


@pytest.fixture
def values():
    torch.manual_seed(0)
    return (torch.complex(torch.randn(3, 4), torch.randn(3, 4)), torch.complex(torch.randn(4, 2), torch.randn(4, 2)),
            torch.randn(3, 4))


def _resolved(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg()


@pytest.mark.parametrize("name", READS)
def test_a_marked_tensor_is_read_by_its_values(name, values, neuron):
    fn = READS[name]
    if fn is None:
        got, expected = values[0].conj().to(neuron).cpu(), values[0].conj()
    else:
        got, expected = fn(*(v.to(neuron) for v in values)).cpu(), fn(*values)
    torch.testing.assert_close(_resolved(got), _resolved(expected))


@pytest.mark.parametrize("name", WRITES)
def test_an_in_place_op_on_a_conj_view_writes_the_tensor_under_it(name, values, neuron):
    z = values[0]
    on_host, on_device = z.clone(), z.to(neuron)
    WRITES[name](on_host.conj(), z)
    WRITES[name](on_device.conj(), z)
    torch.testing.assert_close(on_device.cpu(), on_host)


def test_an_in_place_op_on_a_negative_view_writes_the_tensor_under_it(neuron):
    on_host = torch.tensor([1.0, 2.0])
    on_device = on_host.to(neuron)
    on_host._neg_view().add_(1)
    on_device._neg_view().add_(1)
    assert torch.equal(on_device.cpu(), on_host)


def test_a_device_tensor_copied_into_a_conj_view_on_the_host_is_conjugated(values, neuron):
    z = values[0]
    on_host, expected = torch.zeros_like(z), torch.zeros_like(z)
    on_host.conj().copy_(z.to(neuron))
    expected.conj().copy_(z)
    assert torch.equal(on_host, expected)


def test_a_conj_view_copied_to_another_core_is_copied_by_its_values(values, neuron):
    z = values[0]
    on_core_1 = torch.empty_like(z, device="neuron:1")
    on_core_1.copy_(z.to(neuron).conj())
    assert torch.equal(on_core_1.cpu(), z.conj().resolve_conj())


def test_a_compiled_graph_reads_a_negative_view_by_its_values(values, neuron, fresh_dynamo):
    """A negative view (what PyTorch makes of ``z.conj().imag``) given to a compiled graph is computed with by its
    values, as eager does: the device path read its bytes, the CPU path refused it converting to numpy."""
    x = values[2]
    compiled = torch.compile(lambda a: torch.sin(a) * 2, backend="neuron")
    expected = torch.sin(-x) * 2
    torch.testing.assert_close(compiled(x.to(neuron)._neg_view()).cpu(), expected)
    torch.testing.assert_close(compiled(x._neg_view()), expected)
