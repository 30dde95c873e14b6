"""Writing a file atomically: readers, and a crash, see the old file or the new one, never part.

Used for everything neuronc leaves on disk that another process may read: NEFFs, compile-cache
entries, traces and reports. A ground-floor module (stdlib only), so the runtime may use it.
"""
from __future__ import annotations

import os
import secrets


def write_atomically(path, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to a temporary file beside `path`, flush it to disk, rename it."""
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"  # same directory, so os.replace is a rename
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides who may read
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
