"""Arrow columns -> shared buffers: a selected column, its sizing pass and its copy.

Nulls are refused with :class:`NullValuesError` unless a ``fill_value`` is given:
never a silent 0.

Note [Nested Arrow columns]
===========================
A ``list<struct<role: string, content: string>>`` column, ``list<string>`` or
``list<list<float>>`` becomes a tree of levels (``columns/_nested.py``): one int64
``offsets`` buffer per list level, ``offsets`` + ``values`` per string level, ``data``
per number level; a struct's fields are levels with as many elements. Each chunk is
taken apart level by level (``Copy._walk``, which takes a string or binary column
apart as one such level and a ragged one as a list of numbers, their buffers named
``offsets`` + ``values``): list lengths (a null list counts 0) and
values (``flatten()``, which skips what null slots or slices leave behind and follows
list views in any order), struct fields with the struct's nulls merged in, strings as
their offsets + bytes, numbers. Sizing adds up the lengths; writing rebases
them onto each level's running total. A null anywhere is refused unless a
``fill_value`` is given: then null lists are empty, null strings the fill string (or
``""`` for a number given for every column), null numbers the fill number.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..columns._columns import ColumnSpec
from ..columns._nested import Level, NestedSpec, children
from ..errors import NullValuesError, SourceReadError, UnsupportedDtypeError
from ._arrow_types import (
    UuidAs,
    classify,
    decoded,
    extension_of,
    list_parts,
    meaning_of,
    normalize,
    pyarrow_module,
)
from ._source import Buffer

__all__ = ["ArrowColumn", "Sizer", "Writer", "rebase_offsets"]


def rebase_offsets(src: np.ndarray, base: int, out: np.ndarray) -> int:
    """Write a chunk's ``n + 1`` offsets as ``n`` int64 end offsets after ``base``; the new total.

    Example:
        >>> out = np.zeros(3, np.int64)
        >>> rebase_offsets(np.array([5, 7, 7, 10], np.int32), 2**31, out)
        2147483653
        >>> out.tolist()
        [2147483650, 2147483650, 2147483653]
    """
    if len(src) <= 1:
        return base
    out[:] = src[1:]  # widened to int64 before any arithmetic
    out -= int(src[0])
    out += base
    return base + int(src[-1]) - int(src[0])


def _valid_mask(arr: Any) -> np.ndarray:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _leaf(arr: Any) -> tuple[Any, np.ndarray | None]:
    """The leaf values of (nested) fixed-size lists, null rows' slots included, and their mask."""
    pa = pyarrow_module()
    if not pa.types.is_fixed_size_list(arr.type):
        return arr, (_valid_mask(arr) if arr.null_count else None)
    size = arr.type.list_size
    child, mask = _leaf(arr.values.slice(arr.offset * size, len(arr) * size))
    if arr.null_count and len(arr):
        rows = np.repeat(_valid_mask(arr), len(child) // len(arr))
        mask = rows if mask is None else mask & rows
    return child, mask


def _numpy_values(prim: Any, dtype: np.dtype) -> np.ndarray:
    """A primitive array's values as numpy (zero-copy when possible), nulls as garbage."""
    pa = pyarrow_module()
    if len(prim) == 0:
        return np.zeros(0, dtype)
    if prim.null_count == 0:
        return prim.to_numpy(zero_copy_only=False)
    if pa.types.is_boolean(prim.type):  # bit-packed: no raw view
        return pa.compute.fill_null(prim, False).to_numpy(zero_copy_only=False)
    data = prim.buffers()[1]
    if data is None:
        return np.zeros(len(prim), dtype)
    return np.frombuffer(data, dtype=dtype, count=len(prim), offset=prim.offset * dtype.itemsize)


def _var_offsets(arr: Any) -> np.ndarray:
    """The ``len + 1`` offsets of a string/binary/list array, its slice offset applied."""
    pa = pyarrow_module()
    t = arr.type
    wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t)
    dtype = np.dtype(np.int64 if wide else np.int32)
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(len(arr) + 1, dtype)
    return np.frombuffer(buf, dtype=dtype, count=len(arr) + 1, offset=arr.offset * dtype.itemsize)


def _text(arr: Any) -> tuple[np.ndarray, np.ndarray]:
    """A string/binary array's offsets and the bytes they cover."""
    offsets = _var_offsets(arr)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = arr.buffers()[2]
    if data is None or stop == start:
        return offsets, np.zeros(0, np.uint8)
    return offsets, np.frombuffer(data, np.uint8, count=stop - start, offset=start)


class ArrowColumn:
    """One selected column: its kind, its fill value, and how a chunk becomes buffers.

    ``path`` is the top-level column and the struct fields leading to this one (name
    ``s.a``); ``fill_is_global``: ``fill`` was given for every column (a number then
    makes a string column's nulls empty); ``metadata`` may name an unregistered
    extension type.
    """

    def __init__(
        self,
        name: str,
        arrow_type: Any,
        label: str,
        fill: Any,
        fill_is_global: bool = False,
        path: tuple[str, ...] = (),
        records: bool = True,
        metadata: Mapping[bytes, bytes] | None = None,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        self.name, self.arrow_type, self.label = name, arrow_type, label
        ext = extension_of(arrow_type, metadata)
        self.meaning = meaning_of(ext, name, label, uuid_as) if ext is not None else None
        self.kind = self.meaning.kind if self.meaning else classify(arrow_type, name, label)
        self.fill, self.fill_is_global = fill, fill_is_global
        self.path = path or (name,)
        self.records = records

    def extract(self, chunk: Any) -> Any:
        """This column's values out of a chunk of its top-level column, normalized.

        A struct field comes with its struct's nulls merged in (as ``Table.flatten()``);
        a chunk of a promoted type is cast to the column's.
        """
        for name in self.path[1:]:
            chunk = decoded(chunk)
            chunk = chunk.flatten()[chunk.type.get_field_index(name)]
        if chunk.type != self.arrow_type:
            chunk = chunk.cast(self.arrow_type)
        if self.meaning is not None:
            chunk = self.meaning.convert(chunk)
        return chunk if self.kind.kind == "nested" else normalize(chunk)

    def nested_fill(self) -> tuple[bytes | None, Any] | None:
        """The (text, number) put in place of a nested column's null leaves (None: refuse)."""
        fill = self.fill
        if fill is None:
            return None
        if isinstance(fill, (str, bytes)):
            return fill.encode("utf-8") if isinstance(fill, str) else fill, None
        if isinstance(fill, (bool, int, float, np.bool_, np.number)) and np.ndim(fill) == 0:
            return b"", fill
        raise self._bad_fill("a str or a number", "''")

    def null_error(self, per_file: Mapping[str, int], *, at_least: bool = False) -> NullValuesError:
        """The error for a column with nulls and no fill value."""
        total = sum(per_file.values())
        where = ", ".join(f"{f}: {n}" for f, n in per_file.items() if n)
        example = "''" if self.kind.kind in ("str", "bytes") else "0"
        lists = "; null lists become empty lists" if self.kind.kind == "ragged" else ""
        return NullValuesError(
            f"column {self.name!r} ({self.arrow_type}) holds {'at least ' if at_least else ''}"
            f"{total} null value{'s' if total != 1 else ''} (in {where}); shareddata never "
            "stores a null as a silent 0. Pass fill_value= to replace them: a scalar for every "
            f"column, or a dict per column (fill_value={{{self.name!r}: {example}}}); null "
            f"strings become '' or the string given{lists}. Or drop those rows first "
            "(table.drop_null())."
        )

    @functools.cached_property
    def fill_scalar(self) -> Any:
        """The fill value, checked against the column's type (a numpy scalar, or bytes)."""
        fill, kind, dtype = self.fill, self.kind.kind, self.kind.dtype
        if kind in ("str", "bytes"):
            if isinstance(fill, str):
                return fill.encode("utf-8")
            if isinstance(fill, bytes) and (kind == "bytes" or _is_utf8(fill)):
                return fill
            if self.fill_is_global and isinstance(fill, (int, float, np.number)):
                return b""  # the number given for every column: strings become empty
            raise self._bad_fill("a str" if kind == "str" else "bytes or a str", "''")
        ok = isinstance(fill, (bool, int, float, np.bool_, np.number)) and np.ndim(fill) == 0
        if ok and dtype.kind == "b":
            ok = fill in (0, 1)
        elif ok and dtype.kind in "iu":
            info = np.iinfo(dtype)
            ok = float(fill).is_integer() and info.min <= int(fill) <= info.max
        elif ok and dtype.kind == "f":
            ok = not np.isfinite(fill) or abs(fill) <= float(np.finfo(dtype).max)
        if not ok:
            raise self._bad_fill(f"a number that {dtype} can hold", "0")
        return np.asarray(fill).astype(dtype)[()]

    def _bad_fill(self, wanted: str, example: str) -> UnsupportedDtypeError:
        return UnsupportedDtypeError(
            f"fill_value {self.fill!r} does not fit column {self.name!r} of {self.label} "
            f"({self.arrow_type}); give {wanted}, e.g. fill_value={{{self.name!r}: {example}}}."
        )


def _count_keys(tree: Any) -> list[str]:
    """Per level, the buffer whose length is its element count (a struct: its first field's)."""
    levels = children(tree)

    def key(i: int) -> str:
        level, kids = levels[i]
        if level.kind == "struct":
            return key(kids[0])
        return f"{i}.data" if level.kind == "num" else f"{i}.offsets"

    return [key(i) for i in range(len(levels))]


_Pieces = list[tuple[str, Any, str | None]]  # (buffer, values, base): see Copy
_FLAT_KEYS = {"0.offsets": "offsets", "0.values": "values", "1.data": "values"}


class Copy:
    """One column's chunks as ``(key, values, base)``: values appended to buffer ``key``.

    For an offsets buffer, ``values`` are the chunk's ``n + 1`` offsets and ``base`` the
    buffer whose running length they are rebased onto. :class:`Sizer` adds up the
    lengths, :class:`Writer` copies.
    """

    def __init__(self, column: ArrowColumn) -> None:
        self.column = column
        k = column.kind
        tree = k.tree  # a str/bytes column is walked as one level, a ragged one as two:
        if k.kind in ("str", "bytes"):
            tree = Level(k.kind)
        elif k.kind == "ragged":
            tree = Level("list", children=(Level("num", k.dtype.name),))
        self.levels = children(tree) if tree is not None else []
        self.count_keys = _count_keys(tree) if tree is not None else []
        self.keys = {} if k.kind == "nested" else _FLAT_KEYS  # their buffers' names
        self.length: dict[str, int] = {}  # per buffer: elements appended so far

    def pieces(self, arr: Any, where: str) -> tuple[_Pieces, int]:
        """The pieces of one chunk and its nulls (no pieces: nulls with no fill value)."""
        col = self.column
        if col.kind.kind != "tensor":  # str, bytes, ragged, nested: one walk of levels
            if col.kind.kind == "nested":
                col.nested_fill()  # a fill value that fits no leaf fails even without nulls
            out: _Pieces = []
            nulls = self._walk(arr, 0, where, out)
            return [(self.keys.get(k, k), v, b and self.keys.get(b, b)) for k, v, b in out], nulls
        leaf, mask = _leaf(arr)
        atomic = col.meaning is not None and col.meaning.atomic  # a null UUID is one null
        nulls = arr.null_count if atomic or mask is None else len(mask) - np.count_nonzero(mask)
        if nulls and col.fill is None:
            return [], int(nulls)
        data = _numpy_values(leaf, col.kind.dtype)
        if mask is not None:
            data = data.copy()
            data[~mask] = col.fill_scalar
        return [("data", data.reshape(len(arr), *col.kind.shape), None)], int(nulls)

    def _walk(self, arr: Any, i: int, where: str, out: _Pieces) -> int:
        """Append the pieces of level ``i`` of a chunk and under it; the nulls met.

        Note [Nested Arrow columns]. Null leaves become :meth:`_fill` (with no fill
        value: counted, refused later).
        """
        pa, pc = pyarrow_module(), pyarrow_module().compute
        level, kids = self.levels[i]
        name, nulls = self.column.name, 0
        arr = decoded(arr) if level.kind in ("list", "struct") else normalize(arr)
        if level.kind == "list":
            nulls += arr.null_count
            offsets, flat = list_parts(arr)
            if len(flat) != offsets[-1] - offsets[0]:
                raise UnsupportedDtypeError(
                    f"column {name!r} of {where}: the list values of a {arr.type} chunk do not "
                    "add up to its lengths; cast the column to a plain list type first."
                )
            out.append((f"{i}.offsets", offsets, self.count_keys[kids[0]]))
            return nulls + self._walk(flat, kids[0], where, out)
        if level.kind == "struct":  # its fields come with the struct's nulls merged in
            return sum(self._walk(c, k, where, out) for c, k in zip(arr.flatten(), kids))
        nulls, fill = arr.null_count, self.column.fill is not None
        if level.kind in ("str", "bytes"):
            if nulls and fill:
                value = self._fill(level.kind, arr, where)
                value = value.decode("utf-8") if level.kind == "str" else value
                arr = pc.fill_null(arr, pa.scalar(value, arr.type))
            offsets, data = _text(arr)
            out += [(f"{i}.offsets", offsets, f"{i}.values"), (f"{i}.values", data, None)]
            return nulls
        if nulls:  # num
            value = self._fill("num", arr, where) if fill else 0  # no fill: refused later
            value = bool(value) if pa.types.is_boolean(arr.type) else value
            arr = pc.fill_null(arr, pa.scalar(value, arr.type))
        values = arr.to_numpy(zero_copy_only=False).astype(np.dtype(level.dtype), copy=False)
        out.append((f"{i}.data", values, None))
        return nulls

    def _fill(self, kind: str, arr: Any, where: str) -> Any:
        """What a null leaf of a ``kind`` level becomes (text as bytes, or a number).

        A str, bytes or ragged column's checked fill value; a nested column's text for
        text leaves and its number for number leaves.
        """
        col, name = self.column, self.column.name
        if col.kind.kind != "nested":
            return col.fill_scalar
        text, number = col.nested_fill()  # type: ignore[misc]
        if kind == "num" and number is None:
            raise UnsupportedDtypeError(
                f"column {name!r} of {where} holds null numbers ({arr.type}) and "
                f"the fill_value is not a number; give one, e.g. "
                f"fill_value={{{name!r}: 0}}."
            )
        return number if kind == "num" else text

    @staticmethod
    def size(key: str, values: Any) -> int:
        """Elements ``values`` append to buffer ``key``."""
        return len(values) - 1 if key.endswith("offsets") else len(values)


class Sizer(Copy):
    """Counts one column's nulls and values over its chunks: the exact spec, or the error."""

    def __init__(self, column: ArrowColumn) -> None:
        super().__init__(column)
        self.nulls: dict[str, int] = {}

    def add(self, where: str, chunk: Any) -> None:
        """Account for one normalized chunk from ``where``."""
        column = self.column
        if column.kind.kind in ("str", "nested"):
            _check_utf8(chunk, column.name, where)
        pieces, nulls = self.pieces(chunk, where)  # (which checks the fill value it uses)
        if nulls:
            self.nulls[where] = self.nulls.get(where, 0) + nulls
        for key, values, _ in pieces:
            self.length[key] = self.length.get(key, 0) + self.size(key, values)

    def spec(self, rows: int) -> ColumnSpec:
        """The column's spec, or NullValuesError if it has nulls and no fill value."""
        column, k, n = self.column, self.column.kind, self.length
        if self.nulls and column.fill is None:
            raise column.null_error(self.nulls)
        if k.tree is not None:
            counts = tuple((n.get(key, 0), n.get(f"{i}.values", 0))
                           for i, key in enumerate(self.count_keys))  # fmt: skip
            return NestedSpec(column.name, rows, k.dtype, (), "nested", 0, tree=k.tree,
                              counts=counts, records=column.records)  # fmt: skip
        return ColumnSpec(column.name, rows, k.dtype, k.shape, k.spec_kind, n.get("values", 0))


class Writer(Copy):
    """Copies one column's chunks, in order, into its shared buffers."""

    def __init__(self, column: ArrowColumn, spec: ColumnSpec, buffers: dict[str, Buffer]) -> None:
        super().__init__(column)
        self.spec, self.buffers = spec, buffers
        self.length = dict.fromkeys(buffers, 0)
        for key, buf in buffers.items():
            if key.endswith("offsets"):
                buf.rows(0, 1)[0] = 0

    def write(self, arr: Any, where: str) -> int:
        """Copy one normalized chunk; return the bytes written."""
        pieces, nulls = self.pieces(arr, where)
        if nulls and self.column.fill is None:  # the sizing pass did not see them: changed file
            raise self.column.null_error({where: nulls}, at_least=True)
        start, written = dict(self.length), 0
        for key, values, base in pieces:
            at, n = start[key], self.size(key, values)
            buf = self.buffers[key]
            if at + n > len(buf) - (base is not None):
                raise SourceReadError(
                    f"{where} has more values in column {self.spec.name!r} than its metadata "
                    f"or the sizing pass said; was the file changed while it was being loaded?"
                )
            if base is None:
                dest = buf.rows(at, at + n)
                dest[...] = values
            else:
                dest = buf.rows(at + 1, at + n + 1)
                rebase_offsets(values, start[base], dest)
            self.length[key] = at + n
            written += dest.nbytes
        return written

    def finish(self, where: str) -> None:
        """Check that every row and value the spec promised was written."""
        for key, buf in self.buffers.items():
            if self.length[key] != len(buf) - key.endswith("offsets"):
                raise SourceReadError(
                    f"{where} gave fewer values for column {self.spec.name!r} than its metadata "
                    "or the sizing pass said; was the file changed while it was being loaded?"
                )


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _check_utf8(chunk: Any, name: str, where: str) -> None:
    """Refuse a string chunk whose bytes are not UTF-8 (Parquet readers do not check)."""
    try:
        chunk.validate(full=True)
    except pyarrow_module().ArrowInvalid as error:
        raise SourceReadError(
            f"{where}: column {name!r} holds bytes that are not UTF-8 text ({error}). The "
            "file is corrupt, or the column is binary data written as a string: re-create "
            "the file, or store the column as binary (it then loads as bytes)."
        ) from error
