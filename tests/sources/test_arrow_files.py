"""Arrow files by path: IPC files, IPC streams, Feather v2, lists of them and HF folders.

Each form is written by pyarrow and loaded equal, value by value, to what pyarrow's own
reader of that form gives (``reference()``: structs flattened, times as integers);
anything that is not one of them is refused naming what it is and what to pass.
"""

import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pytest
from conftest import REPO

import shareddata as sd
from shareddata.datasets._load import build
from shareddata.sources._arrow_ipc import IpcInput
from shareddata.sources.arrow import ArrowSource

sys.path.insert(0, os.path.dirname(__file__))
from test_arrow import plain, reference, rows_of  # noqa: E402

N = 11


def _table(n=N, seed=0):
    rng = np.random.default_rng(seed)
    tensor = pa.fixed_shape_tensor(pa.float32(), (2, 2))
    return pa.table({
        "id": pa.array(np.arange(n) + seed * 100, pa.int32()),
        "x": pa.array(rng.standard_normal(n)),
        "text": [f"héllo {i}" * (i % 3) for i in range(n)],
        "tokens": pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int16())),
        "turns": [[{"role": "user", "content": str(i)}] * (i % 2) for i in range(n)],
        "meta": [{"lang": "en" if i % 2 else "fr", "n": i} for i in range(n)],
        "kind": pa.array(["a", "b", "a"] * (n // 3) + ["c"] * (n % 3)).dictionary_encode(),
        "uid": pa.array([uuid.UUID(int=i).bytes for i in range(n)], pa.uuid()),
        "image": pa.ExtensionArray.from_storage(tensor, pa.FixedSizeListArray.from_arrays(
            pa.array(rng.standard_normal(n * 4).astype(np.float32)), 4)),
        "at": pa.array(np.arange(n) * 10**9, pa.timestamp("ns", tz="UTC")),
    })  # fmt: skip


def _write(kind, path, table, rows_per_batch=3):
    batches = table.to_batches(max_chunksize=rows_per_batch)
    if kind.startswith("feather"):
        compression = kind.split("-")[1]
        feather.write_feather(table, path, compression=compression, chunksize=rows_per_batch)
        return feather.read_table(path)
    if kind == "stream":
        with ipc.new_stream(path, table.schema) as writer:
            for b in batches:
                writer.write_batch(b)
        return ipc.open_stream(path).read_all()
    options = ipc.IpcWriteOptions(compression="zstd" if kind == "file-zstd" else None)
    with ipc.new_file(path, table.schema, options=options) as writer:
        for b in batches:
            writer.write_batch(b)
    return ipc.open_file(path).read_all()


KINDS = ["file", "file-zstd", "stream", "feather-lz4", "feather-uncompressed"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_form_loads_equal_to_pyarrows_own_reader(kind, tmp_path):
    path = tmp_path / "data.arrow"
    read_back = _write(kind, path, _table())
    want = reference(read_back)
    for given in (path, str(path)):
        ds = sd.ArrowDataset(given, progress=False)
        assert rows_of(ds) == want
        assert [plain(dict(s)) for s in ds.__getitems__(list(range(N)))] == want
    assert ds.specs["uid"].kind == "uuid" and ds.specs["image"].shape == (2, 2)
    picked = sd.ArrowDataset(path, columns=["meta", "id"], progress=False)
    assert picked.columns == ["meta.lang", "meta.n", "id"]
    assert rows_of(picked) == [{k: r[k] for k in picked.columns} for r in want]


def test_a_list_of_files_in_the_order_given_and_a_range_of_rows(tmp_path):
    a, b = _table(7, seed=1), _table(5, seed=2)
    _write("file", tmp_path / "a.arrow", a, rows_per_batch=3)
    _write("stream", tmp_path / "b.arrows", b, rows_per_batch=2)
    files = [tmp_path / "b.arrows", tmp_path / "a.arrow"]
    ds = sd.ArrowDataset(files, progress=False)
    assert rows_of(ds) == reference(pa.concat_tables([b, a]))
    # shard="node" reads a range of rows: batches and files it cuts are sliced
    both = pa.concat_tables([b, a])
    for start, stop in ((0, 12), (3, 9), (5, 6), (4, 5), (11, 12)):
        names = ["id", "text", "turns"]
        source = ArrowSource(IpcInput(files, names), names)
        assert source.total_rows() == 12
        source.select_rows(start, stop)
        columns = build(source, share="process", progress=False)
        got = [{k: plain(c.get(i)) for k, c in columns.items()} for i in range(stop - start)]
        assert got == reference(both.select(["id", "text", "turns"]).slice(start, stop - start))


def test_nulls_are_refused_naming_the_file_or_filled(tmp_path):
    path = tmp_path / "n.arrows"
    _write("stream", path, pa.table({"x": [1.0, None, 3.0], "s": ["a", None, "c"]}))
    with pytest.raises(sd.NullValuesError, match=rf"'x'.*1 null.*{path.name}"):
        sd.ArrowDataset(path, progress=False)
    ds = sd.ArrowDataset(path, fill_value={"x": -1.0, "s": "?"}, progress=False)
    assert rows_of(ds) == [{"x": 1.0, "s": "a"}, {"x": -1.0, "s": "?"}, {"x": 3.0, "s": "c"}]


def _garbage(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1]}), tmp_path / "t.parquet")
    (tmp_path / "v1.feather").write_bytes(b"FEA1" + b"\0" * 60)  # pyarrow 25+ warns on writing
    (tmp_path / "notes.arrow").write_text("not arrow at all\n")
    (tmp_path / "empty.arrow").write_bytes(b"")
    np.save(tmp_path / "a.npy", np.zeros(3))
    return {
        "t.parquet": "Parquet file: load it with sd.ParquetDataset",
        "v1.feather": "Feather v1 .*write_feather",
        "notes.arrow": "not an Arrow IPC file or stream .*b'not arro'",
        "empty.arrow": "empty",
        "a.npy": r"\.npy file: load it with sd.NumpyDataset",
    }


def test_paths_that_are_not_arrow_are_refused_naming_what_they_are(tmp_path):
    for name, what in _garbage(tmp_path).items():
        with pytest.raises(sd.SourceReadError, match=what) as info:
            sd.ArrowDataset(tmp_path / name, progress=False)
        assert str(tmp_path / name) in str(info.value) and isinstance(info.value, OSError)
        assert "Arrow IPC stream" in str(info.value)  # what it takes
    with pytest.raises(sd.MissingFileError, match="nope.arrow does not exist.*HF datasets"):
        sd.ArrowDataset(tmp_path / "nope.arrow", progress=False)
    with pytest.raises(FileNotFoundError, match="list of Arrow files is empty"):
        sd.ArrowDataset([], progress=False)
    with pytest.raises(FileNotFoundError, match=r"missing.arrow does not exist \(in the list"):
        sd.ArrowDataset([tmp_path / "a.npy", tmp_path / "missing.arrow"], progress=False)


def test_truncated_files_name_the_file(tmp_path):
    table = _table(40)
    for kind, name in (("file", "t.arrow"), ("stream", "t.arrows")):
        path = tmp_path / name
        _write(kind, path, table, rows_per_batch=8)
        data = path.read_bytes()
        for cut in (len(data) // 2, len(data) - 40):
            path.write_bytes(data[:cut])
            with pytest.raises(sd.SourceReadError, match=name) as info:
                sd.ArrowDataset(path, progress=False)
            assert "truncated" in str(info.value)


def test_hf_folders_are_read_from_their_state_json_or_refused_naming_the_fix(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    parts = [_table(4, seed=s) for s in (1, 2)]
    for i, part in enumerate(parts):
        _write("stream", folder / f"data-{i:05d}-of-00002.arrow", part)
    with pytest.raises(sd.MissingFileError, match=r"no state.json.*2 Arrow file.*glob.glob"):
        sd.ArrowDataset(folder, progress=False)
    # the order state.json lists, not the sorted order
    files = [{"filename": "data-00001-of-00002.arrow"}, {"filename": "data-00000-of-00002.arrow"}]
    (folder / "state.json").write_text(json.dumps({"_data_files": files}))
    assert rows_of(sd.ArrowDataset(folder, progress=False)) == reference(
        pa.concat_tables(parts[::-1])
    )
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(sd.MissingFileError, match="'gone.arrow', which is not in"):
        sd.ArrowDataset(folder, progress=False)
    (folder / "state.json").write_text("{not json")
    with pytest.raises(sd.SourceReadError, match="state.json could not be read as JSON"):
        sd.ArrowDataset(folder, progress=False)
    splits = tmp_path / "dd"
    (splits / "train").mkdir(parents=True)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(sd.MissingFileError, match=r"DatasetDict.*train, test.*dd/train"):
        sd.ArrowDataset(splits, progress=False)


def test_files_that_differ_are_refused_naming_both(tmp_path):
    _write("file", tmp_path / "a.arrow", pa.table({"x": [1], "s": ["a"]}))
    _write("file", tmp_path / "b.arrow", pa.table({"x": [1.5], "s": ["b"]}))
    _write("file", tmp_path / "c.arrow", pa.table({"x": [2]}))
    with pytest.raises(sd.UnsupportedDtypeError, match=r"'x' is double in .*b.arrow but int64"):
        sd.ArrowDataset([tmp_path / "a.arrow", tmp_path / "b.arrow"], progress=False)
    with pytest.raises(sd.MissingColumnError, match="different columns"):
        sd.ArrowDataset([tmp_path / "a.arrow", tmp_path / "c.arrow"], progress=False)
    ds = sd.ArrowDataset([tmp_path / "a.arrow", tmp_path / "c.arrow"], columns=["x"],
                         progress=False)  # fmt: skip
    assert rows_of(ds) == [{"x": 1}, {"x": 2}]
    with pytest.raises(sd.MissingColumnError, match="'y' is not in .*it has: 'x', 's'"):
        sd.ArrowDataset(tmp_path / "a.arrow", columns=["y"], progress=False)


def test_loading_a_file_keeps_no_private_copy_of_the_table(tmp_path):
    """Peak RSS growth: the shared copy and a batch, where reading the table first is 2x."""
    path = tmp_path / "big.arrow"
    code = textwrap.dedent(
        f"""
        import numpy as np, pyarrow as pa, sys, shareddata as sd

        def kib(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) << 10

        x = np.random.default_rng(0).standard_normal(96 << 18, dtype=np.float32)
        table = pa.table({{"x": pa.FixedSizeListArray.from_arrays(pa.array(x), 256),
                          "s": [str(i) for i in range(len(x) // 256)]}})
        with pa.ipc.new_file({str(path)!r}, table.schema) as w:
            for b in table.to_batches(max_chunksize=8192):  # 8 MiB batches
                w.write_batch(b)
        del table, x, w, b
        sd.ArrowDataset(pa.table({{"x": [1]}}), progress=False)  # lazy imports
        pa.default_memory_pool().release_unused()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = kib("VmRSS")
        if sys.argv[1] == "path":
            ds = sd.ArrowDataset({str(path)!r}, progress=False)
        else:
            ds = sd.ArrowDataset(pa.ipc.open_file({str(path)!r}).read_all(), progress=False)
        print((kib("VmHWM") - before) / ds.nbytes)
        """
    )
    peaks = {}
    for how in ("path", "table"):
        proc = subprocess.run(
            [sys.executable, "-c", code, how],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO},
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[how] = float(proc.stdout.split()[-1])
    assert peaks["table"] > 1.8, peaks  # the measurement sees a private copy
    assert peaks["path"] < 1.3, peaks
