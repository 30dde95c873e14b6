"""A value pickled with its source locations left out (neuronc/locs_apart.py): values that differ only in their
locations share the bytes, which load back into the value located nowhere."""
from __future__ import annotations

import dataclasses
import itertools

from neuronc import ir
from neuronc.locs_apart import LocsApart, located_nowhere
from neuronc.isa import DType
from neuronc.neff.program import DebugLoc


@dataclasses.dataclass(frozen=True)
class _Record:
    rows: int
    loc: DebugLoc
    inner: tuple


def _record(line: int) -> _Record:
    return _Record(128, DebugLoc("model.py", line, f"blocks.{line}", "aten.mm"),
                   (DebugLoc("model.py", line + 1, "", "aten.add"), 0.5))


def test_values_that_differ_only_in_their_locations_share_a_key():
    first, second = LocsApart(), LocsApart()
    assert first.key(_record(10)) == second.key(_record(20))
    assert [loc.line for loc in first.locs] == [10, 11]  # in pickling order
    assert LocsApart().key(_record(10)) != LocsApart().key(dataclasses.replace(_record(10), rows=64))


def test_a_key_loads_back_into_its_value_with_every_location_empty():
    value = located_nowhere(LocsApart().key(_record(10)))
    assert value == _Record(128, DebugLoc(), (DebugLoc(), 0.5))
    assert value.loc is not value.inner[0]  # each its own: a DebugLoc is mutable


def test_skipped_ids_are_taken_and_peeking_takes_none(monkeypatch):
    monkeypatch.setattr(ir, "_ids", itertools.count(10))
    assert ir.next_id() == ir.next_id() == 10
    ir.skip_ids(3)
    assert ir.node(ir.Op.PARAMETER, [], (1,), DType.F32).id == 13


def test_a_location_met_twice_as_one_object_is_pickled_once_and_loads_back_as_one_object():
    loc = DebugLoc("model.py", 3, "blocks.0", "aten.mm")
    pickler = LocsApart()
    value = located_nowhere(pickler.key((loc, loc, DebugLoc("model.py", 3, "blocks.0", "aten.mm"))))
    assert pickler.locs == [loc, loc] and pickler.locs[0] is loc and pickler.locs[1] is not loc
    assert value[0] is value[1] and value[2] is not value[0] and value == (DebugLoc(),) * 3
