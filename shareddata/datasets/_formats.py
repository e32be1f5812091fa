"""One Dataset class per source format: NumPy, HDF5, Parquet, Arrow.

Each only makes its source (``sources/``) and the key local ranks agree on;
:class:`LoadOptions` loads it with the options every kind takes.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..sources._arrow_ipc import IpcInput, is_path
from ..sources._arrow_types import UuidAs, check_uuid_as, pyarrow_module
from ..sources.arrow import ArrowSource, FillValue, TableInput
from ..sources.hdf5 import HDF5Source
from ..sources.npy import NumpySource
from ..sources.parquet import ParquetInput
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions, Shard, Share

__all__ = ["ArrowDataset", "HDF5Dataset", "NumpyDataset", "ParquetDataset"]

PathLike = str | os.PathLike


class NumpyDataset(ColumnDataset):
    """A dataset of NumPy arrays, loaded once into shared memory.

    Args:
        source: a ``.npy`` or ``.npz`` path, a folder of ``.npy`` files (one column
            per file, named by its stem, in sorted order), a numpy array or tensor
            (column ``"data"``), or a mapping ``{column: array | tensor | path}``.
        columns: names of the columns to load, in sample order (default: all).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: tensor}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows
            (``ds.node_shard`` says which; sample with ``sd.NodeShardSampler``).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

    Raises:
        FileNotFoundError: a path does not exist.
        KeyError: a requested column does not exist (the message lists those that do).
        ValueError: columns have different lengths.
        TypeError: a column's dtype cannot be stored (object, structured, strings).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> ds = sd.NumpyDataset({"x": np.ones((4, 3), np.float32), "y": np.arange(4)},
        ...                      output="tuple")
        >>> len(ds), ds.columns
        (4, ['x', 'y'])
        >>> x, y = ds[-1]
        >>> x.shape, int(y)
        (torch.Size([3]), 3)
    """

    def __init__(
        self,
        source: Any,
        *,
        columns: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        share: Share | None = None,
        shard: Shard | None = None,
        timeout: float | None = None,
    ) -> None:
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        make = functools.partial(NumpySource, source, columns)  # made only where it loads
        load = options.loader(make, ("NumpyDataset", source, columns))
        super().__init__(load, transform=transform, output=output)


class HDF5Dataset(ColumnDataset):
    """Datasets of an HDF5 file as columns, loaded once into shared memory.

    Each HDF5 dataset is a column, its first dimension the row: numbers (any
    layout and filter h5py reads) give tensors in the file's dtype, strings ``str``,
    variable-length numbers 1-D tensors. A compound dataset gives one column per
    field (``dataset/field``); a pandas store its frame's columns; enums and
    categories their codes (:attr:`labels`). An AnnData ``.h5ad`` loads as cells
    (``X``, then ``obs``); a sparse matrix group is one column of rows; a netCDF-4
    file is decoded by the CF conventions (docs/tutorials/single-cell.md and
    climate-netcdf.md). The file is closed once loaded.

    Args:
        path: the HDF5 file.
        columns: dataset paths in sample order (``"images"``, ``"grp/labels"``, a
            compound's ``"table/x"``, a pandas key ``"df"`` or column ``"df/price"``),
            each column named as given. ``None``: every dataset and frame whose rows
            equal the longest, in visit order (types that cannot be stored are left
            out with a warning).
        keys: the old name of ``columns`` (a ``FutureWarning``).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: as for :class:`NumpyDataset`.
        progress: a progress bar for loads longer than ~2 s.
        share: as for :class:`NumpyDataset`.
        shard: as for :class:`NumpyDataset`.
        timeout: seconds to wait for another local rank.
        nested: items give each column at its path split at ``/`` (``{"meta":
            {"label": ...}}``) instead of under its flat name.
        sparse: a sparse row as a dense tensor (``"dense"``) or a 1-D sparse COO one.
        decode_cf: decode a netCDF file's CF conventions (default); False keeps codes.

    Attributes:
        labels: for enum and category columns, ``{column: {label: code}}``.
        coords: a netCDF file's variables that do not run along the rows.
        attrs: a netCDF file's attributes per column and coordinate.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        KeyError: a key is not a dataset of the file (the message lists those that are).
        ValueError: the datasets have different lengths; ``columns=[]``.
        TypeError: a selected dataset's type cannot be stored (references, times).
        OSError: locked, truncated or corrupt (``SourceReadError``, naming the fix).
        ImportError: h5py, or a compression filter, is not installed.
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import os, tempfile, h5py, numpy as np
        >>> from shareddata import HDF5Dataset
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "tiny.h5")
        >>> with h5py.File(path, "w") as f:
        ...     f["images"] = np.ones((4, 2, 2), np.float32)
        ...     f["meta/label"] = np.arange(4, dtype=np.int32)
        ...     f["meta/name"] = np.array(["a", "b", "c", "d"], dtype=h5py.string_dtype())
        >>> ds = HDF5Dataset(path)
        >>> ds.columns, ds[-1]["meta/label"], ds[-1]["meta/name"]
        (['images', 'meta/label', 'meta/name'], tensor(3, dtype=torch.int32), 'd')
        >>> HDF5Dataset(path, ["/meta/name"], output="tuple")[0]
        ('a',)
        >>> tmp.cleanup()
    """

    _pickled = ("labels", "coords", "attrs")

    def __init__(
        self,
        path: PathLike,
        columns: str | Sequence[str] | None = None,
        *,
        keys: str | Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        share: Share | None = None,
        shard: Shard | None = None,
        timeout: float | None = None,
        nested: bool = False,
        sparse: Literal["dense", "coo"] = "dense",
        decode_cf: bool = True,
    ) -> None:
        if not isinstance(decode_cf, bool):
            raise ArgumentTypeError(f"decode_cf must be True or False, got {decode_cf!r}")
        if keys is not None:
            if columns is not None:
                raise InvalidArgumentError(
                    f"HDF5Dataset({os.fspath(path)!r}) got both columns= and keys=; pass "
                    "columns= alone (keys= is its old name)."
                )
            warnings.warn(
                "HDF5Dataset(keys=...) is now HDF5Dataset(columns=...), the name every "
                "dataset class uses; keys= still works for now.",
                FutureWarning,
                stacklevel=2,
            )
            columns = keys
        source = HDF5Source(path, columns, sparse, decode_cf)
        self.labels = {p.name: dict(p.labels) for p in source.plans if p.labels is not None}
        self.coords = {
            n: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for n, v in source.coords.items()
        }
        self.attrs = source.attrs
        names = [p.name for p in source.plans]
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        try:
            super().__init__(
                options.loader(source, ("HDF5Dataset", source.label, names, sparse, decode_cf)),
                transform=transform,
                output=output,
                nested=nested,
                paths={n: tuple(n.split("/")) for n in names},
            )
        except BaseException:  # refused before the loader owns the file (close is idempotent)
            source.close()
            raise


class ArrowBacked(ColumnDataset):
    """What :class:`ParquetDataset` and :class:`ArrowDataset` share: an :class:`ArrowSource`."""

    def __init__(
        self,
        input: Any,
        key: tuple[Any, ...] | None,
        columns: Sequence[str] | None,
        options: LoadOptions,
        *,
        transform: Callable[[Any], Any] | None,
        output: Output,
        fill_value: FillValue,
        records: bool,
        nested: bool,
        uuid_as: UuidAs,
        types: dict[str, Any],
    ) -> None:
        source = ArrowSource(
            input, columns, fill_value=fill_value, records=records, uuid_as=uuid_as, types=types
        )
        if key is None:  # a table: keyed by its loaded columns
            key = input.key(list(dict.fromkeys(c.path[0] for c in source.columns)))
        names = [c.name for c in source.columns]
        key += (names, repr(fill_value), records, uuid_as, sorted(map(str, types.items())))
        super().__init__(
            options.loader(source, key), transform=transform, output=output, nested=nested,
            paths={c.name: c.path for c in source.columns},
        )  # fmt: skip


class ParquetDataset(ArrowBacked):
    """A dataset of Parquet columns, loaded once into shared memory.

    Files are read one row group x one column at a time, in batches of a few MiB,
    straight into the shared columns. Numbers and bool give scalar tensors,
    ``fixed_size_list`` tensors of that shape, strings ``str``, binary ``bytes``, lists
    of numbers 1-D tensors; dictionaries give their values, times their integer
    storage. A struct gives one column per field (``s.a``, as ``Table.flatten()``);
    lists of strings, lists and structs come back per item as lists (of dicts).

    Args:
        path: a ``.parquet`` file, a glob (``"data/train-*.parquet"``), a folder
            (searched by ``pyarrow.dataset``; Hive partition keys become columns), or a
            list of files (rows in the order given; globs and folders sorted).
        columns: names of the columns to load, in sample order (default: all; a
            struct's name selects all its fields).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: as for :class:`NumpyDataset`.
        progress: a progress bar for loads longer than ~2 s.
        share: as for :class:`NumpyDataset`.
        shard: as for :class:`NumpyDataset`.
        timeout: seconds to wait for another local rank.
        fill_value: what nulls become: ``None`` refuses them (``NullValuesError``); a
            scalar fills every column (strings and binary given a number get
            ``""``/``b""``, null lists become empty); ``{column: value}`` per column.
        records: a list of structs per item as a list of dicts (default) or a dict of
            lists (``False``).
        nested: a struct's fields nested (``{"s": {"a": ...}}``, as ``to_pylist()``)
            instead of flat (``{"s.a": ...}``).
        uuid_as: UUID columns give ``uuid.UUID`` (``"uuid"``) or uint8 tensors
            ``(16,)`` (``"tensor"``).

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no ``.parquet``.
        KeyError: a requested column is missing (the message lists those that exist).
        ValueError: nulls that no ``fill_value`` covers; ``columns=[]``.
        TypeError: a column's type cannot be stored (map, union, decimal...).
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
        share: Share | None = None,
        shard: Shard | None = None,
        timeout: float | None = None,
        fill_value: FillValue = None,
        records: bool = True,
        nested: bool = False,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        check_uuid_as(uuid_as)
        files = ParquetInput(path, columns)
        super().__init__(
            files, ("ParquetDataset", files.paths), columns,
            LoadOptions(storage_dir, progress, share, shard, timeout), transform=transform,
            output=output, fill_value=fill_value, records=records, nested=nested,
            uuid_as=uuid_as, types={},
        )  # fmt: skip


class ArrowDataset(ArrowBacked):
    """A dataset of an Arrow table's columns, copied once into shared memory.

    Column types are those of :class:`ParquetDataset`; the table is not kept. Accepts
    a ``pyarrow.Table`` or ``RecordBatch``; any object exporting Arrow data (polars
    and pandas frames, duckdb relations); an HF ``datasets.Dataset``, in its row order
    and with its format kept (its columns, the ``"torch"`` format's int64/float32, a
    ``with_transform`` function applied per sample before ``transform``; other
    formats are refused by name); or Arrow files by path: IPC files and streams
    (``.arrow``, ``.feather``, ``.arrows``), a list of them, an HF ``save_to_disk``
    folder, memory-mapped and read one column at a time. Extension types load as what
    they mean (``arrow.uuid`` as ``uuid.UUID``, ``fixed_shape_tensor`` and HF
    ``ArrayND`` as tensors); others are refused by name.

    Args:
        table: a table, an object exporting Arrow data, an HF dataset, or a path.
        columns: names of the columns to load, in sample order (default: all, or those
            of an HF format; a struct's name selects all its fields).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: as for :class:`NumpyDataset`.
        progress: a progress bar for loads longer than ~2 s.
        share: as for :class:`NumpyDataset`.
        shard: as for :class:`NumpyDataset`.
        timeout: seconds to wait for another local rank.
        fill_value: what nulls become (as for :class:`ParquetDataset`).
        records: a list of structs as a list of dicts (default) or a dict of lists.
        nested: a struct's fields nested instead of flat.
        uuid_as: UUID columns as ``uuid.UUID`` (``"uuid"``) or uint8 tensors (``"tensor"``).

    Raises:
        FileNotFoundError: a path does not exist, or a folder has no ``state.json``.
        KeyError: a requested column is missing (the message lists those that exist).
        ValueError: nulls that no ``fill_value`` covers; ``columns=[]``; an HF format
            that cannot be kept.
        TypeError: not a table, or a column's type cannot be stored.
        OSError: a file is not Arrow IPC, or is truncated (``SourceReadError``).
        ImportError: pyarrow is not installed.
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import pyarrow as pa, shareddata as sd
        >>> table = pa.table({"x": pa.array([1.5, None, 3.0], pa.float32()),
        ...                   "name": ["a", None, "c"]})
        >>> ds = sd.ArrowDataset(table, fill_value={"x": 0.0, "name": "?"}, output="tuple")
        >>> ds[1]
        (tensor(0.), '?')
        >>> chat = pa.table({"messages": [[{"role": "user", "content": "hi"}], []],
        ...                  "meta": [{"id": 7, "lang": "en"}, {"id": 8, "lang": "fr"}]})
        >>> sd.ArrowDataset(chat)[0]
        {'messages': [{'role': 'user', 'content': 'hi'}], 'meta.id': tensor(7), 'meta.lang': 'en'}
        >>> sd.ArrowDataset(chat, columns=["meta"], nested=True)[1]
        {'meta': {'id': tensor(8), 'lang': 'fr'}}
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
        share: Share | None = None,
        shard: Shard | None = None,
        timeout: float | None = None,
        fill_value: FillValue = None,
        records: bool = True,
        nested: bool = False,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        check_uuid_as(uuid_as)
        if is_path(table):
            input: Any = IpcInput(table, columns)
            key: tuple[Any, ...] | None = ("ArrowDataset", input.paths)
            fmt = input.hf_format
        else:
            input, key = TableInput(table), None
            fmt = table.format if type(table).__module__.startswith("datasets.") else None
        columns, types, transform = _hf_format(fmt, input.schema, columns, transform, output)
        super().__init__(
            input, key, columns, LoadOptions(storage_dir, progress, share, shard, timeout),
            transform=transform, output=output, fill_value=fill_value, records=records,
            nested=nested, uuid_as=uuid_as, types=types,
        )  # fmt: skip


# -- an HF datasets.Dataset's format (set_format / with_format / with_transform) --------------


def _hf_format(
    fmt: Any, schema: Any, columns: Sequence[str] | None, transform: Any, output: str
) -> tuple[Sequence[str] | None, dict[str, Any], Any]:
    """The columns, loaded types and transform that keep an HF ``Dataset``'s format ``fmt``."""
    if not isinstance(fmt, dict):  # not an HF dataset
        return columns, {}, transform
    kind, kwargs = fmt.get("type"), dict(fmt.get("format_kwargs") or {})
    hf_transform = kwargs.pop("transform", None) if kind == "custom" else None
    if kind not in (None, "numpy", "torch", "custom") or kwargs:
        how = f"with_format({kind!r}{''.join(f', {k}=...' for k in kwargs)})"
        raise InvalidArgumentError(
            f"ArrowDataset cannot keep the HF dataset's format {how}: it gives torch tensors "
            "(as the 'torch' format does), str and bytes. Load it without that format "
            "(hf_dataset.with_format(None) or 'torch'), and convert in transform=."
        )
    if hf_transform is not None and output != "dict":
        raise InvalidArgumentError(
            f"ArrowDataset(output={output!r}) cannot apply the HF dataset's with_transform "
            "function, which takes a dict; pass output='dict', or drop the HF transform "
            "(hf_dataset.with_format(None)) and pass transform= instead."
        )
    loaded = fmt.get("columns")
    keep_all = bool(fmt.get("output_all_columns"))
    if columns is None and loaded is not None:  # in table order; output_all_columns: then the rest
        columns = [n for n in schema.names if n in loaded]
        columns += [n for n in schema.names if keep_all and n not in loaded]
    types = {}
    if kind == "torch":  # integers as int64, floats as float32, as its formatter gives them
        for name in loaded if loaded is not None else schema.names:
            t = schema.field(name).type
            if _torch_type(t) != t:
                types[name] = _torch_type(t)
    if hf_transform is not None:
        given = list(loaded) if keep_all and loaded is not None else None
        transform = HFTransform(hf_transform, given, transform)
    return columns, types, transform


def _torch_type(t: Any) -> Any:
    """What the HF ``"torch"`` format makes of an Arrow type: int64 and float32 numbers."""
    pa = pyarrow_module()
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float32()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_torch_type(t.value_type), t.list_size)
    if pa.types.is_list(t):
        return pa.list_(_torch_type(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_torch_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_torch_type(f.type)) for f in t])
    return t


class HFTransform:
    """An HF ``with_transform`` function applied to one sample, as a batch of one row.

    ``columns``: the columns it is given (``output_all_columns``: the others are added
    after); ``then``: the ``transform=`` applied after it.
    """

    def __init__(self, fn: Callable[[dict[str, Any]], Any], columns: list[str] | None,
                 then: Callable[[Any], Any] | None) -> None:  # fmt: skip
        self.fn, self.columns, self.then = fn, columns, then

    def __call__(self, sample: dict[str, Any]) -> Any:
        given = {k: [_python(v)] for k, v in sample.items()
                 if self.columns is None or k in self.columns}  # fmt: skip
        out = {key: values[0] for key, values in self.fn(given).items()}
        if self.columns is not None:
            out.update((k, v) for k, v in sample.items() if k not in given)
        return out if self.then is None else self.then(out)


def _python(value: Any) -> Any:
    """A sample's value as HF's python extractor gives it (lists, ints)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    return value
