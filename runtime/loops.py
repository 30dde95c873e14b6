"""Programs with registers and hardware loops (neuronc/isa.py, "Registers and loops"): loaded once, run at any
register values in their declared ranges without loading again.

A loop's body is its own streams; an iteration starts when the previous one (or the previous loop) has completed
on every stream, so a body runs exactly as a program of its own would, at offsets shifted by its operands'
terms. The load proves, for every register value in range, what the load of a static program checks on its one
run (or refuses the program with a NeuronRuntimeError saying which rule failed):

* *bounds*: an operand's offset is affine in the register values and the loop index, so over the box of values
  it is smallest and largest at two corners; both shifted patterns must lie in the same tensor entry (and a
  written one in an output or scratch entry), and then every one between does.
* *races and unwritten reads*: every HBM tensor a body writes is accessed in that body with one set of terms only
  (on-chip operands have none), so the relative placement of a body's accesses does not change with the values:
  the exact access check of a static program (runtime.core) on the body at one value decides them all. Across
  iterations the barrier orders everything. A body reads on chip only what it wrote in the same iteration.
* *inputs and outputs*: an input or output whose first dim is sized by registers (``TensorEntry.rows``) holds the
  launch's rows only; every HBM read of an input must stay inside them and every output byte inside them must be
  written, at every value in the box (enumerated, with numpy, over at most MAX_STATES values; a write counts
  only if it is dense, and a loop's iterations as one span only if they leave no gap between them).

The timeline of a launch is the body's (its simulation at load, the same for every iteration: durations depend
on sizes, never on offsets) repeated, each iteration after the loop's compare-and-branch (targets.py
``loop_iteration_cycles``).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import numpy as np

from neuronc.errors import InputMismatchError, NeuronRuntimeError
from neuronc.isa import LOOP_INDEX, AccessPattern, Space
from neuronc.neff.program import Neff, TensorKind
from neuronc.neff.rules import TensorIndex, check_hbm_operand, check_tensor_table, hbm_span
from neuronc.neff.verifier import check_references
from runtime.memory import HbmLayout, Memory, allocate_hbm, check_bounds
from runtime.semantics import Scratch, kernel
from runtime.timeline import Timeline

MAX_STATES = 1 << 17  # register values the load enumerates at most (a stated bound: ~0.1 s of numpy at most)
PLANS_KEPT = 64  # launches' bound calls a program keeps (per register values), the oldest dropped first


def resolve(ap: AccessPattern, values: tuple, index: int) -> AccessPattern:
    """``ap`` at these register values and loop index: its terms added to its offset."""
    if not ap.terms:
        return ap
    shift = sum(c * (index if source == LOOP_INDEX else values[source]) for source, c in ap.terms)
    return dataclasses.replace(ap, offset=ap.offset + shift, terms=())


def instantiate(instr, values: tuple, index: int):
    """``instr`` with its operands resolved (itself when none has terms)."""
    if not any(ap.terms for ap in instr.operands):
        return instr
    return dataclasses.replace(instr, operands=tuple(resolve(ap, values, index) for ap in instr.operands))


def rows_at(t, values) -> int:
    """The rows of tensor entry ``t`` a launch at ``values`` passes (all of them when it has no row terms)."""
    return sum(rows * values[r] for r, rows in t.rows) if t.rows else (t.shape[0] if t.shape else 1)


class LoopedProgram:
    """A NEFF with loops, loaded on a core: checked for every register value in range; ``at(values)`` is a launch."""

    def __init__(self, core, neff: Neff, *, trusted: bool = False):
        from runtime.core import access_check_id  # (runtime.core imports this module)

        self.core, self.neff = core, neff
        check_references(neff)  # the format's rules (the reader applies them too; a Neff object may come from code)
        check_tensor_table(neff)
        self.access_checked = True
        self.checked_now = None if trusted else access_check_id()
        self._layout = HbmLayout(neff.tensors)
        self._free = weakref.finalize(self, core.hbm.free, core.hbm.allocate(neff))
        self._plans: dict = {}
        try:
            self._check_terms()
            self._bodies = [self._body(n, trusted) for n in range(len(neff.loops))]
            if not trusted:
                self._check_rows()
        except BaseException:
            self._free()
            raise

    # -- loading ----------------------------------------------------------------------------------

    def _box(self) -> list:
        return [(r.lo, r.hi) for r in self.neff.registers]

    def _shift_range(self, ap: AccessPattern, loop) -> tuple:
        """The least and greatest shift of ``ap``'s offset over the box (a loop's index in [0, hi - 1])."""
        lo = hi = 0
        for source, c in ap.terms:
            a, b = (0, max(self.neff.registers[loop.register].hi - 1, 0)) if source == LOOP_INDEX \
                else (self.neff.registers[source].lo, self.neff.registers[source].hi)
            lo, hi = lo + min(c * a, c * b), hi + max(c * a, c * b)
        return lo, hi

    def _check_terms(self) -> None:
        """Bounds at the box's two extreme corners of each operand with terms; one set of terms per tensor a
        body writes."""
        neff, tensors = self.neff, TensorIndex(self.neff.tensors)
        shape = (neff.hbm_size,)
        for n, loop in enumerate(neff.loops):
            written_terms: dict = {}  # tensor name -> terms of the body's writes to it
            accesses = []
            for (engine, queue), stream in loop.streams.items():
                for k, instr in enumerate(stream):
                    writes = len(instr.writes)
                    for position, ap in enumerate(instr.operands):
                        if ap.space != Space.HBM:
                            continue
                        entries = []
                        for shift in self._shift_range(ap, loop):
                            moved = dataclasses.replace(ap, offset=ap.offset + shift, terms=())
                            what = f"loop {n}, {engine.name}:{queue} instruction {k}, operand {position}"
                            try:
                                check_bounds(moved, shape)
                                check_hbm_operand(tensors, moved, position < writes, neff.hbm_size, what)
                                self._layout.check(moved)
                            except NeuronRuntimeError as e:
                                raise NeuronRuntimeError(
                                    f"program {neff.name!r}: {what} at its register values' extreme: {e.message}",
                                    hint="declare the registers' ranges so that every access stays inside its "
                                    "tensor (or size the tensors for the ranges)") from None
                            entries.append(tensors.covering(*hbm_span(moved)))
                        if entries[0] is not entries[1]:
                            raise NeuronRuntimeError(
                                f"program {neff.name!r}: loop {n}'s operand {position} of {engine.name}:{queue} "
                                f"instruction {k} moves from tensor {entries[0].name!r} to {entries[1].name!r} "
                                "over its registers' ranges", hint="an access stays inside one tensor")
                        accesses.append((entries[0].name, ap.terms))
                        if position < writes:
                            written_terms.setdefault(entries[0].name, set()).add(ap.terms)
            for name, terms in accesses:
                if name in written_terms and written_terms[name] != {terms}:
                    raise NeuronRuntimeError(
                        f"program {neff.name!r}: loop {n} accesses tensor {name!r}, which it writes, at offsets "
                        "with different register terms: whether they race cannot be decided once for every value",
                        hint="address a tensor a loop body writes with one set of terms throughout the body")

    def _body(self, n: int, trusted: bool):
        """Loop ``n``'s body as a static program at the box's upper corner and index 0: checked exactly (races,
        unwritten reads) and simulated once; its instructions' order and events serve every iteration."""
        from runtime.core import LoadedProgram

        neff, loop = self.neff, self.neff.loops[n]
        values = tuple(r.hi for r in neff.registers)
        streams = {key: [instantiate(i, values, 0) for i in stream] for key, stream in loop.streams.items()}
        original = {id(made): instr for key, stream in loop.streams.items() for made, instr in zip(streams[key], stream)}
        body = Neff(f"{neff.name} (loop {n})", neff.target, neff.tensors, streams, neff.hbm_size,
                    debug_locs=neff.debug_locs, kernels=neff.kernels)
        program = LoadedProgram(self.core, body, trusted=trusted, part_of=self)
        program.loop_order = [(k, original[id(instr)]) for k, instr in program.order]  # (the loop's own instructions)
        return program

    def _states(self) -> list:
        box = self._box()
        count = 1
        for lo, hi in box:
            count *= hi - lo + 1
        if count > MAX_STATES:
            raise NeuronRuntimeError(
                f"program {self.neff.name!r} declares {count} combinations of register values, more than the "
                f"{MAX_STATES} its load checks", hint="declare narrower register ranges")
        grids = np.meshgrid(*[np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in box], indexing="ij")
        return [g.reshape(-1) for g in grids]  # per register, its value in each state

    def _check_rows(self) -> None:
        """At every register value: the inputs' reads inside the rows the launch passes, the outputs' rows
        written (module docstring)."""
        states = self._states()
        self._check_rows_at(states, len(states[0]) if states else 1)

    def _check_rows_at(self, states: list, size: int) -> None:
        neff = self.neff
        tensors = TensorIndex(neff.tensors)
        spans: dict = {}  # tensor name -> [(lo, hi) per state as arrays]: what the loops write
        upper = tuple(r.hi for r in neff.registers)
        for loop in neff.loops:
            count = states[loop.register]
            runs = count > 0
            written: dict = {}  # tensor name -> the body's writes to it (one set of terms: _check_terms)

            def shift_and_step(terms):
                shift, step = np.zeros(size, np.int64), 0
                for source, c in terms:
                    if source == LOOP_INDEX:
                        step += c
                    else:
                        shift += c * states[source]
                return shift, step

            for stream in loop.streams.values():
                for instr in stream:
                    writes = len(instr.writes)
                    for position, ap in enumerate(instr.operands):
                        if ap.space != Space.HBM:
                            continue
                        entry = tensors.covering(*hbm_span(resolve(ap, upper, 0)))
                        if position < writes:
                            written.setdefault(entry.name, []).append(ap)
                            continue
                        if entry.kind != TensorKind.INPUT or not entry.rows:
                            continue
                        lo, hi = hbm_span(ap)
                        shift, step = shift_and_step(ap.terms)
                        end_hi = hi + shift + np.maximum(step * np.maximum(count - 1, 0), 0)
                        bad = runs & (end_hi > entry.offset + self._rows_bytes(entry, states, size))
                        if bad.any():
                            at = tuple(int(v[np.argmax(bad)]) for v in states)
                            raise NeuronRuntimeError(
                                f"program {neff.name!r} reads input {entry.name!r} past the rows a launch passes "
                                f"at register values {at}", hint="keep each read inside the input's rows")
            for name, aps in written.items():
                shift, step = shift_and_step(aps[0].terms)
                last = step * np.maximum(count - 1, 0)
                for lo, hi in _written_runs(aps):  # an iteration's bytes, as runs; its iterations join when they touch
                    ok = runs & ((abs(step) <= hi - lo) | (count == 1))
                    spans.setdefault(name, []).append((np.where(ok, lo + shift + np.minimum(last, 0), 0),
                                                       np.where(ok, hi + shift + np.maximum(last, 0), 0)))
        for t in neff.tensors:
            if t.kind != TensorKind.OUTPUT or not t.nbytes:
                continue
            need = t.offset + self._rows_bytes(t, states, size)
            found = spans.get(t.name, [])
            los = np.stack([lo for lo, _ in found] or [np.zeros(size, np.int64)])  # [span, state]
            his = np.stack([hi for _, hi in found] or [np.zeros(size, np.int64)])
            order = np.argsort(los, axis=0, kind="stable")
            los, his = np.take_along_axis(los, order, 0), np.take_along_axis(his, order, 0)
            reach = np.maximum(np.maximum.accumulate(his, axis=0), t.offset)
            before = np.concatenate([np.full((1, size), t.offset), reach[:-1]], axis=0)
            gap = ((los > before) & (before < need) & (his > los)).any(axis=0) | (reach[-1] < need)
            gap &= need > t.offset
            if gap.any():
                at = tuple(int(v[np.argmax(gap)]) for v in states)
                raise NeuronRuntimeError(
                    f"program {neff.name!r} may leave bytes of output {t.name!r} unwritten at register values {at}",
                    hint="write every row of each output at every register value (dense writes; a loop's "
                    "iterations adjacent)")

    @staticmethod
    def _rows_bytes(t, states: list, size: int) -> np.ndarray:
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
        if not t.rows:
            return np.full(size, t.nbytes, np.int64)
        return sum(rows * row * states[r] for r, rows in t.rows)

    # -- running ----------------------------------------------------------------------------------

    @functools.cached_property
    def memory(self) -> Memory:
        """The program's HBM (weights and constants in place). Outputs are not filled: every byte a launch
        copies out is proven written."""
        memory = Memory(allocate_hbm(self._layout, self.neff.name), self.core.sbuf, self.core.psum, self._layout)
        for t in self.neff.tensors:
            if t.kind in (TensorKind.WEIGHT, TensorKind.CONSTANT):
                memory.tensor(t)[...] = t.data
        return memory

    def at(self, values) -> "Launch":
        """A launch at register ``values`` (one int per register, in its declared range)."""
        values = tuple(int(v) for v in values)
        registers = self.neff.registers
        if len(values) != len(registers):
            raise InputMismatchError(f"program {self.neff.name!r} has {len(registers)} registers, got "
                                     f"{len(values)} values")
        for r, v in zip(registers, values):
            if not r.lo <= v <= r.hi:
                raise InputMismatchError(f"register {r.name!r} of program {self.neff.name!r} takes values in "
                                         f"[{r.lo}, {r.hi}], got {v}",
                                         hint="compile the program for a wider range, or this size on its own")
        return Launch(self, values)

    def _calls(self, values: tuple) -> list:
        plan = self._plans.get(values)
        if plan is not None:
            return plan
        memory, scratch = self.memory, Scratch()
        view = functools.partial(memory.view, checked=True)
        calls = []
        for loop, body in zip(self.neff.loops, self._bodies):
            count = values[loop.register]
            if not count:
                continue
            fixed = {}
            for index in range(count):
                for i, instr in body.loop_order:
                    steps = fixed.get(i)
                    if steps is None:
                        scratch.next_kernel()
                        resolved = instantiate(instr, values, index)
                        steps = kernel(resolved, *map(view, resolved.operands), new=scratch)
                        if resolved is instr:
                            fixed[i] = steps
                    calls += steps
        if len(self._plans) >= PLANS_KEPT:
            del self._plans[next(iter(self._plans))]
        self._plans[values] = calls
        return calls

    def time_at(self, values: tuple) -> Timeline:
        """The timeline of a launch at ``values``: each iteration the loop's branch, then its body's events."""
        target = self.core.target
        branch = target.loop_iteration_cycles / target.vector_ghz
        events, now, moved = [], 0.0, 0
        for loop, body in zip(self.neff.loops, self._bodies):
            makespan = body.makespan
            for _ in range(values[loop.register]):
                now += branch
                events += [e._replace(start_ns=e.start_ns + now, end_ns=e.end_ns + now) for e in body.events]
                now += makespan
                moved += body.hbm_bytes
        return Timeline(events, moved)

    def unload(self) -> None:
        self._free()
        self.__dict__.pop("memory", None)
        self._plans.clear()

    @property
    def loaded(self) -> bool:
        return self._free.alive


MAX_MASK_BYTES = 1 << 26  # the widest span of one body's writes to a tensor whose bytes the load maps (a stated bound)


def _written_runs(aps: list) -> list:
    """The bytes the HBM patterns ``aps`` (of one tensor, with the same terms) write, at their offsets as they are,
    as [lo, hi) runs of consecutive bytes (none when they spread over more than MAX_MASK_BYTES)."""
    dense = [hbm_span(ap) for ap in aps if hbm_span(ap)[1] - hbm_span(ap)[0] == ap.num_elements * ap.dtype.itemsize]
    strided = [ap for ap in aps if hbm_span(ap)[1] - hbm_span(ap)[0] != ap.num_elements * ap.dtype.itemsize]
    runs = sorted(dense + _strided_runs(strided))
    merged: list = []
    for lo, hi in runs:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _strided_runs(aps: list) -> list:
    """[lo, hi) runs of the bytes strided patterns write (none when they spread over more than MAX_MASK_BYTES)."""
    if not aps:
        return []
    spans = [hbm_span(ap) for ap in aps]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if hi - lo > MAX_MASK_BYTES:
        return []
    mask = np.zeros(hi - lo, bool)
    for ap in aps:
        itemsize = ap.dtype.itemsize
        starts = np.zeros((), np.int64) + (ap.offset - lo)
        for stride, size in ap.dims:
            starts = np.add.outer(starts, np.arange(size, dtype=np.int64) * stride * itemsize)
        starts = starts.reshape(-1)
        for byte in range(itemsize):
            mask[starts + byte] = True
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [(lo + int(a), lo + int(b)) for a, b in zip(edges[::2], edges[1::2])]


class Launch:
    """A LoopedProgram at one set of register values: runs like a LoadedProgram (``run``, ``run_into``, ``time``),
    its inputs and outputs of the rows those values give."""

    def __init__(self, program: LoopedProgram, values: tuple):
        self.program, self.values, self.neff = program, values, program.neff
        self.inputs = [(t, rows_at(t, values)) for t in self.neff.inputs()]
        self.outputs = [(t, rows_at(t, values)) for t in self.neff.outputs()]

    def _views(self, entries) -> list:
        memory = self.program.memory
        return [memory.tensor(t)[:rows] if t.rows else memory.tensor(t) for t, rows in entries]

    def run_into(self, inputs: list, outputs: list) -> None:
        """Copy ``inputs`` in, run every iteration, write the outputs' rows into ``outputs`` (host arrays)."""
        program = self.program
        if not program.loaded:
            raise NeuronRuntimeError(f"program {self.neff.name!r} was unloaded from its NeuronCore",
                                     hint="load the NEFF again to run it")
        from runtime.core import quiet_numerics

        calls = program._calls(self.values)
        with program.core.on_chip.lock:
            for view, x in zip(self._views(self.inputs), inputs):
                view[...] = x
            with quiet_numerics():
                for call in calls:
                    call()
            for out, view in zip(outputs, self._views(self.outputs)):
                out[...] = view

    def run(self, inputs: list):
        """Run on ``inputs`` (checked against the launch's shapes); returns copies of the outputs and the timeline."""
        from runtime.core import RunResult

        if len(inputs) != len(self.inputs):
            raise InputMismatchError(f"program {self.neff.name!r} takes {len(self.inputs)} inputs, got {len(inputs)}")
        for n, ((t, rows), x) in enumerate(zip(self.inputs, inputs)):
            shape = (rows, *t.shape[1:]) if t.rows else tuple(t.shape)
            x = np.asarray(x)
            if x.shape != shape or x.dtype != t.dtype.numpy:
                raise InputMismatchError(f"input {n} ({t.name!r}) must be {t.dtype.numpy}{list(shape)} at register "
                                         f"values {self.values}, got {x.dtype}{list(x.shape)}")
        outputs = [np.empty((rows, *t.shape[1:]) if t.rows else tuple(t.shape), t.dtype.numpy)
                   for t, rows in self.outputs]
        self.run_into(inputs, outputs)
        return RunResult(outputs, self.time())

    def time(self) -> Timeline:
        return self.program.time_at(self.values)


def registers_for_rows(n: int, blocks: tuple) -> tuple:
    """Register values serving ``n`` rows with tiles of ``blocks`` rows (largest first, each dividing the one before):
    the count of each block size, n = sum(count * block)."""
    values = []
    for block in blocks:
        values.append(n // block)
        n %= block
    return tuple(values)


__all__ = ["Launch", "LoopedProgram", "instantiate", "registers_for_rows", "resolve", "rows_at"]
