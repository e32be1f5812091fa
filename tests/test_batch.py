"""The default collate's shortcut: batches equal per-sample ones, whatever a collate_fn does."""

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import shareddata as sd


def _dataset(output="dict"):
    rng = np.random.default_rng(0)
    return sd.NumpyDataset(
        {"x": rng.random((50, 3, 2), dtype=np.float32), "y": np.arange(50, dtype=np.int32)},
        output=output,
    )


def _per_sample(ds, idx):
    return default_collate([ds[i] for i in idx])


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


@pytest.mark.parametrize("output", ["dict", "tuple"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_equal_per_sample_batches(output, num_workers):
    ds = _dataset(output)
    loader = DataLoader(ds, batch_size=16, num_workers=num_workers)
    order = list(range(50))
    for start, batch in zip(range(0, 50, 16), loader):
        assert _equal(batch, _per_sample(ds, order[start : start + 16]))


def test_samples_are_dicts_and_tuples_to_users():
    ds, dt = _dataset(), _dataset("tuple")
    s, t = ds.__getitems__([4, 2]), dt.__getitems__([4, 2])
    assert isinstance(s[0], dict) and s[0].keys() == {"x", "y"}
    assert isinstance(t[0], tuple) and len(t[0]) == 2
    assert torch.equal(s[1]["x"], ds[2]["x"]) and torch.equal(t[0][1], dt[4][1])
    again = pickle.loads(pickle.dumps(list(s)))
    assert torch.equal(again[0]["x"], s[0]["x"]) and again[0].keys() == s[0].keys()


def test_collate_fn_that_replaces_values_gets_its_values():
    ds = _dataset()

    def collate(batch):
        for sample in batch:
            sample["x"] = sample["x"].double() * 2
        return default_collate(batch)

    batch = next(iter(DataLoader(ds, batch_size=8, collate_fn=collate)))
    assert batch["x"].dtype == torch.float64
    assert torch.equal(batch["x"], _per_sample(ds, range(8))["x"].double() * 2)


def test_collate_fn_that_filters_reorders_or_adds_keys():
    ds = _dataset()
    idx = [5, 9, 1, 7]

    samples = ds.__getitems__(idx)
    del samples[1]
    assert _equal(default_collate(samples), _per_sample(ds, [5, 1, 7]))

    samples = ds.__getitems__(idx)
    samples.reverse()
    assert _equal(default_collate(samples), _per_sample(ds, idx[::-1]))

    samples = ds.__getitems__(idx)
    for s in samples:
        s["z"] = torch.tensor(1.0)
    batch = default_collate(samples)
    assert batch.keys() == {"x", "y", "z"} and torch.equal(batch["z"], torch.ones(4))

    samples = ds.__getitems__(idx)
    del samples[0]["y"]
    with pytest.raises(KeyError):  # as for plain dicts: the first sample sets the keys
        default_collate(list(reversed(samples)))


def test_samples_of_two_batches_collate_together():
    ds = _dataset("tuple")
    mixed = ds.__getitems__([1, 2]) + ds.__getitems__([30, 40])
    assert _equal(default_collate(mixed), _per_sample(ds, [1, 2, 30, 40]))


def test_in_place_change_of_a_sample_reaches_the_batch():
    ds = _dataset()
    samples = ds.__getitems__([3, 4])
    samples[0]["x"].zero_()
    batch = default_collate(samples)
    assert not batch["x"][0].any() and torch.equal(batch["x"][1], ds[4]["x"])
    assert ds[3]["x"].any(), "the shared data itself never changes"


def test_string_and_ragged_columns_collate_as_for_plain_samples():
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"s": ["a", "bb", "c", "dd"], "v": [[1, 2], [3, 4], [5], [6, 7]]})
    ds = sd.ArrowDataset(table)
    assert _equal(default_collate(ds.__getitems__([0, 1])), _per_sample(ds, [0, 1]))
    with pytest.raises(RuntimeError, match="equal size"):  # rows of different lengths
        default_collate(ds.__getitems__([0, 2]))


# Every way a collate_fn may use the list it is given (Note [Samples made when first
# used] in _batch.py): each must see all the samples, as from an eager list.
_LIST_USES = {
    "iterate": lambda s: list(iter(s)),
    "len and index": lambda s: [s[i] for i in range(len(s))],
    "negative index": lambda s: [s[-1], s[-len(s)]],
    "slice": lambda s: s[1:],
    "reversed": lambda s: list(reversed(s)),
    "tuple": lambda s: tuple(s),
    "star args": lambda s: list(zip(*s)),
    "list + samples": lambda s: [None] + s,
    "samples + list": lambda s: s + [None],
    "samples + samples": lambda s: s + s,
    "list.extend": lambda s: [0, *s],
    "repeat": lambda s: s * 2,
    "sorted": lambda s: sorted(s, key=lambda r: -int(r["y"])),
    "shuffle in place": lambda s: (s.reverse(), s.insert(0, s.pop()), list(s))[-1],
    "contains and index": lambda s: (s[0] in s, s.index(s[0]), len(s)),
    "truth": lambda s: bool(s),
    "copy": lambda s: __import__("copy").copy(s),
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
}


@pytest.mark.parametrize("use", sorted(_LIST_USES))
def test_every_list_use_sees_every_sample(use):
    ds, idx = _dataset(), [7, 3, 11, 0]
    expected = _LIST_USES[use]([ds[i] for i in idx])
    assert _equal_loose(_LIST_USES[use](ds.__getitems__(idx)), expected)
    first = ds.__getitems__(idx)  # the first sample, made alone, stays the list's own
    head = first[0]
    assert _equal_loose(_LIST_USES[use](first), expected)
    assert any(s is head for s in first)


def _equal_loose(a, b):
    """Equal values, ``Row``/``Samples`` compared as the dict/list they stand for."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Tensor):
        return (
            isinstance(b, type(a).__mro__[-2]) and len(a) == len(b) and all(map(_equal_loose, a, b))
        )
    return _equal(a, b)


def test_samples_never_looked_at_pickle_as_their_columns():
    """What ``collate_fn=lambda b: b`` sends: a few tensors, not one per row and column."""
    from multiprocessing.reduction import ForkingPickler

    ds = sd.NumpyDataset({"x": np.random.rand(4096, 8), "y": np.arange(4096)}, progress=False)
    idx = list(range(0, 4096, 16))
    expected = [ds[i] for i in idx]
    small = len(ForkingPickler.dumps(ds.__getitems__(idx)))
    samples = ds.__getitems__(idx)
    list(samples)  # looked at: crosses as the list of its samples
    assert small * 10 < len(ForkingPickler.dumps(samples))
    for crossed in (
        pickle.loads(pickle.dumps(ds.__getitems__(idx))),
        pickle.loads(ForkingPickler.dumps(ds.__getitems__(idx))),
    ):
        assert _equal_loose(crossed, expected)
        assert default_collate(crossed)["x"] is crossed.batched[0]  # still the shortcut


def test_the_default_collate_makes_no_per_row_samples(monkeypatch):
    from shareddata.columns._columns import TensorColumn

    cuts = []
    split = TensorColumn.split
    monkeypatch.setattr(TensorColumn, "split", lambda self, b: cuts.append(1) or split(self, b))
    ds = _dataset()
    assert _equal(default_collate(ds.__getitems__([4, 9, 2])), _per_sample(ds, [4, 9, 2]))
    assert not cuts, "the batch is the gathered columns: no row was cut out of them"
    samples = ds.__getitems__([4, 9, 2])
    samples[0]["x"] = torch.zeros(3, 2)  # the first sample changed: collated the generic way
    batch = default_collate(samples)
    assert not batch["x"][0].any() and torch.equal(batch["x"][1:], _per_sample(ds, [9, 2])["x"])
    assert cuts


def test_transform_sees_plain_samples_and_batches_match():
    ds = sd.NumpyDataset(np.arange(20.0).reshape(10, 2), transform=lambda s: s["data"] * 10)
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert torch.equal(batch, torch.arange(8.0).reshape(4, 2) * 10)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_batches_stay_valid_after_the_workers_exit(method):
    data = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    ds = sd.NumpyDataset(data)
    workers = 2 if method == "fork" else 1  # a spawn worker costs seconds to start
    loader = DataLoader(ds, batch_size=16, num_workers=workers, multiprocessing_context=method)
    batches = list(loader)  # the workers have exited once the epoch is over
    assert torch.equal(torch.cat([b["data"] for b in batches]), torch.from_numpy(data))
    fast = DataLoader(ds, sampler=sd.IndexBatchSampler(ds, 16), batch_size=None, num_workers=2)
    assert torch.equal(torch.cat([b["data"] for b in fast]), torch.from_numpy(data))


def test_a_worker_holds_a_bounded_number_of_batch_descriptors():
    import os

    ds = sd.NumpyDataset(np.zeros((4096, 64), np.float32))
    loader = DataLoader(ds, batch_size=8, num_workers=1, persistent_workers=True)
    it = iter(loader)
    counts = []
    for i in range(300):
        next(it)
        if i % 50 == 49:
            counts.append(len(os.listdir(f"/proc/{it._workers[0].pid}/fd")))
    assert max(counts) - min(counts) <= 4, counts  # acknowledged batches are closed
    del it, loader


def test_index_batches_reach_workers_by_value_as_plain_tensors():
    import pickle
    from multiprocessing.reduction import ForkingPickler

    batch = next(iter(sd.IndexBatchSampler(100, 8, shuffle=True)))
    sent = pickle.loads(ForkingPickler.dumps(batch))  # what a DataLoader worker receives
    assert type(sent) is torch.Tensor and torch.equal(sent, batch)
    assert not sent.is_shared(), "indices are copied into the pickle, not put in /dev/shm"


def test_a_worker_closes_batches_that_a_transform_replaced():
    import os

    ds = sd.NumpyDataset(np.zeros((4096, 64), np.float32), transform=lambda s: s["data"] + 1)
    loader = DataLoader(ds, batch_size=8, num_workers=1, persistent_workers=True)
    it = iter(loader)
    counts = []
    for i in range(200):
        assert float(next(it)[0, 0]) == 1.0
        if i % 50 == 49:
            counts.append(len(os.listdir(f"/proc/{it._workers[0].pid}/fd")))
    assert max(counts) - min(counts) <= 4, counts  # gathered, never sent, closed
    del it, loader


def _memfd_inode(tensor):
    """The inode of the memfd that ``tensor``'s memory is mapped from (None if not one)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop:
                return int(fields[4]) if "shareddata-batch" in line else None
    return None


def _reuse_loader(data, **kwargs):
    ds = sd.NumpyDataset(data)
    return DataLoader(ds, batch_size=16, num_workers=1, persistent_workers=True, **kwargs)


def test_a_worker_reuses_the_memory_of_batches_the_main_process_dropped():
    # Note [Reusing a batch's pages] in crossing/_transport.py
    data = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64)
    it = iter(_reuse_loader(data, shuffle=True))
    inodes = set()
    for _ in range(100):
        batch = next(it)["data"]
        inodes.add(_memfd_inode(batch))
        del batch
    assert None not in inodes
    assert len(inodes) <= 12, f"{len(inodes)} memfds for 100 batches: dropped ones not reused"
    del it


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_or_a_view_still_held_is_never_overwritten(method):
    data = np.arange(1024 * 64, dtype=np.float32).reshape(1024, 64)
    loader = _reuse_loader(data, multiprocessing_context=method)
    held, views, expected_views = [], [], []
    for _epoch in range(3):  # batches dropped in between are reused meanwhile
        for i, batch in enumerate(loader):
            if i % 3 == 0:
                held.append((i, batch["data"]))  # the whole batch
            elif i % 3 == 1:
                views.append(batch["data"][5].numpy())  # a view of one row, as numpy
                expected_views.append(data[i * 16 + 5])
            del batch
    for i, b in held:
        assert torch.equal(b, torch.from_numpy(data[i * 16 : (i + 1) * 16])), f"batch {i} changed"
    for view, expected in zip(views, expected_views):
        assert np.array_equal(view, expected), "a view of a dropped batch changed"


def test_a_fork_child_dropping_its_copy_of_a_batch_does_not_release_the_parents():
    import os

    data = np.arange(1024 * 64, dtype=np.float32).reshape(1024, 64)
    it = iter(_reuse_loader(data))
    held = next(it)["data"]
    pid = os.fork()
    if pid == 0:  # the child's copy of the batch dies here
        del held
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    for _ in range(40):  # batches that the worker would gather into a released memfd
        next(it)
    assert torch.equal(held, torch.from_numpy(data[:16]))
    del it


@pytest.mark.parametrize("output", ["dict", "tuple"])
def test_a_changed_nested_first_sample_is_collated_with_its_change(output):
    pa = pytest.importorskip("pyarrow")
    rows = [{"a": i, "b": {"c": float(i)}} for i in range(6)]
    ds = sd.ArrowDataset(pa.table({"s": rows, "x": list(range(6))}), nested=True, output=output)
    samples = ds.__getitems__([1, 2])
    first = samples[0]["s"] if output == "dict" else samples[0][0]
    first["b"]["c"] = torch.tensor(100.0, dtype=torch.float64)
    batch = default_collate(samples)
    inner = batch["s"] if output == "dict" else batch[0]
    assert inner["b"]["c"].tolist() == [100.0, 2.0] and inner["a"].tolist() == [1, 2]
    assert _equal(default_collate(ds.__getitems__([1, 2])), _per_sample(ds, [1, 2]))
