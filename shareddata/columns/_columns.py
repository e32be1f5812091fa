"""Columns: typed views over shared arrays that fetch one row or gather a batch.

A source describes each column with a :class:`ColumnSpec`; :meth:`Column.layout`
names the buffers its kind needs; the loader allocates them in one segment, the
source fills them, and the column is built over them. Kinds (:data:`COLUMN_KINDS`):
``"tensor"`` (fixed-shape rows), ``"ragged"``/``"str"``/``"bytes"`` (Arrow's
``offsets`` + ``values``: no Python object per row in any process, so memory stays
flat under ``fork``, pytorch/pytorch#13246), ``"uuid"``, and ``"nested"`` and
``"sparse"`` (their own modules). A fetched row or batch is always a fresh tensor,
never a view of shared memory.
"""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from .._compat import default_collate_fn_map
from ..errors import AttachError
from ..storage import SharedArray, to_numpy_dtype

__all__ = [
    "COLUMN_KINDS", "UUID", "BytesColumn", "Column", "ColumnSpec", "Fill", "RaggedColumn",
    "StringColumn", "TensorColumn", "UuidColumn", "as_is", "gather_rows", "row_elements",
    "torch_dtype",
]  # fmt: skip

Parts = list[tuple[tuple[int, ...], torch.dtype]]
Fill = Callable[[list[torch.Tensor]], Any]
"""Gathers a planned batch into empty tensors of its ``(shape, dtype)`` parts."""
Layout = dict[str, tuple[tuple[int, ...], Any]]


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


@dataclass(frozen=True)
class ColumnSpec:
    """What a source says about one column before anything is allocated.

    ``shape`` is one row's (``()`` for scalars), ``kind`` a key of
    :data:`COLUMN_KINDS`, ``values`` the total value elements of variable-length kinds.
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
        """A short description, e.g. ``float32 (3, 32, 32)``."""
        return f"{self.dtype} {self.shape}" if self.kind == "tensor" else self.kind


class Column:
    """One column of a dataset over buffers in shared memory.

    Subclasses define :meth:`layout`, :meth:`get` (one row), :meth:`gather` (a batch
    of int64 indices), :meth:`gather_plan` where a batch has tensors to fill in a
    worker's one memfd (Note [How a batch leaves a worker] in
    ``crossing/_transport.py``) and, for rows gathered as Python objects,
    ``split = as_is``.
    """

    kind: ClassVar[str]

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        self.spec = spec
        self.arrays = arrays

    @classmethod
    def over(cls, spec: ColumnSpec, arrays: dict[str, Any]) -> Any:
        """A column over a copy of ``arrays`` (for tests and small data)."""
        shared = {k: SharedArray.from_array(np.asarray(a)).readonly() for k, a in arrays.items()}
        return cls(spec, shared)

    @staticmethod
    def layout(spec: ColumnSpec) -> Layout:
        """The named buffers (shape, dtype) this kind needs for ``spec``."""
        raise NotImplementedError

    def get(self, index: int) -> Any:
        """The value of row ``index`` (0 <= index < len)."""
        return self.gather(torch.tensor([index]))[0]

    def gather(self, indices: torch.Tensor) -> Any:
        """The batched values of rows ``indices``, in fresh private memory."""
        raise NotImplementedError

    def split(self, batch: Any) -> list[Any]:
        """Per-row values of a batch returned by :meth:`gather`."""
        return list(batch.unbind(0))

    def gather_plan(self, indices: torch.Tensor) -> tuple[Parts, Fill]:
        """The buffers a batch of rows ``indices`` needs, and what gathers it into them.

        The rows' ranges are worked out once, for both; no part: rows cross by value.
        """
        return [], lambda outs: self.gather(indices)

    def _checked(self, indices: torch.Tensor) -> np.ndarray:
        """``indices`` as an array; ``IndexError`` for one outside ``[0, len)``, negatives too."""
        idx = indices.numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for column {self.name!r} of {len(self)} rows")
        return idx

    @property
    def name(self) -> str:
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
        """Rebuild over the received arrays; never raises.

        Note [A column that cannot be attached]
        ---------------------------------------
        A dataset from a process that no longer holds its segments cannot be mapped.
        Unpickling may run in a ``multiprocessing.Pool``'s result-handler thread, which
        an exception kills silently, leaving ``pool.map`` waiting forever (issue 14).
        So the column records the ``AttachError``; its spec stays readable, and the
        first access to its data (``__getattr__``: those attributes were never set)
        raises it in the caller's thread.
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
        error = self.__dict__.get("_unattached")
        if error is not None and not name.startswith("__"):
            raise AttachError(str(error))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.spec.describe()}, rows={len(self)})"


def as_is(batch: Any) -> Any:
    """A batch that is already the list of its rows."""
    return batch


class TensorColumn(Column):
    """Fixed-shape numeric rows: row ``i`` is ``data[i]``.

    Example:
        >>> col = TensorColumn.over(ColumnSpec("x", 3, np.int32, (2,)),
        ...                         {"data": np.arange(6, dtype=np.int32).reshape(3, 2)})
        >>> col.get(1)
        tensor([2, 3], dtype=torch.int32)
        >>> col.gather(torch.tensor([2, 0]))
        tensor([[4, 5],
                [0, 1]], dtype=torch.int32)
    """

    kind = "tensor"

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        self._np = arrays["data"].numpy()
        with warnings.catch_warnings():  # torch warns that the numpy buffer is read-only
            warnings.simplefilter("ignore", UserWarning)
            self._data = torch.from_numpy(self._np)
        self._torch_gather = True

    @staticmethod
    def layout(spec: ColumnSpec) -> Layout:
        return {"data": ((spec.rows, *spec.shape), spec.dtype)}

    def get(self, index: int) -> Any:
        """A copy of row ``index`` (a 0-d tensor for a scalar column)."""
        return self._data[index].clone()

    def gather(self, indices: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        """Rows ``indices`` stacked by one ``index_select`` (into ``out`` if given).

        Raises ``IndexError`` for an index outside ``[0, len)``, negatives too
        (``ColumnDataset`` relies on it).
        """
        if self._torch_gather:
            try:
                if out is None:
                    return torch.index_select(self._data, 0, indices)
                # into the plain alias of ``out``: no Python dispatch of its type
                torch.index_select(self._data, 0, indices, out=out.as_subclass(torch.Tensor))
                return out
            except (RuntimeError, NotImplementedError):  # dtype without a torch kernel
                self._torch_gather = False
        idx = self._checked(indices)
        if out is None:
            return torch.from_numpy(np.take(self._np, idx, axis=0))
        np.take(self._np, idx, axis=0, out=out.as_subclass(torch.Tensor).numpy())
        return out

    def gather_plan(self, indices: torch.Tensor) -> tuple[Parts, Fill]:
        parts = [((len(indices), *self.spec.shape), self._data.dtype)]
        return parts, lambda outs: self.gather(indices, outs[0])


class _VarColumn(Column):
    """Rows ``values[offsets[i]:offsets[i + 1]]``, each made a value by ``_make``."""

    split = staticmethod(as_is)

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        self._offsets = arrays["offsets"].numpy()
        self._values = arrays["values"].numpy()

    @staticmethod
    def layout(spec: ColumnSpec) -> Layout:
        return {"offsets": ((spec.rows + 1,), np.int64), "values": ((spec.values,), spec.dtype)}

    def _make(self, values: np.ndarray) -> Any:
        raise NotImplementedError

    def get(self, index: int) -> Any:
        start, stop = self._offsets[index], self._offsets[index + 1]
        return self._make(self._values[start:stop].copy())

    def gather(self, indices: torch.Tensor) -> Any:
        """The rows as a list: one slice per row (each row is its own object anyway)."""
        idx = indices.numpy()
        starts, stops = self._offsets[idx].tolist(), self._offsets[idx + 1].tolist()
        values, make = self._values, self._make
        return [make(values[a:b].copy()) for a, b in zip(starts, stops)]


class RaggedColumn(_VarColumn):
    """Variable-length numeric rows, each a 1-D tensor.

    Example:
        >>> col = RaggedColumn.over(ColumnSpec("t", 3, np.int32, (), "ragged", 3),
        ...                         {"offsets": [0, 2, 2, 3], "values": np.int32([1, 2, 3])})
        >>> col.get(0)
        tensor([1, 2], dtype=torch.int32)
        >>> col.gather(torch.tensor([2, 1]))
        [tensor([3], dtype=torch.int32), tensor([], dtype=torch.int32)]
    """

    kind = "ragged"

    def _make(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values)

    def gather_plan(self, indices: torch.Tensor) -> tuple[Parts, Fill]:
        """In a worker the rows are views of ONE buffer: one memfd per batch."""
        idx = indices.numpy()
        starts, stops = self._offsets[idx], self._offsets[idx + 1]
        parts: Parts = [((int((stops - starts).sum()),), torch_dtype(self._values.dtype))]
        return parts, lambda outs: gather_rows(self._values, starts, stops, outs[0])


def row_elements(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[starts[r], stops[r])`` of every row ``r`` in one array, and each one's row.

    Example:
        >>> pos, row = row_elements(np.array([5, 0, 2]), np.array([7, 0, 3]))
        >>> pos.tolist(), row.tolist()
        ([5, 6, 2], [0, 0, 2])
    """
    lengths = stops - starts
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    rows = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    return first + np.arange(int(lengths.sum()), dtype=np.int64), rows


def gather_rows(
    values: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    out: torch.Tensor,
    lengths: list[int] | None = None,
) -> list[torch.Tensor]:
    """Rows ``values[starts[k]:stops[k]]`` copied side by side into ``out`` (their size).

    Returns views of ``out``, of its type: one per row, or per ``lengths`` if given.

    Example:
        >>> values, out = np.arange(10, dtype=np.int32), torch.empty(3, dtype=torch.int32)
        >>> gather_rows(values, np.array([6, 0]), np.array([8, 1]), out)
        [tensor([6, 7], dtype=torch.int32), tensor([0], dtype=torch.int32)]
    """
    if len(starts):
        rows = [values[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
        np.concatenate(rows, out=out.as_subclass(torch.Tensor).numpy())
    return list(out.split((stops - starts).tolist() if lengths is None else lengths))


class StringColumn(_VarColumn):
    """UTF-8 text rows, each a ``str``.

    Example:
        >>> text = np.frombuffer("héllox".encode(), np.uint8)
        >>> col = StringColumn.over(ColumnSpec("s", 3, np.uint8, (), "str", 7),
        ...                         {"offsets": [0, 6, 6, 7], "values": text})
        >>> col.get(0), col.gather(torch.tensor([2, 1]))
        ('héllo', ['x', ''])
    """

    kind = "str"

    def _make(self, values: np.ndarray) -> str:
        return values.tobytes().decode("utf-8")


class BytesColumn(_VarColumn):
    """Binary rows, each ``bytes``."""

    kind = "bytes"

    def _make(self, values: np.ndarray) -> bytes:
        return values.tobytes()


class UUID(uuid.UUID):
    """A ``uuid.UUID`` read from a shared column, equal to the ``uuid.UUID`` of its value.

    Only this type is registered in ``default_collate_fn_map`` (which refuses
    ``uuid.UUID``): a batch of them is their list. torch's own entries are left alone
    (issue 21).

    Example:
        >>> UUID(int=5) == uuid.UUID(int=5), UUID(int=5)
        (True, UUID('00000000-0000-0000-0000-000000000005'))
    """

    __slots__ = ()


class UuidColumn(Column):
    """Rows of 16 bytes (``data`` ``(rows, 16)`` uint8), each a :class:`UUID`.

    Example:
        >>> raw = np.frombuffer(uuid.UUID(int=1).bytes + uuid.UUID(int=2).bytes, np.uint8)
        >>> spec = ColumnSpec("id", 2, np.uint8, (16,), "uuid")
        >>> col = UuidColumn.over(spec, {"data": raw.reshape(2, 16)})
        >>> col.get(1)
        UUID('00000000-0000-0000-0000-000000000002')
        >>> [u.int for u in col.gather(torch.tensor([1, 0]))]
        [2, 1]
    """

    kind = "uuid"
    split = staticmethod(as_is)
    layout = staticmethod(TensorColumn.layout)

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        self._np = arrays["data"].numpy()

    def get(self, index: int) -> uuid.UUID:
        return UUID(bytes=self._np[index].tobytes())

    def gather(self, indices: torch.Tensor) -> Any:
        """Rows ``indices`` (checked by the dataset) as a list of :class:`UUID`."""
        return [UUID(bytes=row.tobytes()) for row in self._np[indices.numpy()]]


def collate_uuids(batch: list[uuid.UUID], *, collate_fn_map: Any = None) -> list[uuid.UUID]:
    """``default_collate`` of UUIDs: the list of them, as for strings."""
    return list(batch)


COLUMN_KINDS: dict[str, type[Column]] = {
    cls.kind: cls for cls in (TensorColumn, RaggedColumn, StringColumn, BytesColumn, UuidColumn)
}
default_collate_fn_map[UUID] = collate_uuids
