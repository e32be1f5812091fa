"""How a DataLoader worker puts a batch in shared memory that the main process maps.

Note [How a batch leaves a worker]
----------------------------------
torch carries a tensor out of a worker in a ``/dev/shm`` segment that it creates
and faults in up front, and pickles it as a file descriptor that the main process
then fetches from the worker over a socket (``multiprocessing.resource_sharer``):
a connection, an authentication handshake, and a thread of the worker that must
take the GIL from the worker's busy main thread (``benchmarks/bench_ipc.py``
measures it).

A batch that shareddata gathers in a worker goes instead into a memfd
(``memfd_create`` + ``ftruncate``: no page is touched until the gather writes it):
every numeric column of the batch in ONE memfd, as :class:`SharedTensor` s over one
storage -- fixed-shape columns stacked, a variable-length column's rows side by
side, each row a view; a ``SharedList`` batch's items, unpickled afresh per row,
have their tensors copied into one memfd the same way (:func:`into_one_batch`).
However many rows are ragged, a batch leaves the worker as one descriptor, never
one torch ``/dev/shm`` segment per row (``tests/test_crossing.py`` counts them for
every dataset kind). The tensors carry the memfd's :class:`BatchRef`, which pickles
as the memfd's handle ``(pid, fd, device, inode, ...)`` plus the byte range (Note
[Tensors over our memory cross by handle] in ``storage/_tensor.py``); the reference is
pickled once per message, however many tensors of the batch it carries. The main
process opens ``/proc/<pid>/fd/<fd>`` itself, checks device and inode, maps it, and
counts the batch *received* (``crossing/_inbox.py``). The worker keeps each batch's
descriptor until every send of it is received, however many are in flight
(``prefetch_factor`` batches per worker, each of them possibly many memfds: a
``collate_fn`` that returns samples made one by one, such as slices of a dataset,
carries one memfd per sample); only received batches that stay pinned are closed,
beyond ``MAX_UNACKNOWLEDGED``, which their receivers do not notice. Only beyond
``MAX_UNRECEIVED`` (a quarter of the descriptor limit) is an unreceived batch
closed, and a receiver that comes later gets :class:`~shareddata.AttachError`. A
batch that is received stays valid after its worker exits: the main process's
mapping holds the pages. Nothing is ever named in ``/dev/shm``, so a small
``/dev/shm`` (Docker's 64 MiB) does not limit the batch size, and a killed process
leaves nothing behind.

Note [Reusing a batch's pages]
------------------------------
A fresh memfd costs its first touch: the kernel allocates and zeroes every page as
the gather writes it, several times the gather itself for large batches. So a
worker reuses the memfd of a batch that nobody holds any more. The memfd ends,
after its data, with a *released* and a *received* counter. Each time the worker
pickles the batch's reference it counts one send; the main process counts the
batch received when it maps it, and released when nothing holds any part of it
(``crossing/_inbox.py``). The worker keeps, per memfd, the one storage that its
batches' tensors view, by a weak reference to the numpy array the storage was made
from: ``torch.from_numpy`` holds that array for as long as the storage lives, so the
array is gone exactly when no tensor, view or storage in the worker holds any part
of the batch (and when torch moved the storage into a segment of its own, which no
longer needs the memfd). The worker puts a batch in its pool once that array is
gone and the released counter equals its sends: until then the batch is *pinned*.
No counter private to torch or CPython decides it; a batch whose holders cannot be
told is never reused. The pool holds at most ``POOL`` memfds; the worker keeps its own
mapping of them up to ``IDLE_BYTES`` in all (the rest unmapped, in no process's
PSS: ``verify`` measures data, not transport). The next batch goes into a pooled
memfd that is large enough: one still mapped costs no system call; one unmapped is
mapped again with ``MADV_POPULATE_WRITE`` (its pages exist). A batch that is never
released (the user keeps it, or sends it on) is never reused: its memfd is closed
once it is the oldest beyond the cap, and the main process's mapping keeps its
pages.

Note [What one crossing costs]
------------------------------
Once both ends have a memfd mapped, a batch crosses with no system call of ours
and few Python objects: the DataLoader's own per-batch cost (its queues, pickling,
``record_function``) is a floor that no transport goes below, so every object made
per batch shows. The worker reuses the memfd's mapping and the layout
of the batch's parts; a batch's reference pickles flat (the memfd's handle as ints
and the byte range) and each tensor as its dtype's name, offset, shape and stride;
the receiver takes the idle mapping's array, slices it and watches the slice with
a weak reference. The process id is read once per process. Figures before and
after: ``benchmarks/results/ipc.md``.
"""

from __future__ import annotations

import collections
import ctypes
import math
import os
import weakref
from typing import Any, cast

import numpy as np
import torch

from .._compat import torch_reduce_storage
from ..storage import SharedTensor, shared_tensor
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
from ..storage._tensor import describe_failure, raise_send_error
from . import _inbox
from ._inbox import IDLE_BYTES, MAX_UNRECEIVED

__all__ = [
    "MAX_UNACKNOWLEDGED",
    "MAX_UNRECEIVED",
    "POOL",
    "into_one_batch",
    "worker_buffers",
    "worker_empty",
]

MAX_UNACKNOWLEDGED = 64
"""Received batches still pinned that a worker keeps open; older ones are closed."""
POOL = 4
"""Released batch memfds a worker keeps for reuse (Note [Reusing a batch's pages])."""
_ALIGN = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = 8  # bytes of the released counter and the received counter (uint32 each)


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
                    return _inbox.receive, (*memfd.handle, 0, self.nbytes)
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
        self.handle: tuple[int, ...] = ()  # what a receiver needs, but the byte range
        self.sends = 0

    def use(self, data: int, total: int, populate: bool) -> torch.UntypedStorage:
        """Make this memfd hold a new batch of ``data`` bytes: mapped, counters at zero.

        Returns the new batch's storage over its data, which this object does not hold
        (:meth:`gone_here`). A memfd still mapped here costs no system call.
        """
        fd = cast(int, self.fd)  # a memfd in use or in the pool is open
        if self.address and self.length < total:
            self.unmap()
        if not self.address:
            with named_os_errors("a DataLoader worker's batch", total):
                self.address, self.length = map_fd(fd, total), total
            if populate:  # its pages exist: map them all in one call
                madvise(self.address, total, MADV_POPULATE_WRITE)
        if self.counter is None or self.data != data:
            self.counter = ctypes.c_uint32.from_address(self.address + data)
            self.received = ctypes.c_uint32.from_address(self.address + data + 4)
            self.data = data
            self.handle = (_PID, fd, *self.ident, total, data)
        array = array_at(self.address, data)
        storage = torch.from_numpy(array).untyped_storage()
        self.alive = weakref.ref(array)
        self.ref = BatchRef(self)  # a new use: views of an older one never match it
        # the counters of this use of the memfd start at zero (a pooled one was counted)
        self.counter.value = self.received.value = 0  # type: ignore[union-attr]
        self.sends = 0
        return storage

    def gone_here(self) -> bool:
        """Whether nothing in this worker holds any part of the batch any more."""
        return self.alive is None or self.alive() is None

    def released(self) -> bool:
        """Whether every mapping of this batch in a receiver is gone."""
        return self.sends == 0 or self.counter.value >= self.sends  # type: ignore[union-attr]

    def all_received(self) -> bool:
        """Whether every send of this batch has reached its receiver."""
        return self.received.value >= self.sends  # type: ignore[union-attr]

    def unmap(self) -> None:
        """Drop this worker's mapping (nothing here may hold the batch any more)."""
        # only once the batch is gone here (or its memfd closed and its views gone)
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
        # no mapping of a sent batch is kept here: a batch in flight counts once, where held
        self.pending: collections.deque[_Memfd] = collections.deque()
        self.mapped: set[_Memfd] = set()  # every memfd whose mapping here may live
        # released, to be reused; their mappings here kept up to IDLE_BYTES in all
        self.pool: list[_Memfd] = []
        self.pool_mapped = 0

    def reap(self) -> None:
        """Pool or close every batch that is done with (and close the oldest beyond the caps).

        A batch is done once nothing in this worker holds it any more and every
        mapping of it in the receiver is released: its memfd goes to the pool (or is
        closed when the pool is full). Beyond ``MAX_UNACKNOWLEDGED`` pending, the
        oldest received ones are closed (their receivers keep their mappings);
        beyond ``MAX_UNRECEIVED``, the oldest whatever they are.
        """
        excess = len(self.pending) - MAX_UNACKNOWLEDGED + 1  # room for the next batch
        force = len(self.pending) - MAX_UNRECEIVED + 1
        keep: collections.deque[_Memfd] = collections.deque()
        for i, memfd in enumerate(self.pending):
            gone_here = memfd.gone_here()
            if gone_here and memfd.released():
                self.mapped.discard(memfd)
                if len(self.pool) < POOL:
                    if self.pool_mapped + memfd.length > IDLE_BYTES:
                        memfd.unmap()
                    self.pool_mapped += memfd.length
                    self.pool.append(memfd)
                else:
                    memfd.unmap()
                    memfd.close()
            elif i < force or (excess > 0 and memfd.all_received()):
                # pinned too long: close it; receivers keep their mappings (one that
                # has not received it yet, only beyond MAX_UNRECEIVED, gets AttachError)
                excess -= 1
                memfd.close()
                if gone_here:
                    self.mapped.discard(memfd)
                    memfd.unmap()
            else:
                keep.append(memfd)
        self.pending = keep
        if len(self.mapped) > len(keep):  # closed ones held here: unmap those now gone
            for memfd in [m for m in self.mapped if m.fd is None and m.gone_here()]:
                self.mapped.discard(memfd)
                memfd.unmap()

    def take(self, size: int) -> _Memfd | None:
        """The smallest pooled memfd of at least ``size`` bytes, or None."""
        best = None
        for memfd in self.pool:
            if memfd.size >= size and (best is None or memfd.size < best.size):
                best = memfd
        if best is not None:
            self.pool.remove(best)
            self.pool_mapped -= best.length
        return best


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = ForkSafeLock()
_PID = os.getpid()
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
    """Empty tensors for the parts (columns) of one batch, all in one memfd.

    One descriptor per batch, however many columns it has. The memfd ends with the
    batch's counters (Note [Reusing a batch's pages]); the memfd is a fresh one, or
    one of this worker's released batches. The tensors are :class:`SharedTensor` s
    (but empty ones, which are plain).

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
    global _OUTBOX
    layout, data = _layout(parts)
    if data == 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    total = data + _COUNTER
    _inbox.release_queued()  # batches this process received and dropped (a pool's chain)
    with _OUTBOX_LOCK:
        box = _OUTBOX
        if box is None:  # first batch of this process
            box = _OUTBOX = _Outbox()
        box.reap()
        memfd = box.take(total)
        populate = memfd is not None and not memfd.address
        if memfd is None:
            memfd = _Memfd(total)
        try:
            storage = memfd.use(data, total, populate)
        except BaseException:
            memfd.unmap()
            memfd.close()
            raise
        box.pending.append(memfd)
        box.mapped.add(memfd)
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
        ((SharedTensor([1., 1.]), 'x'), 1)
    """
    found: list[torch.Tensor] = []
    _collect(items, found)
    if not found:
        return items
    outs = iter(worker_buffers([(tuple(t.shape), t.dtype) for t in found]))
    return _replace(items, lambda t: _copy_into(next(outs), t))


def _copy_into(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    out.as_subclass(torch.Tensor).copy_(value)  # plain: no Python dispatch per copy
    return out


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


def _after_fork_in_child() -> None:
    global _PID, _OUTBOX
    _PID = os.getpid()
    _OUTBOX = None  # the parent's batches are not this process's to send or reuse


os.register_at_fork(after_in_child=_after_fork_in_child)

_ = (np, SharedTensor)  # re-exported types used in annotations by callers
