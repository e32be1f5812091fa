"""Nested columns: lists of records, lists of strings, lists of lists, in flat shared buffers.

A ``"nested"`` column stores a tree of Arrow-like levels, each in flat typed buffers
(never pickled Python objects), the way Arrow lays out ``list<struct<...>>``:

* a **list** level: ``offsets`` (int64, ``n + 1``) into the elements of its child;
* a **struct** level: no buffer of its own; each field is a child level with ``n``
  elements;
* a **str** / **bytes** level: ``offsets`` (int64, ``n + 1``) into UTF-8 / raw ``values``;
* a **num** level: ``data``, one number per element.

The root is always a list level with one element per row. The tree and the
element counts of every level live in the :class:`NestedSpec`, so a worker that
unpickles the column knows the layout without reading any data.

A row comes back as the Python value ``pyarrow``'s ``to_pylist()`` gives, except
that a list of numbers is a 1-D tensor (as in a ``"ragged"`` column): a
``list<struct<role: string, content: string>>`` row is a list of dicts
``[{"role": ..., "content": ...}, ...]``, or, with ``records=False`` in the spec, a
dict of lists ``{"role": [...], "content": [...]}``.

In a DataLoader worker the lists of numbers of a gathered batch are copied side by
side into one buffer per level (:meth:`NestedColumn.batch_parts`), part of the
worker's one memfd per batch, and the row tensors are views of it: the batch
leaves the worker as that memfd, not as one shared segment per list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch

from ..storage import SharedArray
from ._columns import COLUMN_KINDS, Alloc, Column, ColumnSpec, gather_rows

__all__ = ["Level", "NestedColumn", "NestedSpec", "children"]

Supply = dict[int, Iterator[torch.Tensor]] | None
"""Per list-of-numbers level, its gathered tensors in visiting order (``gather_into``)."""


@dataclass(frozen=True)
class Level:
    """One level of a nested column's tree.

    Attributes:
        kind: ``"list"``, ``"struct"``, ``"str"``, ``"bytes"`` or ``"num"``.
        dtype: the numpy dtype of a ``"num"`` level (``"uint8"`` for others).
        names: the field names of a ``"struct"`` level.
        children: the child levels (one for a list, one per field for a struct).
    """

    kind: str
    dtype: str = "uint8"
    names: tuple[str, ...] = ()
    children: tuple[Level, ...] = ()

    def levels(self) -> list[Level]:
        """This level and every level under it, in preorder (the buffer order)."""
        out = [self]
        for child in self.children:
            out.extend(child.levels())
        return out

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
    """A :class:`ColumnSpec` for a ``"nested"`` column: its tree and level sizes.

    Attributes:
        tree: the root :class:`Level` (a list level).
        counts: per level (preorder), ``(elements, values)``: the number of elements
            at that level and, for ``str``/``bytes`` levels, the bytes of all of them.
        records: a list of structs comes back as a list of dicts (``True``) or a dict
            of lists (``False``).
    """

    tree: Level = field(default_factory=lambda: Level("list", children=(Level("num"),)))
    counts: tuple[tuple[int, int], ...] = ()
    records: bool = True

    def describe(self) -> str:
        """The column's nested type."""
        return self.tree.describe()


def level_layout(
    tree: Level, counts: tuple[tuple[int, int], ...]
) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The named flat buffers of a tree: ``"<level>.offsets"``, ``".values"``, ``".data"``."""
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for i, (level, (n, values)) in enumerate(zip(tree.levels(), counts)):
        if level.kind in ("list", "str", "bytes"):
            out[f"{i}.offsets"] = ((n + 1,), np.dtype(np.int64))
        if level.kind in ("str", "bytes"):
            out[f"{i}.values"] = ((values,), np.dtype(np.uint8))
        elif level.kind == "num":
            out[f"{i}.data"] = ((n,), np.dtype(level.dtype))
    return out


def children(tree: Level) -> list[tuple[Level, tuple[int, ...]]]:
    """Per level (preorder), the level and the preorder indices of its children."""
    out: list[tuple[Level, tuple[int, ...]]] = []

    def walk(level: Level) -> int:
        i = len(out)
        out.append((level, ()))
        kids = tuple(walk(c) for c in level.children)
        out[i] = (level, kids)
        return i

    walk(tree)
    return out


def _elements(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The indices ``[starts[r], stops[r])`` of every ``r``, in order, in one array.

    Example:
        >>> _elements(np.array([5, 0, 2]), np.array([7, 0, 3])).tolist()
        [5, 6, 2]
    """
    lengths = stops - starts
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return first + np.arange(int(lengths.sum()), dtype=first.dtype)  # type: ignore[no-any-return]


def _arrow_friendly(tree: Level) -> bool:
    """Whether Arrow's ``to_pylist`` gives this tree's values as the Python path does."""
    for level in tree.levels():
        if level.kind == "num" and level.dtype in ("bool", "float16"):
            return False
        if level.kind == "list" and level.children[0].kind == "num":
            return False  # lists of numbers come back as tensors
    return True


class NestedColumn(Column):
    """Rows of nested lists/records, decoded from flat shared buffers on access.

    Example:
        >>> tree = Level("list", children=(Level("struct", names=("role", "n"),
        ...     children=(Level("str"), Level("num", "int32"))),))
        >>> col = NestedColumn.from_rows("m", tree, [[{"role": "user", "n": 1},
        ...     {"role": "bot", "n": 2}], []])
        >>> col.get(0)
        [{'role': 'user', 'n': 1}, {'role': 'bot', 'n': 2}]
        >>> col.gather(torch.tensor([1, 0]))
        [[], [{'role': 'user', 'n': 1}, {'role': 'bot', 'n': 2}]]
    """

    kind = "nested"

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        assert isinstance(spec, NestedSpec)
        self._tree = children(spec.tree)
        self._np = {k: a.numpy() for k, a in arrays.items()}
        self._records = spec.records
        self._arrow: Any = None  # built on first use: Note [Gathering through Arrow]
        self._arrow_ok = spec.records and _arrow_friendly(spec.tree)
        # (list level, its numbers' level) of every list of numbers (1-D tensors)
        self._tensor_levels = [
            (i, kids[0])
            for i, (level, kids) in enumerate(self._tree)
            if level.kind == "list" and self._tree[kids[0]][0].kind == "num"
        ]

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
        """One flat buffer per offsets/values/data of each level (see :func:`level_layout`)."""
        assert isinstance(spec, NestedSpec)
        return level_layout(spec.tree, spec.counts)

    def _range(self, i: int, start: int, stop: int, supply: Supply = None) -> Any:
        """The values of elements ``[start, stop)`` of level ``i`` (a list, or a dict).

        ``supply``: per list-of-numbers level, its element tensors in visiting order,
        already gathered (:meth:`gather_into`); None copies each one.
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
        if level.kind == "str":
            values = self._np[f"{i}.values"]
            return [values[a:b].tobytes().decode("utf-8") for a, b in pairs]
        if level.kind == "bytes":
            values = self._np[f"{i}.values"]
            return [values[a:b].tobytes() for a, b in pairs]
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
        """The value of row ``index``."""
        return self._range(0, index, index + 1)[0]

    def gather(self, indices: torch.Tensor, alloc: Alloc | None = None) -> list[Any]:
        """The rows ``indices``, one Python value each.

        With ``alloc`` (in a DataLoader worker) the tensors of lists of numbers are
        views of buffers made to leave the worker (:meth:`gather_into`).
        """
        if alloc is not None and self._tensor_levels:
            return self.gather_into(indices, alloc(self.batch_parts(indices)))
        arrow = self._as_arrow() if self._arrow_ok else None
        if arrow is not None:
            import pyarrow as pa

            return arrow.take(pa.array(indices.numpy())).to_pylist()  # type: ignore[no-any-return]
        return [self._range(0, i, i + 1)[0] for i in indices.tolist()]

    def _row_ranges(self, idx: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per level (preorder), each row's elements there: ``(starts, stops)``.

        A row's elements are contiguous at every level (Arrow's layout): a list level
        maps its range ``[s, e)`` to ``[offsets[s], offsets[e])`` of its child, a
        struct passes its range to each field.
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

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One buffer per list-of-numbers level: the numbers of the rows' lists there.

        Text and records are Python objects (they cross by value); the tensors of
        lists of numbers are views of these buffers, so that a batch leaves a worker
        in one memfd (Note [How a batch leaves a worker] in ``crossing/_outbox.py``).
        """
        if not self._tensor_levels:
            return []
        ranges = self._row_ranges(indices.numpy())
        parts: list[tuple[tuple[int, ...], torch.dtype]] = []
        for _, k in self._tensor_levels:
            starts, stops = ranges[k]  # the numbers under the rows' lists
            total = int((stops - starts).sum())
            dtype = torch.from_numpy(np.empty(0, self._np[f"{k}.data"].dtype)).dtype
            parts.append(((total,), dtype))
        return parts

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> list[Any]:
        """:meth:`gather`; each list of numbers a view of ``outs`` (see :meth:`batch_parts`)."""
        if not self._tensor_levels:
            return self.gather(indices)
        idx = indices.numpy()
        ranges = self._row_ranges(idx)
        supply: dict[int, Iterator[torch.Tensor]] = {}
        for (i, k), out in zip(self._tensor_levels, outs):
            # the rows' numbers side by side, then split into one tensor per list
            rows = gather_rows(self._np[f"{k}.data"], *ranges[k], out)
            flat = out[: sum(len(r) for r in rows)]  # views of ``out``, of its type
            offsets = self._np[f"{i}.offsets"]
            lists = _elements(*ranges[i])
            supply[i] = iter(flat.split((offsets[lists + 1] - offsets[lists]).tolist()))
        return [self._range(0, r, r + 1, supply)[0] for r in idx.tolist()]

    def _as_arrow(self) -> Any:
        """An Arrow array over the shared buffers (no copy), or None without pyarrow.

        Note [Gathering through Arrow]
        ------------------------------
        The levels are Arrow's own layout (int64 offsets, UTF-8 values, numbers), so
        an Arrow ``large_list<struct<...>>`` can be laid over the shared buffers
        without a copy; a batch is then ``take`` + ``to_pylist``, which builds the
        Python values in C++ (what HF ``datasets`` does), instead of one Python call
        per element. Used where that gives the same values as the Python path: lists
        of records (``records=True``) without lists of numbers (tensors there) and
        without bool or float16 levels (no zero-copy Arrow form).
        """
        if self._arrow is None:
            try:
                import pyarrow as pa
            except ImportError:
                self._arrow_ok = False
                return None
            tree = children(self.spec.tree)  # type: ignore[attr-defined]
            counts = self.spec.counts  # type: ignore[attr-defined]

            def build(i: int) -> Any:
                level, kids = tree[i]
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
                return pa.Array.from_buffers(
                    kind, n, [None, offsets, pa.py_buffer(self._np[f"{i}.values"])]
                )

            self._arrow = build(0)
        return self._arrow

    def split(self, batch: list[Any]) -> list[Any]:
        """A gathered batch is already a list of rows."""
        return batch

    @classmethod
    def from_rows(
        cls, name: str, tree: Level, rows: list[Any], records: bool = True
    ) -> NestedColumn:
        """A column holding ``rows`` (Python values shaped like ``tree``; for tests)."""
        levels = children(tree)
        parts: list[list[Any]] = [[] for _ in levels]

        def add(i: int, values: list[Any]) -> None:
            level, kids = levels[i]
            parts[i].extend(values)
            if level.kind == "struct":
                for n, k in zip(level.names, kids):
                    add(k, [v[n] for v in values])
            elif level.kind == "list":
                add(kids[0], [x for v in values for x in v])

        add(0, list(rows))
        arrays: dict[str, np.ndarray] = {}
        counts = []
        for i, (level, _) in enumerate(levels):
            values, nbytes = parts[i], 0
            if level.kind in ("list", "str", "bytes"):
                blobs = [v.encode() if isinstance(v, str) else v for v in values]
                offsets = np.zeros(len(values) + 1, np.int64)
                np.cumsum([len(b) for b in blobs], out=offsets[1:])
                arrays[f"{i}.offsets"] = offsets
                if level.kind != "list":
                    arrays[f"{i}.values"] = np.frombuffer(b"".join(blobs), np.uint8)
                    nbytes = int(offsets[-1])
            elif level.kind == "num":
                arrays[f"{i}.data"] = np.asarray(values, level.dtype)
            counts.append((len(values), nbytes))
        spec = NestedSpec(
            name, len(rows), np.dtype(np.uint8), (), "nested", 0,
            tree=tree, counts=tuple(counts), records=records,
        )  # fmt: skip
        shared = {k: SharedArray.from_array(a).readonly() for k, a in arrays.items()}
        return cls(spec, shared)


COLUMN_KINDS.setdefault(NestedColumn.kind, NestedColumn)
