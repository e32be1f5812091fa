"""Arrow tables (pyarrow, polars, duckdb, pandas, HF datasets) and files into shared memory.

:class:`ArrowDataset` copies the selected columns of a table, chunk by chunk, into
one shared segment (Arrow files by path: ``_arrow_files.py``); the type mapping
(``_arrow_types.py``, extension types: ``_arrow_extensions.py``), selection
(``_arrow_select.py``), null handling and copying (``_arrow_columns.py``) are shared
with Parquet.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .._columns import ColumnSpec
from .._dataset import ColumnDataset, Output
from .._load import Buffer, build
from ..errors import ArgumentTypeError, UnsupportedDtypeError
from ._arrow_columns import ArrowColumn, Sizer, Writer, rebase_offsets
from ._arrow_extensions import UuidAs, check_uuid_as
from ._arrow_files import ArrowFileSource, is_path
from ._arrow_select import FillValue, make_columns, select_fields
from ._arrow_types import pyarrow_module, release_arrow_memory

__all__ = ["ArrowDataset", "ArrowSource", "rebase_offsets"]


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


class ArrowDataset(ColumnDataset):
    """A dataset of an Arrow table's columns, copied once into shared memory.

    Column types and null handling are those of :class:`ParquetDataset`. The table
    itself is not kept: once loaded, it can be dropped, and workers only map the
    shared copy.

    Any object that exports Arrow data is accepted as it is: a polars or pandas
    DataFrame, a duckdb relation (``__arrow_c_stream__`` or ``__arrow_c_array__``),
    and an HF ``datasets.Dataset`` (its Arrow table, in its current row order).

    So are Arrow files by path, recognised by their first bytes: an Arrow IPC file
    (``.arrow``; Feather v2 ``.feather`` is one, compressed or not), an IPC stream
    (``.arrows``; HF ``datasets`` writes its ``.arrow`` files as streams), a list of
    them (rows in the order given), and an HF ``Dataset.save_to_disk`` folder (the
    data files its ``state.json`` lists, in order; its ``set_format`` is not applied:
    select columns with ``columns=``). Files are memory-mapped and read one column at
    a time, so loading needs no private copy of the table (Note [Reading Arrow IPC
    files one column at a time] in ``_arrow_files.py``). Anything else (Parquet,
    Feather v1, a folder without ``state.json``) is refused naming what it is and what
    to pass instead.

    Extension types load as what they mean: ``arrow.uuid`` as ``uuid.UUID`` (a batch
    holds their list) or, with ``uuid_as="tensor"``, a uint8 tensor of the 16 bytes
    (batches stack them); ``arrow.bool8`` as bool tensors; ``arrow.json`` as its text;
    ``arrow.fixed_shape_tensor`` and HF ``Array2D``...``Array5D`` features as tensors of
    their shape (an HF first dimension of ``None``: a list of the row's sub-arrays).
    Any other extension type is refused with its name (never loaded as its storage).

    Struct columns load as one column per field, named as ``Table.flatten()`` names
    them (``s.a``, nested ``s.b.c``); items are flat (``{"s.a": ..., "s.b.c": ...}``),
    or with ``nested=True`` nested as ``to_pylist()`` gives them (``{"s": {"a": ...,
    "b": {"c": ...}}}``).
    Lists of strings, of lists and of structs (``messages: list<struct<role: string,
    content: string>>``) load as offsets and typed values in shared memory and come
    back per item as Python lists (of dicts, or with ``records=False`` a dict of
    lists); lists of numbers inside them come back as 1-D tensors.

    Args:
        table: a ``pyarrow.Table`` or ``pyarrow.RecordBatch``, an object exporting
            Arrow data (``__arrow_c_stream__`` / ``__arrow_c_array__``), or a path: an
            IPC file or stream, a list of them, or an HF ``save_to_disk`` folder.
        columns: names of the columns to load, in sample order (default: all; a
            struct's name selects all its fields).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared.
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows, where
            the source can read a range of rows (else ``ShardingNotSupportedError``).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).
        fill_value: what null values become (see :class:`ParquetDataset`); ``None``
            refuses nulls with a ``NullValuesError``.
        records: a list of structs comes back per item as a list of dicts (default),
            or as a dict of lists (``False``).
        nested: items give a struct's fields nested (``{"s": {"a": ..., "b": {"c":
            ...}}}``, the shape ``to_pylist()`` gives) instead of flat (``{"s.a": ...,
            "s.b.c": ...}``, the default); batches are nested the same way. With
            ``output="tuple"``, the top-level values in order.
        uuid_as: ``arrow.uuid`` columns give ``uuid.UUID`` values (``"uuid"``, the
            default) or uint8 tensors of shape ``(16,)`` (``"tensor"``).

    Raises:
        FileNotFoundError: a path does not exist, or a folder has no ``state.json``.
        KeyError: a requested column is missing (the message lists those that exist).
        ValueError: a column holds nulls and no ``fill_value`` covers it; ``columns=[]``
            (``EmptySelectionError``).
        TypeError: not a table, or a column's type cannot be stored.
        OSError: a file is not Arrow IPC, or is truncated (``SourceReadError``).
        ImportError: pyarrow is not installed (``pip install 'shareddata[parquet]'``).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import pyarrow as pa, shareddata as sd
        >>> table = pa.table({"x": pa.array([1.5, None, 3.0], pa.float32()),
        ...                   "name": ["a", None, "c"]})
        >>> ds = sd.ArrowDataset(table, fill_value={"x": 0.0, "name": "?"}, output="tuple")
        >>> ds[1]
        (tensor(0.), '?')
        >>> ds.__getitems__([2, 0])
        [(tensor(3.), 'c'), (tensor(1.5000), 'a')]
        >>> chat = pa.table({"messages": [[{"role": "user", "content": "hi"}], []],
        ...                  "meta": [{"id": 7, "lang": "en"}, {"id": 8, "lang": "fr"}]})
        >>> sd.ArrowDataset(chat)[0]
        {'messages': [{'role': 'user', 'content': 'hi'}], 'meta.id': tensor(7), 'meta.lang': 'en'}
        >>> sd.ArrowDataset(chat, columns=["meta"], nested=True)[1]
        {'meta': {'id': tensor(8), 'lang': 'fr'}}
        >>> import os, tempfile, uuid
        >>> path = os.path.join(tempfile.mkdtemp(), "ids.arrow")
        >>> ids = pa.table({"id": pa.array([uuid.UUID(int=7).bytes], pa.uuid()), "n": [1]})
        >>> with pa.ipc.new_file(path, ids.schema) as writer:
        ...     writer.write_table(ids)
        >>> sd.ArrowDataset(path)[0]
        {'id': UUID('00000000-0000-0000-0000-000000000007'), 'n': tensor(1)}
    """

    def __init__(
        self,
        table: Any,
        *,
        columns: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        share: Literal["node", "process"] | None = None,
        shard: Literal["node"] | None = None,
        timeout: float | None = None,
        fill_value: FillValue = None,
        records: bool = True,
        nested: bool = False,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        options: dict[str, Any] = {
            "fill_value": fill_value, "records": records, "uuid_as": check_uuid_as(uuid_as)
        }  # fmt: skip
        source: ArrowSource | ArrowFileSource
        key: tuple[Any, ...]
        if is_path(table):
            source = ArrowFileSource(table, columns, **options)
            # what ranks must agree on: every file, the columns in order, the options
            key = ("ArrowDataset", source.paths, [c.name for c in source.columns])
            key += (repr(fill_value),)
        else:
            source = ArrowSource(table, columns, **options)
            key = _table_key(source, fill_value)
        super().__init__(
            lambda: build(  # after the arguments are checked
                source,
                storage_dir=storage_dir,
                progress=progress,
                share=share,
                shard=shard,
                timeout=timeout,
                key=(*key, records, uuid_as),
            ),
            transform=transform,
            output=output,
            nested=nested,
            paths={c.name: c.path for c in source.columns},
        )


def _table_key(source: ArrowSource, fill_value: FillValue) -> tuple[Any, ...]:
    """What tells in-memory tables apart across local ranks: schema, length, sampled rows.

    Every ArrowDataset has the same label, so without this two ranks building different
    tables (one per rank, say) would be taken for the same dataset under torchrun.
    """
    table = source.table.select(list(dict.fromkeys(c.path[0] for c in source.columns)))
    n = table.num_rows
    rows = sorted({round(i * (n - 1) / 63) for i in range(64)}) if n else []
    sample = [table.slice(i, 1).to_pylist() for i in rows]  # slices: any type, no copy
    return ("ArrowDataset", table.schema.to_string(), n, repr(fill_value), sample)
