"""Repeated kernels generated once: a model's N identical layers make N copies of each of their kernels.

A kernel's instructions depend on its node (op, shape, dtype, attributes and plans, its inputs' ops and types), on
where its tensors lie in HBM, and on three things of the emitter: whether the kernel's number is odd (its SBUF
pools stack from the other end), the DMA queue its first transfer takes (round robin) and its debug location.
Everything else is the same for two kernels of the same *signature*: the node's canonical IR text (its line
with the nodes it refers to numbered locally, no source location) and which of its tensors share a buffer.

So each signature's kernel runs once, on a scratch emitter, against a symbolic memory plan that puts tensor k of
the kernel at byte (k + 1) x 2**40; every instance (the first one too) is that recording with each HBM offset
rebound to the instance's own tensor (offset - (k + 1) x 2**40 + the tensor's address), its queues turned by the
emitter's round robin, and its kernel and debug numbers (a matmul chain's first matmul locates its instructions
at its own source location: the signature numbers the locations its attributes hold, and each instance takes its
own). A signature met at both kernel parities runs once: the other parity's recording is the first one with each
SBUF operand moved to its pool's base at that parity (all the parity changes). A recording is not reused (the kernel
runs as usual) when the kernel asks the plan for anything but a tensor of its signature, locates instructions at a
location its signature does not name, or fails. The NEFF is the same, byte for byte, as the kernels emitted one by
one (tests/test_kernel_reuse.py compares both).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import struct

import numpy as np

from neuronc import ir
from neuronc.codegen.emitter import Emitter
from neuronc.ir import Node
from neuronc.ir_text import _Printer, _load_plan_types
from neuronc.isa import AccessPattern, Instruction, Space
from neuronc.locs_apart import LocsApart
from neuronc.neff.program import DebugLoc
from neuronc.plans import MemoryPlan

SPAN = 1 << 40  # bytes between two symbolic tensors: far more than any tensor (or view offset) reaches


class _NotReusable(Exception):
    """The kernel read something its signature does not describe."""


class _LocalIds:
    """Numbers nodes in the order they are first referred to: the kernel's node 0, then the ones it names."""

    def __init__(self):
        self.ids: dict = {}

    def __contains__(self, node) -> bool:
        return True

    def __getitem__(self, node: Node) -> int:
        return self.ids.setdefault(node, len(self.ids))


_APART = "locations apart"  # _Signature.texts[record type]: its records are keyed with their locations left out
_LOC_MARK = "\x00loc\x00"  # a location in a kept template (no other text has a NUL: strings print as JSON)


class _Signature(_Printer):
    """A node's text without its source location. A location among its attributes (a matmul chain's first matmul's)
    is printed as its number among the distinct locations the signature met, the kernel's own first (`locs`): two
    kernels of one signature locate their instructions alike, each at its own locations."""

    def __init__(self, loc: DebugLoc, texts: dict):
        super().__init__(_LocalIds(), None, wrap=False)
        self.locs: dict = {loc.key(): loc}
        self.texts = texts  # a plan's pickle -> its text; a record type -> False: not kept (_attr)
        self.numbered = 0  # nodes and locations printed so far (their text depends on the signature's numbering)
        self.met: list | None = None  # while a record is printed as a template: the locations met, in order

    def node(self, n: Node) -> str:
        head = f"{self.ref(n)} = {n.op.name.lower()}({', '.join(self.ref(i) for i in n.inputs)}) : " \
               f"{n.dtype.name.lower()}{n.shape}"
        return head + (" {" + ", ".join(f"{self._key(k)} = {self._attr(v)}" for k, v in n.attrs.items()) + "}"
                       if n.attrs else "")

    def _attr(self, v) -> str:
        """An attribute's text. A record (a plan: each layer's kernels have their own, equal ones) is printed once
        per distinct value, its pickle the key: equal pickles are equal types, fields, float bits and dict orders,
        which print alike. A record type whose text numbers a location (a norm prologue's: each layer's own) is
        keyed from then on by its pickle with the locations left out (LocsApart), and its text kept as a template:
        the locations are printed into it in the order the printer meets them, a function of the pickle (see
        _keep). A record whose text numbers a node is not kept, and its type is printed afresh from then on (a
        node's pickle holds its whole graph)."""
        kind = self.texts.get(type(v))
        if not dataclasses.is_dataclass(v) or isinstance(v, type) or kind is False:
            return self.value(v)
        pickler = LocsApart() if kind is _APART else None
        try:
            key = pickle.dumps(v, pickle.HIGHEST_PROTOCOL) if pickler is None else pickler.key(v)
        except (pickle.PicklingError, TypeError, AttributeError):
            return self.value(v)
        kept = self.texts.get(key)
        if isinstance(kept, str):  # (a value with no location: its text under either key)
            return kept
        if kept is not None:
            template, order = kept
            return self._filled(template, [pickler.locs[j] for j in order])
        numbered, self.met = self.numbered, []
        try:
            template = self.value(v)  # a location printed as _LOC_MARK, noted in self.met
        finally:
            met, self.met = self.met, None
        text = self._filled(template, met)
        if self.numbered != numbered + len(met):  # it numbers a node: not kept
            self.texts[type(v)] = False
        elif not met:
            self.texts[key] = text
        elif pickler is None:
            self.texts[type(v)] = _APART
        else:
            self._keep(key, template, met, pickler.locs)
        return text

    def _keep(self, key: bytes, template: str, met: list, pickled: list) -> None:
        """Keeps `template` under `key` with the order of its locations as positions in the pickle. A value of the
        same key has the same structure (shared objects too: the pickle's memo), so the printer meets its locations
        at the same positions, and the i-th location printed is the one pickled at position order[i]; kept only when
        that position is unambiguous (each location pickled is its own object)."""
        position = {id(loc): j for j, loc in enumerate(pickled)}
        if len(position) == len(pickled) and all(id(loc) in position for loc in met) \
                and template.count(_LOC_MARK) == len(met):
            self.texts[key] = (template, [position[id(loc)] for loc in met])

    def _filled(self, template: str, locs: list) -> str:
        """`template` with its i-th _LOC_MARK replaced by the text of locs[i], printed in order (numbering them)."""
        if not locs:
            return template
        pieces = template.split(_LOC_MARK)
        return pieces[0] + "".join(self._flat(loc) + piece for loc, piece in zip(locs, pieces[1:]))

    def ref(self, node: Node) -> str:
        self.numbered += 1
        return super().ref(node)

    def _flat(self, v) -> str:
        if isinstance(v, DebugLoc):
            if self.met is not None:
                self.met.append(v)
                return _LOC_MARK
            self.numbered += 1
            key = v.key()
            self.locs.setdefault(key, v)
            return f"loc{list(self.locs).index(key)}"
        if isinstance(v, float) and math.isnan(v):  # the IR text prints every NaN alike: its bits tell them apart
            return f"nan<{struct.pack('<d', v).hex()}>"
        if isinstance(v, np.floating) and np.isnan(v):
            return f"nan<{v.dtype.name}:{v.tobytes().hex()}>"
        return super()._flat(v)


def _attr_nodes(value, found: list) -> None:
    """The nodes an attribute value refers to (a matmul chain's first matmul), in order."""
    if isinstance(value, Node):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _attr_nodes(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _attr_nodes(v, found)


def signature(node: Node, plan: MemoryPlan, texts: dict | None = None) -> tuple:
    """(key, the nodes numbered as the key numbers them, the locations as the key numbers them): nodes printed whole
    (the kernel's and those its attributes name), the others (inputs) by op and type; with which of them share a
    buffer. `texts` keeps the plans' texts between calls (_Signature._attr)."""
    _load_plan_types()
    printer = _Signature(node.loc, {} if texts is None else texts)
    whole, lines = [node], []
    while len(lines) < len(whole):
        n = whole[len(lines)]
        lines.append(printer.node(n))
        for attr in n.attrs.values():
            found: list = []
            _attr_nodes(attr, found)
            whole += [f for f in found if f not in whole]
    numbered = list(printer.number.ids)
    lines += [f"%{k} : {n.op.name.lower()} {n.dtype.name.lower()}{n.shape}"
              for k, n in enumerate(numbered) if n not in whole]
    entries: dict = {}
    shared = tuple(entries.setdefault(id(plan.placement[n]), k) if plan.has_buffer(n) else -1
                   for k, n in enumerate(numbered))
    text = "\n".join(lines) + f"\nbuffers {shared}"
    return hashlib.sha256(text.encode()).hexdigest(), numbered, list(printer.locs.values())


class _SymbolicPlan:
    """A memory plan that places the kernel's k-th node at (k + 1) x SPAN, and knows nothing else."""

    def __init__(self, numbered: list, plan: MemoryPlan):
        self._number = {n: k for k, n in enumerate(numbered)}
        self._plan = plan

    def offset(self, node) -> int:
        if node not in self._number or not self._plan.has_buffer(node):
            raise _NotReusable(node)
        return (self._number[node] + 1) * SPAN

    def has_buffer(self, node) -> bool:
        if node not in self._number:
            raise _NotReusable(node)
        return self._plan.has_buffer(node)

    def __getattr__(self, name):
        raise _NotReusable(name)


class _Recorder(Emitter):
    """An emitter that notes which instructions took the DMA round robin (or a queue counted as it, dma_on), and
    where each SBUF pool lies at this kernel parity and at the other."""

    def __init__(self, target):
        super().__init__(target)
        self.rotated: list = []
        self.pools: list = []  # (base at this parity, base at the other, bytes), in allocation order

    def sbuf_pool(self, dtype, free_elements: int, bufs: int = 2):
        below = self._sbuf_used
        pool = super().sbuf_pool(dtype, free_elements, bufs)
        size = self._sbuf_used - below
        even, odd = below, self.target.sbuf_bytes_per_partition - self._sbuf_used  # as Emitter.sbuf_pool places it
        self.pools.append((odd, even, size) if (len(self.kernels) - 1) % 2 else (even, odd, size))
        return pool

    def dma(self, dst, src, **kwargs) -> None:
        self.rotated.append(len(self.instructions))
        super().dma(dst, src, **kwargs)

    def dma_on(self, queue, dst, src, transpose: bool = False) -> None:
        self.rotated.append(len(self.instructions))
        super().dma_on(queue, dst, src, transpose)


def _tensor(ap: AccessPattern) -> int:
    """The number k of the tensor a symbolic HBM operand addresses (tensor k lies at (k + 1) x SPAN)."""
    return (ap.offset + SPAN // 2) // SPAN - 1


def _rebased(ap: AccessPattern, bases: list) -> AccessPattern:
    """A symbolic HBM operand at its instance's address: tensor k at bases[k]."""
    k = _tensor(ap)
    return AccessPattern(ap.space, ap.dtype, ap.offset - (k + 1) * SPAN + bases[k], ap.dims, ap.partition)


class _Recording:
    """One signature's instructions, with symbolic HBM offsets and queues counted from 0."""

    def __init__(self, em: _Recorder, queues: int, tensors: int, locs: list):
        kernel, debug = len(em.kernels) - 1, em.kernels[-1].debug
        # rows located elsewhere than the kernel (a matmul chain's first matmul, Emitter.locate): by the number of
        # their location in the signature, in the order the recording met them (the order the debug table grew)
        numbers = {loc.key(): k for k, loc in enumerate(locs)}
        self.located: dict = {}  # the recording's debug index -> the location's number in the signature
        for inst in em.instructions:
            if inst.kernel != kernel:
                raise _NotReusable(inst)
            if inst.debug != debug and inst.debug not in self.located:
                number = numbers.get(em.debug_locs[inst.debug].key())
                if not number:  # a location the signature does not name (or the kernel's, under another index)
                    raise _NotReusable(inst)
                self.located[inst.debug] = number
            for ap in inst.operands:
                if ap.space == Space.HBM and not 0 <= _tensor(ap) < tensors:
                    raise _NotReusable(ap)  # an HBM address not made from one of its tensors
        rotated = set(em.rotated)
        numbered: dict = {}  # each distinct operand of the rows that address HBM -> its number

        def slots(operands: tuple) -> tuple | None:
            if all(ap.space != Space.HBM for ap in operands):
                return None  # the row's operands are every instance's
            return tuple(numbered.setdefault(ap, len(numbered)) for ap in operands)

        self.rows = [(i.opcode, i.engine, i.operands, slots(i.operands), i.queue, k in rotated, i.alu, i.alu1, i.func,
                      i.imm0, i.imm1, i.accumulate, i.reverse, None if i.debug == debug else i.debug)
                     for k, i in enumerate(em.instructions)]
        self.operands = list(numbered)  # a row's slots number its operands in this list, HBM ones rebased by instance
        self.dmas, self.queues = em._dma_turn, queues  # the round robin's turns (Emitter.dma_on takes none)
        self.sbuf_used, self.psum_used = em._sbuf_used, em._psum_used
        self.pools = em.pools

    def at_other_parity(self) -> "_Recording":
        """This recording as the kernel makes it at the other parity: the same rows, each SBUF operand moved from its
        pool's base to that pool's base at the other parity (the one thing the parity changes: Emitter.sbuf_pool).
        Raises _NotReusable for an SBUF operand in no pool."""
        moved: dict = {}

        def move(ap: AccessPattern) -> AccessPattern:
            if ap.space != Space.SBUF:
                return ap
            new = moved.get(ap)
            if new is None:
                base, other = next(((base, other) for base, other, size in self.pools
                                    if base <= ap.offset < base + size), (None, None))
                if base is None:
                    raise _NotReusable(ap)
                new = moved[ap] = AccessPattern(ap.space, ap.dtype, ap.offset - base + other, ap.dims, ap.partition)
            return new

        derived = object.__new__(_Recording)
        derived.__dict__.update(self.__dict__)
        derived.__dict__.pop("_keys", None)  # (its rows' price keys name it, not this recording)
        derived.__dict__.pop("_hbm_operands", None)  # (made from its own operands)
        derived.rows = [(opcode, engine, tuple(map(move, operands)), *rest)
                        for opcode, engine, operands, *rest in self.rows]
        derived.operands = list(map(move, self.operands))
        derived.pools = [(other, base, size) for base, other, size in self.pools]
        return derived

    def _hbm(self) -> list:
        """[(position in self.operands, the operand, its tensor's number)] of the HBM operands, the ones an instance
        rebases: found once per recording, not per instance."""
        found = self.__dict__.get("_hbm_operands")
        if found is None:
            found = self._hbm_operands = [(index, ap, _tensor(ap)) for index, ap in enumerate(self.operands)
                                          if ap.space == Space.HBM]
        return found

    def instantiate(self, em: Emitter, bases: list, price_keys: dict, locs: list, rebased: dict) -> None:
        """Append this recording's instructions to `em`'s current kernel, its tensor k at bases[k]; notes in
        `price_keys` {id(instruction): (id of this recording, its row)} (copies of a row differ only in HBM offsets
        and DMA queue, so the cost estimate prices a row once: stream_timing.replay). `rebased` {(id(symbolic HBM
        operand), its tensor's base): the operand there} keeps each operand made once: instances whose tensor lies
        at one address (a layer's activations in the scratch slot of the layer two before) share the (immutable)
        pattern, which the hazard grid measures once (codegen.sync: by identity) and the NEFF writer writes once."""
        kernel, debug, turn = len(em.kernels) - 1, em.kernels[-1].debug, em._dma_turn
        located = {index: em._debug(locs[number]) for index, number in sorted(self.located.items())}
        rebound = list(self.operands)
        for index, ap, k in self._hbm():
            key = (id(ap), bases[k])
            rebound[index] = rebased.get(key) or rebased.setdefault(key, _rebased(ap, bases))
        operand = rebound.__getitem__
        queues, made = self.queues, []
        append = made.append
        for opcode, engine, operands, slots, queue, rotated, alu, alu1, func, imm0, imm1, accumulate, reverse, at \
                in self.rows:
            append(Instruction(opcode, engine, operands if slots is None else tuple(map(operand, slots)),
                               (queue + turn) % queues if rotated else queue, alu, alu1, func, imm0, imm1,
                               accumulate, reverse, (), kernel, debug if at is None else located[at]))
        em.instructions += made
        keys = self.__dict__.get("_keys")  # (this recording, row) per row, made once
        if keys is None:
            me = id(self)
            keys = self._keys = [(me, row) for row in range(len(self.rows))]
        price_keys.update(zip(map(id, made), keys))
        em._dma_turn += self.dmas
        em._sbuf_used, em._psum_used = self.sbuf_used, self.psum_used


class KernelReuse:
    """Emits kernels through recordings kept by signature (see the module's docstring)."""

    def __init__(self, target):
        self.target = target
        self.recordings: dict = {}  # (kernel function, signature, parity) -> _Recording, or None: not reusable
        self.hits = 0
        self.price_keys: dict = {}  # id(instruction) -> (recording, row): see _Recording.instantiate
        self.plan_texts: dict = {}  # the signatures' plan texts by their pickle: see _Signature._attr
        self.rebased: dict = {}  # the recordings' HBM operands at their instances' bases: see _Recording.instantiate

    def emit(self, em: Emitter, kernel, node: Node, plan: MemoryPlan) -> None:
        """Emit `node`'s kernel into `em`'s current kernel (begun by the caller)."""
        try:
            key, numbered, locs = signature(node, plan, self.plan_texts)
        except (TypeError, ValueError):  # an attribute the IR text cannot print: emitted as usual
            kernel(em, node, plan)
            return
        parity = (len(em.kernels) - 1) % 2
        key = (kernel, key, parity)
        if key not in self.recordings:
            self.recordings[key] = (self._derive(self.recordings.get((kernel, key[1], 1 - parity)))
                                    or self._record(em, kernel, node, plan, numbered, locs))
        else:
            self.hits += 1
        recording = self.recordings[key]
        if recording is None:
            kernel(em, node, plan)
            return
        recording.instantiate(em, [plan.offset(n) if plan.has_buffer(n) else 0 for n in numbered],
                              self.price_keys, locs, self.rebased)

    @staticmethod
    def _derive(recorded: _Recording | None) -> _Recording | None:
        """The other parity's recording made from `recorded` (None: there is none to make it from)."""
        if recorded is None:
            return None
        try:
            return recorded.at_other_parity()
        except _NotReusable:
            return None

    def _record(self, em: Emitter, kernel, node: Node, plan: MemoryPlan, numbered: list,
                locs: list) -> _Recording | None:
        scratch = _Recorder(self.target)
        scratch.kernels = [None] * ((len(em.kernels) - 1) % 2)
        scratch.begin_kernel("recording", (), node.loc)
        try:
            kernel(scratch, node, _SymbolicPlan(numbered, plan))
            return _Recording(scratch, self.target.dma_queues, len(numbered), locs)
        except Exception:  # noqa: BLE001 - anything the signature does not cover, or an error: emitted as usual
            return None


NOT_REUSED = frozenset({ir.Op.CUSTOM_KERNEL, ir.Op.COLLECTIVE, ir.Op.CONSTANT})  # their own addressing/queues
