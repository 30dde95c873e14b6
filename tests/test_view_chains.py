"""A view of a reshaped view (attention's heads: slice q out of the projection, split the heads, transpose them)
reads the projection once at -O2 (passes/view_chains.py): one copy kernel where there were two, the same values."""
from __future__ import annotations

import torch
import torch.nn as nn

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.frontend.tensors import from_numpy, to_numpy
from neuronc.ir import Op
from neuronc.ir_text import parse, to_text
from neuronc.passes.context import PassContext
from neuronc.passes.view_chains import compose_view_chains
from runtime import run_neff


class HeadsOfK(nn.Module):
    def forward(self, qkv):  # [1, 128, 3 * 64]: k's 4 heads of 16, transposed (an output)
        k = qkv.split(64, dim=-1)[1].view(1, 128, 4, 16).transpose(1, 2)
        return k.contiguous()


def _views(graph):
    return [n for n in graph.nodes() if n.op is Op.VIEW]


def test_the_head_transpose_reads_the_projection_itself():
    qkv = torch.randn(1, 128, 192)
    program = torch.export.export(HeadsOfK(), (qkv,))
    compiled = compile_exported(program, CompileOptions(opt_level=0))
    graph = compiled.graph
    assert len(_views(graph)) == 2  # the slice and the transpose, through a reshape
    composed = compose_view_chains(parse(to_text(graph)), PassContext(opt_level=2))
    (head_view,) = [v for v in _views(composed) if v.shape == (1, 4, 128, 16)]
    assert head_view.inputs[0] is composed.params[0]  # the projection itself, not the slice's copy
    assert head_view.attrs["strides"][1:] == (16, 192, 1) and head_view.attrs["offset"] == 64


def test_one_copy_at_o2_and_the_values_of_eager():
    torch.manual_seed(0)
    qkv = torch.randn(1, 128, 192)
    program = torch.export.export(HeadsOfK(), (qkv,))
    compiled = compile_exported(program, CompileOptions(opt_level=2))
    out = from_numpy(run_neff(compiled.neff, [to_numpy(qkv)]).outputs[0])
    assert len(_views(compiled.graph)) <= 1
    torch.testing.assert_close(out, HeadsOfK()(qkv))


class HeadsConcatenated(nn.Module):
    def forward(self, dq, dk, dv):  # [heads, seq, d] each, back to [seq, heads * d], side by side (QKV's gradient)
        return torch.cat([t.exp().transpose(0, 1).reshape(128, 64) for t in (dq, dk, dv)], dim=-1)


def test_a_concatenate_reads_transposed_heads_through_their_views_with_no_copy_kernel():
    torch.manual_seed(0)
    heads = tuple(torch.randn(4, 128, 16) for _ in range(3))
    program = torch.export.export(HeadsConcatenated(), heads)
    compiled = compile_exported(program, CompileOptions(opt_level=2))
    out = from_numpy(run_neff(compiled.neff, [to_numpy(h) for h in heads]).outputs[0])
    (concatenated,) = [n for n in compiled.graph.nodes() if n.op is Op.CONCATENATE]
    assert all(view is not None for view in concatenated.attrs["views"])
    assert not _views(compiled.graph)
    torch.testing.assert_close(out, HeadsConcatenated()(*heads))
