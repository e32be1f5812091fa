"""``ArrowDataset``: an Arrow table, an object exporting Arrow data, or Arrow files by path."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from ..errors import InvalidArgumentError
from ..sources._arrow_extensions import UuidAs, check_uuid_as
from ..sources._arrow_ipc import IpcInput, is_path
from ..sources._arrow_table import TableInput
from ..sources._arrow_types import pyarrow_module
from ..sources.arrow import ArrowSource, FillValue
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions

__all__ = ["ArrowDataset"]


class ArrowDataset(ColumnDataset):
    """A dataset of an Arrow table's columns, copied once into shared memory.

    Column types, struct columns, lists of records and nulls are those of
    :class:`ParquetDataset`. The table itself is not kept: once loaded, it can be
    dropped, and workers only map the shared copy. Accepted as they are:

    - a ``pyarrow.Table`` or ``RecordBatch``; any object that exports Arrow data
      (``__arrow_c_stream__`` / ``__arrow_c_array__``: polars and pandas frames, duckdb
      relations);
    - an HF ``datasets.Dataset``, in its current row order and with its format kept:
      its columns (``with_format(..., columns=...)``; ``output_all_columns`` adds the
      others after them), the ``"torch"`` format's dtypes (integers as int64, floats as
      float32, as its formatter gives them), and a ``with_transform`` /
      ``set_transform`` function, applied to each sample in the worker as ``datasets``
      applies it (to a batch of one row of Python values), before ``transform``. A
      format it cannot keep (``"pandas"``, ``"polars"``, ``"arrow"``, format options
      such as ``dtype=``) is refused by name;
    - Arrow files by path, recognised by their first bytes: an IPC file (``.arrow``;
      Feather v2 ``.feather``, compressed or not), an IPC stream (``.arrows``; HF
      ``datasets`` writes its ``.arrow`` files as streams), a list of them (rows in the
      order given), and an HF ``Dataset.save_to_disk`` folder (the data files its
      ``state.json`` lists, in order, with the format it was saved with). Files are
      memory-mapped and read one column at a time, so loading needs no private copy
      of the table (Note [Reading Arrow IPC files one column at a time] in
      ``sources/_arrow_ipc.py``). Anything else (Parquet, Feather v1, a folder without
      ``state.json``) is refused naming what it is and what to pass instead.

    Extension types load as what they mean: ``arrow.uuid`` as ``uuid.UUID`` (a batch
    holds their list) or, with ``uuid_as="tensor"``, a uint8 tensor of the 16 bytes
    (batches stack them); ``arrow.bool8`` as bool tensors; ``arrow.json`` as its text;
    ``arrow.fixed_shape_tensor`` and HF ``Array2D``...``Array5D`` features as tensors of
    their shape (an HF first dimension of ``None``: a list of the row's sub-arrays).
    Any other extension type is refused with its name (never loaded as its storage).

    Args:
        table: a table, an object exporting Arrow data, an HF dataset, or a path: an
            IPC file or stream, a list of them, or an HF ``save_to_disk`` folder.
        columns: names of the columns to load, in sample order (default: all, or those
            of an HF format; a struct's name selects all its fields).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared.
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows.
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).
        fill_value: what null values become (see :class:`ParquetDataset`); ``None``
            refuses nulls with a ``NullValuesError``.
        records: a list of structs comes back per item as a list of dicts (default),
            or as a dict of lists (``False``).
        nested: items give a struct's fields nested (``{"s": {"a": ...}}``, as
            ``to_pylist()``) instead of flat (``{"s.a": ...}``, the default).
        uuid_as: ``arrow.uuid`` columns give ``uuid.UUID`` values (``"uuid"``, the
            default) or uint8 tensors of shape ``(16,)`` (``"tensor"``).

    Raises:
        FileNotFoundError: a path does not exist, or a folder has no ``state.json``.
        KeyError: a requested column is missing (the message lists those that exist).
        ValueError: a column holds nulls and no ``fill_value`` covers it; ``columns=[]``
            (``EmptySelectionError``); an HF format that cannot be kept.
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
        check_uuid_as(uuid_as)
        if is_path(table):
            input: Any = IpcInput(table, columns)
            # what ranks must agree on: every file, the columns in order, the options
            key: tuple[Any, ...] = ("ArrowDataset", input.paths)
            fmt = input.hf_format
        else:
            input, key = TableInput(table), ()
            fmt = table.format if type(table).__module__.startswith("datasets.") else None
        columns, types, transform = _hf_format(fmt, input.schema, columns, transform, output)
        source = ArrowSource(
            input, columns, fill_value=fill_value, records=records, uuid_as=uuid_as, types=types
        )
        names = [c.name for c in source.columns]
        if not key:
            key = input.key(list(dict.fromkeys(c.path[0] for c in source.columns)))
        key += (names, repr(fill_value), records, uuid_as, sorted(map(str, types.items())))
        load = LoadOptions(storage_dir, progress, share, shard, timeout)
        super().__init__(
            load.loader(source, key),
            transform=transform,
            output=output,
            nested=nested,
            paths={c.name: c.path for c in source.columns},
        )


# -- an HF datasets.Dataset's format (set_format / with_format / with_transform) --------------


def _hf_format(
    fmt: Any, schema: Any, columns: Sequence[str] | None, transform: Any, output: str
) -> tuple[Sequence[str] | None, dict[str, Any], Any]:
    """The columns, loaded types and transform that keep an HF ``Dataset``'s format ``fmt``.

    ``"torch"`` casts integers to int64 and floats to float32, as its formatter does;
    ``"numpy"`` and ``"python"`` (no format) keep the stored dtypes; ``"custom"`` (a
    ``with_transform``) applies its function to each sample in the worker, as a batch of
    one row of Python values, as ``datasets`` does. Any other format is refused by name.
    """
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
    if kind == "torch":
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
    """An HF ``with_transform`` function applied to one sample, as ``datasets`` applies it.

    The function takes a batch (a dict of lists of Python values) and returns one; a
    sample is given as a batch of one row, and the first row of what it returns is the
    sample. ``columns``: the columns it is given (``output_all_columns``: the others are
    added after); ``then``: the ``transform=`` applied after it.
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
    """A sample's value as the Python values HF's python extractor gives (lists, ints)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    return value
