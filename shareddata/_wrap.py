"""The drop-in path: ``SharedDataset(any map-style dataset)`` and ``SharedList``.

``SharedDataset`` reads every item of the wrapped dataset once, infers a schema
from the first item (a tree of tuples, lists and dicts whose leaves are tensors,
arrays, numbers, strings, bytes or anything picklable), writes each leaf into a
shared column (``_materialise.py``), and from then on rebuilds items from shared
memory with the same structure and types the original returned.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from ._columns import BytesColumn, Column, ColumnSpec
from ._dataset import ColumnDataset, _progress_bar
from ._materialise import _VarBuffer, build_columns, rebuild, restore
from ._storage import _fmt, allocate, seal

__all__ = ["SharedDataset", "SharedList"]


# -- the datasets --------------------------------------------------------------------------


class SharedDataset(ColumnDataset):
    """Wraps ANY map-style dataset: every item is materialised once into shared memory.

    The drop-in path for existing code: ``ds = sd.SharedDataset(MyDataset(...))``.
    Items come back with the same structure and types the original returned (a tuple
    stays a tuple, an ``int`` an ``int``, a numpy array a numpy array), so the
    default collate gives the batches the original gave. Items may hold tensors and
    arrays (fixed or varying shape), Python numbers, ``str``, ``bytes``, lists of
    numbers, and tuples/lists/dicts of these; any other picklable value is kept as
    pickled bytes in a shared buffer.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        transform: applied to each rebuilt item, in the worker.
        num_workers: read the original with a DataLoader of this many workers, which
            write the fixed-size fields straight into the shared columns (for datasets
            whose ``__getitem__`` is expensive: decoding, augmenting); 0 reads it here.
        progress: show a progress bar for materialisations longer than ~2 s.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.

    Raises:
        TypeError: for an ``IterableDataset``, or an item whose structure or types
            differ from the first item's (naming the index and the field).
        ValueError: for an empty dataset, or a value its column cannot hold (an int
            beyond int64, text that is not valid UTF-8), naming the index and field.
        SharedMemoryFullError: when the data does not fit in RAM (or ``storage_dir``).

    Whatever fails (an error above, ``__getitem__`` raising, Ctrl-C), everything
    allocated is freed before the error propagates.

    Example:
        >>> import torch, shareddata as sd
        >>> class Squares(torch.utils.data.Dataset):
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i): return torch.full((2,), i * i), i, f"#{i}"
        >>> ds = sd.SharedDataset(Squares())
        >>> ds[3]
        (tensor([9, 9]), 3, '#3')
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        transform: Callable[[Any], Any] | None = None,
        num_workers: int = 0,
        progress: bool = True,
        storage_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"SharedDataset needs a map-style dataset with a length; "
                f"{type(dataset).__name__} is iterable-only. Only a map-style dataset has a "
                "length to preallocate shared columns for; convert it to one (e.g. collect "
                "its items into a list and wrap that)."
            )
        rows = len(dataset)
        label = type(dataset).__name__
        if rows == 0:
            raise ValueError(f"{label} is empty: there is nothing to share")
        with _progress_bar(rows, f"materialising {label}", progress) as update:
            # frees everything it allocated if anything fails
            columns, kinds, schema = build_columns(dataset, rows, storage_dir, update, num_workers)
        self._init(columns, kinds, transform, schema)

    def _init(
        self, columns: dict[str, Column], restore: list[str], transform: Any, schema: Any
    ) -> None:
        super().__init__(columns, transform=transform, output="tuple")
        self._restore_kinds = restore
        self._schema = schema

    def _pack(self, values: Sequence[Any]) -> Any:
        leaf_values: list[Any] = []
        it = iter(values)
        for kind in self._restore_kinds:
            value = next(it)
            if kind.endswith("+ragged"):
                shape = next(it).tolist()
                value = value.reshape(shape)
                kind = kind[: -len("+ragged")]
            leaf_values.append(restore(kind, value))
        return rebuild(self._schema, leaf_values)

    def __getitem__(self, index: Any) -> Any:
        from ._dataset import _is_int

        if _is_int(index):
            return super().__getitem__(index)
        return default_collate(self.__getitems__(self._indices(index).tolist()))

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "restore": self._restore_kinds, "schema": self._schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SharedDataset._init(
            self, state["columns"], state["restore"], state["transform"], state["schema"]
        )


class SharedList(Sequence):
    """An immutable list of picklable objects, held once in shared memory.

    The fix for per-sample metadata (annotations, file lists) that grows every
    worker's memory under ``fork`` (pytorch/pytorch#13246) and is pickled into every
    worker under ``spawn``: items are stored pickled in one shared buffer and
    unpickled on access, so no Python object per item lives in any process.

    Args:
        items: any iterable of picklable objects.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.

    Example:
        >>> import shareddata as sd
        >>> names = sd.SharedList({"file": f"img{i}.jpg", "boxes": [i]} for i in range(3))
        >>> len(names), names[-1], names[:2][1]["file"]
        (3, {'file': 'img2.jpg', 'boxes': [2]}, 'img1.jpg')
    """

    def __init__(
        self, items: Iterable[Any], *, storage_dir: str | os.PathLike[str] | None = None
    ) -> None:
        buffer = _VarBuffer(np.uint8)
        it, dumps, protocol = iter(items), pickle.dumps, pickle.HIGHEST_PROTOCOL
        while blobs := [dumps(item, protocol) for item in islice(it, 4096)]:
            buffer.extend(b"".join(blobs), map(len, blobs))
        del blobs
        offsets, values = allocate(
            [((len(buffer.offsets),), np.int64), ((len(buffer.values),), np.uint8)],
            storage_dir,
            what=f"SharedList of {len(buffer.offsets) - 1} items ({_fmt(len(buffer.values))})",
        )
        offsets.numpy()[:] = np.frombuffer(buffer.offsets, np.int64)
        values.numpy()[:] = np.frombuffer(buffer.values, np.uint8)
        del buffer
        rows = len(offsets) - 1
        spec = ColumnSpec("items", rows, np.dtype(np.uint8), (), "bytes", len(values))
        # fork children map it copy-on-write: Note [Sealed segments] in _storage.py
        offsets, values = seal([offsets, values])
        self._column = BytesColumn(spec, {"offsets": offsets, "values": values})

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            rows = range(*index.indices(len(self)))
            if not rows:
                return []
            blobs = self._column.gather(torch.tensor(list(rows), dtype=torch.int64))
            return [pickle.loads(b) for b in blobs]
        i = int(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"SharedList index {i} out of range for {n} items")
        return pickle.loads(self._column.get(i + n if i < 0 else i))

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory."""
        return self._column.nbytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_list, (self._column,))

    def __repr__(self) -> str:
        return f"SharedList({len(self)} items, {_fmt(self.nbytes)})"


def _rebuild_list(column: BytesColumn) -> SharedList:
    obj = SharedList.__new__(SharedList)
    obj._column = column
    return obj
