"""The one Arrow source: any Arrow input's columns, sized from its schema, copied batch by batch.

An input (:class:`ArrowInput`) gives its schema, its rows and per column the
:class:`Piece` s its rows come in: in-memory tables (:class:`TableInput`), IPC files and
HF folders (``_arrow_ipc.py``), Parquet (``parquet.py``). :class:`ArrowSource` does the
rest: which columns (struct fields as ``s.a``), nulls, a window of rows, the sizing pass
and the copy (``_arrow_columns.py``).
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..columns._columns import ColumnSpec
from ..errors import (
    ArgumentTypeError,
    MissingColumnError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._arrow_columns import ArrowColumn, Sizer, Writer
from ._arrow_types import UuidAs, pyarrow_module, release_arrow_memory, temporal_storage
from ._source import Buffer, select_columns

__all__ = [
    "ArrowInput", "ArrowSource", "FillValue", "Piece", "TableInput", "check_files", "read_error",
    "read_errors",
]  # fmt: skip

FillValue = Any  # a scalar, or a mapping {column: scalar}
_Field = tuple[str, tuple[str, ...], Any, Any]  # name, path, type, metadata
_NESTED_ROWS = 1 << 16  # rows of a nested column taken apart at a time


@dataclass
class Piece:
    """Rows of one column that come together: a table chunk, a file, a row group."""

    file: str  # the file (or table), for null counts and messages
    where: str  # the file and the part of it (``f.parquet (row group 3)``), for messages
    rows: int
    batches: Callable[[], Iterable[Any]]  # the column's arrays, decoded when iterated


class ArrowInput:
    """What an input gives: ``label``, ``schema``, ``total_rows()`` and ``pieces(column)``.

    ``pieces`` yields a column's pieces in row order (a struct field: its top-level
    column's); ``null_counts`` the nulls per file from metadata alone, or None (a
    sizing pass counts them); ``file_types``: column -> {type: first file}, where promoted.
    """

    label: str
    schema: Any
    format = ""  # what the files are, for messages ("": an in-memory table)
    file_types: dict[str, dict[Any, str]] = {}

    def total_rows(self) -> int:
        """Rows of the whole input."""
        raise NotImplementedError

    def pieces(self, column: ArrowColumn) -> Iterator[Piece]:
        """``column``'s pieces, in row order."""
        raise NotImplementedError

    def null_counts(self, column: ArrowColumn, window: bool) -> dict[str, int] | None:
        """Nulls per file from metadata alone, or None."""
        return None

    def close(self) -> None:
        """Release the files (called after loading, also on error)."""


class ArrowSource:
    """Reads the selected columns of an :class:`ArrowInput` into shared buffers.

    ``columns``: in this order (a struct's name selects its fields); ``fill_value``: what
    nulls become (None refuses them); ``records``: lists of structs as lists of dicts;
    ``types``: loaded types of some top-level columns (each batch is cast to it).
    """

    def __init__(
        self,
        input: ArrowInput,
        columns: Sequence[str] | None = None,
        *,
        fill_value: FillValue = None,
        records: bool = True,
        uuid_as: UuidAs = "uuid",
        types: Mapping[str, Any] | None = None,
    ) -> None:
        self.input, self.label = input, input.label
        schema = input.schema
        for name, t in (types or {}).items():
            i = schema.get_field_index(name)
            schema = schema.set(i, schema.field(i).with_type(t))
        fields = _fields(schema)
        names = _select(fields, columns, self.label)
        per_column = isinstance(fill_value, Mapping)
        if per_column:
            unknown = [k for k in fill_value if k not in names]
            if unknown:
                raise MissingColumnError(
                    f"fill_value names column {unknown[0]!r}, which is not loaded from "
                    f"{self.label}; the columns are: {', '.join(map(repr, names))}."
                )
        by_name = {name: (path, t, meta) for name, path, t, meta in fields}
        self.columns = []
        for name in names:
            path, t, meta = by_name[name]
            fill = fill_value.get(name) if per_column else fill_value
            is_global = fill is not None and not per_column
            self.columns.append(
                ArrowColumn(name, t, self.label, fill, is_global, path, records, meta, uuid_as)
            )
        self._by_name = {c.name: c for c in self.columns}
        self._window: tuple[int, int] | None = None
        self._specs: list[ColumnSpec] | None = None

    def total_rows(self) -> int:
        """Rows of the whole input (before :meth:`select_rows`)."""
        return self.input.total_rows()

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)``: pieces outside are never decoded."""
        self._window, self._specs = (int(start), int(stop)), None

    def _chunks(self, column: ArrowColumn) -> Iterator[tuple[Piece, Any]]:
        """``column``'s normalized chunks with their pieces, in row order, window applied."""
        lo, hi = self._window or (0, 1 << 62)
        step = _NESTED_ROWS if column.kind.kind == "nested" else None
        end = 0
        for piece in self.input.pieces(column):
            first, end = end, end + piece.rows
            if end <= lo or first >= hi:
                continue
            seen = 0
            try:
                for batch in piece.batches():
                    at, n = first + seen, len(batch)
                    seen += n
                    if seen > piece.rows:
                        break
                    a, b = max(at, lo), min(at + n, hi)
                    if a < b:
                        part = batch if b - a == n else batch.slice(a - at, b - a)
                        for i in range(0, b - a, step or b - a):
                            rows = part if step is None else part.slice(i, step)
                            yield piece, self._extract(column, rows, piece.file)
                            del rows
                        del part
                    del batch  # nothing of it is referenced when the next is decoded
            except read_errors() as e:
                if isinstance(e, SharedDataError) or not self.input.format:
                    raise
                doing = f"reading column {column.name!r}"
                raise read_error(piece.where, self.input.format, e, doing) from e
            if seen != piece.rows:
                raise SourceReadError(
                    f"{piece.where} gave {seen} rows of {column.name!r} where its metadata "
                    f"says {piece.rows}; re-create the file."
                )
            release_arrow_memory()

    def _extract(self, column: ArrowColumn, chunk: Any, path: str) -> Any:
        """``column.extract(chunk)``; a value the promoted type cannot hold is named."""
        pa = pyarrow_module()
        try:
            return column.extract(chunk)
        except pa.ArrowInvalid as e:
            types = self.input.file_types.get(column.path[0])
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

    def specs(self) -> list[ColumnSpec]:
        """Exact specs: from metadata where it says enough, else from one sizing pass."""
        if self._specs is not None:
            return self._specs
        rows = self.total_rows() if self._window is None else self._window[1] - self._window[0]
        specs = []
        for column in self.columns:
            k = column.kind
            nulls = self.input.null_counts(column, self._window is not None)
            total = sum(nulls.values()) if nulls is not None else 0
            if total and column.fill is None and not k.shape:
                raise column.null_error(nulls)  # type: ignore[arg-type]
            if nulls is not None and (not total or column.fill is not None):
                if total:
                    _ = column.fill_scalar  # a bad fill value fails before loading
                specs.append(ColumnSpec(column.name, rows, k.dtype, k.shape, k.spec_kind))
                continue
            sizer = Sizer(column)  # var-length, or nulls to count: read once
            for piece, chunk in self._chunks(column):
                sizer.add(piece.file, chunk)
                del chunk  # not alive while the next batch is decoded
            specs.append(sizer.spec(rows))
        self._specs = specs
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill one column's buffers, one record batch at a time."""
        writer = Writer(self._by_name[spec.name], spec, buffers)
        for piece, chunk in self._chunks(writer.column):
            progress(writer.write(chunk, piece.where))
            del chunk  # not alive while the next batch is decoded
        writer.finish(self.label)

    def close(self) -> None:
        """Close the input's files and give Arrow's memory back."""
        self.input.close()
        release_arrow_memory()


def read_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises for a file it cannot read."""
    return (pyarrow_module().ArrowException, OSError, ValueError, EOFError)


def read_error(path: str, format: str, error: BaseException, doing: str) -> SourceReadError:
    """The error for ``path``, which ``format``'s reader failed on while ``doing``."""
    return SourceReadError(
        f"{path} could not be read as {format} while {doing} ({type(error).__name__}: "
        f"{error}). The file may be truncated or corrupt; re-create it."
    )


def _fields(schema: Any) -> list[_Field]:
    """Every loadable column: ``(name, path, type, metadata)``, structs flattened (``s.a``).

    A struct stored as an (unregistered) extension type stays one column.
    """
    pa = pyarrow_module()
    out: list[_Field] = []

    def walk(name: str, path: tuple[str, ...], field: Any) -> None:
        t = field.type
        extension = b"ARROW:extension:name" in (field.metadata or {})
        if pa.types.is_struct(t) and t.num_fields and not extension:
            for f in t:
                walk(f"{name}.{f.name}", (*path, f.name), f)
        else:
            out.append((name, path, t, field.metadata))

    for f in schema:
        walk(f.name, (f.name,), f)
    return out


def _select(fields: Sequence[_Field], columns: Any, label: str) -> list[str]:
    """The selected columns, in order (a struct's name, ``s`` or ``s.b``, selects its fields)."""
    groups: dict[str, list[str]] = {}
    for name, path, _, _ in fields:
        for k in range(1, len(path)):
            groups.setdefault(".".join(path[:k]), []).append(name)
    return select_columns([f[0] for f in fields], columns, label, groups)


def check_files(
    files: Sequence[tuple[str, Any]],
    columns: Sequence[str] | None,
    promote: bool,
    skip: Sequence[str] = (),
) -> tuple[Any, dict[str, dict[Any, str]]]:
    """The schema the ``(path, schema)`` files' loaded columns share, and the promoted columns.

    ``columns=None``: every file must have the same columns. ``promote``: types may
    differ where ``pa.unify_schemas(promote_options="permissive")`` promotes them (each
    batch is then cast). ``skip``: columns not in the files (Hive partitions).
    """
    pa = pyarrow_module()
    (first, schema) = files[0]
    promoted: dict[str, dict[Any, str]] = {}
    wanted = [f.name for f in schema]
    if columns is not None:  # the top-level columns of the selected names
        names = _select(_fields(schema), columns, first)
        wanted = list(dict.fromkeys(n if n in schema.names else n.split(".")[0] for n in names))
    fields = {n: schema.field(n) for n in wanted if n not in skip}
    for path, other in files[1:]:
        if columns is None and other.names != schema.names:
            raise MissingColumnError(
                f"{path} and {first} have different columns ({other.names} vs {schema.names}); "
                "every file must have the same columns. Pass columns=[...] to load the columns "
                "they share."
            )
        for name, a in list(fields.items()):
            if name not in other.names:
                raise MissingColumnError(
                    f"column {name!r} is in {first} but not in {path}, which has: "
                    f"{', '.join(repr(n) for n in other.names)}. Every file must have the "
                    "columns loaded."
                )
            b = other.field(name)
            if a.type == b.type:
                continue
            try:
                if not promote:
                    raise TypeError("the files of one dataset must have one type per column")
                both = [pa.schema([a]), pa.schema([b])]
                fields[name] = pa.unify_schemas(both, promote_options="permissive").field(0)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise UnsupportedDtypeError(
                    f"column {name!r} is {b.type} in {path} but {a.type} in the files before "
                    f"it ({first}...)"
                    f"{', and pyarrow cannot promote one to the other' if promote else ''} "
                    f"({e}). Rewrite the files with one type (e.g. table.cast(...)) or leave "
                    f"{name!r} out with columns=[...]."
                ) from e
            promoted.setdefault(name, {a.type: first}).setdefault(b.type, path)
    return pa.schema([fields.get(f.name, f) for f in schema]), promoted


def _first_lost(chunk: Any, arrow_type: Any) -> Any:
    """The first value of ``chunk`` a cast to ``arrow_type`` changes, or None."""
    pa = pyarrow_module()
    pc = pa.compute
    try:
        back = chunk.cast(arrow_type, safe=False).cast(chunk.type, safe=False)
        changed = pc.fill_null(pc.not_equal(chunk, back), False)
        i = pc.index(changed, True).as_py()
        return None if i < 0 else chunk[i].as_py()
    except (pa.ArrowException, TypeError, ValueError):  # a type compute cannot compare
        return None


class TableInput(ArrowInput):
    """An in-memory table (or record batch, frame, HF dataset): each chunk is a piece."""

    label = "the Arrow table"

    def __init__(self, table: Any) -> None:
        self.table = _as_table(table)
        self.schema = self.table.schema

    def total_rows(self) -> int:
        """Rows of the table."""
        return int(self.table.num_rows)

    def pieces(self, column: ArrowColumn) -> Iterator[Piece]:
        """One piece per chunk of ``column``'s top-level column."""
        for chunk in self.table.column(column.path[0]).chunks:
            yield Piece(self.label, self.label, len(chunk), functools.partial(list, [chunk]))

    def close(self) -> None:
        """Drop the reference to the table (the caller's table is untouched)."""
        self.table = None

    def key(self, names: list[str]) -> tuple[Any, ...]:
        """What tells in-memory tables apart across local ranks: schema, length, sampled rows."""
        pa = pyarrow_module()
        table = self.table.select(names)
        n = table.num_rows
        rows = sorted({round(i * (n - 1) / 63) for i in range(64)}) if n else []
        sample = pa.concat_tables([table.slice(i, 1) for i in rows]) if rows else table
        # temporal values as their numbers: a timestamp[ns] has no datetime
        plain = [c.cast(temporal_storage(c.type) or c.type) for c in sample.columns]
        values = pa.table(plain, names=sample.column_names).to_pylist()
        return ("ArrowDataset", table.schema.to_string(), n, values)


def _as_table(table: Any) -> Any:
    """``table`` as a ``pyarrow.Table`` (no copy), or ArgumentTypeError naming the fix.

    Any ``__arrow_c_stream__`` / ``__arrow_c_array__`` exporter converts through
    ``pa.table``; an HF ``datasets.Dataset`` gives its table in its current row order.
    """
    pa = pyarrow_module()
    if isinstance(table, pa.Table):
        return table
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([table])
    if type(table).__module__.startswith("datasets.") and hasattr(table, "flatten_indices"):
        if getattr(table, "_indices", None) is not None:
            table = table.flatten_indices()
        return table.data.table
    exports = hasattr(table, "__arrow_c_stream__") or hasattr(table, "__arrow_c_array__")
    if exports and not isinstance(table, (pa.ChunkedArray, pa.Array)):
        try:
            return pa.table(table)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise UnsupportedDtypeError(
                f"ArrowDataset could not read the Arrow data a {type(table).__name__} exports "
                f"({type(e).__name__}: {e}); it must export a table or a struct array "
                "(one field per column)."
            ) from e
    hint = {
        "pandas": "Convert it with pa.Table.from_pandas(df, preserve_index=False).",
        "polars": "Convert it with df.to_arrow().",
    }.get(type(table).__module__.split(".")[0], "Build one with pa.table({column: values}).")
    raise ArgumentTypeError(
        f"ArrowDataset: table={reprlib.repr(table)} (type {type(table).__name__}) is not a "
        f"pyarrow.Table or RecordBatch. {hint}"
    )
