"""A pickle of a value with its source locations left out: values that differ only in their DebugLocs (a model's
repeated layers: each layer's own) get the same bytes, and the bytes load back into the value located nowhere."""
from __future__ import annotations

import io
import pickle

from neuronc.neff.program import DebugLoc


class LocsApart(pickle.Pickler):
    """A pickle of a value with each DebugLoc in it pickled as an empty one, the locations listed in pickling order:
    values that differ only in their locations get the same key. A location is met once per object (the pickle's
    memo refers back to it after that), so the key also says which locations are one object, as it says it of
    every other object."""

    def __init__(self):
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, pickle.HIGHEST_PROTOCOL)
        self.locs: list = []

    def reducer_override(self, obj):
        """Called only for objects of classes (not for numbers, strings, tuples, lists or dicts, nor for an object
        already pickled): far fewer calls into Python than a persistent_id, which is asked of every object."""
        if isinstance(obj, DebugLoc):
            self.locs.append(obj)
            return DebugLoc, ()
        return NotImplemented

    def key(self, v) -> bytes:
        self.dump(v)
        return self.buffer.getvalue()


def located_nowhere(key: bytes):
    """The value a `LocsApart` key was made from, each of its locations an empty DebugLoc: a function of the key."""
    return pickle.loads(key)
