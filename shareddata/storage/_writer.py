"""Shared files written with ``pwrite``: one that grows as values come, and the helpers.

Variable-length values are written to a shared file each (:class:`VarStore`) as they
come; :func:`pwrite_all` and :func:`map_written` are what any writer of a segment's
file uses (``datasets/_materialise/_writer.py`` writes blocks of fixed-size rows).
"""

from __future__ import annotations

import errno
import os
import secrets
from array import array
from collections.abc import Iterable
from itertools import accumulate, islice
from typing import Any

import numpy as np

from .._text import format_bytes
from ..errors import (
    SharedMemoryFullError,
)
from ._array import SharedArray, aligned
from ._capacity import available_memory, check_capacity, named_os_errors, resolve_storage_dir
from ._linux import MADV_POPULATE_READ, anonymous_file, madvise
from ._segment import Segment

__all__ = ["FULL_ERRNOS", "VarStore", "map_written", "pwrite_all"]


# -- variable-length leaves ----------------------------------------------------------------


# Note [Variable-length values go to shared memory as they come]
# ===============================================================
# The size of a variable-length leaf (str, bytes, lists of numbers, arrays whose
# shape varies, pickled objects) is known only once every item is read. Its values
# are not collected privately: each leaf has a :class:`VarStore`, an anonymous file
# of its own (a memfd, or ``O_TMPFILE`` in ``storage_dir``) that grows as values are
# ``pwrite``-n (``pwritev``) to its end, from a private buffer of at most
# ``_VAR_BUFFER_BYTES`` (4 MiB) of pending values (views of the items' own buffers,
# not copies). So private memory stays bounded whatever the dataset's size:
#
# * Room is checked as the file grows, up to ``_VAR_STEP_BYTES`` (64 MiB) at a time:
#   when the values about to be written do not fit in what ``check_capacity`` says
#   is free (RAM and the memory cgroup with the load's private peak and a margin, or
#   the file system of ``storage_dir``: Note [A load is refused, never killed]),
#   SharedMemoryFullError names the field, the bytes already stored, the bytes to
#   write and what is free, and the fix, before they are written (a few KiB of
#   strings fit in a few KiB of room: the step is only how far one check reaches).
#   A full memory during a ``pwrite`` (something else took it meanwhile) is
#   ENOSPC/ENOMEM, raised as SharedMemoryFullError too;
#   nothing is written through a mapping, so no SIGBUS is possible.
# * At the end the file becomes the column's segment as it is: it is cut to the
#   data (``ftruncate``), mapped, and its pages mapped here (``MADV_POPULATE_READ``),
#   as the fixed-size writer does; the loader then seals it (Note [Sealed segments]
#   in ``_segment.py``). No copy.
# * The offsets (8 bytes per row) and, for ragged arrays, the shapes (8 bytes per
#   dimension per row) stay private until the end, then are copied into one small
#   segment: they grow with the number of rows, not with the size of the values.
# * On a failure the files are closed (``discard``): nothing is left behind.
# * Private memory is then the pending buffer plus the offsets, whatever the size of
#   the values, and nothing is copied at the end (``tests/test_wrap.py`` bounds the
#   growth; the figures are in ``benchmarks/results/wrap.md``).
# * The builder hands values over every ``chunk`` rows; the chunk shrinks when the
#   variable-length values of a chunk pass ``_BLOCK_BYTES``, so the items held in
#   the sinks stay bounded too (``Builder._flush`` in ``_materialise/_builder.py``).

_VAR_BUFFER_BYTES = 4 << 20  # pending variable-length bytes before a pwritev
_VAR_STEP_BYTES = 64 << 20  # a store's capacity is checked this much at a time
_IOV_MAX = 1024  # buffers per pwritev


class VarStore:
    """The values of one variable-length leaf, written to a growing shared file as they come.

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
            with named_os_errors(self.what):  # reading the room takes a descriptor
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
        with named_os_errors(self.what):  # no descriptor left: named
            self.fd = anonymous_file(self.directory)

    def _grow(self, end: int) -> None:
        """Check room for the file to grow to ``end`` bytes (and up to a step more).

        Only what is about to be written must fit: a small store fits in little room,
        and where more is free the check covers a whole step ahead.
        """
        need = end - self.checked
        what = (
            f"{self.what} (after {len(self.offsets) - 1} items, "
            f"{format_bytes(self.written)} stored so far; the values that follow)"
        )
        left = check_capacity(need, self.directory, what)  # Note [A load is refused, ...]
        self.checked += need + min(max(_VAR_STEP_BYTES - need, 0), left)

    def finish(self) -> tuple[Segment, int]:
        """Hand the file over as a segment (no copy): ``(segment, elements)``.

        The tail left by growth is trimmed. The caller owns the segment from now on.
        """
        self.flush()
        size = max(self.written, 1)
        os.ftruncate(self.fd, size)
        segment = Segment(self.fd, size, secrets.token_hex(8))  # closes fd when dropped
        segment.created_here = True
        self.fd = -1
        map_written(segment.address, self.written)
        return segment, self.written // self.dtype.itemsize

    def finish_with_offsets(self) -> tuple[SharedArray, SharedArray]:
        """Hand the file over with the offsets after the values: ``(values, offsets)``.

        One segment, so one descriptor, for a whole column (``SharedList``): the
        offsets (int64, rows + 1) are written past the values, aligned, as the
        values were, capacity checked.
        """
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


def map_written(address: int, nbytes: int) -> None:
    """Map written pages into this process (``MADV_POPULATE_READ``), as the writer does."""
    if nbytes:
        start = address // _PAGE * _PAGE
        madvise(start, address + nbytes - start, MADV_POPULATE_READ)


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


_PAGE = os.sysconf("SC_PAGE_SIZE")
FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
