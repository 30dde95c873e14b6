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
#      U16, U32, U64 and the ALU ops SHIFT_LEFT, SHIFT_RIGHT_LOGICAL, SHIFT_RIGHT_ARITHMETIC
FORMAT_MINOR = 9


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


@dataclasses.dataclass
class KernelInfo:
    """One kernel: a group of consecutive instructions that implement one graph op."""

    name: str  # e.g. "matmul_3"
    ops: tuple = ()  # graph ops implemented by this kernel
    debug: int = -1  # index into Neff.debug_locs
    estimated_ns: float = 0.0


@dataclasses.dataclass
class Neff:
    name: str
    target: str  # "trn1" | "trn2" | "trn3"
    tensors: list  # of TensorEntry
    streams: dict  # (Engine, queue) -> list[Instruction], each in execution order
    hbm_size: int  # bytes of HBM the program needs
    debug_locs: list = dataclasses.field(default_factory=list)  # of DebugLoc
    kernels: list = dataclasses.field(default_factory=list)  # of KernelInfo
    estimated_ns: float = 0.0
    compiler_version: str = ""
    format_major: int = FORMAT_MAJOR
    format_minor: int = FORMAT_MINOR
    content_hash: str = ""  # sha256 of the encoded program; filled in by the reader/writer
    cache_key: str = ""  # the compile-cache key, in the NEFFs of cache entries only (neuronc/cache.py)

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
    "TensorEntry",
    "TensorKind",
]
