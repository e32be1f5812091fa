"""In-memory Arrow data as an Arrow input: tables, record batches, frames, HF datasets.

Any object that exports Arrow data (``__arrow_c_stream__`` / ``__arrow_c_array__``:
polars, duckdb, pandas >= 2.2) converts through ``pa.table``; an HF
``datasets.Dataset`` gives its Arrow table in its current row order. Each chunk of
the table is one :class:`~shareddata.sources.arrow.Piece`, nothing is copied until
the source writes it.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Iterator
from typing import Any

from ..errors import ArgumentTypeError, UnsupportedDtypeError
from ._arrow_columns import ArrowColumn
from ._arrow_nested import temporal_storage
from ._arrow_types import pyarrow_module
from .arrow import Piece

__all__ = ["TableInput", "as_table"]


def as_table(table: Any) -> Any:
    """``table`` as a ``pyarrow.Table`` (no copy), or ArgumentTypeError naming the fix."""
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
        try:
            return pa.table(table)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise UnsupportedDtypeError(
                f"ArrowDataset could not read the Arrow data a {type(table).__name__} exports "
                f"({type(e).__name__}: {e}); it must export a table or a struct array "
                "(one field per column)."
            ) from e
    module = type(table).__module__.split(".")[0]
    hint = {
        "pandas": "Convert it with pa.Table.from_pandas(df, preserve_index=False).",
        "polars": "Convert it with df.to_arrow().",
    }.get(module, "Build one with pa.table({column: values}).")
    raise ArgumentTypeError(
        f"ArrowDataset: table={reprlib.repr(table)} (type {type(table).__name__}) is not a "
        f"pyarrow.Table or RecordBatch. {hint}"
    )


class TableInput:
    """An in-memory table: its schema, its rows, and its chunks as pieces."""

    label = "the Arrow table"
    format = ""  # errors of an in-memory table are not a file's
    file_types: dict[str, dict[Any, str]] = {}

    def __init__(self, table: Any) -> None:
        self.table = as_table(table)
        self.schema = self.table.schema

    def total_rows(self) -> int:
        """Rows of the table."""
        return int(self.table.num_rows)

    def pieces(self, column: ArrowColumn) -> Iterator[Piece]:
        """One piece per chunk of ``column``'s top-level column."""
        for chunk in self.table.column(column.path[0]).chunks:
            yield Piece(self.label, self.label, len(chunk), functools.partial(list, [chunk]))

    def null_counts(self, column: ArrowColumn, window: bool) -> None:
        """Nulls are counted by the sizing pass (over the table's buffers: no copy)."""
        return None

    def close(self) -> None:
        """Drop the reference to the table (the caller's table is untouched)."""
        self.table = None

    def key(self, names: list[str]) -> tuple[Any, ...]:
        """What tells in-memory tables apart across local ranks: schema, length, sampled rows.

        Every in-memory table has the same label, so without this two ranks building
        different tables (one per rank, say) would be taken for the same dataset.
        """
        pa = pyarrow_module()
        table = self.table.select(names)
        n = table.num_rows
        rows = sorted({round(i * (n - 1) / 63) for i in range(64)}) if n else []
        sample = pa.concat_tables([table.slice(i, 1) for i in rows]) if rows else table
        # temporal values as their numbers: a timestamp[ns] has no datetime
        plain = [c.cast(temporal_storage(c.type) or c.type) for c in sample.columns]
        values = pa.table(plain, names=sample.column_names).to_pylist()
        return ("ArrowDataset", table.schema.to_string(), n, values)
