"""Arrow types -> column kinds (:func:`classify`), chunks -> the few layouts the copy reads.

Numbers, bool and temporal types (as their integer storage) -> ``"tensor"``;
fixed-size lists of numbers and ``arrow.fixed_shape_tensor`` -> ``"tensor"`` of that
row shape; strings -> ``"str"``; binary -> ``"bytes"``; lists of numbers ->
``"ragged"``; lists of strings, lists and structs -> ``"nested"`` (Note [Nested Arrow
columns] in ``_arrow_columns.py``); dictionary and run-end encodings -> their values.
Extension types load as their meaning (:func:`meaning_of`: UUIDs, bool8, JSON, HF
``datasets`` arrays), recognised by name even when their class is not registered
(``ARROW:extension:name`` in the field's metadata), or are refused by name. Maps,
unions, decimals and empty structs are refused saying what to do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from ..columns._columns import UuidColumn
from ..columns._nested import Level
from ..errors import (
    InvalidArgumentError,
    SourceReadError,
    UnsupportedDtypeError,
    missing_dependency,
)

__all__ = [
    "ArrowKind", "Meaning", "UuidAs", "check_uuid_as", "classify", "decoded", "extension_of",
    "is_list", "list_parts", "meaning_of", "normalize", "pyarrow_module", "release_arrow_memory",
    "temporal_storage",
]  # fmt: skip

UuidAs = Literal["uuid", "tensor"]
_NAME, _METADATA = b"ARROW:extension:name", b"ARROW:extension:metadata"
_HF_ARRAY = re.compile(r"datasets\.features\.features\.Array([2-5])DExtensionType")


def pyarrow_module() -> ModuleType:
    """``pyarrow``, imported on first use so ``import shareddata`` works without it."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
    except ImportError as e:
        missing_dependency("pyarrow", "parquet", e)
    return pyarrow


def release_arrow_memory() -> None:
    """Give the memory Arrow's allocator keeps after a read back to the system."""
    pyarrow_module().default_memory_pool().release_unused()


@dataclass(frozen=True)
class ArrowKind:
    kind: str  # "tensor", "ragged", "str", "bytes", "nested"
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    tree: Level | None = None  # the levels of a "nested" column
    column: str | None = None  # the column class, where not ``kind``'s ("uuid")

    @property
    def spec_kind(self) -> str:
        return self.column or self.kind


class Refused(Exception):
    """An Arrow type inside a nested column that no level can hold (``args[0]``)."""


def unsupported(name: str, label: str, arrow_type: Any, fix: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        f"column {name!r} of {label} has Arrow type {arrow_type}, which shareddata cannot "
        f"store. Fix: {fix}; or leave the column out with columns=[...]."
    )


def _numeric(t: Any, temporal: bool = False) -> np.dtype | None:
    """The numpy dtype of a number or bool type (or temporal, as its storage), else None."""
    pa = pyarrow_module()
    storage = temporal_storage(t) if temporal else None
    t = t if storage is None else storage
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


def _text_kind(t: Any) -> str | None:
    """``"str"`` for a string type, ``"bytes"`` for a binary one, else None."""
    pa = pyarrow_module().types
    if pa.is_string(t) or pa.is_large_string(t) or pa.is_string_view(t):
        return "str"
    if (
        pa.is_binary(t)
        or pa.is_large_binary(t)
        or pa.is_binary_view(t)
        or pa.is_fixed_size_binary(t)
    ):
        return "bytes"
    return None


def classify(t: Any, name: str, label: str) -> ArrowKind:
    """The column kind an Arrow type is stored as, or an UnsupportedDtypeError with the fix.

    (Nested) fixed-size lists of numbers are tensors, lists of numbers ragged; any other
    type is what its level tree (:func:`level_of`) says: a number, text or nested lists.
    """
    pa = pyarrow_module()
    if isinstance(t, pa.FixedShapeTensorType):
        perm = t.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise unsupported(name, label, t, "a tensor with a non-default dimension order "
                              "(permutation); store it row-major (permutation=None)")  # fmt: skip
        inner = classify(t.storage_type, name, label)
        return ArrowKind("tensor", inner.dtype, tuple(int(s) for s in t.shape))
    if isinstance(t, pa.BaseExtensionType):  # top-level ones: meaning_of
        raise unsupported(
            name, label, t, "an extension type inside another type; store a plain Arrow type"
        )
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        inner = classify(t.value_type, name, label)
        if pa.types.is_dictionary(t) and (inner.kind in ("ragged", "nested") or inner.shape):
            raise unsupported(name, label, t, "decode the dictionary (pc.dictionary_decode)")
        return inner
    shape: tuple[int, ...] = ()
    item = t
    while pa.types.is_fixed_size_list(item):
        shape, item = (*shape, int(item.list_size)), item.value_type
    if shape or (is_list(t) and _numeric(t.value_type) is not None):
        dtype = _numeric(item if shape else t.value_type)
        if dtype is None:
            raise unsupported(name, label, t, "a fixed-size list must hold numbers (or "
                              "fixed-size lists of numbers); store other values as separate "
                              "columns")  # fmt: skip
        return ArrowKind("tensor" if shape else "ragged", dtype, shape)
    try:
        level = level_of(t)
        if level.kind != "struct":  # a struct with fields: inside a dictionary
            kind = {"list": "nested", "num": "tensor"}.get(level.kind, level.kind)
            return ArrowKind(kind, np.dtype(level.dtype), (), level if kind == "nested" else None)
    except Refused as e:
        if is_list(t):
            raise unsupported(name, label, t, f"its elements hold {e.args[0]}, which a nested "
                              "column cannot store (lists, structs, strings, binary and numbers "
                              "can); cast that part to one of those") from None  # fmt: skip
    fix = next((fix for test, fix in _FIXES.items() if getattr(pa.types, test)(t)), None)
    raise unsupported(name, label, t, fix or "cast it to numbers, strings or binary before loading")


_FIXES = {  # what to do with a type no column kind holds
    "is_struct": "a struct without fields (or inside a dictionary/extension type) has nothing "
    "to load; drop it",
    "is_map": "a map: store its keys and its values as two list columns (pc.map_keys, "
    "pc.map_values)",
    "is_decimal": "decimals have no exact numpy type: cast it to float64 (pc.cast(column, "
    "pa.float64())), to int64 in units of its scale, or to strings",
    "is_null": "the column holds only nulls: drop it, or give it a type and values",
}


def level_of(t: Any) -> Level:
    """The level tree of an Arrow type; :class:`Refused` names a type it cannot hold."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        if t.extension_name == "arrow.json":  # its storage is its text
            return level_of(t.storage_type)
        raise Refused(t)  # inside lists its meaning would be lost
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return level_of(t.value_type)
    dtype, text = _numeric(t, temporal=True), _text_kind(t)
    if dtype is not None:
        return Level("num", dtype.name)
    if text is not None:
        return Level(text)
    if is_list(t) or pa.types.is_fixed_size_list(t):
        return Level("list", children=(_field_level(t.value_field),))
    if pa.types.is_struct(t) and t.num_fields:
        names = tuple(f.name for f in t)
        return Level("struct", names=names, children=tuple(_field_level(f) for f in t))
    raise Refused(t)


def _field_level(field: Any) -> Level:
    name = (field.metadata or {}).get(_NAME)  # an unregistered extension is refused
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
        elif pa.types.is_dictionary(t):  # (views normalized: no take kernel for them)
            arr = normalize(arr.dictionary).take(arr.indices)
        elif pa.types.is_run_end_encoded(t):
            arr = pa.compute.run_end_decode(arr)
        else:
            return arr


def normalize(arr: Any) -> Any:
    """``arr`` decoded, views as ``large_*`` types, temporal types as their integers."""
    pa = pyarrow_module()
    arr = decoded(arr)
    t = arr.type
    if pa.types.is_string_view(t):
        return arr.cast(pa.large_string())
    if pa.types.is_binary_view(t) or pa.types.is_fixed_size_binary(t):
        return arr.cast(pa.large_binary())
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        offsets, values = list_parts(arr)  # a view's offsets may be in any order, or overlap
        mask = arr.is_null() if arr.null_count else None
        return pa.LargeListArray.from_arrays(pa.array(offsets), values, mask=mask)
    storage = temporal_storage(t)
    return arr.view(storage) if storage is not None else arr


def list_parts(arr: Any) -> tuple[np.ndarray, Any]:
    """A list (or list view) array's ``n + 1`` offsets and the values they cover.

    A plain list without nulls gives its own offsets; else they are int64 from the
    lengths (a null list is empty) from 0, the values ``flatten()`` (in row order,
    whatever a view's offsets are).

    Example:
        >>> import pyarrow as pa
        >>> offsets, values = list_parts(pa.array([[1, 2], None, [3]]))
        >>> offsets.tolist(), values.to_pylist()
        ([0, 2, 2, 3], [1, 2, 3])
    """
    pa, pc = pyarrow_module(), pyarrow_module().compute
    if not arr.null_count and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        return arr.offsets.to_numpy(), arr.flatten()  # as stored (not from 0 in a slice)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, arr.flatten()


# -- extension types: what they mean ----------------------------------------------------------


def check_uuid_as(uuid_as: Any) -> UuidAs:
    if uuid_as not in ("uuid", "tensor"):
        raise InvalidArgumentError(
            f"uuid_as={uuid_as!r}: pass 'uuid' (each row a uuid.UUID) or 'tensor' (each row "
            "a uint8 tensor of its 16 bytes, which batches stack)."
        )
    return uuid_as  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Extension:
    name: str
    metadata: bytes  # its serialized parameters
    storage: Any


def extension_of(t: Any, metadata: Mapping[bytes, bytes] | None = None) -> Extension | None:
    """The extension a field's type (or, unregistered, its metadata) declares, else None."""
    if isinstance(t, pyarrow_module().BaseExtensionType):
        serialize = getattr(t, "__arrow_ext_serialize__", None)  # Python-defined types
        params = serialize() if serialize is not None else (metadata or {}).get(_METADATA, b"")
        return Extension(t.extension_name, params or b"", t.storage_type)
    if metadata and _NAME in metadata:
        return Extension(
            metadata[_NAME].decode("utf-8", "replace"), metadata.get(_METADATA, b""), t
        )
    return None


@dataclass(frozen=True)
class Meaning:
    """How an extension column loads: its kind and a chunk -> loadable array conversion."""

    kind: ArrowKind
    convert: Callable[[Any], Any]
    atomic: bool = False  # a row is one value (a UUID): its nulls are counted per row


def _storage(chunk: Any) -> Any:
    return chunk.storage if isinstance(chunk.type, pyarrow_module().BaseExtensionType) else chunk


def meaning_of(ext: Extension, name: str, label: str, uuid_as: UuidAs = "uuid") -> Meaning | None:
    """How column ``name`` of extension ``ext`` loads (None: as ``classify`` says).

    ``arrow.uuid``: ``uuid.UUID`` or a uint8 tensor of its 16 bytes; ``arrow.bool8``: bool;
    ``arrow.json``: its text; HF ``Array2D``...``Array5D``: a tensor of the feature's
    shape, or its nested lists where rows vary. Any other extension is refused.
    """
    pa = pyarrow_module()
    storage = ext.storage
    if ext.name == "arrow.fixed_shape_tensor":
        return None
    if ext.name == "arrow.uuid" and storage == pa.binary(16):
        column = UuidColumn.kind if uuid_as == "uuid" else None  # (registers the kind)
        kind = ArrowKind("tensor", np.dtype(np.uint8), (16,), column=column)
        return Meaning(kind, _uuid_bytes, atomic=True)
    if ext.name == "arrow.bool8" and storage == pa.int8():
        bools = ArrowKind("tensor", np.dtype(np.bool_))
        return Meaning(bools, lambda c: _storage(c).cast(pa.bool_()))
    if ext.name == "arrow.json" and classify(storage, name, label).kind == "str":
        return Meaning(classify(storage, name, label), _storage)
    hf = _HF_ARRAY.fullmatch(ext.name)
    if hf is not None:
        return _hf_array(ext, int(hf.group(1)), name, label)
    raise unsupported(
        name,
        label,
        f"extension<{ext.name}> (storage {storage})",
        f"shareddata does not know what the extension type {ext.name!r} means, and loading its "
        "storage would silently change its values. Read it with its own library and store a plain "
        "Arrow type (numbers, strings, binary, lists); or, to load the raw storage, pass a table "
        "whose column is the storage array (pa.chunked_array([c.storage for c in column.chunks]))",
    )


def _uuid_bytes(chunk: Any) -> Any:
    """A ``fixed_size_binary[16]`` array as ``fixed_size_list<uint8>[16]``, zero-copy."""
    pa = pyarrow_module()
    storage = _storage(chunk)
    n = len(storage)
    data = storage.buffers()[1] if n else pa.py_buffer(b"")
    values = pa.Array.from_buffers(pa.uint8(), n * 16, [None, data], offset=storage.offset * 16)
    mask = storage.is_null() if storage.null_count else None
    return pa.FixedSizeListArray.from_arrays(values, 16, mask=mask)


def _hf_array(ext: Extension, ndim: int, name: str, label: str) -> Meaning:
    try:
        shape, dtype = json.loads(ext.metadata)
        shape = [None if d is None else int(d) for d in shape]
    except (ValueError, TypeError) as e:
        raise unsupported(
            name, label, ext.name, f"its parameters {ext.metadata!r} are not [shape, dtype] ({e})"
        ) from None
    if len(shape) != ndim:
        raise unsupported(name, label, ext.name, f"its shape {shape} is not {ndim}-D")
    if any(d is None for d in shape):  # rows of varying length: nested lists
        return Meaning(classify(ext.storage, name, label), _storage)
    leaf = ext.storage
    for _ in range(ndim):
        leaf = getattr(leaf, "value_type", None)
    if leaf is None or _numeric(leaf) is None:
        raise unsupported(
            name,
            label,
            f"{ext.name}(shape={shape}, dtype={dtype})",
            "an HF Array feature of non-numeric values; store it as a list column",
        )
    return Meaning(
        ArrowKind("tensor", _numeric(leaf), tuple(shape)),  # type: ignore[arg-type]
        lambda chunk: _regular(_storage(chunk), shape, name),
    )


def _regular(arr: Any, shape: list[int], name: str) -> Any:
    """Nested lists whose every row has ``shape`` as nested fixed-size lists (else an error).

    A null row becomes zeros under the fixed-size list's null bit.
    """
    pa, pc = pyarrow_module(), pyarrow_module().compute
    mask = arr.is_null() if arr.null_count else None
    if mask is not None:
        leaf = arr.type
        for _ in shape:
            leaf = leaf.value_type
        zero = False if pa.types.is_boolean(leaf) else 0
        arr = pc.fill_null(arr, pa.scalar(np.full(shape, zero, object).tolist(), arr.type))
    level = arr
    for depth, size in enumerate(shape):
        lengths = pc.list_value_length(level)
        bad = pc.not_equal(lengths, size)
        if pc.any(bad).as_py():
            i = pc.index(bad, True).as_py()
            raise SourceReadError(
                f"column {name!r}: a row holds {lengths[i].as_py()} values at dimension {depth} "
                f"where its HF Array feature's shape {tuple(shape)} says {size}; the file does "
                "not match its own schema. Re-create it."
            )
        level = level.flatten()
    for size in reversed(shape[1:]):
        level = pa.FixedSizeListArray.from_arrays(level, size)
    return pa.FixedSizeListArray.from_arrays(level, shape[0], mask=mask)
