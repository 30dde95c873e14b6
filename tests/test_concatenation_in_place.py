"""A custom kernel whose outputs only one concatenation reads writes them into their places in it
(passes/concatenation_in_place.py): the kernel node becomes the concatenation, with `output_views` giving each
output's place; anything else keeps its concatenate."""
from __future__ import annotations

import numpy as np

import neuronc.nki as nki
import neuronc.nki.language as nl
from neuronc import ir_verifier
from neuronc.ir import Op
from neuronc.ir_text import parse
from neuronc.nki.kernel import register
from neuronc.passes.concatenation_in_place import write_outputs_into_concatenations
from neuronc.passes.context import PassContext


@nki.jit
def heads_and_doubled(x):
    """x ([heads, rows, d]) and 2 x, stored head by head, rows of d."""
    same = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    doubled = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for h in nl.affine_range(x.shape[0]):
        tile = nl.load(x[h])
        nl.store(same[h], value=tile)
        nl.store(doubled[h], value=nl.multiply(tile, 2.0))
    return same, doubled


def _graph(concatenation: str, more: str = "", returned: str = "%3") -> str:
    """A [2, 128, 64] input, the kernel on it, its second output, and `concatenation` as %3 (then `more`)."""
    ref = register(heads_and_doubled.trace(np.zeros((2, 128, 64), np.float32)))
    return f"""
graph @main(%0) {{
  %0 = parameter() : 2x128x64xf32 {{index = 0, name = "x", kind = "input"}}
  %1 = custom_kernel(%0) : 2x128x64xf32 {{kernel = KernelRef(name="{ref.name}", key="{ref.key}"),
      outputs = (((2, 128, 64), DType.F32), ((2, 128, 64), DType.F32)), scratch = ()}}
  %2 = kernel_output(%1) : 2x128x64xf32 {{index = 1}}
  %3 = {concatenation}
{more}  return {returned}
}}"""


def _rewritten(text: str):
    graph = write_outputs_into_concatenations(parse(text), PassContext(opt_level=2))
    ir_verifier.verify(graph, "write_outputs_into_concatenations")
    return graph


def test_a_kernel_writes_both_outputs_into_their_concatenation():
    graph = _rewritten(_graph("concatenate(%1, %2) : 4x128x64xf32 {dimension = 0}"))
    (kernel,) = graph.outputs
    assert kernel.op is Op.CUSTOM_KERNEL and kernel.shape == (4, 128, 64)
    assert kernel.attrs["outputs"] == (((4, 128, 64), kernel.dtype),)
    # the second output starts after the first's 2 * 128 * 64 elements, both dense
    assert kernel.attrs["output_views"] == ((0, (8192, 64, 1)), (16384, (8192, 64, 1)))
    assert Op.CONCATENATE not in {n.op for n in graph.nodes()} and Op.KERNEL_OUTPUT not in {
        n.op for n in graph.nodes()}


def test_outputs_the_concatenation_reads_through_head_views_are_written_as_rows():
    """As the flash backward's dq, dk, dv: [heads, rows, d] each, concatenated as [rows, heads * d] side by side
    (each read through its head transpose: passes/view_chains.py's `views`)."""
    viewed = "(0, (64, 8192, 1), (128, 2, 64), (256, 64, 1))"
    graph = _rewritten(_graph(f"concatenate(%1, %2) : 128x256xf32 {{dimension = 1, views = ({viewed}, {viewed}), "
                              f"shapes = ((128, 128), (128, 128))}}"))
    (kernel,) = graph.outputs
    assert kernel.op is Op.CUSTOM_KERNEL and kernel.shape == (128, 256)
    # element (head, row, d) of each output at row * 256 + head * 64 + d, the second from column 128
    assert kernel.attrs["output_views"] == ((0, (64, 256, 1)), (128, (64, 256, 1)))


def test_an_output_read_by_another_node_keeps_the_concatenate():
    text = _graph("concatenate(%1, %2) : 4x128x64xf32 {dimension = 0}",
                  "  %4 = negate(%2) : 2x128x64xf32\n", returned="%3, %4")
    graph = _rewritten(text)
    assert Op.CONCATENATE in {n.op for n in graph.nodes()}
    assert not any("output_views" in n.attrs for n in graph.nodes())


def test_a_concatenation_of_a_kernel_output_and_another_tensor_keeps_the_concatenate():
    graph = _rewritten(_graph("concatenate(%1, %2, %0) : 6x128x64xf32 {dimension = 0}"))
    assert graph.outputs[0].op is Op.CONCATENATE
