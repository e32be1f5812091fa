"""Compatibility: Arrow files by path as pyarrow, pandas, polars and HF ``datasets`` write them.

Every file is written here by the tool itself, and every column loads equal, value by
value, to what the tool's own reader gives (``pl.read_ipc``, ``datasets.load_from_disk``,
``feather.read_table``...: their Arrow output, structs flattened and times as
integers), or is refused with an error naming it. The loaded datasets then go through
DataLoader workers (fork and spawn) and must arrive unchanged.
``python tests/sources/test_compat_arrow_files.py`` prints the compatibility table.
"""

import glob
import os
import sys
import tempfile
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pytest
from torch.utils.data import ConcatDataset, DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from test_arrow import plain, rows_of  # noqa: E402
from test_compat_arrow import CONVERSATIONS, _check_columns, _polars_frame  # noqa: E402

import shareddata as sd  # noqa: E402


def _pyarrow_table():
    tensor = pa.fixed_shape_tensor(pa.float32(), (2, 2))
    return pa.table({
        "id": pa.array([1, 2, 3, 4], pa.int32()),
        "text": ["a", "", "héllo", "日本語"],
        "messages": pa.array([c or [] for c in CONVERSATIONS],
                             pa.list_(pa.struct([("role", pa.string()),
                                                 ("content", pa.string())]))),
        "uid": pa.array([uuid.UUID(int=i).bytes for i in range(4)], pa.uuid()),
        "image": pa.ExtensionArray.from_storage(tensor, pa.FixedSizeListArray.from_arrays(
            pa.array(np.arange(16, dtype=np.float32)), 4)),
        "kind": pa.array(["x", "y", "x", "x"]).dictionary_encode(),
        "flag": pa.ExtensionArray.from_storage(pa.bool8(), pa.array([1, 0, 0, 1], pa.int8())),
        "opaque": pa.ExtensionArray.from_storage(pa.opaque(pa.binary(), "blob", "vendor"),
                                                 pa.array([b"1", b"2", b"3", b"4"])),
    })  # fmt: skip


def _by_path(path):
    return lambda cols, fill: sd.ArrowDataset(path, columns=cols, fill_value=fill, progress=False)


def _pyarrow_files(tmp, rows):
    table = _pyarrow_table()
    results = {}
    writers = {
        "pyarrow IPC file": ("t.arrow", lambda p: _ipc(ipc.new_file, p, table),
                             lambda p: ipc.open_file(p).read_all()),
        "pyarrow IPC stream": ("t.arrows", lambda p: _ipc(ipc.new_stream, p, table),
                               lambda p: ipc.open_stream(p).read_all()),
        "pyarrow Feather v2 (lz4)": ("t.feather", lambda p: feather.write_feather(
            table, p, chunksize=3), feather.read_table),
        "pyarrow Feather v2 (zstd)": ("z.feather", lambda p: feather.write_feather(
            table, p, compression="zstd", chunksize=3), feather.read_table),
    }  # fmt: skip
    for name, (file, write, read) in writers.items():
        path = os.path.join(tmp, file)
        write(path)
        results[name] = _check_columns(name, _by_path(path), read(path), rows)
    return results


def _ipc(new, path, table):
    with new(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)


def _pandas_feather(tmp, rows):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({
        "id": np.arange(4, dtype=np.int16), "x": [0.5, np.nan, 2.5, 3.5],
        "name": ["a", "b", None, "d"], "cat": pd.Categorical(["u", "v", "u", "u"]),
        "when": pd.to_datetime(["2024-01-01", "1970-01-01", "2000-02-29", "1999-12-31"]),
    })  # fmt: skip
    path = os.path.join(tmp, "pandas.feather")
    frame.to_feather(path)
    own = pa.Table.from_pandas(pd.read_feather(path), preserve_index=False)  # pandas' reader
    return {"pandas to_feather": _check_columns("pandas to_feather", _by_path(path), own, rows)}


def _polars_files(tmp, rows):
    pl = pytest.importorskip("polars")
    df = _polars_frame()
    results = {}
    for name, file, write, read in (
        ("polars write_ipc", "pl.arrow", df.write_ipc, pl.read_ipc),
        ("polars write_ipc (zstd)", "plz.arrow",
         lambda p: df.write_ipc(p, compression="zstd"), pl.read_ipc),
        ("polars write_ipc_stream", "pl.arrows", df.write_ipc_stream, pl.read_ipc_stream),
    ):  # fmt: skip
        path = os.path.join(tmp, file)
        write(path)
        own = read(path).to_arrow()  # polars' own reader, as Arrow
        results[name] = _check_columns(name, _by_path(path), own, rows)
    return results


def _hf(tmp, rows):
    datasets = pytest.importorskip("datasets")
    n = 8
    hf = datasets.Dataset.from_dict(
        {
            "messages": [CONVERSATIONS[i % 4] or [] for i in range(n)],
            "label": [i % 2 for i in range(n)],
            "tokens": [list(range(i % 3)) for i in range(n)],
            "text": [f"t{i}" for i in range(n)],
            "image": [{"bytes": b"\x89PNG" + bytes([i]), "path": None} for i in range(n)],
            "pixels": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3),
            "rows": [np.full((i % 3, 2), i, np.int16) for i in range(n)],
        },
        features=datasets.Features({
            "messages": datasets.List({"role": datasets.Value("string"),
                                       "content": datasets.Value("string")}),
            "label": datasets.ClassLabel(names=["neg", "pos"]),
            "tokens": datasets.List(datasets.Value("int32")),
            "text": datasets.Value("large_string"),
            "image": datasets.Image(),
            "pixels": datasets.Array2D((2, 3), "float32"),
            "rows": datasets.Array2D((None, 2), "int16"),
        }),
    )  # fmt: skip
    folder = os.path.join(tmp, "hf")
    hf.shuffle(seed=0).save_to_disk(folder, num_shards=3)  # the shuffled order is saved
    own = datasets.load_from_disk(folder)
    results = {
        "HF save_to_disk (3 shards)": _check_columns(
            "HF save_to_disk (3 shards)", _by_path(folder), own.with_format("arrow")[:], rows
        )
    }
    ds = sd.ArrowDataset(folder, columns=["pixels", "rows"], progress=False)  # as torch
    torch_rows = own.select_columns(["pixels", "rows"]).with_format("torch")
    for i in range(n):
        assert plain(ds[i]["pixels"]) == torch_rows[i]["pixels"].tolist()
        assert plain(ds[i]["rows"]) == torch_rows[i]["rows"].tolist()
    splits = datasets.DatasetDict({"train": hf, "test": hf.select(range(2))})
    dd = os.path.join(tmp, "hf_dict")
    splits.save_to_disk(dd)
    with pytest.raises(sd.MissingFileError, match=r"DatasetDict.*pass the folder of one split"):
        sd.ArrowDataset(dd, progress=False)
    rows.append(("HF DatasetDict save_to_disk", "(folder)", "refused: pass one split's folder"))
    split = sd.ArrowDataset(os.path.join(dd, "test"), columns=["text"], progress=False)
    assert rows_of(split) == [{"text": t} for t in datasets.load_from_disk(dd)["test"]["text"]]
    return results


def _polars_hive(tmp, rows):
    pl = pytest.importorskip("polars")
    frame = pl.DataFrame({"year": [2024, 2023, 2024], "x": [1.0, 2.0, 3.0]})
    keyed, plain_keys = os.path.join(tmp, "hive_keyed"), os.path.join(tmp, "hive")
    frame.write_parquet(keyed, partition_by="year")
    frame.write_parquet(pl.PartitionBy(plain_keys, key="year", include_key=False))
    with pytest.raises(sd.MissingColumnError, match="'year' is also a column inside its files"):
        sd.ParquetDataset(keyed, progress=False)
    rows.append(("polars write_parquet(partition_by=)", "(folder)",
                 "refused: key 'year' also inside the files; pass the files"))  # fmt: skip
    files = sorted(glob.glob(os.path.join(keyed, "**", "*.parquet"), recursive=True))
    for name, path, own in (
        ("polars partition_by, its files listed", files, pl.read_parquet(keyed)),
        ("polars PartitionBy(include_key=False)", plain_keys,
         pl.read_parquet(plain_keys, hive_partitioning=True)),
    ):  # fmt: skip
        ds = sd.ParquetDataset(path, progress=False)
        got = sorted(rows_of(ds), key=lambda r: (r["year"], r["x"]))
        assert got == sorted(own.to_dicts(), key=lambda r: (r["year"], r["x"])), name
        rows.append((name, ", ".join(ds.columns), "pass"))


def _expect(results, refused):
    """Each layout: the columns in ``refused[layout]`` refused, every other one equal."""
    for layout, outcomes in results.items():
        for column, outcome in outcomes.items():
            expected = "refused" if column in refused.get(layout, ()) else "pass"
            assert outcome.startswith(expected), (layout, column, outcome)


POLARS_REFUSED = {"price"}  # decimal128
PYARROW_REFUSED = {"opaque"}  # an extension whose meaning is unknown


def test_pyarrow_and_pandas_files(tmp_path):
    results = _pyarrow_files(str(tmp_path), [])
    _expect(results, {k: PYARROW_REFUSED for k in results})
    _expect(_pandas_feather(str(tmp_path), []), {})


def test_polars_ipc_files_and_streams(tmp_path):
    results = _polars_files(str(tmp_path), [])
    _expect(results, {k: POLARS_REFUSED for k in results})


def test_hf_save_to_disk_folders(tmp_path):
    _expect(_hf(str(tmp_path), []), {})


def test_polars_hive_folders(tmp_path):
    _polars_hive(str(tmp_path), [])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_layout_reaches_workers_unchanged(method, tmp_path):
    """All layouts in one loader: each sample, read in a worker, equals the in-process one."""
    pytest.importorskip("polars")
    pytest.importorskip("datasets")
    tmp = str(tmp_path)
    _pyarrow_files(tmp, []), _polars_files(tmp, []), _hf(tmp, [])
    paths = ["t.arrow", "t.arrows", "z.feather", "pl.arrow", "plz.arrow", "pl.arrows", "hf"]
    parts = [sd.ArrowDataset(os.path.join(tmp, p), fill_value=0, progress=False,
                             columns=[c for c in _loadable(os.path.join(tmp, p))])
             for p in paths]  # fmt: skip
    whole = ConcatDataset(parts)
    want = [plain(dict(whole[i])) for i in range(len(whole))]
    loader = DataLoader(whole, batch_size=5, num_workers=2, collate_fn=_plain_batch,
                        multiprocessing_context=method, timeout=120)  # fmt: skip
    assert [s for batch in loader for s in batch] == want


def _loadable(path):
    """The top-level columns of a file that are not refused (see the tables above)."""
    if os.path.isdir(path):
        path = sorted(glob.glob(os.path.join(path, "*.arrow")))[0]
    with open(path, "rb") as f:
        stream = f.read(4) == b"\xff\xff\xff\xff"
    schema = (ipc.open_stream if stream else ipc.open_file)(path).schema
    return [n for n in schema.names if n not in POLARS_REFUSED | PYARROW_REFUSED]


def _plain_batch(samples):
    return [plain(dict(s)) for s in samples]


if __name__ == "__main__":
    table: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in (_pyarrow_files, _pandas_feather, _polars_files, _hf, _polars_hive):
            check(tmp, table)
    print("| layout | column | outcome |\n|---|---|---|")
    for layout, column, outcome in table:
        print(f"| {layout} | {column} | {outcome} |")
