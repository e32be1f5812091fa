"""Arrow columns -> shared buffers: a selected column's sizing pass and its copy.

A selected column (:class:`ArrowColumn`: its kind from ``_arrow_types.py``, its fill
value and null handling), its sizing pass (:class:`Sizer`) and its copy into the
buffers (:class:`Writer`, only through ``Buffer.rows``), for every input of the one
Arrow source (``arrow.py``).

Nulls are refused with :class:`NullValuesError` unless a ``fill_value`` is given:
never a silent 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..columns._columns import ColumnSpec
from ..columns._nested import NestedSpec, children
from ..errors import NullValuesError, SourceReadError, UnsupportedDtypeError
from ._arrow_extensions import UuidAs, extension_of, meaning_of
from ._arrow_nested import Parts, parts
from ._arrow_types import classify, decoded, normalize, pyarrow_module
from ._source import Buffer

__all__ = ["ArrowColumn", "Sizer", "Writer", "rebase_offsets"]


def rebase_offsets(src: np.ndarray, base: int, out: np.ndarray) -> int:
    """Write a chunk's Arrow offsets into ``out``, moved onto a running int64 total.

    ``src`` holds the ``n + 1`` offsets of one chunk (int32 or int64; a sliced array's
    offsets need not start at 0); ``out`` receives the ``n`` end offsets of its rows in
    the whole column, ``base + (src[1:] - src[0])``, computed in int64 so that a
    column of more than 2 GiB of values does not wrap around.

    Args:
        src: the chunk's offsets (length ``n + 1``).
        base: the number of values already written before this chunk.
        out: int64 destination of length ``n`` (the column's ``offsets[pos + 1:pos + n + 1]``).

    Returns:
        The new running total (``base`` plus the chunk's number of values).

    Example:
        >>> out = np.zeros(3, np.int64)
        >>> rebase_offsets(np.array([5, 7, 7, 10], np.int32), 2**31, out)
        2147483653
        >>> out.tolist()
        [2147483650, 2147483650, 2147483653]
    """
    n = len(src) - 1
    if n <= 0:
        return base
    out[:] = src[1:]  # widened to int64 before any arithmetic
    out -= int(src[0])
    out += base
    return base + int(src[-1]) - int(src[0])


def _valid_mask(arr: Any) -> np.ndarray:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _leaf(arr: Any) -> tuple[Any, np.ndarray | None]:
    """The primitive values of a (nested fixed-size list) array and their validity.

    Returns the leaf array (``len(arr) * prod(shape)`` values, a null row's slots
    included) and a mask of valid leaf values, or None when every value is valid.
    """
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


class ArrowColumn:
    """One selected column: its kind, its fill value, and how a chunk is turned into buffers.

    Args:
        name: the column name (``s.a`` for field ``a`` of struct column ``s``).
        arrow_type: its Arrow type (as declared by the table or file).
        label: the source, for messages.
        fill: what its nulls become (None: refuse them).
        fill_is_global: ``fill`` is the scalar given for every column (a number then
            makes a string column's nulls empty instead of being refused).
        path: the top-level column and the struct fields leading to this one.
        records: a nested list of structs comes back as a list of dicts (else a dict
            of lists).
        metadata: the field's metadata (names an extension type not registered here).
        uuid_as: how ``arrow.uuid`` values come back (``_arrow_extensions.py``).
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
        self.name = name
        self.arrow_type = arrow_type
        self.label = label
        ext = extension_of(arrow_type, metadata)
        self.meaning = meaning_of(ext, name, label, uuid_as) if ext is not None else None
        self.kind = self.meaning.kind if self.meaning else classify(arrow_type, name, label)
        self.fill = fill
        self.fill_is_global = fill_is_global
        self.path = path or (name,)
        self.records = records
        self._fill: Any = None

    def extract(self, chunk: Any) -> Any:
        """This column's values out of a chunk of its top-level column, normalized.

        A struct field comes with its struct's nulls merged in (``StructArray.flatten``),
        as ``Table.flatten()`` gives it; a chunk of another type (a Parquet file whose
        type was promoted) is cast to the column's.
        """
        for field in self.path[1:]:
            chunk = decoded(chunk)
            chunk = chunk.flatten()[chunk.type.get_field_index(field)]
        if chunk.type != self.arrow_type:  # a file's type, promoted to the dataset's
            chunk = chunk.cast(self.arrow_type)
        if self.meaning is not None:  # an extension type, as what it means
            chunk = self.meaning.convert(chunk)
        return chunk if self.kind.kind == "nested" else normalize(chunk)

    # -- nested columns (Note [Nested Arrow columns] in _arrow_nested.py) --------------------
    def nested_fill(self) -> tuple[bytes | None, Any] | None:
        """The (text, number) put in place of a nested column's null leaves (None: refuse)."""
        fill = self.fill
        if fill is None:
            return None
        if isinstance(fill, str):
            return fill.encode("utf-8"), None
        if isinstance(fill, bytes):
            return fill, None
        if isinstance(fill, (bool, int, float, np.bool_, np.number)) and np.ndim(fill) == 0:
            return b"", fill
        raise self._bad_fill("a str or a number", "''")

    def nested_parts(self, arr: Any, where: str) -> Parts:
        """One chunk of a nested column taken apart into its levels' pieces."""
        return parts(arr, self.kind.tree, self.nested_fill(), where, self.name)  # type: ignore[arg-type]

    # -- nulls -----------------------------------------------------------------------------
    def count_nulls(self, arr: Any) -> int:
        """Null values in a normalized chunk (null rows, and null elements of lists)."""
        if self.meaning is not None and self.meaning.atomic:  # a null UUID is one null
            return int(arr.null_count)
        if self.kind.kind == "tensor":
            _, mask = _leaf(arr)
            return 0 if mask is None else int(len(mask) - np.count_nonzero(mask))
        nulls = arr.null_count
        if self.kind.kind == "ragged":
            nulls += self._child(arr).null_count
        return int(nulls)

    def check_fill(self, arr: Any) -> None:
        """Check the fill value against a chunk that has nulls (before anything is loaded)."""
        if self.kind.kind != "ragged" or self._child(arr).null_count:
            self.fill_scalar()  # null list rows become [] whatever the fill value

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

    def fill_scalar(self) -> Any:
        """The fill value, checked against the column's type (a numpy scalar, or bytes)."""
        if self._fill is None:
            self._fill = self._checked_fill()
        return self._fill

    def _checked_fill(self) -> Any:
        fill, kind, dtype = self.fill, self.kind.kind, self.kind.dtype
        if kind in ("str", "bytes"):
            if isinstance(fill, str):
                return fill.encode("utf-8")
            if isinstance(fill, bytes):
                try:
                    if kind == "str":
                        fill.decode("utf-8")
                    return fill
                except UnicodeDecodeError:
                    pass
            elif self.fill_is_global and isinstance(fill, (int, float, np.number)):
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

    # -- chunk -> buffers --------------------------------------------------------------------
    def _child(self, arr: Any) -> Any:
        offsets = _var_offsets(arr)
        start, stop = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
        return arr.values.slice(start, stop - start)

    def var_parts(self, arr: Any) -> tuple[np.ndarray, Any, np.ndarray | None]:
        """Offsets, values (numpy) and element validity of a normalized var-length chunk.

        Null rows are replaced by the fill value here (the caller has checked that
        one was given); null elements of lists are reported by the mask.
        """
        pa = pyarrow_module()
        if arr.null_count:
            if self.kind.kind == "ragged":
                arr = pa.compute.fill_null(arr, pa.scalar([], type=arr.type))
            else:
                fill = self.fill_scalar()
                text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
                scalar = pa.scalar(fill.decode("utf-8") if text else fill, type=arr.type)
                arr = pa.compute.fill_null(arr, scalar)
        offsets = _var_offsets(arr)
        start, stop = int(offsets[0]), int(offsets[-1])
        if self.kind.kind == "ragged":
            child = arr.values.slice(start, stop - start)
            mask = _valid_mask(child) if child.null_count else None
            return offsets, _numpy_values(child, self.kind.dtype), mask
        data = arr.buffers()[2]
        if data is None or stop == start:
            return offsets, np.zeros(0, np.uint8), None
        return offsets, np.frombuffer(data, np.uint8, count=stop - start, offset=start), None


def _count_keys(tree: Any) -> list[str]:
    """Per level of a nested tree, the buffer whose length is its number of elements.

    A struct has no buffer: its elements are its first field's.
    """
    levels = children(tree)

    def key(i: int) -> str:
        level, kids = levels[i]
        if level.kind == "struct":
            return key(kids[0])
        return f"{i}.data" if level.kind == "num" else f"{i}.offsets"

    return [key(i) for i in range(len(levels))]


class Copy:
    """One column's chunks as what each of its buffers receives, in order.

    :meth:`pieces` turns a normalized chunk into ``(key, values, base)`` triples: the
    values appended to buffer ``key``, and for an offsets buffer (``values``: the
    chunk's ``n + 1`` offsets, any start) the buffer whose running length they are
    rebased onto. :class:`Sizer` adds up the lengths, :class:`Writer` copies.
    """

    def __init__(self, column: ArrowColumn) -> None:
        self.column = column
        tree = column.kind.tree
        self.levels = tree.levels() if tree is not None else []
        self.count_keys = _count_keys(tree) if tree is not None else []
        self.length: dict[str, int] = {}  # per buffer: elements appended so far

    def pieces(self, arr: Any, where: str) -> tuple[list[tuple[str, Any, str | None]], int]:
        """The pieces of one chunk and its nulls (no pieces: nulls with no fill value)."""
        col, kind = self.column, self.column.kind.kind
        if kind == "nested":
            p = col.nested_parts(arr, where)
            out: list[tuple[str, Any, str | None]] = []
            for i, level in enumerate(self.levels):
                if level.kind == "list":
                    out.append((f"{i}.offsets", _offsets(p.lengths[i]), self.count_keys[i + 1]))
                elif level.kind in ("str", "bytes"):
                    out.append((f"{i}.offsets", _offsets(p.lengths[i]), f"{i}.values"))
                    out.append((f"{i}.values", p.data[i], None))
                elif level.kind == "num":
                    out.append((f"{i}.data", p.data[i], None))
            return out, p.nulls
        nulls = col.count_nulls(arr)
        if nulls and col.fill is None:
            return [], nulls
        if kind == "tensor":
            leaf, mask = _leaf(arr)
            values = _numpy_values(leaf, col.kind.dtype)
            if mask is not None:
                values = values.copy()
                values[~mask] = col.fill_scalar()
            return [("data", values.reshape(len(arr), *col.kind.shape), None)], nulls
        offsets, values, mask = col.var_parts(arr)
        if mask is not None:
            values = values.copy()
            values[~mask] = col.fill_scalar()
        return [("offsets", offsets, "values"), ("values", values, None)], nulls

    @staticmethod
    def size(key: str, values: Any) -> int:
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
        pieces, nulls = self.pieces(chunk, where)
        if nulls:
            self.nulls[where] = self.nulls.get(where, 0) + nulls
            if column.fill is not None and column.kind.kind != "nested":
                column.check_fill(chunk)
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


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """The ``n + 1`` offsets from 0 of ``n`` lengths."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _check_utf8(chunk: Any, name: str, where: str) -> None:
    """Refuse a string chunk whose bytes are not UTF-8 (Parquet readers do not check).

    Found by fuzzing: a flipped bit in a string page loads without complaint and
    fails later, on access, with a ``UnicodeDecodeError`` that names nothing.
    """
    try:
        chunk.validate(full=True)
    except pyarrow_module().ArrowInvalid as error:
        raise SourceReadError(
            f"{where}: column {name!r} holds bytes that are not UTF-8 text ({error}). The "
            "file is corrupt, or the column is binary data written as a string: re-create "
            "the file, or store the column as binary (it then loads as bytes)."
        ) from error
