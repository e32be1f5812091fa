"""Shared memory segments and the arrays laid over them.

Note [How shared segments are made, shared and freed]
=====================================================
A segment is an *anonymous* file: ``memfd_create`` (RAM) or ``O_TMPFILE`` in
``storage_dir`` (a disk, mapped shared so every process reads one copy through
the page cache). Neither ever has a name in ``/dev/shm`` or in the directory, so
nothing can be left behind whatever kills which process: the kernel frees the
pages when the last descriptor and the last mapping are gone
(``docs/internals.md#memfd``; why not named ``/dev/shm`` files or torch's
handles: ``docs/how-it-works.md`` and ``docs/internals.md#resource-tracker``).

A memfd is not counted against ``/dev/shm``; its limit is RAM and the memory
cgroup, which ``check_capacity`` reads before allocating. Every page is then
allocated and mapped up front (Note [Allocating shared pages]): a full memory is
raised at once, never as a SIGBUS later (``docs/internals.md#sigbus``).

Sharing: a segment pickles as a *handle* ``(pid, fd, dev, inode, size)`` plus a
ticket. The receiving process opens ``/proc/<pid>/fd/<fd>``, which gives it its
own descriptor of the same file (checked by device and inode), and maps it. This
works for ``fork``, ``spawn`` and ``forkserver`` children and for unrelated
processes of the same user (another ``torchrun`` rank). A process that attached
hands out its own ``(pid, fd)`` in turn, so attaching never depends on the
creator staying alive, only on the *sender* holding the file until the receiver
has opened it, which the ticket ensures (Note [Handing a segment over] in
``_handoff.py``). Within one process a segment is mapped once, however many
arrays refer to it (``_ATTACHED``).

Read-only handles (the datasets' columns) are mapped copy-on-write
(``MAP_PRIVATE``) by the receiver: reads map the same physical pages, and a write
forced through can never reach another process. ``fork`` children of the loading
process map a dataset's segment copy-on-write too (Note [Sealed segments]).
"""

from __future__ import annotations

import errno
import functools
import math
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from . import _handoff
from ._capacity import (
    FULL_ERRNOS,
    available_memory,
    check_capacity,
    fallocate,
    fmt_bytes,
    full_error,
    resolve_storage_dir,
)
from ._linux import (
    MADV_HUGEPAGE,
    MADV_POPULATE_WRITE,
    MAP_PRIVATE_FIXED,
    PROT_READ_WRITE,
    address_of,
    is_tmpfs,
    libc_mmap,
    madvise,
    open_tmpfile,
    replace_with_anonymous,
)
from .errors import AttachError, UnsupportedDtypeError

__all__ = [
    "Segment",
    "SharedArray",
    "aligned",
    "allocate",
    "attach",
    "available_memory",
    "check_capacity",
    "copy_chunked",
    "populate",
    "population_threads",
    "ready",
    "seal",
    "to_numpy_dtype",
]

# Old private names, kept while importers move to _capacity/_linux/_text (and for tests
# that patch _madvise here: population below calls it through this module).
_address = address_of
_madvise = madvise
_MADV_POPULATE_WRITE = MADV_POPULATE_WRITE
_PROT_READ_WRITE = PROT_READ_WRITE
_libc_mmap = libc_mmap
_fmt = fmt_bytes
_resolve_storage_dir = resolve_storage_dir

_ATTACHED: weakref.WeakValueDictionary[tuple[str, bool], Segment] = weakref.WeakValueDictionary()
_ATTACH_LOCK = threading.Lock()


class Segment:
    """One anonymous shared file, mapped into this process.

    Use :meth:`create` or unpickle a handle; do not call the constructor directly.
    The segment is freed by the kernel when every process has dropped it.
    """

    def __init__(self, fd: int, size: int, token: str, writable: bool = True) -> None:
        self.fd = fd
        self.size = size
        self.token = token
        self.writable = writable
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
        self.mmap = mmap.mmap(fd, size, access=access)
        st = os.fstat(fd)
        self._ident = (st.st_dev, st.st_ino)
        # closes fd, or holds it while a receiver has yet to open it (_handoff.release)
        self._finalizer = weakref.finalize(self, _handoff.release, fd)
        self.created_here = False  # set by create(): only the creator may discard()

    @classmethod
    def create(
        cls,
        nbytes: int,
        storage_dir: str | os.PathLike[str] | None = None,
        what: str = "this allocation",
        reserve: bool = True,
        ahead: bool = False,
    ) -> Segment:
        """Allocate a segment of ``nbytes``, reserving every page before returning.

        Args:
            nbytes: size in bytes (0 is allowed and takes one page).
            storage_dir: ``None`` for RAM; a directory for a file-backed segment.
                Defaults to the ``SHAREDDATA_STORAGE_DIR`` environment variable.
            what: how to name the allocation in errors.
            reserve: ``False`` only sizes the file (capacity still checked): for a
                writer that fills it with ``os.pwrite`` on :attr:`fd`, which reports a
                full memory as an error, never through the mapping (a SIGBUS then).
            ahead: with ``reserve``, for RAM with room to spare, return at once while
                threads allocate the pages in address order; the caller fills the
                first ones meanwhile, calling :func:`ready` before writing any range,
                and ends with :meth:`finish_population` (:meth:`stop_population` on an
                error). Note [Filling while the pages are allocated].

        Raises:
            SharedMemoryFullError: before anything is written, when there is no room.
        """
        directory = resolve_storage_dir(storage_dir)
        size = max(int(nbytes), 1)
        check_capacity(size, directory, what)
        if directory is None:
            fd = os.memfd_create("shareddata", os.MFD_CLOEXEC)
        else:
            fd = open_tmpfile(directory)
        # Shared memory (a memfd, or a file on tmpfs) is reserved by populating it:
        # Note [Allocating shared pages]
        by_faults = reserve and (directory is None or is_tmpfs(fd))
        try:
            # a disk file is reserved with fallocate; where it cannot be, sized only
            # (its capacity was checked above)
            if reserve and not by_faults:
                fallocate(fd, size, directory, what)
            try:  # the data, then the slots of Note [Handing a segment over] (sparse)
                os.ftruncate(fd, _handoff.file_size(size))
            except OSError as e:
                if e.errno in FULL_ERRNOS:
                    raise full_error(size, available_memory(directory), directory, what) from e
                raise
            segment = cls(fd, size, secrets.token_hex(8))
        except BaseException:
            os.close(fd)
            raise
        segment.created_here = True
        if reserve:
            try:
                if ahead and directory is None and available_memory(None) >= 2 * size:
                    segment._population = _Population(segment, directory, what)
                else:
                    segment._reserve(by_faults, directory, what)
            except BaseException:
                segment.close()
                raise
        return segment._register()

    _population: _Population | None = None

    def _reserve(self, by_faults: bool, directory: str | None, what: str) -> None:
        """Allocate (``by_faults``) and map every page: Note [Allocating shared pages]."""
        if by_faults:
            _madvise(address_of(self.mmap), self.size, MADV_HUGEPAGE)  # a hint; may do nothing
        error = self._populate()
        if by_faults and error:
            _population_failed(error, self.fd, self.size, directory, what)

    def _populate(self) -> int:
        """Map (and allocate) every page with ``MADV_POPULATE_WRITE``; 0 or the errno."""
        return populate(address_of(self.mmap), self.size)

    def finish_population(self) -> None:
        """Wait until the pages that ``create(ahead=True)`` allocates are all in.

        Raises:
            SharedMemoryFullError: a page could not be allocated.
        """
        if self._population is not None:
            self._population.finish()
            self._population = None

    def stop_population(self) -> None:
        """Stop allocating the pages of ``create(ahead=True)`` and wait for the threads."""
        if self._population is not None:
            self._population.stop()
            self._population = None

    def handle(self, ticket: bool = False) -> tuple[Any, ...]:
        """What pickling sends: enough for another process to open and map this file.

        Args:
            ticket: draw a ticket, so that this process keeps the file until the
                receiver has opened it even if the segment is dropped meanwhile
                (Note [Handing a segment over] in ``_handoff.py``). Pickles made by
                ``multiprocessing`` (queues, pipes, pools, process arguments) draw one.
        """
        slot, nonce = _handoff.ticket(self.fd, self.size, self.created_here) if ticket else (0, 0)
        return (os.getpid(), self.fd, self._ident, self.size, self.token, slot, nonce)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce(ticket=False)

    def _reduce(self, ticket: bool) -> tuple[Any, ...]:
        return (attach, (*self.handle(ticket), self.writable))

    def _register(self) -> Segment:
        with _ATTACH_LOCK:
            _ATTACHED[(self.token, self.writable)] = self
        return self

    def close(self) -> None:
        """Unmap and close now (arrays over the segment must be gone)."""
        _ATTACHED.pop((self.token, self.writable), None)
        try:
            self.mmap.close()
        except BufferError:  # views still exist: they keep the mapping alive
            return
        self._finalizer()

    def seal(self) -> None:
        """Make ``fork`` children map this segment copy-on-write (Note [Sealed segments]).

        For a dataset's segment once it is filled: nothing writes to it any more,
        and no forked DataLoader worker can write through to the others.
        """
        libc_mmap()  # looked up here: a fork child must not dlopen (the loader's lock)
        with _ATTACH_LOCK:
            _SEALED.add(self)

    def discard(self) -> None:
        """Free the segment now, even while arrays over it are still referenced.

        For a load that failed: see Note [Freeing a failed load]. Arrays that
        survive read zeros from then on; nothing else may use the segment. Only
        the process that created the segment may discard it (its mapping is the
        only one in this process).
        """
        if not self.created_here:
            raise RuntimeError("only the process that created a segment may discard it")
        _handoff.forget(self.fd)  # freed on purpose: no receiver is waited for
        _ATTACHED.pop((self.token, self.writable), None)
        _SEALED.discard(self)
        try:
            self.mmap.close()
        except BufferError:  # views are alive: swap the pages out from under them
            if not replace_with_anonymous(self.mmap, self.size, self._ident):
                return  # could not: the views keep it until they are gone
        self._finalizer()

    def __repr__(self) -> str:
        return f"Segment(size={self.size}, fd={self.fd}, token={self.token!r})"


# Note [Freeing a failed load]
# ============================
# When a load fails halfway (a corrupt chunk, Ctrl-C, a full disk), the error's
# traceback often still refers to the half-filled arrays: through the frames of the
# reader, the ``__cause__`` of a library's exception, a closure. A notebook keeps the
# last exception (``sys.last_value``) until the next one, so a failed 100 GiB load
# would stay in RAM and make the retry fail for lack of room. The loader therefore
# discards the segment at once, whatever still refers to it:
#
# * the mapping is replaced in place by anonymous zero pages (``mmap`` with
#   ``MAP_FIXED`` at the same address), so a leftover array stays valid memory and
#   reads zeros instead of crashing; Python's ``mmap`` object unmaps that range
#   when it is collected, as it would have;
# * Python's ``mmap`` keeps a duplicate of the descriptor (for ``size()``): that
#   descriptor number is pointed at ``/dev/null`` with ``dup2`` (so it stays owned
#   by the ``mmap`` object, which closes it later) and our own descriptor is closed.
#
# The kernel then frees the pages at once. Nothing in ``shareddata`` touches a
# discarded segment again.


# Note [Sealed segments]
# ======================
# A ``fork`` child inherits its parent's mappings as they are. The loading process
# maps a dataset's segment shared and writable (it filled it), so a forked
# DataLoader worker that forced a write (numpy's ``writeable`` flag set back, a raw
# pointer) would change what every process reads. Right after ``fork``, the child
# therefore maps every *sealed* segment again, at the same address, copy-on-write
# (``MAP_PRIVATE | MAP_FIXED`` over the same descriptor, ``os.register_at_fork``):
# reads share the same pages, a write copies the page into the writer. The parent
# keeps its mapping (with its page tables, so the data shows in its PSS); writable
# ``SharedArray``\ s are never sealed, so writes to them still reach every process.

_SEALED: weakref.WeakSet[Segment] = weakref.WeakSet()


def _remap_sealed_in_child() -> None:
    if not _SEALED:
        return
    mmap_at = libc_mmap()
    for segment in list(_SEALED):
        try:
            address = address_of(segment.mmap)
        except (ValueError, TypeError):  # closed meanwhile
            continue
        mmap_at(address, segment.size, PROT_READ_WRITE, MAP_PRIVATE_FIXED, segment.fd, 0)


os.register_at_fork(after_in_child=_remap_sealed_in_child)


# Note [Allocating shared pages]
# ==============================
# Filling fresh shared memory costs more than the copy itself: the kernel allocates,
# zeroes and maps each 4 KiB page (``docs/internals.md#allocating-pages``;
# ``benchmarks/bench_first_touch.py`` measures it). Private numpy arrays fault 2 MiB
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
        >>> m = mmap.mmap(-1, 64 << 20)
        >>> populate(address_of(m), len(m), threads=2)
        0
        >>> m.close()
    """
    threads = population_threads(nbytes) if threads is None else max(1, threads)
    steps = iter(range(0, nbytes, _POPULATE_STEP))
    lock = threading.Lock()
    errors: list[int] = []

    def work() -> None:
        while not errors:
            with lock:
                start = next(steps, None)
            if start is None:
                return
            length = min(_POPULATE_STEP, nbytes - start)
            error = _madvise(address + start, length, _MADV_POPULATE_WRITE)
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


def _population_failed(error: int, fd: int, size: int, directory: str | None, what: str) -> None:
    """Raise SharedMemoryFullError for a failed population, or fall back to fallocate."""
    if error in FULL_ERRNOS or error == errno.EFAULT:  # EFAULT: the fault hit SIGBUS
        raise full_error(size, available_memory(directory), directory, what)
    fallocate(fd, size, directory, what)  # MADV_POPULATE_WRITE unknown (Linux < 5.14)


# Note [Filling while the pages are allocated]
# ============================================
# A dataset's segment is filled front to back (column after column, row block after
# row block). ``Segment.create(ahead=True)`` therefore returns as soon as the file
# is sized, and threads allocate and map its pages in address order (``_Population``,
# 32 MiB per step) while the source already copies into the first ones: the copy
# hides behind the page allocation (``benchmarks/bench_formats.py``, section 1).
#
# Writes never overtake the population: a writer calls :func:`ready` for the range
# it is about to fill, which waits for the steps below its end. So a page is only
# ever written once it is allocated, and a failed allocation is raised there as
# SharedMemoryFullError (the loader then stops the threads and discards the
# segment), never as a SIGBUS. ``load_columns`` ends the fill with
# ``finish_population`` (the pages no writer asked for, e.g. alignment gaps) or, on
# any error, ``stop_population`` before ``discard``: no thread ever touches a
# segment that is gone.
#
# Allocation can then fail after the first rows are copied, where a reserved
# segment fails before. Only RAM segments with at least twice their size free are
# filled this way, so that takes another process grabbing the memory in between;
# near the limit, and for ``storage_dir`` (a small tmpfs, a disk), every page is
# reserved before the source gets its buffers, as for any other segment.

_POPULATIONS: list[_Population] = []
_POPULATIONS_LOCK = threading.Lock()


class _Population:
    """The pages of a new segment, allocated and mapped by threads in address order."""

    def __init__(self, segment: Segment, directory: str | None, what: str) -> None:
        self.fd, self.size = segment.fd, segment.size
        self.base = address_of(segment.mmap)
        self.directory, self.what = directory, what
        self.steps = -(-self.size // _POPULATE_STEP)
        self._done = [False] * self.steps
        self._ready = 0  # steps [0, _ready) are done
        self._next = 0
        self._error = 0
        self._stopped = False
        self._cond = threading.Condition()
        _madvise(self.base, self.size, MADV_HUGEPAGE)  # a hint; may do nothing
        with _POPULATIONS_LOCK:
            _POPULATIONS.append(self)
        # a segment dropped without finish()/stop(): end the threads before it unmaps
        self._finalizer = weakref.finalize(segment, self.stop)
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
            error = _madvise(self.base + start, length, _MADV_POPULATE_WRITE)
            with self._cond:
                self._error = self._error or error
                self._done[step] = True
                while self._ready < self.steps and self._done[self._ready]:
                    self._ready += 1
                self._cond.notify_all()

    def wait(self, end: int) -> None:
        """Return once bytes ``[0, end)`` are allocated and mapped; raise if that failed."""
        need = min(self.steps, -(-end // _POPULATE_STEP))
        with self._cond:
            while self._ready < need and not self._error:
                self._cond.wait()
            error = self._error
        if error:
            self._stop_threads()
            with self._cond:
                if self._error:  # the first waiter handles it; an old kernel falls back
                    _population_failed(error, self.fd, self.size, self.directory, self.what)
                    self._error, self._ready = 0, self.steps

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
        with _POPULATIONS_LOCK:
            if self in _POPULATIONS:
                _POPULATIONS.remove(self)

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
    for population in list(_POPULATIONS):
        if population.base <= start < population.base + population.size:
            population.wait(end - population.base)
            return


def attach(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    size: int,
    token: str,
    slot: int = 0,
    nonce: int = 0,
    writable: bool = True,
) -> Segment:
    """Map the segment that process ``pid`` holds as descriptor ``fd`` (unpickling).

    Acknowledges the ticket ``(slot, nonce)`` once the file is held here, so the
    sender may let go of it (Note [Handing a segment over] in ``_handoff.py``).

    Raises:
        AttachError: the sender no longer holds the file, or may not be read.
    """
    with _ATTACH_LOCK:
        # A writable mapping serves read-only arrays too; a copy-on-write one never
        # serves writable arrays (their writes must reach the other processes).
        existing = _ATTACHED.get((token, True)) or (
            None if writable else _ATTACHED.get((token, False))
        )
        if existing is not None:
            _handoff.acknowledge(existing.fd, size, slot, nonce)
            return existing
        path = f"/proc/{pid}/fd/{fd}"
        try:
            new_fd = _open_for_attach(path, writable)
        except FileNotFoundError as e:
            holder = "this process" if pid == os.getpid() else f"process {pid}, which sent it,"
            raise AttachError(
                f"cannot attach shared segment {token}: {holder} no longer holds it "
                f"({path} is gone: the sender exited or was killed before this process "
                f"received it, or {_handoff.HOLD:.0f} s passed). Keep the dataset or "
                "SharedArray alive in the sending process until every receiver has "
                "unpickled it."
            ) from e
        except PermissionError as e:
            raise AttachError(
                f"cannot attach shared segment {token}: opening {path} was refused ({e}). "
                f"Attaching needs the same user as process {pid} and read access to its /proc "
                "entry (ptrace read); a hardened /proc (hidepid) or a setuid/non-dumpable "
                "sender prevents it."
            ) from e
        try:
            st = os.fstat(new_fd)
            if (st.st_dev, st.st_ino) != tuple(ident):
                raise AttachError(
                    f"cannot attach shared segment {token}: {path} now refers to another "
                    "file (the sender closed the segment and reused the descriptor)."
                )
            _handoff.acknowledge(new_fd, size, slot, nonce)
            segment = Segment(new_fd, size, token, writable=writable)
        except BaseException:
            os.close(new_fd)
            raise
        _ATTACHED[(token, writable)] = segment
        return segment


def _open_for_attach(path: str, writable: bool) -> int:
    """Our own descriptor of the file at ``path``; read-write where allowed, to acknowledge.

    A read-only segment is still mapped copy-on-write; the descriptor is writable
    only so that the receiver can write its acknowledgement past the data.
    """
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        if writable:
            raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


_ALIGN = 64  # bytes; every array in a segment starts on a cache line

_TORCH_TO_NUMPY = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_TO_NUMPY[getattr(torch, _name)] = getattr(np, _name)


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """Normalise a numpy or torch dtype (or anything ``np.dtype`` takes) to ``np.dtype``.

    Example:
        >>> to_numpy_dtype(torch.int32), to_numpy_dtype("float32")
        (dtype('int32'), dtype('float32'))
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise UnsupportedDtypeError(
                f"torch dtype {dtype} has no numpy equivalent and cannot be stored; "
                "convert it first (e.g. bfloat16 -> float32 or view it as int16)."
            )
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    return np.dtype(dtype)


def aligned(offset: int) -> int:
    """Round ``offset`` up to the alignment of arrays inside a segment."""
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedArray:
    """An n-dimensional array in shared memory, pickled by handle, never by value.

    Every process that unpickles it maps the same pages, under ``fork``,
    ``spawn`` and ``forkserver`` alike, including DataLoader workers and
    ``multiprocessing`` pools, and back: an array a pool worker creates and
    returns reaches the parent by handle, even if the worker exits right after
    (Note [Handing a segment over]); if it cannot be attached, its first use raises
    :class:`~shareddata.AttachError`. It is writable, so processes can build
    results in place; concurrent writes are the caller's to coordinate (a
    ``multiprocessing.Lock``, disjoint slices per process, or accepted races for
    statistics that tolerate them).

    Args:
        segment: the segment holding the data.
        offset: byte offset of the first element in the segment.
        shape: the array's shape.
        dtype: numpy dtype.
        writable: ``False`` for read-only views (dataset columns).

    Example:
        >>> a = SharedArray.empty((2, 3), "float32")
        >>> a.numpy()[:] = 1.5
        >>> a.torch().sum().item()
        9.0
        >>> b = SharedArray.from_array(np.arange(4))
        >>> b.shape, b.dtype, b.nbytes
        ((4,), dtype('int64'), 32)
    """

    __slots__ = ("_array", "_error", "_tensor", "dtype", "offset", "segment", "shape", "writable")

    def __init__(
        self,
        segment: Segment,
        offset: int,
        shape: Sequence[int],
        dtype: Any,
        writable: bool = True,
    ) -> None:
        self.segment = segment
        self.offset = int(offset)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = to_numpy_dtype(dtype)
        self.writable = writable
        count = math.prod(self.shape)
        if self.offset + count * self.dtype.itemsize > segment.size:
            raise ValueError(
                f"array of shape {self.shape} and dtype {self.dtype} at offset {offset} "
                f"does not fit in a segment of {segment.size} bytes"
            )
        raw = np.frombuffer(segment.mmap, self.dtype, count, self.offset)
        # Every view of this array (a numpy slice, a torch tensor over it) has ``raw`` as
        # its base: the segment lives as long as any of them, so a view still crosses by
        # handle after the array itself is dropped (a pool worker returning a slice of
        # its own SharedArray; Note [Tensors over our memory cross by handle] in _reduce).
        weakref.finalize(raw, _hold, segment).atexit = False
        array = raw.reshape(self.shape)
        if not writable:
            array.flags.writeable = False
        self._array: np.ndarray | None = array
        self._tensor: torch.Tensor | None = None
        self._error: str | None = None

    @classmethod
    def _unattached(
        cls, error: AttachError, shape: Sequence[int], dtype: Any, writable: bool
    ) -> SharedArray:
        """An array whose segment could not be attached: raises ``error`` on first use."""
        self = cls.__new__(cls)
        self.segment = None  # type: ignore[assignment]
        self.offset, self.shape = 0, tuple(int(s) for s in shape)
        self.dtype, self.writable = to_numpy_dtype(dtype), writable
        self._array, self._tensor, self._error = None, None, str(error)
        return self

    def _data(self) -> np.ndarray:
        if self._array is None:
            raise AttachError(str(self._error))
        return self._array

    @classmethod
    def empty(
        cls,
        shape: int | Sequence[int],
        dtype: Any,
        *,
        storage_dir: str | os.PathLike[str] | None = None,
    ) -> SharedArray:
        """Allocate an uninitialised (zero-filled) shared array.

        Args:
            shape: the shape.
            dtype: a numpy or torch dtype.
            storage_dir: ``None`` for RAM; a directory for a file-backed array.

        Raises:
            SharedMemoryFullError: when there is no room, before anything is written.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = to_numpy_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        segment = Segment.create(nbytes, storage_dir, what=f"SharedArray{shape} {dtype}")
        return cls(segment, 0, shape, dtype)

    @classmethod
    def from_array(
        cls, array: Any, *, storage_dir: str | os.PathLike[str] | None = None
    ) -> SharedArray:
        """Copy a numpy array or CPU tensor into a new shared array.

        Args:
            array: anything ``np.asarray`` takes, or a ``torch.Tensor``.
            storage_dir: ``None`` for RAM; a directory for a file-backed array.
        """
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu().numpy()
        array = np.asarray(array)
        if array.dtype.hasobject:
            raise UnsupportedDtypeError(
                "SharedArray.from_array got an object array; shared memory holds fixed-size "
                "numeric data. Convert it to a numeric dtype (or use a SharedList)."
            )
        out = cls.empty(array.shape, array.dtype.newbyteorder("="), storage_dir=storage_dir)
        copy_chunked(out.numpy(), array)
        return out

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (read-only if the array is).

        Raises:
            AttachError: the array was received from a process that no longer held it.
        """
        return self._data()

    def torch(self) -> torch.Tensor:
        """A zero-copy ``torch.Tensor`` view (do not write to it if the array is read-only)."""
        if self._tensor is None:
            if self.writable:
                self._tensor = torch.from_numpy(self._data())
            else:
                import warnings

                with warnings.catch_warnings():  # torch warns that the buffer is read-only
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensor = torch.from_numpy(self._data())
        return self._tensor

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d SharedArray")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._data()
        return array if dtype is None else array.astype(dtype)

    def readonly(self) -> SharedArray:
        """A read-only view of the same memory (what datasets hand to workers)."""
        self._data()
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, writable=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce(ticket=False)

    def _reduce(self, ticket: bool) -> tuple[Any, ...]:
        # Receivers of read-only arrays map copy-on-write: Note [How shared segments ...].
        self._data()
        handle = (*self.segment.handle(ticket), self.writable)
        return (_rebuild, (handle, self.offset, self.shape, self.dtype.str, self.writable))

    def __repr__(self) -> str:
        flag = "" if self.writable else ", read-only"
        flag += "" if self._error is None else ", not attached"
        return f"SharedArray(shape={self.shape}, dtype={self.dtype}{flag})"


def _hold(segment: Segment) -> None:
    """Nothing: a finalizer's arguments live until the object it watches is gone."""


def seal(arrays: Sequence[SharedArray]) -> list[SharedArray]:
    """Read-only views of ``arrays``, whose segment ``fork`` children map copy-on-write.

    What a loader hands out once it has filled ``arrays``: no process, ``fork``
    children included, can change what the others read (Note [Sealed segments]).

    Example:
        >>> a, b = allocate([((3,), "int64"), ((2,), "float32")])
        >>> a.numpy()[:] = 7
        >>> ro, _ = seal([a, b])
        >>> ro.numpy().tolist(), ro.writable
        ([7, 7, 7], False)
    """
    for segment in {id(a.segment): a.segment for a in arrays}.values():
        segment.seal()
    return [a.readonly() for a in arrays]


def _rebuild(
    handle: tuple[Any, ...], offset: int, shape: tuple[int, ...], dtype: str, writable: bool
) -> SharedArray:
    # never raises: unpickling may run in a pool's result thread, whose death hangs the
    # pool; the error is raised where the array is used (Note [Handing a segment over])
    try:
        segment = attach(*handle)
    except AttachError as e:
        return SharedArray._unattached(e, shape, dtype, writable)
    return SharedArray(segment, offset, shape, dtype, writable)


# multiprocessing's pickler (every queue, pipe, pool and process argument, torch's and
# the DataLoader's included) draws a ticket: Note [Handing a segment over].
ForkingPickler.register(Segment, functools.partial(Segment._reduce, ticket=True))
ForkingPickler.register(SharedArray, functools.partial(SharedArray._reduce, ticket=True))


def allocate(
    layouts: Sequence[tuple[Sequence[int], Any]],
    storage_dir: str | os.PathLike[str] | None = None,
    what: str = "this dataset",
    reserve: bool = True,
    ahead: bool = False,
) -> list[SharedArray]:
    """Allocate several arrays in ONE segment (one descriptor, one capacity check).

    Args:
        layouts: ``(shape, dtype)`` of each array.
        storage_dir: ``None`` for RAM; a directory for file-backed arrays.
        what: how to name the allocation in errors.
        reserve: see :meth:`Segment.create`.
        ahead: see :meth:`Segment.create`: write only after :func:`ready`.

    Returns:
        The arrays, writable, in the order given.
    """
    offsets, end = [], 0
    norm = []
    for shape, dtype in layouts:
        shape, dtype = tuple(int(s) for s in shape), to_numpy_dtype(dtype)
        end = aligned(end)
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
        norm.append((shape, dtype))
    ahead = ahead and end > 0  # nothing to fill: nothing to wait for
    segment = Segment.create(end, storage_dir, what=what, reserve=reserve, ahead=ahead)
    return [SharedArray(segment, o, s, d) for o, (s, d) in zip(offsets, norm)]


_CHUNK = 64 << 20


def copy_chunked(dest: np.ndarray, src: np.ndarray, progress: Any = None) -> None:
    """Copy ``src`` into ``dest`` row block by row block (no full temporary)."""
    if dest.shape != src.shape:
        raise ValueError(f"shape mismatch: {src.shape} into {dest.shape}")
    if dest.ndim == 0 or dest.shape[0] == 0:
        ready(dest)
        dest[...] = src
        return
    row_bytes = max(1, dest.nbytes // dest.shape[0])
    step = max(1, _CHUNK // row_bytes)
    for start in range(0, dest.shape[0], step):
        stop = min(start + step, dest.shape[0])
        ready(dest[:stop])  # a segment still being allocated: Note [Filling while ...]
        dest[start:stop] = src[start:stop]
        if progress is not None:
            progress((stop - start) * row_bytes)
