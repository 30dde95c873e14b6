"""NEURON_CC_FLAGS: compiler flags from the environment, the Neuron toolchain's convention.

Both the compile options (`--target`, `-O1`) and the compile cache (`--cache_dir`, `--no_cache`)
read it, through these two functions.
"""
from __future__ import annotations

import os
import shlex


def cc_flags() -> list:
    return shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))


def flag_value(flags: list, name: str) -> str | None:
    """The value of `--name=value` or `--name value` (the last one given), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
        elif flag == f"--{name}" and i + 1 < len(flags):
            value = flags[i + 1]
    return value
