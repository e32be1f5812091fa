"""Opening an HDF5 file, and read errors that name the real cause and its fix."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import (
    MissingDependencyError,
    MissingFileError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
    missing_dependency,
)

__all__ = ["check_filters", "import_h5py", "open_file", "read_errors"]

_HDF5PLUGIN = {32001, 32004, 32008, 32013, 32015, 32017, 32018, 32024, 32026, 32028, 307}
"""Filter ids ``hdf5plugin`` provides (blosc, lz4, bitshuffle, zfp, zstd, sz, ...)."""
_LZO = 305
_MAGIC = {b"PAR1": "Parquet", b"\x93NUMPY": ".npy", b"PK\x03\x04": "zip/.npz", b"ARROW1": "Arrow"}


def import_h5py() -> Any:
    """``h5py``, plus any filter plugins ``hdf5plugin`` registers when installed."""
    try:
        import h5py
    except ImportError as error:
        missing_dependency("h5py", "hdf5", error)
        raise  # unreachable: missing_dependency raises
    try:  # registers extra compression filters (blosc, zstd, lz4, ...) with HDF5
        import hdf5plugin  # noqa: F401
    except Exception:  # not installed or broken: the built-in filters still work
        pass
    return h5py


def open_file(h5py: Any, label: str) -> tuple[Any, bool]:
    """The file opened for reading, and whether as a SWMR reader; errors name the cause."""
    try:
        os.stat(label)
    except FileNotFoundError as error:
        raise MissingFileError(
            f"{label} does not exist. Pass the path of an HDF5 file (.h5, .hdf5)."
        ) from error
    except PermissionError as error:  # a folder on the way that may not be searched
        raise SourceReadError(
            f"{label} cannot be reached by this process: permission denied on a folder of "
            "its path. Fix: make the folders searchable (chmod a+x) or run as a user who "
            "may read them."
        ) from error
    if os.path.isdir(label):
        raise SourceReadError(
            f"{label} is a folder, not an HDF5 file. Pass the path of an HDF5 file."
        )
    if not os.access(label, os.R_OK):
        raise _unreadable(label)
    try:
        return h5py.File(label, "r"), False
    except OSError as error:
        text = str(error)
        if error.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or "unable to lock file" in text:
            raise SourceReadError(
                f"{label} is locked by another process that has it open for writing "
                "(HDF5's file lock). Fix: close the file in the writer before loading; or, "
                "to read it while it is written, have the writer open it with "
                "libver='latest' and set f.swmr_mode = True (shareddata then reads it as "
                "a SWMR reader); or, if no process writes it (a lock left behind on a "
                "network file system), set HDF5_USE_FILE_LOCKING=FALSE in the environment."
            ) from error
        if "already open for write" in text:  # a SWMR writer, or one that crashed
            try:
                return h5py.File(label, "r", swmr=True), True
            except OSError:
                raise SourceReadError(
                    f"{label} is marked as open for writing by another process (HDF5's "
                    "consistency flags), without SWMR. Fix: close the file in the writer, "
                    "or open it there with f.swmr_mode = True; if no process writes it "
                    f"(the writer crashed), clear the flags with: h5clear -s {label}"
                ) from error
        if error.errno in (errno.EACCES, errno.EPERM):
            raise _unreadable(label) from error
        if error.errno == errno.EIO:
            raise SourceReadError(
                f"{label} could not be read: the disk or file system reported an I/O "
                f"error ({error}). Check the disk, or copy the file elsewhere and load it."
            ) from error
        raise SourceReadError(
            f"{label} is not a readable HDF5 file ({error}). {_guess(label)}"
        ) from error


def _unreadable(label: str) -> SourceReadError:
    try:
        st = os.stat(label)
        owner = f" (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
    except OSError:
        owner = ""
    return SourceReadError(
        f"{label} cannot be read by this process: permission denied{owner}. Fix: make it "
        f"readable (chmod a+r {label}) or run as a user who may read it."
    )


def _guess(label: str) -> str:
    """What a file that is not HDF5 seems to be, and the fix."""
    try:
        with open(label, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return f"It is a {kind} file: load it with the dataset class for {kind}."
    if head.startswith(b"\x89HDF"):
        return "It is cut short or corrupt; re-create or re-download it."
    return "It may be truncated, corrupt or of another format; re-create or re-download it."


def check_filters(h5py: Any, label: str, name: str, ds: Any) -> None:
    """Refuse a dataset whose compression filter HDF5 does not have here."""
    h5z = h5py.h5z
    dcpl = ds.id.get_create_plist()
    for i in range(dcpl.get_nfilters()):
        code, flags, _, filter_name = dcpl.get_filter(i)
        if h5z.filter_avail(code):
            continue
        if flags & h5z.FLAG_OPTIONAL and _skipped(ds, i):
            continue  # an optional filter the writer could not apply: nothing to undo
        called = filter_name.decode(errors="replace") if filter_name else "unnamed"
        if code in _HDF5PLUGIN:
            fix = (
                "install the filter plugins with: pip install hdf5plugin (shareddata "
                "uses them when installed)"
            )
        elif code == _LZO:
            fix = (
                "no pip package gives h5py the LZO filter (hdf5plugin has none); "
                "re-compress the file where PyTables reads it, e.g. ptrepack "
                f"--complib=zlib --complevel=5 {label} out.h5"
            )
        else:
            fix = (
                f"build or install the HDF5 plugin of filter id {code} and point "
                "HDF5_PLUGIN_PATH at its folder, or re-write the file with gzip"
            )
        raise MissingDependencyError(
            f"dataset {name!r} of {label} is compressed with the HDF5 filter "
            f"{called!r} (id {code}), which is not available here. Fix: {fix}."
        )


def _skipped(ds: Any, index: int) -> bool:
    """Whether the first stored chunk skipped filter ``index`` (or none is stored)."""
    try:
        if ds.id.get_num_chunks() == 0:
            return True
        return bool(ds.id.get_chunk_info(0).filter_mask >> index & 1)
    except (OSError, RuntimeError, ValueError, AttributeError):
        return False


@contextmanager
def read_errors(label: str, path: str, conversion: str) -> Iterator[None]:
    """h5py's read errors as errors naming the file, the dataset and the cause."""
    try:
        yield
    except SharedDataError:  # SourceReadError, or the memory's own (full, no descriptor)
        raise
    except (OSError, RuntimeError) as error:
        text = str(error)
        if "conversion path" in text:  # a type HDF5 cannot convert: not corruption
            raise UnsupportedDtypeError(
                f"{label}: dataset {path!r} cannot be converted from {conversion} by HDF5 "
                f"({error}). Fix: store the column as a plain numeric dataset, or pass "
                "columns=[...] without it."
            ) from error
        if "not registered" in text or "can't open directory" in text:  # a filter
            raise MissingDependencyError(
                f"{label}: dataset {path!r} needs an HDF5 filter plugin that is not "
                f"available ({error}). Fix: pip install hdf5plugin, or point "
                "HDF5_PLUGIN_PATH at the plugin's folder."
            ) from error
        if isinstance(error, OSError) and error.errno == errno.EIO:
            cause = (
                "The disk or file system reported an I/O error; check it, or copy the "
                "file elsewhere and load it again."
            )
        else:
            cause = "The file is truncated or corrupt; re-create or re-download it."
        raise SourceReadError(
            f"{label}: reading dataset {path!r} failed ({error}). {cause}"
        ) from error
