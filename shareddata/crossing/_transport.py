"""A DataLoader worker's batch in one memfd of its own, and the main process mapping it.

Note [How a batch leaves a worker]
----------------------------------
torch carries a tensor out of a worker in a ``/dev/shm`` segment that it faults in up
front, and pickles it as a descriptor that the main process fetches over a socket
(``multiprocessing.resource_sharer``: a connection, a handshake, and a worker thread
that must take the GIL from the busy main thread; ``benchmarks/bench_ipc.py``). A
batch that shareddata gathers in a worker goes instead into ONE memfd (no page touched
until the gather writes it): every numeric column as :class:`SharedTensor` s over one
storage, a variable-length column's rows side by side, a ``SharedList`` batch's
tensors copied in (``into_one_batch`` in ``_collate.py``). The tensors carry a :class:`BatchRef`,
pickled once per message as the memfd's handle ``(pid, fd, device, inode, size,
data bytes)``; the main process opens ``/proc/<pid>/fd/<fd>``, checks device and
inode, maps it and counts the batch *received*. The worker keeps each descriptor
until every send is received; of received batches still pinned it keeps
``MAX_UNACKNOWLEDGED`` (closing older ones, which receivers do not notice), of
unreceived ones ``MAX_UNRECEIVED`` (a later receiver of a closed one gets
:class:`~shareddata.AttachError`). A received batch outlives its worker. Nothing is
named in ``/dev/shm``: a small ``/dev/shm`` does not limit batches, a kill leaves
nothing behind.

Note [Reusing a batch's pages]
------------------------------
A fresh memfd costs its first touch (the kernel zeroes every page), so a worker reuses
the memfd of a batch that nobody holds. The memfd ends, after its data, with a
*released* and a *received* counter: the worker counts each pickle of the batch's
reference as a send; the receiver counts it received when it maps it and released
when nothing holds any part of it. The worker watches, by a weak reference, the numpy
array its batch's storage was made from: ``torch.from_numpy`` holds it as long as the
storage lives, so it is gone exactly when no tensor, view or storage in the worker
holds the batch (or torch moved the storage into a segment of its own). Once it is
gone and released equals sends, the memfd goes to the pool (at most ``POOL``; mapped
up to ``IDLE_BYTES`` in all, the rest unmapped); until then it is *pinned*. No counter
private to torch or CPython decides it. A batch never released is never reused.

Note [Releasing a received batch]
---------------------------------
A received batch is a storage over this process's mapping of the worker's memfd. When
nothing holds it, a weak reference's callback on the array under the storage queues
its release (a garbage collection may run it inside any code, whatever lock that
holds); the next :func:`receive` or :func:`release_queued` carries it out under the
inbox's lock: one more on the released counter, and the mapping kept *idle* (at most
``IDLE_BYTES``, oldest unmapped first), so the next batch in that memfd is received
with no system call (opening, mapping and unmapping cost ~140 us per batch). A fork
child of the receiver unmaps the idle mappings and never counts a release.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import math
import os
import resource
import weakref
from typing import Any, cast

import numpy as np
import torch

from .._compat import torch_reduce_storage
from ..storage import shared_tensor
from ..storage._capacity import named_os_errors
from ..storage._linux import (
    MADV_POPULATE_WRITE,
    ForkSafeLock,
    array_at,
    file_identity,
    madvise,
    map_fd,
    unmap,
)
from ..storage._segment import open_sent
from ..storage._tensor import describe_failure, raise_send_error

__all__ = [
    "IDLE_BYTES", "MAX_UNACKNOWLEDGED", "MAX_UNRECEIVED", "POOL", "receive", "release_queued",
    "worker_buffers", "worker_empty",
]  # fmt: skip

MAX_UNRECEIVED = max(256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
"""Batches not yet received that a worker keeps open (bounds its descriptors)."""
MAX_UNACKNOWLEDGED = 64
"""Received batches still pinned that a worker keeps open; older ones are closed."""
POOL = 4
"""Released batch memfds a worker keeps for reuse (Note [Reusing a batch's pages])."""
IDLE_BYTES = 4 << 20
"""Bytes of released batch mappings a process keeps, to map their memfds again."""
_ALIGN = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = 8  # bytes of the released counter and the received counter (uint32 each)
_PID = os.getpid()

# -- receiving (Note [Releasing a received batch]) ----------------------------------------
_LOCK = ForkSafeLock()
# (pid, fd, device, inode) of a worker's memfd -> (address, length, array) of our idle
# mapping; oldest first. A live inode is never renumbered, so a key names one file.
_IDLE: dict[tuple[int, ...], tuple[int, int, np.ndarray]] = {}
_idle_bytes = 0
# id of a weak reference to a received storage's array -> (the reference, the pid that
# received it, key, address, length, data bytes (the counters follow), the mapping's array)
_LIVE: dict[int, tuple[Any, ...]] = {}
_QUEUED: collections.deque[int] = collections.deque()  # ids of references whose arrays died


def receive(
    pid: int, fd: int, device: int, inode: int, size: int, data: int
) -> torch.UntypedStorage:
    """Unpickle the storage of a worker's batch: map its memfd (or reuse our mapping)."""
    global _idle_bytes
    key = (pid, fd, device, inode)
    with _LOCK:
        _release_queued()
        idle = _IDLE.pop(key, None)
        if idle is not None:
            _idle_bytes -= idle[1]
    if idle is not None:  # mapped here before (the whole file, always): no system call
        address, length, mapped = idle
    else:
        address, length = _map_batch(pid, fd, (device, inode), size), size
        mapped = array_at(address, length)
    # mapped: the worker may close its descriptor now
    received = ctypes.c_uint32.from_address(address + data + 4)
    with _LOCK:
        received.value += 1
    view = mapped[:data]
    ref = weakref.ref(view, _queue_release)  # the storage below alone holds ``view``
    _LIVE[id(ref)] = (ref, _PID, key, address, length, data, mapped)
    return torch.from_numpy(view).untyped_storage()


def _queue_release(ref: Any) -> None:
    # in a fork child of the receiver (the batch is its parent's) only unmap, at once
    live = _LIVE.get(id(ref))
    if live is not None and live[1] != _PID:
        del _LIVE[id(ref)]
        unmap(live[3], live[4])
    else:
        _QUEUED.append(id(ref))


def release_queued() -> None:
    """Carry out the releases that garbage collection queued (any thread may call it)."""
    if _QUEUED:
        with _LOCK:
            _release_queued()


def _release_queued() -> None:
    """Release every queued mapping; the caller holds ``_LOCK``."""
    global _idle_bytes
    unmaps: list[tuple[int, int]] = []
    while _QUEUED:
        live = _LIVE.pop(_QUEUED.popleft(), None)
        if live is None:
            continue
        _, _, key, address, length, data, mapped = live
        ctypes.c_uint32.from_address(address + data).value += 1
        if key not in _IDLE and length <= IDLE_BYTES:
            _IDLE[key] = (address, length, mapped)
            _idle_bytes += length
            while _idle_bytes > IDLE_BYTES:
                oldest = _IDLE.pop(next(iter(_IDLE)))
                _idle_bytes -= oldest[1]
                unmaps.append((oldest[0], oldest[1]))
        else:
            unmaps.append((address, length))
    for mapping in unmaps:  # (unmapping with the lock held is safe: it takes no other lock)
        unmap(mapping[0], mapping[1])


_NOT_HELD = (
    f"the worker exited, or closed it after making more than {MAX_UNRECEIVED} batch memfds "
    "that were not received. Receive batches as they come, or lower prefetch_factor."
)


def _map_batch(pid: int, fd: int, ident: tuple[int, int], total: int) -> int:
    """Map ``total`` bytes of the memfd ``fd`` of process ``pid``; its address."""
    what = f"a batch from DataLoader worker {pid}"
    new_fd = open_sent(pid, fd, ident, what, _NOT_HELD, writable=True)
    try:
        with named_os_errors(what, total):
            return map_fd(new_fd, total)
    finally:
        os.close(new_fd)


# -- sending (Note [How a batch leaves a worker]) -----------------------------------------
class BatchRef:
    """One use of a worker's memfd, as its tensors reference it; pickles as its handle.

    Each pickle (one per message, thanks to the pickler's memo) counts one send.
    """

    __slots__ = ("address", "memfd", "nbytes")

    def __init__(self, memfd: _Memfd) -> None:
        self.memfd, self.address, self.nbytes = memfd, memfd.address, memfd.data

    def __reduce__(self) -> tuple[Any, ...]:
        memfd = self.memfd
        try:
            with _OUTBOX_LOCK:
                if memfd.ref is self and memfd.fd is not None:
                    memfd.sends += 1
                    return receive, memfd.handle
            # closed (kept here beyond the cap): send a copy, the way torch sends a storage
            copy = torch.empty(self.nbytes, dtype=torch.uint8)
            copy.copy_(torch.from_numpy(array_at(self.address, self.nbytes)))
            return torch_reduce_storage(copy.untyped_storage())
        except Exception as e:  # never raise in a queue's feeder thread
            return raise_send_error, (describe_failure(e, "a batch made in a worker"),)


class _Memfd:
    """One memfd of a worker, for one batch at a time (kept across uses by the pool)."""

    __slots__ = (
        "address", "alive", "counter", "data", "fd", "handle", "ident", "length", "received",
        "ref", "sends", "size",
    )  # fmt: skip

    def __init__(self, total: int) -> None:
        with named_os_errors("a DataLoader worker's batch"):
            fd = os.memfd_create("shareddata-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            ident = file_identity(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # None once closed (its mapping here may still live)
        self.size = total  # file size (a pooled memfd may be larger than a later batch)
        self.ident = ident
        self.address = self.length = 0  # this worker's mapping (0: none)
        self.data = 0  # bytes of data of the current batch; its counters follow them
        # the array the current batch's storage was made from, alive while anything holds it
        self.alive: weakref.ref[Any] | None = None
        self.ref: BatchRef | None = None  # what the current batch's tensors reference
        self.counter: ctypes.c_uint32 | None = None
        self.received: ctypes.c_uint32 | None = None
        self.handle: tuple[int, ...] = ()  # what a receiver needs
        self.sends = 0

    def use(self, data: int, total: int) -> torch.UntypedStorage:
        """Hold a new batch of ``data`` bytes: mapped, counters at zero; its storage."""
        fd = cast(int, self.fd)  # a memfd in use or in the pool is open
        if not self.address:  # the whole file: a later, smaller batch maps nothing
            with named_os_errors("a DataLoader worker's batch", self.size):
                self.address, self.length = map_fd(fd, self.size), self.size
            if self.data:  # used before, so its pages exist: map them all in one call
                madvise(self.address, total, MADV_POPULATE_WRITE)
        if self.counter is None or self.data != data:
            self.counter = ctypes.c_uint32.from_address(self.address + data)
            self.received = ctypes.c_uint32.from_address(self.address + data + 4)
            self.data = data
            self.handle = (_PID, fd, *self.ident, self.size, data)
        array = array_at(self.address, data)
        storage = torch.from_numpy(array).untyped_storage()
        self.alive = weakref.ref(array)
        self.ref = BatchRef(self)  # a new use: views of an older one never match it
        self.counter.value = self.received.value = 0  # type: ignore[union-attr]
        self.sends = 0
        return storage

    def gone_here(self) -> bool:
        """Whether nothing in this worker holds any part of the batch any more."""
        return self.alive is None or self.alive() is None

    def released(self) -> bool:
        """Whether every mapping of this batch in a receiver is gone."""
        return self.sends == 0 or self.counter.value >= self.sends  # type: ignore[union-attr]

    def unmap(self) -> None:
        """Drop this worker's mapping (nothing here may hold the batch any more)."""
        self.counter = self.received = self.ref = self.alive = None
        if self.address:
            unmap(self.address, self.length)
        self.address = self.length = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Outbox:
    """The batches this worker process has made and not yet seen released, and its pool."""

    def __init__(self) -> None:
        self.pending: collections.deque[_Memfd] = collections.deque()
        self.held: list[_Memfd] = []  # closed, but their mapping here may still be held
        self.pool: list[_Memfd] = []  # released, to be reused; mapped up to IDLE_BYTES

    def reap(self) -> None:
        """Pool (or close) every batch done with; close the oldest beyond the caps."""
        excess = len(self.pending) - MAX_UNACKNOWLEDGED + 1  # room for the next batch
        force = len(self.pending) - MAX_UNRECEIVED + 1
        keep: collections.deque[_Memfd] = collections.deque()
        for i, memfd in enumerate(self.pending):
            gone_here = memfd.gone_here()
            if gone_here and memfd.released():
                if len(self.pool) < POOL:
                    if sum(m.length for m in self.pool) + memfd.length > IDLE_BYTES:
                        memfd.unmap()
                    self.pool.append(memfd)
                else:
                    memfd.unmap()
                    memfd.close()
            elif i < force or (excess > 0 and memfd.received.value >= memfd.sends):  # type: ignore[union-attr]
                # pinned too long: close it; receivers keep their mappings
                excess -= 1
                memfd.close()
                self.held.append(memfd)
            else:
                keep.append(memfd)
        self.pending = keep
        for memfd in [m for m in self.held if m.gone_here()]:  # unmapped once gone here
            self.held.remove(memfd)
            memfd.unmap()

    def take(self, size: int) -> _Memfd | None:
        """The smallest pooled memfd of at least ``size`` bytes, or None."""
        best = min((m for m in self.pool if m.size >= size), key=lambda m: m.size, default=None)
        if best is not None:
            self.pool.remove(best)
        return best


_OUTBOX = _Outbox()
_OUTBOX_LOCK = ForkSafeLock()
# (shapes and dtypes of a batch's parts) -> (per part: element offset and bytes; data bytes)
_LAYOUTS: dict[tuple[Any, ...], tuple[list[tuple[int, int]], int]] = {}


def _layout(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[tuple[int, int]], int]:
    key = tuple(parts)
    found = _LAYOUTS.get(key)
    if found is not None:
        return found
    layout = []
    offset = 0
    for shape, dtype in parts:
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((offset // dtype.itemsize, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    found = layout, -(-offset // _PAGE) * _PAGE  # the counters on a page of their own
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    _LAYOUTS[key] = found
    return found


def worker_buffers(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty :class:`SharedTensor` s for the parts of one batch, all in one memfd.

    The memfd is a fresh one or one of this worker's released batches (empty parts
    are plain tensors).

    Example:
        >>> import pickle
        >>> x, y = worker_buffers([((2, 3), torch.float32), ((2,), torch.int64)])
        >>> _ = x.fill_(1.0), y.fill_(7)
        >>> type(x).__name__, type(x[0]).__name__, type(x + 1).__name__
        ('SharedTensor', 'SharedTensor', 'Tensor')
        >>> pickle.loads(pickle.dumps(x)), pickle.loads(pickle.dumps(y))
        (tensor([[1., 1., 1.],
                [1., 1., 1.]]), tensor([7, 7]))
    """
    layout, data = _layout(parts)
    if data == 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    total = data + _COUNTER
    release_queued()  # batches this process received and dropped (a pool's chain)
    with _OUTBOX_LOCK:
        _OUTBOX.reap()
        memfd = _OUTBOX.take(total) or _Memfd(total)
        try:
            storage = memfd.use(data, total)
        except BaseException:
            memfd.unmap()
            memfd.close()
            raise
        _OUTBOX.pending.append(memfd)
        ref = memfd.ref
    return [
        shared_tensor(torch.empty(0, dtype=dtype).set_(storage, start, shape), ref, new=True)  # type: ignore[call-overload, arg-type]
        if nbytes
        else torch.empty(shape, dtype=dtype)
        for (shape, dtype), (start, nbytes) in zip(parts, layout)
    ]


def worker_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One empty batch tensor in its own memfd (:func:`worker_buffers` with one part)."""
    return worker_buffers([(shape, dtype)])[0]


def _after_fork_in_child() -> None:
    global _PID, _OUTBOX, _idle_bytes
    _PID = os.getpid()
    _OUTBOX = _Outbox()  # the parent's batches are not this process's to send or reuse
    _QUEUED.clear()  # nor its received batches to release
    for idle in _IDLE.values():  # nor its idle mappings: unmapped, their files can go
        unmap(idle[0], idle[1])
    _IDLE.clear()
    _idle_bytes = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_LIVE.clear)  # at exit nothing is released: the mappings go with the process
