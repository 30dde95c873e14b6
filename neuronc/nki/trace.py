"""Tracing a kernel: the instructions a kernel's API calls make, in program order, with where each came from.

While a ``@nki.jit`` function runs (its Python loops unrolled, its values the shapes of its arguments), every
``nl.*`` / ``nisa.*`` call appends instructions of :mod:`neuronc.isa` here. Operands name their storage and
an access pattern relative to it; on-chip addresses are chosen once the whole kernel is known
(``alloc.py``), HBM ones when the kernel is placed in a program (``kernel.py``). Each instruction is checked
when it is made against the same rules the emulated NeuronCore loads programs with
(:func:`runtime.semantics.check`), so a broken rule is reported at the kernel's own source line.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading

from neuronc.errors import KernelError, KernelUnsupportedError, NeuronRuntimeError
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.isa import AluOp, DType, Engine, Instruction, Opcode, Space
from neuronc.neff.program import DebugLoc
from neuronc.nki.tensor import NkiTensor, Storage, new_hbm, new_onchip
from neuronc.targets import Target
from runtime.semantics import check

_HERE = os.path.dirname(os.path.abspath(__file__))
_local = threading.local()


@dataclasses.dataclass
class Emitted:
    """One traced instruction: operands as (storage, access pattern relative to it)."""

    opcode: Opcode
    engine: Engine
    operands: tuple  # of (Storage, AccessPattern)
    fields: dict
    debug: int  # index into Trace.debug_locs
    queue: int = 0


def current() -> "Trace":
    trace = getattr(_local, "trace", None)
    if trace is None:
        raise KernelError("an nki.language / nki.isa API was called outside a kernel",
                          hint="call it inside a function decorated with @nki.jit, and call that function")
    return trace


def user_location(api: str) -> DebugLoc:
    """The kernel source line that called ``api``: the innermost frame outside this package."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _HERE:
        frame = frame.f_back
    if frame is None:
        return DebugLoc(op=api)
    trace = getattr(_local, "trace", None)
    return DebugLoc(frame.f_code.co_filename, frame.f_lineno, trace.name if trace else "", api)


def fail(message: str, hint: str = "", api: str = "", unsupported: bool = False):
    loc = user_location(api)
    cls = KernelUnsupportedError if unsupported else KernelError
    raise cls(f"{api}: {message}" if api else message, hint=hint, location=str(loc))


class Trace:
    """The instructions and storages of one kernel being traced (one SPMD program after another)."""

    def __init__(self, target: Target, name: str):
        self.target, self.name = target, name
        self.instrs: list = []
        self.storages: list = []  # on-chip
        self.hbm: list = []  # HBM storages: inputs, outputs, scratch
        self.debug_locs: list = []
        self._debug_index: dict = {}
        self._dma_turn = 0
        self.busy = {e: 0.0 for e in Engine}  # estimated ns queued on each engine so far (engine choice)
        self.program_id = ()
        self.grid_shape = ()
        self.outputs_by_position: list = []  # shared_hbm tensors of the first SPMD program, in creation order
        self._shared_seen = 0
        self._identity: dict = {}  # dtype -> identity tile (nc_transpose)
        self.api = ""
        self.pending = None  # the latest nl.* result not yet computed (ops.Result)

    # -- context --------------------------------------------------------------------------------------
    def __enter__(self):
        if getattr(_local, "trace", None) is not None:
            raise KernelError("a kernel was called while another one is being traced",
                              hint="call helper functions directly (they trace into the caller)")
        _local.trace = self
        return self

    def __exit__(self, *exc):
        _local.trace = None

    # -- storage ----------------------------------------------------------------------------------------
    def onchip(self, space: Space, shape, dtype: DType, name: str = "") -> NkiTensor:
        loc = user_location(self.api)
        name = name or f"{space.name.lower()}_{len(self.storages)}"
        t = new_onchip(space, shape, dtype, name, loc)
        limit = self.target.partitions
        if t.storage.partitions > limit:
            fail(f"a tile of {t.storage.partitions} partitions (shape {list(t.shape)}); the NeuronCore has {limit}",
                 hint="tile the partition dim by nl.tile_size.pmax (128)", api=self.api or "nl.ndarray")
        self.storages.append(t.storage)
        return t

    def hbm_tensor(self, shape, dtype: DType, kind: str, name: str = "") -> NkiTensor:
        if kind == "output" and self.program_id and any(self.program_id):
            # SPMD programs after the first share the first one's outputs (shared_hbm), in creation order
            if self._shared_seen < len(self.outputs_by_position):
                t = self.outputs_by_position[self._shared_seen]
                self._shared_seen += 1
                if t.shape != tuple(shape):
                    fail(f"SPMD program {self.program_id} creates shared_hbm tensor #{self._shared_seen} of shape "
                         f"{list(shape)}, the first program {list(t.shape)}", api="nl.ndarray")
                return NkiTensor(t.storage, t.isa_dtype, 0, t.dims)
        loc = user_location(self.api)
        t = new_hbm(shape, dtype, name or f"{kind}{len(self.hbm)}", kind, loc)
        self.hbm.append(t.storage)
        if kind == "output":
            self.outputs_by_position.append(t)
            self._shared_seen += 1
        return t

    def start_program(self, program_id: tuple) -> None:
        self.program_id = program_id
        self._shared_seen = 0

    # -- instructions -------------------------------------------------------------------------------------
    def _debug(self, loc: DebugLoc) -> int:
        key = (loc.file, loc.line, loc.op)
        if key not in self._debug_index:
            self._debug_index[key] = len(self.debug_locs)
            self.debug_locs.append(loc)
        return self._debug_index[key]

    def next_queue(self) -> int:
        q = self._dma_turn % self.target.dma_queues
        self._dma_turn += 1
        return q

    def flush(self) -> None:
        """Compute the pending nl.* result into its own tile (something else is about to happen)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            from neuronc.nki.ops import materialise

            materialise(pending)

    def emit(self, opcode: Opcode, engine: Engine, operands: list, api: str, **fields) -> Emitted:
        """Append one instruction; ``operands`` are views (or (storage, ap) pairs), destination first."""
        self.flush()
        refs = []
        for x in operands:
            if isinstance(x, NkiTensor):
                refs.append((x.storage, x.access()))
            else:
                refs.append(x)
        loc = user_location(api)
        queue = fields.pop("queue", None)
        if engine == Engine.DMA and queue is None:
            queue = self.next_queue()
        instr = Instruction(opcode, engine, tuple(ap for _, ap in refs), queue=queue or 0, **fields)
        try:
            check(instr, self.target)
        except NeuronRuntimeError as e:
            raise KernelError(f"{api}: {e.message}", hint=e.hint, location=str(loc)) from None
        self._pending_zeros(opcode, refs, fields, api)
        for storage, _ in refs:
            if storage.space != Space.HBM:
                position = len(self.instrs)
                if storage.first is None:
                    storage.first = position
                storage.last = position
        self._track_psum(opcode, refs, fields)
        emitted = Emitted(opcode, engine, tuple(refs), fields, self._debug(loc), queue or 0)
        self.instrs.append(emitted)
        if engine != Engine.DMA:
            self.busy[engine] += instruction_cost_ns(instr, self.target)
        return emitted

    def _pending_zeros(self, opcode: Opcode, refs: list, fields: dict, api: str) -> None:
        """nl.zeros in PSUM is lazy: dropped when the first instruction touching it is a matmul overwriting all
        of it, else made (a memset) right before that instruction."""
        for i, (storage, ap) in enumerate(refs):
            if not storage.zero_pending:
                continue
            storage.zero_pending = False
            covers = (opcode == Opcode.MATMUL and i == 0 and not fields.get("accumulate")
                      and ap.offset == 0 and ap.partition == 0 and ap.partitions == storage.partitions
                      and ap.num_elements * ap.dtype.itemsize == storage.partitions * storage.nbytes)
            if not covers:
                self.memset_storage(storage, 0.0, api)

    def memset_storage(self, storage: Storage, value: float, api: str) -> None:
        dtype = storage.dtype
        whole = NkiTensor(storage, dtype, 0, ((1, storage.partitions), (1, storage.nbytes // dtype.itemsize)), 0, 0)
        self.emit(Opcode.MEMSET, Engine.VECTOR, [whole], api, imm0=float(value))

    def _track_psum(self, opcode: Opcode, refs: list, fields: dict) -> None:
        """Which bytes of each PSUM tile matmuls wrote (for accumulate=None: a matmul onto them accumulates)."""
        storage, ap = refs[0]
        if storage.space != Space.PSUM:
            return
        box = _box(ap)
        if opcode == Opcode.MATMUL:
            if not any(_overlap(box, b) for b in storage.matmul_written):
                storage.matmul_written.append(box)
        else:
            storage.matmul_written = [b for b in storage.matmul_written if not _overlap(box, b)]

    def matmul_accumulates(self, dst: NkiTensor) -> bool:
        box = _box(dst.access())
        return any(_overlap(box, b) for b in dst.storage.matmul_written)

    # -- engine choice --------------------------------------------------------------------------------------
    def pick_engine(self, candidates, operands) -> Engine:
        """The least busy of ``candidates`` (so far in the trace) that can reach every operand (GpSimd cannot
        reach PSUM)."""
        psum = any(isinstance(x, NkiTensor) and x.space == Space.PSUM for x in operands)
        usable = [e for e in candidates if not (psum and e == Engine.GPSIMD)]
        return min(usable, key=lambda e: (self.busy[e], list(candidates).index(e)))

    def identity(self, dtype: DType, n: int) -> NkiTensor:
        """An n x n identity tile (made once per dtype, on GpSimd: an iota of column - partition, compared with 0),
        the moving operand of Tensor-engine transposes."""
        key = dtype
        if key not in self._identity:
            p = self.target.partitions
            diff = self.onchip(Space.SBUF, (p, p), DType.I32, "identity_iota")
            self.emit(Opcode.IOTA, Engine.GPSIMD, [diff], "nisa.nc_transpose", imm0=0.0, imm1=-1.0)
            ident = self.onchip(Space.SBUF, (p, p), dtype, f"identity_{dtype.name.lower()}")
            self.emit(Opcode.TENSOR_SCALAR, Engine.GPSIMD, [ident, diff], "nisa.nc_transpose", alu=AluOp.EQ, imm0=0.0)
            self._identity[key] = ident
        return self._identity[key][0:n, 0:n]


def _box(ap) -> tuple:
    lo = hi = ap.offset
    for stride, size in ap.dims[1:]:
        reach = stride * (size - 1) * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    return lo, hi + ap.dtype.itemsize, ap.partition, ap.partition + ap.partitions


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]
