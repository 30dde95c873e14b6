"""TORCH_NEURONX_DEBUG_DIR: keep what every compilation saw and made, to debug it afterwards.

For each compilation a folder `<dir>/<NNNN>_<name>/` gets the FX graph, the StableHLO, the
optimised graph IR (as text: every attribute and plan, see neuronc/ir_text.py), the NEFF, and `INDEX`,
one line per file saying what it is. With a debug folder (or NEURONC_VERIFY_IR=1), the IR verifier
checks the graph after every pass, as it does at -O0.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING, Callable

from neuronc.errors import NeuronConfigError

if TYPE_CHECKING:
    from neuronc.compiler import Compiled

ENV = "TORCH_NEURONX_DEBUG_DIR"
VERIFY_ENV = "NEURONC_VERIFY_IR"
ELIDE_ARRAYS_OVER = 1024  # elements: longer arrays (weights) are elided in optimized_ir.txt; the NEFF holds them
_counter = itertools.count()
log = logging.getLogger("neuronc")


def check() -> None:
    """Make TORCH_NEURONX_DEBUG_DIR if it is set, or refuse it (a file, or a place it cannot be made),
    before anything is compiled."""
    root = os.environ.get(ENV)
    if not root:
        return
    try:
        os.makedirs(root, exist_ok=True)
    except FileExistsError:
        raise NeuronConfigError(f"{ENV}={root}: it is a file, not a directory",
                                hint=f"point {ENV} at a directory, or unset it") from None
    except OSError as error:
        raise NeuronConfigError(f"{ENV}={root}: cannot make the directory ({error.strerror or error})",
                                hint=f"point {ENV} at a directory neuronc may create, or unset it") from None


def verifying() -> bool:
    """Whether compilations verify their graph after every pass (a debug folder, or NEURONC_VERIFY_IR=1)."""
    return bool(os.environ.get(ENV)) or os.environ.get(VERIFY_ENV, "") not in ("", "0")


def keep(compiled: Compiled, fx_text: str | Callable[[], str] = "") -> str | None:
    """Write the artefacts of `compiled` if TORCH_NEURONX_DEBUG_DIR is set; returns the folder. A folder
    that cannot be written is a warning: the compilation itself is not lost. `fx_text` may be a function making
    the text, called only then."""
    root = os.environ.get(ENV)
    if not root:
        return None
    if callable(fx_text):
        fx_text = fx_text()
    try:
        return _write(compiled, fx_text, root)
    except OSError as error:
        log.warning("neuronc: cannot keep the artefacts of %s in %s=%s (%s)", compiled.neff.name, ENV, root,
                    error.strerror or error)
        return None


def _write(compiled, fx_text: str, root: str) -> str:
    from neuronc.neff import save

    folder = os.path.join(root, f"{os.getpid()}_{next(_counter):04d}_{compiled.neff.name}")
    os.makedirs(folder, exist_ok=True)
    files = {
        "fx_graph.txt": ("the FX graph handed to neuronc", fx_text),
        "stablehlo.mlir": ("the StableHLO module torch-mlir produced (large constants elided; for a stack of repeated layers, the "
                           "module of the rest, then one layer's)", compiled.stablehlo),
        "optimized_ir.txt": ("the neuronc graph IR after the pass pipeline, every attribute and plan (neuronc/ir_text.py; "
                             f"arrays of more than {ELIDE_ARRAYS_OVER} elements elided)", _ir_text(compiled.graph)),
    }
    index = []
    for name, (what, text) in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text or "(not available)\n")
        index.append(f"{name}: {what}")
    save(compiled.neff, os.path.join(folder, "model.neff"))
    index.append("model.neff: the compiled NEFF (neuronc inspect / run / profile it)")
    with open(os.path.join(folder, "INDEX"), "w") as f:
        f.write("\n".join(index) + "\n")
    return folder


def _ir_text(graph) -> str:
    if graph is None:
        return "(NEFF taken from the compile cache)\n"
    from neuronc import ir_text

    return ir_text.to_text(graph, elide_arrays_over=ELIDE_ARRAYS_OVER)
