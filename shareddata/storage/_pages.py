"""Shared pages allocated up front, by threads, optionally ahead of the writer."""

from __future__ import annotations

import errno
import os
import threading
import weakref
from typing import Any

import numpy as np

from ._capacity import FULL_ERRNOS, available_memory, fallocate, full_error
from ._linux import MADV_HUGEPAGE, MADV_POPULATE_WRITE, ForkSafeLock, madvise

__all__ = ["Population", "populate", "population_failed", "population_threads", "ready"]

# Note [Allocating shared pages]
# ==============================
# Allocating, zeroing and mapping fresh shared pages costs more than the copy
# (``docs/internals.md#allocating-pages``), so segments ask for huge pages
# (``MADV_HUGEPAGE``, a hint) and a RAM segment (memfd, tmpfs) is reserved by
# ``MADV_POPULATE_WRITE`` run by threads on disjoint 32 MiB steps (in parallel, where
# ``posix_fallocate`` runs on one core). ENOMEM/EFAULT is raised as
# SharedMemoryFullError before anything is written, never a SIGBUS. Disk files are
# ``posix_fallocate``-d; kernels < 5.14 fall back to it.

_POPULATE_STEP = 32 << 20
_POPULATE_MAX_THREADS = 8


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
    """``MADV_POPULATE_WRITE`` over the range by threads; 0 or the first errno.

    Every thread has stopped when this returns, even on KeyboardInterrupt.

    Example:
        >>> import mmap
        >>> from shareddata.storage._linux import address_of
        >>> m = mmap.mmap(-1, 64 << 20)
        >>> populate(address_of(m), len(m), threads=2)
        0
        >>> m.close()
    """
    threads = population_threads(nbytes) if threads is None else max(1, threads)
    steps = iter(range(0, nbytes, _POPULATE_STEP))
    lock = ForkSafeLock()
    errors: list[int] = []

    def work() -> None:
        while not errors:
            with lock:
                start = next(steps, None)
            if start is None:
                return
            length = min(_POPULATE_STEP, nbytes - start)
            error = madvise(address + start, length, MADV_POPULATE_WRITE)
            if error:
                errors.append(error)

    helpers = [threading.Thread(target=work, daemon=True) for _ in range(threads - 1)]
    for helper in helpers:
        helper.start()
    try:
        work()
    except BaseException:
        errors.append(errno.EINTR)  # the helpers stop at their next step
        raise
    finally:
        _join(helpers, lambda: errors.append(errno.EINTR))
    return errors[0] if errors else 0


def _join(threads: list[threading.Thread], interrupted: Any) -> None:
    """Join every thread (but this one), calling ``interrupted`` on an interrupt, raised last."""
    caught: BaseException | None = None
    for thread in threads:
        if thread is threading.current_thread():  # a collection ran in this thread
            continue
        while thread.is_alive():  # never return (or raise) with a thread running
            try:
                thread.join()
            except BaseException as e:
                interrupted()
                caught = e
    if caught is not None:
        raise caught


def population_failed(error: int, fd: int, size: int, directory: str | None, what: str) -> None:
    """Raise SharedMemoryFullError for a failed population, or fall back to fallocate."""
    if error in FULL_ERRNOS or error == errno.EFAULT:  # EFAULT: the fault hit SIGBUS
        raise full_error(size, available_memory(directory), directory, what)
    fallocate(fd, size, directory, what)  # MADV_POPULATE_WRITE unknown (Linux < 5.14)


# Note [Filling while the pages are allocated]
# ============================================
# ``Segment.create(ahead=True)`` returns once the file is sized; threads allocate its
# pages in address order (:class:`Population`) while the source copies into the first
# ones. A writer calls :func:`ready` for the range it is about to fill, so a page is
# written only once allocated and a failure is SharedMemoryFullError there, never a
# SIGBUS. The loader ends with ``finish_population`` or, on error,
# ``stop_population`` before ``discard``. Only RAM segments with twice their size
# free are filled this way; the others are reserved first.

_POPULATIONS: dict[int, Population] = {}  # by id; added and popped without a lock
_WAIT_STEP = 1.0  # seconds between checks that the population threads still run


class Population:
    """The pages of a new segment, allocated and mapped by threads in address order."""

    def __init__(self, segment: Any, directory: str | None, what: str) -> None:
        self.fd, self.size = segment.fd, segment.size
        self.base = segment.address
        self.directory, self.what = directory, what
        self.steps = -(-self.size // _POPULATE_STEP)
        self._done = [False] * self.steps
        self._ready = 0  # steps [0, _ready) are done
        self._next = 0
        self._error = 0
        self._stopped = False
        self._cond = threading.Condition(ForkSafeLock())  # type: ignore[arg-type]
        madvise(self.base, self.size, MADV_HUGEPAGE)
        _POPULATIONS[id(self)] = self
        # dropped without finish()/stop(): threads stop at their next step (no lock)
        self._finalizer = weakref.finalize(segment, _abandon, self)
        self._threads = [
            threading.Thread(target=self._work, name="shareddata-populate", daemon=True)
            for _ in range(population_threads(self.size))
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stopped or self._error or self._next >= self.steps:
                    return
                step = self._next
                self._next += 1
            error = self._populate(step)
            with self._cond:
                self._error = self._error or error
                self._advance(step)
                self._cond.notify_all()

    def _populate(self, step: int) -> int:
        start = step * _POPULATE_STEP
        length = min(_POPULATE_STEP, self.size - start)
        return madvise(self.base + start, length, MADV_POPULATE_WRITE)

    def _advance(self, step: int) -> None:
        self._done[step] = True
        while self._ready < self.steps and self._done[self._ready]:
            self._ready += 1

    def wait(self, end: int) -> None:
        """Return once bytes ``[0, end)`` are allocated (here if the threads ended)."""
        need = min(self.steps, -(-end // _POPULATE_STEP))
        with self._cond:
            while self._ready < need and not self._error:
                if not self._cond.wait(_WAIT_STEP) and not self._running():
                    break
            error = self._error
            missing = [s for s in range(need) if not self._done[s]] if not error else []
        for step in missing:
            error = self._populate(step)
            if error:
                break
            with self._cond:
                self._advance(step)
        if missing and error:
            with self._cond:
                self._error = self._error or error
        if error:
            self._stop_threads()
            with self._cond:
                if self._error:  # the first waiter handles it; an old kernel falls back
                    population_failed(error, self.fd, self.size, self.directory, self.what)
                    self._error, self._ready = 0, self.steps

    def _running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def finish(self) -> None:
        self.wait(self.size)
        self._stop_threads()
        self._unregister()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
        self._stop_threads()
        self._unregister()

    def _unregister(self) -> None:
        self._finalizer.detach()
        _POPULATIONS.pop(id(self), None)

    def _stop_threads(self) -> None:
        _join(self._threads, self._interrupted)

    def _interrupted(self) -> None:
        with self._cond:
            self._stopped = True


def _abandon(population: Population) -> None:
    population._stopped = True
    _POPULATIONS.pop(id(population), None)


def ready(array: np.ndarray, nbytes: int | None = None) -> None:
    """Wait until the pages under ``array`` (its first ``nbytes``) may be written.

    Example:
        >>> ready(np.zeros(4))  # private memory: nothing to wait for
    """
    if not _POPULATIONS:
        return
    start = array.__array_interface__["data"][0]
    end = start + (array.nbytes if nbytes is None else nbytes)
    for population in list(_POPULATIONS.values()):
        if population.base <= start < population.base + population.size:
            population.wait(end - population.base)
            return


def _forget_populations_in_child() -> None:
    _POPULATIONS.clear()  # their threads are the parent's


os.register_at_fork(after_in_child=_forget_populations_in_child)
