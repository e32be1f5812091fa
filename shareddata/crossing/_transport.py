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
checks device and inode, maps it, and counts the batch *received* (a second
counter, next to the released one of Note [Reusing a batch's pages]). The worker
keeps each batch's descriptor until every send of it is received, however many
are in flight (``prefetch_factor`` batches per worker, each of them possibly many
memfds: a ``collate_fn`` that returns samples made one by one, such as slices of a
dataset, carries one memfd per sample); only received batches that stay pinned are
closed, beyond ``MAX_UNACKNOWLEDGED``, which their receivers do not notice. Only
beyond ``MAX_UNRECEIVED`` (a quarter of the descriptor limit) is an unreceived batch
closed, and a receiver that comes later gets :class:`~shareddata.AttachError`. A
batch that is received stays valid after its worker exits: the main process's
mapping holds the pages. Nothing is ever named in
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
array or other holder of any part of it is left -- a weak reference's callback on
that array adds one to the counter. The main process keeps that mapping *idle* (at
most ``IDLE_BYTES`` of them, the oldest unmapped first): when the worker sends a
batch in the same memfd again, receiving it costs no system call at all, where
opening, mapping and unmapping cost ~140 us of the main process's time per batch on
the 2-core VM (``munmap`` alone ~100 us: it must flush the TLBs of the other CPUs).
Idle mappings never hold a live batch (the worker may overwrite their pages), and
they keep a closed memfd's pages for at most ``IDLE_BYTES``. (A fork child of the
receiver inherits the mappings; its callbacks only unmap, and it unmaps the idle
ones at once.) The worker keeps, per memfd, the one storage that its batches'
tensors are views of; it puts a batch in its pool once nothing in the worker holds
that storage but itself (the storage's use count is one: the batch has been pickled
and dropped) and the counter equals its sends: the batch is *pinned* for as long as
any view of it lives in the main process. The pool holds at most ``POOL`` memfds;
the worker keeps its own mapping of them, and their storages, up to ``IDLE_BYTES``
in all (the rest unmapped, in no process's PSS: ``verify`` measures data, not
transport). The worker gathers its next batch into a pooled memfd that is large
enough: one still mapped costs no system call; one unmapped is mapped again with
``MADV_POPULATE_WRITE`` (its pages exist: ~1.2 ms for 4 MiB instead of 3.3 ms). A
batch that is never released (the user keeps it, or sends it on) is never reused:
its memfd is closed once it is the oldest beyond the cap, and the main process's
mapping keeps its pages.

Note [What one crossing costs]
------------------------------
Once both ends have a memfd mapped, a batch crosses with no system call of ours
and few Python objects: the DataLoader's own per-batch cost (its queues, pickling,
``record_function``) is a floor that no transport goes below, so every object made
per batch shows. The worker reuses the memfd's mapping, its storage and the layout
of the batch's parts (no new numpy, ctypes or storage object); a batch's tensor
pickles as its storage (found by one dict lookup of its address, then flat: the
memfd's handle as ints and the byte range) and its dtype by name, offset, shape
and stride; the receiver takes the idle mapping's array, slices it and watches the
slice with a weak reference (``weakref.finalize`` costs several times more). The
process id is read once per process (``os.getpid`` is a system call). Figures
before and after: ``benchmarks/results/ipc.md``.

Plain ``pickle`` (``torch.save``, a user's own pickling) sees a ``WorkerBatch`` as
an ordinary tensor, by value. Every torch operation on a ``WorkerBatch`` returns a
plain tensor.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import math
import os
import resource
import sys
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

import numpy as np
import torch

from ..errors import AttachError
from ..storage._linux import MADV_POPULATE_WRITE, PROT_READ_WRITE, file_identity, libc_mmap, madvise
from ._reduce import MAP_FAILED, guard_worker_sends, munmap, reduce_tensor, register_memory

__all__ = [
    "MAX_UNACKNOWLEDGED",
    "MAX_UNRECEIVED",
    "WorkerBatch",
    "into_one_batch",
    "worker_buffers",
    "worker_empty",
]

MAX_UNACKNOWLEDGED = 64
"""Received batches still pinned that a worker keeps open; older ones are closed."""
MAX_UNRECEIVED = max(256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
"""Batches not yet received that a worker keeps open (bounds its descriptors)."""
POOL = 4
"""Released batch memfds a worker keeps for reuse (Note [Reusing a batch's pages])."""
_ALIGN = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = 8  # bytes of the released counter and the received counter (uint32 each)


class WorkerBatch(torch.Tensor):
    """A batch made in a worker, in its own memfd; pickled for the DataLoader as a handle."""

    # every operation returns a plain tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Plain pickle: an ordinary tensor, by value.
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


ForkingPickler.register(WorkerBatch, functools.partial(reduce_tensor, ours=True))


class _Memfd:
    """One memfd of a worker, for one batch at a time (kept across uses by the pool)."""

    __slots__ = (
        "address", "counter", "data", "fd", "handle", "ident", "length", "received", "sends",
        "size", "storage",
    )  # fmt: skip

    def __init__(self, total: int) -> None:
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
        self.data = 0  # bytes of data of the current batch; its counter follows them
        self.storage: torch.UntypedStorage | None = None  # over the data, held here
        self.counter: ctypes.c_uint32 | None = None
        self.received: ctypes.c_uint32 | None = None
        self.handle: tuple[int, ...] = ()  # what a receiver needs, but the byte range
        self.sends = 0

    def use(self, data: int, total: int, populate: bool) -> None:
        """Make this memfd hold a new batch of ``data`` bytes: mapped, counter at zero.

        A memfd still mapped here with a storage of that size costs no system call
        and no new object but the counter's reset.
        """
        fd = cast(int, self.fd)  # a memfd in use or in the pool is open
        if self.address and self.length < total:
            self.unmap()
        if not self.address:
            self.address, self.length = _map_fd(fd, total), total
            if populate:  # its pages exist: map them all in one call
                madvise(self.address, total, MADV_POPULATE_WRITE)
        if self.storage is None or self.data != data:
            # the storage covers this batch's data exactly (a pooled mapping may be
            # longer): _find recognises a storage inside [address, address + data)
            self.storage = None
            mapped = np.ctypeslib.as_array((ctypes.c_uint8 * data).from_address(self.address))
            self.storage = torch.from_numpy(mapped).untyped_storage()
            self.counter = ctypes.c_uint32.from_address(self.address + data)
            self.received = ctypes.c_uint32.from_address(self.address + data + 4)
            self.data = data
            self.handle = (_PID, fd, *self.ident, total, data)
        # the counter of this use of the memfd starts at zero (a pooled one was counted)
        self.counter.value = self.received.value = 0  # type: ignore[union-attr]
        self.sends = 0

    def gone_here(self) -> bool:
        """Whether nothing in this worker holds the batch but this object's storage."""
        storage = self.storage
        # (the getrefcount: ours and its argument; a caller may hold the storage object itself)
        return storage is None or (
            _use_count(storage._cdata) == 1 and sys.getrefcount(storage) == 3
        )

    def released(self) -> bool:
        """Whether every mapping of this batch in a receiver is gone."""
        # read through this worker's mapping (it lives while the batch is pending)
        return self.sends == 0 or self.counter.value >= self.sends  # type: ignore[union-attr]

    def all_received(self) -> bool:
        """Whether every send of this batch has reached its receiver."""
        return self.received.value >= self.sends  # type: ignore[union-attr]

    def unmap(self) -> None:
        """Drop this worker's mapping (nothing here may hold the batch any more)."""
        self.storage = self.counter = self.received = None
        if self.address:
            munmap(self.address, self.length)
        self.address = self.length = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_use_count = torch._C._storage_Use_Count


class _Outbox:
    """The batches this worker process has made and not yet seen released, and its pool."""

    def __init__(self) -> None:
        # no mapping of a sent batch is kept here: a batch in flight counts once, where held
        self.pending: collections.deque[_Memfd] = collections.deque()
        self.by_address: dict[int, _Memfd] = {}  # every batch whose mapping here may live
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
                self._forget(memfd)
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
                    self._forget(memfd)
                    memfd.unmap()
            else:
                keep.append(memfd)
        self.pending = keep
        if len(self.by_address) > len(keep):  # closed ones held here: unmap those now gone
            for memfd in list(self.by_address.values()):
                if memfd.fd is None and memfd.gone_here() and self._forget(memfd):
                    memfd.unmap()

    def _forget(self, memfd: _Memfd) -> bool:
        # a later batch may be mapped at the same address already
        if self.by_address.get(memfd.address) is memfd:
            del self.by_address[memfd.address]
            return True
        return False

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

    def locate(self, address: int, nbytes: int) -> _Memfd | None:
        """The batch whose data holds ``[address, address + nbytes)``."""
        memfd = self.by_address.get(address)
        if memfd is None:
            for candidate in self.by_address.values():  # a storage over part of a batch
                if candidate.address <= address < candidate.address + candidate.data:
                    memfd = candidate
                    break
        if memfd is None or address + nbytes > memfd.address + memfd.data:
            return None
        return memfd


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = threading.Lock()
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
    found = layout, -(-offset // _PAGE) * _PAGE  # the counter on its own page
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    _LAYOUTS[key] = found
    return found


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
    layout, data = _layout(parts)
    if data == 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    total = data + _COUNTER
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
            memfd.use(data, total, populate)
        except BaseException:
            memfd.unmap()
            memfd.close()
            raise
        box.pending.append(memfd)
        box.by_address[memfd.address] = memfd
        storage = memfd.storage
    return [
        torch.empty(0, dtype=dtype)
        .set_(storage, start, shape)  # type: ignore[call-overload]
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
    box = _OUTBOX
    return box is not None and box.locate(address, nbytes) is not None


def _find(storage: torch.UntypedStorage, address: int, nbytes: int) -> Any:
    """The reduction of a storage inside one of this worker's batches (counts a send)."""
    box = _OUTBOX
    if box is None:
        return None
    with _OUTBOX_LOCK:
        memfd = box.locate(address, nbytes)
        if memfd is None:
            return None
        if memfd.fd is not None:
            memfd.sends += 1
            return (_receive, (*memfd.handle, address - memfd.address, nbytes))
    # closed (kept here beyond the cap): send a copy, the way torch sends any storage
    from torch.multiprocessing.reductions import reduce_storage

    copy = torch.empty(nbytes, dtype=torch.uint8)
    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))  # type: ignore[call-overload]
    return reduce_storage(copy.untyped_storage())


register_memory(_find, _owns)


def _receive(
    pid: int,
    fd: int,
    device: int,
    inode: int,
    total: int,
    counter_at: int,
    start: int,
    nbytes: int,
) -> torch.UntypedStorage:
    """Unpickle a storage of a worker's batch: map the worker's memfd.

    The batch counts received at once; the mapping is released (the released
    counter incremented, then kept idle or unmapped) as soon as nothing holds the
    storage any more (Note [Reusing a batch's pages]).
    """
    key = (pid, fd, device, inode)
    idle = _take_idle(key)
    if idle is not None and idle[1] >= total:  # mapped here before: no system call
        address, length, mapped = idle
    else:
        if idle is not None:
            munmap(idle[0], idle[1])
        address, length = _map_batch(pid, fd, (device, inode), total), total
        mapped = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
    with _RELEASE_LOCK:  # mapped: the worker may close its descriptor now
        ctypes.c_uint32.from_address(address + counter_at + 4).value += 1
    view = mapped[start : start + nbytes]
    # Called once the storage below is freed: it alone holds ``view``.
    ref = weakref.ref(view, _freed)
    _LIVE[id(ref)] = (ref, _PID, key, address, length, counter_at, mapped)
    return torch.from_numpy(view).untyped_storage()


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
        if file_identity(new_fd) != tuple(ident):
            raise AttachError(
                f"cannot receive a batch from DataLoader worker {pid}: {path} now refers to "
                f"another file: the worker made more than {MAX_UNRECEIVED} batch memfds that "
                "were not received and closed the oldest. Receive batches as they come, or "
                "lower prefetch_factor."
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
_IDLE: dict[tuple[int, ...], tuple[int, int, np.ndarray]] = {}
_idle_bytes = 0
# id of a weak reference to a received storage's array -> (the reference, the pid that
# received it, key, address, length, counter_at, the whole mapping's array)
_LIVE: dict[int, tuple[Any, ...]] = {}


def _freed(ref: Any) -> None:
    """A received storage is gone: release its mapping."""
    _release(*_LIVE.pop(id(ref))[1:])


def _release(
    pid: int, key: tuple[int, ...], address: int, length: int, counter_at: int, mapped: Any
) -> None:
    """Tell the worker that this mapping of the batch is gone; keep it idle or unmap it."""
    global _idle_bytes
    if pid != _PID:  # a fork child: the receiver may still hold it
        munmap(address, length)
        return
    unmap = [(address, length)]
    with _RELEASE_LOCK:
        ctypes.c_uint32.from_address(address + counter_at).value += 1
        if key not in _IDLE and length <= IDLE_BYTES:
            _IDLE[key] = (address, length, mapped)
            unmap.clear()
            _idle_bytes += length
            while _idle_bytes > IDLE_BYTES:
                oldest = _IDLE.pop(next(iter(_IDLE)))
                unmap.append(oldest[:2])
                _idle_bytes -= oldest[1]
    for mapping in unmap:
        munmap(*mapping)


def _take_idle(key: tuple[int, ...]) -> tuple[int, int, np.ndarray] | None:
    global _idle_bytes
    with _RELEASE_LOCK:
        idle = _IDLE.pop(key, None)
        if idle is not None:
            _idle_bytes -= idle[1]
    return idle


def _after_fork_in_child() -> None:
    global _PID, _OUTBOX, _OUTBOX_LOCK, _RELEASE_LOCK, _idle_bytes
    _PID = os.getpid()
    # the parent's batches are not this process's to send or reuse
    _OUTBOX = None
    _OUTBOX_LOCK, _RELEASE_LOCK = threading.Lock(), threading.Lock()
    # nor its idle mappings: unmapping them here lets their files go when the parent
    # and the worker let go of them
    for idle in _IDLE.values():
        munmap(idle[0], idle[1])
    _IDLE.clear()
    _idle_bytes = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
# at exit nothing is released (as weakref.finalize's atexit=False): the process's
# mappings go with it
atexit.register(_LIVE.clear)


def _map_fd(fd: int, nbytes: int) -> int:
    """Map ``nbytes`` of ``fd`` shared; the address (unmapped explicitly, by the outbox)."""
    address = libc_mmap()(None, nbytes, PROT_READ_WRITE, _MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap of a new batch failed")
    return int(address)
