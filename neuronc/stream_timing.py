"""When each instruction of semaphore-synchronised streams starts and ends: the discrete-event schedule that
both the runtime's clock and the cost model's estimate run, so the two agree to the nanosecond.

Each stream (an engine, or one DMA queue) executes its list in order; an instruction starts at the later of
its stream's previous end and the time every semaphore it waits on reached its count (a stream's semaphore
counts its completed instructions), and lasts its duration, a DMA longer when the queues together ask more
of the core's HBM than it has (:class:`~neuronc.instruction_cost.HbmChannel`, served in order of start).
Events come in simulated-time order; at equal times completions first, then by stream number.
"""
from __future__ import annotations

import heapq
from typing import Iterator

from neuronc.instruction_cost import (HbmChannel, hbm_bytes, instruction_cost_ns, remaining_latency_ns, start_latency_ns,
                                      stream_costs)
from neuronc.parallel_access import ports
from neuronc.targets import Target

COMPLETE, START = 0, 1  # phases of an instruction; at equal times completions go first


def stream_order(streams: dict) -> list:
    """The (engine, queue) of each stream number: the program's streams and those its instructions wait on."""
    waited = {(w[0], w[1]) for stream in streams.values() for instr in stream for w in instr.waits}
    return sorted(set(streams) | waited)


def simulate(durations: list, waits: list, hbm_bytes: list, target: Target, ports: list | None = None,
             latencies: list | None = None, gaps: list | None = None) -> Iterator[tuple]:
    """(phase, stream, index, time) of every start and completion, in the order they happen.

    Per stream number s: ``durations[s][i]`` the ns instruction i takes alone, ``waits[s][i]`` its
    ((stream, count), ...) semaphore waits, ``hbm_bytes[s][i]`` the HBM bytes it moves, ``ports[s][i]`` the
    memory ports it holds while it runs (neuronc.parallel_access: an instruction ready while another holds one of
    its ports starts when that one ends), ``latencies[s][i]`` the leading part of its duration before its data
    moves (a DMA's fixed cost, instruction_cost.start_latency_ns): it runs from when its waits are met and the
    previous instruction of its stream moves data, so a queue prepares its next transfer while one moves data
    (only what is left of it when the instruction starts counts), ``gaps[s][i]`` the ns it starts after the
    previous instruction of its stream ends at the earliest (a dependent instruction,
    instruction_cost.stream_costs). Stops early, with instructions left, when
    the streams deadlock (the caller sees it in what completed)."""
    n = len(durations)
    held: dict = {}  # port -> when the instruction holding it ends
    done = [0] * n  # completed instructions per stream: its semaphore
    ends = [[] for _ in range(n)]  # completion time of each completed instruction per stream
    moving = [0.0] * n  # when the last started instruction of each stream began moving data
    ready = [0.0] * n  # when the waits of each stream's next instruction were met
    blocked_on = [[] for _ in range(n)]  # streams whose next instruction waits for this stream
    agenda = []  # heap of (time, phase, stream)
    hbm = HbmChannel(target)

    def schedule(s: int) -> None:
        if done[s] == len(durations[s]):
            return
        start = ends[s][-1] + (gaps[s][done[s]] if gaps is not None else 0.0) if ends[s] else 0.0
        met = 0.0
        for t, count in waits[s][done[s]]:
            if done[t] < count:
                blocked_on[t].append(s)
                return
            if count > 0:
                met = max(met, ends[t][count - 1])
        ready[s] = met
        heapq.heappush(agenda, (max(start, met), START, s))

    for s in range(n):
        schedule(s)
    while agenda:
        time, phase, s = heapq.heappop(agenda)
        i = done[s]
        if phase == START and ports is not None and ports[s][i]:
            free_at = max(held.get(port, 0.0) for port in ports[s][i])
            if free_at > time:  # a port is taken: try again when it frees
                heapq.heappush(agenda, (free_at, START, s))
                continue
        yield phase, s, i, time
        if phase == START:
            duration, lead = durations[s][i], 0.0
            if latencies is not None and latencies[s][i]:
                latency = latencies[s][i]
                lead = remaining_latency_ns(time, ready[s], moving[s] if i else 0.0, latency)
                duration -= latency - lead
            moving[s] = time + lead
            end = hbm.end(time, duration, hbm_bytes[s][i], lead)
            if ports is not None:
                for port in ports[s][i]:
                    held[port] = end
            heapq.heappush(agenda, (end, COMPLETE, s))
            continue
        ends[s].append(time)
        done[s] += 1
        schedule(s)
        if blocked_on[s]:
            waiters, blocked_on[s] = blocked_on[s], []
            for w in waiters:
                schedule(w)


def replay(streams: dict, target: Target, same_price=None) -> Iterator[tuple]:
    """(instruction, start ns, end ns) of every instruction of scheduled streams, in order of completion:
    the emulator's timeline without running (the same simulation, neuronc.stream_timing).

    ``same_price``: {id(instruction): key}, instructions of one key priced alike (codegen.reuse: copies of one
    recorded instruction, which differ only in HBM offsets and DMA queue, neither of which an instruction's own
    price reads); each key is priced once. Missing instructions are priced on their own."""
    keys = stream_order(streams)
    number = {key: n for n, key in enumerate(keys)}
    lists = [streams.get(key, []) for key in keys]
    started = [0.0] * len(keys)
    extras, gaps = zip(*(stream_costs(stream, target) for stream in lists)) if lists else ((), ())
    memo: dict = {}  # key of same_price -> its prices
    priced = [[_prices(i, target, same_price, memo) for i in stream] for stream in lists]
    for phase, s, index, time in simulate([[p[0] + extra for p, extra in zip(prices, more)]
                                           for prices, more in zip(priced, extras)],
                                          [[tuple((number[(w.engine, w.queue)], w.count) for w in i.waits)
                                            for i in stream] for stream in lists],
                                          [[p[1] for p in prices] for prices in priced], target,
                                          [[p[2] for p in prices] for prices in priced],
                                          [[p[3] for p in prices] for prices in priced],
                                          list(gaps)):
        if phase == START:
            started[s] = time
        else:
            yield lists[s][index], started[s], time


def _prices(instr, target: Target, same_price: dict | None, memo: dict) -> tuple:
    """(duration ns, HBM bytes, ports, start latency ns) of one instruction alone; once per key of `same_price`."""
    key = same_price.get(id(instr)) if same_price else None
    prices = memo.get(key) if key is not None else None
    if prices is None:
        prices = (instruction_cost_ns(instr, target), hbm_bytes(instr, target), ports(instr, target),
                  start_latency_ns(instr, target))
        if key is not None:
            memo[key] = prices
    return prices


def estimate_streams(streams: dict, target: Target, same_price: dict | None = None) -> tuple:
    """(makespan in ns, {kernel index: ns summed over its instructions}) of scheduled streams (`same_price`: see
    replay)."""
    return kernel_totals((inst.kernel, start, end) for inst, start, end in replay(streams, target, same_price))


def kernel_totals(spans) -> tuple:
    """(makespan in ns, {kernel index: ns summed over its instructions}) of (kernel, start, end) per instruction:
    codegen's estimate from `replay`, the eager path's from a load's timeline (the same simulation)."""
    makespan, kernel_ns = 0.0, {}
    for kernel, start, end in spans:
        kernel_ns[kernel] = kernel_ns.get(kernel, 0.0) + end - start
        makespan = max(makespan, end)
    return makespan, kernel_ns


def kernel_spans(streams: dict, target: Target) -> dict:
    """{kernel index: (first start, last end)} of scheduled streams: when each kernel ran (kernels overlap)."""
    spans: dict = {}
    for inst, start, end in replay(streams, target):
        first, last = spans.get(inst.kernel, (start, end))
        spans[inst.kernel] = (min(first, start), max(last, end))
    return spans
