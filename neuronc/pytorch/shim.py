"""Builds and loads the C++ half of the `neuron` device (``csrc/neuron_shim.cpp``).

PyTorch takes a device's allocator, device guard (current device, streams, events) and hooks only from
C++, so those live in a small extension compiled with ``torch.utils.cpp_extension`` (g++ and ninja).
It is built once per source and torch version into ``$NEURONC_SHIM_DIR`` (default
``~/.cache/neuronc/shim/<hash>``): ``make install`` builds it (``python -m neuronc.pytorch.shim``); otherwise
the first use of the device builds it. Loading a built shim is a ``dlopen``, cheap enough for the
``torch.backends`` autoload that runs at every ``import torch``.

The c10d Backend of the "neuron" process group (``csrc/neuron_c10d.cpp``) is a second extension built the
same way (:func:`load_c10d`), loaded when a process group is made, not at ``import torch``.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from neuronc.errors import NeuronDeviceError

NAME = "neuron_shim"
SOURCE = Path(__file__).parent / "csrc" / "neuron_shim.cpp"
C10D_NAME = "neuron_c10d"
C10D_SOURCE = Path(__file__).parent / "csrc" / "neuron_c10d.cpp"


def build_directory(source: Path = SOURCE) -> Path:
    """Where the shim of this source and this torch is built (one directory per pair)."""
    from torch.version import __version__ as torch_version

    digest = hashlib.sha256(source.read_bytes() + torch_version.encode()).hexdigest()[:16]
    root = os.environ.get("NEURONC_SHIM_DIR") or Path.home() / ".cache" / "neuronc" / "shim"
    return Path(root) / digest


def library_path(name: str = NAME, source: Path = SOURCE) -> Path:
    return build_directory(source) / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[-1]}"


def load_built(name: str = NAME, source: Path = SOURCE):
    """The shim module if it is already built, else None (never compiles: safe at `import torch`)."""
    if name in sys.modules:
        return sys.modules[name]
    path = library_path(name, source)
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(name: str = NAME, source: Path = SOURCE):
    """Compile the shim (about a minute) and load it; a typed error says what is missing."""
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None and not _pip_ninja(tool)]
    if missing:
        raise NeuronDeviceError(
            f"the neuron device needs its C++ shim, and building it needs {' and '.join(missing)}, "
            "which this machine does not have",
            hint="install a C++ compiler (apt-get install g++) and ninja (pip install ninja), then run "
            "`python -m neuronc.pytorch.shim` once",
        )
    from torch.utils import cpp_extension

    directory = build_directory(source)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        kineto = Path(cpp_extension.include_paths()[0]) / "kineto"  # torch's Kineto headers: the profiler plugin
        module = cpp_extension.load(name, [str(source)], build_directory=str(directory),
                                    extra_cflags=["-O2", "-DUSE_KINETO"], extra_include_paths=[str(kineto)],
                                    verbose=False)
    except Exception as e:  # compiler errors: show them with what to do
        raise NeuronDeviceError(f"building the neuron device's C++ shim failed: {e}",
                                hint=f"see the build log in {directory}; a C++20 g++ is needed") from e
    sys.modules[name] = module
    return module


def _pip_ninja(tool: str) -> bool:
    """The `ninja` PyPI package puts its binary beside the interpreter, which PATH may not list."""
    if tool != "ninja" or not (Path(sys.executable).parent / "ninja").exists():
        return False
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return True


def load():
    """The shim, built first if needed."""
    return load_built() or build()


def load_c10d():
    """The c10d Backend extension, built first if needed."""
    return load_built(C10D_NAME, C10D_SOURCE) or build(C10D_NAME, C10D_SOURCE)


if __name__ == "__main__":
    print(f"building the neuron device shim in {build_directory()} ...")
    load()
    print(f"ok: {library_path()}")
    print(f"building the neuron process group's c10d backend in {build_directory(C10D_SOURCE)} ...")
    load_c10d()
    print(f"ok: {library_path(C10D_NAME, C10D_SOURCE)}")
