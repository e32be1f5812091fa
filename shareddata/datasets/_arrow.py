"""``ArrowDataset``: an Arrow table, an object exporting Arrow data, or Arrow files by path."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..sources._arrow_extensions import UuidAs, check_uuid_as
from ..sources._arrow_files import ArrowFileSource, is_path
from ..sources._arrow_select import FillValue
from ..sources.arrow import ArrowSource, table_key
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions

__all__ = ["ArrowDataset"]


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
    files one column at a time] in ``sources/_arrow_files.py``). Anything else (Parquet,
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
        ImportError: pyarrow is not installed (``pip install 'torch-shareddata[parquet]'``).
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
            key = table_key(source, fill_value)
        load = LoadOptions(storage_dir, progress, share, shard, timeout)
        super().__init__(
            load.loader(source, (*key, records, uuid_as)),
            transform=transform,
            output=output,
            nested=nested,
            paths={c.name: c.path for c in source.columns},
        )
