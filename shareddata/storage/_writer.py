"""Where materialised rows go: growing shared files, and a writer thread for fixed-size rows.

Variable-length leaves are written to a shared file each (:class:`VarStore`) as they
come; blocks of fixed-size rows are ``pwrite``-n into their shared segment by
:class:`Writer`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import queue
import secrets
import threading
from array import array
from collections.abc import Iterable
from itertools import accumulate, islice
from typing import Any

import numpy as np
import torch

from .._text import format_bytes
from ..columns._items import Leaf, host_numpy
from ..errors import (
    SharedMemoryFullError,
)
from . import Segment, SharedArray
from ._capacity import available_memory, full_error, resolve_storage_dir
from ._handoff import file_size
from ._linux import address_of, open_tmpfile

__all__ = ["BlockWriter", "VarStore", "Writer", "chunk_rows"]


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
#   when the values about to be written do not fit in what ``available_memory`` says
#   is free (RAM and the memory cgroup, or the file system of ``storage_dir``),
#   SharedMemoryFullError names the field, the bytes already stored, the bytes to
#   write and what is free, and the fix, before they are written (a few KiB of
#   strings fit in a few KiB of room: the step is only how far one check reaches).
#   A full memory during a ``pwrite`` (something else took it meanwhile) is
#   ENOSPC/ENOMEM, raised as SharedMemoryFullError too;
#   nothing is written through a mapping, so no SIGBUS is possible.
# * At the end the file becomes the column's segment as it is: it is cut to the
#   data plus the acknowledgement slots of ``_handoff.file_size`` (``ftruncate``),
#   mapped, and its pages mapped here (``MADV_POPULATE_READ``), as the fixed-size
#   writer does. No copy.
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
            self._grow(end)
        views, self._pending, self._pending_bytes = self._pending, [], 0
        try:
            done = os.pwritev(self.fd, views, self.written)
        except OSError as e:
            if e.errno not in _FULL_ERRNOS:
                raise
            done = 0
        offset = self.written + done
        for view in views:  # a short write (or a full memory): the rest, one by one
            if done >= view.nbytes:
                done -= view.nbytes
                continue
            _pwrite_all(self.fd, view[done:], offset, end, self.directory, self.what)
            offset += view.nbytes - done
            done = 0
        self.written = end

    def _open(self) -> None:
        if self.directory is None:
            self.fd = os.memfd_create("shareddata", os.MFD_CLOEXEC)
        else:
            self.fd = open_tmpfile(self.directory)

    def _grow(self, end: int) -> None:
        """Check room for the file to grow to ``end`` bytes (and up to a step more).

        Only what is about to be written must fit: a small store fits in little room,
        and where more is free the check covers a whole step ahead.
        """
        need = end - self.checked
        free = available_memory(self.directory)
        if need > free:
            what = (
                f"{self.what} (after {len(self.offsets) - 1} items, "
                f"{format_bytes(self.written)} stored so far; the values that follow)"
            )
            raise full_error(need, free, self.directory, what)
        self.checked += min(max(_VAR_STEP_BYTES, need), free)

    def finish(self) -> tuple[Segment, int]:
        """Hand the file over as a segment (no copy): ``(segment, elements)``.

        The tail left by growth is trimmed; the acknowledgement slots of
        ``_handoff.file_size`` follow the data. The caller owns the segment from now on.
        """
        self.flush()
        size = max(self.written, 1)
        os.ftruncate(self.fd, file_size(size))
        segment = Segment(self.fd, size, secrets.token_hex(8))  # closes fd when dropped
        segment.created_here = True
        self.fd = -1
        _map_here(address_of(segment.mmap), self.written)
        return segment, self.written // self.dtype.itemsize

    def discard(self) -> None:
        """Free the file now (a failed load)."""
        self._pending, self._pending_bytes = [], 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map_here(address: int, nbytes: int) -> None:
    """Map written pages into this process (``MADV_POPULATE_READ``), as the writer does."""
    if nbytes:
        start = address // _PAGE * _PAGE
        _madvise()(start, address + nbytes - start, _MADV_POPULATE_READ)


def _pwrite_all(
    fd: int, view: memoryview, offset: int, size: int, directory: str | None, what: str
) -> None:
    """``pwrite`` all of ``view`` at ``offset``; a full memory is SharedMemoryFullError."""
    while view:
        try:
            written = os.pwrite(fd, view, offset)
        except OSError as e:
            if e.errno not in _FULL_ERRNOS:
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


# -- fixed-size leaves: written from a background thread ------------------------------------

# Note [Writing rows in the background]
# =====================================
# Filling new shared pages is kernel work: each 4 KiB page of a memfd is allocated
# when it is first written (``docs/internals.md#allocating-pages``; for a dataset of
# images, a large part of the time it takes to iterate it once: the ``pages_only``
# row of ``benchmarks/results/wrap.md``). The builder hides it behind the
# iteration: the main thread only checks each item and collects its values; every
# ``chunk`` rows it hands the fixed-size values to a
# writer thread, which stacks them into a private staging block (``torch.stack``)
# and ``pwrite``s the block into the segment's file. Both calls release the GIL, so
# the writer runs on another core while the dataset's ``__getitem__`` runs here.
#
# * The segment is sized, not reserved (``allocate(reserve=False)``; its capacity is
#   checked before the first item). ``pwrite`` allocates the pages as it fills them,
#   with no zeroing and no page fault per page, and reports a full memory as
#   ENOSPC/ENOMEM, raised as SharedMemoryFullError: nothing is ever written through
#   the mapping, so no SIGBUS is possible.
# * ``MADV_POPULATE_READ`` then maps each written block into this process, as loading
#   through the mapping would have: the loading process holds the one copy that the
#   PSS accounting of ``verify`` expects it to hold before the workers start.
# * The main thread runs at most two blocks ahead of the writer (a bounded queue).
# * On any error (an item that does not fit, ``__getitem__`` raising, Ctrl-C) the
#   writer is stopped and joined BEFORE the segment is discarded, so it never writes
#   to a descriptor that has been closed (and maybe reused).

_BLOCK_BYTES = 4 << 20  # fixed-size bytes per block handed to the writer
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)


def chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows per block: up to ``_BLOCK_BYTES``, and ~1/64 of a small dataset.

    The main thread waits at the end for the blocks still queued (up to three): small
    blocks keep that tail short for small datasets, 64+ rows keep the cost per block
    (a few Python calls) negligible per row.
    """
    return max(16, min(4096, _BLOCK_BYTES // max(row_bytes, 1), max(64, -(-rows // 64))))


@functools.cache
def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise  # ctypes releases the GIL during the call


class BlockWriter:
    """Writes blocks of fixed-size rows into a segment's file with ``pwrite``.

    The writer thread of the loading process uses one, and so does each DataLoader
    worker of a parallel materialisation (Note [Materialising with workers]).
    """

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self.fd = segment.fd
        self.size = segment.size
        self.chunk = chunk
        self.storage_dir = storage_dir
        self.what = what
        self._stages: dict[int, Any] = {}

    def write(self, start: int, rows: int, target: SharedArray, leaf: Leaf, values: list) -> None:
        """Write ``values`` as rows ``[start, start + rows)`` of ``target``."""
        row_bytes = target.nbytes // target.shape[0]
        self._pwrite(self._stage(target, leaf, values, rows), target.offset + start * row_bytes)

    def _stage(self, target: SharedArray, leaf: Leaf, values: list[Any], rows: int) -> Any:
        """The block of ``values`` as one contiguous array."""
        if leaf.kind == "tensor":
            stage = self._stages.get(id(target))
            if stage is None:
                stage = torch.empty((self.chunk, *leaf.shape), dtype=leaf.torch_dtype)
                self._stages[id(target)] = stage
            out = stage[:rows]
            try:
                torch.stack(values, out=out)
            except RuntimeError:  # e.g. tensors on a GPU: copy_ moves them
                for row, value in zip(out, values):
                    row.copy_(value)
            return host_numpy(out)
        if leaf.kind == "ndarray":
            stage = self._stages.get(id(target))
            if stage is None:
                stage = np.empty((self.chunk, *leaf.shape), dtype=leaf.dtype)
                self._stages[id(target)] = stage
            return np.stack(values, out=stage[:rows])
        return np.asarray(values, dtype=target.dtype)

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        _pwrite_all(
            self.fd, view, offset, self.size, resolve_storage_dir(self.storage_dir), self.what
        )


class Writer:
    """Writes blocks of fixed-size rows from a background thread, and maps them here.

    See Note [Writing rows in the background].
    """

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self._blocks = BlockWriter(segment, chunk, storage_dir, what)
        self._base = address_of(segment.mmap)
        self._madvise = _madvise()
        self._populate = True
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shareddata-writer", daemon=True)
        self._thread.start()

    def submit(self, start: int, rows: int, blocks: list[tuple[SharedArray, Leaf, Any]]) -> None:
        """Queue rows ``[start, start + rows)`` of each ``(array, leaf, values)``.

        ``values`` None: the rows are written already (by a worker); only map them.
        """
        self._raise()
        self._jobs.put((start, rows, blocks))

    def wait(self) -> None:
        """Return once every queued block is written; raise the writer's error if any."""
        self._jobs.join()
        self._raise()

    def close(self) -> None:
        """Write what is queued and end the thread."""
        self.wait()
        self._jobs.put(None)
        self._thread.join()

    def abort(self) -> None:
        """Drop what is queued, let the block being written finish, and end the thread."""
        self._stop = True
        if not self._thread.is_alive():
            return
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
            self._jobs.task_done()
        self._jobs.put(None)
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        with torch.no_grad():  # per thread: values that require grad are only copied
            while True:
                job = self._jobs.get()
                try:
                    if job is None:
                        return
                    if not self._stop and self._error is None:
                        self._write(*job)
                except BaseException as e:  # handed to the main thread by submit()/wait()
                    self._error = e
                finally:
                    job = None
                    self._jobs.task_done()

    def _write(self, start: int, rows: int, blocks: list[tuple[SharedArray, Leaf, Any]]) -> None:
        for target, leaf, values in blocks:
            if values is not None:
                self._blocks.write(start, rows, target, leaf, values)
            row_bytes = target.nbytes // target.shape[0]
            self._map(target.offset + start * row_bytes, rows * row_bytes)

    def _map(self, offset: int, nbytes: int) -> None:
        if not self._populate or nbytes == 0:
            return
        start = (self._base + offset) // _PAGE * _PAGE
        if self._madvise(start, self._base + offset + nbytes - start, _MADV_POPULATE_READ):
            self._populate = False  # older kernel: pages map in when first read
