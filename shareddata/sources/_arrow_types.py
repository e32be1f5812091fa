"""Arrow types -> column kinds: which kind a type is stored as, and its physical form.

A column's kind comes from :func:`classify` (or an :class:`UnsupportedDtypeError`
naming the column, the type and the fix), and each chunk is normalised to the few
physical layouts the copy in ``_arrow_columns.py`` understands (:func:`normalize`).

* integers, floats (float16 too), bool -> ``"tensor"`` with scalar rows;
* ``fixed_size_list`` of numbers (nested -> several dimensions) and the
  ``arrow.fixed_shape_tensor`` extension type -> ``"tensor"`` with that row shape;
* timestamps, dates, times and durations -> ``"tensor"`` of their integer storage
  (int64 or int32 counts of their unit since the epoch; timestamps in UTC);
* ``string`` / ``large_string`` / ``string_view`` -> ``"str"``;
  ``binary`` / ``large_binary`` / ``binary_view`` / ``fixed_size_binary`` -> ``"bytes"``;
* ``list`` / ``large_list`` / list views of numbers -> ``"ragged"``;
* lists of strings, of lists and of structs -> ``"nested"``, a tree of levels
  (:func:`level_of`; Note [Nested Arrow columns] in ``_arrow_nested.py``);
* dictionary-encoded and run-end encoded columns -> the kind of their values;
* other extension types -> their meaning (``_arrow_extensions.py``: UUIDs, bool8,
  JSON, HF ``datasets`` arrays), or refused by name; never their storage silently.

Maps, unions, decimals and empty structs are refused saying what to do (structs with
fields are split into their fields before they get here: ``arrow.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..columns._nested import Level
from ..errors import UnsupportedDtypeError, missing_dependency

__all__ = [
    "ArrowKind",
    "Refused",
    "classify",
    "decoded",
    "is_binary",
    "is_list",
    "is_text",
    "level_of",
    "normalize",
    "pyarrow_module",
    "release_arrow_memory",
    "temporal_storage",
    "unsupported",
]


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
    pyarrow_module().default_memory_pool().release_unused()


@dataclass(frozen=True)
class ArrowKind:
    """The column kind an Arrow type is stored as (see the mapping above)."""

    kind: str  # "tensor", "ragged", "str", "bytes", "nested"
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    tree: Level | None = None  # the levels of a "nested" column
    column: str | None = None  # the column class, where not ``kind``'s ("uuid")

    @property
    def spec_kind(self) -> str:
        """The ``ColumnSpec.kind`` the column is stored as (its column class)."""
        return self.column or self.kind


class Refused(Exception):
    """An Arrow type inside a nested column that no level can hold (``args[0]``: the type)."""


def unsupported(name: str, label: str, arrow_type: Any, fix: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        f"column {name!r} of {label} has Arrow type {arrow_type}, which shareddata cannot "
        f"store. Fix: {fix}; or leave the column out with columns=[...]."
    )


def _numeric(t: Any) -> np.dtype | None:
    """The numpy dtype of an integer, float or bool Arrow type (else None)."""
    pa = pyarrow_module()
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.dtype(t.to_pandas_dtype())
    return None


def temporal_storage(t: Any) -> Any:
    """The integer type a timestamp/date/time/duration is stored as (else None)."""
    pa = pyarrow_module()
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return pa.int64()
    return None


def is_list(t: Any) -> bool:
    """A list, large list or list view (not a fixed-size list)."""
    pa = pyarrow_module().types
    return bool(pa.is_list(t) or pa.is_large_list(t) or pa.is_list_view(t)
                or pa.is_large_list_view(t))  # fmt: skip


def is_text(t: Any) -> bool:
    pa = pyarrow_module().types
    return bool(pa.is_string(t) or pa.is_large_string(t) or pa.is_string_view(t))


def is_binary(t: Any) -> bool:
    pa = pyarrow_module().types
    return bool(pa.is_binary(t) or pa.is_large_binary(t) or pa.is_binary_view(t)
                or pa.is_fixed_size_binary(t))  # fmt: skip


def classify(t: Any, name: str, label: str) -> ArrowKind:
    """The column kind an Arrow type is stored as, or a clear UnsupportedDtypeError."""
    pa = pyarrow_module()
    if isinstance(t, pa.FixedShapeTensorType):
        perm = t.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise unsupported(name, label, t, "a tensor with a non-default dimension order "
                              "(permutation); store it row-major (permutation=None)")  # fmt: skip
        inner = classify(t.storage_type, name, label)
        return ArrowKind("tensor", inner.dtype, tuple(int(s) for s in t.shape))
    if isinstance(t, pa.BaseExtensionType):  # their meanings: _arrow_extensions.py
        raise unsupported(
            name, label, t, "an extension type inside another type; store a plain Arrow type"
        )
    if pa.types.is_dictionary(t):
        inner = classify(t.value_type, name, label)
        if inner.kind not in ("tensor", "str", "bytes") or inner.shape:
            raise unsupported(name, label, t, "decode the dictionary (pc.dictionary_decode)")
        return inner
    if pa.types.is_run_end_encoded(t):
        return classify(t.value_type, name, label)
    dtype = _numeric(t if temporal_storage(t) is None else temporal_storage(t))
    if dtype is not None:
        return ArrowKind("tensor", dtype)
    if is_text(t) or is_binary(t):
        return ArrowKind("str" if is_text(t) else "bytes", np.dtype(np.uint8))
    if pa.types.is_fixed_size_list(t):
        item = t.value_type
        if _numeric(item) is None and not pa.types.is_fixed_size_list(item):
            item = None
        kind = classify(item, name, label) if item is not None else None
        if kind is None or kind.kind != "tensor":
            raise unsupported(name, label, t, "a fixed-size list must hold numbers (or "
                              "fixed-size lists of numbers); store other values as separate "
                              "columns")  # fmt: skip
        return ArrowKind("tensor", kind.dtype, (int(t.list_size), *kind.shape))
    if is_list(t):
        inner_dtype = _numeric(t.value_type)
        if inner_dtype is not None:
            return ArrowKind("ragged", inner_dtype)
        try:  # lists of strings, records, lists: Note [Nested Arrow columns]
            return ArrowKind("nested", np.dtype(np.uint8), (), level_of(t))
        except Refused as e:
            raise unsupported(name, label, t, f"its elements hold {e.args[0]}, which a nested "
                              "column cannot store (lists, structs, strings, binary and numbers "
                              "can); cast that part to one of those") from None  # fmt: skip
    if pa.types.is_struct(t):
        fix = "a struct without fields (or inside a dictionary/extension type) has nothing to load"
        fix += "; drop it"
    elif pa.types.is_map(t):
        fix = (
            "a map: store its keys and its values as two list columns (pc.map_keys, pc.map_values)"
        )
    elif pa.types.is_decimal(t):
        fix = ("decimals have no exact numpy type: cast it to float64 (pc.cast(column, "
               "pa.float64())), to int64 in units of its scale, or to strings")  # fmt: skip
    elif pa.types.is_null(t):
        fix = "the column holds only nulls: drop it, or give it a type and values"
    else:
        fix = "cast it to numbers, strings or binary before loading"
    raise unsupported(name, label, t, fix)


def level_of(t: Any) -> Level:
    """The level tree of an Arrow type; :class:`Refused` names a type it cannot hold."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        if t.extension_name == "arrow.json":  # its storage is its text
            return level_of(t.storage_type)
        raise Refused(t)  # inside lists its meaning would be lost: _arrow_extensions.py
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return level_of(t.value_type)
    dtype = _numeric(t if temporal_storage(t) is None else temporal_storage(t))
    if dtype is not None:
        return Level("num", dtype.name)
    if is_text(t) or is_binary(t):
        return Level("str" if is_text(t) else "bytes")
    if is_list(t) or pa.types.is_fixed_size_list(t):
        return Level("list", children=(_field_level(t.value_field),))
    if pa.types.is_struct(t) and t.num_fields:
        names = tuple(t.field(i).name for i in range(t.num_fields))
        return Level("struct", names=names, children=tuple(_field_level(f) for f in t))
    raise Refused(t)


def _field_level(field: Any) -> Level:
    """:func:`level_of` a child field; an unregistered extension (by metadata) is refused."""
    name = (field.metadata or {}).get(b"ARROW:extension:name")
    if name is not None and name != b"arrow.json":
        raise Refused(f"{field.type} (extension {name.decode('utf-8', 'replace')})")
    return level_of(field.type)


def decoded(arr: Any) -> Any:
    """``arr`` without extension, dictionary or run-end encoding (values as stored)."""
    pa = pyarrow_module()
    while True:
        t = arr.type
        if isinstance(t, pa.BaseExtensionType):
            arr = arr.storage
        elif pa.types.is_dictionary(t):
            values = arr.dictionary
            if pa.types.is_string_view(values.type):  # no take kernel for views
                values = values.cast(pa.large_string())
            elif pa.types.is_binary_view(values.type):
                values = values.cast(pa.large_binary())
            arr = values.take(arr.indices)
        elif pa.types.is_run_end_encoded(t):
            arr = pa.compute.run_end_decode(arr)
        else:
            return arr


def normalize(arr: Any) -> Any:
    """An Arrow array in the physical form the copy understands (no dictionary, views...).

    Strings and binary -> ``(large_)string/(large_)binary``, lists -> ``(large_)list``,
    temporal -> their integer storage, extension -> storage, dictionary -> decoded.
    """
    pa = pyarrow_module()
    arr = decoded(arr)
    t = arr.type
    if pa.types.is_string_view(t):
        return arr.cast(pa.large_string())
    if pa.types.is_binary_view(t) or pa.types.is_fixed_size_binary(t):
        return arr.cast(pa.large_binary())
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        # rebuilt from the views' lengths and values in order: a view's offsets may be in
        # any order, or overlap (a cast gave every row empty, pyarrow 26)
        lengths = pa.compute.fill_null(pa.compute.list_value_length(arr), 0)
        offsets = np.zeros(len(arr) + 1, np.int64)
        np.cumsum(lengths.to_numpy(zero_copy_only=False), out=offsets[1:])
        mask = arr.is_null() if arr.null_count else None
        return pa.LargeListArray.from_arrays(pa.array(offsets), arr.flatten(), mask=mask)
    storage = temporal_storage(t)
    return arr.view(storage) if storage is not None else arr
