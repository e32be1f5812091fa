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
    ds = HDF5Dataset(path, progress=False)
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
    sys.exit(0)
