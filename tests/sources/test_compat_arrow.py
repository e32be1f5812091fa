"""Compatibility: Parquet and Arrow data written by other tools (polars, duckdb, HF datasets).

Every file is generated here by the tool itself. For each file and column, the column
loads with every value equal to what the reference reader returns (pyarrow for
Parquet, the tool's own Arrow table otherwise; lists of numbers compared as lists,
temporal values as their integer storage), or it is refused with
``UnsupportedDtypeError`` naming the column. ``python tests/sources/test_compat_arrow.py``
prints the per-file, per-column table.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_arrow import plain, reference, rows_of  # noqa: E402

import shareddata as sd  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "日本語 🙂"}],
    [],
    [{"role": "user", "content": "x" * 40}],
    None,
]


def _polars_frame():
    pl = pytest.importorskip("polars")
    from datetime import date, datetime, timedelta
    from decimal import Decimal

    turn = pl.Struct({"role": pl.String, "content": pl.String})
    return pl.DataFrame(
        {
            "id": [1, 2, 3, 4],
            "text": ["a", "", "a long string " * 3, None],
            "meta": [{"lang": "en", "n": 1}, {"lang": "fr", "n": 2}, None, {"lang": None, "n": 4}],
            "messages": pl.Series(CONVERSATIONS, dtype=pl.List(turn)),
            "tags": [["a", "b"], [], ["c"], None],
            "grid": [[[1.0], []], [], [[2.0, 3.0]], [[4.0]]],
            "category": pl.Series(["x", "y", "x", None], dtype=pl.Categorical),
            "enum": pl.Series(["lo", "hi", "lo", "hi"], dtype=pl.Enum(["lo", "hi"])),
            "ts": [datetime(2024, 1, 1), datetime(1970, 1, 1), datetime(2000, 2, 29, 1), None],
            "ts_tz": pl.Series(
                [datetime(2024, 1, 1), datetime(2024, 6, 1), datetime(2024, 1, 2), None]
            ).dt.replace_time_zone("Europe/Paris"),
            "day": [date(2024, 1, 1), date(1969, 12, 31), date(2000, 1, 1), None],
            "dur": [timedelta(seconds=1), timedelta(0), timedelta(days=-1), None],
            "price": pl.Series(
                [Decimal("1.25"), Decimal("0"), None, Decimal("-3.5")], dtype=pl.Decimal(10, 2)
            ),  # fmt: skip
            "vec": pl.Series([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=pl.Array(pl.Int16, 2)),
        }
    )


def _duckdb_sql():
    return """
        SELECT * FROM (VALUES
          (1, 'a', {'lang': 'en', 'n': 1}, [{'role': 'user', 'content': 'héllo'}],
           ['a', 'b'], TIMESTAMP '2024-01-01 10:00:00', TIMESTAMPTZ '2024-01-01 10:00:00+00',
           DATE '2024-01-01', 1.25::DECIMAL(10, 2), 'lo'::ENUM_T, MAP {'k': 1},
           '00000000-0000-0000-0000-000000000001'::UUID,
           170141183460469231731687303715884105727::HUGEINT,
           INTERVAL 1 DAY, [[1.5::DOUBLE], []]),
          (2, repeat('long ', 20), {'lang': NULL, 'n': 2}, [],
           [], TIMESTAMP '1970-01-01 00:00:00', TIMESTAMPTZ '1999-12-31 23:59:59+00',
           DATE '1969-12-31', 0::DECIMAL(10, 2), 'hi'::ENUM_T, MAP {'j': 2},
           '00000000-0000-0000-0000-000000000002'::UUID, 0::HUGEINT,
           INTERVAL 2 HOUR, [[2.5::DOUBLE]])
        ) t(id, text, meta, messages, tags, ts, ts_tz, day, price, enum, kv, uid, huge, span, grid)
    """


def _duckdb():
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.execute("CREATE TYPE ENUM_T AS ENUM ('lo', 'hi')")
    return con


def _outcome(make, column):
    """'pass', or 'refused: <reason>' for one column; anything else fails the test."""
    try:
        ds = make(column)
    except sd.UnsupportedDtypeError as e:
        assert _names(column, e), str(e)
        return "refused: " + str(e).split("Fix: ")[-1].split(";")[0][:70]
    except sd.NullValuesError as e:
        assert _names(column, e), str(e)
        return "nulls"
    return ds


def _names(column, error):
    """The message names the column, or (for a struct) one of its fields."""
    return repr(column) in str(error) or f"'{column}." in str(error)


def _check_columns(name, make_dataset, want_table, table_rows):
    """Each column of ``want_table`` alone: equal to the reference, or refused by name."""
    results = {}
    for column in want_table.column_names:
        ds = _outcome(lambda c: make_dataset([c], None), column)
        if ds == "nulls":  # refused without a fill value: load with one, then compare
            ds = _outcome(lambda c: make_dataset([c], 0), column)
            filled = True
        else:
            filled = False
        if isinstance(ds, str):
            results[column] = ds
            continue
        want = reference(want_table.select([column]))
        got = rows_of(ds)
        gathered = [{k: plain(v) for k, v in s.items()} for s in ds.__getitems__(range(len(ds)))]
        assert gathered == got, (name, column)
        if filled:
            want = [_fill_like(w, g) for w, g in zip(want, got)]
        assert got == want, (name, column, got, want)
        results[column] = "pass" + (" (nulls filled)" if filled else "")
    table_rows.extend((name, c, r) for c, r in results.items())
    return results


def _fill_like(want, got):
    """``want`` with its nulls replaced by what ``fill_value=0`` puts there in ``got``."""
    if want is None:
        return got
    if isinstance(want, dict):
        return {k: _fill_like(v, got[k]) for k, v in want.items()}
    if isinstance(want, list):
        return [_fill_like(w, g) for w, g in zip(want, got)] if len(want) == len(got) else want
    return want


def polars_parquet(tmp, rows):
    df = _polars_frame()
    path = os.path.join(tmp, "polars.parquet")
    df.write_parquet(path, row_group_size=2)
    table = pq.read_table(path)
    make = lambda cols, fill: sd.ParquetDataset(path, cols, fill_value=fill, progress=False)  # noqa: E731
    return _check_columns("polars.parquet", make, table, rows)


def polars_frame(tmp, rows):
    df = _polars_frame()
    table = pa.table(df)  # the reference: polars' own Arrow export (views, categoricals)
    make = lambda cols, fill: sd.ArrowDataset(df, columns=cols, fill_value=fill, progress=False)  # noqa: E731
    return _check_columns("polars DataFrame", make, table, rows)


def duckdb_parquet(tmp, rows):
    con = _duckdb()
    path = os.path.join(tmp, "duckdb.parquet")
    con.execute(f"COPY ({_duckdb_sql()}) TO '{path}' (FORMAT PARQUET, ROW_GROUP_SIZE 1)")
    table = pq.read_table(path, arrow_extensions_enabled=True)  # UUID as uuid.UUID
    make = lambda cols, fill: sd.ParquetDataset(path, cols, fill_value=fill, progress=False)  # noqa: E731
    return _check_columns("duckdb.parquet", make, table, rows)


def duckdb_relation(tmp, rows):
    con = _duckdb()
    table = con.sql(_duckdb_sql()).to_arrow_table()
    make = lambda cols, fill: sd.ArrowDataset(  # noqa: E731
        con.sql(_duckdb_sql()), columns=cols, fill_value=fill, progress=False
    )
    return _check_columns("duckdb relation", make, table, rows)


def hf_datasets(tmp, rows):
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict(
        {
            "messages": [c or [] for c in CONVERSATIONS],
            "label": [0, 1, 1, 0],
            "tokens": [[1, 2], [], [3], [4, 5, 6]],
            "text": ["a", "b", "", "é"],
            "image": [{"bytes": b"\x89PNG", "path": None}] * 4,
        },
        features=datasets.Features(
            {
                "messages": datasets.List(
                    {"role": datasets.Value("string"), "content": datasets.Value("string")}
                ),  # fmt: skip
                "label": datasets.ClassLabel(names=["neg", "pos"]),
                "tokens": datasets.List(datasets.Value("int32")),
                "text": datasets.Value("large_string"),
                "image": datasets.Image(),
            }
        ),
    )
    folder = os.path.join(tmp, "hf")
    hf.save_to_disk(folder)
    loaded = datasets.load_from_disk(folder).shuffle(seed=0)  # an indices mapping too
    table = loaded.with_format("arrow")[:]
    make = lambda cols, fill: sd.ArrowDataset(loaded, columns=cols, fill_value=fill,  # noqa: E731
                                              progress=False)  # fmt: skip
    return _check_columns("HF datasets (save_to_disk, shuffled)", make, table, rows)


def _expected_refusals(results, refused):
    for column, outcome in results.items():
        if column in refused:
            assert outcome.startswith("refused"), (column, outcome)
        else:
            assert outcome.startswith("pass"), (column, outcome)


def test_polars_parquet_and_frame(tmp_path):
    rows = []
    _expected_refusals(polars_parquet(str(tmp_path), rows), {"price"})
    _expected_refusals(polars_frame(str(tmp_path), rows), {"price"})


def test_duckdb_parquet_and_relation(tmp_path):
    rows = []
    # decimal and map refused; duckdb writes HUGEINT to Parquet as a double and INTERVAL
    # as 12 bytes (both load), but exports them to Arrow as decimal128(38) and
    # month_day_nano_interval (both refused)
    _expected_refusals(duckdb_parquet(str(tmp_path), rows), {"price", "kv"})
    _expected_refusals(duckdb_relation(str(tmp_path), rows), {"price", "kv", "huge", "span"})


def test_hf_datasets_arrow_files(tmp_path):
    _expected_refusals(hf_datasets(str(tmp_path), []), set())


# -- an HF dataset's format (with_format / set_format / with_transform) is kept -------------


def _hf_tokenized():
    datasets = pytest.importorskip("datasets")
    rows = 6
    return datasets.Dataset.from_dict(
        {
            "text": [f"sentence {i}" for i in range(rows)],
            "input_ids": pa.array([[101, i, 102] for i in range(rows)], pa.list_(pa.int32())),
            "attention_mask": pa.array([[1, 1, 1]] * rows, pa.list_(pa.int8())),
            "label": pa.array([i % 2 for i in range(rows)], pa.int16()),
            "score": pa.array([i / 3 for i in range(rows)], pa.float64()),
            "flag": [i % 3 == 0 for i in range(rows)],
        }
    )


def _same_as_hf(ds, hf):
    """Every item of ``ds`` has the keys, dtypes and values of the HF dataset's item."""
    import torch

    assert len(ds) == len(hf)
    for i in range(len(hf)):
        got, want = ds[i], hf[i]
        assert list(got) == list(want), i
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert isinstance(got[k], torch.Tensor) and got[k].dtype == v.dtype, (k, got[k])
                assert torch.equal(got[k], v), (k, got[k], v)
            else:  # a column outside the format: the value, as shareddata gives it
                assert plain(got[k]) == v, (k, got[k], v)


def test_hf_torch_format_keeps_its_columns_and_dtypes(tmp_path):
    datasets = pytest.importorskip("datasets")
    hf = _hf_tokenized()
    for formatted in (
        hf.with_format("torch", columns=["input_ids", "label"]),
        hf.with_format("torch"),  # every column: integers int64, floats float32
        hf.with_format("torch", columns=["attention_mask", "score"], output_all_columns=True),
        hf.shuffle(seed=3).with_format("torch", columns=["flag", "input_ids"]),
    ):
        _same_as_hf(sd.ArrowDataset(formatted, progress=False), formatted)
    # a save_to_disk folder keeps the format it was saved with, as load_from_disk does
    hf.with_format("torch", columns=["input_ids", "score"]).save_to_disk(tmp_path / "saved")
    saved = datasets.load_from_disk(str(tmp_path / "saved"))
    _same_as_hf(sd.ArrowDataset(tmp_path / "saved", progress=False), saved)
    explicit = sd.ArrowDataset(hf.with_format("torch"), columns=["label"], progress=False)
    assert list(explicit[0]) == ["label"] and explicit[0]["label"].dtype.is_floating_point is False
    assert explicit[0]["label"].dtype == hf.with_format("torch")[0]["label"].dtype


def test_hf_numpy_and_python_formats_keep_their_columns_and_stored_dtypes():
    import torch

    hf = _hf_tokenized()
    for fmt in ("numpy", None):
        formatted = hf.with_format(fmt, columns=["label", "text"])
        ds = sd.ArrowDataset(formatted, progress=False)
        assert list(ds[1]) == list(formatted[1]) == ["text", "label"]
        assert ds[1]["text"] == "sentence 1"
        assert ds[1]["label"].dtype == torch.int16


def _hf_upper(batch):
    return {"text": [t.upper() for t in batch["text"]], "n": [len(ids) for ids in batch["ids"]]}


def test_hf_with_transform_is_applied_in_the_workers_as_hf_applies_it():
    import torch

    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"text": ["ab", "c", "def"], "ids": [[1, 2], [3], []]})
    transformed = hf.with_transform(_hf_upper)
    ds = sd.ArrowDataset(transformed, progress=False)
    assert [ds[i] for i in range(3)] == [transformed[i] for i in range(3)]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")  # fmt: skip
    assert list(loader) == [transformed[i] for i in range(3)]
    # a transform= given too runs after it; output_all_columns adds the other columns
    after = sd.ArrowDataset(transformed, transform=lambda s: s["n"], progress=False)
    assert [after[i] for i in range(3)] == [2, 1, 0]
    partial = hf.with_transform(lambda b: {"text": b["text"][::-1]}, columns=["text"],
                                output_all_columns=True)  # fmt: skip
    got = sd.ArrowDataset(partial, progress=False)[0]
    assert got["text"] == partial[0]["text"] and got["ids"].tolist() == partial[0]["ids"]


def test_hf_formats_that_cannot_be_kept_are_refused_by_name():
    hf = _hf_tokenized()
    for fmt, name in ((hf.with_format("pandas"), "'pandas'"),
                      (hf.with_format("torch", dtype="float16"), "dtype=")):  # fmt: skip
        with pytest.raises(sd.InvalidArgumentError, match=rf"format.*{name}.*transform="):
            sd.ArrowDataset(fmt, progress=False)
    with pytest.raises(ValueError, match=r"output='tuple'.*with_transform.*transform="):
        sd.ArrowDataset(hf.with_transform(_hf_upper), output="tuple", progress=False)


def test_timestamps_with_nanoseconds_load_from_a_table_as_from_parquet(tmp_path):
    # without pandas, pyarrow has no value for a nanosecond (to_pylist raised ValueError)
    code = textwrap.dedent(
        f"""
        import sys

        class NoPandas:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pandas":
                    raise ModuleNotFoundError("No module named 'pandas'")

        sys.meta_path.insert(0, NoPandas())
        import pyarrow as pa, pyarrow.parquet as pq
        import shareddata as sd

        ns = pa.array([1, 1_000_000_001, None, -7], pa.timestamp("ns"))
        table = pa.table({{"t": ns, "t_tz": ns.cast(pa.timestamp("ns", "Europe/Paris")),
                          "d": ns.cast(pa.int64()).cast(pa.duration("ns"))}})
        pq.write_table(table, {str(tmp_path / "t.parquet")!r})
        for ds in (sd.ArrowDataset(table, fill_value=0, progress=False),
                   sd.ParquetDataset({str(tmp_path / "t.parquet")!r}, fill_value=0,
                                     progress=False)):
            print([{{k: v.item() for k, v in ds[i].items()}} for i in range(len(ds))])
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    from_table, from_parquet = proc.stdout.splitlines()
    assert from_table == from_parquet
    assert "'t': 1000000001" in from_table


if __name__ == "__main__":
    table: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in (polars_parquet, polars_frame, duckdb_parquet, duckdb_relation, hf_datasets):
            check(tmp, table)
    print("| file | column | outcome |\n|---|---|---|")
    for file, column, outcome in table:
        print(f"| {file} | {column} | {outcome} |")
