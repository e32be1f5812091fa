"""Shared pages allocated up front, by threads, optionally ahead of the writer.

Note [Allocating shared pages] says why and how every page of a RAM segment is
allocated before anything is written; Note [Filling while the pages are allocated]
says how a loader writes into the first pages while threads still allocate the rest
(:class:`Population`, :func:`ready`).
"""

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
# Filling fresh shared memory costs more than the copy itself: the kernel allocates,
# zeroes and maps each 4 KiB page (``docs/internals.md#allocating-pages``;
# ``benchmarks/harness/topics/limits.py`` measures it). Private numpy arrays fault 2 MiB
# transparent huge pages instead; shared memory gets them only where
# ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (memfd) or the tmpfs mount's
# ``huge=`` option allows, so each segment asks for them (``MADV_HUGEPAGE``:
# honoured under ``advise``, a no-op under ``never``).
#
# A segment in RAM (a memfd, or a file on tmpfs) is therefore reserved by
# ``MADV_POPULATE_WRITE`` alone, run by several threads on disjoint ranges (ctypes
# releases the GIL): faults allocate in parallel, where ``posix_fallocate`` holds
# the file's lock for the whole call and runs on one core. A page that cannot be
# allocated makes the call fail with ENOMEM/EFAULT, which is raised as
# SharedMemoryFullError before anything is written: never a SIGBUS later. Disk
# files keep ``posix_fallocate`` (it reserves their blocks), then are populated the
# same way. Kernels without ``MADV_POPULATE_WRITE`` (< 5.14) fall back to
# ``posix_fallocate``, and pages map in on first write.

_POPULATE_STEP = 32 << 20
"""Bytes per ``madvise`` call; each thread takes the next step until none is left."""
_POPULATE_MAX_THREADS = 8


def population_threads(nbytes: int) -> int:
    """How many threads populate ``nbytes``: one per usable core, 32 MiB each at least.

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
    """``MADV_POPULATE_WRITE`` over ``[address, address + nbytes)`` in parallel.

    Args:
        address: page-aligned start of a writable mapping.
        nbytes: its length.
        threads: how many threads (default :func:`population_threads`); the calling
            thread is one of them.

    Returns:
        0, or the first errno seen (EINVAL: the kernel does not know the advice).
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
        interrupted: BaseException | None = None
        for helper in helpers:
            while helper.is_alive():  # never return (or raise) with a helper running
                try:
                    helper.join()
                except BaseException as e:
                    errors.append(errno.EINTR)
                    interrupted = e
        if interrupted is not None:
            raise interrupted
    return errors[0] if errors else 0


def population_failed(error: int, fd: int, size: int, directory: str | None, what: str) -> None:
    """Raise SharedMemoryFullError for a failed population, or fall back to fallocate."""
    if error in FULL_ERRNOS or error == errno.EFAULT:  # EFAULT: the fault hit SIGBUS
        raise full_error(size, available_memory(directory), directory, what)
    fallocate(fd, size, directory, what)  # MADV_POPULATE_WRITE unknown (Linux < 5.14)


# Note [Filling while the pages are allocated]
# ============================================
# A dataset's segment is filled front to back (column after column, row block after
# row block). ``Segment.create(ahead=True)`` therefore returns as soon as the file
# is sized, and threads allocate and map its pages in address order (``Population``,
# 32 MiB per step) while the source already copies into the first ones: the copy
# hides behind the page allocation (``benchmarks/harness/topics/load.py``, optimisations).
#
# Writes never overtake the population: a writer calls :func:`ready` for the range
# it is about to fill, which waits for the steps below its end. So a page is only
# ever written once it is allocated, and a failed allocation is raised there as
# SharedMemoryFullError (the loader then stops the threads and discards the
# segment), never as a SIGBUS. The loader (``_load.build``) ends the fill with
# ``finish_population`` (the pages no writer asked for, e.g. alignment gaps) or, on
# any error, ``stop_population`` before ``discard``: no thread ever touches a
# segment that is gone.
#
# Allocation can then fail after the first rows are copied, where a reserved
# segment fails before. Only RAM segments with at least twice their size free are
# filled this way, so that takes another process grabbing the memory in between;
# near the limit, and for ``storage_dir`` (a small tmpfs, a disk), every page is
# reserved before the source gets its buffers, as for any other segment.

_POPULATIONS: dict[int, Population] = {}  # by id; a finalizer pops without the lock
_WAIT_STEP = 1.0  # seconds between checks that the population threads still run
_POPULATIONS_LOCK = ForkSafeLock()


class Population:
    """The pages of a new segment, allocated and mapped by threads in address order."""

    def __init__(self, segment: Any, directory: str | None, what: str) -> None:
        """Start allocating the pages of ``segment`` (a ``Segment``, which imports this module)."""
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
        madvise(self.base, self.size, MADV_HUGEPAGE)  # a hint; may do nothing
        with _POPULATIONS_LOCK:
            _POPULATIONS[id(self)] = self
        # a segment dropped without finish()/stop(): forgotten at once, and its threads
        # stop at their next step (a finalizer takes no lock: Note [One lock rule])
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
            start = step * _POPULATE_STEP
            length = min(_POPULATE_STEP, self.size - start)
            error = madvise(self.base + start, length, MADV_POPULATE_WRITE)
            with self._cond:
                self._error = self._error or error
                self._done[step] = True
                while self._ready < self.steps and self._done[self._ready]:
                    self._ready += 1
                self._cond.notify_all()

    def wait(self, end: int) -> None:
        """Return once bytes ``[0, end)`` are allocated and mapped; raise if that failed.

        Bounded: if every thread has ended (stopped) with the range not done, the
        range is allocated here, in this thread.
        """
        need = min(self.steps, -(-end // _POPULATE_STEP))
        with self._cond:
            while self._ready < need and not self._error:
                if not self._cond.wait(_WAIT_STEP) and not self._running():
                    break
            error = self._error
            missing = [s for s in range(need) if not self._done[s]] if not error else []
        for step in missing:  # the threads ended: allocate what is left here
            start = step * _POPULATE_STEP
            length = min(_POPULATE_STEP, self.size - start)
            error = madvise(self.base + start, length, MADV_POPULATE_WRITE)
            if error:
                break
            with self._cond:
                self._done[step] = True
                while self._ready < self.steps and self._done[self._ready]:
                    self._ready += 1
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
        interrupted: BaseException | None = None
        for thread in self._threads:
            if thread is threading.current_thread():  # a collection ran in this thread
                continue
            while thread.is_alive():  # never return (or raise) with a thread running
                try:
                    thread.join()
                except BaseException as e:
                    with self._cond:
                        self._stopped = True
                    interrupted = e
        if interrupted is not None:
            raise interrupted


def _abandon(population: Population) -> None:
    """The segment of ``population`` is gone: forget it, and let its threads stop."""
    population._stopped = True
    _POPULATIONS.pop(id(population), None)


def ready(array: np.ndarray, nbytes: int | None = None) -> None:
    """Wait until the pages under ``array`` (its first ``nbytes``) may be written.

    Only segments made with ``create(ahead=True)`` wait (Note [Filling while the
    pages are allocated]); for any other memory this returns at once.

    Raises:
        SharedMemoryFullError: a page of the segment could not be allocated.

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
    _POPULATIONS.clear()  # their threads are the parent's: none runs in a fork child


os.register_at_fork(after_in_child=_forget_populations_in_child)
