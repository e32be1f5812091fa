"""Shared files written with ``pwrite``: :class:`VarStore` grows as values come."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable
from itertools import accumulate, islice
from typing import Any

import numpy as np

from .._text import format_bytes
from ..errors import SharedMemoryFullError
from ._array import SharedArray, aligned
from ._capacity import (
    FULL_ERRNOS,
    available_memory,
    check_capacity,
    named_os_errors,
    resolve_storage_dir,
)
from ._linux import anonymous_file
from ._segment import Segment

# Note [Variable-length values go to shared memory as they come]
# ===============================================================
# A variable-length leaf's size is known only once every item is read, so its values
# go to an anonymous file of its own (:class:`VarStore`) that grows by ``pwritev``
# from at most 4 MiB of pending views. Room is checked as it grows, up to 64 MiB
# ahead (Note [A load is refused, never killed]); a full memory during a write is
# SharedMemoryFullError too, and nothing is written through a mapping (no SIGBUS). At
# the end the file is cut to the data and becomes the column's segment (no copy;
# sealed by the loader). Offsets and shapes stay private until then. A failure
# closes the file (``discard``).

_VAR_BUFFER_BYTES = 4 << 20  # pending variable-length bytes before a pwritev
_VAR_STEP_BYTES = 64 << 20  # a store's capacity is checked this much at a time
_IOV_MAX = 1024  # buffers per pwritev


class VarStore:
    """One variable-length leaf's values, written as they come.

    Note [Variable-length values go to shared memory as they come].
    """

    def __init__(self, dtype: Any, storage_dir: Any, what: str) -> None:
        self.dtype = np.dtype(dtype)
        self.directory = resolve_storage_dir(storage_dir)
        self.what = what
        self.offsets = array("q", [0])  # private: 8 bytes per row
        self.shapes: list[tuple[int, ...]] = []
        self.fd = -1
        self.written = 0  # bytes in the file
        self.checked = 0  # bytes the capacity was checked for
        self._pending: list[memoryview] = []
        self._pending_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of values added so far (written or pending)."""
        return self.written + self._pending_bytes

    def add(self, data: Any, shape: tuple[int, ...] = ()) -> None:
        """Append one row: ``data`` is a C-contiguous buffer of its values."""
        self._queue(data)
        self.offsets.append(self.nbytes // self.dtype.itemsize)
        self.shapes.append(shape)

    def extend(self, data: Any, lengths: Iterable[int]) -> None:
        """Append rows whose values, concatenated, are ``data``; ``lengths`` in elements."""
        self._queue(data)
        self.offsets.extend(islice(accumulate(lengths, initial=self.offsets[-1]), 1, None))

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the values, read back into a private array."""
        self.flush()
        size = self.dtype.itemsize
        data = os.pread(self.fd, (stop - start) * size, start * size) if stop > start else b""
        return np.frombuffer(data, self.dtype)

    def _queue(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._pending.append(view)
            self._pending_bytes += view.nbytes
        if self._pending_bytes >= _VAR_BUFFER_BYTES or len(self._pending) >= _IOV_MAX:
            self.flush()

    def flush(self) -> None:
        """Write the pending values into the file (growing it, capacity checked)."""
        if self.fd < 0:
            self._open()
        if not self._pending:
            return
        end = self.written + self._pending_bytes
        if end > self.checked:
            with named_os_errors(self.what):
                self._grow(end)
        views, self._pending, self._pending_bytes = self._pending, [], 0
        try:
            done = os.pwritev(self.fd, views, self.written)
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise
            done = 0
        offset = self.written + done
        for view in views:  # a short write (or a full memory): the rest, one by one
            if done >= view.nbytes:
                done -= view.nbytes
                continue
            pwrite_all(self.fd, view[done:], offset, end, self.directory, self.what)
            offset += view.nbytes - done
            done = 0
        self.written = end

    def _open(self) -> None:
        with named_os_errors(self.what):
            self.fd = anonymous_file(self.directory)

    def _grow(self, end: int) -> None:
        """Check room to grow to ``end`` bytes; where more is free, a step ahead."""
        need = end - self.checked
        what = (
            f"{self.what} (after {len(self.offsets) - 1} items, "
            f"{format_bytes(self.written)} stored so far; the values that follow)"
        )
        left = check_capacity(need, self.directory, what)
        self.checked += need + min(max(_VAR_STEP_BYTES - need, 0), left)

    def finish(self) -> tuple[Segment, int]:
        """Hand the file over, trimmed, as the caller's segment: ``(segment, elements)``."""
        self.flush()
        fd, self.fd = self.fd, -1
        try:
            segment = Segment.adopt(fd, self.written, self.what)
        except BaseException:
            os.close(fd)
            raise
        return segment, self.written // self.dtype.itemsize

    def finish_with_offsets(self) -> tuple[SharedArray, SharedArray]:
        """``(values, offsets)`` in one segment: the int64 offsets written after the values."""
        self.flush()
        count = self.written // self.dtype.itemsize
        start = aligned(self.written)
        offsets = np.frombuffer(self.offsets, np.int64)
        self._queue(bytes(start - self.written))
        self._queue(offsets)
        self.flush()
        segment, _ = self.finish()
        values = SharedArray(segment, 0, (count,), self.dtype)
        return values, SharedArray(segment, start, offsets.shape, np.int64)

    def discard(self) -> None:
        """Free the file now (a failed load)."""
        self._pending, self._pending_bytes = [], 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pwrite_all(
    fd: int, view: memoryview, offset: int, size: int, directory: str | None, what: str
) -> None:
    """``pwrite`` all of ``view`` at ``offset``; a full memory is SharedMemoryFullError."""
    while view:
        try:
            written = os.pwrite(fd, view, offset)
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise
            where = f"storage_dir={directory!r}" if directory else "RAM"
            raise SharedMemoryFullError(
                f"{what} ran out of room in {where} at byte {offset} of {size} "
                f"({os.strerror(e.errno)}; {format_bytes(available_memory(directory))} "
                "free now): "
                "something else took the memory while the dataset was read. Nothing is "
                "kept. Fix: free memory or disk space, or pass storage_dir='/path' on a "
                "local disk."
            ) from e
        view = view[written:]
        offset += written
