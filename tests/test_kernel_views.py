"""A custom kernel reads an input that is a view chain read by it alone through the composed view
(passes/kernel_views.py): the flash backward reads q, k, v (split into heads out of the saved QKV projection) and
the output gradient (split into heads) from those tensors themselves, with no copy, and the gradients keep -O0's
bits."""
from __future__ import annotations

import copy

import torch

from benchmarks.roofline import _aot_graphs
from neuronc.compiler import CompileOptions, compile_fx
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from neuronc.isa import AccessPattern, DType, Space
from neuronc.nki.kernel import read_through
from runtime import run_neff
from tests.zoo import SdpaCausalSelfAttention


def _graphs():
    """AOTAutograd's forward and backward graphs of a bf16 causal self-attention (QKV projection, heads, flash
    kernels, projection), the forward's inputs, and the backward's: the values the forward saved (run eagerly)
    and an output gradient."""
    torch.manual_seed(0)
    model = SdpaCausalSelfAttention(128, 2).to(torch.bfloat16)
    x = torch.randn(1, 256, 128).to(torch.bfloat16)
    forward, backward = _aot_graphs(model, (x,), True)
    primals = [x] + [p.detach() for p in model.parameters()]  # Dynamo lifts the input first
    out, *saved = forward(*primals)
    grad = torch.randn(out.shape).to(out.dtype)
    return forward, primals, backward, [*saved, grad]


def _run(graph, inputs, level):
    compiled = compile_fx(copy.deepcopy(graph), CompileOptions(opt_level=level), inputs_returned_as_given=True)
    outputs = run_neff(compiled.neff, [to_numpy(t) for t in inputs]).outputs
    return compiled, [None if i is None or isinstance(i, tuple) else from_numpy(outputs[i])
                      for i in compiled.output_layout]


def test_the_flash_backward_reads_the_output_gradient_through_its_heads_view_with_o0s_bits():
    _, _, backward, inputs = _graphs()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    (kernel,) = [n for n in optimised.graph.nodes() if n.op is Op.CUSTOM_KERNEL]
    assert Op.VIEW not in {n.op for n in optimised.graph.nodes()}  # no copy of dO into heads
    read = {i: view for i, view in enumerate(kernel.attrs["views"]) if view is not None}
    # q, k, v as [heads, seq, d] in the saved [seq, 3 * width] projection; dO in the [seq, width] gradient
    assert read == {0: (0, (64, 384, 1)), 1: (128, (64, 384, 1)), 2: (256, (64, 384, 1)), 4: (0, (64, 128, 1))}
    assert kernel.inputs[0] is kernel.inputs[1] is kernel.inputs[2] and kernel.inputs[4].shape[-2:] == (256, 128)
    _assert_o0s_bits_and_close_to_eager(out, baseline, backward(*inputs))


def test_the_flash_backward_writes_dq_dk_dv_into_the_qkv_gradient_with_o0s_bits():
    """passes/concatenation_in_place.py: no concatenate kernel; the kernel stores each gradient's heads as rows
    of 64 of the [seq, 3 * width] gradient of the QKV projection."""
    _, _, backward, inputs = _graphs()
    optimised, out = _run(backward, inputs, 2)
    _, baseline = _run(backward, inputs, 0)
    (kernel,) = [n for n in optimised.graph.nodes() if n.op is Op.CUSTOM_KERNEL]
    assert Op.CONCATENATE not in {n.op for n in optimised.graph.nodes()}
    assert kernel.shape[-2:] == (256, 384)
    assert kernel.attrs["output_views"] == ((0, (64, 384, 1)), (128, (64, 384, 1)), (256, (64, 384, 1)))
    _assert_o0s_bits_and_close_to_eager(out, baseline, backward(*inputs))


def test_an_access_maps_through_a_view_only_when_it_stays_one_access_pattern():
    """Rows of a head ([heads, seq, d] dense) are rows of 64 of the [seq, heads * d] tensor; a run over the head
    axis and d together crosses a dim the view reorders."""
    shape, view = (2, 256, 64), (0, (64, 128, 1))
    head1_rows = AccessPattern(Space.HBM, DType.BF16, 256 * 64 * 2, ((64, 128), (1, 64)))
    mapped = read_through(head1_rows, shape, *view)
    assert mapped.offset == 64 * 2 and mapped.dims == ((128, 128), (1, 64))
    flat = AccessPattern(Space.HBM, DType.BF16, 0, ((1, 2 * 256 * 64),))
    assert read_through(flat, shape, *view) is None


def test_the_flash_forward_reads_q_k_v_through_their_heads_views_with_o0s_bits():
    forward, inputs, _, _ = _graphs()
    optimised, out = _run(forward, inputs, 2)
    _, baseline = _run(forward, inputs, 0)
    (kernel,) = [n for n in optimised.graph.nodes() if n.op is Op.CUSTOM_KERNEL]
    assert kernel.attrs["views"] == ((0, (64, 384, 1)), (128, (64, 384, 1)), (256, (64, 384, 1)))
    _assert_o0s_bits_and_close_to_eager(out, baseline, forward(*inputs))


def _assert_o0s_bits_and_close_to_eager(outputs, baseline, expected) -> None:
    """Each output has the -O0 program's bits and is close to the graph run eagerly: eager rounds each op to bf16
    where the flash kernels keep fp32, so close as a whole (relative norm 1e-2), not element by element."""
    for value, base, eager in zip(outputs, baseline, expected):
        if value is None:
            continue
        assert torch.equal(value, base)
        error = torch.linalg.vector_norm(value.float() - eager.float()) / torch.linalg.vector_norm(eager.float())
        assert error < 1e-2
