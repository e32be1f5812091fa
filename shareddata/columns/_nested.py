"""Nested columns: lists of records, of strings, of lists, in flat shared buffers.

A ``"nested"`` column is a tree of Arrow-like levels, each in flat typed buffers: a
**list** level has ``offsets`` (int64, ``n + 1``) into its child's elements; a
**struct** level has none, each field is a child of ``n`` elements; a **str** /
**bytes** level has ``offsets`` into UTF-8 / raw ``values``; a **num** level has
``data``. The root is a list level with one element per row; the tree and each
level's counts are in the :class:`NestedSpec`. A row comes back as pyarrow's
``to_pylist()`` gives it, except that a list of numbers is a 1-D tensor (in a worker,
a view of the batch's one memfd); with ``records=False`` a list of structs is a dict
of lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch

from ..storage import SharedArray
from ._columns import (
    COLUMN_KINDS,
    Column,
    ColumnSpec,
    Fill,
    Parts,
    as_is,
    gather_rows,
    row_elements,
    torch_dtype,
)

__all__ = ["Level", "NestedColumn", "NestedSpec", "children"]

_NOT_ARROW = {"bool", "float16"}  # num dtypes Note [Gathering through Arrow] leaves out


@dataclass(frozen=True)
class Level:
    """One level of a nested column's tree.

    ``kind`` is ``"list"``, ``"struct"``, ``"str"``, ``"bytes"`` or ``"num"``;
    ``dtype`` a num level's numpy dtype; ``names`` a struct's field names;
    ``children`` one for a list, one per field for a struct.
    """

    kind: str
    dtype: str = "uint8"
    names: tuple[str, ...] = ()
    children: tuple[Level, ...] = ()

    def describe(self) -> str:
        """The Arrow-like type, e.g. ``list<struct<role: str, content: str>>``."""
        if self.kind == "list":
            return f"list<{self.children[0].describe()}>"
        if self.kind == "struct":
            inner = ", ".join(f"{n}: {c.describe()}" for n, c in zip(self.names, self.children))
            return f"struct<{inner}>"
        return self.dtype if self.kind == "num" else self.kind


@dataclass(frozen=True)
class NestedSpec(ColumnSpec):
    """A :class:`ColumnSpec` for a ``"nested"`` column.

    ``counts``: per level (preorder), ``(elements, value bytes of str/bytes levels)``;
    ``records``: a list of structs comes back as a list of dicts (else a dict of lists).
    """

    tree: Level = field(default_factory=lambda: Level("list", children=(Level("num"),)))
    counts: tuple[tuple[int, int], ...] = ()
    records: bool = True

    def describe(self) -> str:
        return self.tree.describe()


def children(tree: Level) -> list[tuple[Level, tuple[int, ...]]]:
    """Per level (preorder), the level and the preorder indices of its children."""
    out: list[tuple[Level, tuple[int, ...]]] = []

    def walk(level: Level) -> int:
        i = len(out)
        out.append((level, ()))
        out[i] = (level, tuple(walk(c) for c in level.children))
        return i

    walk(tree)
    return out


class NestedColumn(Column):
    """Rows of nested lists/records, decoded from flat shared buffers on access.

    Example:
        >>> tree = Level("list", children=(Level("struct", names=("role", "n"),
        ...     children=(Level("str"), Level("num", "int32"))),))
        >>> spec = NestedSpec("m", 2, np.dtype(np.uint8), (), "nested", tree=tree,
        ...                   counts=((2, 0), (2, 0), (2, 7), (2, 0)))
        >>> col = NestedColumn.over(spec, {"0.offsets": [0, 2, 2], "2.offsets": [0, 4, 7],
        ...     "2.values": np.frombuffer(b"userbot", np.uint8), "3.data": np.int32([1, 2])})
        >>> col.get(0)
        [{'role': 'user', 'n': 1}, {'role': 'bot', 'n': 2}]
        >>> col.gather(torch.tensor([1, 0]))
        [[], [{'role': 'user', 'n': 1}, {'role': 'bot', 'n': 2}]]
    """

    kind = "nested"
    split = staticmethod(as_is)

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        assert isinstance(spec, NestedSpec)
        self._tree = children(spec.tree)
        self._np = {k: a.numpy() for k, a in arrays.items()}
        self._records = spec.records
        # (list level, its numbers' level) of every list of numbers (1-D tensors)
        self._tensor_levels = [
            (i, kids[0])
            for i, (level, kids) in enumerate(self._tree)
            if level.kind == "list" and self._tree[kids[0]][0].kind == "num"
        ]
        self._arrow: Any = None  # built on first use: Note [Gathering through Arrow]
        # where Arrow's to_pylist gives what the Python path gives
        numbers = {level.dtype for level, _ in self._tree if level.kind == "num"}
        self._arrow_ok = spec.records and not self._tensor_levels and not numbers & _NOT_ARROW

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, Any]:
        """Buffers ``"<level>.offsets"``, ``".values"``, ``".data"`` of each level."""
        assert isinstance(spec, NestedSpec)
        out: dict[str, Any] = {}
        for i, ((level, _), (n, values)) in enumerate(zip(children(spec.tree), spec.counts)):
            if level.kind in ("list", "str", "bytes"):
                out[f"{i}.offsets"] = ((n + 1,), np.dtype(np.int64))
            if level.kind in ("str", "bytes"):
                out[f"{i}.values"] = ((values,), np.dtype(np.uint8))
            elif level.kind == "num":
                out[f"{i}.data"] = ((n,), np.dtype(level.dtype))
        return out

    def _range(
        self, i: int, start: int, stop: int, supply: dict[int, Iterator[Any]] | None = None
    ) -> Any:
        """The values of elements ``[start, stop)`` of level ``i`` (a list, or a dict).

        ``supply``: per list-of-numbers level, its tensors in visiting order, already
        gathered (:meth:`gather_plan`); None copies each one.
        """
        level, kids = self._tree[i]
        if level.kind == "num":
            return self._np[f"{i}.data"][start:stop].tolist()
        if level.kind == "struct":
            fields = [self._range(k, start, stop, supply) for k in kids]
            if self._records:
                return [dict(zip(level.names, row)) for row in zip(*fields)]
            return dict(zip(level.names, fields))
        offsets = self._np[f"{i}.offsets"][start : stop + 1].tolist()
        pairs = zip(offsets, offsets[1:])
        if level.kind in ("str", "bytes"):
            values = self._np[f"{i}.values"]
            if level.kind == "bytes":
                return [values[a:b].tobytes() for a, b in pairs]
            return [values[a:b].tobytes().decode("utf-8") for a, b in pairs]
        (k,) = kids
        child = self._tree[k][0]
        if child.kind == "num":  # a list of numbers: a 1-D tensor, as in a "ragged" column
            if supply is not None:
                return list(islice(supply[i], stop - start))
            data = self._np[f"{k}.data"]
            return [torch.from_numpy(data[a:b].copy()) for a, b in pairs]
        if child.kind == "struct" and not self._records:
            return [self._range(k, a, b, supply) for a, b in pairs]
        if offsets[0] == offsets[-1]:
            return [[] for _ in range(len(offsets) - 1)]
        flat = self._range(k, offsets[0], offsets[-1], supply)
        base = offsets[0]
        return [flat[a - base : b - base] for a, b in pairs]

    def get(self, index: int) -> Any:
        return self._range(0, index, index + 1)[0]

    def gather(self, indices: torch.Tensor) -> Any:
        """The rows ``indices`` (Note [Gathering through Arrow] where it serves)."""
        arrow = self._as_arrow() if self._arrow_ok else None
        if arrow is not None:
            import pyarrow as pa

            return arrow.take(pa.array(indices.numpy())).to_pylist()
        return [self._range(0, i, i + 1)[0] for i in indices.tolist()]

    def _row_ranges(self, idx: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per level (preorder), each row's elements there: ``(starts, stops)``.

        A row's elements are contiguous at every level (Arrow's layout).
        """
        ranges: list[tuple[np.ndarray, np.ndarray]] = [(idx, idx)] * len(self._tree)
        ranges[0] = (idx, idx + 1)
        for i, (level, kids) in enumerate(self._tree):
            starts, stops = ranges[i]
            if level.kind == "list":
                offsets = self._np[f"{i}.offsets"]
                starts, stops = offsets[starts], offsets[stops]
            for k in kids:
                ranges[k] = (starts, stops)
        return ranges

    def gather_plan(self, indices: torch.Tensor) -> tuple[Parts, Fill]:
        """One buffer per list-of-numbers level (text and records cross by value)."""
        if not self._tensor_levels:
            return super().gather_plan(indices)
        idx = indices.numpy()
        ranges = self._row_ranges(idx)
        parts: Parts = [
            ((int((ranges[k][1] - ranges[k][0]).sum()),), torch_dtype(self._np[f"{k}.data"].dtype))
            for _, k in self._tensor_levels
        ]

        def fill(outs: list[torch.Tensor]) -> Any:
            supply: dict[int, Iterator[Any]] = {}
            for (i, k), out in zip(self._tensor_levels, outs):
                # the rows' numbers side by side (they fill ``out``), one view per list
                offsets, lists = self._np[f"{i}.offsets"], row_elements(*ranges[i])[0]
                lengths = (offsets[lists + 1] - offsets[lists]).tolist()
                supply[i] = iter(gather_rows(self._np[f"{k}.data"], *ranges[k], out, lengths))
            return [self._range(0, r, r + 1, supply)[0] for r in idx.tolist()]

        return parts, fill

    def _as_arrow(self) -> Any:
        """An Arrow array over the shared buffers (no copy), or None without pyarrow.

        Note [Gathering through Arrow]
        ------------------------------
        The levels are Arrow's own layout, so a ``large_list<struct<...>>`` can be laid
        over the shared buffers without a copy, and a batch is ``take`` + ``to_pylist``
        (the Python values built in C++) instead of one Python call per element. Used
        where the values are the same as the Python path's: ``records=True``, no lists
        of numbers (tensors there), no bool or float16 levels.
        """
        if self._arrow is None:
            try:
                import pyarrow as pa
            except ImportError:
                self._arrow_ok = False
                return None
            counts = self.spec.counts  # type: ignore[attr-defined]

            def build(i: int) -> Any:
                level, kids = self._tree[i]
                n = counts[i][0]
                if level.kind == "struct":
                    return pa.StructArray.from_arrays([build(k) for k in kids], list(level.names))
                if level.kind == "num":
                    data = self._np[f"{i}.data"]
                    return pa.Array.from_buffers(
                        pa.from_numpy_dtype(data.dtype), n, [None, pa.py_buffer(data)]
                    )
                offsets = pa.py_buffer(self._np[f"{i}.offsets"])
                if level.kind == "list":
                    child = build(kids[0])
                    return pa.Array.from_buffers(
                        pa.large_list(child.type), n, [None, offsets], children=[child]
                    )
                kind = pa.large_string() if level.kind == "str" else pa.large_binary()
                values = pa.py_buffer(self._np[f"{i}.values"])
                return pa.Array.from_buffers(kind, n, [None, offsets, values])

            self._arrow = build(0)
        return self._arrow


COLUMN_KINDS.setdefault(NestedColumn.kind, NestedColumn)
