"""`torch.neuron`: the device module of the `neuron` device (PrivateUse1 renamed).

Registered by :func:`neuronc.pytorch.autoload.register` at `import torch`; everything here is cheap to
import. PyTorch calls :func:`_lazy_init` the first time a tensor is made on the device: that loads (or
builds) the C++ shim and registers the eager op kernels (:mod:`neuronc.pytorch.eager`). The runtime and
the compiler are imported then, not before.

Device count: emulated NeuronCores, ``NEURON_RT_VISIBLE_CORES`` (``"0-3"``, ``"0,1"``, ``"2"``) as on
a Neuron host, default 2. Each core has its own HBM (the target's capacity).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

from neuronc.errors import NeuronConfigError

DEFAULT_CORES = 2
_initialized = False
_init_lock = threading.RLock()


def _visible_cores() -> int:
    text = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not text:
        return DEFAULT_CORES
    try:
        cores = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise NeuronConfigError(f"NEURON_RT_VISIBLE_CORES={text!r} is not a list of cores",
                                hint="write core numbers and ranges, e.g. 0-1 or 0,2") from None
    if not cores:
        raise NeuronConfigError(f"NEURON_RT_VISIBLE_CORES={text!r} names no core", hint="e.g. 0-1")
    return len(cores)


def _reserve(index: int, nbytes: int) -> tuple:
    """The shim's allocator calls this for every storage (the runtime is imported on first use)."""
    global _reserve, _release
    from neuronc.pytorch.device_memory import release, reserve

    _reserve, _release = reserve, release
    return reserve(index, nbytes)


def _release(index: int, handle: int) -> None:
    from neuronc.pytorch.device_memory import release

    release(index, handle)


def _synchronize(index: int) -> None:
    """The shim calls this when a stream, an event or the device is synchronised or queried."""
    from neuronc.pytorch.queues import synchronize

    synchronize(index)


def _init_shim(shim) -> None:
    shim.init(_visible_cores(), lambda i, n: _reserve(i, n), lambda i, h: _release(i, h), _synchronize)


def _lazy_init() -> None:
    """Load (or build) the C++ shim and register the op kernels; PyTorch calls it on first use."""
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        from neuronc.pytorch import data_parallel, eager, shim
        from neuronc.pytorch.device_memory import NUMPY_DTYPES

        loaded = shim.load()
        _init_shim(loaded)
        loaded.set_numpy_dtypes(NUMPY_DTYPES)
        eager.register()
        data_parallel.install()
        _initialized = True


def is_initialized() -> bool:
    return _initialized


def is_available() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _visible_cores()


def current_device() -> int:
    _lazy_init()
    return torch.accelerator.current_device_index()


def set_device(device) -> None:
    _lazy_init()
    torch.accelerator.set_device_index(device)


class device:  # noqa: N801 (torch.cuda.device's name: a class used as a context manager)
    """``with torch.neuron.device(1):`` makes ``neuron:1`` the current device inside the block, as
    ``torch.cuda.device`` does (None: no change). ``torch.load`` uses it to put back tensors saved from the device."""

    def __init__(self, device):
        self._switch = torch.accelerator.device_index(None if device is None else _index(device))

    def __enter__(self):
        _lazy_init()
        self._switch.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._switch.__exit__(*exc_info)


def device_of(obj) -> device:
    """The current-device context of a tensor's device (no change for a tensor not on `neuron`)."""
    return device(obj.get_device() if obj.device.type == "neuron" else None)


def get_device_name(device=None) -> str:
    return f"NeuronCore ({_device_memory().target()}, emulated) neuron:{_index(device)}"


def get_device_properties(device=None):
    """Name, emulated target and HBM capacity of ``neuron:device``."""
    from types import SimpleNamespace

    return SimpleNamespace(name=get_device_name(device), total_memory=mem_get_info(device)[1],
                           target=_device_memory().target())


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the NeuronCore's HBM, as ``torch.cuda.mem_get_info``."""
    _lazy_init()
    hbm = _device_memory().core(_index(device)).hbm
    return hbm.capacity - hbm.in_use, hbm.capacity


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def memory_reserved(device=None) -> int:
    _lazy_init()
    return torch.accelerator.memory_reserved(device)


def max_memory_reserved(device=None) -> int:
    _lazy_init()
    return torch.accelerator.max_memory_reserved(device)


def _device_memory():
    from neuronc.pytorch import device_memory

    return device_memory


def synchronize(device=None) -> None:
    """Run the device's queued work (every stream, in emulated-time order); its errors are raised here."""
    _lazy_init()
    torch.accelerator.synchronize(device)


def current_stream(device=None) -> torch.Stream:
    _lazy_init()
    return torch.accelerator.current_stream(device)


def Stream(device=None, priority: int = 0) -> torch.Stream:  # noqa: N802 (a class for the user)
    _lazy_init()
    return torch.Stream(device=device if device is not None else "neuron", priority=priority)


def Event(enable_timing: bool = True, **kwargs) -> torch.Event:  # noqa: N802
    _lazy_init()
    return torch.Event(device="neuron", enable_timing=enable_timing, **kwargs)


@contextlib.contextmanager
def stream(s: torch.Stream):
    """Make ``s`` the current stream of its device inside the block."""
    _lazy_init()
    previous = torch.accelerator.current_stream(s.device_index)
    torch.accelerator.set_stream(s)
    try:
        yield s
    finally:
        torch.accelerator.set_stream(previous)


def memory_allocated(device=None) -> int:
    _lazy_init()
    return torch.accelerator.memory_allocated(device)


def max_memory_allocated(device=None) -> int:
    _lazy_init()
    return torch.accelerator.max_memory_allocated(device)


def memory_stats(device=None) -> dict:
    _lazy_init()
    return torch.accelerator.memory_stats(device)


def reset_peak_memory_stats(device=None) -> None:
    _lazy_init()
    torch.accelerator.reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Give the storage buffers the allocator keeps for reuse back to their NeuronCores' HBM."""
    _lazy_init()
    torch.accelerator.empty_cache()


def set_adaptive_eager(enabled: bool) -> None:
    """Opt in (or out) of adaptive eager: the ops queued between two synchronisations are batched into one
    NEFF (experimental; off under torch.use_deterministic_algorithms(True)). See neuronc.pytorch.adaptive."""
    from neuronc.pytorch import adaptive

    adaptive.set_enabled(enabled)


def get_amp_supported_dtype() -> list:
    return [torch.bfloat16, torch.float16]


def _outside_graphs(fn):
    """The generator-state functions run eagerly, never traced by Dynamo: they read and write the shim's
    generator, which Dynamo's fake tensors cannot stand for (traced under `no_dispatch()`, as
    `torch.testing`'s `freeze_rng_state` calls `set_rng_state`, Dynamo failed with an AssertionError
    inside the compiled function). A compiled function calling them is split around the call."""
    return torch._disable_dynamo(fn)


def default_generator(device=None) -> torch.Generator:
    """The default generator of ``neuron:device`` (the current device for None): one per NeuronCore, a
    counter-based (Philox) state (seed, offset) that the device's random ops draw from on the device
    (:mod:`neuronc.pytorch.random_ops`)."""
    _lazy_init()
    from neuronc.pytorch import shim

    return shim.load().default_generator(_index(device))


@_outside_graphs
def manual_seed(seed: int) -> None:
    """Seed the default generator of the current device."""
    default_generator().manual_seed(int(seed))


@_outside_graphs
def manual_seed_all(seed: int) -> None:
    """Seed the default generator of every device (``torch.manual_seed`` calls this)."""
    for index in range(device_count()):
        default_generator(index).manual_seed(int(seed))


@_outside_graphs
def seed() -> None:
    """Seed the current device's default generator with a non-deterministic number."""
    default_generator().seed()


@_outside_graphs
def initial_seed() -> int:
    return default_generator().initial_seed()


@_outside_graphs
def get_rng_state(device=None) -> torch.Tensor:
    return default_generator(device).get_state()


@_outside_graphs
def set_rng_state(state: torch.Tensor, device=None) -> None:
    default_generator(device).set_state(state)


def __getattr__(name: str):
    """``torch.neuron.comm``: collectives between the cores of this process (imported on first use)."""
    if name == "comm":
        from neuronc.pytorch import comm

        return comm
    raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")


def _index(device) -> int:
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "neuron":
        raise NeuronConfigError(f"{device} is not a neuron device", hint="name a core as neuron:N or N")
    return device.index if device.index is not None else torch.accelerator.current_device_index()
