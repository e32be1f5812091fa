"""Arrow tables (pyarrow, polars, duckdb, pandas, HF datasets) and files into shared memory.

:class:`ArrowDataset` copies the selected columns of a table, chunk by chunk, into
one shared segment (Arrow files by path: ``_arrow_files.py``); the type mapping
(``_arrow_types.py``, extension types: ``_arrow_extensions.py``), selection
(``_arrow_select.py``), null handling and copying (``_arrow_columns.py``) are shared
with Parquet.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from typing import Any

from ..columns._columns import ColumnSpec
from ..errors import ArgumentTypeError, UnsupportedDtypeError
from ._arrow_columns import ArrowColumn, Sizer, Writer, rebase_offsets
from ._arrow_extensions import UuidAs
from ._arrow_select import FillValue, make_columns, select_fields
from ._arrow_types import pyarrow_module, release_arrow_memory
from ._source import Buffer

__all__ = ["ArrowSource", "rebase_offsets", "table_key"]


# -- Arrow tables --------------------------------------------------------------------------


_NESTED_ROWS = 1 << 16
"""Rows of an in-memory nested column taken apart at a time (bounds the temporaries)."""


def _as_table(table: Any) -> Any:
    pa = pyarrow_module()
    if isinstance(table, pa.Table):
        return table
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([table])
    if type(table).__module__.startswith("datasets.") and hasattr(table, "flatten_indices"):
        # an HF datasets.Dataset: its Arrow table, in the order its indices mapping gives
        if getattr(table, "_indices", None) is not None:
            table = table.flatten_indices()
        return table.data.table
    exports = hasattr(table, "__arrow_c_stream__") or hasattr(table, "__arrow_c_array__")
    if exports and not isinstance(table, (pa.ChunkedArray, pa.Array)):
        # polars, duckdb, pandas >= 2.2, HF datasets' tables: any Arrow PyCapsule producer
        try:
            return pa.table(table)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise UnsupportedDtypeError(
                f"ArrowDataset could not read the Arrow data a {type(table).__name__} exports "
                f"({type(e).__name__}: {e}); it must export a table or a struct array "
                "(one field per column)."
            ) from e
    hint = ""
    module = type(table).__module__.split(".")[0]
    if module == "pandas":
        hint = " Convert it with pa.Table.from_pandas(df, preserve_index=False)."
    elif module == "polars":
        hint = " Convert it with df.to_arrow()."
    raise ArgumentTypeError(
        f"ArrowDataset: table={reprlib.repr(table)} (type {type(table).__name__}) is not a "
        "pyarrow.Table or RecordBatch."
        f"{hint or ' Build one with pa.table({column: values}).'}"
    )


class ArrowSource:
    """Reads the columns of an in-memory Arrow table (see :class:`ArrowDataset`).

    Args:
        table: a ``pyarrow.Table`` or ``RecordBatch`` (or an Arrow stream/array producer).
        columns: the columns to load, in this order (default: all; a struct's name
            selects its fields).
        fill_value: what nulls become (see :class:`ParquetDataset`); ``None`` refuses nulls.
        records: a list of structs comes back as a list of dicts (else a dict of lists).
        uuid_as: ``arrow.uuid`` values as ``"uuid"`` (``uuid.UUID``) or ``"tensor"``.
    """

    label = "the Arrow table"

    def __init__(
        self,
        table: Any,
        columns: Sequence[str] | None = None,
        *,
        fill_value: FillValue = None,
        records: bool = True,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        self.table = _as_table(table)
        names = select_fields(self.table.schema, columns, self.label)
        self.columns = make_columns(
            self.table.schema, names, self.label, fill_value, records, uuid_as
        )
        self._by_name = {c.name: c for c in self.columns}

    def _each_chunk(self, column: ArrowColumn, fn: Callable[[str, str, Any], None]) -> None:
        step = _NESTED_ROWS if column.kind.kind == "nested" else None
        for chunk in self.table.column(column.path[0]).chunks:
            if step is None:
                fn(self.label, self.label, column.extract(chunk))
                continue
            for start in range(0, len(chunk), step):  # nested: bounded pieces
                fn(self.label, self.label, column.extract(chunk.slice(start, step)))

    def total_rows(self) -> int:
        """Rows of the whole table (before :meth:`select_rows`)."""
        return int(self.table.num_rows)

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)`` (``shard="node"``; a zero-copy slice)."""
        self.table = self.table.slice(start, stop - start)

    def specs(self) -> list[ColumnSpec]:
        """Exact specs, from the table's buffers (nothing is copied)."""
        specs = []
        for column in self.columns:
            sizer = Sizer(column)
            self._each_chunk(column, sizer.add)
            specs.append(sizer.spec(self.table.num_rows))
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill one column's buffers, one chunk at a time."""
        writer = Writer(self._by_name[spec.name], spec, buffers)
        self._each_chunk(
            writer.column, lambda _, where, chunk: progress(writer.write(chunk, where))
        )
        writer.finish(self.label)
        release_arrow_memory()

    def close(self) -> None:
        """Drop the reference to the table (the caller's table is untouched)."""
        self.table = None


def table_key(source: ArrowSource, fill_value: FillValue) -> tuple[Any, ...]:
    """What tells in-memory tables apart across local ranks: schema, length, sampled rows.

    Every ArrowDataset has the same label, so without this two ranks building different
    tables (one per rank, say) would be taken for the same dataset under torchrun.
    """
    table = source.table.select(list(dict.fromkeys(c.path[0] for c in source.columns)))
    n = table.num_rows
    rows = sorted({round(i * (n - 1) / 63) for i in range(64)}) if n else []
    sample = [_row(table.slice(i, 1)) for i in rows]  # slices: any type, no copy
    return ("ArrowDataset", table.schema.to_string(), n, repr(fill_value), sample)


def _row(row: Any) -> Any:
    """One row's values; pyarrow's text of them where Python has no type for one.

    (``timestamp[ns]`` values with nanoseconds fit no ``datetime`` without pandas.)
    """
    try:
        return row.to_pylist()
    except ValueError:
        return [column.to_string() for column in row.columns]
