"""The drop-in path: ``SharedDataset(any map-style dataset)`` and ``SharedList``.

``SharedDataset`` reads every item of the wrapped dataset once, infers a schema
from the first item (a tree of tuples, lists and dicts whose leaves are tensors,
arrays, numbers, strings, bytes or anything picklable), writes each leaf into a
shared column, and from then on rebuilds items from shared memory with the same
structure and types the original returned. Fixed-shape leaves go straight into
columns preallocated from the first item; variable-length leaves (strings, bytes,
token lists, arrays whose shape varies, pickled objects) are collected and then
copied into one shared segment.
"""

from __future__ import annotations

import os
import pickle
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from ._columns import BytesColumn, Column, ColumnSpec, RaggedColumn, StringColumn, TensorColumn
from ._dataset import ColumnDataset, _progress_bar
from ._storage import SharedArray, _fmt, allocate, to_numpy_dtype
from .errors import SharedDataError, UnsupportedDtypeError

__all__ = ["SharedDataset", "SharedList"]


class ItemMismatchError(SharedDataError, TypeError):
    """An item's structure or type differs from the first item's."""


# -- leaves ------------------------------------------------------------------------------
# A leaf is one column. ``kind`` says how a value is stored and rebuilt:
#   tensor / ndarray / npscalar / int / float / bool : fixed rows (TensorColumn);
#   when the shape of tensors/arrays varies they switch to ragged values + shapes;
#   str / bytes : StringColumn / BytesColumn; intlist / floatlist : RaggedColumn;
#   pickle : BytesColumn of pickled objects.


@dataclass
class _Leaf:
    path: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False


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
        value = value.detach()
        if value.dtype == torch.bfloat16:
            raise UnsupportedDtypeError(
                f"field {_field(path)} is a bfloat16 tensor, which shared columns cannot hold "
                "(numpy has no bfloat16); return .float() or .view(torch.int16) from the dataset."
            )
        return _Leaf(path, "tensor", to_numpy_dtype(value.dtype), tuple(value.shape))
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


def _numeric_list(value: list[Any]) -> str | None:
    """Return "intlist" or "floatlist" for a flat list of ints or floats, "" if empty, else None."""
    if not value:
        return ""
    if all(type(v) is int for v in value):
        return "intlist"
    if all(type(v) is float for v in value):
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


def _rebuild(node: Any, values: Sequence[Any]) -> Any:
    tag, body = node
    if tag == "leaf":
        return values[body]
    if tag == "dict":
        return {k: _rebuild(child, values) for k, child in body}
    built = [_rebuild(child, values) for child in body]
    return tuple(built) if tag == "tuple" else built


# -- building the columns -----------------------------------------------------------------

_FIXED = {"tensor", "ndarray", "npscalar", "int", "float", "bool"}


class _VarBuffer:
    """Growable private offsets + values for one variable-length leaf, copied out at the end."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.values = bytearray()
        self.offsets = array("q", [0])
        self.shapes: list[tuple[int, ...]] = []

    def add(self, data: np.ndarray | bytes, shape: tuple[int, ...] = ()) -> None:
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
        self.values += raw
        self.offsets.append(len(self.values) // self.dtype.itemsize)
        self.shapes.append(shape)


# The exact Python type that passes a leaf's check without classifying the value again.
_EXACT = {"int": int, "float": float, "bool": bool, "str": str, "bytes": bytes}


def _matches_fast(leaf: _Leaf, value: Any, tensor_dtype: Any) -> bool:
    """Whether ``value`` surely matches ``leaf``: the per-item fast path.

    When it returns False, ``_check_leaf`` classifies the value and explains a mismatch.
    """
    kind = leaf.kind
    if kind == "tensor":
        return type(value) is torch.Tensor and value.dtype is tensor_dtype
    if kind == "ndarray":
        return type(value) is np.ndarray and value.dtype == leaf.dtype
    return type(value) is _EXACT.get(kind)


def _check_leaf(leaf: _Leaf, value: Any, index: int) -> None:
    if leaf.kind == "pickle":
        return  # anything picklable
    got = _classify(value, leaf.path)
    ok = False
    if got is not None:
        ok = got.kind == leaf.kind or (
            leaf.kind in ("intlist", "floatlist") and got.kind in ("intlist", "floatlist", "")
        )
        if ok and leaf.kind in ("tensor", "ndarray", "npscalar") and got.dtype != leaf.dtype:
            ok = False
        if ok and leaf.kind in ("intlist", "floatlist") and value and got.kind != leaf.kind:
            ok = False
    if not ok:
        expected = f"{leaf.kind} {leaf.dtype}" if leaf.kind in _FIXED - {"int"} else leaf.kind
        raise ItemMismatchError(
            f"item {index}, field {_field(leaf.path)}: expected {expected} as in item 0, got "
            f"{_describe(value)}. Make every item return the same types (cast in the dataset), "
            "or wrap the value in a type that pickles."
        )


class _Builder:
    """Collects the items of a dataset into shared columns."""

    def __init__(self, first: Any, rows: int, storage_dir: Any) -> None:
        self.leaves: list[_Leaf] = []
        self.schema = _schema(first, "", self.leaves)
        self.rows = rows
        self.storage_dir = storage_dir
        for leaf in self.leaves:
            if leaf.kind == "" or leaf.kind == "intlist":
                leaf.kind, leaf.dtype = "intlist", np.dtype(np.int64)
            elif leaf.kind == "floatlist":
                leaf.dtype = np.dtype(np.float64)
        fixed = [i for i, leaf in enumerate(self.leaves) if leaf.kind in _FIXED]
        arrays = allocate(
            [((rows, *self.leaves[i].shape), self.leaves[i].dtype) for i in fixed],
            storage_dir,
            what="SharedDataset's fixed-size fields",
        )
        self.fixed: dict[int, SharedArray] = dict(zip(fixed, arrays))
        self.segment = arrays[0].segment if arrays else None
        self._rows = {n: array.numpy() for n, array in self.fixed.items()}  # writable views
        first_values: list[Any] = []
        _flatten(first, self.schema, first_values, 0)
        self._tensor_dtypes = [getattr(v, "dtype", None) for v in first_values]
        self.var: dict[int, _VarBuffer] = {
            i: _VarBuffer(leaf.dtype) for i, leaf in enumerate(self.leaves) if i not in self.fixed
        }

    def add(self, index: int, item: Any) -> None:
        values: list[Any] = []
        _flatten(item, self.schema, values, index)
        for n, (leaf, value) in enumerate(zip(self.leaves, values)):
            numlist = leaf.kind in ("intlist", "floatlist")
            if numlist and type(value) is list and value and _numeric_list(value) != leaf.kind:
                self._to_pickle(n, leaf)  # e.g. [] first, then [Box(...)]: keep lists whole
            if not _matches_fast(leaf, value, self._tensor_dtypes[n]):
                _check_leaf(leaf, value, index)
            if n in self.fixed:
                self._put_fixed(n, leaf, index, value)
            else:
                self._put_var(n, leaf, value)

    def _put_fixed(self, n: int, leaf: _Leaf, index: int, value: Any) -> None:
        if leaf.kind in ("tensor", "ndarray"):
            data = value.detach().cpu().numpy() if leaf.kind == "tensor" else value
            if data.shape != leaf.shape:  # the shape varies: keep values + shapes instead
                self._to_ragged(n, leaf, index)
                self._put_var(n, leaf, value)
                return
            self._rows[n][index] = data
        else:
            self._rows[n][index] = value

    def _to_ragged(self, n: int, leaf: _Leaf, upto: int) -> None:
        buffer = _VarBuffer(leaf.dtype)
        rows = self.fixed.pop(n).numpy()
        del self._rows[n]
        for i in range(upto):
            buffer.add(rows[i], leaf.shape)
        leaf.ragged = True
        self.var[n] = buffer

    def _to_pickle(self, n: int, leaf: _Leaf) -> None:
        old = self.var[n]
        values = np.frombuffer(bytes(old.values), old.dtype)
        buffer = _VarBuffer(np.dtype(np.uint8))
        for start, stop in zip(old.offsets[:-1], old.offsets[1:]):
            buffer.add(pickle.dumps(values[start:stop].tolist(), protocol=pickle.HIGHEST_PROTOCOL))
        leaf.kind, leaf.dtype = "pickle", np.dtype(np.uint8)
        self.var[n] = buffer

    def _put_var(self, n: int, leaf: _Leaf, value: Any) -> None:
        buffer = self.var[n]
        if leaf.kind in ("tensor", "ndarray"):
            data = value.detach().cpu().numpy() if leaf.kind == "tensor" else value
            buffer.add(data, data.shape)
        elif leaf.kind == "str":
            buffer.add(value.encode("utf-8"))
        elif leaf.kind == "bytes":
            buffer.add(value)
        elif leaf.kind in ("intlist", "floatlist"):
            buffer.add(np.asarray(value, dtype=leaf.dtype))
        else:
            buffer.add(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def finish(self) -> tuple[dict[str, Column], list[str]]:
        """Copy the variable-length leaves into one shared segment; build every column."""
        layouts: list[tuple[tuple[int, ...], Any]] = []
        for n in sorted(self.var):  # leaf order: the order the columns are built in below
            buffer = self.var[n]
            layouts.append(((len(buffer.offsets),), np.int64))
            layouts.append(((len(buffer.values) // buffer.dtype.itemsize,), buffer.dtype))
            if self.leaves[n].ragged:
                layouts.append(((self.rows, len(self.leaves[n].shape)), np.int64))
        shared = iter(allocate(layouts, self.storage_dir, what="SharedDataset's variable fields"))
        columns: dict[str, Column] = {}
        restore: list[str] = []
        for n, leaf in enumerate(self.leaves):
            name = leaf.path or "value"
            if n in self.fixed:
                spec = ColumnSpec(name, self.rows, leaf.dtype, leaf.shape)
                columns[name] = TensorColumn(spec, {"data": self.fixed[n].readonly()})
            else:
                buffer = self.var[n]
                offsets, values = next(shared), next(shared)
                offsets.numpy()[:] = np.frombuffer(buffer.offsets, np.int64)
                values.numpy()[:] = np.frombuffer(bytes(buffer.values), buffer.dtype)
                kind = {"str": "str", "bytes": "bytes", "pickle": "bytes"}.get(leaf.kind, "ragged")
                spec = ColumnSpec(name, self.rows, buffer.dtype, (), kind, len(values))
                cls = {"str": StringColumn, "bytes": BytesColumn, "ragged": RaggedColumn}[kind]
                arrays = {"offsets": offsets.readonly(), "values": values.readonly()}
                columns[name] = cls(spec, arrays)
                if leaf.ragged:
                    shapes = next(shared)
                    shapes.numpy()[:] = np.asarray(buffer.shapes, np.int64).reshape(
                        self.rows, len(leaf.shape)
                    )
                    spec = ColumnSpec(
                        name + ".shape", self.rows, np.dtype(np.int64), (len(leaf.shape),)
                    )
                    columns[spec.name] = TensorColumn(spec, {"data": shapes.readonly()})
                self.var[n] = None  # type: ignore[assignment]  # free the private copy now
            restore.append(leaf.kind + ("+ragged" if leaf.ragged else ""))
        return columns, restore


def _restore(kind: str, value: Any) -> Any:
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


# -- the datasets --------------------------------------------------------------------------


class SharedDataset(ColumnDataset):
    """Wraps ANY map-style dataset: every item is materialised once into shared memory.

    The drop-in path for existing code: ``ds = sd.SharedDataset(MyDataset(...))``.
    Items come back with the same structure and types the original returned (a tuple
    stays a tuple, an ``int`` an ``int``, a numpy array a numpy array), so the
    default collate gives the batches the original gave. Items may hold tensors and
    arrays (fixed or varying shape), Python numbers, ``str``, ``bytes``, lists of
    numbers, and tuples/lists/dicts of these; any other picklable value is kept as
    pickled bytes in a shared buffer.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        transform: applied to each rebuilt item, in the worker.
        num_workers: read the original with a DataLoader of this many workers.
        progress: show a progress bar for materialisations longer than ~2 s.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.

    Raises:
        TypeError: for an ``IterableDataset``, or an item whose structure or types
            differ from the first item's (naming the index and the field).

    Example:
        >>> import torch, shareddata as sd
        >>> class Squares(torch.utils.data.Dataset):
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i): return torch.full((2,), i * i), i, f"#{i}"
        >>> ds = sd.SharedDataset(Squares())
        >>> ds[3]
        (tensor([9, 9]), 3, '#3')
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        transform: Callable[[Any], Any] | None = None,
        num_workers: int = 0,
        progress: bool = True,
        storage_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"SharedDataset needs a map-style dataset with a length; "
                f"{type(dataset).__name__} is iterable-only. Only a map-style dataset has a "
                "length to preallocate shared columns for; convert it to one (e.g. collect "
                "its items into a list and wrap that)."
            )
        rows = len(dataset)
        builder: _Builder | None = None
        label = type(dataset).__name__
        try:
            with _progress_bar(rows, f"materialising {label}", progress) as update:
                for index, item in _items(dataset, rows, num_workers):
                    if builder is None:
                        builder = _Builder(item, rows, storage_dir)
                    builder.add(index, item)
                    update(1)
        except BaseException:
            # Free the columns now, although the traceback still refers to them:
            # Note [Freeing a failed load] in _storage.py.
            if builder is not None and builder.segment is not None:
                builder.segment.discard()
            raise
        if builder is None:
            raise ValueError(f"{label} is empty: there is nothing to share")
        columns, restore = builder.finish()
        schema = builder.schema
        del builder
        self._init(columns, restore, transform, schema)

    def _init(
        self, columns: dict[str, Column], restore: list[str], transform: Any, schema: Any
    ) -> None:
        super().__init__(columns, transform=transform, output="tuple")
        self._restore_kinds = restore
        self._schema = schema

    def _pack(self, values: Sequence[Any]) -> Any:
        leaf_values: list[Any] = []
        it = iter(values)
        for kind in self._restore_kinds:
            value = next(it)
            if kind.endswith("+ragged"):
                shape = next(it).tolist()
                value = value.reshape(shape)
                kind = kind[: -len("+ragged")]
            leaf_values.append(_restore(kind, value))
        return _rebuild(self._schema, leaf_values)

    def __getitem__(self, index: Any) -> Any:
        from ._dataset import _is_int

        if _is_int(index):
            return super().__getitem__(index)
        return default_collate(self.__getitems__(self._indices(index).tolist()))

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "restore": self._restore_kinds, "schema": self._schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SharedDataset._init(
            self, state["columns"], state["restore"], state["transform"], state["schema"]
        )


def _items(dataset: Any, rows: int, num_workers: int) -> Iterator[tuple[int, Any]]:
    if num_workers <= 0:
        for index in range(rows):
            yield index, _fetch(dataset, index)
        return
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, collate_fn=_identity)
    yield from enumerate(loader)


def _identity(x: Any) -> Any:
    return x


def _fetch(dataset: Any, index: int) -> Any:
    try:
        return dataset[index]
    except Exception as e:
        note = f"while SharedDataset read item {index} of {type(dataset).__name__}"
        if hasattr(e, "add_note"):  # Python >= 3.11: keep the original exception type
            e.add_note(note)
            raise
        raise SharedDataError(f"{type(e).__name__}: {e} ({note})") from e


class SharedList(Sequence):
    """An immutable list of picklable objects, held once in shared memory.

    The fix for per-sample metadata (annotations, file lists) that grows every
    worker's memory under ``fork`` (pytorch/pytorch#13246) and is pickled into every
    worker under ``spawn``: items are stored pickled in one shared buffer and
    unpickled on access, so no Python object per item lives in any process.

    Args:
        items: any iterable of picklable objects.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.

    Example:
        >>> import shareddata as sd
        >>> names = sd.SharedList({"file": f"img{i}.jpg", "boxes": [i]} for i in range(3))
        >>> len(names), names[-1], names[:2][1]["file"]
        (3, {'file': 'img2.jpg', 'boxes': [2]}, 'img1.jpg')
    """

    def __init__(
        self, items: Iterable[Any], *, storage_dir: str | os.PathLike[str] | None = None
    ) -> None:
        buffer = _VarBuffer(np.dtype(np.uint8))
        for item in items:
            buffer.add(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        offsets, values = allocate(
            [((len(buffer.offsets),), np.int64), ((len(buffer.values),), np.uint8)],
            storage_dir,
            what=f"SharedList of {len(buffer.offsets) - 1} items ({_fmt(len(buffer.values))})",
        )
        offsets.numpy()[:] = np.frombuffer(buffer.offsets, np.int64)
        values.numpy()[:] = np.frombuffer(bytes(buffer.values), np.uint8)
        del buffer
        rows = len(offsets) - 1
        spec = ColumnSpec("items", rows, np.dtype(np.uint8), (), "bytes", len(values))
        self._column = BytesColumn(
            spec, {"offsets": offsets.readonly(), "values": values.readonly()}
        )

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            rows = range(*index.indices(len(self)))
            if not rows:
                return []
            blobs = self._column.gather(torch.tensor(list(rows), dtype=torch.int64))
            return [pickle.loads(b) for b in blobs]
        i = int(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"SharedList index {i} out of range for {n} items")
        return pickle.loads(self._column.get(i + n if i < 0 else i))

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory."""
        return self._column.nbytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_list, (self._column,))

    def __repr__(self) -> str:
        return f"SharedList({len(self)} items, {_fmt(self.nbytes)})"


def _rebuild_list(column: BytesColumn) -> SharedList:
    obj = SharedList.__new__(SharedList)
    obj._column = column
    return obj
