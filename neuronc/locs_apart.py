"""A pickle of a value with its source locations left out: values that differ only in their DebugLocs (a model's
repeated layers: each layer's own) get the same bytes, and the bytes load back into the value located nowhere."""
from __future__ import annotations

import io
import pickle

from neuronc.neff.program import DebugLoc


class LocsApart(pickle.Pickler):
    """A pickle of a value with each DebugLoc in it left out (a persistent id), the locations listed in pickling
    order: values that differ only in their locations get the same key."""

    def __init__(self):
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, pickle.HIGHEST_PROTOCOL)
        self.locs: list = []

    def persistent_id(self, obj):
        if isinstance(obj, DebugLoc):  # called for every occurrence, before the pickle's memo
            self.locs.append(obj)
            return 0
        return None

    def key(self, v) -> bytes:
        self.dump(v)
        return self.buffer.getvalue()


class _Nowhere(pickle.Unpickler):
    def persistent_load(self, pid):
        return DebugLoc()  # a fresh one per location: DebugLoc is mutable


def located_nowhere(key: bytes):
    """The value a `LocsApart` key was made from, each of its locations an empty DebugLoc: a function of the key."""
    return _Nowhere(io.BytesIO(key)).load()
