"""Which Parquet files a path names: a file, a glob, a folder (recursive) or a list.

Discovery is ``pyarrow.dataset``'s, not hand-written path logic: a folder is searched
recursively (names starting with ``.`` or ``_`` are skipped, as Spark's ``_SUCCESS``),
and Hive partition folders (``year=2024/part-0.parquet``) become columns, their values
per file read from the dataset's fragments. A glob's Hive partitions start under its
first wildcard. A partition key that is also a column inside the files (what polars'
``write_parquet(partition_by=...)`` writes) is refused naming the key and the fix.
Errors name the path and what to pass instead.
"""

from __future__ import annotations

import glob
import os
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..errors import ArgumentTypeError, MissingColumnError, MissingFileError, SourceReadError
from ._arrow_types import pyarrow_module
from ._io import listed_files

__all__ = [
    "Found",
    "arrow_errors",
    "parquet_files",
    "parquet_module",
    "partition_clash",
    "read_error",
]

_SUFFIXES = (".parquet",)


def _dataset() -> ModuleType:
    pyarrow_module()
    import pyarrow.dataset

    return pyarrow.dataset


def parquet_module() -> ModuleType:
    """``pyarrow.parquet``, imported on first use."""
    pyarrow_module()
    import pyarrow.parquet

    return pyarrow.parquet


_GLOB = "*?["


@dataclass
class Found:
    """What a path, glob, folder or list names: the files, in order, and their partitions."""

    files: list[str]
    label: str
    partitions: list[dict[str, Any]]  # per file: hive key -> value
    partition_schema: Any  # the partition columns' Arrow fields (pa.schema)


def parquet_files(path: Any) -> Found:
    """The files of a path / glob / folder (recursive) / list of paths, and their partitions.

    Discovery is ``pyarrow.dataset``'s: a folder is searched recursively (names
    starting with ``.`` or ``_`` are skipped, as Spark's ``_SUCCESS``), and Hive
    partition folders (``year=2024/part-0.parquet``) become columns. Only files
    ending in ``.parquet`` are read from a folder or glob.
    """
    base: str | None = None
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if os.path.isdir(p):
            found = sorted(f for f in _discover(p) if f.endswith(_SUFFIXES))
            if not found:
                raise MissingFileError(
                    f"folder {p} holds no .parquet files (sub-folders included); pass a "
                    ".parquet file, a glob or a list of files."
                )
            files, label, base = found, p, p
        elif os.path.exists(p):
            files, label = [p], p
        elif any(c in p for c in _GLOB):
            matched = glob.glob(p, recursive=True)
            files = sorted(f for f in matched if os.path.isfile(f) and f.endswith(_SUFFIXES))
            if not files:
                raise MissingFileError(
                    f"the pattern {p} matches no .parquet file; check the folder and the pattern "
                    "(use ** to search sub-folders)."
                )
            label = p
            base = _glob_root(p)
        else:
            raise MissingFileError(
                f"{p} does not exist. Pass a .parquet file, a glob (data/*.parquet), a list of "
                "files, or a folder of .parquet files."
            )
    elif isinstance(path, Sequence) and not isinstance(path, (bytes, bytearray)):
        bad = [f for f in path if not isinstance(f, (str, os.PathLike))]
        if bad:
            raise ArgumentTypeError(
                f"the list of Parquet files holds {reprlib.repr(bad[0])} (type "
                f"{type(bad[0]).__name__}); every item must be a path (a str or pathlib.Path)."
            )
        files, label = listed_files(path, "Parquet")
    else:
        raise ArgumentTypeError(
            f"ParquetDataset cannot read path={reprlib.repr(path)} (type {type(path).__name__}); "
            "pass a .parquet path, a glob, a list of paths, or a folder of .parquet "
            "files (for a pyarrow.Table use ArrowDataset)."
        )
    partitions, schema = _partitions(files, base, label)
    return Found(files, label, partitions, schema)


def _glob_root(pattern: str) -> str:
    """The folder a glob's first wildcard is under (where Hive partitions start)."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts:
        if any(c in part for c in _GLOB):
            break
        fixed.append(part)
    return os.sep.join(fixed) or "."


def _discover(folder: str) -> list[str]:
    """The files ``pyarrow.dataset`` finds under ``folder`` (recursively)."""
    try:
        # an empty schema: no file is opened to infer one (a README.txt may sort first)
        found = _dataset().dataset(folder, format="parquet", schema=pyarrow_module().schema([]))
        return list(found.files)
    except arrow_errors() as e:
        raise read_error(folder, e, "listing its files") from e


def _hive_keys(files: list[str], base: str) -> list[str]:
    """The Hive partition keys (``key=value`` folder names under ``base``), in folder order."""
    keys: dict[str, None] = {}
    for f in files:
        for part in os.path.relpath(os.path.dirname(f), base).split(os.sep):
            if "=" in part:
                keys.setdefault(part.split("=", 1)[0])
    return list(keys)


def partition_clash(key: str, file: str, label: str) -> MissingColumnError:
    """The error for a Hive partition key that is also a column inside the files."""
    every = label if any(c in label for c in _GLOB) else os.path.join(label, "**", "*.parquet")
    return MissingColumnError(
        f"{label} is partitioned by {key!r} (its {key}=... folders), and {key!r} is also a "
        f"column inside its files ({file}), as polars' write_parquet(partition_by=...) "
        f"writes them: {key!r} would be two columns. Fix: pass the files themselves, which "
        f"reads {key!r} from inside them: sd.ParquetDataset(sorted(glob.glob({every!r}, "
        "recursive=True))); or write the files without the key column (polars: "
        "pl.PartitionBy(..., include_key=False); pyarrow.dataset.write_dataset with "
        "partitioning_flavor='hive' leaves it out)."
    )


def _partitions(files: list[str], base: str | None, label: str) -> tuple[list[dict[str, Any]], Any]:
    """Per file, its Hive partition values (``key=value`` folders under ``base``)."""
    pa, ds = pyarrow_module(), _dataset()
    keys = _hive_keys(files, base) if base is not None else []
    if base is None or not keys:
        return [{} for _ in files], pa.schema([])
    try:  # a key inside the files too would fail below as a type clash or be loaded twice
        inside = [k for k in keys if k in parquet_module().read_schema(files[0]).names]
    except arrow_errors() as e:
        raise read_error(files[0], e, "reading its schema") from e
    if inside:
        raise partition_clash(inside[0], files[0], label)
    try:
        dataset = ds.dataset(files, format="parquet", partitioning="hive", partition_base_dir=base)
        fragments = {os.path.normpath(f.path): f for f in dataset.get_fragments()}
    except arrow_errors() as e:
        raise read_error(base, e, "reading its partition folders") from e
    per_file = [ds.get_partition_keys(fragments[os.path.normpath(f)].partition_expression)
                for f in files]  # fmt: skip
    found = {k for d in per_file for k in d}  # in folder order, as the dataset's schema
    return per_file, pa.schema([f for f in dataset.schema if f.name in found])


def arrow_errors() -> tuple[type[BaseException], ...]:
    pa = pyarrow_module()
    return (pa.ArrowException, OSError, ValueError, EOFError)


def read_error(path: str, error: BaseException, doing: str) -> SourceReadError:
    return SourceReadError(
        f"{path} could not be read as Parquet while {doing} ({type(error).__name__}: {error}). "
        "The file may be truncated or not a Parquet file; re-create it."
    )
