"""The pass pipeline of each optimisation level, readable top to bottom.

-O0/-O1 keep one kernel per op (the baseline); -O2/-O3 compute attention as one flash-attention kernel
(softmax(Q K^T) V, the scores never in HBM) and row-wise normalisations as one kernel each,
fuse elementwise groups, read matmul operands through their views, and compute elementwise consumers of a
matmul as its epilogue; the tiling pass then chooses each matmul's tiles and loop order with the cost model
(-O3 searching more candidates; -O0/-O1 stream both operands tile by tile). At -O2/-O3 convolutions are
implicit-GEMM kernels with their epilogue (passes/conv.py); -O0/-O1 keep im2col + matmul. The layout pass
(-O2/-O3) stores a weight that matmuls read only transposed transposed in the NEFF, and has a row-wise
kernel write its result transposed when matmuls read only its transpose. Every level must give
the same numbers as eager PyTorch. A pass is a function of the graph; the few that weigh
the target's budgets (listed in TARGETED) also take the target.
"""
from __future__ import annotations

import time

from neuronc import ir
from neuronc.passes.attention import fuse_attention
from neuronc.errors import NeuronConfigError
from neuronc.passes.auto_cast import AutoCast
from neuronc.passes.canonicalize import (demote_f64, fold_constants, narrow_matmul_operands, raise_erf, raise_gelu,
                                         simplify)
from neuronc.passes.conv import fuse_conv_epilogues, lower_convolutions
from neuronc.passes.fusion import (fuse_elementwise, fuse_matmul_epilogues, fuse_matmul_operands,
                                   fuse_reduction_prologues)
from neuronc.passes.indexing import lower_gather_scatter
from neuronc.passes.layout import store_activations_transposed, store_weights_transposed
from neuronc.passes.legalize import legalize
from neuronc.passes.matmul_chain import chain_matmuls
from neuronc.passes.rowwise import fuse_rowwise
from neuronc.passes.tiling import baseline_tiles, search_matmul_tiles, tile_matmuls
from neuronc.targets import Target, get_target

BASELINE = [demote_f64, lower_gather_scatter, fold_constants, simplify, fold_constants, raise_erf, raise_gelu,
            narrow_matmul_operands, legalize, simplify]
OPTIMISED = (BASELINE[:BASELINE.index(legalize)] + [lower_convolutions] + BASELINE[BASELINE.index(legalize):]
             + [store_weights_transposed, fuse_attention, fuse_rowwise, fuse_matmul_operands, fuse_elementwise,
                fuse_matmul_epilogues, fuse_conv_epilogues, fuse_reduction_prologues, simplify,
                store_activations_transposed, chain_matmuls])

PIPELINES = {0: BASELINE + [baseline_tiles], 1: BASELINE + [baseline_tiles], 2: OPTIMISED + [tile_matmuls],
             3: OPTIMISED + [search_matmul_tiles]}
# passes that take the target (SBUF budget, cost model) as their second argument
TARGETED = {chain_matmuls, fuse_attention, fuse_rowwise, baseline_tiles, tile_matmuls, search_matmul_tiles, lower_convolutions,
            fuse_conv_epilogues}


def passes_for(opt_level: int, cast: AutoCast = AutoCast()) -> list:
    """The passes of an optimisation level; an auto-cast other than none goes right after canonicalize."""
    if opt_level not in PIPELINES:
        raise NeuronConfigError(f"unknown optimisation level {opt_level}", hint="use -O0, -O1, -O2 or -O3")
    passes = PIPELINES[opt_level]
    if cast.mode == "none":
        return passes
    after_canonicalize = min(passes.index(p) for p in (lower_convolutions, legalize) if p in passes)
    return passes[:after_canonicalize] + [cast] + passes[after_canonicalize:]


def run_pipeline(graph: ir.Graph, opt_level: int = 2, target: Target | None = None,
                 cast: AutoCast = AutoCast(), timings: dict | None = None) -> ir.Graph:
    """Run the passes of `opt_level` in order; with `timings`, record each pass's seconds in it as
    "pass/<name>" ("pass/<name>#2" for its second run, ...)."""
    target = target or get_target()
    for step in passes_for(opt_level, cast):
        start = time.perf_counter()
        graph = step(graph, target) if step in TARGETED else step(graph)
        if timings is not None:
            name = getattr(step, "__name__", type(step).__name__)
            key, run = f"pass/{name}", 1
            while key in timings:
                run += 1
                key = f"pass/{name}#{run}"
            timings[key] = time.perf_counter() - start
    return graph
