"""TORCH_NEURONX_DEBUG_DIR: keep what every compilation saw and made, to debug it afterwards.

For each compilation a folder `<dir>/<NNNN>_<name>/` gets the FX graph, the StableHLO, the
optimised graph IR, the NEFF, and `INDEX`, one line per file saying what it is.
"""
from __future__ import annotations

import itertools
import logging
import os

from neuronc.errors import NeuronConfigError

ENV = "TORCH_NEURONX_DEBUG_DIR"
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


def keep(compiled, fx_text: str = "") -> str | None:
    """Write the artefacts of `compiled` if TORCH_NEURONX_DEBUG_DIR is set; returns the folder. A folder
    that cannot be written is a warning: the compilation itself is not lost."""
    root = os.environ.get(ENV)
    if not root:
        return None
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
        "stablehlo.mlir": ("the StableHLO module torch-mlir produced (large constants elided)", compiled.stablehlo),
        "optimized_ir.txt": ("the neuronc graph IR after the pass pipeline",
                             str(compiled.graph) if compiled.graph is not None else "(NEFF taken from the compile cache)"),
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
