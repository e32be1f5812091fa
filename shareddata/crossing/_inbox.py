"""How the main process receives a worker's batch: it maps the worker's memfd.

Note [Releasing a received batch]
---------------------------------
A received batch is a storage over this process's mapping of the worker's memfd
(Note [How a batch leaves a worker] in ``_outbox.py``). Mapping it counts the batch
*received* at once. When nothing holds any part of it any more (no tensor, view or
numpy array), a weak reference's callback on the array under the storage queues
its *release*: the release adds one to the memfd's released counter, which lets the
worker reuse the memfd (Note [Reusing a batch's pages]), and keeps the mapping
*idle* (at most ``IDLE_BYTES`` of them, the oldest unmapped first): when the worker
sends a batch in the same memfd again, receiving it costs no system call at all,
where opening, mapping and unmapping cost ~140 us of the main process's time per
batch on a 2-core VM (``munmap`` alone ~100 us: it flushes the TLBs of the other
CPUs). Idle mappings never hold a live batch (the worker may overwrite their
pages), and they keep a closed memfd's pages for at most ``IDLE_BYTES``.

The callback only queues (it may run inside any code of this process, whatever lock
that code holds, when a garbage collection frees the batch): queued releases are
carried out by the next :func:`receive`, or by :func:`release_queued`, under the
inbox's lock. A fork child of the receiver inherits the mappings; it unmaps the idle
ones at once and never counts a release (the batch is its parent's).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import resource
import weakref
from typing import Any

import numpy as np
import torch

from ..errors import AttachError, TooManyOpenFilesError
from ..storage._capacity import named_os_errors
from ..storage._linux import ForkSafeLock, array_at, file_identity, map_fd, unmap

__all__ = ["IDLE_BYTES", "MAX_UNRECEIVED", "receive", "release_queued"]

MAX_UNRECEIVED = max(256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
"""Batches not yet received that a worker keeps open (bounds its descriptors)."""
IDLE_BYTES = 4 << 20
"""Bytes of released batch mappings a receiver keeps, to receive their memfds again."""
UNRECEIVED_HINT = "Receive batches as they come, or lower prefetch_factor."

_LOCK = ForkSafeLock()
_PID = os.getpid()
# (pid, fd, device, inode) of a worker's memfd -> (address, length, array) of our idle
# mapping; oldest first. A live inode is never renumbered, so a key names one file.
_IDLE: dict[tuple[int, ...], tuple[int, int, np.ndarray]] = {}
_idle_bytes = 0
# id of a weak reference to a received storage's array -> (the reference, the pid that
# received it, key, address, length, counter_at, the whole mapping's array)
_LIVE: dict[int, tuple[Any, ...]] = {}
_QUEUED: collections.deque[int] = collections.deque()  # ids of references whose arrays died


def receive(
    pid: int,
    fd: int,
    device: int,
    inode: int,
    total: int,
    counter_at: int,
    start: int,
    nbytes: int,
) -> torch.UntypedStorage:
    """Unpickle a storage of a worker's batch: map the worker's memfd (or reuse our mapping).

    The batch counts received at once; it is released once nothing holds the storage
    (Note [Releasing a received batch]).
    """
    key = (pid, fd, device, inode)
    with _LOCK:
        _release_queued()
        idle = _IDLE.pop(key, None)
        if idle is not None:
            _forget_idle(idle)
    if idle is not None and idle[1] >= total:  # mapped here before: no system call
        address, length, mapped = idle
    else:
        if idle is not None:
            unmap(idle[0], idle[1])
        address, length = _map_batch(pid, fd, (device, inode), total), total
        mapped = array_at(address, length)
    # mapped: the worker may close its descriptor now
    received = ctypes.c_uint32.from_address(address + counter_at + 4)
    with _LOCK:
        received.value += 1
    view = mapped[start : start + nbytes]
    ref = weakref.ref(view, _queue_release)  # the storage below alone holds ``view``
    _LIVE[id(ref)] = (ref, _PID, key, address, length, counter_at, mapped)
    return torch.from_numpy(view).untyped_storage()


def _queue_release(ref: Any) -> None:
    """A received storage is gone: queue its release (Note [Releasing a received batch]).

    In a fork child of the receiver (the batch is its parent's) the inherited mapping
    is only unmapped, at once: a system call, no lock.
    """
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
        _, _, key, address, length, counter_at, mapped = live
        ctypes.c_uint32.from_address(address + counter_at).value += 1
        if key not in _IDLE and length <= IDLE_BYTES:
            _IDLE[key] = (address, length, mapped)
            _idle_bytes += length
            while _idle_bytes > IDLE_BYTES:
                oldest = _IDLE.pop(next(iter(_IDLE)))
                _forget_idle(oldest)
                unmaps.append((oldest[0], oldest[1]))
        else:
            unmaps.append((address, length))
    for mapping in unmaps:  # (unmapping with the lock held is safe: it takes no other lock)
        unmap(mapping[0], mapping[1])


def _forget_idle(idle: tuple[int, int, np.ndarray]) -> None:
    global _idle_bytes
    _idle_bytes -= idle[1]


def _map_batch(pid: int, fd: int, ident: tuple[int, int], total: int) -> int:
    """Map ``total`` bytes of the memfd ``fd`` of process ``pid``; its address."""
    path = f"/proc/{pid}/fd/{fd}"
    what = f"a batch from DataLoader worker {pid}"
    try:
        with named_os_errors(what):
            new_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except TooManyOpenFilesError:
        raise
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
                f"were not received and closed the oldest. {UNRECEIVED_HINT}"
            )
        with named_os_errors(what, total):
            return map_fd(new_fd, total)
    finally:
        os.close(new_fd)


def _after_fork_in_child() -> None:
    global _PID, _idle_bytes
    _PID = os.getpid()
    _QUEUED.clear()  # the parent's received batches are not this process's to release
    # nor its idle mappings: unmapping them here lets their files go when the parent
    # and the worker let go of them
    for idle in _IDLE.values():
        unmap(idle[0], idle[1])
    _IDLE.clear()
    _idle_bytes = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
# at exit nothing is released: the process's mappings go with it
atexit.register(_LIVE.clear)
