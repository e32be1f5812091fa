"""The one lock rule (Note [One lock rule] in ``shareddata/storage/_linux.py``).

A garbage collection can free a received batch or a segment anywhere, also inside
the code that holds the lock its release needs; weakref callbacks and finalizers
therefore only queue work. Threads that attach and pickle concurrently never
deadlock, and nothing is left open afterwards.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import shareddata as sd
from shareddata.crossing import _transport
from shareddata.storage import _handoff


def _run_bounded(fn, seconds=30):
    """Run ``fn`` in a thread; fail (not hang) if it does not end in ``seconds``."""
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"deadlock: {fn.__name__} did not end in {seconds} s"
    if errors:
        raise errors[0]


def _received_batch(value):
    """A batch as the main process receives it from a worker (in-process round trip),
    and the worker's memfd of it (whose released counter the receiver counts)."""
    batch = _transport.worker_empty((64, 64), torch.float32).fill_(value)
    memfd = batch.__dict__["_shared"].memfd
    return pickle.loads(ForkingPickler.dumps(batch)), memfd


def test_a_collection_inside_the_release_path_frees_a_batch_without_deadlock(monkeypatch):
    # batch A is only reachable through a reference cycle: a collection frees it.
    # The collection is forced inside the release of batch B, with the inbox's lock
    # held by this very thread: a callback that took the lock would wait forever.
    a, memfd_a = _received_batch(1.0)
    cycle = [a]
    cycle.append(cycle)
    del a
    b, memfd_b = _received_batch(2.0)
    real_unmap, collected = _transport.unmap, []

    def unmap_and_collect(address, length):
        if not collected:
            collected.append(gc.collect())  # frees A here, lock held
        real_unmap(address, length)

    monkeypatch.setattr(_transport, "unmap", unmap_and_collect)
    monkeypatch.setattr(_transport, "IDLE_BYTES", 0)  # every release unmaps: the hook runs
    del cycle, b
    _run_bounded(_transport.release_queued)
    assert collected, "the release path never ran"
    assert memfd_b.released()
    _run_bounded(_transport.release_queued)  # what the collection queued, done next time
    assert memfd_a.released()


def test_a_segment_finalized_inside_the_handoff_lock_is_closed_without_deadlock(monkeypatch):
    # a Segment only reachable through a cycle is collected while this thread holds the
    # handoff lock (drawing a ticket): its finalizer must not take that lock
    array = sd.SharedArray.from_array(np.arange(10.0))
    fd = array.segment.fd
    cycle = [array]
    cycle.append(cycle)
    del array
    real = _handoff.secrets.randbelow
    collected = []

    def randbelow_and_collect(n):
        if not collected:
            collected.append(gc.collect())
        return real(n)

    other = sd.SharedArray.from_array(np.arange(4.0))
    monkeypatch.setattr(_handoff.secrets, "randbelow", randbelow_and_collect)
    del cycle
    _run_bounded(lambda: ForkingPickler.dumps(other))  # draws a ticket: lock held
    assert collected
    with pytest.raises(OSError):
        os.fstat(fd)  # the collected segment's descriptor is closed (it had no ticket)


def test_threads_that_attach_and_pickle_concurrently_never_deadlock():
    # four threads make arrays, pickle them (and views of them) the way a pool does,
    # unpickle (attach) them, drop them and collect, for two seconds
    before = len(os.listdir("/proc/self/fd"))
    stop = time.monotonic() + 2.0
    counts = []

    def churn():
        n = 0
        while time.monotonic() < stop:
            array = sd.SharedArray.from_array(np.full(1000, n, np.float32))
            buf = io.BytesIO()
            ForkingPickler(buf).dump((array, array.torch()[10:20], array.torch()[::7]))
            back, view, strided = pickle.loads(buf.getvalue())
            assert float(back.numpy()[0]) == n and bool((view == n).all())
            assert strided.shape == (143,)
            del array, back, view, strided
            if n % 10 == 0:
                gc.collect()
            n += 1
        counts.append(n)

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "deadlock among attaching threads"
    assert len(counts) == 4 and min(counts) > 0, counts
    gc.collect()
    deadline = time.monotonic() + 10  # every ticket was acknowledged here: all close
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before, "descriptors left open"


def test_a_ticket_never_overwrites_an_outstanding_one(monkeypatch):
    # two pickles of one segment that draw the same random slot: the second one gets
    # another slot, so the first receiver's acknowledgement is still awaited
    array = sd.SharedArray.from_array(np.arange(4.0))
    draws = iter([7, 7, 9])
    monkeypatch.setattr(_handoff.secrets, "randbelow", lambda n: next(draws))
    first = array.segment.handle(ticket=True)
    second = array.segment.handle(ticket=True)
    assert first[5][3] == 7 and second[5][3] == 9  # the slot of each ticket
    assert _handoff.BOARD.outstanding(array.segment.fd) == 2
