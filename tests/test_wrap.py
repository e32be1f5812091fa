import dataclasses
import gc
import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from conftest import START_METHODS, fd_links, open_fds
from torch.utils.data import DataLoader, Dataset, IterableDataset

import shareddata as sd
from shareddata.crossing import _collate as sd_batch


class Images(Dataset):
    """(float32 tensor [3, 32, 32], int label, str caption), as a user writes it."""

    def __init__(self, n=300):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 32, 32, generator=g), i % 10, f"picture nº{i} " * (i % 4)


class Tokens(Dataset):
    """Dicts with numpy arrays and varying-length token lists."""

    def __len__(self):
        return 200

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return {
            "feat": rng.random(8).astype(np.float32),
            "mask": rng.random((i % 5 + 1, 4)) > 0.5,  # shape varies
            "tokens": rng.integers(0, 1000, i % 7).tolist(),
            "score": float(i) / 3,
            "keep": i % 3 == 0,
            "raw": bytes(range(i % 5)),
        }


@dataclasses.dataclass
class Box:
    x: int
    label: str


class Boxes(Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return Box(i, str(i)), [Box(j, "b") for j in range(i % 3)]


# A batch's samples (``__getitems__``, a collate_fn's argument) are shareddata's own
# dict/tuple/list subclasses at the top, for the default collate's shortcut.
SAMPLE_TYPES = {dict: sd_batch.Row, tuple: sd_batch.RowTuple, list: sd_batch.RowList}


def _equal(a, b, sample=False):
    own = sample and type(a) is SAMPLE_TYPES.get(type(b))
    assert type(a) is type(b) or own, (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("make", [Images, Tokens, Boxes])
def test_every_item_equals_the_original(make):
    original = make()
    ds = sd.SharedDataset(original)
    assert len(ds) == len(original)
    for i in range(len(original)):
        _equal(ds[i], original[i])
    idx = [3, 0, len(original) - 1, 3]
    for got, i in zip(ds.__getitems__(idx), idx):
        _equal(got, original[i], sample=True)
    _equal(ds[-1], original[len(original) - 1])
    with pytest.raises(IndexError):
        ds[len(original)]
    back = pickle.loads(pickle.dumps(ds))
    _equal(back[7], original[7])
    assert len(pickle.dumps(ds)) < 4000


def test_materialise_with_workers_and_transform():
    ds = sd.SharedDataset(Images(40), num_workers=2, transform=lambda s: s[1])
    assert [ds[i] for i in range(40)] == [i % 10 for i in range(40)]


@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_batches_equal_the_originals(method):
    original = Images(96)
    ds = sd.SharedDataset(original)
    mine = list(DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=method))
    theirs = list(DataLoader(original, batch_size=16))
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        _equal(a, b)


def _as_list(batch):
    return batch


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("make", [Tokens, Boxes])
def test_dataloader_gives_the_original_items_of_every_kind(make, method):
    # Ragged arrays, token lists, bytes, pickled dataclasses: no default collate, so
    # compare what the workers return (rebuilt in the workers, pickled to this process).
    original = make()
    ds = sd.SharedDataset(original)
    loader = DataLoader(
        ds, batch_size=16, num_workers=2, multiprocessing_context=method, collate_fn=_as_list
    )
    got = [item for batch in loader for item in batch]
    assert len(got) == len(original)
    for i, item in enumerate(got):
        _equal(item, original[i], sample=True)


def test_verify_under_spawn_with_4_workers():
    ds = sd.SharedDataset(Images(8192))  # 96 MiB of images + labels + captions
    loader = DataLoader(ds, batch_size=128, num_workers=4, multiprocessing_context="spawn")
    report = sd.verify(loader, batches=24, max_duplication=1.10)
    assert report.duplication <= 1.10


def test_structure_mismatch_names_index_and_field():
    class Bad(Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"x": torch.zeros(2), "y": "a" if i < 3 else 7}

    with pytest.raises(TypeError, match=r"item 3, field 'y': expected str.*got int"):
        sd.SharedDataset(Bad())

    class BadDtype(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(2, dtype=torch.float32 if i == 0 else torch.float64)

    with pytest.raises(TypeError, match=r"item 1, field the item itself: expected tensor float32"):
        sd.SharedDataset(BadDtype())

    class BadKeys(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"a": 1} if i == 0 else {"b": 1}

    with pytest.raises(TypeError, match="item 1.*keys"):
        sd.SharedDataset(BadKeys())


def test_iterable_dataset_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(TypeError, match="length to preallocate"):
        sd.SharedDataset(Stream())


def test_getitem_error_names_the_index_and_frees_everything():
    class Broken(Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i == 42:
                raise ValueError("bad record")
            return torch.zeros(1024)

    fds = open_fds()
    with pytest.raises(ValueError, match="bad record") as info:
        sd.SharedDataset(Broken())
    assert "item 42 of Broken" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    del info
    gc.collect()
    assert open_fds() == fds


def test_shared_list():
    items = [{"file": f"img{i}.jpg", "boxes": [[i, i + 1]]} for i in range(1000)]
    sl = sd.SharedList(items)
    assert len(sl) == 1000 and sl[5] == items[5] and sl[-1] == items[-1]
    assert sl[10:13] == items[10:13] and sl[::250] == items[::250] and sl[5:5] == []
    assert list(sl) == items
    with pytest.raises(IndexError):
        sl[1000]
    back = pickle.loads(pickle.dumps(sl))
    assert back[999] == items[999] and len(pickle.dumps(sl)) < 500


def test_shared_list_stores_a_tensors_values_not_its_storage():
    # Note [Tensors in SharedList items]: a row of a big tensor pickled by torch carried
    # its whole storage (64 rows x 64 rows of 1 KiB: 4 MiB for 64 KiB of data)
    rows = torch.rand(64, 256)
    sl = sd.SharedList([{"x": rows[i], "y": i} for i in range(64)], progress=False)
    assert sl.nbytes < 80 * 1024, sl.nbytes
    for i in (0, 63):
        got = sl[i]["x"]
        assert type(got) is torch.Tensor and got.dtype == torch.float32
        assert torch.equal(got, rows[i]) and got.untyped_storage().nbytes() == 1024
        got += 1  # writable, its own memory
    # what torch must pickle itself comes back as torch pickles it
    odd = [
        torch.nn.Parameter(torch.ones(2)),
        torch.ones(2, requires_grad=True),
        torch.arange(3).bfloat16(),
        torch.ones(2).as_subclass(Marked),
        torch.tensor([1 + 2j]).conj(),
        rows[::2, ::3],  # a strided view: contiguous values of the same shape
    ]
    back = sd.SharedList([odd], progress=False)[0]
    for got, want in zip(back, odd):
        assert type(got) is type(want) and got.dtype == want.dtype
        assert got.requires_grad == want.requires_grad and torch.equal(got, want)


META = None  # what fork workers inherit, as a user's global metadata list


def _worker_uss_growth(args):
    """USS growth of this process while reading every item of ``meta`` (or META)."""
    meta, n = args
    meta = META if meta is None else meta
    from shareddata.memory import measure

    gc.collect()
    before = measure().uss
    total = 0
    for i in range(n):
        total += meta[i]["id"]
    return measure().uss - before, total


def _fork_growth(meta, n):
    import multiprocessing as mp

    global META
    META = meta
    try:
        with mp.get_context("fork").Pool(1) as pool:
            return pool.apply(_worker_uss_growth, ((None, n),))
    finally:
        META = None


def test_shared_list_does_not_grow_workers_where_a_plain_list_does():
    import multiprocessing as mp

    n = 1_000_000
    plain = [{"id": i, "name": "x"} for i in range(n)]
    shared = sd.SharedList(plain)
    plain_growth, t1 = _fork_growth(plain, n)
    shared_growth, t2 = _fork_growth(shared, n)
    with mp.get_context("spawn").Pool(1) as pool:
        spawn_growth, t3 = pool.apply(_worker_uss_growth, ((shared, n),))
    assert t1 == t2 == t3 == n * (n - 1) // 2
    assert plain_growth > 50 << 20  # refcounts copied the list's pages into the worker
    assert shared_growth < 8 << 20 and spawn_growth < 8 << 20


class Shifting(Dataset):
    """A 4 KiB tensor whose shape changes for items 1500-1599 only, where its token list
    also turns to floats: columns adapt mid-way, after blocks of rows were written."""

    def __len__(self):
        return 3000

    def __getitem__(self, i):
        odd = 1500 <= i < 1600
        x = torch.full((5 if odd else 4, 256), float(i))
        return {"x": x, "tokens": [i + 0.5] if odd else [i, i], "id": i, "name": f"n{i}"}


@pytest.mark.parametrize("workers", [0, 2])
def test_columns_adapt_after_blocks_were_written(workers):
    original = Shifting()
    ds = sd.SharedDataset(original, num_workers=workers)
    assert "x.shape" in ds.columns  # x became ragged, its first 1024+ rows read back
    for i in [0, 1023, 1024, 1499, 1500, 1599, 1600, 2047, 2048, 2999]:
        _equal(ds[i], original[i])
    assert [ds[i]["tokens"] for i in range(1495, 1605)] == [
        original[i]["tokens"] for i in range(1495, 1605)
    ]
    assert not any(t.name == "shareddata-writer" for t in threading.enumerate())


class Odd(Dataset):
    """Item 5 holds ``odd``, every other item ``usual``."""

    def __init__(self, usual, odd):
        self.usual, self.odd = usual, odd

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"v": self.odd if i == 5 else self.usual}


@pytest.mark.parametrize(
    ("usual", "odd", "error", "match"),
    [
        (1, 2**70, ValueError, r"item 5, field 'v': 1180591620717411303424 does not fit in"),
        ("ok", "bad \ud800", ValueError, r"item 5, field 'v': the str is not valid text"),
        (torch.ones(2), torch.ones(2, 2), TypeError, r"item 5, field 'v'.*2 dimensions, item 0"),
        (Box(1, "a"), lambda: 0, TypeError, r"item 5, field 'v': a function cannot be pickled"),
    ],
    ids=["int-beyond-int64", "surrogate-str", "ndim-changes", "unpicklable"],
)
def test_values_a_column_cannot_hold_name_index_and_field(usual, odd, error, match):
    with pytest.raises(error, match=match) as info:
        sd.SharedDataset(Odd(usual, odd))
    assert isinstance(info.value, sd.SharedDataError)


def test_lists_widen_and_grad_tensors_keep_requires_grad():
    class Lists(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return [] if i < 3 else [i / 2], torch.ones(3, requires_grad=True) * i

    ds = sd.SharedDataset(Lists())
    assert ds[4][0] == [2.0] and ds[0][0] == [] and isinstance(ds[3][0][0], float)
    # the data and requires_grad come back, as a leaf (the graph that made it cannot)
    assert ds[5][1].requires_grad and ds[5][1].is_leaf and ds[5][1].tolist() == [5.0] * 3


def _worker_error(i):
    if i == 700:
        raise ValueError("bad record")
    return torch.zeros(1024), f"{i}"


class BrokenInWorker(Dataset):
    def __len__(self):
        return 2000

    def __getitem__(self, i):
        return _worker_error(i)


def test_workers_report_the_index_and_free_everything():
    fds = fd_links()
    with pytest.raises(ValueError, match="bad record") as info:
        sd.SharedDataset(BrokenInWorker(), num_workers=2)
    assert "item 700 of BrokenInWorker" in str(info.value)
    with pytest.raises(TypeError, match=r"item 3, field 'y': expected str.*got int"):
        sd.SharedDataset(Mixed(), num_workers=2)
    del info
    gc.collect()
    # A multiprocessing.Queue's feeder thread closes its pipe after the queue's close()
    # returns (torch cancels the join), so the last pipe may close a moment later.
    deadline = time.monotonic() + 10
    while (now := fd_links()).keys() != fds.keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now.keys() == fds.keys(), {fd: now.get(fd, fds.get(fd)) for fd in now.keys() ^ fds}


class Mixed(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"x": torch.zeros(2), "y": "a" if i < 3 else 7}


@pytest.mark.parametrize("failure", ["full", "interrupt"])
def test_a_failure_mid_way_stops_the_writer_and_frees_everything(failure, monkeypatch):
    import errno

    from shareddata.storage import _writer

    class Big(Dataset):
        def __len__(self):
            return 4000

        def __getitem__(self, i):
            if failure == "interrupt" and i == 3500:
                raise KeyboardInterrupt
            return torch.zeros(1024), i

    if failure == "full":
        real, calls = os.pwrite, []

        def pwrite(fd, data, offset):
            calls.append(1)
            if len(calls) > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        monkeypatch.setattr(_writer.os, "pwrite", pwrite)
    fds = open_fds()
    expected = sd.SharedMemoryFullError if failure == "full" else KeyboardInterrupt
    with pytest.raises(expected) as info:
        sd.SharedDataset(Big())
    assert failure == "interrupt" or "ran out of room" in str(info.value)
    monkeypatch.undo()
    del info
    gc.collect()
    assert open_fds() == fds
    assert not any(t.name == "shareddata-writer" for t in threading.enumerate())


# -- bounded private memory for variable-length values (Note [Variable-length values go
# to shared memory as they come] in _writer.py) ------------------------------------------

_RAGGED_SCRIPT = """
import os, shutil, sys, time, threading
import torch, shareddata as sd
from torch.utils.data import Dataset

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)

ROWS, TOTAL = 4096, int(sys.argv[1]) << 20
class Ragged(Dataset):  # items made on demand: the test's data is never held privately
    def __len__(self):
        return ROWS
    def size(self, i):  # 0.5x .. 1.5x the mean, int64 elements; item 0 small (the
        # fixed-size column sized from it stays small until the shape varies)
        return 1 if i == 0 else (TOTAL // ROWS // 8) * (50 + (i * 37) % 101) // 100
    def __getitem__(self, i):
        return {"x": torch.full((self.size(i),), i, dtype=torch.int64), "label": i}

class Blobs:  # SharedList items: variable-size bytes, made on demand
    def __len__(self):
        return ROWS
    def __iter__(self):
        for i in range(ROWS):
            yield bytes([i % 251]) * (Ragged().size(i) * 8)

mode, store = sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
fds = len(os.listdir("/proc/self/fd"))
torch.full((10,), 1)  # torch's own first allocations before the start
start = anon()
threading.Thread(target=watch, daemon=True).start()
t0 = time.perf_counter()
try:
    if mode == "dataset":
        ds = sd.SharedDataset(Ragged(), storage_dir=store, progress=False)
        for i in (0, 1, 777, ROWS - 1):
            item = ds[i]
            assert item["label"] == i and item["x"].shape == (Ragged().size(i),), i
            assert bool((item["x"] == i).all()), i
    else:
        items = sd.SharedList(Blobs(), storage_dir=store, progress=False)
        for i in (0, 5, ROWS - 1):
            assert items[i] == bytes([i % 251]) * (Ragged().size(i) * 8), i
    print("@@OK", flush=True)
except sd.SharedMemoryFullError as e:
    print("@@FULL", str(e).replace(chr(10), " "), flush=True)
    print("@@STORE_USED", shutil.disk_usage(store).used if store else 0, flush=True)
print("@@FDS", len(os.listdir("/proc/self/fd")) - fds, flush=True)
def link(f):
    try:
        return os.readlink(f"/proc/self/fd/{f}")
    except OSError:
        return None
print("@@FDLIST", [link(f) for f in os.listdir("/proc/self/fd")])
print("@@PEAK", peak[0] - start, "@@SECONDS", round(time.perf_counter() - t0, 1), flush=True)
"""


def _ragged_run(mode: str, mib: int, store_mib: int = 0) -> dict[str, str]:
    from conftest import can_unshare, run_isolated

    extra = ""
    args = f"{mib} {mode}"
    if store_mib:
        if not can_unshare():
            pytest.skip("a small tmpfs for storage_dir needs root (unshare -m)")
        extra = (
            f"mkdir -p /mnt/sd-small && mount -t tmpfs -o size={store_mib}m tmpfs /mnt/sd-small &&"
        )
        args += " /mnt/sd-small"
    script = f"import sys; sys.argv = ['x'] + {args.split()!r}\n" + _RAGGED_SCRIPT
    run = run_isolated(script, timeout=120, extra_mounts=extra)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for line in run.stdout.splitlines():
        if line.startswith("@@"):
            key, _, rest = line.partition(" ")
            out[key] = rest
    print(run.stdout)
    return out


@pytest.mark.parametrize("mode", ["dataset", "list"])
def test_ragged_items_use_bounded_private_memory(mode):
    """~1 GiB of variable-size items: private memory grows < 200 MiB; rows checked."""
    out = _ragged_run(mode, 1024)
    assert "@@OK" in out, out
    peak = int(out["@@PEAK"].split()[0])
    assert peak < 200 << 20, f"private memory grew by {peak >> 20} MiB"


@pytest.mark.parametrize("mode", ["dataset", "list"])
def test_ragged_items_in_a_too_small_store_fail_early_and_leave_nothing(mode):
    """A 128 MiB storage_dir for ~1 GiB: SharedMemoryFullError, memory bounded, store empty."""
    out = _ragged_run(mode, 1024, store_mib=128)
    assert "@@FULL" in out, out
    message = out["@@FULL"]
    assert "storage_dir=" in message and "Fix:" in message, message
    assert ("field 'x'" in message) if mode == "dataset" else ("SharedList" in message)
    assert int(out["@@STORE_USED"]) < 1 << 20  # the file is gone
    assert "shareddata" not in out["@@FDLIST"] and "sd-small" not in out["@@FDLIST"]
    assert int(out["@@PEAK"].split()[0]) < 200 << 20


@pytest.mark.parametrize("kind", ["shared_list", "shared_dataset"])
def test_small_text_fits_where_little_room_is_left(kind, monkeypatch):
    """A few KiB of strings load with 1 MiB free; a 2 MiB string is refused, by name.

    (The room was checked 64 MiB at a time, so any text needed 64 MiB free.) Free here
    means beyond the load's private peak and margin, which are left out.
    """
    from shareddata.storage import _capacity

    monkeypatch.setattr(_capacity, "available_memory", lambda directory=None: 1 << 20)
    monkeypatch.setattr(_capacity, "margin", lambda nbytes: 0)
    monkeypatch.setattr(_capacity, "_private", lambda: 0)

    def make(names):
        if kind == "shared_list":
            return sd.SharedList(names, progress=False)
        return sd.SharedDataset(names, progress=False)  # a list is a map-style dataset

    names = [f"{i:08d}.jpg" for i in range(1000)]
    small = make(names)
    assert [small[i] for i in (0, 999)] == [names[0], names[999]]
    with pytest.raises(
        sd.SharedMemoryFullError,
        match=r"the values that follow\) needs 2\.0 MiB.*only 1\.0 MiB \(1048576 bytes\) is free",
    ):
        make(["a", "b" * (2 << 20)])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's, unpickling one
def test_datetimes_and_sparse_tensors_come_back_as_they_were():
    """Values no tensor column can hold (datetime64, sparse COO) are kept whole, exactly."""
    items = [
        {
            "day": np.datetime64("2020-01-01") + i,
            "stamps": np.array([i, i + 1], "datetime64[s]"),
            "gap": np.timedelta64(i, "ms"),
            "adj": (torch.eye(3) * i).to_sparse(),
            "x": i,
        }
        for i in range(6)
    ]
    ds = sd.SharedDataset(items, progress=False)
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list, timeout=60)
    for got, want in zip([ds[i] for i in range(6)] + [s for b in loader for s in b], items * 2):
        assert got["day"] == want["day"] and type(got["day"]) is np.datetime64
        assert got["stamps"].dtype == want["stamps"].dtype
        assert (got["stamps"] == want["stamps"]).all() and got["gap"] == want["gap"]
        assert got["adj"].layout is torch.sparse_coo
        assert torch.equal(got["adj"].to_dense(), want["adj"].to_dense()) and got["x"] == want["x"]


def test_fields_whose_paths_coincide_stay_apart():
    """A key "a.b" next to {"a": {"b": ...}}, a ragged "r" next to a key "r.shape":
    one column each (they shared one, and items lost a field or failed)."""
    items = [
        {"a.b": i, "a": {"b": 100 + i}, "r": torch.arange(i + 1).reshape(1, -1), "r.shape": i}
        for i in range(6)
    ]
    ds = sd.SharedDataset(items, progress=False)
    assert len(set(ds.columns)) == len(ds.columns)
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list, timeout=60)
    for got, want in zip([ds[i] for i in range(6)] + [s for b in loader for s in b], items * 2):
        assert (
            got["a.b"] == want["a.b"]
            and got["a"] == want["a"]
            and got["r.shape"] == want["r.shape"]
        )
        assert torch.equal(got["r"], want["r"])


def test_bfloat16_tensors_are_stored_as_their_bits_and_come_back_bfloat16():
    """Fixed-shape and ragged bfloat16 tensors (mixed-precision features, embeddings)."""
    g = torch.Generator().manual_seed(0)
    items = [
        {"emb": torch.randn(8, generator=g).bfloat16(), "r": torch.randn(i + 1, 2).bfloat16()}
        for i in range(6)
    ]
    ds = sd.SharedDataset(items, progress=False)
    assert ds.nbytes < 1024  # two bytes a value, no pickles
    read_by_workers = sd.SharedDataset(items, num_workers=2, progress=False)
    assert all(torch.equal(read_by_workers[i]["emb"], items[i]["emb"]) for i in range(6))
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list, timeout=60)
    for got, want in zip([ds[i] for i in range(6)] + [s for b in loader for s in b], items * 2):
        assert got["emb"].dtype is torch.bfloat16 and torch.equal(got["emb"], want["emb"])
        assert got["r"].dtype is torch.bfloat16 and torch.equal(got["r"], want["r"])
    batch = next(
        iter(DataLoader(ds, batch_size=6, collate_fn=lambda b: torch.stack([s["emb"] for s in b])))
    )
    assert torch.equal(batch, torch.stack([it["emb"] for it in items]))
    # an int16 tensor is not a bfloat16 one, though both are stored as 16 bits
    with pytest.raises(
        sd.ItemMismatchError, match=r"item 1, field 'emb': expected tensor bfloat16"
    ):
        sd.SharedDataset([items[0], {"emb": torch.ones(8, dtype=torch.int16), "r": items[0]["r"]}])


# -- items come back with the types they had (issue 22; Note [What comes back]) ----------------


class Marked(torch.Tensor):
    """A tensor subclass that only marks a type (as torchvision's tv_tensors.Image does)."""


class Annotated(torch.Tensor):
    """A tensor subclass whose instances carry attributes: kept whole, pickled."""


def _annotated(i):
    t = torch.full((2,), float(i)).as_subclass(Annotated)
    t.source = f"file{i}"
    return t


class Typed(Dataset):
    """Items whose types a plain copy would lose: Parameters, subclasses, requires_grad,
    big-endian arrays (fixed and ragged), np.memmap rows, dicts in another key order."""

    def __init__(self, path, n=12):
        self.n, self.path = n, str(path)
        mm = np.memmap(self.path, dtype=">f8", mode="w+", shape=(n, 3))
        mm[:] = np.arange(n * 3).reshape(n, 3) / 4
        mm.flush()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        mm = np.memmap(self.path, dtype=">f8", mode="r", shape=(self.n, 3))
        item = {
            "param": torch.nn.Parameter(torch.full((2,), float(i))),
            "frozen": torch.nn.Parameter(torch.full((2,), float(i)), requires_grad=False),
            "marked": (torch.arange(3.0) + i).as_subclass(Marked),
            "grad": torch.full((2,), float(i)).requires_grad_(),
            "annotated": _annotated(i),
            "big": (np.arange(3) + i).astype(">i4"),
            "big_ragged": (np.arange(i % 3 + 1) + i).astype(">f8"),
            "mm": mm[i],
            "meta": {"b": i, "a": str(i)} if i % 2 else {"a": str(i), "b": i},
        }
        return item if i % 2 == 0 else dict(reversed(list(item.items())))


def _as_typed(got, want, where):
    """``got`` holds ``want``'s values, with its type, dtype and requires_grad."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for k in want:
            _as_typed(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, torch.Tensor):
        assert type(got) is type(want), (where, type(got), type(want))
        assert got.dtype == want.dtype and got.requires_grad == want.requires_grad, where
        assert torch.equal(got.detach(), want.detach()), where
        assert getattr(got, "__dict__", {}) == getattr(want, "__dict__", {}), where
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, (where, type(got))  # an np.memmap too
        assert got.dtype == want.dtype and got.dtype.str == want.dtype.str, (where, got.dtype)
        assert np.array_equal(got, want), where
    else:
        assert type(got) is type(want) and got == want, where


def test_items_come_back_with_their_types(tmp_path):
    original = Typed(tmp_path / "mm")
    assert original[0]["big"].dtype.str == ">i4" and type(original[0]["mm"]) is np.memmap
    keys = list(original[0])
    for ds in (
        sd.SharedDataset(original, progress=False),
        sd.SharedDataset(original, num_workers=2, progress=False),  # read by workers
    ):
        assert type(ds[3]["param"]) is torch.nn.Parameter and ds[3]["param"].requires_grad
        assert ds[3]["big"].dtype.str == ">i4" and ds[3]["big_ragged"].dtype.str == ">f8"
        for i in range(len(original)):
            _as_typed(ds[i], original[i], f"ds[{i}]")
            # every item in item 0's key order (the default collate's), its keys in any
            assert list(ds[i]) == keys and list(ds[i]["meta"]) == ["a", "b"]
        for got, i in zip(ds.__getitems__([5, 0, 7]), [5, 0, 7]):
            _as_typed(got, original[i], f"sample {i}")
        back = pickle.loads(pickle.dumps(ds))
        _as_typed(back[9], original[9], "unpickled ds[9]")
    # from fork workers, never looked at in the worker (made on arrival) and looked at:
    # arrays cross as numpy pickles them (native byte order before pickle protocol 5,
    # for any dataset), so only the tensors' types are compared here
    for collate in (list, lambda b: [dict(s) for s in b]):
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate, timeout=60)
        for k, got in enumerate(s for b in loader for s in b):
            want = original[k]
            for name in ("param", "frozen", "marked", "grad", "annotated"):
                _as_typed(got[name], want[name], f"item {k} from a worker")
            assert np.array_equal(got["mm"], want["mm"]) and got["meta"] == want["meta"]


def test_batches_of_typed_items_are_what_the_default_collate_makes_of_them(tmp_path):
    from torch.utils.data import default_collate

    original = Typed(tmp_path / "mm")
    ds = sd.SharedDataset(original, progress=False)
    order = [2, 7, 4, 11]
    # default_collate refuses big-endian arrays, and stacks parameters that require
    # grad into a batch that does too (in a worker: refused, out= has no autograd)
    for name, error in [("big", ValueError), ("mm", ValueError)]:
        with pytest.raises(error) as theirs:
            default_collate([original[i][name] for i in order])
        with pytest.raises(error) as mine:
            default_collate([s[name] for s in ds.__getitems__(order)])
        assert str(mine.value) == str(theirs.value)
    collatable = ["param", "frozen", "marked", "grad", "meta"]

    class Pick(Dataset):
        def __len__(self):
            return len(original)

        def __getitem__(self, i):
            return {k: original[i][k] for k in collatable}

    picked = sd.SharedDataset(Pick(), progress=False)
    want = default_collate([Pick()[i] for i in order])
    for got in (
        next(iter(DataLoader(picked, batch_size=4, sampler=order))),
        picked[order],  # what IndexBatchSampler batches are
    ):
        assert list(got) == list(want)
        for k in ("param", "frozen", "marked", "grad"):
            assert type(got[k]) is type(want[k]), (k, type(got[k]), type(want[k]))
            assert got[k].requires_grad == want[k].requires_grad, k
            assert torch.equal(got[k].detach(), want[k].detach()), k
        assert got["meta"]["a"] == want["meta"]["a"]
        assert torch.equal(got["meta"]["b"], want["meta"]["b"])
    # in a worker the default collate refuses to stack tensors that require grad
    # (out= has no autograd): the original and SharedDataset raise the same error
    errors = []
    for d in (Pick(), picked):
        with pytest.raises(RuntimeError) as info:
            next(iter(DataLoader(d, batch_size=4, num_workers=1, timeout=60)))
        errors.append(str(info.value).split("Original Traceback")[0])
    assert errors[0] == errors[1] and "DataLoader worker" in errors[0]
    # the whole item, through SharedDataset's own batches: the same error as the original's
    with pytest.raises(ValueError, match="byte order"):
        next(iter(DataLoader(original, batch_size=4)))
    with pytest.raises(ValueError, match="byte order"):
        next(iter(DataLoader(ds, batch_size=4)))


class Keyed(Dataset):
    """Dict items whose keys come in another order from item to item."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        item = {"x": torch.full((3,), float(i)), "y": i, "t": f"#{i}", "r": list(range(i % 3))}
        order = [["x", "y", "t", "r"], ["t", "r", "y", "x"], ["y", "x", "r", "t"]][i % 3]
        return {k: item[k] for k in order}


def test_dicts_with_keys_in_another_order_are_accepted():
    from torch.utils.data import default_collate

    original = Keyed()
    for workers in (0, 2):
        ds = sd.SharedDataset(original, num_workers=workers, progress=False)
        for i in range(len(original)):
            got, want = ds[i], original[i]
            assert list(got) == ["x", "y", "t", "r"]  # item 0's order
            assert all(got[k] == want[k] for k in "ytr") and torch.equal(got["x"], want["x"])
        mine = next(iter(DataLoader(ds, batch_size=9, collate_fn=lambda b: b)))
        plain = [{k: s[k] for k in s} for s in mine]
        theirs = default_collate([{k: original[i][k] for k in ("x", "y", "t")} for i in range(9)])
        got = default_collate([{k: s[k] for k in ("x", "y", "t")} for s in plain])
        assert torch.equal(got["x"], theirs["x"]) and torch.equal(got["y"], theirs["y"])
        assert got["t"] == theirs["t"]


def test_items_whose_types_differ_from_item_0s_are_refused_by_name(tmp_path):
    def items(first, other):
        return [{"v": first}] * 3 + [{"v": other}] + [{"v": first}]

    p = torch.nn.Parameter(torch.ones(2))
    cases = [
        (p, torch.ones(2), r"item 3, field 'v': expected Parameter float32 requiring grad as "
                           r"in item 0, got tensor torch.float32 \(2,\)"),
        (torch.ones(2), torch.ones(2, requires_grad=True),
         r"expected tensor float32 as in item 0, got tensor torch.float32 \(2,\) requiring"),
        (np.ones(2, ">f8"), np.ones(2, "<f8"), r"expected ndarray >f8 as in item 0, got ndarray "
                                               r"float64"),
        (torch.ones(2).as_subclass(Marked), _annotated(1).as_subclass(Marked),
         r"expected Marked float32 as in item 0"),
    ]  # fmt: skip
    for first, other, match in cases:
        if type(other) is Marked:
            other.source = "x"  # a Marked that carries an attribute: not rebuildable
        with pytest.raises(sd.ItemMismatchError, match=match):
            sd.SharedDataset(items(first, other), progress=False)
    # keys: the same ones in any order, not others
    with pytest.raises(sd.ItemMismatchError, match=r"item 1, field 'm': keys \['a', 'c'\]"):
        sd.SharedDataset([{"m": {"a": 1, "b": 2}}, {"m": {"a": 1, "c": 2}}], progress=False)


def test_shared_array_from_array_makes_big_endian_native():
    # the documented conversion: a SharedArray is a tensor's memory too (torch has
    # native byte order only), so from_array keeps the values in native order
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    a = sd.SharedArray.from_array(big)
    assert a.dtype == np.dtype("int32") and a.dtype.isnative
    assert np.array_equal(a.numpy(), big) and a.torch().tolist() == big.tolist()


class Nested(Dataset):
    """Items nested in tuples, dicts and lists, with numbers, text and numpy values."""

    def __init__(self, ragged=False):
        self.ragged = ragged

    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        boxes = torch.rand((i % 3 + 1) if self.ragged else 2, 4, generator=g)
        meta = {"label": i % 5, "boxes": boxes, "names": (f"a{i}", f"b{i}")}
        return torch.rand(2, 3, generator=g), meta, [i / 3, np.float32(i), np.arange(2) + i]


def _plain_batch(batch):
    from kinds import to_plain

    plain = to_plain(batch)
    return plain, type(batch).__name__


@pytest.mark.parametrize("kind", ["shared_dataset", "shared_list"])
def test_nested_and_ragged_items_leave_a_worker_as_one_memfd(kind, monkeypatch):
    """SharedDataset and SharedList batches of nested items (default collate and
    IndexBatchSampler) and of ragged ones (samples as they are) cross as one memfd,
    and equal what the original dataset gives (issue 22)."""
    import test_crossing as crossing
    from torch.utils.data import default_collate, default_convert

    def wrap(original):
        if kind == "shared_dataset":
            return sd.SharedDataset(original, progress=False)
        return sd.SharedList([original[i] for i in range(len(original))], progress=False)

    fixed, ragged = Nested(), Nested(ragged=True)
    shared, shared_ragged = wrap(fixed), wrap(ragged)
    crossing._count_receptions(monkeypatch)
    kw = {"num_workers": 2, "multiprocessing_context": "fork", "timeout": 60}
    loaders = [
        (DataLoader(shared, batch_size=8, **kw), fixed, "default collate"),
        (DataLoader(shared_ragged, batch_size=8, collate_fn=_as_list, **kw), ragged, "samples"),
    ]
    if kind == "shared_dataset":
        sampler = sd.IndexBatchSampler(shared, 8)
        loaders.append((DataLoader(shared, sampler=sampler, batch_size=None, **kw), fixed, "ibs"))
    for loader, original, what in loaders:
        crossing.RECEIVED.clear()
        n = 0
        for k, batch in enumerate(loader):
            items = [original[i] for i in range(8 * k, 8 * (k + 1))]
            if what == "samples":
                for got, want in zip(batch, items):
                    _equal(got, want, sample=True)
            else:  # (batch_size=None: the DataLoader's default_convert makes tuples lists)
                want = default_collate(items)
                want = default_convert(want) if what == "ibs" else want
                assert _plain_batch(batch) == _plain_batch(want), what
            crossing._assert_one_memfd(batch, f"{kind}, {what}")
            n += 1
        assert n == 6 and {"receive": n} == crossing.RECEIVED, (what, crossing.RECEIVED)


class Alone(Dataset):
    """Items that are a tensor alone (unlabelled images)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 4), float(i))


def test_items_that_are_a_tensor_alone_leave_a_worker_as_one_memfd(monkeypatch):
    # the samples are the gathered column's rows (SharedTensors in a worker): the
    # default collate takes the column for them (collate_shared in crossing/_collate.py)
    import test_crossing as crossing
    from torch.utils.data import default_collate

    original = Alone()
    ds = sd.SharedDataset(original, progress=False)
    crossing._count_receptions(monkeypatch)
    kw = {"num_workers": 2, "multiprocessing_context": "fork", "timeout": 60}
    for loader in (
        DataLoader(ds, batch_size=8, **kw),
        DataLoader(ds, sampler=sd.IndexBatchSampler(ds, 8), batch_size=None, **kw),
    ):
        crossing.RECEIVED.clear()
        for k, batch in enumerate(loader):
            assert torch.equal(
                batch, default_collate([original[i] for i in range(8 * k, 8 * k + 8)])
            )
            crossing._assert_one_memfd(batch, "a tensor alone")
        assert crossing.RECEIVED == {"receive": 4}


# -- image folders: a random augmentation is caught; JPEG bytes stay encoded ---------------


def _jpeg_folder(root, per_class=6, size=(40, 32)):
    """An ImageFolder layout of real JPEG files written by PIL: root/<class>/<n>.jpg."""
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    rng = np.random.default_rng(0)
    for c, name in enumerate(("cat", "dog")):
        os.makedirs(root / name)
        for n in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            pixels[..., c] = 255  # label = the brighter channel
            image_module.fromarray(pixels).save(root / name / f"{n}.jpg", quality=90)
    return root


class JpegFolder(Dataset):
    """What torchvision's ImageFolder does: (loader(path), class index) over root/<class>/*;
    ``loader`` decodes with PIL by default, and ``transform`` runs on what it returns."""

    def __init__(self, root, transform=None, loader=None):
        classes = sorted(p.name for p in root.iterdir())
        self.samples = [
            (p, c) for c, name in enumerate(classes) for p in sorted((root / name).iterdir())
        ]
        self.transform, self.loader = transform, loader or _decode_file

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        item = self.loader(path)
        return (self.transform(item) if self.transform else item), label


def _decode_file(path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def _to_tensor(image):
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def _random_crop(image, size=24):  # what RandomResizedCrop does, minus the resize
    y, x = (int(torch.randint(0, n - size + 1, ())) for n in image.shape[1:])
    return image[:, y : y + size, x : x + size]


def _crop_item(item):
    image, label = item
    return _random_crop(image), label


def _decode_and_crop(item):  # the worker's part: decode the shared bytes, augment
    import io

    from PIL import Image

    data, label = item
    with Image.open(io.BytesIO(data)) as image:
        return _random_crop(_to_tensor(image.convert("RGB"))), label


def _read_bytes(path):  # ImageFolder's loader= for the recipe: the file, not decoded
    with open(path, "rb") as f:
        return f.read()


def test_a_random_augmentation_in_the_wrapped_dataset_is_named_with_its_fix(tmp_path):
    """SharedDataset(ImageFolder(root, transform=RandomResizedCrop)) would freeze the crop:
    it warns, naming the dataset, the index and transform=; the fix gives new crops."""
    root = _jpeg_folder(tmp_path / "images")
    torch.manual_seed(0)
    before = torch.rand(())
    with pytest.warns(UserWarning, match=r"JpegFolder\): item 0 differs .* transform=") as caught:
        frozen = sd.SharedDataset(JpegFolder(root, transform=_decode_crop), progress=False)
    assert len(caught) == 1 and "JpegFolder[0]" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the SharedDataset(...) line
    torch.manual_seed(0)
    assert torch.rand(()) == before  # the check reads under its own random state
    assert torch.equal(frozen[3][0], frozen[3][0])  # frozen indeed: one crop forever
    # the fix: decode in the dataset (deterministic, no warning), crop per read
    fixed = sd.SharedDataset(
        JpegFolder(root, transform=_to_tensor), transform=_crop_item, progress=False
    )
    crops = {fixed[3][0].numpy().tobytes() for _ in range(8)}
    assert len(crops) > 1


def _decode_crop(image):  # a random crop inside the dataset: what gets frozen
    return _random_crop(_to_tensor(image))


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_jpeg_bytes_stay_encoded_and_are_decoded_in_the_worker(tmp_path, mode):
    """The recipe of docs/tutorials/migrate.md: an ImageFolder whose loader reads the file's
    bytes, wrapped with a transform that decodes and augments: the shared copy holds the
    JPEG files' bytes (not decoded pixels), and the workers give the files' images."""
    root = _jpeg_folder(tmp_path / "images")
    encoded = sd.SharedDataset(
        JpegFolder(root, loader=_read_bytes), transform=_decode_and_crop, progress=False
    )
    decoded = sd.SharedDataset(JpegFolder(root, transform=_to_tensor), progress=False)
    files = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    assert files <= encoded.nbytes < files + 4096  # the bytes, plus offsets and labels
    assert decoded.nbytes >= 12 * 3 * 40 * 32
    loader = DataLoader(encoded, batch_size=4, num_workers=2, multiprocessing_context=mode)
    crops, labels = zip(*loader)
    crops, labels = torch.cat(crops), torch.cat(labels)
    assert crops.shape == (12, 3, 24, 24) and labels.tolist() == [0] * 6 + [1] * 6
    for crop, label in zip(crops, labels):  # the label's channel is the brightest
        assert crop[label].float().mean() > 200
    image, label = decoded[7]
    assert label == 1 and torch.equal(
        image, _to_tensor(_decode_file(JpegFolder(root).samples[7][0]))
    )


def test_torchvision_image_folder_with_a_random_crop_warns_and_its_bytes_recipe_works(tmp_path):
    datasets = pytest.importorskip(
        "torchvision.datasets",
        reason="torchvision is not installed (it does not install beside torch 2.13.0 here)",
    )
    from torchvision import transforms

    root = _jpeg_folder(tmp_path / "images")
    with pytest.warns(UserWarning, match=r"SharedDataset\(ImageFolder\): item 0 differs"):
        sd.SharedDataset(
            datasets.ImageFolder(root, transform=transforms.RandomResizedCrop(16)), progress=False
        )
    recipe = sd.SharedDataset(
        datasets.ImageFolder(root, loader=_read_bytes), transform=_decode_and_crop, progress=False
    )
    crop, label = recipe[11]
    assert crop.shape == (3, 24, 24) and label == 1


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch's
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32"])
def test_shared_list_reads_back_tensors_of_dtypes_numpy_lacks(name):
    """Issue 29: float8 and complex32 items were stored, then raised AttributeError when read.

    (torch's own pickle of them cannot be loaded; they go as their bytes now.)
    """
    dtype = getattr(torch, name)
    t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7).to(dtype)
    items = [{"t": t, "row": t[1], "n": i} for i in range(3)]
    ds = sd.SharedList(items, progress=False)
    again = pickle.loads(pickle.dumps(ds))  # what a spawned worker reads
    for got in (ds[2], again[2], ds[:3][2]):
        assert got["n"] == 2
        for key, want in (("t", t), ("row", t[1])):
            assert got[key].dtype == dtype and got[key].shape == want.shape
            assert torch.equal(got[key].view(torch.uint8), want.contiguous().view(torch.uint8))
