"""Columns: typed views over shared arrays that fetch one row or gather a batch.

A source describes each column with a :class:`ColumnSpec` (name, rows, dtype,
row shape, kind). The loader asks the column class for the buffers that kind
needs (:meth:`Column.layout`), allocates all of a dataset's buffers in one shared
segment, lets the source fill them, and builds the column over them.

Kinds (``Column.kind``, registered in :data:`COLUMN_KINDS`):

* ``"tensor"``: fixed-shape numeric rows in one ``(rows, *shape)`` array.
* ``"ragged"``, ``"str"``, ``"bytes"``: variable-length rows in Arrow's layout, an
  ``offsets`` array (int64, ``rows + 1``) into one ``values`` buffer; row ``i`` is
  ``values[offsets[i]:offsets[i + 1]]`` (numbers for ``ragged``, UTF-8 or raw
  bytes for the others). No Python object per row exists in any process, which is
  what keeps memory flat under ``fork`` (pytorch/pytorch#13246).

Columns never hand out views of shared memory: a fetched row or batch is a
fresh tensor, so a sample that a worker (or the user) writes to cannot change the
data that other processes read.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import AttachError
from ..storage import SharedArray, to_numpy_dtype

__all__ = [
    "COLUMN_KINDS",
    "Alloc",
    "BytesColumn",
    "Column",
    "ColumnSpec",
    "RaggedColumn",
    "StringColumn",
    "TensorColumn",
    "gather_rows",
]


Alloc = Callable[[list[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor]]
"""Makes empty tensors of the given ``(shape, dtype)`` parts: where a batch is gathered."""


@dataclass(frozen=True)
class ColumnSpec:
    """What a source says about one column before anything is allocated.

    Attributes:
        name: column name.
        rows: number of rows.
        dtype: element dtype (numpy).
        shape: shape of one row (``()`` for a scalar column).
        kind: which :class:`Column` class stores it (a key of :data:`COLUMN_KINDS`).
        values: for variable-length kinds, the total number of value elements.
    """

    name: str
    rows: int
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    kind: str = "tensor"
    values: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this column takes in shared memory."""
        return sum(
            math.prod(shape) * to_numpy_dtype(dtype).itemsize
            for shape, dtype in COLUMN_KINDS[self.kind].layout(self).values()
        )

    def describe(self) -> str:
        """A short human description, e.g. ``float32 (3, 32, 32)``."""
        return f"{self.dtype} {self.shape}" if self.kind == "tensor" else self.kind


class Column(ABC):
    """One column of a dataset, over buffers in shared memory.

    Subclasses define :meth:`layout` (the buffers a spec needs), :meth:`get`
    (one row), :meth:`gather` (a batch for int64 indices already checked against
    ``len``) and :meth:`split` (a gathered batch back into per-row values).
    """

    kind: ClassVar[str]

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        self.spec = spec
        self.arrays = arrays

    @staticmethod
    @abstractmethod
    def layout(spec: ColumnSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The named buffers (shape, dtype) this kind needs for ``spec``."""

    @abstractmethod
    def get(self, index: int) -> Any:
        """The value of row ``index`` (0 <= index < len)."""

    @abstractmethod
    def gather(self, indices: torch.Tensor, alloc: Alloc | None = None) -> Any:
        """The batched values of rows ``indices`` (int64, in range).

        Args:
            indices: 1-D int64 tensor of row numbers.
            alloc: where the batch's tensors go (the buffers of :meth:`batch_parts`,
                all at once); ``None``: fresh private memory. A DataLoader worker passes
                its batch allocator, so the batch leaves the worker without another copy.
        """

    @abstractmethod
    def split(self, batch: Any) -> list[Any]:
        """Per-row values of a batch returned by :meth:`gather`."""

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The buffers (shape, dtype) that :meth:`gather_into` fills for rows ``indices``.

        A worker allocates the parts of every column of a batch in ONE memfd (Note
        [How a batch leaves a worker] in ``crossing/_outbox.py``). Empty: the column's
        rows are Python objects (text, bytes), which cross by value.
        """
        return []

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> Any:
        """:meth:`gather` into the buffers of :meth:`batch_parts` (same order)."""
        return self.gather(indices)

    @property
    def name(self) -> str:
        """The column's name."""
        return self.spec.name

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory."""
        return sum(a.nbytes for a in self.arrays.values())

    def __len__(self) -> int:
        return self.spec.rows

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "arrays": self.arrays}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild over the received arrays; never raises (Note [A column that cannot be attached]).

        Note [A column that cannot be attached]
        ---------------------------------------
        A dataset received from a process that no longer holds its segments (a pool
        worker that built it and exited, a SIGKILLed sender) cannot be mapped. Its
        arrays unpickle anyway (``_storage/_array.py``'s ``_rebuild`` never raises) and raise
        :class:`~shareddata.AttachError` where they are used, and a column is unpickled
        the same way: unpickling may run in a ``multiprocessing.Pool``'s result-handler
        thread, which an exception kills silently, leaving ``pool.map`` waiting forever
        (issue 14). So the column records the failure; its spec (length, dtype) stays
        readable, and the first access to its data raises the ``AttachError`` in the
        caller's thread (``__getattr__`` below: the attributes over the data were
        never set). Every dataset made of columns (``NumpyDataset`` and the other
        file kinds, ``ArrowDataset``, ``SharedDataset``, ``SharedList``) arrives this way.
        """
        try:
            self.__init__(state["spec"], state["arrays"])  # type: ignore[misc]
        except AttachError as e:
            self.spec, self.arrays = state["spec"], state["arrays"]
            self._unattached = AttachError(
                f"column {self.spec.name!r} of a dataset received from another process "
                f"cannot be read: {e}"
            )

    def __getattr__(self, name: str) -> Any:
        # only for attributes not set: those over the data of an unattached column
        error = self.__dict__.get("_unattached")
        if error is not None and not name.startswith("__"):
            raise AttachError(str(error))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.spec.describe()}, rows={len(self)})"


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that the numpy buffer is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class TensorColumn(Column):
    """Fixed-shape numeric rows: row ``i`` is ``data[i]``.

    Example:
        >>> col = TensorColumn.from_array("x", np.arange(6, dtype=np.int32).reshape(3, 2))
        >>> col.get(1)
        tensor([2, 3], dtype=torch.int32)
        >>> col.gather(torch.tensor([2, 0]))
        tensor([[4, 5],
                [0, 1]], dtype=torch.int32)
    """

    kind = "tensor"

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        self._data = _readonly_tensor(arrays["data"].numpy())
        self._np = arrays["data"].numpy()
        self._torch_gather = True

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
        """One array of shape ``(rows, *shape)``."""
        return {"data": ((spec.rows, *spec.shape), spec.dtype)}

    @classmethod
    def from_array(cls, name: str, array: np.ndarray) -> TensorColumn:
        """A column holding a copy of ``array`` (for tests and small data)."""
        spec = ColumnSpec(name, len(array), array.dtype, tuple(array.shape[1:]))
        data = SharedArray.from_array(array)
        return cls(spec, {"data": data.readonly()})

    def get(self, index: int) -> torch.Tensor:
        """A copy of row ``index`` (a 0-d tensor for a scalar column)."""
        return self._data[index].clone()

    def gather(
        self, indices: torch.Tensor, alloc: Alloc | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``indices`` stacked, in one ``index_select`` (into ``out`` when given).

        Raises ``IndexError`` for an index outside ``[0, len)`` (negatives too),
        like ``index_select`` itself; ``ColumnDataset`` relies on it.
        """
        if out is None and alloc is not None:
            out = alloc(self.batch_parts(indices))[0]
        if self._torch_gather:
            try:
                if out is None:
                    return torch.index_select(self._data, 0, indices)
                # into the plain alias of ``out``: no Python dispatch of its type
                torch.index_select(self._data, 0, indices, out=out.as_subclass(torch.Tensor))
                return out
            except (RuntimeError, NotImplementedError):  # dtype without a torch kernel
                self._torch_gather = False
        idx = indices.numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self._np)):  # as index_select does
            raise IndexError(f"index out of range for column {self.name!r} of {len(self)} rows")
        batch = torch.from_numpy(np.take(self._np, idx, axis=0))
        if out is None:
            return batch
        out.as_subclass(torch.Tensor).copy_(batch)
        return out

    def batch_shape(self, n: int) -> tuple[int, ...]:
        """The shape of a batch of ``n`` rows."""
        return (n, *self.spec.shape)

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One buffer: the stacked batch."""
        return [(self.batch_shape(len(indices)), self._data.dtype)]

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`gather` into ``outs[0]``."""
        return self.gather(indices, out=outs[0])

    def split(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """Views of each row of the batch."""
        return list(batch.unbind(0))


class _VarColumn(Column):
    """Rows ``values[offsets[i]:offsets[i + 1]]``; subclasses turn a slice into a value."""

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        self._offsets = arrays["offsets"].numpy()
        self._values = arrays["values"].numpy()

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``offsets`` (int64, rows + 1) and ``values`` (spec.values elements)."""
        return {"offsets": ((spec.rows + 1,), np.int64), "values": ((spec.values,), spec.dtype)}

    def _make(self, values: np.ndarray) -> Any:
        raise NotImplementedError

    def get(self, index: int) -> Any:
        """The value of row ``index``."""
        start, stop = self._offsets[index], self._offsets[index + 1]
        return self._make(self._values[start:stop].copy())

    def gather(self, indices: torch.Tensor, alloc: Alloc | None = None) -> list[Any]:
        """The rows ``indices`` as a list: one vectorised offsets lookup, one slice per row.

        Each row becomes its own Python object (a ``str``, ``bytes`` or tensor) anyway,
        so a slice per row costs no more than the object, and needs no index arrays
        (a flat gather index would take 8 bytes per byte of text).
        """
        idx = indices.numpy()
        starts = self._offsets[idx].tolist()
        stops = self._offsets[idx + 1].tolist()
        values, make = self._values, self._make
        return [make(values[a:b].copy()) for a, b in zip(starts, stops)]

    def split(self, batch: list[Any]) -> list[Any]:
        """A gathered batch is already a list of rows."""
        return batch

    @classmethod
    def from_parts(cls, name: str, parts: list[np.ndarray], dtype: np.dtype) -> Any:
        """A column over a copy of ``parts`` (one array per row)."""
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        values = np.concatenate(parts) if parts else np.zeros(0, dtype)
        spec = ColumnSpec(name, len(parts), dtype, (), cls.kind, int(offsets[-1]))
        arrays = {
            "offsets": SharedArray.from_array(offsets),
            "values": SharedArray.from_array(values),
        }
        return cls(spec, {k: a.readonly() for k, a in arrays.items()})


class RaggedColumn(_VarColumn):
    """Variable-length numeric rows, each a 1-D tensor.

    Example:
        >>> col = RaggedColumn.from_lists("t", [[1, 2], [], [3]], np.int32)
        >>> col.get(0)
        tensor([1, 2], dtype=torch.int32)
        >>> col.gather(torch.tensor([2, 1]))
        [tensor([3], dtype=torch.int32), tensor([], dtype=torch.int32)]
    """

    kind = "ragged"

    def _make(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values)

    def gather(self, indices: torch.Tensor, alloc: Alloc | None = None) -> list[Any]:
        """The rows ``indices``, each a 1-D tensor.

        With ``alloc`` (in a DataLoader worker) the rows are views of ONE buffer,
        where they are copied side by side: the batch leaves the worker as one memfd
        however many rows it has (Note [How a batch leaves a worker] in
        ``crossing/_outbox.py``), not as one shared segment per row.
        """
        if alloc is None:
            return super().gather(indices)
        return self.gather_into(indices, alloc(self.batch_parts(indices)))

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One buffer: the rows' values side by side."""
        idx = indices.numpy()
        total = int((self._offsets[idx + 1] - self._offsets[idx]).sum())
        return [((total,), _readonly_tensor(self._values[:0]).dtype)]  # no warning: read-only

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows ``indices``, copied side by side into ``outs[0]``: views of it."""
        idx = indices.numpy()
        return gather_rows(self._values, self._offsets[idx], self._offsets[idx + 1], outs[0])

    @classmethod
    def from_lists(cls, name: str, rows: list[Any], dtype: Any) -> RaggedColumn:
        """A column holding ``rows`` (for tests and small data)."""
        parts = [np.asarray(r, dtype=dtype).reshape(-1) for r in rows]
        return cls.from_parts(name, parts, np.dtype(dtype))


def gather_rows(
    values: np.ndarray, starts: np.ndarray, stops: np.ndarray, out: torch.Tensor
) -> list[torch.Tensor]:
    """Rows ``values[starts[k]:stops[k]]`` copied side by side into ``out``; views of it.

    ``out`` holds at least ``sum(stops - starts)`` elements of ``values``' dtype (a
    part of a worker's batch: its rows then leave the worker in that one memfd).

    Example:
        >>> values, out = np.arange(10, dtype=np.int32), torch.empty(3, dtype=torch.int32)
        >>> gather_rows(values, np.array([6, 0]), np.array([8, 1]), out)
        [tensor([6, 7], dtype=torch.int32), tensor([0], dtype=torch.int32)]
    """
    flat, at = out.as_subclass(torch.Tensor).numpy(), 0
    lengths = (stops - starts).tolist()
    for start, length in zip(starts.tolist(), lengths):
        flat[at : at + length] = values[start : start + length]
        at += length
    return list(out[:at].split(lengths))  # views of ``out``, of its type


class StringColumn(_VarColumn):
    """UTF-8 text rows, each a ``str``.

    Example:
        >>> col = StringColumn.from_strings("s", ["héllo", "", "x"])
        >>> col.get(0), col.gather(torch.tensor([2, 1]))
        ('héllo', ['x', ''])
    """

    kind = "str"

    def _make(self, values: np.ndarray) -> str:
        return values.tobytes().decode("utf-8")

    @classmethod
    def from_strings(cls, name: str, rows: list[str]) -> StringColumn:
        """A column holding ``rows`` (for tests and small data)."""
        parts = [np.frombuffer(r.encode("utf-8"), np.uint8) for r in rows]
        return cls.from_parts(name, parts, np.dtype(np.uint8))


class BytesColumn(_VarColumn):
    """Binary rows, each ``bytes``."""

    kind = "bytes"

    def _make(self, values: np.ndarray) -> bytes:
        return values.tobytes()


COLUMN_KINDS: dict[str, type[Column]] = {
    cls.kind: cls for cls in (TensorColumn, RaggedColumn, StringColumn, BytesColumn)
}
