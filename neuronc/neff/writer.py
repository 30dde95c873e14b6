"""Encode a `Neff` as NEFF bytes (the flatbuffer of neff.fbs) and save it to a file atomically.

The one place that builds the flatbuffer; reader.py undoes exactly what is done here.
"""
from __future__ import annotations

import hashlib
import math
import struct

import flatbuffers
import numpy as np

from neuronc.atomic_file import write_atomically
from neuronc.errors import NeffFormatError
from neuronc.neff.generated import AccessPattern as fb_operand
from neuronc.neff.generated import DebugLoc as fb_debug_loc
from neuronc.neff.generated import Dim as fb_dim
from neuronc.neff.generated import Header as fb_header
from neuronc.neff.generated import Instruction as fb_instruction
from neuronc.neff.generated import Kernel as fb_kernel
from neuronc.neff.generated import NeffFile as fb_file
from neuronc.neff.generated import Program as fb_program
from neuronc.neff.generated import Stream as fb_stream
from neuronc.neff.generated import Tensor as fb_tensor
from neuronc.neff.generated import Wait as fb_wait
from neuronc.neff.program import Neff
from neuronc.neff.verifier import check_references, header_digest

FILE_IDENTIFIER = b"NEFF"


def encode(neff: Neff) -> bytes:
    """The NEFF file bytes of `neff`. Sets `neff.content_hash` to the hash stored in them."""
    try:
        check_references(neff)
        program = _encode_program(neff)
        neff.content_hash = hashlib.sha256(program).hexdigest()
        return _encode_file(neff, program, neff.content_hash)
    except (TypeError, ValueError, OverflowError, struct.error) as error:
        raise NeffFormatError(
            f"cannot encode NEFF {neff.name!r}: a field has a value of the wrong type or out of range ({error})"
        ) from error


def save(neff: Neff, path) -> None:
    """Write `neff` to `path`. Atomic: readers (and a crash) see the old file or the new one, never part."""
    write_atomically(path, encode(neff))


def _encode_file(neff: Neff, program: bytes, content_hash: str) -> bytes:
    """The outer NeffFile: the header of `neff` and its checksum around the encoded `program`."""
    builder = flatbuffers.Builder(len(program) + 1024)
    program_vector = builder.CreateByteVector(program)
    header_hash = header_digest(
        neff.format_major, neff.format_minor, neff.compiler_version, neff.target, neff.name, content_hash,
        neff.hbm_size, neff.estimated_ns,
    )
    strings = [builder.CreateString(s) for s in (neff.compiler_version, neff.target, neff.name, content_hash,
                                                  header_hash)]
    cache_key = builder.CreateString(neff.cache_key) if neff.cache_key else None
    fb_header.Start(builder)
    fb_header.AddFormatMajor(builder, neff.format_major)
    fb_header.AddFormatMinor(builder, neff.format_minor)
    fb_header.AddCompilerVersion(builder, strings[0])
    fb_header.AddTarget(builder, strings[1])
    fb_header.AddName(builder, strings[2])
    fb_header.AddContentHash(builder, strings[3])
    fb_header.AddHbmSize(builder, neff.hbm_size)
    _add_float(builder, fb_header.AddEstimatedNs, neff.estimated_ns)
    fb_header.AddHeaderHash(builder, strings[4])
    if cache_key is not None:
        fb_header.AddCacheKey(builder, cache_key)
    header = fb_header.End(builder)
    fb_file.Start(builder)
    fb_file.AddHeader(builder, header)
    fb_file.AddProgram(builder, program_vector)
    builder.Finish(fb_file.End(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _encode_program(neff: Neff) -> bytes:
    builder = flatbuffers.Builder(1 << 16)
    tensors = [_tensor(builder, tensor) for tensor in neff.tensors]
    operands = {}  # AccessPattern -> offset of its table: identical operands share one table
    streams = [
        _stream(builder, engine, queue, instructions, operands)
        for (engine, queue), instructions in neff.streams.items()
    ]
    debug_locs = [_debug_loc(builder, loc) for loc in neff.debug_locs]
    kernels = [_kernel(builder, kernel) for kernel in neff.kernels]
    tensors = _offsets(builder, fb_program.StartTensorsVector, tensors)
    streams = _offsets(builder, fb_program.StartStreamsVector, streams)
    debug_locs = _offsets(builder, fb_program.StartDebugLocsVector, debug_locs)
    kernels = _offsets(builder, fb_program.StartKernelsVector, kernels)
    fb_program.Start(builder)
    fb_program.AddTensors(builder, tensors)
    fb_program.AddStreams(builder, streams)
    fb_program.AddDebugLocs(builder, debug_locs)
    fb_program.AddKernels(builder, kernels)
    builder.Finish(fb_program.End(builder))
    return bytes(builder.Output())


def _add_float(builder, add_field, value) -> None:
    """Add a float field exactly: the builder leaves out a value equal to the default 0.0, and -0.0 is."""
    negative_zero = value == 0 and math.copysign(1.0, value) < 0
    builder.ForceDefaults(negative_zero)
    add_field(builder, value)
    builder.ForceDefaults(False)


def _offsets(builder, start_vector, offsets: list) -> int:
    """A vector of the tables (or strings) at `offsets`."""
    start_vector(builder, len(offsets))
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _tensor(builder, tensor) -> int:
    if any(size < 0 for size in tensor.shape):
        raise NeffFormatError(f"cannot encode tensor {tensor.name!r}: its shape {tuple(tensor.shape)} has a negative size")
    name = builder.CreateString(tensor.name)
    shape = builder.CreateNumpyVector(np.asarray(tensor.shape, dtype="<i8").reshape(-1))
    data = None
    if tensor.data is not None:
        array = np.asarray(tensor.data)
        if array.dtype != tensor.dtype.numpy or array.shape != tuple(tensor.shape):
            raise NeffFormatError(
                f"cannot encode tensor {tensor.name!r}: its data is {array.dtype}{list(array.shape)}, "
                f"but the entry says {tensor.dtype.name}{list(tensor.shape)}"
            )
        data = builder.CreateByteVector(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    fb_tensor.Start(builder)
    fb_tensor.AddName(builder, name)
    fb_tensor.AddKind(builder, tensor.kind)
    fb_tensor.AddDtype(builder, tensor.dtype)
    fb_tensor.AddShape(builder, shape)
    fb_tensor.AddOffset(builder, tensor.offset)
    fb_tensor.AddIndex(builder, tensor.index)
    if data is not None:
        fb_tensor.AddData(builder, data)
    return fb_tensor.End(builder)


def _stream(builder, engine, queue, instructions, operands: dict) -> int:
    instructions = _offsets(
        builder, fb_stream.StartInstructionsVector, [_instruction(builder, inst, operands) for inst in instructions]
    )
    fb_stream.Start(builder)
    fb_stream.AddEngine(builder, engine)
    fb_stream.AddQueue(builder, queue)
    fb_stream.AddInstructions(builder, instructions)
    return fb_stream.End(builder)


def _instruction(builder, inst, operands: dict) -> int:
    tables = []
    for operand in inst.operands:
        table = operands.get(operand)
        if table is None:
            table = operands[operand] = _operand(builder, operand)
        tables.append(table)
    operand_vector = _offsets(builder, fb_instruction.StartOperandsVector, tables)
    waits = None
    if inst.waits:
        fb_instruction.StartWaitsVector(builder, len(inst.waits))
        for engine, queue, count in reversed(inst.waits):
            fb_wait.CreateWait(builder, engine, queue, count)
        waits = builder.EndVector()
    fb_instruction.Start(builder)
    fb_instruction.AddOpcode(builder, inst.opcode)
    fb_instruction.AddEngine(builder, inst.engine)
    fb_instruction.AddQueue(builder, inst.queue)
    fb_instruction.AddOperands(builder, operand_vector)
    fb_instruction.AddAlu(builder, inst.alu)
    fb_instruction.AddAlu1(builder, inst.alu1)
    fb_instruction.AddFunc(builder, inst.func)
    _add_float(builder, fb_instruction.AddImm0, inst.imm0)
    _add_float(builder, fb_instruction.AddImm1, inst.imm1)
    fb_instruction.AddAccumulate(builder, inst.accumulate)
    fb_instruction.AddReverse(builder, inst.reverse)
    if waits is not None:
        fb_instruction.AddWaits(builder, waits)
    fb_instruction.AddKernel(builder, inst.kernel)
    fb_instruction.AddDebug(builder, inst.debug)
    return fb_instruction.End(builder)


def _operand(builder, operand) -> int:
    fb_operand.StartDimsVector(builder, len(operand.dims))
    for stride, size in reversed(operand.dims):
        fb_dim.CreateDim(builder, stride, size)
    dims = builder.EndVector()
    fb_operand.Start(builder)
    fb_operand.AddSpace(builder, operand.space)
    fb_operand.AddDtype(builder, operand.dtype)
    fb_operand.AddPartition(builder, operand.partition)
    fb_operand.AddOffset(builder, operand.offset)
    fb_operand.AddDims(builder, dims)
    return fb_operand.End(builder)


def _debug_loc(builder, loc) -> int:
    strings = [builder.CreateString(s) for s in (loc.file, loc.module_path, loc.op)]
    fb_debug_loc.Start(builder)
    fb_debug_loc.AddFile(builder, strings[0])
    fb_debug_loc.AddLine(builder, loc.line)
    fb_debug_loc.AddModulePath(builder, strings[1])
    fb_debug_loc.AddOp(builder, strings[2])
    return fb_debug_loc.End(builder)


def _kernel(builder, kernel) -> int:
    name = builder.CreateString(kernel.name)
    ops = _offsets(builder, fb_kernel.StartOpsVector, [builder.CreateString(op) for op in kernel.ops])
    fb_kernel.Start(builder)
    fb_kernel.AddName(builder, name)
    fb_kernel.AddOps(builder, ops)
    fb_kernel.AddDebug(builder, kernel.debug)
    _add_float(builder, fb_kernel.AddEstimatedNs, kernel.estimated_ns)
    return fb_kernel.End(builder)
