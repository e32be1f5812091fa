"""Parquet and Arrow sources: Parquet files, lists and folders of them, ``pyarrow`` tables.

Note [Reading Parquet into shared memory]
=========================================
``specs()`` gives exact sizes before anything is allocated. Fixed-shape columns are
sized from the file metadata alone (row counts, and the null counts of the column
statistics). Variable-length columns (strings, binary, lists) need the number of
values, which Parquet metadata gives only as an upper bound, so a *sizing pass*
reads each of them once and keeps nothing but the total.

``read()`` then copies ONE COLUMN at a time, in batches of rows of one row group
(``iter_batches``, about ``_BATCH_BYTES`` of decoded values each, from the row
group's uncompressed size), into the preallocated shared buffers: fixed-shape
columns through ``to_numpy`` (zero-copy over the decoded Arrow buffer),
variable-length columns through Arrow's ``offsets`` and ``values`` buffers. Each
chunk's offsets (int32 for ``string``/``list``) are rebased onto the running int64
total (:func:`rebase_offsets`), so columns beyond 2 GiB work. Arrow's memory is
given back to the system after every row group (``release_unused``): its allocator
otherwise keeps several times the data after a load (docs/internals.md#arrow-memory).

The loading process's private memory is thus bounded by a batch, not by the row
group: decoding needs about eight times the batch's values (levels, pages, the
values). Batches are decoded with ``use_threads=False``, and not ahead in other
threads: threads decoding row groups ahead gain little on few cores for a higher
peak, and their per-thread allocator heaps are what ``release_unused`` cannot
return (the figures: docs/internals.md#arrow-memory).

Column types and nulls are those of ``arrow.py`` (Arrow types -> column kinds).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..columns._columns import ColumnSpec
from ..errors import (
    MissingColumnError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._arrow_columns import ArrowColumn, Sizer, Writer, rebase_offsets
from ._arrow_extensions import UuidAs
from ._arrow_select import FillValue, make_columns, select_fields
from ._arrow_types import is_list, pyarrow_module, release_arrow_memory
from ._parquet_files import arrow_errors, parquet_files, partition_clash, read_error
from ._source import Buffer

__all__ = ["ParquetSource", "rebase_offsets"]

PathLike = str | os.PathLike
_BATCH_BYTES = 4 << 20
"""Decoded bytes of one column per batch (from the row group's uncompressed size)."""
_MAX_BATCH_ROWS = 1 << 20


def _parquet() -> ModuleType:
    pyarrow_module()
    import pyarrow.parquet

    return pyarrow.parquet


def _leaf_count(t: Any) -> int:
    """How many Parquet leaf columns an Arrow type is stored as."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        return _leaf_count(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaf_count(t.key_type) + _leaf_count(t.item_type)
    if is_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_count(t.value_type)
    if pa.types.is_dictionary(t):
        return _leaf_count(t.value_type)
    return 1


def _struct_leaves(name: str, t: Any, first: int, out: dict[str, int]) -> None:
    """The first Parquet leaf column of each field of a struct (``s.a``, ``s.b.c``)."""
    pa = pyarrow_module()
    if not pa.types.is_struct(t):
        return
    j = first
    for f in t:
        out.setdefault(f"{name}.{f.name}", j)
        _struct_leaves(f"{name}.{f.name}", f.type, j, out)
        j += _leaf_count(f.type)


@dataclass
class _ParquetFileInfo:
    path: str
    metadata: Any
    schema: Any
    row_groups: list[int]  # rows per row group
    leaf_index: dict[str, int]  # first Parquet leaf column of each top-level field

    @property
    def rows(self) -> int:
        return sum(self.row_groups)


class ParquetSource:
    """Reads columns of Parquet files (see :class:`ParquetDataset`); metadata only until asked.

    Args:
        path: a ``.parquet`` file, a glob, a folder (recursive, Hive partitions
            become columns) or a list of files (see :class:`ParquetDataset`).
        columns: the columns to load, in this order (default: all).
        fill_value: what nulls become (see :class:`ParquetDataset`); ``None`` refuses nulls.
        memory_map: map the files instead of reading them (less private memory).
        records: a list of structs comes back as a list of dicts (else a dict of lists).
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        *,
        fill_value: FillValue = None,
        memory_map: bool = True,
        records: bool = True,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        pa = pyarrow_module()
        self._pq = _parquet()
        found = parquet_files(path)
        self.paths, self.label = found.files, found.label
        self.partitions = found.partitions
        self.memory_map = memory_map
        # UUID and JSON logical types read as arrow.uuid / arrow.json: _arrow_extensions.py
        self._options = {"memory_map": memory_map, "arrow_extensions_enabled": True}
        self._open: Any = None
        self._specs: list[ColumnSpec] | None = None
        self._window: tuple[int, int] | None = None  # rows [start, stop) of select_rows
        self.files = [self._info(p) for p in self.paths]
        first = self.files[0]
        schema = first.schema
        for info in self.files:  # _parquet_files checked the first file's columns only
            clash = [f.name for f in found.partition_schema if f.name in info.schema.names]
            if clash:
                raise partition_clash(clash[0], info.path, self.label)
        schema = pa.schema([*schema, *found.partition_schema])
        names = select_fields(schema, columns, first.path)
        tops = list(dict.fromkeys(n.split(".")[0] if n not in schema.names else n
                                  for n in names))  # fmt: skip
        self._file_types: dict[str, dict[Any, str]] = {}  # column -> {type: first file}
        self.schema = self._unify(schema, tops, found.partition_schema.names, columns is None)
        self.columns = make_columns(self.schema, names, self.label, fill_value, records, uuid_as)
        self._by_name = {c.name: c for c in self.columns}
        self._partition_names = set(found.partition_schema.names)

    def _info(self, path: str) -> _ParquetFileInfo:
        try:
            with self._pq.ParquetFile(path, **self._options) as pf:
                metadata = pf.metadata
                schema = pf.schema_arrow
        except arrow_errors() as e:
            if isinstance(e, SharedDataError):
                raise
            raise read_error(path, e, "reading its metadata") from e
        row_groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        leaf_index: dict[str, int] = {}
        j = 0
        for field in schema:
            leaf_index.setdefault(field.name, j)
            _struct_leaves(field.name, field.type, j, leaf_index)
            j += _leaf_count(field.type)
        if j != metadata.num_columns:  # a layout this mapping does not know: no statistics
            leaf_index = {}
        return _ParquetFileInfo(path, metadata, schema, row_groups, leaf_index)

    def _unify(
        self, schema: Any, tops: Sequence[str], partition_names: Sequence[str], all_columns: bool
    ) -> Any:
        """The schema the selected columns are loaded with, over every file.

        Files may differ in a column's type where pyarrow can promote one to the other
        (``int32`` and ``int64``, ``string`` and ``large_string``, a null column and
        any type...: ``pa.unify_schemas(promote_options="permissive")``); each batch is
        cast to the promoted type (a value it cannot hold, an int64 beyond 2**53 as
        double, is refused by :meth:`_extract`). Otherwise the file and column are named.
        """
        pa = pyarrow_module()
        first = self.files[0]
        fields = {name: schema.field(name) for name in tops}
        for other in self.files[1:]:
            if all_columns and other.schema.names != first.schema.names:
                raise MissingColumnError(
                    f"{other.path} and {first.path} have different columns "
                    f"({other.schema.names} vs {first.schema.names}); every file must have the "
                    "same columns. Pass columns=[...] to load the columns they share."
                )
            for name in tops:
                if name in partition_names:
                    continue
                if name not in other.schema.names:
                    raise MissingColumnError(
                        f"column {name!r} is in {first.path} but not in {other.path}, which has: "
                        f"{', '.join(repr(n) for n in other.schema.names)}. Every file must "
                        "have the columns loaded."
                    )
                a, b = fields[name], other.schema.field(name)
                if a.type == b.type:
                    continue
                try:
                    unified = pa.unify_schemas(
                        [pa.schema([a]), pa.schema([b])], promote_options="permissive"
                    )
                except (pa.ArrowException, TypeError, ValueError) as e:
                    raise UnsupportedDtypeError(
                        f"column {name!r} is {b.type} in {other.path} but {a.type} in the "
                        f"files before it ({first.path}...), and pyarrow cannot promote one "
                        f"to the other ({e}). Rewrite the files with one type (e.g. "
                        f"table.cast(...)) or leave {name!r} out with columns=[...]."
                    ) from e
                fields[name] = unified.field(0)
                self._file_types.setdefault(name, {a.type: first.path}).setdefault(
                    b.type, other.path
                )
        return pa.schema([fields[n] if n in fields else schema.field(n) for n in schema.names])

    def total_rows(self) -> int:
        """Rows of every file together (before :meth:`select_rows`), from the metadata."""
        return sum(info.rows for info in self.files)

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)`` of the files together (``shard="node"``).

        Row groups outside the range are never decoded; the ones it cuts are decoded
        and sliced.
        """
        self._window = (int(start), int(stop))
        self._specs = None

    def _overlap(self, first: int, count: int) -> tuple[int, int] | None:
        """The part ``[a, b)`` of global rows ``[first, first + count)`` that is selected."""
        lo, hi = self._window if self._window is not None else (0, first + count)
        a, b = max(first, lo), min(first + count, hi)
        return (a, b) if a < b else None

    # -- reading one column, row group by row group ------------------------------------------
    def _file(self, info: _ParquetFileInfo) -> Any:
        self._close_open()
        try:
            self._open = self._pq.ParquetFile(info.path, metadata=info.metadata, **self._options)
        except arrow_errors() as e:
            if isinstance(e, SharedDataError):
                raise
            raise read_error(info.path, e, "opening it") from e
        return self._open

    def _each_chunk(self, column: ArrowColumn, fn: Callable[[str, str, Any], None]) -> None:
        """Call ``fn(file, where, chunk)`` for one column, in bounded batches of rows.

        Each row group is decoded a batch of about ``_BATCH_BYTES`` at a time
        (Note [Reading Parquet into shared memory]); nothing of a batch is
        referenced once ``fn`` returns, and Arrow's memory is given back after
        every row group.
        """
        pa = pyarrow_module()
        selector = ".".join(column.path)  # a struct's field: only its leaves are decoded
        base = 0  # global row of the current file's first row
        for f, info in enumerate(self.files):
            first_file_row, base = base, base + info.rows
            if self._overlap(first_file_row, info.rows) is None:
                continue
            if column.name in self._partition_names:  # the value of the file's folder
                a, b = self._overlap(first_file_row, info.rows)  # type: ignore[misc]
                value = pa.scalar(self.partitions[f].get(column.name), column.arrow_type)
                for start in range(a, b, _MAX_BATCH_ROWS):
                    n = min(_MAX_BATCH_ROWS, b - start)
                    fn(info.path, info.path, column.extract(pa.repeat(value, n)))
                continue
            pf = self._file(info)
            group_first = first_file_row
            for i, rows in enumerate(info.row_groups):
                group_first += rows
                if self._overlap(group_first - rows, rows) is None:
                    continue
                where = f"{info.path} (row group {i})"
                batch_rows = self._batch_rows(info, column, i)
                seen = 0
                try:
                    for batch in pf.iter_batches(
                        batch_size=batch_rows, row_groups=[i], columns=[selector],
                        use_threads=False,
                    ):  # fmt: skip
                        at = group_first - rows + seen  # global row of the batch's first row
                        seen += batch.num_rows
                        if seen > rows:
                            break
                        chunk = batch.column(0)
                        del batch
                        part = self._overlap(at, len(chunk))
                        if part is not None:
                            if part != (at, at + len(chunk)):
                                chunk = chunk.slice(part[0] - at, part[1] - part[0])
                            fn(info.path, where, self._extract(column, chunk, info.path))
                        del chunk
                except arrow_errors() as e:
                    if isinstance(e, SharedDataError):
                        raise
                    raise read_error(
                        info.path, e, f"reading column {column.name!r} of row group {i}"
                    ) from e
                if seen != rows:
                    raise SourceReadError(
                        f"{where} gave {seen} rows of {column.name!r} where its metadata says "
                        f"{rows}; re-create the file."
                    )
                release_arrow_memory()
            self._close_open()

    def _extract(self, column: ArrowColumn, chunk: Any, path: str) -> Any:
        """``column.extract(chunk)``; a value the promoted type cannot hold is named."""
        pa = pyarrow_module()
        try:
            return column.extract(chunk)
        except pa.ArrowInvalid as e:
            types = self._file_types.get(column.path[0])
            if types is None:  # the column's type is the same in every file: not a cast
                raise
            value = _first_lost(chunk, column.arrow_type)
            seen = f"its value {value!r}" if value is not None else "a value"
            others = " and ".join(f"{t} in {f}" for t, f in types.items() if t != chunk.type)
            raise UnsupportedDtypeError(
                f"column {column.name!r} is {chunk.type} in {path} but {others or 'another type'}"
                f"; the files load it as {column.arrow_type}, which cannot hold {seen} in "
                f"{path} ({e}). Fix: cast the column to one type in every file (e.g. "
                f"pq.write_table(table.cast(...))), or leave {column.name!r} out with "
                "columns=[...]."
            ) from e

    def _batch_rows(self, info: _ParquetFileInfo, column: ArrowColumn, i: int) -> int:
        """Rows per batch so that one decoded batch is about ``_BATCH_BYTES``."""
        rows = info.row_groups[i]
        first = info.leaf_index.get(column.name)
        if first is None or rows == 0:
            return max(1, min(rows, _MAX_BATCH_ROWS))
        group = info.metadata.row_group(i)
        leaves = range(first, first + _leaf_count(column.arrow_type))
        size = sum(group.column(j).total_uncompressed_size for j in leaves)
        per_row = max(1, size // rows)
        return max(1, min(rows, _MAX_BATCH_ROWS, _BATCH_BYTES // per_row))

    def _stats_nulls(self, column: ArrowColumn) -> dict[str, int] | None:
        """Nulls per file from the column statistics, or None where they are missing."""
        if self._window is not None:  # statistics cover whole row groups, not a range
            return None
        per_file: dict[str, int] = {}
        for info in self.files:
            j = info.leaf_index.get(column.name)
            if j is None or len(column.path) > 1:  # a struct's nulls are its fields' too
                return None
            if info.schema.field(column.name).type != column.arrow_type:
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

    def specs(self) -> list[ColumnSpec]:
        """Exact specs: metadata for fixed-shape columns, a sizing pass for the others."""
        if self._specs is not None:
            return self._specs
        rows = self.total_rows()
        if self._window is not None:
            rows = self._window[1] - self._window[0]
        specs = []
        for column in self.columns:
            k = column.kind
            stats = self._stats_nulls(column) if k.kind == "tensor" else None
            if stats is not None and (
                not sum(stats.values()) or column.fill is not None or not k.shape
            ):
                # statistics are exact for scalar columns; for fixed-size lists they
                # count levels, so the message's count comes from a read instead
                if sum(stats.values()):
                    if column.fill is None:
                        raise column.null_error(stats)
                    column.fill_scalar()  # a bad fill value fails before loading
                specs.append(ColumnSpec(column.name, rows, k.dtype, k.shape, k.spec_kind))
                continue
            sizer = Sizer(column)  # var-length, or no usable statistics: read once
            self._each_chunk(column, sizer.add)
            specs.append(sizer.spec(rows))
        self._specs = specs
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill one column's buffers, one batch of rows at a time."""
        writer = Writer(self._by_name[spec.name], spec, buffers)
        self._each_chunk(
            writer.column, lambda _, where, chunk: progress(writer.write(chunk, where))
        )
        writer.finish(self.label)

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def close(self) -> None:
        """Close the file being read, and give Arrow's memory back."""
        self._close_open()
        release_arrow_memory()


def _first_lost(chunk: Any, arrow_type: Any) -> Any:
    """The first value of ``chunk`` a cast to ``arrow_type`` changes, or None if none is found."""
    pa = pyarrow_module()
    pc = pa.compute
    try:
        back = chunk.cast(arrow_type, safe=False).cast(chunk.type, safe=False)
        changed = pc.fill_null(pc.not_equal(chunk, back), False)
        i = pc.index(changed, True).as_py()
        return None if i < 0 else chunk[i].as_py()
    except (pa.ArrowException, TypeError, ValueError):  # a type compute cannot compare
        return None
