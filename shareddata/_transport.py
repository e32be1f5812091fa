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
uses) pickles it as a handle ``(pid, fd, device, inode, seq, ...)``; the main
process opens ``/proc/<pid>/fd/<fd>`` itself, as ``_storage`` does for segments,
checks device and inode, maps it, and writes ``seq`` into the worker's
acknowledgement page (one small memfd per worker, mapped once). The worker keeps
each batch's descriptor until it sees the acknowledgement, and closes the
acknowledged ones when it makes its next batch; it never holds more than
``MAX_UNACKNOWLEDGED`` (a DataLoader has ``prefetch_factor`` batches per worker in
flight). A batch that is received stays valid after its worker exits: the main
process's mapping holds the pages. Nothing is ever named in ``/dev/shm``, so a
small ``/dev/shm`` (Docker's 64 MiB) does not limit the batch size, and a killed
process leaves nothing behind.

Plain ``pickle`` (``torch.save``, a user's own queue) sees a ``WorkerBatch`` as an
ordinary tensor, by value. Every torch operation on a ``WorkerBatch`` returns a
plain tensor, so only the gathered batch itself takes this path.
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import struct
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .errors import AttachError

__all__ = ["MAX_UNACKNOWLEDGED", "WorkerBatch", "worker_empty"]

MAX_UNACKNOWLEDGED = 256
_ACK = struct.Struct("q")


class WorkerBatch(torch.Tensor):
    """A batch made in a worker, in its own memfd; pickled for the DataLoader as a handle."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops return plain tensors

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Plain pickle: an ordinary tensor, by value.
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


class _Outbox:
    """The batches one worker process has sent and not yet seen acknowledged."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ack_fd = os.memfd_create("shareddata-acks", os.MFD_CLOEXEC)
        os.ftruncate(self.ack_fd, _ACK.size)
        st = os.fstat(self.ack_fd)
        self.ack_ident = (st.st_dev, st.st_ino)
        self.ack = mmap.mmap(self.ack_fd, _ACK.size)
        self.seq = 0
        self.pending: collections.deque[tuple[int, int]] = collections.deque()

    def reap(self) -> None:
        """Close the descriptors of every acknowledged batch (and of the oldest beyond the cap)."""
        acked = _ACK.unpack_from(self.ack, 0)[0]
        pending = self.pending
        while pending and (pending[0][0] <= acked or len(pending) >= MAX_UNACKNOWLEDGED):
            os.close(pending.popleft()[1])


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = threading.Lock()


def worker_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty batch tensor in a fresh memfd, to be filled and sent to the main process.

    Example:
        >>> import pickle
        >>> t = worker_empty((2, 3), torch.float32).fill_(1.0)
        >>> type(t).__name__, type(t + 1).__name__
        ('WorkerBatch', 'Tensor')
        >>> pickle.loads(pickle.dumps(t))
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    global _OUTBOX
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with _OUTBOX_LOCK:
        if _OUTBOX is None or _OUTBOX.pid != os.getpid():  # first batch of this process
            _OUTBOX = _Outbox()
        box = _OUTBOX
        box.reap()
        fd = os.memfd_create("shareddata-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            buf = mmap.mmap(fd, nbytes)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        box.seq += 1
        box.pending.append((box.seq, fd))
        seq = box.seq
    tensor = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape).as_subclass(WorkerBatch)
    tensor._sd_handle = (  # type: ignore[attr-defined]
        box.pid,
        fd,
        (st.st_dev, st.st_ino),
        nbytes,
        seq,
        box.ack_fd,
        box.ack_ident,
    )
    return tensor


def _reduce(tensor: WorkerBatch) -> Any:
    """``ForkingPickler``'s reduction: the handle, or torch's own for anything else."""
    from torch.multiprocessing.reductions import reduce_tensor

    handle = getattr(tensor, "_sd_handle", None)
    plain = tensor.as_subclass(torch.Tensor)
    if (
        handle is None
        or handle[0] != os.getpid()
        or plain.storage_offset() != 0
        or not plain.is_contiguous()
        or plain.nbytes != handle[3]
    ):
        return reduce_tensor(plain)
    return _receive, (*handle, tuple(plain.shape), plain.dtype)


ForkingPickler.register(WorkerBatch, _reduce)

_ACKS: collections.OrderedDict[tuple[int, int, int], mmap.mmap] = collections.OrderedDict()
_ACKS_LOCK = threading.Lock()
_MAX_ACK_PAGES = 64


def _open_proc_fd(pid: int, fd: int, ident: tuple[int, int], what: str) -> int:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        new_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise AttachError(
            f"cannot receive {what} from DataLoader worker {pid}: opening {path} failed ({e}). "
            "The worker exited before the batch was received, or /proc is restricted "
            "(receiving needs the same user and ptrace read access to the worker)."
        ) from e
    st = os.fstat(new_fd)
    if (st.st_dev, st.st_ino) != tuple(ident):
        os.close(new_fd)
        raise AttachError(
            f"cannot receive {what} from DataLoader worker {pid}: {path} now refers to "
            f"another file (the batch was not received within {MAX_UNACKNOWLEDGED} batches)."
        )
    return new_fd


def _receive(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    nbytes: int,
    seq: int,
    ack_fd: int,
    ack_ident: tuple[int, int],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Unpickle a batch in the receiving process: map the worker's memfd, acknowledge it."""
    new_fd = _open_proc_fd(pid, fd, ident, "a batch")
    try:
        buf = mmap.mmap(new_fd, nbytes)
    finally:
        os.close(new_fd)
    _acknowledge(pid, ack_fd, ack_ident, seq)
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def _acknowledge(pid: int, ack_fd: int, ack_ident: tuple[int, int], seq: int) -> None:
    key = (pid, *ack_ident)
    with _ACKS_LOCK:
        page = _ACKS.get(key)
        if page is None:
            try:
                new_fd = _open_proc_fd(pid, ack_fd, ack_ident, "an acknowledgement page")
            except AttachError:
                return  # the worker is gone: nothing left to tell it
            try:
                page = mmap.mmap(new_fd, _ACK.size)
            finally:
                os.close(new_fd)
            _ACKS[key] = page
            if len(_ACKS) > _MAX_ACK_PAGES:
                _ACKS.popitem(last=False)[1].close()
        else:
            _ACKS.move_to_end(key)
        if _ACK.unpack_from(page, 0)[0] < seq:
            _ACK.pack_into(page, 0, seq)
