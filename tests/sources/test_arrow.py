"""Every Arrow layout read right or refused by name; structs, nested lists, many Parquet files.

Each case is compared against pyarrow's own reading (``to_pylist()``), with lists of
numbers compared as lists and temporal values as their integer storage.
"""

import decimal
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import ArrowDataset, ParquetDataset


def plain(value):
    """A loaded value as the Python value ``to_pylist()`` gives (tensors -> lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def rows_of(ds):
    return [{k: plain(v) for k, v in ds[i].items()} for i in range(len(ds))]


def reference(table):
    """pyarrow's rows of ``table``: structs flattened (``s.a``), times as integers, and
    extension types as their ``to_pylist()`` (``uuid.UUID``, bool, JSON text), a
    fixed-shape tensor as nested lists of its shape."""
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    cols = {}
    for name, col in zip(table.column_names, table.columns):
        if isinstance(col.type, pa.FixedShapeTensorType):  # rows of its shape
            cols[name] = pa.array([r for c in col.chunks if len(c)
                                   for r in c.to_numpy_ndarray().tolist()])  # fmt: skip
            continue
        t = col.type
        if pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_duration(t):
            col = col.cast(pa.int64())
        elif pa.types.is_date32(t):
            col = col.cast(pa.int32())
        cols[name] = col
    return pa.table(cols).to_pylist()


def _list_view_out_of_order():
    # offsets out of order and overlapping: rows [13, 14], [10], [11, 12], [11]
    return pa.ListViewArray.from_arrays(
        pa.array([3, 0, 1, 1], pa.int32()), pa.array([2, 1, 2, 1], pa.int32()),
        pa.array([10, 11, 12, 13, 14], pa.int64()),
    )  # fmt: skip


LONG = "a string longer than the twelve inline bytes of a view"
LAYOUTS = {
    "string_view": pa.array(["a", "", LONG, "x" * 13], pa.string_view()),
    "binary_view": pa.array([b"a", b"", LONG.encode(), b"\x00" * 13], pa.binary_view()),
    "string_view_sliced": pa.array(["zz", "a", LONG, "ccc", "q"], pa.string_view()).slice(1, 4),
    "large_string": pa.array(["a", "", LONG, "é"], pa.large_string()),
    "large_binary": pa.array([b"a", b"", b"\xff", b"xy"], pa.large_binary()),
    "large_list": pa.array([[1, 2], [], [3], [4, 5, 6]], pa.large_list(pa.int16())),
    "list_view": pa.array([[1, 2], [], [3], [4]], pa.list_view(pa.int32())),
    "list_view_out_of_order": _list_view_out_of_order(),
    "large_list_view": pa.array([[1.5], [], [2.5, 3.5], []], pa.large_list_view(pa.float32())),
    "run_end_encoded": pc.run_end_encode(pa.array([7, 7, 7, 9])),
    "run_end_encoded_strings": pc.run_end_encode(pa.array(["a", "a", LONG, "b"])),
    "dictionary_of_view": pa.DictionaryArray.from_arrays(
        pa.array([0, 1, 0, 1], pa.int32()), pa.array(["x", LONG], pa.string_view())
    ),
    "fixed_size_binary": pa.array([b"ab", b"cd", b"ef", b"gh"], pa.binary(2)),
    "timestamp_tz": pa.array([0, 1, 10**15, -5], pa.timestamp("us", tz="Europe/Paris")),
    "date32": pa.array([0, 1, 19000, -1], pa.date32()),
    "sliced_list": pa.array([[9], [1, 2], None, [3], [4]]).slice(1, 4).fill_null([]),
    "list_of_view_strings": pa.array([["a", LONG], [], ["b"], [""]], pa.list_(pa.string_view())),
    "list_of_large_lists": pa.array(
        [[[1.0], []], [], [[2.0, 3.0]], [[]]], pa.list_(pa.large_list(pa.float64()))
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_loads_equal_to_pyarrow(name):
    arr = LAYOUTS[name]
    table = pa.table({name: arr})
    chunked = pa.Table.from_batches(
        [table.to_batches()[0].slice(0, 1), table.slice(1).to_batches()[0]]
    )
    for t in (table, chunked):
        assert rows_of(ArrowDataset(t, progress=False)) == reference(t)


@pytest.mark.parametrize(
    "column, type_name, fix",
    [
        (pa.array([decimal.Decimal("1.25")] * 2, pa.decimal128(5, 2)), "decimal128", "float64"),
        (
            pa.UnionArray.from_dense(
                pa.array([0, 1], pa.int8()),
                pa.array([0, 0], pa.int32()),
                [pa.array([1]), pa.array(["a"])],
            ),
            "dense_union",
            "cast it",
        ),
        (pa.array([[[(1, 2)]], []], pa.list_(pa.map_(pa.int8(), pa.int8()))), "map", "elements"),
        (pa.array([None, None]), "null", "only nulls"),
    ],
    ids=["decimal", "union", "list-of-map", "null"],
)
def test_unstorable_types_are_refused_naming_column_type_and_fix(column, type_name, fix):
    with pytest.raises(sd.UnsupportedDtypeError, match=fix) as info:
        ArrowDataset(pa.table({"ok": [1, 2], "bad": column}), progress=False)
    assert "'bad'" in str(info.value) and type_name in str(info.value)
    assert isinstance(info.value, TypeError)


class _Exporter:
    """An object that only exports Arrow data (what polars, duckdb, nanoarrow hand over)."""

    def __init__(self, data, how):
        self.data, self.how = data, how

    def __getattr__(self, name):
        if name == f"__arrow_c_{self.how}__":
            return getattr(self.data, name)
        raise AttributeError(name)


def test_any_arrow_exporter_is_accepted():
    batch = pa.record_batch({"x": [1, 2], "s": [{"a": "p"}, {"a": "q"}]})
    for obj in (_Exporter(batch, "array"), _Exporter(pa.table(batch), "stream")):
        assert rows_of(ArrowDataset(obj, progress=False)) == reference(pa.table(batch))
    with pytest.raises(TypeError, match="Build one with pa.table"):
        ArrowDataset([1, 2], progress=False)


def test_table_and_columns_of_a_wrong_type_are_argument_type_errors():
    for table, seen in (({"a": [1]}, r"table=\{'a': \[1\]\} \(type dict\)"), (None, "NoneType")):
        with pytest.raises(TypeError, match=seen) as info:
            ArrowDataset(table, progress=False)
        assert isinstance(info.value, sd.ArgumentTypeError) and "pa.table" in str(info.value)
    with pytest.raises(TypeError, match=r"columns=5 \(type int\) for the Arrow table") as info:
        ArrowDataset(pa.table({"a": [1]}), columns=5, progress=False)
    assert isinstance(info.value, sd.ArgumentTypeError)


# -- structs ---------------------------------------------------------------------------------

STRUCTS = pa.table({
    "id": [1, 2, 3, 4],
    "meta": pa.array(
        [{"lang": "en", "score": 0.5, "src": {"url": "u1", "n": 1}},
         None,
         {"lang": None, "score": 1.5, "src": {"url": "u3", "n": 3}},
         {"lang": "fr", "score": None, "src": None}],
        pa.struct([("lang", pa.string()), ("score", pa.float64()),
                   ("src", pa.struct([("url", pa.string()), ("n", pa.int32())]))]),
    ),
})  # fmt: skip


def test_struct_fields_load_as_flattened_columns_with_their_struct_nulls(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(STRUCTS, path, row_group_size=3)
    for make in (lambda **k: ArrowDataset(STRUCTS, **k), lambda **k: ParquetDataset(path, **k)):
        with pytest.raises(sd.NullValuesError, match="'meta.lang'"):
            make(progress=False)
        ds = make(progress=False, fill_value={"meta.lang": "?", "meta.score": -1.0,
                                              "meta.src.url": "", "meta.src.n": 0})  # fmt: skip
        assert ds.columns == ["id", "meta.lang", "meta.score", "meta.src.url", "meta.src.n"]
        want = [{k: (v if v is not None else {"meta.lang": "?", "meta.score": -1.0,
                 "meta.src.url": "", "meta.src.n": 0}[k]) for k, v in r.items()}
                for r in reference(STRUCTS)]  # fmt: skip
        assert rows_of(ds) == want
        picked = make(progress=False, columns=["meta.src", "id"], fill_value=0)
        assert picked.columns == ["meta.src.url", "meta.src.n", "id"]
        assert plain(picked[2]) == {"meta.src.url": "u3", "meta.src.n": 3, "id": 3}


# -- nested lists ------------------------------------------------------------------------------

TURN = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("tokens", pa.list_(pa.int32()))]
)
CHAT = pa.struct([("role", pa.string()), ("content", pa.large_string()), ("n", pa.int8())])


def _conversations(n=40, seed=0):
    rng = np.random.default_rng(seed)
    words = ["hi", "", "héllo", "日本語", "x" * 30, "🙂"]
    messages, tags, grid = [], [], []
    for i in range(n):
        turns = int(rng.integers(0, 4))
        messages.append([
            {"role": ["user", "assistant"][t % 2], "content": words[(i + t) % len(words)],
             "tokens": list(range(int(rng.integers(0, 3))))}
            for t in range(turns)
        ])  # fmt: skip
        tags.append([words[j % len(words)] for j in range(i % 3)])
        grid.append([rng.standard_normal(int(k)).tolist() for k in rng.integers(0, 3, i % 4)])
    return pa.table({
        "messages": pa.array(messages, pa.list_(TURN)),
        "chat": pa.array(
            [[{"role": t["role"], "content": t["content"], "n": len(t["tokens"])} for t in m]
             for m in messages], pa.list_(CHAT)),  # fmt: skip
        "tags": pa.array(tags, pa.list_(pa.string())),
        "grid": pa.array(grid, pa.list_(pa.list_(pa.float64()))),
    })  # fmt: skip


def test_nested_lists_load_equal_to_pyarrow_from_arrow_and_parquet(tmp_path):
    table = _conversations()
    path = tmp_path / "c.parquet"
    pq.write_table(table, path, row_group_size=7)
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5, 20), table.slice(25)])
    for ds in (ArrowDataset(chunked, progress=False), ParquetDataset(path, progress=False)):
        assert ds.specs["messages"].kind == "nested"
        assert rows_of(ds) == reference(table)
        gathered = ds.__getitems__(list(range(len(ds))))  # lists of records: through Arrow
        assert [plain(dict(s)) for s in gathered] == reference(table)
        batch = ds.__getitems__([3, 0])
        assert plain(batch[0]["messages"]) == table["messages"][3].as_py()
    by_columns = ParquetDataset(path, ["messages"], records=False, progress=False)
    for i in (0, 5, 17):
        turns = table["messages"][i].as_py()
        want = {k: [t[k] for t in turns] for k in ("role", "content", "tokens")}
        assert plain(by_columns[i]["messages"]) == want


def test_nested_nulls_are_refused_or_filled():
    table = pa.table({"m": pa.array(
        [[{"role": None, "content": "x", "tokens": [1, None]}], None, [None], []],
        pa.list_(TURN))})  # fmt: skip
    with pytest.raises(sd.NullValuesError, match="'m'"):
        ArrowDataset(table, progress=False)
    ds = ArrowDataset(table, fill_value={"m": 0}, progress=False)
    assert plain(ds[0]["m"]) == [{"role": "", "content": "x", "tokens": [1, 0]}]
    assert plain(ds[1]["m"]) == [] and plain(ds[3]["m"]) == []
    assert plain(ds[2]["m"]) == [{"role": "", "content": "", "tokens": []}]


def _epoch(ds):
    # the worker turns its samples into plain values: what is checked is what it read
    loader = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=_plain_batch, timeout=60,
                        multiprocessing_context="fork")  # fmt: skip
    return [s for batch in loader for s in batch]


def _plain_batch(samples):
    return [plain(dict(s)) for s in samples]


def test_nested_and_struct_columns_reach_workers_unchanged(tmp_path):
    table = _conversations(30)
    table = table.append_column("meta", pa.array([{"a": i, "b": str(i)} for i in range(30)]))
    ds = ArrowDataset(table, progress=False)
    assert _epoch(ds) == reference(table)
    # the data is in shared buffers, not in Python objects: nbytes covers every level
    strings = sum(len(t["content"].encode()) + len(t["role"])
                  for m in table["messages"].to_pylist() for t in m)  # fmt: skip
    assert ds.nbytes >= strings


NESTED = pa.table({
    "id": [1, 2, 3],
    "meta": [{"lang": "en", "src": {"url": "u1", "n": 1}},
             {"lang": "fr", "src": {"url": "", "n": 2}},
             {"lang": "de", "src": {"url": "u3", "n": 3}}],
    "conv": [{"turns": [{"role": "user", "content": "hi"}], "score": 0.5},
             {"turns": [], "score": 1.0}, {"turns": [{"role": "bot", "content": "yo"}] * 2,
             "score": 2.0}],
})  # fmt: skip


def test_nested_items_and_batches_are_what_to_pylist_gives(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(NESTED, path, row_group_size=2)
    want = NESTED.to_pylist()
    for make in (lambda **k: ArrowDataset(NESTED, **k), lambda **k: ParquetDataset(path, **k)):
        ds = make(nested=True, progress=False)
        assert ds.columns == ["id", "meta.lang", "meta.src.url", "meta.src.n", "conv.turns",
                              "conv.score"]  # fmt: skip
        assert rows_of(ds) == want
        assert [plain(dict(s)) for s in ds.__getitems__([2, 0, 1])] == [want[2], want[0], want[1]]
        assert _epoch(ds) == want  # from a worker
        stackable = make(nested=True, columns=["meta", "conv.score"], progress=False)
        batch = next(iter(DataLoader(stackable, batch_size=3)))  # the collate's shortcut
        assert plain(batch) == {
            "meta": {"lang": ["en", "fr", "de"], "src": {"url": ["u1", "", "u3"], "n": [1, 2, 3]}},
            "conv": {"score": [0.5, 1.0, 2.0]},
        }
        assert plain(ds[[1, 2]]["meta"]) == {"lang": ["fr", "de"],
                                             "src": {"url": ["", "u3"], "n": [2, 3]}}  # fmt: skip
        picked = make(nested=True, columns=["meta.src", "id"], progress=False)
        assert plain(picked[2]) == {"meta": {"src": {"url": "u3", "n": 3}}, "id": 3}
        assert list(make(progress=False)[0]) == ds.columns  # flat by default
        # the option is not part of what is loaded: same specs, same bytes
        assert make(progress=False).specs == ds.specs


def test_nested_paths_that_collide_are_refused():
    from shareddata.columns._items import nest_paths

    with pytest.raises(sd.errors.InvalidArgumentError, match="'a/b'.*'a'"):
        nest_paths(["a", "a/b"], [("a",), ("a", "b")])
    with pytest.raises(ValueError, match="'a'.*'a/b'"):
        nest_paths(["a/b", "a"], [("a", "b"), ("a",)])


# -- many Parquet files ----------------------------------------------------------------------


def test_globs_recursive_folders_hive_partitions_and_promoted_types(tmp_path):
    root = tmp_path / "data"
    parts = {}
    for year, kind, ids in ((2023, "a", [1, 2]), (2024, "a", [3]), (2024, "b", [4, 5, 6])):
        folder = root / f"year={year}" / f"kind={kind}"
        folder.mkdir(parents=True)
        ids_type = pa.int32() if year == 2023 else pa.int64()  # promoted to int64
        parts[(year, kind)] = pa.table(
            {"id": pa.array(ids, ids_type), "text": [f"t{i}" for i in ids]}
        )
        pq.write_table(parts[(year, kind)], folder / "part-0.parquet")
    (root / "_SUCCESS").write_text("")
    (root / "year=2024" / "README.txt").write_text("not data")
    (root / "A-README.txt").write_text("not data, listed first")
    want = [{"id": i, "text": f"t{i}", "year": y, "kind": k}
            for (y, k), t in sorted(parts.items()) for i in t["id"].to_pylist()]  # fmt: skip
    for path in (root, str(root / "**" / "*.parquet")):
        ds = ParquetDataset(path, progress=False)
        assert ds.columns == ["id", "text", "year", "kind"]
        assert ds.specs["id"].dtype == np.int64
        assert rows_of(ds) == want
    listed = ParquetDataset(sorted(map(str, root.glob("year=2024/*/*.parquet"))), ["id"],
                            progress=False)  # fmt: skip
    assert [r["id"] for r in rows_of(listed)] == [3, 4, 5, 6]
    with pytest.raises(FileNotFoundError, match="matches no .parquet"):
        ParquetDataset(str(root / "*.nope"), progress=False)
    pq.write_table(pa.table({"id": ["x"], "text": ["y"]}),
                   root / "year=2024" / "kind=b" / "part-1.parquet")  # fmt: skip
    with pytest.raises(
        sd.UnsupportedDtypeError, match=r"'id' is string in .*part-1.* but int64 in"
    ):
        ParquetDataset(root, progress=False)
    assert os.path.exists(root / "_SUCCESS")


_NANOSECONDS = r"""
import sys


class NoPandas:  # pandas is optional: without it pyarrow has no type for nanoseconds
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pandas":
            raise ModuleNotFoundError("No module named 'pandas'")


sys.meta_path.insert(0, NoPandas())
import pyarrow as pa, pyarrow.parquet as pq
from shareddata import ArrowDataset, ParquetDataset

table = pa.table({"at": pa.array([1, 1_000_000_001, 7], pa.timestamp("ns")), "i": [0, 1, 2]})
pq.write_table(table, sys.argv[1])
arrow, parquet = ArrowDataset(table, progress=False), ParquetDataset(sys.argv[1], progress=False)
print([[int(v) for v in ds[i].values()] for ds in (arrow, parquet) for i in range(3)])
"""


def test_nanosecond_timestamps_load_as_from_parquet(tmp_path):
    """Issue 29: sub-microsecond timestamp[ns] values made ArrowDataset raise pyarrow's raw
    ValueError (in the key that tells tables apart), where pandas is not installed."""
    import subprocess
    import sys

    command = [sys.executable, "-c", _NANOSECONDS, str(tmp_path / "t.parquet")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[1, 0], [1_000_000_001, 1], [7, 2]]
    assert run.stdout.strip() == repr(rows + rows)
