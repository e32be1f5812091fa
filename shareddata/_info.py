"""``python -m shareddata info FILE``: what a dataset class would load from a file, and room.

Sized with the load's own code (``source.specs()``, ``check_lengths``), so a file that
does not load fails here with the same error; nothing is loaded (metadata, and
variable-length Parquet columns read once, as the load sizes them).
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from typing import Any

from ._text import format_bytes, plural
from .columns._columns import ColumnSpec
from .datasets._load import READ_CHUNK_BYTES, check_lengths
from .errors import MissingColumnError, MissingFileError
from .sources.hdf5 import HDF5Source
from .sources.npy import NumpySource
from .sources.parquet import parquet_source
from .storage._capacity import available_memory, margin

__all__ = ["FORMATS", "CommandError", "info", "names", "open_sources"]

FORMATS = (
    ".npy, .npz, .h5/.hdf5 (.h5ad, netCDF-4 .nc), .parquet, or a folder of .npy or .parquet files"
)
# the dataset class that reads a path: the suffixes it takes, the source it makes
_READERS: dict[str, tuple[tuple[str, ...], Any]] = {
    "sd.HDF5Dataset": ((".h5", ".hdf5", ".hdf", ".he5", ".h5ad", ".nc", ".nc4"), HDF5Source),
    "sd.ParquetDataset": ((".parquet", ".pq"), parquet_source),
    "sd.NumpyDataset": ((".npy", ".npz"), NumpySource),
}


class CommandError(Exception):
    """A usage error: printed as one ``error:`` line, exit code 2."""


def open_sources(path: str, names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """``(dataset class, its source)`` for each class that reads ``path`` (metadata only).

    A file is read by the class of its extension; a folder by ``sd.NumpyDataset`` (its
    ``.npy`` files) and ``sd.ParquetDataset`` (its ``.parquet`` files, sub-folders too),
    by each that finds files of its kind there.

    Raises:
        CommandError: ``path`` does not exist or is in no format shareddata reads.
        SharedDataError: the dataset class would raise it for ``path`` and ``names``.
    """
    if not os.path.exists(path):
        raise CommandError(f"{path} does not exist (looked in {os.getcwd()})")
    if not os.path.isdir(path):
        for cls, (suffixes, make) in _READERS.items():
            if path.lower().endswith(suffixes):
                return [(cls, make(path, names))]
        raise CommandError(f"{path}: not a format shareddata reads; it reads {FORMATS}")
    found, missing = [], []
    try:
        for cls in ("sd.NumpyDataset", "sd.ParquetDataset"):
            try:
                found.append((cls, _READERS[cls][1](path, names)))
            except (MissingFileError, MissingColumnError) as e:  # none of its kind, or names
                missing.append(e)
    except BaseException:
        for _, source in found:
            source.close()
        raise
    if not found:
        columns = [e for e in missing if isinstance(e, MissingColumnError)]
        if columns:
            raise columns[0]
        raise CommandError(" ".join(map(str, missing)))
    return found


def _files(source: Any, path: str) -> str:
    """The files ``source`` reads, relative to the folder ``path`` if it is one."""
    if hasattr(getattr(source, "input", None), "paths"):  # Parquet: every file it found
        files = list(source.input.paths)
    elif hasattr(source, "entries"):  # NumpySource: the selected columns' files
        files = list(dict.fromkeys(e.path for e in source.entries))
    else:  # HDF5Source: one file
        files = [path]
    if os.path.isdir(path):
        files = [os.path.relpath(f, path) for f in files]
    return ", ".join(files[:8]) + (f", ... ({len(files)} files)" if len(files) > 8 else "")


def _dtype(spec: ColumnSpec) -> str:
    if spec.kind in ("ragged", "sparse"):
        return f"{spec.kind} {spec.dtype}"
    return str(spec.dtype) if spec.kind == "tensor" else spec.kind  # "str", "bytes"


def _row_shape(spec: ColumnSpec) -> str:
    if spec.kind == "tensor":
        return str(tuple(spec.shape))
    mean = spec.values / spec.rows if spec.rows else 0.0
    if spec.kind == "sparse":  # rows of a CSR matrix
        return f"{tuple(spec.shape)}, {mean:.1f} nonzeros on average"
    return f"varies, {mean:.1f} {'bytes' if spec.kind in ('str', 'bytes') else 'values'} on average"


def info(args: argparse.Namespace) -> int:
    """A file's columns, dtypes, rows and bytes, and whether it fits in memory.

    Describe what the dataset class that reads FILE would load, without loading it
    (metadata, and a sizing read of variable-length Parquet columns): the files read,
    each column's dtype, row shape and size in shared memory, the total, and the room
    this machine has for it. Reads {formats}. Exit code 1 when it does not fit, 2 where
    the load would fail (the same error).

    Examples:
        python -m shareddata info data.h5
        python -m shareddata info data.h5 --keys images,labels
        python -m shareddata info train.parquet --columns text,label
        python -m shareddata info features/   # a folder of .npy files
    """
    selected = names(args.keys) if args.keys else None
    sources = open_sources(args.file, selected)
    if len(sources) > 1:
        print(f"{args.file} holds files of two formats, each read by its own dataset class:")
    ram = available_memory()
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    try:  # sized as the load sizes them: a folder that does not load fails here too
        sized = [(cls, source.specs(), source) for cls, source in sources]
        described = [
            (cls, specs, check_lengths(specs, source.label), _files(source, args.file))
            for cls, specs, source in sized
        ]
    finally:
        for _, source in sources:
            source.close()
    code = 0
    for cls, specs, rows, read in described:
        needed = sum(s.nbytes for s in specs)
        print(
            f"{args.file} as {cls} loads it: {plural(len(specs), 'column')}, {plural(rows, 'row')}"
        )
        print(f"  read: {read}")
        table = [("column", "dtype", "row shape", "bytes")]
        table += [(s.name, _dtype(s), _row_shape(s), format_bytes(s.nbytes)) for s in specs]
        widths = [max(len(r[i]) for r in table) for i in range(3)]
        for r in table:
            print(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>10}")
        # what the load's capacity check asks for: its read chunk and the margin too
        asked = needed + min(needed, READ_CHUNK_BYTES) + margin(needed)
        print(f"shared memory needed: {format_bytes(needed)} ({needed:,} bytes)")
        print(f"the load asks for {format_bytes(asked)} free (with its read chunk and a margin)")
        print(f"room for it: {format_bytes(ram)} (free RAM, within the memory cgroup's limit)")
        print(f"room in /dev/shm, which DataLoader batches pass through: {format_bytes(shm)}")
        if asked <= ram:
            print(f"fits: yes, with {format_bytes(ram - asked)} to spare")
            continue
        print(
            f"fits: NO, {format_bytes(asked - ram)} short. Load fewer columns (--keys/--columns "
            "here, columns=[...] in Python), or pass storage_dir='/a/local/disk'."
        )
        code = 1
    return code


def names(values: list[str]) -> list[str]:
    """Comma-separated names given once or more, as one list."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]
