"""The emulated NeuronCore: loads a NEFF into its memories and runs the instruction streams.

Loading lays out the program's HBM (weights and constants at their offsets), checks every
instruction against the ISA and the target's rules and binds it to numpy views of the memories,
so a bad program is refused before it runs and running costs little Python per instruction.

Running is a discrete-event simulation. Each stream (an engine, or one DMA queue) executes its list
in order; an instruction starts at the later of its stream's clock and the time every semaphore it
waits on reached its count (a stream's semaphore counts its completed instructions), and lasts
:func:`~neuronc.instruction_cost.instruction_cost_ns`. Events are processed in simulated-time order
(ties: completions first, then by stream): an instruction reads its operands when it starts and
writes its destination when it completes. So a consumer that does not wait for its producer reads
what the memory held before the producer finished (NaN for fresh on-chip memory), never silently
the right data.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import os
from typing import Callable, NamedTuple

import numpy as np

from neuronc.errors import InputMismatchError, NeuronRuntimeError
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import AccessPattern, Engine, Instruction, Space
from neuronc.neff.program import Neff, TensorKind
from neuronc.targets import Target, get_target
from runtime.memory import UNINITIALISED, Memory, allocate_hbm, allocate_on_chip
from runtime.semantics import SEMANTICS, check
from runtime.timeline import Event, Timeline


@dataclasses.dataclass
class RunResult:
    outputs: list  # of np.ndarray, in the program's output order
    timeline: Timeline


_COMPLETE, _START = 0, 1  # phases of an instruction in the event agenda


class _Step(NamedTuple):
    """One instruction, ready to run: bound to its operands' views and priced."""

    compute: Callable[[], object]  # the destination's new value, from the operands as they are now
    dst: np.ndarray  # view of the destination
    duration_ns: float
    waits: tuple  # ((stream number, count), ...)
    instr: Instruction
    index: int
    hbm_bytes: int


def _as_neff(neff_or_path) -> Neff:
    if isinstance(neff_or_path, Neff):
        return neff_or_path
    from neuronc.neff import load  # the codec is only needed for programs stored in files

    return load(os.fspath(neff_or_path))


def _stream_name(stream: tuple) -> str:
    engine, queue = Engine(stream[0]), stream[1]
    return f"DMA queue {queue}" if engine == Engine.DMA else engine.name


def _operand_text(ap: AccessPattern) -> str:
    where = f"@{ap.offset}" if ap.space == Space.HBM else f"@p{ap.partition}+{ap.offset}"
    return f"{ap.space.name} {ap.dtype.name}{list(ap.shape)}{where}"


class NeuronCore:
    """One emulated NeuronCore of ``target`` (a name or a :class:`Target`) with its SBUF and PSUM."""

    def __init__(self, target: str | Target = "trn2"):
        self.target = target if isinstance(target, Target) else get_target(target)
        self.sbuf, self.psum = allocate_on_chip(self.target)

    def load(self, neff) -> "LoadedProgram":
        """Load a :class:`Neff` (or the path of a NEFF file) into this core."""
        return LoadedProgram(self, _as_neff(neff))


class LoadedProgram:
    """A NEFF laid out in its own HBM on a core, every instruction checked and bound; run it many times."""

    def __init__(self, core: NeuronCore, neff: Neff):
        self.core, self.neff = core, neff
        hbm = allocate_hbm(neff, core.target)
        self.memory = Memory(hbm, core.sbuf, core.psum)
        for t in neff.tensors:
            if t.offset < 0 or t.offset + t.nbytes > neff.hbm_size:
                raise NeuronRuntimeError(
                    f"tensor {t.name!r} occupies HBM bytes [{t.offset}, {t.offset + t.nbytes}) "
                    f"outside the program's {neff.hbm_size} bytes"
                )
        self._place_data(hbm)
        self._inputs = [self._tensor_view(hbm, t) for t in neff.inputs()]
        self._outputs = [self._tensor_view(hbm, t) for t in neff.outputs()]
        self._volatile = [hbm[t.offset:t.offset + t.nbytes] for t in neff.tensors
                          if t.kind in (TensorKind.OUTPUT, TensorKind.SCRATCH)]

        waited = {(w[0], w[1]) for stream in neff.streams.values() for instr in stream for w in instr.waits}
        self.streams = sorted(set(neff.streams) | waited)  # (Engine, queue) of each stream number
        number = {key: n for n, key in enumerate(self.streams)}
        self._steps = [
            [self._prepare(key, index, instr, number) for index, instr in enumerate(neff.streams.get(key, []))]
            for key in self.streams
        ]

    # -- loading ----------------------------------------------------------------------------------

    @staticmethod
    def _tensor_view(hbm: np.ndarray, t) -> np.ndarray:
        return np.ndarray(tuple(t.shape), t.dtype.numpy, buffer=hbm, offset=t.offset)

    def _place_data(self, hbm: np.ndarray) -> None:
        for t in self.neff.tensors:
            if t.kind not in (TensorKind.WEIGHT, TensorKind.CONSTANT):
                continue
            if t.data is None or t.data.shape != tuple(t.shape) or t.data.dtype != t.dtype.numpy:
                got = "no data" if t.data is None else f"{t.data.dtype}{list(t.data.shape)}"
                raise NeuronRuntimeError(
                    f"{t.kind.name.lower()} {t.name!r} should hold {t.dtype.name}{list(t.shape)}, has {got}"
                )
            self._tensor_view(hbm, t)[...] = t.data

    def _prepare(self, stream: tuple, index: int, instr: Instruction, number: dict) -> _Step:
        try:
            if instr.stream != stream:
                raise NeuronRuntimeError(f"listed in the stream of {_stream_name(stream)}")
            check(instr, self.core.target)
            views = [self.memory.view(ap) for ap in instr.operands]
        except NeuronRuntimeError as e:
            raise self._error(instr, index, e.message, e.hint) from None
        hbm_operands = sum(ap.space == Space.HBM for ap in instr.operands)  # only DMA reaches HBM
        return _Step(
            compute=functools.partial(SEMANTICS[instr.opcode], instr, *views),
            dst=views[0],
            duration_ns=instruction_cost_ns(instr, self.core.target),
            waits=tuple((number[(w[0], w[1])], w[2]) for w in instr.waits),
            instr=instr,
            index=index,
            hbm_bytes=hbm_operands * instr.dst.num_elements * instr.dst.dtype.itemsize,
        )

    def _error(self, instr: Instruction, index: int, problem: str, hint: str = "") -> NeuronRuntimeError:
        what = f"{instr.opcode.name} #{index} on {_stream_name(instr.stream)}"
        if 0 <= instr.kernel < len(self.neff.kernels):
            what += f" (kernel {self.neff.kernels[instr.kernel].name})"
        operands = ", ".join(_operand_text(ap) for ap in instr.operands)
        location = str(self.neff.debug_locs[instr.debug]) if 0 <= instr.debug < len(self.neff.debug_locs) else ""
        return NeuronRuntimeError(f"{what} [{operands}]: {problem}", hint=hint, location=location)

    # -- running ----------------------------------------------------------------------------------

    def run(self, inputs: list) -> RunResult:
        """Execute the program on ``inputs``; returns copies of the outputs and the timeline."""
        self._write_inputs(inputs)
        for region in (*self._volatile, self.core.sbuf, self.core.psum):
            region.fill(UNINITIALISED)
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) are the device's answer, not warnings
            timeline = self._execute()
        return RunResult([view.copy() for view in self._outputs], timeline)

    def _write_inputs(self, inputs: list) -> None:
        expected = self.neff.inputs()
        if len(inputs) != len(expected):
            names = ", ".join(t.name for t in expected)
            raise InputMismatchError(
                f"program {self.neff.name!r} takes {len(expected)} inputs ({names}), got {len(inputs)}"
            )
        for i, (t, x, view) in enumerate(zip(expected, inputs, self._inputs)):
            x = np.asarray(x)
            if x.shape != tuple(t.shape) or x.dtype != t.dtype.numpy:
                raise InputMismatchError(
                    f"input {i} ({t.name!r}) must be {t.dtype.numpy}{list(t.shape)}, got {x.dtype}{list(x.shape)}",
                    hint="the program was compiled for these shapes and dtypes; recompile for new ones",
                )
            view[...] = x

    def _execute(self) -> Timeline:
        steps = self._steps
        done = [0] * len(steps)  # instructions completed per stream: its semaphore
        ends = [[] for _ in steps]  # completion time of each completed instruction per stream
        running = [None] * len(steps)  # (start time, computed value) of each stream's running instruction
        blocked_on = [[] for _ in steps]  # streams whose next instruction waits for this stream
        agenda = []  # heap of (time, phase, stream number); at equal times completions go first
        events, hbm_bytes = [], 0

        def schedule(s: int) -> None:
            if done[s] == len(steps[s]):
                return
            start = ends[s][-1] if ends[s] else 0.0
            for t, count in steps[s][done[s]].waits:
                if done[t] < count:
                    blocked_on[t].append(s)
                    return
                if count > 0:
                    start = max(start, ends[t][count - 1])
            heapq.heappush(agenda, (start, _START, s))

        for s in range(len(steps)):
            schedule(s)
        while agenda:
            time, phase, s = heapq.heappop(agenda)
            step = steps[s][done[s]]
            try:
                if phase == _START:  # read the operands now ...
                    running[s] = (time, step.compute())
                    heapq.heappush(agenda, (time + step.duration_ns, _COMPLETE, s))
                    continue
                start, value = running[s]
                step.dst[...] = value  # ... and write the destination when the instruction completes
            except Exception as e:  # numpy refused, e.g. an integer raised to a negative power
                raise self._error(step.instr, step.index, f"failed: {e}") from e
            running[s] = None
            ends[s].append(time)
            done[s] += 1
            hbm_bytes += step.hbm_bytes
            instr = step.instr
            events.append(Event(self.streams[s], step.index, instr.opcode, start, time, instr.kernel, instr.debug))
            schedule(s)
            if blocked_on[s]:
                waiters, blocked_on[s] = blocked_on[s], []
                for w in waiters:
                    schedule(w)

        if any(done[s] < len(steps[s]) for s in range(len(steps))):
            raise self._deadlock(done)
        return Timeline(events, hbm_bytes)

    def _deadlock(self, done: list) -> NeuronRuntimeError:
        blocked = []
        for s, stream in enumerate(self._steps):
            if done[s] < len(stream):
                step = stream[done[s]]
                unmet = "; ".join(
                    f"waits for {_stream_name(self.streams[t])}'s semaphore to reach {count} "
                    f"(it completed {done[t]} of its {len(self._steps[t])} instructions)"
                    for t, count in step.waits if done[t] < count
                )
                blocked.append(str(self._error(step.instr, step.index, unmet)))
        return NeuronRuntimeError(
            "deadlock: no stream can make progress\n    " + "\n    ".join(blocked),
            hint="every wait must name a count its stream reaches without waiting, directly or not, on the waiter",
        )


def run_neff(neff_or_path, inputs: list, target: str | Target | None = None) -> RunResult:
    """Load a NEFF (object or file) on a fresh core of ``target`` (default: the NEFF's) and run it once."""
    neff = _as_neff(neff_or_path)
    return NeuronCore(target or neff.target).load(neff).run(inputs)
