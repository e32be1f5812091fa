"""Handing a segment to another process: the sender holds it until the receiver has it.

Note [Handing a segment over]
=============================
The receiver opens ``/proc/<pid>/fd/<fd>``, which works only while the sender holds
``fd`` (a pool worker may drop its result, or exit, first). So each ``multiprocessing``
pickle carries a ticket: a random slot of the sender's *ticket board* (one small memfd
per process, since a loaded dataset's file is sealed, Note [Sealed segments] in
``_segment.py``) and a random nonce. The receiver, once it holds the file, opens the
board via ``/proc`` (checked by device and inode) and ``pwrite``s the nonce into the
slot. A dropped segment with tickets outstanding is held (descriptor only) until its
nonces show up or ``HOLD`` passes; a reaper thread checks every ``POLL`` s. At exit a
``multiprocessing`` child waits up to ``EXIT_WAIT`` s (``$SHAREDDATA_HANDOFF_TIMEOUT``)
for the tickets of segments it created. The finalizer takes no lock: it queues the
descriptor for the reaper (Note [One lock rule] in ``_linux.py``).

Limits: a plain ``pickle.dumps`` draws no ticket; a ticket covers one receiver; a
receiver barred from the board (``hidepid``) cannot acknowledge; a SIGKILLed sender
holds nothing (the receiver gets :class:`~shareddata.AttachError` on first use).
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from ._linux import ForkSafeLock, close_fd, file_identity

__all__ = [
    "EXIT_WAIT",
    "HOLD",
    "SLOTS",
    "acknowledge",
    "forget",
    "held",
    "outstanding",
    "release",
    "ticket",
]

SLOTS = 4096  # 8-byte slots of the ticket board (sparse)
HOLD = 300.0  # seconds a dropped segment is held for a receiver that has not come
EXIT_WAIT = 10.0  # seconds a multiprocessing child waits at exit for its receivers
_EXIT_WAIT_ENV = "SHAREDDATA_HANDOFF_TIMEOUT"
POLL = 0.05
IDLE_POLL = 1.0


@dataclass
class _Sent:
    created: bool  # this process created the segment: wait for its receivers at exit
    dropped: bool = False  # the Segment is gone: the descriptor is ours to close
    pending: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # slot: nonce, deadline


_SENT: dict[int, _Sent] = {}
_DROPPED: collections.deque[int] = collections.deque()  # queued by finalizers, for the reaper
_TAKEN: set[int] = set()  # slots of the board with a ticket outstanding
_LOCK = ForkSafeLock()
_STATE = {"pid": 0}  # the process whose reaper runs and whose exit hook is set
_BOARD = {"pid": 0, "fd": -1, "dev": 0, "ino": 0}  # this process's ticket board


def _board() -> int:
    """This process's ticket board; the caller holds ``_LOCK``."""
    if _BOARD["pid"] != os.getpid():
        fd = os.memfd_create("sd-handoff-tickets", os.MFD_CLOEXEC)
        os.ftruncate(fd, 8 * SLOTS)
        dev, ino = file_identity(fd)
        _BOARD.update(pid=os.getpid(), fd=fd, dev=dev, ino=ino)
    return _BOARD["fd"]


def ticket(fd: int, created: bool) -> tuple[int, ...]:
    """``(board, dev, ino, slot, nonce)`` for one pickle of ``fd``; ``()`` if all slots are taken.

    Example:
        >>> fd = os.memfd_create("t"); os.ftruncate(fd, 10)
        >>> drawn = ticket(fd, created=True)
        >>> outstanding(fd)
        1
        >>> acknowledge(os.getpid(), drawn); outstanding(fd)
        0
        >>> release(fd)  # no ticket left: closed at once
    """
    nonce = secrets.randbits(63) | 1
    with _LOCK:
        board = _board()
        if len(_TAKEN) >= SLOTS:  # tickets nobody redeemed yet: forget the expired ones
            now = time.monotonic()
            for held_fd, sent in list(_SENT.items()):
                _reap_one(held_fd, sent, now)
            if len(_TAKEN) >= SLOTS:
                return ()
        found = _SENT.get(fd)
        sent = found if found is not None else _SENT.setdefault(fd, _Sent(created))
        slot = secrets.randbelow(SLOTS)
        while slot in _TAKEN:  # never overwrite a ticket still outstanding
            slot = secrets.randbelow(SLOTS)
        _TAKEN.add(slot)
        sent.pending[slot] = (nonce.to_bytes(8, "little"), time.monotonic() + HOLD)
        started = _STATE["pid"] != os.getpid()
        if started:
            _STATE["pid"] = os.getpid()
            threading.Thread(target=_reaper, name="shareddata-handoff", daemon=True).start()
    if started:
        _register_exit_hook()
    return (board, _BOARD["dev"], _BOARD["ino"], slot, nonce)


def acknowledge(pid: int, drawn: tuple[int, ...]) -> None:
    """Receiver: write the nonce of ``drawn`` on ``pid``'s board (else it holds until ``HOLD``)."""
    if not drawn:
        return
    board, dev, ino, slot, nonce = drawn
    try:
        fd = os.open(f"/proc/{pid}/fd/{board}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if file_identity(fd) == (dev, ino):
            os.pwrite(fd, nonce.to_bytes(8, "little"), 8 * slot)
    except OSError:
        pass
    finally:
        os.close(fd)


def outstanding(fd: int) -> int:
    """Tickets of ``fd`` not yet acknowledged (checked now)."""
    with _LOCK:
        _take_dropped()
        sent = _SENT.get(fd)
        if sent is None:
            return 0
        _reap_one(fd, sent, time.monotonic())
        sent = _SENT.get(fd)
        return 0 if sent is None else len(sent.pending)


def release(fd: int) -> None:
    """The Segment's finalizer, lock-free: close ``fd``, or queue it for the reaper."""
    if fd in _SENT:
        _DROPPED.append(fd)
    else:
        close_fd(fd)


def forget(fd: int) -> None:
    """Drop the tickets of ``fd`` (freed on purpose); the caller closes it."""
    with _LOCK:
        sent = _SENT.pop(fd, None)
        _TAKEN.difference_update(sent.pending if sent else ())


def held() -> int:
    """Descriptors this process holds only for receivers that have not come yet."""
    with _LOCK:
        _take_dropped()
        return sum(1 for sent in _SENT.values() if sent.dropped)


def _take_dropped() -> None:
    while _DROPPED:
        fd = _DROPPED.popleft()
        sent = _SENT.get(fd)
        if sent is None:  # its tickets were all acknowledged meanwhile
            close_fd(fd)
        else:
            sent.dropped = True


def _reap_one(fd: int, sent: _Sent, now: float) -> None:
    for slot, (nonce, deadline) in list(sent.pending.items()):
        try:
            seen = os.pread(_BOARD["fd"], 8, 8 * slot)
        except OSError:
            seen = nonce  # the board is unusable: nothing left to hold
        if seen == nonce or now > deadline:
            del sent.pending[slot]
            _TAKEN.discard(slot)
    if not sent.pending:
        del _SENT[fd]
        if sent.dropped:
            close_fd(fd)


def _reap(created_only: bool = False) -> int:
    """Reap every descriptor; the tickets still outstanding."""
    now, left = time.monotonic(), 0
    with _LOCK:
        _take_dropped()
        for fd, sent in list(_SENT.items()):
            _reap_one(fd, sent, now)
            if fd in _SENT and (sent.created or not created_only):
                left += len(sent.pending)
    return left


def _reaper() -> None:
    pid = os.getpid()
    while _STATE["pid"] == pid:
        time.sleep(POLL if _SENT or _DROPPED else IDLE_POLL)
        _reap()


def _wait_at_exit() -> None:
    try:
        wait = float(os.environ.get(_EXIT_WAIT_ENV) or EXIT_WAIT)
    except ValueError:
        wait = EXIT_WAIT
    deadline = time.monotonic() + wait
    while _reap(created_only=True) and time.monotonic() < deadline:
        time.sleep(0.01)


def _register_exit_hook() -> None:
    import multiprocessing
    import multiprocessing.util

    if multiprocessing.parent_process() is not None:  # after Queue feeders (priority -5)
        multiprocessing.util.Finalize(None, _wait_at_exit, exitpriority=-100)


def _after_fork_in_child() -> None:
    for fd, sent in list(_SENT.items()):
        if sent.dropped or fd in _DROPPED:
            close_fd(fd)
    _SENT.clear()
    _DROPPED.clear()
    _TAKEN.clear()
    _STATE["pid"] = 0
    close_fd(_BOARD["fd"])
    _BOARD.update(pid=0, fd=-1)


os.register_at_fork(after_in_child=_after_fork_in_child)
with _LOCK:  # now, so the descriptor count stays flat once running
    _board()
