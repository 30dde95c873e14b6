"""``nki.compiler``: NKI's compiler directives and its direct-allocation API. neuronc's kernel language places
on-chip tiles itself and has no middle end to skip, so a directive that only steers neuronx-cc is accepted as a
no-op, and direct allocation (``nki.compiler.sbuf.mod_alloc``, ``psum.alloc``, ...) is refused by name."""
from __future__ import annotations

from neuronc.errors import KernelUnsupportedError


def skip_middle_end_transformations(kernel):
    """A neuronx-cc directive: the kernel as it is (neuronc traces kernels as written)."""
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise KernelUnsupportedError(f"nki.compiler.{name} (direct allocation) is not supported by neuronc.nki",
                                 hint="allocate tiles with nl.ndarray(shape, dtype, buffer=nl.sbuf or nl.psum) and "
                                      "let neuronc place them")
