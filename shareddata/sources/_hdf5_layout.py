"""Which columns an HDF5 dataset holds: HDF5 types and compound fields as plans.

Numbers (any byte order, bool, enum codes, array types) are ``tensor`` columns;
each field of a compound is a column; strings are ``str`` (utf-8 or variable-length)
or ``bytes`` (fixed ascii, opaque); ``vlen`` numbers are ``ragged``; references,
times, quad floats and pickled objects are refused (``UnsupportedDtypeError``).
Nothing here reads data rows.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import UnsupportedDtypeError

__all__ = ["Plan", "Refuse", "attr_value", "gather", "is_bookkeeping", "native", "plans_of", "text"]

_NUMERIC = "biufc"
_TORCH_ITEMSIZE = {"b": 1, "i": 8, "u": 8, "f": 8, "c": 16}
"""Largest itemsize torch has a dtype for, per numpy kind (no float128/complex256)."""

_BOOKKEEPING_CLASSES = {b"INDEXARRAY", b"LASTROWARRAY", b"CACHEARRAY", b"INDEX", b"TINDEX"}
"""PyTables ``CLASS`` attributes of a table's index structures (never data)."""


@dataclass
class Plan:
    """How one column is read.

    ``reader``: ``"direct"`` (a whole numeric dataset), ``"member"`` (numbers HDF5
    converts: a compound field, an array or enum type, a pandas block's column),
    ``"fixed"`` (fixed-length strings), ``"opaque"``, ``"vlen_str"``, ``"vlen"``,
    ``"vlen_ucs4"`` (PyTables' unicode, re-encoded as UTF-8); ``"cf"`` (a netCDF variable
    CF-decoded) and ``"level"`` (a MultiIndex level's values by code) go through ``decode``.
    """

    name: str
    path: str
    rows: int
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    reader: str
    member: tuple[str, ...] = ()  # field names down the compound type to this column
    index: int | None = None  # position along the member's last axis (a pandas block's)
    source: np.dtype | None = None  # the member's type as h5py gives it, to convert from
    labels: dict[str, int] | None = None  # an enum's or pandas category's labels: codes
    blocks: list[tuple[int, int, int]] = field(default_factory=list)  # sized (start, stop, n)
    first: int = 0  # the dataset's row that is the column's row 0 (``select_rows``)
    special: Any = None  # a reader of its own (a sparse matrix): datasets, spec(), read()
    decode: Callable[[np.ndarray], np.ndarray] | None = None  # each block of stored rows
    values: Any = None  # the values, already read by anndata (numbers or UTF-8 bytes)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not loaded from a file")


def attr_value(obj: Any, name: str) -> Any:
    r"""Attribute ``name`` of an HDF5 object (None if unreadable); pickles decoded safely.

    pandas' protocol-0 pickled lists and dicts are loaded refusing every global.

    Example:
        >>> attr_value({"a": b"(lp0\nVx\np1\na."}, "a")
        ['x']
    """
    try:
        value = obj.attrs[name] if hasattr(obj, "attrs") else obj[name]
    except (KeyError, OSError, RuntimeError, TypeError, ValueError):
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes) and value.endswith(b"."):
        try:
            return _NoGlobals(io.BytesIO(value)).load()
        except Exception:  # not a pickle, or one with globals: keep the bytes
            return value
    return value


def is_bookkeeping(name: str, obj: Any) -> bool:
    """Whether a dataset is PyTables' own index data rather than the user's.

    Example:
        >>> is_bookkeeping("df/_i_table/index/sortedLR", {})
        True
    """
    if any(part.startswith("_i_") for part in name.split("/")):
        return True
    try:
        return bytes(obj.attrs.get("CLASS", b"")) in _BOOKKEEPING_CLASSES
    except (AttributeError, OSError, RuntimeError, TypeError, ValueError):
        return False


Refuse = Callable[[str, str, str], UnsupportedDtypeError]
"""``refuse(column, what, fix)``: the error for a type that cannot be stored."""


def gather(
    skipped: dict[str, str] | None,
    name: str,
    make: Callable[[], list[Plan]],
    refused: tuple[type[Exception], ...] = (UnsupportedDtypeError,),
) -> list[Plan]:
    """``make()``; or, when it refuses ``name``, no plans and the reason in ``skipped``.

    ``skipped=None`` raises the refusal instead (a key that names the column).
    """
    try:
        return make()
    except refused as error:
        if skipped is None:
            raise
        skipped[name] = str(error)
        return []


def _unreadable_type(h5py: Any, htype: Any, where: str) -> tuple[str, str] | None:
    """What h5py cannot map to numpy in ``htype`` (quad floats, times): (what, fix)."""
    cls = htype.get_class()
    if cls == h5py.h5t.TIME:
        return (
            f"has the HDF5 time type H5T_TIME{where}, which has no numpy or torch type",
            "store the times as int64 (e.g. seconds or nanoseconds since the epoch)",
        )
    if cls == h5py.h5t.FLOAT and htype.get_size() > 8:
        return (
            f"has {8 * htype.get_size()}-bit floats{where} (quad precision), which have no "
            "torch type",
            "store them as float64 (f['x64'] = values.astype('f8') in the writer)",
        )
    if cls == h5py.h5t.COMPOUND:
        for i in range(htype.get_nmembers()):
            name = htype.get_member_name(i).decode(errors="replace")
            found = _unreadable_type(h5py, htype.get_member_type(i), f" in field {name!r}")
            if found:
                return found
    if cls == h5py.h5t.ARRAY:
        return _unreadable_type(h5py, htype.get_super(), where)
    return None


def plans_of(
    h5py: Any,
    ds: Any,
    name: str,
    refuse: Refuse,
    member: tuple[str, ...] = (),
    index: int | None = None,
    path: str | None = None,
) -> list[Plan]:
    """Plans for dataset ``ds`` (or its field ``member``), columns named ``name[/field]``.

    ``index``: one position of the member's last axis (a pandas block's column);
    ``path``: where the file reaches ``ds`` (an external link's own path).
    """
    shape = ds.shape
    if shape is None:
        raise refuse(name, "is empty (no dataspace)", "write it with a shape, rows first")
    if shape == ():
        raise refuse(
            name,
            "is a scalar (one value)",
            "a column needs a first dimension of rows; store it as shape (rows, ...), "
            "or read it directly with h5py",
        )
    htype = ds.id.get_type()
    try:
        dtype = ds.dtype
    except (TypeError, ValueError) as error:  # h5py maps no numpy type to it
        found = _unreadable_type(h5py, htype, "")
        what, fix = found or (
            f"has an HDF5 type h5py cannot read ({error})",
            "convert it to a numeric, string or variable-length numeric dataset",
        )
        raise refuse(name, what, fix) from error
    for part in member:
        htype = htype.get_member_type(htype.get_member_index(part.encode()))
        dtype = dtype[part]
    rows, row_shape = int(shape[0]), tuple(int(s) for s in shape[1:])
    pseudo = attr_value(ds, "PSEUDOATOM") if not member else None
    if pseudo in (b"object", "object"):
        raise refuse(
            name,
            "holds pickled Python objects (a PyTables ObjectAtom / pandas object column), "
            "and shareddata does not unpickle files",
            "store numbers, strings or bytes instead (pandas: df.to_hdf(..., format='table'))",
        )
    if pseudo in (b"vlstring", "vlstring") and not row_shape:  # PyTables' VLStringAtom
        path = path or ds.name.lstrip("/")
        return [Plan(name, path, rows, "bytes", np.dtype(np.uint8), (), "vlen", source=dtype)]
    if pseudo in (b"vlunicode", "vlunicode") and not row_shape:  # UCS-4 code points
        path = path or ds.name.lstrip("/")
        return [Plan(name, path, rows, "str", np.dtype(np.uint8), (), "vlen_ucs4", source=dtype)]
    if index is not None:  # one column of a block: its last axis is the columns
        if dtype.subdtype is not None:
            dtype, htype = dtype.subdtype[0], htype.get_super()
        else:
            row_shape = row_shape[:-1]
    path = path or ds.name.lstrip("/")
    plans = []
    for column, at, dt, ht in _fields(name, member, dtype, htype):
        position = index if at == member else None  # a block's column: never a compound's
        leaf = Plan(column, path, rows, "", dt, row_shape, "", at, position, dt)
        plans.append(_leaf(h5py, leaf, ht, refuse))
    return plans


def _fields(
    name: str, member: tuple[str, ...], dtype: np.dtype, htype: Any
) -> Iterator[tuple[str, tuple[str, ...], np.dtype, Any]]:
    """Every leaf of a compound type, depth first: (column, member, dtype, HDF5 type)."""
    if dtype.fields is None:
        yield name, member, dtype, htype
        return
    for field_name in dtype.names or ():
        inner = htype.get_member_type(htype.get_member_index(field_name.encode()))
        yield from _fields(f"{name}/{field_name}", (*member, field_name), dtype[field_name], inner)


def _leaf(h5py: Any, leaf: Plan, htype: Any, refuse: Refuse) -> Plan:
    """The plan of one non-compound ``leaf`` (its ``source`` the type HDF5 converts from)."""
    name, row_shape, dtype = leaf.name, leaf.shape, leaf.dtype

    def plan(kind: str, dt: np.dtype, shape: tuple[int, ...], reader: str, **kw: Any) -> Plan:
        return replace(leaf, kind=kind, dtype=dt, shape=shape, reader=reader, **kw)

    per_row = (
        f"holds {int(np.prod(row_shape))} values per row (shape {row_shape}) of a "
        "string or variable-length type; a string or variable-length column holds one "
        "value per row"
    )
    per_row_fix = "store one 1-D dataset per position, or flatten the rows"
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        if row_shape:
            strings = "variable-length" if string.length is None else f"fixed-length ({dtype})"
            raise refuse(
                name,
                f"holds {int(np.prod(row_shape))} {strings} strings per row (rows of shape "
                f"{row_shape}); a string column holds one string per row",
                f"store one 1-D dataset per position (f['{name}_0'] = f['{name}'][:, 0]), or "
                "the strings' bytes as a uint8 dataset",
            )
        if string.length is None:
            return plan("str", np.dtype(np.uint8), (), "vlen_str")
        kind = "str" if string.encoding == "utf-8" else "bytes"
        return plan(kind, np.dtype(np.uint8), (), "fixed")
    if h5py.check_ref_dtype(dtype) is not None:
        raise refuse(
            name,
            "holds object or region references",
            "dereference them with h5py and store the referenced data as datasets",
        )
    base = h5py.check_vlen_dtype(dtype)
    if base is not None:
        base = np.dtype(base)
        if base.kind not in _NUMERIC or base.fields is not None or base.subdtype is not None:
            raise refuse(
                name,
                f"holds variable-length sequences of {base}",
                "store variable-length sequences of a plain numeric type "
                "(h5py.vlen_dtype(np.int32)), one dataset per field",
            )
        if row_shape:
            raise refuse(name, per_row, per_row_fix)
        return plan("ragged", native(base), (), "vlen")
    sub_shape: tuple[int, ...] = ()
    if dtype.subdtype is not None:
        sub, sub_shape = dtype.subdtype
        if h5py.check_string_dtype(sub) is not None or sub.kind in "SU":
            raise refuse(
                name,
                f"holds {int(np.prod(sub_shape))} fixed-length strings ({sub}) per row",
                "store one string field per position, or the strings' bytes as uint8",
            )
        if sub.fields is not None or sub.subdtype is not None or sub.kind not in _NUMERIC:
            raise refuse(
                name,
                f"has an array type of {sub}",
                "store it as a plain numeric dataset with the array's shape as extra dimensions",
            )
        dtype, htype = sub, htype.get_super()
    labels = h5py.check_enum_dtype(dtype)
    if dtype.kind in _NUMERIC:
        if dtype.itemsize > _TORCH_ITEMSIZE[dtype.kind]:
            raise refuse(
                name,
                f"has dtype {dtype} (extended precision), which has no torch type",
                "store it as float64 / complex128",
            )
        whole = not leaf.member and leaf.index is None and labels is None and not sub_shape
        reader = "direct" if whole else "member"
        if htype.get_class() == h5py.h5t.BITFIELD and dtype.itemsize == 1:
            return plan("tensor", np.dtype(np.bool_), row_shape, reader)  # PyTables' bool
        labels = labels if dtype.kind != "b" else None  # h5py's own bool is an enum
        return plan("tensor", native(dtype), row_shape + sub_shape, reader, labels=labels)
    if dtype.kind == "V":
        if row_shape:
            raise refuse(name, per_row, per_row_fix)
        return plan("bytes", np.dtype(np.uint8), (), "opaque")
    raise refuse(
        name,
        f"has dtype {dtype} (HDF5 type class {htype.get_class()})",
        "convert it to a numeric, string or variable-length numeric dataset",
    )


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in native byte order, without h5py's metadata."""
    return np.dtype(dtype.str).newbyteorder("=")


def text(value: Any) -> str:
    """An attribute's bytes or value as ``str`` (UTF-8, bad bytes replaced)."""
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)
