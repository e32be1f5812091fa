"""HDF5 files written by other tools (PyTables, pandas, h5py), read back column by column.

Every column of every file either loads with each value equal to what the tool's
own reader returns, or is refused by name (``UnsupportedDtypeError`` or
``MissingDependencyError`` naming the column and the fix). :func:`compare` makes
the per-file, per-column table (``python tests/sources/test_compat_hdf5.py`` prints it).
"""

import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import HDF5Dataset

tables = pytest.importorskip("tables")
pd = pytest.importorskip("pandas")

ROWS = 257


def _quiet():
    """PyTables and pandas warn about natural names and performance: not ours."""
    warnings.simplefilter("ignore")


class Point(tables.IsDescription):
    """A PyTables record, nested and with an enum, as PyTables users write them."""

    i32 = tables.Int32Col(pos=0)
    f64 = tables.Float64Col(pos=1)
    name = tables.StringCol(8, pos=2)
    flag = tables.BoolCol(pos=3)
    grid = tables.Float32Col(shape=(2, 3), pos=4)
    color = tables.EnumCol(["red", "green", "blue"], "red", base="uint8", pos=5)
    u16 = tables.UInt16Col(pos=6)

    class inner(tables.IsDescription):  # noqa: N801 -- a PyTables nested column
        x = tables.Int64Col(pos=0)
        c = tables.ComplexCol(itemsize=16, pos=1)


def _pytables(path, filters):
    rng = np.random.default_rng(1)
    with warnings.catch_warnings():
        _quiet()
        with tables.open_file(path, "w") as f:
            t = f.create_table("/", "points", Point, filters=filters, expectedrows=ROWS)
            row = t.row
            for i in range(ROWS):
                row["i32"], row["f64"] = i - 100, rng.standard_normal()
                row["name"] = f"p{i}".encode() if i % 5 else b""
                row["flag"], row["grid"] = i % 3 == 0, rng.random((2, 3))
                row["color"], row["u16"] = i % 3, i * 7
                row["inner/x"], row["inner/c"] = -i, complex(i, -i)
                row.append()
            t.flush()
            t.cols.i32.create_index()  # PyTables' index arrays: never data
            f.create_array("/", "matrix", rng.standard_normal((ROWS, 4)))
            f.create_carray("/", "image", obj=rng.integers(0, 255, (ROWS, 3, 3), np.uint8),
                            filters=filters)  # fmt: skip
            e = f.create_earray("/", "series", tables.Float32Atom(), (0,), filters=filters)
            e.append(rng.random(ROWS).astype(np.float32))
            words = f.create_vlarray("/", "words", tables.VLStringAtom())
            texts = f.create_vlarray("/", "texts", tables.VLUnicodeAtom())
            ragged = f.create_vlarray("/", "ragged", tables.Int16Atom(), filters=filters)
            objects = f.create_vlarray("/", "objects", tables.ObjectAtom())
            for i in range(ROWS):
                words.append(b"w" * (i % 4))
                texts.append("héllo wörld 🙂"[: i % 14])
                ragged.append(np.arange(i % 5, dtype=np.int16))
                objects.append({"i": i})


def _frame():
    rng = np.random.default_rng(2)
    return pd.DataFrame(
        {
            "price": rng.random(ROWS),
            "qty": np.arange(ROWS, dtype=np.int64),
            "small": np.arange(ROWS, dtype=np.int32) % 7,
            "more": rng.random(ROWS),  # a second float64: shares a block with price
            "city": [["Paris", "Zürich", "東京"][i % 3] for i in range(ROWS)],
            "kind": pd.Categorical([["a", "b", "c"][i % 3] for i in range(ROWS)]),
            "when": pd.date_range("2024-01-01", periods=ROWS, freq="h"),
            "ok": np.arange(ROWS) % 2 == 0,
        },
        index=pd.Index([f"r{i}" for i in range(ROWS)], name="row"),
    )


def _h5py_records(path):
    color = h5py.enum_dtype({"r": 0, "g": 1, "b": 2}, basetype="i1")
    dtype = np.dtype(
        [
            ("x", "<f4"),
            ("big", ">i8"),
            ("v", "<f8", (3,)),
            ("flag", "?"),
            ("tag", "S6"),
            ("text", h5py.string_dtype()),
            ("color", color),
            ("pos", [("lat", "<f8"), ("lon", "<f8"), ("alt", [("m", "<i2")])]),
        ]
    )
    rng = np.random.default_rng(3)
    rec = np.zeros(ROWS, dtype)
    rec["x"], rec["big"], rec["v"] = rng.random(ROWS), np.arange(ROWS) * 3, rng.random((ROWS, 3))
    rec["flag"], rec["tag"] = np.arange(ROWS) % 2 == 1, [f"t{i}".encode() for i in range(ROWS)]
    rec["text"] = [f"é{i}" * (i % 3) for i in range(ROWS)]
    rec["color"], rec["pos"]["lat"] = np.arange(ROWS) % 3, rng.random(ROWS)
    rec["pos"]["alt"]["m"] = np.arange(ROWS, dtype=np.int16)
    with h5py.File(path, "w") as f:
        f.create_dataset("rec", data=rec, chunks=(64,), compression="gzip", shuffle=True)
        f["plain"] = rec  # contiguous


def make_files(root):
    """Every file of the suite, written under ``root``: {path: the tool that wrote it}."""
    made = {}
    with warnings.catch_warnings():
        _quiet()
        for name, filters in [
            ("pytables.h5", None),
            ("pytables-zlib-shuffle.h5", tables.Filters(5, "zlib", shuffle=True)),
            ("pytables-blosc.h5", tables.Filters(5, "blosc")),
        ]:
            _pytables(root / name, filters)
            made[name] = "pytables"
        frame = _frame()
        frame.to_hdf(root / "pandas-table.h5", key="df", format="table")
        frame.to_hdf(root / "pandas-table-dc.h5", key="df", format="table", data_columns=True)
        frame.drop(columns=["kind"]).to_hdf(root / "pandas-fixed.h5", key="df", format="fixed")
        made.update(dict.fromkeys(["pandas-table.h5", "pandas-table-dc.h5"], "pandas"))
        made["pandas-fixed.h5"] = "pandas"
        series = frame["price"].rename("price")
        series.to_hdf(root / "pandas-series-table.h5", key="df", format="table")
        series.to_hdf(root / "pandas-series-fixed.h5", key="df", format="fixed")
        made.update(dict.fromkeys(["pandas-series-table.h5", "pandas-series-fixed.h5"], "pandas"))
    _h5py_records(root / "h5py-records.h5")
    made["h5py-records.h5"] = "h5py"
    return {root / name: tool for name, tool in made.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("compat"))


# -- reference readers ---------------------------------------------------------------------


def _pytables_reference(path):
    """{column: values} as PyTables reads them, named as shareddata names them."""
    out = {}
    with warnings.catch_warnings():
        _quiet()
        with tables.open_file(path) as f:
            rec = f.root.points.read()
            for field in rec.dtype.names:
                if rec.dtype[field].names:
                    for sub in rec.dtype[field].names:
                        out[f"points/{field}/{sub}"] = rec[field][sub]
                else:
                    out[f"points/{field}"] = rec[field]
            out["matrix"] = f.root.matrix.read()
            out["image"] = f.root.image.read()
            out["series"] = f.root.series.read()
            out["words"] = list(f.root.words.read())
            out["texts"] = list(f.root.texts.read())
            out["ragged"] = list(f.root.ragged.read())
            out["objects"] = "refused"
            labels = {k: int(v) for k, v in f.root.points.get_enum("color")}
    return out, {"points/color": labels}


def _pandas_reference(path):
    df = pd.read_hdf(path, "df")
    if isinstance(df, pd.Series):  # a Series is one column, named by its name
        return {"row": list(df.index), df.name: df.to_numpy()}, {}
    out = {"row": list(df.index)}
    labels = {}
    for column in df.columns:
        values = df[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            out[column] = values.cat.codes.to_numpy()
            labels[column] = {c: i for i, c in enumerate(values.cat.categories)}
        elif values.dtype.kind == "M":
            out[column] = values.to_numpy().view(np.int64)
        elif values.dtype.kind in "biuf":
            out[column] = values.to_numpy()
        else:
            out[column] = list(values)
    if "fixed" in path.name:
        out["city"] = "refused"  # pandas pickles object columns in format="fixed"
    return out, labels


def _h5py_reference(path):
    out = {}
    with h5py.File(path) as f:
        for key in ("rec", "plain"):
            rec = f[key][()]
            out[f"{key}/x"], out[f"{key}/big"], out[f"{key}/v"] = rec["x"], rec["big"], rec["v"]
            out[f"{key}/flag"], out[f"{key}/tag"] = rec["flag"], list(rec["tag"])
            out[f"{key}/text"] = [t.decode() for t in rec["text"]]
            out[f"{key}/color"] = rec["color"]
            out[f"{key}/pos/lat"], out[f"{key}/pos/lon"] = rec["pos"]["lat"], rec["pos"]["lon"]
            out[f"{key}/pos/alt/m"] = rec["pos"]["alt"]["m"]
        labels = h5py.check_enum_dtype(f["rec"].dtype["color"])
    return out, {"rec/color": labels, "plain/color": labels}


REFERENCE = {"pytables": _pytables_reference, "pandas": _pandas_reference, "h5py": _h5py_reference}


def _load_each(path, names):
    """{column: (dataset or the error)}, one column at a time (a refusal names it)."""
    loaded = {}
    for name in names:
        try:
            loaded[name] = HDF5Dataset(path, [name], progress=False)
        except (sd.UnsupportedDtypeError, sd.MissingDependencyError) as error:
            loaded[name] = error
    return loaded


def compare(path, tool):
    """Rows of (file, column, what shareddata did, detail); asserts every value equal."""
    want, labels = REFERENCE[tool](path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default selection warns about what it skips
        try:
            default = HDF5Dataset(path, progress=False)
            columns = default.columns
        except sd.MissingDependencyError as error:  # a filter not installed: name it
            return [(path.name, "*", "refused", str(error).split(". Fix")[0][-60:])]
    rows = []
    key_of = {"pandas": lambda c: f"df/{c}"}.get(tool, lambda c: c)
    loaded = _load_each(path, [key_of(c) for c in want])
    for column, reference in want.items():
        got = loaded[key_of(column)]
        if isinstance(got, Exception):
            assert _is_refused(reference), f"{path.name}: {column!r} refused: {got}"
            assert repr(column) in str(got) or repr(key_of(column)) in str(got)
            assert column not in columns  # and left out of the default selection
            rows.append((path.name, column, "refused", type(got).__name__))
            continue
        assert not _is_refused(reference), f"{path.name}: {column!r} loaded"
        assert column in columns, f"{path.name}: {column!r} not in the default selection"
        batch = default[list(range(len(default)))][column]
        _assert_values(batch, reference, f"{path.name}:{column}")
        if column in labels:
            assert default.labels[column] == labels[column]
        spec = default.specs[column]
        rows.append((path.name, column, "equal", spec.describe()))
    extra = set(columns) - set(want)
    assert not extra, f"{path.name}: bookkeeping picked as data: {sorted(extra)}"
    return rows


def _is_refused(reference):
    return isinstance(reference, str) and reference == "refused"


def _assert_values(got, want, where):
    if isinstance(got, torch.Tensor):
        want = np.asarray(want)
        assert got.shape == want.shape, where
        np.testing.assert_array_equal(got.numpy(), want.astype(want.dtype.newbyteorder("=")))
        return
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        w = bytes(w) if isinstance(w, np.bytes_) else str(w) if isinstance(w, np.str_) else w
        if isinstance(g, torch.Tensor):
            np.testing.assert_array_equal(g.numpy(), np.asarray(w), err_msg=where)
        else:
            assert type(g) is type(w) and g == w, (where, g, w)


def test_every_column_is_equal_to_the_tools_reader_or_refused_by_name(files):
    table = []
    for path, tool in files.items():
        table += compare(path, tool)
    by_file = {name for name, *_ in table}
    assert len(by_file) == len(files)
    blosc = [r for r in table if r[0] == "pytables-blosc.h5"]
    if blosc[0][2] == "refused":  # hdf5plugin not installed: said so, with the fix
        assert "'blosc'" in blosc[0][3] or "32001" in blosc[0][3]


def test_pandas_store_loads_its_frame_not_its_indexes(files):
    path = next(p for p in files if p.name == "pandas-table.h5")
    ds = HDF5Dataset(path, progress=False)
    assert len(ds) == ROWS  # not the 131201 rows of PyTables' index arrays
    assert ds.columns == ["row", "price", "qty", "small", "more", "city", "kind", "when", "ok"]
    assert ds[3]["city"] == "Paris" and ds[1]["city"] == "Zürich" and ds[2]["city"] == "東京"
    assert ds[4]["ok"].dtype == torch.bool and bool(ds[4]["ok"])
    assert ds.labels["kind"] == {"a": 0, "b": 1, "c": 2}
    both = HDF5Dataset(path, ["df/price", "df"], progress=False)  # named by the key given
    assert both.columns[:2] == ["df/price", "row"] and len(both.columns) == 10
    with pytest.raises(KeyError, match=r"its datasets are: 'df' \(a pandas frame\)\.$"):
        HDF5Dataset(path, "nope")  # PyTables' index arrays are not offered
    with pytest.raises(KeyError, match=r"frame '/df' has no column 'nope'.*'row', 'price'"):
        HDF5Dataset(path, "df/nope")
    one = HDF5Dataset(path, ["df/price", "df/city"], progress=False)
    assert one.columns == ["df/price", "df/city"]
    want = pd.read_hdf(path, "df")
    loader = DataLoader(
        ds, batch_size=64, num_workers=1, multiprocessing_context="fork", timeout=60
    )
    batches = list(loader)  # from a worker process, through the default collate
    price = torch.cat([b["price"] for b in batches]).numpy()
    np.testing.assert_array_equal(price, want["price"].to_numpy())
    assert [c for b in batches for c in b["city"]] == list(want["city"])


def test_blosc_is_refused_by_name_or_loads(files):
    path = next(p for p in files if p.name == "pytables-blosc.h5")
    try:
        ds = HDF5Dataset(path, ["points"], progress=False)
    except sd.MissingDependencyError as error:
        assert "'points'" in str(error) and "pip install hdf5plugin" in str(error)
    else:
        assert len(ds) == ROWS


def test_pandas_fixed_multiindex_levels_load_or_are_named(tmp_path):
    index = pd.MultiIndex.from_product(
        [["a", "b", "c"], [10, 20], pd.date_range("2024-01-01", periods=2)],
        names=["letter", "num", "day"],
    )
    frame = pd.DataFrame({"x": np.arange(12.0)}, index=index)
    with warnings.catch_warnings():
        _quiet()
        frame.to_hdf(tmp_path / "mi.h5", key="df", format="fixed")
        frame.to_hdf(tmp_path / "mi-table.h5", key="df", format="table")
    want = pd.read_hdf(tmp_path / "mi.h5", "df")
    for name in ("mi.h5", "mi-table.h5"):
        ds = HDF5Dataset(tmp_path / name, progress=False)
        assert ds.columns == ["letter", "num", "day", "x"], name
        batch = ds[list(range(12))]
        np.testing.assert_array_equal(batch["num"].numpy(), want.index.get_level_values("num"))
        days = want.index.get_level_values("day").to_numpy().view(np.int64)
        np.testing.assert_array_equal(batch["day"].numpy(), days)
        np.testing.assert_array_equal(batch["x"].numpy(), want["x"].to_numpy())
    letters = HDF5Dataset(tmp_path / "mi.h5", ["df/letter"], progress=False)
    names = {code: label for label, code in letters.labels["df/letter"].items()}
    got = [names[int(c)] for c in letters[list(range(12))]["df/letter"]]
    assert got == list(want.index.get_level_values("letter"))
    # a level with NaN in it is left out with a warning naming it
    holes = frame.reset_index()
    holes.loc[3, "num"] = np.nan
    with warnings.catch_warnings():
        _quiet()
        holes.set_index(["letter", "num"]).to_hdf(tmp_path / "nan.h5", key="df", format="fixed")
    with pytest.warns(UserWarning, match=r"'num' .* MultiIndex level with missing values"):
        assert HDF5Dataset(tmp_path / "nan.h5", progress=False).columns == ["letter", "day", "x"]
    columns = pd.DataFrame(np.ones((3, 2)), columns=pd.MultiIndex.from_tuples([("a", 1), ("b", 2)]))
    with warnings.catch_warnings():
        _quiet()
        columns.to_hdf(tmp_path / "mc.h5", key="df", format="fixed")
    with pytest.raises(sd.UnsupportedDtypeError, match="columns are a MultiIndex.*flatten"):
        HDF5Dataset(tmp_path / "mc.h5", progress=False)


if __name__ == "__main__":  # the table for the docs / a report
    import tempfile
    from pathlib import Path

    made = make_files(Path(tempfile.mkdtemp(prefix="compat")))
    print("| file | column | result | kind / error |\n|---|---|---|---|")
    for file, tool in made.items():
        for row in compare(file, tool):
            print("| " + " | ".join(row) + " |")
    sys.exit(0)
