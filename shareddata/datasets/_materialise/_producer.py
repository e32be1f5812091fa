"""What ``SharedDataset`` hands the loader: :class:`DatasetProducer` over :func:`build_columns`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...columns._items import LeafType
from ...errors import InvalidArgumentError
from ...storage._capacity import private_peak
from .._load import Allocator, Part, progress_bar
from ._blocks import fetch
from ._builder import Builder

__all__ = ["DatasetProducer", "build_columns"]


def build_columns(
    dataset: Any,
    rows: int,
    alloc: Allocator,
    update: Callable[[int], None],
    workers: int = 0,
    offset: int = 0,
) -> tuple[list[Part], list[LeafType], Any]:
    """Materialise items ``offset .. offset + rows - 1`` of ``dataset`` into shared columns.

    Args:
        dataset: a map-style dataset.
        rows: how many items (``>= 1``).
        alloc: where the segments come from (the load frees them on failure).
        update: called with the number of items added, as they are.
        workers: read the items with a DataLoader of this many workers (0: here).
        offset: the index of the first item (a node's shard starts there).

    Returns:
        The columns' parts (by name, in leaf order), each leaf's type (for
        :func:`restore`; a ragged leaf's ``.shape`` column follows its values), and
        the schema (for :func:`rebuild`).

    Raises:
        ItemMismatchError: an item whose structure or types differ from item 0's.
        ItemValueError: a value its column cannot hold.

    If anything fails, the writer is stopped and the segments freed before the
    error propagates.
    """
    builder: Builder | None = None
    try:
        builder = Builder(fetch(dataset, offset), rows, alloc, workers)
        with private_peak(builder.outstanding):  # Note [A load is refused, never killed]
            builder.allocate()
            if workers > 0:
                builder.run_workers(dataset, workers, update, offset)
            else:
                items = ((i, fetch(dataset, i)) for i in range(offset, offset + rows))
                builder.run(items, update)
            parts, kinds = builder.finish()
    except BaseException:
        # Free the columns now, although the traceback still refers to them:
        # Note [Freeing a failed load] in storage/_segment.py.
        if builder is not None:
            builder.discard()
        raise
    return parts, kinds, builder.schema


class DatasetProducer:
    """What ``SharedDataset`` hands the loader: the items of a map-style dataset.

    A :class:`~shareddata.datasets._load.Producer`: the sizes of variable-length fields are
    known only once every item is read, so it asks the loader for segments as it goes.
    """

    def __init__(self, dataset: Any, num_workers: int) -> None:
        self.dataset = dataset
        self.num_workers = num_workers
        self.label = type(dataset).__name__
        self.start, self.stop = 0, len(dataset)

    def total_rows(self) -> int:
        """Items of the whole dataset."""
        return len(self.dataset)

    def select_rows(self, start: int, stop: int) -> None:
        """Materialise only items ``[start, stop)`` (``shard="node"``)."""
        self.start, self.stop = start, stop

    def produce(self, alloc: Allocator, progress: bool) -> tuple[list[Part], Any]:
        """The columns' parts and ``(kinds, schema)``, the metadata ``SharedDataset`` needs."""
        rows = self.stop - self.start
        if rows == 0:
            raise InvalidArgumentError(
                f"this node's share of {self.label} (items {self.start}-{self.stop} of "
                f"{self.total_rows()}) is empty: there is nothing to share. Use shard=None, or "
                "fewer nodes than items."
            )
        with progress_bar(rows, f"materialising {self.label}", progress, unit="it") as update:
            parts, kinds, schema = build_columns(
                self.dataset, rows, alloc, update, self.num_workers, self.start
            )
        return parts, (kinds, schema)

    def close(self) -> None:
        """Nothing to release: the dataset belongs to the caller."""
