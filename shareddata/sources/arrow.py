"""The one Arrow source: any Arrow input's columns, sized from its schema, copied batch by batch.

An input only says what it holds (:class:`ArrowInput`): its schema, its rows, and per
column the :class:`Piece` s its rows come in, each a row count and the record batches
decoded on demand. The inputs: in-memory tables and frames (``_arrow_table.py``), Arrow
IPC files and streams and HF ``save_to_disk`` folders (``_arrow_ipc.py``), Parquet files
(``parquet.py``: one row group x one column at a time). :class:`ArrowSource` does the
rest for all of them: which columns (struct fields as ``s.a``), their kinds
(``_arrow_types.py``), nulls, a window of rows (``shard="node"``), the sizing pass and
the copy into the shared buffers (``_arrow_columns.py``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..columns._columns import ColumnSpec
from ..errors import (
    ArgumentTypeError,
    EmptySelectionError,
    MissingColumnError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._arrow_columns import ArrowColumn, Sizer, Writer
from ._arrow_extensions import UuidAs
from ._arrow_types import pyarrow_module, release_arrow_memory
from ._source import Buffer

__all__ = ["ArrowInput", "ArrowSource", "FillValue", "Piece", "check_files"]

FillValue = Any  # a scalar, or a mapping {column: scalar}
_NESTED_ROWS = 1 << 16
"""Rows of a nested column taken apart at a time (bounds the temporaries)."""


@dataclass
class Piece:
    """Rows of one column that come together: a table chunk, a file, a row group."""

    file: str  # the file (or table), for null counts and messages
    where: str  # the file and the part of it (``f.parquet (row group 3)``), for messages
    rows: int
    batches: Callable[[], Iterable[Any]]  # the column's arrays, decoded when iterated


class ArrowInput(Protocol):
    """What an Arrow input says: its schema, its rows, and each column's pieces."""

    label: str
    schema: Any  # the schema the columns are loaded with (over every file)
    file_types: dict[str, dict[Any, str]]  # column -> {type: first file}, where promoted
    format: str  # what the files are, for messages ("Parquet"; "": an in-memory table)

    def total_rows(self) -> int:
        """Rows of the whole input."""
        ...

    def pieces(self, column: ArrowColumn) -> Iterator[Piece]:
        """``column``'s pieces, in row order (a struct field: its top-level column's)."""
        ...

    def null_counts(self, column: ArrowColumn, window: bool) -> dict[str, int] | None:
        """Nulls per file from metadata alone, or None (then a sizing pass counts them)."""
        ...

    def close(self) -> None:
        """Release the files (called after loading, also on error)."""
        ...


class ArrowSource:
    """Reads the selected columns of an :class:`ArrowInput` into shared buffers.

    Args:
        input: the table, IPC files or Parquet files.
        columns: the columns to load, in this order (default: all; a struct's name
            selects its fields).
        fill_value: what nulls become (see :class:`ParquetDataset`); ``None`` refuses nulls.
        records: a list of structs comes back as a list of dicts (else a dict of lists).
        uuid_as: ``arrow.uuid`` values as ``"uuid"`` (``uuid.UUID``) or ``"tensor"``.
        types: loaded types of some top-level columns (each batch is cast to it).
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
        names = _select([f[0] for f in fields], columns, self.label, _groups(fields))
        if isinstance(fill_value, Mapping):
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
            fill = fill_value.get(name) if isinstance(fill_value, Mapping) else fill_value
            is_global = fill is not None and not isinstance(fill_value, Mapping)
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
        """Describe and read only rows ``[start, stop)`` (``shard="node"``).

        Pieces outside the range are never decoded; the ones it cuts are sliced.
        """
        self._window, self._specs = (int(start), int(stop)), None

    def _chunks(self, column: ArrowColumn) -> Iterator[tuple[Piece, Any]]:
        """``column``'s normalized chunks with their pieces, in row order, window applied."""
        pa = pyarrow_module()
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
            except (pa.ArrowException, OSError, ValueError, EOFError) as e:
                if isinstance(e, SharedDataError) or not self.input.format:
                    raise
                raise SourceReadError(
                    f"{piece.where} could not be read as {self.input.format} while reading "
                    f"column {column.name!r} ({type(e).__name__}: {e}). The file may be "
                    "truncated or corrupt; re-create it."
                ) from e
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
        rows = self.total_rows()
        if self._window is not None:
            rows = self._window[1] - self._window[0]
        specs = []
        for column in self.columns:
            k = column.kind
            nulls = self.input.null_counts(column, self._window is not None)
            if nulls and sum(nulls.values()) and column.fill is None and not k.shape:
                raise column.null_error(nulls)  # exact for scalars (for lists: levels)
            if nulls is not None and (not sum(nulls.values()) or column.fill is not None):
                if sum(nulls.values()):
                    column.fill_scalar()  # a bad fill value fails before loading
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


# -- which columns: struct fields as columns, names checked -----------------------------------


def _fields(schema: Any) -> list[tuple[str, tuple[str, ...], Any, Any]]:
    """Every loadable column: ``(name, path, type, metadata)``, structs flattened.

    A struct column ``s`` with fields ``a`` and ``b`` gives ``s.a`` and ``s.b`` (nested
    structs ``s.b.c``), the names ``Table.flatten()`` gives them. The field metadata
    names an extension type that is not registered here (``_arrow_extensions.py``).
    """
    pa = pyarrow_module()
    out: list[tuple[str, tuple[str, ...], Any, Any]] = []

    def walk(name: str, path: tuple[str, ...], field: Any) -> None:
        t = field.type
        extension = b"ARROW:extension:name" in (field.metadata or {})  # stored as a struct
        if pa.types.is_struct(t) and t.num_fields and not extension:
            for f in t:
                walk(f"{name}.{f.name}", (*path, f.name), f)
        else:
            out.append((name, path, t, field.metadata))

    for f in schema:
        walk(f.name, (f.name,), f)
    return out


def _groups(fields: Sequence[tuple[str, tuple[str, ...], Any, Any]]) -> dict[str, list[str]]:
    """Each struct's name (``s``, ``s.b``) -> the flattened columns under it."""
    groups: dict[str, list[str]] = {}
    for name, path, _, _ in fields:
        for k in range(1, len(path)):
            groups.setdefault(".".join(path[:k]), []).append(name)
    return groups


def _select(
    available: Sequence[str],
    columns: Sequence[str] | None,
    label: str,
    groups: Mapping[str, list[str]],
) -> list[str]:
    """The selected columns, in order (a struct's name selects its fields)."""
    listed = ", ".join(repr(n) for n in available) or "no columns"
    if columns is None:
        wanted = list(available)
    else:
        if not isinstance(columns, (str, Iterable)):
            raise ArgumentTypeError(
                f"columns={reprlib.repr(columns)} (type {type(columns).__name__}) for {label} is "
                "not a column name or a list of names; pass one of those, or columns=None for "
                "all of them."
            )
        wanted = [columns] if isinstance(columns, str) else list(columns)
        wanted = [n for c in wanted for n in ([c] if c in available else groups.get(c, [c]))]
        missing = [c for c in wanted if c not in available]
        if missing:
            raise MissingColumnError(f"column {missing[0]!r} is not in {label}; it has: {listed}.")
    if not wanted:
        what = "columns=[] selects no column of" if available else "no column to load: nothing in"
        raise EmptySelectionError(
            f"{what} {label}, so the dataset would have no rows and a training loop over it no "
            f"batches; it has: {listed}. Pass the columns to load (or columns=None for all "
            "of them)."
        )
    clash = [n for n in wanted if list(available).count(n) > 1]
    if clash:
        raise MissingColumnError(
            f"column name {clash[0]!r} appears more than once in {label}, so it does not name "
            "one column; rename the columns (table.rename_columns) or select others."
        )
    return wanted


def check_files(
    files: Sequence[tuple[str, Any]],
    columns: Sequence[str] | None,
    promote: bool,
    skip: Sequence[str] = (),
) -> tuple[Any, dict[str, dict[Any, str]]]:
    """The schema every file's loaded columns share, and the columns whose type was promoted.

    Args:
        files: ``(path, schema)`` of every file, in order.
        columns: the columns asked for (``None``: all, and every file must have the same).
        promote: types may differ where pyarrow promotes one to the other (``int32`` and
            ``int64``...: ``pa.unify_schemas(promote_options="permissive")``); each batch
            is then cast to the promoted type. Otherwise a type must be the same everywhere.
        skip: columns not in the files (Hive partitions).

    Raises:
        MissingColumnError: a file lacks a loaded column.
        UnsupportedDtypeError: a column's types differ (and cannot be promoted).
    """
    pa = pyarrow_module()
    (first, schema) = files[0]
    promoted: dict[str, dict[Any, str]] = {}
    wanted = [f.name for f in schema]
    if columns is not None:  # the top-level columns of the selected names
        names = _select([f[0] for f in _fields(schema)], columns, first, _groups(_fields(schema)))
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
    unified = pa.schema([fields.get(f.name, f) for f in schema])
    return unified, promoted


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
