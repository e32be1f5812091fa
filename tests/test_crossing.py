"""Everything a DataLoader worker returns crosses to the main process intact (issue 14).

One ``collate_fn`` returns every shape at once (the samples themselves, a list of
sample values, slices and non-contiguous views of the collated batch, nested
dicts, the default collate, torchvision's ``tuple(zip(*batch))``), for every
dataset kind at once, so that each worker start checks every shape on every kind.
Note [Tensors over our memory cross by handle] in ``shareddata/storage/_tensor.py``.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
import torch
from conftest import hard_timeout as deadline
from conftest import shm_names
from kinds import KINDS, assert_batch, assert_item, make
from torch.utils.data import DataLoader, Dataset, default_collate

import shareddata as sd
from shareddata.errors import BatchSendError

ROWS = 24
BATCH = 8


@pytest.fixture(autouse=True)
def hard_timeout():
    """Fail (with every thread's stack) instead of hanging: a loader must never hang."""
    with deadline(60, "test_crossing: the test"):
        yield


class EveryKind(Dataset):
    """Batch ``indices`` of every dataset, as ``{name: what its __getitems__ returned}``.

    The collate then sees each kind's samples exactly as the DataLoader would give
    them to a ``collate_fn`` (the default collate's shortcut included).
    """

    def __init__(self, datasets):
        self.datasets = datasets

    def __len__(self):
        return ROWS

    def __getitems__(self, indices):
        return {name: _getitems(ds, indices) for name, ds in self.datasets.items()}


def _getitems(ds, indices):
    getitems = getattr(ds, "__getitems__", None)
    return getitems(indices) if getitems else [ds[i] for i in indices]


def every_shape(per_kind):
    """Every collate shape of issue 14 at once, per dataset."""
    out = {}
    for name, samples in per_kind.items():
        tuples = not isinstance(samples[0], dict)
        collated = default_collate(samples)
        x = collated[0] if tuples else collated["x"]
        out[name] = {
            "identity": samples,  # lambda b: b
            "xs": [s[0] if tuples else s["x"] for s in samples],  # [s["x"] for s in b]
            "slice": x[1:3],
            "t": x.t(),
            "strided": x[:, ::2],
            "nested": {"a": {"b": [x[0], x], "c": (samples[1],)}},
            "default": collated,
            "zip": tuple(zip(*samples)),  # torchvision's detection collate
            "fresh": torch.arange(5),  # not ours: torch's own path
        }
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kinds")
    made = {kind: make(kind, tmp / kind, rows=ROWS) for kind in KINDS}
    made["numpy_tuple"] = make("numpy", tmp / "numpy", rows=ROWS, reuse=True, output="tuple")
    return made


def _check(out, made, first):
    for name, got in out.items():
        kind = "numpy" if name == "numpy_tuple" else name
        want = made[name][1][first : first + BATCH]
        xs = torch.from_numpy(np.stack([w["x"] for w in want]))
        for sample, w in zip(got["identity"], want):
            assert_item(sample, w, kind)
        assert torch.equal(torch.stack(got["xs"]), xs), name
        assert torch.equal(got["slice"], xs[1:3]), name
        assert torch.equal(got["t"], xs.t()) and torch.equal(got["strided"], xs[:, ::2]), name
        assert torch.equal(got["nested"]["a"]["b"][0], xs[0]), name
        assert torch.equal(got["nested"]["a"]["b"][1], xs), name
        assert_item(got["nested"]["a"]["c"][0], want[1], kind)
        assert_batch(got["default"], want, kind)
        columns = got["zip"]
        if name == "numpy_tuple":  # (xs, ys)
            assert torch.equal(torch.stack(columns[0]), xs), name
        assert torch.equal(got["fresh"], torch.arange(5))
    # the samples of a batch are views of one memfd: they crossed as one handle
    storages = {s["x"].untyped_storage().data_ptr() for s in out["numpy"]["identity"]}
    assert len(storages) == 1, f"{len(storages)} storages for one batch's samples"


def _run(made, method, workers=2, batches=2):
    ds = EveryKind({name: ds for name, (ds, _) in made.items()})
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=every_shape,
        multiprocessing_context=method,
        timeout=30,
    )
    seen = 0
    for k, out in enumerate(loader):
        _check(out, made, k * BATCH)
        seen += 1
        if seen == batches:
            break
    assert seen == batches
    del loader, out


def _no_new_shm(before):
    gc.collect()
    deadline = time.monotonic() + 5
    while shm_names() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm_names() - before, f"left in /dev/shm: {sorted(shm_names() - before)}"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_collate_shape_of_every_kind_crosses_intact(datasets, method):
    before = shm_names()
    _run(datasets, method, workers=2 if method == "fork" else 1)  # spawn: seconds per worker
    _no_new_shm(before)


def test_every_shape_under_forkserver_and_the_file_system_strategy(datasets):
    before = shm_names()
    _run(datasets, "forkserver", workers=1, batches=1)
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        # the whole epoch: torch leaves its file_system segments of batches that
        # were prefetched and never received until the shm manager exits
        _run(datasets, "fork", workers=1, batches=ROWS // BATCH)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    _no_new_shm(before)


def identity_and_zip(per_kind):
    """``lambda b: b`` and torchvision's ``lambda b: tuple(zip(*b))``, for each kind."""
    out = {}
    for name, samples in per_kind.items():
        rows = [tuple(s.values()) if isinstance(s, dict) else s for s in samples]
        out[name] = {"identity": samples, "zip": samples and tuple(zip(*rows))}
    return out


RECEIVED = {}


def _counting(module, name):
    """``module.name`` that counts its calls in RECEIVED (unpickling looks it up by name)."""
    original = getattr(module, name)

    def counted(*args):
        RECEIVED[name] = RECEIVED.get(name, 0) + 1
        return original(*args)

    counted.__name__ = counted.__qualname__ = name
    counted.__module__ = module.__name__
    return counted


def _count_receptions(monkeypatch):
    """Count in RECEIVED how the main process receives each shared segment."""
    from torch.multiprocessing import reductions

    from shareddata.crossing import _transport
    from shareddata.storage import _tensor

    for module, name in [
        (reductions, "rebuild_storage_fd"),  # a torch segment, sent as a descriptor
        (reductions, "rebuild_storage_filename"),  # a torch segment, sent by name
        (_transport, "receive"),  # a worker's batch memfd
        (_tensor, "_rebuild_segment_storage"),  # a dataset's segment
    ]:
        monkeypatch.setattr(module, name, _counting(module, name))
    RECEIVED.clear()


def _assert_one_memfd(batch, what):
    """Every tensor of ``batch`` is mapped from one worker batch memfd."""
    files = _files_of(batch)
    assert len(files) == 1, f"{what}: a batch crossed in {sorted(files)}"
    assert next(iter(files))[1].endswith("memfd:shareddata-batch"), (what, files)


def _files_of(obj):
    """The (inode, name) of every file that a tensor in ``obj`` is mapped from."""
    tensors = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            tensors.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    files = set()
    for t in (t for t in tensors if t.numel()):
        for fields in maps:
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= t.data_ptr() < stop:
                files.add((fields[4], fields[5] if len(fields) > 5 else "(private)"))
                break
    return files


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_of_ragged_rows_leaves_a_worker_as_one_memfd_for_every_kind(
    tmp_path, monkeypatch, method
):
    # numpy has no ragged column: its fixed rows are checked the same way
    made = {kind: make(kind, tmp_path / kind, rows=ROWS, ragged=kind != "numpy") for kind in KINDS}
    _count_receptions(monkeypatch)
    loader = DataLoader(
        EveryKind({kind: ds for kind, (ds, _) in made.items()}),
        batch_size=BATCH, num_workers=1, collate_fn=identity_and_zip,
        multiprocessing_context=method, timeout=30,
    )  # fmt: skip
    batches = 0
    for k, out in enumerate(loader):
        for kind, got in out.items():
            want = made[kind][1][k * BATCH : (k + 1) * BATCH]
            for sample, w in zip(got["identity"], want):
                assert_item(sample, w, kind)
            xs = torch.from_numpy(np.stack([w["x"] for w in want]))
            assert torch.equal(torch.stack(list(got["zip"][0])), xs), kind  # column x
            _assert_one_memfd(got, f"{kind} ({method})")
        batches += 1
    assert batches == ROWS // BATCH
    # one descriptor per kind per batch, none of torch's
    assert {"receive": len(KINDS) * batches} == RECEIVED, RECEIVED
    del loader, out


def _lists_table(rows):
    """A struct, a list<list<int>> and a list<struct<str, list<int>>> column, and ``x``."""
    import pyarrow as pa

    grid = [[list(range(i, i + j)) for j in range(i % 3)] for i in range(rows)]
    turns = [[{"role": f"r{j}", "tokens": list(range(j + i % 2))} for j in range(i % 3)]
             for i in range(rows)]  # fmt: skip
    x = np.arange(rows * 4, dtype=np.float32)
    return pa.table({
        "x": pa.FixedSizeListArray.from_arrays(pa.array(x), 4),
        "grid": pa.array(grid, pa.list_(pa.list_(pa.int32()))),
        "turns": pa.array(turns, pa.list_(pa.struct([("role", pa.string()),
                                                      ("tokens", pa.list_(pa.int64()))]))),
        "meta": [{"n": i, "deep": [[i], []]} for i in range(rows)],
    })  # fmt: skip


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_of_nested_lists_and_nested_items_leaves_a_worker_as_one_memfd(
    tmp_path, monkeypatch, method
):
    # lists of lists of numbers and lists of records (their number lists are tensors),
    # items nested: every tensor of a batch is a view of the worker's one memfd
    from kinds import assert_nested, make_nested

    table = _lists_table(ROWS)
    datasets = {
        "records": sd.ArrowDataset(table, nested=True, progress=False),
        "columns": sd.ArrowDataset(table, nested=True, records=False, progress=False),
        "hdf5": make_nested("hdf5", tmp_path, rows=ROWS, nested=True)[0],
    }
    want = {"records": table.to_pylist(), "hdf5": make_nested("hdf5", tmp_path / "e", ROWS)[1]}
    _count_receptions(monkeypatch)
    loader = DataLoader(
        EveryKind(datasets), batch_size=BATCH, num_workers=1, collate_fn=identity_and_zip,
        multiprocessing_context=method, timeout=30,
    )  # fmt: skip
    batches = 0
    for k, out in enumerate(loader):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        assert [_plain(s) for s in out["records"]["identity"]] == want["records"][rows]
        for got, w in zip(out["columns"]["identity"], want["records"][rows]):
            turns = {f: [t[f] for t in w["turns"]] for f in ("role", "tokens")}
            assert _plain(got) == {**w, "turns": turns}
        for got, w in zip(out["hdf5"]["identity"], want["hdf5"][rows]):
            assert_nested(got, w)
        for name, got in out.items():
            _assert_one_memfd(got, f"{name} ({method})")
        batches += 1
    assert batches == ROWS // BATCH
    assert {"receive": len(datasets) * batches} == RECEIVED, RECEIVED
    del loader, out


def _mapped_from(tensor):
    """The name of the file that ``tensor``'s memory is mapped from, as /proc/self/maps says."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop:
                return os.path.basename(fields[5]) if len(fields) > 5 else ""
    return None


class ColumnViews(Dataset):
    """A user's Dataset that returns views of shared arrays, ``batch_size=None`` style."""

    def __init__(self, data):
        self.readonly = sd.NumpyDataset({"x": data})
        self.shared = sd.SharedArray.from_array(data)

    def __len__(self):
        return len(self.shared)

    def __getitem__(self, i):
        column = self.readonly._columns["x"].arrays["data"].torch()
        return {"ro": column[i], "rw": self.shared.torch()[i], "col": column[:, 1]}


def test_views_of_shared_memory_cross_without_a_copy():
    data = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    ds = ColumnViews(data)
    loader = DataLoader(ds, batch_size=None, sampler=range(4), num_workers=1, timeout=30)
    before = shm_names()
    for i, item in enumerate(loader):
        assert torch.equal(item["ro"], torch.from_numpy(data[i]))
        assert torch.equal(item["col"], torch.from_numpy(data[:, 1].copy()))
        assert _mapped_from(item["ro"]).startswith("memfd:shareddata")  # the dataset's own
        assert _mapped_from(item["rw"]).startswith("memfd:shareddata")
        assert item["ro"].untyped_storage().nbytes() == data.nbytes  # the column, not a copy
        item["ro"].add_(1000)  # copy-on-write: the dataset never changes
        item["rw"].add_(1)  # a SharedArray is shared: the write reaches its owner
    assert torch.equal(ds.readonly[2]["x"], torch.from_numpy(data[2]))
    assert torch.equal(ds.shared.torch()[:4], torch.from_numpy(data[:4] + 1))
    assert torch.equal(ds.shared.torch()[4:], torch.from_numpy(data[4:]))
    assert shm_names() == before


class BrokenHandle(Dataset):
    """Samples that are views of a SharedArray whose handle cannot be made in the worker."""

    def __init__(self):
        self.array = sd.SharedArray.from_array(np.arange(32.0).reshape(8, 4))

    def __len__(self):
        return 8

    def __getitem__(self, i):
        from shareddata.storage import _segment

        def broken(*args, **kwargs):
            raise OSError(9, "Bad file descriptor (the segment was closed)")

        _segment.Segment.handle = broken  # in this worker only (fork: the parent is untouched)
        return self.array.torch()[i]


def test_a_tensor_of_ours_that_cannot_be_sent_is_an_error_in_the_main_process():
    # our reducer never raises in a worker's queue feeder (the batch would be dropped
    # and the main process would wait forever): the failure crosses, and is raised
    # where the batch was expected (Note [Tensors over our memory cross by handle])
    loader = DataLoader(
        BrokenHandle(), batch_size=None, num_workers=1, timeout=30, multiprocessing_context="fork"
    )
    t0 = time.monotonic()
    with pytest.raises(BatchSendError, match="could not be pickled.*Bad file descriptor") as info:
        next(iter(loader))
    assert isinstance(info.value, RuntimeError) and time.monotonic() - t0 < 25  # not the timeout


def test_import_leaves_torch_reducers_and_collate_registry_as_they_were():
    # issue 21: only shareddata's own types get reducers and collate entries
    import subprocess
    import sys

    code = """
import torch, torch.multiprocessing
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions
from torch.utils.data._utils.collate import default_collate_fn_map
types = (torch.Tensor, torch.UntypedStorage, torch.nn.Parameter)
before = {t: ForkingPickler._extra_reducers.get(t) for t in types}
collate_before = dict(default_collate_fn_map)
import shareddata
after = {t: ForkingPickler._extra_reducers.get(t) for t in types}
assert before == after, (before, after)
assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor
assert ForkingPickler._extra_reducers[torch.UntypedStorage] is reductions.reduce_storage
added = set(default_collate_fn_map) - set(collate_before)
assert all(t.__module__.startswith("shareddata.") for t in added), added
assert all(default_collate_fn_map[t] is f for t, f in collate_before.items())
ours = [t for t in ForkingPickler._extra_reducers if t.__module__.startswith("shareddata.")]
print(sorted(t.__name__ for t in ours))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "SharedTensor" in done.stdout, done.stdout


def test_a_plain_tensor_pickles_as_torch_pickles_it():
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    t = torch.arange(4)
    assert ForkingPickler(__import__("io").BytesIO()).dispatch_table[torch.Tensor] is (
        reductions.reduce_tensor
    )
    view = sd.SharedArray.from_array(np.arange(4)).torch()[1:]
    assert type(view).__name__ == "SharedTensor"
    assert type(view + 1) is torch.Tensor and type(t) is torch.Tensor


def test_the_package_source_walks_no_stack_frames():
    import pathlib

    import shareddata

    root = pathlib.Path(shareddata.__file__).parent
    found = [str(p) for p in root.rglob("*.py") if "_getframe" in p.read_text()]
    assert not found, found


def test_a_held_sample_is_never_overwritten_and_dropped_batches_are_reused():
    data = np.arange(512 * 64, dtype=np.float32).reshape(512, 64)
    ds = sd.NumpyDataset(data)
    loader = DataLoader(
        ds, batch_size=16, num_workers=1, collate_fn=lambda b: b, persistent_workers=True,
        timeout=30,
    )  # fmt: skip
    held, files = [], set()
    for _epoch in range(2):
        for i, samples in enumerate(loader):
            files.add(_inode(samples[0]["data"]))
            if i % 4 == 0:
                held.append((i, samples[3]["data"][::2]))  # a strided view of one sample
            del samples
    for i, view in held:
        assert torch.equal(view, torch.from_numpy(data[i * 16 + 3][::2])), f"batch {i} changed"
    assert len(files) <= 24, f"{len(files)} memfds for 64 batches: dropped ones not reused"
    del loader


_KEPT_IN_WORKER: list = []


def _collate_keeping_parts(samples):
    """A collate_fn that keeps a view and a row of each of its last 12 batches in the worker.

    It returns them again with every batch, so the worker's pool must never reuse the
    memfd of a batch whose parts it still holds, nor the main process's ones.
    """
    x = default_collate(samples)["data"]
    _KEPT_IN_WORKER.append((int(x[0, 0]), x[::2, 1:], x.unbind(0)[-1]))
    del _KEPT_IN_WORKER[:-12]
    return x, list(_KEPT_IN_WORKER)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_batches_views_and_rows_held_across_later_batches_keep_their_values(method):
    n, rows = 480, 8
    data = (np.arange(n)[:, None] + 1000 * np.arange(4)[None, :]).astype(np.float32)
    ds = sd.NumpyDataset(data)
    loader = DataLoader(
        ds, batch_size=rows, num_workers=1, collate_fn=_collate_keeping_parts,
        multiprocessing_context=method, timeout=60,
    )  # fmt: skip

    def check(first, view, row):
        assert torch.equal(view, torch.from_numpy(data[first : first + rows : 2, 1:])), first
        assert torch.equal(row, torch.from_numpy(data[first + rows - 1])), first

    held, files = [], set()
    with deadline(120):
        for k, (x, kept) in enumerate(loader):
            assert torch.equal(x, torch.from_numpy(data[k * rows : (k + 1) * rows])), k
            for part in kept:  # parts of older batches the worker still holds
                check(*part)
            files.add(_inode(x))
            if k % 4 == 0:  # the main process holds a batch, a view and a row of it
                held.append((k * rows, x[::2, 1:], x.unbind(0)[-1], x))
            del x, kept
    assert k == n // rows - 1
    for first, view, row, x in held:
        check(first, view, row)
        assert torch.equal(x, torch.from_numpy(data[first : first + rows]))
    assert len(files) < n // rows, f"{len(files)} memfds for {n // rows} batches: none reused"


def _plain_alias(batch):
    """A collate_fn returning plain tensors over the worker's batch memfd (torch sends them)."""
    collated = default_collate(batch)
    return collated["data"].as_subclass(torch.Tensor), torch.nn.Parameter(collated["data"][:2])


def test_plain_tensors_over_a_worker_batch_arrive_and_later_batches_too():
    # torch sends a plain tensor (or a Parameter) by moving its storage into a segment of
    # its own, in place: the worker's pooled batch storage then pointed there, and every
    # later batch gathered into it arrived with an older batch's rows (14 of 16 wrong)
    data = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    ds = sd.NumpyDataset(data)
    loader = DataLoader(
        ds, batch_size=4, num_workers=1, collate_fn=_plain_alias, multiprocessing_context="fork",
        timeout=30,
    )  # fmt: skip
    for k, (batch, param) in enumerate(loader):
        want = torch.from_numpy(data[4 * k : 4 * k + 4])
        assert torch.equal(batch, want), f"batch {k}: {batch[:, 0]} != {want[:, 0]}"
        assert torch.equal(param.detach(), want[:2])
    assert k == 15


def _inode(tensor):
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop:
                return int(fields[4])
    return None


KEPT = []


def _view_of_a_new_array(i):
    array = sd.SharedArray.from_array(np.full((1000, 4), i, np.float32))
    KEPT.append(array)  # alive while the result is pickled; the worker exits right after
    return array.torch()[10:20:3]


def test_a_view_returned_by_a_pool_worker_that_exits_arrives():
    # the view crosses as the segment's handle with a ticket: the exiting worker
    # waits for the parent to hold the file (Note [Handing a segment over])
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        got = pool.map_async(_view_of_a_new_array, range(4)).get(timeout=30)
    for i, view in enumerate(got):
        assert view.shape == (4, 4) and bool((view == i).all())
        assert _mapped_from(view).startswith("memfd:shareddata")  # no copy


def test_a_smaller_batch_gathered_into_a_reused_memfd_still_crosses_by_handle():
    # a pooled memfd may be larger than the batch reusing it (ragged batches, the last
    # batch of an epoch): the batch crossed as a torch copy when its storage covered
    # the whole mapping instead of the batch's own bytes
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from shareddata.crossing import _transport

    first = _transport.worker_empty((1000, 256), torch.float32)
    inode = _inode(first)
    received = pickle.loads(ForkingPickler.dumps(first))
    del first, received
    gc.collect()
    smaller = _transport.worker_empty((500, 256), torch.float32).fill_(3)
    assert _inode(smaller) == inode  # the pooled memfd, reused
    got = pickle.loads(ForkingPickler.dumps(smaller))
    assert _mapped_from(got) == "memfd:shareddata-batch" and _inode(got) == inode
    assert got.shape == (500, 256) and bool((got == 3).all())


class Windows(Dataset):
    """Sample ``i`` is rows ``[i, i + 4)`` of a dataset, made alone: a memfd of its own."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds) - 4

    def __getitem__(self, i):
        return self.ds[i : i + 4]


def _xs(window):
    rows = window if isinstance(window, list) else [window]  # SharedList: a list of items
    return torch.cat([torch.as_tensor(r["x"]).reshape(-1, 4) for r in rows])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_far_more_memfds_in_flight_than_batches_all_arrive(tmp_path, method):
    """50 windows per batch returned as they are: hundreds of memfds not yet received.

    A worker closed the oldest beyond 64 in flight, received or not: sliding windows
    with a ``collate_fn`` that returns the samples failed with AttachError.
    """
    for kind in KINDS if method == "fork" else ["numpy"]:  # spawn: seconds per worker
        ds, want = make(kind, tmp_path / kind, rows=204)
        loader = DataLoader(
            Windows(ds),
            batch_size=50,
            num_workers=2,
            collate_fn=list,
            multiprocessing_context=method,
            timeout=30,
        )
        batches = list(loader)
        assert len(batches) == 4, kind
        for k, batch in enumerate(batches):
            for j, window in enumerate(batch):
                rows = want[50 * k + j : 50 * k + j + 4]
                assert torch.equal(_xs(window), torch.from_numpy(np.stack([r["x"] for r in rows])))


def test_a_prefetch_deeper_than_the_cap_with_a_slow_consumer_arrives(tmp_path):
    """prefetch_factor=100: the worker makes 100 batches before the first is received."""
    ds, want = make("numpy", tmp_path, rows=400)
    loader = DataLoader(
        ds, batch_size=2, num_workers=1, prefetch_factor=100, multiprocessing_context="fork",
        timeout=30,
    )  # fmt: skip
    batches = iter(loader)
    time.sleep(2)  # a slow first step: every prefetched batch is made and waits
    for k, batch in enumerate(batches):
        assert_batch(batch, want[2 * k : 2 * k + 2], "numpy")
    assert k == 199
