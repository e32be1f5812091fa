"""Parquet files as an Arrow input: one row group x one column at a time.

Note [Reading Parquet into shared memory]
=========================================
Sizes come before anything is allocated. Fixed-shape columns are sized from the file
metadata alone (row counts, and the null counts of the column statistics).
Variable-length columns (strings, binary, lists) need the number of values, which
Parquet metadata gives only as an upper bound, so a *sizing pass* reads each of them
once and keeps nothing but the total.

Each column is then copied ONE ROW GROUP at a time, in batches of rows
(``iter_batches``, about ``_BATCH_BYTES`` of decoded values each, from the row group's
uncompressed size), into the preallocated shared buffers (``arrow.py``). Arrow's
memory is given back to the system after every row group (``release_unused``): its
allocator otherwise keeps several times the data after a load
(docs/internals.md#arrow-memory). The loading process's private memory is thus
bounded by a batch: decoding needs about eight times the batch's values (levels,
pages, the values). Batches are decoded with ``use_threads=False``, and not ahead in
other threads: threads decoding row groups ahead gain little on few cores for a
higher peak, and their per-thread heaps are what ``release_unused`` cannot return.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SharedDataError
from ._arrow_columns import ArrowColumn
from ._arrow_types import is_list, pyarrow_module
from ._parquet_files import (
    arrow_errors,
    parquet_files,
    parquet_module,
    partition_clash,
    read_error,
)
from .arrow import ArrowSource, FillValue, Piece, check_files

__all__ = ["ParquetInput", "parquet_source"]

PathLike = str | os.PathLike
_BATCH_BYTES = 4 << 20
"""Decoded bytes of one column per batch (from the row group's uncompressed size)."""
_MAX_BATCH_ROWS = 1 << 20


def _leaf_count(t: Any) -> int:
    """How many Parquet leaf columns an Arrow type is stored as."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        return _leaf_count(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaf_count(t.key_type) + _leaf_count(t.item_type)
    if is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_dictionary(t):
        return _leaf_count(t.value_type)
    return 1


def _leaves(name: str, t: Any, first: int, out: dict[str, int]) -> int:
    """Record the first Parquet leaf of ``name`` and of its struct fields; return the next."""
    pa = pyarrow_module()
    out.setdefault(name, first)
    if pa.types.is_struct(t):
        j = first
        for f in t:
            j = _leaves(f"{name}.{f.name}", f.type, j, out)
    return first + _leaf_count(t)


@dataclass
class _File:
    path: str
    metadata: Any
    schema: Any
    row_groups: list[int]  # rows per row group
    leaf_index: dict[str, int]  # first Parquet leaf column of each column and struct field

    @property
    def rows(self) -> int:
        return sum(self.row_groups)


class ParquetInput:
    """Parquet files by path (see :class:`ParquetDataset`): metadata only until asked.

    Args:
        path: a ``.parquet`` file, a glob, a folder (recursive, Hive partitions
            become columns) or a list of files (see :class:`ParquetDataset`).
        columns: the columns that will be loaded (``None``: all).
        memory_map: map the files instead of reading them (less private memory).
    """

    format = "Parquet"

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        memory_map: bool = True,
    ) -> None:
        pa = pyarrow_module()
        self._pq = parquet_module()
        found = parquet_files(path)
        self.paths, self.label, self.partitions = found.files, found.label, found.partitions
        # UUID and JSON logical types read as arrow.uuid / arrow.json: _arrow_extensions.py
        self._options = {"memory_map": memory_map, "arrow_extensions_enabled": True}
        self.files = [self._info(p) for p in self.paths]
        keys = found.partition_schema.names
        for info in self.files:  # _parquet_files checked the first file's columns only
            clash = [k for k in keys if k in info.schema.names]
            if clash:
                raise partition_clash(clash[0], info.path, self.label)
        files = [(f.path, pa.schema([*f.schema, *found.partition_schema])) for f in self.files]
        self.schema, self.file_types = check_files(files, columns, promote=True, skip=keys)
        self._partition_names = set(keys)

    def _info(self, path: str) -> _File:
        try:
            with self._pq.ParquetFile(path, **self._options) as pf:
                metadata, schema = pf.metadata, pf.schema_arrow
        except arrow_errors() as e:
            if isinstance(e, SharedDataError):
                raise
            raise read_error(path, e, "reading its metadata") from e
        row_groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        leaf_index: dict[str, int] = {}
        j = 0
        for field in schema:
            j = _leaves(field.name, field.type, j, leaf_index)
        if j != metadata.num_columns:  # a layout this mapping does not know: no statistics
            leaf_index = {}
        return _File(path, metadata, schema, row_groups, leaf_index)

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
            except arrow_errors() as e:
                if isinstance(e, SharedDataError):
                    raise
                raise read_error(info.path, e, "opening it") from e
        rows = info.row_groups[i]
        batch_rows = max(1, min(rows, _MAX_BATCH_ROWS))
        first = info.leaf_index.get(column.name)
        if first is not None and rows:
            leaves = range(first, first + _leaf_count(column.arrow_type))
            group = info.metadata.row_group(i)
            per_row = max(1, sum(group.column(j).total_uncompressed_size for j in leaves) // rows)
            batch_rows = max(1, min(batch_rows, _BATCH_BYTES // per_row))
        selector = ".".join(column.path)  # a struct's field: only its leaves are decoded
        batches = opened[0].iter_batches(
            batch_size=batch_rows, row_groups=[i], columns=[selector], use_threads=False
        )
        return (batch.column(0) for batch in batches)

    def null_counts(self, column: ArrowColumn, window: bool) -> dict[str, int] | None:
        """Nulls per file from the column statistics of a scalar column, or None.

        Statistics count the levels of a fixed-size list, not its nulls, and cover whole
        row groups, not a window of rows: then the sizing pass counts.
        """
        if window or column.kind.kind != "tensor" or len(column.path) > 1:
            return None
        per_file: dict[str, int] = {}
        for info in self.files:
            j = info.leaf_index.get(column.name)
            if j is None or info.schema.field(column.name).type != column.arrow_type:
                return None
            count = 0
            for i in range(len(info.row_groups)):
                chunk = info.metadata.row_group(i).column(j)
                stats = chunk.statistics if chunk.is_stats_set else None
                if stats is None or not stats.has_null_count:
                    return None
                count += stats.null_count
            per_file[info.path] = count
        return per_file

    def close(self) -> None:
        """Nothing stays open: each file is closed after its pieces."""


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
