"""Materialising any map-style dataset into shared columns (what ``SharedDataset`` runs).

Each item is split into *leaves* along a schema inferred from the first item (a
tree of tuples, lists and dicts); each leaf becomes one column:

* fixed-size leaves (tensors and arrays of one shape and dtype, Python and numpy
  numbers) go into one segment sized up front, written block by block from a
  background thread (Note [Writing rows in the background]);
* variable-length leaves (``str``, ``bytes``, lists of numbers, arrays whose shape
  varies, anything else pickled) are collected privately and copied into a second
  segment at the end.

Note [The per-item fast path]
=============================
Materialising must cost little more than iterating the dataset once, so the work
per item is one call to a function generated for the schema (as ``dataclasses``
generates ``__init__``): for an ``(image, label, caption)`` tuple it tests
``type(item) is tuple and len(item) == 3``, then each leaf's exact type, dtype and
(fixed) shape, and appends the three values to per-column lists; ~0.5 us in all,
where walking the schema tree took several. It accepts only what surely matches
the columns as they stand and appends nothing otherwise: the item then takes the
checked path (:meth:`_Builder._add_checked`), which names the index and the field
of any difference, or adapts a column (a shape that varies makes the column
ragged; a list of numbers that stops being one makes it pickled) and recompiles
the fast path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import math
import os
import pickle
import queue
import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, count, islice
from typing import Any, cast

import numpy as np
import torch

from ._capacity import available_memory, resolve_storage_dir
from ._columns import BytesColumn, ColumnSpec, RaggedColumn, StringColumn, TensorColumn
from ._linux import address_of
from ._load import Allocator, Part, progress_bar
from ._storage import Segment, SharedArray, to_numpy_dtype
from ._text import format_bytes
from .errors import (
    InvalidArgumentError,
    ItemMismatchError,
    ItemValueError,
    SharedDataError,
    SharedMemoryFullError,
    UnpicklableItemError,
    UnsupportedDtypeError,
)

__all__ = ["DatasetProducer", "ItemMismatchError", "ItemValueError", "build_columns", "restore"]


# -- leaves ------------------------------------------------------------------------------
# A leaf is one column. ``kind`` says how a value is stored and rebuilt:
#   tensor / ndarray / npscalar / int / float / bool : fixed rows (TensorColumn);
#   when the shape of tensors/arrays varies they switch to ragged values + shapes;
#   str / bytes : StringColumn / BytesColumn; intlist / floatlist : RaggedColumn;
#   pickle : BytesColumn of pickled objects.

_FIXED = {"tensor", "ndarray", "npscalar", "int", "float", "bool"}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class _Leaf:
    path: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    torch_dtype: torch.dtype | None = None


def _field(path: str) -> str:
    return repr(path) if path else "the item itself"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {value.shape}"
    return type(value).__name__


def _classify(value: Any, path: str) -> _Leaf | None:
    """The leaf for ``value``, or None when it is a structure (tuple, list, dict)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise UnsupportedDtypeError(
                f"field {_field(path)} is a bfloat16 tensor, which shared columns cannot hold "
                "(numpy has no bfloat16); return .float() or .view(torch.int16) from the dataset."
            )
        dtype = to_numpy_dtype(value.dtype)
        return _Leaf(path, "tensor", dtype, tuple(value.shape), torch_dtype=value.dtype)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None or value.dtype.kind in "USV":
            return _Leaf(path, "pickle", np.dtype(np.uint8))
        return _Leaf(path, "ndarray", value.dtype.newbyteorder("="), value.shape)
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_, np.void)):
        return _Leaf(path, "npscalar", value.dtype.newbyteorder("="))
    if isinstance(value, bool):
        return _Leaf(path, "bool", np.dtype(np.bool_))
    if isinstance(value, int):
        return _Leaf(path, "int", np.dtype(np.int64))
    if isinstance(value, float):
        return _Leaf(path, "float", np.dtype(np.float64))
    if type(value) is str:
        return _Leaf(path, "str", np.dtype(np.uint8))
    if type(value) is bytes:
        return _Leaf(path, "bytes", np.dtype(np.uint8))
    if type(value) is list:  # numbers: a ragged column; anything else: pickled whole
        kind = _numeric_list(value)
        return _Leaf(path, "pickle" if kind is None else kind or "intlist", np.dtype(np.uint8))
    if type(value) in (tuple, dict):
        return None
    return _Leaf(path, "pickle", np.dtype(np.uint8))


def _all_int(values: list[Any]) -> bool:
    return all(type(v) is int for v in values)


def _all_float(values: list[Any]) -> bool:
    return all(type(v) is float for v in values)


def _numeric_list(value: list[Any]) -> str | None:
    """Return "intlist" or "floatlist" for a flat list of ints or floats, "" if empty, else None."""
    if not value:
        return ""
    if _all_int(value):
        return "intlist"
    if _all_float(value):
        return "floatlist"
    return None


def _schema(item: Any, path: str, leaves: list[_Leaf]) -> Any:
    """A tree mirroring ``item``: ("leaf", n) | ("tuple"|"list", [..]) | ("dict", [(k, ..)])."""
    leaf = _classify(item, path)
    if leaf is not None:
        leaves.append(leaf)
        return ("leaf", len(leaves) - 1)
    if isinstance(item, dict):
        return ("dict", [(k, _schema(v, _join(path, k), leaves)) for k, v in item.items()])
    kind = "tuple" if isinstance(item, tuple) else "list"
    return (kind, [_schema(v, _join(path, i), leaves) for i, v in enumerate(item)])


def _join(path: str, key: Any) -> str:
    """Column names: ``"image"``, ``"0"``, ``"meta.boxes"``."""
    return f"{path}.{key}" if path else str(key)


def _flatten(item: Any, node: Any, out: list[Any], index: int, where: str = "") -> None:
    """Append ``item``'s leaf values to ``out`` in schema order, checking its structure."""
    tag, body = node
    if tag == "leaf":
        out.append(item)
        return
    expected = {"dict": dict, "tuple": tuple, "list": list}[tag]
    if type(item) is not expected:
        raise ItemMismatchError(
            f"item {index}, field {_field(where)}: expected a {expected.__name__} as in item 0, "
            f"got {_describe(item)}. Every item must have the same structure."
        )
    if tag == "dict":
        if list(item) != [k for k, _ in body]:
            raise ItemMismatchError(
                f"item {index}, field {_field(where)}: keys {list(item)} differ from item 0's "
                f"{[k for k, _ in body]}."
            )
        for key, child in body:
            _flatten(item[key], child, out, index, _join(where, key))
        return
    if len(item) != len(body):
        raise ItemMismatchError(
            f"item {index}, field {_field(where)}: {len(item)} elements, item 0 had {len(body)}."
        )
    for i, (value, child) in enumerate(zip(item, body)):
        _flatten(value, child, out, index, _join(where, i))


def rebuild(node: Any, values: Sequence[Any]) -> Any:
    """The item for ``node`` of a schema from its leaf values (the inverse of flattening)."""
    tag, body = node
    if tag == "leaf":
        return values[body]
    if tag == "dict":
        return {k: rebuild(child, values) for k, child in body}
    built = [rebuild(child, values) for child in body]
    return tuple(built) if tag == "tuple" else built


def restore(kind: str, value: Any) -> Any:
    """A leaf value as the original returned it, from what its column gives."""
    if kind == "tensor":
        return value
    if kind == "ndarray":
        return value.numpy()
    if kind == "npscalar":
        return value.numpy()[()]
    if kind in ("int", "float", "bool"):
        return value.item()
    if kind in ("intlist", "floatlist"):
        return value.tolist()
    if kind == "pickle":
        return pickle.loads(value)
    return value  # str, bytes


def _check_leaf(leaf: _Leaf, value: Any, index: int) -> None:
    """Raise :class:`ItemMismatchError` unless ``value`` can go in ``leaf``'s column."""
    if leaf.kind == "pickle":
        return  # anything picklable
    got = _classify(value, leaf.path)
    if got is None:
        ok = False
    elif leaf.kind in ("intlist", "floatlist"):
        ok = got.kind in ("intlist", "floatlist", "") and (not value or got.kind == leaf.kind)
    else:
        ok = got.kind == leaf.kind
        if ok and leaf.kind in ("tensor", "ndarray", "npscalar"):
            ok = got.dtype == leaf.dtype
    if not ok:
        expected = f"{leaf.kind} {leaf.dtype}" if leaf.kind in _FIXED - {"int"} else leaf.kind
        raise ItemMismatchError(
            f"item {index}, field {_field(leaf.path)}: expected {expected} as in item 0, got "
            f"{_describe(value)}. Make every item return the same types (cast in the dataset), "
            "or wrap the value in a type that pickles."
        )


# -- the fast path: Note [The per-item fast path] -----------------------------------------


def _condition(leaf: _Leaf, n: int, v: str, env: dict[str, Any]) -> str | None:
    """Source of the test that the value in variable ``v`` surely fits leaf ``n``."""
    kind = leaf.kind
    if kind in ("tensor", "ndarray"):
        cls, ndim = ("Tensor", "dim()") if kind == "tensor" else ("ndarray", "ndim")
        env[f"D{n}"] = leaf.torch_dtype if kind == "tensor" else leaf.dtype
        dtype = f"{v}.dtype is D{n}" if kind == "tensor" else f"{v}.dtype == D{n}"
        env[f"S{n}"] = leaf.shape
        shape = f"{v}.{ndim} == {len(leaf.shape)}" if leaf.ragged else f"{v}.shape == S{n}"
        return f"type({v}) is {cls} and {dtype} and {shape}"
    if kind == "npscalar":
        env[f"T{n}"], env[f"D{n}"] = leaf.dtype.type, leaf.dtype
        return f"type({v}) is T{n} and {v}.dtype == D{n}"
    if kind == "int":
        return f"type({v}) is int and {_INT64_MIN} <= {v} <= {_INT64_MAX}"
    if kind in ("float", "bool", "str", "bytes"):
        return f"type({v}) is {kind}"
    if kind in ("intlist", "floatlist"):
        return f"type({v}) is list and _all_{kind[:-4]}({v})"
    return None  # pickle: anything


def _compile(schema: Any, leaves: list[_Leaf], sinks: list[list[Any]]) -> Callable[[Any], bool]:
    """The fast path for ``schema``: append each leaf value to its sink, or return False.

    For ``(tensor, int, str)`` items it generates::

        def fast(item):
            if type(item) is not tuple or len(item) != 3: return False
            v0, v1, v2, = item
            if not (type(v0) is Tensor and v0.dtype is D0 and v0.shape == S0): return False
            if not (type(v1) is int and -9223372036854775808 <= v1 <= ...): return False
            if not (type(v2) is str): return False
            A0(v0); A1(v1); A2(v2)
            return True

    Dict keys, dtypes and shapes are bound as globals of the function, never
    written into its source.
    """
    env: dict[str, Any] = {
        "Tensor": torch.Tensor,
        "ndarray": np.ndarray,
        "_all_int": _all_int,
        "_all_float": _all_float,
    }
    lines: list[str] = []
    leaf_var: dict[int, str] = {}
    names = count()

    def visit(node: Any, var: str) -> None:
        tag, body = node
        if tag == "leaf":
            test = _condition(leaves[body], body, var, env)
            if test is not None:
                lines.append(f"if not ({test}): return False")
            leaf_var[body] = var
        elif tag == "dict":
            k = next(names)
            env[f"K{k}"] = tuple(key for key, _ in body)
            lines.append(f"if type({var}) is not dict or tuple({var}) != K{k}: return False")
            for j, (key, child) in enumerate(body):
                env[f"K{k}_{j}"] = key
                sub = f"v{next(names)}"
                lines.append(f"{sub} = {var}[K{k}_{j}]")
                visit(child, sub)
        else:
            lines.append(f"if type({var}) is not {tag} or len({var}) != {len(body)}: return False")
            subs = [f"v{next(names)}" for _ in body]
            if subs:
                lines.append(f"{', '.join(subs)}, = {var}")
            for sub, child in zip(subs, body):
                visit(child, sub)

    visit(schema, "item")
    for n, sink in enumerate(sinks):
        env[f"A{n}"] = sink.append
        lines.append(f"A{n}({leaf_var[n]})")
    source = "def fast(item):\n" + "".join(f"    {line}\n" for line in [*lines, "return True"])
    exec(compile(source, "<SharedDataset fast path>", "exec"), env)
    return env["fast"]  # type: ignore[no-any-return]


# -- variable-length leaves ----------------------------------------------------------------


class VarBuffer:
    """Growable private offsets + values for one variable-length leaf, copied out at the end."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.values = bytearray()
        self.offsets = array("q", [0])
        self.shapes: list[tuple[int, ...]] = []

    def add(self, data: bytes, shape: tuple[int, ...] = ()) -> None:
        """Append one row (``data`` holds its values' bytes)."""
        self.values += data
        self.offsets.append(len(self.values) // self.dtype.itemsize)
        self.shapes.append(shape)

    def extend(self, data: bytes, lengths: Iterable[int]) -> None:
        """Append rows whose values, concatenated, are ``data``; ``lengths`` in elements."""
        self.values += data
        self.offsets.extend(islice(accumulate(lengths, initial=self.offsets[-1]), 1, None))


# -- fixed-size leaves: written from a background thread ------------------------------------

# Note [Writing rows in the background]
# =====================================
# Filling new shared pages is kernel work: each 4 KiB page of a memfd is allocated
# when it is first written (~2 us per page on the 2-core VM measured in
# benchmarks/results/wrap.md: 0.1 s for 192 MiB, half the time it takes to iterate
# that benchmark's dataset once). The
# builder hides it behind the iteration: the main thread only checks each item and
# collects its values; every ``chunk`` rows it hands the fixed-size values to a
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


def _chunk_rows(rows: int, row_bytes: int) -> int:
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


class _BlockWriter:
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

    def write(self, start: int, rows: int, target: SharedArray, leaf: _Leaf, values: list) -> None:
        """Write ``values`` as rows ``[start, start + rows)`` of ``target``."""
        row_bytes = target.nbytes // target.shape[0]
        self._pwrite(self._stage(target, leaf, values, rows), target.offset + start * row_bytes)

    def _stage(self, target: SharedArray, leaf: _Leaf, values: list[Any], rows: int) -> Any:
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
            return out.numpy()
        if leaf.kind == "ndarray":
            stage = self._stages.get(id(target))
            if stage is None:
                stage = np.empty((self.chunk, *leaf.shape), dtype=leaf.dtype)
                self._stages[id(target)] = stage
            return np.stack(values, out=stage[:rows])
        return np.asarray(values, dtype=target.dtype)

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        while view:
            try:
                written = os.pwrite(self.fd, view, offset)
            except OSError as e:
                if e.errno not in _FULL_ERRNOS:
                    raise
                directory = resolve_storage_dir(self.storage_dir)
                where = f"storage_dir={directory!r}" if directory else "RAM"
                raise SharedMemoryFullError(
                    f"{self.what} ran out of room in {where} at byte {offset} of {self.size} "
                    f"({os.strerror(e.errno)}; {format_bytes(available_memory(directory))} "
                    "free now): "
                    "something else took the memory while the dataset was read. Nothing is "
                    "kept. Fix: free memory or disk space, or pass storage_dir='/path' on a "
                    "local disk."
                ) from e
            view = view[written:]
            offset += written


class _Writer:
    """Writes blocks of fixed-size rows from a background thread, and maps them here.

    See Note [Writing rows in the background].
    """

    def __init__(self, segment: Segment, chunk: int, storage_dir: Any, what: str) -> None:
        self._blocks = _BlockWriter(segment, chunk, storage_dir, what)
        self._base = address_of(segment.mmap)
        self._madvise = _madvise()
        self._populate = True
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shareddata-writer", daemon=True)
        self._thread.start()

    def submit(self, start: int, rows: int, blocks: list[tuple[SharedArray, _Leaf, Any]]) -> None:
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

    def _write(self, start: int, rows: int, blocks: list[tuple[SharedArray, _Leaf, Any]]) -> None:
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


# -- the builder ------------------------------------------------------------------------------


class _Builder:
    """Collects the items of a dataset into shared columns, in index order."""

    def __init__(self, first: Any, rows: int, alloc: Allocator) -> None:
        self.leaves: list[_Leaf] = []
        self.schema = _schema(first, "", self.leaves)
        self.rows = rows
        self.alloc = alloc
        self.storage_dir = alloc.storage_dir
        for leaf in self.leaves:
            if leaf.kind in ("", "intlist"):
                leaf.kind, leaf.dtype = "intlist", np.dtype(np.int64)
            elif leaf.kind == "floatlist":
                leaf.dtype = np.dtype(np.float64)
        fixed = [n for n, leaf in enumerate(self.leaves) if leaf.kind in _FIXED]
        self.what = "SharedDataset's fixed-size fields"
        arrays = alloc(
            [((rows, *self.leaves[n].shape), self.leaves[n].dtype) for n in fixed],
            self.what,
            reserve=False,  # filled by pwrite: Note [Writing rows in the background]
        )
        self.fixed: dict[int, SharedArray] = dict(zip(fixed, arrays))
        self.segment = arrays[0].segment if arrays else None
        self.var = {
            n: VarBuffer(leaf.dtype) for n, leaf in enumerate(self.leaves) if n not in fixed
        }
        self.sinks: list[list[Any]] = [[] for _ in self.leaves]
        self.start = 0  # the row of the first value in the sinks
        self.chunk = _chunk_rows(rows, sum(a.nbytes for a in arrays) // rows)
        self.writer: _Writer | None = None  # started at the first block (not before a fork)
        self.fast = _compile(self.schema, self.leaves, self.sinks)
        self.orphans: dict[int, SharedArray] = {}  # fixed leaves made ragged (their old rows)

    def run(self, items: Iterable[tuple[int, Any]], update: Callable[[int], None]) -> None:
        """Add every item (indices 0, 1, ... in order), checking each against the schema."""
        fast, chunk, pending = self.fast, self.chunk, 0
        for index, item in items:
            if not fast(item):
                self._add_checked(index, item)
                fast = self.fast
            pending += 1
            if pending == chunk:
                self._flush(pending)
                update(pending)
                pending = 0
        if pending:
            self._flush(pending)
            update(pending)
        self._close_writer()

    def run_workers(
        self, dataset: Any, workers: int, update: Callable[[int], None], offset: int = 0
    ) -> None:
        """Add every item, read and written by ``workers`` DataLoader workers in blocks.

        Note [Materialising with workers].
        """
        from torch.utils.data import DataLoader, Dataset

        snapshot = [(leaf.kind, leaf.ragged) for leaf in self.leaves]
        reader = _BlockReader(dataset, self.schema, self.leaves, self.fixed, self.chunk, self)
        reader.offset = offset
        loader: DataLoader[Any] = DataLoader(
            cast("Dataset[Any]", reader), batch_size=None, num_workers=workers, collate_fn=_identity
        )
        blocks = iter(loader)
        try:
            for block in blocks:
                self._add_block(block, snapshot)
                update(block.stop - block.start)
        finally:
            # End the workers now: a DataLoader's error keeps its iterator alive in the
            # traceback, and a later fork would copy it into new workers.
            shutdown = getattr(blocks, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            del blocks
        self._close_writer()

    def discard(self) -> None:
        """After a failure: stop the writer, then free the fixed-size segment at once.

        Note [Freeing a failed load] in ``_storage.py``.
        """
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        if self.segment is not None:
            self.segment.discard()

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _add_checked(self, index: int, item: Any) -> None:
        """The slow path: explain why ``item`` does not fit, or adapt the columns to it."""
        values: list[Any] = []
        _flatten(item, self.schema, values, index)
        changed = False
        for n, value in enumerate(values):
            values[n], adapted = self._accept(n, value, index)
            changed = changed or adapted
        for sink, value in zip(self.sinks, values):
            sink.append(value)
        if changed:
            self.fast = _compile(self.schema, self.leaves, self.sinks)

    def _accept(self, n: int, value: Any, index: int) -> tuple[Any, bool]:
        """``value`` as leaf ``n`` stores it, and whether the leaf had to change for it."""
        leaf, changed = self.leaves[n], False
        if leaf.kind in ("intlist", "floatlist") and type(value) is list and value:
            got = _numeric_list(value)
            if got != leaf.kind:
                if got == "floatlist" and self._only_empty_lists(n):
                    leaf.kind, leaf.dtype = "floatlist", np.dtype(np.float64)
                    self.var[n].dtype = leaf.dtype
                else:  # e.g. [] first, then [Box(...)]: keep the lists whole
                    self._to_pickle(n, leaf)
                changed = True
        _check_leaf(leaf, value, index)
        if leaf.kind == "int" and not _INT64_MIN <= value <= _INT64_MAX:
            raise ItemValueError(
                f"item {index}, field {_field(leaf.path)}: {value} does not fit in the int64 "
                "column of this field. Return smaller ints, or a str or a float for this one."
            )
        if leaf.kind in ("tensor", "ndarray"):
            if leaf.kind == "tensor":
                value = value.detach()
            if value.ndim != len(leaf.shape):
                raise ItemMismatchError(
                    f"item {index}, field {_field(leaf.path)}: {_describe(value)} has "
                    f"{value.ndim} dimensions, item 0's had {len(leaf.shape)} {leaf.shape}. "
                    "Shapes may vary, but not the number of dimensions."
                )
            if not leaf.ragged and tuple(value.shape) != leaf.shape:
                self._to_ragged(n, leaf)
                changed = True
        return value, changed

    def _only_empty_lists(self, n: int) -> bool:
        return not self.var[n].values and not any(self.sinks[n])

    def _to_ragged(self, n: int, leaf: _Leaf) -> None:
        """The shape of leaf ``n`` varies: keep its values + shapes instead of fixed rows."""
        if self.writer is not None:
            self.writer.wait()  # rows [0, start) are in the segment: read them back
        self.orphans[n] = self.fixed.pop(n)
        done = np.ascontiguousarray(self.orphans[n].numpy()[: self.start])
        buffer = VarBuffer(leaf.dtype)
        buffer.extend(done.tobytes(), [math.prod(leaf.shape)] * self.start)
        buffer.shapes = [leaf.shape] * self.start
        leaf.ragged = True
        self.var[n] = buffer  # rows still in the sink are added to it when flushed

    def _to_pickle(self, n: int, leaf: _Leaf) -> None:
        """Leaf ``n`` stops being a list of numbers: keep every list pickled instead."""
        old = self.var[n]
        values = np.frombuffer(old.values, old.dtype)
        blobs = [
            pickle.dumps(values[a:b].tolist(), protocol=pickle.HIGHEST_PROTOCOL)
            for a, b in zip(old.offsets[:-1], old.offsets[1:])
        ]
        buffer = VarBuffer(np.uint8)
        buffer.extend(b"".join(blobs), map(len, blobs))
        leaf.kind, leaf.dtype = "pickle", np.dtype(np.uint8)
        self.var[n] = buffer

    def _add_block(self, block: _Block, snapshot: list[tuple[str, bool]]) -> None:
        """Add the rows a worker read (Note [Materialising with workers])."""
        rows = block.stop - block.start
        if block.items is not None:  # not every item fitted the columns: add them one by one
            fast = self.fast
            for index, boxed in enumerate(block.items, block.start):
                item = _unbox(boxed)
                if not fast(item):
                    self._add_checked(index, item)
                    fast = self.fast
            self._flush(rows)
            return
        var = block.var
        if var is None:  # a worker sends either the items or the var leaves' values
            raise RuntimeError(f"rows {block.start}-{block.stop} came back with no values")
        changed = False
        for n, (leaf, sink) in enumerate(zip(self.leaves, self.sinks)):
            if n in self.fixed:
                continue  # the worker wrote the rows
            if n in self.orphans:  # fixed when the workers started, ragged since
                sink.extend(self.orphans[n].numpy()[block.start : block.stop])
            elif (leaf.kind, leaf.ragged) == snapshot[n]:
                sink.extend(var[n])
            else:  # the leaf changed since: check each value against it
                for index, value in enumerate(var[n], block.start):
                    value, adapted = self._accept(n, value, index)
                    sink.append(value)
                    changed = changed or adapted
        if changed:
            self.fast = _compile(self.schema, self.leaves, self.sinks)
        self._flush(rows, written=True)

    def _flush(self, rows: int, written: bool = False) -> None:
        """Hand the fixed-size values to the writer; encode the variable-length ones.

        ``written``: a worker wrote the fixed-size rows; the writer only maps them.
        """
        blocks = []
        for n, (leaf, sink) in enumerate(zip(self.leaves, self.sinks)):
            if n in self.fixed:
                blocks.append((self.fixed[n], leaf, None if written else sink.copy()))
            else:
                self._put_var(n, leaf, sink)
            sink.clear()
        if blocks:
            if self.writer is None:
                assert self.segment is not None
                self.writer = _Writer(self.segment, self.chunk, self.storage_dir, self.what)
            self.writer.submit(self.start, rows, blocks)
        self.start += rows

    def _put_var(self, n: int, leaf: _Leaf, values: list[Any]) -> None:
        buffer = self.var[n]
        if leaf.ragged:
            for value in values:
                data = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
                buffer.add(np.ascontiguousarray(data).tobytes(), data.shape)
        elif leaf.kind == "str":
            self._put_text(buffer, leaf, values)
        elif leaf.kind == "bytes":
            buffer.extend(b"".join(values), map(len, values))
        elif leaf.kind in ("intlist", "floatlist"):
            total = sum(map(len, values))
            try:
                flat = np.fromiter(chain.from_iterable(values), leaf.dtype, total)
            except OverflowError:
                for j, value in enumerate(values):
                    if any(not _INT64_MIN <= v <= _INT64_MAX for v in value):
                        raise ItemValueError(
                            f"item {self.start + j}, field {_field(leaf.path)}: the list holds "
                            "an int beyond int64. Return smaller ints, or floats."
                        ) from None
                raise
            buffer.extend(flat.tobytes(), map(len, values))
        else:
            blobs = []
            for j, value in enumerate(values):
                try:
                    blobs.append(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
                except Exception as e:
                    raise UnpicklableItemError(
                        f"item {self.start + j}, field {_field(leaf.path)}: a "
                        f"{type(value).__name__} cannot be pickled ({type(e).__name__}: {e}); "
                        "SharedDataset keeps values of types it has no column for pickled. "
                        "Return a picklable value (or numbers, str, bytes, arrays) instead."
                    ) from e
            buffer.extend(b"".join(blobs), map(len, blobs))

    def _put_text(self, buffer: VarBuffer, leaf: _Leaf, values: list[str]) -> None:
        text = "".join(values)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            for j, value in enumerate(values):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ItemValueError(
                        f"item {self.start + j}, field {_field(leaf.path)}: the str is not valid "
                        f"text ({e.reason} at position {e.start}) and cannot be stored as "
                        "UTF-8. Return s.encode('utf-8', 'surrogateescape') as bytes, or "
                        "clean the text."
                    ) from e
            raise
        ascii_only = len(data) == len(text)  # then every str takes one byte per character
        lengths = map(len, values) if ascii_only else [len(v.encode("utf-8")) for v in values]
        buffer.extend(data, lengths)

    def finish(self) -> tuple[list[Part], list[str]]:
        """Copy the variable-length leaves into one shared segment; list every column."""
        layouts: list[tuple[tuple[int, ...], Any]] = []
        for n in sorted(self.var):  # leaf order: the order the columns are built in below
            buffer = self.var[n]
            layouts.append(((len(buffer.offsets),), np.int64))
            layouts.append(((len(buffer.values) // buffer.dtype.itemsize,), buffer.dtype))
            if self.leaves[n].ragged:
                layouts.append(((self.rows, len(self.leaves[n].shape)), np.int64))
        what = "SharedDataset's variable-length fields"
        shared = iter(self.alloc(layouts, what) if layouts else [])
        parts: list[Part] = []
        kinds: list[str] = []
        for n, leaf in enumerate(self.leaves):
            name = leaf.path or "value"
            if n in self.fixed:
                spec = ColumnSpec(name, self.rows, leaf.dtype, leaf.shape)
                parts.append((TensorColumn, spec, {"data": self.fixed[n]}))
            else:
                buffer = self.var.pop(n)
                offsets, values = next(shared), next(shared)
                offsets.numpy()[:] = np.frombuffer(buffer.offsets, np.int64)
                values.numpy()[:] = np.frombuffer(buffer.values, buffer.dtype)
                kind = {"str": "str", "bytes": "bytes", "pickle": "bytes"}.get(leaf.kind, "ragged")
                spec = ColumnSpec(name, self.rows, buffer.dtype, (), kind, len(values))
                cls = {"str": StringColumn, "bytes": BytesColumn, "ragged": RaggedColumn}[kind]
                parts.append((cls, spec, {"offsets": offsets, "values": values}))
                if leaf.ragged:
                    shapes = next(shared)
                    shapes.numpy()[:] = np.asarray(buffer.shapes, np.int64).reshape(shapes.shape)
                    spec = ColumnSpec(
                        name + ".shape", self.rows, np.dtype(np.int64), (len(leaf.shape),)
                    )
                    parts.append((TensorColumn, spec, {"data": shapes}))
                del buffer  # free the private copy now
            kinds.append(leaf.kind + ("+ragged" if leaf.ragged else ""))
        return parts, kinds


def build_columns(
    dataset: Any,
    rows: int,
    alloc: Allocator,
    update: Callable[[int], None],
    workers: int = 0,
    offset: int = 0,
) -> tuple[list[Part], list[str], Any]:
    """Materialise items ``offset .. offset + rows - 1`` of ``dataset`` into shared columns.

    Args:
        dataset: a map-style dataset.
        rows: how many items (``>= 1``).
        alloc: where the segments come from (the load frees them on failure).
        update: called with the number of items added, as they are.
        workers: read the items with a DataLoader of this many workers (0: here).
        offset: the index of the first item (a node's shard starts there).

    Returns:
        The columns' parts (by name, in leaf order), each leaf's kind (for
        :func:`restore`; ``"+ragged"`` when a ``.shape`` column follows), and the
        schema (for :func:`rebuild`).

    Raises:
        ItemMismatchError: an item whose structure or types differ from item 0's.
        ItemValueError: a value its column cannot hold.

    If anything fails, the writer is stopped and the segments freed before the
    error propagates.
    """
    builder: _Builder | None = None
    try:
        builder = _Builder(_fetch(dataset, offset), rows, alloc)
        if workers > 0:
            builder.run_workers(dataset, workers, update, offset)
        else:
            items = ((i, _fetch(dataset, i)) for i in range(offset, offset + rows))
            builder.run(items, update)
        parts, kinds = builder.finish()
    except BaseException:
        # Free the columns now, although the traceback still refers to them:
        # Note [Freeing a failed load] in _storage.py.
        if builder is not None:
            builder.discard()
        raise
    return parts, kinds, builder.schema


class DatasetProducer:
    """What ``SharedDataset`` hands the loader: the items of a map-style dataset.

    A :class:`~shareddata._load.Producer`: the sizes of variable-length fields are
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


def _fetch(dataset: Any, index: int) -> Any:
    try:
        return dataset[index]
    except Exception as e:
        note = f"while SharedDataset read item {index} of {type(dataset).__name__}"
        if hasattr(e, "add_note"):  # Python >= 3.11: keep the original exception type
            e.add_note(note)
            raise
        raise SharedDataError(f"{type(e).__name__}: {e} ({note})") from e


def _identity(x: Any) -> Any:
    return x


# -- materialising with DataLoader workers --------------------------------------------------

# Note [Materialising with workers]
# =================================
# ``SharedDataset(ds, num_workers=N)`` reads item 0 here (it fixes the schema and
# sizes the fixed-size segment), then hands blocks of ``chunk`` consecutive rows to
# a DataLoader of N workers (``_BlockReader``). A worker reads its block's items and
# runs the fast path compiled for the schema as it stood when the workers started.
# When every item fits, the worker writes the block's fixed-size rows straight into
# the shared segment (``pwrite``, as the writer thread would) and sends back only
# the variable-length values (text, lists, pickled objects): no tensor crosses a
# process boundary, and the pages are allocated by the workers, in parallel. Here
# the rows are then mapped (``MADV_POPULATE_READ``, for the PSS accounting) and the
# variable-length values added.
#
# When an item of a block does not fit (a shape that varies, a list that changes
# kind, a mismatch to report), the worker writes nothing and sends the block's
# items back (tensors as numpy arrays, which pickle by value, not through one
# shared-memory file each); they take the usual path here, in order, which names the
# index and field of an error or adapts the columns. A leaf that became ragged
# after the workers started keeps receiving fixed rows from them (they still see
# the old schema): those rows are read back from its old array (``orphans``).


@dataclass
class _Block:
    """What a worker sends back for rows ``[start, stop)``."""

    start: int
    stop: int
    var: dict[int, list[Any]] | None = None  # every item fitted: the var leaves' values
    items: list[Any] | None = None  # otherwise: the items (tensors boxed)


class _Box:
    """A tensor carried as a numpy array (pickled by value, not as a shared file)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _box(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _BOXABLE:
        return _Box(value.detach().cpu().numpy())
    if type(value) in (tuple, list):
        return type(value)(_box(v) for v in value)
    if type(value) is dict:
        return {k: _box(v) for k, v in value.items()}
    return value


def _unbox(value: Any) -> Any:
    if type(value) is _Box:
        return torch.from_numpy(value.array)
    if type(value) in (tuple, list):
        return type(value)(_unbox(v) for v in value)
    if type(value) is dict:
        return {k: _unbox(v) for k, v in value.items()}
    return value


_BOXABLE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


class _BlockReader:
    """The dataset the materialising DataLoader's workers read: one block per index."""

    def __init__(
        self,
        dataset: Any,
        schema: Any,
        leaves: list[_Leaf],
        fixed: dict[int, SharedArray],
        chunk: int,
        builder: _Builder,
    ) -> None:
        self.dataset = dataset
        self.schema = schema
        self.leaves = [dataclasses.replace(leaf) for leaf in leaves]  # as they are now
        self.fixed = dict(fixed)
        self.chunk = chunk
        self.rows = builder.rows
        self.storage_dir = builder.storage_dir
        self.what = builder.what
        self.offset = 0  # index in ``dataset`` of row 0
        self._fast: Callable[[Any], bool] | None = None
        self._sinks: list[list[Any]] = []
        self._writer: _BlockWriter | None = None

    def __len__(self) -> int:
        return -(-self.rows // self.chunk)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fast": None, "_sinks": [], "_writer": None}

    def __getitem__(self, block: int) -> _Block:
        start = block * self.chunk
        stop = min(start + self.chunk, self.rows)
        base = self.offset
        items = [_fetch(self.dataset, base + index) for index in range(start, stop)]
        if self._fast is None:
            self._sinks = [[] for _ in self.leaves]
            self._fast = _compile(self.schema, self.leaves, self._sinks)
        if not all(map(self._fast, items)):
            for sink in self._sinks:
                sink.clear()
            return _Block(start, stop, items=[_box(item) for item in items])
        with torch.no_grad():
            for n, target in self.fixed.items():
                if self._writer is None:
                    segment, chunk = target.segment, self.chunk
                    self._writer = _BlockWriter(segment, chunk, self.storage_dir, self.what)
                self._writer.write(start, stop - start, target, self.leaves[n], self._sinks[n])
        var = {n: self._sinks[n].copy() for n in range(len(self.leaves)) if n not in self.fixed}
        for sink in self._sinks:
            sink.clear()
        return _Block(start, stop, var=var)
