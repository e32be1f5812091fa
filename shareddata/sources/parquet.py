"""Parquet files as an Arrow input: one row group x one column at a time.

Note [Reading Parquet into shared memory]
=========================================
Fixed-shape columns are sized from the file metadata alone (row counts, and the null
counts of the column statistics); variable-length ones (strings, binary, lists) by a
*sizing pass* that reads each of them once and keeps only the totals. Each column is
then copied one row group at a time, in batches of about ``_BATCH_BYTES`` decoded
values (``iter_batches``, ``use_threads=False``: decoding threads gain little for a
higher peak), and Arrow's memory is given back after every row group
(``release_unused``; docs/internals.md#arrow-memory), so the loading process's private
memory is bounded by a batch. Files are found by ``pyarrow.dataset`` (a folder
recursively, ``.``/``_`` names skipped; Hive ``key=value`` folders become columns,
under a glob's first wildcard); a partition key that is also a column inside the
files is refused naming the fix.
"""

from __future__ import annotations

import functools
import glob
import importlib
import itertools
import os
import reprlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..errors import (
    ArgumentTypeError,
    MissingColumnError,
    MissingFileError,
)
from ._arrow_columns import ArrowColumn
from ._arrow_types import pyarrow_module
from ._io import listed_files
from .arrow import ArrowInput, ArrowSource, FillValue, Piece, check_files, read_error, read_errors

__all__ = ["ParquetInput", "parquet_files", "parquet_source"]

PathLike = str | os.PathLike
_BATCH_BYTES = 4 << 20
"""Decoded bytes of one column per batch (from the row group's uncompressed size)."""
_MAX_BATCH_ROWS = 1 << 20
_GLOB = "*?["


def _pyarrow(name: str) -> ModuleType:
    """``pyarrow.<name>`` (``parquet``, ``dataset``), imported on first use."""
    pyarrow_module()
    return importlib.import_module(f"pyarrow.{name}")


@dataclass
class _File:
    path: str
    metadata: Any
    schema: Any
    row_groups: list[int]  # rows per row group
    paths: list[tuple[str, ...]]  # per Parquet leaf column, its path (``("s", "a")``)

    @property
    def rows(self) -> int:
        return sum(self.row_groups)

    def leaves(self, column: ArrowColumn) -> list[int]:
        """The Parquet leaf columns of ``column`` (a struct field: its own), in order."""
        n = len(column.path)
        return [j for j, path in enumerate(self.paths) if path[:n] == column.path]


class ParquetInput(ArrowInput):
    """Parquet files (a file, a glob, a folder or a list): metadata only until asked."""

    format = "Parquet"

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        memory_map: bool = True,
    ) -> None:
        pa = pyarrow_module()
        self._pq = _pyarrow("parquet")
        self.paths, self.label, base = parquet_files(path)
        # UUID and JSON logical types read as arrow.uuid / arrow.json (_arrow_types.meaning_of)
        self._options = {"memory_map": memory_map, "arrow_extensions_enabled": True}
        self.files = [self._info(p) for p in self.paths]
        keys = _hive_keys(self.paths, base) if base is not None else []
        for info in self.files:  # (a key inside the files too would clash in _partitions)
            clash = [k for k in keys if k in info.schema.names]
            if clash:
                raise _partition_clash(clash[0], info.path, self.label)
        self.partitions, partition_schema = _partitions(self.paths, base, keys)
        files = [(f.path, pa.schema([*f.schema, *partition_schema])) for f in self.files]
        self.schema, self.file_types = check_files(files, columns, promote=True, skip=keys)
        self._partition_names = set(keys)

    def _info(self, path: str) -> _File:
        try:
            with self._pq.ParquetFile(path, **self._options) as pf:
                metadata, schema = pf.metadata, pf.schema_arrow
                paths = [tuple(p) for p in pf.reader.column_paths]
        except read_errors() as e:
            raise read_error(path, "Parquet", e, "reading its metadata") from e
        row_groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        return _File(path, metadata, schema, row_groups, paths)

    def total_rows(self) -> int:
        """Rows of every file together, from the metadata."""
        return sum(info.rows for info in self.files)

    def pieces(self, column: ArrowColumn) -> Iterator[Piece]:
        """One piece per row group of each file (a partition column: one per file)."""
        pa = pyarrow_module()
        for f, info in enumerate(self.files):
            if column.name in self._partition_names:  # the value of the file's folder
                value = pa.scalar(self.partitions[f].get(column.name), column.arrow_type)
                runs = [min(_MAX_BATCH_ROWS, info.rows - s)
                        for s in range(0, info.rows, _MAX_BATCH_ROWS)]  # fmt: skip
                repeats = functools.partial(map, functools.partial(pa.repeat, value), runs)
                yield Piece(info.path, info.path, info.rows, repeats)
                continue
            opened: list[Any] = []  # the file, opened once its first row group is read
            try:
                for i, rows in enumerate(info.row_groups):
                    read = functools.partial(self._batches, info, opened, column, i)
                    yield Piece(info.path, f"{info.path} (row group {i})", rows, read)
            finally:
                for pf in opened:
                    pf.close()

    def _batches(self, info: _File, opened: list[Any], column: ArrowColumn, i: int) -> Any:
        """Row group ``i`` of ``column`` in batches of about ``_BATCH_BYTES`` decoded."""
        if not opened:
            try:
                opened.append(
                    self._pq.ParquetFile(info.path, metadata=info.metadata, **self._options)
                )
            except read_errors() as e:
                raise read_error(info.path, "Parquet", e, "opening it") from e
        rows = info.row_groups[i]
        batch_rows = max(1, min(rows, _MAX_BATCH_ROWS))
        leaves = info.leaves(column)
        if leaves and rows:
            group = info.metadata.row_group(i)
            per_row = max(1, sum(group.column(j).total_uncompressed_size for j in leaves) // rows)
            batch_rows = max(1, min(batch_rows, _BATCH_BYTES // per_row))
        selector = ".".join(column.path)  # a struct's field: only its leaves are decoded
        batches = opened[0].iter_batches(
            batch_size=batch_rows, row_groups=[i], columns=[selector], use_threads=False
        )
        return (batch.column(0) for batch in batches)

    def null_counts(self, column: ArrowColumn, window: bool) -> dict[str, int] | None:
        """Nulls per file from the statistics of a scalar column (not of a window), or None."""
        if window or column.kind.kind != "tensor" or len(column.path) > 1:
            return None
        per_file: dict[str, int] = {}
        for info in self.files:
            leaves = info.leaves(column)
            if not leaves or info.schema.field(column.name).type != column.arrow_type:
                return None
            count = 0
            for i in range(len(info.row_groups)):
                chunk = info.metadata.row_group(i).column(leaves[0])
                stats = chunk.statistics if chunk.is_stats_set else None
                if stats is None or not stats.has_null_count:
                    return None
                count += stats.null_count
            per_file[info.path] = count
        return per_file


def parquet_source(
    path: PathLike | Sequence[PathLike],
    columns: Sequence[str] | None = None,
    *,
    fill_value: FillValue = None,
    memory_map: bool = True,
    records: bool = True,
    uuid_as: Any = "uuid",
) -> ArrowSource:
    """The source of :class:`ParquetDataset`: the Parquet files' columns (see there)."""
    files = ParquetInput(path, columns, memory_map)
    return ArrowSource(files, columns, fill_value=fill_value, records=records, uuid_as=uuid_as)


def parquet_files(path: Any) -> tuple[list[str], str, str | None]:
    """The files of a path, glob, folder or list, a label, and where Hive partitions start."""
    base: str | None = None
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if os.path.isdir(p):
            try:  # an empty schema: no file is opened to infer one (a README.txt may sort first)
                ds, empty = _pyarrow("dataset"), pyarrow_module().schema([])
                found = ds.dataset(p, format="parquet", schema=empty)
            except read_errors() as e:
                raise read_error(p, "Parquet", e, "listing its files") from e
            found = sorted(f for f in found.files if f.endswith(".parquet"))
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
            files = sorted(f for f in matched if os.path.isfile(f) and f.endswith(".parquet"))
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
    return files, label, base


def _glob_root(pattern: str) -> str:
    """The folder a glob's first wildcard is under (where Hive partitions start)."""
    parts = pattern.split(os.sep)
    fixed = itertools.takewhile(lambda part: not any(c in part for c in _GLOB), parts)
    return os.sep.join(fixed) or "."


def _hive_keys(files: list[str], base: str) -> list[str]:
    """The Hive partition keys (``key=value`` folder names under ``base``), in folder order."""
    keys: dict[str, None] = {}
    for f in files:
        for part in os.path.relpath(os.path.dirname(f), base).split(os.sep):
            if "=" in part:
                keys.setdefault(part.split("=", 1)[0])
    return list(keys)


def _partition_clash(key: str, file: str, label: str) -> MissingColumnError:
    """The error for a Hive partition key that is also a column inside the files."""
    every = label if any(c in label for c in _GLOB) else os.path.join(label, "**", "*.parquet")
    return MissingColumnError(
        f"{label} is partitioned by {key!r} (its {key}=... folders), and {key!r} is also a column "
        f"inside its files ({file}), as polars' write_parquet(partition_by=...) writes them: "
        f"{key!r} would be two columns. Fix: pass the files themselves, which reads {key!r} from "
        f"inside them: sd.ParquetDataset(sorted(glob.glob({every!r}, recursive=True))); or write "
        "the files without the key column (polars: pl.PartitionBy(..., include_key=False); "
        "pyarrow.dataset.write_dataset with partitioning_flavor='hive' leaves it out)."
    )


def _partitions(
    files: list[str], base: str | None, keys: list[str]
) -> tuple[list[dict[str, Any]], Any]:
    """Per file, its Hive partition values (``key=value`` folders under ``base``), their schema."""
    pa, ds = pyarrow_module(), _pyarrow("dataset")
    if base is None or not keys:
        return [{} for _ in files], pa.schema([])
    try:
        dataset = ds.dataset(files, format="parquet", partitioning="hive", partition_base_dir=base)
        fragments = {os.path.normpath(f.path): f for f in dataset.get_fragments()}
    except read_errors() as e:
        raise read_error(base, "Parquet", e, "reading its partition folders") from e
    per_file = [ds.get_partition_keys(fragments[os.path.normpath(f)].partition_expression)
                for f in files]  # fmt: skip
    found = {k for d in per_file for k in d}  # in folder order, as the dataset's schema
    return per_file, pa.schema([f for f in dataset.schema if f.name in found])
