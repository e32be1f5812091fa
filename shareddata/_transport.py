"""How a batch gathered in a DataLoader worker reaches the main process.

Note [How a batch leaves a worker]
----------------------------------
torch carries a tensor out of a worker in a ``/dev/shm`` segment that it creates
and faults in up front, and pickles it as a file descriptor that the main process
then fetches from the worker over a socket (``multiprocessing.resource_sharer``):
a connection, an authentication handshake, and a thread of the worker that must
take the GIL from the worker's busy main thread. On a 2-core VM that cost ~0.8 ms
per 256 KiB batch and ~2 ms per 4 MiB one, with no data read at all
(``benchmarks/bench_suite.py``, "IPC floor").

A batch that shareddata gathers in a worker goes instead into a fresh memfd
(``memfd_create`` + ``ftruncate``: no page is touched until the gather writes it),
as a :class:`WorkerBatch` tensor. ``ForkingPickler`` (what the DataLoader's queue
uses) pickles it as a handle ``(pid, fd, device, inode, offset, ...)``; the main
process opens ``/proc/<pid>/fd/<fd>`` itself, as ``_storage`` does for segments,
checks device and inode, maps it, and sets the part's acknowledgement byte at the
end of the memfd. All the columns of a batch share one memfd (one descriptor per
batch, however many columns). The worker keeps each batch's descriptor until every
part is acknowledged, and closes those when it makes its next batch; it never
holds more than ``MAX_UNACKNOWLEDGED`` (a DataLoader has ``prefetch_factor``
batches per worker in flight; a part that a custom ``collate_fn`` dropped is never
received, and its batch is closed once it is the oldest beyond the cap). A batch
that is received stays valid after its worker exits: the main process's mapping
holds the pages. Nothing is ever named in ``/dev/shm``, so a small ``/dev/shm``
(Docker's 64 MiB) does not limit the batch size, and a killed process leaves
nothing behind.

Note [Reusing a batch's pages]
------------------------------
A fresh memfd costs its first touch: the kernel allocates and zeroes every page as
the gather writes it, ~3.3 ms for a 4 MiB batch on the 2-core VM, where the gather
itself takes 0.1 ms (``benchmarks/bench_suite.py``, 16 KiB samples with workers).
So a worker reuses the memfd of a batch that the main process has let go of. The
memfd ends, after its parts, with a page-aligned block of one *received* byte and
one *released* byte per part. The main process maps the memfd with ``mmap`` itself
(no descriptor kept) under a numpy array that only the part's torch storage holds;
when that storage is freed -- no tensor, view, numpy array or other holder of the
part is left -- a finalizer on the array sets the part's released byte and unmaps
it. (A fork child of the receiver inherits the mapping; its finalizer only unmaps.)
A worker puts a batch whose parts are all released in its pool (at most ``POOL``
memfds, kept unmapped, so they appear in no process's PSS: ``verify`` measures data,
not transport), and gathers its next batch into a pooled memfd that is large
enough, mapped again with ``MADV_POPULATE_WRITE`` (its pages exist: ~1.2 ms for
4 MiB instead of 3.3 ms). A batch that is never released (the user keeps it, or
sends it on) is never reused: its memfd is closed once it is the oldest beyond the
cap, and the main process's mapping keeps its pages.

Plain ``pickle`` (``torch.save``, a user's own queue) sees a ``WorkerBatch`` as an
ordinary tensor, by value. Every torch operation on a ``WorkerBatch`` returns a
plain tensor, so only the gathered batch itself takes this path.
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

from ._storage import _MADV_POPULATE_WRITE, _PROT_READ_WRITE, _libc_mmap, _madvise
from .errors import AttachError

__all__ = ["MAX_UNACKNOWLEDGED", "WorkerBatch", "worker_buffers", "worker_empty"]

MAX_UNACKNOWLEDGED = 64
POOL = 4
"""Released batch memfds a worker keeps for reuse (Note [Reusing a batch's pages])."""
_ALIGN = 64
_PAGE = os.sysconf("SC_PAGE_SIZE")


class WorkerBatch(torch.Tensor):
    """A batch made in a worker, in its own memfd; pickled for the DataLoader as a handle."""

    # every operation returns a plain tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Plain pickle: an ordinary tensor, by value.
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


class _Outbox:
    """The batches one worker process has sent and not yet seen released, and its pool."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # (fd, file size, offset of the flag bytes, number of parts, weakrefs to the
        # parts); no mapping is kept, so a batch in flight counts once, where it is held
        self.pending: collections.deque[tuple[int, int, int, int, list[Any]]] = collections.deque()
        self.sent: set[int] = set()  # descriptors of batches pickled for the main process
        self.pool: list[tuple[int, int]] = []  # (fd, file size): released, to be reused

    def reap(self) -> None:
        """Pool or close every batch that is done with (and close the oldest beyond the cap).

        A sent batch is done once every part is released by the main process (read
        through the descriptor, ``pread``: the worker keeps no mapping of a batch it
        has sent): its memfd goes to the pool. A batch never sent is done once its
        parts are garbage; it is closed, not pooled (views of its parts, made by a
        transform, may still map it).
        """
        excess = len(self.pending) - MAX_UNACKNOWLEDGED + 1  # room for the next batch
        keep: collections.deque[tuple[int, int, int, int, list[Any]]] = collections.deque()
        for i, entry in enumerate(self.pending):
            fd, size, at, parts, refs = entry
            if fd in self.sent:
                released = all(os.pread(fd, parts, at + parts))
                if released and len(self.pool) < POOL:
                    self.sent.discard(fd)
                    self.pool.append((fd, size))
                    continue
                done = released
            else:  # never sent (a transform or collate_fn made another batch of it)
                done = all(ref() is None for ref in refs)
            if i < excess or done:
                self.sent.discard(fd)
                os.close(fd)
            else:
                keep.append(entry)
        self.pending = keep

    def take(self, size: int) -> tuple[int, int] | None:
        """The smallest pooled memfd of at least ``size`` bytes, or None."""
        fits = [entry for entry in self.pool if entry[1] >= size]
        if not fits:
            return None
        entry = min(fits, key=lambda e: e[1])
        self.pool.remove(entry)
        return entry


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = threading.Lock()


def worker_buffers(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty tensors for the parts (columns) of one batch, all in one memfd.

    One descriptor per batch, however many columns it has. The memfd ends with a
    received byte and a released byte per part, which the receiving process sets
    (Note [Reusing a batch's pages]); the memfd is a fresh one, or one of this
    worker's released batches.

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
    layout = []
    offset = 0
    for shape, dtype in parts:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        layout.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    flags_at = -(-offset // _PAGE) * _PAGE  # its own page: the receiver maps it alone
    total = flags_at + 2 * len(parts)
    if all(nbytes == 0 for _, nbytes in layout):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    with _OUTBOX_LOCK:
        if _OUTBOX is None or _OUTBOX.pid != os.getpid():  # first batch of this process
            _OUTBOX = _Outbox()
        box = _OUTBOX
        box.reap()
        pooled = box.take(total)
        if pooled is None:
            fd = os.memfd_create("shareddata-batch", os.MFD_CLOEXEC)
            size = total
        else:
            fd, size = pooled
        try:
            if pooled is None:
                os.ftruncate(fd, total)
            else:
                os.pwrite(fd, bytes(2 * len(parts)), flags_at)
            base = _map(f"/proc/self/fd/{fd}", total)
            if pooled is not None:  # its pages exist: map them all in one call
                _madvise(base.data_ptr(), flags_at, _MADV_POPULATE_WRITE)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        refs: list[Any] = []
        box.pending.append((fd, size, flags_at, len(parts), refs))
    out: list[torch.Tensor] = []
    for k, ((shape, dtype), (start, nbytes)) in enumerate(zip(parts, layout)):
        if nbytes == 0:
            os.pwrite(fd, b"\x01", flags_at + k)  # nothing to receive or release
            os.pwrite(fd, b"\x01", flags_at + len(parts) + k)
            out.append(torch.empty(shape, dtype=dtype))
            continue
        part = base[start : start + nbytes].view(dtype).view(shape).as_subclass(WorkerBatch)
        flags = (flags_at + k, flags_at + len(parts) + k)
        part._sd_handle = (box.pid, fd, (st.st_dev, st.st_ino), total, start, nbytes, flags)  # type: ignore[attr-defined]
        refs.append(weakref.ref(part))
        out.append(part)
    return out


def worker_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One empty batch tensor in its own memfd (:func:`worker_buffers` with one part)."""
    return worker_buffers([(shape, dtype)])[0]


def _reduce(tensor: WorkerBatch) -> Any:
    """``ForkingPickler``'s reduction: the handle, or torch's own for anything else."""
    from torch.multiprocessing.reductions import reduce_tensor

    handle = getattr(tensor, "_sd_handle", None)
    plain = tensor.as_subclass(torch.Tensor)
    if (
        handle is None
        or handle[0] != os.getpid()
        or plain.storage_offset() * plain.element_size() != handle[4]
        or not plain.is_contiguous()
        or plain.nbytes != handle[5]
    ):
        return reduce_tensor(plain)
    with _OUTBOX_LOCK:
        if _OUTBOX is not None:
            _OUTBOX.sent.add(handle[1])
    return _receive, (*handle, tuple(plain.shape), plain.dtype)


ForkingPickler.register(WorkerBatch, _reduce)


def _receive(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    total: int,
    start: int,
    nbytes: int,
    flags: tuple[int, int],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Unpickle one part in the receiving process: map the worker's memfd, acknowledge it.

    The part's memory is released (its released byte set, then unmapped) as soon as
    nothing holds it any more (Note [Reusing a batch's pages]).
    """
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
        address = _libc_mmap()(None, total, _PROT_READ_WRITE, _MAP_SHARED, new_fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of a batch from worker {pid} failed")
    finally:
        os.close(new_fd)
    received, released = flags
    mapped = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(address))
    # Runs once the storage below is freed: it alone holds ``mapped`` (through a view).
    weakref.finalize(mapped, _release, os.getpid(), address, total, released).atexit = False
    mapped[received] = 1
    return torch.from_numpy(mapped[start : start + nbytes]).view(dtype).view(shape)


_MAP_SHARED = 0x01
_MAP_FAILED = 2**64 - 1  # (void *) -1 as ctypes returns it


def _release(pid: int, address: int, total: int, released: int) -> None:
    """Tell the worker that the part is no longer used here, and unmap it."""
    if os.getpid() == pid:  # not in a fork child: the receiver may still hold it
        ctypes.c_uint8.from_address(address + released).value = 1
    _munmap()(address, total)


@functools.lru_cache(maxsize=1)
def _munmap() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc.munmap


def _map(path: str, nbytes: int) -> torch.Tensor:
    """``path`` mapped shared as a uint8 tensor, keeping no descriptor open.

    (``mmap.mmap`` keeps a duplicate of the descriptor for as long as the mapping
    lives: one per batch in flight, which runs into ``RLIMIT_NOFILE``.)
    """
    storage = torch.UntypedStorage.from_file(path, True, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
