"""Writing a file atomically: readers, and a crash, see the old file or the new one, never part.

Used for everything neuronc leaves on disk that another process may read: NEFFs, compile-cache
entries, traces and reports. A ground-floor module (stdlib only), so the runtime may use it.

The bytes go to a temporary file beside the target, `<target>.<random>.writing.tmp`, renamed into
place once flushed. A writer killed before the rename leaves that file behind; to tell it from one a
live writer is still writing, the writer holds an exclusive lock (flock) on it from its creation to
its rename, and the kernel drops the lock when the writer dies. `remove_if_orphaned` removes only
unlocked ones; where liveness cannot be asked (a file system without locks, or a `.tmp` file of an
older neuronc, which took none) a temporary file counts as orphaned once older than ORPHAN_AGE_S.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time

TMP_SUFFIX = ".tmp"
LOCKED_SUFFIX = ".writing.tmp"  # made by a writer that holds its lock for as long as it lives
ORPHAN_AGE_S = 3600.0  # a stated choice: a write takes seconds (a 2 GiB NEFF at 100 MB/s: 20 s)


def write_atomically(path, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to a locked temporary file beside `path`, flush it to disk, rename it."""
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = _locked_temporary(path)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
            os.replace(tmp, path)  # while the lock is held: a cleaner never takes a live writer's file
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _locked_temporary(path: str) -> tuple:
    """(fd, name) of a new temporary file beside `path` (same directory, so os.replace is a rename),
    locked by this process."""
    while True:
        tmp = f"{path}.{secrets.token_hex(4)}{LOCKED_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides who may read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner looks at it
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return fd, tmp  # no locks on this file system: its age will tell
        # A cleaner may have taken the file between its creation and the lock: then it is gone.
        try:
            if os.path.samestat(os.stat(tmp), os.fstat(fd)):
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def is_temporary(name: str) -> bool:
    return name.endswith(TMP_SUFFIX)


def is_orphaned(tmp) -> bool:
    """Whether the temporary file `tmp` was left by a writer that is gone (see the module docstring)."""
    return _check(tmp, remove=False)


def remove_if_orphaned(tmp) -> bool:
    """Remove the temporary file `tmp` if its writer is gone; whether it was removed."""
    return _check(tmp, remove=True)


def _check(tmp, remove: bool) -> bool:
    tmp = os.fspath(tmp)
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone (renamed into place, or removed), or not a file we may look at
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            writer_dead = tmp.endswith(LOCKED_SUFFIX)  # its writer would hold the lock if it lived
        except BlockingIOError:
            return False  # its writer is alive
        except OSError:
            writer_dead = False  # no locks on this file system: unknown
        if not writer_dead and time.time() - info.st_mtime < ORPHAN_AGE_S:
            return False
        if not remove:
            return True
        try:
            if not os.path.samestat(os.stat(tmp, follow_symlinks=False), info):
                return False  # renamed or replaced since it was opened
            os.unlink(tmp)  # under the lock, so no writer is between its creation and its lock
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)
