"""Arrow lists of records / strings / lists taken apart into a ``"nested"`` column's pieces.

Note [Nested Arrow columns]
===========================
A ``list<struct<role: string, content: string>>`` column (how conversation data
stores its turns), ``list<string>`` or ``list<list<float>>`` becomes a tree of
levels (``_nested.py``): one int64 ``offsets`` buffer per list level, one
``offsets`` + ``values`` pair per string level, one ``data`` buffer per number
level. A struct has no buffer: its fields are levels with as many elements.

Each Arrow chunk is taken apart level by level into numpy pieces (:func:`parts`):
list lengths (``pc.list_value_length``, a null list counting 0) and the list's
values in order (``flatten()``, which skips what a null slot or a slice leaves
behind and follows list *views* whatever their offsets' order), a struct's fields
with the struct's nulls merged in (``StructArray.flatten()``), strings as
``large_string`` offsets + bytes (views cast), numbers (temporal types as their
integer storage, dictionaries and run-end encodings decoded). Sizing adds up the
pieces' lengths; writing rebases each level's lengths onto that level's running
total. A null anywhere (a null list, struct, string or number) is refused unless a
``fill_value`` is given: then null lists are empty, null strings the fill string
(or ``""`` for a number given for every column), null numbers the fill number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..columns._nested import Level, children
from ..errors import UnsupportedDtypeError
from ._arrow_types import decoded, pyarrow_module, temporal_storage

__all__ = ["Parts", "parts"]


@dataclass
class Parts:
    """One chunk taken apart: per level (preorder), its pieces, and the nulls met.

    ``lengths[i]``: element lengths (list levels: values per list; str/bytes levels:
    bytes per string); ``data[i]``: numbers (num levels) or bytes (str/bytes levels);
    ``count[i]``: elements at level ``i``.
    """

    lengths: dict[int, np.ndarray] = field(default_factory=dict)
    data: dict[int, np.ndarray] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    nulls: int = 0


def parts(arr: Any, tree: Level, fill: Any, where: str, name: str) -> Parts:
    """Take one chunk of a nested column apart (Note [Nested Arrow columns]).

    Args:
        arr: the chunk (root: a list-like array, one element per row).
        tree: the column's level tree (:func:`level_of` of its type).
        fill: ``None`` (count nulls, values under them unspecified), or the checked
            fill values ``(text_bytes, number)`` put in place of null leaves.
        where: the file/table, for messages.
        name: the column, for messages.
    """
    pa = pyarrow_module()
    levels = children(tree)
    out = Parts()

    def walk(arr: Any, i: int) -> None:
        level, kids = levels[i]
        arr = decoded(arr)
        out.count[i] = len(arr)
        if level.kind == "list":
            out.nulls += arr.null_count
            lengths = pa.compute.list_value_length(arr)
            if lengths.null_count:
                lengths = pa.compute.fill_null(lengths, 0)
            out.lengths[i] = lengths.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            flat = arr.flatten()
            if len(flat) != int(out.lengths[i].sum()):
                raise UnsupportedDtypeError(
                    f"column {name!r} of {where}: the list values of a {arr.type} chunk do not "
                    "add up to its lengths; cast the column to a plain list type first."
                )
            walk(flat, kids[0])
        elif level.kind == "struct":
            for child, k in zip(arr.flatten(), kids):  # the struct's nulls merged in
                walk(child, k)
        elif level.kind in ("str", "bytes"):
            target = pa.large_string() if level.kind == "str" else pa.large_binary()
            if arr.type != target:
                arr = arr.cast(target)
            if arr.null_count:
                out.nulls += arr.null_count
                if fill is not None:
                    value = fill[0].decode("utf-8") if level.kind == "str" else fill[0]
                    arr = pa.compute.fill_null(arr, pa.scalar(value, target))
            buffers = arr.buffers()
            offsets = (
                np.frombuffer(buffers[1], np.int64, len(arr) + 1, arr.offset * 8)
                if len(arr) and buffers[1] is not None
                else np.zeros(len(arr) + 1, np.int64)
            )
            out.lengths[i] = np.diff(offsets)
            start, stop = int(offsets[0]), int(offsets[-1])
            data = buffers[2]
            out.data[i] = (
                np.frombuffer(data, np.uint8, stop - start, start)
                if data is not None and stop > start
                else np.zeros(0, np.uint8)
            )
        else:  # num
            dtype = np.dtype(level.dtype)
            storage = temporal_storage(arr.type)
            if storage is not None:
                arr = arr.view(storage)
            if arr.null_count:
                out.nulls += arr.null_count
                if fill is not None:
                    if fill[1] is None:
                        raise UnsupportedDtypeError(
                            f"column {name!r} of {where} holds null numbers ({arr.type}) and "
                            f"the fill_value is not a number; give one, e.g. "
                            f"fill_value={{{name!r}: 0}}."
                        )
                    value = bool(fill[1]) if pa.types.is_boolean(arr.type) else fill[1]
                    arr = pa.compute.fill_null(arr, pa.scalar(value, arr.type))
                else:  # refused later; the values just need a defined form
                    zero = False if pa.types.is_boolean(arr.type) else 0
                    arr = pa.compute.fill_null(arr, pa.scalar(zero, arr.type))
            out.data[i] = (
                arr.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
                if len(arr)
                else np.zeros(0, dtype)
            )

    walk(arr, 0)
    return out
