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
        from neuronc.pytorch import eager, shim
        from neuronc.pytorch.device_memory import NUMPY_DTYPES

        loaded = shim.load()
        _init_shim(loaded)
        loaded.set_numpy_dtypes(NUMPY_DTYPES)
        eager.register()
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


def default_generator(device=None) -> torch.Generator:
    """The default generator of ``neuron:device`` (the current device for None): one per NeuronCore, a
    counter-based (Philox) state (seed, offset) that the device's random ops draw from on the device
    (:mod:`neuronc.pytorch.random_ops`)."""
    _lazy_init()
    from neuronc.pytorch import shim

    return shim.load().default_generator(_index(device))


def manual_seed(seed: int) -> None:
    """Seed the default generator of the current device."""
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed the default generator of every device (``torch.manual_seed`` calls this)."""
    for index in range(device_count()):
        default_generator(index).manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's default generator with a non-deterministic number."""
    default_generator().seed()


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    default_generator(device).set_state(state)


def _index(device) -> int:
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.accelerator.current_device_index()
