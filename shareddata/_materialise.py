"""Materialising any map-style dataset into shared columns (what ``SharedDataset`` runs).

Each item is split into leaves along a schema inferred from the first item
(``_items.py``); each leaf becomes one column:

* fixed-size leaves (tensors and arrays of one shape and dtype, Python and numpy
  numbers) go into one segment sized up front, written block by block from a
  background thread (Note [Writing rows in the background] in ``_writer.py``);
* variable-length leaves (``str``, ``bytes``, lists of numbers, arrays whose shape
  varies, anything else pickled) are written to a growing shared file each as they
  come, which becomes the column's segment at the end (Note [Variable-length values
  go to shared memory as they come] in ``_writer.py``); their offsets are copied into
  a last, small segment.

The segments are the loader's (``_load.build``) (``_load.build``), which frees them if anything
fails and shares them across the local ranks of a node.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any, cast

import numpy as np
import torch

from ._columns import BytesColumn, ColumnSpec, RaggedColumn, StringColumn, TensorColumn
from ._items import (
    FIXED,
    INT64_MAX,
    INT64_MIN,
    Leaf,
    check_leaf,
    compile_fast_path,
    describe_value,
    field_name,
    flatten,
    infer_schema,
    numeric_list,
    rebuild,
    restore,
)
from ._load import Allocator, Part, progress_bar
from ._storage import SharedArray
from ._writer import BlockWriter, VarStore, Writer, chunk_rows
from .errors import (
    InvalidArgumentError,
    ItemMismatchError,
    ItemValueError,
    SharedDataError,
    UnpicklableItemError,
)

__all__ = [
    "DatasetProducer",
    "ItemMismatchError",
    "ItemValueError",
    "build_columns",
    "rebuild",
    "restore",
]


# -- the builder ------------------------------------------------------------------------------

_VAR_CHUNK_BYTES = 16 << 20  # variable-length bytes of the items held until a flush


class _Builder:
    """Collects the items of a dataset into shared columns, in index order."""

    def __init__(self, first: Any, rows: int, alloc: Allocator) -> None:
        self.leaves: list[Leaf] = []
        self.schema = infer_schema(first, "", self.leaves)
        self.rows = rows
        self.alloc = alloc
        self.storage_dir = alloc.storage_dir
        for leaf in self.leaves:
            if leaf.kind in ("", "intlist"):
                leaf.kind, leaf.dtype = "intlist", np.dtype(np.int64)
            elif leaf.kind == "floatlist":
                leaf.dtype = np.dtype(np.float64)
        fixed = [n for n, leaf in enumerate(self.leaves) if leaf.kind in FIXED]
        self.what = "SharedDataset's fixed-size fields"
        arrays = alloc(
            [((rows, *self.leaves[n].shape), self.leaves[n].dtype) for n in fixed],
            self.what,
            reserve=False,  # filled by pwrite: Note [Writing rows in the background]
        )
        self.fixed: dict[int, SharedArray] = dict(zip(fixed, arrays))
        self.segment = arrays[0].segment if arrays else None
        self.var = {n: self._store(n, leaf.dtype) for n, leaf in enumerate(self.leaves)}
        for n in fixed:
            del self.var[n]
        self.sinks: list[list[Any]] = [[] for _ in self.leaves]
        self.start = 0  # the row of the first value in the sinks
        row_bytes = sum(a.nbytes for a in arrays) // rows + self._var_bytes(first)
        self.chunk = chunk_rows(rows, row_bytes)
        self.writer: Writer | None = None  # started at the first block (not before a fork)
        self.fast = compile_fast_path(self.schema, self.leaves, self.sinks)
        self.orphans: dict[int, SharedArray] = {}  # fixed leaves made ragged (their old rows)

    def _store(self, n: int, dtype: Any) -> VarStore:
        what = f"SharedDataset's field {field_name(self.leaves[n].path)}"
        return VarStore(dtype, self.storage_dir, what)

    def _var_bytes(self, first: Any) -> int:
        """About how many bytes item ``first``'s variable-length values take."""
        values: list[Any] = []
        flatten(first, self.schema, values, 0)
        total = 0
        for leaf, value in zip(self.leaves, values):
            if leaf.kind in FIXED:
                continue
            size = getattr(value, "nbytes", None)
            if size is None:
                size = 8 * len(value) if isinstance(value, (str, bytes, list)) else 64
            total += int(size)
        return total

    def run(self, items: Iterable[tuple[int, Any]], update: Callable[[int], None]) -> None:
        """Add every item (indices 0, 1, ... in order), checking each against the schema."""
        fast, pending = self.fast, 0
        for index, item in items:
            if not fast(item):
                self._add_checked(index, item)
                fast = self.fast
            pending += 1
            if pending >= self.chunk:  # the chunk shrinks for big var values: _flush
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

        Note [Freeing a failed load] in ``_storage/_segment.py``.
        """
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        if self.segment is not None:
            self.segment.discard()
        for store in self.var.values():
            store.discard()

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _add_checked(self, index: int, item: Any) -> None:
        """The slow path: explain why ``item`` does not fit, or adapt the columns to it."""
        values: list[Any] = []
        flatten(item, self.schema, values, index)
        changed = False
        for n, value in enumerate(values):
            values[n], adapted = self._accept(n, value, index)
            changed = changed or adapted
        for sink, value in zip(self.sinks, values):
            sink.append(value)
        if changed:
            self.fast = compile_fast_path(self.schema, self.leaves, self.sinks)

    def _accept(self, n: int, value: Any, index: int) -> tuple[Any, bool]:
        """``value`` as leaf ``n`` stores it, and whether the leaf had to change for it."""
        leaf, changed = self.leaves[n], False
        if leaf.kind in ("intlist", "floatlist") and type(value) is list and value:
            got = numeric_list(value)
            if got != leaf.kind:
                if got == "floatlist" and self._only_empty_lists(n):
                    leaf.kind, leaf.dtype = "floatlist", np.dtype(np.float64)
                    self.var[n].dtype = leaf.dtype
                else:  # e.g. [] first, then [Box(...)]: keep the lists whole
                    self._to_pickle(n, leaf)
                changed = True
        check_leaf(leaf, value, index)
        if leaf.kind == "int" and not INT64_MIN <= value <= INT64_MAX:
            raise ItemValueError(
                f"item {index}, field {field_name(leaf.path)}: {value} does not fit in the int64 "
                "column of this field. Return smaller ints, or a str or a float for this one."
            )
        if leaf.kind in ("tensor", "ndarray"):
            if leaf.kind == "tensor":
                value = value.detach()
            if value.ndim != len(leaf.shape):
                raise ItemMismatchError(
                    f"item {index}, field {field_name(leaf.path)}: {describe_value(value)} has "
                    f"{value.ndim} dimensions, item 0's had {len(leaf.shape)} {leaf.shape}. "
                    "Shapes may vary, but not the number of dimensions."
                )
            if not leaf.ragged and tuple(value.shape) != leaf.shape:
                self._to_ragged(n, leaf)
                changed = True
        return value, changed

    def _only_empty_lists(self, n: int) -> bool:
        return not self.var[n].nbytes and not any(self.sinks[n])

    def _to_ragged(self, n: int, leaf: Leaf) -> None:
        """The shape of leaf ``n`` varies: keep its values + shapes instead of fixed rows."""
        if self.writer is not None:
            self.writer.wait()  # rows [0, start) are in the segment: read them back
        self.orphans[n] = self.fixed.pop(n)
        done = self.orphans[n].numpy()[: self.start]  # a view of the shared rows
        buffer = self._store(n, leaf.dtype)
        buffer.extend(done.reshape(-1).view(np.uint8), [math.prod(leaf.shape)] * self.start)
        buffer.shapes = [leaf.shape] * self.start
        leaf.ragged = True
        self.var[n] = buffer  # rows still in the sink are added to it when flushed

    def _to_pickle(self, n: int, leaf: Leaf) -> None:
        """Leaf ``n`` stops being a list of numbers: keep every list pickled instead."""
        old, buffer = self.var[n], self._store(n, np.uint8)
        self.var[n] = buffer  # freed by discard() from now on
        offsets, step = old.offsets, 4096
        for first in range(0, len(offsets) - 1, step):  # a block of rows at a time
            bounds = offsets[first : first + step + 1]
            values = old.read(bounds[0], bounds[-1])
            base = bounds[0]
            blobs = [
                pickle.dumps(values[a - base : b - base].tolist(), pickle.HIGHEST_PROTOCOL)
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
            buffer.extend(b"".join(blobs), map(len, blobs))
        old.discard()
        leaf.kind, leaf.dtype = "pickle", np.dtype(np.uint8)

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
            self.fast = compile_fast_path(self.schema, self.leaves, self.sinks)
        self._flush(rows, written=True)

    def _flush(self, rows: int, written: bool = False) -> None:
        """Hand the fixed-size values to the writer; encode the variable-length ones.

        ``written``: a worker wrote the fixed-size rows; the writer only maps them.
        """
        blocks, var_bytes = [], 0
        for n, (leaf, sink) in enumerate(zip(self.leaves, self.sinks)):
            if n in self.fixed:
                blocks.append((self.fixed[n], leaf, None if written else sink.copy()))
            else:
                before = self.var[n].nbytes
                self._put_var(n, leaf, sink)
                var_bytes += self.var[n].nbytes - before
            sink.clear()
        if blocks:
            if self.writer is None:
                assert self.segment is not None
                self.writer = Writer(self.segment, self.chunk, self.storage_dir, self.what)
            self.writer.submit(self.start, rows, blocks)
        self.start += rows
        if var_bytes > _VAR_CHUNK_BYTES:  # the items held until a flush stay bounded
            self.chunk = max(1, min(self.chunk, rows * _VAR_CHUNK_BYTES // var_bytes))

    def _put_var(self, n: int, leaf: Leaf, values: list[Any]) -> None:
        buffer = self.var[n]
        if leaf.ragged:
            for value in values:
                data = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
                data = np.ascontiguousarray(data)
                buffer.add(data.reshape(-1).view(np.uint8), data.shape)
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
                    if any(not INT64_MIN <= v <= INT64_MAX for v in value):
                        raise ItemValueError(
                            f"item {self.start + j}, field {field_name(leaf.path)}: the list holds "
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
                        f"item {self.start + j}, field {field_name(leaf.path)}: a "
                        f"{type(value).__name__} cannot be pickled ({type(e).__name__}: {e}); "
                        "SharedDataset keeps values of types it has no column for pickled. "
                        "Return a picklable value (or numbers, str, bytes, arrays) instead."
                    ) from e
            buffer.extend(b"".join(blobs), map(len, blobs))

    def _put_text(self, buffer: VarStore, leaf: Leaf, values: list[str]) -> None:
        text = "".join(values)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            for j, value in enumerate(values):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ItemValueError(
                        f"item {self.start + j}, field {field_name(leaf.path)}: the str is not "
                        f"valid text ({e.reason} at position {e.start}) and cannot be stored as "
                        "UTF-8. Return s.encode('utf-8', 'surrogateescape') as bytes, or "
                        "clean the text."
                    ) from e
            raise
        ascii_only = len(data) == len(text)  # then every str takes one byte per character
        lengths = map(len, values) if ascii_only else [len(v.encode("utf-8")) for v in values]
        buffer.extend(data, lengths)

    def finish(self) -> tuple[list[Part], list[str]]:
        """Hand each variable-length file over as its column's values; list every column.

        The values' files become segments as they are; the offsets (and shapes) are
        copied into one small segment (Note [Variable-length values go to shared
        memory as they come] in ``_writer.py``).
        """
        layouts: list[tuple[tuple[int, ...], Any]] = []
        values: dict[int, SharedArray] = {}
        for n in sorted(self.var):  # leaf order: the order the columns are built in below
            buffer = self.var[n]
            segment, count = buffer.finish()
            self.alloc.adopt(segment)
            values[n] = SharedArray(segment, 0, (count,), buffer.dtype)
            layouts.append(((len(buffer.offsets),), np.int64))
            if self.leaves[n].ragged:
                layouts.append(((self.rows, len(self.leaves[n].shape)), np.int64))
        what = "SharedDataset's variable-length offsets"
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
                offsets = next(shared)
                offsets.numpy()[:] = np.frombuffer(buffer.offsets, np.int64)
                kind = {"str": "str", "bytes": "bytes", "pickle": "bytes"}.get(leaf.kind, "ragged")
                spec = ColumnSpec(name, self.rows, buffer.dtype, (), kind, len(values[n]))
                cls = {"str": StringColumn, "bytes": BytesColumn, "ragged": RaggedColumn}[kind]
                parts.append((cls, spec, {"offsets": offsets, "values": values[n]}))
                if leaf.ragged:
                    shapes = next(shared)
                    shapes.numpy()[:] = np.asarray(buffer.shapes, np.int64).reshape(shapes.shape)
                    spec = ColumnSpec(
                        name + ".shape", self.rows, np.dtype(np.int64), (len(leaf.shape),)
                    )
                    parts.append((TensorColumn, spec, {"data": shapes}))
                del buffer  # free the private offsets now
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
        # Note [Freeing a failed load] in _storage/_segment.py.
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
        leaves: list[Leaf],
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
        self._writer: BlockWriter | None = None

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
            self._fast = compile_fast_path(self.schema, self.leaves, self._sinks)
        if not all(map(self._fast, items)):
            for sink in self._sinks:
                sink.clear()
            return _Block(start, stop, items=[_box(item) for item in items])
        with torch.no_grad():
            for n, target in self.fixed.items():
                if self._writer is None:
                    segment, chunk = target.segment, self.chunk
                    self._writer = BlockWriter(segment, chunk, self.storage_dir, self.what)
                self._writer.write(start, stop - start, target, self.leaves[n], self._sinks[n])
        var = {n: self._sinks[n].copy() for n in range(len(self.leaves)) if n not in self.fixed}
        for sink in self._sinks:
            sink.clear()
        return _Block(start, stop, var=var)
