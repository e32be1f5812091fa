"""Threads that allocate and map the pages of a shared range, in address order.

Note [Allocating shared pages]
==============================
Allocating, zeroing and mapping fresh shared pages costs more than the copy
(``docs/internals.md#allocating-pages``), so a RAM segment asks for huge pages
(``MADV_HUGEPAGE``, a hint) and is populated by ``MADV_POPULATE_WRITE`` run by threads
on disjoint 32 MiB steps (in parallel, where ``posix_fallocate`` runs on one core).
A step that fails returns its errno (ENOMEM/EFAULT: no room), which the segment
raises as SharedMemoryFullError before anything is written, never a SIGBUS; Linux
< 5.14 (EINVAL) falls back to ``posix_fallocate``. This module holds no state: the
:class:`Population` belongs to its segment, and a fork child (where the threads do
not exist) allocates what is missing itself.

Note [Filling while the pages are allocated]
============================================
``Segment.create(ahead=True)`` returns once the file is sized; the first ``ready``
starts its :class:`Population`, which allocates the pages in address order while the
source copies into the first ones. A writer calls ``ready`` for the range it is about
to fill, so a page is written only once allocated and a failure is
SharedMemoryFullError there, never a SIGBUS. A file copied by ``Segment.copy_file``
(``sendfile``) needs no population: the kernel allocates as it writes, and a full
memory is its ``ENOSPC``. The loader ends with ``finish_population`` or, on error,
``discard`` (which stops the threads first). Only RAM segments with twice their size
free are filled this way; the others are populated before ``create`` returns.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ._linux import MADV_POPULATE_WRITE, ForkSafeLock, madvise

_POPULATE_STEP = 32 << 20
_POPULATE_MAX_THREADS = 8
_WAIT_STEP = 1.0  # seconds per bounded wait for the threads


def population_threads(nbytes: int) -> int:
    """Threads to populate ``nbytes``: one per usable core, 32 MiB each at least.

    Example:
        >>> population_threads(1 << 20)
        1
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _POPULATE_MAX_THREADS, nbytes // _POPULATE_STEP))


def populate(address: int, nbytes: int, threads: int | None = None) -> int:
    """Populate the range by threads and wait; 0 or the first errno, every thread ended.

    Example:
        >>> import mmap
        >>> from shareddata.storage._linux import address_of
        >>> m = mmap.mmap(-1, 64 << 20)
        >>> populate(address_of(m), len(m), threads=2)
        0
        >>> m.close()
    """
    return Population(address, nbytes, threads).finish()


class Population:
    """The pages of ``[address, address + size)``, populated by threads in address order.

    ``failed(errno)`` is called once, by the first waiter to see a failed step, after
    the threads ended: it raises, or falls back and the range counts as done.
    """

    def __init__(
        self,
        address: int,
        size: int,
        threads: int | None = None,
        failed: Callable[[int], None] | None = None,
    ) -> None:
        self.address, self.size, self.failed = address, size, failed
        self.steps = -(-size // _POPULATE_STEP)
        self.stopped = False  # set without the lock (a finalizer): read at each step
        self._done = [False] * self.steps
        self._ready = self._next = self._error = 0  # steps [0, _ready) are done
        self._cond = threading.Condition(ForkSafeLock())  # type: ignore[arg-type]
        count = population_threads(size) if threads is None else max(1, threads)
        self._threads = [
            threading.Thread(target=self._work, name="shareddata-populate", daemon=True)
            for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if self.stopped or self._error or self._next >= self.steps:
                    return
                step, self._next = self._next, self._next + 1
            error = self._populate(step)
            with self._cond:
                self._error = self._error or error
                self._advance(step)
                self._cond.notify_all()

    def _populate(self, step: int) -> int:
        start = step * _POPULATE_STEP
        return madvise(
            self.address + start, min(_POPULATE_STEP, self.size - start), MADV_POPULATE_WRITE
        )

    def _advance(self, step: int) -> None:
        self._done[step] = True
        while self._ready < self.steps and self._done[self._ready]:
            self._ready += 1

    def wait(self, end: int) -> int:
        """Return once bytes ``[0, end)`` are populated (here if the threads ended): 0 or errno."""
        need = min(self.steps, -(-end // _POPULATE_STEP))
        with self._cond:
            while self._ready < need and not self._error and self._running():
                self._cond.wait(_WAIT_STEP)
            error = self._error
            done = error or self._ready >= need
            missing = [] if done else [s for s in range(need) if not self._done[s]]
        for step in missing:
            error = self._populate(step)
            with self._cond:
                if error:
                    self._error = self._error or error
                    break
                self._advance(step)
        if not error:
            return 0
        self.stop()
        with self._cond:
            error = self._error
            if error and self.failed is not None:
                self.failed(error)  # raises, or fell back: the range is done
                self._error = error = 0
                self._ready = self.steps
        return error

    def _running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def finish(self) -> int:
        """Wait for the whole range, then for the threads: 0 or the errno."""
        try:
            return self.wait(self.size)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop at the next step and join every thread (never return with one running)."""
        self.stopped = True
        caught: BaseException | None = None
        for thread in self._threads:
            while thread is not threading.current_thread() and thread.is_alive():
                try:
                    thread.join()
                except BaseException as e:  # re-raised once every thread has ended
                    caught = e
        if caught is not None:
            raise caught
