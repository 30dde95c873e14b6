"""The emitter: the one place kernels go through to allocate on-chip tiles and append instructions.

Kernels describe *what* to compute; the emitter owns the bookkeeping: the SBUF/PSUM allocation of
the current kernel (tile pools with several buffers each, so DMA of the next tile can overlap
compute on this one), the round-robin choice of DMA queue, and the kernel/debug tables of the NEFF.
"""
from __future__ import annotations

from neuronc.errors import NeuronCompileError
from neuronc.isa import AccessPattern, AluOp, DType, Engine, Instruction, Opcode, Space, row_major_dims
from neuronc.neff.program import DebugLoc, KernelInfo
from neuronc.placement import SBUF_PAGE_BYTES
from neuronc.targets import Target


def hbm(dtype: DType, byte_offset: int, dims: tuple) -> AccessPattern:
    return AccessPattern(Space.HBM, dtype, int(byte_offset), tuple((int(s), int(n)) for s, n in dims))


class Tile:
    """A [partitions, free...] region at the start of an on-chip buffer slot."""

    def __init__(self, space: Space, dtype: DType, offset: int):
        self.space, self.dtype, self.offset = space, dtype, offset

    def ap(self, partitions: int, *free: int, dtype: DType | None = None) -> AccessPattern:
        return AccessPattern(self.space, dtype or self.dtype, self.offset, ((1, partitions), *row_major_dims(free)))


class Pool:
    """`bufs` slots of `slot_bytes` per partition, handed out in rotation."""

    def __init__(self, space: Space, dtype: DType, base: int, slot_bytes: int, bufs: int):
        self.space, self.dtype, self.base, self.slot_bytes, self.bufs = space, dtype, base, slot_bytes, bufs
        self.turn = 0

    def next(self) -> Tile:
        tile = Tile(self.space, self.dtype, self.base + (self.turn % self.bufs) * self.slot_bytes)
        self.turn += 1
        return tile

    def part(self, first: int, bufs: int) -> "Pool":
        """Slots [first, first + bufs) of this pool as a pool of their own, over the same memory: for uses the
        caller keeps apart (a kernel's phases), the sync pass ordering any reuse across them."""
        return Pool(self.space, self.dtype, self.base + first * self.slot_bytes, self.slot_bytes, bufs)


class Emitter:
    # Tile slots start on the sync pass's tracking pages: two slots never share a page, so the sync
    # pass sees no false dependency between them.
    SLOT_ALIGNMENT = SBUF_PAGE_BYTES

    def __init__(self, target: Target):
        self.target = target
        self.instructions: list = []
        self.kernels: list = []
        self.debug_locs: list = []
        self._debug_index: dict = {}
        self._dma_turn = 0
        self._located = None  # debug-location index overriding the kernel's (`locate`)
        self._sbuf_used = 0
        self._psum_used = 0

    # kernels ----------------------------------------------------------------------------------
    def begin_kernel(self, name: str, ops: tuple, loc: DebugLoc) -> None:
        self.kernels.append(KernelInfo(name=name, ops=tuple(ops), debug=self._debug(loc)))
        self._located = None
        self._sbuf_used = 0
        self._psum_used = 0

    # on-chip memory ----------------------------------------------------------------------------
    def sbuf_pool(self, dtype: DType, free_elements: int, bufs: int = 2) -> Pool:
        slot = -(-free_elements * dtype.itemsize // self.SLOT_ALIGNMENT) * self.SLOT_ALIGNMENT
        base = self._sbuf_used
        self._sbuf_used += slot * bufs
        if (len(self.kernels) - 1) % 2:  # an odd kernel's pools stack down from the top
            base = self.target.sbuf_bytes_per_partition - self._sbuf_used
        pool = Pool(Space.SBUF, dtype, base, slot, bufs)
        if self._sbuf_used > self.target.sbuf_bytes_per_partition:
            raise NeuronCompileError(
                f"kernel {self.kernels[-1].name} needs {self._sbuf_used} SBUF bytes per partition, "
                f"more than the {self.target.sbuf_bytes_per_partition} of {self.target.name}",
                hint="this is a tiling bug in neuronc; please report it",
            )
        return pool

    def psum_pool(self, bufs: int | None = None) -> Pool:
        bank = self.target.psum_bank_bytes
        bufs = bufs or self.target.psum_banks
        pool = Pool(Space.PSUM, DType.F32, self._psum_used, bank, bufs)
        self._psum_used += bank * bufs
        if self._psum_used > self.target.psum_bytes_per_partition:
            raise NeuronCompileError(f"kernel {self.kernels[-1].name} needs more PSUM than the target has")
        return pool

    def psum_bank_elements(self) -> int:
        return self.target.psum_bank_bytes // DType.F32.itemsize

    # instructions ------------------------------------------------------------------------------
    def _debug(self, loc: DebugLoc) -> int:
        """The index of `loc` in the debug-location table (added if new)."""
        key = loc.key()
        if key not in self._debug_index:
            self._debug_index[key] = len(self.debug_locs)
            self.debug_locs.append(loc)
        return self._debug_index[key]

    def locate(self, loc: DebugLoc | None) -> None:
        """Instructions emitted from now on in this kernel come from `loc` (None: the kernel's own location),
        for a kernel computing several source ops one after the other (a matmul chain)."""
        self._located = None if loc is None else self._debug(loc)

    def emit(self, opcode: Opcode, engine: Engine, *operands: AccessPattern, **fields) -> None:
        kernel = self.kernels[-1]
        debug = kernel.debug if self._located is None else self._located
        self.instructions.append(Instruction(opcode, engine, tuple(operands), kernel=len(self.kernels) - 1,
                                             debug=debug, **fields))

    @property
    def dma_turn(self) -> int:
        """The queue the next `dma` takes, before the modulo: the round robin's turns so far."""
        return self._dma_turn

    def dma_on(self, queue: int, dst: AccessPattern, src: AccessPattern, transpose: bool = False) -> None:
        """A DMA copy (or with `transpose`, a DMA transpose, as `dma` makes it) on queue `queue`, one the kernel chose
        from its own transfers' queues (the round robin does not advance): a kernel reused through codegen.reuse turns
        it with the instance's round robin, as its `dma`s, so it keeps its place among them."""
        self.emit(Opcode.DMA_TRANSPOSE if transpose else Opcode.DMA_COPY, Engine.DMA, dst, src,
                  queue=queue % self.target.dma_queues)

    def dma(self, dst: AccessPattern, src: AccessPattern, *, indices: AccessPattern | None = None,
            add: bool = False, transpose: bool = False) -> None:
        """A DMA on the next queue (round robin). With `indices`, an indirect one: a gather of table rows
        when `src` is the HBM table, else a scatter of `src`'s rows into the table `dst` (adding if `add`).
        With `transpose`, a DMA transpose: dst [A, B] = src [B, A]^T (trn2+, isa.py's rules)."""
        queue = self._dma_turn % self.target.dma_queues
        self._dma_turn += 1
        if transpose:
            self.emit(Opcode.DMA_TRANSPOSE, Engine.DMA, dst, src, queue=queue)
        elif indices is None:
            self.emit(Opcode.DMA_COPY, Engine.DMA, dst, src, queue=queue)
        elif src.space == Space.HBM:
            self.emit(Opcode.DMA_GATHER, Engine.DMA, dst, src, indices, queue=queue)
        else:
            self.emit(Opcode.DMA_SCATTER, Engine.DMA, dst, src, indices, queue=queue,
                      alu=AluOp.ADD if add else AluOp.NONE)
