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
from neuronc.codegen.schedule import into_idle_queue_time, prefetch_loads
from neuronc.codegen.sync import HazardGrid, insert_waits
from neuronc.errors import NeuronCompileError
from neuronc.neff.program import Neff, PendingEstimate
from neuronc.plans import MemoryPlan
from neuronc.stream_timing import estimate_streams, kernel_totals, replay as replay_streams
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
             idle_queue_time: bool = False) -> Neff:
    """With `prefetch`, a kernel's loads start during the previous kernel (codegen.schedule). With
    `idle_queue_time` too, from the program's estimated timeline, any load of a kernel goes into time its queue,
    or any queue, would wait, kept when that is faster (a second and a third sync pass and estimate: -O3's trade). With `reuse`, kernels
    of one signature are generated once and instantiated at each one's addresses (codegen.reuse; the same NEFF).
    With `replay` (and `reuse`), a period of the program that repeats the one before it takes its waits when its
    boundary state proves them the same (codegen.sync_replay; the same NEFF; off: not yet cheaper than the pass).
    With `timings`, records the seconds of its stages: kernels, the hazard grid, prefetch, sync (waits) and, with
    `idle_queue_time`, the cost estimate its placement reads. Otherwise the NEFF's estimated_ns (its own and its
    kernels') are computed when first read (neff.program.PendingEstimate: the same numbers; no -O0 to -O2
    decision reads them), or settled by the program's first load from its schedule (the same simulation:
    neuronc.stream_timing), which a compile loaded at once (torch.compile, eager ops) then pays once, not twice."""
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
    instructions, grid = em.instructions, HazardGrid(em.instructions, plan.tensors, target,
                                                     cut_alike=replay and kernels is not None)
    timings["codegen/hazard grid"] = time.perf_counter() - start
    if prefetch:
        start = time.perf_counter()
        instructions = prefetch_loads(instructions, grid)
        timings["codegen/prefetch"] = time.perf_counter() - start
    start = time.perf_counter()
    repeats = kernels.price_keys if kernels is not None and replay else None
    streams = insert_waits(instructions, plan.tensors, target, grid, repeats)
    timings["codegen/sync"] = time.perf_counter() - start
    makespan, kernel_ns = 0.0, {}
    placed = prefetch and idle_queue_time and len(em.kernels) > 1
    if placed:
        # the estimate's timeline places loads into the time queues wait (codegen.schedule): on their own queues, or
        # on any queue; of prefetch_loads' order and these, the one the estimate times fastest is kept
        start = time.perf_counter()
        same_price = kernels.price_keys if kernels else None
        timeline = _timeline(streams, target, same_price)
        timings["codegen/estimate"] = time.perf_counter() - start
        start = time.perf_counter()
        first_timeline = timeline
        for any_queue in (False, True):
            refined = into_idle_queue_time(em.instructions, grid, first_timeline, target, any_queue)
            if refined is None or (any_queue and not refined[1]):  # no load changes queue: the first candidate
                continue
            refined, queues = refined
            kept = [(inst.waits, inst.queue) for inst in em.instructions]  # the sync pass sets waits in place
            for position, queue in queues.items():
                em.instructions[position].queue = queue
            refined_streams = insert_waits(refined, plan.tensors, target, grid, repeats)
            refined_timeline = _timeline(refined_streams, target, same_price)
            if _makespan(refined_timeline) < _makespan(timeline):
                instructions, streams, timeline = refined, refined_streams, refined_timeline
            else:
                for inst, (waits, queue) in zip(em.instructions, kept):
                    inst.waits, inst.queue = waits, queue
        makespan, kernel_ns = kernel_totals((inst.kernel, *timeline[id(inst)]) for inst in instructions)
        timings["codegen/idle queue time"] = time.perf_counter() - start
    for index, ns in kernel_ns.items():
        em.kernels[index].estimated_ns = ns
    neff = Neff(
        name=name, target=target.name, tensors=plan.tensors, streams=streams, hbm_size=plan.hbm_size,
        debug_locs=em.debug_locs, kernels=em.kernels, estimated_ns=makespan, compiler_version=__version__,
    )
    if not placed:  # no decision here reads it: simulated when first read, or settled by a load (neff.program)
        scheduled = {key: list(stream) for key, stream in streams.items()}
        same_price = kernels.price_keys if kernels else None
        neff.estimate_later(PendingEstimate(lambda: estimate_streams(scheduled, target, same_price), target))
    return neff


def _timeline(streams: dict, target: Target, same_price: dict | None) -> dict:
    """{id(instruction): (start ns, end ns)} of scheduled `streams` (`same_price`: see stream_timing.replay)."""
    return {id(inst): (start, end) for inst, start, end in replay_streams(streams, target, same_price)}


def _makespan(timeline: dict) -> float:
    return max((end for _, end in timeline.values()), default=0.0)
