"""The persistent compile cache: a NEFF compiled once is never compiled again.

Entries are keyed by a hash of everything that decides the NEFF: the StableHLO, the compile
options and target, the weights stored in it (for `.pt2` programs), the versions of neuronc,
torch and torch-mlir, and a hash of neuronc's own source (so an edited compiler recompiles). Where it lives follows the Neuron convention: `NEURON_COMPILE_CACHE_URL`,
else `--cache_dir=DIR` in `NEURON_CC_FLAGS`, else `$XDG_CACHE_HOME/neuronc` (`~/.cache/neuronc`);
`--no_cache` in `NEURON_CC_FLAGS` turns it off.

Safe under crashes and concurrency: an entry is written to a temporary file and renamed into place
(atomic), with a sidecar holding its sha256; a corrupted or truncated entry fails the check (and
the NEFF reader's own hashes), is deleted and recompiled, never executed. Each entry's NEFF holds its
key in its header, so an entry holding another program's NEFF (valid, with a matching sidecar) is
treated as damaged too, never served. Two processes compiling the same graph both succeed and leave
one valid entry. Only successful compilations are stored; a store that fails (a full disk, a
read-only cache) is a warning, not a lost compilation.

Temporary files of writers killed before their rename are orphans: listed, removed by `clear` and
`prune`, and aged out by every store into their shard; a live writer's is never touched (see
neuronc/atomic_file.py for how the two are told apart).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time

from neuronc import __version__
from neuronc.atomic_file import is_orphaned, is_temporary, remove_if_orphaned, write_atomically
from neuronc.cc_flags import cc_flags, flag_value
from neuronc.errors import NeffFormatError, NeuronConfigError

ENTRY_SUFFIX = ".neff"
META_SUFFIX = ".json"
NO_CACHE_HINT = ("point it at a directory neuronc may create, or turn the cache off with --no_cache in "
                 "NEURON_CC_FLAGS")

log = logging.getLogger("neuronc")


@functools.cache
def _compiler_fingerprint() -> str:
    """sha256 of neuronc's own source and schema: a changed compiler never serves old NEFFs,
    even while its version number stays the same (a development checkout)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".fbs")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


@functools.cache
def _versions() -> dict:
    """The toolchain's versions, read once per process (3 ms a call: importlib.metadata scans the installed
    packages; an upgrade during the process would not change the torch it has imported anyway)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"neuronc": __version__, "neuronc-source": _compiler_fingerprint()}
    for package in ("torch", "torch-mlir"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found


def cache_key(stablehlo: str, options: dict, weights: dict | None = None) -> str:
    """sha256 over the StableHLO, the options, the weights' bytes and the toolchain versions."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"options": options, "versions": _versions()}, sort_keys=True).encode())
    digest.update(stablehlo.encode())
    for name in sorted(weights or {}):
        array = weights[name]
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(memoryview(array.tobytes()))
    return digest.hexdigest()


def cache_settings() -> tuple:
    """(enabled, directory) from NEURON_COMPILE_CACHE_URL and NEURON_CC_FLAGS."""
    enabled, directory, _setting = _settings()
    return enabled, directory


def _settings() -> tuple:
    """(enabled, directory, the setting that chose the directory, as a user would write it)."""
    flags = cc_flags()
    if "--no_cache" in flags:
        return False, None, "--no_cache"
    url = os.environ.get("NEURON_COMPILE_CACHE_URL", "")
    if url:
        if ("://" in url and not url.startswith("file://")) or not url.removeprefix("file://"):
            raise NeuronConfigError(f"NEURON_COMPILE_CACHE_URL={url}: only local directories are supported",
                                    hint="set it to a directory path (or file:///path)")
        return True, url.removeprefix("file://"), f"NEURON_COMPILE_CACHE_URL={url}"
    directory = flag_value(flags, "cache_dir")
    if directory is not None:
        return True, directory, f"--cache_dir={directory} in NEURON_CC_FLAGS"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    directory = os.path.join(base, "neuronc")
    return True, directory, f"the default cache directory {directory}"


@dataclasses.dataclass
class Entry:
    key: str
    path: str
    size: int
    created: float
    last_used: float
    name: str
    target: str

    @property
    def age_s(self) -> float:
        return time.time() - self.created


@dataclasses.dataclass
class TemporaryFile:
    """A file being written into the cache, or left by a writer killed before its rename (orphaned)."""

    path: str
    size: int
    age_s: float
    orphaned: bool


@dataclasses.dataclass
class Cleanup:
    """What `clear` or `prune` removed, and the temporary files of live writers they left in place."""

    entries: list = dataclasses.field(default_factory=list)  # of Entry
    orphans: list = dataclasses.field(default_factory=list)  # of TemporaryFile
    being_written: list = dataclasses.field(default_factory=list)  # of TemporaryFile


class CompileCache:
    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.path.expanduser(directory))

    @classmethod
    def from_env(cls) -> "CompileCache | None":
        """The cache the settings name, its directory made if missing; None when it is turned off.
        A directory that is a file or cannot be made is a NeuronConfigError naming the setting."""
        enabled, directory, setting = _settings()
        if not enabled:
            return None
        cache = cls(directory)
        try:
            os.makedirs(cache.directory, exist_ok=True)
        except FileExistsError:
            raise NeuronConfigError(f"{setting}: {cache.directory} is a file, not a directory",
                                    hint=NO_CACHE_HINT) from None
        except OSError as error:
            raise NeuronConfigError(f"{setting}: cannot make the cache directory {cache.directory} "
                                    f"({error.strerror or error})", hint=NO_CACHE_HINT) from None
        return cache

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ENTRY_SUFFIX)

    def get(self, key: str):
        """The cached Neff for `key`, or None (a damaged entry is removed and reported as a miss)."""
        return self.read(key)[0]

    def read(self, key: str, touch: bool = True) -> tuple:
        """(the cached Neff for `key`, its sidecar), or (None, None) (a damaged entry is removed and reported as
        a miss). ``touch``: record the use now (else the caller does, with :meth:`touch`, when it suits it)."""
        from neuronc.neff import decode

        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except OSError:
            return None, None
        meta = self._meta(key)
        if meta is None:
            return None, None
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            self.remove(key)
            return None, None
        try:
            neff = decode(data)
        except NeffFormatError:
            self.remove(key)
            return None, None
        if neff.cache_key != key:  # another program's NEFF (or an older neuronc's) in this entry's place
            self.remove(key)
            return None, None
        neff.cache_key = ""  # the NEFF as compiled: the same with the cache on or off
        if touch:
            self.touch(key, meta)
        return neff, meta

    def touch(self, key: str, meta: dict) -> None:
        """Record a use of `key`'s entry (its sidecar `meta`, as :meth:`read` gave it) for `prune`."""
        try:
            self._write_meta(key, {**meta, "last_used": time.time()})
        except OSError:
            pass  # a read-only cache: `prune` sees an older last use, nothing else changes

    def _meta(self, key: str) -> dict | None:
        """The sidecar of `key`'s entry, or None when it is missing or damaged."""
        try:
            with open(self._path(key) + META_SUFFIX) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _write_meta(self, key: str, meta: dict) -> None:
        write_atomically(self._path(key) + META_SUFFIX, json.dumps(meta).encode())

    def checked_by(self, key: str) -> str | None:
        """The id of the runtime access check that the entry's NEFF passed (:meth:`mark_checked`), if any."""
        return (self._meta(key) or {}).get("access_checked_by")

    def mark_checked(self, key: str, checker: str) -> None:
        """Record that the entry's NEFF passed the runtime's load-time access check `checker`, so that the
        next process loading it from the cache can skip that check (the NEFF's bytes are verified by their
        sha256 on every read, and the verdict depends on nothing else)."""
        meta = self._meta(key)
        if meta is not None:  # else the entry is gone or damaged: it will be recompiled and checked again
            self._write_meta(key, {**meta, "access_checked_by": checker})

    def put(self, key: str, neff, extra: dict | None = None, checked_by: str | None = None) -> str | None:
        """Store `neff` under `key`, bound to it (the key goes into the stored NEFF's header); the entry's
        path, or None when it cannot be written (logged as a warning: the compilation is not lost). ``extra``:
        JSON data the caller needs beside the NEFF (an eager op's result structure; :meth:`read` returns it in
        the sidecar, as ``meta["extra"]``: JSON, not code, which the caller checks); ``checked_by``: the
        runtime access check the NEFF already passed (as :meth:`mark_checked`, in the same write)."""
        from neuronc.neff import encode

        stored = dataclasses.replace(neff, cache_key=key)
        data = encode(stored)
        neff.content_hash = stored.content_hash
        path = self._path(key)
        now = time.time()
        meta = {"sha256": hashlib.sha256(data).hexdigest(), "created": now, "last_used": now,
                "name": neff.name, "target": neff.target, "versions": _versions()}
        if extra is not None:
            meta["extra"] = extra
        if checked_by is not None:
            meta["access_checked_by"] = checked_by
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._sweep([os.path.dirname(path)])  # orphans of writers killed while storing into this shard
            write_atomically(path, data)  # the entry first: a sidecar never vouches for missing bytes
            self._write_meta(key, meta)
        except OSError as error:
            log.warning("neuronc: cannot store %s in the compile cache %s (%s); it will be compiled again "
                        "next time", neff.name, self.directory, error.strerror or error)
            return None
        return path

    def remove(self, key: str) -> None:
        for suffix in (ENTRY_SUFFIX, ENTRY_SUFFIX + META_SUFFIX):
            try:
                os.remove(self._path(key)[: -len(ENTRY_SUFFIX)] + suffix)
            except FileNotFoundError:
                pass

    def _folders(self) -> list:
        """The cache directory and its shard folders."""
        if not os.path.isdir(self.directory):
            return []
        shards = (os.path.join(self.directory, name) for name in sorted(os.listdir(self.directory)))
        return [self.directory, *(folder for folder in shards if os.path.isdir(folder))]

    def temporary_files(self, folders=None) -> list:
        """The temporary files in `folders` (default: the whole cache): being written, or orphaned."""
        found, now = [], time.time()
        for folder in self._folders() if folders is None else folders:
            for name in sorted(os.listdir(folder)):
                if not is_temporary(name):
                    continue
                path = os.path.join(folder, name)
                try:
                    info = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # renamed into place meanwhile
                found.append(TemporaryFile(path, info.st_size, now - info.st_mtime, is_orphaned(path)))
        return found

    def _sweep(self, folders=None) -> Cleanup:
        """Remove the orphaned temporary files in `folders` (default: the whole cache)."""
        cleanup = Cleanup()
        for temporary in self.temporary_files(folders):
            if not temporary.orphaned:
                cleanup.being_written.append(temporary)
            elif remove_if_orphaned(temporary.path):
                cleanup.orphans.append(temporary)
        return cleanup

    def entries(self) -> list:
        found = []
        for folder in self._folders()[1:]:
            for name in os.listdir(folder):
                if not name.endswith(ENTRY_SUFFIX):
                    continue
                path, key = os.path.join(folder, name), name[: -len(ENTRY_SUFFIX)]
                meta = self._meta(key) or {}
                size = os.path.getsize(path) if os.path.exists(path) else 0
                found.append(Entry(key, path, size, meta.get("created", 0.0), meta.get("last_used", 0.0),
                                   meta.get("name", "?"), meta.get("target", "?")))
        return sorted(found, key=lambda e: -e.last_used)

    def clear(self) -> Cleanup:
        """Remove every entry and every orphaned temporary file."""
        cleanup = self._sweep()
        cleanup.entries = self.entries()
        for entry in cleanup.entries:
            self.remove(entry.key)
        return cleanup

    def prune(self, max_bytes: int) -> Cleanup:
        """Remove the orphaned temporary files, and the least recently used entries until the cache holds
        at most `max_bytes`."""
        cleanup, total = self._sweep(), 0
        for entry in self.entries():  # most recently used first
            if total + entry.size <= max_bytes:
                total += entry.size
            else:
                self.remove(entry.key)
                cleanup.entries.append(entry)
        return cleanup
