"""How much host memory neuronc lets one thing it reads or emulates take.

A file declares sizes (a NEFF its HBM, a `.pt2` member its length); the host has what it has. Before
allocating for a user's file, neuronc compares with this budget and refuses with a clear error, rather
than letting the kernel's out-of-memory killer end the process.
"""
from __future__ import annotations

import os

from neuronc.errors import NeuronConfigError

HOST_BUDGET_VARIABLE = "NEURONC_HOST_MEMORY_BUDGET"


def host_memory_budget() -> int:
    """The most host bytes one emulated program's HBM, or one member of a `.pt2` archive, may take:
    ``NEURONC_HOST_MEMORY_BUDGET`` (bytes, or with a K/M/G suffix), else half the machine's physical memory (a stated choice: a program the emulator
    cannot hold should fail with a clear error, not be killed by the kernel's out-of-memory killer)."""
    text = os.environ.get(HOST_BUDGET_VARIABLE, "").strip()
    if not text:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        value = -1
    if value <= 0:
        raise NeuronConfigError(f"{HOST_BUDGET_VARIABLE}={text!r} is not a number of bytes",
                                hint=f"set it to bytes or with a K/M/G suffix, e.g. {HOST_BUDGET_VARIABLE}=8G")
    return value
