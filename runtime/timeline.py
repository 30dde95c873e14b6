"""The estimated device timeline of one run: when each instruction ran on which stream.

The runtime records one event per executed instruction (times from
:func:`neuronc.instruction_cost.instruction_cost_ns`); this module turns them into the numbers a
profiler shows: the makespan, how busy each engine was, and the HBM traffic.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from neuronc.isa import Opcode


class Event(NamedTuple):
    stream: tuple  # (Engine, queue)
    index: int  # position in its stream
    opcode: Opcode
    start_ns: float
    end_ns: float
    kernel: int  # index into the program's kernel table (-1: none)
    debug: int  # index into the program's debug-location table (-1: none)


@dataclasses.dataclass
class Timeline:
    events: list  # of Event, in order of completion
    hbm_bytes: int = 0  # bytes DMA read from or wrote to HBM (an HBM-to-HBM copy counts twice)

    @property
    def estimated_ns(self) -> float:
        """Makespan: when the last instruction finished."""
        return max((e.end_ns for e in self.events), default=0.0)

    def busy_ns(self) -> dict:
        """Time each stream spent executing, (Engine, queue) -> ns."""
        busy: dict = {}
        for e in self.events:
            busy[e.stream] = busy.get(e.stream, 0.0) + (e.end_ns - e.start_ns)
        return busy

    def busy_fraction(self) -> dict:
        """Fraction of the makespan each engine had at least one of its streams busy, Engine -> [0, 1]."""
        makespan = self.estimated_ns
        intervals: dict = {}
        for e in self.events:
            intervals.setdefault(e.stream[0], []).append((e.start_ns, e.end_ns))
        return {engine: _covered(spans) / makespan for engine, spans in intervals.items()} if makespan else {}


def _covered(spans: list) -> float:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total

