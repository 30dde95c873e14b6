"""NEURON_CC_FLAGS: compiler flags from the environment, the Neuron toolchain's convention.

The one reader of the variable, for the compile options (`--target`, `-O`, `--auto-cast`, ...) and the
compile cache (`--cache_dir`, `--no_cache`) alike. Every flag is checked each time it is read: an unknown
flag, a bad value or a missing one is a `NeuronConfigError` listing each problem and the valid choices, as
neuronx-cc refuses them, never ignored (a mistyped target would otherwise build for the default one).
"""
from __future__ import annotations

import os
import shlex

from neuronc.errors import NeuronConfigError

OPT_LEVELS = ("0", "1", "2", "3")


def _targets() -> tuple:
    from neuronc.targets import TARGETS

    return tuple(sorted(TARGETS))


def _auto_cast_modes() -> tuple:  # the modes and fp64-to-fp32, alone or together
    from neuronc.passes.auto_cast import VALUES

    return tuple(VALUES)


def _auto_cast_types() -> tuple:
    from neuronc.passes.auto_cast import CAST_TYPES

    return tuple(CAST_TYPES)


# flag -> (the CompileOptions field it sets, what a value is, the valid values); None: a cache flag
VALUED = {
    "--target": ("target", "target", _targets),
    "--optlevel": ("opt_level", "optimisation level", lambda: OPT_LEVELS),
    "-O": ("opt_level", "optimisation level", lambda: OPT_LEVELS),
    "--auto-cast": ("auto_cast", "mode", _auto_cast_modes),
    "--auto-cast-type": ("auto_cast_type", "type", _auto_cast_types),
    "--cache_dir": (None, "directory", None),
}
SWITCHES = ("--no_cache",)


def accepted() -> str:
    """The flags neuronc accepts, for error hints."""
    return (f"--target {{{','.join(_targets())}}}, -O{{{','.join(OPT_LEVELS)}}} (or --optlevel N), "
            f"--auto-cast {{{'|'.join(_auto_cast_modes())}}}, --auto-cast-type {{{','.join(_auto_cast_types())}}}, "
            "--cache_dir DIR, --no_cache")


def _parse(text: str) -> list:
    """[(flag, value or None)] in order, each flag spelled canonically; raises on any problem."""
    try:
        tokens = shlex.split(text)
    except ValueError as error:  # shlex: "No closing quotation"
        raise NeuronConfigError(f"NEURON_CC_FLAGS={text!r}: unbalanced quotes ({error})",
                                hint="quote values as in a shell command line") from None
    parsed, problems, i = [], [], 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        flag, joined, value = token.partition("=")
        if token.startswith("-O") and not token.startswith("--") and len(token) > 2:
            flag, joined, value = "-O", "=", token[2:]  # -O2
        if flag in SWITCHES:
            if joined:
                problems.append(f"{flag} takes no value")
            else:
                parsed.append((flag, None))
            continue
        if flag not in VALUED:
            problems.append(f"{token}: unknown flag")
            continue
        if not joined:  # the value is the next token: `--target trn1`
            if i == len(tokens) or tokens[i].startswith("-"):
                problems.append(f"{flag} needs a value")
                continue
            value = tokens[i]
            i += 1
        _field, what, valid = VALUED[flag]
        if valid is not None and value not in valid():
            spelled = f"{flag}{value}" if flag == "-O" else f"{flag} {value or repr(value)}"
            problems.append(f"{spelled}: unknown {what}; valid: {', '.join(valid())}")
            continue
        parsed.append((flag, value))
    if problems:
        raise NeuronConfigError(f"NEURON_CC_FLAGS={text!r} is refused:\n  - " + "\n  - ".join(problems),
                                hint=f"neuronc accepts {accepted()}")
    return parsed


def _flags() -> list:
    return _parse(os.environ.get("NEURON_CC_FLAGS", ""))


def cc_flags() -> list:
    """The flags of NEURON_CC_FLAGS, as `--flag=value` or `--flag` strings in order (checked)."""
    return [flag if value is None else f"{flag}={value}" for flag, value in _flags()]


def flag_value(flags: list, name: str) -> str | None:
    """The value of `--name=value` or `--name value` (the last one given), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
        elif flag == f"--{name}" and i + 1 < len(flags):
            value = flags[i + 1]
    return value


def compile_flags() -> dict:
    """The compile options NEURON_CC_FLAGS sets, as CompileOptions fields (the last of repeated flags wins,
    as in neuronx-cc)."""
    options = {}
    for flag, value in _flags():
        field = VALUED.get(flag, (None,))[0]
        if field is not None:
            options[field] = int(value) if field == "opt_level" else value
    return options
