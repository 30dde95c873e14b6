"""Fuzz the NEFF reader and the runtime's load checks with damaged and hostile NEFFs.

Every case must end in a documented neuronc error or in a correct run: never in a crash, a hang, a raw
Python exception or a silently wrong result (issue 15). Base programs are NEFFs compiled from a few models
of the test zoo, plus codegen's random-number program (the one user of RNG). Each case takes one and changes
it in one way, chosen by its mutation class:

  bytes          raw byte damage anywhere in the file (set, flip, insert, delete, cut); nothing fixed up
  program-bytes  raw byte damage inside the program, then its hashes recomputed so that the checksums pass
  fields         flatbuffer-aware edits of the program, hashes recomputed: a table's vtable offset, a vtable
                 entry (a table's size, a field's place), an offset to a table, vector or string, a vector
                 or string length, an enum, a bool or another scalar (dims, offsets, counts, indices,
                 immediates) set to an edge value
  header         a header field (HBM size, target, format version, name, estimate, cache key) changed, and
                 the header's hash recomputed
  program        a change to the decoded program, re-encoded (and so re-hashed) by the writer: an operand's
                 dims, strides, offset, partition, dtype or space; an instruction's opcode, engine, queue,
                 ALU ops, activation, immediates, flags, waits, kernel or debug index; instructions dropped,
                 duplicated, swapped or moved to another stream; tensor entries removed, duplicated or
                 changed (offset, shape, dtype, kind, index, name, data); the HBM size
  preserving     a change that must not change what the program computes, re-encoded: a wait added, a
                 kernel or debug index, a scratch tensor's name or an estimate changed, streams or tensor
                 entries listed in another order, the HBM size grown

What counts as correct. A case is correct when reading, loading or running it raises a documented neuronc
error (a subclass of ``neuronc.errors.NeuronError``), or when it runs and
  * (class ``preserving``) its outputs are bit-identical to the unchanged program's;
  * (every other class) its outputs are a function of the program and its inputs alone: bit-identical on a
    second run, and, unless they are bit-identical to the unchanged program's (which passed this test),
    when the program runs again with all the memory nothing wrote holding another byte pattern (its HBM
    made with it, and its output and scratch tensors and the SBUF and PSUM it addresses filled with it
    before the run).
    The outputs may differ from the unchanged program's, since most changes make a legitimate new program
    (another ALU op, another weight, a NaN immediate): a NaN it computes is its answer. NaN read from
    memory that nothing wrote is not, and shows as a difference between the two fills.
Findings (each printed with its reproducer, ``--seed S --case N``): a crash (the child process died), a
hang (over ``--timeout``), a raw Python exception (ValueError, IndexError, KeyError, MemoryError,
RecursionError, ...), a NeffFormatError made by the reader's catch-all (its message names a raw exception:
a check the reader lacks), a run's NeuronRuntimeError caused by a raw exception other than the two that
depend on data (an indirect DMA index outside its table, an integer raised to a negative power: a check the
runtime lacks), outputs that differ between runs or between fills (so a silent all-NaN run, NaN read from
memory nothing wrote, is one), and a preserving change that changed the outputs. An all-NaN output that is
the same under both fills is computed (a NaN weight, a changed activation) and is counted, not a finding.

Cases run in child processes with an address-space limit (RLIMIT_AS) and a per-case timeout. A child runs
case after case (it keeps its imports, its decoded base programs and its NeuronCores); when one crashes or
hangs, it is replaced and the run goes on with the next case. A case is a pure function of (seed, case
number): the child makes it itself, so a reproducer needs nothing but those two numbers and the models.

    .venv/bin/python -m benchmarks.fuzz_neff --cases 100000            # from the repo root; 2 workers
    .venv/bin/python -m benchmarks.fuzz_neff --seed 0 --case 1234      # one case, with its traceback
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

import numpy as np

CLASSES = {  # mutation class -> weight in the mix
    "bytes": 1,
    "program-bytes": 2,
    "fields": 4,
    "header": 1,
    "program": 8,
    "preserving": 2,
}
MODELS = {  # base program -> weight in the mix (cheap programs more often: cases per second)
    "mlp": 8,
    "rng": 6,
    "recommender": 3,
    "cnn": 1,
    "moe": 1,
}
FILL = 0x3C  # the other byte pattern memory nobody wrote starts as, in the second run (0x3C3C3C3C: 0.0115f)
_CATCH_ALL = re.compile(r"corrupted NEFF \((\w+): ")  # reader.py's message for an exception no check names
# What a run may fail with that depends on the data, so no load check can see it (the runtime reports it as a
# NeuronRuntimeError caused by the exception): an indirect DMA's index outside its table, an integer raised to a
# negative power. Any other exception behind a run's NeuronRuntimeError is a check the runtime lacks.
_DATA_ERRORS = re.compile(r"^IndexError: index -?\d+ \(partition \d+\) is outside the table's \d+ rows$|"
                          r"^ValueError: Integers to negative integer powers are not allowed\.$")


# ---------------------------------------------------------------------------------------------
# The corpus: base programs, their inputs (made by the parent, which has torch)


def build_corpus(directory: str, models=tuple(MODELS)) -> str:
    """Compile ``models`` (names of tests/zoo.py, or "rng") into ``directory``: NAME.neff and NAME.npz (inputs)."""
    os.makedirs(directory, exist_ok=True)
    for name in models:
        neff_path = os.path.join(directory, f"{name}.neff")
        if os.path.exists(neff_path):
            continue
        neff, inputs = _compile(name)
        from neuronc.neff import save

        np.savez(os.path.join(directory, f"{name}.npz"), *inputs)
        save(neff, neff_path)
    return directory


def _compile(name: str):
    """(Neff, list of input arrays) of a base program."""
    if name == "rng":
        from neuronc.codegen.rng import random_program
        from neuronc.isa import DType
        from neuronc.targets import get_target

        neff = random_program("dropout", (0.25,), (4, 96), DType.F32, get_target("trn2"), DType.F32)
        x = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)
        return neff, [np.array([1234, 0], np.int64), x]
    import torch

    from neuronc.compiler import CompileOptions, compile_exported
    from tests import zoo

    model, inputs = zoo.build(name)
    compiled = compile_exported(torch.export.export(model, inputs), CompileOptions(name=name))
    return compiled.neff, [x.numpy() for x in inputs]


class Base(NamedTuple):
    name: str
    data: bytes  # the NEFF file
    neff: object  # decoded, never changed in place
    inputs: list
    outputs: list  # of the unchanged program, on a checked core


def _load_corpus(directory: str, models) -> dict:
    from neuronc.neff import decode

    corpus = {}
    for name in models:
        with open(os.path.join(directory, f"{name}.neff"), "rb") as f:
            data = f.read()
        with np.load(os.path.join(directory, f"{name}.npz"), allow_pickle=False) as npz:
            inputs = [npz[f"arr_{i}"] for i in range(len(npz.files))]
        neff = decode(data)
        outputs = _Runner.instance().checked(neff.target).load(neff).run(inputs).outputs
        corpus[name] = Base(name, data, neff, inputs, outputs)
    return corpus


# ---------------------------------------------------------------------------------------------
# Making a case: (seed, number) -> (class, base, what was done, NEFF bytes)


class Unencodable(Exception):
    """The writer refused the changed program (a value out of its field's range): no file to test."""


def make_case(corpus: dict, seed: int, number: int) -> tuple:
    rng = random.Random(f"neff-fuzz:{seed}:{number}")
    klass = rng.choices(list(CLASSES), weights=list(CLASSES.values()))[0]
    names = sorted(corpus)
    base = corpus[rng.choices(names, weights=[MODELS.get(n, 1) for n in names])[0]]
    what, data = _MAKERS[klass](rng, base)
    return klass, base, what, data


def _rehashed(base: Base, program: bytes, neff=None) -> bytes:
    """A NEFF file around ``program`` whose content hash and header hash are right (header fields: ``neff``'s)."""
    from neuronc.neff import writer

    return writer._encode_file(neff or base.neff, program, hashlib.sha256(program).hexdigest())


def _program_bytes(base: Base) -> bytes:
    from neuronc.neff.generated.NeffFile import NeffFile

    return NeffFile.GetRootAs(base.data).ProgramAsNumpy().tobytes()


def _damage(rng: random.Random, data: bytes) -> tuple:
    """Raw byte damage: 1-4 edits of set, flip, insert, delete, or a cut."""
    data = bytearray(data)
    edits = []
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        pos = rng.randrange(len(data))
        op = rng.choice(["set", "flip", "flip", "insert", "delete", "cut", "zero4", "ff4"])
        if op == "set":
            data[pos] = rng.randrange(256)
        elif op == "flip":
            data[pos] ^= 1 << rng.randrange(8)
        elif op == "insert":
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8])))
        elif op == "delete":
            del data[pos:pos + rng.choice([1, 4, 8])]
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos + 4] = (b"\x00" if op == "zero4" else b"\xff") * 4
        edits.append(f"{op}@{pos}")
    return " ".join(edits), bytes(data)


def _make_bytes(rng, base):
    what, data = _damage(rng, base.data)
    return f"file bytes: {what}", data


def _make_program_bytes(rng, base):
    what, program = _damage(rng, _program_bytes(base))
    return f"program bytes, rehashed: {what}", _rehashed(base, program)


# ----- Flatbuffer-aware edits -----


class Site(NamedTuple):
    pos: int
    fmt: str  # struct format character of the value stored there
    kind: str  # soffset | vtable | uoffset | length | enum | scalar
    name: str


_SITES: dict = {}  # base name -> its program's sites


def program_sites(program: bytes) -> list:
    """Every place in a Program flatbuffer whose value the reader interprets, found by walking it with the schema."""
    from neuronc.neff import verifier

    u32 = lambda at: struct.unpack_from("<I", program, at)[0]  # noqa: E731
    sites, seen = [Site(0, "I", "uoffset", "root offset")], set()

    def table(pos: int, kind) -> None:
        if pos in seen:
            return
        seen.add(pos)
        sites.append(Site(pos, "i", "soffset", f"{kind.name} vtable offset"))
        vtable = pos - struct.unpack_from("<i", program, pos)[0]
        vtable_size = struct.unpack_from("<H", program, vtable)[0]
        if vtable not in seen:
            seen.add(vtable)
            sites.extend(Site(vtable + 2 * k, "H", "vtable", f"{kind.name} vtable[{k}]")
                         for k in range(vtable_size // 2))
        for k, field in enumerate(kind.fields[:vtable_size // 2 - 2]):
            offset = struct.unpack_from("<H", program, vtable + 4 + 2 * k)[0]
            if offset:
                value(pos + offset, field.type, f"{kind.name}.{field.name}")

    def value(at: int, kind, name: str) -> None:
        if isinstance(kind, verifier.ScalarType):
            sites.append(Site(at, kind.fmt, "enum" if kind.allowed else "scalar", name))
        elif isinstance(kind, verifier.StructType):
            sites.extend(Site(at + offset, scalar.fmt, "enum" if scalar.allowed else "scalar", f"{name}.{field}")
                         for offset, field, scalar in kind.fields)
        else:
            sites.append(Site(at, "I", "uoffset", name))
            target = at + u32(at)
            if isinstance(kind, verifier.TableType):
                table(target, kind)
            elif kind is verifier.STRING:
                sites.append(Site(target, "I", "length", f"{name} length"))
            else:
                vector(target, kind, name)

    def vector(pos: int, kind, name: str) -> None:
        sites.append(Site(pos, "I", "length", f"{name} length"))
        count, element = u32(pos), kind.element
        size = element.size if isinstance(element, (verifier.ScalarType, verifier.StructType)) else 4
        positions = range(pos + 4, pos + 4 + count * size, size)
        if isinstance(element, verifier.ScalarType) and element.size == 1 and element.allowed is None:
            positions = sorted(set(positions[:2]) | set(positions[-2:]))  # bytes (weights): a few are enough
        for at in positions:
            value(at, element, f"{name}[]")

    table(u32(0), verifier.schema()["Program"])
    return sites


_RANGES = {"b": (-2**7, 2**7 - 1), "B": (0, 2**8 - 1), "h": (-2**15, 2**15 - 1), "H": (0, 2**16 - 1),
           "i": (-2**31, 2**31 - 1), "I": (0, 2**32 - 1), "q": (-2**63, 2**63 - 1), "Q": (0, 2**64 - 1)}


def _edge_value(rng: random.Random, site: Site, old, size: int, others: list):
    if site.fmt in "fd":
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, old * 2, -old,
                           rng.uniform(-1e3, 1e3)])
    lo, hi = _RANGES[site.fmt]
    if site.kind == "enum":
        candidates = [rng.randrange(lo, hi + 1), old + 1, old - 1, hi]
    elif site.kind == "uoffset":
        candidates = [0, 1, 2, 4, old + 4, old - 4, old + 8, old - 8, old + size // 2, size - site.pos,
                      size - site.pos - 4, 2**31 - 1, 2**32 - 1, 2**31, rng.randrange(2**32)]
    elif site.kind == "soffset":
        candidates = [old + 2, old - 2, old + 4, old - 4, old + 8, 0, -old, site.pos, site.pos - size,
                      2**31 - 1, -2**31]
    elif site.kind == "vtable":
        candidates = [0, 2, 4, old + 2, old - 2, old + 4, old - 4, old + 8, 2**16 - 1, 2**16 - 2, rng.randrange(2**16)]
    elif site.kind == "length":
        candidates = [0, 1, old + 1, old - 1, old * 2, old + 4, 2**31 - 1, 2**32 - 1, 2**20, rng.randrange(2**32)]
    else:
        candidates = [0, 1, -1, old + 1, old - 1, old * 2, -old, lo, hi, 2**31, 2**32, 2**40, 2**62,
                      old + rng.choice([-64, 64, 4096, -4096]), rng.randrange(lo, hi + 1)]
        if others:
            candidates.append(rng.choice(others))
    return min(max(rng.choice(candidates), lo), hi)


def _make_fields(rng, base):
    program = bytearray(_program_bytes(base))
    sites = _SITES.get(base.name)
    if sites is None:
        sites = _SITES[base.name] = program_sites(bytes(program))
    edits = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        site = rng.choice(sites)
        old = struct.unpack_from("<" + site.fmt, program, site.pos)[0]
        same = [s for s in sites if s.name == site.name and s.fmt == site.fmt]
        others = [struct.unpack_from("<" + s.fmt, program, s.pos)[0] for s in rng.sample(same, min(4, len(same)))]
        new = _edge_value(rng, site, old, len(program), others)
        struct.pack_into("<" + site.fmt, program, site.pos, new)
        edits.append(f"{site.name}@{site.pos}: {old} -> {new}")
    return "fields, rehashed: " + "; ".join(edits), _rehashed(base, bytes(program))


def _make_header(rng, base):
    neff = dataclasses.replace(base.neff)
    field = rng.choice(["hbm_size", "hbm_size", "target", "format_minor", "name", "estimated_ns", "cache_key"])
    if field == "hbm_size":
        value = rng.choice([0, -1, -2**63, base.neff.hbm_size - 1, base.neff.hbm_size // 2, base.neff.hbm_size + 1,
                            base.neff.hbm_size * 2, 2**31, 2**33, 2**40, 2**63 - 1])
    elif field == "target":
        value = rng.choice(["trn1", "trn3", "", "trn9", "TRN2", "trn2\x00", "ünï"])
    elif field == "format_minor":
        value = rng.choice([0, 65535, base.neff.format_minor + 1])
    elif field in ("name", "cache_key"):
        value = rng.choice(["", "x" * 10000, "ünïcode\u202e", "a\x00b", "0" * 64])
    else:
        value = rng.choice([math.nan, math.inf, -1.0, 0.0])
    setattr(neff, field, value)
    try:
        return f"header, rehashed: {field} = {value!r:.60}", _rehashed(base, _program_bytes(base), neff)
    except Exception as error:
        raise Unencodable(f"header {field} = {value!r:.60}: {error}") from None


# ----- Changes to the decoded program -----


def _copy(neff):
    return dataclasses.replace(neff, tensors=list(neff.tensors), streams={k: list(v) for k, v in neff.streams.items()},
                               kernels=list(neff.kernels), debug_locs=list(neff.debug_locs))


def _encoded(neff) -> bytes:
    from neuronc.errors import NeffFormatError
    from neuronc.neff import encode

    try:
        return encode(neff)
    except NeffFormatError as error:
        raise Unencodable(error.message) from None


def _pick_instruction(rng, neff) -> tuple:
    """(stream key, index, instruction) of a random instruction."""
    keys = [k for k, stream in neff.streams.items() if stream]
    key = rng.choice(keys)
    index = rng.randrange(len(neff.streams[key]))
    return key, index, neff.streams[key][index]


def _name(key, index, instr) -> str:
    return f"{instr.opcode.name}#{index} on {key[0].name}:{key[1]}"


def _int_edge(rng, old: int, scale: int = 1) -> int:
    return rng.choice([0, 1, -1, old + 1, old - 1, old * 2, -old, old + scale, old - scale, old + 64 * scale,
                       2**31 - 1, 2**40, 2**62, -2**62, rng.randrange(-1000, 1000)])


def _change_dims(rng, ap):
    dims = list(ap.dims)
    k = rng.randrange(len(dims))
    choice = rng.choice(["size", "size", "stride", "stride", "add", "add-many", "drop", "swap", "dup"])
    if choice == "size":
        dims[k] = (dims[k][0], rng.choice([0, -1, dims[k][1] + 1, dims[k][1] - 1, dims[k][1] * 2, 2**40, 129, 513]))
    elif choice == "stride":
        dims[k] = (rng.choice([0, -dims[k][0], dims[k][0] + 1, dims[k][0] - 1, dims[k][0] * 2, 2**40, -1]), dims[k][1])
    elif choice == "add":
        dims.insert(rng.randrange(len(dims) + 1), rng.choice([(1, 1), (0, 2), (1, 2), (64, 2)]))
    elif choice == "add-many":
        dims += [(1, 1)] * rng.choice([30, 31, 32, 63, 64, 65, 200])
    elif choice == "drop" and len(dims) > 0:
        del dims[k]
    elif choice == "swap" and len(dims) > 1:
        j = rng.randrange(len(dims))
        dims[k], dims[j] = dims[j], dims[k]
    else:
        dims.insert(k, dims[k])
    return dataclasses.replace(ap, dims=tuple(dims)), f"dims {choice}"


def _mutate_operand(rng, neff) -> str:
    from neuronc.isa import DType, Space

    key, index, instr = _pick_instruction(rng, neff)
    if not instr.operands:
        return "nothing"
    k = rng.randrange(len(instr.operands))
    ap = instr.operands[k]
    field = rng.choice(["dims", "dims", "dims", "offset", "offset", "partition", "dtype", "space", "other"])
    if field == "dims":
        ap, what = _change_dims(rng, ap)
    elif field == "offset":
        ap, what = dataclasses.replace(ap, offset=_int_edge(rng, ap.offset, ap.dtype.itemsize)), "offset"
    elif field == "partition":
        partition = rng.choice([0, 1, -1, ap.partition + 1, 127, 128, 64])
        ap, what = dataclasses.replace(ap, partition=partition), "partition"
    elif field == "dtype":
        ap, what = dataclasses.replace(ap, dtype=rng.choice(list(DType))), "dtype"
    elif field == "space":
        ap, what = dataclasses.replace(ap, space=rng.choice(list(Space))), "space"
    else:  # another operand of the program in its place
        _, _, other = _pick_instruction(rng, neff)
        ap, what = rng.choice(other.operands), "replaced"
    operands = instr.operands[:k] + (ap,) + instr.operands[k + 1:]
    neff.streams[key][index] = dataclasses.replace(instr, operands=operands)
    return f"{_name(key, index, instr)} operand {k} {what} -> {ap}"


def _mutate_instruction(rng, neff) -> str:
    from neuronc.isa import ActFunc, AluOp, Engine, Opcode, Wait

    key, index, instr = _pick_instruction(rng, neff)
    field = rng.choice(["opcode", "engine", "engine-moved", "queue", "alu", "alu1", "func", "imm0", "imm1",
                        "accumulate", "reverse", "waits", "waits", "waits", "kernel", "debug", "operands"])
    changes: dict = {}
    if field == "opcode":
        changes["opcode"] = rng.choice(list(Opcode))
    elif field in ("engine", "engine-moved"):
        changes["engine"] = rng.choice(list(Engine))
    elif field == "queue":
        changes["queue"] = rng.choice([0, 1, 2, 15, 16, -1, 2**31 - 1, instr.queue + 1])
    elif field in ("alu", "alu1"):
        changes[field] = rng.choice(list(AluOp))
    elif field == "func":
        changes["func"] = rng.choice(list(ActFunc))
    elif field in ("imm0", "imm1"):
        old = getattr(instr, field)
        changes[field] = rng.choice([0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e30, -1e30, 2.0**63, 0.5,
                                     old * 2, -old, old + 1, rng.uniform(-10, 10)])
    elif field in ("accumulate", "reverse"):
        changes[field] = not getattr(instr, field)
    elif field == "waits":
        waits = list(instr.waits)
        how = rng.choice(["drop", "add", "count", "stream"] if waits else ["add"])
        if how == "drop":
            del waits[rng.randrange(len(waits))]
        elif how == "add":
            engine, queue = rng.choice(list(neff.streams) + [(Engine.DMA, 9), (Engine.VECTOR, 3)])
            waits.append(Wait(engine, queue, rng.choice([0, 1, len(neff.streams.get((engine, queue), [])),
                                                         len(neff.streams.get((engine, queue), [])) + 1, 2**40, -5])))
        else:
            j = rng.randrange(len(waits))
            w = waits[j]
            if how == "count":
                waits[j] = w._replace(count=rng.choice([0, -1, w.count - 1, w.count + 1, w.count * 2, 2**62]))
            else:
                engine, queue = rng.choice(list(neff.streams))
                waits[j] = Wait(engine, queue, w.count)
        changes["waits"] = tuple(waits)
        field = f"waits {how}"
    elif field in ("kernel", "debug"):
        changes[field] = rng.choice([-1, 0, getattr(instr, field) + 1, getattr(instr, field) - 1])
    else:  # the operand list: one dropped, one repeated, or two swapped
        operands = list(instr.operands)
        how = rng.choice(["drop", "repeat", "swap"])
        if how == "drop" and operands:
            del operands[rng.randrange(len(operands))]
        elif how == "repeat" and operands:
            operands.insert(rng.randrange(len(operands) + 1), rng.choice(operands))
        elif len(operands) > 1:
            i, j = rng.sample(range(len(operands)), 2)
            operands[i], operands[j] = operands[j], operands[i]
        changes["operands"] = tuple(operands)
        field = f"operands {how}"
    new = dataclasses.replace(instr, **changes)
    if field == "engine-moved":  # into the stream of its new engine, where the runtime expects it
        del neff.streams[key][index]
        stream = neff.streams.setdefault(new.stream, [])
        stream.insert(rng.randrange(len(stream) + 1), new)
    else:
        neff.streams[key][index] = new
    return f"{_name(key, index, instr)} {field} -> {changes}"


def _mutate_stream(rng, neff) -> str:
    key, index, instr = _pick_instruction(rng, neff)
    stream = neff.streams[key]
    how = rng.choice(["drop", "drop", "duplicate", "swap", "move", "drop-stream", "truncate"])
    if how == "drop":
        del stream[index]
    elif how == "duplicate":
        stream.insert(rng.randrange(len(stream) + 1), instr)
    elif how == "swap" and len(stream) > 1:
        j = rng.randrange(len(stream))
        stream[index], stream[j] = stream[j], stream[index]
    elif how == "move":
        other = rng.choice(list(neff.streams))
        del stream[index]
        target = neff.streams[other]
        target.insert(rng.randrange(len(target) + 1), dataclasses.replace(instr, engine=other[0], queue=other[1]))
    elif how == "drop-stream":
        del neff.streams[key]
    else:
        del stream[index:]
    return f"stream {key[0].name}:{key[1]} {how} at {index} ({instr.opcode.name})"


def _mutate_tensors(rng, neff) -> str:
    from neuronc.isa import DType
    from neuronc.neff.program import TensorKind

    tensors = neff.tensors
    k = rng.randrange(len(tensors))
    t = tensors[k]
    how = rng.choice(["remove", "remove", "remove-kind", "offset", "shape", "dtype", "kind", "index", "name",
                      "duplicate", "data", "data-nan", "hbm_size", "grow"])
    if how == "remove":
        del tensors[k]
    elif how == "remove-kind":
        kind = rng.choice(list(TensorKind))
        neff.tensors = [x for x in tensors if x.kind != kind]
        how = f"remove every {kind.name}"
    elif how == "offset":
        tensors[k] = dataclasses.replace(t, offset=_int_edge(rng, t.offset, t.dtype.itemsize))
    elif how == "shape":
        shape = list(t.shape) or [1]
        j = rng.randrange(len(shape))
        shape[j] = rng.choice([0, shape[j] + 1, shape[j] - 1, shape[j] * 2, 2**40])
        if rng.random() < 0.3:
            shape = shape + [1] * rng.choice([1, 40, 70])
        tensors[k] = dataclasses.replace(t, shape=tuple(max(s, 0) for s in shape), data=None)  # a weight: no data
    elif how == "dtype":
        dtype = rng.choice(list(DType))
        with np.errstate(all="ignore"):
            data = None if t.data is None else t.data.astype(dtype.numpy)
        tensors[k] = dataclasses.replace(t, dtype=dtype, data=data)
    elif how == "kind":
        tensors[k] = dataclasses.replace(t, kind=rng.choice(list(TensorKind)))
    elif how == "index":
        tensors[k] = dataclasses.replace(t, index=rng.choice([-1, 0, 1, 2, t.index + 1, t.index - 1]))
    elif how == "name":
        tensors[k] = dataclasses.replace(t, name=rng.choice([x.name for x in tensors] + ["", "ünï"]))
    elif how == "duplicate":
        tensors.insert(rng.randrange(len(tensors) + 1), t)
    elif how == "grow":  # to gigabytes, within the target's HBM: what host memory can the runtime be made to take?
        nbytes = rng.choice([2**30, 2**33])
        tensors[k] = dataclasses.replace(t, shape=(nbytes // t.dtype.itemsize,), data=None)
        neff.hbm_size = max(neff.hbm_size, t.offset + nbytes)
        how = f"grown to {nbytes} bytes"
    elif how in ("data", "data-nan") and t.data is not None:
        values = np.random.default_rng(rng.randrange(2**32)).standard_normal(t.data.shape)
        data = np.full(t.data.shape, np.nan) if how == "data-nan" else values * 10
        with np.errstate(all="ignore"):
            tensors[k] = dataclasses.replace(t, data=data.astype(t.data.dtype) if t.data.dtype != bool else data > 0)
    else:
        neff.hbm_size = rng.choice([0, -1, neff.hbm_size // 2, neff.hbm_size - 1, neff.hbm_size + 1, 2**40])
        how = f"hbm_size -> {neff.hbm_size}"
    return f"tensor {t.name!r} ({t.kind.name}) {how}"


def _make_program(rng, base):
    neff = _copy(base.neff)
    changes = [rng.choices([_mutate_operand, _mutate_instruction, _mutate_stream, _mutate_tensors],
                           weights=[4, 4, 2, 3])[0](rng, neff) for _ in range(rng.choice([1, 1, 1, 2]))]
    return "program: " + "; ".join(changes), _encoded(neff)


def _make_preserving(rng, base):
    from neuronc.isa import Wait

    neff = _copy(base.neff)
    how = rng.choice(["wait", "wait", "kernel", "debug", "scratch-name", "estimates", "stream-order",
                      "tensor-order", "hbm_size"])
    if how == "wait":
        key, index, instr = _pick_instruction(rng, neff)
        engine, queue = rng.choice(list(neff.streams))
        count = rng.randrange(len(neff.streams[(engine, queue)]) + 1)
        neff.streams[key][index] = dataclasses.replace(instr, waits=instr.waits + (Wait(engine, queue, count),))
        how = f"{_name(key, index, instr)} also waits for {engine.name}:{queue} to reach {count}"
    elif how in ("kernel", "debug"):
        key, index, instr = _pick_instruction(rng, neff)
        count = len(neff.kernels if how == "kernel" else neff.debug_locs)
        neff.streams[key][index] = dataclasses.replace(instr, **{how: rng.randrange(-1, count)})
        how = f"{_name(key, index, instr)} {how} index changed"
    elif how == "scratch-name":
        scratch = [k for k, t in enumerate(neff.tensors) if t.kind.name == "SCRATCH"]
        if scratch:
            k = rng.choice(scratch)
            name = rng.choice([neff.tensors[j].name for j in scratch] + ["", "ünï", "x" * 300])
            neff.tensors[k] = dataclasses.replace(neff.tensors[k], name=name)
    elif how == "estimates":
        neff.estimated_ns = rng.choice([0.0, -1.0, math.nan, math.inf, 1e300])
        neff.kernels = [dataclasses.replace(k, estimated_ns=rng.choice([0.0, math.nan, -5.0])) for k in neff.kernels]
    elif how == "stream-order":
        keys = list(neff.streams)
        rng.shuffle(keys)
        neff.streams = {k: neff.streams[k] for k in keys}
    elif how == "tensor-order":
        rng.shuffle(neff.tensors)
    else:
        neff.hbm_size += rng.choice([1, 64, 4096])
    return f"preserving: {how}", _encoded(neff)


_MAKERS = {
    "bytes": _make_bytes,
    "program-bytes": _make_program_bytes,
    "fields": _make_fields,
    "header": _make_header,
    "program": _make_program,
    "preserving": _make_preserving,
}


# ---------------------------------------------------------------------------------------------
# Running a case (in a worker)


class _Runner:
    """A process's NeuronCores, per target: one that checks what it loads (the default) and one that does not
    check but fills the memory a program uses with FILL before each of its runs (``refilled_run``)."""

    _instance = None

    def __init__(self):
        self.cores: dict = {}

    @classmethod
    def instance(cls) -> "_Runner":
        if cls._instance is None:
            cls._instance = _Runner()
        return cls._instance

    def _pair(self, target: str) -> tuple:
        from runtime import NeuronCore

        if target not in self.cores:
            self.cores[target] = (NeuronCore(target), NeuronCore(target, check_uninitialised=False))
        return self.cores[target]

    def checked(self, target: str):
        return self._pair(target)[0]

    def refilled_run(self, neff, inputs: list) -> list:
        """The outputs of ``neff`` run on a core where all memory nothing wrote holds FILL, not 0xFF: the
        program's HBM is made with FILL, and an unchecked program's run refills the memory it uses but does
        not write (its output and scratch tensors, the box of SBUF and PSUM its operands address)."""
        import runtime.core
        import runtime.memory

        program = self._pair(neff.target)[1].load(neff)  # not checked: an unchecked program's runs refill
        usual = runtime.memory.UNINITIALISED
        runtime.memory.UNINITIALISED = runtime.core.UNINITIALISED = FILL  # (HBM is made at the first run)
        try:
            return program.run(inputs).outputs
        finally:
            runtime.memory.UNINITIALISED = runtime.core.UNINITIALISED = usual
            program.unload()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _all_nan(array: np.ndarray) -> bool:
    return _is_float(array) and array.size > 0 and bool(np.isnan(array.astype(np.float32)).all())


def _raw(result: dict, stage: str, error: BaseException) -> dict:
    result.update(outcome=f"raw exception at {stage}", finding=f"raw {type(error).__name__} at {stage}",
                  detail="".join(traceback.format_exception(error))[-3000:])
    return result


def run_case(corpus: dict, seed: int, number: int) -> dict:
    """The outcome of one case: {"case", "class", "base", "what", "outcome", "finding" (None when correct),
    "detail"}."""
    result = {"case": number, "class": None, "base": None, "what": None, "outcome": None, "finding": None,
              "detail": ""}
    try:
        klass, base, what, data = make_case(corpus, seed, number)
    except Unencodable as error:
        result.update(outcome="unencodable (the writer refused the change)", detail=str(error)[:300])
        return result
    except Exception as error:  # noqa: BLE001 - a bug of the fuzzer or of the writer: show it
        return _raw(result, "making the case", error)
    return judge(base, klass, what, data, result)


def judge(base: Base, klass: str, what: str, data: bytes, result: dict | None = None) -> dict:
    """Read, load and run the NEFF bytes ``data`` made from ``base`` by a change of class ``klass``, and say
    whether what happened is correct (see the module's docstring)."""
    from neuronc.errors import NeffFormatError, NeuronError
    from neuronc.neff import decode

    result = result if result is not None else {"case": None, "finding": None, "detail": ""}
    result.update({"class": klass, "base": base.name, "what": what[:500]})
    stage = "read"
    try:
        neff = decode(data)
        stage = "load"
        program = _Runner.instance().checked(neff.target).load(neff)
        stage = "run"
        try:
            first = program.run(base.inputs).outputs
            second = program.run(base.inputs).outputs
        finally:
            program.unload()
        # Outputs equal to the unchanged program's passed the refill test with it; others take it now.
        third = first if _same(first, base.outputs) else _Runner.instance().refilled_run(neff, base.inputs)
    except NeuronError as error:
        result.update(outcome=f"refused at {stage}: {type(error).__name__}", detail=error.message[:300])
        match = _CATCH_ALL.search(error.message) if isinstance(error, NeffFormatError) else None
        cause = error.__cause__
        if match:
            result["finding"] = f"the reader's catch-all reported a raw {match.group(1)}"
        elif stage == "run" and isinstance(cause, Exception) and not isinstance(cause, NeuronError) and \
                not _DATA_ERRORS.match(f"{type(cause).__name__}: {cause}"):
            result["finding"] = f"the runtime's catch-all reported a raw {type(cause).__name__}"
            result["detail"] = "".join(traceback.format_exception(cause))[-3000:]
        return result
    except Exception as error:  # noqa: BLE001 - every raw exception is a finding
        return _raw(result, stage, error)
    if not _same(first, second):
        result.update(outcome="ran", finding="outputs differ between two runs")
    elif not _same(first, third):  # (a silent all-NaN run: NaN read from memory nothing wrote, 0xFF bytes)
        result.update(outcome="ran", finding="outputs depend on the contents of memory nothing wrote")
    elif _same(first, base.outputs):
        result["outcome"] = "ran: same outputs"
    elif klass == "preserving":
        result.update(outcome="ran", finding="a preserving change changed the outputs")
    else:
        nan = any(_all_nan(o) and not _all_nan(b) for o, b in zip(first, base.outputs))
        result["outcome"] = "ran: changed outputs" + (" (all-NaN, computed)" if nan else "")
    return result


# ---------------------------------------------------------------------------------------------
# Workers: child processes with a memory limit, one case at a time, replaced when one dies or hangs


def _worker_main(corpus_dir: str, models: list, seed: int, memory_mb: int) -> None:
    import resource
    import warnings

    warnings.simplefilter("ignore")  # numpy's warnings about what a changed program computes are not findings
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    corpus = _load_corpus(corpus_dir, models)
    for base in corpus.values():  # the unchanged programs are correct, on both cores
        if not _same(_Runner.instance().refilled_run(base.neff, base.inputs), base.outputs):
            raise SystemExit(f"base program {base.name} depends on memory nothing wrote")
    protocol.write(json.dumps({"ready": True}) + "\n")
    while line := sys.stdin.readline():
        protocol.write(json.dumps(run_case(corpus, seed, int(line))) + "\n")


class _Worker:
    def __init__(self, args: list, env: dict):
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        cwd=_ROOT, bufsize=0)
        self.buffer = b""
        self.case = None  # the case it runs
        self.deadline = math.inf
        self.ready = False

    def send(self, case: int, timeout: float) -> None:
        self.case, self.deadline = case, time.monotonic() + timeout
        self.process.stdin.write(f"{case}\n".encode())

    def lines(self) -> list | None:
        """The complete lines now readable; None when the child has closed its end (died)."""
        chunk = os.read(self.process.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Report:
    seed: int
    cases: int = 0
    seconds: float = 0.0
    by_class: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    findings: list = dataclasses.field(default_factory=list)  # of result dicts
    results: list | None = None  # every result, when asked for

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


def fuzz(corpus_dir: str, models, *, seed: int = 0, cases: int = 1000, first: int = 0, workers: int = 2,
         timeout: float = 60.0, memory_mb: int = 4096, progress=None, keep_results: bool = False,
         log=None) -> Report:
    """Run cases first..first+cases-1 of ``seed`` in ``workers`` child processes; returns the Report.
    ``log``: a text file to write every case's result to, one JSON object a line."""
    models = list(models)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args = [sys.executable, "-m", "benchmarks.fuzz_neff", "--worker", "--corpus", corpus_dir,
            "--models", ",".join(models), "--seed", str(seed), "--memory-mb", str(memory_mb)]
    report = Report(seed, results=[] if keep_results else None)
    todo = collections.deque(range(first, first + cases))
    pool = [_Worker(args, env) for _ in range(max(1, min(workers, cases)))]
    start = last_progress = time.monotonic()
    startup = 300.0  # seconds a new worker may take to import and decode the corpus

    def record(result: dict) -> None:
        report.cases += 1
        report.by_class[(result["class"], result["outcome"])] += 1
        if result["finding"]:
            report.findings.append(result)
        if report.results is not None:
            report.results.append(result)
        if log is not None:
            log.write(json.dumps(result) + "\n")

    def replace(worker: _Worker, finding: str) -> _Worker:
        if worker.case is not None:
            record({"case": worker.case, "class": "?", "base": "?", "what": "?", "outcome": finding,
                    "finding": finding, "detail": ""})
        worker.kill()
        fresh = _Worker(args, env)
        fresh.deadline = time.monotonic() + startup
        return fresh

    for worker in pool:
        worker.deadline = time.monotonic() + startup
    try:
        while todo or any(w.case is not None for w in pool):
            for worker in pool:
                if worker.ready and worker.case is None and todo:
                    worker.send(todo.popleft(), timeout)
            readable, _, _ = select.select([w.process.stdout for w in pool], [], [],
                                           max(0.0, min(w.deadline for w in pool) - time.monotonic()) + 0.01)
            for k, worker in enumerate(pool):
                if worker.process.stdout in readable:
                    lines = worker.lines()
                    if lines is None:
                        status = worker.process.wait()
                        if not worker.ready and worker.case is None:
                            raise RuntimeError(f"a fuzz worker failed to start (exit status {status}); run "
                                               f"`{' '.join(args)}` to see why")
                        pool[k] = replace(worker, f"crash (exit status {status})")
                        continue
                    for line in lines:
                        if line.get("ready"):
                            worker.ready, worker.deadline = True, math.inf
                        else:
                            record(line)
                            worker.case, worker.deadline = None, math.inf
                elif time.monotonic() > worker.deadline:
                    if not worker.ready:
                        raise RuntimeError("a fuzz worker took too long to start")
                    pool[k] = replace(worker, f"hang (over {timeout:.0f} s)")
            now = time.monotonic()
            if progress and now - last_progress > 10:
                last_progress = now
                report.seconds = now - start
                progress(report)
    finally:
        for worker in pool:
            worker.kill()
    report.seconds = time.monotonic() - start
    return report


# ---------------------------------------------------------------------------------------------
# Command line


def _print_report(report: Report, models: list) -> None:
    print(f"\n{report.cases} cases in {report.seconds:.0f} s: {report.rate:.1f} cases/s")
    print("outcomes by class:")
    for (klass, outcome), count in sorted(report.by_class.items(), key=lambda kv: (str(kv[0][0]), -kv[1])):
        print(f"  {str(klass):<14} {outcome:<58} {count:>8}")
    print(f"findings: {len(report.findings)}")
    for finding in report.findings:
        print(f"- case {finding['case']} ({finding['class']}, {finding['base']}): {finding['finding']}")
        print(f"  what: {finding['what']}")
        if finding["detail"]:
            print("  " + finding["detail"].strip().replace("\n", "\n  ")[-1500:])
        print(f"  reproduce: .venv/bin/python -m benchmarks.fuzz_neff --models {','.join(models)} "
              f"--seed {report.seed} --case {finding['case']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--first", type=int, default=0, help="number of the first case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space limit of a worker")
    parser.add_argument("--models", default=",".join(MODELS), help="base programs: zoo model names, or rng")
    parser.add_argument("--corpus", help="directory of compiled base programs (made if missing; default: temporary)")
    parser.add_argument("--case", type=int, help="run this one case in a child and show its outcome in full")
    parser.add_argument("--log", help="write every case's result to this file, one JSON object a line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.worker:
        _worker_main(args.corpus, models, args.seed, args.memory_mb)
        return 0
    corpus = args.corpus or tempfile.mkdtemp(prefix="fuzz_neff_")
    try:
        start = time.monotonic()
        build_corpus(corpus, models)
        print(f"base programs {', '.join(models)} compiled in {time.monotonic() - start:.0f} s", flush=True)
        if args.case is not None:
            report = fuzz(corpus, models, seed=args.seed, cases=1, first=args.case, workers=1,
                          timeout=args.timeout, memory_mb=args.memory_mb, keep_results=True)
            (result,) = report.results
            for key in ("class", "base", "what", "outcome", "finding", "detail"):
                print(f"{key}: {result[key]}")
            return 1 if report.findings else 0

        def progress(report: Report) -> None:
            print(f"  {report.cases}/{args.cases} cases, {report.rate:.1f}/s, findings {len(report.findings)}",
                  flush=True)

        print(f"fuzzing: seed {args.seed}, cases {args.first}..{args.first + args.cases - 1}, {args.workers} workers, "
              f"timeout {args.timeout:.0f} s, address space {args.memory_mb} MiB per worker", flush=True)
        with open(args.log or os.devnull, "w") as log:
            report = fuzz(corpus, models, seed=args.seed, cases=args.cases, first=args.first, workers=args.workers,
                          timeout=args.timeout, memory_mb=args.memory_mb, progress=progress, log=log)
        _print_report(report, models)
        return 1 if report.findings else 0
    finally:
        if not args.corpus:
            shutil.rmtree(corpus, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
