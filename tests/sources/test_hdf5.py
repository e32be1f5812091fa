import gc
import multiprocessing
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, START_METHODS, open_fds
from torch.utils.data import DataLoader, default_collate

import shareddata as sd
from shareddata import HDF5Dataset
from shareddata.datasets._load import build
from shareddata.sources import _hdf5_chunks, hdf5
from shareddata.sources._source import Buffer
from shareddata.sources.hdf5 import HDF5Source

ROWS = 300
LONGEST = [  # what keys=None selects, in h5py's visit order
    "arr",
    "ascii",
    "big_endian",
    "c64",
    "f16",
    "fixed",
    "fixed_utf8",
    "grp/sub/lzf",
    "images",
    "labels",
    "mask",
    "opaque",
    "ragged",
    "ragged_gzip",
    "table",
    "text",
]


def _texts(rng, n):
    alphabet = ["a", "b", "é", "ß", "漢", "字", "🙂", " ", "\t"]
    return ["".join(rng.choice(alphabet, size=int(k))) for k in rng.integers(0, 12, n)]


def _cut(text, nbytes):
    """``text`` encoded, cut to ``nbytes`` at a character boundary."""
    return text.encode()[:nbytes].decode(errors="ignore").encode()


def _write_every_type(path, rows=ROWS):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "images",
            data=rng.standard_normal((rows, 2, 3)).astype(np.float32),
            chunks=(32, 2, 3),
            compression="gzip",
        )
        f["labels"] = rng.integers(-5, 5, rows).astype(np.int32)  # contiguous
        f.create_dataset(
            "grp/sub/lzf", data=rng.random((rows, 5)), chunks=(50, 5), compression="lzf"
        )
        f["big_endian"] = np.arange(rows, dtype=">i8") * 3
        f["mask"] = rng.random(rows) > 0.5
        f["c64"] = (rng.random(rows) + 1j * rng.random(rows)).astype(np.complex64)
        f["f16"] = rng.random(rows).astype(np.float16)
        texts = _texts(rng, rows)
        texts[0], texts[5] = "", "héllo wörld"
        f.create_dataset("text", data=texts, dtype=h5py.string_dtype())
        f.create_dataset(
            "ascii", data=[f"row{i}" if i % 7 else "" for i in range(rows)],
            dtype=h5py.string_dtype("ascii"),
        )  # fmt: skip
        fixed = np.array([b"a\x00b" if i % 3 == 0 else b"x" * (i % 11) for i in range(rows)], "S10")
        f["fixed"] = fixed
        f.create_dataset(
            "fixed_utf8",
            data=np.array([_cut(t, 12) for t in _texts(rng, rows)], "S12").astype(
                h5py.string_dtype("utf-8", 12)
            ),
        )
        f["opaque"] = np.frombuffer(rng.bytes(4 * rows), "V4")
        ragged = f.create_dataset("ragged", (rows,), dtype=h5py.vlen_dtype(np.int32))
        for i in range(rows):
            ragged[i] = np.arange(i % 5, dtype=np.int32) * i  # rows of length 0 included
        rg = np.empty(rows, dtype=object)
        rg[:] = [rng.random(int(k)) for k in rng.integers(0, 9, rows)]
        f.create_dataset(
            "ragged_gzip",
            data=rg,
            dtype=h5py.vlen_dtype(np.float64),
            chunks=(64,),
            compression="gzip",
        )
        array_type = h5py.h5t.array_create(h5py.h5t.NATIVE_INT16, (2, 2))
        space = h5py.h5s.create_simple((rows,))
        h5py.h5d.create(f.id, b"arr", array_type, space)
        f["arr"][...] = np.arange(rows * 4, dtype=np.int16).reshape(rows, 2, 2)
        f["table"] = rng.integers(0, 100, (rows, 4, 2, 2)).astype(np.uint8)  # 4-D
        f["short"] = np.arange(10)  # skipped by keys=None
        f["scalar"] = 3.5  # skipped by keys=None
        f.create_dataset("empty", data=h5py.Empty("f4"))  # skipped by keys=None
    return path


@pytest.fixture(scope="module")
def h5path(tmp_path_factory):
    return _write_every_type(tmp_path_factory.mktemp("h5") / "every.h5")


def _expected(f, key, i):
    """What h5py's own reading gives for row ``i``, as the type a sample holds."""
    ds = f[key]
    string = h5py.check_string_dtype(ds.dtype)
    if string is not None:
        if string.length is None or string.encoding == "utf-8":
            return ds.asstr()[i]
        return bytes(ds[i])
    value = ds[i : i + 1][0]  # (an H5T_ARRAY row reads as a void scalar with ds[i])
    if ds.dtype.kind == "V" and ds.dtype.subdtype is None:  # opaque
        return value.tobytes()
    return torch.from_numpy(np.asarray(value).astype(np.asarray(value).dtype.newbyteorder("=")))


def _assert_same(got, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    else:
        assert type(got) is type(expected)
        assert got == expected


def test_every_type_round_trips(h5path):
    ds = HDF5Dataset(h5path)
    assert ds.columns == LONGEST  # "short", scalar and empty datasets are skipped
    assert len(ds) == ROWS
    kinds = {n: s.kind for n, s in ds.specs.items()}
    assert kinds["text"] == kinds["ascii"] == kinds["fixed_utf8"] == "str"
    assert kinds["fixed"] == kinds["opaque"] == "bytes"
    assert kinds["ragged"] == kinds["ragged_gzip"] == "ragged"
    with h5py.File(h5path) as f:
        for i in range(ROWS):
            sample = ds[i]
            for key in LONGEST:
                _assert_same(sample[key], _expected(f, key, i))
    s = ds[0]
    assert s["labels"].dtype == torch.int32 and s["labels"].ndim == 0
    assert s["big_endian"].dtype == torch.int64 and int(ds[7]["big_endian"]) == 21
    assert s["mask"].dtype == torch.bool
    assert s["images"].shape == (2, 3) and s["table"].shape == (4, 2, 2)
    assert s["arr"].shape == (2, 2) and s["arr"].dtype == torch.int16
    assert s["text"] == "" and ds[5]["text"] == "héllo wörld"
    assert ds[0]["fixed"] == b"a\x00b" and ds[1]["fixed"] == b"x"  # np.bytes_ semantics
    assert ds[0]["ragged"].numel() == 0 and ds[0]["ragged"].dtype == torch.int32


def test_exact_sizes_in_specs(h5path):
    with HDF5Source(h5path, ["text", "fixed", "ragged", "labels"]) as source:
        specs = {s.name: s for s in source.specs()}
    with h5py.File(h5path) as f:
        assert specs["text"].values == sum(len(b) for b in f["text"][:])
        assert specs["fixed"].values == sum(len(b) for b in f["fixed"][:])
        assert specs["ragged"].values == sum(len(r) for r in f["ragged"][:])
    assert specs["labels"].kind == "tensor" and specs["labels"].dtype == np.int32
    assert specs["ragged"].nbytes == (ROWS + 1) * 8 + specs["ragged"].values * 4


def test_progress_reports_every_byte_of_every_buffer(h5path):
    from shareddata.columns._columns import COLUMN_KINDS

    with HDF5Source(h5path) as source:
        for spec in source.specs():
            layout = COLUMN_KINDS[spec.kind].layout(spec)
            buffers = {
                k: np.empty(shape, dtype).view(Buffer) for k, (shape, dtype) in layout.items()
            }
            seen = []
            source.read(spec, buffers, seen.append)
            assert sum(seen) == spec.nbytes, spec.name


def test_progress_counts_every_byte_of_records_and_frames(tmp_path):
    from shareddata.columns._columns import COLUMN_KINDS

    pd = pytest.importorskip("pandas")
    path = tmp_path / "rec.h5"
    color = h5py.enum_dtype({"r": 0, "g": 1}, basetype="u1")
    dtype = np.dtype([("a", ">i2"), ("t", "S4"), ("s", h5py.string_dtype()), ("c", color)])
    with h5py.File(path, "w") as f:
        f["rec"] = np.array([(i, b"ab", "é" * (i % 3), i % 2) for i in range(50)], dtype)
        f["empty"] = np.zeros(0, dtype)
    frame = pd.DataFrame({"x": np.arange(50.0), "y": np.arange(50.0), "s": ["q"] * 50})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame.to_hdf(tmp_path / "df.h5", key="df", format="table")
    for file, keys in [(path, ["rec"]), (path, ["empty"]), (tmp_path / "df.h5", None)]:
        with HDF5Source(file, keys) as source:
            for spec in source.specs():
                layout = COLUMN_KINDS[spec.kind].layout(spec)
                buffers = {
                    k: np.empty(shape, dtype).view(Buffer) for k, (shape, dtype) in layout.items()
                }
                seen = []
                source.read(spec, buffers, seen.append)
                assert sum(seen) == spec.nbytes, spec.name


def test_empty_file_and_zero_rows(tmp_path):
    with h5py.File(tmp_path / "empty.h5", "w") as f:
        f.create_group("nothing/here")
        f["scalar"] = 1
    with pytest.raises(KeyError, match="holds no dataset with rows"):
        HDF5Dataset(tmp_path / "empty.h5")
    with h5py.File(tmp_path / "zero.h5", "w") as f:
        f["x"] = np.zeros((0, 3), np.float32)
        f.create_dataset("s", (0,), dtype=h5py.string_dtype())
        f.create_dataset("r", (0,), dtype=h5py.vlen_dtype(np.int16))
    ds = HDF5Dataset(tmp_path / "zero.h5")
    assert len(ds) == 0 and ds.columns == ["r", "s", "x"]
    with pytest.raises(IndexError):
        ds[0]


def test_bounded_chunk_aligned_reads(h5path, monkeypatch):
    """Tiny budgets: many blocks, each a whole number of chunks; same data."""
    monkeypatch.setattr(hdf5, "_CHUNK", 1000)
    monkeypatch.setattr(hdf5, "_BLOCK", 600)
    calls = []
    real = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        calls.append((self.name, source_sel, dest_sel, dest.ctypes.data))
        return real(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    ds = HDF5Dataset(h5path)
    lzf = [c for c in calls if c[0] == "/grp/sub/lzf"]
    assert len(lzf) > 3
    assert all(c[1].start % 50 == 0 and c[2] is None for c in lzf)  # chunks of 50 rows
    assert len({c[3] - c[1].start * 40 for c in lzf}) == 1  # into the rows of one buffer
    assert not [c for c in calls if c[0] == "/images"]  # gzip: inflated in threads
    assert not [c for c in calls if c[0] == "/labels"]  # contiguous: copied by the kernel
    full = HDF5Dataset(h5path, ["text", "fixed", "ragged_gzip", "opaque"])
    with h5py.File(h5path) as f:
        for i in range(0, ROWS, 7):
            for key in LONGEST:
                _assert_same(ds[i][key], _expected(f, key, i))
            for key in full.columns:
                _assert_same(full[i][key], ds[i][key])


def test_keys_name_columns_by_path(h5path):
    ds = HDF5Dataset(h5path, ["/grp/sub/lzf", "labels"], output="tuple")
    assert ds.columns == ["grp/sub/lzf", "labels"]
    x, y = ds[3]
    with h5py.File(h5path) as f:
        np.testing.assert_array_equal(x.numpy(), f["grp/sub/lzf"][3])
        assert int(y) == f["labels"][3]
    assert HDF5Dataset(h5path, "short").columns == ["short"]
    assert len(HDF5Dataset(h5path, "short")) == 10
    assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == 0  # files closed


def test_indexing_and_batches(h5path):
    keys = ["images", "labels", "text", "fixed", "ragged"]
    ds = HDF5Dataset(h5path, keys)
    _assert_same(ds[-1]["text"], ds[ROWS - 1]["text"])
    _assert_same(ds[-1]["ragged"], ds[ROWS - 1]["ragged"])
    with pytest.raises(IndexError, match=str(ROWS)):
        ds[ROWS]
    with pytest.raises(IndexError):
        ds[-ROWS - 1]
    idx = [4, -1, 0, 4, 299, 13]
    for got, i in zip(ds.__getitems__(idx), idx):
        want = ds[i]
        assert got.keys() == want.keys()
        for key in keys:
            _assert_same(got[key], want[key])
    batch = ds[[1, 2, 3]]
    assert batch["text"] == [ds[i]["text"] for i in (1, 2, 3)]
    torch.testing.assert_close(batch["images"], torch.stack([ds[i]["images"] for i in (1, 2, 3)]))


def test_storage_dir_and_transform(h5path, tmp_path):
    ds = HDF5Dataset(h5path, ["labels", "text"], storage_dir=tmp_path, transform=_upper)
    with h5py.File(h5path) as f:
        assert ds[5]["text"] == f["text"].asstr()[5].upper()


def _upper(sample):
    return {**sample, "text": sample["text"].upper()}


def _collate(samples):
    """The default collate, except for ragged rows, which stay lists of tensors."""
    ragged = [k for k in samples[0] if k.startswith("ragged")]
    rest = [{k: v for k, v in s.items() if k not in ragged} for s in samples]
    return {**default_collate(rest), **{k: [s[k] for s in samples] for k in ragged}}


@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_batches_equal_the_source(h5path, method):
    keys = ["images", "labels", "mask", "text", "fixed", "ragged_gzip"]
    ds = HDF5Dataset(h5path, keys)
    loader = DataLoader(
        ds, batch_size=64, num_workers=2, multiprocessing_context=method, collate_fn=_collate
    )
    with h5py.File(h5path) as f:
        samples = [{k: _expected(f, k, i) for k in keys} for i in range(ROWS)]
    expected = [_collate(samples[i : i + 64]) for i in range(0, ROWS, 64)]
    got = list(loader)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        assert g["text"] == e["text"] and isinstance(g["text"][0], str)  # default collate
        assert g["fixed"] == e["fixed"] and isinstance(g["fixed"][0], bytes)
        for k in ("images", "labels", "mask"):
            assert g[k].dtype == e[k].dtype
            torch.testing.assert_close(g[k], e[k], rtol=0, atol=0)
        assert len(g["ragged_gzip"]) == len(e["ragged_gzip"])
        for r, want in zip(g["ragged_gzip"], e["ragged_gzip"]):
            _assert_same(r, want)


def test_pickled_size_does_not_grow_with_rows(tmp_path):
    def make(path, rows):
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros((rows, 8), np.float32)
            f.create_dataset("s", data=["abc"] * rows, dtype=h5py.string_dtype())
            r = np.empty(rows, dtype=object)
            r[:] = [np.arange(i % 4, dtype=np.int64) for i in range(rows)]
            f.create_dataset("r", data=r, dtype=h5py.vlen_dtype(np.int64))
        return HDF5Dataset(path)

    small, big = make(tmp_path / "small.h5", 10), make(tmp_path / "big.h5", 100_000)
    assert len(big) == 100_000 and big.nbytes > 4_000_000
    assert len(pickle.dumps(big)) < 3000
    assert abs(len(pickle.dumps(big)) - len(pickle.dumps(small))) < 64
    back = pickle.loads(pickle.dumps(big))
    assert back[99_999]["s"] == "abc" and back[99_999]["r"].tolist() == [0, 1, 2]
    with HDF5Source(tmp_path / "small.h5") as source, pytest.raises(TypeError, match="pickle"):
        pickle.dumps(source)


def _count(samples):
    return len(samples)


def test_verify_string_and_ragged_columns_held_once(tmp_path):
    rows = 32 * 1024
    rng = np.random.default_rng(1)
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        lengths = rng.integers(768, 1280, rows)  # ~32 MiB of text
        f.create_dataset(
            "text", data=[("ab" * 700)[:k] for k in lengths], dtype=h5py.string_dtype()
        )
        ragged = np.empty(rows, dtype=object)
        ragged[:] = [np.full(k, i, np.int32) for i, k in enumerate(rng.integers(0, 512, rows))]
        f.create_dataset("ragged", data=ragged, dtype=h5py.vlen_dtype(np.int32))  # ~32 MiB
    ds = HDF5Dataset(path)
    assert ds.nbytes > 60 << 20
    loader = DataLoader(
        ds, batch_size=256, num_workers=2, multiprocessing_context="spawn", collate_fn=_count
    )
    report = sd.verify(loader, max_duplication=1.10)  # batches of 1024 rows: ~1.12x
    assert report.duplication <= 1.10
    assert sum(1 for p in report.processes if p.role.startswith("worker")) == 2


# -- errors ------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.h5") as info:
        HDF5Dataset(tmp_path / "nope.h5")
    assert isinstance(info.value, sd.SharedDataError)


def test_missing_key_lists_the_datasets(h5path):
    with pytest.raises(KeyError, match=r"'nope' is not a dataset.*'arr', 'ascii'") as info:
        HDF5Dataset(h5path, ["labels", "nope"])
    assert "grp/sub/lzf" in str(info.value)
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(KeyError, match="'labels/x' is not a dataset"):
        HDF5Dataset(h5path, "labels/x")


def test_group_key_lists_its_datasets(h5path):
    with pytest.raises(KeyError, match=r"'grp' .* is a group.*'grp/sub/lzf'") as info:
        HDF5Dataset(h5path, ["grp"])
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(KeyError, match="is a group"):
        HDF5Dataset(h5path, "/")


def test_keys_of_different_lengths(h5path, monkeypatch):
    sized = []
    monkeypatch.setattr(HDF5Source, "_size", lambda self, plan, ds: sized.append(plan) or 0)
    with pytest.raises(ValueError, match=r"'text': 300 rows, 'short': 10 rows") as info:
        HDF5Dataset(h5path, ["text", "short"])
    assert isinstance(info.value, sd.ColumnLengthError)
    assert sized == []  # refused before reading any variable-length data


def test_duplicate_and_bad_keys(h5path):
    with pytest.raises(ValueError, match="twice"):
        HDF5Dataset(h5path, ["labels", "/labels"])
    with pytest.raises(TypeError, match="str"):
        HDF5Dataset(h5path, [3])


def test_path_and_keys_of_a_wrong_type_are_argument_type_errors(h5path):
    with pytest.raises(TypeError, match=r"path=5 \(type int\) is not a path") as info:
        HDF5Dataset(5)
    assert isinstance(info.value, sd.ArgumentTypeError)
    with pytest.raises(TypeError, match=r"columns=5 \(type int\) for .*every\.h5") as info:
        HDF5Dataset(h5path, columns=5)
    assert isinstance(info.value, sd.ArgumentTypeError) and "columns=None" in str(info.value)


def test_the_selection_is_columns_and_keys_is_its_old_name_with_a_warning(h5path):
    with pytest.warns(FutureWarning, match=r"HDF5Dataset\(keys=\.\.\.\) is now .*columns="):
        old = HDF5Dataset(h5path, keys=["arr"])
    assert old.columns == ["arr"] == HDF5Dataset(h5path, columns=["arr"]).columns
    assert HDF5Dataset(h5path, ["arr"]).columns == ["arr"]  # positional, as before
    with pytest.raises(ValueError, match="both columns= and keys=") as info:
        HDF5Dataset(h5path, columns=["arr"], keys=["arr"])
    assert isinstance(info.value, sd.InvalidArgumentError)


def _typed(name, htype):
    """A 4-row dataset of an HDF5 type h5py has no numpy type for."""

    def make(f):
        h5py.h5d.create(f.id, name.encode(), htype, h5py.h5s.create_simple((4,)))

    return make


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda f: f.create_dataset("col", data=[f.ref] * 3, dtype=h5py.ref_dtype), "reference"),
        (
            lambda f: f.create_dataset("col", (3,), dtype=h5py.vlen_dtype(np.dtype("f4,i4"))),
            "plain numeric",
        ),
        (
            lambda f: f.create_dataset("col", data=np.zeros((3, 2), "S3")),
            r"2 fixed-length \(\|S3\) strings per row \(rows of shape \(2,\)\)",
        ),
        (lambda f: f.create_dataset("col", data=1.0), "scalar"),
        (_typed("col", h5py.h5t.UNIX_D64LE), r"H5T_TIME.*int64"),
        (_typed("col", h5py.h5t.IEEE_F128LE), r"128-bit floats.*quad precision.*float64"),
        (lambda f: f.create_dataset("col", data=np.zeros(3, np.longdouble)), "float64"),
        (
            lambda f: f.create_dataset("col", data=np.zeros(3, [("a", "i4"), ("t", "S2", (2,))])),
            r"'col/t' .*2 fixed-length strings",
        ),
    ],
    ids=["reference", "vlen-compound", "2d-strings", "scalar", "time", "quad", "f128", "str-array"],
)
def test_unsupported_dtypes_name_the_dataset_and_type(tmp_path, make, hint):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        make(f)
    with pytest.raises(TypeError, match=hint) as info:
        HDF5Dataset(path, ["col"])
    assert "'col" in str(info.value) and "bad.h5" in str(info.value)
    assert "corrupt" not in str(info.value)
    assert isinstance(info.value, sd.UnsupportedDtypeError)


def test_default_keys_skip_what_cannot_be_stored_with_a_warning(tmp_path):
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(4)
        _typed("when", h5py.h5t.UNIX_D32BE)(f)
        _typed("quad", h5py.h5t.IEEE_F128BE)(f)
    with pytest.warns(UserWarning, match=r"left out 2 .*'quad'.*quad precision.*'when'.*H5T_TIME"):
        ds = HDF5Dataset(path)
    assert ds.columns == ["a"] and ds[3]["a"] == 3
    with pytest.raises(TypeError, match="'when'.*H5T_TIME"):
        HDF5Dataset(path, ["a", "when"])
    with h5py.File(path, "w") as f:
        _typed("when", h5py.h5t.UNIX_D32BE)(f)
    with pytest.raises(TypeError, match="no dataset shareddata can store.*H5T_TIME"):
        HDF5Dataset(path)


def test_empty_keys_list_what_exists(h5path):
    with pytest.raises(ValueError, match=r"columns=\[\] selects no dataset.*'arr', 'ascii'") as e:
        HDF5Dataset(h5path, [])
    assert isinstance(e.value, sd.EmptySelectionError)


def test_invalid_utf8_text_is_refused_when_loading(tmp_path):
    path = tmp_path / "latin.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("bad", data=[b"ok", b"caf\xe9"], dtype=h5py.string_dtype("ascii"))
        f.create_dataset("cut", data=[b"ok", b"\xc3", b"\xa9"], dtype=h5py.string_dtype())
    with pytest.raises(OSError, match=r"'bad'.*row 1 is not valid UTF-8") as info:
        HDF5Dataset(path, "bad")
    assert isinstance(info.value, sd.SourceReadError)
    with pytest.raises(OSError, match="row 1 is not valid UTF-8"):  # each row, not the whole
        HDF5Dataset(path, "cut")


def test_gzip_chunks_are_inflated_in_threads(tmp_path, monkeypatch):
    # Note [Inflating chunks in threads]: same values as h5py, for every chunk shape
    # and byte order; shuffle and chunks never written go through read_direct
    rng = np.random.default_rng(3)
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        kw = {"compression": "gzip"}
        f.create_dataset("a", data=np.arange(1000.0).reshape(100, 10), chunks=(7, 3), **kw)
        f.create_dataset("b", data=rng.random((100, 4, 5)).astype(">f4"), chunks=(9, 4, 2), **kw)
        f.create_dataset(
            "c", data=rng.integers(-999, 999, 100).astype("<i2"), chunks=(16,), shuffle=True, **kw
        )
        f.create_dataset("d", data=rng.random((100, 3)), chunks=(100, 3), shuffle=True, **kw)
        partial = f.create_dataset("e", shape=(100,), dtype="f4", chunks=(10,), fillvalue=7, **kw)
        partial[:35] = 1
    decoded, threads = [], set()
    real_decode = _hdf5_chunks._decode

    def decode(raw, mask):
        decoded.append(mask)
        threads.add(threading.get_ident())
        return real_decode(raw, mask)

    monkeypatch.setattr(_hdf5_chunks, "_decode", decode)
    monkeypatch.setattr(_hdf5_chunks, "_INFLATE_THREADS", 3)
    ds = HDF5Dataset(path)
    batch = ds[:]
    with h5py.File(path) as f:
        for key in "abcde":
            np.testing.assert_array_equal(batch[key].numpy(), f[key][()])
            assert batch[key].numpy().dtype == f[key].dtype.newbyteorder("=")
    assert len(decoded) == 15 * 4 + 12 * 3  # a, b; c, d (shuffle) and e by read_direct
    assert threading.get_ident() not in threads and len(threads) > 1


def test_unfiltered_chunks_are_read_by_read_direct_without_the_chunk_cache(tmp_path, monkeypatch):
    # Note [Reading HDF5 chunks once]: every chunk shape, a last chunk past the end, one
    # chunk larger than the dataset, big-endian ones, chunks never written: read_direct
    # on a dataset handle whose chunk cache holds 0 bytes, same values as h5py
    path = tmp_path / "chunked.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.arange(1030.0).reshape(103, 10), chunks=(8, 10))
        f.create_dataset("b", data=np.arange(103, dtype=">i4"), chunks=(16,))
        f.create_dataset("c", data=np.arange(103 * 6, dtype=np.int16).reshape(103, 2, 3),
                         chunks=(500, 2, 3), maxshape=(None, 2, 3))  # fmt: skip
        f.create_dataset("split", data=np.arange(1030.0).reshape(103, 10), chunks=(8, 5))
        partial = f.create_dataset("partial", shape=(103,), dtype="f4", chunks=(10,), fillvalue=7)
        partial[:35] = 1
    caches = {}
    real = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        caches[self.name] = self.id.get_access_plist().get_chunk_cache()[1]  # bytes
        return real(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    batch = HDF5Dataset(path)[:]
    with h5py.File(path) as f:
        for key in ["a", "b", "c", "split", "partial"]:
            np.testing.assert_array_equal(batch[key].numpy(), f[key][()])
    assert caches == dict.fromkeys(["/a", "/b", "/c", "/split", "/partial"], 0)


def test_contiguous_datasets_with_a_user_block_unwritten_or_big_endian(tmp_path):
    # a user block shifts every offset; an unwritten dataset has no offset, a
    # big-endian one is swapped; a file cut inside the data is a named error
    path = tmp_path / "ub.h5"
    with h5py.File(path, "w", userblock_size=1024) as f:
        f["x"] = np.arange(4000, dtype=">f8").reshape(1000, 4)
        f["y"] = np.arange(1000, dtype=np.uint16)
        f.create_dataset("unwritten", shape=(1000,), dtype=np.float32, fillvalue=2.5)
    ds = HDF5Dataset(path, ["x", "y", "unwritten"], output="tuple")
    batch = ds[:]
    np.testing.assert_array_equal(batch[0].numpy(), np.arange(4000.0).reshape(1000, 4))
    np.testing.assert_array_equal(batch[1].numpy(), np.arange(1000, dtype=np.uint16))
    assert batch[0].dtype == torch.float64 and (batch[2] == 2.5).all()
    with h5py.File(path) as f:
        end = f["x"].id.get_offset() + 3000 * 8  # inside x's data
    gc.collect()
    fds = open_fds()
    source = HDF5Source(path, "x")  # HDF5 checks the length at open: cut the file after
    os.truncate(path, end)
    with pytest.raises(OSError, match=r"ub\.h5: dataset 'x' ended early.*truncated") as info:
        build(source, progress=False)
    assert isinstance(info.value, sd.SourceReadError)
    del info, source
    gc.collect()
    assert open_fds() == fds


def test_garbage_truncated_and_corrupt_files(tmp_path):
    (tmp_path / "garbage.h5").write_bytes(b"definitely not hdf5" * 100)
    with pytest.raises(OSError, match=r"garbage\.h5 is not a readable HDF5 file") as info:
        HDF5Dataset(tmp_path / "garbage.h5")
    assert isinstance(info.value, sd.SourceReadError)

    path = tmp_path / "full.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(100_000, dtype=np.float64)
    data = path.read_bytes()
    (tmp_path / "truncated.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=r"truncated\.h5"):
        HDF5Dataset(tmp_path / "truncated.h5")

    path = tmp_path / "corrupt.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("z", data=np.arange(100_000.0), chunks=(10_000,), compression="gzip")
        info_chunk = ds.id.get_chunk_info(3)
    data = bytearray(path.read_bytes())
    start = info_chunk.byte_offset
    data[start : start + info_chunk.size] = b"\xff" * info_chunk.size
    path.write_bytes(bytes(data))
    gc.collect()
    fds = open_fds()
    with pytest.raises(OSError, match=r"corrupt\.h5: reading dataset 'z' failed") as info:
        HDF5Dataset(path)
    assert isinstance(info.value, sd.SourceReadError)
    del info
    gc.collect()
    assert open_fds() == fds


@pytest.mark.parametrize("field", ["address", "size"])
def test_a_corrupt_chunk_index_names_file_and_dataset(tmp_path, field):
    path = tmp_path / "index.h5"
    with h5py.File(path, "w") as f:  # a version 1 B-tree: each chunk's key, then its address
        data = np.arange(40_000.0).reshape(4000, 10)
        f.create_dataset("x", data=data, chunks=(1000, 10), compression="gzip")
        chunk = f["x"].id.get_chunk_info(2)
    key = struct.pack("<IIQQQQ", chunk.size, 0, 2000, 0, 0, chunk.byte_offset)
    if field == "address":  # beyond what os.pread takes (was a raw OverflowError)
        bad = struct.pack("<IIQQQQ", chunk.size, 0, 2000, 0, 0, chunk.byte_offset ^ 0xFFFF << 48)
    else:  # 4 GiB: os.pread would allocate it all first
        bad = struct.pack("<IIQQQQ", 0xFFFF_FFF0, 0, 2000, 0, 0, chunk.byte_offset)
    raw = path.read_bytes()
    assert raw.count(key) == 1
    path.write_bytes(raw.replace(key, bad))
    gc.collect()
    fds = open_fds()
    with pytest.raises(OSError, match=r"index\.h5: reading dataset 'x' failed.*index") as info:
        HDF5Dataset(path, progress=False)
    assert isinstance(info.value, sd.SourceReadError) and "outside the file" in str(info.value)
    del info
    gc.collect()
    assert open_fds() == fds


def test_missing_h5py_says_how_to_install(h5path, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ImportError, match=r"pip install 'torch-shareddata\[hdf5\]'") as info:
        HDF5Dataset(h5path)
    assert isinstance(info.value, sd.SharedDataError)


def test_shareddata_imports_without_h5py():
    code = (
        "import sys; sys.modules['h5py'] = None\n"
        "import shareddata, shareddata.sources.hdf5 as m\n"
        "try:\n    m.HDF5Source('x.h5')\nexcept ImportError as e:\n    print('OK', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "OK" in run.stdout and "torch-shareddata[hdf5]" in run.stdout


@pytest.mark.parametrize(
    "code, fix",
    [
        (32001, r"'blosc'.*pip install hdf5plugin"),
        (305, r"LZO filter \(hdf5plugin has none\).*ptrepack"),
        (40000, r"plugin of filter id 40000.*HDF5_PLUGIN_PATH"),
    ],
    ids=["blosc", "lzo", "unknown"],
)
def test_unavailable_filter_says_where_to_get_it(tmp_path, code, fix):
    path = tmp_path / "filtered.h5"
    with h5py.File(path, "w") as f:
        f["ok"] = np.arange(8)
        x = f.create_dataset(
            "x", (8,), "f4", chunks=(4,), compression=code, allow_unknown_filter=True
        )  # HDF5 accepts a filter it does not have as optional; a chunk stored through it:
        x.id.write_direct_chunk((0,), b"bytes the filter made", filter_mask=0)
    if code == 32001:  # as PyTables names it
        fix = fix.replace("'blosc'", r"'(blosc|unnamed)'")
    with pytest.raises(ImportError, match=r"'x'.*" + fix) as info:
        HDF5Dataset(path)
    assert isinstance(info.value, sd.MissingDependencyError)
    assert HDF5Dataset(path, "ok").columns == ["ok"]


def test_failure_halfway_frees_everything(h5path, monkeypatch):
    real = HDF5Source.read
    calls = []

    def failing_read(self, spec, buffers, progress):
        calls.append(spec.name)
        if len(calls) == 2:
            raise RuntimeError("disk went away")
        return real(self, spec, buffers, progress)

    monkeypatch.setattr(HDF5Source, "read", failing_read)
    gc.collect()
    fds = open_fds()
    with pytest.raises(RuntimeError, match="disk went away"):
        HDF5Dataset(h5path, ["images", "text", "ragged"])
    gc.collect()
    assert calls == ["images", "text"]
    assert open_fds() == fds
    assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == 0  # file closed


# -- errors that name the real cause -------------------------------------------------------


def _writer(path, code):
    """A process that runs ``code`` (with ``f`` open on ``path``) and then waits."""
    script = (
        "import sys, h5py, numpy as np\n"
        f"{code}\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"  # until the test closes our stdin
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HDF5_USE_FILE_LOCKING": "TRUE"},
    )
    ready = threading.Timer(60, proc.kill)  # a bound on the wait for its line
    ready.start()
    line = proc.stdout.readline()
    ready.cancel()
    assert line == "ready\n", "the writer process did not start"
    return proc


def _stop(proc, kill=False):
    if kill:
        proc.kill()
    proc.stdin.close()  # the writer's end: it closes the file and exits
    proc.wait(timeout=60)
    proc.stdout.close()


def test_file_held_by_a_writer_says_so_and_how_to_read_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    path = tmp_path / "live.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(10)
    writer = _writer(path, f"f = h5py.File({str(path)!r}, 'a')")
    try:
        with pytest.raises(OSError, match=r"locked by another process") as info:
            HDF5Dataset(path)
        message = str(info.value)
        assert "swmr_mode" in message and "HDF5_USE_FILE_LOCKING=FALSE" in message
        assert "close the file in the writer" in message and "corrupt" not in message
        assert isinstance(info.value, sd.SourceReadError)
    finally:
        _stop(writer)
    assert HDF5Dataset(path)[9]["x"] == 9  # the writer closed it: it loads

    # a SWMR writer: read as a SWMR reader, while the writer keeps the file open
    code = (
        f"f = h5py.File({str(path)!r}, 'w', libver='latest')\n"
        "f['x'] = np.arange(6.0); f['s'] = np.array([b'ab'] * 6)\n"
        "f.swmr_mode = True; f.flush()"
    )
    writer = _writer(path, code)
    try:
        ds = HDF5Dataset(path, progress=False)
        assert ds.columns == ["s", "x"] and ds[5]["x"] == 5.0 and ds[0]["s"] == b"ab"
    finally:
        _stop(writer, kill=True)  # leaves the consistency flags set, as a crash would

    # a writer without SWMR that crashed: the flags stay; h5clear clears them
    writer = _writer(path, f"f = h5py.File({str(path)!r}, 'w', libver='latest'); f.flush()")
    _stop(writer, kill=True)
    with pytest.raises(OSError, match=r"marked as open for writing.*h5clear -s") as info:
        HDF5Dataset(path)
    assert "corrupt" not in str(info.value)


_NOBODY = 65534


def test_unreadable_file_or_folder_says_permission_denied():
    with tempfile.TemporaryDirectory() as top:  # pytest's tmp_path is in a root-only folder
        try:
            _check_permissions(Path(top))
        finally:  # so that the folder can be removed
            if (Path(top) / "closed").exists():
                os.chmod(Path(top) / "closed", 0o755)


def _open_as_nobody(paths, send):
    """In a forked child: drop root (which reads everything), open each path."""
    if os.geteuid() == 0:
        os.setuid(_NOBODY)
    lines = []
    for path in paths:
        try:
            HDF5Source(path)
        except OSError as e:
            lines.append(f"{type(e).__name__} {e}")
    send.send(lines)
    send.close()


def _check_permissions(tmp_path):
    folder = tmp_path / "closed"
    folder.mkdir()
    with h5py.File(folder / "data.h5", "w") as f:
        f["x"] = np.arange(3)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    with h5py.File(open_dir / "data.h5", "w") as f:
        f["x"] = np.arange(3)
    os.chmod(open_dir / "data.h5", 0)  # (root's child drops to nobody, who reads neither)
    for p in (tmp_path, open_dir):
        os.chmod(p, 0o755)
    os.chmod(folder, 0)
    ctx = multiprocessing.get_context("fork")  # no new interpreter: a second at most
    receive, send = ctx.Pipe(duplex=False)
    paths = [str(open_dir / "data.h5"), str(folder / "data.h5")]
    child = ctx.Process(target=_open_as_nobody, args=(paths, send))
    child.start()
    send.close()
    assert receive.poll(60), "the child did not answer"
    lines = receive.recv()
    child.join(timeout=60)
    receive.close()
    assert len(lines) == 2, lines
    assert lines[0].startswith("SourceReadError") and "permission denied (owner uid" in lines[0]
    assert "chmod a+r" in lines[0]
    assert "permission denied on a folder of its path" in lines[1]
    assert not any("corrupt" in line or "does not exist" in line for line in lines)


def test_a_file_on_a_full_disk_loads(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        path = mount / "data.h5"
        with h5py.File(path, "w") as f:
            f["x"] = np.arange(1000, dtype=np.int32)
            f.create_dataset("s", data=["a", "bc"] * 500, dtype=h5py.string_dtype())
        with open(mount / "filler", "wb") as filler, pytest.raises(OSError):
            while True:  # until the file system is full
                filler.write(b"\0" * 65536)
                filler.flush()
        ds = HDF5Dataset(path, progress=False)
        assert ds[999]["x"] == 999 and ds[1]["s"] == "bc"
        with pytest.raises(MemoryError) as info:  # shared storage there: no room
            HDF5Dataset(path, storage_dir=mount, progress=False)
        assert "corrupt" not in str(info.value)
    finally:
        gc.collect()
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


# -- records, enums, frames ------------------------------------------------------------------


def test_compound_fields_by_key_and_in_small_blocks(tmp_path, monkeypatch):
    color = h5py.enum_dtype({"red": 0, "green": 1, "blue": 2}, basetype=">i2")
    dtype = np.dtype([("a", "<i4"), ("pos", [("lat", ">f8"), ("c", color)]), ("m", "<f4", (2, 2))])
    rec = np.zeros(100, dtype)
    rec["a"], rec["pos"]["lat"] = np.arange(100), np.arange(100) / 4
    rec["pos"]["c"], rec["m"] = np.arange(100) % 3, np.arange(400).reshape(100, 2, 2)
    path = tmp_path / "rec.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("rec", data=rec, chunks=(8,), compression="gzip")
    monkeypatch.setattr(hdf5, "_CHUNK", 100)  # blocks of a chunk (8 rows): same values
    with pytest.raises(ValueError, match=r"'rec/m' .* selected twice \(twice from 'rec'"):
        HDF5Dataset(path, ["rec/m", "rec"])
    ds = HDF5Dataset(path, ["rec/pos/c", "/rec/m", "rec/a", "rec/pos/lat"], progress=False)
    assert ds.columns == ["rec/pos/c", "rec/m", "rec/a", "rec/pos/lat"]
    assert HDF5Dataset(path).columns == ["rec/a", "rec/pos/lat", "rec/pos/c", "rec/m"]
    batch = ds[list(range(100))]
    np.testing.assert_array_equal(batch["rec/pos/c"].numpy(), rec["pos"]["c"])
    assert batch["rec/pos/c"].dtype == torch.int16 and batch["rec/m"].shape == (100, 2, 2)
    np.testing.assert_array_equal(batch["rec/m"].numpy(), rec["m"])
    np.testing.assert_array_equal(batch["rec/pos/lat"].numpy(), rec["pos"]["lat"])
    assert ds.labels == {"rec/pos/c": {"red": 0, "green": 1, "blue": 2}}
    assert pickle.loads(pickle.dumps(ds)).labels == ds.labels  # what spawn workers get
    with pytest.raises(KeyError, match=r"'rec/pos' has no field 'x'.*'lat', 'c'") as info:
        HDF5Dataset(path, ["rec/pos/x"])
    assert isinstance(info.value, sd.SharedDataError)


def test_two_pandas_frames_with_one_column_name(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "two.h5"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTables' own warnings
        pd.DataFrame({"x": np.arange(5)}).to_hdf(path, key="train", format="table")
        pd.DataFrame({"x": np.arange(5.0)}).to_hdf(path, key="test", format="table")
    with pytest.raises(ValueError, match=r"'x' of .* is selected twice.*'test/table'") as info:
        HDF5Dataset(path)
    assert isinstance(info.value, sd.SharedDataError)
    ds = HDF5Dataset(path, "train", progress=False)
    assert ds.columns == ["x"] and ds[4]["x"] == 4 and len(ds) == 5


def test_fields_of_records_are_read_by_hdf5(tmp_path):
    # contiguous, chunked (a last chunk past the end), gzip and vlen records: HDF5
    # converts each field straight into its column
    dtype = np.dtype([("a", ">i4"), ("p", [("x", "<f8"), ("ok", "?")]), ("v", "<u2", (3,))])
    rec = np.zeros(103, dtype)
    rec["a"], rec["p"]["x"], rec["p"]["ok"] = np.arange(103), np.arange(103) / 8, True
    rec["v"] = np.arange(309).reshape(103, 3)
    with_text = np.dtype(dtype.descr + [("t", h5py.string_dtype())])
    path = tmp_path / "raw.h5"
    with h5py.File(path, "w") as f:
        f["flat"] = rec
        f.create_dataset("chunked", data=rec, chunks=(10,), maxshape=(None,))
        f.create_dataset("gz", data=rec, chunks=(10,), compression="gzip")
        text = f.create_dataset("text", (103,), with_text)
        text[:] = [(*r.tolist(), "é") for r in rec]
    ds = HDF5Dataset(path, progress=False)
    batch = ds[list(range(103))]
    for key in ("flat", "chunked", "gz", "text"):
        np.testing.assert_array_equal(batch[f"{key}/a"].numpy(), rec["a"])
        np.testing.assert_array_equal(batch[f"{key}/p/x"].numpy(), rec["p"]["x"])
        assert batch[f"{key}/p/ok"].dtype == torch.bool and bool(batch[f"{key}/p/ok"].all())
        np.testing.assert_array_equal(batch[f"{key}/v"].numpy(), rec["v"])
    assert batch["text/t"] == ["é"] * 103

    with h5py.File(path) as f:
        end = f["flat"].id.get_offset() + 50 * dtype.itemsize
    gc.collect()
    fds = open_fds()
    source = HDF5Source(path, "flat/p/x")
    os.truncate(path, end)  # HDF5 checks the length at open: cut the file after
    with pytest.raises(OSError, match=r"'flat' ended early.*truncated") as info:
        build(source, progress=False)
    assert isinstance(info.value, sd.SourceReadError)
    del info, source
    gc.collect()
    assert open_fds() == fds


def test_a_range_of_rows_for_shard_node(h5path, tmp_path):
    """``select_rows`` (what shard="node" calls): every reader reads only those rows."""
    rec = np.zeros(300, [("a", ">i4"), ("t", "S3"), ("v", "<f4", (2,))])
    rec["a"], rec["t"], rec["v"] = np.arange(300), b"ab", np.arange(600).reshape(300, 2)
    records = tmp_path / "records.h5"
    with h5py.File(records, "w") as f:
        f["flat"] = rec  # raw records
        f.create_dataset("gz", data=rec, chunks=(32,), compression="gzip")  # through HDF5
    for path in (h5path, records):
        full = HDF5Dataset(path, progress=False)
        source = HDF5Source(path)
        assert source.total_rows() == 300
        source.select_rows(37, 211)
        part = build(source, share="process", progress=False)
        assert list(part) == full.columns
        for name, column in part.items():
            assert len(column) == 174
            for i in (0, 1, 100, 173):
                _assert_same(column.get(i), full[37 + i][name])
    with HDF5Source(records) as source, pytest.raises(ValueError, match=r"\[0, 301\)"):
        source.select_rows(0, 301)


def _h5py_value(value):
    """h5py's reading of a record as a nested dict of plain values (what nested=True gives)."""
    if isinstance(value, np.void) and value.dtype.names:
        return {name: _h5py_value(value[name]) for name in value.dtype.names}
    if isinstance(value, bytes):
        return value  # fixed-length ascii loads as bytes
    return np.asarray(value).tolist()


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_nested_items_are_records_and_groups_as_h5py_reads_them(tmp_path):
    path = str(tmp_path / "nested.h5")
    inner = np.dtype([("q", np.int16), ("v", np.float32, (2,))])
    rec = np.zeros(20, dtype=[("x", np.float64), ("p", inner), ("tag", "S4")])
    rec["x"] = np.arange(20) / 4
    rec["p"]["q"] = np.arange(20) * 3
    rec["p"]["v"] = np.arange(40).reshape(20, 2)
    rec["tag"] = [b"t%d" % i for i in range(20)]
    with h5py.File(path, "w") as f:
        f["rec"] = rec
        f["grp/label"] = np.arange(20, dtype=np.int32) - 5
    ds = HDF5Dataset(path, nested=True, progress=False)
    assert ds.columns == ["grp/label", "rec/x", "rec/p/q", "rec/p/v", "rec/tag"]
    with h5py.File(path) as f:
        want = [
            {"grp": {"label": int(f["grp/label"][i])}, "rec": _h5py_value(f["rec"][i])}
            for i in range(20)
        ]
    assert [_plain(ds[i]) for i in range(20)] == want
    assert [_plain(s) for s in ds.__getitems__([7, 3])] == [want[7], want[3]]
    loader = DataLoader(ds, batch_size=4, num_workers=1, timeout=60)
    batch = next(iter(loader))  # from a worker, through the default collate's shortcut
    assert batch["rec"]["p"]["v"].tolist() == [w["rec"]["p"]["v"] for w in want[:4]]
    assert batch["rec"]["tag"] == [w["rec"]["tag"] for w in want[:4]]
    assert batch["grp"]["label"].tolist() == [-5, -4, -3, -2]
    assert list(HDF5Dataset(path, progress=False)[0]) == ds.columns  # flat by default
    picked = HDF5Dataset(path, ["rec/p"], nested=True, output="tuple", progress=False)
    (p,) = picked[1]
    assert _plain(p) == {"p": want[1]["rec"]["p"]}


def test_nested_paths_that_clash_are_refused_before_loading(tmp_path, monkeypatch):
    """A field named "b/c" next to a field "b": nested=True has no place for both."""
    path = tmp_path / "clash.h5"
    with h5py.File(path, "w") as f:
        f["rec"] = np.zeros(5, dtype=[("b", np.int64), ("b/c", np.int64)])
    loads = []
    load_here = build.__globals__["_load_here"]
    monkeypatch.setitem(
        build.__globals__, "_load_here", lambda *a: loads.append(a) or load_here(*a)
    )
    with pytest.raises(ValueError, match=r"cannot place column 'rec/b/c'.*'rec/b'") as info:
        HDF5Dataset(path, nested=True, progress=False)
    assert isinstance(info.value, sd.SharedDataError) and loads == []
    assert len(HDF5Dataset(path, progress=False)) == 5  # flat names do not clash; file closed


def test_packing_attributes_outside_netcdf_are_named(tmp_path):
    """h5py-written codes with scale_factor/add_offset: loaded as stored, with a warning."""
    path = tmp_path / "packed.h5"
    with h5py.File(path, "w") as f:
        t2m = f.create_dataset("t2m", data=np.arange(10, dtype=np.int16))
        t2m.attrs["scale_factor"], t2m.attrs["add_offset"] = 0.5, 273.0
        f["plain"] = np.arange(10)
    with pytest.warns(UserWarning, match=r"'t2m' carries .*scale_factor.* not netCDF") as caught:
        ds = HDF5Dataset(path, progress=False)
    assert ds.specs["t2m"].dtype == np.int16 and ds[3]["t2m"] == 3  # the codes
    assert len(caught) == 1 and "'plain'" not in str(caught[0].message)


def test_contiguous_datasets_are_copied_by_the_kernel_and_read_right(tmp_path, monkeypatch):
    # a contiguous dataset stored as the buffer's bytes goes by sendfile from its offset
    # (a userblock before it), never through the page threads; one stored big-endian or
    # never written (its fill value) goes through h5py, and each reads right
    from shareddata.storage import _pages, _segment

    populated = []

    def population(address, size, *args, **kwargs):
        populated.append(size)
        return _pages.Population(address, size, *args, **kwargs)

    monkeypatch.setattr(_segment, "Population", population)
    path = tmp_path / "c.h5"
    x = np.arange(1 << 22, dtype=np.float32).reshape(-1, 4)
    with h5py.File(path, "w", userblock_size=512) as f:
        f["x"] = x
        f["be"] = np.arange(1 << 20, dtype=">i4").reshape(-1, 4)
        f.create_dataset("unwritten", (1 << 18, 4), "f8", fillvalue=3.0)
    ds = HDF5Dataset(path, columns=["x"])
    assert populated == []  # no page was written through the mapping
    assert np.array_equal(ds[:]["x"].numpy(), x)
    both = HDF5Dataset(path, columns=["be", "unwritten"])
    assert populated  # these were
    assert np.array_equal(both[:]["be"].numpy(), np.arange(1 << 20).reshape(-1, 4))
    assert (both[:]["unwritten"].numpy() == 3.0).all()
    source = HDF5Source(path, ["x"])
    source.select_rows(1000, 3000)  # a node's share: the copy starts at its first row
    part = build(source, share="process", progress=False)
    assert np.array_equal(part["x"].arrays["data"].numpy(), x[1000:3000])
