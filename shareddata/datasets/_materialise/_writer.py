"""Blocks of fixed-size rows written into their segment, by a background thread.

``SharedDataset`` hands every ``chunk`` rows of its fixed-size leaves to a
:class:`Writer` (Note [Writing rows in the background]); DataLoader workers of a
parallel materialisation write their blocks with a :class:`BlockWriter` of their own
(Note [Materialising with workers] in ``_blocks.py``).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np
import torch

from ...columns._items import Leaf, host_numpy
from ...storage import Segment, SharedArray
from ...storage._capacity import resolve_storage_dir
from ...storage._linux import MADV_POPULATE_READ, libc, madvise
from ...storage._writer import pwrite_all

__all__ = ["TRIM_BYTES", "BlockWriter", "HeapTrim", "Writer", "chunk_rows"]


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
_PAGE = os.sysconf("SC_PAGE_SIZE")

# Note [Items freed back to the system]
# =====================================
# glibc serves an allocation of 128 KiB or more with a mapping of its own, and raises
# that threshold (up to 32 MiB) to the size of each such block freed: a dataset's
# items of 1-32 MiB (images, decoded tensors) then come from the heap, and the heap
# keeps the pages of items already written, which the kernel still charges to the
# process and its memory cgroup. The builder (and each worker of a parallel
# materialisation) hands them back with ``malloc_trim`` every ``TRIM_BYTES`` of
# items, so the private memory of a materialisation stays a few blocks, not a heap of
# freed items (Note [A load is refused, never killed] in ``storage/_capacity.py``).
# Where libc has no ``malloc_trim`` (musl), nothing is done.
TRIM_BYTES = 16 << 20
_TRIM = getattr(libc(), "malloc_trim", None)


class HeapTrim:
    """Called with the bytes of items done with; trims the heap every ``TRIM_BYTES``."""

    def __init__(self) -> None:
        self.freed = 0

    def __call__(self, nbytes: int) -> None:
        self.freed += nbytes
        if self.freed >= TRIM_BYTES and _TRIM is not None:
            self.freed = 0
            _TRIM(0)


def chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows per block: up to ``_BLOCK_BYTES`` (one row if it is bigger), ~1/64 of a small dataset.

    The main thread waits at the end for the blocks still queued (up to three): small
    blocks keep that tail short for small datasets, 64+ rows keep the cost per block
    (a few Python calls) negligible per row. A block never holds more than
    ``_BLOCK_BYTES`` of rows beyond one, so the private memory of a materialisation,
    a few blocks (``Builder._private_peak``), stays small beside its data.

    Example:
        >>> chunk_rows(1000, 64), chunk_rows(20, 16 << 20)
        (64, 1)
    """
    by_size = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    return min(4096, by_size, max(64, -(-rows // 64)))


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
        pwrite_all(
            self.fd, view, offset, self.size, resolve_storage_dir(self.storage_dir), self.what
        )


class Writer:
    """Writes blocks of fixed-size rows from a background thread, and maps them here.

    See Note [Writing rows in the background].
    """

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self._blocks = BlockWriter(segment, chunk, storage_dir, what)
        self._base = segment.address
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
        if madvise(start, self._base + offset + nbytes - start, MADV_POPULATE_READ):
            self._populate = False  # older kernel: pages map in when first read
