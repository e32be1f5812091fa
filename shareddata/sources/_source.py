"""What a source is: it sizes its columns, then fills the buffers it is given.

Every format module of this package implements :class:`Source`; the loader
(``shareddata/datasets/_load.py``) allocates, and hands the source :class:`Buffer` s
to fill. Sharing, indexing and pickling are not a source's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..columns._columns import ColumnSpec
from ..storage import ready

__all__ = ["Buffer", "Source", "as_buffer"]


class Buffer(np.ndarray):
    """A shared buffer a source fills: write only through :meth:`rows`.

    An ``ndarray`` subclass, so code that indexes it like an array keeps working;
    :meth:`rows` is the sink: it returns a plain writable view once the pages under
    it are allocated (the loader allocates them in background threads while the
    source fills the first ones: Note [Filling while the pages are allocated] in
    ``storage/_pages.py``).

    Example:
        >>> buf = np.zeros((4, 2), np.int64).view(Buffer)
        >>> buf.rows(1, 3)[...] = 7
        >>> buf.tolist()
        [[0, 0], [7, 7], [7, 7], [0, 0]]
    """

    def rows(self, start: int, stop: int) -> np.ndarray:
        """A writable view of elements ``[start, stop)`` along the first axis, pages ready.

        Raises:
            SharedMemoryFullError: a page under the view could not be allocated.
        """
        view = self.view(np.ndarray)[start:stop]
        if view.size:
            ready(view)
        return view


def as_buffer(array: np.ndarray) -> Buffer:
    """``array`` (a view of shared pages) as a :class:`Buffer`."""
    return array.view(Buffer)


class Source(Protocol):
    """What a format module implements: size the columns, then fill given buffers.

    Sharing, indexing and pickling are not a source's business; see :func:`build`.

    Optional: ``select_rows(start, stop)``; from then on ``specs()`` and ``read()``
    describe and fill only rows ``[start, stop)`` (what ``shard="node"`` needs), and
    ``total_rows()``, the rows before any selection (default: from ``specs()``).
    """

    label: str
    """The file (or object) the data comes from, for messages."""

    def specs(self) -> list[ColumnSpec]:
        """Describe every selected column, with exact sizes, before any allocation."""
        ...

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Any], progress: Callable[[int], None]
    ) -> None:
        """Fill ``buffers``: :class:`Buffer` s laid out as ``COLUMN_KINDS[spec.kind].layout(spec)``.

        Write only through ``buffer.rows(start, stop)``; call ``progress(nbytes)`` as
        data arrives.
        """
        ...

    def close(self) -> None:
        """Release file handles (called after loading, also on error)."""
        ...
