"""``python -m shareddata info FILE``: what a file holds and whether it fits in memory.

:func:`open_source` picks the source reader by the file's extension and reads its
metadata only; :func:`info` prints each column's dtype, row shape and bytes, and the
room this machine has for them.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from typing import Any

from ._text import format_bytes, plural
from .columns._columns import ColumnSpec
from .storage._capacity import available_memory

__all__ = ["FORMATS", "CommandError", "info", "names", "open_source"]


_HDF5 = (".h5", ".hdf5", ".hdf", ".he5", ".h5ad", ".nc", ".nc4")
_PARQUET = (".parquet", ".pq")
_NUMPY = (".npy", ".npz")
FORMATS = (
    ".npy, .npz, .h5/.hdf5 (.h5ad, netCDF-4 .nc), .parquet, or a folder of .npy or .parquet files"
)


class CommandError(Exception):
    """A usage error: printed as one ``error:`` line, exit code 2."""


def open_source(path: str, names: Sequence[str] | None = None) -> Any:
    """The source reader for a file or folder, chosen by its extension (metadata only).

    Args:
        path: a ``.npy``/``.npz``/``.h5``/``.parquet`` file or a folder of them.
        names: the columns (HDF5: keys) to select; ``None`` selects all.

    Raises:
        CommandError: ``path`` does not exist or is in no format shareddata reads.
    """
    if not os.path.exists(path):
        raise CommandError(f"{path} does not exist (looked in {os.getcwd()})")
    lower = path.lower().rstrip("/")
    if os.path.isdir(path):
        entries = os.listdir(path)
        if any(n.endswith(_PARQUET) for n in entries):
            lower = ".parquet"
        elif any(n.endswith(".npy") for n in entries):
            lower = ".npy"
        else:
            raise CommandError(f"folder {path} holds no .npy or .parquet files")
    if lower.endswith(_HDF5):
        from .sources.hdf5 import HDF5Source

        return HDF5Source(path, names)
    if lower.endswith(_PARQUET):
        from .sources.parquet import parquet_source

        return parquet_source(path, names)
    if lower.endswith(_NUMPY):
        from .sources.npy import NumpySource

        return NumpySource(path, names)
    raise CommandError(f"{path}: not a format shareddata reads; it reads {FORMATS}")


# -- info ----------------------------------------------------------------------------------


def _dtype(spec: ColumnSpec) -> str:
    if spec.kind == "tensor":
        return str(spec.dtype)
    if spec.kind in ("ragged", "sparse"):
        return f"{spec.kind} {spec.dtype}"
    return spec.kind  # "str", "bytes"


def _row_shape(spec: ColumnSpec) -> str:
    if spec.kind == "tensor":
        return str(tuple(spec.shape))
    if spec.kind == "sparse":  # rows of a CSR matrix
        mean = spec.values / spec.rows if spec.rows else 0.0
        return f"{tuple(spec.shape)}, {mean:.1f} nonzeros on average"
    unit = {"str": "bytes", "bytes": "bytes"}.get(spec.kind, "values")
    mean = spec.values / spec.rows if spec.rows else 0.0
    return f"varies, {mean:.1f} {unit} on average"


def info(args: argparse.Namespace) -> int:
    """The ``info`` command: print the columns of ``args.file``; 1 if they do not fit."""
    selected = names(args.keys) if args.keys else None
    source = open_source(args.file, selected)
    try:
        specs: list[ColumnSpec] = source.specs()
    finally:
        source.close()
    rows = specs[0].rows if specs else 0
    needed = sum(s.nbytes for s in specs)
    print(f"{args.file}: {plural(len(specs), 'column')}, {plural(rows, 'row')}")
    table = [("column", "dtype", "row shape", "bytes")]
    table += [(s.name, _dtype(s), _row_shape(s), format_bytes(s.nbytes)) for s in specs]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        print(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>10}")
    ram = available_memory()
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    print(f"shared memory needed: {format_bytes(needed)} ({needed:,} bytes)")
    print(f"room for it: {format_bytes(ram)} (free RAM, within the memory cgroup's limit)")
    print(f"room in /dev/shm, which DataLoader batches pass through: {format_bytes(shm)}")
    if needed <= ram:
        print(f"fits: yes, with {format_bytes(ram - needed)} to spare")
        return 0
    print(
        f"fits: NO, {format_bytes(needed - ram)} short. Load fewer columns (--keys/--columns "
        "here, columns=[...] or keys=[...] in Python), or pass storage_dir='/a/local/disk'."
    )
    return 1


def names(values: list[str]) -> list[str]:
    """Comma-separated names given once or more, as one list."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]
