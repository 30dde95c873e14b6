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
from neuronc.neff import layout
from neuronc.neff.generated import AccessPattern as fb_operand
from neuronc.neff.generated import DebugLoc as fb_debug_loc
from neuronc.neff.generated import Dim as fb_dim
from neuronc.neff.generated import Header as fb_header
from neuronc.neff.generated import Instruction as fb_instruction
from neuronc.neff.generated import Kernel as fb_kernel
from neuronc.neff.generated import Loop as fb_loop
from neuronc.neff.generated import NeffFile as fb_file
from neuronc.neff.generated import Program as fb_program
from neuronc.neff.generated import Register as fb_register
from neuronc.neff.generated import Stream as fb_stream
from neuronc.neff.generated import Tensor as fb_tensor
from neuronc.neff.generated import Term as fb_term
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


# The tables of neff.fbs as `_encode_program_with_builder` adds their fields: (vtable slot, struct code), in that order.
_TENSOR = layout.Table(7, ((0, "U"), (1, "B"), (2, "B"), (3, "U"), (4, "q"), (5, "i"), (6, "U")))
_STREAM = layout.Table(3, ((0, "B"), (1, "i"), (2, "U")))
_INSTRUCTION = layout.Table(14, (
    (0, "B"), (1, "B"), (2, "i"), (3, "U"), (4, "B"), (13, "B"), (5, "B"), (6, "d"), (7, "d"), (8, "?"), (9, "?"),
    (10, "U"), (11, "i"), (12, "i"),
))
_OPERAND = layout.Table(5, ((0, "B"), (1, "B"), (2, "i"), (3, "q"), (4, "U")))
_DEBUG_LOC = layout.Table(4, ((0, "U"), (1, "i"), (2, "U"), (3, "U")))
_KERNEL = layout.Table(4, ((0, "U"), (1, "U"), (2, "i"), (3, "d")))
_PROGRAM = layout.Table(4, ((0, "U"), (1, "U"), (2, "U"), (3, "U")))


def _encode_program(neff: Neff) -> bytes:
    """The program bytes `_encode_program_with_builder` makes, written by layout.Writer (about 20x faster).

    A value the fast path does not take as the Builder would (a wrong type, a number out of range) goes to the
    Builder, which encodes it or raises its own error. So does a program with registers (format 1.13: the fast
    path writes no registers, loops, terms or row terms; terms and row terms need registers)."""
    if neff.registers or neff.loops:
        return _encode_program_with_builder(neff)
    try:
        return _encode_program_fast(neff)
    except (TypeError, ValueError, OverflowError, struct.error):
        return _encode_program_with_builder(neff)


def _encode_program_fast(neff: Neff) -> bytes:
    writer = layout.Writer()
    tensors = [_fast_tensor(writer, tensor) for tensor in neff.tensors]
    operands = {}  # AccessPattern -> offset of its table: identical operands share one table
    by_id = {}  # id of an AccessPattern -> offset of its table
    streams = []
    for (engine, queue), instructions in neff.streams.items():
        vector = writer.offsets(_fast_instructions(writer, instructions, operands, by_id))
        streams.append(writer.table(_STREAM, [engine, queue, vector], (engine != 0, queue != 0, True)))
    debug_locs = []
    for loc in neff.debug_locs:
        file, module_path, op = (writer.string(s) for s in (loc.file, loc.module_path, loc.op))
        debug_locs.append(writer.table(_DEBUG_LOC, [file, loc.line, module_path, op], (True, loc.line != 0, True, True)))
    kernels = []
    for kernel in neff.kernels:
        name = writer.string(kernel.name)
        ops = writer.offsets([writer.string(op) for op in kernel.ops])
        estimated_ns = kernel.estimated_ns
        kernels.append(writer.table(
            _KERNEL, [name, ops, kernel.debug, estimated_ns], (True, True, kernel.debug != -1, _float_present(estimated_ns))
        ))
    vectors = [writer.offsets(offsets) for offsets in (tensors, streams, debug_locs, kernels)]
    return writer.finish(writer.table(_PROGRAM, vectors, (True, True, True, True)))


def _float_present(value) -> bool:
    """Whether the Builder writes a float field: not equal to its default 0.0, or -0.0 (see `_add_float`)."""
    return value != 0.0 or math.copysign(1.0, value) < 0


def _fast_tensor(writer, tensor) -> int:
    _check_shape(tensor)
    name = writer.string(tensor.name)
    shape = np.asarray(tensor.shape, dtype="<i8").reshape(-1)
    shape = writer.vector(shape.tobytes(), shape.size, 8, 8)
    data = None
    if tensor.data is not None:
        data = writer.byte_vector(_data_bytes(tensor))
    return writer.table(
        _TENSOR, [name, tensor.kind, tensor.dtype, shape, tensor.offset, tensor.index, data],
        (True, tensor.kind != 0, tensor.dtype != 0, True, tensor.offset != 0, tensor.index != -1, data is not None),
    )


def _fast_instructions(writer, instructions, operands: dict, by_id: dict) -> list:
    """The offsets of the tables of `instructions`, written as `_instruction` on a Builder writes them, one after
    the other; the writer's methods inlined, as this is where the time goes."""
    chunks, vtables, plans = writer.chunks, writer.vtables, _INSTRUCTION_PLANS
    append, pads, offset = chunks.append, _PADDING, writer.offset
    vtable_of = {}  # plan -> offset of its vtable in this writer
    prepared_8 = False  # whether a Prep(8) was made for a vector of waits
    written = []
    for inst in instructions:
        tables = []
        for operand in inst.operands:
            table = by_id.get(id(operand))  # operands are often the same object: no need to hash their value
            if table is None:
                table = operands.get(operand)
                if table is None:
                    writer.offset = offset
                    table = operands[operand] = _fast_operand(writer, operand)
                    offset = writer.offset
                by_id[id(operand)] = table
            tables.append(table)
        # writer.offsets(tables)
        count = len(tables)
        if offset & 3:
            append(pads[-offset & 3])
            offset += -offset & 3
        end = offset + 4 * count
        if count == 2:
            append(_OFFSETS[2].pack(2, end - tables[0], end - 4 - tables[1]))
        elif count == 1:
            append(_OFFSETS[1].pack(1, end - tables[0]))
        else:
            append(struct.pack(f"<{count + 1}I", count, *[end - 4 * i - table for i, table in enumerate(tables)]))
        offset = operand_vector = end + 4
        waits = inst.waits
        if waits:  # writer.vector(..., 16, 8)
            prepared_8 = True
            if offset & 7:
                append(pads[-offset & 7])
                offset += -offset & 7
            if len(waits) == 1:
                append(_WAIT.pack(*waits[0]))
            elif len(waits) == 2:
                append(_WAITS2.pack(*waits[0], *waits[1]))
            else:
                append(b"".join([_WAIT.pack(*wait) for wait in waits]))
            append(_COUNT.pack(len(waits)))
            offset = waits_vector = offset + 16 * len(waits) + 4
        else:
            waits_vector = None
        # writer.table(_INSTRUCTION, ...)
        opcode, engine, queue, alu, alu1, func = inst.opcode, inst.engine, inst.queue, inst.alu, inst.alu1, inst.func
        imm0, imm1, accumulate, reverse, kernel, debug = (
            inst.imm0, inst.imm1, inst.accumulate, inst.reverse, inst.kernel, inst.debug
        )
        if type(accumulate) is not bool or type(reverse) is not bool:
            raise TypeError("accumulate and reverse are bools")  # the Builder takes 0 and 1 too: let it
        key = (opcode != 0, engine != 0, queue != 0, alu != 0, alu1 != 0, func != 0,
               imm0 != 0.0 or math.copysign(1.0, imm0) < 0, imm1 != 0.0 or math.copysign(1.0, imm1) < 0, accumulate,
               reverse, waits_vector is not None, kernel != -1, debug != -1, offset & 7)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _INSTRUCTION.plan((*key[:3], True, *key[3:13]), offset)
        values = (opcode, engine, queue, offset + plan.after[3] - operand_vector, alu, alu1, func, imm0, imm1,
                  accumulate, reverse, waits_vector and offset + plan.after[11] - waits_vector, kernel, debug)
        object_offset = offset + plan.size
        vtable = vtable_of.get(plan)  # = vtables.get(plan.vtable_key), without hashing the key
        if vtable is None:
            vtable = vtable_of[plan] = vtables.get(plan.vtable_key)
        if vtable is None:
            append(plan.struct.pack(len(plan.vtable), *plan.fields(values)))
            append(plan.vtable)
            offset = vtables[plan.vtable_key] = vtable_of[plan] = object_offset + len(plan.vtable)
        else:
            append(plan.struct.pack(vtable - object_offset, *plan.fields(values)))
            offset = object_offset
        written.append(object_offset)
    writer.offset = offset
    # Builder.minalign: the widest Prep, of the waits, of an instruction table (every plan used is in vtable_of) or
    # of an operand (_fast_operand sets it).
    writer.minalign = max([writer.minalign, 8 if prepared_8 else 4, *(plan.align for plan in vtable_of)])
    return written


def _fast_operand(writer, operand) -> int:
    """writer.vector of its dims, then writer.table(_OPERAND, ...), inlined."""
    dims, offset, chunks = operand.dims, writer.offset, writer.chunks
    if offset & 7:  # Prep(4, 16 n) and Prep(8, 16 n)
        chunks.append(_PADDING[-offset & 7])
        offset += -offset & 7
    count = len(dims)
    chunks.append(struct.pack(f"<I{2 * count}q", count, *[n for dim in dims for n in dim]))  # count, then the dims
    offset = dims_vector = offset + 16 * count + 4
    space, dtype, partition, hbm_offset = operand.space, operand.dtype, operand.partition, operand.offset
    key = (space != 0, dtype != 0, partition != 0, hbm_offset != 0, offset & 7)
    plan = _OPERAND_PLANS.get(key)
    if plan is None:
        plan = _OPERAND_PLANS[key] = _OPERAND.plan((*key[:4], True), offset)
    if writer.minalign < 8:  # the dims' Prep(8); no field is wider
        writer.minalign = 8
    values = (space, dtype, partition, hbm_offset, offset + plan.after[4] - dims_vector)
    object_offset = offset + plan.size
    vtable = writer.vtables.get(plan.vtable_key)
    if vtable is None:
        chunks.append(plan.struct.pack(len(plan.vtable), *plan.fields(values)))
        chunks.append(plan.vtable)
        writer.offset = writer.vtables[plan.vtable_key] = object_offset + len(plan.vtable)
    else:
        chunks.append(plan.struct.pack(vtable - object_offset, *plan.fields(values)))
        writer.offset = object_offset
    return object_offset


_OPERAND_PLANS = {}  # the presence of each field but dims (always there), offset modulo 8 -> its plan
_INSTRUCTION_PLANS = {}  # the presence of each field but operands (always there), offset modulo 8 -> its plan
_PADDING = [bytes(n) for n in range(8)]
_COUNT = struct.Struct("<I")
_OFFSETS = [struct.Struct(f"<{n + 1}I") for n in range(3)]
_WAIT = struct.Struct("<B3xiq")
_WAITS2 = struct.Struct("<B3xiqB3xiq")


def _encode_program_with_builder(neff: Neff) -> bytes:
    """The program bytes made with flatbuffers' Builder, call by call: what `_encode_program` must equal."""
    builder = flatbuffers.Builder(1 << 16)
    tensors = [_tensor(builder, tensor) for tensor in neff.tensors]
    operands = {}  # AccessPattern -> offset of its table: identical operands share one table
    streams = [
        _stream(builder, engine, queue, instructions, operands)
        for (engine, queue), instructions in neff.streams.items()
    ]
    debug_locs = [_debug_loc(builder, loc) for loc in neff.debug_locs]
    kernels = [_kernel(builder, kernel) for kernel in neff.kernels]
    registers = [_register(builder, r) for r in neff.registers]
    loops = [_loop(builder, loop, operands) for loop in neff.loops]
    tensors = _offsets(builder, fb_program.StartTensorsVector, tensors)
    streams = _offsets(builder, fb_program.StartStreamsVector, streams)
    debug_locs = _offsets(builder, fb_program.StartDebugLocsVector, debug_locs)
    kernels = _offsets(builder, fb_program.StartKernelsVector, kernels)
    registers = _offsets(builder, fb_program.StartRegistersVector, registers) if neff.registers else None
    loops = _offsets(builder, fb_program.StartLoopsVector, loops) if neff.loops else None
    fb_program.Start(builder)
    fb_program.AddTensors(builder, tensors)
    fb_program.AddStreams(builder, streams)
    fb_program.AddDebugLocs(builder, debug_locs)
    fb_program.AddKernels(builder, kernels)
    if registers is not None:
        fb_program.AddRegisters(builder, registers)
    if loops is not None:
        fb_program.AddLoops(builder, loops)
    builder.Finish(fb_program.End(builder))
    return bytes(builder.Output())


def _register(builder, register) -> int:
    name = builder.CreateString(register.name)
    fb_register.Start(builder)
    fb_register.AddName(builder, name)
    fb_register.AddLo(builder, register.lo)
    fb_register.AddHi(builder, register.hi)
    return fb_register.End(builder)


def _loop(builder, loop, operands: dict) -> int:
    streams = _offsets(builder, fb_loop.StartStreamsVector, [
        _stream(builder, engine, queue, instructions, operands) for (engine, queue), instructions in loop.streams.items()])
    fb_loop.Start(builder)
    fb_loop.AddRegister(builder, loop.register)
    fb_loop.AddStreams(builder, streams)
    return fb_loop.End(builder)


def _terms(builder, start_vector, terms) -> int:
    start_vector(builder, len(terms))
    for source, coefficient in reversed(terms):
        fb_term.CreateTerm(builder, source, coefficient)
    return builder.EndVector()


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


def _check_shape(tensor) -> None:
    if any(size < 0 for size in tensor.shape):
        raise NeffFormatError(f"cannot encode tensor {tensor.name!r}: its shape {tuple(tensor.shape)} has a negative size")


def _data_bytes(tensor) -> bytes:
    """The values of a tensor entry that has data, little-endian, row-major."""
    array = np.asarray(tensor.data)
    if array.dtype != tensor.dtype.numpy or array.shape != tuple(tensor.shape):
        raise NeffFormatError(
            f"cannot encode tensor {tensor.name!r}: its data is {array.dtype}{list(array.shape)}, "
            f"but the entry says {tensor.dtype.name}{list(tensor.shape)}"
        )
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _tensor(builder, tensor) -> int:
    _check_shape(tensor)
    name = builder.CreateString(tensor.name)
    shape = builder.CreateNumpyVector(np.asarray(tensor.shape, dtype="<i8").reshape(-1))
    data = None
    if tensor.data is not None:
        data = builder.CreateByteVector(_data_bytes(tensor))
    rows = _terms(builder, fb_tensor.StartRowsVector, tensor.rows) if tensor.rows else None
    fb_tensor.Start(builder)
    fb_tensor.AddName(builder, name)
    fb_tensor.AddKind(builder, tensor.kind)
    fb_tensor.AddDtype(builder, tensor.dtype)
    fb_tensor.AddShape(builder, shape)
    fb_tensor.AddOffset(builder, tensor.offset)
    fb_tensor.AddIndex(builder, tensor.index)
    if data is not None:
        fb_tensor.AddData(builder, data)
    if rows is not None:
        fb_tensor.AddRows(builder, rows)
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
    terms = _terms(builder, fb_operand.StartTermsVector, operand.terms) if operand.terms else None
    fb_operand.Start(builder)
    fb_operand.AddSpace(builder, operand.space)
    fb_operand.AddDtype(builder, operand.dtype)
    fb_operand.AddPartition(builder, operand.partition)
    fb_operand.AddOffset(builder, operand.offset)
    fb_operand.AddDims(builder, dims)
    if terms is not None:
        fb_operand.AddTerms(builder, terms)
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
