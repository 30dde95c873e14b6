"""MoE token dispatch and combine: the data movement around a mixture of experts' expert MLPs.

Routing gives each expert ``capacity`` slots, each naming the token it takes (``slot_tokens`` [experts * capacity],
int32). ``moe_dispatch`` gathers the tokens' rows into the experts' contiguous inputs [experts * capacity, D]: per
128 slots, the token numbers loaded onto partitions and one indirect DMA (a gather) reading those rows.
``moe_combine`` scatters the experts' outputs back, each row scaled by its slot's gate weight and added to its
token's row (an indirect DMA scatter that accumulates, as a token routed to several experts needs): y = sum over a
token's slots of gate * expert_out, zeros for tokens no slot takes.
"""
from __future__ import annotations

import neuronc.nki as nki
import neuronc.nki.isa as nisa
import neuronc.nki.language as nl


@nki.jit
def moe_dispatch(x, slot_tokens):
    tokens, width = x.shape
    (slots,) = slot_tokens.shape
    out = nl.ndarray((slots, width), dtype=x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    for i in nl.affine_range((slots + P - 1) // P):
        r = min(P, slots - i * P)
        index = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=index[0:r], src=slot_tokens[i * P:i * P + r].reshape((r, 1)))
        rows = nl.ndarray((P, width), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[0:r], src=x.ap(pattern=[[width, r], [1, width]], vector_offset=index[0:r]))
        nisa.dma_copy(dst=out[i * P:i * P + r], src=rows[0:r])
    return out


@nki.jit
def moe_combine(expert_out, slot_tokens, slot_gates, tokens):
    slots, width = expert_out.shape
    y = nl.ndarray((tokens, width), dtype=expert_out.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    zeros = nl.ndarray((P, width), dtype=expert_out.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    for i in nl.affine_range((tokens + P - 1) // P):  # every token's row starts at zero
        r = min(P, tokens - i * P)
        nisa.dma_copy(dst=y[i * P:i * P + r], src=zeros[0:r])
    for i in nl.affine_range((slots + P - 1) // P):
        r = min(P, slots - i * P)
        index = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=index[0:r], src=slot_tokens[i * P:i * P + r].reshape((r, 1)))
        gate = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=gate[0:r], src=slot_gates[i * P:i * P + r].reshape((r, 1)))
        rows = nl.ndarray((P, width), dtype=expert_out.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[0:r], src=expert_out[i * P:i * P + r])
        weighted = nl.ndarray((P, width), dtype=expert_out.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=weighted[0:r], data=rows[0:r], op0=nl.multiply, operand0=gate[0:r])
        nl.atomic_rmw(y[index[0:r], :], value=weighted[0:r], op=nl.add)
    return y
