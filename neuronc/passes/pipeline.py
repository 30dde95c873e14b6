"""The pass pipeline of each optimisation level, readable top to bottom.

-O0/-O1 keep one kernel per op (the baseline); -O2/-O3 compute row-wise normalisations as one kernel each,
fuse elementwise groups, read matmul operands through their views, and compute elementwise consumers of a
matmul as its epilogue. Layout, tiling search and scheduling passes join them as they are written. Every
level must give the same numbers as eager PyTorch. A pass is a function of the graph; the few that weigh
the target's budgets (listed in TARGETED) also take the target.
"""
from __future__ import annotations

import time

from neuronc import ir
from neuronc.errors import NeuronConfigError
from neuronc.passes.canonicalize import demote_f64, fold_constants, raise_erf, raise_gelu, simplify
from neuronc.passes.fusion import (fuse_elementwise, fuse_matmul_epilogues, fuse_matmul_operands,
                                   fuse_reduction_prologues)
from neuronc.passes.indexing import lower_gather_scatter
from neuronc.passes.legalize import legalize
from neuronc.passes.rowwise import fuse_rowwise
from neuronc.targets import Target, get_target

BASELINE = [demote_f64, lower_gather_scatter, fold_constants, simplify, fold_constants, raise_erf, raise_gelu,
            legalize, simplify]
OPTIMISED = BASELINE + [fuse_rowwise, fuse_matmul_operands, fuse_elementwise, fuse_matmul_epilogues,
                        fuse_reduction_prologues,
                        simplify]

PIPELINES = {0: BASELINE, 1: BASELINE, 2: OPTIMISED, 3: OPTIMISED}
TARGETED = {fuse_rowwise}  # passes that take the target (SBUF budget) as their second argument


def passes_for(opt_level: int) -> list:
    if opt_level not in PIPELINES:
        raise NeuronConfigError(f"unknown optimisation level {opt_level}", hint="use -O0, -O1, -O2 or -O3")
    return PIPELINES[opt_level]


def run_pipeline(graph: ir.Graph, opt_level: int = 2, target: Target | None = None,
                 timings: dict | None = None) -> ir.Graph:
    """Run the passes of `opt_level` in order; with `timings`, record each pass's seconds in it as
    "pass/<name>" ("pass/<name>#2" for its second run, ...)."""
    target = target or get_target()
    for step in passes_for(opt_level):
        start = time.perf_counter()
        graph = step(graph, target) if step in TARGETED else step(graph)
        if timings is not None:
            key, run = f"pass/{step.__name__}", 1
            while key in timings:
                run += 1
                key = f"pass/{step.__name__}#{run}"
            timings[key] = time.perf_counter() - start
    return graph
