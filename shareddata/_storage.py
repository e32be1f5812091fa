"""Shared memory segments and the arrays laid over them.

Note [How shared segments are made, shared and freed]
=====================================================
A segment is an *anonymous* file: ``memfd_create`` (RAM) or ``O_TMPFILE`` in
``storage_dir`` (a disk, mapped shared so every process reads one copy through
the page cache). Neither ever has a name in ``/dev/shm`` or in the directory, so
nothing can be left behind whatever kills which process: the kernel frees the
pages when the last descriptor and the last mapping are gone.

Other choices, and why not (measured facts in FACTS.md):

* ``multiprocessing.shared_memory`` / named ``/dev/shm`` files leak when the
  process that would unlink them (the creator or the resource tracker) is
  SIGKILLed, and on Python < 3.13 every attaching process unlinks on exit
  (cpython#82300). They are also bound by the size of the ``/dev/shm`` mount
  (64 MiB by default in Docker), where ``ftruncate`` + touching pages ends in an
  uncatchable SIGBUS.
* torch's ``share_memory_()`` handles cannot cross ``torchrun`` ranks (different
  authkeys; a pickled fd can be redeemed once) and one fd per storage runs out of
  descriptors.

A memfd is not counted against ``/dev/shm``; its limit is RAM and the memory
cgroup, which :func:`check_capacity` reads before allocating. Every page is then
allocated and mapped up front, by several threads (``MADV_POPULATE_WRITE``; disk
files are reserved with ``posix_fallocate`` first): a full memory is raised at
once, never as a SIGBUS later, and the first write runs at memcpy speed instead of
one page fault per 4 KiB (Note [Allocating shared pages]).

Sharing: a segment pickles as a *handle* ``(pid, fd, dev, inode, size)``. The
receiving process opens ``/proc/<pid>/fd/<fd>``, which gives it its own
descriptor of the same file (checked by device and inode), and maps it. This
works for ``fork``, ``spawn`` and ``forkserver`` children and for unrelated
processes of the same user (another ``torchrun`` rank). A process that attached
hands out its own ``(pid, fd)`` in turn, so attaching never depends on the
creator staying alive: it only needs the *sender* to hold the segment until the
receiver has mapped it. Within one process a segment is mapped once, however
many arrays refer to it (see ``_ATTACHED``).

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
from typing import Any

import numpy as np
import torch

from .errors import AttachError, SharedMemoryFullError, UnsupportedDtypeError

__all__ = [
    "Segment",
    "SharedArray",
    "available_memory",
    "check_capacity",
    "seal",
    "to_numpy_dtype",
]

_ALIGN = 64  # bytes; every array in a segment starts on a cache line
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; mmap module names it only on 3.13+
_TMPFS_MAGIC = 0x01021994
_FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
_STORAGE_ENV = "SHAREDDATA_STORAGE_DIR"

_ATTACHED: weakref.WeakValueDictionary[tuple[str, bool], Segment] = weakref.WeakValueDictionary()
_ATTACH_LOCK = threading.Lock()


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"  # pragma: no cover


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _cgroup_available() -> int | None:
    """Bytes the memory cgroup of this process can still take, or None if unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: walk up the hierarchy, keep the tightest limit
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                base = os.path.join("/sys/fs/cgroup", *parts[:depth])
                limit = _read_int(os.path.join(base, "memory.max"))
                used = _read_int(os.path.join(base, "memory.current"))
                if limit is not None and used is not None:
                    free = limit - used + _reclaimable(os.path.join(base, "memory.stat"))
                    best = free if best is None else min(best, free)
        elif "memory" in controllers.split(","):  # cgroup v1
            base = "/sys/fs/cgroup/memory"
            limit = _read_int(os.path.join(base, "memory.limit_in_bytes"))
            used = _read_int(os.path.join(base, "memory.usage_in_bytes"))
            if limit is not None and used is not None and limit < (1 << 60):
                free = limit - used + _reclaimable(os.path.join(base, "memory.stat"))
                best = free if best is None else min(best, free)
    return best


def _reclaimable(stat_path: str) -> int:
    """Inactive page cache in a cgroup: the kernel drops it before failing an allocation."""
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(value)
    except OSError:
        pass
    return 0


def available_memory(storage_dir: str | os.PathLike[str] | None = None) -> int:
    """Bytes that a new segment can take without running the machine out of room.

    Args:
        storage_dir: ``None`` for RAM (memfd): the smaller of ``MemAvailable`` and
            what the memory cgroup still allows; a directory: its free disk space.

    Returns:
        The number of bytes.

    Example:
        >>> available_memory() > 0
        True
    """
    if storage_dir is not None:
        st = os.statvfs(storage_dir)
        return st.f_bavail * st.f_frsize
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = psutil.virtual_memory().available
    cgroup = _cgroup_available()
    return avail if cgroup is None else min(avail, cgroup)


def _full_error(
    needed: int, free: int, storage_dir: str | None, what: str
) -> SharedMemoryFullError:
    where = f"the file system of storage_dir={storage_dir!r}" if storage_dir else "RAM"
    fixes = (
        "free disk space or choose another storage_dir"
        if storage_dir
        else "load fewer columns; raise the container's memory limit (Docker `--memory`, "
        "Kubernetes `resources.limits.memory`; a memory-backed `emptyDir` counts against "
        "it too); or put the data in files on a local disk with storage_dir='/path' "
        f"(or the {_STORAGE_ENV} environment variable)"
    )
    return SharedMemoryFullError(
        f"{what} needs {_fmt(needed)} ({needed} bytes) of shared memory but only "
        f"{_fmt(free)} ({free} bytes) is free in {where}. Nothing was loaded. Fix: {fixes}."
    )


def check_capacity(
    nbytes: int, storage_dir: str | os.PathLike[str] | None = None, what: str = "this allocation"
) -> None:
    """Raise :class:`~shareddata.SharedMemoryFullError` if ``nbytes`` do not fit.

    Args:
        nbytes: bytes about to be allocated.
        storage_dir: where they would go (``None``: RAM).
        what: how to name the allocation in the message (e.g. a file name).

    Raises:
        SharedMemoryFullError: with the bytes needed and free, and the fixes.

    Example:
        >>> check_capacity(1024)
        >>> check_capacity(1 << 62)
        Traceback (most recent call last):
        ...
        shareddata.errors.SharedMemoryFullError: this allocation needs ... is free in RAM...
    """
    free = available_memory(storage_dir)
    if nbytes > free:
        raise _full_error(nbytes, free, None if storage_dir is None else str(storage_dir), what)


def _resolve_storage_dir(storage_dir: str | os.PathLike[str] | None) -> str | None:
    if storage_dir is None:
        storage_dir = os.environ.get(_STORAGE_ENV) or None
    if storage_dir is None:
        return None
    path = os.fspath(storage_dir)
    if not os.path.isdir(path):
        from .errors import MissingFileError

        raise MissingFileError(
            f"storage_dir={path!r} is not a directory. Create it, or pass storage_dir=None "
            "to keep the data in RAM."
        )
    return path


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
        self._finalizer = weakref.finalize(self, _close_fd, fd)
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
        directory = _resolve_storage_dir(storage_dir)
        size = max(int(nbytes), 1)
        check_capacity(size, directory, what)
        if directory is None:
            fd = os.memfd_create("shareddata", os.MFD_CLOEXEC)
        else:
            fd = _open_tmpfile(directory)
        # Shared memory (a memfd, or a file on tmpfs) is reserved by populating it:
        # Note [Allocating shared pages]
        by_faults = reserve and (directory is None or _is_tmpfs(fd))
        try:
            # a disk file is reserved with fallocate; where it cannot be, sized only
            # (its capacity was checked above)
            if not (reserve and not by_faults and _fallocate(fd, size, directory, what)):
                try:
                    os.ftruncate(fd, size)
                except OSError as e:
                    if e.errno in _FULL_ERRNOS:
                        raise _full_error(size, available_memory(directory), directory, what) from e
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
            _madvise(_address(self.mmap), self.size, _MADV_HUGEPAGE)  # a hint; may do nothing
        error = self._populate()
        if by_faults and error:
            _population_failed(error, self.fd, self.size, directory, what)

    def _populate(self) -> int:
        """Map (and allocate) every page with ``MADV_POPULATE_WRITE``; 0 or the errno."""
        return populate(_address(self.mmap), self.size)

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

    def handle(self) -> tuple[Any, ...]:
        """What pickling sends: enough for another process to open and map this file."""
        return (os.getpid(), self.fd, self._ident, self.size, self.token)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (*self.handle(), self.writable))

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
        _libc_mmap()  # looked up here: a fork child must not dlopen (the loader's lock)
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
        _ATTACHED.pop((self.token, self.writable), None)
        _SEALED.discard(self)
        try:
            self.mmap.close()
        except BufferError:  # views are alive: swap the pages out from under them
            if not _replace_with_anonymous(self.mmap, self.size, self._ident):
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

_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10


def _replace_with_anonymous(mapped: mmap.mmap, size: int, ident: tuple[int, int]) -> bool:
    """Swap ``mapped``'s pages for anonymous zeros; True on success (see the Note above)."""
    address = _address(mapped)
    result = _libc_mmap()(address, size, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0)
    if result != address:
        return False
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                st = os.stat(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident and int(name) != null:
                os.dup2(null, int(name))  # the mmap object's duplicate (and our own fd)
    finally:
        os.close(null)
    return True


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
_MAP_PRIVATE_FIXED = 0x02 | 0x10


@functools.lru_cache(maxsize=1)
def _libc_mmap() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    return libc.mmap


def _address(mapped: mmap.mmap) -> int:
    import ctypes

    view = ctypes.c_char.from_buffer(mapped)  # writable for ACCESS_WRITE and ACCESS_COPY
    address = ctypes.addressof(view)
    del view  # release the buffer export at once
    return address


def _remap_sealed_in_child() -> None:
    if not _SEALED:
        return
    libc_mmap = _libc_mmap()
    for segment in list(_SEALED):
        try:
            address = _address(segment.mmap)
        except (ValueError, TypeError):  # closed meanwhile
            continue
        libc_mmap(address, segment.size, _PROT_READ_WRITE, _MAP_PRIVATE_FIXED, segment.fd, 0)


os.register_at_fork(after_in_child=_remap_sealed_in_child)


# Note [Allocating shared pages]
# ==============================
# Filling fresh shared memory costs more than the copy itself: the kernel allocates
# and zeroes each 4 KiB page and maps it into the page tables, ~2 us per page on a
# VM (FACTS.md; ``benchmarks/bench_formats.py`` measures it as the "first touch"
# limit). Private numpy arrays fault 2 MiB transparent huge pages instead; shared
# memory gets them only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
# (memfd) or the tmpfs mount's ``huge=`` option allows, so each segment asks for
# them (``MADV_HUGEPAGE``: honoured under ``advise``, a no-op under ``never``).
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


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _madvise(address: int, length: int, advice: int) -> int:
    """``madvise`` with the GIL released (ctypes); 0 or the errno."""
    import ctypes

    if _libc().madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


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
        >>> populate(_address(m), len(m), threads=2)
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
    if error in _FULL_ERRNOS or error == errno.EFAULT:  # EFAULT: the fault hit SIGBUS
        raise _full_error(size, available_memory(directory), directory, what)
    _fallocate(fd, size, directory, what)  # MADV_POPULATE_WRITE unknown (Linux < 5.14)


def _fallocate(fd: int, size: int, directory: str | None, what: str) -> bool:
    """Reserve ``size`` bytes of ``fd``; False where the file system cannot.

    Raises:
        SharedMemoryFullError: there is no room for them.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in _FULL_ERRNOS:
            raise _full_error(size, available_memory(directory), directory, what) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False
    return True


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
        self.base = _address(segment.mmap)
        self.directory, self.what = directory, what
        self.steps = -(-self.size // _POPULATE_STEP)
        self._done = [False] * self.steps
        self._ready = 0  # steps [0, _ready) are done
        self._next = 0
        self._error = 0
        self._stopped = False
        self._cond = threading.Condition()
        _madvise(self.base, self.size, _MADV_HUGEPAGE)  # a hint; may do nothing
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


def _is_tmpfs(fd: int) -> bool:
    """Whether ``fd`` is a file on tmpfs (its pages are RAM, like a memfd's)."""
    import ctypes

    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
    try:
        if _libc().fstatfs(fd, buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == _TMPFS_MAGIC


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _open_tmpfile(directory: str) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    # File systems without O_TMPFILE: create a name and unlink it at once.
    import tempfile

    fd, path = tempfile.mkstemp(prefix=".shareddata-", dir=directory)
    os.unlink(path)
    return fd


def _attach(
    pid: int, fd: int, ident: tuple[int, int], size: int, token: str, writable: bool = True
) -> Segment:
    """Map the segment that process ``pid`` holds as descriptor ``fd`` (unpickling)."""
    with _ATTACH_LOCK:
        # A writable mapping serves read-only arrays too; a copy-on-write one never
        # serves writable arrays (their writes must reach the other processes).
        existing = _ATTACHED.get((token, True)) or (
            None if writable else _ATTACHED.get((token, False))
        )
        if existing is not None:
            return existing
        if pid == os.getpid():
            raise AttachError(
                f"shared segment {token} is no longer held by this process (fd {fd}); "
                "keep the SharedArray or dataset alive while its pickle is in use."
            )
        path = f"/proc/{pid}/fd/{fd}"
        try:
            new_fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise AttachError(
                f"cannot attach shared segment {token}: process {pid}, which sent it, no "
                f"longer holds it ({path} is gone). Keep the dataset or SharedArray alive in "
                "the sending process until every receiver has unpickled it."
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
            segment = Segment(new_fd, size, token, writable=writable)
        except BaseException:
            os.close(new_fd)
            raise
        _ATTACHED[(token, writable)] = segment
        return segment


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
    ``multiprocessing`` pools. It is writable, so processes can build results in
    place; concurrent writes are the caller's to coordinate (a
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

    __slots__ = ("_array", "_tensor", "dtype", "offset", "segment", "shape", "writable")

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
        array = np.frombuffer(segment.mmap, self.dtype, count, self.offset).reshape(self.shape)
        if not writable:
            array.flags.writeable = False
        self._array = array
        self._tensor: torch.Tensor | None = None

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
        """A zero-copy numpy view (read-only if the array is)."""
        return self._array

    def torch(self) -> torch.Tensor:
        """A zero-copy ``torch.Tensor`` view (do not write to it if the array is read-only)."""
        if self._tensor is None:
            if self.writable:
                self._tensor = torch.from_numpy(self._array)
            else:
                import warnings

                with warnings.catch_warnings():  # torch warns that the buffer is read-only
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensor = torch.from_numpy(self._array)
        return self._tensor

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return int(self._array.nbytes)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d SharedArray")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._array if dtype is None else self._array.astype(dtype)

    def readonly(self) -> SharedArray:
        """A read-only view of the same memory (what datasets hand to workers)."""
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, writable=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # Receivers of read-only arrays map copy-on-write: Note [How shared segments ...].
        handle = (*self.segment.handle(), self.writable)
        return (_rebuild, (handle, self.offset, self.shape, self.dtype.str, self.writable))

    def __repr__(self) -> str:
        flag = "" if self.writable else ", read-only"
        return f"SharedArray(shape={self.shape}, dtype={self.dtype}{flag})"


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
    return SharedArray(_attach(*handle), offset, shape, dtype, writable)


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
