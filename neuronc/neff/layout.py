"""Flatbuffer bytes laid out exactly as flatbuffers' Python `Builder` lays them out, in far fewer Python calls.

The Builder writes back to front: each scalar is padded to its own size (measured from the end of the buffer),
each table ends with a vtable unless an identical one was written before, each vector is preceded by its length.
Where the padding falls depends only on the offset from the end modulo 8 (no value is wider than 8 bytes), so a
table's layout is computed once per (fields present, offset modulo 8) and then written with one `struct.pack`.
`Writer` keeps the Builder's state (offset from the end, largest alignment, vtables by content) and appends each
piece's bytes, in their final order, to a list read back to front at the end.

The same calls in the same order as on a Builder give the same bytes; writer.py's tests compare the two.
"""
from __future__ import annotations

import struct
from operator import itemgetter

_SIZES = {"B": 1, "?": 1, "i": 4, "q": 8, "d": 8, "U": 4}  # "U": an offset to something written earlier
_COUNT = struct.Struct("<I")


class Table:
    """A table type: its number of vtable slots and its fields as (slot, struct code), in the order they are added."""

    def __init__(self, slots: int, fields: tuple):
        self.slots, self.fields = slots, fields
        self.plans: dict = {}

    def plan(self, present: tuple, start: int) -> _Plan:
        plan = self.plans.get((present, start & 7))
        if plan is None:
            plan = self.plans[(present, start & 7)] = _Plan(self, present, start & 7)
        return plan


class _Plan:
    """Where the Builder puts the present fields of a table started at an offset `base` modulo 8."""

    def __init__(self, table: Table, present: tuple, base: int):
        offset, vtable, written = base, [0] * table.slots, []  # written: (field index, code, offset after, padding)
        self.align = 4
        for index, ((slot, code), here) in enumerate(zip(table.fields, present)):
            if not here:
                continue
            size = _SIZES[code]
            self.align = max(self.align, size)
            padding = -offset & (size - 1)
            offset += padding + size
            vtable[slot] = offset
            written.append((index, code, offset - base, padding))
        padding = -offset & 3  # then the table's offset to its vtable
        object_offset = offset + padding + 4
        self.size = object_offset - base
        fmt = "<i" + "x" * padding
        for _index, code, _after, padding in reversed(written):
            fmt += ("I" if code == "U" else code) + "x" * padding
        self.struct = struct.Struct(fmt)
        # The field values in memory order, from the values of all fields in the order they are added.
        indices = [index for index, _code, _after, _padding in reversed(written)]
        self.fields = itemgetter(*indices) if len(indices) > 1 else lambda values: tuple(values[i] for i in indices)
        # The offset fields: (index, offset after it from the table's start); the value written is that offset
        # minus the offset pointed to.
        self.offsets = tuple((index, after) for index, code, after, _padding in written if code == "U")
        self.after = [0] * len(table.fields)  # the same by field index (0 for a field absent or not an offset)
        for index, after in self.offsets:
            self.after[index] = after
        while vtable and not vtable[-1]:
            vtable.pop()
        entries = [object_offset - at if at else 0 for at in vtable]
        self.vtable_key = (*reversed(entries), self.size)
        self.vtable = struct.pack(f"<{len(entries) + 2}H", (len(entries) + 2) * 2, self.size, *entries)


class Writer:
    """A flatbuffer written back to front; each method is the Builder call(s) named in its docstring."""

    def __init__(self):
        self.chunks: list = []  # the bytes written, first written first (so last in the buffer)
        self.offset = 0  # the Builder's Offset(): bytes written so far
        self.minalign = 1
        self.vtables: dict = {}  # vtable content -> its offset, as the Builder's

    def prep(self, size: int, additional: int) -> None:
        """Builder.Prep."""
        if size > self.minalign:
            self.minalign = size
        padding = -(self.offset + additional) & (size - 1)
        if padding:
            self.chunks.append(bytes(padding))
            self.offset += padding

    def string(self, s) -> int:
        """Builder.CreateString."""
        if isinstance(s, str):
            s = s.encode("utf-8")
        elif not isinstance(s, bytes):
            raise TypeError("non-string passed to CreateString")
        self.prep(4, len(s) + 1)
        self.chunks.append(_COUNT.pack(len(s)) + s + b"\0")
        self.offset += len(s) + 5
        return self.offset

    def vector(self, payload: bytes, count: int, element_size: int, alignment: int) -> int:
        """Builder.StartVector, then `payload` (the elements, in memory order), then Builder.EndVector."""
        self.prep(4, element_size * count)
        self.prep(alignment, element_size * count)
        self.chunks.append(payload)
        self.chunks.append(_COUNT.pack(count))
        self.offset += len(payload) + 4
        return self.offset

    def byte_vector(self, payload: bytes) -> int:
        """Builder.CreateByteVector."""
        self.prep(4, len(payload))
        self.chunks.append(payload)
        self.chunks.append(_COUNT.pack(len(payload)))
        self.offset += len(payload) + 4
        return self.offset

    def offsets(self, targets: list) -> int:
        """A vector of offsets to the tables (or strings) at `targets`: StartVector, PrependUOffsetTRelative each
        from the last, EndVector."""
        count = len(targets)
        self.prep(4, 4 * count)
        end = self.offset + 4 * count  # the offset after the elements
        self.chunks.append(struct.pack(f"<{count + 1}I", count, *[end - 4 * i - target for i, target in
                                                                   enumerate(targets)]))
        self.offset = end + 4
        return self.offset

    def table(self, table: Table, values: list, present: tuple) -> int:
        """StartObject, Prepend*Slot for each present field (an offset field's value is the offset it points to,
        replaced in `values` by the value written), EndObject."""
        start = self.offset
        plan = table.plan(present, start)
        if plan.align > self.minalign:
            self.minalign = plan.align
        object_offset = start + plan.size
        for index, after in plan.offsets:
            values[index] = start + after - values[index]
        fields = plan.fields(values)
        vtable = self.vtables.get(plan.vtable_key)
        if vtable is None:
            self.chunks.append(plan.struct.pack(len(plan.vtable), *fields))
            self.chunks.append(plan.vtable)
            self.offset = self.vtables[plan.vtable_key] = object_offset + len(plan.vtable)
        else:
            self.chunks.append(plan.struct.pack(vtable - object_offset, *fields))
            self.offset = object_offset
        return object_offset

    def finish(self, root: int) -> bytes:
        """Builder.Finish (no file identifier) and Builder.Output."""
        self.prep(self.minalign, 4)
        self.prep(4, 0)
        self.chunks.append(_COUNT.pack(self.offset + 4 - root))
        self.offset += 4
        return b"".join(reversed(self.chunks))
