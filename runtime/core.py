"""The emulated NeuronCore: loads a NEFF into its memories and runs the instruction streams.

Running is a discrete-event simulation (:func:`neuronc.stream_timing.simulate`, which the cost model
runs too). Each stream (an engine, or one DMA queue) executes its list in order; an instruction starts
at the later of its stream's clock and the time every semaphore it waits on reached its count (a
stream's semaphore counts its completed instructions), and lasts
:func:`~neuronc.instruction_cost.instruction_cost_ns` (a DMA longer when the queues together ask more of
HBM than the core has; a Scalar-engine activation longer by the table it loads, and an instruction reading its
engine's previous result starts a dependency spacing after it: ``instruction_cost.stream_costs``). Events are processed in simulated-time order
(ties: completions first, then by stream): an instruction reads its operands when it starts and
writes its destination when it completes. So a consumer that does not wait for its producer reads
what the memory held before the producer finished, never silently the right data.

None of that depends on data: durations come from the program and the target, so the order of every
start and completion (the schedule) is fixed by the program. Loading therefore does all the work
that does not need data, once:

* checks every instruction against the ISA and the target, and accounts the program's HBM on the
  core (:class:`~runtime.memory.HbmAllocator`);
* simulates the schedule, giving the :class:`Timeline` of every run (``LoadedProgram.time()``
  returns it without running anything) and refusing programs that deadlock;
* replays the schedule with who last wrote each byte, and refuses a program in which an instruction
  reads a byte nothing wrote (a tile read before it is loaded) or races with another: the two touch
  the same byte, one writing, and no chain of semaphore waits orders them, so the program is right,
  if at all, only by the timing (a consumer that forgot to wait for its producer, say). Exact to the
  byte and independent of durations (``LoadedProgram._check_accesses``); off with
  ``NeuronCore(target, check_uninitialised=False)``, and skipped for a NEFF that already passed it under
  this runtime (``load(neff, checked_by=access_check_id())``, which the compile cache records);
* turns the schedule into one flat list of numpy calls on views of the memories
  (:func:`runtime.semantics.kernel`; done on the first run, with the program's HBM and weights).
  An instruction that nothing else writes under while it runs computes and writes at its
  completion in one go; the others (only racy programs have them) read into a buffer at their
  start and write it at their completion, exactly as the simulation says.

Running is then: copy the inputs in, make the calls in order, copy the outputs out (``run``; or, for a
host launching one program many times on its own buffers, ``run_into``, which skips the timeline and the
output copies). Inputs the host keeps in its own arrays across runs (a compiled model's parameters) can be
bound instead (``bind_inputs``): the calls then read them in place and no run copies them.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import os
import threading
import weakref
from typing import NamedTuple

import numpy as np

from neuronc.collector import collector_paused
from neuronc.errors import CollectiveError, DeviceOutOfMemoryError, InputMismatchError, NeuronRuntimeError
from neuronc.host_memory import HOST_BUDGET_VARIABLE, host_memory_budget
from neuronc.instruction_cost import hbm_bytes, instruction_cost_ns, start_latency_ns, stream_costs
from neuronc.isa import COLLECTIVES, AccessPattern, Engine, Instruction, Opcode, Space
from neuronc.neff.program import Neff, TensorKind
from neuronc.neff.rules import WRITABLE, TensorIndex, check_hbm_operand, check_tensor_table
from neuronc.parallel_access import ports
from neuronc.stream_timing import COMPLETE, START, kernel_totals, simulate, stream_order
from neuronc.targets import Target, get_target
from runtime.memory import (UNINITIALISED, Cells, Columns, HbmAllocator, HbmLayout, HbmRegions, Memory, OnChip,
                            allocate_hbm, check_bounds, extent, hbm_regions, overlaps, size_text)
from runtime.semantics import SEMANTICS, Scratch, check, kernel, store_all
from runtime.timeline import Event, Timeline


@dataclasses.dataclass
class RunResult:
    outputs: list  # of np.ndarray, in the program's output order (empty when run without numerics)
    timeline: Timeline




class _Instr(NamedTuple):
    """One instruction with what the schedule needs to know of it, computed once at load."""

    instr: Instruction
    stream: int  # stream number
    index: int  # position in its stream
    duration_ns: float
    waits: tuple  # ((stream number, count), ...)
    reads: tuple  # positions of the operands it reads
    hbm_bytes: int
    ports: tuple  # the memory ports it holds while it runs (neuronc.parallel_access)
    latency_ns: float  # the leading part of its duration a DMA queue overlaps (instruction_cost.start_latency_ns)

    @property
    def key(self) -> tuple:
        return self.stream, self.index


@functools.cache
def access_check_id() -> str:
    """Names this runtime's load-time access check (a sha256 of the runtime's source): a verdict recorded
    under another id, an older or edited runtime's, is not trusted."""
    digest = hashlib.sha256()
    folder = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


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
    shape = list(ap.shape) if len(ap.dims) <= 8 else f"[{', '.join(map(str, ap.shape[:4]))}, ... ({len(ap.dims)} dims)]"
    return f"{ap.space.name} {ap.dtype.name}{shape}{where}"


def _check_strides(ap: AccessPattern, position: int, memory_shape: tuple) -> None:
    """Refuse a stride that reaches further than the memory the operand is in, even on a dim of one element
    (where it moves nothing, but is still an address the emulator's numpy views must hold)."""
    limit = memory_shape[-1]  # bytes of HBM, or of each partition on chip
    for stride, _ in ap.dims if ap.space == Space.HBM else ap.dims[1:]:
        if abs(stride) * ap.dtype.itemsize > limit:
            raise NeuronRuntimeError(f"operand {position} has a stride of {stride} elements of {ap.dtype.name}, "
                                     f"further than its {ap.space.name}'s {limit} bytes")


def _facts_key(instr: Instruction) -> tuple:
    """Every field of ``instr`` but its waits, kernel and debug location, the immediates with their signs and types
    (0.0 and -0.0 are equal as keys, an int and a float too, and are told apart here)."""
    imm0, imm1 = instr.imm0, instr.imm1
    return (instr.opcode, instr.engine, instr.queue, tuple(instr.operands), instr.alu, instr.alu1, instr.func, imm0, imm1,
            _sign(imm0), _sign(imm1), instr.accumulate, instr.reverse)


def _sign(x) -> object:
    return math.copysign(1.0, x) if type(x) is float else type(x)


def _reads(instr: Instruction) -> tuple:
    """Positions of the operands an instruction reads (Instruction.reads)."""
    return tuple(range(len(instr.operands) - len(instr.reads), len(instr.operands)))


_OVERWRITES = frozenset({Opcode.DMA_COPY, Opcode.TENSOR_COPY, Opcode.MEMSET})  # write every byte of their dst
_NEVER = np.iinfo(np.int64).max  # the position of an overwrite that does not come


def _on_chip_box(ap: AccessPattern) -> tuple:
    """(space, first partition, end partition, first byte, end byte, whether ``ap`` addresses every byte of that
    box in each partition) of an on-chip operand: dense when its free dims, by stride, are row-major (each stride
    the product of the sizes inside it), so no element is skipped and none addressed twice."""
    dense, inner = True, 1
    for stride, size in sorted(d for d in ap.dims[1:] if d[1] > 1):
        dense, inner = dense and stride == inner, inner * size
    return (int(ap.space), *extent(ap), dense)


def _region(ap: AccessPattern) -> tuple:
    return ap.space, extent(ap)


def _unordered_writer(who: np.ndarray, clock: list, firsts: list):
    """A writer id among ``who`` that does not happen before the instruction whose vector clock is ``clock``,
    or None (the first such id in ``who``'s order when there are several).

    Ids number the instructions stream by stream in order: stream t's are ``firsts[t]`` to ``firsts[t + 1]``,
    and its writer at index k happens before the instruction when ``clock[t] > k``, so the writers that do
    not are one range of ids per stream, ``firsts[t] + clock[t]`` to ``firsts[t + 1]``. Ids 0 (the host) and
    1 (nobody) happen before it when their slots ``clock[n]``, ``clock[n + 1]`` are set. One writer, or
    writers of one stream, is the common case (two reductions: every id from the least to the greatest is
    then of that stream and ordered when the greatest is); others are judged against a table of those
    ranges, one gather. Entries scattered in the table (a transposed or strided operand) are copied together
    first: one pass over them in their order, then the reductions and the gather over a contiguous array."""
    n = len(firsts) - 1
    if not who.flags.c_contiguous:
        who = who.ravel()  # (a copy, in who's order)
    lo, hi = int(_least(who, axis=None)), int(_greatest(who, axis=None))  # (ufuncs called directly: cheaper)
    if lo == hi and lo < 2:
        return None if clock[n + lo] else lo
    t = bisect.bisect_right(firsts, lo) - 1
    if lo >= 2 and hi < firsts[t] + clock[t]:  # (then also hi < firsts[t + 1]: a clock counts its stream's)
        return None
    if lo == hi:
        return lo
    late = np.zeros(hi + 1, bool)  # ids up to hi: which do not happen before
    late[:2] = not clock[n], not clock[n + 1]
    for t in range(n):
        if firsts[t + 1] > lo and firsts[t] <= hi:
            late[firsts[t] + clock[t]:firsts[t + 1]] = True
    if not late[lo:].any():
        return None
    mask = late.take(who)  # (= late[who]; take gathers 16-bit indices 1.5-2x faster than fancy indexing)
    return int(who[mask][0]) if mask.any() else None


_least, _greatest = np.minimum.reduce, np.maximum.reduce


def _cached(cache: dict, fn, ap: AccessPattern):
    """``fn(ap)``, computed once per pattern in ``cache``."""
    value = cache.get(ap)
    if value is None:
        value = cache[ap] = fn(ap)
    return value


class _WriterBounds:
    """What is known of the writers of large operands' entries, so that checking a read or write of one often needs
    no pass over its entries: a tile loaded over a dozen DMA queues has hundreds of thousands, read by each of a run
    of matmuls; a scatter's destination is its whole table, millions, written again and read by each of thousands of
    instructions. For an operand: an instruction every writer among its entries happened before at some point (a
    read of it by that instruction was checked and accepted), or None; and, per stream, the last instruction that
    wrote a byte of its box since (the whole operand: then no instruction before). All the writers of its entries
    happen before an instruction when those do: happening before is transitive, and a stream's instructions happen
    before its later ones. Each write looks only at the operands near its box: they are filed by the stretches of
    ``SPAN`` bytes their boxes cover (those covering more than ``WIDE`` stretches, wide, with every write); a wide
    write forgets every operand of its memory (forgetting is always safe). Operands are named by their pattern's
    number (equal patterns have one: _check_accesses numbers them)."""

    LARGE = 16384  # entries: below, a pass over them costs less than the bookkeeping
    SPAN, WIDE, KEPT, KEPT_WIDE = 4096, 16, 256, 16  # KEPT: operands per stretch, KEPT_WIDE: wide ones (the oldest
    # forgotten: every write looks at the wide ones)

    def __init__(self):
        # pattern number -> [its space, the keys of near it is filed under, its box, reader (stream, index) or
        # None, {stream: index} of the writes since]
        self.known: dict = {}
        self.near: dict = {}  # (space, stretch, or None for the wide) -> {pattern number: its entry of known}
        self.spaces: dict = {}  # space -> {pattern number: its entry of known} (for a wide write)

    def happen_before(self, pattern: int, clock: list, own: tuple | None = None) -> bool:
        """Whether all the writers of ``pattern``'s entries are known to happen before the instruction whose vector
        clock is ``clock`` (False: not known). ``own``: that instruction's (stream, index) when it completes (a
        write's check): the read of ``pattern`` it made at its start, when accepted, bounds them too (its writers then
        happened before its start; any write since is among the writes noted)."""
        known = self.known.get(pattern)
        if known is None:
            return False
        reader, writes = known[3], known[4]
        return (reader is None or reader == own or clock[reader[0]] > reader[1]) and \
            all(clock[t] > k for t, k in writes.items())

    def read(self, pattern: int, region: tuple, reader: tuple, entries: int) -> None:
        """Note that ``reader``'s read of ``pattern`` (of ``region``, (space, box)), ``entries`` entries, was accepted:
        every writer among them happens before it."""
        if entries >= self.LARGE:
            self._keep(pattern, region, reader, {})

    def written(self, pattern: int, region: tuple, writer: tuple, entries: int) -> None:
        """Note that ``writer`` (stream, index) wrote ``pattern`` (of ``region``), ``entries`` entries of the table."""
        space, (p0, p1, lo, hi) = region
        stretches = self._stretches(lo, hi)
        if stretches is None:  # a wide write: every operand of its memory forgotten (cheaper than comparing)
            for other in list(self.spaces.get(space, ())):
                self._forget(other)
        t, k = writer
        for filed in [self.near.get((space, stretch), {}) for stretch in (None, *(stretches or ()))]:
            # (an operand filed under two stretches is noted twice: the same)
            for known in filed.values():
                q0, q1, lo2, hi2 = known[2]
                if p0 < q1 and q0 < p1 and lo < hi2 and lo2 < hi:
                    known[4][t] = k
        if entries >= self.LARGE:
            self._keep(pattern, region, None, {t: k})

    def _stretches(self, lo: int, hi: int):
        """The stretches of bytes [lo, hi), or None when they are more than WIDE."""
        first, last = lo // self.SPAN, (hi - 1) // self.SPAN
        return None if last - first >= self.WIDE else range(first, last + 1)

    def _keep(self, pattern: int, region: tuple, reader: tuple | None, writes: dict) -> None:
        known = self.known.get(pattern)
        if known is not None:
            known[3], known[4] = reader, writes
            return
        space, box = region
        stretches = self._stretches(box[2], box[3])
        keys = [(space, None)] if stretches is None else [(space, k) for k in stretches]
        for key in keys:
            filed = self.near.setdefault(key, {})
            if len(filed) >= (self.KEPT if key[1] is not None else self.KEPT_WIDE):
                self._forget(next(iter(filed)))
        self.known[pattern] = known = [space, keys, box, reader, writes]
        for key in keys:
            self.near[key][pattern] = known
        self.spaces.setdefault(space, {})[pattern] = known

    def _forget(self, pattern: int) -> None:
        known = self.known.pop(pattern)
        for key in known[1]:
            del self.near[key][pattern]
        del self.spaces[known[0]][pattern]


def _boxes_read(read_regions: list, spaces) -> dict:
    """The boxes each stream reads, per memory: space -> ([stream][(p0, p1, lo, hi, index, operand), ...] in order,
    [stream][index]: where the reads of instruction ``index`` start in that list (one more: the end), the streams
    that read that memory at all, in order), so that the reads of a run of a stream's instructions in one memory are
    one slice."""
    tables = {}
    for space in spaces:
        boxes, firsts = [], []
        for stream_reads in read_regions:
            flat, starts = [], []
            for k, reads in enumerate(stream_reads):
                starts.append(len(flat))
                flat.extend((*box, k, operand) for operand, (space2, box) in reads if space2 == space)
            starts.append(len(flat))
            boxes.append(flat)
            firsts.append(starts)
        tables[space] = boxes, firsts, [t for t, flat in enumerate(boxes) if flat]
    return tables


def _merged(spans: list) -> tuple:
    """Byte spans [lo, hi) merged into disjoint sorted ones: (starts, ends)."""
    starts, ends = [], []
    for lo, hi in sorted(spans):
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _intersects(merged: tuple, lo: int, hi: int) -> bool:
    """Whether [lo, hi) shares a byte with the spans of :func:`_merged`."""
    starts, ends = merged
    k = bisect.bisect_right(starts, lo) - 1  # the last span starting at or before lo
    return (k >= 0 and ends[k] > lo) or (k + 1 < len(starts) and starts[k + 1] < hi)


class _Plan(NamedTuple):
    """A loaded program bound to memory: what a run does."""

    calls: list  # numpy calls to make in order
    owners: list  # the _Instr each call belongs to
    inputs: list  # views of the input tensors in HBM
    outputs: list  # views of the output tensors in HBM
    resets: list  # memory to fill with NaN before each run
    copied: list  # (position, view) of the inputs a run copies: those not bound in place (bind_inputs)


class NeuronCore:
    """One emulated NeuronCore of ``target`` (a name or a :class:`Target`): its HBM, SBUF and PSUM.

    Loading a program checks that no instruction reads memory nothing wrote and that no two instructions
    race (see ``LoadedProgram._check_accesses``). ``check_uninitialised=False`` skips that: programs load
    faster, and every run resets the memory they use to NaN so that reads of unwritten memory still show
    in the outputs, and races run as the timing has them.

    ``load(neff, undefined_on_chip=True)`` (or a set of kernel numbers: for their instructions only): SBUF
    and PSUM hold undefined values until written, as NKI kernels have them (a masked load leaves the rest of
    its tile undefined, and the public samples compute on whole tiles, storing only the loaded rows): a read of on-chip bytes of which some, not all, were written is allowed,
    and every run fills the on-chip memory the program uses with NaN first, so that the undefined values show
    in the outputs if they reach them. A read of nothing but unwritten bytes, races and reads of unwritten
    HBM are still refused."""

    def __init__(self, target: str | Target = "trn2", *, check_uninitialised: bool = True,
                 on_chip: OnChip | None = None):
        self.target = target if isinstance(target, Target) else get_target(target)
        self.check_uninitialised = check_uninitialised
        self.hbm = HbmAllocator(self.target)
        if on_chip is not None and on_chip.target != self.target:
            raise NeuronRuntimeError(f"a {self.target.name} NeuronCore cannot share the SBUF and PSUM of a "
                                     f"{on_chip.target.name} one")
        self.on_chip = on_chip or OnChip(self.target)  # shared with other cores when given: runs take turns
        self.sbuf, self.psum = self.on_chip.sbuf, self.on_chip.psum

    def load(self, neff, *, checked_by: str | None = None,
             undefined_on_chip: bool | frozenset = False) -> "LoadedProgram":
        """Load a :class:`Neff` (or the path of a NEFF file) into this core.

        ``checked_by``: the :func:`access_check_id` under which this very NEFF already passed the access
        check (a compile cache records it, next to the NEFF's checksum). When it is this runtime's, the
        check, whose verdict depends on nothing but the program and the checker, is not run again."""
        neff = _as_neff(neff)
        if neff.loops or neff.registers:  # (runtime.loops: checked for every register value in range)
            from runtime.loops import LoopedProgram

            return LoopedProgram(self, neff, trusted=checked_by == access_check_id())
        return LoadedProgram(self, neff, trusted=checked_by == access_check_id(), undefined_on_chip=undefined_on_chip)

    def unload(self, program: "LoadedProgram") -> None:
        """Free ``program``'s HBM (same as ``program.unload()``)."""
        if program.core is not self:
            raise NeuronRuntimeError(f"program {program.neff.name!r} is not loaded on this NeuronCore")
        program.unload()

    def memory_allocated(self) -> int:
        """Bytes of this core's HBM held by loaded programs."""
        return self.hbm.in_use

    def max_memory_allocated(self) -> int:
        """The most bytes of HBM held at once since the core was made."""
        return self.hbm.peak


class LoadedProgram:
    """A NEFF loaded on a core: checked, scheduled and its HBM accounted; run it many times.

    Its HBM bytes, weights and bound kernels are made on the first ``run`` (``time`` needs none)."""

    def __init__(self, core: NeuronCore, neff: Neff, *, trusted: bool = False,
                 undefined_on_chip: bool | frozenset = False, part_of=None):
        self.core, self.neff = core, neff
        # A loop's body (runtime.loops): checked and simulated as a program, its HBM the looped program's, its
        # outputs written by all the iterations together (not checked here), never run itself.
        self.part_of = part_of
        # How its collective instructions reach the other ranks of their groups (runtime.collectives.Transport),
        # given by the host; a program with collectives cannot run without one.
        self.transport = None
        # Instructions that may read on-chip bytes nothing wrote, as NaN (see NeuronCore): all, or those of
        # the kernels numbered in the set.
        self.undefined_on_chip = undefined_on_chip
        # Whether the program is known free of races and of reads of unwritten memory: checked at this load,
        # or before (``trusted``, see NeuronCore.load). Runs of an unchecked one reset its memory to NaN.
        self.access_checked = trusted or core.check_uninitialised
        self._trusted = trusted
        # The access_check_id whose check passed at this load, for a compile cache to record; None when the
        # check did not run here (trusted, or check_uninitialised off).
        self.checked_now = access_check_id() if self.access_checked and not trusted else None
        self._shapes = {Space.HBM: (neff.hbm_size,), Space.SBUF: core.sbuf.shape, Space.PSUM: core.psum.shape}
        self._check_tensors()
        self._layout = HbmLayout(neff.tensors)  # host memory for the tensors' bytes only
        self._input_entries = neff.inputs()
        self._bound: dict = {}  # input position -> the host array read in place (bind_inputs)
        self._free = weakref.finalize(self, core.hbm.free, core.hbm.allocate(neff)) if part_of is None else \
            weakref.finalize(self, int)  # frees also when dropped
        try:
            with collector_paused():
                self._load()
        except BaseException:
            self._free()
            raise

    def _load(self) -> None:
        neff = self.neff
        self.streams = stream_order(neff.streams)  # (Engine, queue) of each stream number
        number = {key: n for n, key in enumerate(self.streams)}
        tensors, passed, facts = TensorIndex(neff.tensors), set(), {}
        self._instrs = [
            [self._prepare(key, index, instr, number, tensors, passed, facts)
             for index, instr in enumerate(neff.streams.get(key, []))]
            for key in self.streams
        ]
        self._order, self._events = self._schedule()
        pending = neff.pending_estimate()
        if pending is not None and pending.target == self.core.target:  # the compile's estimate is this simulation
            pending.settle(kernel_totals((e.kernel, e.start_ns, e.end_ns) for e in self._events))
        self._hbm_bytes = sum(i.hbm_bytes for stream in self._instrs for i in stream)
        if self.access_checked and not self._trusted:
            self._check_accesses()

    # -- loading ----------------------------------------------------------------------------------

    def _check_tensors(self) -> None:
        check_tensor_table(self.neff)
        for t in self.neff.tensors:
            if t.kind in (TensorKind.WEIGHT, TensorKind.CONSTANT) and (
                    t.data is None or t.data.shape != tuple(t.shape) or t.data.dtype != t.dtype.numpy):
                got = "no data" if t.data is None else f"{t.data.dtype}{list(t.data.shape)}"
                raise NeuronRuntimeError(
                    f"{t.kind.name.lower()} {t.name!r} should hold {t.dtype.name}{list(t.shape)}, has {got}"
                )

    def _prepare(self, stream: tuple, index: int, instr: Instruction, number: dict, tensors: TensorIndex,
                 passed: set, facts: dict) -> _Instr:
        """``instr`` checked and costed. ``passed``: the (operand, written to HBM) pairs whose checks passed in
        this program already (its instructions share their tiles' patterns; the checks depend on nothing else).
        ``facts``: the checks' verdict and the costs of the instructions met so far, by :func:`_facts_key`: every
        field of the instruction but its waits, kernel and debug location, which neither the ISA checks nor the
        costs read (a model's layers repeat most of their instructions; the checks run once per distinct one)."""
        key = _facts_key(instr)
        known = facts.get(key)
        try:
            if instr.stream != stream:
                raise NeuronRuntimeError(f"listed in the stream of {_stream_name(stream)}")
            if known is None:
                check(instr, self.core.target)
                written = len(instr.writes)
                for position, ap in enumerate(instr.operands):
                    operand = (ap, position < written and ap.space == Space.HBM)  # (on chip, writing adds no check)
                    if operand in passed:
                        continue
                    _check_strides(ap, position, self._shapes[ap.space])
                    check_bounds(ap, self._shapes[ap.space])
                    if ap.space == Space.HBM:
                        check_hbm_operand(tensors, ap, position < written, self.neff.hbm_size, f"operand {position}")
                        self._layout.check(ap)
                    passed.add(operand)
        except NeuronRuntimeError as e:
            raise self._error(instr, index, e.message, e.hint) from None
        if known is None:
            target = self.core.target
            known = facts[key] = (instruction_cost_ns(instr, target), _reads(instr), hbm_bytes(instr, target),
                                  ports(instr, target), start_latency_ns(instr, target))
        duration, reads, nbytes, held, latency = known
        return _Instr(instr, number[stream], index, duration, tuple((number[(w[0], w[1])], w[2]) for w in instr.waits),
                      reads, nbytes, held, latency)

    def _schedule(self) -> tuple:
        """The simulation without data: (every start and completion as (phase, stream, index) in the
        order they happen, the events of the timeline in order of completion)."""
        instrs = self._instrs
        done = [0] * len(instrs)  # instructions completed per stream
        started = [0.0] * len(instrs)  # start time of each stream's running instruction
        order, events = [], []
        extras, gaps = zip(*(stream_costs([i.instr for i in stream], self.core.target) for stream in instrs)) \
            if instrs else ((), ())
        for phase, s, index, time in simulate([[i.duration_ns + extra for i, extra in zip(stream, more)]
                                               for stream, more in zip(instrs, extras)],
                                              [[i.waits for i in stream] for stream in instrs],
                                              [[i.hbm_bytes for i in stream] for stream in instrs], self.core.target,
                                              [[i.ports for i in stream] for stream in instrs],
                                              [[i.latency_ns for i in stream] for stream in instrs], list(gaps)):
            order.append((phase, s, index))
            if phase == START:
                started[s] = time
                continue
            done[s] += 1
            i = instrs[s][index]
            events.append(Event(self.streams[s], i.index, i.instr.opcode, started[s], time, i.instr.kernel,
                                i.instr.debug))
        if any(done[s] < len(instrs[s]) for s in range(len(instrs))):
            raise self._deadlock(done)
        return order, events

    def _check_accesses(self) -> None:
        """Refuse reads of memory that nothing wrote, and races: exactly (to the byte), whatever the timing.

        Instruction A happens before instruction B when B cannot start before A completed, whatever the
        durations: A is earlier in B's stream, or B waits for A's stream to count past A, or so on through
        other instructions. A vector clock per instruction (for each stream, how many of its instructions
        happen before this one starts) answers that. Replaying the schedule with who last wrote each byte,
        a program is refused when an instruction
        * reads a byte nothing wrote before it started (on chip; in HBM, of an output or scratch tensor);
        * reads a byte whose last writer does not happen before it (read after write);
        * writes a byte that an instruction not happening before it wrote (write after write), or that an
          instruction started but not happening before it reads (write after read).
        A racing program is right, if at all, only by the timing: it is missing a wait."""
        instrs, n = self._instrs, len(self._instrs)
        by_id = [None, None] + [i for stream in instrs for i in stream]
        dtype = np.uint16 if len(by_id) <= 2**16 else np.uint32  # (ids from 0 to len(by_id) - 1)
        # Who last wrote each byte, by id: 2 and up, an instruction; 1, nobody (HBM outputs and scratch);
        # 0, nobody on chip, the host (inputs, weights, constants) in HBM. Kept for the bytes the program uses.
        writers, probes = {}, {}  # space -> Cells: writer ids; marks of one write
        volatile = self._writable
        operands, budget = {space: [] for space in self._shapes}, host_memory_budget()
        for i in by_id[2:]:
            for ap in i.instr.operands:
                operands[ap.space].append(ap)
        for space in self._shapes:
            aps = operands[space]
            if space == Space.HBM:  # outputs and scratch only, a granule per region (memory.HbmRegions)
                partitions, layout = 1, hbm_regions(volatile, aps)
            else:  # the partitions the operands use, and their bytes, packed, a granule per stretch (memory.Columns)
                partitions, layout = max((ap.partition + ap.dims[0][1] for ap in aps), default=1), Columns(aps)
            writers[space], probes[space] = self._access_tables(partitions, dtype, layout, budget)
            for t in volatile if space == Space.HBM else ():
                if t.nbytes:  # (an empty tensor has no bytes, and no place in the layout)
                    writers[space].span(t.offset, t.nbytes)[...] = 1

        # Writer w happens before an instruction when its clock counts past w's index in w's stream; ids 0
        # (the host) and 1 (nobody) get two extra clock slots, set per check (see _unordered_writer).
        firsts = list(itertools.accumulate((len(stream) for stream in instrs), initial=2))
        bounds = _WriterBounds()

        def unordered(who: np.ndarray, clock: list, pattern: int, own: tuple | None = None):
            return None if bounds.happen_before(pattern, clock, own) else _unordered_writer(who, clock, firsts)

        # HBM bytes whose last writer is the host for the whole run: in no output or scratch tensor and
        # written by no instruction. A read of only such bytes is ordered with everything: not checked.
        device_written = _merged([(t.offset, t.offset + t.nbytes) for t in volatile] +
                                 [extent(ap)[2:] for i in by_id[2:] for ap in i.instr.writes if ap.space == Space.HBM])
        # What the check needs of each pattern, made once per pattern object (a program reuses its tiles' patterns;
        # equal patterns that are distinct objects get equal facts): ((space, box), its writer entries, or None when
        # a read of it is not checked: the host wrote HBM only, and only bytes the program writes have entries;
        # its number: equal patterns have one, which _WriterBounds keys them by)
        facts, numbers = {}, {}

        def fact(ap: AccessPattern) -> tuple:
            known = facts.get(id(ap))
            if known is None:
                space, box = region = (ap.space, extent(ap))
                known = facts[id(ap)] = (region, writers[space].of(ap) if space != Space.HBM or
                                         _intersects(device_written, box[2], box[3]) else None,
                                         numbers.setdefault(ap, len(numbers)))
            return known

        read_slots = {space: [space == Space.HBM, False] for space in self._shapes}  # clock slots of ids 0 and 1
        # [stream][index]: (operand, (space, box)) of each read; (operand, pattern number, writer entries, clock slots
        # of ids 0 and 1, (space, box)) of each read to check; (pattern, (space, box), writer entries, pattern number)
        # of each write
        read_regions, checked_reads, write_facts = [], [], []
        for stream in instrs:
            regions_of, checked_of, writes_of = [], [], []
            for i in stream:
                operands, regions, checked = i.instr.operands, [], []
                for operand in i.reads:
                    ap = operands[operand]
                    region, who, number = fact(ap)
                    regions.append((operand, region))
                    if who is not None:
                        checked.append((operand, number, who, read_slots[ap.space], region))
                regions_of.append(regions)
                checked_of.append(checked)
                writes_of.append([(dst, *fact(dst)) for dst in i.instr.writes])
            read_regions.append(regions_of)
            checked_reads.append(checked_of)
            write_facts.append(writes_of)
        boxes_read = _boxes_read(read_regions, self._shapes)
        # [stream][index]: vector clock at its start; instructions started per stream
        clock, started = [[None] * len(stream) for stream in instrs], [0] * n
        for position, (phase, s, k) in enumerate(self._order):
            i = instrs[s][k]
            if phase == START:
                vc = list(clock[s][k - 1]) if k else [0] * n
                vc[s] = k
                for t, count in i.waits:
                    # A wait for what already happens before adds nothing: a clock counting past an instruction
                    # of stream t counts past all that happens before it (it is the merge of their clocks).
                    if vc[t] < count:
                        vc = list(map(max, vc, clock[t][count - 1]))
                        vc[t] = count
                clock[s][k], started[s] = vc, started[s] + 1
                for operand, number, who, slots, region in checked_reads[s][k]:
                    w = unordered(who, vc + slots, number)
                    if w is None:  # (not after the retry below: a partly written tile bounds nothing)
                        bounds.read(number, region, (s, k), who.size)
                    elif w == 0 and (who != 0).any() and self._undefined_on_chip(i):  # a partly written tile
                        w = unordered(who, vc + [True, False], number)
                    if w is not None:
                        space = i.instr.operands[operand].space
                        raise self._bad_read(i, operand, writers[space], who == w, by_id[w], position, probes[space])
                continue
            writes = write_facts[s][k]
            for dst, region, who, number in writes:
                self._check_write(i, dst, region, who, number, clock[s][k], writers, probes, started, by_id,
                                  unordered, boxes_read)
            writer = firsts[s] + k  # (its id)
            for dst, region, who, number in writes:  # (all checked before any is marked: an instruction does not
                who[...] = writer  # race with itself)
                bounds.written(number, region, (s, k), who.size)
        if self.part_of is None:
            self._check_outputs_written(writers[Space.HBM])

    @functools.cached_property
    def order(self) -> list:
        """(number, instruction) of every instruction in the order they complete: the order a run computes them."""
        return [(n, self._instrs[s][k].instr) for n, (phase, s, k) in enumerate(self._order) if phase != START]

    @property
    def events(self) -> list:
        return self._events

    @property
    def makespan(self) -> float:
        return max((e.end_ns for e in self._events), default=0.0)

    @property
    def hbm_bytes(self) -> int:
        return self._hbm_bytes

    def _undefined_on_chip(self, i: _Instr) -> bool:
        allowed = self.undefined_on_chip
        return allowed is True or (not isinstance(allowed, bool) and i.instr.kernel in allowed)

    def _check_outputs_written(self, writers: Cells) -> None:
        """Refuse a program that leaves bytes of an output unwritten: the host would read memory nothing wrote."""
        for t in self.neff.outputs():
            entry = _first_equal(writers.span(t.offset, t.nbytes), 1) if t.nbytes else None
            if entry is not None:
                byte = entry * writers.granule_at(t.offset)  # (of the output)
                raise NeuronRuntimeError(
                    f"program {self.neff.name!r} never writes byte {byte} of output {t.index} ({t.name!r}, HBM bytes "
                    f"[{t.offset}, {t.offset + t.nbytes})): a run would return memory nothing wrote",
                    hint="an instruction storing the output is missing, or the NEFF was damaged or changed")

    def _access_tables(self, partitions: int, dtype, layout, budget: int) -> tuple:
        """The (writers, probes) tables of one memory for the access check, within the host memory budget: one
        entry per granule of the program's outputs and scratch tensors in HBM (memory.HbmRegions), of the bytes
        its operands use on chip (memory.Columns), in the partitions they use."""
        entries = layout.size if isinstance(layout, HbmRegions) else partitions * layout.size  # as Cells
        need = entries * (np.dtype(dtype).itemsize + 1)
        try:
            if need > budget:
                raise MemoryError
            return Cells(partitions, dtype, layout), Cells(partitions, bool, layout)
        except MemoryError:
            limit = "could allocate" if need <= budget else f"budget of {budget} bytes allows"
            raise DeviceOutOfMemoryError(
                f"checking the memory accesses of {self.neff.name!r} needs {need} bytes ({size_text(need)}) of host "
                f"memory, more than the host {limit}",
                hint=f"raise the budget ({HOST_BUDGET_VARIABLE}) on a machine with that much memory, use a smaller "
                "batch, or load with NeuronCore(check_uninitialised=False)") from None

    def _check_write(self, i: _Instr, dst: AccessPattern, region: tuple, who: np.ndarray, number: int, vc: list,
                     writers: dict, probes: dict, started: list, by_id: list, unordered, boxes_read: dict) -> None:
        """Refuse ``i`` writing ``dst`` (of ``region``, (space, box); writer entries ``who``; pattern number
        ``number``) when another write or a read of those bytes is not ordered with it."""
        instrs, s = self._instrs, i.stream
        # (overwriting host data or nothing is no race; the writers of an operand ``i`` read at its start, when no
        # instruction wrote its box since, happen before it: that read was accepted)
        w = unordered(who, vc + [True, True], number, i.key)
        if w is not None:
            raise self._race(i, by_id[w], f"writes {self._where(dst, writers[dst.space], who == w)}, "
                             f"also written by")
        space, (p0, p1, lo, hi) = region
        boxes, firsts, streams = boxes_read[space]
        readers = [(instrs[t][k], operand) for t in streams if t != s and vc[t] < started[t]  # started, not
                   for q0, q1, lo2, hi2, k, operand in boxes[t][firsts[t][vc[t]]:firsts[t][started[t]]]  # happening
                   if p0 < q1 and q0 < p1 and lo < hi2 and lo2 < hi]  # before i, reading a box overlapping dst's
        if readers:
            mark = probes[dst.space].of(dst)
            mark[...] = True
            for r, operand in readers:
                ap = r.instr.operands[operand]
                shared = probes[ap.space].of(ap)
                if shared.any():
                    place = self._where(ap, probes[ap.space], shared)
                    raise self._race(i, r, f"writes {place}, read (operand {operand}) by")
            mark[...] = False

    def _bad_read(self, i: _Instr, operand: int, cells: Cells, where: np.ndarray, writer: _Instr | None,
                  position: int, probe: Cells) -> NeuronRuntimeError:
        """The error for ``i`` reading, ``where``, bytes nothing wrote or that ``writer`` wrote racing with it."""
        if writer is None:
            return self._unwritten(i, operand, cells, where, position, probe)
        ap = i.instr.operands[operand]
        return self._race(i, writer, f"operand {operand} reads {self._where(ap, cells, where)}, last written by")

    def _where(self, ap: AccessPattern, cells: Cells, mask: np.ndarray) -> str:
        """Where the first byte of ``ap`` that ``mask`` (over ``cells.of(ap)``) selects is, in words."""
        partition, byte = cells.locate(ap, tuple(int(x) for x in np.argwhere(mask)[0]))
        if ap.space != Space.HBM:
            return f"{ap.space.name} partition {partition} byte {byte}"
        owner = [t for t in self.neff.tensors if t.offset <= byte < t.offset + t.nbytes]
        return f"HBM byte {byte}" + (f" (of {owner[0].kind.name.lower()} {owner[0].name!r})" if owner else "")

    def _times(self, i: _Instr) -> tuple:
        """(start, end) of ``i`` in the schedule, ns."""
        return next((e.start_ns, e.end_ns) for e in self._events
                    if e.stream == self.streams[i.stream] and e.index == i.index)

    def _name(self, i: _Instr) -> str:
        return f"{i.instr.opcode.name} #{i.index} on {_stream_name(self.streams[i.stream])}"

    def _wait_for(self, i: _Instr) -> str:
        return f"wait for {_stream_name(self.streams[i.stream])}'s semaphore to reach {i.index + 1}"

    def _unwritten(self, i: _Instr, operand: int, cells: Cells, unwritten: np.ndarray, position: int, probe: Cells):
        """The error for ``i`` reading bytes nothing wrote, naming the instruction that writes them later, if any.
        ``probe`` is the check's own (all clear) table of marks for that memory: no second table of its size."""
        ap = i.instr.operands[operand]
        problem = (f"operand {operand} reads {self._where(ap, cells, unwritten)}, which nothing wrote before the "
                   f"instruction started at {self._times(i)[0]:.0f} ns")
        hint = "a missing semaphore wait or a tile read before it is loaded"
        partition, byte = cells.locate(ap, tuple(int(x) for x in np.argwhere(unwritten)[0]))
        for phase, s, k in self._order[position:]:
            writer = self._instrs[s][k]
            written = [dst for dst in writer.instr.writes if dst.space == ap.space]
            if phase == COMPLETE and written:
                for dst in written:
                    probe.of(dst)[...] = True
                if probe.at(partition, byte):
                    problem += f"; {self._name(writer)} writes it, completing at {self._times(writer)[1]:.0f} ns"
                    return self._error(i.instr, i.index, problem, f"{hint}: {self._wait_for(writer)}")
        return self._error(i.instr, i.index, problem, f"{hint}: no instruction of the program ever writes it")

    def _race(self, i: _Instr, other: _Instr, access: str) -> NeuronRuntimeError:
        """The error for ``i`` and ``other`` touching the same byte, one writing, when no wait orders them."""
        start, end = self._times(other)
        return self._error(
            i.instr, i.index, f"{access} {self._name(other)} (running {start:.0f}-{end:.0f} ns), and no semaphore "
            f"wait orders the two: only the timing does (a race)", f"a missing semaphore wait: {self._wait_for(other)}")

    def _error(self, instr: Instruction, index: int, problem: str, hint: str = "") -> NeuronRuntimeError:
        what = f"{instr.opcode.name} #{index} on {_stream_name(instr.stream)}"
        if 0 <= instr.kernel < len(self.neff.kernels):
            what += f" (kernel {self.neff.kernels[instr.kernel].name})"
        operands = ", ".join(_operand_text(ap) for ap in instr.operands)
        location = str(self.neff.debug_locs[instr.debug]) if 0 <= instr.debug < len(self.neff.debug_locs) else ""
        return NeuronRuntimeError(f"{what} [{operands}]: {problem}", hint=hint, location=location)

    def _deadlock(self, done: list) -> NeuronRuntimeError:
        blocked = []
        for s, stream in enumerate(self._instrs):
            if done[s] < len(stream):
                i = stream[done[s]]
                unmet = "; ".join(
                    f"waits for {_stream_name(self.streams[t])}'s semaphore to reach {count} "
                    f"(it completed {done[t]} of its {len(self._instrs[t])} instructions)"
                    for t, count in i.waits if done[t] < count
                )
                blocked.append(str(self._error(i.instr, i.index, unmet)))
        return NeuronRuntimeError(
            "deadlock: no stream can make progress\n    " + "\n    ".join(blocked),
            hint="every wait must name a count its stream reaches without waiting, directly or not, on the waiter",
        )

    # -- binding to memory (on the first run) -----------------------------------------------------

    @functools.cached_property
    def _writable(self) -> list:
        """The program's output and scratch tensors: the only HBM it may write (neff.rules.WRITABLE)."""
        return [t for t in self.neff.tensors if t.kind in WRITABLE]

    @functools.cached_property
    def memory(self) -> Memory:
        """The program's own HBM, with its weights and constants in place, and its core's SBUF and PSUM."""
        fresh = [(t.offset, t.nbytes) for t in self._writable]
        memory = Memory(allocate_hbm(self._layout, self.neff.name, fresh), self.core.sbuf, self.core.psum,
                        self._layout)
        for t in self.neff.tensors:
            if t.kind in (TensorKind.WEIGHT, TensorKind.CONSTANT):
                memory.tensor(t)[...] = t.data
        return memory

    @functools.cached_property
    def _plan(self) -> _Plan:
        """The schedule bound to memory: each instruction's kernel at its completion, in schedule order.

        Computing at completion what the instruction read at its start is the same unless an instruction
        completing meanwhile wrote memory it reads; such an instruction (only racy programs have them)
        reads into a buffer at its start and writes that at its completion instead."""
        deferred, running = set(), {}  # keys of instructions that must read at their start; stream -> instruction
        regions, reads = {}, {}  # access pattern -> (space, box); instruction key -> the regions it reads
        for phase, s, k in self._order:
            i = self._instrs[s][k]
            if phase == START:
                running[s] = i
                continue
            del running[s]
            if not running:  # (a program of one stream never gets further)
                continue
            written = [_cached(regions, _region, dst) for dst in i.instr.writes]
            for j in running.values():
                if j.key in deferred:
                    continue
                read = reads.get(j.key)
                if read is None:
                    read = reads[j.key] = [_cached(regions, _region, j.instr.operands[r]) for r in j.reads]
                if any(overlaps(w, r) for w in written for r in read):
                    deferred.add(j.key)

        memory, scratch = self.memory, Scratch()
        calls, owners, values = [], [], {}
        live = self._read_partitions()  # key -> the partitions of its destination a broadcast writes
        # one view per access pattern (a program's instructions share their tiles' patterns), made without the
        # bounds check the load made of every operand
        view = functools.partial(_cached, {}, functools.partial(memory.view, checked=True))

        for phase, s, k in self._order:
            i = self._instrs[s][k]
            if i.instr.opcode in COLLECTIVES:  # through the transport, at its completion, racy or not
                if phase == START:
                    continue
                steps = [functools.partial(self._collective, i.instr,
                                           *(view(ap).reshape(-1) for ap in i.instr.operands))]
            elif i.key not in deferred:
                if phase == START:
                    continue
                scratch.next_kernel()
                rows = live.get(i.key)
                if rows is None:
                    steps = kernel(i.instr, *map(view, i.instr.operands), new=scratch)
                else:  # a broadcast, on the partitions read (none: no call)
                    steps = kernel(i.instr, *(view(ap)[rows] for ap in i.instr.operands), new=scratch) \
                        if rows.stop > rows.start else []
            elif phase == START:
                values[i.key] = box = [None]
                steps = [functools.partial(_read, box, SEMANTICS[i.instr.opcode], i.instr,
                                           *map(view, i.instr.operands))]
            else:
                steps = [functools.partial(_write, tuple(map(view, i.instr.writes)), values.pop(i.key))]
            calls += steps
            owners += [i] * len(steps)
        inputs = [memory.tensor(t) for t in self.neff.inputs()]
        return _Plan(calls, owners, inputs, [memory.tensor(t) for t in self.neff.outputs()],
                     self._used_memory(memory, hbm=not self.access_checked)
                     if not self.access_checked or bool(self.undefined_on_chip) else [],
                     [(i, view) for i, view in enumerate(inputs) if i not in self._bound])

    def _read_partitions(self) -> dict:
        """Instruction key -> slice of the partitions its destination is read at, for each partition broadcast
        (a DMA_COPY of one row to many partitions on chip: codegen's bias and norm-parameter tiles) of which
        some partitions no instruction reads before a copy or memset overwrites them, or the program ends;
        the run writes only the partitions from the first read to the last (none, an empty slice, when no
        partition is read). The others hold what no instruction of the program reads, nor any other program (a
        checked one reads no on-chip byte it did not write; an unchecked one has its on-chip bytes reset before
        it runs), so the outputs and the timeline are those of the whole copy.

        Conservative: a read is its operand's box; every operand counts as a read but an overwrite (a copy or
        memset whose operand is row-major by stride and covers the broadcast's bytes); and a read by an
        instruction that completes later counts even if it read earlier."""
        if self.undefined_on_chip:  # (they may read any on-chip byte)
            return {}
        done = [self._instrs[s][k] for phase, s, k in self._order if phase != START]  # the order kernels run in
        broadcasts = [(n, i) for n, i in enumerate(done) if i.instr.opcode == Opcode.DMA_COPY
                      and i.instr.dst.space != Space.HBM and i.instr.dst.dims[0][1] > 1
                      and i.instr.operands[1].dims[0][0] == 0 and i.instr.operands[1].shape == i.instr.dst.shape]
        if not broadcasts:
            return {}
        rows = []  # (position, space, first partition, end partition, first byte, end byte, overwrites)
        boxes: dict = {}  # id(operand) -> (space, its extent, dense), or () in HBM
        for n, i in enumerate(done):
            instr = i.instr
            reads = i.reads[0] if i.reads else len(instr.operands)  # operands from here on are read
            overwrite = instr.opcode in _OVERWRITES and not instr.accumulate
            for position, ap in enumerate(instr.operands):
                box = boxes.get(id(ap))
                if box is None:
                    box = boxes[id(ap)] = () if ap.space == Space.HBM else _on_chip_box(ap)
                if box:
                    rows.append((n, *box[:5], overwrite and position < reads and box[5]))
        at, space, q0, q1, lo2, hi2, overwrites = np.array(rows, dtype=np.int64).T
        live = {}
        for n, i in broadcasts:
            dst = i.instr.dst
            p0, p1, lo, hi = extent(dst)
            near = np.flatnonzero((at > n) & (space == int(dst.space)) & (lo2 < hi) & (lo < hi2) & (q0 < p1)
                                  & (p0 < q1))  # the later operands that touch its box
            kills = overwrites[near].astype(bool) & (lo2[near] <= lo) & (hi <= hi2[near])
            partitions = np.arange(p0, p1)[:, None]
            covers = (q0[near] <= partitions) & (partitions < q1[near])  # [partition, operand]
            first_kill = np.where(covers & kills, at[near], _NEVER).min(axis=1, initial=_NEVER)
            read = (covers & ~kills & (at[near] <= first_kill[:, None])).any(axis=1)
            used = np.flatnonzero(read)
            if not len(used):
                live[i.key] = slice(0, 0)  # nothing reads it: no call at all
            elif used[-1] - used[0] + 1 < p1 - p0:
                live[i.key] = slice(int(used[0]), int(used[-1]) + 1)
        return live

    def _used_memory(self, memory: Memory, hbm: bool = True) -> list:
        """What a run resets to NaN when reads of unwritten memory are not refused: the output and scratch
        HBM (when ``hbm``), and the box of SBUF and PSUM that the program's operands cover."""
        regions = [memory.tensor_bytes(t) for t in self._writable] if hbm else []
        for space, memory in ((Space.SBUF, self.core.sbuf), (Space.PSUM, self.core.psum)):
            boxes = [extent(ap) for stream in self._instrs for i in stream for ap in i.instr.operands
                     if ap.space == space]
            if boxes:
                p0, p1, lo, hi = zip(*boxes)
                regions.append(memory[min(p0):max(p1), min(lo):max(hi)])
        return regions

    # -- running ----------------------------------------------------------------------------------

    def run(self, inputs: list) -> RunResult:
        """Execute the program on ``inputs``; returns copies of the outputs and the timeline."""
        self._check_loaded()
        plan = self._plan
        with self.core.on_chip.lock:
            self._write_inputs(inputs, plan.inputs)
            self._execute(plan)
            outputs = [view.copy() for view in plan.outputs]
        return RunResult(outputs, self.time())

    def run_into(self, inputs: list, outputs: list, bound: dict | None = None) -> None:
        """Execute the program reading ``inputs`` and writing ``outputs`` in place: the host's own arrays
        (any strides; a Python number for a 0-d input), in the program's input and output order. ``bound``:
        inputs read in place from this run on (``bind_inputs`` first; None at their positions in ``inputs``),
        for a host that queues runs and may rebind between them: each run reads what it was queued with.

        For a host that launches one loaded program many times on its own buffers (the `neuron` device's
        eager ops): no timeline is built (``time()`` is the same for every run, the host reads it once),
        the outputs go straight into the host's arrays instead of into fresh copies, and the shapes and
        dtypes are not checked again (the host keys its programs by them; ``run`` checks). The inputs are
        still copied into the program's HBM: its kernels are bound to views of it at the first run, and
        rebinding them to other buffers on every launch would cost more than the copy of the small
        tensors an eager op usually has."""
        if bound is not None:
            self.bind_inputs(bound)  # checks that the program is loaded
        elif not self._free.alive:
            self._check_loaded()
        plan = self._plan
        with self.core.on_chip.lock:
            for i, view in plan.copied:
                view[...] = inputs[i]
            self._execute(plan)
            for out, view in zip(outputs, plan.outputs):
                out[...] = view

    def bind_inputs(self, arrays: dict) -> None:
        """Read the inputs at the positions of ``arrays`` (position -> host array) in place, from the host's
        own arrays, on every run from now on, instead of copying them into the program's HBM at each run: a
        host keeps its parameters resident this way (a `torch.compile`d model's weights, which are inputs of
        its graphs). The program reads what the arrays hold when it runs, so the host may change them in
        place between runs; ``run`` ignores its inputs at bound positions (give None there).

        Each array must be C-contiguous, of its input's shape and dtype. Binding other arrays (or ``{}``:
        none) rebinds the program's instructions to them: the next run rebuilds its calls, which costs about
        what the first run's building did, so bind once and run many times."""
        self._check_loaded()
        if arrays.keys() == self._bound.keys() and all(a is self._bound[p] for p, a in arrays.items()):
            return  # the arrays bound now (checked when they were bound)
        entries = self._input_entries
        for position, array in arrays.items():
            t = entries[position]
            if not isinstance(array, np.ndarray) or array.shape != tuple(t.shape) or array.dtype != t.dtype.numpy:
                got = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
                raise InputMismatchError(f"input {position} ({t.name!r}) must be {t.dtype.numpy}{list(t.shape)} to "
                                         f"be bound, got {got}")
            if not array.flags.c_contiguous:
                raise InputMismatchError(f"input {position} ({t.name!r}) must be C-contiguous to be bound",
                                         hint="bind np.ascontiguousarray(x), or give it to run() instead")
        self._bound = dict(arrays)
        self.memory.bind([(entries[p], a) for p, a in arrays.items()])
        self.__dict__.pop("_plan", None)

    def run_observed(self, inputs: list, observe) -> RunResult:
        """`run`, calling ``observe(kernel, hbm)`` as soon as the last instruction of each kernel has completed
        (a kernel's number, the program's HBM as bytes): a debugger reads a kernel's output tensor there,
        before any later kernel can reuse its memory (`neuronc bisect`). Slower than `run`."""
        self._check_loaded()
        plan = self._plan
        last_call = {owner.instr.kernel: position for position, owner in enumerate(plan.owners)}
        ends = {position: kernel for kernel, position in last_call.items()}
        hbm = self.memory.arrays[Space.HBM]
        self._write_inputs(inputs, plan.inputs)
        for region in plan.resets:
            region.fill(UNINITIALISED)
        with quiet_numerics():
            for position, call in enumerate(plan.calls):
                try:
                    call()
                except Exception as e:  # numpy refused, e.g. an integer raised to a negative power
                    owner = plan.owners[position]
                    raise self._error(owner.instr, owner.index, f"failed: {e}") from e
                if position in ends:
                    observe(ends[position], hbm)
        return RunResult([view.copy() for view in plan.outputs], self.time())

    def _execute(self, plan: _Plan) -> None:
        for region in plan.resets:
            region.fill(UNINITIALISED)
        if getattr(_quiet, "on", False):
            self._call(plan)
        else:
            with quiet_numerics():
                self._call(plan)

    def _collective(self, instr: Instruction, dst: np.ndarray, src: np.ndarray) -> None:
        """A collective instruction, run by the host's transport (see runtime.collectives)."""
        if self.transport is None:
            raise CollectiveError(
                f"program {self.neff.name!r} has collective instructions ({instr.opcode.name} over {int(instr.imm0)} "
                "ranks) and was given no transport to the other ranks",
                hint="run it where its group exists: under torch.distributed (a compiled graph on neuron tensors), "
                "or on the cores of one process with runtime.collectives.run_on_cores")
        self.transport.collective(COLLECTIVES[instr.opcode], int(instr.imm1), int(instr.imm0), instr.alu, dst, src)

    def _call(self, plan: _Plan) -> None:
        calls = plan.calls
        remaining = iter(calls)
        try:
            for call in remaining:
                call()
        except CollectiveError:  # the group failed (a rank died, a timeout): said as it is
            raise
        except Exception as e:  # numpy refused, e.g. an integer raised to a negative power
            i = plan.owners[len(calls) - operator.length_hint(remaining) - 1]  # the call that raised
            raise self._error(i.instr, i.index, f"failed: {e}") from e

    def time(self) -> Timeline:
        """The timeline of a run, without running: times depend on the program and the target, not on data."""
        self._check_loaded()
        return Timeline(list(self._events), self._hbm_bytes)

    def unload(self) -> None:
        """Free the program's HBM on its core; the program cannot run any more."""
        self._free()
        self.__dict__.pop("memory", None)
        self.__dict__.pop("_plan", None)

    @property
    def loaded(self) -> bool:
        return self._free.alive

    def _check_loaded(self) -> None:
        if not self.loaded:
            raise NeuronRuntimeError(f"program {self.neff.name!r} was unloaded from its NeuronCore",
                                     hint="load the NEFF again to run it")

    def _write_inputs(self, inputs: list, views: list) -> None:
        expected = self._input_entries
        if len(inputs) != len(expected):
            names = ", ".join(t.name for t in expected)
            raise InputMismatchError(
                f"program {self.neff.name!r} takes {len(expected)} inputs ({names}), got {len(inputs)}"
            )
        for i, (t, x, view) in enumerate(zip(expected, inputs, views)):
            if i in self._bound:  # read in place (bind_inputs)
                continue
            x = np.asarray(x)
            if x.shape != tuple(t.shape) or x.dtype != t.dtype.numpy:
                raise InputMismatchError(
                    f"input {i} ({t.name!r}) must be {t.dtype.numpy}{list(t.shape)}, got {x.dtype}{list(x.shape)}",
                    hint="the program was compiled for these shapes and dtypes; recompile for new ones",
                )
            view[...] = x


_quiet = threading.local()  # .on inside quiet_numerics(): numpy's float errors are already ignored (errstate is
# per thread too)


@contextlib.contextmanager
def quiet_numerics():
    """Runs inside it treat IEEE results (inf, NaN) as the device's answer, not as numpy warnings. Every run
    enters it; a host that runs many programs back to back (the `neuron` device's queues) enters it once
    around them all, which saves numpy's errstate switch per run (a few us of an eager op's few tens)."""
    if getattr(_quiet, "on", False):
        yield
        return
    with np.errstate(all="ignore"):
        _quiet.on = True
        try:
            yield
        finally:
            _quiet.on = False


def _read(box: list, fn, instr: Instruction, dst: np.ndarray, *srcs: np.ndarray) -> None:
    """An instruction's start when it must read then: compute its value from the operands as they are now."""
    box[0] = fn(instr, dst, *srcs)


def _write(dsts: tuple, box: list) -> None:
    """... and its completion: round the value into the destination(s)."""
    store_all(dsts, box[0])


def run_neff(neff_or_path, inputs: list | None = None, target: str | Target | None = None, *,
             numerics: bool = True) -> RunResult:
    """Load a NEFF (object or file) on a fresh core of ``target`` (default: the NEFF's) and run it once.

    ``numerics=False`` only times it: no inputs needed, no outputs, the same timeline."""
    neff = _as_neff(neff_or_path)
    program = NeuronCore(target or neff.target).load(neff)
    if not numerics:
        return RunResult([], program.time())
    return program.run(inputs if inputs is not None else [])


SCAN_CHUNK = 1 << 20
"""Entries compared at a time when scanning an access table: a 1 GiB output's scan must not need another GiB."""


def _first_equal(entries: np.ndarray, value) -> int | None:
    """The index of the first entry equal to ``value``, or None, in bounded extra memory (chunk by chunk)."""
    for start in range(0, len(entries), SCAN_CHUNK):
        hits = np.flatnonzero(entries[start:start + SCAN_CHUNK] == value)
        if len(hits):
            return start + int(hits[0])
    return None
