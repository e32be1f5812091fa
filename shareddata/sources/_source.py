"""What a source is: it sizes its columns, then fills the buffers the loader allocates.

Sharing, indexing and pickling are not a source's business (``datasets/_load.py``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..columns._columns import ColumnSpec
from ..errors import ArgumentTypeError, EmptySelectionError, MissingColumnError
from ..storage import ready

__all__ = ["Buffer", "Source", "as_buffer", "select_columns"]


class Buffer(np.ndarray):
    """A shared buffer a source fills, only through :meth:`rows`.

    :meth:`rows` gives a writable view once the pages under it are allocated (Note
    [Filling while the pages are allocated] in ``storage/_pages.py``).

    Example:
        >>> buf = np.zeros((4, 2), np.int64).view(Buffer)
        >>> buf.rows(1, 3)[...] = 7
        >>> buf.tolist()
        [[0, 0], [7, 7], [7, 7], [0, 0]]
    """

    def rows(self, start: int, stop: int) -> np.ndarray:
        """A writable view of rows ``[start, stop)``, pages ready (or SharedMemoryFullError)."""
        view = self.view(np.ndarray)[start:stop]
        if view.size:
            ready(view)
        return view


def as_buffer(array: np.ndarray) -> Buffer:
    """``array`` (a view of shared pages) as a :class:`Buffer`."""
    return array.view(Buffer)


class Source(Protocol):
    """What a format module implements: size the columns, then fill given buffers.

    Optional: ``select_rows(start, stop)`` (then ``specs()`` and ``read()`` cover only
    those rows: ``shard="node"``) and ``total_rows()`` (the rows before any selection).
    """

    label: str  # the file (or object) the data comes from, for messages

    def specs(self) -> list[ColumnSpec]:
        """Describe every selected column, with exact sizes, before any allocation."""
        ...

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Any], progress: Callable[[int], None]
    ) -> None:
        """Fill ``buffers`` (``COLUMN_KINDS[spec.kind].layout(spec)``); ``progress(nbytes)``."""
        ...

    def close(self) -> None:
        """Release file handles (called after loading, also on error)."""
        ...


def select_columns(
    available: Sequence[str], columns: Any, label: str, groups: Mapping[str, list[str]] = {}
) -> list[str]:
    """The ``columns`` selected (None: all) of ``available``, in order; a group selects its own."""
    listed = ", ".join(repr(n) for n in available) or "no columns"
    if columns is None:
        wanted = list(available)
    else:
        if not isinstance(columns, (str, Iterable)):
            raise ArgumentTypeError(
                f"columns={reprlib.repr(columns)} (type {type(columns).__name__}) for {label} is "
                "not a column name or a list of names; pass one of those, or columns=None for all."
            )
        wanted = [columns] if isinstance(columns, str) else list(columns)
        wanted = [n for c in wanted for n in ([c] if c in available else groups.get(c, [c]))]
        missing = [c for c in wanted if c not in available]
        if missing:
            raise MissingColumnError(f"column {missing[0]!r} is not in {label}; it has: {listed}.")
    if not wanted:
        what = "columns=[] selects no column of" if available else "no column to load:"
        raise EmptySelectionError(
            f"{what} {label}{'' if available else ' holds no columns'}, so the dataset would "
            f"have no rows and a training loop over it no batches; it has: {listed}. Pass the "
            "columns to load (or columns=None for all of them)."
        )
    clash = [n for n in wanted if list(available).count(n) > 1]
    if clash:
        raise MissingColumnError(
            f"column name {clash[0]!r} appears more than once in {label}, so it does not name "
            "one column; rename the columns (table.rename_columns) or select others."
        )
    return wanted
