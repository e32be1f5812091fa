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

Plain ``pickle`` (``torch.save``, a user's own queue) sees a ``WorkerBatch`` as an
ordinary tensor, by value. Every torch operation on a ``WorkerBatch`` returns a
plain tensor, so only the gathered batch itself takes this path.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .errors import AttachError

__all__ = ["MAX_UNACKNOWLEDGED", "WorkerBatch", "worker_buffers", "worker_empty"]

MAX_UNACKNOWLEDGED = 64
_ALIGN = 64


class WorkerBatch(torch.Tensor):
    """A batch made in a worker, in its own memfd; pickled for the DataLoader as a handle."""

    # every operation returns a plain tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Plain pickle: an ordinary tensor, by value.
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


class _Outbox:
    """The batches one worker process has sent and not yet seen acknowledged."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # (fd, offset of the acknowledgement bytes, number of parts, weakrefs to the
        # parts); no mapping is kept, so a batch in flight counts once, where it is held
        self.pending: collections.deque[tuple[int, int, int, list[Any]]] = collections.deque()
        self.sent: set[int] = set()  # descriptors of batches pickled for the main process

    def reap(self) -> None:
        """Close every batch that is done with (and the oldest beyond the cap).

        A sent batch is done once every part is acknowledged (the bytes are read
        through the descriptor, ``pread``: the worker keeps no mapping of a batch it
        has sent); a batch never sent, once its parts are garbage (views of them
        keep their own mapping).
        """
        excess = len(self.pending) - MAX_UNACKNOWLEDGED + 1  # room for the next batch
        keep: collections.deque[tuple[int, int, int, list[Any]]] = collections.deque()
        for i, entry in enumerate(self.pending):
            fd, at, parts, refs = entry
            if fd in self.sent:
                done = all(os.pread(fd, parts, at))  # every part received
            else:  # never sent (a transform or collate_fn made another batch of it)
                done = all(ref() is None for ref in refs)
            if i < excess or done:
                self.sent.discard(fd)
                os.close(fd)
            else:
                keep.append(entry)
        self.pending = keep


_OUTBOX: _Outbox | None = None
_OUTBOX_LOCK = threading.Lock()


def worker_buffers(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty tensors for the parts (columns) of one batch, all in one fresh memfd.

    One descriptor per batch, however many columns it has. The memfd ends with one
    acknowledgement byte per part, which the receiving process sets once it has
    mapped that part.

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
    ack_at = offset
    total = offset + len(parts)
    if all(nbytes == 0 for _, nbytes in layout):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    with _OUTBOX_LOCK:
        if _OUTBOX is None or _OUTBOX.pid != os.getpid():  # first batch of this process
            _OUTBOX = _Outbox()
        box = _OUTBOX
        box.reap()
        fd = os.memfd_create("shareddata-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            base = _map(f"/proc/self/fd/{fd}", total)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        refs: list[Any] = []
        box.pending.append((fd, ack_at, len(parts), refs))
    out: list[torch.Tensor] = []
    for k, ((shape, dtype), (start, nbytes)) in enumerate(zip(parts, layout)):
        if nbytes == 0:
            os.pwrite(fd, b"\x01", ack_at + k)  # nothing to receive
            out.append(torch.empty(shape, dtype=dtype))
            continue
        part = base[start : start + nbytes].view(dtype).view(shape).as_subclass(WorkerBatch)
        part._sd_handle = (box.pid, fd, (st.st_dev, st.st_ino), total, start, nbytes, ack_at + k)  # type: ignore[attr-defined]
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
    ack_at: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Unpickle one part in the receiving process: map the worker's memfd, acknowledge it."""
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
        base = _map(f"/proc/self/fd/{new_fd}", total)
    finally:
        os.close(new_fd)
    base.numpy()[ack_at] = 1
    return base[start : start + nbytes].view(dtype).view(shape)


def _map(path: str, nbytes: int) -> torch.Tensor:
    """``path`` mapped shared as a uint8 tensor, keeping no descriptor open.

    (``mmap.mmap`` keeps a duplicate of the descriptor for as long as the mapping
    lives: one per batch in flight, which runs into ``RLIMIT_NOFILE``.)
    """
    storage = torch.UntypedStorage.from_file(path, True, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
