"""CPython's cyclic garbage collector paused around work that makes millions of short-lived objects: the compiler
(IR nodes, access patterns, instructions) and the runtime's load of a program (its checks' lists and tuples). Every
so often the collector would rescan the whole heap, torch's objects included, finding nothing: a third of the
compiler's time on a large model, a tenth of a 12-layer GPT-2's load. Reference counting still frees the objects
meanwhile; the few cycles made are collected once the collector runs again."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector paused for the duration (as it was on exit)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
