"""The common Dataset over shared columns: len, samples, batches, pickling as handles."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, get_worker_info

from .._text import format_bytes
from ..columns._columns import Column, ColumnSpec, TensorColumn
from ..columns._items import nest_paths, rebuild
from ..crossing._collate import Samples, collate_columns
from ..crossing._transport import worker_buffers
from ..errors import ArgumentTypeError, InvalidArgumentError
from ._indexing import (
    index_shape,
    index_tensor,
    is_int,
    lenient_collate,
    out_of_range,
    rows_by_index,
)
from ._load import Source, check_lengths

__all__ = ["ColumnDataset", "Leaves", "Source"]

Output = Literal["dict", "tuple"]
Leaves = tuple[list[Any], list[bool], list[Callable[[Any], Any]], list[Any] | None]
"""A gathered batch's leaves: per leaf its batch, whether stacked, its split, its first."""


class Closed:
    """What a closed dataset holds instead of its columns: any use but ``len()`` is refused.

    With :class:`~shareddata.InvalidArgumentError` (a ``ValueError``, as for a closed file).
    """

    def __init__(self, owner: str, length: int) -> None:
        self._message = (
            f"{owner} is closed (its close() was called or its `with` block ended), so "
            "it no longer refers to its shared memory. Make a new dataset to read again."
        )
        self._length = length

    def refuse(self, *args: Any, **kwargs: Any) -> Any:
        """Raise the closed dataset's error."""
        raise InvalidArgumentError(self._message)

    values = items = keys = get = gather = __getitem__ = __iter__ = __reduce__ = refuse

    def __getattr__(self, name: str) -> Any:  # a column's attributes (nbytes, arrays...)
        self.refuse()

    def __len__(self) -> int:
        return self._length


class Closable:
    """``close()``, ``closed`` and ``with`` for a dataset whose data is held by ``_held``."""

    _held = "_columns"  # the attribute that refers to the shared memory

    def close(self) -> None:
        """Let go of the shared memory now (idempotent); any later use is refused.

        The memory is freed once nothing holds it: samples, batches and workers already
        started keep theirs. ``with`` closes the dataset at the block's end.

        Example:
            >>> import numpy as np, shareddata as sd
            >>> with sd.NumpyDataset(np.zeros((4, 2), np.float32)) as ds:
            ...     row = ds[0]
            >>> ds[0]
            Traceback (most recent call last):
            ...
            shareddata.errors.InvalidArgumentError: NumpyDataset is closed ...
            >>> row, len(ds)
            ({'data': tensor([0., 0.])}, 4)
        """
        if not self.closed:
            setattr(self, self._held, Closed(type(self).__name__, len(self)))  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return isinstance(getattr(self, self._held), Closed)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ColumnDataset(Closable, Dataset):
    """A map-style Dataset over columns in shared memory; subclasses only build the columns.

    Args:
        columns: the columns by name (all of one length), or a function loading them
            (called after every other argument is checked).
        transform: applied to each sample, in the worker, after indexing.
        output: ``"dict"`` (``{column: value}``) or ``"tuple"`` (values in column order).
        nested: each value at its key path in ``paths`` (Note [Nested items] in
            ``columns/_items.py``) instead of under its flat name.
        paths: each column's key path (default: its name alone).

    Attributes:
        node_shard: with ``shard="node"``, the rows of the whole dataset held here
            (a :class:`~shareddata.distributed.NodeShard`); otherwise ``None``.
    """

    def __init__(
        self,
        columns: dict[str, Column] | Callable[[], dict[str, Column]],
        *,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        nested: bool = False,
        paths: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        if output not in ("dict", "tuple"):
            raise InvalidArgumentError(f"output must be 'dict' or 'tuple', got {output!r}")
        if transform is not None and not callable(transform):
            raise ArgumentTypeError(f"transform must be callable, got {type(transform).__name__}")
        if not isinstance(nested, bool):
            raise ArgumentTypeError(f"nested must be True or False, got {nested!r}")
        if nested and paths:
            nest_paths(list(paths), [tuple(p) for p in paths.values()])  # clashes, before loading
        if callable(columns):
            columns = columns()
        self._columns = columns
        self._names = list(columns)
        self._len = check_lengths([c.spec for c in columns.values()], type(self).__name__)
        self.node_shard = getattr(columns, "node_shard", None)  # distributed.ShardedColumns
        self.transform = transform
        self.output: Output = output
        self.nested = nested
        self._paths = {n: tuple(paths[n]) if paths else (n,) for n in self._names}
        self._nesting = (
            nest_paths(self._names, [self._paths[n] for n in self._names]) if nested else None
        )
        self._batch = (self._names, self._nesting, output != "dict")  # what samples are made of
        # index_select checks the bounds itself: see _gather
        self._torch_bounds = bool(columns) and all(
            type(c).gather is TensorColumn.gather for c in columns.values()
        )

    # -- what users read -------------------------------------------------------------
    @property
    def columns(self) -> list[str]:
        """Column names, in sample order."""
        return list(self._names)

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory."""
        return sum(c.nbytes for c in self._columns.values())

    @property
    def specs(self) -> dict[str, ColumnSpec]:
        """Each column's spec (dtype, row shape, kind)."""
        return {n: c.spec for n, c in self._columns.items()}

    def __len__(self) -> int:
        return self._len

    def segment_identity(self) -> frozenset[tuple[int, int]]:
        """The (device, inode) of every shared segment mapped: equal for one copy."""
        return frozenset(
            array.segment.handle()[2]
            for column in self._columns.values()
            for array in column.arrays.values()
        )

    def __repr__(self) -> str:
        if self.closed:
            return f"{type(self).__name__}(rows={self._len}, closed)"
        cols = ", ".join(f"{n}: {c.spec.describe()}" for n, c in self._columns.items())
        size = format_bytes(self.nbytes)
        return f"{type(self).__name__}(rows={self._len}, {size}, columns={{{cols}}})"

    # -- indexing ----------------------------------------------------------------------
    def _pack(self, values: Sequence[Any]) -> Any:
        if self._nesting is not None:
            item = rebuild(self._nesting, values)
            return item if self.output == "dict" else tuple(item.values())
        return dict(zip(self._names, values)) if self.output == "dict" else tuple(values)

    def _indices(self, indices: Any, check: bool = True) -> torch.Tensor:
        """``indices`` as a flat int64 tensor in ``[0, len)`` (:func:`_indexing.index_tensor`)."""
        return index_tensor(indices, self._len, type(self).__name__, check)

    def __getitem__(self, index: Any) -> Any:
        """One sample for an int; for indices, the default collate of their samples.

        Note [A batch by index] in ``_indexing.py``.
        """
        if is_int(index):
            i, n = int(index), self._len
            if not -n <= i < n:
                raise out_of_range(i, n, type(self).__name__)
            i = i + n if i < 0 else i
            sample = self._pack([c.get(i) for c in self._columns.values()])
            return sample if self.transform is None else self.transform(sample)
        shape = index_shape(index)
        if shape is None:
            if self.transform is not None:
                idx = self._indices(index)
                if len(idx):
                    return lenient_collate(self.__getitems__(idx.tolist()))
            else:
                shared = get_worker_info() is not None  # leaving a worker: in shared memory
                idx, batched = self._gather(index, shared)
                names, nesting, tuples = self._batch
                if len(idx):  # each column's batch as gathered, the others collated
                    values, stacked, _, _ = self._leaves(batched)
                    return collate_columns(names, values, stacked, nesting, tuples, lenient=True)
                if type(self)._pack is ColumnDataset._pack:
                    # no row: each column as gathered, 0 rows or no value
                    if tuples and nesting is None:  # as the default collate: tuples of text
                        text = [c.kind in ("str", "bytes") for c in self._columns.values()]
                        batched = [() if t else b for b, t in zip(batched, text)]
                    return collate_columns(names, batched, [True] * len(names), nesting, tuples)
            shape = (0,)
        return rows_by_index(self.__getitems__, self._indices(index), shape, self._len)

    def _gather(self, indices: Any, shared: bool) -> tuple[torch.Tensor, list[Any]]:
        """The checked indices and each column's gathered batch.

        Where ``index_select`` gathers every column it checks the bounds itself
        (negatives included); only if it raises are the indices checked here and
        gathered again: no separate pass over the indices per batch.
        """
        if self._torch_bounds:
            idx = self._indices(indices, check=False)
            try:
                return idx, self._gather_checked(idx, shared)
            except IndexError:
                pass
        idx = self._indices(indices)
        return idx, self._gather_checked(idx, shared)

    def _gather_checked(self, idx: torch.Tensor, shared: bool) -> list[Any]:
        columns = list(self._columns.values())
        if not shared:
            return [c.gather(idx) for c in columns]
        # Leaving a worker: every numeric column of the batch (fixed-shape and ragged)
        # in one memfd (Note [How a batch leaves a worker] in crossing/_transport.py).
        plans = [c.gather_plan(idx) for c in columns]
        outs = iter(worker_buffers([p for ps, _ in plans for p in ps]))
        return [fill([next(outs) for _ in ps]) for ps, fill in plans]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples ``indices``, gathering each column once (what the DataLoader calls).

        Without a ``transform`` the default collate takes each column's batch as
        gathered (Note [The default collate's shortcut] in ``crossing/_collate.py``);
        in a worker the batch is gathered into shared memory, as it leaves.
        """
        idx, batched = self._gather(indices, get_worker_info() is not None)
        if self.transform is None:
            names, nesting, tuples = self._batch
            values, stacked, splits, firsts = self._leaves(batched)
            return Samples(
                names, values, stacked, splits, len(idx), nesting, tuples, firsts, self._portable
            )
        values = [c.split(b) for c, b in zip(self._columns.values(), batched)]
        rows = zip(*values) if values else [[]] * len(idx)
        return [self.transform(self._pack(row)) for row in rows]

    _portable = False  # True: the splits are module-level functions, pickled with Samples

    def _leaves(self, batched: list[Any]) -> Leaves:
        """What a gathered batch's samples are made of (``SharedDataset``: its leaves)."""
        stacked = [isinstance(b, torch.Tensor) for b in batched]
        return batched, stacked, [c.split for c in self._columns.values()], None

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._len):
            yield self[i]

    # -- pickling: handles, never data -------------------------------------------------
    _pickled: tuple[str, ...] = ()  # a subclass's own attributes that travel too

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self._pickled}
        return {**state, "columns": self._columns, "transform": self.transform,
                "output": self.output, "nested": self.nested, "paths": self._paths}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in self._pickled:
            setattr(self, k, state[k])
        ColumnDataset.__init__(
            self, state["columns"], transform=state["transform"], output=state["output"],
            nested=state["nested"], paths=state["paths"],
        )  # fmt: skip
