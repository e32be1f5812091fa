import errno
import gc
import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from conftest import START_METHODS, open_fds, run_isolated
from torch.utils.data import DataLoader, default_collate

import shareddata as sd


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((257, 3, 4)).astype(np.float32),
        "y": rng.integers(0, 10, 257).astype(np.int32),
        "m": rng.random(257) > 0.5,
    }


def _assert_sample(sample, arrays, i):
    for name, array in arrays.items():
        value = sample[name]
        assert isinstance(value, torch.Tensor)
        assert value.shape == array.shape[1:]
        np.testing.assert_array_equal(value.numpy(), array[i])
        assert value.numpy().dtype == array.dtype


def test_sources_npy_npz_folder_mapping_array(tmp_path, arrays):
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)
    for source in [
        tmp_path / "plain.npz",
        str(tmp_path / "packed.npz"),
        {k: tmp_path / f"{k}.npy" for k in arrays},
        {"x": arrays["x"], "y": tmp_path / "y.npy", "m": torch.from_numpy(arrays["m"])},
    ]:
        ds = sd.NumpyDataset(source)
        assert len(ds) == 257 and sorted(ds.columns) == sorted(arrays)
        for i in (0, 100, 256, -1):
            _assert_sample(ds[i], arrays, i)
    folder = sd.NumpyDataset(tmp_path)  # .npy files in sorted order, named by stem
    assert folder.columns == ["m", "x", "y"]
    single = sd.NumpyDataset(tmp_path / "x.npy")
    assert single.columns == ["x"]
    assert sd.NumpyDataset(arrays["y"]).columns == ["data"]
    assert folder.nbytes == sum(a.nbytes for a in arrays.values())


def test_column_subset_in_the_order_asked(arrays):
    ds = sd.NumpyDataset(arrays, columns=["y", "x"], output="tuple")
    y, x = ds[5]
    assert int(y) == arrays["y"][5] and x.shape == (3, 4)


def test_fortran_order_and_big_endian_files(tmp_path):
    a = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(4, 6))
    np.save(tmp_path / "f.npy", a)
    b = np.arange(10, dtype=">i8")
    np.save(tmp_path / "b.npy", b)
    ds = sd.NumpyDataset({"f": tmp_path / "f.npy", "b": tmp_path / "b.npy"}, columns=["f"])
    np.testing.assert_array_equal(ds[[0, 1, 2, 3]]["f"].numpy(), a)
    ds = sd.NumpyDataset(tmp_path / "b.npy")
    assert ds[3]["b"].item() == 3 and ds[3]["b"].dtype == torch.int64


def test_scalar_columns_give_0d_tensors_and_dtypes_stay(arrays):
    ds = sd.NumpyDataset(arrays)
    s = ds[7]
    assert s["y"].ndim == 0 and s["y"].dtype == torch.int32
    assert s["m"].dtype == torch.bool


def test_indexing_and_batches(arrays):
    ds = sd.NumpyDataset(arrays)
    with pytest.raises(IndexError, match="257"):
        ds[257]
    with pytest.raises(IndexError):
        ds[-258]
    with pytest.raises(IndexError):
        ds.__getitems__([1, 300])
    idx = [5, -1, 0, 5]
    items = ds.__getitems__(idx)
    for got, i in zip(items, idx):
        _assert_sample(got, arrays, i)
    batch = ds[idx]
    for name, a in arrays.items():
        np.testing.assert_array_equal(batch[name].numpy(), a[idx])
    np.testing.assert_array_equal(ds[10:20]["y"].numpy(), arrays["y"][10:20])
    np.testing.assert_array_equal(ds[torch.tensor([3, 4])]["x"].numpy(), arrays["x"][[3, 4]])
    assert list(iter(ds))[-1]["y"] == arrays["y"][-1]


def test_samples_are_copies_and_the_data_is_read_only(arrays):
    ds = sd.NumpyDataset(arrays)
    s = ds[0]
    s["x"].fill_(1000)
    assert float(ds[0]["x"][0, 0]) == arrays["x"][0, 0, 0]
    batch = ds[[0, 1]]
    batch["x"].zero_()
    assert float(ds[1]["x"][0, 0]) == arrays["x"][1, 0, 0]
    column = ds._columns["x"].arrays["data"].numpy()
    with pytest.raises(ValueError, match="read-only"):
        column[0] = 0


def test_output_tuple_and_transform(arrays):
    ds = sd.NumpyDataset(arrays, columns=["x", "y"], output="tuple", transform=_double_x)
    x, y = ds[3]
    np.testing.assert_allclose(x.numpy(), 2 * arrays["x"][3])
    items = ds.__getitems__([3, 4])
    np.testing.assert_allclose(items[1][0].numpy(), 2 * arrays["x"][4])
    with pytest.raises(ValueError, match="output"):
        sd.NumpyDataset(arrays, output="list")


def _double_x(sample):
    x, y = sample
    return x * 2, y


def test_pickled_size_does_not_grow_with_rows():
    small = sd.NumpyDataset({"a": np.zeros((10, 4), np.float32), "b": np.zeros(10)})
    big = sd.NumpyDataset({"a": np.zeros((1_000_000, 4), np.float32), "b": np.zeros(1_000_000)})
    assert len(pickle.dumps(big)) < 2000
    assert abs(len(pickle.dumps(big)) - len(pickle.dumps(small))) < 32
    back = pickle.loads(pickle.dumps(big))
    assert len(back) == 1_000_000 and back.columns == ["a", "b"]


def _reference_batches(arrays, batch_size, columns):
    n = len(next(iter(arrays.values())))
    samples = [{c: torch.from_numpy(np.array(arrays[c][i])) for c in columns} for i in range(n)]
    return [default_collate(samples[i : i + batch_size]) for i in range(0, n, batch_size)]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_batches_equal_per_sample_batches(arrays, method, persistent):
    ds = sd.NumpyDataset(arrays)
    loader = DataLoader(
        ds,
        batch_size=32,
        num_workers=2,
        multiprocessing_context=method,
        persistent_workers=persistent,
    )
    expected = _reference_batches(arrays, 32, ds.columns)
    for _epoch in range(2 if persistent else 1):
        got = list(loader)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.keys() == e.keys()
            for k in e:
                assert g[k].dtype == e[k].dtype
                torch.testing.assert_close(g[k], e[k], rtol=0, atol=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_index_batch_sampler_fast_path(arrays, num_workers):
    ds = sd.NumpyDataset(arrays)
    sampler = sd.IndexBatchSampler(ds, 32, shuffle=True, seed=3)
    ctx = "spawn" if num_workers else None
    loader = DataLoader(
        ds, sampler=sampler, batch_size=None, num_workers=num_workers, multiprocessing_context=ctx
    )
    seen = []
    for batch in loader:
        assert batch["x"].shape[1:] == (3, 4) and batch["y"].dtype == torch.int32
        seen.append(batch["y"])
    assert len(seen) == len(sampler) == 9
    assert sorted(torch.cat(seen).tolist()) == sorted(arrays["y"].tolist())
    first = [b["y"].tolist() for b in loader]
    sampler.set_epoch(0)
    assert [b.tolist() for b in sampler] == [b.tolist() for b in sampler]  # epoch fixed
    assert first != [b.tolist() for b in seen]  # a new order each pass without set_epoch
    assert len(sd.IndexBatchSampler(10, 4, drop_last=True)) == 2


def test_torch_multiprocessing_pool():
    import torch.multiprocessing as tmp

    ds = sd.NumpyDataset(np.arange(100, dtype=np.int64))
    with tmp.get_context("spawn").Pool(2) as pool:
        assert pool.map(_item, [(ds, 5), (ds, 99)]) == [5, 99]


def _item(args):
    ds, i = args
    return int(ds[i]["data"])


# -- errors ------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.npy") as info:
        sd.NumpyDataset(tmp_path / "nope.npy")
    assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(FileNotFoundError, match="no .npy files"):
        sd.NumpyDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="gone.npy"):
        sd.NumpyDataset({"a": tmp_path / "gone.npy"})


def test_missing_column_lists_what_exists(arrays):
    with pytest.raises(KeyError, match="'z' is not in.*'x', 'y', 'm'") as info:
        sd.NumpyDataset(arrays, columns=["x", "z"])
    assert isinstance(info.value, sd.SharedDataError)


def test_columns_of_different_lengths():
    with pytest.raises(ValueError, match=r"'a': 3 rows, 'b': 4 rows"):
        sd.NumpyDataset({"a": np.zeros(3), "b": np.zeros(4)})


@pytest.mark.parametrize(
    "array, hint",
    [
        (np.array([{"a": 1}, None], dtype=object), "SharedList"),
        (np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]), "one column per field"),
        (np.array(["ab", "c"]), "strings"),
        (np.zeros(3, dtype="datetime64[s]"), "int64"),
        (np.float32(3.0), "0-d"),
    ],
    ids=["object", "structured", "unicode", "datetime", "0-d"],
)
def test_unsupported_dtypes_say_what_to_do(array, hint):
    with pytest.raises(TypeError, match=hint) as info:
        sd.NumpyDataset({"col": array})
    assert "'col'" in str(info.value)
    assert isinstance(info.value, sd.SharedDataError)


def test_object_npy_file(tmp_path):
    np.save(tmp_path / "o.npy", np.array([[1], "x"], dtype=object), allow_pickle=True)
    with pytest.raises(TypeError, match="object"):
        sd.NumpyDataset(tmp_path / "o.npy")


@pytest.mark.parametrize(
    "source, hint",
    [(42, ""), (None, ""), ([1, 2, 3], "np.asarray"), (np.float32(3), "numpy scalar has no rows")],
    ids=["int", "None", "list", "numpy-scalar"],
)
def test_source_of_a_wrong_type_is_an_argument_type_error(source, hint):
    name = type(source).__name__
    with pytest.raises(TypeError, match=rf"source=.* \(type {name}\); pass a \.npy") as info:
        sd.NumpyDataset(source)
    assert isinstance(info.value, sd.ArgumentTypeError) and hint in str(info.value)
    with pytest.raises(TypeError, match=r"columns=5 \(type int\) for .* is not a column") as info:
        sd.NumpyDataset({"a": np.arange(3)}, columns=5)
    assert isinstance(info.value, sd.ArgumentTypeError)


def test_truncated_and_garbage_files(tmp_path):
    np.save(tmp_path / "t.npy", np.zeros((1000, 10), np.float32))
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=r"t\.npy is truncated"):
        sd.NumpyDataset(tmp_path / "t.npy")
    (tmp_path / "g.npy").write_bytes(b"not numpy at all" * 10)
    with pytest.raises(OSError, match=r"g\.npy is not a valid \.npy"):
        sd.NumpyDataset(tmp_path / "g.npy")
    (tmp_path / "g.npz").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(OSError, match=r"g\.npz"):
        sd.NumpyDataset(tmp_path / "g.npz")


def test_npz_with_a_damaged_central_directory_names_the_file(tmp_path):
    path = tmp_path / "cd.npz"
    np.savez(path, x=np.arange(1000.0), y=np.arange(1000))
    data = bytearray(path.read_bytes())
    entry = data.rindex(b"PK\x01\x02")  # y's central directory entry
    data[entry + 42 : entry + 46] = (len(data) - 10).to_bytes(4, "little")  # its local header
    path.write_bytes(bytes(data))
    gc.collect()
    fds = open_fds()
    with pytest.raises(OSError, match=r"cd\.npz is not a valid \.npz archive.*np\.savez") as info:
        sd.NumpyDataset(path)
    assert isinstance(info.value, sd.SourceReadError) and "y.npy" in str(info.value)
    del info
    gc.collect()
    assert open_fds() == fds


def test_failure_halfway_frees_everything(tmp_path, monkeypatch):
    from shareddata.sources import npy

    np.save(tmp_path / "a.npy", np.ones((1 << 20,), np.float32))
    np.save(tmp_path / "b.npy", np.ones((1 << 20,), np.float32))
    fds = open_fds()
    calls = []

    def failing_read(self, out, progress):
        calls.append(self.name)
        if len(calls) == 2:
            raise RuntimeError("disk went away")
        out[...] = 1

    monkeypatch.setattr(npy._NpyFile, "read", failing_read)
    with pytest.raises(RuntimeError, match="disk went away"):
        sd.NumpyDataset(tmp_path)
    gc.collect()
    assert calls == ["a", "b"]
    assert open_fds() == fds


def test_200_mib_dataset_in_a_64_mib_dev_shm():
    run = run_isolated(
        """
        import numpy as np, torch, shareddata as sd
        from torch.utils.data import DataLoader
        rows = 200 * 1024  # 200 MiB of 1 KiB rows
        ds = sd.NumpyDataset(np.arange(rows, dtype=np.int64)[:, None].repeat(128, 1))
        loader = DataLoader(ds, batch_size=512, num_workers=2, multiprocessing_context="spawn")
        total = sum(int(b["data"][:, 0].sum()) for b in loader)
        print("OK", ds.nbytes >> 20, total == rows * (rows - 1) // 2)
        """,
        shm_size="64m",
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "OK 200 True" in run.stdout
    assert run.leftovers == []


@pytest.mark.parametrize("method", START_METHODS)
def test_verify_passes_a_numpy_dataset_with_4_workers(method):
    ds = sd.NumpyDataset(np.ones((32768, 1024), np.float32))  # 128 MiB
    loader = DataLoader(
        ds, batch_size=256, shuffle=True, num_workers=4, multiprocessing_context=method
    )
    report = sd.verify(loader, batches=40, max_duplication=1.10)
    assert report.dataset_bytes == 128 << 20
    assert 0.9 < report.duplication <= 1.10
    assert len([p for p in report.processes if p.role.startswith("worker")]) == 4


def test_npy_data_is_copied_into_the_file_by_the_kernel_without_page_threads(tmp_path):
    # read_into over a segment: sendfile fills its file, so no page is populated through
    # the writable mapping (the seal's remap is then cheap) and every page is allocated
    from shareddata.storage import attached_segments

    nbytes = 96 << 20
    np.save(tmp_path / "x.npy", np.arange(nbytes // 4, dtype=np.float32))
    ds = sd.NumpyDataset(tmp_path / "x.npy")
    assert not [s for s in attached_segments() if s._population]
    assert not [t for t in threading.enumerate() if t.name == "shareddata-populate"]
    segment = ds._columns["x"].arrays["data"].segment
    assert os.fstat(segment.fd).st_blocks * 512 >= nbytes  # every page allocated
    assert np.array_equal(ds[:]["x"].numpy(), np.arange(nbytes // 4, dtype=np.float32))


def test_pages_are_allocated_ahead_of_the_writes_and_never_overtaken(tmp_path, monkeypatch):
    # Note [Filling while the pages are allocated]: threads allocate and map the segment
    # in address order while a source writes its first pages through the mapping (a
    # Fortran-order .npy is copied row block by row block); a write waits for its pages
    from shareddata.sources import _source, npy
    from shareddata.storage import _pages, attached_segments

    nbytes = 160 << 20
    np.save(tmp_path / "x.npy", np.asfortranarray(np.ones((nbytes // 16, 4), np.float32)))
    monkeypatch.setattr(npy, "_CHUNK", 16 << 20)
    writes, real_rows, real_populate = [], _source.Buffer.rows, _pages.Population._populate
    first_write = threading.Event()

    def populate(self, step):  # the steps after the first wait (bounded) for a first write,
        if step:  # so a busy machine cannot finish them all before it: a write that
            first_write.wait(10)  # waited for every page is then seen below
        return real_populate(self, step)

    def rows(self, start, stop):
        view = real_rows(self, start, stop)  # waits for the pages under the view
        (population,) = [s._population for s in attached_segments() if s._population]
        end = view.ctypes.data + view.nbytes - population.address
        writes.append((end, population._ready * _pages._POPULATE_STEP))
        first_write.set()
        return view

    monkeypatch.setattr(_pages.Population, "_populate", populate)
    monkeypatch.setattr(_source.Buffer, "rows", rows)
    ds = sd.NumpyDataset(tmp_path / "x.npy")
    assert len(writes) == 10
    assert all(end <= populated for end, populated in writes)  # never ahead of the pages
    assert any(populated < nbytes for _, populated in writes)  # writes did not wait for all
    assert not [s for s in attached_segments() if s._population]
    assert not [t for t in threading.enumerate() if t.name == "shareddata-populate"]
    segment = ds._columns["x"].arrays["data"].segment
    assert os.fstat(segment.fd).st_blocks * 512 >= nbytes  # every page allocated
    assert float(ds[:]["x"].sum()) == nbytes // 4


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_page_that_cannot_be_allocated_fails_the_load_cleanly(tmp_path, monkeypatch, order):
    # a C-order .npy is copied by sendfile (a full memory is its ENOSPC), a Fortran-order
    # one through the mapping after the page threads (their ENOMEM); both are refused
    from shareddata.storage import _pages

    data = np.ones(((128 << 20) // 16, 4), np.float32)
    np.save(tmp_path / "x.npy", np.asfortranarray(data) if order == "F" else data)
    real, real_sendfile, steps = _pages.madvise, os.sendfile, []

    def madvise(address, length, advice):  # memory runs out after three steps
        if advice == _pages.MADV_POPULATE_WRITE:
            steps.append(address)
            if len(steps) > 3:
                return errno.ENOMEM
        return real(address, length, advice)

    def sendfile(out_fd, in_fd, offset, count):  # the same, for the kernel's copy
        steps.append(offset)
        if len(steps) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_sendfile(out_fd, in_fd, offset, min(count, 32 << 20))

    monkeypatch.setattr(_pages, "madvise", madvise)
    monkeypatch.setattr(os, "sendfile", sendfile)
    gc.collect()
    fds = open_fds()
    with pytest.raises(sd.SharedMemoryFullError, match=r"x\.npy needs 128\.0 MiB"):
        sd.NumpyDataset(tmp_path / "x.npy")
    gc.collect()
    assert steps
    assert open_fds() == fds  # the segment is gone
    assert not [t for t in threading.enumerate() if t.name == "shareddata-populate"]


def test_populating_stops_every_thread_at_the_first_error(monkeypatch):
    from shareddata.storage import _pages

    calls = []

    def failing(address, length, advice):
        calls.append(address)
        time.sleep(0.01)
        return errno.ENOMEM

    monkeypatch.setattr(_pages, "madvise", failing)
    before = threading.active_count()
    assert _pages.populate(1 << 30, 16 * _pages._POPULATE_STEP, threads=4) == errno.ENOMEM
    assert threading.active_count() == before  # every helper has ended
    assert len(calls) <= 4  # each thread stopped after its first step


def test_a_segment_dropped_while_its_pages_are_allocated_stops_the_threads():
    from shareddata.storage import Segment, ready

    segment = Segment.create(256 << 20, ahead=True)
    segment.ready(1)  # the first write to come starts the threads
    assert segment._population is not None
    del segment
    gc.collect()
    deadline = time.monotonic() + 10  # the threads stop at their next step (32 MiB)
    while [t for t in threading.enumerate() if t.name == "shareddata-populate"]:
        assert time.monotonic() < deadline, "population threads still run"
        time.sleep(0.01)
    small = sd.SharedArray.empty(16, np.uint8)  # new mappings are not mistaken for it
    ready(small.numpy())


def test_an_empty_selection_names_what_exists(tmp_path):
    with pytest.raises(sd.EmptySelectionError, match="holds no columns") as err:
        sd.NumpyDataset({})
    assert isinstance(err.value, ValueError)
    np.save(tmp_path / "a.npy", np.arange(3))
    np.save(tmp_path / "b.npy", np.arange(3))
    with pytest.raises(sd.EmptySelectionError, match="columns=\\[\\].*'a', 'b'"):
        sd.NumpyDataset(tmp_path, columns=[])


@pytest.mark.parametrize("dtype", ["longdouble", "clongdouble"])
def test_extended_precision_is_refused_naming_the_column_before_loading(tmp_path, dtype):
    if np.dtype(dtype).itemsize <= (8 if dtype == "longdouble" else 16):
        pytest.skip(f"{dtype} is plain double precision on this platform")
    np.save(tmp_path / "wide.npy", np.zeros(4, dtype))
    for source in ({"ok": np.arange(4), "wide": np.zeros(4, dtype)}, tmp_path / "wide.npy"):
        with pytest.raises(sd.UnsupportedDtypeError, match="'wide'.*astype") as err:
            sd.NumpyDataset(source, progress=False)
        assert isinstance(err.value, TypeError)
