"""netCDF-4 files: variables along one dimension as columns, decoded as xarray decodes them.

Rows run along the first dimension of most data variables (found by dimension
scales); variables along other dimensions go to ``ds.coords``. Fill values are masked
to NaN, then packed values scaled, in xarray's float type; ``_Unsigned`` and
``dtype: bool`` are honoured. Times on a standard calendar become int64 ns since 1970
(cftime places the reference date; the ``netcdf`` extra), durations int64 ns; other
calendars or times outside datetime64[ns] keep their numbers, with a warning
(:func:`times_of`). ``decode_cf=False`` keeps every variable as stored.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..errors import MissingDependencyError
from ._hdf5_layout import Plan, attr_value

__all__ = ["Netcdf", "Times", "cf_decode", "decoded_attrs", "is_netcdf", "times_of"]

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
NAT = np.iinfo(np.int64).min
"""What a missing time is (``NaT``) in an int64 time column."""
_INT64_MAX = np.iinfo(np.int64).max
_NS_LIMIT = (1 - 2**-20) * 2.0**63  # float times below this (a margin for _to_ns's steps)
_BLOCK = 32 << 20  # bytes of stored values decoded per block


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


@dataclass(frozen=True)
class Times:
    """How a time variable's numbers become int64 ns: ``number * per + base``."""

    per: int  # ns per unit
    base: int  # the reference date in ns since 1970-01-01 (0 for a duration)
    since: bool  # a date (``<unit> since <date>``), not a duration


def _time_units(attrs: dict[str, Any]) -> tuple[int, bool] | None:
    """``(ns per unit, whether "since" a date)`` of time-like ``units``, or None."""
    units = attrs.get("units")
    if not isinstance(units, str):
        return None
    unit, since, _ = units.strip().partition(" since ")
    per = _NS.get(_ALIASES.get(unit.strip().lower(), unit.strip().lower()))
    return None if per is None else (per, bool(since))


def _fits(low: Any, high: Any, per: int, base: int) -> bool:
    """Whether every ``v * per + base`` for ``low <= v <= high`` is an int64 that is not NaT."""
    if isinstance(low, float):  # a margin for the float steps of _to_ns
        return low * per + base > -_NS_LIMIT and high * per + base < _NS_LIMIT
    lo, hi, shift = int(low), int(high), base // per  # _to_ns adds the shift first
    ends = (lo * per + base, hi * per + base, lo + shift, hi + shift)
    return ends[0] > NAT and ends[2] > NAT and max(ends[1], ends[3]) <= _INT64_MAX


def times_of(label: str, name: str, ds: Any, attrs: dict[str, Any]) -> Times | None:
    """How variable ``name`` decodes to datetime64[ns] / timedelta64[ns], or None.

    Decoded only on a standard calendar (cftime places the reference date) when every
    value lands within datetime64[ns]; else a warning names variable, units, calendar.
    """
    unit = _time_units(attrs)
    if unit is None or ds.dtype.kind not in "iuf":
        return None
    per, since = unit
    units, calendar = attrs["units"], str(attrs.get("calendar", "standard")).lower()
    why = f"calendar {calendar!r} has no datetime64 equivalent"
    if not since:
        base, why = 0, "the durations do not fit int64 nanoseconds"
    elif calendar in _STANDARD:
        try:
            import cftime
        except ImportError as error:
            raise MissingDependencyError(
                f"{label}: variable {name!r} holds CF times, which cftime decodes, and cftime "
                "is not installed. Install it with: pip install 'torch-shareddata[netcdf]' "
                "(or pass decode_cf=False to keep every variable as stored)."
            ) from error
        why = "its reference date cannot be read"
        try:
            ref = cftime.num2date(0, units, calendar, only_use_cftime_datetimes=True)
            delta = ref - cftime.datetime(1970, 1, 1, calendar=calendar)
        except (ValueError, TypeError, OverflowError):
            base = None
        else:
            base = (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
            why = "its dates fall outside datetime64[ns] (1677-09-21 to 2262-04-11)"
    else:
        base = None
    if base is not None:
        low, high = _value_range(ds, attrs)
        if low is None or _fits(low, high, per, base):
            return Times(per, base, since)
    warnings.warn(
        f"{label}: variable {name!r} (units {units!r}, calendar {calendar!r}) is kept as "
        f"its stored numbers: {why}. ds.attrs[{name!r}] keeps its units and calendar; "
        "cftime.num2date(values, units, calendar) gives its dates.",
        UserWarning,
        stacklevel=2,
    )
    return None


def _value_range(ds: Any, attrs: dict[str, Any]) -> tuple[Any, Any]:
    """The smallest and largest decoded number of ``ds`` (fill values left out), or None."""
    low = high = None
    step = max(1, _BLOCK // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))))
    for start in range(0, int(ds.shape[0]) if ds.shape else 1, step):
        block = cf_decode(ds[start : start + step] if ds.shape else ds[()], attrs)
        block = block[~np.isnan(block)] if block.dtype.kind == "f" else block[block != NAT]
        if block.size:
            lo, hi = block.min().item(), block.max().item()
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
    return low, high


def _float_dtype(dtype: np.dtype, attrs: dict[str, Any]) -> np.dtype:
    """The float type xarray decodes ``dtype`` into (``_choose_float_dtype``)."""
    scale, offset = attrs.get("scale_factor"), attrs.get("add_offset")
    if scale is None and offset is None:
        small = dtype.kind in "fiu" and dtype.itemsize <= (4 if dtype.kind == "f" else 2)
        return np.dtype(np.float32 if small else np.float64)
    scale_type = np.dtype(type(scale)) if scale is not None else None
    if (
        scale_type in (np.float32, np.float64)
        and (np.dtype(type(offset)) if offset is not None else None) == scale_type
    ):
        return np.dtype(np.float64 if dtype.itemsize == 4 and dtype.kind in "iu" else scale_type)
    if offset is not None or scale_type is None or scale_type.kind != "f":
        return np.dtype(np.float64)
    return scale_type


def _fills(attrs: dict[str, Any]) -> list[Any]:
    out = []
    for key in ("missing_value", "_FillValue"):
        if key in attrs:
            out += [v for v in np.ravel(attrs[key]) if not np.isnan(np.float64(v))]
    return out


def cf_dtype(dtype: np.dtype, attrs: dict[str, Any], time: Times | None = None) -> np.dtype:
    """The type of a variable of stored type ``dtype`` once :func:`cf_decode` decoded it."""
    return cf_decode(np.zeros(0, dtype), attrs, time).dtype


def cf_decode(values: np.ndarray, attrs: dict[str, Any], time: Times | None = None) -> np.ndarray:
    """``values`` decoded as xarray decodes a variable with these attributes.

    Example:
        >>> cf_decode(np.array([0, 100, -1], np.int16), {"scale_factor": np.float32(0.5),
        ...                                              "_FillValue": np.int16(-1)})
        array([ 0., 50., nan], dtype=float32)
        >>> day = Times(3600 * 10**9, 946684800 * 10**9, since=True)  # 2000-01-01
        >>> cf_decode(np.array([0, 24]), {}, day).view("M8[ns]")
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
        return _to_ns(data, time.per, time.base)
    if str(attrs.get("dtype", "")) == "bool" and data.dtype.kind in "iu":
        return data.astype(bool)
    return data


def _to_ns(data: np.ndarray, per: int, base: int) -> np.ndarray:
    """Numbers of ``per``-ns units after ``base`` as int64 ns (xarray's steps).

    Counted from the unit nearest 1970 first, so ``base`` may lie outside int64.
    """
    shift, base = divmod(base, per)
    if data.dtype.kind in "iu":
        missing = data == NAT if data.dtype == np.int64 else np.zeros(data.shape, bool)
        out = (np.where(missing, 0, data).astype(np.int64) + shift) * per + base
        out[missing] = NAT
        return out
    values = data.astype(np.float64) + shift
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


def decoded_attrs(attrs: dict[str, Any], time: Times | None) -> dict[str, Any]:
    """What a variable's attributes say once decoded (xarray's ``.attrs``, times renamed)."""
    out = {k: v for k, v in attrs.items() if k not in _ENCODING}
    if str(out.get("dtype", "")) == "bool":
        out.pop("dtype")
    if time is not None:
        out.pop("calendar", None)
        out["units"] = "nanoseconds since 1970-01-01" if time.since else "nanoseconds"
        if time.since:
            out["calendar"] = "proleptic_gregorian"
    return out


class Netcdf:
    """The variables of a netCDF-4 file, their dimensions, coordinates and decoding."""

    def __init__(self, h5py: Any, file: Any, decode: bool, label: str) -> None:
        self._h5py = h5py
        self.decode = decode
        self.label = label
        self._times: dict[str, Times | None] = {}
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
        pool = [n for n, ds in self.variables.items() if ds.shape]
        rows = self._rows(pool) if pool else ""
        return [n for n in pool if self.dimension(n) == rows]

    def _rows(self, paths: list[str]) -> str:
        """The rows' dimension: the commonest first dimension of data (not coordinate) paths."""
        dims = [self.dimension(p) for p in paths]
        data = [d for p, d in zip(paths, dims) if p not in self.coordinates]
        return Counter(data or dims).most_common(1)[0][0]

    def split(self, plans: list[Plan]) -> tuple[list[Plan], list[str]]:
        """Plans along the rows' dimension (most data variables' first), and the others."""
        if not plans:
            return plans, []
        rows = self._rows([p.path for p in plans])
        dims = [self.dimension(p.path) for p in plans]
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
        time = self.times(plan.path)
        dtype = cf_dtype(ds.dtype, attrs, time)
        if dtype == plan.dtype and not _fills(attrs) and time is None:
            return plan
        plan.dtype, plan.reader = dtype, "cf"
        plan.decode = partial(cf_decode, attrs=attrs, time=time)
        return plan

    def times(self, name: str) -> Times | None:
        """How variable ``name``'s times decode (:func:`times_of`, asked once per variable)."""
        if name not in self._times:
            ds = self.variables[name]
            self._times[name] = times_of(self.label, name, ds, variable_attrs(ds))
        return self._times[name]

    def attrs(self, name: str) -> dict[str, Any]:
        """Variable ``name``'s attributes as xarray shows them (decoded ones when decoding)."""
        attrs = variable_attrs(self.variables[name])
        return decoded_attrs(attrs, self.times(name)) if self.decode else attrs

    def coord(self, name: str) -> Any:
        """Variable ``name`` read whole and decoded: a numpy array (or a list of str)."""
        ds = self.variables[name]
        values = ds[()]
        if self._h5py.check_string_dtype(ds.dtype) is not None:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(values)]
        return cf_decode(values, variable_attrs(ds), self.times(name)) if self.decode else values
