"""Which on-chip accesses of different engines cannot overlap in time: the memory-port rules of each NeuronCore.

AWS documents (TRAINIUM.md, "Corrections and additions"; aws-neuron-sdk nki/guides/architecture/trainium2_arch.rst):
* NeuronCore-v2 (trn1): the Vector and GpSimd engines cannot access SBUF in parallel, and the Vector and Scalar
  engines cannot access PSUM in parallel;
* NeuronCore-v3 (trn2) and later lift both: Vector and Scalar read PSUM in parallel at full bandwidth if they use
  different PSUM banks (so two accesses of the same bank do not overlap).

Each instruction gets the ports it holds for its whole duration (a stated choice: the docs say "not in parallel",
not how the hardware interleaves, so the model serialises the two instructions whole); two instructions holding a
common port never run at the same time (stream_timing serves them first come, first served). The same engine's
instructions are in order anyway. Not modelled: the bus Vector's bf16 performance mode shares with GpSimd on trn2
(the hardware arbitrates; neuronc does not model performance mode's speed-up either).
"""
from __future__ import annotations

from neuronc.isa import Engine, Instruction, Space
from neuronc.targets import Target

SBUF_VECTOR_GPSIMD = "sbuf: vector/gpsimd"  # trn1's shared SBUF port of Vector and GpSimd
PSUM_VECTOR_SCALAR = "psum: vector/scalar"  # trn1's shared PSUM port of Vector and Scalar


def psum_banks(ap, target: Target) -> range:
    """The PSUM banks an on-chip PSUM operand touches (its bytes per partition, banks of psum_bank_bytes)."""
    lo = hi = ap.offset
    for stride, size in ap.dims[1:]:
        reach = (size - 1) * stride * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    bank = target.psum_bank_bytes
    return range(lo // bank, (hi + ap.dtype.itemsize - 1) // bank + 1)


def ports(instr: Instruction, target: Target) -> tuple:
    """The memory ports ``instr`` holds while it runs on ``target`` (empty: it overlaps anything)."""
    engine, spaces = instr.engine, {ap.space for ap in instr.operands}
    held = []
    if target.vector_gpsimd_exclusive_sbuf and engine in (Engine.VECTOR, Engine.GPSIMD) and Space.SBUF in spaces:
        held.append(SBUF_VECTOR_GPSIMD)
    if engine in (Engine.VECTOR, Engine.SCALAR) and Space.PSUM in spaces:
        if target.vector_scalar_exclusive_psum:
            held.append(PSUM_VECTOR_SCALAR)
        else:  # different banks in parallel, the same bank not
            held.extend(sorted({("psum bank", b) for ap in instr.operands if ap.space == Space.PSUM
                                for b in psum_banks(ap, target)}))
    return tuple(held)
