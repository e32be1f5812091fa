"""Items checked against the schema, adapted where they differ, written into columns.

The schema comes from the first item (``columns/_items.py``); a later item that does
not fit is explained (``ItemMismatchError``, ``ItemValueError``) or adapts the columns
(a fixed-size leaf turns ragged, a list turns pickled). Fixed-size rows go through
a background writer (``_writer.py``), variable-length values to growing shared files.
"""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..._compat import shutdown_dataloader_iterator
from ...columns._columns import COLUMN_KINDS, ColumnSpec, TensorColumn
from ...columns._items import (
    FIXED,
    INT64_MAX,
    INT64_MIN,
    Leaf,
    LeafType,
    check_leaf,
    compile_fast_path,
    describe_value,
    field_name,
    flatten,
    host_numpy,
    infer_schema,
    numeric_list,
    plain_tensor,
)
from ...distributed import sample_digest
from ...errors import InvalidArgumentError, ItemMismatchError, ItemValueError, UnpicklableItemError
from ...storage import SharedArray
from ...storage._capacity import private_peak
from ...storage._writer import VarStore
from .._load import Allocator, Part, progress_bar
from ._writer import TRIM_BYTES, Block, BlockReader, HeapTrim, Writer, chunk_rows, fetch, identity

__all__ = ["Builder", "DatasetProducer"]

_VAR_CHUNK_BYTES = 16 << 20  # variable-length bytes of the items held until a flush
_WORKER_BYTES = 32 << 20  # a forked worker's own pages (copied on write, its interpreter's)


class DatasetProducer:
    """What ``SharedDataset`` hands the loader (a ``Producer``): the dataset's items.

    After them, three items are read twice more (Note [A random item is frozen]);
    :attr:`varies` is one that differed.
    """

    varies: int | None = None

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
        rows, span = self.stop - self.start, range(self.start, self.stop)
        if rows == 0:
            raise InvalidArgumentError(
                f"this node's share of {self.label} (items {self.start}-{self.stop} of "
                f"{self.total_rows()}) is empty: there is nothing to share. Use shard=None, or "
                "fewer nodes than items."
            )
        dataset, workers, builder = self.dataset, self.num_workers, None
        try:
            builder = Builder(fetch(dataset, self.start), rows, alloc, workers)
            with (
                private_peak(builder.outstanding),  # Note [A load is refused, never killed]
                progress_bar(rows, f"materialising {self.label}", progress, unit="it") as update,
            ):
                builder.allocate()
                if workers > 0:
                    builder.run_workers(dataset, workers, update, self.start)
                else:
                    builder.run(((i, fetch(dataset, i)) for i in span), update)
                parts, kinds = builder.finish()
        except BaseException:
            if builder is not None:  # Note [Freeing a failed load] in storage/_segment.py
                builder.discard()
            raise
        for i in sorted({span[0], span[rows // 2], span[-1]}):
            try:
                if _digest_of_read(self.dataset, i, 1) != _digest_of_read(self.dataset, i, 2):
                    self.varies = i
                    break
            except Exception:  # the load read it once: no second read, nothing to check
                break
        return parts, (kinds, builder.schema)

    def close(self) -> None:
        """Nothing to release: the dataset belongs to the caller."""


# Note [A random item is frozen]: SharedDataset stores one read of every item, so a
# __getitem__ that augments at random would give one crop forever. Where the items are
# read, the first, middle and last are read twice more with torch, numpy and Python
# seeded differently (sample_digest restores the caller's random states), and their
# digests compared; a difference warns, naming the fix (the random part to transform=).


def _digest_of_read(dataset: Any, i: int, seed: int) -> str:
    def read(_: int) -> Any:
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        return dataset[i]

    return sample_digest(read, 1)


class Builder:
    """Collects the items of a dataset into shared columns, in index order.

    Made from item 0; then :meth:`allocate`, :meth:`run` or :meth:`run_workers`, :meth:`finish`.
    """

    what = "SharedDataset's fixed-size fields"

    def __init__(self, first: Any, rows: int, alloc: Allocator, workers: int = 0) -> None:
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
        self.fixed: dict[int, SharedArray] = {}
        self.segment: Any = None
        self._fixed = [n for n, leaf in enumerate(self.leaves) if leaf.kind in FIXED]
        self.fixed_row_bytes = sum(
            math.prod(self.leaves[n].shape) * self.leaves[n].dtype.itemsize for n in self._fixed
        )
        self.trim = HeapTrim()  # Note [Items freed back to the system] in _writer.py
        row_bytes = self.fixed_row_bytes + self._var_bytes(first)
        self.chunk = chunk_rows(rows, row_bytes)
        self.workers = workers
        self.private = self._private_peak(row_bytes, workers)
        self.var: dict[int, VarStore] = {}
        self.sinks: list[list[Any]] = [[] for _ in self.leaves]
        self.start = 0  # the row of the first value in the sinks
        self.writer: Writer | None = None  # started at the first block (not before a fork)
        self.fast = compile_fast_path(self.schema, self.leaves, self.sinks)
        self.orphans: dict[int, SharedArray] = {}  # fixed leaves made ragged (their old rows)

    def _private_peak(self, row_bytes: int, workers: int) -> int:
        """The private memory this materialisation needs at most, besides its segments.

        Blocks of ``chunk`` rows (filling, queued, written, staged; a worker's own and
        prefetched ones), per row the offsets (and shapes) of variable-length leaves,
        their pending values, and up to ``TRIM_BYTES`` of freed items.
        """
        block = self.chunk * row_bytes
        var = [leaf for leaf in self.leaves if leaf.kind not in FIXED]
        per_row = sum(8 + (80 if leaf.ragged else 0) for leaf in var)
        per_worker = 4 * block + TRIM_BYTES + _WORKER_BYTES
        blocks = 6 * block + TRIM_BYTES + len(var) * _VAR_CHUNK_BYTES
        return blocks + workers * per_worker + self.rows * per_row

    def outstanding(self) -> int:
        """Bytes still to take: :attr:`private` and the fixed segment's unwritten rows.

        What the load's capacity checks count (Note [A load is refused, never killed] in
        ``storage/_capacity.py``); workers still write a leaf made ragged since.
        """
        arrays = [*self.fixed.values(), *(self.orphans.values() if self.workers else ())]
        rows = self.rows - self.start
        return self.private + sum(a.nbytes // self.rows * rows for a in arrays)

    def allocate(self) -> None:
        """Make the fixed-size segment (the capacity checked) and the variable-length stores."""
        arrays = self.alloc(
            [((self.rows, *self.leaves[n].shape), self.leaves[n].dtype) for n in self._fixed],
            self.what,
            reserve=False,  # filled by pwrite: Note [Writing rows in the background]
        )
        self.fixed = dict(zip(self._fixed, arrays))
        self.segment = arrays[0].segment if arrays else None
        var = [n for n in range(len(self.leaves)) if n not in self.fixed]
        self.var = {n: self._store(n, self.leaves[n].dtype) for n in var}

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
            try:
                size = value.nbytes
            except (AttributeError, RuntimeError):  # none, or a sparse tensor's
                size = 8 * len(value) if isinstance(value, (str, bytes, list)) else 64
            total += int(size)
        return total

    def run(self, items: Iterable[tuple[int, Any]], update: Callable[[int], None]) -> None:
        """Add every item, in order, checking each against the schema."""
        fast, pending = self.fast, 0
        for index, item in items:
            if not fast(item):
                self._add_checked(index, item)
                fast = self.fast
            pending += 1
            if pending >= self.chunk:  # _flush may shrink the chunk
                self._flush(pending)
                update(pending)
                pending = 0
        if pending:
            self._flush(pending)
            update(pending)

    def run_workers(
        self, dataset: Any, workers: int, update: Callable[[int], None], offset: int = 0
    ) -> None:
        """Add every item, read and written by DataLoader workers in blocks.

        Note [Materialising with workers].
        """
        snapshot = [(leaf.kind, leaf.ragged) for leaf in self.leaves]
        reader = BlockReader(
            dataset, self.schema, self.leaves, self.fixed, self.chunk,
            self.rows, self.storage_dir, self.what, offset,
        )  # fmt: skip
        loader = DataLoader(reader, batch_size=None, num_workers=workers, collate_fn=identity)  # type: ignore[arg-type,var-annotated]
        blocks = iter(loader)
        try:
            for block in blocks:
                self._add_block(block, snapshot)
                update(block.stop - block.start)
        finally:
            # End the workers now: a DataLoader's error keeps its iterator alive in the
            # traceback, and a later fork would copy it into new workers.
            shutdown_dataloader_iterator(blocks)
            del blocks

    def discard(self) -> None:
        """After a failure: stop the writer, then free the segments at once."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        if self.segment is not None:
            self.segment.discard()
        for store in self.var.values():
            store.discard()

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
                if got == "floatlist" and not self.var[n].nbytes and not any(self.sinks[n]):
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
                value = plain_tensor(value)  # its data: the type comes back from the leaf
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
        old, self.var[n] = self.var[n], self._store(n, np.uint8)  # discard() frees the new one
        leaf.kind, leaf.dtype = "pickle", np.dtype(np.uint8)
        offsets, step = old.offsets, 4096
        try:
            for first in range(0, len(offsets) - 1, step):  # a block of rows at a time
                bounds = offsets[first : first + step + 1]
                values = old.read(bounds[0], bounds[-1])
                base = bounds[0]
                rows = zip(bounds[:-1], bounds[1:])
                self._put_var(n, leaf, [values[a - base : b - base].tolist() for a, b in rows])
        finally:
            old.discard()

    def _add_block(self, block: Block, snapshot: list[tuple[str, bool]]) -> None:
        """Add the rows a worker read (Note [Materialising with workers])."""
        if block.items is not None:  # not every item fitted the columns: add them one by one
            self.run(enumerate(block.items, block.start), lambda rows: None)
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
        self._flush(block.stop - block.start, written=True)

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
        self.trim(var_bytes + rows * self.fixed_row_bytes)

    def _put_var(self, n: int, leaf: Leaf, values: list[Any]) -> None:
        buffer = self.var[n]
        if leaf.ragged:
            for value in values:
                data = host_numpy(value) if isinstance(value, torch.Tensor) else value
                data = np.ascontiguousarray(data, dtype=leaf.dtype)  # native byte order
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

    def finish(self) -> tuple[list[Part], list[LeafType]]:
        """Every column; the variable-length files become segments as they are.

        Each file gets its offsets written after its values (one segment per leaf);
        the shapes of ragged leaves go into one small segment (Note [Variable-length
        values go to shared memory as they come] in ``storage/_writer.py``).
        """
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        ragged = [n for n in self.var if self.leaves[n].ragged]
        layouts = [((self.rows, len(self.leaves[n].shape)), np.int64) for n in ragged]
        what = "SharedDataset's ragged shapes"
        shapes = dict(zip(ragged, self.alloc(layouts, what) if layouts else []))
        parts: list[Part] = []
        kinds: list[LeafType] = []
        taken: set[str] = set()

        def unique(name: str) -> str:
            """``name``, or ``name~2``... where paths coincide (``{"a.b": 1, "a": {"b": 2}}``)."""
            made, k = name, 1
            while made in taken:
                k += 1
                made = f"{name}~{k}"
            taken.add(made)
            return made

        for n, leaf in enumerate(self.leaves):
            name = unique(leaf.path or "value")
            kinds.append(LeafType.of(leaf))
            if n in self.fixed:
                spec = ColumnSpec(name, self.rows, leaf.dtype, leaf.shape)
                parts.append((TensorColumn, spec, {"data": self.fixed[n]}))
                continue
            values, offsets = self.var[n].finish_with_offsets()
            self.alloc.adopt(values.segment)
            buffer = self.var.pop(n)  # its private offsets go with it
            kind = {"str": "str", "bytes": "bytes", "pickle": "bytes"}.get(leaf.kind, "ragged")
            spec = ColumnSpec(name, self.rows, buffer.dtype, (), kind, len(values))
            parts.append((COLUMN_KINDS[kind], spec, {"offsets": offsets, "values": values}))
            if n in shapes:
                data = shapes[n]
                data.numpy()[:] = np.asarray(buffer.shapes, np.int64).reshape(data.shape)
                spec = ColumnSpec(
                    unique(name + ".shape"), self.rows, np.dtype(np.int64), (len(leaf.shape),)
                )
                parts.append((TensorColumn, spec, {"data": data}))
        return parts, kinds
