"""Arrays and datasets made in pool workers and returned to the parent arrive with their data.

Note [Handing a segment over] in shareddata/storage/_handoff.py: the worker keeps what it
sent until the parent has opened it, whether it drops it at once, keeps running, or
exits right after the task.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing as mp
import os
import pickle
import re
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from conftest import hard_timeout as deadline
from conftest import holders, run_isolated

import shareddata as sd

SMALL = 1 << 20
BIG = 256 << 20


def _make(job: tuple[int, int]) -> sd.SharedArray:
    """Worker: a new array of ``n`` bytes, all ``k % 251``; the worker drops it once sent."""
    n, k = job
    a = sd.SharedArray.empty(n, np.uint8)
    a.numpy()[:] = k % 251
    return a


def _make_dataset(k: int) -> sd.NumpyDataset:
    return sd.NumpyDataset(np.full((100, 4), k, np.float32))


class _Unheld:
    """Pickles as an array whose sender holds nothing under that descriptor."""

    def __init__(self) -> None:
        self.reduced = sd.SharedArray.empty(16, np.uint8).__reduce__()

    def __reduce__(self):  # type: ignore[no-untyped-def]
        rebuild, (handle, *rest) = self.reduced
        return rebuild, ((handle[0], 1 << 20, *handle[2:]), *rest)


def _unheld(_: int) -> _Unheld:
    return _Unheld()


def _segment_fds() -> int:
    """Descriptors of this process on shareddata segments (other fds belong to the pools)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shareddata")
        except OSError:
            pass
    return count


def _pss() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return int(re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M).group(1)) << 10  # type: ignore[union-attr]


def _ident(a: sd.SharedArray) -> tuple[int, int]:
    st = os.fstat(a.segment.fd)
    return (st.st_dev, st.st_ino)


def _check(results: list[sd.SharedArray], n: int) -> set[tuple[int, int]]:
    """Values equal; returns the segments, for the leak check."""
    for k, a in enumerate(results):
        assert a.shape == (n,) and a.segment.size == n
        view = a.numpy()
        assert view[0] == k % 251 and view[-1] == k % 251 and (view == k % 251).all()
    return {_ident(a) for a in results}


def _gone(segments: set[tuple[int, int]], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while holders(segments) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not holders(segments)


def _check_pool(pool, n: int, count: int) -> set[tuple[int, int]]:
    results = pool.map(_make, [(n, k) for k in range(count)])
    return _check(results, n)


def test_fork_pool_workers_that_keep_running_exit_or_are_torch_s():
    gc.collect()  # earlier tests' garbage holds segments, and would be freed mid-test
    fds = _segment_fds()
    ctx = mp.get_context("fork")
    with ctx.Pool(2) as pool:  # workers drop each result once sent and keep running
        results = pool.map(_make, [(SMALL, k) for k in range(6)])
        segments = _check(results, SMALL)
        workers = {p.pid for p in pool._pool}  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5  # they let go as soon as the parent has opened it
        while time.monotonic() < deadline and workers & set(sum(holders(segments).values(), [])):
            time.sleep(0.05)
        assert not workers & set(sum(holders(segments).values(), []))
        datasets = pool.map(_make_dataset, [1, 2])
        assert [float(d[7]["data"][0]) for d in datasets] == [1.0, 2.0]
        assert len(datasets[0]) == 100
    with ctx.Pool(2, maxtasksperchild=1) as pool:  # each worker exits after its task
        segments |= _check_pool(pool, SMALL, 4)
    with tmp.get_context("fork").Pool(1) as pool:
        segments |= _check_pool(pool, SMALL, 2)
    with cf.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        segments |= _check(list(ex.map(_make, [(SMALL, k) for k in range(4)])), SMALL)
    del results, datasets
    gc.collect()
    assert _gone(segments)  # nothing held by any process
    assert _segment_fds() <= fds  # none of this test's descriptors is left open


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_exit_right_after_the_task(method):
    gc.collect()
    fds = _segment_fds()
    ctx = mp.get_context(method)
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        segments = _check_pool(pool, SMALL, 2)
    with cf.ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as ex:
        segments |= _check(list(ex.map(_make, [(SMALL, 0)])), SMALL)
    gc.collect()
    assert _gone(segments)
    assert _segment_fds() <= fds  # none of this test's descriptors is left open


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_256_mib_results_are_mapped_not_copied(method):
    gc.collect()
    fds, before = _segment_fds(), _pss()
    with mp.get_context(method).Pool(1, maxtasksperchild=1) as pool:
        results = pool.map(_make, [(BIG, k) for k in range(2)])
    segments = _check(results, BIG)  # touches every page
    grown = _pss() - before
    assert grown <= 1.1 * 2 * BIG, f"parent PSS grew {grown >> 20} MiB for 512 MiB of results"
    assert all(len(pickle.dumps(a)) < 400 for a in results)  # handles, not data
    del results
    gc.collect()
    assert _gone(segments)
    assert _segment_fds() <= fds  # none of this test's descriptors is left open


@pytest.mark.parametrize("kind", ["pool", "executor"])
def test_a_failed_attach_is_raised_in_the_caller_not_in_the_pool(kind):
    ctx = mp.get_context("fork")
    if kind == "pool":
        with ctx.Pool(1) as pool:
            got = pool.map_async(_unheld, [0, 1]).get(timeout=60)  # returns: no hang
    else:
        with cf.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            got = list(ex.map(_unheld, [0, 1], timeout=60))  # no BrokenProcessPool
    assert len(got) == 2 and "not attached" in repr(got[0])
    with pytest.raises(sd.AttachError, match="no longer holds it") as info:
        got[0].numpy()
    assert isinstance(info.value, OSError) and isinstance(info.value, sd.SharedDataError)
    with pytest.raises(sd.AttachError):
        got[1].torch()


class _UnheldArray:
    """Pickles as ``array`` would, but under a descriptor its sender does not hold."""

    def __init__(self, array: sd.SharedArray) -> None:
        self.reduced = array.__reduce__()

    def __reduce__(self):  # type: ignore[no-untyped-def]
        rebuild, (handle, *rest) = self.reduced
        return rebuild, ((handle[0], 1 << 20, *handle[2:]), *rest)


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return torch.full((2,), i * i), f"#{i}"


def _unheld_dataset(kind: str):  # type: ignore[no-untyped-def]
    """Worker: a dataset of ``kind`` whose segments its receiver cannot attach."""
    if kind == "numpy":
        ds = sd.NumpyDataset(np.arange(40, dtype=np.float32).reshape(10, 4))
    elif kind == "shared_dataset":
        ds = sd.SharedDataset(_Squares(), progress=False)
    else:
        ds = sd.SharedList([{"i": i} for i in range(10)], progress=False)
    columns = [ds._column] if kind == "shared_list" else ds._columns.values()
    for column in columns:
        column.arrays = {name: _UnheldArray(a) for name, a in column.arrays.items()}
    return ds


@pytest.fixture
def hard_timeout():
    """Fail with every thread's stack after 90 s instead of hanging."""
    with deadline(90):
        yield


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_dataset_that_fails_to_attach_is_an_error_in_the_caller(method, hard_timeout):
    # unpickling runs in the pool's result-handler thread: an error there would kill
    # it and pool.map would wait forever (Note [A column that cannot be attached])
    kinds = ["numpy", "shared_dataset", "shared_list"]
    with mp.get_context(method).Pool(1) as pool:
        got = pool.map_async(_unheld_dataset, kinds).get(timeout=60)  # returns: no hang
    for kind, ds in zip(kinds, got):
        assert len(ds) == (8 if kind == "shared_dataset" else 10), kind  # the spec is there
        with pytest.raises(sd.AttachError, match="no longer holds it") as info:
            ds[0]
        assert isinstance(info.value, OSError) and isinstance(info.value, sd.SharedDataError)
        assert "cannot be read" in str(info.value), kind
        with pytest.raises(sd.AttachError):
            next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))


def _views_of_a_dropped_array(k: int):  # type: ignore[no-untyped-def]
    """Worker: a torch view and a numpy slice of a new array, which it drops at once."""
    array = sd.SharedArray.from_array(np.full((1000, 4), k, np.float32))
    st = os.fstat(array.segment.fd)
    return array.torch()[10:20:3], array.numpy()[5:7], (st.st_dev, st.st_ino)


def _mapped_inode(tensor: torch.Tensor) -> tuple[str, int]:
    """The file name and inode that ``tensor``'s memory is mapped from (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= tensor.data_ptr() < stop:
                return (fields[5] if len(fields) > 5 else ""), int(fields[4])
    raise AssertionError("not mapped")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_view_of_an_array_the_worker_dropped_arrives_by_handle(method, hard_timeout):
    # the view keeps the segment (through its numpy base), so it crosses as the
    # segment's handle with a ticket even though the SharedArray itself is gone; it
    # hung pool.map under maxtasksperchild=1 (torch's copy could not be fetched from
    # the exited worker, in the result-handler thread)
    with mp.get_context(method).Pool(2, maxtasksperchild=1) as pool:
        got = pool.map_async(_views_of_a_dropped_array, range(4)).get(timeout=60)
    segments = set()
    for k, (view, sliced, segment) in enumerate(got):
        assert view.shape == (4, 4) and bool((view == k).all())
        assert sliced.shape == (2, 4) and bool((sliced == k).all())  # numpy: by value
        name, inode = _mapped_inode(view)
        assert name == "/memfd:shareddata" and inode == segment[1], (name, inode)  # no copy
        segments.add(segment)
    del got, view, sliced
    gc.collect()
    assert _gone(segments)


def _send_and_exit(conn) -> None:  # type: ignore[no-untyped-def]
    a = sd.SharedArray.empty(SMALL, np.uint8)
    conn.send_bytes(ForkingPickler.dumps(a))  # what a multiprocessing queue sends
    conn.send(_ident(a))


def test_a_result_never_unpickled_is_freed_after_the_bounded_wait(monkeypatch):
    monkeypatch.setenv("SHAREDDATA_HANDOFF_TIMEOUT", "1")
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_send_and_exit, args=(there,))
    start = time.monotonic()
    child.start()
    data, segment = here.recv_bytes(), here.recv()
    child.join(30)
    took = time.monotonic() - start
    assert child.exitcode == 0
    assert 0.9 < took < 10, took  # waited for the parent, then gave up
    assert _gone({segment}, timeout=5)
    late = pickle.loads(data)  # unpickling never raises...
    with pytest.raises(sd.AttachError, match="no longer holds it"):
        late.numpy()  # ...the first use does


KILLED_MIDWAY = """
import os, signal, numpy as np, multiprocessing as mp, shareddata as sd
os.setpgrp()  # the script and its pool workers: one group, killed at once below

def make(k):
    a = sd.SharedArray.empty(32 << 20, np.uint8)
    a.numpy()[:] = k
    return a

with mp.get_context("fork").Pool(2) as pool:
    for i, a in enumerate(pool.imap_unordered(make, range(50))):
        st = os.fstat(a.segment.fd)
        print("SEG", st.st_dev, st.st_ino, flush=True)
        if i == 3:
            os.killpg(0, signal.SIGKILL)
"""


def test_the_same_run_killed_midway_leaves_nothing():
    run = run_isolated(KILLED_MIDWAY, shm_size="16m", timeout=120)
    assert run.returncode != 0  # killed
    segments = {
        (int(dev), int(ino)) for dev, ino in re.findall(r"^SEG (\d+) (\d+)$", run.stdout, re.M)
    }
    assert len(segments) == 4, run.stdout + run.stderr
    assert _gone(segments)
    assert run.leftovers == []


def _build_in_a_fork_child():
    a = sd.SharedArray.empty((256, 1024), "float32")  # segments, pages, registries
    a.numpy()[:] = 1
    ds = sd.NumpyDataset({"x": a.numpy()}, progress=False)
    assert float(ds[3]["x"].sum()) == 1024


def test_a_child_forked_while_another_thread_holds_the_locks_does_not_deadlock():
    """A Pool forks a new worker (maxtasksperchild) from one thread while its
    result thread attaches a returned array: the child must not inherit a held lock."""
    import threading

    from shareddata.distributed import _node
    from shareddata.storage import _segment

    locks = [_segment._ATTACH_LOCK, _node._DATASETS_LOCK]
    held, release = threading.Event(), threading.Event()

    def hold():
        for lock in locks:
            lock.__enter__()
        held.set()
        release.wait(30)
        for lock in locks:
            lock.__exit__(None, None, None)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        child = mp.get_context("fork").Process(target=_build_in_a_fork_child)
        child.start()
        child.join(30)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0, "the child deadlocked on a lock held at fork"
    finally:
        release.set()
        holder.join()
