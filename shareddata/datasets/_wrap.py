"""``SharedDataset``: any map-style dataset, every item materialised once into shared columns."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from ..columns._columns import Column
from ..columns._items import LeafType, leaf_batches, rebuild, restore
from ..errors import ArgumentTypeError, InvalidArgumentError
from ._dataset import ColumnDataset, Leaves
from ._list import sampled_key
from ._load import LoadOptions, Shard, Share
from ._materialise import DatasetProducer

__all__ = ["SharedDataset"]


class SharedDataset(ColumnDataset):
    """Wraps ANY map-style dataset: every item is materialised once into shared memory.

    The drop-in path: ``ds = sd.SharedDataset(MyDataset(...))``. Items come back with
    the structure and types the original returned (a tuple stays a tuple, an ``int``
    an ``int``, an array an array of its dtype, a tensor subclass itself), so the
    default collate gives the same batches. Tensors, arrays (fixed or varying shape),
    numbers, ``str``, ``bytes``, lists of numbers and tuples/lists/dicts of them get
    columns; any other picklable value is kept pickled (Note [What comes back] in
    ``columns/_items.py``).

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        transform: applied to each rebuilt item, in the worker.
        num_workers: read the original with a DataLoader of this many workers, which
            write the fixed-size fields straight into the shared columns; 0 reads here.
        progress: a progress bar for materialisations longer than ~2 s.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        timeout: seconds to wait for another local rank.
        share: under torchrun, ``"node"`` (the default there): local rank 0 reads the
            items, the others attach, reading only a sample of 16 items to compare
            (different data: ``LocalRankError``); ``"process"``: every process reads.
        shard: ``"node"`` materialises only this node's contiguous share of the items.

    Raises:
        TypeError: an ``IterableDataset``, or an item whose structure or types differ
            from the first item's (naming the index and the field).
        ValueError: an empty dataset, or a value its column cannot hold.
        SharedMemoryFullError: the data does not fit in RAM (or ``storage_dir``).

    Warns:
        UserWarning: an item differs between two reads (a random augmentation, frozen
            by the copy): the random part belongs in ``transform``.

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
        if transform is not None and not callable(transform):
            raise ArgumentTypeError(f"transform must be callable, got {type(transform).__name__}")
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
        producer = DatasetProducer(dataset, num_workers)  # reads items only where it loads
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        key = functools.partial(sampled_key, "SharedDataset", dataset, rows)
        columns = options.loader(producer, key)()
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
        # flat tuples or dicts of the leaves take the columns' path; other trees: rebuilt
        tag, body = schema
        children = [c for _, c in body] if tag == "dict" else body if tag != "leaf" else None
        flat = children is not None and all(c == ("leaf", k) for k, c in enumerate(children))
        names: list[Any] = [k for k, _ in body] if flat and tag == "dict" else []
        names = names or [str(k) for k in range(len(types))]
        self._batch = (names, None if flat and tag != "list" else schema, flat and tag == "tuple")

    def _pack(self, values: Sequence[Any]) -> Any:
        leaf_values: list[Any] = []
        it = iter(values)
        for t in self._types:
            value = next(it)
            if t.ragged:
                value = value.reshape(next(it).tolist())
            leaf_values.append(restore(t, value))
        return rebuild(self._schema, leaf_values)

    _portable = True  # leaf_batches' splits are module-level

    def _leaves(self, batched: list[Any]) -> Leaves:
        """The leaves' batches (Note [What comes back] in ``columns/_items.py``)."""
        return leaf_batches(self._types, batched)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "restore": self._types, "schema": self._schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SharedDataset._init(
            self, state["columns"], state["restore"], state["transform"], state["schema"]
        )
