import dataclasses
import gc
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from conftest import START_METHODS, open_fds
from torch.utils.data import DataLoader, Dataset, IterableDataset

import shareddata as sd
from shareddata.crossing import _batch as sd_batch


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
    fds = open_fds()
    with pytest.raises(ValueError, match="bad record") as info:
        sd.SharedDataset(BrokenInWorker(), num_workers=2)
    assert "item 700 of BrokenInWorker" in str(info.value)
    with pytest.raises(TypeError, match=r"item 3, field 'y': expected str.*got int"):
        sd.SharedDataset(Mixed(), num_workers=2)
    del info
    gc.collect()
    assert open_fds() == fds


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

    (The room was checked 64 MiB at a time, so any text needed 64 MiB free.)
    """
    from shareddata.storage import _writer

    monkeypatch.setattr(_writer, "available_memory", lambda directory=None: 1 << 20)

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
