"""What a program must be for the runtime to run it correctly, beyond what its encoding can say.

The reader (reader.py, verifier.py) guarantees a well-formed `Neff`; these rules say whether it makes
sense. A file changed and re-hashed (a buggy writer, or a hostile file) passes every checksum, so the
runtime checks these at load and refuses a program that breaks one with a NeuronRuntimeError, before it
allocates or computes anything:

* the tensor table: inputs and outputs each numbered 0..n-1 once, with names of their own; entries of at
  most MAX_TENSOR_DIMS dims, inside the program's HBM; and an input, output, weight or constant holds bytes
  of its own (only scratch entries share bytes: the memory planner reuses scratch space by liveness);
* every HBM operand lies inside one tensor entry (``covering_entry``): the program touches no HBM byte
  that the table does not describe. This is what lets the runtime give host memory only to tensor
  entries, and it is what the compiler's programs do (each HBM access pattern is a view of one tensor);
* an instruction writes HBM only in an output or scratch entry: inputs, weights and constants are
  read-only, so one run cannot change the next.

A program without outputs is not refused: its run returns nothing, as its table says (the runtime times
such programs). An output entry removed from a program that stores into it is refused by the second rule,
and the runtime's access check refuses a program that leaves any byte of an output unwritten.

Pure functions of the in-memory program (no runtime state), importable by the runtime and by tools.
"""
from __future__ import annotations

import bisect
import itertools

from neuronc.errors import NeuronRuntimeError
from neuronc.isa import AccessPattern
from neuronc.neff.program import MAX_TENSOR_DIMS, TensorKind

# Entries whose bytes may be written by instructions; the others are filled by the host.
WRITABLE = frozenset({TensorKind.OUTPUT, TensorKind.SCRATCH})
_SHARED = frozenset({TensorKind.SCRATCH})  # the kinds whose entries may share bytes (with each other only)


def hbm_span(ap: AccessPattern) -> tuple:
    """Bytes [lo, hi) of HBM that hold every element an HBM operand addresses (a box: strides may skip)."""
    lo = hi = 0
    for stride, size in ap.dims:
        reach = (size - 1) * stride * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    return ap.offset + lo, ap.offset + hi + ap.dtype.itemsize


class TensorIndex:
    """The tensor entries of a program, ordered so that the entry holding a span of bytes is found in
    O(log n): built once per program, asked once per HBM operand."""

    def __init__(self, tensors):
        entries = sorted((t for t in tensors if t.nbytes > 0), key=lambda t: t.offset)
        self._starts = [t.offset for t in entries]
        # The entry reaching furthest among the first k (by start): the one to ask about a span starting
        # at or after all of them.
        self._furthest = list(itertools.accumulate(entries, lambda a, b: b if _end(b) > _end(a) else a))

    def covering(self, lo: int, hi: int):
        """An entry whose bytes hold all of [lo, hi), or None."""
        k = bisect.bisect_right(self._starts, lo)  # entries starting at or before lo
        if k and _end(self._furthest[k - 1]) >= hi:
            return self._furthest[k - 1]
        return None


def _end(t) -> int:
    return t.offset + t.nbytes


def covering_entry(tensors, ap: AccessPattern):
    """The tensor entry among ``tensors`` whose bytes hold every byte HBM operand ``ap`` addresses, or None.

    For many operands of one program, build a :class:`TensorIndex` once and ask it instead."""
    return TensorIndex(tensors).covering(*hbm_span(ap))


def check_hbm_operand(index: TensorIndex, ap: AccessPattern, written: bool, hbm_size: int,
                      what: str = "HBM operand") -> None:
    """Raise NeuronRuntimeError unless HBM operand ``ap`` lies inside one tensor entry of ``index`` (and,
    when ``written``, inside an output or scratch entry). ``what`` names the operand in the message."""
    lo, hi = hbm_span(ap)
    entry = index.covering(lo, hi)
    if entry is None:
        raise NeuronRuntimeError(
            f"{what} addresses HBM bytes [{lo}, {hi}), which no tensor of the program holds "
            f"(of its {hbm_size} bytes of HBM, a program may touch only the tensors its table lists)",
            hint="the NEFF's tensor table and its instructions disagree: the file was damaged or changed; "
            "compile the model again")
    if written and entry.kind not in WRITABLE:
        raise NeuronRuntimeError(
            f"{what} writes HBM bytes [{lo}, {hi}) of {entry.kind.name.lower()} {entry.name!r}, which is read-only "
            f"(only outputs and scratch tensors are written by a program)",
            hint="the NEFF's instructions are damaged or were changed; compile the model again")


def check_tensor_table(neff) -> None:
    """Raise NeuronRuntimeError unless the tensor table of ``neff`` describes a program that can run: see
    the module's docstring."""
    if neff.hbm_size < 0:
        raise NeuronRuntimeError(f"program {neff.name!r} declares {neff.hbm_size} bytes of HBM")
    for t in neff.tensors:
        if len(t.shape) > MAX_TENSOR_DIMS or any(size < 0 for size in t.shape):
            raise NeuronRuntimeError(f"tensor {t.name!r} has the shape {tuple(t.shape)}: a tensor has at most "
                                     f"{MAX_TENSOR_DIMS} dimensions, none negative")
        if t.offset < 0 or t.offset + t.nbytes > neff.hbm_size:
            raise NeuronRuntimeError(
                f"tensor {t.name!r} occupies HBM bytes [{t.offset}, {t.offset + t.nbytes}) "
                f"outside the program's {neff.hbm_size} bytes"
            )
    for kind in (TensorKind.INPUT, TensorKind.OUTPUT):
        _check_numbering(neff, kind)
    _check_own_bytes(neff.tensors)


def _check_numbering(neff, kind: TensorKind) -> None:
    """The entries of ``kind`` (inputs or outputs) are numbered 0..n-1, once each, and named once each."""
    entries = [t for t in neff.tensors if t.kind == kind]
    what = kind.name.lower()
    indices = sorted(t.index for t in entries)
    if indices != list(range(len(entries))):
        raise NeuronRuntimeError(
            f"the {len(entries)} {what}s of program {neff.name!r} are numbered {indices}, not 0..{len(entries) - 1} "
            f"once each", hint="the NEFF's tensor table is damaged or was changed; compile the model again")
    names = [t.name for t in entries]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise NeuronRuntimeError(f"program {neff.name!r} has two {what}s named {twice[0]!r}",
                                 hint="the NEFF's tensor table is damaged or was changed; compile the model again")


def _check_own_bytes(tensors) -> None:
    """Inputs, outputs, weights and constants overlap no other entry (scratch entries may overlap each other).

    In order of offset, an entry overlaps an earlier one exactly when an earlier one reaches past its start:
    so it is enough to know the earliest entries reaching furthest, among all and among the non-scratch ones."""
    furthest_any = furthest_own = None
    for t in sorted((t for t in tensors if t.nbytes > 0), key=lambda t: t.offset):
        own = t.kind not in _SHARED
        other = furthest_any if own else furthest_own
        if other is not None and _end(other) > t.offset:
            raise NeuronRuntimeError(
                f"{other.kind.name.lower()} {other.name!r} (HBM bytes [{other.offset}, {_end(other)})) and "
                f"{t.kind.name.lower()} {t.name!r} (bytes [{t.offset}, {_end(t)})) share bytes; only scratch "
                f"tensors may", hint="the NEFF's tensor table is damaged or was changed; compile the model again")
        if furthest_any is None or _end(t) > _end(furthest_any):
            furthest_any = t
        if own and (furthest_own is None or _end(t) > _end(furthest_own)):
            furthest_own = t
