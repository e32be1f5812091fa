"""Fixed-size rows written into their segment: by a background thread, or by workers.

The builder hands every ``chunk`` rows to a :class:`Writer` (Note [Writing rows in the
background]); the DataLoader workers of ``SharedDataset(num_workers=N)`` read and
write blocks with a :class:`BlockReader` (Note [Materialising with workers]).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...columns._items import Leaf, compile_fast_path, host_numpy
from ...errors import SharedDataError
from ...storage import Segment, SharedArray
from ...storage._capacity import resolve_storage_dir
from ...storage._linux import libc
from ...storage._writer import pwrite_all

__all__ = [
    "TRIM_BYTES", "Block", "BlockReader", "BlockWriter", "HeapTrim", "Writer", "box",
    "chunk_rows", "fetch", "identity",
]  # fmt: skip


# Note [Writing rows in the background]
# =====================================
# Filling new shared pages is kernel work (``docs/internals.md#allocating-pages``).
# The builder hides it behind the iteration: the main thread checks each item and
# collects its values; every ``chunk`` rows a writer thread stacks the fixed-size
# values into a staging block and ``pwrite``s it into the segment's file (both
# release the GIL).
#
# * The segment is sized, not reserved: ``pwrite`` allocates pages as it fills them
#   and reports a full memory as ENOSPC (SharedMemoryFullError), never SIGBUS.
# * The seal maps the pages here (Note [Sealed segments] in ``storage/_segment.py``),
#   so the loading process holds the one copy ``verify``'s PSS accounting expects.
# * The main thread runs at most two blocks ahead (a bounded queue).
# * On any error the writer is stopped and joined BEFORE the segment is discarded,
#   so it never writes to a closed (maybe reused) descriptor.

_BLOCK_BYTES = 4 << 20  # fixed-size bytes per block handed to the writer

# Note [Items freed back to the system]
# =====================================
# glibc raises its mmap threshold (up to 32 MiB) to each large block freed, so items
# of 1-32 MiB come from the heap, which keeps their pages after they are written.
# The builder (and each worker) hands them back with ``malloc_trim`` every
# ``TRIM_BYTES`` of items, so a materialisation's private memory stays a few blocks
# (not on musl, which has no ``malloc_trim``).
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
    """Rows per block: up to ``_BLOCK_BYTES`` (at least one row), ~1/64 of a small dataset.

    Example:
        >>> chunk_rows(1000, 64), chunk_rows(20, 16 << 20)
        (64, 1)
    """
    by_size = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    return min(4096, by_size, max(64, -(-rows // 64)))


class BlockWriter:
    """Writes blocks of fixed-size rows into a segment's file with ``pwrite``."""

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self.fd = segment.fd
        self.size = segment.size
        self.chunk = chunk
        self.storage_dir = storage_dir
        self.what = what
        self._stages: dict[int, Any] = {}

    def write(self, start: int, rows: int, target: SharedArray, leaf: Leaf, values: list) -> None:
        """Write ``values`` as rows ``[start, start + rows)`` of ``target``."""
        data = self._stage(target, leaf, values, rows)
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        offset = target.offset + start * (target.nbytes // target.shape[0])
        where = resolve_storage_dir(self.storage_dir)
        pwrite_all(self.fd, view, offset, self.size, where, self.what)

    def _stage(self, target: SharedArray, leaf: Leaf, values: list[Any], rows: int) -> Any:
        """The block of ``values`` as one contiguous array (in a staging block kept per leaf)."""
        if leaf.kind not in ("tensor", "ndarray"):
            return np.asarray(values, dtype=target.dtype)
        stage: Any = self._stages.get(id(target))
        if stage is None:
            shape = (self.chunk, *leaf.shape)
            if leaf.kind == "tensor":
                stage = torch.empty(shape, dtype=leaf.torch_dtype)
            else:
                stage = np.empty(shape, leaf.dtype)
            self._stages[id(target)] = stage
        if leaf.kind == "ndarray":
            return np.stack(values, out=stage[:rows])
        out = stage[:rows]
        try:
            torch.stack(values, out=out)
        except RuntimeError:  # e.g. tensors on a GPU: copy_ moves them
            for row, value in zip(out, values):
                row.copy_(value)
        return host_numpy(out)


class Writer:
    """Writes blocks of fixed-size rows from a background thread.

    Note [Writing rows in the background].
    """

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self._blocks = BlockWriter(segment, chunk, storage_dir, what)
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


def fetch(dataset: Any, index: int) -> Any:
    """Item ``index`` of ``dataset``; an error says which item was being read."""
    try:
        return dataset[index]
    except Exception as e:
        note = f"while SharedDataset read item {index} of {type(dataset).__name__}"
        if hasattr(e, "add_note"):  # Python >= 3.11: keep the original exception type
            e.add_note(note)
            raise
        raise SharedDataError(f"{type(e).__name__}: {e} ({note})") from e


def identity(x: Any) -> Any:
    """``x`` itself (the workers' ``collate_fn``: a block is not collated)."""
    return x


# Note [Materialising with workers]
# =================================
# ``SharedDataset(ds, num_workers=N)`` reads item 0 here (the schema, the fixed-size
# segment's size), then hands blocks of ``chunk`` rows to N DataLoader workers
# (``BlockReader``). When every item of a block fits the schema as it stood when
# the workers started, the worker ``pwrite``s the fixed-size rows into the segment
# and sends back only the variable-length values: no tensor crosses, and pages are
# allocated in parallel. Here the rows are mapped and the values added.
#
# Otherwise the worker writes nothing and sends the items back (tensors as numpy
# arrays, pickled by value, unpickled as tensors); they take the usual path here,
# which names an error's index and field or adapts the columns. A leaf made ragged
# since still gets fixed rows from the workers: those are read back from its old
# array (``orphans``).


@dataclass
class Block:
    """What a worker sends back for rows ``[start, stop)``."""

    start: int
    stop: int
    var: dict[int, list[Any]] | None = None  # every item fitted: the var leaves' values
    items: list[Any] | None = None  # otherwise: the items (tensors boxed)


class _Box:
    """A value pickled as ``rebuild(*args)``: unpickled, it is that value again."""

    def __init__(self, rebuild: Callable[..., Any], *args: Any) -> None:
        self.rebuild, self.args = rebuild, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.rebuild, self.args


def box(value: Any) -> Any:
    """``value`` with the tensors in its tuples, lists and dicts as :class:`_Box` es.

    What a worker sends back: a tensor as its numpy array, a non-native array as a
    native one (a Parameter, a subclass: as they are).
    """
    if type(value) in (tuple, list):
        return type(value)(box(v) for v in value)
    if type(value) is dict:
        return {k: box(v) for k, v in value.items()}
    if type(value) is torch.Tensor and not value.requires_grad and value.dtype in _BOXABLE:
        return _Box(torch.from_numpy, value.cpu().numpy())
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return _Box(np.ndarray.astype, value.astype(value.dtype.newbyteorder("=")), value.dtype)
    return value


_BOXABLE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


@dataclass(eq=False)
class BlockReader:
    """The dataset the materialising DataLoader's workers read: one block per index."""

    dataset: Any
    schema: Any
    leaves: list[Leaf]
    fixed: dict[int, SharedArray]
    chunk: int
    rows: int
    storage_dir: Any
    what: str
    offset: int = 0  # index in ``dataset`` of row 0

    def __post_init__(self) -> None:
        self.leaves = [dataclasses.replace(leaf) for leaf in self.leaves]  # as they are now
        self.fixed = dict(self.fixed)
        self._fast: Callable[[Any], bool] | None = None
        self._sinks: list[list[Any]] = []
        self._writer: BlockWriter | None = None
        self._trim = HeapTrim()  # Note [Items freed back to the system]

    def __len__(self) -> int:
        return -(-self.rows // self.chunk)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fast": None, "_sinks": [], "_writer": None, "_trim": HeapTrim()}

    def __getitem__(self, block: int) -> Block:
        start = block * self.chunk
        stop = min(start + self.chunk, self.rows)
        base = self.offset
        items = [fetch(self.dataset, base + index) for index in range(start, stop)]
        if self._fast is None:
            self._sinks = [[] for _ in self.leaves]
            self._fast = compile_fast_path(self.schema, self.leaves, self._sinks)
        if not all(map(self._fast, items)):
            for sink in self._sinks:
                sink.clear()
            return Block(start, stop, items=[box(item) for item in items])
        with torch.no_grad():
            for n, target in self.fixed.items():
                if self._writer is None:
                    segment, chunk = target.segment, self.chunk
                    self._writer = BlockWriter(segment, chunk, self.storage_dir, self.what)
                self._writer.write(start, stop - start, target, self.leaves[n], self._sinks[n])
                self._trim(target.nbytes // self.rows * (stop - start))
        var = {n: self._sinks[n].copy() for n in range(len(self.leaves)) if n not in self.fixed}
        for sink in self._sinks:
            sink.clear()
        return Block(start, stop, var=var)
