"""Codegen: a legalised, memory-planned graph becomes per-engine instruction streams (a `Neff`).

No policy is decided here: kernels follow the tile rules of the target, `sync` orders the
streams. The result is the in-memory NEFF the writer serialises and the runtime executes.
"""
from __future__ import annotations

import time
from collections import Counter

from neuronc import __version__, ir
from neuronc.codegen.emitter import Emitter
from neuronc.codegen.kernels import kernel_for
from neuronc.codegen.reuse import NOT_REUSED, KernelReuse
from neuronc.codegen.schedule import prefetch_loads
from neuronc.codegen.sync import HazardGrid, insert_waits
from neuronc.errors import NeuronCompileError
from neuronc.neff.program import Neff
from neuronc.plans import MemoryPlan
from neuronc.stream_timing import estimate_streams
from neuronc.targets import Target


def _fused_ops(node: ir.Node) -> tuple:
    """The graph ops a kernel computes, for `neuronc inspect --kernels`."""
    if node.op in (ir.Op.FUSED, ir.Op.ROWWISE):
        ops = tuple(step.op.name.lower() for step in ir.body_of(node))
        transposed = node.op is ir.Op.ROWWISE and node.attrs["out_strides"][1] != 1  # passes/layout.py
        return ops + ("[stored transposed]",) * transposed
    if node.op is ir.Op.CUSTOM_KERNEL:
        return (f"nki:{node.attrs['kernel'].name}",)
    ops = tuple(node.attrs.get("ops", (node.op.name.lower(),)))
    tiling, chain = node.attrs.get("tiling"), node.attrs.get("chain")
    if chain is not None:  # two matmuls in one kernel (passes/matmul_chain.py)
        return tuple(chain.attrs.get("ops", ("matmul",))) + ops + (
            f"[chain tiles {chain.attrs.get('tiling')}, then {tiling}]",)
    return ops + (f"[tiles {tiling}]",) if tiling is not None else ops


def generate(graph: ir.Graph, plan: MemoryPlan, target: Target, name: str = "main",
             timings: dict | None = None, prefetch: bool = False, reuse: bool = True, replay: bool = False,
             estimate: bool = True) -> Neff:
    """With `prefetch`, a kernel's loads start during the previous kernel (codegen.schedule). With `reuse`, kernels
    of one signature are generated once and instantiated at each one's addresses (codegen.reuse; the same NEFF).
    With `replay` (and `reuse`), a period of the program that repeats the one before it takes its waits when its
    boundary state proves them the same (codegen.sync_replay; the same NEFF; off: not yet cheaper than the pass).
    With `timings`, records the seconds of its stages: kernels, the hazard grid, prefetch, sync (waits) and the
    cost estimate. Without `estimate`, the NEFF's estimated_ns (its own and its kernels') are left 0 for the caller
    to fill: a caller loading the program at once gets the same numbers from the runtime's schedule of the load
    (the same simulation: neuronc.stream_timing), as the eager path does (pytorch/eager.py)."""
    timings = {} if timings is None else timings
    start = time.perf_counter()
    em = Emitter(target)
    kernels = KernelReuse(target) if reuse else None
    found = [(node, kernel_for(node, plan)) for node in graph.nodes()]
    # a recording pays off only for a kernel met twice; one whose function, op, shape and dtype no other kernel
    # has cannot share a signature (a single op's eager program: every kernel) and is emitted directly
    kinds = Counter((kernel, node.op, node.shape, node.dtype) for node, kernel in found if kernel is not None)
    for index, (node, kernel) in enumerate(found):
        if kernel is None:
            if node.op not in (ir.Op.PARAMETER, ir.Op.RESHAPE, ir.Op.CONSTANT, ir.Op.KERNEL_OUTPUT):
                raise NeuronCompileError(f"no kernel for {node.op.name.lower()}", location=str(node.loc))
            continue
        ops = _fused_ops(node)
        em.begin_kernel(f"{node.op.name.lower()}_{index}", ops, node.loc)
        if kernels is None or node.op in NOT_REUSED or kinds[(kernel, node.op, node.shape, node.dtype)] == 1:
            kernel(em, node, plan)
        else:
            kernels.emit(em, kernel, node, plan)
    timings["codegen/kernels"] = time.perf_counter() - start
    start = time.perf_counter()
    instructions, grid = em.instructions, HazardGrid(em.instructions, plan.tensors, target)
    timings["codegen/hazard grid"] = time.perf_counter() - start
    if prefetch:
        start = time.perf_counter()
        instructions = prefetch_loads(instructions, grid)
        timings["codegen/prefetch"] = time.perf_counter() - start
    start = time.perf_counter()
    streams = insert_waits(instructions, plan.tensors, target, grid,
                           kernels.price_keys if kernels is not None and replay else None)
    timings["codegen/sync"] = time.perf_counter() - start
    makespan, kernel_ns = 0.0, {}
    if estimate:
        start = time.perf_counter()
        makespan, kernel_ns = estimate_streams(streams, target, kernels.price_keys if kernels else None)
        timings["codegen/estimate"] = time.perf_counter() - start
    for index, ns in kernel_ns.items():
        em.kernels[index].estimated_ns = ns
    return Neff(
        name=name, target=target.name, tensors=plan.tensors, streams=streams, hbm_size=plan.hbm_size,
        debug_locs=em.debug_locs, kernels=em.kernels, estimated_ns=makespan, compiler_version=__version__,
    )
