"""Handing a segment to another process: the sender holds it until the receiver has it.

Note [Handing a segment over]
=============================
A segment pickles as ``(pid, fd, ...)`` and the receiver opens ``/proc/<pid>/fd/<fd>``,
which works only while the sender still holds ``fd``. A pool worker drops its result
once it is sent, or exits (``maxtasksperchild=1``), before the parent's result thread
has unpickled it. So each pickle that ``multiprocessing`` makes carries a *ticket*: a
random slot among the ``SLOTS`` 8-byte slots of the sender's *ticket board* and a
random nonce. The board is one small memfd per process (sparse, not a segment: a
loaded dataset's own file is sealed against every write, Note [Sealed segments] in
``_segment.py``). The receiver, once it holds the file (its own descriptor, or a
mapping already there), opens the board as ``/proc/<pid>/fd/<board>``, checks it is the
same file (device and inode), and writes the nonce into the slot (``pwrite``). The
sender does not close a descriptor with a ticket outstanding: a dropped segment is
*held* (descriptor only, no mapping, so in nobody's PSS) until its nonces show up or
``HOLD`` seconds pass; a daemon thread checks every ``POLL`` seconds. At exit a
``multiprocessing`` child waits up to ``EXIT_WAIT`` seconds (``$SHAREDDATA_HANDOFF_TIMEOUT``)
for the tickets of the segments it created (``multiprocessing.util.Finalize``: pool
children end with ``os._exit`` after running those).

The Segment's finalizer only closes a descriptor that has no ticket, or queues it
for the reaper thread (Note [One lock rule] in ``_linux.py``); the reaper, once a
ticket was drawn, runs for the life of the process (every ``POLL`` seconds while
tickets are outstanding, every ``IDLE_POLL`` seconds otherwise). A slot is never
drawn while another ticket of the process still waits on it.

Limits: only ``multiprocessing``'s pickler draws tickets (queues, pipes, pools, process
arguments, torch's and the DataLoader's): after a plain ``pickle.dumps`` the sender
must keep the array alive. A ticket covers the first receiver of one pickle. A
receiver that may not open the sender's board (``hidepid``) cannot acknowledge (the
sender holds the file until ``HOLD``). A SIGKILLed sender holds nothing: its receiver
gets :class:`~shareddata.AttachError` when it first uses the array (unpickling itself
never raises).
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

SLOTS = 4096
"""Slots of a process's ticket board (8 bytes each; sparse): its outstanding tickets."""
HOLD = 300.0
"""Seconds a live process holds a dropped segment for a receiver that has not come."""
EXIT_WAIT = 10.0
"""Seconds a ``multiprocessing`` child waits at exit for its receivers (default of
``$SHAREDDATA_HANDOFF_TIMEOUT``)."""
_EXIT_WAIT_ENV = "SHAREDDATA_HANDOFF_TIMEOUT"
POLL = 0.05
IDLE_POLL = 1.0


@dataclass
class _Sent:
    """The outstanding tickets of one descriptor of this process."""

    created: bool  # this process created the segment: wait for its receivers at exit
    dropped: bool = False  # the Segment is gone: the descriptor is ours to close
    pending: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # slot: nonce, deadline


_SENT: dict[int, _Sent] = {}
_DROPPED: collections.deque[int] = collections.deque()  # queued by finalizers, for the reaper
_TAKEN: set[int] = set()  # slots of the board with a ticket outstanding
_LOCK = ForkSafeLock()
_STATE = {"reaper": 0, "exit_hook": 0}  # pid that started the reaper / registered the hook
_BOARD = {"pid": 0, "fd": -1, "dev": 0, "ino": 0}  # this process's ticket board


def _board() -> int:
    """This process's ticket board (made once per process); the caller holds ``_LOCK``."""
    if _BOARD["pid"] != os.getpid():
        fd = os.memfd_create("sd-handoff-tickets", os.MFD_CLOEXEC)
        os.ftruncate(fd, 8 * SLOTS)
        dev, ino = file_identity(fd)
        _BOARD.update(pid=os.getpid(), fd=fd, dev=dev, ino=ino)
    return _BOARD["fd"]


def ticket(fd: int, created: bool) -> tuple[int, ...]:
    """A new ticket for one pickle of the segment held as ``fd``: what the receiver needs.

    ``(board, board_dev, board_ino, slot, nonce)``, or ``()`` when every slot is taken
    (the receiver must then come while the segment is alive).

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
        _start_reaper()
    _register_exit_hook()
    return (board, _BOARD["dev"], _BOARD["ino"], slot, nonce)


def acknowledge(pid: int, drawn: tuple[int, ...]) -> None:
    """Receiver: tell process ``pid``, which drew ticket ``drawn``, that the file is held here.

    Where its board cannot be opened (the sender is gone, or its ``/proc`` entry is
    closed to us), the sender holds the file until its ``HOLD`` expires.
    """
    if not drawn:
        return
    board, dev, ino, slot, nonce = drawn
    try:
        fd = os.open(f"/proc/{pid}/fd/{board}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:  # the descriptor may have been closed and its number reused: check the file
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
    """The segment of ``fd`` is gone from this process: close ``fd``, or hold it for receivers.

    The Segment's finalizer: it takes no lock (Note [One lock rule] in ``_linux.py``).
    A descriptor with tickets is queued for the reaper, which started with the first
    ticket and closes it once its receivers hold the file.
    """
    if fd in _SENT:  # (atomic under the GIL; no new ticket is drawn for a dropped segment)
        _DROPPED.append(fd)
    else:
        close_fd(fd)


def forget(fd: int) -> None:
    """Drop the tickets of ``fd`` (a segment freed on purpose); the caller closes it."""
    with _LOCK:
        sent = _SENT.pop(fd, None)
        _TAKEN.difference_update(sent.pending if sent else ())


def held() -> int:
    """Descriptors this process holds only for receivers that have not come yet."""
    with _LOCK:
        _take_dropped()
        return sum(1 for sent in _SENT.values() if sent.dropped)


def _take_dropped() -> None:
    """Mark the descriptors that finalizers queued as dropped; the caller holds ``_LOCK``."""
    while _DROPPED:
        fd = _DROPPED.popleft()
        sent = _SENT.get(fd)
        if sent is None:  # its tickets were all acknowledged meanwhile
            close_fd(fd)
        else:
            sent.dropped = True


def _reap_one(fd: int, sent: _Sent, now: float) -> None:
    """Forget the acknowledged and expired tickets of ``fd``; close it if dropped and done."""
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
    """Reap every descriptor; how many tickets are still outstanding (of created segments)."""
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
    while _STATE["reaper"] == pid:
        time.sleep(POLL if _SENT or _DROPPED else IDLE_POLL)
        _reap()


def _start_reaper() -> None:
    """Start the reaper thread of this process, once; the caller holds ``_LOCK``."""
    if _STATE["reaper"] != os.getpid():
        _STATE["reaper"] = os.getpid()
        threading.Thread(target=_reaper, name="shareddata-handoff", daemon=True).start()


def _wait_at_exit() -> None:
    """Wait (bounded) until the receivers of this process's segments hold them."""
    try:
        wait = float(os.environ.get(_EXIT_WAIT_ENV) or EXIT_WAIT)
    except ValueError:
        wait = EXIT_WAIT
    deadline = time.monotonic() + wait
    while _reap(created_only=True) and time.monotonic() < deadline:
        time.sleep(0.01)


def _register_exit_hook() -> None:
    if _STATE["exit_hook"] == os.getpid():
        return
    _STATE["exit_hook"] = os.getpid()
    import multiprocessing
    import multiprocessing.util

    if multiprocessing.parent_process() is not None:  # a child: its parent may still attach
        # after a Queue's feeder thread has flushed (those run at priority -5)
        multiprocessing.util.Finalize(None, _wait_at_exit, exitpriority=-100)


def _after_fork_in_child() -> None:
    for fd, sent in list(_SENT.items()):
        if sent.dropped or fd in _DROPPED:  # the parent's held descriptor: not ours to keep
            close_fd(fd)
    _SENT.clear()
    _DROPPED.clear()
    _TAKEN.clear()
    _STATE["reaper"] = _STATE["exit_hook"] = 0
    close_fd(_BOARD["fd"])  # the parent's board: this child draws tickets on its own
    _BOARD.update(pid=0, fd=-1)


os.register_at_fork(after_in_child=_after_fork_in_child)
with _LOCK:  # made now, so that a process's descriptor count stays flat once it runs
    _board()
