"""``ParquetDataset``: Parquet files (one, a list, a glob, a folder) as columns."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..sources._arrow_extensions import UuidAs, check_uuid_as
from ..sources.arrow import ArrowSource, FillValue
from ..sources.parquet import ParquetInput
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions

__all__ = ["ParquetDataset"]

PathLike = str | os.PathLike


class ParquetDataset(ColumnDataset):
    """A dataset of Parquet columns, loaded once into shared memory.

    The constructor reads each file's metadata, sizes the columns exactly (reading
    variable-length columns once), allocates one shared segment, and copies one
    column at a time into it, in batches of a few MiB: the loading process needs
    only a batch's worth of private memory on top of the data, whatever the size
    of the row groups.

    Column types: integers, floats and bool give scalar tensors; ``fixed_size_list``
    of numbers (nested for more dimensions) gives tensors of that shape; strings give
    ``str``, binary gives ``bytes``; lists of numbers give 1-D tensors of varying
    length; dictionary-encoded columns give their values; timestamps, dates, times
    and durations give their integer storage (int64 or int32 counts of their unit
    since the epoch, timestamps in UTC). Dtypes stay as stored (int32 stays int32).

    Struct columns load as one column per field, named as ``Table.flatten()`` names
    them (``s.a``, nested ``s.b.c``; items are flat, or nested with ``nested=True``).
    Lists of strings, lists and
    structs (``messages: list<struct<role: string, content: string>>``) load as
    offsets and typed values in shared memory and come back per item as lists (of
    dicts; see ``records``). Details: :class:`~shareddata.ArrowDataset`.

    Args:
        path: a ``.parquet`` file; a glob (``"data/train-*.parquet"``, ``**`` for
            sub-folders); a folder, searched recursively by ``pyarrow.dataset``
            (names starting with ``.`` or ``_`` skipped); or a list of files (rows in
            the order given). Globs and folders are read in sorted order. Hive
            partition folders (``year=2024/part-0.parquet``) become columns, after the
            files' own, as ``pyarrow.dataset`` reads them; a key that is also a column
            inside the files (polars' ``write_parquet(partition_by=...)``) is refused:
            pass the list of files instead. The files must have the loaded columns;
            types may differ where pyarrow promotes one to the other (``int32``/``int64``...).
        columns: names of the columns to load, in sample order (default: all; a
            struct's name selects all its fields).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows, where
            the source can read a range of rows (else ``ShardingNotSupportedError``).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).
        fill_value: what null values become. ``None`` (default) refuses nulls with a
            ``NullValuesError``. A scalar applies to every column: a number fills
            numeric columns and the elements of list columns, a string fills string
            columns (string and binary columns given a number get ``""``/``b""``);
            null lists become empty lists. A dict ``{column: value}`` gives one value
            per column (columns not in it still refuse nulls).
        records: a list of structs comes back per item as a list of dicts (default),
            or as a dict of lists (``False``).
        nested: items give a struct's fields nested (``{"s": {"a": ..., "b": {"c":
            ...}}}``, the shape ``to_pylist()`` gives) instead of flat (``{"s.a": ...,
            "s.b.c": ...}``, the default); batches are nested the same way. With
            ``output="tuple"``, the top-level values in order.
        uuid_as: UUID columns (Parquet's UUID logical type, ``arrow.uuid``) give
            ``uuid.UUID`` values (``"uuid"``, the default) or uint8 tensors of shape
            ``(16,)`` (``"tensor"``); other extension types: :class:`ArrowDataset`.

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no ``.parquet``.
        KeyError: a requested column is missing (the message lists those that exist),
            the files have different columns, or a Hive partition key is also a
            column inside the files.
        ValueError: a column holds nulls and no ``fill_value`` covers it; ``columns=[]``
            (``EmptySelectionError``).
        TypeError: a column's type cannot be stored (map, union, decimal...), the
            files have types pyarrow cannot promote to one, or a fill value does not
            fit its column.
        OSError: a file is truncated or not Parquet (``SourceReadError``).
        ImportError: pyarrow is not installed (``pip install 'torch-shareddata[parquet]'``).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import os, tempfile
        >>> import pyarrow as pa, pyarrow.parquet as pq, shareddata as sd
        >>> path = os.path.join(tempfile.mkdtemp(), "tiny.parquet")
        >>> pq.write_table(pa.table({"label": pa.array([3, 1, 2], pa.int32()),
        ...                          "text": ["a", "", "héllo"],
        ...                          "tokens": [[1, 2], [], [3]]}), path)
        >>> ds = sd.ParquetDataset(path)
        >>> len(ds), ds.columns
        (3, ['label', 'text', 'tokens'])
        >>> ds[-1]
        {'label': tensor(2, dtype=torch.int32), 'text': 'héllo', 'tokens': tensor([3])}
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        *,
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
        check_uuid_as(uuid_as)
        files = ParquetInput(path, columns)
        source = ArrowSource(
            files, columns, fill_value=fill_value, records=records, uuid_as=uuid_as
        )
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        # what ranks must agree on: every file, the columns in order, the options
        names = [c.name for c in source.columns]
        key = ("ParquetDataset", files.paths, names, repr(fill_value), records, uuid_as)
        super().__init__(
            options.loader(source, key),
            transform=transform,
            output=output,
            nested=nested,
            paths={c.name: c.path for c in source.columns},
        )
