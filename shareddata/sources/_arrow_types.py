"""Arrow types -> column kinds: which kind a type is stored as, and its physical form.

What :class:`~shareddata.ArrowDataset` and
:class:`~shareddata.ParquetDataset` share about types: a column's
kind (:func:`classify`, or an :class:`UnsupportedDtypeError` naming the column, the
type and the fix) and a chunk normalised to the few physical layouts the copy in
``_arrow_columns.py`` understands (:func:`normalize`).

Type mapping (Arrow type -> column kind):

* integers, floats (float16 too), bool -> ``"tensor"`` with scalar rows;
* ``fixed_size_list`` of numbers (nested -> several dimensions) and the
  ``arrow.fixed_shape_tensor`` extension type -> ``"tensor"`` with that row shape;
* timestamps, dates, times and durations -> ``"tensor"`` of their integer storage
  (int64 or int32 counts of their unit since the epoch; timestamps in UTC);
* ``string`` / ``large_string`` / ``string_view`` -> ``"str"``;
  ``binary`` / ``large_binary`` / ``binary_view`` / ``fixed_size_binary`` -> ``"bytes"``;
* ``list`` / ``large_list`` / list views of numbers -> ``"ragged"``;
* lists of strings, of lists and of structs -> ``"nested"`` (Note [Nested Arrow
  columns] in ``_arrow_nested.py``);
* dictionary-encoded columns -> the kind of their values (decoded while copying);
* other extension types -> their meaning (``_arrow_extensions.py``: UUIDs, bool8,
  JSON, HF ``datasets`` arrays), or refused by name; never their storage silently.

Maps, unions, decimals and empty structs are refused with
:class:`UnsupportedDtypeError` saying what to do (structs with fields are split
into their fields before they get here: ``_arrow_select.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..columns._nested import Level
from ..errors import UnsupportedDtypeError, missing_dependency
from ._arrow_nested import Refused, decoded, level_of, temporal_storage

__all__ = [
    "ArrowKind",
    "classify",
    "is_list",
    "is_numberish",
    "normalize",
    "numeric_dtype",
    "pyarrow_module",
    "release_arrow_memory",
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
    pa = pyarrow_module()
    pa.default_memory_pool().release_unused()


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


def unsupported(name: str, label: str, arrow_type: Any, fix: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        f"column {name!r} of {label} has Arrow type {arrow_type}, which shareddata cannot "
        f"store. Fix: {fix}; or leave the column out with columns=[...]."
    )


def numeric_dtype(t: Any) -> np.dtype | None:
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


def classify(t: Any, name: str, label: str) -> ArrowKind:
    """The column kind an Arrow type is stored as, or a clear UnsupportedDtypeError."""
    pa = pyarrow_module()
    if isinstance(t, pa.FixedShapeTensorType):
        perm = t.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise unsupported(
                name,
                label,
                t,
                "a tensor with a non-default dimension order (permutation); store it "
                "row-major (permutation=None)",
            )
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
    dtype = numeric_dtype(t)
    if dtype is not None:
        return ArrowKind("tensor", dtype)
    storage = temporal_storage(t)
    if storage is not None:
        return ArrowKind("tensor", np.dtype(storage.to_pandas_dtype()))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return ArrowKind("str", np.dtype(np.uint8))
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return ArrowKind("bytes", np.dtype(np.uint8))
    if pa.types.is_fixed_size_list(t):
        item = classify(t.value_type, name, label) if is_numberish(t.value_type) else None
        if item is None or item.kind != "tensor":
            raise unsupported(
                name,
                label,
                t,
                "a fixed-size list must hold numbers (or fixed-size lists of numbers); store "
                "other values as separate columns",
            )
        return ArrowKind("tensor", item.dtype, (int(t.list_size), *item.shape))
    if is_list(t):
        inner_dtype = numeric_dtype(t.value_type)
        if inner_dtype is not None:
            return ArrowKind("ragged", inner_dtype)
        try:  # lists of strings, records, lists: Note [Nested Arrow columns]
            return ArrowKind("nested", np.dtype(np.uint8), (), level_of(t))
        except Refused as e:
            raise unsupported(
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
    raise unsupported(name, label, t, fix)


def is_numberish(t: Any) -> bool:
    pa = pyarrow_module()
    return numeric_dtype(t) is not None or pa.types.is_fixed_size_list(t)


def normalize(arr: Any) -> Any:
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
