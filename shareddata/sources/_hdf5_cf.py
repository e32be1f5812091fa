"""netCDF-4 files: variables along one dimension as columns, decoded by the CF conventions.

A netCDF-4 file (HDF5 with ``_NCProperties``, netCDF's dimension scales or a CF
``Conventions`` attribute) is read as xarray reads it, with ``decode_cf=True``:

* **rows** run along one dimension: the first dimension of most data variables
  (``time`` for ``temp(time, lat, lon)``), found through the dimension scales, not
  by length. Every variable along it is a column; coordinates along other
  dimensions (``lat``, ``lon``, bounds, ``coordinates`` attributes) go to
  ``ds.coords``, decoded; netCDF's own dimension placeholders are never data.
* **packed values** (``scale_factor``, ``add_offset``) and **fill values**
  (``_FillValue``, ``missing_value``) are decoded as xarray's ``CFMaskCoder`` then
  ``CFScaleOffsetCoder`` do: masked to NaN first, then scaled, in the float type
  xarray chooses (``int16`` packed with a float64 ``scale_factor`` gives float64;
  an int16 variable with only a fill value, float32). ``_Unsigned`` and xarray's
  ``dtype: bool`` are honoured.
* **times** (``units`` ``"<unit> since <date>"`` on a standard, gregorian or
  proleptic_gregorian calendar) become int64 nanoseconds since 1970-01-01 (what
  ``datetime64[ns]`` holds; NaT is the smallest int64): ``.numpy().view(
  "datetime64[ns]")`` gives xarray's values. Their ``ds.attrs`` then say so
  (``units: "nanoseconds since 1970-01-01"``). Durations (``units: "hours"``) become
  int64 nanoseconds likewise. Other calendars keep their numbers and units.

With ``decode_cf=False`` every variable keeps its stored values (codes).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..columns._columns import ColumnSpec
from ._hdf5_layout import Plan, attr_value
from ._source import Buffer

__all__ = ["CFRead", "Netcdf", "cf_decode", "decoded_attrs", "is_netcdf"]

_PHONY = "This is a netCDF dimension but not a netCDF variable"
_BOOKKEEPING = {"CLASS", "NAME", "REFERENCE_LIST", "DIMENSION_LIST", "_Netcdf4Dimid",
                "_Netcdf4Coordinates", "_nc3_strict", "_NCProperties"}  # fmt: skip
_ENCODING = {"scale_factor", "add_offset", "_FillValue", "missing_value", "_Unsigned"}
_NS = {"nanoseconds": 1, "microseconds": 1_000, "milliseconds": 1_000_000, "seconds": 10**9,
       "minutes": 60 * 10**9, "hours": 3600 * 10**9, "days": 86400 * 10**9}  # fmt: skip
_ALIASES = {"ns": "nanoseconds", "us": "microseconds", "ms": "milliseconds", "s": "seconds",
            "sec": "seconds", "secs": "seconds", "second": "seconds", "min": "minutes",
            "mins": "minutes", "minute": "minutes", "h": "hours", "hr": "hours",
            "hrs": "hours", "hour": "hours", "d": "days", "day": "days"}  # fmt: skip
_STANDARD = {"standard", "gregorian", "proleptic_gregorian"}
_DATE = re.compile(
    r"^(-?\d{1,4})-(\d{1,2})-(\d{1,2})(?:[ T](\d{1,2}):(\d{1,2})(?::(\d{1,2})(\.\d*)?)?)?"
    r"\s*(Z|UTC|GMT|[+-]\d{1,2}(?::?\d{2})?)?$"
)
NAT = np.iinfo(np.int64).min
"""What a missing time is (``NaT``) in an int64 time column."""
_BLOCK = 32 << 20
"""Bytes of stored values decoded per block."""


def _scalar(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", errors="replace")
    return value


def is_netcdf(file: Any) -> bool:
    """Whether an open HDF5 file is a netCDF-4 file (or claims the CF conventions)."""
    if "_NCProperties" in file.attrs:
        return True
    conventions = _scalar(attr_value(file, "Conventions"))
    if isinstance(conventions, str) and conventions.strip().upper().startswith("CF"):
        return True
    for name in file:  # netCDF's own attribute on a variable at the root
        link = file.get(name, getlink=True)
        if type(link).__name__ == "HardLink" and "_Netcdf4Dimid" in file[name].attrs:
            return True
    return False


def _time_unit(units: Any) -> tuple[int, int | None] | None:
    """``(nanoseconds per unit, reference in ns since 1970 or None)`` of time-like units."""
    if not isinstance(units, str):
        return None
    unit, since, ref = units.strip().partition(" since ")
    per = _NS.get(_ALIASES.get(unit.strip().lower(), unit.strip().lower()))
    if per is None:
        return None
    if not since:
        return per, None
    match = _DATE.match(ref.strip())
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        stamp = np.datetime64(
            f"{int(year):04d}-{int(month):02d}-{int(day):02d}T{int(hour or 0):02d}:"
            f"{int(minute or 0):02d}:{int(second or 0):02d}",
            "ns",
        )
    except ValueError:
        return None
    ns = int(stamp.astype(np.int64)) + round(float(fraction or 0) * 10**9)
    if zone and zone not in ("Z", "UTC", "GMT"):  # to UTC, as pandas does
        hours, _, minutes = zone[1:].partition(":")
        if not minutes and len(hours) > 2:
            hours, minutes = hours[:-2], hours[-2:]
        sign = -1 if zone[0] == "-" else 1
        ns -= sign * (int(hours) * 3600 + int(minutes or 0) * 60) * 10**9
    return per, ns


def _float_dtype(dtype: np.dtype, attrs: dict[str, Any]) -> np.dtype:
    """The float type xarray decodes ``dtype`` into (``_choose_float_dtype``)."""
    scale, offset = attrs.get("scale_factor"), attrs.get("add_offset")
    if scale is not None or offset is not None:
        scale_type = np.dtype(type(scale)) if scale is not None else None
        offset_type = np.dtype(type(offset)) if offset is not None else None
        if (
            scale_type is not None
            and offset_type == scale_type
            and scale_type in (np.float32, np.float64)
        ):
            return np.dtype(
                np.float64 if dtype.itemsize == 4 and dtype.kind in "iu" else scale_type
            )
        if offset is not None:
            return np.dtype(np.float64)
        return scale_type if scale_type is not None and scale_type.kind == "f" else np.dtype("f8")
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return np.dtype(np.float32)
    if dtype.kind in "iu" and dtype.itemsize <= 2:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _fills(attrs: dict[str, Any]) -> list[Any]:
    out = []
    for key in ("missing_value", "_FillValue"):
        if key in attrs:
            out += [v for v in np.ravel(attrs[key]) if not np.isnan(np.float64(v))]
    return out


def _time(attrs: dict[str, Any]) -> tuple[int, int | None] | None:
    calendar = str(attrs.get("calendar", "standard")).lower()
    unit = _time_unit(attrs.get("units"))
    if unit is None or (unit[1] is not None and calendar not in _STANDARD):
        return None
    return unit


def cf_dtype(dtype: np.dtype, attrs: dict[str, Any]) -> np.dtype:
    """The type of a variable of stored type ``dtype`` once :func:`cf_decode` decoded it."""
    return cf_decode(np.zeros(0, dtype), attrs).dtype


def cf_decode(values: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """``values`` decoded as xarray decodes a variable with these attributes (module doc).

    Example:
        >>> cf_decode(np.array([0, 100, -1], np.int16), {"scale_factor": np.float32(0.5),
        ...                                              "_FillValue": np.int16(-1)})
        array([ 0., 50., nan], dtype=float32)
        >>> cf_decode(np.array([0, 24]), {"units": "hours since 2000-01-01"}).view("M8[ns]")
        array(['2000-01-01T00:00:00.000000000', '2000-01-02T00:00:00.000000000'],
              dtype='datetime64[ns]')
    """
    data = values
    unsigned = str(attrs.get("_Unsigned", "")).lower()
    fills = _fills(attrs)
    if unsigned == "true" and data.dtype.kind == "i":
        data = data.view(f"u{data.dtype.itemsize}")
        fills = [np.array(f, values.dtype).view(data.dtype).item() for f in fills]
    elif unsigned == "false" and data.dtype.kind == "u":
        data = data.view(f"i{data.dtype.itemsize}")
        fills = [data.dtype.type(f) for f in fills]
    packed = "scale_factor" in attrs or "add_offset" in attrs
    time = _time(attrs)
    if fills:
        if packed:
            dtype = _float_dtype(data.dtype, attrs)
        elif data.dtype.kind == "f":
            dtype = data.dtype
        elif time is not None and data.dtype.kind in "iu":
            dtype = np.dtype(np.int64)
        else:
            dtype = np.dtype(np.float32 if data.dtype.itemsize <= 2 else np.float64)
        missing = np.zeros(data.shape, bool)
        converted = data.astype(dtype)
        for fill in fills:
            missing |= converted == fill
        data = converted
        data[missing] = NAT if dtype.kind == "i" else np.nan
    if packed:
        if not fills or time is not None:
            data = data.astype(_float_dtype(data.dtype, attrs))
        elif data is values:
            data = data.copy()
        if attrs.get("scale_factor") is not None:
            data *= _scalar(np.asarray(attrs["scale_factor"]))
        if attrs.get("add_offset") is not None:
            data += _scalar(np.asarray(attrs["add_offset"]))
    if time is not None and data.dtype.kind in "iuf":
        return _to_ns(data, *time)
    if str(attrs.get("dtype", "")) == "bool" and data.dtype.kind in "iu":
        return data.astype(bool)
    return data


def _to_ns(data: np.ndarray, per: int, ref: int | None) -> np.ndarray:
    """Numbers of ``per``-ns units after ``ref`` as int64 ns since 1970 (xarray's steps)."""
    base = 0 if ref is None else ref
    if data.dtype.kind in "iu":
        missing = data == NAT if data.dtype == np.int64 else np.zeros(data.shape, bool)
        out = data.astype(np.int64) * per + base
        out[missing] = NAT
        return out
    values = data.astype(np.float64)
    missing = np.isnan(values)
    unit = per
    if unit > 10**9:  # to the reference's seconds first, as pandas does
        values, unit = values * (unit // 10**9), 10**9
    while unit > 1 and np.any(values[~missing] % 1):
        values, unit = values * 1000, unit // 1000
    with np.errstate(invalid="ignore"):
        out = np.where(missing, 0, values).astype(np.int64) * unit + base
    out[missing] = NAT
    return out


def variable_attrs(ds: Any) -> dict[str, Any]:
    """A variable's own attributes (netCDF's bookkeeping left out), as Python values."""
    out = {}
    for key in ds.attrs:
        if key in _BOOKKEEPING:
            continue
        value = _scalar(attr_value(ds, key))
        out[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def decoded_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """What a variable's attributes say once decoded (xarray's ``.attrs``, times renamed)."""
    out = {k: v for k, v in attrs.items() if k not in _ENCODING}
    if str(out.get("dtype", "")) == "bool":
        out.pop("dtype")
    time = _time(attrs)
    if time is not None:
        out.pop("calendar", None)
        out["units"] = "nanoseconds" if time[1] is None else "nanoseconds since 1970-01-01"
        if time[1] is not None:
            out["calendar"] = "proleptic_gregorian"
    return out


@dataclass
class CFRead:
    """Reads a variable decoded by :func:`cf_decode` (a :class:`Plan`'s ``special``)."""

    path: str
    attrs: dict[str, Any]

    @property
    def datasets(self) -> list[str]:
        """The variable's dataset (for the compression-filter check)."""
        return [self.path]

    def spec(self, plan: Plan, file: Any) -> ColumnSpec:
        """A tensor column of the decoded type."""
        return ColumnSpec(plan.name, plan.rows, plan.dtype, plan.shape)

    def read(
        self,
        plan: Plan,
        file: Any,
        buffers: dict[str, Buffer],
        progress: Callable[[int], None],
        read_range: Any,
    ) -> None:
        """Decode the variable block by block into the column's buffer."""
        ds, out = file[self.path], buffers["data"]
        row = max(1, ds.dtype.itemsize * int(np.prod(plan.shape, dtype=np.int64)))
        step = max(1, _BLOCK // row)
        if ds.chunks:
            step = max(int(ds.chunks[0]), step - step % int(ds.chunks[0]))
        for start in range(0, plan.rows, step):
            stop = min(plan.rows, start + step)
            block = ds[plan.first + start : plan.first + stop]
            dest = out.rows(start, stop)
            dest[...] = cf_decode(block, self.attrs)
            progress(dest.nbytes)


class Netcdf:
    """The variables of a netCDF-4 file, their dimensions, coordinates and decoding.

    Args:
        h5py: the module.
        file: the open file.
        decode: decode the CF conventions (``decode_cf``).
    """

    def __init__(self, h5py: Any, file: Any, decode: bool) -> None:
        self._h5py = h5py
        self.decode = decode
        self.variables: dict[str, Any] = {}
        self.coordinates: set[str] = set()
        file.visititems(self._visit)
        for name, ds in self.variables.items():
            for key in ("coordinates", "bounds"):
                listed = _scalar(attr_value(ds, key))
                if isinstance(listed, str):
                    folder = name.rpartition("/")[0]
                    for other in listed.split():
                        self.coordinates.add(f"{folder}/{other}" if folder else other)

    def _visit(self, name: str, obj: Any) -> None:
        if not isinstance(obj, self._h5py.Dataset):
            return
        label = _scalar(attr_value(obj, "NAME"))
        if isinstance(label, str) and label.startswith(_PHONY):
            return  # a dimension without a variable: HDF5 needs a dataset, it holds no data
        self.variables[name] = obj
        if _scalar(attr_value(obj, "CLASS")) == "DIMENSION_SCALE":
            self.coordinates.add(name)

    def dimension(self, name: str) -> str:
        """The identity of a variable's first dimension (its scale's path, or its length)."""
        ds = self.variables.get(name)
        if ds is None or not ds.shape:
            return ""
        try:
            scales = list(ds.dims[0].values())
        except (RuntimeError, OSError, ValueError, KeyError):
            scales = []
        if scales:
            return str(scales[0].name)
        if _scalar(attr_value(ds, "CLASS")) == "DIMENSION_SCALE":
            return str(ds.name)
        return f"length {ds.shape[0]}"

    def default_names(self) -> list[str]:
        """Variables along the rows' dimension: the first dimension of most data variables."""
        data = [n for n, ds in self.variables.items() if ds.shape and n not in self.coordinates]
        pool = data or [n for n, ds in self.variables.items() if ds.shape]
        if not pool:
            return []
        rows = Counter(self.dimension(n) for n in pool).most_common(1)[0][0]
        return [n for n, ds in self.variables.items() if ds.shape and self.dimension(n) == rows]

    def split(self, plans: list[Plan]) -> tuple[list[Plan], list[str]]:
        """Plans along the rows' dimension, and the names of the others.

        The rows' dimension is the first dimension of most of the plans' data
        variables (coordinates count only if there are none; a tie goes to the
        first plan's). The others (variables named in ``keys`` that run along
        another dimension) and every coordinate not along the rows are coordinates.
        """
        if not plans:
            return plans, []
        dims = [self.dimension(p.path) for p in plans]
        data = [d for p, d in zip(plans, dims) if p.path not in self.coordinates]
        rows = Counter(data or dims).most_common(1)[0][0]
        along = [p for p, d in zip(plans, dims) if d == rows]
        others = [p.path for p, d in zip(plans, dims) if d != rows]
        others += sorted(
            n for n in self.coordinates
            if n in self.variables and self.variables[n].shape and self.dimension(n) != rows
            and n not in others
        )  # fmt: skip
        return [self.decoded(p) for p in along], others

    def decoded(self, plan: Plan) -> Plan:
        """``plan`` reading its variable decoded, when its attributes ask for it."""
        ds = self.variables.get(plan.path)
        if ds is None or not self.decode or plan.kind != "tensor" or plan.member:
            return plan
        attrs = variable_attrs(ds)
        dtype = cf_dtype(ds.dtype, attrs)
        if dtype == plan.dtype and not _fills(attrs) and _time(attrs) is None:
            return plan
        plan.dtype, plan.special, plan.reader = dtype, CFRead(plan.path, attrs), "cf"
        return plan

    def attrs(self, name: str) -> dict[str, Any]:
        """Variable ``name``'s attributes as xarray shows them (decoded ones when decoding)."""
        attrs = variable_attrs(self.variables[name])
        return decoded_attrs(attrs) if self.decode else attrs

    def coord(self, name: str) -> Any:
        """Variable ``name`` read whole and decoded: a numpy array (or a list of str)."""
        ds = self.variables[name]
        values = ds[()]
        if self._h5py.check_string_dtype(ds.dtype) is not None:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(values)]
        return cf_decode(values, variable_attrs(ds)) if self.decode else values
