"""The drop-in path: ``SharedDataset(any map-style dataset)`` and ``SharedList``.

``SharedDataset`` reads every item of the wrapped dataset once, infers a schema
from the first item (a tree of tuples, lists and dicts whose leaves are tensors,
arrays, numbers, strings, bytes or anything picklable), writes each leaf into a
shared column (``_materialise/``), and from then on rebuilds items from shared
memory with the same structure and types the original returned.
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from collections.abc import Set as AbstractSet
from itertools import islice
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .._text import format_bytes
from ..columns._columns import BytesColumn, Column, ColumnSpec
from ..columns._items import LeafType, leaf_batches, rebuild, restore
from ..crossing._collate import Row, RowList, RowTuple
from ..crossing._transport import into_one_batch
from ..distributed import SAMPLE_ITEMS, NodeShard, sample_digest
from ..errors import (
    ArgumentTypeError,
    IndexOutOfRangeError,
    IndexTypeError,
    InvalidArgumentError,
    ShardingNotSupportedError,
    UnpicklableItemError,
)
from ..storage._writer import VarStore
from ._dataset import BatchValues, Closable, ColumnDataset, is_int
from ._indexing import index_shape, index_tensor, nest_rows
from ._itempickle import ItemPickler
from ._load import Allocator, Part, Shard, Share, build, progress_bar
from ._materialise import DatasetProducer

__all__ = ["SharedDataset", "SharedList"]


# -- the datasets --------------------------------------------------------------------------


class SharedDataset(ColumnDataset):
    """Wraps ANY map-style dataset: every item is materialised once into shared memory.

    The drop-in path for existing code: ``ds = sd.SharedDataset(MyDataset(...))``.
    Items come back with the same structure and types the original returned (a tuple
    stays a tuple, an ``int`` an ``int``, a numpy array a numpy array of its dtype,
    big-endian too; an ``nn.Parameter`` or a tensor subclass as itself, with its
    ``requires_grad``), so the default collate gives the batches the original gave,
    and from DataLoader workers they leave as one shared memory handle per batch,
    as ``NumpyDataset``'s do. Items may hold tensors and arrays (fixed or varying
    shape, ``bfloat16`` too), Python and numpy numbers, ``str``, ``bytes``, lists of
    numbers, and tuples/lists/dicts of these; any other picklable value (datetimes,
    sparse tensors, objects, a tensor subclass whose instances carry attributes) is
    kept as pickled bytes in a shared buffer. Dicts may have item 0's keys in any
    order: every item comes back in item 0's order, the one the default collate
    uses. An ``np.memmap`` comes back as an ``ndarray`` in memory. Note [What comes
    back] in ``columns/_items.py`` has the details.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        transform: applied to each rebuilt item, in the worker.
        num_workers: read the original with a DataLoader of this many workers, which
            write the fixed-size fields straight into the shared columns (for datasets
            whose ``__getitem__`` is expensive: decoding, augmenting); 0 reads it here.
        progress: show a progress bar for materialisations longer than ~2 s.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        share: under torchrun, ``"node"`` (the default there): local rank 0 reads the
            items once per node and the other local ranks attach without reading
            the dataset (they call its ``__getitem__`` only for a sample of 16
            items, which every rank compares with local rank 0's:
            ranks that wrap different data get ``LocalRankError``, never another
            rank's items); ``"process"``: every process reads its own copy.
        shard: ``"node"`` materialises only this node's contiguous share of the
            items (``ds.node_shard`` says which; sample with ``sd.NodeShardSampler``).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

    Raises:
        TypeError: for an ``IterableDataset``, or an item whose structure or types
            differ from the first item's (naming the index and the field): another
            class, dtype, byte order or ``requires_grad``, other dict keys.
        ValueError: for an empty dataset, or a value its column cannot hold (an int
            beyond int64, text that is not valid UTF-8), naming the index and field.
        SharedMemoryFullError: when the data does not fit in RAM (or ``storage_dir``).

    Warns:
        UserWarning: when an item differs between two reads of the original (a random
            augmentation, frozen by the copy): the random part belongs in ``transform``.

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
        share: Share | None = None,
        shard: Shard | None = None,
        timeout: float | None = None,
    ) -> None:
        _check_transform(transform)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise InvalidArgumentError(
                f"num_workers must be an int >= 0 (0 reads the items here), got {num_workers!r}"
            )
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ArgumentTypeError(
                f"SharedDataset needs a map-style dataset with a length; "
                f"{type(dataset).__name__} is iterable-only. Only a map-style dataset has a "
                "length to preallocate shared columns for; convert it to one (e.g. collect "
                "its items into a list and wrap that)."
            )
        rows = len(dataset)
        kind = type(dataset)
        if rows == 0:
            raise InvalidArgumentError(f"{kind.__name__} is empty: there is nothing to share")
        producer = _CheckedProducer(dataset, num_workers)  # reads items only where it loads
        columns = build(
            producer,
            key=functools.partial(_dataset_key, dataset, rows),
            share=share,
            shard=shard,
            storage_dir=storage_dir,
            progress=progress,
            timeout=timeout,
        )
        kinds, schema = columns.meta
        self._init(columns, kinds, transform, schema)
        if producer.varies is not None:
            name, i = kind.__name__, producer.varies
            warnings.warn(
                f"SharedDataset({name}): item {i} differs between two reads of {name}[{i}] "
                f"(a random augmentation in its __getitem__ or transform?). SharedDataset "
                "stores one read of every item, so every epoch would see that same one. Move "
                f"the random part to SharedDataset({name}(...), transform=...), which runs in "
                "the worker on every read, and keep the dataset's own reading deterministic.",
                UserWarning,
                stacklevel=2,
            )

    def _init(
        self, columns: dict[str, Column], types: list[LeafType], transform: Any, schema: Any
    ) -> None:
        super().__init__(columns, transform=transform, output="tuple")
        self._types = types
        self._schema = schema
        # what a batch's samples are made of: flat tuples or dicts of the leaves in
        # order take the columns' own path; any other tree is rebuilt from its schema
        tag, body = schema
        children = [c for _, c in body] if tag == "dict" else body if tag != "leaf" else None
        flat = children is not None and all(c == ("leaf", k) for k, c in enumerate(children))
        self._leaf_names: list[Any] = [k for k, _ in body] if flat and tag == "dict" else []
        self._leaf_names = self._leaf_names or [str(k) for k in range(len(types))]
        self._flat_tuples = flat and tag == "tuple"
        self._leaf_nesting = None if flat and tag != "list" else schema

    def _pack(self, values: Sequence[Any]) -> Any:
        leaf_values: list[Any] = []
        it = iter(values)
        for t in self._types:
            value = next(it)
            if t.ragged:
                value = value.reshape(next(it).tolist())
            leaf_values.append(restore(t, value))
        return rebuild(self._schema, leaf_values)

    def _values(self, batched: list[Any]) -> BatchValues:
        """The leaves' batches (Note [What comes back] in ``columns/_items.py``)."""
        values, stacked, splits, firsts = leaf_batches(self._types, batched)
        return BatchValues(
            self._leaf_names, values, stacked, splits, firsts, self._leaf_nesting,
            self._flat_tuples, portable=True,
        )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "restore": self._types, "schema": self._schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SharedDataset._init(
            self, state["columns"], state["restore"], state["transform"], state["schema"]
        )


# Note [A random item is frozen]: SharedDataset stores one read of every item, so a
# __getitem__ that augments at random (ImageFolder(transform=RandomResizedCrop)) would give
# one crop forever. Where the items are read (local rank 0 under torchrun), three of them
# (first, middle, last) are read twice more, with torch, numpy and Python seeded
# differently each time (sample_digest puts the caller's random states back), and their
# digests compared; a difference warns, naming the fix (the random part to transform=).


class _CheckedProducer(DatasetProducer):
    """The items, then three read twice more (Note [A random item is frozen])."""

    varies: int | None = None  # an item that differed between two reads, if read here

    def produce(self, alloc: Allocator, progress: bool) -> tuple[list[Part], Any]:
        """The columns' parts, as DatasetProducer's, then the check."""
        parts = super().produce(alloc, progress)
        rows = range(self.start, self.stop)  # not empty: produce() refused that
        for i in sorted({rows[0], rows[len(rows) // 2], rows[-1]}):
            try:
                if _digest_of_read(self.dataset, i, 1) != _digest_of_read(self.dataset, i, 2):
                    self.varies = i
                    break
            except Exception:  # the load read it once: no second read, nothing to check
                break
        return parts


def _digest_of_read(dataset: Any, i: int, seed: int) -> str:
    def read(_: int) -> Any:
        torch.manual_seed(seed)  # sample_digest puts the caller's random states back
        np.random.seed(seed)
        random.seed(seed)
        return dataset[i]

    return sample_digest(read, 1)


def _dataset_key(dataset: Any, rows: int) -> tuple[Any, ...]:
    """What local ranks compare for a SharedDataset: its class, length and a sample of items."""
    kind = type(dataset)
    sample = sample_digest(lambda i: dataset[i], rows)
    return (
        "SharedDataset",
        f"{kind.__module__}.{kind.__qualname__}",
        rows,
        f"sampled items {sample}",
    )


def _list_key(items: Any, size: int | None) -> tuple[Any, ...]:
    """What local ranks compare for a SharedList: the type, length and a sample of items.

    A sequence is sampled across its length; another collection that can be iterated
    again (a dict's keys) by its first items; a one-shot iterable (a generator) not at
    all: reading it here would leave nothing for the load.
    """
    kind = f"{type(items).__module__}.{type(items).__qualname__}"
    if size is not None and isinstance(items, (Sequence, np.ndarray, torch.Tensor)):
        sample = sample_digest(lambda i: items[i], size)
    elif size is not None and not isinstance(items, (Iterator, AbstractSet)):
        first = list(islice(iter(items), SAMPLE_ITEMS))
        sample = sample_digest(first.__getitem__, len(first))
    else:
        return ("SharedList", kind, size)
    return ("SharedList", kind, size, f"sampled items {sample}")


def _check_transform(transform: Any) -> None:
    if transform is not None and not callable(transform):
        raise ArgumentTypeError(f"transform must be callable, got {type(transform).__name__}")


class SharedList(Closable, Sequence):
    """An immutable list of picklable objects, held once in shared memory.

    The fix for per-sample metadata (annotations, file lists) that grows every
    worker's memory under ``fork`` (pytorch/pytorch#13246) and is pickled into every
    worker under ``spawn``: items are stored pickled in one shared buffer and
    unpickled on access, so no Python object per item lives in any process.

    Args:
        items: any iterable of picklable objects.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        share: under torchrun, ``"node"`` (the default there): local rank 0 pickles
            the items once per node and the other local ranks attach (they read
            only a sample of ``items``, which every rank compares with local rank
            0's; a one-shot iterable is never read there, and compared by type and
            length only); ``"process"``: every process keeps its own copy.
        shard: ``"node"`` keeps only this node's contiguous share of the items
            (``items`` must have a length; ``node_shard`` says which).
        progress: show a progress bar for copies longer than ~2 s.
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

    Raises:
        UnpicklableItemError: an item cannot be pickled (a ``TypeError``), naming it.
        ShardingNotSupportedError: ``shard="node"`` over a one-shot iterable.

    Example:
        >>> import shareddata as sd
        >>> names = sd.SharedList({"file": f"img{i}.jpg", "boxes": [i]} for i in range(3))
        >>> len(names), names[-1], names[:2][1]["file"]
        (3, {'file': 'img2.jpg', 'boxes': [2]}, 'img1.jpg')
    """

    node_shard: NodeShard | None = None
    _held = "_column"

    def __init__(
        self,
        items: Iterable[Any],
        *,
        storage_dir: str | os.PathLike[str] | None = None,
        share: Share | None = None,
        shard: Shard | None = None,
        progress: bool = True,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(items, Iterable):
            raise ArgumentTypeError(
                f"SharedList needs an iterable of items, got {type(items).__name__}"
            )
        size = len(items) if isinstance(items, Sized) else None
        columns = build(
            _Items(items),
            key=functools.partial(_list_key, items, size),
            share=share,
            shard=shard,
            storage_dir=storage_dir,
            progress=progress,
            timeout=timeout,
        )
        self._column = columns["items"]
        self.node_shard = columns.node_shard

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: Any) -> Any:
        """An item for an int; a list of items for a slice or indices (Note [A batch by index]).

        An n-D index gives nested lists of items, laid out in its shape, as numpy does.
        """
        if is_int(index):
            i = int(index)
            n = len(self)
            if not -n <= i < n:
                raise IndexOutOfRangeError(f"SharedList index {i} out of range for {n} items")
            return pickle.loads(self._column.get(i + n if i < 0 else i))
        if not isinstance(index, (slice, list, tuple, np.ndarray, torch.Tensor)):
            raise IndexTypeError(
                f"SharedList indices must be integers, slices or sequences of integers, "
                f"got {type(index).__name__}"
            )
        shape = index_shape(index)
        idx = index_tensor(index, len(self), "SharedList")
        items = [pickle.loads(b) for b in self._column.gather(idx)] if len(idx) else []
        if items and get_worker_info() is not None:  # IndexBatchSampler: see __getitems__
            items = into_one_batch(items)
        return items if shape is None else nest_rows(items, shape)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items ``indices`` (what a DataLoader calls for a batch).

        In a DataLoader worker the tensors of the batch's items are copied into one
        batch memfd, which leaves the worker as one handle (``into_one_batch`` in
        ``crossing/_transport.py``), not as one shared segment per tensor; items that are
        dicts, tuples and lists come as ``Row``, ``RowTuple`` and ``RowList`` (plain
        ``dict``, ``tuple`` and ``list`` to their user), which the default collate
        collates into one memfd too (Note [Collating into one memfd] in
        ``crossing/_collate.py``).
        """
        items = [self[i] for i in indices]
        if get_worker_info() is None:
            return items
        return [_ROWS.get(type(item), _same)(item) for item in into_one_batch(items)]

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory."""
        return self._column.nbytes

    def segment_identity(self) -> frozenset[tuple[int, int]]:
        """The (device, inode) of the shared segment holding the items (one copy each)."""
        return frozenset(array.segment.handle()[2] for array in self._column.arrays.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_list, (self._column, self.node_shard))

    def __repr__(self) -> str:
        if self.closed:
            return f"SharedList({len(self)} items, closed)"
        return f"SharedList({len(self)} items, {format_bytes(self.nbytes)})"


_ROWS: dict[type, Callable[[Any], Any]] = {dict: Row, tuple: RowTuple, list: RowList}


def _same(item: Any) -> Any:
    return item


def _rebuild_list(column: BytesColumn, node_shard: NodeShard | None = None) -> SharedList:
    obj = SharedList.__new__(SharedList)
    obj._column = column
    obj.node_shard = node_shard
    return obj


class _Items:
    """``SharedList``'s producer: its items, pickled and written to shared memory as they come.

    The pickles go to a growing shared file (Note [Variable-length values go to shared
    memory as they come] in ``storage/_writer.py``): private memory holds the offsets (8 bytes
    per item) and one block of pickles, whatever the items weigh.
    """

    label = "SharedList"

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items
        self.start, self.stop = 0, cast("int | None", None)
        self.store: VarStore | None = None

    def total_rows(self) -> int:
        """Items in all (sharding needs a length)."""
        if not isinstance(self.items, Sized):
            raise ShardingNotSupportedError(
                f"shard='node' needs to know how many items there are, but SharedList was "
                f"given a one-shot iterable ({type(self.items).__name__}) with no length: each "
                "node would have to read every item to find its share. Pass a list (or any "
                "sized sequence), or use shard=None."
            )
        return len(self.items)

    def select_rows(self, start: int, stop: int) -> None:
        """Keep only items ``[start, stop)``."""
        self.start, self.stop = start, stop

    def produce(self, alloc: Allocator, progress: bool) -> tuple[list[Part], Any]:
        """Pickle the items into a shared file; the one bytes column over it."""
        store = self.store = VarStore(np.uint8, alloc.storage_dir, "SharedList's items")
        it = islice(iter(self.items), self.start, self.stop)
        dumps, index = ItemPickler().dumps, self.start  # Note [Tensors in SharedList items]
        total = (self.stop or 0) - self.start if self.stop is not None else 0
        if not total and isinstance(self.items, Sized):
            total = len(self.items) - self.start
        with progress_bar(total, "pickling SharedList", progress, unit="it") as update:
            step = 16  # items pickled at once: up to 256, fewer when they are big
            while chunk := list(islice(it, step)):
                try:
                    blobs = [dumps(item) for item in chunk]
                except Exception:
                    blobs = [_pickle_item(dumps, item, index + j) for j, item in enumerate(chunk)]
                for blob in blobs:  # one at a time: a block of big pickles is not joined
                    store.add(blob)
                index += len(chunk)
                update(len(chunk))
                size = sum(map(len, blobs))
                step = max(1, min(256, step * (4 << 20) // max(size, 1)))
                del blobs, chunk
        values, offsets = store.finish_with_offsets()  # one segment: one descriptor
        alloc.adopt(values.segment)
        count = values.shape[0]
        spec = ColumnSpec("items", len(store.offsets) - 1, np.dtype(np.uint8), (), "bytes", count)
        return [(BytesColumn, spec, {"offsets": offsets, "values": values})], None

    def close(self) -> None:
        """Free the file if the items never made it into a column (an error)."""
        if self.store is not None:
            self.store.discard()
            self.store = None


def _pickle_item(dumps: Callable[[Any], bytes], item: Any, index: int) -> bytes:
    try:
        return dumps(item)
    except Exception as e:
        raise UnpicklableItemError(
            f"SharedList item {index} (a {type(item).__name__}) cannot be pickled "
            f"({type(e).__name__}: {e}). SharedList stores its items pickled: make the item "
            "picklable (no lambdas, open files, locks or local classes), or store what it "
            "refers to (a path, a number) instead."
        ) from e
