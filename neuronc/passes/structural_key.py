"""A hashable key equal for structurally equal values (kernel bodies, views, plans), and only for them, and the memo
of the passes that decide once per distinct kernel by it (rowwise_schedule.choose_schedule, rowwise_plan.tile_plan,
fuse_rowwise's SBUF fit and plans)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import numpy as np


def structural_key(value, known: dict | None = None):
    """A hashable value equal for equal bodies and views, and only for them: floats and numpy scalars by their
    type and bits (so -0.0 and 0.0, 1 and 1.0, stay apart), arrays by dtype, shape and bytes. `known` (see
    `keyed_once`): the keys of some objects, made before, taken for those very objects wherever they occur."""
    if known is not None:
        hit = known.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
    if isinstance(value, enum.Enum):
        return value
    if isinstance(value, (float, np.floating, np.generic)):
        return type(value).__name__, np.asarray(value).tobytes()
    if isinstance(value, (bool, int, str)) or value is None:
        return type(value).__name__, value
    if isinstance(value, np.ndarray):
        return "array", value.dtype.str, value.shape, value.tobytes()
    if isinstance(value, dict):
        return "dict", tuple((structural_key(k, known), structural_key(v, known)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(structural_key(v, known) for v in value)
    if dataclasses.is_dataclass(value):
        return type(value).__name__, tuple(structural_key(getattr(value, f.name), known)
                                           for f in dataclasses.fields(value))
    raise TypeError(f"no structural key for a {type(value).__name__}: {value!r}")


def keyed_once(*values) -> dict:
    """`known` for structural_key: each value's key made now, by the object (which the dict keeps alive, so its id
    names no other). For a caller that keys the same objects in several keys while they stay as they are (a
    row-wise kernel's body and views, keyed for its SBUF fit, its schedule and its plan: issue 24). Values that do
    not key are left out (keyed where they occur, and raise there as they would)."""
    known: dict = {}
    for value in values:
        try:
            known[id(value)] = (value, structural_key(value))
        except TypeError:
            pass
    return known


def once_per_key(memo: dict, key_of: Callable, make: Callable, limit: int = 0):
    """``make()``, or what it gave before for the same ``key_of()`` (kept in ``memo``, emptied once it holds ``limit``
    entries; 0: no limit). Made every time when ``key_of`` raises TypeError (a value ``structural_key`` does not
    know) or gives an unhashable key."""
    try:
        key = key_of()
        hash(key)
    except TypeError:
        return make()
    if key not in memo:
        if limit and len(memo) >= limit:
            memo.clear()
        memo[key] = make()
    return memo[key]
