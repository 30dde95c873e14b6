"""A program's inputs read from .npy and .npz files (`neuronc run`/`profile --input`), trusting nothing in them.

Nothing is unpickled: a file holding Python objects is refused (unpickling one can run any code). Each
array's header is checked against the program's input (count, shape, dtype) before its data is read, so
a small file declaring a huge array allocates nothing. Every problem is an InputMismatchError naming the
file (and the .npz member).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import zipfile
import zlib

import numpy as np

from neuronc.errors import InputMismatchError

NPY_MAGIC, ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"
HINT = "inputs are .npy files written by numpy.save (or .npz files, by numpy.savez) of numeric arrays"
# what zipfile raises on a damaged or unusual archive (an encrypted member: RuntimeError, an unknown
# compression: NotImplementedError, a damaged deflate stream: zlib.error)
ZIP_ERRORS = (zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError, zlib.error)
RECOMPILE = "the program was compiled for these shapes and dtypes; recompile for new ones"


@dataclasses.dataclass
class _Array:
    where: str  # the file, and the member of an .npz
    shape: tuple
    dtype: np.dtype
    open: object  # () -> a binary file at the start of the array's .npy data


def load_inputs(paths, entries: list, program: str, notes: list | None = None) -> list:
    """The arrays in the files `paths` (an .npz gives its arrays in order), checked against the program's
    input `entries` (neuronc.neff TensorEntry) before any data is read.

    A float64 array given for a float32 input is cast to float32 (a note appended to `notes` says so): the
    NeuronCore has no float64, and a program compiled with `--auto-cast fp64-to-fp32` takes its float64
    inputs as float32 ones, so the float64 data the model was written for is what a user has."""
    arrays = [array for path in paths for array in _arrays_in(path)]
    if len(arrays) != len(entries):
        names = ", ".join(t.name for t in entries)
        raise InputMismatchError(f"program {program!r} takes {len(entries)} inputs ({names}), got {len(arrays)}",
                                 hint="give one --input per program input, in order (an .npz counts its arrays)")
    narrowed = set()
    for i, (entry, array) in enumerate(zip(entries, arrays)):
        if _raw_bytes_of(array.dtype, entry.dtype.numpy):
            array.dtype = entry.dtype.numpy
        if array.dtype == np.float64 and entry.dtype.numpy == np.float32 and array.shape == tuple(entry.shape):
            narrowed.add(i)
            if notes is not None:
                notes.append(f"input {i} ({entry.name!r}): float64 from {array.where} cast to float32, "
                             "the program's type (the NeuronCore has no float64)")
            continue
        if array.shape != tuple(entry.shape) or array.dtype != entry.dtype.numpy:
            raise InputMismatchError(f"input {i} ({entry.name!r}) must be {entry.dtype.numpy}{list(entry.shape)}, "
                                     f"got {array.dtype}{list(array.shape)} from {array.where}", hint=RECOMPILE)
    values = [_read(array).view(array.dtype) for array in arrays]
    return [v.astype(np.float32) if i in narrowed else v for i, v in enumerate(values)]


def _raw_bytes_of(stored: np.dtype, wanted: np.dtype) -> bool:
    """numpy.save writes an ml_dtypes array (bfloat16, float8_*) as raw bytes of its width ('|V2', '|V1'): such
    an array, given for an input of that ml_dtypes type, is read as that type."""
    return (stored.kind == "V" and stored.names is None and stored.subdtype is None and wanted.kind == "V"
            and stored.itemsize == wanted.itemsize)


def _arrays_in(path) -> list:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block, or never end
            raise InputMismatchError(f"cannot read input {path}: not a regular file", hint=HINT)
        with open(path, "rb") as file:
            magic = file.read(len(NPY_MAGIC))
            if magic.startswith(NPY_MAGIC):
                file.seek(0)
                return [_header(file, str(path), lambda: open(path, "rb"))]
        if magic.startswith(ZIP_MAGIC):
            return _npz_arrays(path)
    except OSError as error:
        raise InputMismatchError(f"cannot read input {path}: {error.strerror or error}", hint=HINT) from None
    raise InputMismatchError(f"cannot read input {path}: not a .npy or .npz file", hint=HINT)


def _npz_arrays(path) -> list:
    try:
        with zipfile.ZipFile(path) as archive:
            arrays = []
            for member in archive.namelist():
                where = f"{path} (member {member})"
                if not member.endswith(".npy"):
                    raise InputMismatchError(f"cannot read input {where}: not a .npy array", hint=HINT)
                with archive.open(member) as file:
                    arrays.append(_header(file, where, lambda member=member: _member(path, member)))
            return arrays
    except ZIP_ERRORS as error:
        raise InputMismatchError(f"cannot read input {path}: a damaged .npz file ({error})", hint=HINT) from None


@contextlib.contextmanager
def _member(path, member: str):
    with zipfile.ZipFile(path) as archive, archive.open(member) as file:
        yield file


def _header(file, where: str, reopen) -> _Array:
    """The shape and dtype a .npy header declares (nothing after it is read)."""
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(file)
        else:
            raise ValueError(f".npy format version {version[0]}.{version[1]}, which neuronc does not read")
    except ValueError as error:
        raise InputMismatchError(f"cannot read input {where}: a damaged .npy header ({error})", hint=HINT) from None
    if dtype.hasobject:
        raise InputMismatchError(f"cannot read input {where}: it holds Python objects (a pickled object array), "
                                 "which neuronc never loads", hint=HINT)
    return _Array(where, tuple(shape), dtype, reopen)


def _read(array: _Array) -> np.ndarray:
    try:
        with array.open() as file:
            return np.lib.format.read_array(file, allow_pickle=False)
    except (OSError, ValueError, *ZIP_ERRORS) as error:
        raise InputMismatchError(f"cannot read input {array.where}: damaged data ({error})", hint=HINT) from None
