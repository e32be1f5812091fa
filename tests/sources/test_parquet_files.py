"""Hive-partitioned folders as polars and pyarrow write them: loaded as their readers read
them, or (a key also inside the files) refused naming the key and the fix, which works.
"""

import glob
import os

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

import shareddata as sd

ROWS = {"year": [2023, 2023, 2024, 2025, 2024], "id": [1, 2, 3, 4, 5],
        "text": ["a", "", "héllo", "d", "e"], "score": [0.5, 1.5, 2.5, 3.5, 4.5]}  # fmt: skip


def _rows(ds):
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in ds[i].items()}
            for i in range(len(ds))]  # fmt: skip


def _by_id(rows):
    return sorted(rows, key=lambda r: r["id"])


def test_a_polars_hive_folder_names_the_key_clash_and_the_fix_works(tmp_path):
    pl = pytest.importorskip("polars")
    folder = tmp_path / "pl"
    pl.DataFrame(ROWS).write_parquet(folder, partition_by="year")  # year also in the files
    assert "year" in pq.read_schema(glob.glob(str(folder / "*" / "*.parquet"))[0]).names
    for path in (folder, str(folder / "*" / "*.parquet")):
        with pytest.raises(sd.MissingColumnError) as info:
            sd.ParquetDataset(path, progress=False)
        message = str(info.value)
        assert "'year'" in message and "inside its files" in message, message
        assert "pass the files" in message and "include_key=False" in message, message
        assert "truncated" not in message
    # the fix the message gives: the files themselves (year read from inside them)
    files = sorted(glob.glob(str(folder / "**" / "*.parquet"), recursive=True))
    ds = sd.ParquetDataset(files, progress=False)
    want = pl.read_parquet(folder).to_dicts()  # polars' own reader of the folder
    assert _by_id(_rows(ds)) == _by_id(want)
    assert ds.columns == ["year", "id", "text", "score"]


def test_a_string_key_inside_the_files_is_named_too(tmp_path):
    # same type in the path and the files: pyarrow merges the schemas; still two columns
    for kind in ("a", "b"):
        part = tmp_path / f"kind={kind}"
        part.mkdir()
        pq.write_table(pa.table({"kind": [kind], "x": [1]}), part / "0.parquet")
    with pytest.raises(sd.MissingColumnError, match="partitioned by 'kind'.*inside its files"):
        sd.ParquetDataset(tmp_path, progress=False)


def test_hive_keys_only_in_the_path_load_as_columns_as_their_readers_give(tmp_path):
    pl = pytest.importorskip("polars")
    table = pa.table(ROWS)
    by_arrow = tmp_path / "arrow"
    pads.write_dataset(table, by_arrow, format="parquet", partitioning=["year"],
                       partitioning_flavor="hive")  # fmt: skip
    by_polars = tmp_path / "polars"
    pl.DataFrame(ROWS).write_parquet(pl.PartitionBy(by_polars, key="year", include_key=False))
    for folder, reader in (
        (by_arrow, lambda f: pads.dataset(f, partitioning="hive").to_table().to_pylist()),
        (by_polars, lambda f: pl.read_parquet(f, hive_partitioning=True).to_dicts()),
    ):
        ds = sd.ParquetDataset(folder, progress=False)
        assert ds.columns == ["id", "text", "score", "year"]  # keys after the files' columns
        assert _by_id(_rows(ds)) == _by_id(reader(folder)), folder
        assert sorted(os.listdir(folder)) == ["year=2023", "year=2024", "year=2025"]
        # folders are read in sorted order: the years come in order
        assert [r["year"] for r in _rows(ds)] == sorted(ROWS["year"])
