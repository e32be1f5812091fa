"""netCDF-4 files, written by xarray (both engines) and by the netCDF4 library itself.

Every variable along the rows is compared value by value with what
``xarray.open_dataset`` gives with each engine (``netcdf4`` and ``h5netcdf``): CF
decoding (packing, fill values, ``_Unsigned``, times, durations, booleans), in this
process and in DataLoader workers. :func:`compare` makes the per-file table
(``python tests/sources/test_netcdf.py`` prints it).
"""

import os
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import HDF5Dataset

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")
_PLUGINS = os.environ.get("HDF5_PLUGIN_PATH")
netCDF4 = pytest.importorskip("netCDF4")
# Importing netCDF4 points HDF5_PLUGIN_PATH at its own filter plugins, built for its
# own libhdf5; h5py's HDF5 in this process would then load them (test_hdf5's filter
# tests fail after this module). Restore what the environment said before the import.
if _PLUGINS is None:
    os.environ.pop("HDF5_PLUGIN_PATH", None)
else:
    os.environ["HDF5_PLUGIN_PATH"] = _PLUGINS
pytest.importorskip("h5netcdf")
cftime = pytest.importorskip("cftime")

ENGINES = ["netcdf4", "h5netcdf"]
TIMES, LAT, LON = 30, 6, 8


def _xarray_dataset():
    rng = np.random.default_rng(0)
    temp = (270 + 30 * rng.random((TIMES, LAT, LON))).astype(np.float32)
    temp[0, 0, :3] = np.nan
    count = rng.integers(0, 100, TIMES).astype(np.float64)
    count[4] = np.nan  # stored as int32 with a _FillValue: back as float64 NaN
    ds = xr.Dataset(
        {
            "temp": (("time", "lat", "lon"), temp),
            "prec": (("time", "lat", "lon"), rng.random((TIMES, LAT, LON)).astype(np.float32)),
            "pres": (("time",), 1e5 + 1e3 * rng.random(TIMES)),
            "count": (("time",), count),
            "sst": (
                ("time", "lat"),
                np.where(rng.random((TIMES, LAT)) > 0.8, np.nan, rng.random((TIMES, LAT))).astype(
                    np.float32
                ),
            ),
            "lead": (("time",), pd.to_timedelta(np.arange(TIMES) * 3, unit="h")),
            "valid": (("time",), pd.date_range("2021-03-01", periods=TIMES, freq="12h")),
            "ok": (("time",), np.arange(TIMES) % 3 == 0),
            "station": (("time",), [f"st{i}" for i in range(TIMES)]),
            "land": (("lat", "lon"), (rng.random((LAT, LON)) > 0.5).astype(np.int8)),
        },
        coords={
            "time": pd.date_range("2020-01-01", periods=TIMES, freq="6h"),
            "lat": np.linspace(-60, 60, LAT),
            "lon": np.linspace(0, 315, LON).astype(np.float32),
        },
        attrs={"Conventions": "CF-1.8", "title": "test"},
    )
    ds["temp"].attrs.update(units="K", long_name="air temperature")
    encoding = {
        "temp": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 280.0,
                 "_FillValue": np.int16(-32767), "zlib": True, "chunksizes": (7, LAT, LON)},
        "prec": {"dtype": "int16", "scale_factor": np.float32(0.001), "_FillValue": np.int16(-1)},
        "pres": {"dtype": "int32", "scale_factor": np.float32(0.1),
                 "add_offset": np.float32(90000)},
        "count": {"dtype": "int32", "_FillValue": np.int32(-999)},
        "sst": {"_FillValue": np.float32(1e20)},
        "time": {"units": "hours since 2020-01-01 00:00:00", "calendar": "standard"},
        "valid": {"units": "days since 2021-03-01T00:00:00Z", "dtype": "float64"},
        "lead": {"units": "hours", "dtype": "int32"},
    }  # fmt: skip
    return ds, encoding


def _netcdf4_library(path):
    """Layouts xarray does not write by default, written with the netCDF4 library."""
    with netCDF4.Dataset(path, "w") as f:
        f.createDimension("time", None)  # unlimited, as climate models write it
        f.createDimension("x", 4)
        time = f.createVariable("time", "f8", ("time",))
        time.units, time.calendar = "days since 2000-01-01 00:00:00", "noleap"
        rh = f.createVariable("rh", "i1", ("time", "x"), fill_value=np.int8(-1))
        rh.setncattr("_Unsigned", "true")
        wind = f.createVariable("wind", "f4", ("time",))
        wind.missing_value = np.float32(-999.0)
        hours = f.createVariable("hours", "i8", ("time",))
        hours.units = "hours since 1999-12-31 18:00:00+06:00"
        f.set_auto_maskandscale(False)
        n = 12
        time[:] = np.arange(n) * 1.5
        rh[:] = (np.arange(n * 4).reshape(n, 4) * 11 % 256).astype(np.uint8).view(np.int8)
        wind[:] = np.where(np.arange(n) % 4 == 0, -999.0, np.arange(n) * 1.5).astype(np.float32)
        hours[:] = np.arange(n) * 5
        f.createVariable("x", "i4", ("x",))[:] = np.arange(4) * 10


def make_files(root):
    """{path: what wrote it}."""
    made = {}
    ds, encoding = _xarray_dataset()
    for engine in ENGINES:
        path = root / f"xarray-{engine}.nc"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # xarray's: packing without a _FillValue
            ds.to_netcdf(path, engine=engine, encoding=encoding)
        made[path] = f"xarray ({engine})"
    path = root / "netcdf4-library.nc"
    _netcdf4_library(path)
    made[path] = "netCDF4"
    return made


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("netcdf"))


def _file(files, name):
    return next(p for p in files if p.name == name)


def _as_numpy(got):
    return got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)


def _equal(got, want, where):
    """``got`` (what shareddata gave) holds xarray's ``want`` values."""
    if want.dtype.kind in "Mm":  # int64 ns, NaT the smallest int64 in both
        want = want.astype(f"{want.dtype.kind}8[ns]").view(np.int64)
    if want.dtype.kind in "OU":
        assert list(got) == list(want), where
        return
    got = _as_numpy(got)
    assert got.dtype == want.dtype, (where, got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want, err_msg=where)


def compare(path, engine):
    """Rows of (file, engine, variable, result, detail); asserts every value equal."""
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = HDF5Dataset(path, progress=False)
    named = [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # xarray's own warnings (noleap calendars)
        ref = xr.open_dataset(path, engine=engine)
        raw = xr.open_dataset(path, engine=engine, decode_cf=False)
    along = [n for n in ref.variables if ref[n].dims and ref[n].dims[0] == ds_rows(ref, ds)]
    assert sorted(ds.columns) == sorted(along), (ds.columns, along)
    batch = ds[list(range(len(ds)))]
    for name in along:
        want = ref[name].values
        if want.dtype.kind == "O" and not isinstance(want.reshape(-1)[0], str):
            # a calendar numpy has no dates for (noleap): xarray gives cftime objects
            _equal(batch[name], raw[name].values, f"{path.name}:{name}")
            calendar = ds.attrs[name]["calendar"]
            assert any(f"{name!r}" in m and repr(calendar) in m for m in named), named
            rows.append(
                (path.name, engine, name, "numbers", f"calendar {ds.attrs[name]['calendar']}")
            )
            continue
        _equal(batch[name], want, f"{path.name}:{name} ({engine})")
        rows.append((path.name, engine, name, "equal", str(ds.specs[name].describe())))
    for name, values in ds.coords.items():
        _equal(values, ref[name].values, f"{path.name}: coordinate {name}")
        rows.append((path.name, engine, name, "ds.coords", str(ref[name].dtype)))
    return rows


def ds_rows(ref, ds):
    """The rows' dimension name in xarray's terms (that of the first column)."""
    return ref[ds.columns[0]].dims[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_variable_equals_xarray(files, engine):
    table = []
    for path in files:
        table += compare(path, engine)
    assert {row[0] for row in table} == {p.name for p in files}


def test_a_climate_file_is_its_time_steps(files):
    path = _file(files, "xarray-h5netcdf.nc")
    ds = HDF5Dataset(path, progress=False)
    assert len(ds) == TIMES  # rows along time, not along lon (8) or the longest dimension
    assert set(ds.coords) == {"lat", "lon"} and "land" not in ds.columns
    assert ds.specs["temp"].dtype == np.float64 and ds.specs["prec"].dtype == np.float32
    assert ds.attrs["temp"] == {"units": "K", "long_name": "air temperature"}
    assert ds.attrs["time"]["units"] == "nanoseconds since 1970-01-01"
    first = ds[0]["time"].numpy().view("datetime64[ns]")
    assert first == np.datetime64("2020-01-01T00:00")
    assert torch.isnan(ds[0]["temp"][0, :3]).all()
    codes = HDF5Dataset(path, decode_cf=False, progress=False)
    assert codes.specs["temp"].dtype == np.int16 and codes[0]["temp"][0, 0] == -32767
    assert codes.attrs["temp"]["scale_factor"] == 0.01
    # a variable of another dimension named in keys comes along as a coordinate
    picked = HDF5Dataset(path, ["temp", "land"], progress=False)
    assert picked.columns == ["temp"] and set(picked.coords) == {"land", "lat", "lon"}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_decoded_variables_in_dataloader_workers(files, method):
    path = _file(files, "xarray-netcdf4.nc")
    ref = xr.open_dataset(path, engine="netcdf4")
    ds = HDF5Dataset(path, ["time", "temp", "pres"], progress=False)
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=method,
                        timeout=60)  # fmt: skip
    batches = list(loader)
    for name in ("time", "temp", "pres"):
        _equal(torch.cat([b[name] for b in batches]), ref[name].values, name)
    assert len(batches) == 4


def test_a_node_shard_is_decoded_too(files):
    from shareddata.datasets._load import build
    from shareddata.sources.hdf5 import HDF5Source

    path = _file(files, "xarray-netcdf4.nc")
    ref = xr.open_dataset(path, engine="netcdf4")
    with HDF5Source(path, ["temp"]) as source:
        source.select_rows(10, 25)
        columns = build(source, share="process", progress=False)
    _equal(columns["temp"].gather(torch.arange(15)), ref["temp"].values[10:25], "temp")


# -- CF times: every calendar, unit and date range against cftime --------------------------

CALENDARS = ["standard", "gregorian", "proleptic_gregorian", "julian", "noleap", "365_day",
             "all_leap", "366_day", "360_day"]  # fmt: skip
UNITS = {"seconds": 86400, "minutes": 1440, "hours": 24, "days": 1}  # per day
RANGES = {  # reference date: day offsets (dates from year 1 to 9999)
    "0001-01-01": [0, 1, 577460, 730000],  # year 1; the Julian years; 1582; ~2000
    "0001-01-01 00:00:00": [730000, 730001, 730500],  # ~2000 only, counted from year 1
    "1500-01-01": [0, 31, 365],
    "1677-09-22": [0, 1, 1000],  # just inside datetime64[ns]
    "1970-01-01": [-36524, 0, 19000.5, 106750],  # 1870 to 2262
    "2000-01-01": [0, 1, 200000],  # 2547: beyond datetime64[ns]
    "9999-01-01": [0, 100, 300],
}


def _cf_times_file(path):
    """One variable per calendar x unit x reference date, along one dimension."""
    width = max(map(len, RANGES.values()))
    with netCDF4.Dataset(path, "w") as f:
        f.createDimension("t", width)
        for c, calendar in enumerate(CALENDARS):
            for u, (unit, per_day) in enumerate(UNITS.items()):
                for r, (ref, days) in enumerate(RANGES.items()):
                    days = days + [days[-1]] * (width - len(days))
                    values = np.array(days) * per_day
                    floats = any(d % 1 for d in days) or (c + u + r) % 2
                    var = f.createVariable(f"v{c}_{u}_{r}", "f8" if floats else "i8", ("t",))
                    var.units, var.calendar = f"{unit} since {ref}", calendar
                    var[:] = values if floats else values.astype(np.int64)


def _instant_ns(date):
    """A cftime date as ns since 1970-01-01 on its own calendar (exact, a Python int)."""
    delta = date - cftime.datetime(1970, 1, 1, calendar=date.calendar)
    return ((delta.days * 86400 + delta.seconds) * 10**6 + delta.microseconds) * 1000


def cf_table(path):
    """Rows (calendar, unit, reference, result) and the assertions behind each.

    Every variable is either decoded to the instants cftime (through
    ``xarray.open_dataset(decode_times=CFDatetimeCoder(use_cftime=True))``) gives, with
    xarray's date labels, or kept as its stored numbers with a warning naming it, its
    units and its calendar; kept only when some date has no datetime64[ns] (a calendar
    other than the standard ones, or outside 1677-09-21..2262-04-11).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = HDF5Dataset(path, progress=False)
    named = [str(w.message) for w in caught]
    coder = xr.coders.CFDatetimeCoder(use_cftime=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = xr.open_dataset(path, engine="netcdf4", decode_times=coder)
        raw = xr.open_dataset(path, engine="netcdf4", decode_times=False)
    batch = ds[list(range(len(ds)))]
    rows = []
    for c, calendar in enumerate(CALENDARS):
        for u, unit in enumerate(UNITS):
            for r, since in enumerate(RANGES):
                name = f"v{c}_{u}_{r}"
                dates = ref[name].values
                instants = [_instant_ns(d) for d in dates]
                fits = calendar in ("standard", "gregorian", "proleptic_gregorian") and all(
                    np.iinfo(np.int64).min < i <= np.iinfo(np.int64).max for i in instants
                )
                got = batch[name].numpy()
                where = f"{name}: {unit} since {since}, {calendar}"
                if fits:
                    assert ds.attrs[name]["units"] == "nanoseconds since 1970-01-01", where
                    assert got.tolist() == instants, where
                    labels = np.array([np.datetime64(d.isoformat(), "ns") for d in dates])
                    np.testing.assert_array_equal(got.view(labels.dtype), labels, err_msg=where)
                    result = f"equal: {dates[0].isoformat()[:10]} .. {dates[-1].isoformat()[:10]}"
                else:
                    assert ds.attrs[name]["units"] == f"{unit} since {since}", where
                    assert ds.attrs[name]["calendar"] == calendar, where
                    np.testing.assert_array_equal(got, raw[name].values, err_msg=where)
                    message = [m for m in named if f"{name!r}" in m]
                    assert len(message) == 1, (where, named)
                    assert f"{unit} since {since}" in message[0] and repr(calendar) in message[0]
                    result = "numbers, named in a warning"
                rows.append((calendar, unit, since, result))
    return rows


def test_cf_times_equal_cftime_on_every_calendar_or_stay_numbers(tmp_path):
    path = tmp_path / "calendars.nc"
    _cf_times_file(path)
    rows = cf_table(path)
    assert len(rows) == len(CALENDARS) * len(UNITS) * len(RANGES)
    decoded = {(row[0], row[2]) for row in rows if row[3].startswith("equal")}
    # only the standard calendars within datetime64[ns] (1677-09-21..2262-04-11) decode
    standard = ("standard", "gregorian", "proleptic_gregorian")
    within = ("0001-01-01 00:00:00", "1677-09-22", "1970-01-01")
    assert decoded == {(c, r) for c in standard for r in within}


def test_cf_times_without_cftime_are_a_named_error(files, monkeypatch):
    path = _file(files, "xarray-netcdf4.nc")
    monkeypatch.setitem(sys.modules, "cftime", None)  # import cftime: ImportError
    with pytest.raises(sd.MissingDependencyError, match=r"'time'.*torch-shareddata\[netcdf\]"):
        HDF5Dataset(path, progress=False)
    codes = HDF5Dataset(path, decode_cf=False, progress=False)  # as stored: no cftime needed
    assert codes.attrs["time"]["units"].startswith("hours since 2020-01-01")
    durations = HDF5Dataset(path, ["lead"], progress=False)  # durations need no cftime
    assert durations.attrs["lead"]["units"] == "nanoseconds"


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_a_truncated_netcdf_file_is_a_named_error(files, tmp_path, keep):
    data = _file(files, "xarray-netcdf4.nc").read_bytes()
    cut = tmp_path / "cut.nc"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(sd.SharedDataError, match="cut.nc"):
        HDF5Dataset(cut, progress=False)


if __name__ == "__main__":  # the table for the docs / a report
    import tempfile
    from pathlib import Path

    made = make_files(Path(tempfile.mkdtemp(prefix="netcdf")))
    print("| file | read by xarray's engine | variable | result | detail |\n|---|---|---|---|---|")
    for file in made:
        for engine in ENGINES:
            for row in compare(file, engine):
                print("| " + " | ".join(row) + " |")
    calendars = next(iter(made)).parent / "calendars.nc"
    _cf_times_file(calendars)
    print("\n| calendar | units | since | result |\n|---|---|---|---|")
    for row in cf_table(calendars):
        print("| " + " | ".join(row) + " |")
    sys.exit(0)
