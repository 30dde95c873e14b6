"""Decode NEFF bytes (or a .neff file) into a `Neff`, trusting nothing in them.

Every check comes before the data it protects is read: size and file identifier, the outer
flatbuffer's structure (verifier.py), the format version, the header and program hashes, the
program's structure, and only then the program itself. Whatever goes wrong is a NeffFormatError.

Fields are read by a small unpacker driven by the same binary schema as the verifier rather than
by the flatc-generated accessors: those re-read the vtable for every field, which made reading a
program of 50,000 instructions about four times slower.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
import os
import struct

import numpy as np

from neuronc.errors import NeffFormatError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff import verifier
from neuronc.neff.program import (FORMAT_MAJOR, MAX_TENSOR_DIMS, DebugLoc, KernelInfo, Loop, Neff, Register,
                                   TensorEntry, TensorKind)
from neuronc.neff.writer import FILE_IDENTIFIER

MIN_SIZE = 8  # root offset + file identifier
MAX_SIZE = (1 << 31) - 1  # flatbuffer offsets are 32-bit
DAMAGED = verifier.DAMAGED
FOREIGN = "give the .neff file that `neuronc compile` wrote"

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")


def load(path) -> Neff:
    """Read and decode the NEFF file at `path`."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise NeffFormatError(f"NEFF file not found: {path}", hint="check the path") from None
    except OSError as error:
        raise NeffFormatError(f"cannot read NEFF file {path}: {error.strerror or error}", hint=FOREIGN) from None
    return _decode(data, os.fspath(path))


def decode(data: bytes) -> Neff:
    """Decode the bytes of a NEFF file."""
    return _decode(bytes(data), None)


def _decode(data: bytes, source: str | None) -> Neff:
    prefix = f"{source}: " if source else ""
    try:
        return _decode_checked(data)
    except NeffFormatError as error:
        raise NeffFormatError(prefix + error.message, hint=error.hint or DAMAGED) from None
    except Exception as error:  # a check this reader lacks: still report it as a bad file
        raise NeffFormatError(f"{prefix}corrupted NEFF ({type(error).__name__}: {error})", hint=DAMAGED) from error


def _decode_checked(data: bytes) -> Neff:
    if len(data) < MIN_SIZE:
        raise NeffFormatError(f"not a NEFF file: {len(data)} bytes, too short to be one")
    if len(data) > MAX_SIZE:
        raise NeffFormatError(f"not a NEFF file: {len(data)} bytes, longer than a NEFF can be")
    identifier = data[4:8]
    if identifier != FILE_IDENTIFIER:
        hint = FOREIGN
        if data[:4] == b"PK\x03\x04":
            hint = "this is a zip archive, such as a .pt2 model: compile it into a NEFF with `neuronc compile` first"
        raise NeffFormatError(
            f"not a NEFF file (file identifier is {identifier!r}, expected {FILE_IDENTIFIER!r})", hint=hint
        )
    verifier.verify(data, "NeffFile")
    file = _Unpacker(data).root("NeffFile")
    header = file.header
    if header.format_major != FORMAT_MAJOR:
        newer = header.format_major > FORMAT_MAJOR
        raise NeffFormatError(
            f"NEFF format version {header.format_major}.{header.format_minor} is "
            f"{'a newer' if newer else 'an older'} format than this neuronc reads ({FORMAT_MAJOR}.x)",
            hint="recompile the model with this neuronc, or upgrade neuronc" if newer
            else "recompile the model with this neuronc",
        )
    expected = verifier.header_digest(
        header.format_major, header.format_minor, header.compiler_version, header.target, header.name,
        header.content_hash, header.hbm_size, header.estimated_ns,
    )
    if header.header_hash != expected:
        raise NeffFormatError("corrupted NEFF: the header does not match its checksum", hint=DAMAGED)
    if hashlib.sha256(file.program).hexdigest() != header.content_hash:
        raise NeffFormatError("corrupted NEFF: the program does not match its content hash", hint=DAMAGED)
    verifier.verify(file.program, "Program")
    program = _Unpacker(file.program).root("Program")
    neff = Neff(
        name=header.name,
        target=header.target,
        tensors=[_tensor(tensor) for tensor in program.tensors],
        streams={},
        hbm_size=header.hbm_size,
        debug_locs=[DebugLoc(loc.file, loc.line, loc.module_path, loc.op) for loc in program.debug_locs],
        kernels=[KernelInfo(k.name, k.ops, k.debug, k.estimated_ns) for k in program.kernels],
        estimated_ns=header.estimated_ns,
        compiler_version=header.compiler_version,
        format_major=header.format_major,
        format_minor=header.format_minor,
        content_hash=header.content_hash,
        cache_key=header.cache_key or "",
    )
    operands = {}  # id of a record -> its AccessPattern: operands that share a table share the object
    for stream in program.streams:
        key = (_ENGINES[stream.engine], stream.queue)
        if key in neff.streams:
            raise NeffFormatError(f"corrupted NEFF: stream {key[0].name}:{key[1]} appears twice", hint=DAMAGED)
        neff.streams[key] = [_instruction(inst, operands) for inst in stream.instructions]
    neff.registers = [Register(r.name, r.lo, r.hi) for r in program.registers or ()]
    for loop in program.loops or ():
        streams = {}
        for stream in loop.streams:
            key = (_ENGINES[stream.engine], stream.queue)
            if key in streams:
                raise NeffFormatError(f"corrupted NEFF: a loop's stream {key[0].name}:{key[1]} appears twice",
                                      hint=DAMAGED)
            streams[key] = [_instruction(inst, operands) for inst in stream.instructions]
        neff.loops.append(Loop(loop.register, streams))
    verifier.check_references(neff)
    return neff


# ----- From records to the dataclasses of program.py and isa.py -----


def _members(enum_class) -> dict:
    return {member.value: member for member in enum_class}


# The verifier has checked every enum value, so these lookups cannot fail (and beat EnumClass(value)).
_OPCODES, _ENGINES, _SPACES, _DTYPES = _members(Opcode), _members(Engine), _members(Space), _members(DType)
_ALU_OPS, _ACT_FUNCS, _KINDS = _members(AluOp), _members(ActFunc), _members(TensorKind)


def _tensor(tensor) -> TensorEntry:
    dtype = _DTYPES[tensor.dtype]
    if len(tensor.shape) > MAX_TENSOR_DIMS:
        raise NeffFormatError(
            f"corrupted NEFF: tensor {tensor.name!r} has {len(tensor.shape)} dimensions, more than {MAX_TENSOR_DIMS}",
            hint=DAMAGED)
    if any(size < 0 for size in tensor.shape):
        raise NeffFormatError(
            f"corrupted NEFF: tensor {tensor.name!r} has a negative size in its shape {tensor.shape}", hint=DAMAGED
        )
    data = None
    if tensor.data is not None:
        nbytes = dtype.itemsize * math.prod(tensor.shape)
        if len(tensor.data) != nbytes:
            raise NeffFormatError(
                f"corrupted NEFF: tensor {tensor.name!r} ({dtype.name}{list(tensor.shape)}) needs {nbytes} bytes "
                f"of data but has {len(tensor.data)}",
                hint=DAMAGED,
            )
        if dtype == DType.BOOL and tensor.data.strip(b"\x00\x01"):
            raise NeffFormatError(
                f"corrupted NEFF: bool tensor {tensor.name!r} holds a byte other than 0 or 1", hint=DAMAGED
            )
        little_endian = np.frombuffer(tensor.data, dtype=dtype.numpy.newbyteorder("<"))
        data = little_endian.astype(dtype.numpy).reshape(tensor.shape)
    return TensorEntry(tensor.name, _KINDS[tensor.kind], dtype, tensor.shape, tensor.offset, tensor.index, data,
                       tuple(tensor.rows or ()))


def _instruction(inst, operands: dict) -> Instruction:
    return Instruction(
        opcode=_OPCODES[inst.opcode],
        engine=_ENGINES[inst.engine],
        operands=tuple(_operand(operand, operands) for operand in inst.operands),
        queue=inst.queue,
        alu=_ALU_OPS[inst.alu],
        alu1=_ALU_OPS[inst.alu1],
        func=_ACT_FUNCS[inst.func],
        imm0=inst.imm0,
        imm1=inst.imm1,
        accumulate=bool(inst.accumulate),
        reverse=bool(inst.reverse),
        waits=tuple(Wait(_ENGINES[engine], queue, count) for engine, queue, count in inst.waits or ()),
        kernel=inst.kernel,
        debug=inst.debug,
    )


def _operand(operand, operands: dict) -> AccessPattern:
    # By id: the unpacker returns one record per operand table, alive until decoding is done.
    decoded = operands.get(id(operand))
    if decoded is None:
        decoded = operands[id(operand)] = AccessPattern(
            _SPACES[operand.space], _DTYPES[operand.dtype], operand.offset, operand.dims, operand.partition,
            tuple(operand.terms or ()))
    return decoded


# ----- Reading a verified buffer -----


@functools.cache
def _record(kind: verifier.TableType) -> type:
    """The namedtuple a table of `kind` is read into: one attribute per field, named as in neff.fbs."""
    return collections.namedtuple(kind.name, [field.name for field in kind.fields])


class _Unpacker:
    """Reads a buffer that `verifier.verify` accepted into records.

    A table becomes a namedtuple (absent fields: their schema default, or None), a vector a tuple
    (a vector of bytes: `bytes`), a struct a tuple of its fields, a string a `str`.

    Flatbuffers allow any object to be referenced many times, but a NEFF shares only operand
    tables; anything else referenced twice is refused. Otherwise a small hostile file (one
    instruction with a long operand list, referenced from every entry of a long stream) would
    decode into a product of sizes and take hours.
    """

    SHAREABLE = frozenset({"AccessPattern"})

    def __init__(self, buf: bytes):
        self.buf = buf
        self.seen = set()  # positions of every table, vector and string read
        self.shared = {}  # position -> (kind, record) of the shareable tables read

    def root(self, name: str):
        return self.table(_U32.unpack_from(self.buf, 0)[0], verifier.schema()[name])

    def claim(self, pos: int, what: str) -> None:
        if pos in self.seen:
            raise NeffFormatError(f"corrupted NEFF: the {what} at offset {pos} is referenced twice", hint=DAMAGED)
        self.seen.add(pos)

    def table(self, pos: int, kind: verifier.TableType):
        shared = self.shared.get(pos)
        if shared is not None and shared[0] is kind:
            return shared[1]
        self.claim(pos, f"{kind.name} table")
        buf = self.buf
        vtable = pos - _I32.unpack_from(buf, pos)[0]
        known = min(len(kind.fields), _U16.unpack_from(buf, vtable)[0] // 2 - 2)
        offsets = struct.unpack_from(f"<{known}H", buf, vtable + 4) + (0,) * (len(kind.fields) - known)
        values = []
        for field, offset in zip(kind.fields, offsets):
            if not offset:
                values.append(field.default)
            elif isinstance(field.type, verifier.ScalarType):
                values.append(field.type.struct.unpack_from(buf, pos + offset)[0])
            else:
                values.append(self.value(pos + offset, field.type))
        record = _record(kind)._make(values)
        if kind.name in self.SHAREABLE:
            self.shared[pos] = (kind, record)
        return record

    def value(self, at: int, kind):
        """The value of a non-scalar field, or vector element, stored at `at`."""
        buf = self.buf
        if isinstance(kind, verifier.StructType):
            return kind.struct.unpack_from(buf, at)
        at += _U32.unpack_from(buf, at)[0]
        if isinstance(kind, verifier.TableType):
            return self.table(at, kind)
        self.claim(at, kind.name)
        count = _U32.unpack_from(buf, at)[0]
        start = at + 4
        if kind is verifier.STRING:
            return buf[start : start + count].decode()
        element = kind.element
        if isinstance(element, verifier.ScalarType):
            if element.size == 1 and element.allowed is None:
                return buf[start : start + count]
            return struct.unpack_from(f"<{count}{element.fmt}", buf, start)
        if isinstance(element, verifier.StructType):
            return tuple(element.struct.iter_unpack(buf[start : start + count * element.size]))
        return tuple(self.value(pos, element) for pos in range(start, start + 4 * count, 4))
