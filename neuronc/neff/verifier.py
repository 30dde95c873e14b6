"""Check a NEFF before anything in it is trusted.

The Python flatbuffers runtime has no verifier: it follows whatever offsets a buffer holds, so a
truncated or hostile file makes a read raise IndexError or struct.error from deep inside, or
quietly return garbage. `verify` walks a buffer first, as flatbuffers' C++ verifier does, and
raises NeffFormatError naming the first problem and where it is. It is driven by the binary
schema `generated/neff.bfbs` that flatc makes from neff.fbs, so it can never disagree with the
schema.

Also here, because both the writer and the reader need them: `header_digest`, the checksum that
protects the header as `content_hash` protects the program, and `check_references`, the rules a
decoded NEFF must follow that the schema cannot express.
"""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import struct
from typing import NamedTuple

from flatbuffers import table as fb_table

from neuronc.errors import NeffFormatError
from neuronc.isa import LOOP_INDEX, Engine, Space

BFBS = pathlib.Path(__file__).resolve().parent / "generated" / "neff.bfbs"
NAMESPACE = "neuronc.neff.generated."

DAMAGED = "the file is damaged or was cut short; compile the model again"
MAX_DEPTH = 64  # tables nested deeper than this are refused (the NEFF schema needs 5)
MAX_TABLES = 1 << 22  # distinct tables one buffer may hold (a program has 1 to 5 per instruction)

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16x2 = struct.Struct("<HH")


# ----- The schema -----


class ScalarType:
    def __init__(self, name: str, fmt: str, allowed: frozenset | None = None):
        self.name = name  # for messages: "ubyte", or the enum's name
        self.fmt = fmt  # struct format character
        self.struct = struct.Struct("<" + fmt)
        self.size = self.struct.size
        self.allowed = allowed  # the values an enum (or a bool) may hold; None: any


class StructType:
    def __init__(self, name: str, size: int, align: int, fields: list):
        """`fields`: (byte offset, name, ScalarType), in order of offset."""
        self.name = name
        self.size = size
        self.align = align
        self.fields = tuple(fields)
        layout, end = "<", 0
        for offset, _, scalar in fields:
            layout += "x" * (offset - end) + scalar.fmt
            end = offset + scalar.size
        self.struct = struct.Struct(layout + "x" * (size - end))  # unpacks to one value per field
        # (index in the unpacked tuple, field name, ScalarType) of the fields whose values are restricted
        self.checks = tuple((i, name, scalar) for i, (_, name, scalar) in enumerate(fields) if scalar.allowed)


class StringType:
    name = "string"


STRING = StringType()


class VectorType:
    name = "vector"

    def __init__(self, element):
        self.element = element  # ScalarType | StructType | StringType | TableType


class TableType:
    def __init__(self, name: str):
        self.name = name
        self.fields = []  # of Field, indexed by field id; filled in once every type exists
        self.align = 4  # the largest alignment of a field (at least a table's own)


class Field(NamedTuple):
    name: str
    type: object  # ScalarType | StructType | StringType | VectorType | TableType
    required: bool
    default: object  # the value of an absent scalar field; None for the others
    size: int  # bytes the field takes inside its table
    align: int


# Reflection BaseType values (flatbuffers' reflection.fbs) of scalars -> (name, struct format).
_SCALARS = {2: ("bool", "B"), 3: ("byte", "b"), 4: ("ubyte", "B"), 5: ("short", "h"), 6: ("ushort", "H"),
            7: ("int", "i"), 8: ("uint", "I"), 9: ("long", "q"), 10: ("ulong", "Q"), 11: ("float", "f"),
            12: ("double", "d")}
_BOOL, _STRING, _VECTOR, _OBJ = 2, 13, 14, 15


class _Reflected:
    """A table of the binary schema, its fields addressed by their id in reflection.fbs."""

    def __init__(self, buf: bytes, pos: int):
        self._table = fb_table.Table(buf, pos)

    def _at(self, field_id: int) -> int:
        offset = self._table.Offset(4 + 2 * field_id)
        return offset + self._table.Pos if offset else 0

    def scalar(self, field_id: int, fmt: str, default=0):
        at = self._at(field_id)
        return struct.unpack_from("<" + fmt, self._table.Bytes, at)[0] if at else default

    def string(self, field_id: int) -> str:
        at = self._at(field_id)
        return self._table.String(at).decode() if at else ""

    def table(self, field_id: int) -> "_Reflected":
        return _Reflected(self._table.Bytes, self._table.Indirect(self._at(field_id)))

    def tables(self, field_id: int) -> list:
        at = self._at(field_id)
        if not at:
            return []
        start = self._table.Indirect(at)
        count = _U32.unpack_from(self._table.Bytes, start)[0]
        return [_Reflected(self._table.Bytes, self._table.Indirect(start + 4 + 4 * i)) for i in range(count)]


def _load_schema(bfbs: bytes) -> dict:
    """{table name without namespace: TableType} from a binary schema (reflection.fbs layout).

    Supports what neff.fbs uses: scalars, enums, strings, tables, structs of scalars and vectors
    of those; not unions, fixed-size arrays or nested structs.
    """
    schema = _Reflected(bfbs, _U32.unpack_from(bfbs, 0)[0])
    objects, enums = schema.tables(0), schema.tables(1)

    def unsupported(what: str) -> ValueError:
        return ValueError(f"{BFBS}: {what} is not supported by neuronc.neff.verifier")

    def scalar(base_type: int, enum_index: int) -> ScalarType:
        name, fmt = _SCALARS[base_type]
        if enum_index >= 0:
            enum = enums[enum_index]
            values = frozenset(value.scalar(1, "q") for value in enum.tables(1))
            return ScalarType(enum.string(0).removeprefix(NAMESPACE), fmt, values)
        return ScalarType(name, fmt, frozenset((0, 1)) if base_type == _BOOL else None)

    tables = {}
    types = []  # by object index: a StructType, or a TableType whose fields are filled in below
    for obj in objects:
        name = obj.string(0).removeprefix(NAMESPACE)
        if not obj.scalar(2, "?", False):
            types.append(tables.setdefault(name, TableType(name)))
            continue
        fields = []
        for field in obj.tables(1):
            ftype = field.table(1)
            if ftype.scalar(0, "b") not in _SCALARS:
                raise unsupported(f"struct {name} with a field of base type {ftype.scalar(0, 'b')}")
            offset = field.scalar(3, "H")
            fields.append((offset, field.string(0), scalar(ftype.scalar(0, "b"), ftype.scalar(2, "i", -1))))
        types.append(StructType(name, obj.scalar(4, "i"), obj.scalar(3, "i"), sorted(fields)))

    def element(base_type: int, index: int):
        if base_type == _STRING:
            return STRING
        if base_type == _OBJ:
            return types[index]
        if base_type in _SCALARS:
            return scalar(base_type, index)
        raise unsupported(f"base type {base_type}")

    for obj, table in zip(objects, types):
        if isinstance(table, StructType):
            continue
        for field_id, field in enumerate(sorted(obj.tables(1), key=lambda f: f.scalar(2, "H"))):
            assert field.scalar(2, "H") == field_id, "flatc numbers the fields of a table 0, 1, 2, ..."
            ftype = field.table(1)
            base_type, elem, index = ftype.scalar(0, "b"), ftype.scalar(1, "b"), ftype.scalar(2, "i", -1)
            kind = VectorType(element(elem, index)) if base_type == _VECTOR else element(base_type, index)
            default = None
            if isinstance(kind, ScalarType):
                default = field.scalar(5, "d", 0.0) if kind.fmt in "fd" else field.scalar(4, "q", 0)
            size, align = (kind.size, kind.size) if isinstance(kind, ScalarType) else (4, 4)  # 4: an offset
            if isinstance(kind, StructType):
                size, align = kind.size, kind.align
            table.fields.append(Field(field.string(0), kind, field.scalar(7, "?", False), default, size, align))
            table.align = max(table.align, align)
    return tables


@functools.cache
def schema() -> dict:
    """The NEFF schema's tables by name ("NeffFile", "Program", ...), read once from neff.bfbs."""
    return _load_schema(BFBS.read_bytes())


# ----- The walk -----


class _Invalid(Exception):
    """A problem found while walking; `path` is filled in on the way out (innermost first)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem
        self.path = []


class _Walk:
    """One verification. Hot: called for every table of a program of maybe 100,000 tables."""

    def __init__(self, buf, max_depth: int, max_tables: int):
        self.buf = buf
        self.size = len(buf)
        self.max_depth = max_depth
        self.max_tables = max_tables
        self.tables = 0
        # (offset, type) of what is already verified: a shared table or vector is walked once, so
        # a buffer whose offsets all point at the same few objects cannot make the walk explode.
        self.done = set()
        # Bytes left for the objects (tables, vectors, strings) not yet verified. Objects do not
        # overlap, so they add up to at most the buffer; a buffer of many overlapping long strings
        # or vectors, which would take time and memory quadratic in its size to read, is refused.
        self.unclaimed = self.size
        self.layouts = {}  # (vtable, TableType, table offset % its alignment) -> what `layout` returns

    def outside(self, pos: int, length: int) -> bool:
        return pos < 0 or pos + length > self.size

    def truncated(self, pos: int, what: str) -> _Invalid:
        return _Invalid(f"truncated: {what} at offset {pos} extends past the end of the buffer ({self.size} bytes)")

    def claim(self, pos: int, length: int, what: str) -> None:
        self.unclaimed -= length
        if self.unclaimed < 0:
            raise _Invalid(
                f"overlapping objects: with the {what} at offset {pos}, the objects add up to more than the "
                f"buffer's {self.size} bytes"
            )

    @staticmethod
    def misaligned(pos: int, align: int, what: str) -> _Invalid:
        return _Invalid(f"misaligned: {what} at offset {pos} is not {align}-byte aligned")

    @staticmethod
    def bad_value(value, kind: ScalarType, what: str) -> _Invalid:
        return _Invalid(f"{what} holds {value}, which is not a valid {kind.name}")

    def table(self, pos: int, kind: TableType, depth: int) -> None:
        if (pos, kind) in self.done:
            return
        if depth > self.max_depth:
            raise _Invalid(f"tables nested more than {self.max_depth} deep")
        self.tables += 1
        if self.tables > self.max_tables:
            raise _Invalid(f"more than {self.max_tables} tables")
        if self.outside(pos, 4):
            raise self.truncated(pos, f"{kind.name} table")
        if pos % 4:
            raise self.misaligned(pos, 4, f"{kind.name} table")
        vtable = pos - _I32.unpack_from(self.buf, pos)[0]
        key = (vtable, kind, pos % kind.align)
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = self.layout(pos, vtable, kind)
        table_size, fields = layout
        if self.outside(pos, table_size):
            raise self.truncated(pos, f"{kind.name} table")
        self.claim(pos, table_size, f"{kind.name} table")
        for field, offset in fields:
            ftype = field.type
            if isinstance(ftype, ScalarType):
                value = ftype.struct.unpack_from(self.buf, pos + offset)[0]
                if value not in ftype.allowed:
                    raise self.bad_value(value, ftype, f"field {kind.name}.{field.name}")
                continue
            try:
                self.child(pos + offset, ftype, depth)
            except _Invalid as invalid:
                invalid.path.append(field.name)
                raise
        self.done.add((pos, kind))

    def layout(self, pos: int, vtable: int, kind: TableType) -> tuple:
        """Check a vtable for a table at `pos`; return the table's size and the fields whose values
        need checking, as (Field, offset) pairs. Tables that share the vtable (and `pos` modulo the
        alignment) share the result: the builder writes one vtable for many tables."""
        if self.outside(vtable, 4):
            raise self.truncated(vtable, f"vtable of {kind.name}")
        if vtable % 2:
            raise self.misaligned(vtable, 2, f"vtable of {kind.name}")
        vtable_size, table_size = _U16x2.unpack_from(self.buf, vtable)
        if vtable_size < 4 or vtable_size % 2:
            raise _Invalid(f"vtable of {kind.name} at offset {vtable} has a bad size {vtable_size}")
        if table_size < 4:
            raise _Invalid(f"{kind.name} table at offset {pos} has a bad size {table_size}")
        if self.outside(vtable, vtable_size):
            raise self.truncated(vtable, f"vtable of {kind.name}")
        known = min(len(kind.fields), vtable_size // 2 - 2)  # a newer writer may add fields: ignore them
        offsets = struct.unpack_from(f"<{known}H", self.buf, vtable + 4) + (0,) * (len(kind.fields) - known)
        checked = []
        for field, offset in zip(kind.fields, offsets):
            if offset == 0:
                if field.required:
                    raise _Invalid(f"required field {kind.name}.{field.name} is missing")
                continue
            if offset < 4 or offset + field.size > table_size:
                raise _Invalid(f"field {field.name} at offset {offset} lies outside its table ({table_size} bytes)")
            if (pos + offset) % field.align:
                raise self.misaligned(pos + offset, field.align, f"field {field.name}")
            if not isinstance(field.type, ScalarType) or field.type.allowed is not None:
                checked.append((field, offset))
        return table_size, tuple(checked)

    def child(self, at: int, kind, depth: int) -> None:
        """Check the struct stored at `at`, or what the offset stored at `at` points to."""
        if isinstance(kind, StructType):
            self.check_struct(kind.struct.unpack_from(self.buf, at), kind)
            return
        offset = _U32.unpack_from(self.buf, at)[0]
        if offset == 0 or offset >= 1 << 31:
            raise _Invalid(f"bad offset {offset} at offset {at}")
        target = at + offset
        if self.outside(target, 4):
            raise self.truncated(target, f"{kind.name} table" if isinstance(kind, TableType) else kind.name)
        if isinstance(kind, TableType):
            self.table(target, kind, depth + 1)
        elif kind is STRING:
            self.string(target)
        else:
            self.vector(target, kind, depth)

    def check_struct(self, values: tuple, kind: StructType) -> None:
        for index, name, scalar in kind.checks:
            if values[index] not in scalar.allowed:
                raise self.bad_value(values[index], scalar, f"{kind.name}.{name}")

    def string(self, pos: int) -> None:
        if (pos, STRING) in self.done:
            return
        if pos % 4:
            raise self.misaligned(pos, 4, "string")
        length = _U32.unpack_from(self.buf, pos)[0]
        if self.outside(pos, 4 + length + 1):
            raise self.truncated(pos, f"string of {length} bytes")
        if self.buf[pos + 4 + length] != 0:
            raise _Invalid(f"string at offset {pos} is not NUL-terminated")
        self.claim(pos, 4 + length + 1, "string")
        try:
            bytes(self.buf[pos + 4 : pos + 4 + length]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise _Invalid(f"string at offset {pos} is not valid UTF-8 ({error.reason})") from None
        self.done.add((pos, STRING))

    def vector(self, pos: int, kind: VectorType, depth: int) -> None:
        if (pos, kind) in self.done:
            return
        if pos % 4:
            raise self.misaligned(pos, 4, "vector")
        count = _U32.unpack_from(self.buf, pos)[0]
        element = kind.element
        start = pos + 4
        if isinstance(element, (ScalarType, StructType)):
            if self.outside(pos, 4 + count * element.size):
                raise self.truncated(pos, f"vector of {count} {element.name}")
            self.claim(pos, 4 + count * element.size, "vector")
            align = element.size if isinstance(element, ScalarType) else element.align
            if start % align:
                raise self.misaligned(start, align, f"vector of {element.name}")
            if isinstance(element, StructType):
                if element.checks:
                    elements = element.struct.iter_unpack(self.buf[start : start + count * element.size])
                    for i, values in enumerate(elements):
                        try:
                            self.check_struct(values, element)
                        except _Invalid as invalid:
                            invalid.path.append(f"[{i}]")
                            raise
            elif element.allowed is not None:
                for i, value in enumerate(struct.unpack_from(f"<{count}{element.fmt}", self.buf, start)):
                    if value not in element.allowed:
                        invalid = self.bad_value(value, element, "element")
                        invalid.path.append(f"[{i}]")
                        raise invalid
        else:
            if self.outside(pos, 4 + count * 4):
                raise self.truncated(pos, f"vector of {count} offsets")
            self.claim(pos, 4 + count * 4, "vector")
            for i in range(count):
                try:
                    self.child(start + 4 * i, element, depth)
                except _Invalid as invalid:
                    invalid.path.append(f"[{i}]")
                    raise
        self.done.add((pos, kind))


def verify(buf, root: str = "NeffFile", *, max_depth: int = MAX_DEPTH, max_tables: int = MAX_TABLES) -> None:
    """Check that `buf` is a well-formed flatbuffer whose root is the table `root` of neff.fbs.

    Checks every offset (root, vtable, field, table, vector, string) lies inside the buffer and is
    aligned, vector and string lengths fit, strings are NUL-terminated UTF-8, enums and bools
    hold known values and required fields are present. A nested flatbuffer is checked as a byte
    vector only: verify it with its own root once it is known to be of a readable version.
    """
    kind = schema()[root]
    walk = _Walk(buf, max_depth, max_tables)
    try:
        if walk.outside(0, 4):
            raise walk.truncated(0, "root offset")
        walk.child(0, kind, 0)
    except _Invalid as invalid:
        where = root + "".join(part if part.startswith("[") else "." + part for part in reversed(invalid.path))
        raise NeffFormatError(f"{invalid.problem} (in {where})", hint=DAMAGED) from None


# ----- Beyond the flatbuffer structure -----


def header_digest(format_major, format_minor, compiler_version, target, name, content_hash, hbm_size,
                  estimated_ns) -> str:
    """sha256 (hex) of the header fields in a canonical text form (floats exactly, as float.hex)."""
    canonical = json.dumps(
        [format_major, format_minor, compiler_version, target, name, content_hash, hbm_size, float(estimated_ns).hex()]
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_references(neff) -> None:
    """Every kernel and debug-location index of a Neff points into its tables (or is -1)."""
    kernels, locs = len(neff.kernels), len(neff.debug_locs)
    for (engine, queue), stream in neff.streams.items():
        for i, inst in enumerate(stream):
            if not -1 <= inst.kernel < kernels:
                raise NeffFormatError(
                    f"instruction {i} of stream {Engine(engine).name}:{queue} refers to kernel {inst.kernel}, "
                    f"but there are {kernels} kernels"
                )
            if not -1 <= inst.debug < locs:
                raise NeffFormatError(
                    f"instruction {i} of stream {Engine(engine).name}:{queue} refers to debug location "
                    f"{inst.debug}, but there are {locs} debug locations"
                )
    for n, loop in enumerate(getattr(neff, "loops", ())):
        for (engine, queue), stream in loop.streams.items():
            for i, inst in enumerate(stream):
                if not -1 <= inst.kernel < kernels or not -1 <= inst.debug < locs:
                    raise NeffFormatError(f"instruction {i} of loop {n}'s stream {Engine(engine).name}:{queue} refers "
                                          f"to kernel {inst.kernel} or debug location {inst.debug}, of {kernels} and {locs}")
    _check_loops(neff)
    for kernel in neff.kernels:
        if not -1 <= kernel.debug < locs:
            raise NeffFormatError(
                f"kernel {kernel.name!r} refers to debug location {kernel.debug}, but there are {locs} debug locations"
            )


MAX_REGISTERS = 64  # registers a program may declare (a stated bound)
MAX_TERMS = 8  # terms an operand's offset or a tensor's rows may have (a stated bound)
MAX_COEFFICIENT = 1 << 40  # bytes a term may add per unit of its value (HBM is far smaller)
REGISTER_MAX = (1 << 31) - 1  # registers are 32-bit ("a bound must be 32-bit", nki.language.fori_loop)


def _check_loops(neff) -> None:
    """The rules of registers and loops (format 1.13; neuronc/isa.py, "Registers and loops"): ranges within
    32 bits, references to declared registers, a loop's index read only inside it, terms on HBM operands only,
    a body's waits on its own streams within its length, no instruction outside the loops of a program that has
    some, tensors' row terms within their first dim."""
    registers, loops = list(getattr(neff, "registers", ())), list(getattr(neff, "loops", ()))
    if len(registers) > MAX_REGISTERS:
        raise NeffFormatError(f"the program declares {len(registers)} registers, more than {MAX_REGISTERS}")
    for r in registers:
        if not (isinstance(r.lo, int) and isinstance(r.hi, int) and 0 <= r.lo <= r.hi <= REGISTER_MAX):
            raise NeffFormatError(f"register {r.name!r} has the range [{r.lo}, {r.hi}]: a register's range is "
                                  f"0 <= lo <= hi <= {REGISTER_MAX}")
    if loops and any(neff.streams.values()):
        raise NeffFormatError("a program with loops has instructions outside them: its instructions are all in "
                              "its loops (format 1.13)")

    def terms(what: str, ap, in_loop: bool) -> None:
        if not ap.terms:
            return
        if ap.space != Space.HBM:
            raise NeffFormatError(f"{what} is a {ap.space.name} operand with register terms: only HBM offsets "
                                  "take registers")
        if len(ap.terms) > MAX_TERMS:
            raise NeffFormatError(f"{what} has {len(ap.terms)} terms, more than {MAX_TERMS}")
        for source, coefficient in ap.terms:
            if source == LOOP_INDEX and not in_loop:
                raise NeffFormatError(f"{what} reads a loop index outside any loop")
            if not (source == LOOP_INDEX or 0 <= source < len(registers)):
                raise NeffFormatError(f"{what} reads register {source}, but the program declares {len(registers)}")
            if abs(coefficient) > MAX_COEFFICIENT:
                raise NeffFormatError(f"{what} has a term of {coefficient} bytes, more than {MAX_COEFFICIENT}")

    for (engine, queue), stream in neff.streams.items():
        for i, inst in enumerate(stream):
            for position, ap in enumerate(inst.operands):
                terms(f"operand {position} of instruction {i} of stream {Engine(engine).name}:{queue}", ap, False)
    for n, loop in enumerate(loops):
        if not 0 <= loop.register < len(registers):
            raise NeffFormatError(f"loop {n} counts with register {loop.register}, but the program declares "
                                  f"{len(registers)}")
        if not any(loop.streams.values()):
            raise NeffFormatError(f"loop {n} has no instructions")
        lengths = {(int(e), q): len(stream) for (e, q), stream in loop.streams.items()}
        for (engine, queue), stream in loop.streams.items():
            for i, inst in enumerate(stream):
                where = f"instruction {i} of loop {n}'s stream {Engine(engine).name}:{queue}"
                for position, ap in enumerate(inst.operands):
                    terms(f"operand {position} of {where}", ap, True)
                for wait in inst.waits:
                    length = lengths.get((int(wait[0]), wait[1]))
                    if length is None or not 0 <= wait[2] <= length:
                        raise NeffFormatError(
                            f"{where} waits for {wait[2]} instructions of {Engine(wait[0]).name}:{wait[1]}, which its "
                            f"loop's body runs {length or 0} of per iteration (a body waits only on itself)")
    for t in neff.tensors:
        rows = getattr(t, "rows", ())
        if not rows:
            continue
        if len(rows) > MAX_TERMS or not t.shape:
            raise NeffFormatError(f"tensor {t.name!r} has {len(rows)} row terms (at most {MAX_TERMS}, on a tensor "
                                  "of one dim or more)")
        if t.kind.name not in ("INPUT", "OUTPUT"):
            raise NeffFormatError(f"{t.kind.name.lower()} {t.name!r} has row terms: only inputs and outputs do")
        most = 0
        for register, count in rows:
            if not 0 <= register < len(registers) or not 0 <= count <= t.shape[0]:
                raise NeffFormatError(f"tensor {t.name!r} has the row term ({register}, {count}): a declared "
                                      "register and a count within its first dim")
            most += count * registers[register].hi
        if most > t.shape[0]:
            raise NeffFormatError(f"tensor {t.name!r} passes up to {most} rows at its registers' highest values, "
                                  f"but holds {t.shape[0]}")
