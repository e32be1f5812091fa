"""pandas ``HDFStore`` frames and series (``to_hdf``, either format) as plans."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ._hdf5_layout import Plan, Refuse, attr_value, gather, native, plans_of, text

__all__ = ["frame_plans", "is_frame"]

_FRAMES = {b"frame", b"frame_table", b"series", b"series_table"}  # pandas_type attributes


def is_frame(obj: Any) -> bool:
    """Whether an h5py group is a pandas ``HDFStore`` frame :func:`frame_plans` reads."""
    try:
        return bytes(obj.attrs.get("pandas_type", b"")) in _FRAMES
    except (OSError, RuntimeError, TypeError, ValueError):
        return False


def frame_plans(
    h5py: Any, group: Any, refuse: Refuse, skipped: dict[str, str] | None
) -> list[Plan]:
    """Plans for a frame's columns in its order, a named index first.

    ``table`` frames hold several columns per ``values_block_N`` field, ``fixed`` ones
    ``blockN_values`` arrays. Categories load as codes (labels in :attr:`Plan.labels`),
    dates as int64. ``skipped``: when given, unstorable columns go there, not raised.
    """
    key = group.name.strip("/")
    plans: list[Plan] = []

    def add(column: str, make: Callable[[], list[Plan]], pandas_dtype: Any = None) -> None:
        for plan in gather(skipped, column, make):
            if plan.kind == "bytes":
                plan.kind = "str"  # pandas decodes its strings (UTF-8)
            if text(pandas_dtype) == "bool" and plan.dtype.kind == "u":
                plan.dtype = np.dtype(np.bool_)
            plans.append(plan)

    if bytes(group.attrs.get("pandas_type", b"")) == b"series":  # a Series, format="fixed"
        name = attr_value(group, "name")
        name = text(name) if isinstance(name, (bytes, str)) else key.rsplit("/", 1)[-1]
        _named_index(h5py, group, "index", refuse, add)
        if "values" in group:
            add(name, partial(plans_of, h5py, group["values"], name, refuse))
        return plans

    if bytes(group.attrs.get("pandas_type", b"")) == b"frame":  # format="fixed"
        _named_index(h5py, group, "axis1", refuse, add)
        _levels(h5py, group, refuse, add)
        if "axis0" not in group:
            add(key, partial(_multi_columns, key, refuse))
            return plans
        order = [text(n) for n in group["axis0"][()]]
        for block in range(int(attr_value(group, "nblocks") or 0)):
            items = [text(n) for n in group[f"block{block}_items"][()]]
            values = group[f"block{block}_values"]
            pickled = bytes(values.attrs.get("CLASS", b"")) == b"VLARRAY"
            for position, column in enumerate(items):
                if pickled:
                    add(column, partial(_pickled_column, column, key, refuse))
                else:
                    add(column, partial(plans_of, h5py, values, column, refuse, index=position))
        return _in_order(plans, order)

    table = group["table"]  # format="table"
    info = attr_value(group, "info")
    index_name = None
    if isinstance(info, dict) and isinstance(info.get("index"), dict):
        index_name = info["index"].get("index_name")
    if isinstance(index_name, str) and "index" in (table.dtype.names or ()):
        add(index_name, lambda: plans_of(h5py, table, index_name, refuse, ("index",)))
    for values_col in attr_value(group, "values_cols") or []:
        kind = attr_value(table, f"{values_col}_kind")
        pandas_dtype = attr_value(table, f"{values_col}_dtype")
        labels = None
        if text(attr_value(table, f"{values_col}_meta") or b"") == "category":
            labels = _categories(group, values_col)
        block = isinstance(kind, list) and table.dtype[values_col].subdtype is not None
        for position, column in enumerate(kind if block else [values_col]):
            start = len(plans)
            at = position if block else None
            make = partial(plans_of, h5py, table, str(column), refuse, (values_col,), at)
            add(str(column), make, pandas_dtype)
            for plan in plans[start:]:
                plan.labels = labels if labels is not None else plan.labels
    axes = attr_value(group, "non_index_axes")  # [(1, [the frame's columns, in order])]
    order = []
    if isinstance(axes, list) and axes and isinstance(axes[0], tuple) and len(axes[0]) == 2:
        order = [str(c) for c in axes[0][1]]
    return _in_order(plans, order)


def _in_order(plans: list[Plan], order: list[str]) -> list[Plan]:
    """The frame's columns in its order (pandas groups them by dtype); index first."""
    position = {name: i for i, name in enumerate(order)}
    return sorted(plans, key=lambda p: position.get(p.name, -1))


def _named_index(
    h5py: Any, group: Any, axis: str, refuse: Refuse, add: Callable[..., None]
) -> None:
    """The index of a ``format="fixed"`` frame or series, as a column if it has a name."""
    if axis not in group:
        return
    name = attr_value(group[axis], "name")  # pickled None, or the name
    if isinstance(name, bytes):
        name = text(name)
    if isinstance(name, str):
        add(name, partial(plans_of, h5py, group[axis], name, refuse))


def _levels(h5py: Any, group: Any, refuse: Refuse, add: Callable[..., None]) -> None:
    """The named levels of a ``fixed`` frame's MultiIndex: numbers by value, text by code."""
    nlevels = attr_value(group, "axis1_nlevels")
    for i in range(nlevels if isinstance(nlevels, int) else 0):
        level, codes = group[f"axis1_level{i}"], group[f"axis1_label{i}"]
        name = attr_value(level, "name")
        name = text(name) if isinstance(name, bytes) else name
        if isinstance(name, str):  # an unnamed level is not loaded, as an unnamed index
            add(name, partial(_level_plans, h5py, level, codes, name, refuse))


def _level_plans(h5py: Any, level: Any, codes: Any, name: str, refuse: Refuse) -> list[Plan]:
    values, rows = level[()], int(codes.shape[0])
    if rows and int(codes[()].min()) < 0:
        raise refuse(
            name,
            "is a MultiIndex level with missing values (NaN in the index)",
            "fill them before writing (df.index = df.index.fillna(...)), or use "
            "format='table', whose index levels are columns",
        )
    path = codes.name.lstrip("/")
    if values.dtype.kind not in "biuf":
        plans = plans_of(h5py, codes, name, refuse, path=path)
        plans[0].labels = {text(v): i for i, v in enumerate(values)}
        return plans
    plan = Plan(name, path, rows, "tensor", native(values.dtype), (), "level")
    plan.decode = values.__getitem__  # each row's value by its code
    return [plan]


def _multi_columns(key: str, refuse: Refuse) -> list[Plan]:
    raise refuse(
        key,
        "is a pandas frame whose columns are a MultiIndex (format='fixed')",
        f"flatten the columns (df.columns = ['_'.join(map(str, c)) for c in df.columns]) "
        f"before df.to_hdf(path, key={key!r})",
    )


def _pickled_column(column: str, key: str, refuse: Refuse) -> list[Plan]:
    raise refuse(
        column,
        "is stored by pandas as pickled Python objects (an object column written with "
        "format='fixed'), and shareddata does not unpickle files",
        f"write the frame with df.to_hdf(path, key={key!r}, format='table')",
    )


def _categories(group: Any, values_col: str) -> dict[str, int] | None:
    """A pandas categorical column's labels, from ``meta/<column>/meta/table``."""
    try:
        values = group[f"meta/{values_col}/meta/table"]["values"]
    except (KeyError, OSError, RuntimeError, ValueError, TypeError):
        return None
    return {text(v): code for code, v in enumerate(values)}
