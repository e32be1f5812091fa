"""``SharedList``: picklable objects held once in shared memory, pickled as they come.

Note [Tensors in SharedList items]
----------------------------------
``pickle`` sends a tensor through ``torch.save``'s format: unpickling runs
``torch.load`` (~100 us for a 1 KiB tensor) and a view pickles its whole storage. So
``SharedList`` pickles with a dispatch table of its own (never ``copyreg``'s) that sends
a plain CPU tensor as a numpy array of its values (``torch.from_numpy`` back: ~10 us,
only the view's bytes), and a dtype numpy lacks (``bfloat16``, float8) as its bytes.
It comes back contiguous, with a storage of its own. Any other tensor (a subclass,
``requires_grad``, attributes, conj/neg views, another device) is pickled by torch.
"""

from __future__ import annotations

import copyreg
import functools
import io
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from collections.abc import Set as AbstractSet
from itertools import islice
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .._text import format_bytes
from ..columns._columns import BytesColumn, ColumnSpec
from ..crossing._collate import Row, RowList, RowTuple, into_one_batch
from ..distributed import SAMPLE_ITEMS, NodeShard, sample_digest
from ..errors import (
    ArgumentTypeError,
    IndexOutOfRangeError,
    IndexTypeError,
    ShardingNotSupportedError,
    UnpicklableItemError,
)
from ..storage._writer import VarStore
from ._dataset import Closable
from ._indexing import index_shape, index_tensor, is_int, nest_rows
from ._load import Allocator, LoadOptions, Part, Shard, Share, progress_bar

__all__ = ["ItemPickler", "SharedList", "sampled_key"]


class SharedList(Closable, Sequence):
    """An immutable list of picklable objects, held once in shared memory.

    For per-sample metadata (annotations, file lists) that grows every worker's
    memory under ``fork`` (pytorch/pytorch#13246) and is pickled into every worker
    under ``spawn``: items are stored pickled in one shared buffer and unpickled on
    access.

    Args:
        items: any iterable of picklable objects.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        progress: a progress bar for copies longer than ~2 s.
        timeout: seconds to wait for another local rank.
        share: under torchrun, ``"node"`` (the default there): local rank 0 pickles
            the items, the others attach (they read only a sample of ``items`` to
            compare); ``"process"``: every process keeps its own copy.
        shard: ``"node"`` keeps only this node's contiguous share of the items
            (``items`` must have a length).

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
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        indexed = isinstance(items, (Sequence, np.ndarray, torch.Tensor))
        key = functools.partial(sampled_key, "SharedList", items, size, indexed)
        columns = options.loader(_Items(items), key)()
        self._column = columns["items"]
        self.node_shard = columns.node_shard

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: Any) -> Any:
        """An item for an int; a list of items for indices (Note [A batch by index])."""
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

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items ``indices`` (what a DataLoader calls for a batch).

        In a worker their tensors go into one memfd (``into_one_batch``), and dicts,
        tuples and lists come as ``Row``, ``RowTuple``, ``RowList``, which the default
        collate collates into one memfd too (Note [Collating into one memfd] in
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
        """The (device, inode) of the shared segment holding the items."""
        return frozenset(array.segment.handle()[2] for array in self._column.arrays.values())

    def __repr__(self) -> str:
        if self.closed:
            return f"SharedList({len(self)} items, closed)"
        return f"SharedList({len(self)} items, {format_bytes(self.nbytes)})"


_ROWS: dict[type, Callable[[Any], Any]] = {dict: Row, tuple: RowTuple, list: RowList}


def _same(item: Any) -> Any:
    return item


class _Items:
    """``SharedList``'s producer: the items pickled into a growing shared file as they come.

    Note [Variable-length values go to shared memory as they come] in ``storage/_writer.py``.
    """

    label = "SharedList"

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items
        self.start, self.stop = 0, cast("int | None", None)
        self.store: VarStore | None = None

    def total_rows(self) -> int:
        """Items in all."""
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
        items = islice(iter(self.items), self.start, self.stop)
        dumps = ItemPickler().dumps  # Note [Tensors in SharedList items]
        sized = isinstance(self.items, Sized)
        stop = self.stop if self.stop is not None else len(self.items) if sized else self.start  # type: ignore[arg-type]
        with progress_bar(stop - self.start, "pickling SharedList", progress, unit="it") as update:
            for index, item in enumerate(items, self.start):
                try:
                    blob = dumps(item)
                except Exception as e:
                    raise UnpicklableItemError(
                        f"SharedList item {index} (a {type(item).__name__}) cannot be pickled "
                        f"({type(e).__name__}: {e}). SharedList stores its items pickled: make "
                        "the item picklable (no lambdas, open files, locks or local classes), "
                        "or store what it refers to (a path, a number) instead."
                    ) from e
                store.add(blob)
                update(1)
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


class ItemPickler:
    """Pickles items one after another (Note [Tensors in SharedList items]).

    Example:
        >>> dumps = ItemPickler().dumps
        >>> rows = torch.arange(12.0).reshape(4, 3)
        >>> back = pickle.loads(dumps({"row": rows[1], "n": 1}))
        >>> back, back["row"].untyped_storage().nbytes()
        ({'row': tensor([3., 4., 5.]), 'n': 1}, 12)
    """

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._pickler = pickle.Pickler(self._buffer, pickle.HIGHEST_PROTOCOL)
        table = copyreg.dispatch_table.copy()
        table[torch.Tensor] = _reduce_tensor  # exact type: subclasses are torch's
        self._pickler.dispatch_table = table  # type: ignore[misc]

    def dumps(self, item: Any) -> bytes:
        """``item`` pickled."""
        buffer = self._buffer
        buffer.seek(0)
        buffer.truncate()
        self._pickler.clear_memo()
        self._pickler.dump(item)
        return buffer.getvalue()


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    if (
        tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__
    ):
        try:
            array = tensor.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks: bfloat16, float8, complex32
            try:
                bits = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            except (TypeError, RuntimeError):  # quantized...: torch's own pickle
                pass
            else:
                return tensor_from_bytes, (bits, tensor.dtype, tuple(tensor.shape))
        else:
            return tensor_from_array, (array,)
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def tensor_from_array(array: np.ndarray) -> torch.Tensor:
    """A tensor of ``array``'s values (a read-only array is copied)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def tensor_from_bytes(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of a dtype numpy lacks, from its bytes."""
    return tensor_from_array(bits).view(dtype).reshape(shape)


def sampled_key(label: str, items: Any, size: int | None, indexed: bool = True) -> tuple[Any, ...]:
    """What local ranks compare: ``label``, the type, length and a sample of ``items``.

    Indexable items are sampled across their length, other re-iterable ones by their
    first items, a one-shot iterable (or one without a length) not at all: reading it
    would consume it.

    Example:
        >>> sampled_key("SharedList", iter([1, 2]), None)
        ('SharedList', 'builtins.list_iterator', None)
    """
    kind = f"{type(items).__module__}.{type(items).__qualname__}"
    if size is not None and indexed:
        sample = sample_digest(lambda i: items[i], size)
    elif size is not None and not isinstance(items, (Iterator, AbstractSet)):
        first = list(islice(iter(items), SAMPLE_ITEMS))
        sample = sample_digest(first.__getitem__, len(first))
    else:
        return (label, kind, size)
    return (label, kind, size, f"sampled items {sample}")
