"""The cost model: how long a scheduled program takes on the target, without running it.

Prices each instruction with `neuronc.instruction_cost` (the same rule the emulator's clock uses)
and replays the streams' semaphore waits, so the estimate is the emulator's timeline makespan.
Passes ask it to choose between alternatives; the NEFF header records its estimate.
"""
from __future__ import annotations

from neuronc.instruction_cost import instruction_cost_ns
from neuronc.targets import Target

# On-chip tiles are placed on pages of this many bytes per partition (the sync pass tracks hazards per
# page, so two tiles never share one): a placement granularity of codegen, not a hardware number.
SBUF_PAGE_BYTES = 1024


def fits_sbuf(bytes_per_partition: int, target: Target) -> bool:
    """Whether a kernel's tiles, `bytes_per_partition` on each partition, fit the target's SBUF."""
    return bytes_per_partition <= target.sbuf_bytes_per_partition


def estimate_streams(streams: dict, target: Target) -> tuple:
    """(makespan in ns, {kernel index: ns summed over its instructions}) of scheduled streams."""
    done = {s: [] for s in streams}  # stream -> end time of each completed instruction
    cursor = {s: 0 for s in streams}
    kernel_ns: dict = {}
    progressed = True
    while progressed:
        progressed = False
        for stream, instructions in streams.items():
            i = cursor[stream]
            while i < len(instructions):
                inst = instructions[i]
                ready = 0.0
                for wait in inst.waits:
                    finished = done.get((wait.engine, wait.queue), [])
                    if len(finished) < wait.count:
                        break
                    ready = max(ready, finished[wait.count - 1])
                else:
                    start = max(ready, done[stream][-1] if done[stream] else 0.0)
                    cost = instruction_cost_ns(inst, target)
                    done[stream].append(start + cost)
                    kernel_ns[inst.kernel] = kernel_ns.get(inst.kernel, 0.0) + cost
                    i += 1
                    progressed = True
                    continue
                break
            cursor[stream] = i
    makespan = max((ends[-1] for ends in done.values() if ends), default=0.0)
    return makespan, kernel_ns
