"""Materialising with DataLoader workers: items read and written in blocks, in the workers.

Note [Materialising with workers] says what crosses and what does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...columns._items import Leaf, compile_fast_path
from ...errors import SharedDataError
from ...storage import SharedArray
from ._writer import BlockWriter, HeapTrim

__all__ = ["Block", "BlockReader", "box", "fetch", "identity", "unbox"]


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
# ``SharedDataset(ds, num_workers=N)`` reads item 0 here (it fixes the schema and
# sizes the fixed-size segment), then hands blocks of ``chunk`` consecutive rows to
# a DataLoader of N workers (``BlockReader``). A worker reads its block's items and
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
class Block:
    """What a worker sends back for rows ``[start, stop)``."""

    start: int
    stop: int
    var: dict[int, list[Any]] | None = None  # every item fitted: the var leaves' values
    items: list[Any] | None = None  # otherwise: the items (tensors boxed)


class _Box:
    """A tensor carried as a numpy array (pickled by value, not as a shared file).

    Or an array of another byte order (numpy's pickle before protocol 5 makes it native).
    """

    def __init__(self, array: np.ndarray, dtype: np.dtype | None = None) -> None:
        self.array, self.dtype = array, dtype


def box(value: Any) -> Any:
    """``value`` with its tensors as :class:`_Box` (a block sent back by a worker)."""
    if type(value) is torch.Tensor and not value.requires_grad and value.dtype in _BOXABLE:
        return _Box(value.cpu().numpy())  # (a Parameter, a subclass: pickled as they are)
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return _Box(value.astype(value.dtype.newbyteorder("=")), value.dtype)
    if type(value) in (tuple, list):
        return type(value)(box(v) for v in value)
    if type(value) is dict:
        return {k: box(v) for k, v in value.items()}
    return value


def unbox(value: Any) -> Any:
    """``value`` with its :class:`_Box` es as tensors again (:func:`box` undone)."""
    if type(value) is _Box:
        if value.dtype is not None:
            return value.array.astype(value.dtype)
        return torch.from_numpy(value.array)
    if type(value) in (tuple, list):
        return type(value)(unbox(v) for v in value)
    if type(value) is dict:
        return {k: unbox(v) for k, v in value.items()}
    return value


_BOXABLE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


class BlockReader:
    """The dataset the materialising DataLoader's workers read: one block per index."""

    def __init__(
        self,
        dataset: Any,
        schema: Any,
        leaves: list[Leaf],
        fixed: dict[int, SharedArray],
        chunk: int,
        rows: int,
        storage_dir: Any,
        what: str,
    ) -> None:
        self.dataset = dataset
        self.schema = schema
        self.leaves = [dataclasses.replace(leaf) for leaf in leaves]  # as they are now
        self.fixed = dict(fixed)
        self.chunk = chunk
        self.rows = rows
        self.storage_dir = storage_dir
        self.what = what
        self.offset = 0  # index in ``dataset`` of row 0
        self._fast: Callable[[Any], bool] | None = None
        self._sinks: list[list[Any]] = []
        self._writer: BlockWriter | None = None
        self._trim = HeapTrim()  # Note [Items freed back to the system] in _writer.py

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
