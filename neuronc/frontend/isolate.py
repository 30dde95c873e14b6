"""Run a frontend step in a forked child process, so a crash inside torch-mlir cannot kill the caller.

torch-mlir is C++ and is known to segfault on some graphs (e.g. reductions over 0-d tensors). The
user's process (a training script, a notebook) must survive that, so the import runs in a
`fork()`ed copy of the process and sends its result back through a pipe, pickled. Forking keeps
the cost low: nothing has to be imported again or sent to the child (torch-mlir's modules are imported in the
parent before its first child, for that reason).
"""
from __future__ import annotations

import faulthandler
import math
import os
import pickle
import select
import signal
import sys
import time
import traceback
import warnings

from neuronc.errors import FrontendCrashError, NeuronConfigError, NeuronError

_OK, _ERROR = b"O", b"E"
DEFAULT_TIMEOUT_S = 600.0  # NEURONC_FRONTEND_TIMEOUT overrides; torch-mlir can also loop forever


def preload_torch_mlir() -> None:
    """Import torch-mlir's modules (its MLIR libraries) here, once, so that every forked child has them: each child
    importing them itself cost ~2 s of CPU (3 s wall), more than the import of a GPT-2 graph, in every compile
    and every op `neuronc check` probes. Importing makes no MLIR context, starts no thread and runs nothing on a
    user's graph, so what can crash still runs only in the children."""
    if "torch_mlir.fx" in sys.modules:
        return
    from torch_mlir import fx, ir, passmanager  # noqa: F401
    from torch_mlir._mlir_libs import _stablehlo  # noqa: F401
    from torch_mlir.dialects import torch as torch_dialect  # noqa: F401


def run_isolated(fn, *args, what: str = "the torch-mlir import"):
    """Return fn(*args), computed in a forked child. Exceptions raised by fn are re-raised here."""
    if not hasattr(os, "fork") or os.environ.get("NEURONC_NO_ISOLATION") == "1":
        return fn(*args)
    preload_torch_mlir()
    timeout = timeout_s()
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # JAX warns at every fork of a process it runs threads in: a child that used JAX could deadlock on a
        # lock one of them held. The child here runs only torch-mlir and neuronc's importer, never JAX.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        _silence_native_diagnostics()
        _single_threaded()
        status = 0
        try:
            try:
                payload = _OK + pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
                payload = _ERROR + _pickle_exception(exc)
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(payload)
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        payload, timed_out = _read_until(read_fd, time.monotonic() + timeout)
    except BaseException:  # e.g. Ctrl-C while waiting: never leave the child behind
        timed_out = True
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, wait_status = os.waitpid(pid, 0)
    if timed_out:
        raise FrontendCrashError(
            f"{what} did not finish within {timeout:.0f} s and was stopped; your process was not affected",
            hint="torch-mlir can loop forever on some graphs (e.g. reductions over 0-d tensors); "
            "raise NEURONC_FRONTEND_TIMEOUT if the graph is just large, otherwise rewrite the op "
            "or keep it outside the compiled region",
        )
    if payload[:1] == _OK:
        return pickle.loads(payload[1:])
    if payload[:1] == _ERROR:
        raise pickle.loads(payload[1:])
    raise FrontendCrashError(
        f"{what} crashed ({_describe(wait_status)}); your process was not affected",
        hint="this is a bug in torch-mlir on this graph; run `neuronc check` to see its ops, "
        "and report the graph (set TORCH_NEURONX_DEBUG_DIR to keep it). "
        "Rewriting the op that triggers it, or compiling a smaller part of the model, avoids it.",
    )


def timeout_s() -> float:
    """NEURONC_FRONTEND_TIMEOUT in seconds (default DEFAULT_TIMEOUT_S); anything else than a positive
    number is refused."""
    text = os.environ.get("NEURONC_FRONTEND_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise NeuronConfigError(f"NEURONC_FRONTEND_TIMEOUT={text}: not a positive number of seconds",
                                hint=f"e.g. NEURONC_FRONTEND_TIMEOUT=1200, or unset it for {DEFAULT_TIMEOUT_S:.0f} s")
    return seconds


def _read_until(fd: int, deadline: float) -> tuple:
    """All bytes from fd until EOF, or (what came, True) if the deadline passes first."""
    chunks = []
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return b"".join(chunks), True
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
    finally:
        os.close(fd)


def _silence_native_diagnostics() -> None:
    """MLIR prints its diagnostics straight to fd 2, and faulthandler (if the caller enabled it, as
    pytest does) would dump the crash; the errors we raise already say what failed."""
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _single_threaded() -> None:
    """A forked child has only the thread that forked: OpenMP's pool (started by any parallel ATen op the caller
    ran) is not there, and libgomp's first parallel region in the child waits for it forever. One thread makes
    ATen run its parallel loops inline (at::parallel_for with one thread enters no OpenMP region)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _pickle_exception(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot cross the pipe is sent as text
        detail = "".join(traceback.format_exception(exc))
        return pickle.dumps(NeuronError(f"{what_failed(exc)}\n{detail}"))


def what_failed(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _describe(wait_status: int) -> str:
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(wait_status)}"
