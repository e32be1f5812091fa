"""The common Dataset over shared columns.

Data flows one way: a source (``sources/``) sizes its columns -> :func:`_load.build`
allocates every buffer in shared memory and lets the source fill it -> the columns
(``_columns.py``) index it -> :class:`ColumnDataset` serves samples and batches, and
pickles into workers as handles (``_storage/``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .._text import format_bytes
from ..columns._columns import Column, ColumnSpec, TensorColumn
from ..columns._items import nest_paths, rebuild
from ..crossing._collate import Samples, collate_columns
from ..crossing._transport import worker_buffers
from ..errors import ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError
from ._indexing import index_shape, index_tensor, lenient_collate, rows_by_index
from ._load import Source, check_lengths

__all__ = ["ColumnDataset", "Source"]

Output = Literal["dict", "tuple"]


class BatchValues(NamedTuple):
    """What the samples of a gathered batch are made of (the arguments of :class:`Samples`).

    A :class:`ColumnDataset`'s values are its columns; a ``SharedDataset``'s are its
    items' leaves (a ragged leaf is two columns).
    """

    names: list[Any]
    batched: list[Any]
    stacked: list[bool]
    splits: list[Callable[[Any], Any]]
    firsts: list[Callable[[Any], Any] | None] | None
    nesting: Any
    tuples: bool
    portable: bool = False

    def samples(self, n: int) -> Samples:
        """The :class:`Samples` of ``n`` rows, made when first used."""
        return Samples(
            self.names, self.batched, self.stacked, self.splits, n, self.nesting,
            self.tuples, self.firsts, self.portable,
        )  # fmt: skip

    def collated(self) -> Any:
        """The batch ``default_collate`` makes of the samples.

        A column it cannot collate (rows of varying length) stays the list of its rows.
        """
        return collate_columns(
            self.names, self.batched, self.stacked, self.nesting, self.tuples, lenient=True
        )


def is_int(index: Any) -> bool:
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return True
    return (
        isinstance(index, (torch.Tensor, np.ndarray))
        and index.ndim == 0
        and (
            not index.dtype.is_floating_point
            if isinstance(index, torch.Tensor)
            else np.issubdtype(index.dtype, np.integer)
        )
    )


class Closed:
    """What a closed dataset holds instead of its columns: every use is refused by name.

    ``len()`` still answers; indexing, batches, pickling (a DataLoader's workers) and
    sizes raise :class:`~shareddata.InvalidArgumentError` (a ``ValueError``, as a
    closed file's methods do).
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
        """Let go of the shared memory now; any later use of the dataset is refused.

        The memory is freed once nothing else holds it: samples and batches already
        taken stay valid, and so do DataLoader workers already started (each holds
        the memory itself). Idempotent. ``with`` closes the dataset at the block's end.

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
    """A map-style Dataset over columns in shared memory.

    Subclasses (one per source format) only build the columns; everything a
    user indexes, batches and pickles is here.

    Args:
        columns: the columns by name (all of one length), or a function that loads
            them: every other argument is checked first, so a bad one is refused
            before anything is loaded.
        transform: applied to each sample, in the worker, after indexing.
        output: ``"dict"`` for ``{column: value}`` samples, ``"tuple"`` for values in
            column order (what ``TensorDataset`` users unpack as ``x, y``).
        nested: give each column's value at its key path in ``paths`` (``{"s": {"a":
            ...}}``) instead of under its flat name (Note [Nested items] in
            ``columns/_items.py``); with ``output="tuple"``, the top-level values in order.
        paths: each column's key path (default: its name alone); used with ``nested``.

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
        # index_select checks bounds itself (IndexError, negatives included): when it
        # gathers every column, _gather skips the separate check (Note in _gather).
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
        """The (device, inode) of every shared segment this dataset maps.

        Two datasets with equal identities hold one copy of the data (e.g. two local
        ranks of a node, one attached to the other's columns).
        """
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

    def _check_index(self, index: Any) -> int:
        i = int(index)
        n = self._len
        if not -n <= i < n:
            raise IndexOutOfRangeError(
                f"index {i} is out of range for {type(self).__name__} of {n} rows"
            )
        return i + n if i < 0 else i

    def _indices(self, indices: Any, check: bool = True) -> torch.Tensor:
        """``indices`` as a flat int64 tensor in ``[0, len)`` (:func:`_indexing.index_tensor`)."""
        return index_tensor(indices, self._len, type(self).__name__, check)

    def __getitem__(self, index: Any) -> Any:
        """One sample for an int; a batch (values stacked per field) for indices.

        ``ds[[3, 1, 4]]``, ``ds[2:10]``, ``ds[tensor]`` gather every column once and
        return the batch the default collate makes of those samples (same containers,
        same values; ``collate_columns`` in ``_batch.py`` is the one place that says
        how), except that a field it cannot collate (rows of different lengths)
        stays the list of its rows. A ``transform`` is applied per sample, then the
        samples are collated. No row (``ds[[]]``) gives an empty batch of the same
        structure, an n-D index a batch laid out in its shape, as numpy does (Note [A
        batch by index] in ``_indexing.py``).
        """
        if is_int(index):
            i = self._check_index(index)
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
                if len(idx):  # each column's batch as gathered, the others collated
                    return self._values(batched).collated()
                if type(self)._pack is ColumnDataset._pack:
                    # no row: each column as gathered, 0 rows or no value
                    names, nesting, tuples = self._names, self._nesting, self.output != "dict"
                    if tuples and nesting is None:  # as the default collate: tuples of text
                        text = [c.kind in ("str", "bytes") for c in self._columns.values()]
                        batched = [() if t else b for b, t in zip(batched, text)]
                    return collate_columns(names, batched, [True] * len(names), nesting, tuples)
            shape = (0,)
        return rows_by_index(self.__getitems__, self._indices(index), shape, self._len)

    def _gather(self, indices: Any, shared: bool) -> tuple[torch.Tensor, list[Any]]:
        """The checked indices and each column's gathered batch.

        Where ``index_select`` gathers every column, it is trusted with the bounds:
        it raises ``IndexError`` for any index outside ``[0, len)``, negatives
        included, before anything is returned. Only then are the indices checked
        here (which wraps negatives, or names the bad index), and the batch gathered
        again. That saves a separate pass over the indices on every batch.
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
        parts = [c.batch_parts(idx) for c in columns]
        outs = iter(worker_buffers([p for ps in parts for p in ps]))
        return [c.gather_into(idx, [next(outs) for _ in ps]) for c, ps in zip(columns, parts)]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples ``indices``, gathering each column once (what the DataLoader calls).

        The default collate gives the same batch as fetching each sample alone,
        and without a ``transform`` it takes each column's batch as gathered, with no
        second copy (Note [The default collate's shortcut] in ``crossing/_collate.py``).
        """
        # In a worker the gathered batch is built in shared memory: it is the batch
        # that travels to the main process (and a private temporary per batch would
        # grow the worker's heap by several MiB, which glibc keeps).
        shared = get_worker_info() is not None
        idx, batched = self._gather(indices, shared)
        if self.transform is None:
            return self._values(batched).samples(len(idx))
        values = [c.split(b) for c, b in zip(self._columns.values(), batched)]
        if values:
            samples = [self._pack(row) for row in zip(*values)]
        else:
            samples = [self._pack([]) for _ in range(len(idx))]
        if self.transform is not None:
            samples = [self.transform(s) for s in samples]
        return samples

    def _values(self, batched: list[Any]) -> BatchValues:
        """What the samples of a gathered batch (each column's batch) are made of.

        Subclasses whose samples are not their columns (``SharedDataset``) say it here,
        so that ``__getitems__`` and ``ds[indices]`` take the same shortcut for them.
        """
        stacked = [isinstance(b, torch.Tensor) for b in batched]
        splits: list[Callable[[Any], Any]] = [c.split for c in self._columns.values()]
        tuples = self.output != "dict"
        return BatchValues(self._names, batched, stacked, splits, None, self._nesting, tuples)

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._len):
            yield self[i]

    # -- pickling: handles, never data -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "columns": self._columns,
            "transform": self.transform,
            "output": self.output,
            "nested": self.nested,
            "paths": self._paths,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        ColumnDataset.__init__(
            self,
            state["columns"],
            transform=state["transform"],
            output=state["output"],
            nested=state.get("nested", False),
            paths=state.get("paths"),
        )
