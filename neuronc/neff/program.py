"""The in-memory form of a NEFF: what the compiler produces and the runtime loads.

The flatbuffer codec (`writer.py`, `reader.py`) converts exactly this structure to and from bytes;
nothing else in the code base touches the encoded form.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np

from neuronc.isa import DType, Engine, Instruction

FORMAT_MAJOR = 1
# 1.1: Opcode.DMA_GATHER; 1.2: DMA_SCATTER, MAX8, FIND_INDEX8, MATCH_REPLACE8;
# 1.3: ACTIVATE_BIAS_REDUCE (an activation with a per-partition bias tile and a row-sum destination);
# 1.4: RNG (the GpSimd engine's counter-based random numbers); TENSOR_SCALAR_REDUCE (a multiplication by
#      a scalar with a row-reduction destination); 1.5: TENSOR_ALU2 (two ALU ops in one pass) and the
#      instruction field alu1; 1.6: the header field cache_key; 1.7: the collective engine (Engine.COLLECTIVE)
#      and its ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER and ALL_TO_ALL; 1.8: DMA_TRANSPOSE (trn2+); 1.9: the dtypes
#      U16, U32, U64 and the ALU ops SHIFT_LEFT, SHIFT_RIGHT_LOGICAL, SHIFT_RIGHT_ARITHMETIC; 1.10: TENSOR_TENSOR_SCAN
#      (NKI's tensor_tensor_scan); 1.11: BN_STATS and BN_AGGR (NKI's bn_stats / bn_aggr); 1.12: ACTIVATE_SCALED (an
#      activation with a per-partition scale tile and bias tile)
FORMAT_MINOR = 12


# The most dimensions a tensor entry may have: numpy's limit (an entry's values are a numpy array), which is
# also PyTorch's.
MAX_TENSOR_DIMS = 64


class TensorKind(enum.IntEnum):
    INPUT = 0
    OUTPUT = 1
    WEIGHT = 2  # parameters and buffers: data stored in the NEFF
    CONSTANT = 3  # literals of the graph: data stored in the NEFF
    SCRATCH = 4  # intermediates: HBM space only


@dataclasses.dataclass
class TensorEntry:
    name: str
    kind: TensorKind
    dtype: DType
    shape: tuple
    offset: int  # byte offset in the core's HBM
    index: int = -1  # position among the inputs, or among the outputs; -1 otherwise
    data: np.ndarray | None = None  # WEIGHT and CONSTANT only: the values, of `dtype` and `shape`

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass
class DebugLoc:
    """Where a piece of the program came from in the user's PyTorch code."""

    file: str = ""
    line: int = 0
    module_path: str = ""  # e.g. "blocks.0.attn"
    op: str = ""  # the ATen / StableHLO op, e.g. "aten.addmm"

    def key(self) -> tuple:
        """The location as a hashable value (the dataclass is mutable), for tables of distinct locations."""
        return self.file, self.line, self.module_path, self.op

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "<unknown location>"
        mod = f" in {self.module_path}" if self.module_path else ""
        return f"{where}{mod} ({self.op})" if self.op else f"{where}{mod}"


class PendingEstimate:
    """A program's estimate, (makespan ns, {kernel index: ns summed over its instructions}), computed when first
    read and then kept. Codegen at -O0 to -O2 decides nothing from it (only -O3's placement reads its timeline),
    so a compile whose estimate nobody asks for does not pay for the simulation: a program the runtime loads
    settles it from its load's schedule (the same simulation, neuronc.stream_timing), a compile made only to
    learn whether a graph compiles never computes it. `target`: the target the estimate prices for (a load on
    a core of another target cannot settle it)."""

    def __init__(self, compute, target):
        self._compute, self._result, self.target = compute, None, target

    @property
    def pending(self) -> bool:
        return self._result is None

    def result(self) -> tuple:
        if self._result is None:
            self.settle(self._compute())
        return self._result

    def settle(self, result: tuple) -> None:
        """Keep `result`, (makespan ns, {kernel index: ns}), computed elsewhere from the same simulation."""
        if self._result is None:
            self._result, self._compute = result, None


class _Share:
    """A field's part of a PendingEstimate: the makespan (`kernel` None) or one kernel's ns (0.0 if it has no
    instruction). Pickled or copied, it is its value (a compute function is no value to carry)."""

    def __init__(self, estimate: PendingEstimate, kernel: int | None):
        self.estimate, self.kernel = estimate, kernel

    def value(self) -> float:
        makespan, kernel_ns = self.estimate.result()
        return makespan if self.kernel is None else kernel_ns.get(self.kernel, 0.0)

    def __reduce__(self):
        return float, (self.value(),)


class _Estimated:
    """A dataclass field of nanoseconds that may hold a `_Share` of a pending estimate, read as its value (kept)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:  # the dataclass's default
            return 0.0
        value = obj.__dict__[self.name]
        if isinstance(value, _Share):
            value = obj.__dict__[self.name] = value.value()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value


@dataclasses.dataclass
class KernelInfo:
    """One kernel: a group of consecutive instructions that implement one graph op."""

    name: str  # e.g. "matmul_3"
    ops: tuple = ()  # graph ops implemented by this kernel
    debug: int = -1  # index into Neff.debug_locs
    estimated_ns: float = _Estimated()


@dataclasses.dataclass
class Neff:
    name: str
    target: str  # "trn1" | "trn2" | "trn3"
    tensors: list  # of TensorEntry
    streams: dict  # (Engine, queue) -> list[Instruction], each in execution order
    hbm_size: int  # bytes of HBM the program needs
    debug_locs: list = dataclasses.field(default_factory=list)  # of DebugLoc
    kernels: list = dataclasses.field(default_factory=list)  # of KernelInfo
    estimated_ns: float = _Estimated()  # the makespan; may be computed when first read (estimate_later)
    compiler_version: str = ""
    format_major: int = FORMAT_MAJOR
    format_minor: int = FORMAT_MINOR
    content_hash: str = ""  # sha256 of the encoded program; filled in by the reader/writer
    cache_key: str = ""  # the compile-cache key, in the NEFFs of cache entries only (neuronc/cache.py)

    def estimate_later(self, estimate: PendingEstimate) -> None:
        """Its estimated_ns and its kernels' are `estimate`'s, computed when one of them is first read."""
        self.estimated_ns = _Share(estimate, None)
        for index, kernel in enumerate(self.kernels):
            kernel.estimated_ns = _Share(estimate, index)

    def pending_estimate(self) -> PendingEstimate | None:
        """The estimate not computed yet that its estimated_ns will read, if any."""
        value = self.__dict__["estimated_ns"]
        return value.estimate if isinstance(value, _Share) and value.estimate.pending else None

    def inputs(self) -> list:
        return sorted((t for t in self.tensors if t.kind == TensorKind.INPUT), key=lambda t: t.index)

    def outputs(self) -> list:
        return sorted((t for t in self.tensors if t.kind == TensorKind.OUTPUT), key=lambda t: t.index)

    def instruction_count(self) -> dict:
        counts: dict = {}
        for (engine, _queue), stream in self.streams.items():
            counts[engine] = counts.get(engine, 0) + len(stream)
        return counts


__all__ = [
    "DType",
    "DebugLoc",
    "Engine",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "Instruction",
    "KernelInfo",
    "MAX_TENSOR_DIMS",
    "Neff",
    "PendingEstimate",
    "TensorEntry",
    "TensorKind",
]
