import gc
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, START_METHODS, open_fds
from torch.utils.data import DataLoader, default_collate

import shareddata as sd
import shareddata.columns._columns
from shareddata import ArrowDataset, ParquetDataset
from shareddata.datasets._load import build
from shareddata.sources import parquet as sp
from shareddata.sources._arrow_columns import ArrowColumn, Writer, rebase_offsets
from shareddata.sources._source import as_buffer
from shareddata.sources.arrow import ArrowSource, TableInput
from shareddata.sources.parquet import parquet_source

N = 23  # rows; not a multiple of the row group size


def _table(n=N, seed=0):
    """A table with one column of every supported type."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, n)
    lengths[1] = 0  # an empty list and an empty string for sure
    words = ["", "héllo", "日本語", "a", "emoji 🙂", "x" * 40]
    return pa.table(
        {
            "i32": pa.array(rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32)),
            "i64": pa.array(rng.integers(-(2**62), 2**62, n)),
            "u8": pa.array(rng.integers(0, 256, n).astype(np.uint8)),
            "b": pa.array(rng.random(n) > 0.5),
            "f16": pa.array(rng.standard_normal(n).astype(np.float16)),
            "f64": pa.array(rng.standard_normal(n)),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(n * 3).astype(np.float32)), 3
            ),
            "img": pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 6, dtype=np.uint8)), 3),
                2,
            ),
            "text": pa.array([words[i % len(words)] * (i % 3) for i in range(n)]),
            "big_text": pa.array([f"row {i}" for i in range(n)], pa.large_string()),
            "blob": pa.array([bytes(range(i % 7)) for i in range(n)]),
            "big_blob": pa.array([b"\x00\xff" * (i % 4) for i in range(n)], pa.large_binary()),
            "tokens": pa.array([list(range(int(k))) for k in lengths], pa.list_(pa.int32())),
            "scores": pa.array(
                [rng.standard_normal(int(k)).tolist() for k in lengths], pa.large_list(pa.float64())
            ),
            "flags": pa.array([[bool(j % 2) for j in range(int(k))] for k in lengths]),
            "cat": pa.array(
                [["red", "green", "blue"][i % 3] for i in range(n)]
            ).dictionary_encode(),
            "ts": pa.array(np.arange(n) * 1000, pa.timestamp("ms", tz="UTC")),
            "day": pa.array(np.arange(n, dtype=np.int32), pa.date32()),
        }
    )


TENSOR_DTYPES = {
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "b": torch.bool,
    "f16": torch.float16,
    "f64": torch.float64,
    "vec": torch.float32,
    "img": torch.uint8,
    "ts": torch.int64,
    "day": torch.int32,
}


def _expected(table):
    """Per-column python values as shareddata returns them (temporals as integers)."""
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.int64())
        elif pa.types.is_date32(col.type):
            col = col.cast(pa.int32())
        out[name] = col.to_pylist()
    return out


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def _assert_matches(ds, table):
    expected = _expected(table)
    assert len(ds) == table.num_rows
    assert ds.columns == table.column_names
    for i in range(len(ds)):
        sample = ds[i]
        for name, values in expected.items():
            got = sample[name]
            if name in TENSOR_DTYPES:
                assert isinstance(got, torch.Tensor) and got.dtype == TENSOR_DTYPES[name], name
            assert _plain(got) == values[i], (name, i)
    kinds = {name: spec.kind for name, spec in ds.specs.items()}
    for name in ("text", "big_text", "cat"):
        assert kinds[name] == "str"
    for name in ("blob", "big_blob"):
        assert kinds[name] == "bytes"
    for name in ("tokens", "scores", "flags"):
        assert kinds[name] == "ragged"
    assert ds.specs["vec"].shape == (3,) and ds.specs["img"].shape == (2, 3)
    if len(ds):
        assert ds[0]["i32"].ndim == 0 and isinstance(ds[0]["blob"], bytes)


@pytest.fixture
def table():
    return _table()


@pytest.fixture
def pq_file(tmp_path, table):
    path = tmp_path / "data.parquet"
    pq.write_table(table, path, row_group_size=5)
    return path


def test_every_type_round_trips_from_parquet(pq_file, table):
    assert pq.ParquetFile(pq_file).num_row_groups == 5
    _assert_matches(ParquetDataset(pq_file), table)
    _assert_matches(ParquetDataset(str(pq_file)), table)


def test_every_type_round_trips_from_arrow(table):
    _assert_matches(ArrowDataset(table), table)
    _assert_matches(ArrowDataset(table.to_batches()[0]), table)  # a RecordBatch


def test_sliced_tables_and_chunked_columns(table):
    # slices start mid-buffer (bit offset for bools, offsets not starting at 0)
    for part in (table.slice(3, 11), table.slice(7), table.slice(0, 1), table.slice(5, 0)):
        _assert_matches(ArrowDataset(part), part)
    chunked = pa.concat_tables([table.slice(0, 4), table.slice(4, 9), table.slice(13)])
    assert chunked.column("text").num_chunks == 3
    _assert_matches(ArrowDataset(chunked), chunked)
    combined = chunked.combine_chunks().slice(2, 15)
    _assert_matches(ArrowDataset(combined), combined)


def test_several_files_in_the_order_given_and_a_folder_in_sorted_order(tmp_path, table):
    parts = {"b.parquet": table.slice(0, 10), "a.parquet": table.slice(10, 5)}
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, part in parts.items():
        pq.write_table(part, folder / name, row_group_size=4)
    (folder / "_SUCCESS").write_text("")  # what Spark leaves next to its files
    (folder / "notes.txt").write_text("not data")
    listed = ParquetDataset([folder / "b.parquet", folder / "a.parquet"])
    _assert_matches(listed, table.slice(0, 15))
    by_folder = ParquetDataset(folder)
    _assert_matches(by_folder, pa.concat_tables([parts["a.parquet"], parts["b.parquet"]]))


def test_column_subset_in_the_order_asked(pq_file, table):
    ds = ParquetDataset(pq_file, ["tokens", "i32", "text"], output="tuple")
    assert ds.columns == ["tokens", "i32", "text"]
    tokens, i32, text = ds[4]
    assert tokens.tolist() == table["tokens"][4].as_py()
    assert int(i32) == table["i32"][4].as_py() and text == table["text"][4].as_py()
    assert ArrowDataset(table, columns=["text"]).columns == ["text"]
    assert ParquetDataset(pq_file, "u8").columns == ["u8"]
    with pytest.raises(sd.EmptySelectionError, match=r"columns=\[\] selects no column.*'i32'"):
        ParquetDataset(pq_file, [])
    with pytest.raises(ValueError, match="'text'"):
        ArrowDataset(table, columns=[])
    with pytest.raises(sd.EmptySelectionError, match="no column to load"):
        ArrowDataset(pa.table({}))


def test_dictionary_encoded_strings_in_parquet_and_arrow(tmp_path):
    values = ["cat", "dog", "cat", "", "ü", "dog"] * 5
    table = pa.table({"d": pa.array(values).dictionary_encode()})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    # plain strings written with Parquet's dictionary encoding, read back as dictionaries too
    pq.write_table(pa.table({"d": values}), tmp_path / "e.parquet", use_dictionary=True)
    assert (
        pq.ParquetFile(tmp_path / "e.parquet").metadata.row_group(0).column(0).has_dictionary_page
    )
    for ds in (
        ParquetDataset(tmp_path / "d.parquet"),
        ParquetDataset(tmp_path / "e.parquet"),
        ArrowDataset(table),
        ArrowDataset(table.slice(4, 20)),
    ):
        expected = values if len(ds) == len(values) else values[4:24]
        assert [ds[i]["d"] for i in range(len(ds))] == expected
        assert ds.specs["d"].kind == "str"
    assert pq.ParquetFile(tmp_path / "d.parquet").schema_arrow.field("d").type.value_type == (
        pa.string()
    )


def test_fixed_shape_tensor_extension_and_views(table):
    storage = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(24, dtype=np.float32)), 6)
    tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), (2, 3)), storage)
    views = pa.table(
        {
            "t": tensor,
            "sv": pa.array(["a", "bb", "", "ccc"], pa.string_view()),
            "fb": pa.array([b"ab", b"cd", b"ef", b"gh"], pa.binary(2)),
        }
    )
    ds = ArrowDataset(views)
    assert ds.specs["t"].shape == (2, 3)
    np.testing.assert_array_equal(ds[1]["t"].numpy(), np.arange(6, 12).reshape(2, 3))
    assert [ds[i]["sv"] for i in range(4)] == ["a", "bb", "", "ccc"]
    assert ds[3]["fb"] == b"gh"


def test_indexing_negative_and_getitems_equal_per_sample(pq_file, table):
    ds = ParquetDataset(pq_file)
    assert _plain(ds[-1]["tokens"]) == table["tokens"][-1].as_py()
    assert ds[-N]["text"] == ds[0]["text"]
    with pytest.raises(IndexError):
        ds[N]
    with pytest.raises(IndexError):
        ds[-N - 1]
    idx = [5, -1, 0, 5, 17, 1]
    for got, i in zip(ds.__getitems__(idx), idx):
        single = ds[i]
        assert got.keys() == single.keys()
        for name in got:
            assert _plain(got[name]) == _plain(single[name]), name
            if isinstance(single[name], torch.Tensor):
                assert got[name].dtype == single[name].dtype


def test_storage_dir_and_nbytes(tmp_path, pq_file, table):
    ds = ParquetDataset(pq_file, ["tokens", "text", "vec"], storage_dir=tmp_path)
    values = table["tokens"].combine_chunks().values
    text_bytes = sum(len(s.encode()) for s in table["text"].to_pylist())
    assert ds.specs["tokens"].values == len(values)
    assert ds.specs["text"].values == text_bytes
    assert ds.nbytes == (N + 1) * 8 * 2 + len(values) * 4 + text_bytes + N * 3 * 4
    assert ds[2]["text"] == table["text"][2].as_py()


def test_progress_reports_every_byte(pq_file):
    source = parquet_source(pq_file, ["i64", "text", "tokens", "img"])
    seen = []
    try:
        for spec in source.specs():
            layout = sd.columns._columns.COLUMN_KINDS[spec.kind].layout(spec)
            buffers = {k: as_buffer(np.zeros(s, d)) for k, (s, d) in layout.items()}
            source.read(spec, buffers, seen.append)
            assert sum(seen) == spec.nbytes - (8 if spec.kind != "tensor" else 0)
            seen.clear()
    finally:
        source.close()


def test_metadata_only_until_specs(pq_file, monkeypatch):
    reads = []
    original = pq.ParquetFile.read_row_group

    def counting(self, *args, **kwargs):
        reads.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    source = parquet_source(pq_file)
    assert reads == []
    source.close()
    fixed = parquet_source(pq_file, ["i32", "vec", "img", "b"])
    specs = fixed.specs()  # statistics say "no nulls": nothing to read
    assert reads == [] and [s.rows for s in specs] == [N] * 4
    fixed.close()


# -- DataLoader workers ------------------------------------------------------------------------


def _as_lists(batch):
    return batch


def _canonical(batches):
    """Batches (dicts of batched columns) as plain python values, for comparison."""
    return [{k: _canonical_value(v) for k, v in batch.items()} for batch in batches]


FIXED = ["i32", "vec", "text", "f16", "b"]  # default_collate stacks these
VARYING = ["tokens", "blob", "scores"]  # rows of varying length stay lists


def _collate_mixed(samples):
    batch = default_collate([{k: s[k] for k in FIXED} for s in samples])
    batch.update({k: [s[k] for s in samples] for k in VARYING})
    return batch


@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_batches_equal_the_source(pq_file, table, method):
    ds = ParquetDataset(pq_file, FIXED + VARYING)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=method, collate_fn=_collate_mixed
    )
    dtypes = {"i32": torch.int32, "vec": torch.float32, "f16": torch.float16, "b": torch.bool}
    rows = []
    for values in zip(*(_expected(table)[c] for c in ds.columns)):
        row = dict(zip(ds.columns, values))
        row.update({k: torch.tensor(row[k], dtype=d) for k, d in dtypes.items()})
        row["tokens"] = torch.tensor(row["tokens"], dtype=torch.int32)
        row["scores"] = torch.tensor(row["scores"], dtype=torch.float64)
        rows.append(row)
    expected = [_collate_mixed(rows[i : i + 4]) for i in range(0, N, 4)]
    got = list(loader)
    assert _canonical(got) == _canonical(expected)
    for g, e in zip(got, expected):
        for k, d in dtypes.items():
            assert g[k].dtype == d and g[k].shape == e[k].shape
        assert all(t.dtype == torch.int32 for t in g["tokens"])


def _canonical_value(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return _plain(value)


def test_pickled_size_does_not_grow_with_rows(tmp_path):
    sizes = []
    for rows in (10, 100_000):
        table = pa.table(
            {"x": np.arange(rows), "s": [str(i) for i in range(rows)], "l": [[1, 2]] * rows}
        )
        ds = ArrowDataset(table)
        sizes.append(len(pickle.dumps(ds)))
        back = pickle.loads(pickle.dumps(ds))
        assert len(back) == rows and back[rows - 1]["s"] == str(rows - 1)
    assert sizes[1] < 3000 and abs(sizes[1] - sizes[0]) < 64


def test_verify_passes_with_string_and_ragged_columns_under_spawn(tmp_path):
    # ~96 MiB in 3072 rows of ~16 KiB of text and ~4096 int32 tokens. Few large rows keep
    # the epoch short: every ragged row leaves a worker as its own tensor (one storage each).
    # Not smaller: receiving large str batches grows the main process by 1-6 MiB (seen
    # with any str column, run to run), which alone reads as ~1.09x over 64 MiB.
    rows = 3072
    rng = np.random.default_rng(1)
    lengths = rng.integers(3072, 5120, rows)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32))
    )
    text = pa.array([chr(97 + i % 26) * int(k * 4) for i, k in enumerate(lengths)])
    pq.write_table(pa.table({"tokens": tokens, "text": text}), tmp_path / "v.parquet")
    del tokens, text
    pa.default_memory_pool().release_unused()
    ds = ParquetDataset(tmp_path / "v.parquet")
    assert 90 << 20 < ds.nbytes < 100 << 20
    loader = DataLoader(
        ds, batch_size=8, num_workers=2, multiprocessing_context="spawn", collate_fn=_as_lists
    )
    report = sd.verify(loader, max_duplication=1.10)
    assert report.duplication <= 1.10
    assert len(report.processes) == 3


# -- errors ------------------------------------------------------------------------------------


def test_missing_file_folder_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet") as info:
        ParquetDataset(tmp_path / "nope.parquet")
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(FileNotFoundError, match="no .parquet files"):
        ParquetDataset(tmp_path)
    pq.write_table(pa.table({"a": [1]}), tmp_path / "ok.parquet")
    with pytest.raises(FileNotFoundError, match="gone.parquet"):
        ParquetDataset([tmp_path / "ok.parquet", tmp_path / "gone.parquet"])
    with pytest.raises(FileNotFoundError, match="empty"):
        ParquetDataset([])
    with pytest.raises(TypeError, match="ArrowDataset"):
        ParquetDataset(pa.table({"a": [1]}))


def test_path_and_columns_of_a_wrong_type_are_argument_type_errors(pq_file):
    for path, seen in ((5, r"path=5 \(type int\)"), ([pq_file, 5], r"holds 5 \(type int\)")):
        with pytest.raises(TypeError, match=seen) as info:
            ParquetDataset(path)
        assert isinstance(info.value, sd.ArgumentTypeError)
    with pytest.raises(TypeError, match=r"columns=5 \(type int\) for .*data\.parquet") as info:
        ParquetDataset(pq_file, columns=5)
    assert isinstance(info.value, sd.ArgumentTypeError) and "columns=None" in str(info.value)


def test_missing_column_lists_what_exists(pq_file, table):
    with pytest.raises(KeyError, match=r"'nope' is not in .*data\.parquet.*'i32', 'i64'") as info:
        ParquetDataset(pq_file, ["i32", "nope"])
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(KeyError, match="'nope' is not in the Arrow table"):
        ArrowDataset(table, columns=["nope"])


@pytest.mark.parametrize(
    "column, hint",
    [
        (pa.array([[(1, 2)]] * 3, pa.map_(pa.int64(), pa.int64())), "map_keys"),
        (pa.array([[[(1, 2)]]] * 3, pa.list_(pa.map_(pa.int64(), pa.int64()))), "elements hold"),
        (pa.array([1, 2, 3], pa.decimal128(5, 2)), "float64"),
        (pa.array([None, None, None]), "only nulls"),
    ],
    ids=["map", "list-of-maps", "decimal", "null"],
)
def test_unsupported_types_name_file_column_type_and_fix(tmp_path, column, hint):
    table = pa.table({"ok": [1, 2, 3], "bad": column})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(TypeError, match=hint) as info:
        ParquetDataset(tmp_path / "t.parquet")
    message = str(info.value)
    kind = str(column.type).split("<")[0].split("(")[0]  # Parquet renames list items
    assert "'bad'" in message and "t.parquet" in message and f"Arrow type {kind}" in message
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(TypeError, match=hint):
        ArrowDataset(table)
    assert len(ParquetDataset(tmp_path / "t.parquet", ["ok"])) == 3  # the others still load


def test_files_with_different_schemas_name_both_files(tmp_path):
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"a": ["1.5", "2"], "b": ["x", "y"]}), tmp_path / "2.parquet")
    with pytest.raises(TypeError, match=r"'a' is string in .*2\.parquet but int64 in .*1\.parquet"):
        ParquetDataset(tmp_path)
    assert len(ParquetDataset(tmp_path, ["b"])) == 4
    pq.write_table(pa.table({"a": [1], "c": [3]}), tmp_path / "3.parquet")
    with pytest.raises(KeyError, match=r"3\.parquet and .*1\.parquet have different columns"):
        ParquetDataset([tmp_path / "1.parquet", tmp_path / "3.parquet"])
    with pytest.raises(KeyError, match=r"'b' is in .*1\.parquet but not in .*3\.parquet"):
        ParquetDataset([tmp_path / "1.parquet", tmp_path / "3.parquet"], ["b"])


def test_a_value_the_promoted_type_cannot_hold_names_column_files_types_and_value(tmp_path):
    ints, floats = tmp_path / "ints.parquet", tmp_path / "floats.parquet"
    pq.write_table(pa.table({"a": np.array([2**53 + 1, 2, 3]), "b": [1, 2, 3]}), ints)
    pq.write_table(pa.table({"a": [0.5, 1.5, 2.5], "b": [4, 5, 6]}), floats)
    seen = rf"'a' is int64 in .*ints\.parquet but double in .*floats\.parquet.*value {2**53 + 1}"
    for files in ([ints, floats], [floats, ints]):
        with pytest.raises(TypeError, match=seen) as info:
            ParquetDataset(files, progress=False)
        assert isinstance(info.value, sd.UnsupportedDtypeError)
        assert "re-create" not in str(info.value) and "columns=[...]" in str(info.value)
    assert len(ParquetDataset([ints, floats], ["b"], progress=False)) == 6


def test_truncated_and_garbage_files_name_the_file(tmp_path, pq_file):
    data = pq_file.read_bytes()
    (tmp_path / "trunc.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 50)
    # a valid footer over a damaged body: found while reading, not at open
    middle = len(data) // 3
    (tmp_path / "body.parquet").write_bytes(data[:middle] + b"\xff" * 2000 + data[middle + 2000 :])
    for name in ("trunc", "junk", "body"):
        with pytest.raises(OSError, match=rf"{name}\.parquet") as info:
            ParquetDataset(tmp_path / f"{name}.parquet")
        assert isinstance(info.value, sd.SourceReadError)
    gc.collect()


def test_pyarrow_missing_says_how_to_install(monkeypatch, pq_file):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'torch-shareddata\[parquet\]'") as info:
        ParquetDataset(pq_file)
    assert isinstance(info.value, sd.MissingDependencyError)
    with pytest.raises(ImportError, match="pyarrow"):
        ArrowDataset(object())


def test_import_shareddata_does_not_import_pyarrow():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pyarrow"] = None  # as if it were not installed
        import shareddata, shareddata.sources.parquet as p
        assert "pyarrow.parquet" not in sys.modules
        try:
            shareddata.ParquetDataset("x.parquet")
        except ImportError as e:
            print("OK", e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout and "torch-shareddata[parquet]" in proc.stdout


def test_not_a_table(table):
    with pytest.raises(TypeError, match="pa.table"):
        ArrowDataset({"a": [1, 2]})

    class Producer:  # anything exporting an Arrow stream (polars, pandas >= 2.2)
        def __arrow_c_stream__(self, requested_schema=None):
            return table.__arrow_c_stream__(requested_schema)

    assert len(ArrowDataset(Producer())) == N


def test_duplicate_column_names():
    table = pa.table([pa.array([1]), pa.array([2]), pa.array([3])], names=["a", "a", "b"])
    with pytest.raises(KeyError, match="'a' appears more than once"):
        ArrowDataset(table)
    assert ArrowDataset(table, columns=["b"])[0]["b"].item() == 3


# -- nulls -------------------------------------------------------------------------------------


def _null_table():
    return pa.table(
        {
            "i": pa.array([1, None, 3, None], pa.int32()),
            "f": pa.array([1.5, None, None, 4.0], pa.float32()),
            "s": pa.array(["a", None, "", "d"]),
            "bin": pa.array([b"a", None, b"c", None]),
            "l": pa.array([[1, None], None, [], [4]], pa.list_(pa.int64())),
            "v": pa.FixedSizeListArray.from_arrays(
                pa.array([1, 2, None, 4, 5, 6, 7, 8], pa.int16()),
                2,
                mask=pa.array([False, False, True, False]),
            ),
            "ok": pa.array([1, 2, 3, 4]),
        }
    )


def test_nulls_are_refused_naming_file_column_and_count(tmp_path):
    table = _null_table()
    pq.write_table(table.slice(0, 2), tmp_path / "a.parquet")
    pq.write_table(table.slice(2), tmp_path / "b.parquet")
    expected = {"i": 2, "f": 2, "s": 1, "bin": 2, "l": 2, "v": 3}
    for name, count in expected.items():
        with pytest.raises(ValueError, match="fill_value") as info:
            ParquetDataset(tmp_path, [name, "ok"])
        message = str(info.value)
        assert isinstance(info.value, sd.NullValuesError)
        assert f"column {name!r}" in message and f"{count} null value" in message, message
        assert "a.parquet" in message or "b.parquet" in message
        with pytest.raises(ValueError, match=f"{count} null value"):
            ArrowDataset(table, columns=[name])
    assert ParquetDataset(tmp_path, ["ok"])[3]["ok"].item() == 4


def test_fill_values_scalar_and_per_column(tmp_path):
    table = _null_table()
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=3)
    for ds in (
        ParquetDataset(tmp_path / "n.parquet", fill_value=0),
        ArrowDataset(table, fill_value=0),
    ):
        assert [ds[i]["i"].item() for i in range(4)] == [1, 0, 3, 0]
        assert ds[0]["i"].dtype == torch.int32
        assert [ds[i]["f"].item() for i in range(4)] == [1.5, 0.0, 0.0, 4.0]
        assert [ds[i]["s"] for i in range(4)] == ["a", "", "", "d"]  # a number: strings empty
        assert [ds[i]["bin"] for i in range(4)] == [b"a", b"", b"c", b""]
        assert [ds[i]["l"].tolist() for i in range(4)] == [[1, 0], [], [], [4]]
        assert [ds[i]["v"].tolist() for i in range(4)] == [[1, 2], [0, 4], [0, 0], [7, 8]]
    ds = ArrowDataset(
        table,
        fill_value={"i": -1, "f": float("nan"), "s": "?", "bin": "none", "l": 9, "v": 7},
    )
    assert ds[1]["i"].item() == -1 and np.isnan(ds[1]["f"].item())
    assert ds[1]["s"] == "?" and ds[1]["bin"] == b"none"
    assert ds[0]["l"].tolist() == [1, 9] and ds[1]["l"].tolist() == []
    assert ds[2]["v"].tolist() == [7, 7] and ds[1]["v"].tolist() == [7, 4]
    with pytest.raises(ValueError, match="'i'"):  # a dict covers only the columns it names
        ArrowDataset(table, fill_value={"f": 0.0})


def test_bad_fill_values(tmp_path):
    table = _null_table()
    with pytest.raises(TypeError, match="int32 can hold"):
        ArrowDataset(table, columns=["i"], fill_value=1.5)
    with pytest.raises(TypeError, match="int32 can hold"):
        ArrowDataset(table, columns=["i"], fill_value=2**40)
    with pytest.raises(TypeError, match="'s'.*give a str"):
        ArrowDataset(table, columns=["s"], fill_value={"s": 0})
    with pytest.raises(TypeError, match="'i'"):
        ArrowDataset(table, columns=["i"], fill_value="")
    with pytest.raises(KeyError, match="'zz'.*'i'"):
        ArrowDataset(table, columns=["i"], fill_value={"zz": 0})
    pq.write_table(table, tmp_path / "n.parquet")
    with pytest.raises(TypeError, match="int32 can hold"):
        ParquetDataset(tmp_path / "n.parquet", ["i"], fill_value=0.5)
    assert ArrowDataset(table, columns=["ok"], fill_value="x")[0]["ok"].item() == 1  # unused


# -- failures and offsets ----------------------------------------------------------------------


def test_failure_halfway_propagates_and_frees_everything(pq_file, monkeypatch):
    ParquetDataset(pq_file)  # warm up imports / caches that hold descriptors
    gc.collect()
    fds = open_fds()
    calls = []
    original = ArrowSource.read

    def failing_read(self, spec, buffers, progress):
        calls.append(spec.name)
        if len(calls) == 2:
            raise RuntimeError("disk went away")
        original(self, spec, buffers, progress)

    monkeypatch.setattr(ArrowSource, "read", failing_read)
    with pytest.raises(RuntimeError, match="disk went away"):
        ParquetDataset(pq_file, ["text", "tokens", "i32"])
    gc.collect()
    assert calls == ["text", "tokens"]
    assert open_fds() == fds


def test_a_file_changed_between_sizing_and_reading(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"s": ["ab", "cd"]}), path)
    source = parquet_source(path)
    try:
        (spec,) = source.specs()
        pq.write_table(pa.table({"s": ["abc", "cd"]}), path)  # one more byte
        buffers = {"offsets": np.zeros(3, np.int64), "values": np.zeros(spec.values, np.uint8)}
        buffers = {k: as_buffer(b) for k, b in buffers.items()}
        with pytest.raises(OSError, match="changed"):
            source.read(spec, buffers, lambda n: None)
    finally:
        source.close()


def test_rebase_offsets_beyond_int32():
    base = 3 * 2**31  # far past what int32 offsets can express
    src = np.array([2**31 - 100, 2**31 - 60, 2**31 - 60, 2**31 - 1], np.int32)
    out = np.zeros(3, np.int64)
    end = rebase_offsets(src, base, out)
    assert out.tolist() == [base + 40, base + 40, base + 99]
    assert end == base + 99
    # chunks chained one after another give one increasing int64 column
    column = np.zeros(7, np.int64)
    total = rebase_offsets(np.array([0, 2**31 - 1], np.int32), 0, column[1:2])
    total = rebase_offsets(np.array([10, 2**31 - 1, 2**31 - 1], np.int32), total, column[2:4])
    total = rebase_offsets(np.array([0, 5, 9, 12], np.int64), total, column[4:7])
    assert np.all(np.diff(column) >= 0) and column[-1] == total
    assert total == (2**31 - 1) + (2**31 - 11) + 12
    assert rebase_offsets(np.array([4], np.int32), 17, np.zeros(0, np.int64)) == 17


def test_writer_rebases_chunks_onto_a_large_running_total():
    # a string chunk written when 3 GiB of values are already in the column
    column = ArrowColumn("s", pa.string(), "t", None)
    spec = sd.columns._columns.ColumnSpec("s", 2, np.dtype(np.uint8), (), "str", 5)
    buffers = {"offsets": np.zeros(3, np.int64), "values": np.zeros(5, np.uint8)}
    writer = Writer(column, spec, {k: as_buffer(b) for k, b in buffers.items()})
    writer.write(pa.array(["ab", "cde"]).slice(0), "t")
    assert buffers["offsets"].tolist() == [0, 2, 5]
    assert bytes(buffers["values"]) == b"abcde"


def test_arrow_memory_goes_back_after_a_load(tmp_path):
    """The loading process ends close to where it started (Arrow's pool is released)."""
    code = textwrap.dedent(
        f"""
        import gc, numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from shareddata import ParquetDataset

        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon"):
                    return int(line.split()[1]) << 10

        rows = 1 << 16
        rng = np.random.default_rng(0)
        table = pa.table({{
            "x": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(rows * 128).astype(np.float32)), 128),
            "s": pa.array([str(i) * 20 for i in range(rows)]),
            "l": pa.array([list(range(i % 64)) for i in range(rows)], pa.list_(pa.int32())),
        }})
        pq.write_table(table, {str(tmp_path / "m.parquet")!r}, row_group_size=8192)
        del table
        gc.collect()
        pa.default_memory_pool().release_unused()
        before = anon()
        ds = ParquetDataset({str(tmp_path / "m.parquet")!r})
        gc.collect()
        print(ds.nbytes >> 20, (anon() - before) >> 20)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data_mib, grown_mib = map(int, proc.stdout.split())
    assert data_mib >= 40
    assert grown_mib < 12, f"loading {data_mib} MiB left {grown_mib} MiB of private memory"


def test_row_groups_are_decoded_in_bounded_batches(tmp_path, monkeypatch):
    # one row group of 2000 rows: each column arrives in batches of ~_BATCH_BYTES
    rows = 2000
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, 8))
    text = [f"row {i} " * (i % 7) for i in range(rows)]
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 8),
            "text": text,
            "n": pa.array(np.arange(rows, dtype=np.int16)),
        }
    )
    path = tmp_path / "one_group.parquet"
    pq.write_table(table, path, row_group_size=rows)
    monkeypatch.setattr(sp, "_BATCH_BYTES", 6400)  # 100 rows of x
    chunks = []
    real = Writer.write

    def write(self, arr, where):
        chunks.append((self.spec.name, len(arr)))
        return real(self, arr, where)

    monkeypatch.setattr(Writer, "write", write)
    ds = ParquetDataset(path)
    x_chunks = [n for name, n in chunks if name == "x"]
    assert sum(x_chunks) == rows and max(x_chunks) <= 110 and len(x_chunks) >= 18
    assert max(n for name, n in chunks if name == "n") <= 6400 // 2 + 100
    batch = ds[:]
    np.testing.assert_array_equal(batch["x"].numpy(), x)
    assert batch["text"] == text
    assert batch["n"].tolist() == list(range(rows))


def test_build_with_an_arrow_source_directly(table):
    columns = build(ArrowSource(TableInput(table), ["text", "i32"]), progress=False)
    assert list(columns) == ["text", "i32"]
    assert columns["text"].get(1) == table["text"][1].as_py()


def test_arrow_tables_are_told_apart_across_ranks():
    # Under torchrun ranks match datasets by a fingerprint of their arguments; every
    # ArrowDataset has the same label, so the key must come from the table itself.
    from shareddata.distributed import fingerprint

    def key(table):
        return fingerprint(TableInput(table).key(table.column_names))

    a = pa.table({"x": list(range(1000)), "s": [str(i) for i in range(1000)]})
    assert key(a) == key(pa.table({"x": list(range(1000)), "s": [str(i) for i in range(1000)]}))
    assert key(a) != key(a.set_column(0, "x", pa.array(list(range(1, 1001)))))
    assert key(a) != key(a.select(["x"]))


def test_invalid_utf8_in_a_string_column_is_refused_naming_file_and_column(tmp_path):
    # Parquet readers do not check UTF-8: without the check, the load succeeded and a
    # later ds[i] raised a UnicodeDecodeError that named nothing (found by fuzzing)
    text = pa.array([b"ok", b"caf\xc3\xa9", b"bad \xbc byte"], pa.binary()).view(pa.string())
    path = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": text, "n": [1, 2, 3]}), path)
    with pytest.raises(sd.SourceReadError, match=r"text\.parquet.*'text'.*not UTF-8") as info:
        ParquetDataset(path, progress=False)
    assert "binary" in str(info.value)
    assert ParquetDataset(path, columns=["n"], progress=False)[2]["n"].item() == 3


def test_select_rows_reads_a_range_across_files_and_row_groups(tmp_path):
    """What shard="node" loads: rows [start, stop) of the files together, any cut."""
    from shareddata.datasets._dataset import ColumnDataset

    n = 1000
    table = pa.table(
        {
            "i": np.arange(n),
            "s": [f"r{i}" for i in range(n)],
            "l": pa.array([[i] * (i % 3) for i in range(n)]),
            "st": pa.array([{"a": i, "b": str(i)} for i in range(n)]),
        }
    )
    pq.write_table(table.slice(0, 400), tmp_path / "a.parquet", row_group_size=70)
    pq.write_table(table.slice(400), tmp_path / "b.parquet", row_group_size=130)
    full = table.to_pylist()
    for start, stop in [(0, 333), (333, 666), (666, 1000), (399, 401), (999, 1000)]:
        source = parquet_source(tmp_path)
        assert source.total_rows() == n
        source.select_rows(start, stop)
        ds = ColumnDataset(build(source, share="process", progress=False))
        assert len(ds) == stop - start
        for k in range(stop - start):
            got, want = ds[k], full[start + k]
            assert int(got["i"]) == want["i"] and got["s"] == want["s"]
            assert got["l"].tolist() == want["l"]
            assert (int(got["st.a"]), got["st.b"]) == (want["st"]["a"], want["st"]["b"])
