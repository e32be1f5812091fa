"""Arrow extension types -> what they mean: UUIDs, bool8, JSON text, HF ``datasets`` arrays.

An extension type is a storage type plus a name that gives the bytes a meaning
(``arrow.uuid``: 16 bytes that are a UUID). A column of one loads as its meaning or
is refused by name, never silently as its storage. An extension type whose class
is not registered in this process (HF ``datasets`` not imported, say) arrives as
its storage type with the name in the field's metadata (``ARROW:extension:name``):
it is recognised by that name all the same, so a column loads the same whether or
not the library that wrote it is imported.

Meanings (extension name -> what a row gives):

* ``arrow.fixed_shape_tensor`` -> a tensor of its shape (``_arrow_types.classify``);
* ``arrow.uuid`` -> a ``uuid.UUID`` (``uuid_as="uuid"``, the default), or a uint8
  tensor of its 16 bytes (``uuid_as="tensor"``, which batches stack);
* ``arrow.bool8`` -> a bool tensor;
* ``arrow.json`` -> the JSON text, a ``str`` (as ``to_pylist()`` gives it);
* HF ``datasets`` ``Array2D`` ... ``Array5D`` -> a tensor of the feature's shape and
  dtype; with a first dimension of ``None`` (rows of different lengths), the list of
  the row's sub-arrays (1-D tensors for ``Array2D``), as its nested lists give it;
* any other (``arrow.opaque``, geoarrow, pandas periods...) -> UnsupportedDtypeError
  naming the extension.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..columns._columns import UuidColumn
from ..errors import InvalidArgumentError, SourceReadError
from ._arrow_types import ArrowKind, classify, pyarrow_module, unsupported

__all__ = ["Extension", "Meaning", "UuidAs", "check_uuid_as", "extension_of", "meaning_of"]

UuidAs = Literal["uuid", "tensor"]

_NAME, _METADATA = b"ARROW:extension:name", b"ARROW:extension:metadata"
_HF_ARRAY = re.compile(r"datasets\.features\.features\.Array([2-5])DExtensionType")


def check_uuid_as(uuid_as: Any) -> UuidAs:
    """``uuid_as`` checked: ``"uuid"`` or ``"tensor"``."""
    if uuid_as not in ("uuid", "tensor"):
        raise InvalidArgumentError(
            f"uuid_as={uuid_as!r}: pass 'uuid' (each row a uuid.UUID) or 'tensor' (each row "
            "a uint8 tensor of its 16 bytes, which batches stack)."
        )
    return uuid_as  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Extension:
    """An extension type's name, serialized parameters and storage type."""

    name: str
    metadata: bytes
    storage: Any


def extension_of(t: Any, metadata: Mapping[bytes, bytes] | None = None) -> Extension | None:
    """The extension a field's type (or, unregistered, its metadata) declares, else None."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        serialize = getattr(t, "__arrow_ext_serialize__", None)  # Python-defined types
        params = serialize() if serialize is not None else (metadata or {}).get(_METADATA, b"")
        return Extension(t.extension_name, params or b"", t.storage_type)
    if metadata and _NAME in metadata:
        name = metadata[_NAME].decode("utf-8", "replace")
        return Extension(name, metadata.get(_METADATA, b""), t)
    return None


@dataclass(frozen=True)
class Meaning:
    """How an extension column loads: its kind and a chunk -> loadable array conversion."""

    kind: ArrowKind
    convert: Callable[[Any], Any]
    atomic: bool = False  # a row is one value (a UUID): its nulls are counted per row


def _storage(chunk: Any) -> Any:
    pa = pyarrow_module()
    return chunk.storage if isinstance(chunk.type, pa.BaseExtensionType) else chunk


def meaning_of(ext: Extension, name: str, label: str, uuid_as: UuidAs = "uuid") -> Meaning | None:
    """How column ``name`` of extension ``ext`` loads (None: as ``classify`` says).

    Raises:
        UnsupportedDtypeError: an extension whose meaning shareddata does not know.
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
        return Meaning(
            ArrowKind("tensor", np.dtype(np.bool_)), lambda c: _storage(c).cast(pa.bool_())
        )
    if ext.name == "arrow.json" and classify(storage, name, label).kind == "str":
        return Meaning(classify(storage, name, label), _storage)
    hf = _HF_ARRAY.fullmatch(ext.name)
    if hf is not None:
        return _hf_array(ext, int(hf.group(1)), name, label)
    raise unsupported(
        name,
        label,
        f"extension<{ext.name}> (storage {storage})",
        f"shareddata does not know what the extension type {ext.name!r} means, and loading "
        "its storage would silently change its values. Read it with its own library and "
        "store a plain Arrow type (numbers, strings, binary, lists); or, to load the raw "
        "storage, pass a table whose column is the storage array (pa.chunked_array([c.storage "
        "for c in column.chunks]))",
    )


def _uuid_bytes(chunk: Any) -> Any:
    """A UUID (``fixed_size_binary[16]``) array as ``fixed_size_list<uint8>[16]``, zero-copy."""
    pa = pyarrow_module()
    storage = _storage(chunk)
    n = len(storage)
    data = storage.buffers()[1] if n else pa.py_buffer(b"")
    values = pa.Array.from_buffers(pa.uint8(), n * 16, [None, data], offset=storage.offset * 16)
    mask = storage.is_null() if storage.null_count else None
    return pa.FixedSizeListArray.from_arrays(values, 16, mask=mask)


def _hf_array(ext: Extension, ndim: int, name: str, label: str) -> Meaning:
    """An HF ``ArrayND`` feature: a tensor of its shape, or nested lists if its rows vary."""
    try:
        shape, dtype = json.loads(ext.metadata)
        shape = [None if d is None else int(d) for d in shape]
    except (ValueError, TypeError) as e:
        raise unsupported(
            name, label, ext.name, f"its parameters {ext.metadata!r} are not [shape, dtype] ({e})"
        ) from None
    if len(shape) != ndim:
        raise unsupported(name, label, ext.name, f"its shape {shape} is not {ndim}-D")
    storage = ext.storage
    if shape[0] is None or any(d is None for d in shape):  # rows of varying length
        return Meaning(classify(storage, name, label), _storage)
    pa = pyarrow_module()
    leaf = storage
    for _ in range(ndim):
        leaf = getattr(leaf, "value_type", None)
    if leaf is None or not (pa.types.is_integer(leaf) or pa.types.is_floating(leaf)
                            or pa.types.is_boolean(leaf)):  # fmt: skip
        raise unsupported(
            name,
            label,
            f"{ext.name}(shape={shape}, dtype={dtype})",
            "an HF Array feature of non-numeric values; store it as a list column",
        )
    inner = classify(leaf, name, label)
    return Meaning(
        ArrowKind("tensor", inner.dtype, tuple(shape)),
        lambda chunk: _regular(_storage(chunk), shape, name),
    )


def _regular(arr: Any, shape: list[int], name: str) -> Any:
    """Nested lists whose every row has ``shape`` as nested fixed-size lists (else an error).

    A null row becomes a row of zeros under the fixed-size list's null bit (refused
    or filled like any null).
    """
    pa, pc = pyarrow_module(), pyarrow_module().compute
    mask = arr.is_null() if arr.null_count else None
    if mask is not None:  # a null row has no values: give it a shape's worth
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
