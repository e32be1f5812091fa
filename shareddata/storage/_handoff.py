"""Handing a segment to another process: the sender holds it until the receiver has it.

Note [Handing a segment over]
=============================
The receiver opens ``/proc/<pid>/fd/<fd>``, which works only while the sender holds
``fd`` (a pool worker may drop its result, or exit, first). So each ``multiprocessing``
pickle carries a ticket: a random slot of the sender's ticket board (one small memfd
per process, since a loaded dataset's file is sealed, Note [Sealed segments] in
``_segment.py``) and a random nonce. The receiver, once it holds the file, opens the
board via ``/proc`` (checked by device and inode) and ``pwrite``s the nonce into the
slot. A segment closed or dropped with tickets outstanding leaves its descriptor to
the :class:`Board` (descriptor only), which holds it until its nonces show up or
``HOLD`` passes; a reaper thread checks every ``POLL`` s. At exit a
``multiprocessing`` child waits up to ``EXIT_WAIT`` s (``$SHAREDDATA_HANDOFF_TIMEOUT``)
for the tickets of segments it created. The finalizer takes no lock: it queues the
descriptor for the reaper (Note [One lock rule] in ``_linux.py``). A fork child gets
a board of its own and closes the parent's held descriptors (``_segment.py``'s
at-fork hook).

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

SLOTS = 4096  # 8-byte slots of the ticket board (sparse)
HOLD = 300.0  # seconds a dropped segment is held for a receiver that has not come
EXIT_WAIT = 10.0  # seconds a multiprocessing child waits at exit for its receivers
_EXIT_WAIT_ENV = "SHAREDDATA_HANDOFF_TIMEOUT"
POLL = 0.05
IDLE_POLL = 1.0


@dataclass
class _Sent:
    created: bool  # this process created the segment: wait for its receivers at exit
    dropped: bool = False  # its Segment is gone: the descriptor is the board's to close
    pending: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # slot: nonce, deadline


class Board:
    """This process's ticket board, and the descriptors it holds for receivers.

    Example:
        >>> fd = os.memfd_create("t"); os.ftruncate(fd, 10)
        >>> drawn = BOARD.ticket(fd, created=True)
        >>> BOARD.outstanding(fd)
        1
        >>> acknowledge(os.getpid(), drawn); BOARD.outstanding(fd)
        0
        >>> release(fd)  # no ticket left: closed at once
    """

    def __init__(self) -> None:
        self.fd = os.memfd_create("sd-handoff-tickets", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 8 * SLOTS)
        self.identity = file_identity(self.fd)
        self.sent: dict[int, _Sent] = {}  # by descriptor, while tickets are outstanding
        self.dropped: collections.deque[int] = collections.deque()  # queued by finalizers
        self.taken: set[int] = set()  # slots with a ticket outstanding
        self.lock = ForkSafeLock()
        self.reaping = False

    def ticket(self, fd: int, created: bool) -> tuple[int, ...]:
        """``(board, dev, ino, slot, nonce)`` for a pickle of ``fd``; ``()`` if no slot is free."""
        nonce = secrets.randbits(63) | 1
        with self.lock:
            if len(self.taken) >= SLOTS:  # forget the expired tickets first
                self._reap(time.monotonic())
                if len(self.taken) >= SLOTS:
                    return ()
            sent = self.sent.get(fd) or self.sent.setdefault(fd, _Sent(created))
            slot = secrets.randbelow(SLOTS)
            while slot in self.taken:  # never overwrite a ticket still outstanding
                slot = secrets.randbelow(SLOTS)
            self.taken.add(slot)
            sent.pending[slot] = (nonce.to_bytes(8, "little"), time.monotonic() + HOLD)
            start, self.reaping = not self.reaping, True
        if start:
            threading.Thread(target=self._reaper, name="shareddata-handoff", daemon=True).start()
            import multiprocessing.util

            if multiprocessing.parent_process() is not None:  # after Queue feeders (-5)
                multiprocessing.util.Finalize(None, self._wait_at_exit, exitpriority=-100)
        return (self.fd, *self.identity, slot, nonce)

    def release(self, fd: int) -> None:
        """Close ``fd``, or queue it for the reaper if tickets are out (lock-free: a finalizer)."""
        if fd in self.sent:
            self.dropped.append(fd)
        else:
            close_fd(fd)

    def forget(self, fd: int) -> None:
        """Drop the tickets of ``fd`` (freed on purpose); the caller closes it."""
        with self.lock:
            sent = self.sent.pop(fd, None)
            self.taken.difference_update(sent.pending if sent else ())

    def outstanding(self, fd: int) -> int:
        """Tickets of ``fd`` not yet acknowledged (checked now)."""
        with self.lock:
            self._take_dropped()
            if fd in self.sent:
                self._reap_one(fd, self.sent[fd], time.monotonic())
            return len(self.sent[fd].pending) if fd in self.sent else 0

    def held(self) -> int:
        """Descriptors held only for receivers that have not come yet."""
        with self.lock:
            self._take_dropped()
            return sum(sent.dropped for sent in self.sent.values())

    def reap(self, created_only: bool = False) -> int:
        """Forget acknowledged and expired tickets, close what is done; how many are still out."""
        with self.lock:
            self._take_dropped()
            return self._reap(time.monotonic(), created_only)

    def _reap(self, now: float, created_only: bool = False) -> int:
        left = 0
        for fd, sent in list(self.sent.items()):
            self._reap_one(fd, sent, now)
            if fd in self.sent and (sent.created or not created_only):
                left += len(sent.pending)
        return left

    def _take_dropped(self) -> None:
        while self.dropped:
            fd = self.dropped.popleft()
            if fd in self.sent:
                self.sent[fd].dropped = True
            else:  # its tickets were all acknowledged meanwhile
                close_fd(fd)

    def _reap_one(self, fd: int, sent: _Sent, now: float) -> None:
        for slot, (nonce, deadline) in list(sent.pending.items()):
            try:
                seen = os.pread(self.fd, 8, 8 * slot)
            except OSError:
                seen = nonce  # the board is unusable: nothing left to hold
            if seen == nonce or now > deadline:
                del sent.pending[slot]
                self.taken.discard(slot)
        if not sent.pending:
            del self.sent[fd]
            if sent.dropped:
                close_fd(fd)

    def _reaper(self) -> None:
        while BOARD is self:  # a fork child has a board of its own (and not this thread)
            time.sleep(POLL if self.sent or self.dropped else IDLE_POLL)
            self.reap()

    def _wait_at_exit(self) -> None:
        try:
            wait = float(os.environ.get(_EXIT_WAIT_ENV) or EXIT_WAIT)
        except ValueError:
            wait = EXIT_WAIT
        deadline = time.monotonic() + wait
        while self.reap(created_only=True) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close_in_child(self) -> None:
        """In a fork child: close the parent's board and the descriptors it held."""
        for fd in [fd for fd, sent in self.sent.items() if sent.dropped] + list(self.dropped):
            close_fd(fd)
        close_fd(self.fd)
        self.sent.clear()  # inert: its exit wait, if it runs here, finds nothing
        self.dropped.clear()


BOARD = Board()  # made now, so the descriptor count stays flat once running


def release(fd: int) -> None:
    """A Segment's finalizer: :meth:`Board.release` on this process's board."""
    BOARD.release(fd)


def renew_in_child() -> None:
    """A fork child's board of its own (called by ``_segment.py``'s at-fork hook)."""
    global BOARD
    BOARD.close_in_child()
    BOARD = Board()


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
