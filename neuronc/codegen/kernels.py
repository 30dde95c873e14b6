"""Kernels: each legalised op becomes a tiled instruction sequence for the emulated NeuronCore.

One function per kernel form, in a registry keyed by op; each form lives in a module of its own. Every
kernel respects the tile rules of the target: at most `partitions` rows on chip, matmul stationary
[K<=128, M<=128] and moving [K<=128, N<=512] accumulating in fp32 in one PSUM bank, data moved HBM<->SBUF
by DMA.
"""
from __future__ import annotations

from typing import Callable

from neuronc import ir
from neuronc.codegen.attention import attention
from neuronc.codegen.collective import collective
from neuronc.codegen.conv import convolution
from neuronc.codegen.custom import custom_kernel
from neuronc.codegen.emitter import Emitter
from neuronc.codegen.elementwise import bitcast_copy, concatenate, elementwise, pad, splat_constant, view_copy
from neuronc.codegen.indexing import gather_rows, scatter_rows, topk
from neuronc.codegen.matmul import matmul
from neuronc.codegen.rng import random_kernel
from neuronc.codegen.rowwise import reduce_last, rowwise
from neuronc.ir import Node, Op
from neuronc.plans import MemoryPlan


KERNELS = {op: elementwise for op in (ir.ELEMENTWISE - {Op.CLAMP}) | {Op.FUSED}}
KERNELS.update({
    Op.VIEW: view_copy,
    Op.BITCAST: bitcast_copy,
    Op.PAD: pad,
    Op.CONCATENATE: concatenate,
    Op.MATMUL: matmul,
    Op.REDUCE_LAST: reduce_last,
    Op.ROWWISE: rowwise,
    Op.ATTENTION: attention,
    Op.CONV: convolution,
    Op.GATHER_ROWS: gather_rows,
    Op.SCATTER_ROWS: scatter_rows,
    Op.TOPK: topk,
    Op.COLLECTIVE: collective,
    Op.CUSTOM_KERNEL: custom_kernel,
    Op.RANDOM: random_kernel,
})


def kernel_for(node: Node, plan: MemoryPlan) -> Callable[[Emitter, Node, MemoryPlan], None] | None:
    """The kernel that computes `node`, or None when it needs no instructions."""
    if node.op in (Op.PARAMETER, Op.RESHAPE, Op.KERNEL_OUTPUT):  # a kernel output: written by its kernel
        return None
    if node.op is Op.CONSTANT:
        return splat_constant if node.is_splat and plan.has_buffer(node) else None
    return KERNELS.get(node.op)
