"""The NEFF codec: exact round trips, generated code in step with the schema, and a reader that
turns every damaged, foreign, hostile or too-new file into a NeffFormatError."""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import math
import os
import re
import struct
import zipfile

import flatbuffers
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronc import atomic_file
from neuronc.errors import NeffFormatError, NeuronRuntimeError
from neuronc.isa import ARITY, AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff import decode, encode, load, regenerate, save, verifier, writer
from neuronc.neff.generated import Instruction as fb_instruction
from neuronc.neff.generated import Kernel as fb_kernel
from neuronc.neff.generated import Program as fb_program
from neuronc.neff.generated import Stream as fb_stream
from neuronc.neff.generated import Tensor as fb_tensor
from neuronc.neff.generated.NeffFile import NeffFile as FbNeffFile
from neuronc.neff.generated.Program import Program as FbProgram
from neuronc.neff.program import FORMAT_MAJOR, FORMAT_MINOR, DebugLoc, KernelInfo, Neff, TensorEntry, TensorKind
from tests.conftest import require_tool


# ----- A program that uses every opcode, enum value and field -----


def _operand(space: Space, dtype: DType, i: int) -> AccessPattern:
    dims = ((1, 1 + i % 128), (-(i + 1), 7), (0, 3)) if i % 2 else ((1, 128), (i * 1000, 1 << 40))
    return AccessPattern(space, dtype, offset=(i * 4097) % (1 << 40), dims=dims, partition=i % 128)


def full_neff() -> Neff:
    streams = {}
    spaces, dtypes = list(Space), list(DType)
    alus, funcs = list(AluOp), list(ActFunc)
    i = 0
    for engine in Engine:
        for queue in (0, 1, 15) if engine == Engine.DMA else (0,):
            stream = streams[(engine, queue)] = []
            for opcode in Opcode:
                operands = tuple(_operand(spaces[(i + k) % 3], dtypes[(i + k) % len(dtypes)], i + k)
                                 for k in range(ARITY[opcode]))
                stream.append(Instruction(
                    opcode=opcode,
                    engine=engine,
                    operands=operands,
                    queue=queue,
                    alu=alus[i % len(alus)],
                    alu1=alus[(i + 1) % len(alus)],
                    func=funcs[i % len(funcs)],
                    imm0=i * 0.1 - 3.0,
                    imm1=-1e300 if i % 2 else 2.5e-310,
                    accumulate=i % 2 == 0,
                    reverse=i % 3 == 0,
                    waits=tuple(Wait(e, i % 3, i * 7 + e) for e in list(Engine)[: i % 4]),
                    kernel=i % 3 - 1,
                    debug=i % 4 - 1,
                ))
                i += 1
    # Every alu and func value, even those the loop above did not reach.
    streams[(Engine.VECTOR, 0)] += [
        Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (_operand(Space.SBUF, DType.F32, 0),) * 2, alu=alu)
        for alu in AluOp
    ]
    streams[(Engine.SCALAR, 0)] += [
        Instruction(Opcode.ACTIVATE, Engine.SCALAR, (_operand(Space.SBUF, DType.BF16, 1),) * 2, func=func)
        for func in ActFunc
    ]
    rng = np.random.default_rng(0)
    tensors = [
        TensorEntry("x", TensorKind.INPUT, DType.F32, (4, 8), 0, 0),
        TensorEntry("mask", TensorKind.INPUT, DType.BOOL, (8,), 128, 1),
        TensorEntry("y", TensorKind.OUTPUT, DType.BF16, (4, 16), 256, 0),
        TensorEntry("w", TensorKind.WEIGHT, DType.F32, (8, 16), 512,
                    data=rng.standard_normal((8, 16)).astype(np.float32)),
        TensorEntry("w_bf16", TensorKind.WEIGHT, DType.BF16, (16,), 1024,
                    data=rng.standard_normal(16).astype(ml_dtypes.bfloat16)),
        TensorEntry("positions", TensorKind.CONSTANT, DType.I64, (2, 3), 2048,
                    data=np.array([[0, -1, 2**62], [-(2**63), 5, 6]], dtype=np.int64)),
        TensorEntry("keep", TensorKind.CONSTANT, DType.BOOL, (5,), 4096, data=np.array([1, 0, 1, 1, 0], dtype=bool)),
        TensorEntry("scale", TensorKind.CONSTANT, DType.F64, (), 4104, data=np.array(math.pi)),
        TensorEntry("empty", TensorKind.CONSTANT, DType.I8, (0, 3), 4112, data=np.zeros((0, 3), dtype=np.int8)),
        TensorEntry("tmp", TensorKind.SCRATCH, DType.F16, (1024,), 8192),
    ]
    return Neff(
        name="mlp — ünïcode",
        target="trn2",
        tensors=tensors,
        streams=streams,
        hbm_size=1 << 34,
        debug_locs=[
            DebugLoc("model.py", 12, "blocks.0.attn", "aten.addmm"),
            DebugLoc(),
            DebugLoc("/home/user/ünï.py", 2**31 - 1, "", "aten.relu"),
        ],
        kernels=[
            KernelInfo("matmul_0", ("aten.addmm", "aten.relu"), 0, 1234.5),
            KernelInfo("copy_1", (), -1, 0.0),
        ],
        estimated_ns=98765.4321,
        compiler_version="neuronc 0.1.0",
    )


def assert_same_neff(actual: Neff, expected: Neff) -> None:
    for field in ("name", "target", "hbm_size", "debug_locs", "kernels", "estimated_ns", "compiler_version",
                  "format_major", "format_minor", "content_hash"):
        assert getattr(actual, field) == getattr(expected, field), field
    assert list(actual.streams) == list(expected.streams)
    for key, stream in expected.streams.items():
        assert actual.streams[key] == stream, key
    assert len(actual.tensors) == len(expected.tensors)
    for got, want in zip(actual.tensors, expected.tensors):
        assert (got.name, got.kind, got.dtype, got.shape, got.offset, got.index) == (
            want.name, want.kind, want.dtype, want.shape, want.offset, want.index)
        if want.data is None:
            assert got.data is None
        else:
            assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
            assert got.data.tobytes() == want.data.tobytes()


@pytest.fixture(scope="module")
def neff_bytes() -> bytes:
    return encode(full_neff())


def _program_span(data: bytes) -> range:
    """Where the nested program's bytes lie in a NEFF file."""
    root = FbNeffFile.GetRootAs(data)
    start = root._tab.Vector(root._tab.Offset(6))  # NeffFile.program
    return range(start, start + root.ProgramLength())


def _program_of(data: bytes) -> bytes:
    return FbNeffFile.GetRootAs(data).ProgramAsNumpy().tobytes()


# ----- Round trips -----


def test_round_trip_preserves_every_field_of_a_program_using_every_opcode_and_enum():
    original = full_neff()
    data = encode(original)
    decoded = decode(data)
    assert_same_neff(decoded, original)
    used = {inst.opcode for stream in decoded.streams.values() for inst in stream}
    assert used == set(Opcode)
    assert {t.kind for t in decoded.tensors} == set(TensorKind)
    operands = [op for stream in decoded.streams.values() for inst in stream for op in inst.operands]
    assert {op.space for op in operands} == set(Space) and {op.dtype for op in operands} == set(DType)


def test_decoded_values_have_the_python_types_of_the_in_memory_neff(neff_bytes):
    decoded = decode(neff_bytes)
    inst = decoded.streams[(Engine.DMA, 1)][3]
    assert type(inst.opcode) is Opcode and type(inst.engine) is Engine
    assert type(inst.alu) is AluOp and type(inst.func) is ActFunc
    assert type(inst.operands) is tuple and type(inst.operands[0].space) is Space
    assert type(inst.operands[0].dims) is tuple and type(inst.operands[0].dims[0]) is tuple
    assert all(type(w) is Wait and type(w.engine) is Engine for stream in decoded.streams.values()
               for i in stream for w in i.waits)
    assert type(inst.accumulate) is bool and type(inst.imm0) is float
    assert all(type(key[0]) is Engine for key in decoded.streams)
    assert all(type(t.shape) is tuple and type(t.kind) is TensorKind for t in decoded.tensors)
    assert type(decoded.kernels[0].ops) is tuple


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_weights_of_every_dtype_round_trip_bit_exactly(dtype):
    values = np.random.default_rng(int(dtype)).standard_normal((3, 5)) * 100
    values = values.astype(dtype.numpy) if dtype != DType.BOOL else values > 0
    neff = Neff("w", "trn1", [TensorEntry("w", TensorKind.WEIGHT, dtype, (3, 5), 0, data=values)], {}, 64)
    (tensor,) = decode(encode(neff)).tensors
    assert tensor.data.dtype == dtype.numpy and tensor.data.shape == (3, 5)
    assert tensor.data.tobytes() == values.tobytes()
    assert tensor.data.flags.writeable


@pytest.mark.parametrize("value", [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1 / 3, -1.7976931348623157e308])
def test_float_fields_round_trip_bit_exactly(value):
    inst = Instruction(Opcode.MEMSET, Engine.GPSIMD, (_operand(Space.SBUF, DType.F32, 0),), imm0=value, imm1=-value)
    neff = Neff("f", "trn1", [], {(Engine.GPSIMD, 0): [inst]}, 0, estimated_ns=value,
                kernels=[KernelInfo("k", estimated_ns=value)])
    decoded = decode(encode(neff))
    (got,) = decoded.streams[(Engine.GPSIMD, 0)]
    assert _bits(got.imm0) == _bits(value) and _bits(got.imm1) == _bits(-value)
    assert _bits(decoded.estimated_ns) == _bits(value) and _bits(decoded.kernels[0].estimated_ns) == _bits(value)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_an_empty_program_round_trips():
    neff = Neff("empty", "trn3", [], {}, 0)
    assert_same_neff(decode(encode(neff)), neff)


def test_encode_fills_in_the_sha256_of_the_program_as_content_hash():
    neff = full_neff()
    data = encode(neff)
    assert neff.content_hash == hashlib.sha256(_program_of(data)).hexdigest()
    assert decode(data).content_hash == neff.content_hash


def test_encoding_is_deterministic(neff_bytes):
    assert encode(full_neff()) == neff_bytes


def test_identical_operands_are_stored_once_and_decoded_as_one_object():
    tile = _operand(Space.SBUF, DType.F32, 3)
    stream = [Instruction(Opcode.TENSOR_COPY, Engine.VECTOR, (tile, tile)) for _ in range(100)]
    neff = Neff("shared", "trn2", [], {(Engine.VECTOR, 0): stream}, 0)
    data = encode(neff)
    distinct = Neff("distinct", "trn2", [], {(Engine.VECTOR, 0): [
        Instruction(Opcode.TENSOR_COPY, Engine.VECTOR, (_operand(Space.SBUF, DType.F32, i),) * 2)
        for i in range(100)]}, 0)
    assert len(data) < len(encode(distinct)) / 2
    decoded = decode(data).streams[(Engine.VECTOR, 0)]
    assert decoded == stream
    assert decoded[0].operands[0] is decoded[99].operands[1]


def test_files_are_readable_with_the_flatc_generated_accessors(neff_bytes):
    root = FbNeffFile.GetRootAs(neff_bytes)
    assert FbNeffFile.NeffFileBufferHasIdentifier(neff_bytes, 0)
    assert root.Header().Name().decode() == "mlp — ünïcode"
    assert root.Header().FormatMajor() == FORMAT_MAJOR
    program = FbProgram.GetRootAs(_program_of(neff_bytes))
    inst = program.Streams(0).Instructions(1)
    assert inst.Opcode() == Opcode.MATMUL and inst.Kernel() == 0
    assert program.Tensors(3).Name().decode() == "w"


# ----- Files -----


def test_save_then_load_round_trips(tmp_path):
    neff = full_neff()
    path = tmp_path / "model.neff"
    save(neff, path)
    assert_same_neff(load(path), neff)
    assert_same_neff(load(str(path)), neff)


def test_a_save_that_fails_midway_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "model.neff"
    save(full_neff(), path)
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file.os, "fsync", crash)  # save writes through neuronc.atomic_file
    with pytest.raises(OSError, match="disk full"):
        save(Neff("other", "trn1", [], {}, 0), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.neff"]


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "model.neff"
    save(full_neff(), path)
    save(Neff("small", "trn1", [], {}, 0), path)
    assert load(path).name == "small"
    assert os.listdir(tmp_path) == ["model.neff"]


def test_loading_a_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.neff"
    with pytest.raises(NeffFormatError, match="NEFF file not found: .*nope.neff"):
        load(missing)


def test_loading_a_directory_is_a_format_error(tmp_path):
    with pytest.raises(NeffFormatError, match="cannot read NEFF file"):
        load(tmp_path)


def test_load_errors_name_the_file_once(tmp_path, neff_bytes):
    path = tmp_path / "cut.neff"
    path.write_bytes(neff_bytes[:100])
    with pytest.raises(NeffFormatError, match=r"cut\.neff: truncated"):
        load(path)
    path.write_bytes(b"GIF89a" + bytes(20))
    with pytest.raises(NeffFormatError) as raised:
        load(path)
    assert raised.value.message == f"{path}: not a NEFF file (file identifier is b'9a\\x00\\x00', expected b'NEFF')"


# ----- The writer refuses what the reader would refuse -----


def test_encoding_weights_whose_data_does_not_match_the_entry_fails():
    neff = Neff("w", "trn1", [TensorEntry("w", TensorKind.WEIGHT, DType.F32, (2, 2), 0,
                                          data=np.zeros((2, 3), np.float32))], {}, 0)
    with pytest.raises(NeffFormatError, match=r"float32\[2, 3\], but the entry says F32\[2, 2\]"):
        encode(neff)


def test_encoding_a_negative_shape_fails():
    neff = Neff("s", "trn1", [TensorEntry("x", TensorKind.INPUT, DType.F32, (2, -1), 0, 0)], {}, 0)
    with pytest.raises(NeffFormatError, match=r"tensor 'x': its shape \(2, -1\) has a negative size"):
        encode(neff)


@pytest.mark.parametrize("change", ["kernel", "debug", "kernel_debug"])
def test_encoding_a_dangling_kernel_or_debug_index_fails(change):
    neff = full_neff()
    inst = neff.streams[(Engine.TENSOR, 0)][0]
    if change == "kernel":
        inst.kernel = len(neff.kernels)
    elif change == "debug":
        inst.debug = -2
    else:
        neff.kernels[0].debug = 99
    with pytest.raises(NeffFormatError, match="refers to"):
        encode(neff)


def test_encoding_an_out_of_range_value_fails_with_a_format_error():
    neff = Neff("big", "trn1", [], {(Engine.DMA, 2**40): []}, 0)
    with pytest.raises(NeffFormatError, match="cannot encode NEFF 'big'"):
        encode(neff)


# ----- Foreign, damaged and too-new files -----


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model/data.pkl", b"not a neff")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "0 bytes, too short"),
        (b"NEFF", "4 bytes, too short"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"file identifier is b'\\r\\n\\x1a\\n', expected b'NEFF'"),
        (_zip_bytes(), "file identifier is .*, expected b'NEFF'"),
        (b"\x7fELF\x02\x01\x01\x00" + bytes(56), r"file identifier is b'\\x02\\x01\\x01\\x00'"),
        (b"hello, this is plain text\n", r"file identifier is b'o, t'"),
    ],
    ids=["empty", "short", "png", "zip", "elf", "text"],
)
def test_a_foreign_file_is_reported_as_not_a_neff(data, message):
    with pytest.raises(NeffFormatError, match="not a NEFF file") as raised:
        decode(data)
    assert raised.match(message)
    assert raised.value.hint


def test_a_zip_archive_gets_a_hint_to_compile_it_first():
    with pytest.raises(NeffFormatError) as raised:
        decode(_zip_bytes())
    assert ".pt2" in raised.value.hint


def test_a_file_cut_short_anywhere_is_a_format_error(neff_bytes):
    cuts = sorted(set(range(0, 64)) | set(range(0, len(neff_bytes), 97)) | {len(neff_bytes) - 1})
    for cut in cuts:
        with pytest.raises(NeffFormatError, match="truncated|too short"):
            decode(neff_bytes[:cut])


def test_a_flipped_byte_in_the_program_is_always_detected(neff_bytes):
    span = _program_span(neff_bytes)
    for pos in range(span.start, span.stop, 13):
        damaged = bytearray(neff_bytes)
        damaged[pos] ^= 0x10
        with pytest.raises(NeffFormatError, match="the program does not match its content hash"):
            decode(bytes(damaged))


def test_a_flipped_byte_outside_the_program_decodes_to_the_same_neff_or_is_detected(neff_bytes):
    original = decode(neff_bytes)
    span = _program_span(neff_bytes)
    detected = 0
    for pos in [p for p in range(len(neff_bytes)) if p not in span]:
        for bit in (0x01, 0x80):
            damaged = bytearray(neff_bytes)
            damaged[pos] ^= bit
            try:
                decoded = decode(bytes(damaged))
            except NeffFormatError:
                detected += 1
            else:
                assert_same_neff(decoded, original)
    assert detected > 0


def test_a_damaged_header_field_is_caught_by_the_header_checksum(neff_bytes):
    name = "mlp — ünïcode".encode()
    pos = neff_bytes.index(name)
    damaged = neff_bytes[:pos] + b"x" + neff_bytes[pos + 1:]
    with pytest.raises(NeffFormatError, match="header does not match its checksum"):
        decode(damaged)


def test_a_newer_major_version_is_refused_with_both_versions_and_what_to_do():
    neff = Neff("future", "trn2", [], {}, 0, format_major=FORMAT_MAJOR + 1, format_minor=3)
    with pytest.raises(NeffFormatError) as raised:
        decode(encode(neff))
    message = str(raised.value)
    assert f"version {FORMAT_MAJOR + 1}.3 is a newer format" in message
    assert f"({FORMAT_MAJOR}.x" in message
    assert "recompile" in raised.value.hint and "upgrade neuronc" in raised.value.hint


def test_a_newer_major_version_is_refused_before_its_program_is_looked_at():
    neff = Neff("future", "trn2", [], {}, 0, format_major=FORMAT_MAJOR + 1)
    data = encode(neff)
    span = _program_span(data)
    damaged = bytearray(data)
    damaged[span.start:span.stop] = bytes(len(span))  # a program this neuronc could not read anyway
    with pytest.raises(NeffFormatError, match="newer format"):
        decode(bytes(damaged))


def test_an_older_major_version_is_refused():
    with pytest.raises(NeffFormatError, match="an older format"):
        decode(encode(Neff("past", "trn1", [], {}, 0, format_major=FORMAT_MAJOR - 1)))


def test_a_newer_minor_version_is_read():
    neff = full_neff()
    neff.format_minor = FORMAT_MINOR + 7
    decoded = decode(encode(neff))
    assert decoded.format_minor == FORMAT_MINOR + 7
    assert_same_neff(decoded, neff)


# ----- The verifier on hostile buffers whose hashes are right -----


def _rewrap(program: bytes) -> bytes:
    """A NEFF file around `program` with correct hashes: only the verifier stands in the way."""
    return writer._encode_file(Neff("hostile", "trn1", [], {}, 0), program, hashlib.sha256(program).hexdigest())


def _valid_program() -> bytes:
    return writer._encode_program(full_neff())


def _build_program(build_stream=None, tensors=(), streams=1, build_kernel=None) -> bytes:
    """A Program made with the generated builder functions, bypassing the writer's checks.

    `build_stream(builder)` (called `streams` times) and `build_kernel(builder)` return the
    offset of a Stream, or Kernel, table; `tensors` holds (name, dtype, shape, data bytes).
    """
    builder = flatbuffers.Builder(256)
    streams = [build_stream(builder) for _ in range(streams)] if build_stream else []
    kernels = [build_kernel(builder)] if build_kernel else []
    tensor_offsets = []
    for name, dtype, shape, data in tensors:
        name = builder.CreateString(name)
        shape = builder.CreateNumpyVector(np.array(shape, dtype="<i8"))
        data = builder.CreateByteVector(data)
        fb_tensor.Start(builder)
        fb_tensor.AddName(builder, name)
        fb_tensor.AddKind(builder, TensorKind.CONSTANT)
        fb_tensor.AddDtype(builder, dtype)
        fb_tensor.AddShape(builder, shape)
        fb_tensor.AddData(builder, data)
        tensor_offsets.append(fb_tensor.End(builder))
    vectors = []
    for start, items in ((fb_program.StartTensorsVector, tensor_offsets), (fb_program.StartStreamsVector, streams),
                         (fb_program.StartDebugLocsVector, []), (fb_program.StartKernelsVector, kernels)):
        vectors.append(writer._offsets(builder, start, items))
    fb_program.Start(builder)
    fb_program.AddTensors(builder, vectors[0])
    fb_program.AddStreams(builder, vectors[1])
    fb_program.AddDebugLocs(builder, vectors[2])
    fb_program.AddKernels(builder, vectors[3])
    builder.Finish(fb_program.End(builder))
    return bytes(builder.Output())


def _stream_of(instructions):
    """build_stream for _build_program: one VECTOR stream of raw instruction tables."""

    def build(builder):
        offsets = [make(builder) for make in instructions]
        vector = writer._offsets(builder, fb_stream.StartInstructionsVector, offsets)
        fb_stream.Start(builder)
        fb_stream.AddEngine(builder, Engine.VECTOR)
        fb_stream.AddInstructions(builder, vector)
        return fb_stream.End(builder)

    return build


def _raw_instruction(opcode=Opcode.MEMSET, with_operands=True, kernel=-1, operand_count=1):
    def make(builder):
        operand = writer._operand(builder, _operand(Space.SBUF, DType.F32, 0))
        operands = writer._offsets(builder, fb_instruction.StartOperandsVector, [operand] * operand_count)
        fb_instruction.Start(builder)
        fb_instruction.AddOpcode(builder, opcode)
        if with_operands:
            fb_instruction.AddOperands(builder, operands)
        fb_instruction.AddKernel(builder, kernel)
        return fb_instruction.End(builder)

    return make


def test_the_hand_built_program_helper_makes_a_valid_program():
    neff = decode(_rewrap(_build_program(_stream_of([_raw_instruction()]))))
    assert neff.streams[(Engine.VECTOR, 0)][0].opcode == Opcode.MEMSET


def test_an_unknown_enum_value_is_refused_by_name():
    program = _build_program(_stream_of([_raw_instruction(), _raw_instruction(opcode=200)]))
    with pytest.raises(NeffFormatError, match=r"Instruction.opcode holds 200, which is not a valid Opcode"
                                              r" \(in Program.streams\[0\].instructions\[1\]\)"):
        verifier.verify(program, "Program")
    with pytest.raises(NeffFormatError, match="not a valid Opcode"):
        decode(_rewrap(program))


def test_a_missing_required_field_is_refused():
    program = _build_program(_stream_of([_raw_instruction(with_operands=False)]))
    with pytest.raises(NeffFormatError, match="required field Instruction.operands is missing"):
        verifier.verify(program, "Program")


def test_an_offset_past_the_end_is_refused():
    program = bytearray(_valid_program())
    struct.pack_into("<I", program, 0, len(program) + 100)  # the root offset
    with pytest.raises(NeffFormatError, match=r"truncated: Program table at offset \d+ extends past the end"):
        verifier.verify(bytes(program), "Program")
    with pytest.raises(NeffFormatError, match="truncated"):
        decode(_rewrap(bytes(program)))


def test_a_vtable_outside_the_buffer_is_refused():
    program = bytearray(_valid_program())
    root = struct.unpack_from("<I", program, 0)[0]
    struct.pack_into("<i", program, root, -(2**31 - 1))
    with pytest.raises(NeffFormatError, match="truncated: vtable of Program"):
        verifier.verify(bytes(program), "Program")


def test_a_misaligned_table_is_refused():
    program = bytearray(_valid_program())
    struct.pack_into("<I", program, 0, struct.unpack_from("<I", program, 0)[0] + 1)
    with pytest.raises(NeffFormatError, match="misaligned: Program table"):
        verifier.verify(bytes(program), "Program")


def test_a_vector_longer_than_the_buffer_is_refused():
    program = _valid_program()
    tensors_vector = FbProgram.GetRootAs(program)._tab.Vector(FbProgram.GetRootAs(program)._tab.Offset(4)) - 4
    damaged = bytearray(program)
    struct.pack_into("<I", damaged, tensors_vector, 0x7FFFFFFF)
    with pytest.raises(NeffFormatError, match=r"truncated: vector of 2147483647 offsets .* \(in Program.tensors\)"):
        verifier.verify(bytes(damaged), "Program")


def test_a_string_without_its_terminating_nul_is_refused():
    program = _valid_program()
    name = program.index(b"matmul_0\x00")
    damaged = program[: name + 8] + b"!" + program[name + 9:]
    with pytest.raises(NeffFormatError, match=r"not NUL-terminated \(in Program.kernels\[0\].name\)"):
        verifier.verify(damaged, "Program")


def test_a_string_that_is_not_utf8_is_refused():
    program = _valid_program()
    name = program.index(b"matmul_0\x00")
    damaged = program[:name] + b"\xff" + program[name + 1:]
    with pytest.raises(NeffFormatError, match="not valid UTF-8"):
        decode(_rewrap(damaged))


def test_an_unknown_enum_in_a_struct_is_refused():
    program = bytearray(_valid_program())
    inst = FbProgram.GetRootAs(bytes(program)).Streams(0).Instructions(3)
    assert inst.WaitsLength() > 0
    program[inst.Waits(0)._tab.Pos] = 77  # Wait.engine
    where = r"\(in Program\.streams\[0\]\.instructions\[3\]\.waits\[0\]\)"
    with pytest.raises(NeffFormatError, match=r"Wait\.engine holds 77, which is not a valid Engine " + where):
        verifier.verify(bytes(program), "Program")


def test_nesting_and_table_count_are_limited():
    program = _valid_program()
    with pytest.raises(NeffFormatError, match="nested more than 2 deep"):
        verifier.verify(program, "Program", max_depth=2)
    with pytest.raises(NeffFormatError, match="more than 10 tables"):
        verifier.verify(program, "Program", max_tables=10)


def test_a_table_referenced_many_times_is_verified_once():
    # 20,000 references to one instruction count as one table, and cost one check ...
    shared = _build_program(lambda builder: _shared_stream(builder, 20_000))
    verifier.verify(shared, "Program", max_tables=10)
    # ... but a NEFF shares only operands, so decoding refuses it.
    with pytest.raises(NeffFormatError, match=r"the Instruction table at offset \d+ is referenced twice"):
        decode(_rewrap(shared))


def test_a_long_operand_list_shared_by_many_instructions_is_refused_quickly():
    # 2,000 instructions x 2,000 operands would be 4 million operands from a 50 kB file.
    def build(builder):
        operand = writer._operand(builder, _operand(Space.SBUF, DType.F32, 0))
        operands = writer._offsets(builder, fb_instruction.StartOperandsVector, [operand] * 2000)
        instructions = []
        for _ in range(2000):
            fb_instruction.Start(builder)
            fb_instruction.AddOperands(builder, operands)
            instructions.append(fb_instruction.End(builder))
        vector = writer._offsets(builder, fb_stream.StartInstructionsVector, instructions)
        fb_stream.Start(builder)
        fb_stream.AddInstructions(builder, vector)
        return fb_stream.End(builder)

    with pytest.raises(NeffFormatError, match="vector at offset \\d+ is referenced twice"):
        decode(_rewrap(_build_program(build)))


def _shared_stream(builder, copies: int) -> int:
    inst = _raw_instruction()(builder)
    vector = writer._offsets(builder, fb_stream.StartInstructionsVector, [inst] * copies)
    fb_stream.Start(builder)
    fb_stream.AddInstructions(builder, vector)
    return fb_stream.End(builder)


def test_weight_data_of_the_wrong_size_is_refused():
    program = _build_program(tensors=[("w", DType.F32, (2, 2), bytes(12))])
    verifier.verify(program, "Program")  # well-formed, but ...
    with pytest.raises(NeffFormatError, match=r"tensor 'w' \(F32\[2, 2\]\) needs 16 bytes of data but has 12"):
        decode(_rewrap(program))


def test_a_negative_shape_is_refused():
    program = _build_program(tensors=[("w", DType.F32, (2, -2), bytes(0))])
    with pytest.raises(NeffFormatError, match="negative size"):
        decode(_rewrap(program))


def test_bool_weights_holding_other_bytes_are_refused():
    program = _build_program(tensors=[("m", DType.BOOL, (3,), b"\x00\x01\x02")])
    with pytest.raises(NeffFormatError, match="bool tensor 'm' holds a byte other than 0 or 1"):
        decode(_rewrap(program))


def test_a_dangling_kernel_index_in_a_file_is_refused():
    program = _build_program(_stream_of([_raw_instruction(kernel=5)]))
    with pytest.raises(NeffFormatError, match="refers to kernel 5, but there are 0 kernels"):
        decode(_rewrap(program))


def test_overlapping_strings_are_refused_before_they_are_read():
    # 3,000 strings of 4 kB each, all inside one 20 kB string: 12 MB to check and decode.
    def build_kernel(builder):
        text = builder.CreateString(b"\x00\x10\x00\x00" * 5000)  # a length of 4096 at every 4th byte
        fb_kernel.StartOpsVector(builder, 3000)
        for k in range(3000, 0, -1):
            builder.PrependUOffsetTRelative(text - 4 * k)  # a string starting 4 * k bytes into `text`
        ops = builder.EndVector()
        name = builder.CreateString("k")
        fb_kernel.Start(builder)
        fb_kernel.AddName(builder, name)
        fb_kernel.AddOps(builder, ops)
        return fb_kernel.End(builder)

    program = _build_program(build_kernel=build_kernel)
    with pytest.raises(NeffFormatError, match=r"overlapping objects: .* \(in Program.kernels\[0\].ops\[\d+\]\)"):
        verifier.verify(program, "Program")


def test_a_stream_stored_twice_is_refused():
    program = _build_program(_stream_of([_raw_instruction()]), streams=2)
    with pytest.raises(NeffFormatError, match="stream VECTOR:0 appears twice"):
        decode(_rewrap(program))


# ----- Properties -----

# no deadline: a time limit is a timing assertion, and these machines are shared and noisy
_PROPERTY = settings(max_examples=300, deadline=None)


def _decodes_or_format_error(data: bytes) -> None:
    try:
        decode(data)
    except NeffFormatError:
        pass


@_PROPERTY
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_a_format_error(data):
    _decodes_or_format_error(data)


@_PROPERTY
@given(st.binary(min_size=4, max_size=512))
def test_random_bytes_with_the_neff_identifier_never_raise_anything_but_a_format_error(data):
    _decodes_or_format_error(data[:4] + b"NEFF" + data[4:])


_mutations = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(min_value=0), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)


def _mutate(data: bytes, mutations) -> bytes:
    data = bytearray(data)
    for kind, where, value in mutations:
        if not data:
            break
        pos = where % len(data)
        if kind == "set":
            data[pos] = value
        elif kind == "insert":
            data.insert(pos, value)
        else:
            del data[pos]
    return bytes(data)


@_PROPERTY
@given(_mutations)
def test_mutations_of_a_valid_neff_never_raise_anything_but_a_format_error(neff_bytes, mutations):
    _decodes_or_format_error(_mutate(neff_bytes, mutations))


@_PROPERTY
@given(_mutations)
def test_mutations_of_a_program_behind_correct_hashes_never_raise_anything_but_a_format_error(mutations):
    _decodes_or_format_error(_rewrap(_mutate(_small_program(), mutations)))


@_PROPERTY
@given(st.lists(st.tuples(st.integers(min_value=0), st.sampled_from([0, 1, 4, 0x80, 0xFF, 0x7F])), min_size=1,
                max_size=4))
def test_offsets_and_lengths_set_to_extremes_never_raise_anything_but_a_format_error(changes):
    program = bytearray(_small_program())
    for where, value in changes:
        pos = (where % (len(program) // 4)) * 4
        struct.pack_into("<I", program, pos, value * 0x01010101 if value in (0xFF, 0x7F) else value)
    _decodes_or_format_error(_rewrap(bytes(program)))


@functools.cache
def _small_program() -> bytes:
    """A program with a bit of everything, small enough to mutate quickly."""
    tile = _operand(Space.SBUF, DType.BF16, 1)
    neff = Neff(
        "small", "trn2",
        [TensorEntry("w", TensorKind.WEIGHT, DType.F32, (2,), 0, data=np.array([1.5, -2], np.float32)),
         TensorEntry("x", TensorKind.INPUT, DType.F32, (2,), 8, 0)],
        {(Engine.VECTOR, 0): [Instruction(Opcode.TENSOR_TENSOR, Engine.VECTOR, (tile, tile, tile), alu=AluOp.ADD,
                                          waits=(Wait(Engine.DMA, 1, 2),), kernel=0, debug=0)]},
        64, [DebugLoc("m.py", 3, "a", "aten.add")], [KernelInfo("add_0", ("aten.add",), 0, 5.0)],
    )
    return writer._encode_program(neff)


# ----- The schema, the generated code and the Python enums agree -----


@pytest.mark.parametrize(
    "python_enum, schema_name",
    [(Opcode, "Opcode"), (Engine, "Engine"), (Space, "Space"), (DType, "DType"), (AluOp, "AluOp"),
     (ActFunc, "ActFunc"), (TensorKind, "TensorKind")],
)
def test_schema_enums_mirror_the_python_enums(python_enum, schema_name):
    module = __import__(f"neuronc.neff.generated.{schema_name}", fromlist=[schema_name])
    generated = getattr(module, schema_name)
    members = {name: value for name, value in vars(generated).items() if not name.startswith("_")}
    assert members == {member.name: member.value for member in python_enum}


def test_the_verifier_reads_the_whole_schema_from_the_binary_schema():
    tables = verifier.schema()
    assert set(tables) == {"NeffFile", "Header", "Program", "Tensor", "Stream", "Instruction", "AccessPattern",
                           "DebugLoc", "Kernel", "Register", "Loop"}
    instruction = {field.name: field for field in tables["Instruction"].fields}
    assert instruction["opcode"].type.allowed == {op.value for op in Opcode}
    assert instruction["kernel"].default == -1 and instruction["operands"].required
    assert [f.name for f in tables["Header"].fields][:2] == ["format_major", "format_minor"]


def test_the_header_layout_is_frozen():
    # Older and newer neuroncs find the version here; appending fields is the only allowed change.
    fields = [field.name for field in verifier.schema()["Header"].fields]
    assert fields[:9] == ["format_major", "format_minor", "compiler_version", "target", "name", "content_hash",
                          "hbm_size", "estimated_ns", "header_hash"]
    assert [field.name for field in verifier.schema()["NeffFile"].fields][:2] == ["header", "program"]


def test_the_generated_code_is_up_to_date_with_the_schema():
    require_tool("flatc", "apt-get install flatbuffers-compiler")  # to compare the generated code with neff.fbs
    stale = regenerate.check()
    assert not stale, f"stale generated files {stale}: run `python -m neuronc.neff.regenerate`"


def test_the_stale_check_lists_a_file_that_differs():
    fresh = {name: data for name, data in
             ((p.name, p.read_bytes()) for p in regenerate.GENERATED.iterdir() if p.is_file())}
    assert regenerate.stale_files(fresh) == []
    fresh["Opcode.py"] += b"# changed\n"
    fresh["New.py"] = b""
    del fresh["Wait.py"]
    assert regenerate.stale_files(fresh) == ["New.py", "Opcode.py", "Wait.py"]



# ----- Programs changed and re-hashed: refused at load, never run wrong (issue 15) -----
# A changed program behind correct hashes is what a buggy writer or a hostile file looks like: the
# checksums pass, so the runtime's load checks (runtime/semantics.py, neuronc/neff/rules.py) decide.


@pytest.fixture(scope="module")
def mlp_program():
    """The zoo's MLP compiled: (NEFF bytes, inputs, outputs of a run)."""
    import torch

    from neuronc.compiler import CompileOptions, compile_exported
    from runtime import NeuronCore
    from tests import zoo

    model, inputs = zoo.build("mlp")
    neff = compile_exported(torch.export.export(model, inputs), CompileOptions(name="mlp")).neff
    inputs = [x.numpy() for x in inputs]
    return encode(neff), inputs, NeuronCore("trn2").load(neff).run(inputs).outputs


def _rehashed(data: bytes, change) -> bytes:
    """`data` decoded, changed in place by `change(neff)`, and encoded again (so its hashes are right)."""
    neff = decode(data)
    change(neff)
    return encode(neff)


def _load(data: bytes, **core_options):
    from runtime import NeuronCore

    return NeuronCore("trn2", **core_options).load(decode(data))


def _replace_operand(neff, find, change) -> Instruction:
    """Replace the first operand `find(instruction, position, operand)` accepts by `change(operand)`."""
    for stream in neff.streams.values():
        for i, inst in enumerate(stream):
            for k, ap in enumerate(inst.operands):
                if find(inst, k, ap):
                    operands = inst.operands[:k] + (change(ap),) + inst.operands[k + 1:]
                    stream[i] = dataclasses.replace(inst, operands=operands)
                    return stream[i]
    raise AssertionError("no such operand")


def _entry(neff, name: str) -> TensorEntry:
    return next(t for t in neff.tensors if t.name == name)


def _reads_weight(name: str):
    def find(neff):
        t = _entry(neff, name)
        return lambda inst, k, ap: k >= len(inst.writes) and ap.space == Space.HBM and t.offset <= ap.offset < \
            t.offset + t.nbytes
    return find


def _with_many_dims(data: bytes) -> bytes:
    """The MLP with the first HBM read of fc1.weight given 63 more dims of size 1: 65 in all."""
    return _rehashed(data, lambda neff: _replace_operand(
        neff, _reads_weight("fc1.weight")(neff), lambda ap: dataclasses.replace(ap, dims=ap.dims + ((1, 1),) * 63)))


@pytest.mark.parametrize("check_uninitialised", [True, False], ids=["checked", "unchecked"])
def test_an_operand_of_65_dimensions_is_refused_at_load_naming_the_instruction(mlp_program, check_uninitialised):
    data = _with_many_dims(mlp_program[0])
    with pytest.raises(NeuronRuntimeError) as raised:
        _load(data, check_uninitialised=check_uninitialised)  # used to load, then raise numpy's ValueError at run
    message = str(raised.value)
    assert re.search(r"DMA_COPY #\d+ on DMA queue \d+ \(kernel matmul_\d+\)", message), message
    assert "operand 1 has 65 dimensions; an access pattern has 1 to 32" in message
    assert "(65 dims)" in message and len(message) < 1000  # the operand is abbreviated, not 65 sizes long


def test_neuronc_inspect_exits_1_with_the_error_on_a_program_the_runtime_refuses(mlp_program, tmp_path):
    from click.testing import CliRunner

    from neuronc.cli import main

    path = tmp_path / "many_dims.neff"
    path.write_bytes(_with_many_dims(mlp_program[0]))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1, result.output
    assert "error: DMA_COPY" in result.output and "65 dimensions" in result.output
    assert "Traceback" not in result.output


def test_a_program_reading_hbm_that_its_bias_entry_no_longer_covers_is_refused(mlp_program):
    data = _rehashed(mlp_program[0], lambda neff: neff.tensors.remove(_entry(neff, "fc1.bias")))
    with pytest.raises(NeuronRuntimeError) as raised:  # used to run and return all-NaN outputs
        _load(data)
    message = str(raised.value)
    assert re.search(r"DMA_COPY #\d+ on DMA queue \d+ \(kernel \w+\) \[.*\]: operand 1 addresses HBM bytes "
                     r"\[\d+, \d+\), which no tensor of the program holds", message), message
    assert "hint:" in message


def test_a_program_without_its_output_entry_is_refused(mlp_program):
    data = _rehashed(mlp_program[0], lambda neff: neff.tensors.remove(_entry(neff, "output0")))
    with pytest.raises(NeuronRuntimeError, match=r"DMA_COPY #\d+ .*: operand 0 addresses HBM bytes .* which no "
                                                 r"tensor of the program holds"):  # used to run, returning []
        _load(data)


def _drop_output_stores(neff) -> None:
    out = _entry(neff, "output0")
    for key, stream in neff.streams.items():
        neff.streams[key] = [inst for inst in stream if not (
            inst.dst.space == Space.HBM and out.offset <= inst.dst.offset < out.offset + out.nbytes)]


def test_a_program_that_never_writes_its_output_is_refused(mlp_program):
    with pytest.raises(NeuronRuntimeError, match=r"never writes byte 0 of output 0 \('output0'"):
        _load(_rehashed(mlp_program[0], _drop_output_stores))


def test_a_program_writing_into_a_weight_is_refused(mlp_program):
    def store_into_weight(neff):
        out, weight = _entry(neff, "output0"), _entry(neff, "fc2.weight")
        _replace_operand(neff, lambda inst, k, ap: k == 0 and ap.space == Space.HBM and ap.offset == out.offset,
                         lambda ap: dataclasses.replace(ap, offset=weight.offset))

    with pytest.raises(NeuronRuntimeError, match=r"operand 0 writes HBM bytes \[\d+, \d+\) of weight 'fc2.weight', "
                                                 r"which is read-only"):
        _load(_rehashed(mlp_program[0], store_into_weight))


def test_a_destination_writing_a_byte_twice_is_refused(mlp_program):
    def broadcast_store(neff):
        _replace_operand(neff, lambda inst, k, ap: k == 0 and inst.opcode == Opcode.DMA_COPY and ap.space == Space.SBUF,
                         lambda ap: dataclasses.replace(ap, dims=(ap.dims[0], (0, ap.dims[1][1])) + ap.dims[2:]))

    with pytest.raises(NeuronRuntimeError, match=r"operand 0 addresses some bytes more than once"):
        _load(_rehashed(mlp_program[0], broadcast_store))


def test_a_compute_instruction_on_a_second_queue_of_its_engine_is_refused(mlp_program):
    def second_queue(neff):
        key = next(k for k in neff.streams if k[0] == Engine.TENSOR)
        neff.streams[(Engine.TENSOR, 1)] = [dataclasses.replace(inst, queue=1) for inst in neff.streams.pop(key)]

    with pytest.raises(NeuronRuntimeError, match="the TENSOR engine has one instruction queue, 0"):
        _load(_rehashed(mlp_program[0], second_queue))


@pytest.mark.parametrize("change, problem", [
    (lambda neff: setattr(_entry(neff, "x"), "offset", _entry(neff, "fc1.weight").offset),
     r"weight 'fc1.weight' .* and input 'x' .* share bytes; only scratch tensors may"),
    (lambda neff: neff.tensors.append(dataclasses.replace(_entry(neff, "x"), name="y", offset=neff.hbm_size - 1024)),
     r"the 2 inputs of program 'mlp' are numbered \[0, 0\], not 0..1 once each"),
    (lambda neff: neff.tensors.append(dataclasses.replace(_entry(neff, "output0"), index=1,
                                                          offset=neff.hbm_size - 512)),
     r"program 'mlp' has two outputs named 'output0'"),
    (lambda neff: setattr(neff, "hbm_size", -1), r"declares -1 bytes of HBM"),
], ids=["input-on-weight", "input-index-twice", "output-name-twice", "negative-hbm"])
def test_a_tensor_table_that_cannot_describe_a_run_is_refused(mlp_program, change, problem):
    with pytest.raises(NeuronRuntimeError, match=problem):
        _load(_rehashed(mlp_program[0], change))


def test_an_rng_position_that_is_not_a_number_is_refused_not_a_raw_error():
    from neuronc.codegen.rng import random_program
    from neuronc.targets import get_target
    from runtime import NeuronCore

    neff = random_program("uniform", (0.0, 1.0), (4, 8), DType.F32, get_target("trn2"))
    for stream in neff.streams.values():
        stream[:] = [dataclasses.replace(inst, imm1=math.nan) if inst.opcode == Opcode.RNG else inst for inst in stream]
    with pytest.raises(NeuronRuntimeError, match=r"RNG #\d+ on GPSIMD .*RNG element numbers imm0=.*imm1=nan must be "
                                                 r"whole, not negative and below 2\*\*63"):  # was int(nan)'s ValueError
        NeuronCore("trn2").load(decode(encode(neff)))


def test_the_compilers_own_programs_follow_the_rules(mlp_program):
    data, inputs, outputs = mlp_program
    assert [o.tobytes() for o in _load(data).run(inputs).outputs] == [o.tobytes() for o in outputs]


# ----- The rule the runtime's HBM relies on: every HBM operand lies inside one tensor entry -----


def _hbm(offset: int, dims: tuple, dtype=DType.F32) -> AccessPattern:
    return AccessPattern(Space.HBM, dtype, offset, dims)


def test_the_entry_covering_an_hbm_operand_is_the_one_holding_all_its_bytes():
    from neuronc.neff.rules import covering_entry

    a = TensorEntry("a", TensorKind.INPUT, DType.F32, (4, 8), 0, 0)  # bytes [0, 128)
    b = TensorEntry("b", TensorKind.WEIGHT, DType.F32, (16,), 128)  # bytes [128, 192)
    s1 = TensorEntry("s1", TensorKind.SCRATCH, DType.F32, (8,), 256)  # [256, 288), a slot's short tenant
    s2 = TensorEntry("s2", TensorKind.SCRATCH, DType.F32, (32,), 256)  # [256, 384), its long one
    tensors = [b, s1, a, s2]
    assert covering_entry(tensors, _hbm(0, ((8, 4), (1, 8)))) is a
    assert covering_entry(tensors, _hbm(4, ((8, 4), (1, 7)))) is a  # a sub-block
    assert covering_entry(tensors, _hbm(124, ((1, 2),))) is None  # straddles a and b, adjacent as they are
    assert covering_entry(tensors, _hbm(128, ((0, 128), (1, 16)))) is b  # a stride-0 broadcast of b
    assert covering_entry(tensors, _hbm(188, ((-1, 4),))) is b  # elements 188, 184, 180, 176
    assert covering_entry(tensors, _hbm(132, ((-1, 4),))) is None  # a negative stride reaching back into a
    assert covering_entry(tensors, _hbm(192, ((1, 1),))) is None  # a gap no entry holds
    assert covering_entry(tensors, _hbm(280, ((1, 4),))) is s2  # past the short tenant, inside the long one
    assert covering_entry(tensors, _hbm(380, ((1, 2),))) is None  # past the end of every entry
    assert covering_entry([], _hbm(0, ((1, 1),))) is None


# ----- The fuzzer (benchmarks/fuzz_neff.py): a few thousand cases, every one correct -----


@pytest.fixture(scope="module")
def fuzz_corpus(mlp_program, tmp_path_factory):
    """Base programs for the fuzzer: the MLP (already compiled) and codegen's random-number program."""
    from benchmarks import fuzz_neff

    directory = tmp_path_factory.mktemp("fuzz_corpus")
    data, inputs, _ = mlp_program
    (directory / "mlp.neff").write_bytes(data)
    np.savez(directory / "mlp.npz", *inputs)
    return fuzz_neff.build_corpus(str(directory), ["mlp", "rng"])


def test_fuzzed_neffs_end_in_a_documented_error_or_a_correct_run(fuzz_corpus):
    from benchmarks import fuzz_neff

    report = fuzz_neff.fuzz(fuzz_corpus, ["mlp", "rng"], seed=15, cases=2000, workers=2, timeout=120)
    assert not report.findings, "\n".join(
        f"case {f['case']} ({f['class']}, {f['base']}): {f['finding']}: {f['what']}\n{f['detail']}"
        for f in report.findings[:5])
    assert report.cases == 2000
    outcomes = collections.Counter()
    for (klass, outcome), count in report.by_class.items():
        outcomes[klass] += count
        outcomes[outcome.split(":")[0]] += count
    assert all(outcomes[klass] > 0 for klass in fuzz_neff.CLASSES), outcomes  # every kind of change was made
    for outcome in ("refused at read", "refused at load", "ran"):  # and they were refused at each stage, or ran
        assert outcomes[outcome] > 50, outcomes


def test_the_fuzzers_judgement_catches_a_runtime_that_runs_a_program_returning_memory_nothing_wrote(
        mlp_program, monkeypatch):
    from benchmarks import fuzz_neff
    from runtime.core import LoadedProgram

    data, inputs, outputs = mlp_program
    base = fuzz_neff.Base("mlp", data, decode(data), inputs, outputs)
    no_store = _rehashed(data, _drop_output_stores)
    assert fuzz_neff.judge(base, "program", "output stores dropped", no_store)["finding"] is None  # refused
    monkeypatch.setattr(LoadedProgram, "_check_outputs_written", lambda *args: None)  # a runtime without the rule
    judged = fuzz_neff.judge(base, "program", "output stores dropped", no_store)
    assert judged["outcome"] == "ran"
    assert judged["finding"] == "outputs depend on the contents of memory nothing wrote"


def test_an_empty_output_at_an_address_of_its_own_loads_and_runs(mlp_program):
    def add_empty_output(neff):
        out = _entry(neff, "output0")
        neff.tensors.append(dataclasses.replace(out, name="empty", shape=(0,), offset=neff.hbm_size + 64, index=1))
        neff.hbm_size += 128

    data, inputs, outputs = mlp_program
    got = _load(_rehashed(data, add_empty_output)).run(inputs).outputs  # was a TypeError in the access check
    assert [o.shape for o in got] == [outputs[0].shape, (0,)]
    assert got[0].tobytes() == outputs[0].tobytes()


def test_a_tensor_grown_to_gigabytes_is_refused_within_the_host_budget_not_with_a_memory_error(mlp_program,
                                                                                               monkeypatch):
    def grow_scratch(neff):
        k = max(i for i, t in enumerate(neff.tensors) if t.kind == TensorKind.SCRATCH)
        t = neff.tensors[k]
        neff.tensors[k] = dataclasses.replace(t, shape=(2**31 // 4,))  # 2 GiB, inside trn2's HBM
        neff.hbm_size = t.offset + 2**31

    monkeypatch.setenv("NEURONC_HOST_MEMORY_BUDGET", "1G")
    from neuronc.errors import DeviceOutOfMemoryError

    with pytest.raises(DeviceOutOfMemoryError, match=r"checking the memory accesses of 'mlp' needs \d+ bytes "
                                                     r"\(1\.5 GiB\) of host memory, more than the host budget of "
                                                     r"1073741824 bytes"):
        _load(_rehashed(mlp_program[0], grow_scratch))
