"""Which Arrow columns are loaded: structs split into their fields, names checked.

A struct column ``s`` with fields ``a`` and ``b`` gives the columns ``s.a`` and
``s.b`` (nested structs ``s.b.c``), as ``Table.flatten()`` names them; selecting
``s`` selects them all. :func:`make_columns` pairs each selected name with its
path of fields (what ``nested=True`` nests items by: Note [Nested items] in
``columns/_items.py``), its type and its fill value.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ArgumentTypeError, EmptySelectionError, MissingColumnError
from ._arrow_columns import ArrowColumn
from ._arrow_extensions import UuidAs
from ._arrow_types import pyarrow_module

__all__ = ["FillValue", "make_columns", "select_fields"]

FillValue = Any  # a scalar, or a mapping {column: scalar}


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


def _fields(schema: Any) -> list[tuple[str, tuple[str, ...], Any, Any]]:
    """Every loadable column of a schema: ``(name, path, type, metadata)``, structs flattened.

    A struct column ``s`` with fields ``a`` and ``b`` gives ``s.a`` and ``s.b`` (nested
    structs ``s.b.c``), the names ``Table.flatten()`` gives them. The field metadata
    names an extension type that is not registered here (``_arrow_extensions.py``).
    """
    pa = pyarrow_module()
    out: list[tuple[str, tuple[str, ...], Any, Any]] = []

    def walk(name: str, path: tuple[str, ...], field: Any) -> None:
        t = field.type
        extension = b"ARROW:extension:name" in (field.metadata or {})  # stored as a struct
        if pa.types.is_struct(t) and t.num_fields and not extension:
            for f in t:
                walk(f"{name}.{f.name}", (*path, f.name), f)
        else:
            out.append((name, path, t, field.metadata))

    for f in schema:
        walk(f.name, (f.name,), f)
    return out


def _groups(fields: Sequence[tuple[str, tuple[str, ...], Any, Any]]) -> dict[str, list[str]]:
    """Each struct's name (``s``, ``s.b``) -> the flattened columns under it."""
    groups: dict[str, list[str]] = {}
    for name, path, _, _ in fields:
        for k in range(1, len(path)):
            groups.setdefault(".".join(path[:k]), []).append(name)
    return groups


def make_columns(
    schema: Any,
    names: Sequence[str],
    label: str,
    fill_value: FillValue,
    records: bool = True,
    uuid_as: UuidAs = "uuid",
) -> list[ArrowColumn]:
    _check_fill_keys(fill_value, names, label)
    by_name = {name: (path, t, meta) for name, path, t, meta in _fields(schema)}
    columns = []
    for name in names:
        fill, is_global = _fill_for(fill_value, name)
        path, t, meta = by_name[name]
        columns.append(ArrowColumn(name, t, label, fill, is_global, path, records, meta, uuid_as))
    return columns


def select_fields(schema: Any, columns: Sequence[str] | None, label: str) -> list[str]:
    """The flattened columns selected from ``schema`` (a struct's name selects its fields)."""
    fields = _fields(schema)
    return _select([n for n, _, _, _ in fields], columns, label, _groups(fields))


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
        if not isinstance(columns, (str, Iterable)):
            raise ArgumentTypeError(
                f"columns={reprlib.repr(columns)} (type {type(columns).__name__}) for {label} is "
                "not a column name or a list of names; pass one of those, or columns=None for "
                "all of them."
            )
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
