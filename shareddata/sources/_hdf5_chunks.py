"""The gzip chunk reader: HDF5 deflate chunks inflated in threads, straight into the rows.

Every other layout is read by h5py's ``read_direct``, which measured as fast
(``benchmarks/bench_hdf5_readers.py``, docs/benchmarks.md).
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
from ._source import Buffer

__all__ = ["inflatable", "inflate", "row_steps"]

# Note [Inflating chunks in threads]
# ==================================
# HDF5 runs its filters in the calling thread and h5py serialises every call, so
# ``read_direct`` of a gzip dataset decodes on one core. For chunks whose only filter
# is deflate, shareddata reads each stored chunk's bytes itself (``chunk_iter`` gives
# their offsets, ``os.pread`` reads them) and inflates them in threads (``zlib`` and
# numpy release the GIL), each writing its chunk straight into the shared buffer; at
# most four chunks per thread wait in memory. Measured 1.55x faster than h5py. A chunk
# whose ``filter_mask`` has bit 0 set was stored raw. Chunks never written (the fill
# value) and other file drivers go through ``read_direct``.

_INFLATE_THREADS: int | None = None
"""Threads decoding gzip chunks (None: one per usable core, at most 8)."""


def _inflate_threads() -> int:
    if _INFLATE_THREADS is not None:
        return max(1, _INFLATE_THREADS)
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _decode(raw: bytes, mask: int) -> bytes:
    """A chunk's bytes inflated (as stored when its ``filter_mask`` skipped deflate)."""
    return raw if mask & 1 else zlib.decompress(raw)


def inflatable(ds: Any) -> bool:
    """Whether :func:`inflate` reads this dataset: numbers, gzip alone, a plain file."""
    if ds.chunks is None or ds.dtype.kind not in "iufc" or ds.file.driver != "sec2":
        return False
    if not hasattr(ds.id, "chunk_iter"):  # h5py < 3.8
        return False
    dcpl = ds.id.get_create_plist()
    filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
    return filters == [1]  # H5Z_FILTER_DEFLATE alone


def inflate(what: str, ds: Any, out: Buffer, progress: Callable[[int], None]) -> bool:
    """Read every chunk of ``ds`` raw and inflate it in threads, into ``out``.

    Returns False, having written nothing, when a chunk was never written (HDF5
    knows the fill value): the caller reads the dataset with h5py instead.

    Raises:
        SourceReadError: a chunk is cut short, does not decode, or lies outside the file.
    """
    stored: list[tuple[tuple[int, ...], int, int, int]] = []
    ds.id.chunk_iter(
        lambda c: stored.append((c.chunk_offset, c.filter_mask, c.byte_offset, c.size))
    )
    shape, chunks = tuple(ds.shape), tuple(ds.chunks)
    if len(stored) != math.prod(-(-s // c) for s, c in zip(shape, chunks)):
        return False
    dtype = ds.dtype
    chunk_bytes = math.prod(chunks) * dtype.itemsize

    def place(rows_of: np.ndarray, offset: tuple[int, ...], mask: int, at: int, size: int) -> int:
        raw = os.pread(fd, size, at)
        if len(raw) != size:
            raise SourceReadError(f"{what} failed: the file ends inside a chunk")
        data = _decode(raw, mask)
        if len(data) != chunk_bytes:
            raise SourceReadError(
                f"{what} failed: a chunk decodes to {len(data)} bytes, not {chunk_bytes}"
            )
        sizes = [min(c, s - o) for o, c, s in zip(offset, chunks, shape)]
        where = (slice(0, sizes[0]),) + tuple(
            slice(o, o + n) for o, n in zip(offset[1:], sizes[1:])
        )
        rows_of[where] = np.frombuffer(data, dtype).reshape(chunks)[tuple(map(slice, sizes))]
        return math.prod(sizes) * rows_of.itemsize

    threads = _inflate_threads()
    fd = os.open(ds.file.filename, os.O_RDONLY | os.O_CLOEXEC)
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
            rows_of = out.rows(first, min(first + chunks[0], shape[0]))
            pending.append(executor.submit(place, rows_of, *chunk))
        while pending:
            progress(pending.popleft().result())
    except SourceReadError:
        raise
    except (zlib.error, OSError, ValueError, OverflowError) as error:
        raise SourceReadError(
            f"{what} failed ({type(error).__name__}: {error}). The file is truncated or "
            "corrupt; re-create or re-download it."
        ) from error
    finally:  # no thread writes to ``out`` once this returns, on an error too
        executor.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
    return True


def row_steps(rows: int, row_bytes: int, budget: int, chunks: Any) -> Iterator[tuple[int, int]]:
    """Blocks of rows of about ``budget`` bytes, whole chunks along axis 0 if chunked.

    Example:
        >>> list(row_steps(10, 8, 32, (3,)))
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    step = max(1, budget // max(1, row_bytes))
    if chunks:
        step = max(int(chunks[0]), step - step % int(chunks[0]))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
