"""How a batch gathered in a DataLoader worker reaches the main process.

Note [How a batch leaves a worker]
----------------------------------
torch carries a tensor out of a worker in a ``/dev/shm`` segment that it creates
and faults in up front, and pickles it as a file descriptor that the main process
then fetches from the worker over a socket (``multiprocessing.resource_sharer``):
a connection, an authentication handshake, and a thread of the worker that must
take the GIL from the worker's busy main thread. On a 2-core VM that cost ~0.8 ms
per 256 KiB batch and ~2 ms per 4 MiB one, with no data read at all
(``benchmarks/bench_ipc.py``).

A batch that shareddata gathers in a worker goes instead into a memfd
(``memfd_create`` + ``ftruncate``: no page is touched until the gather writes it):
every numeric column of the batch in ONE memfd, as :class:`WorkerBatch` tensors
over one storage -- fixed-shape columns stacked, a variable-length column's rows
side by side, each row a view (``Column.batch_parts``/``gather_into``); a
``SharedList`` batch's items, unpickled afresh per row, have their tensors copied
into one memfd the same way (:func:`into_one_batch`). However many rows are ragged,
a batch leaves the worker as one descriptor, never one torch ``/dev/shm`` segment
per row (``tests/test_crossing.py`` counts them for every dataset kind).
``ForkingPickler`` pickles any tensor over that storage -- the batch
itself, a sample, a slice, a non-contiguous view -- as the memfd's handle
``(pid, fd, device, inode, ...)`` plus the byte range and the tensor's layout
(Note [Tensors over our memory cross by handle] in ``_reduce.py``); the storage is
pickled once per message, however many tensors of the batch it carries. The main
process opens ``/proc/<pid>/fd/<fd>`` itself, as ``_storage`` does for segments,
checks device and inode, and maps it. The worker keeps each batch's descriptor
while the batch may still be received, and never holds more than
``MAX_UNACKNOWLEDGED`` (a DataLoader has ``prefetch_factor`` batches per worker in
flight); beyond that the oldest is closed, and a receiver that comes later gets
:class:`~shareddata.AttachError`. A batch that is received stays valid after its
worker exits: the main process's mapping holds the pages. Nothing is ever named in
``/dev/shm``, so a small ``/dev/shm`` (Docker's 64 MiB) does not limit the batch
size, and a killed process leaves nothing behind.

Note [Reusing a batch's pages]
------------------------------
A fresh memfd costs its first touch: the kernel allocates and zeroes every page as
the gather writes it, ~3.3 ms for a 4 MiB batch on the 2-core VM, where the gather
itself takes 0.1 ms (``benchmarks/bench_suite.py``, 16 KiB samples with workers).
So a worker reuses the memfd of a batch that nobody holds any more. The memfd
ends, after its data, with a page holding a *released* counter. Each time the
worker pickles the batch's storage it counts one send; the main process maps the
memfd with ``mmap`` itself (no descriptor kept) under a numpy array that only the
received storage holds, and when that storage is freed -- no tensor, view, numpy
array or other holder of any part of it is left -- a finalizer on the array adds
one to the counter. The main process keeps that mapping *idle* (at most
``IDLE_BYTES`` of them, the oldest unmapped first): when the worker sends a batch
in the same memfd again, receiving it costs no system call at all, where opening,
mapping and unmapping cost ~140 us of the main process's time per batch on the
2-core VM (``munmap`` alone ~100 us: it must flush the TLBs of the other CPUs).
Idle mappings never hold a live batch (the worker may overwrite their pages), and
they keep a closed memfd's pages for at most ``IDLE_BYTES``. (A fork child of the
receiver inherits the mappings; its finalizers only unmap, and it unmaps the idle
ones at once.) A worker puts a batch in its pool once its
own mapping is gone (nothing in the worker refers to the batch: it has been
pickled and dropped) and the counter equals its sends: the batch is *pinned* for
as long as any view of it lives in the main process. The pool holds at most
``POOL`` memfds; the worker keeps its own mapping of them up to ``IDLE_BYTES`` in
all (the rest unmapped, in no process's PSS: ``verify`` measures data, not
transport). The worker gathers its next batch into a pooled memfd that is large
enough: one still mapped costs no system call; one unmapped is mapped again with
``MADV_POPULATE_WRITE`` (its pages exist: ~1.2 ms for 4 MiB instead of 3.3 ms).
With both ends mapped, a 256 KiB batch costs ~370 us of CPU in all (main process
and workers) against ~1190 us with a fresh memfd per batch and ~1370 us by torch
(``benchmarks/bench_ipc.py``, 2-core VM under load). A batch that is never released (the
user keeps it, or sends it on) is never reused: its memfd is closed once it is the
oldest beyond the cap, and the main process's mapping keeps its pages.

Plain ``pickle`` (``torch.save``, a user's own pickling) sees a ``WorkerBatch`` as
an ordinary tensor, by value. Every torch operation on a ``WorkerBatch`` returns a
plain tensor.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import os
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._linux import MADV_POPULATE_WRITE, PROT_READ_WRITE, libc_mmap, madvise
from ._reduce import MAP_FAILED, guard_worker_sends, munmap, reduce_tensor, register_memory
from .errors import AttachError

__all__ = ["MAX_UNACKNOWLEDGED", "WorkerBatch", "into_one_batch", "worker_buffers", "worker_empty"]

MAX_UNACKNOWLEDGED = 64
POOL = 4
"""Released batch memfds a worker keeps for reuse (Note [Reusing a batch's pages])."""
_ALIGN = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = 8  # bytes of the released counter (a uint32, padded)


class WorkerBatch(torch.Tensor):
    """A batch made in a worker, in its own memfd; pickled for the DataLoader as a handle."""

    # every operation returns a plain tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Plain pickle: an ordinary tensor, by value.
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


ForkingPickler.register(WorkerBatch, functools.partial(reduce_tensor, ours=True))


class _Batch:
    """One memfd a worker gathered a batch into."""

    __slots__ = (
        "address", "counter_at", "data", "fd", "ident", "length", "ref", "sends", "size", "total",
    )  # fmt: skip

    def __init__(
        self,
        fd: int,
        size: int,
        ident: tuple[int, int],
        total: int,
        data: int,
        length: int,
        storage: torch.UntypedStorage,
    ) -> None:
        self.fd: int | None = fd  # None once closed (its mapping here may still live)
        self.size = size  # file size (a pooled memfd may be larger than this batch)
        self.ident = ident  # (device, inode)
        self.total = total  # bytes a receiver maps: data, then the counter's page
        self.data = data  # bytes of data
        self.counter_at = data
        self.address = storage.data_ptr()  # this worker's mapping of ``length`` bytes
        self.length = length  # >= total: the mapping covers the counter too
        self.ref = StorageWeakRef(storage)
        self.sends = 0

    def released(self) -> bool:
        """Whether every mapping of this batch in a receiver is gone."""
        if self.sends == 0:
            return True
        # read through this worker's mapping (it lives while the batch is pending)
        return ctypes.c_uint32.from_address(self.address + self.counter_at).value >= self.sends


class _Outbox:
    """The batches one worker process has made and not yet seen released, and its pool."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # no mapping of a sent batch is kept here: a batch in flight counts once, where held
        self.pending: collections.deque[_Batch] = collections.deque()
        self.by_address: dict[int, _Batch] = {}  # every batch whose mapping here may live
        # released, to be reused: (fd, file size, ident, address, length) with the
        # worker's mapping kept (address 0: none) up to IDLE_BYTES in all
        self.pool: list[tuple[int, int, tuple[int, int], int, int]] = []

    def reap(self) -> None:
        """Pool or close every batch that is done with (and close the oldest beyond the cap).

        A batch is done once nothing in this worker maps it any more and every
        mapping of it in the receiver is released: its memfd goes to the pool (or is
        closed when the pool is full).
        """
        excess = len(self.pending) - MAX_UNACKNOWLEDGED + 1  # room for the next batch
        keep: collections.deque[_Batch] = collections.deque()
        for i, batch in enumerate(self.pending):
            assert batch.fd is not None
            gone_here = batch.ref.expired()
            if gone_here and batch.released():
                self._forget(batch)
                if len(self.pool) < POOL:
                    address, length = batch.address, batch.length
                    if sum(e[4] for e in self.pool) + length > IDLE_BYTES:
                        munmap(address, length)
                        address = length = 0
                    self.pool.append((batch.fd, batch.size, batch.ident, address, length))
                else:
                    munmap(batch.address, batch.length)
                    os.close(batch.fd)
                batch.fd = None
            elif i < excess:  # pinned too long: close it; receivers keep their mappings
                os.close(batch.fd)
                batch.fd = None
                if gone_here:
                    self._forget(batch)
                    munmap(batch.address, batch.length)
            else:
                keep.append(batch)
        self.pending = keep
        for batch in list(self.by_address.values()):  # closed ones, now gone
            if batch.fd is None and batch.ref.expired() and self._forget(batch):
                munmap(batch.address, batch.length)

    def _forget(self, batch: _Batch) -> bool:
        # a later batch may be mapped at the same address already
        if self.by_address.get(batch.address) is batch:
            del self.by_address[batch.address]
            return True
        return False

    def take(self, size: int) -> tuple[int, int, tuple[int, int], int, int] | None:
        """The smallest pooled memfd of at least ``size`` bytes, or None."""
        fits = [entry for entry in self.pool if entry[1] >= size]
        if not fits:
            return None
        entry = min(fits, key=lambda e: e[1])
        self.pool.remove(entry)
        return entry

    def locate(self, address: int, nbytes: int) -> _Batch | None:
        """The live batch whose data holds ``[address, address + nbytes)``."""
        batch = self.by_address.get(address)
        if batch is None or batch.ref.expired():
            batch = None
            for candidate in self.by_address.values():  # a storage over part of a batch
                start = candidate.address
                if start <= address < start + candidate.data and not candidate.ref.expired():
                    batch = candidate
                    break
        if batch is None or address + nbytes > batch.address + batch.data:
            return None
        return batch


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = threading.Lock()


def _outbox() -> _Outbox | None:
    box = _OUTBOX
    return box if box is not None and box.pid == os.getpid() else None


def worker_buffers(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty tensors for the parts (columns) of one batch, all in one memfd.

    One descriptor per batch, however many columns it has. The memfd ends with the
    batch's released counter (Note [Reusing a batch's pages]); the memfd is a fresh
    one, or one of this worker's released batches.

    Example:
        >>> import pickle
        >>> x, y = worker_buffers([((2, 3), torch.float32), ((2,), torch.int64)])
        >>> _ = x.fill_(1.0), y.fill_(7)
        >>> type(x).__name__, type(x + 1).__name__
        ('WorkerBatch', 'Tensor')
        >>> pickle.loads(pickle.dumps(x)), pickle.loads(pickle.dumps(y))
        (tensor([[1., 1., 1.],
                [1., 1., 1.]]), tensor([7, 7]))
    """
    global _OUTBOX
    guard_worker_sends()  # Note [A batch that cannot be sent] in _reduce.py
    layout = []
    offset = 0
    for shape, dtype in parts:
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    data = -(-offset // _PAGE) * _PAGE  # the counter on its own page
    total = data + _COUNTER
    if data == 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    with _OUTBOX_LOCK:
        box = _outbox()
        if box is None:  # first batch of this process
            box = _OUTBOX = _Outbox()
        box.reap()
        pooled = box.take(total)
        if pooled is None:
            fd = os.memfd_create("shareddata-batch", os.MFD_CLOEXEC)
            size, address, length = total, 0, 0
        else:
            fd, size, ident, address, length = pooled
        try:
            if pooled is None:
                os.ftruncate(fd, total)
                st = os.fstat(fd)
                ident = (st.st_dev, st.st_ino)
            if address and length < total:
                munmap(address, length)
                address = 0
            if not address:  # (a pooled memfd still mapped here needs no system call)
                address, length = _map_fd(fd, total), total
                if pooled is not None:  # its pages exist: map them all in one call
                    madvise(address, total, MADV_POPULATE_WRITE)
            # the counter of this use of the memfd starts at zero (a pooled one was counted)
            ctypes.c_uint64.from_address(address + data).value = 0
            # the storage covers this batch's data exactly (a pooled mapping may be longer):
            # _find recognises a storage inside [address, address + data)
            mapped = np.ctypeslib.as_array((ctypes.c_uint8 * data).from_address(address))
            storage = torch.from_numpy(mapped).untyped_storage()
            batch = _Batch(fd, size, ident, total, data, length, storage)
        except BaseException:
            if address:
                munmap(address, length)
            os.close(fd)
            raise
        box.pending.append(batch)
        box.by_address[batch.address] = batch
    return [
        torch.empty(0, dtype=dtype)
        .set_(storage, start // dtype.itemsize, shape)  # type: ignore[call-overload]
        .as_subclass(WorkerBatch)
        if nbytes
        else torch.empty(shape, dtype=dtype)
        for (shape, dtype), (start, nbytes) in zip(parts, layout)
    ]


def worker_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One empty batch tensor in its own memfd (:func:`worker_buffers` with one part)."""
    return worker_buffers([(shape, dtype)])[0]


def into_one_batch(items: list[Any]) -> list[Any]:
    """``items`` with every plain tensor in them moved into one batch memfd of this worker.

    For values that are made afresh per row (``SharedList`` unpickles each item):
    left alone, each tensor would leave the worker as a shared segment of its own
    (torch's path), one or more per row. Tensors inside dicts, lists and tuples
    (named ones too) are copied side by side into one memfd and replaced by views
    of it, so the batch crosses as one handle however many rows and tensors it has.
    Other objects, and tensors torch must send itself (``requires_grad``, sparse, a
    subclass, not on the CPU), are kept as they are.

    Example:
        >>> rows = [{"a": torch.arange(3), "b": (torch.ones(2), "x")}, [torch.zeros(1)]]
        >>> out = into_one_batch(rows)  # outside a worker there is one memfd too
        >>> out[0]["b"], len({t.untyped_storage().data_ptr() for t in (out[0]["a"], out[1][0])})
        ((tensor([1., 1.]), 'x'), 1)
    """
    found: list[torch.Tensor] = []
    _collect(items, found)
    if not found:
        return items
    outs = iter(worker_buffers([(tuple(t.shape), t.dtype) for t in found]))
    return _replace(items, lambda t: next(outs).as_subclass(torch.Tensor).copy_(t))


def _movable(obj: Any) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.layout is torch.strided
        and obj.device.type == "cpu"
        and not obj.requires_grad
        and not obj.is_quantized
        and obj.numel() > 0
    )


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if _movable(obj):
        found.append(obj)
    elif type(obj) is dict:
        for value in obj.values():
            _collect(value, found)
    elif type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        for value in obj:
            _collect(value, found)


def _replace(obj: Any, move: Any) -> Any:
    # the same traversal order as _collect
    if _movable(obj):
        return move(obj)
    if type(obj) is dict:
        return {key: _replace(value, move) for key, value in obj.items()}
    if type(obj) is list:
        return [_replace(value, move) for value in obj]
    if type(obj) is tuple:
        return tuple(_replace(value, move) for value in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_replace(value, move) for value in obj))
    return obj


def _owns(address: int, nbytes: int) -> bool:
    box = _outbox()
    return box is not None and box.locate(address, nbytes) is not None


def _find(storage: torch.UntypedStorage, address: int, nbytes: int) -> Any:
    """The reduction of a storage inside one of this worker's batches (counts a send)."""
    box = _outbox()
    if box is None:
        return None
    with _OUTBOX_LOCK:
        batch = box.locate(address, nbytes)
        if batch is None:
            return None
        if batch.fd is not None:
            batch.sends += 1
            handle = (box.pid, batch.fd, batch.ident, batch.total, batch.counter_at)
            return (_receive, (*handle, address - batch.address, nbytes))
    # closed (kept here beyond the cap): send a copy, the way torch sends any storage
    from torch.multiprocessing.reductions import reduce_storage

    copy = torch.empty(nbytes, dtype=torch.uint8)
    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))  # type: ignore[call-overload]
    return reduce_storage(copy.untyped_storage())


register_memory(_find, _owns)


def _receive(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    total: int,
    counter_at: int,
    start: int,
    nbytes: int,
) -> torch.UntypedStorage:
    """Unpickle a storage of a worker's batch: map the worker's memfd.

    The mapping is released (the counter incremented, then unmapped) as soon as
    nothing holds the storage any more (Note [Reusing a batch's pages]).
    """
    key = (pid, fd, *ident)
    with _RELEASE_LOCK:
        idle = _IDLE.pop(key, None)
    if idle is not None and idle[1] >= total:  # mapped here before: no system call
        address, length = idle
    else:
        if idle is not None:
            munmap(*idle)
        address, length = _map_batch(pid, fd, ident, total), total
    mapped = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
    # Runs once the storage below is freed: it alone holds ``mapped`` (through a view).
    finalizer = weakref.finalize(mapped, _release, os.getpid(), key, address, length, counter_at)
    finalizer.atexit = False
    return torch.from_numpy(mapped[start : start + nbytes]).untyped_storage()


def _map_batch(pid: int, fd: int, ident: tuple[int, int], total: int) -> int:
    """Map ``total`` bytes of the memfd ``fd`` of process ``pid``; its address."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        new_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise AttachError(
            f"cannot receive a batch from DataLoader worker {pid}: opening {path} failed ({e}). "
            "The worker exited before the batch was received, or /proc is restricted "
            "(receiving needs the same user and ptrace read access to the worker)."
        ) from e
    try:
        st = os.fstat(new_fd)
        if (st.st_dev, st.st_ino) != tuple(ident):
            raise AttachError(
                f"cannot receive a batch from DataLoader worker {pid}: {path} now refers to "
                f"another file (the batch was not received within {MAX_UNACKNOWLEDGED} batches)."
            )
        address = libc_mmap()(None, total, PROT_READ_WRITE, _MAP_SHARED, new_fd, 0)
        if address in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of a batch from worker {pid} failed")
    finally:
        os.close(new_fd)
    return int(address)


_MAP_SHARED = 0x01
_RELEASE_LOCK = threading.Lock()
IDLE_BYTES = 4 << 20
"""Bytes of released batch mappings a receiver keeps, to receive their memfds again."""
# (pid, fd, device, inode) of a worker's memfd -> (address, length) of our idle mapping;
# oldest first. A live inode is never renumbered, so a key names one file.
_IDLE: dict[tuple[int, ...], tuple[int, int]] = {}


def _forget_idle() -> None:
    # a fork child: the parent's idle mappings are not its to reuse; unmapping them
    # here lets their files go when the parent and the worker let go of them
    for mapping in _IDLE.values():
        munmap(*mapping)
    _IDLE.clear()


os.register_at_fork(after_in_child=_forget_idle)


def _release(pid: int, key: tuple[int, ...], address: int, length: int, counter_at: int) -> None:
    """Tell the worker that this mapping of the batch is gone; keep it idle or unmap it."""
    if os.getpid() != pid:  # a fork child: the receiver may still hold it
        munmap(address, length)
        return
    counter = ctypes.c_uint32.from_address(address + counter_at)
    unmap = [(address, length)]
    with _RELEASE_LOCK:
        counter.value += 1
        if key not in _IDLE and length <= IDLE_BYTES:
            _IDLE[key] = (address, length)
            unmap.clear()
            kept = sum(n for _, n in _IDLE.values())
            while kept > IDLE_BYTES:
                oldest = next(iter(_IDLE))
                unmap.append(_IDLE.pop(oldest))
                kept -= unmap[-1][1]
    for mapping in unmap:
        munmap(*mapping)


def _map_fd(fd: int, nbytes: int) -> int:
    """Map ``nbytes`` of ``fd`` shared; the address (unmapped explicitly, by the outbox)."""
    address = libc_mmap()(None, nbytes, PROT_READ_WRITE, _MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap of a new batch failed")
    return int(address)
