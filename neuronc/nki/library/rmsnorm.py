"""RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight, over the last axis of x [rows, D].

Per tile of 128 rows: one load, the squares and their row sum in one Scalar-engine pass (activation with
``reduce_res``), 1 / sqrt(sum / D + eps) as one activation on the [128, 1] sums, and (x * rstd) * weight as one
Vector/GpSimd pass (scalar_tensor_tensor); the weight is broadcast to every partition once, by a DMA reading its
row 128 times. Statistics in fp32 whatever x's dtype; the output in x's dtype.
"""
from __future__ import annotations

import neuronc.nki as nki
import neuronc.nki.isa as nisa
import neuronc.nki.language as nl


@nki.jit
def rmsnorm(x, weight, eps=1e-6):
    rows, width = x.shape
    out = nl.ndarray((rows, width), dtype=x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    w = nl.ndarray((P, width), dtype=weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w, src=weight.reshape((1, width)).broadcast_to((P, width)))
    for i in nl.affine_range((rows + P - 1) // P):
        r = min(P, rows - i * P)
        tile = nl.ndarray((P, width), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[0:r], src=x[i * P:i * P + r])
        squares = nl.ndarray((P, width), dtype=nl.bfloat16, buffer=nl.sbuf)  # only their sum is used
        total = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=squares[0:r], op=nl.square, data=tile[0:r], reduce_op=nl.add, reduce_res=total[0:r])
        rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd[0:r], op=nl.rsqrt, data=total[0:r], scale=1.0 / width, bias=eps)
        normed = nl.ndarray((P, width), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=normed[0:r], data=tile[0:r], op0=nl.multiply, operand0=rstd[0:r],
                                  op1=nl.multiply, operand1=w[0:r])
        nisa.dma_copy(dst=out[i * P:i * P + r], src=normed[0:r])
    return out
