"""Arrow columns -> shared buffers: Arrow types -> column kinds, chunks -> buffers, selection.

What :class:`~shareddata.sources.arrow.ArrowDataset` (in-memory tables) and
:class:`~shareddata.sources.parquet.ParquetDataset` (decoded Parquet batches) share:
a selected column (:class:`ArrowColumn`, struct fields flattened to ``s.a``), its
sizing pass (:class:`Sizer`) and its copy into the buffers (:class:`Writer`, only
through ``Buffer.rows``); see Note [Reading Parquet into shared memory] in
``parquet.py`` for how Parquet batches are cut.

Type mapping (Arrow type -> column kind):

* integers, floats (float16 too), bool -> ``"tensor"`` with scalar rows;
* ``fixed_size_list`` of numbers (nested -> several dimensions) and the
  ``arrow.fixed_shape_tensor`` extension type -> ``"tensor"`` with that row shape;
* timestamps, dates, times and durations -> ``"tensor"`` of their integer storage
  (int64 or int32 counts of their unit since the epoch; timestamps in UTC);
* ``string`` / ``large_string`` / ``string_view`` -> ``"str"``;
  ``binary`` / ``large_binary`` / ``binary_view`` / ``fixed_size_binary`` -> ``"bytes"``;
* ``list`` / ``large_list`` / list views of numbers -> ``"ragged"``;
* dictionary-encoded columns -> the kind of their values (decoded while copying);
* other extension types -> the kind of their storage type.

Structs, maps, unions, decimals and lists of non-numbers are refused with
:class:`UnsupportedDtypeError` saying what to do. Nulls are refused with
:class:`NullValuesError` unless a ``fill_value`` is given: never a silent 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._columns import ColumnSpec
from .._load import Buffer
from .._nested import Level, NestedSpec
from ..errors import (
    EmptySelectionError,
    MissingColumnError,
    NullValuesError,
    SourceReadError,
    UnsupportedDtypeError,
    missing_dependency,
)
from ._arrow_nested import Parts, Refused, decoded, level_of, parts, temporal_storage

FillValue = Any  # a scalar, or a mapping {column: scalar}


def pyarrow_module() -> ModuleType:
    """``pyarrow``, imported on first use so ``import shareddata`` works without it."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401  (pc.fill_null, pc.if_else)
    except ImportError as e:
        missing_dependency("pyarrow", "parquet", e)
    return pyarrow


def release_arrow_memory() -> None:
    """Give the memory Arrow's allocator keeps after a read back to the system."""
    pa = pyarrow_module()
    pa.default_memory_pool().release_unused()


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


# -- Arrow types -> column kinds -----------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    kind: str  # "tensor", "ragged", "str", "bytes", "nested"
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    tree: Level | None = None  # the levels of a "nested" column


def _unsupported(name: str, label: str, arrow_type: Any, fix: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        f"column {name!r} of {label} has Arrow type {arrow_type}, which shareddata cannot "
        f"store. Fix: {fix}; or leave the column out with columns=[...]."
    )


def _numeric_dtype(t: Any) -> np.dtype | None:
    """The numpy dtype of an integer, float or bool Arrow type (else None)."""
    pa = pyarrow_module()
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.dtype(t.to_pandas_dtype())
    return None


def is_list(t: Any) -> bool:
    pa = pyarrow_module()
    return bool(
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


def _classify(t: Any, name: str, label: str) -> _Kind:
    """The column kind an Arrow type is stored as, or a clear UnsupportedDtypeError."""
    pa = pyarrow_module()
    if isinstance(t, pa.FixedShapeTensorType):
        perm = t.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise _unsupported(
                name,
                label,
                t,
                "a tensor with a non-default dimension order (permutation); store it "
                "row-major (permutation=None)",
            )
        inner = _classify(t.storage_type, name, label)
        return _Kind("tensor", inner.dtype, tuple(int(s) for s in t.shape))
    if isinstance(t, pa.BaseExtensionType):
        return _classify(t.storage_type, name, label)
    if pa.types.is_dictionary(t):
        inner = _classify(t.value_type, name, label)
        if inner.kind not in ("tensor", "str", "bytes") or inner.shape:
            raise _unsupported(name, label, t, "decode the dictionary (pc.dictionary_decode)")
        return inner
    if pa.types.is_run_end_encoded(t):
        return _classify(t.value_type, name, label)
    dtype = _numeric_dtype(t)
    if dtype is not None:
        return _Kind("tensor", dtype)
    storage = temporal_storage(t)
    if storage is not None:
        return _Kind("tensor", np.dtype(storage.to_pandas_dtype()))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return _Kind("str", np.dtype(np.uint8))
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return _Kind("bytes", np.dtype(np.uint8))
    if pa.types.is_fixed_size_list(t):
        item = _classify(t.value_type, name, label) if _is_numberish(t.value_type) else None
        if item is None or item.kind != "tensor":
            raise _unsupported(
                name,
                label,
                t,
                "a fixed-size list must hold numbers (or fixed-size lists of numbers); store "
                "other values as separate columns",
            )
        return _Kind("tensor", item.dtype, (int(t.list_size), *item.shape))
    if is_list(t):
        inner_dtype = _numeric_dtype(t.value_type)
        if inner_dtype is not None:
            return _Kind("ragged", inner_dtype)
        try:  # lists of strings, records, lists: Note [Nested Arrow columns]
            return _Kind("nested", np.dtype(np.uint8), (), level_of(t))
        except Refused as e:
            raise _unsupported(
                name,
                label,
                t,
                f"its elements hold {e.args[0]}, which a nested column cannot store (lists, "
                "structs, strings, binary and numbers can); cast that part to one of those",
            ) from None
    if pa.types.is_struct(t):
        fix = (
            "a struct without fields (or inside a dictionary/extension type) has nothing to "
            "load; drop it"
        )
    elif pa.types.is_map(t):
        fix = (
            "a map: store its keys and its values as two list columns (pc.map_keys, pc.map_values)"
        )
    elif pa.types.is_decimal(t):
        fix = (
            "decimals have no exact numpy type: cast it to float64 (pc.cast(column, "
            "pa.float64())), to int64 in units of its scale, or to strings"
        )
    elif pa.types.is_null(t):
        fix = "the column holds only nulls: drop it, or give it a type and values"
    else:
        fix = "cast it to numbers, strings or binary before loading"
    raise _unsupported(name, label, t, fix)


def _is_numberish(t: Any) -> bool:
    pa = pyarrow_module()
    return _numeric_dtype(t) is not None or pa.types.is_fixed_size_list(t)


def _normalize(arr: Any) -> Any:
    """An Arrow array in the physical form the copy understands (no dictionary, views...).

    Strings and binary -> ``(large_)string/(large_)binary``, lists -> ``(large_)list``,
    temporal -> their integer storage, extension -> storage, dictionary -> decoded.
    """
    pa = pyarrow_module()
    while True:
        t = arr.type
        if isinstance(t, pa.BaseExtensionType):
            arr = arr.storage
        elif pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
            arr = decoded(arr)
        elif pa.types.is_string_view(t):
            arr = arr.cast(pa.large_string())
        elif pa.types.is_binary_view(t) or pa.types.is_fixed_size_binary(t):
            arr = arr.cast(pa.large_binary())
        elif pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
            # rebuilt from the views' lengths and values in order: a view's offsets may
            # be in any order, or overlap (a cast gave every row empty, pyarrow 26)
            lengths = pa.compute.fill_null(pa.compute.list_value_length(arr), 0)
            offsets = np.zeros(len(arr) + 1, np.int64)
            np.cumsum(lengths.to_numpy(zero_copy_only=False), out=offsets[1:])
            mask = arr.is_null() if arr.null_count else None
            arr = pa.LargeListArray.from_arrays(pa.array(offsets), arr.flatten(), mask=mask)
        elif temporal_storage(t) is not None:
            arr = arr.view(temporal_storage(t))
        else:
            return arr


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
    ) -> None:
        self.name = name
        self.arrow_type = arrow_type
        self.label = label
        self.kind = _classify(arrow_type, name, label)
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
        return chunk if self.kind.kind == "nested" else _normalize(chunk)

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

    def var_size(self, arr: Any) -> int:
        """The number of values a normalized chunk adds (after filling nulls)."""
        offsets = self.var_parts(arr)[0]
        return int(offsets[-1]) - int(offsets[0])


class Writer:
    """Copies one column's chunks, in order, into its shared buffers."""

    def __init__(self, column: ArrowColumn, spec: ColumnSpec, buffers: dict[str, Buffer]) -> None:
        self.column = column
        self.spec = spec
        self.buffers = buffers
        self.row = 0
        self.value = 0
        self.done: list[int] = []  # nested: elements written per level
        self.bytes_done: list[int] = []  # nested: string bytes written per level
        if spec.kind == "nested":
            for key, buf in buffers.items():
                if key.endswith(".offsets"):
                    buf.rows(0, 1)[0] = 0
            levels = len(column.kind.tree.levels())  # type: ignore[union-attr]
            self.done, self.bytes_done = [0] * levels, [0] * levels
        elif spec.kind != "tensor":
            buffers["offsets"].rows(0, 1)[0] = 0

    def write(self, arr: Any, where: str) -> int:
        """Copy one normalized chunk; return the bytes written."""
        col, spec, n = self.column, self.spec, len(arr)
        if self.row + n > spec.rows:
            raise SourceReadError(
                f"{where} has more rows than its metadata said ({spec.rows}); was the file "
                "changed while it was being loaded?"
            )
        if spec.kind == "nested":
            return self._write_nested(col.nested_parts(arr, where), where)
        nulls = col.count_nulls(arr)
        if nulls and col.fill is None:  # the sizing pass did not see them: changed file
            raise col.null_error({where: nulls}, at_least=True)
        if spec.kind == "tensor":
            leaf, mask = _leaf(arr)
            values = _numpy_values(leaf, spec.dtype)
            dest = self.buffers["data"].rows(self.row, self.row + n).reshape(-1)
            dest[...] = values
            if mask is not None:
                dest[~mask] = col.fill_scalar()
            self.row += n
            return dest.nbytes
        offsets, values, mask = col.var_parts(arr)
        end = self.value + len(values)
        if end > spec.values:
            raise SourceReadError(
                f"{where} has more values in column {spec.name!r} than the sizing pass counted "
                f"({spec.values}); was the file changed while it was being loaded?"
            )
        dest_offsets = self.buffers["offsets"].rows(self.row + 1, self.row + n + 1)
        rebase_offsets(offsets, self.value, dest_offsets)
        dest = self.buffers["values"].rows(self.value, end)
        dest[...] = values
        if mask is not None:
            dest[~mask] = col.fill_scalar()
        self.row += n
        self.value = end
        return dest_offsets.nbytes + dest.nbytes

    def _write_nested(self, pieces: Parts, where: str) -> int:
        col, spec, buffers = self.column, self.spec, self.buffers
        assert isinstance(spec, NestedSpec)
        if pieces.nulls and col.fill is None:  # the sizing pass did not see them
            raise col.null_error({where: pieces.nulls}, at_least=True)
        written = 0
        levels = spec.tree.levels()
        for i, level in enumerate(levels):
            n, e = pieces.count[i], self.done[i]
            if e + n > spec.counts[i][0]:
                raise SourceReadError(
                    f"{where} has more values in column {spec.name!r} than the sizing pass "
                    "counted; was the file changed while it was being loaded?"
                )
            if level.kind in ("list", "str", "bytes"):
                # a list's child level follows it in preorder
                base = self.done[i + 1] if level.kind == "list" else self.bytes_done[i]
                dest = buffers[f"{i}.offsets"].rows(e + 1, e + n + 1)
                np.cumsum(pieces.lengths[i], out=dest)
                dest += base
                written += dest.nbytes
            if level.kind in ("str", "bytes"):
                data, v = pieces.data[i], self.bytes_done[i]
                if v + len(data) > spec.counts[i][1]:
                    raise SourceReadError(
                        f"{where} has more text in column {spec.name!r} than the sizing pass "
                        "counted; was the file changed while it was being loaded?"
                    )
                buffers[f"{i}.values"].rows(v, v + len(data))[...] = data
                self.bytes_done[i] = v + len(data)
                written += len(data)
            elif level.kind == "num":
                dest = buffers[f"{i}.data"].rows(e, e + n)
                dest[...] = pieces.data[i]
                written += dest.nbytes
        for i in range(len(levels)):
            self.done[i] += pieces.count[i]
        self.row = self.done[0]
        return written

    def finish(self, where: str) -> None:
        """Check that every row (and value) the spec promised was written."""
        spec = self.spec
        if isinstance(spec, NestedSpec):
            full = [(d, b) for d, b in zip(self.done, self.bytes_done)]
            counts = [(n, v if lv.kind in ("str", "bytes") else 0)
                      for (n, v), lv in zip(spec.counts, spec.tree.levels())]  # fmt: skip
            if full != counts:
                raise SourceReadError(
                    f"{where} gave fewer values for column {spec.name!r} than the sizing pass "
                    "counted; was the file changed while it was being loaded?"
                )
        short = self.row != spec.rows or (
            spec.kind not in ("tensor", "nested") and self.value != spec.values
        )
        if short:
            raise SourceReadError(
                f"{where} gave {self.row} rows for column {spec.name!r} where its metadata said "
                f"{spec.rows}; was the file changed while it was being loaded?"
            )


class Sizer:
    """Counts one column's nulls and values over its chunks: the exact spec, or the error."""

    def __init__(self, column: ArrowColumn) -> None:
        self.column = column
        self.values = 0
        self.nulls: dict[str, int] = {}
        self.counts: list[list[int]] = []  # nested: [elements, bytes] per level

    def add(self, where: str, _: str, chunk: Any) -> None:
        """Account for one normalized chunk from ``where``."""
        column = self.column
        if column.kind.kind == "nested":
            self._add_nested(where, chunk)
            return
        nulls = column.count_nulls(chunk)
        if nulls:
            self.nulls[where] = self.nulls.get(where, 0) + nulls
            if column.fill is None:
                return  # reported once every chunk is counted
            column.check_fill(chunk)
        if column.kind.kind == "str":
            _check_utf8(chunk, column.name, where)
        if column.kind.kind != "tensor":
            self.values += column.var_size(chunk)

    def _add_nested(self, where: str, chunk: Any) -> None:
        column = self.column
        tree = column.kind.tree
        assert tree is not None
        _check_utf8(chunk, column.name, where)
        pieces = column.nested_parts(chunk, where)
        if pieces.nulls:
            self.nulls[where] = self.nulls.get(where, 0) + pieces.nulls
        if not self.counts:
            self.counts = [[0, 0] for _ in tree.levels()]
        for i, level in enumerate(tree.levels()):
            self.counts[i][0] += pieces.count[i]
            if level.kind in ("str", "bytes"):
                self.counts[i][1] += len(pieces.data[i])

    def spec(self, rows: int) -> ColumnSpec:
        """The column's spec, or NullValuesError if it has nulls and no fill value."""
        column, k = self.column, self.column.kind
        if self.nulls and column.fill is None:
            raise column.null_error(self.nulls)
        if k.tree is not None:
            counts = self.counts or [[0, 0] for _ in k.tree.levels()]
            return NestedSpec(
                column.name, rows, k.dtype, (), "nested", 0,
                tree=k.tree, counts=tuple((n, v) for n, v in counts), records=column.records,
            )  # fmt: skip
        return ColumnSpec(column.name, rows, k.dtype, k.shape, k.kind, self.values)


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


def _fill_for(fill_value: FillValue, name: str) -> tuple[Any, bool]:
    """The fill value for column ``name`` and whether it came from a global scalar."""
    if isinstance(fill_value, Mapping):
        return fill_value.get(name), False
    return fill_value, fill_value is not None


def _check_fill_keys(fill_value: FillValue, names: Sequence[str], label: str) -> None:
    if isinstance(fill_value, Mapping):
        unknown = [k for k in fill_value if k not in names]
        if unknown:
            raise MissingColumnError(
                f"fill_value names column {unknown[0]!r}, which is not loaded from {label}; "
                f"the columns are: {', '.join(repr(n) for n in names) or 'none'}."
            )


def _fields(schema: Any) -> list[tuple[str, tuple[str, ...], Any]]:
    """Every loadable column of a schema: ``(name, path, type)``, structs flattened.

    A struct column ``s`` with fields ``a`` and ``b`` gives ``s.a`` and ``s.b`` (nested
    structs ``s.b.c``), the names ``Table.flatten()`` gives them.
    """
    pa = pyarrow_module()
    out: list[tuple[str, tuple[str, ...], Any]] = []

    def walk(name: str, path: tuple[str, ...], t: Any) -> None:
        if pa.types.is_struct(t) and t.num_fields:
            for f in t:
                walk(f"{name}.{f.name}", (*path, f.name), f.type)
        else:
            out.append((name, path, t))

    for f in schema:
        walk(f.name, (f.name,), f.type)
    return out


def _groups(fields: Sequence[tuple[str, tuple[str, ...], Any]]) -> dict[str, list[str]]:
    """Each struct's name (``s``, ``s.b``) -> the flattened columns under it."""
    groups: dict[str, list[str]] = {}
    for name, path, _ in fields:
        for k in range(1, len(path)):
            groups.setdefault(".".join(path[:k]), []).append(name)
    return groups


def make_columns(
    schema: Any,
    names: Sequence[str],
    label: str,
    fill_value: FillValue,
    records: bool = True,
) -> list[ArrowColumn]:
    _check_fill_keys(fill_value, names, label)
    by_name = {name: (path, t) for name, path, t in _fields(schema)}
    columns = []
    for name in names:
        fill, is_global = _fill_for(fill_value, name)
        path, t = by_name[name]
        columns.append(ArrowColumn(name, t, label, fill, is_global, path, records))
    return columns


def select_fields(schema: Any, columns: Sequence[str] | None, label: str) -> list[str]:
    """The flattened columns selected from ``schema`` (a struct's name selects its fields)."""
    fields = _fields(schema)
    return _select([n for n, _, _ in fields], columns, label, _groups(fields))


def _empty_selection(available: Sequence[str], label: str) -> EmptySelectionError:
    what = "columns=[] selects no column of" if available else "no column to load: nothing in"
    return EmptySelectionError(
        f"{what} {label}, so the dataset would have no rows and a training loop over it no "
        f"batches; it has: {', '.join(repr(n) for n in available) or 'no columns'}. Pass the "
        "columns to load (or columns=None for all of them)."
    )


def _select(
    available: Sequence[str],
    columns: Sequence[str] | None,
    label: str,
    groups: Mapping[str, list[str]] | None = None,
) -> list[str]:
    dupes = {n for n in available if list(available).count(n) > 1}
    if columns is None:
        wanted = list(available)
    else:
        wanted = [columns] if isinstance(columns, str) else list(columns)
        if groups:  # a struct's name: its fields, in order
            wanted = [n for c in wanted for n in ([c] if c in available else groups.get(c, [c]))]
        missing = [c for c in wanted if c not in available]
        if missing:
            raise MissingColumnError(
                f"column {missing[0]!r} is not in {label}; it has: "
                f"{', '.join(repr(n) for n in available) or 'no columns'}."
            )
    if not wanted:
        raise _empty_selection(available, label)
    clash = [n for n in wanted if n in dupes]
    if clash:
        raise MissingColumnError(
            f"column name {clash[0]!r} appears more than once in {label}, so it does not name "
            "one column; rename the columns (table.rename_columns) or select others."
        )
    return wanted
