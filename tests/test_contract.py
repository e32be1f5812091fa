"""The contract every dataset kind keeps (SPEC "Every dataset"), checked for all six at once.

A capability that holds for one kind must hold for every kind: each test here is
parametrised over ``kinds.KINDS`` (NumpyDataset, HDF5Dataset, ParquetDataset,
ArrowDataset, SharedDataset, SharedList), and over the start methods where processes
are involved. A capability added to the library is added here once and is then
checked for every kind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from conftest import REPO, START_METHODS, torchrun_env
from kinds import (
    COLUMN_KINDS,
    KINDS,
    NESTED_KINDS,
    AllKinds,
    as_dict,
    assert_batch,
    assert_item,
    assert_nested,
    collated,
    make,
    make_nested,
    to_plain,
)
from torch.utils.data import DataLoader

import shareddata as sd

ROWS = 64
TESTS = os.path.join(REPO, "tests")


# -- items and batches ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_items_equal_the_source(kind, tmp_path):
    ds, expected = make(kind, tmp_path, rows=ROWS, ragged=kind != "numpy")
    assert len(ds) == ROWS
    for i in range(ROWS):
        assert_item(ds[i], expected[i], kind)
    for i in (-1, -ROWS):
        assert_item(ds[i], expected[i], kind)
    assert ds.nbytes > 0


@pytest.mark.parametrize("kind", KINDS)
def test_batches_equal_the_source(kind, tmp_path):
    """The default collate gives the batch of per-sample fetching, whatever the path."""
    ds, expected = make(kind, tmp_path, rows=ROWS)
    order = [5, 0, 63, 17, 17, 2, 40]
    batched = next(iter(DataLoader(ds, batch_size=len(order), sampler=order)))
    assert_batch(batched, [expected[i] for i in order], kind)
    samples = next(iter(DataLoader(ds, batch_size=len(order), sampler=order, collate_fn=list)))
    for got, i in zip(samples, order):
        assert_item(got, expected[i], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_batches_are_what_the_default_collate_makes_of_the_samples(kind, tmp_path):
    """Same containers and values as ``default_collate([ds[i] for i in order])``: a tuple
    sample's str column is a tuple, a dict's a list; a list<float> column whose rows
    are all of one length is stacked. From a loader with and without workers, and from
    ``ds[indices]`` (what ``IndexBatchSampler`` batches are)."""
    import pyarrow as pa
    from torch.utils.data import default_collate

    options = [{}]
    if kind in COLUMN_KINDS:
        options.append({"output": "tuple"})
    if kind in NESTED_KINDS:
        options += [{"nested": True}, {"nested": True, "output": "tuple"}]
    order = [5, 0, 63, 17, 17, 2]
    for k, kwargs in enumerate(options):
        if kind == "arrow":  # and a list<float> column whose rows are all 3 long
            table = pa.table({"v": [[float(i)] * 3 for i in range(ROWS)], "t": ["a"] * ROWS})
            ds = sd.ArrowDataset(table, progress=False, **kwargs)
        else:
            ds, _ = make(kind, tmp_path / str(k), rows=ROWS, reuse=k > 0, **kwargs)
        want = to_plain(default_collate([ds[i] for i in order]))
        for workers in (0, 2):
            loader = DataLoader(ds, batch_size=len(order), sampler=order, num_workers=workers)
            assert to_plain(next(iter(loader))) == want, (kwargs, workers)
        if kind != "shared_list":
            assert to_plain(ds[order]) == want, kwargs


def _fields(batch):
    """A batch's fields: (name, value) of a dict batch, (position, value) of a list one."""
    return list(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_by_index_means_the_same_for_every_kind(kind, transform, tmp_path):
    """Note [A batch by index]: ``ds[indices]`` is the default collate of the samples, with
    ragged fields as the list of their rows; no row is an empty batch of the same
    structure; an n-D index lays the batch out in its shape, as numpy does. SharedList
    gives lists of items, as its slices do."""
    import numpy as np

    if transform and kind == "shared_list":
        pytest.skip("SharedList takes no transform")
    kwargs = {"transform": _tag} if transform else {}
    ds, _ = make(kind, tmp_path, rows=ROWS, ragged=kind != "numpy", **kwargs)
    empties = ([], slice(5, 5), np.array([], np.int64), torch.tensor([], dtype=torch.long))
    grids = (np.array([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 4]]), [[1, 2], [3, 4]])
    items = [ds[i] for i in range(8)]
    if kind == "shared_list":
        assert to_plain(ds[[1, 2]]) == to_plain([items[1], items[2]])
        assert to_plain(ds[torch.tensor([3, -64])]) == to_plain([items[3], items[0]])
        for empty in empties:
            assert ds[empty] == []
        for grid in grids:
            want = [[items[1], items[2]], [items[3], items[4]]]
            assert to_plain(ds[grid]) == to_plain(want)
        assert ds[np.zeros((2, 0), np.int64)] == [[], []]
    else:
        # rows of different lengths (r: 1 and 2 long): the list of rows, as ParquetDataset
        # always gave, never torch's "stack expects each tensor to be equal size"
        batch = ds[[1, 2]]
        for name, value in _fields(batch):
            assert to_plain(list(value)) == to_plain([items[1][name], items[2][name]]), name
        ragged = dict(_fields(batch)).get("r", dict(_fields(batch)).get(3))
        if kind != "numpy":
            assert isinstance(ragged, list) and [len(t) for t in ragged] == [1, 2], ragged
        # no row: an empty batch with the fields, dtypes and row shapes of a batch
        full = ds[[0, 1, 2, 3]]
        for empty in empties:
            got = ds[empty]
            assert type(got) is type(full) and len(got) == len(full), (empty, got)
            for (name, want), (_, value) in zip(_fields(full), _fields(got)):
                if isinstance(want, torch.Tensor):
                    assert isinstance(value, torch.Tensor) and value.dtype == want.dtype, name
                    assert value.shape == (0, *want.shape[1:]), (empty, name, value.shape)
                else:  # strs, ragged rows: a list of no row
                    assert list(value) == [], (empty, name, value)
        # an n-D index: the batch laid out in its shape (as numpy does), the same values
        flat = ds[[1, 2, 3, 4]]
        for grid in grids:
            got = ds[grid]
            for (name, want), (_, value) in zip(_fields(flat), _fields(got)):
                if isinstance(want, torch.Tensor):
                    assert value.shape == (2, 2, *want.shape[1:]) and value.dtype == want.dtype
                    assert torch.equal(value.reshape(want.shape), want), name
                else:
                    rows = list(want)
                    assert to_plain([list(r) for r in value]) == to_plain([rows[:2], rows[2:]])
        y = dict(_fields(ds[np.zeros((2, 0), np.int64)])).get("y")
        assert y is None or y.shape == (2, 0)
    with pytest.raises(TypeError) as info:
        ds[[[1, 2], [3]]]  # not rectangular: refused by name, as numpy refuses it
    assert isinstance(info.value, sd.SharedDataError) and "different lengths" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_index_batch_sampler_follows_torch_seed_for_every_kind(kind, tmp_path):
    """IndexBatchSampler batches (``ds[tensor]``) of every kind, in an order that
    ``torch.manual_seed`` fixes (like ``DataLoader(shuffle=True)``) and each epoch changes."""
    ds, expected = make(kind, tmp_path, rows=ROWS)

    def epochs(seed):
        torch.manual_seed(seed)
        sampler = sd.IndexBatchSampler(ds, 16, shuffle=True)
        loader = DataLoader(ds, sampler=sampler, batch_size=None)
        return [[to_plain(batch) for batch in loader] for _ in range(2)], sampler

    (first, second), sampler = epochs(7)
    assert epochs(7)[0] == [first, second]  # seeded: the same orders
    assert first != second and epochs(8)[0][0] != first  # another epoch, another seed
    sampler.set_epoch(0)
    for indices, batch in zip(sampler, first):
        assert batch == to_plain(ds[indices])
        if kind == "shared_list":
            for item, i in zip(ds[indices], indices.tolist()):
                assert_item(item, expected[i], kind)
        else:
            assert_batch(ds[indices], [expected[i] for i in indices.tolist()], kind)


def _tag(sample):
    """A transform that keeps the sample's structure (and marks that it ran)."""
    if isinstance(sample, dict):
        return {**sample, "y": sample["y"] + 1000}
    return sample


def _as_they_come(samples):
    return samples


@pytest.mark.parametrize("kind", KINDS)
def test_samples_returned_untouched_by_the_collate_arrive(kind, tmp_path):
    """``collate_fn=lambda b: b`` from workers: the samples arrive, equal and usable
    (a list never looked at in the worker crosses as its columns, made on arrival)."""
    ds, expected = make(kind, tmp_path, rows=ROWS)
    order = [5, 0, 63, 17, 17, 2]
    for method in ("fork", "spawn") if kind == "numpy" else ("fork",):
        loader = DataLoader(
            ds, batch_size=3, sampler=order, num_workers=2, collate_fn=_as_they_come,
            multiprocessing_context=method, timeout=60,
        )  # fmt: skip
        got = [s for batch in loader for s in batch]
        assert len(got) == len(order)
        for sample, i in zip(got, order):
            assert_item(sample, expected[i], kind)


@pytest.mark.parametrize("kind", COLUMN_KINDS)
def test_tuple_output(kind, tmp_path):
    ds, expected = make(kind, tmp_path, rows=ROWS, output="tuple")
    assert isinstance(ds[3], tuple)
    assert_item(ds[3], expected[3], kind)
    first = next(iter(DataLoader(ds, batch_size=4)))
    assert isinstance(first, (list, tuple))
    assert_batch(first, expected[:4], kind)


@pytest.mark.parametrize("kind", NESTED_KINDS)
def test_nested_items(kind, tmp_path):
    """nested=True: records/structs (and HDF5 groups) come back nested on every path."""
    ds, expected = make_nested(kind, tmp_path, rows=ROWS, nested=True)
    assert ds.nested and len(ds.columns) == 3
    for i in (0, 7, -1):
        assert_nested(ds[i], expected[i])
    order = [5, 0, 63, 17, 17, 2]
    want = [expected[i] for i in order]
    assert_nested(ds[order], collated(want))  # a batch by indexing
    samples = ds.__getitems__(order)
    for got, w in zip(samples, want):
        assert_nested(got, w)
    batched = next(iter(DataLoader(ds, batch_size=len(order), sampler=order)))
    assert_nested(batched, collated(want))  # the default collate's shortcut
    from torch.utils.data import default_collate

    batch = default_collate(samples)
    assert batch["rec"]["x"] is samples.batched[ds.columns.index(_name(kind, "rec", "x"))]
    samples[1]["rec"]["y"] = torch.tensor(-1)  # replaced: collated the generic way
    changed = default_collate(samples)
    assert changed["rec"]["y"][1] == -1 and changed["rec"]["y"][0] == want[0]["rec"]["y"]
    again = pickle.loads(pickle.dumps(ds))
    assert_nested(again[3], expected[3])
    flat, _ = make_nested(kind, tmp_path / "flat", rows=ROWS)
    assert not flat.nested and list(flat[0]) == flat.columns  # the default: flat
    tuples, _ = make_nested(kind, tmp_path / "tuple", rows=ROWS, nested=True, output="tuple")
    meta, rec = tuples[4]
    assert_nested({"meta": meta, "rec": rec}, expected[4])
    meta, rec = next(iter(DataLoader(tuples, batch_size=len(order), sampler=order)))
    assert_nested({"meta": meta, "rec": rec}, collated(want))


def _name(kind, *path):
    return ("/" if kind == "hdf5" else ".").join(path)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", NESTED_KINDS)
def test_nested_batches_from_workers(kind, method, tmp_path):
    ds, expected = make_nested(kind, tmp_path, rows=32, nested=True)
    loader = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context=method, timeout=60)
    for k, batch in enumerate(loader):
        assert_nested(batch, collated(expected[k * 8 : (k + 1) * 8]))
    assert k == 3


# -- pickling: handles, never data --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pickles_as_a_handle(kind, tmp_path):
    """What workers receive is O(columns), not O(rows): 64x the rows, the same pickle."""
    small, _ = make(kind, tmp_path / "small", rows=ROWS)
    big, expected = make(kind, tmp_path / "big", rows=ROWS * 64)
    sizes = [len(ForkingPickler.dumps(ds)) for ds in (small, big)]
    assert sizes[1] < 16 << 10, sizes
    assert sizes[1] <= sizes[0] * 1.2 + 64, sizes
    again = pickle.loads(pickle.dumps(big))
    assert_item(again[ROWS * 64 - 1], expected[-1], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_gives_the_same_items_over_the_same_memory(kind, tmp_path):
    """A dataset's data is read-only: ``copy.deepcopy`` (a val split made from a train
    split) holds no second copy; a writable SharedArray's deep copy is a copy."""
    import copy

    ds, expected = make(kind, tmp_path, rows=ROWS)
    again = copy.deepcopy(ds)
    assert again is not ds and len(again) == ROWS
    assert_item(again[ROWS - 1], expected[-1], kind)
    assert again.segment_identity() == ds.segment_identity()


# -- errors --------------------------------------------------------------------------------


_DESCRIPTORS_SCRIPT = """
import gc, json, os, resource, sys
sys.path.insert(0, sys.argv[3])
from kinds import make

kind, folder = sys.argv[1], sys.argv[2]
fds = lambda: len(os.listdir("/proc/self/fd"))
make(kind, folder, rows=16)  # the files, written before counting
gc.collect()
base = fds()
keep = [make(kind, folder, rows=16, reuse=True, progress=False)[0] for _ in range(10)]
out = {"per_dataset": (fds() - base) / 10}
del keep
gc.collect()
base = fds()
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (base + 60, hard))
keep = []
try:
    for _ in range(1000):
        keep.append(make(kind, folder, rows=16, reuse=True, progress=False)[0])
except Exception as e:
    out.update(made=len(keep), mro=[c.__name__ for c in type(e).__mro__], message=str(e))
del keep
gc.collect()
out["left_open"] = fds() - base
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_one_descriptor_per_dataset_and_a_named_error_past_the_limit(kind, tmp_path):
    """Each dataset holds one descriptor (a SharedDataset one more per variable-length
    field, its offsets after its values, and one for ragged fields' shapes; before: twice
    as many, as Python's mmap kept a duplicate). Past ``ulimit -n``: TooManyOpenFilesError
    naming the limit and the fix (before: a bare ``OSError: [Errno 24]``), and nothing
    left open."""
    command = [sys.executable, "-c", _DESCRIPTORS_SCRIPT, kind, str(tmp_path), TESTS]
    run = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    per_dataset = 2 if kind == "shared_dataset" else 1  # x, y in one segment; t + offsets
    assert out["per_dataset"] == per_dataset, out
    assert out["mro"][:3] == ["TooManyOpenFilesError", "SharedDataError", "OSError"], out
    assert (
        "ulimit -n" in out["message"] and str(out["made"]) and out["made"] >= 60 // per_dataset - 3
    )
    assert out["left_open"] == 0, out


_WARNINGS_SCRIPT = r"""
import sys, warnings
sys.path.insert(0, sys.argv[3])
warnings.simplefilter("error")  # and in the fork workers, which inherit it
import torch
torch.set_warn_always(True)  # torch warns once per process, maybe before (suppressed)
from torch.utils.data import DataLoader
from kinds import make
kind, path = sys.argv[1], sys.argv[2]
ds, expected = make(kind, path, rows=16, ragged=kind != "numpy", progress=False)
loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork",
                    collate_fn=list)
print(sum(len(batch) for batch in loader))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_no_warning_reaches_users_from_a_worker(kind, tmp_path):
    """Issue 29: torch's "The given NumPy array is not writable" warning came from a ragged
    column's batch in a worker (where no column had made torch warn once already)."""
    command = [sys.executable, "-c", _WARNINGS_SCRIPT, kind, str(tmp_path), TESTS]
    run = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "16", run.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_is_an_index_error(kind, tmp_path):
    ds, _ = make(kind, tmp_path, rows=ROWS)
    for bad in (ROWS, -ROWS - 1, 10**12, 2**64, -(2**70)):
        for fetch in (ds.__getitem__, lambda i: ds.__getitems__([0, i])):
            with pytest.raises(IndexError) as info:
                fetch(bad)
            assert isinstance(info.value, sd.SharedDataError), type(info.value).__mro__
            assert str(bad) in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_index_type_is_a_type_error(kind, tmp_path):
    ds, _ = make(kind, tmp_path, rows=ROWS)
    for bad in ("3", 1.5, None):
        with pytest.raises(TypeError) as info:
            ds[bad]
        assert isinstance(info.value, sd.SharedDataError), (bad, type(info.value).__mro__)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_share_and_shard_arguments(kind, tmp_path):
    for arguments in ({"share": "everywhere"}, {"shard": "rank"}):
        with pytest.raises(ValueError) as info:
            make(kind, tmp_path / "bad", rows=ROWS, **arguments)
        assert isinstance(info.value, sd.SharedDataError), type(info.value).__mro__
        assert str(next(iter(arguments.values()))) in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_are_refused_before_anything_is_loaded(kind, tmp_path, monkeypatch):
    """A wrong transform, output, nested, share, timeout or storage_dir costs no load."""
    import shareddata.datasets._load

    make(kind, tmp_path, rows=ROWS)  # the files, before the spy counts loads
    loads = []
    load_here = shareddata.datasets._load._load_here
    monkeypatch.setattr(
        shareddata.datasets._load, "_load_here", lambda *a: loads.append(a) or load_here(*a)
    )
    bad: list[dict] = [
        {"share": "everywhere"},
        {"timeout": -1},
        {"storage_dir": 5},
        {"storage_dir": tmp_path / "no such folder"},
    ]
    if kind != "shared_list":
        bad.append({"transform": 3})
    if kind in COLUMN_KINDS:
        bad += [{"output": "list"}]
    if kind in NESTED_KINDS:
        bad += [{"nested": "yes"}]
    for arguments in bad:
        with pytest.raises((ValueError, TypeError, FileNotFoundError)) as info:
            make(kind, tmp_path, rows=ROWS, reuse=True, **arguments)
        assert isinstance(info.value, sd.SharedDataError), (arguments, type(info.value).__mro__)
        assert loads == [], f"{arguments} was refused only after loading"


@pytest.mark.parametrize("kind", KINDS)
def test_empty_selection_is_a_value_error(kind, tmp_path):
    """A dataset with nothing in it is a named ValueError, never a silent 0-row dataset."""
    if kind == "numpy":
        build = lambda: sd.NumpyDataset({})  # noqa: E731
    elif kind in ("hdf5", "parquet"):
        make(kind, tmp_path, rows=ROWS)
        path = tmp_path / ("data.h5" if kind == "hdf5" else "data.parquet")
        build = (
            (lambda: sd.HDF5Dataset(path, columns=[]))
            if kind == "hdf5"
            else (lambda: sd.ParquetDataset(path, columns=[]))
        )
    elif kind == "arrow":
        import pyarrow as pa

        build = lambda: sd.ArrowDataset(pa.table({"x": [1, 2]}).select([]))  # noqa: E731
    elif kind == "shared_dataset":
        build = lambda: sd.SharedDataset(torch.utils.data.TensorDataset(torch.zeros(0, 2)))  # noqa: E731
    else:
        pytest.skip("an empty SharedList is an empty list, as for any Python sequence")
    with pytest.raises(ValueError) as info:
        build()
    assert isinstance(info.value, sd.SharedDataError), type(info.value).__mro__


# -- share=, shard=, storage_dir= -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_share_shard_and_storage_dir(kind, tmp_path):
    """Outside torchrun: share="process" loads here; shard="node" is the whole dataset."""
    storage = tmp_path / "storage"
    storage.mkdir()
    for i, arguments in enumerate(
        ({"share": "process"}, {"shard": "node"}, {"storage_dir": storage})
    ):
        ds, expected = make(kind, tmp_path / str(i), rows=ROWS, **arguments)
        assert len(ds) == ROWS
        assert_item(ds[ROWS - 1], expected[-1], kind)
        if "shard" in arguments:
            shard = ds.node_shard
            assert (shard.start, shard.stop, shard.total) == (0, ROWS, ROWS)


# -- how a batch leaves a worker -------------------------------------------------------------


def _as_it_is(sample):
    return sample


def _holders(inodes):
    """What in this process still maps or holds open a file of ``inodes``."""
    found = []
    with open("/proc/self/maps") as f:
        found += [
            line.split()[0]
            for line in f
            if len(line.split()) > 4 and int(line.split()[4]) in inodes
        ]
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino in inodes:
                found.append(f"fd {fd}")
        except OSError:
            pass
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_dataset_lets_its_memory_go_and_refuses_use(kind, tmp_path):
    import gc

    with make(kind, tmp_path, rows=32)[0] as ds:
        inodes = {inode for _, inode in ds.segment_identity()}
        sample = ds[3]
        loader = DataLoader(ds, batch_size=4, num_workers=0)  # keeps a reference to ds
        first = next(iter(loader))
        assert _holders(inodes)
    assert ds.closed and len(ds) == 32 and "closed" in repr(ds)
    for use in (
        lambda: ds[0],
        lambda: ds[[0, 1]],
        lambda: next(iter(loader)),
        lambda: pickle.dumps(ds),
    ):
        with pytest.raises(ValueError, match="is closed") as info:
            use()
        assert isinstance(info.value, sd.SharedDataError)
    ds.close()  # idempotent
    assert sample is not None and first is not None  # taken before: still readable
    del sample, first
    gc.collect()
    assert not _holders(inodes), "the closed dataset's memory is still held here"


@pytest.mark.parametrize("sampler", ["default collate", "IndexBatchSampler", "transform"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_leaves_a_worker_as_one_memfd(kind, sampler, tmp_path, monkeypatch):
    """With the default collate (fixed-shape rows) and with ``IndexBatchSampler`` (ragged
    rows too: a list of rows; with a ``transform`` too), every kind's batch reaches the
    main process as ONE worker memfd and no torch ``/dev/shm`` segment, and holds the
    rows (issue 22: SharedDataset and SharedList took torch's path, a segment per
    stacked tensor)."""
    import test_crossing as crossing

    if kind == "shared_list" and sampler == "transform":
        pytest.skip("a SharedList has no transform")
    ragged = sampler != "default collate" and kind != "numpy"
    kwargs = {"transform": _as_it_is} if sampler == "transform" else {}
    ds, expected = make(kind, tmp_path, rows=ROWS, ragged=ragged, **kwargs)
    crossing._count_receptions(monkeypatch)
    if sampler == "default collate":
        order = list(range(ROWS))[::-1]
        kw = {"batch_size": 16, "sampler": order}
    else:  # (with a transform: ds[indices] collates the transformed samples leniently)
        order = list(range(ROWS))
        kw = {"sampler": sd.IndexBatchSampler(ds, 16), "batch_size": None}
    loader = DataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=60, **kw)
    n = 0
    for k, batch in enumerate(loader):
        want = [expected[i] for i in order[16 * k : 16 * (k + 1)]]
        if kind == "shared_list" and sampler != "default collate":  # a list of items
            for item, w in zip(batch, want):
                assert_item(item, w, kind)
        else:
            assert_batch(batch, want, kind)
        crossing._assert_one_memfd(batch, f"{kind}, {sampler}")
        n += 1
    assert n == ROWS // 16
    assert {"receive": n} == crossing.RECEIVED, crossing.RECEIVED


# -- worker processes, every start method ----------------------------------------------------


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    built = {kind: make(kind, root / kind, rows=ROWS, ragged=kind != "numpy") for kind in KINDS}
    return {k: ds for k, (ds, _) in built.items()}, {k: exp for k, (_, exp) in built.items()}


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_index_one_copy(every_kind, method):
    """Every kind in the workers of every start method: the rows, and one copy (verify)."""
    datasets, expected = every_kind
    loader = DataLoader(
        AllKinds(datasets),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context(method),
        collate_fn=to_plain,  # plain lists cross: this test is about indexing, not transport
        persistent_workers=True,
        timeout=60,
    )
    seen = set()
    for batch in loader:
        for rows in batch:
            y = as_dict(rows["numpy"], "numpy")["y"]
            index = (y + 7) // 3
            seen.add(index)
            for kind in KINDS:
                assert_item(rows[kind], expected[kind][index], kind)
    assert seen == set(range(ROWS))
    report = sd.verify(loader, max_duplication=None)
    assert report.duplication <= 1.10, str(report)


# -- one copy per node under torchrun ----------------------------------------------------------


def test_one_copy_per_node_under_torchrun(tmp_path):
    """torchrun, 2 local ranks: every kind maps the same pages on both ranks (share default),
    its own pages with share="process"."""
    data = tmp_path / "data"
    for kind in KINDS:
        make(kind, data, rows=ROWS)  # the files, written once before the ranks start
    found = {}
    for share in ("node", "process"):
        out = tmp_path / share
        out.mkdir()
        env = torchrun_env()
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                os.path.join(REPO, "tests", "distributed", "scripts", "contract_node.py"),
                str(data),
                str(out),
                "--share",
                share,
                "--rows",
                str(ROWS),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=REPO,
            env=env,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        found[share] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for kind in KINDS:
        node = [set(r[kind]) for r in found["node"]]
        own = [set(r[kind]) for r in found["process"]]
        assert node[0] and node[0] == node[1], (kind, node)
        assert own[0] and own[1] and not own[0] & own[1], (kind, own)
