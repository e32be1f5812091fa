"""Raw readers of HDF5 numeric data: a dataset's bytes copied or inflated by shareddata.

HDF5 runs its filters in the calling thread and h5py serialises every call, so
``read_direct`` uses one core and copies through HDF5's buffers. For the common
layouts the bytes are read from the file here instead, straight into the rows
they belong to:

* contiguous, unfiltered datasets: ``os.preadv`` from the dataset's offset
  (:func:`raw_offset`);
* chunked ones whose pipeline is ``deflate`` (optionally after ``shuffle``), or no
  filter with chunks of whole rows: each stored chunk read and decoded in threads
  (:func:`inflatable`, :func:`inflate`; Note [Inflating chunks in threads]).

Everything else (other filters, compound members, chunks never written, other
file drivers) goes through h5py; see :mod:`shareddata.sources.hdf5`.
"""

from __future__ import annotations

import collections
import math
import os
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import SourceReadError
from ._io import open_file, read_exactly
from ._source import Buffer

__all__ = [
    "copy_field",
    "copy_raw",
    "inflatable",
    "inflate",
    "raw_offset",
    "record_runs",
    "row_steps",
    "runs_within",
]

# Note [Inflating chunks in threads]
# ==================================
# HDF5 runs its filters in the calling thread, one chunk after another, and h5py
# serialises every call, so ``read_direct`` of a gzip dataset uses one core. For
# the common pipelines (``deflate``, optionally after ``shuffle``), shareddata reads
# each stored chunk's bytes itself (``chunk_iter`` gives their offsets, ``os.pread``
# reads them) and decodes them in several threads (``zlib`` and numpy release the
# GIL), each writing its chunk straight into the shared buffer; at most four chunks
# per thread wait in memory. A chunk's ``filter_mask`` says which filters were
# skipped for it. Unfiltered chunks that hold whole rows take the same path, each
# ``preadv``-ed by a thread straight into its rows (``read_direct`` copies them one
# after another through HDF5). Other filters (lzf, szip, fletcher32, plugins), chunks
# never written (the fill value) and other file drivers go through ``read_direct``.

_DEFLATE = 1  # H5Z_FILTER_DEFLATE
_SHUFFLE = 2  # H5Z_FILTER_SHUFFLE
_INFLATE_THREADS: int | None = None
"""Threads decoding gzip chunks (None: one per usable core, at most 8)."""


def _inflate_threads() -> int:
    if _INFLATE_THREADS is not None:
        return max(1, _INFLATE_THREADS)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _decode(raw: bytes, mask: int, filters: list[int], itemsize: int) -> bytes:
    """Undo a chunk's filters, last first, skipping those its ``filter_mask`` names."""
    data = raw
    for index in reversed(range(len(filters))):
        if mask >> index & 1:
            continue
        if filters[index] == _DEFLATE:
            data = zlib.decompress(data)
        elif itemsize > 1:  # shuffle: byte j of every element was stored together
            count = len(data) // itemsize
            planes = np.frombuffer(data, np.uint8, count * itemsize).reshape(itemsize, count)
            data = planes.T.tobytes() + data[count * itemsize :]
    return data


def raw_offset(h5py: Any, ds: Any, nbytes: int) -> int | None:
    """Where a contiguous, unfiltered numeric dataset's bytes start in the file, or None.

    Such a dataset is stored as one run of raw bytes (in the file's byte order),
    so ``preadv`` can copy it without HDF5's per-call overhead. Anything else
    (chunked, compact, external, virtual, not yet written, a driver other than a
    single plain file, a type HDF5 converts) goes through h5py.
    """
    if ds.dtype.kind not in "iufc" or ds.file.driver != "sec2":
        return None
    try:
        dcpl = ds.id.get_create_plist()
        if (
            dcpl.get_layout() != h5py.h5d.CONTIGUOUS
            or dcpl.get_nfilters()
            or dcpl.get_external_count()
            or ds.id.get_storage_size() != nbytes  # unallocated: its offset is garbage
        ):
            return None
        offset = ds.id.get_offset()
    except (OSError, RuntimeError, ValueError, AttributeError):
        return None
    return None if offset is None or offset < 0 else int(offset)


_RAW_BLOCK = 64 << 20
"""Bytes per ``preadv`` of a contiguous dataset (one progress update each)."""


def copy_raw(
    path: str, what: str, offset: int, out: Buffer, progress: Callable[[int], None]
) -> None:
    """Fill ``out`` with the bytes of ``path`` from ``offset`` on, in blocks of whole rows.

    ``os.preadv`` copies from the page cache into the rows' shared pages: one
    kernel copy, no private buffer, the GIL released while it runs.

    Raises:
        SourceReadError: the file ends early, or the disk or file system fails.
    """
    row_bytes = out.nbytes // max(1, len(out))
    step = max(1, _RAW_BLOCK // max(1, row_bytes))
    done = 0
    with open_file(path, what) as fd:
        for start in range(0, len(out), step):
            view = out.rows(start, min(len(out), start + step)).reshape(-1).view(np.uint8)
            read_exactly(fd, view, offset + done, what)
            done += view.nbytes
            progress(view.nbytes)


def inflatable(ds: Any) -> list[int] | None:
    """The filter pipeline of a chunked numeric dataset :func:`inflate` can read, or None.

    Only pipelines of ``deflate`` (gzip) and ``shuffle`` qualify, and no filters
    at all when each chunk holds whole rows: Note [Inflating chunks in threads].
    """
    if ds.chunks is None or ds.dtype.kind not in "iufc":
        return None
    if ds.file.driver != "sec2" or not hasattr(ds.id, "chunk_iter"):
        return None
    try:
        dcpl = ds.id.get_create_plist()
        filters = [int(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters())]
    except (OSError, RuntimeError, ValueError):
        return None
    if not filters and tuple(ds.chunks[1:]) == tuple(ds.shape[1:]):
        return filters  # chunks of whole rows, stored as they are
    if _DEFLATE not in filters or not set(filters) <= {_DEFLATE, _SHUFFLE}:
        return None
    return filters


def inflate(
    path: str,
    what: str,
    ds: Any,
    filters: list[int],
    out: Buffer,
    progress: Callable[[int], None],
) -> bool:
    """Read every chunk of ``ds`` raw and decode it in threads, into ``out``.

    Args:
        path: the HDF5 file.
        what: the dataset, for messages (``"f.h5: reading dataset 'x'"``).
        ds: the h5py dataset.
        filters: its pipeline, from :func:`inflatable`.
        out: the dataset's buffer (native byte order).
        progress: called with the bytes of each chunk placed.

    Returns:
        False, having written nothing, when a chunk was never written (HDF5 knows
        the fill value): the caller reads the dataset with h5py instead.

    Raises:
        SourceReadError: a chunk is cut short or does not decode, or the chunk index
            puts one outside the file (a corrupt index).
    """
    stored: list[tuple[tuple[int, ...], int, int, int]] = []
    ds.id.chunk_iter(
        lambda c: stored.append((c.chunk_offset, c.filter_mask, c.byte_offset, c.size))
    )
    shape, chunks = tuple(ds.shape), tuple(ds.chunks)
    if len(stored) != math.prod(-(-s // c) for s, c in zip(shape, chunks)):
        return False  # chunks never written hold the fill value: HDF5 knows it
    dtype = ds.dtype
    chunk_bytes = math.prod(chunks) * dtype.itemsize

    def place(
        rows_of: np.ndarray, offset: tuple[int, ...], mask: int, address: int, size: int
    ) -> int:
        """Chunk ``offset`` into ``rows_of``, the rows it covers (from ``rows``)."""
        if not filters and dtype.isnative:  # whole rows: straight into them
            if size != chunk_bytes:
                raise SourceReadError(f"{what} failed: a chunk's size is not its rows' bytes")
            read_exactly(fd, rows_of.reshape(-1).view(np.uint8), address, f"{what} (a chunk)")
            return rows_of.nbytes
        raw = os.pread(fd, size, address)
        if len(raw) != size:
            raise SourceReadError(f"{what} failed: the file ends inside a chunk")
        data = _decode(raw, mask, filters, dtype.itemsize)
        if len(data) != chunk_bytes:
            raise SourceReadError(
                f"{what} failed: a chunk decodes to {len(data)} bytes, not {chunk_bytes}"
            )
        sizes = [min(c, s - o) for o, c, s in zip(offset, chunks, shape)]
        where = (slice(0, sizes[0]),) + tuple(
            slice(o, o + n) for o, n in zip(offset[1:], sizes[1:])
        )
        block = np.frombuffer(data, dtype).reshape(chunks)
        rows_of[where] = block[tuple(slice(0, n) for n in sizes)]
        return math.prod(sizes) * rows_of.itemsize

    threads = _inflate_threads()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    executor = ThreadPoolExecutor(threads, thread_name_prefix="shareddata-hdf5")
    pending: collections.deque[Future[int]] = collections.deque()
    try:
        file_bytes = os.fstat(fd).st_size
        for offset, _, address, size in stored:  # a corrupt chunk index: garbage addresses
            if not (address >= 0 and 0 <= size <= file_bytes - address):
                raise SourceReadError(
                    f"{what} failed: its chunk index puts the chunk at {offset} ({size} bytes) "
                    f"at byte {address}, outside the file ({file_bytes} bytes); the index is "
                    "corrupt. Re-create or re-download the file."
                )
        for chunk in stored:
            if len(pending) >= 4 * threads:
                progress(pending.popleft().result())
            first = chunk[0][0]
            rows_of = out.rows(first, min(first + chunks[0], shape[0]))  # pages are in
            pending.append(executor.submit(place, rows_of, *chunk))
        while pending:
            progress(pending.popleft().result())
    except (zlib.error, OSError, ValueError, OverflowError) as error:
        if isinstance(error, SourceReadError):
            raise
        raise SourceReadError(
            f"{what} failed ({type(error).__name__}: {error}). The file is truncated or "
            "corrupt; re-create or re-download it."
        ) from error
    finally:  # no thread writes to ``out`` once this returns, on an error too
        executor.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
    return True


# Note [Fields of raw records]
# ============================
# A compound (record) dataset loads as one column per field, and the loader reads
# one column at a time, so every field is a pass over all the records. Through
# HDF5 each pass converts every record (a subset conversion per field); when the
# records are stored raw (no filter, contiguous or chunked, a fixed-size type whose
# numpy layout is HDF5's), shareddata instead reads a bounded block of records
# with ``preadv`` and copies the field out with numpy (a strided copy, byte order
# swapped on the way). Records with variable-length members (whose in-file size
# differs from numpy's), filtered chunks, chunks never written and other drivers
# go through HDF5.

_RECORD_BLOCK = 4 << 20
"""Bytes of records read per ``preadv`` when a field is copied out of raw records."""


def _same_layout(h5py: Any, htype: Any, dtype: np.dtype) -> bool:
    """Whether numpy ``dtype`` places every member where HDF5 type ``htype`` does."""
    if htype.get_size() != dtype.itemsize:
        return False
    if htype.get_class() != h5py.h5t.COMPOUND or dtype.names is None:  # (complex: {r, i})
        return not dtype.hasobject
    names = dtype.names or ()
    if htype.get_nmembers() != len(names):
        return False
    for i, name in enumerate(names):
        sub, offset = dtype.fields[name][:2]  # type: ignore[index]
        if htype.get_member_offset(i) != offset or htype.get_member_name(i) != name.encode():
            return False
        if not _same_layout(h5py, htype.get_member_type(i), sub):
            return False
    return True


def record_runs(h5py: Any, ds: Any) -> list[tuple[int, int, int]] | None:
    """``(first row, rows, file offset)`` of the raw records of a 1-D compound dataset.

    None when the records are not stored raw in one plain file (Note [Fields of
    raw records]): HDF5 must read them.
    """
    if ds.dtype.names is None or len(ds.shape or ()) != 1 or ds.file.driver != "sec2":
        return None
    try:
        if not _same_layout(h5py, ds.id.get_type(), ds.dtype):
            return None
        dcpl = ds.id.get_create_plist()
        if dcpl.get_nfilters() or dcpl.get_external_count():
            return None
        rows, size = int(ds.shape[0]), ds.dtype.itemsize
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            offset = ds.id.get_offset()
            if offset is None or ds.id.get_storage_size() != rows * size:
                return None
            return [(0, rows, int(offset))] if rows else []
        if layout != h5py.h5d.CHUNKED or not hasattr(ds.id, "chunk_iter"):
            return None
        along = int(ds.chunks[0])
        runs: list[tuple[int, int, int]] = []
        ds.id.chunk_iter(
            lambda c: runs.append(
                (c.chunk_offset[0], min(along, rows - c.chunk_offset[0]), c.byte_offset)
                if c.size == along * size and not c.filter_mask
                else (-1, 0, 0)
            )
        )
    except (OSError, RuntimeError, ValueError, TypeError, AttributeError):
        return None
    runs.sort()
    if len(runs) != -(-rows // along) or any(r[0] != i * along for i, r in enumerate(runs)):
        return None  # chunks never written (the fill value) or not as expected
    return runs


def copy_field(
    path: str,
    what: str,
    ds: Any,
    runs: list[tuple[int, int, int]],
    take: Callable[[np.ndarray], np.ndarray],
    out: Buffer,
    progress: Callable[[int], None],
) -> None:
    """Copy ``take(records)`` of each block of raw records into the rows of ``out``.

    Args:
        path: the HDF5 file.
        what: the column, for messages.
        ds: the h5py dataset (its numpy dtype describes the records).
        runs: from :func:`record_runs`.
        take: the field of a block of records (``records["a"]["b"]``).
        out: the column's buffer.
        progress: called with the bytes of each block of rows written.

    Raises:
        SourceReadError: the file ends inside the records.
    """
    dtype = ds.dtype
    step = max(1, _RECORD_BLOCK // dtype.itemsize)
    block = np.empty(min(step, max((n for _, n, _ in runs), default=1)), dtype)
    raw = block.view(np.uint8)
    row_bytes = out.nbytes // max(1, len(out))
    with open_file(path, what) as fd:
        for first, count, offset in runs:
            for start in range(0, count, step):
                n = min(step, count - start)
                nbytes = n * dtype.itemsize
                read_exactly(fd, raw[:nbytes], offset + start * dtype.itemsize, what)
                out.rows(first + start, first + start + n)[...] = take(block[:n])
                progress(n * row_bytes)


def row_steps(rows: int, row_bytes: int, budget: int, chunks: Any) -> Iterator[tuple[int, int]]:
    """Blocks of rows of about ``budget`` bytes, whole chunks along axis 0 if chunked.

    Example:
        >>> list(row_steps(10, 8, 32, (3,)))
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    step = max(1, budget // max(1, row_bytes))
    if chunks:
        along = int(chunks[0])
        step = max(along, step - step % along)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def runs_within(
    runs: list[tuple[int, int, int]], start: int, stop: int, size: int
) -> list[tuple[int, int, int]]:
    """The parts of ``runs`` of records in rows ``[start, stop)``, renumbered from ``start``.

    Example:
        >>> runs_within([(0, 10, 100), (10, 10, 500)], 5, 12, 2)
        [(0, 5, 110), (5, 2, 500)]
    """
    inside = []
    for first, count, offset in runs:
        lo, hi = max(first, start), min(first + count, stop)
        if lo < hi:
            inside.append((lo - start, hi - lo, offset + (lo - first) * size))
    return inside
