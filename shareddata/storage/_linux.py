"""Thin wrappers over the Linux calls that Python does not expose (through libc).

``mmap`` at a fixed address, ``madvise`` with the GIL released, ``fstatfs``, the
address of a Python ``mmap``, and the anonymous files segments are made of. Facts
they rely on: ``docs/internals.md#memfd`` and ``docs/internals.md#allocating-pages``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import threading
import weakref
from typing import Any

__all__ = [
    "ForkSafeLock",
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "MAP_PRIVATE_ANONYMOUS_FIXED",
    "MAP_PRIVATE_FIXED",
    "PROT_READ_WRITE",
    "SEAL_ALL",
    "SEAL_SIZE",
    "add_seals",
    "address_of",
    "anonymous_file",
    "array_at",
    "close_fd",
    "file_identity",
    "is_tmpfs",
    "libc",
    "map_fd",
    "page_floor",
    "unmap",
    "madvise",
    "open_tmpfile",
    "replace_with_anonymous",
]

MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux >= 5.14; the mmap module names them only on 3.13+
MADV_POPULATE_WRITE = 23
PROT_READ_WRITE = 0x1 | 0x2
MAP_PRIVATE_FIXED = 0x02 | 0x10
MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
_TMPFS_MAGIC = 0x01021994


# Note [One lock rule]
# ====================
# Every lock of the package is a :class:`ForkSafeLock` (a ``threading.Condition`` is
# built over one), and three rules hold wherever one is used:
#
# * a ``fork`` child gets every lock unlocked: a child is forked from one thread, and
#   a lock another thread held at that moment would stay held in the child forever
#   (a ``multiprocessing.Pool`` forks replacement workers from one thread while its
#   result thread attaches what workers returned). What the locks guard are
#   registries whose worst state after a fork is an entry too many, and each module
#   resets its own registries in the child (``os.register_at_fork``);
# * a weakref callback or a finalizer never takes a lock: it may run inside any code
#   of the process, when a garbage collection frees an object, also while that code
#   holds the very lock. Callbacks only queue work (a ``deque.append``) or do what
#   needs no lock (close a descriptor nobody else knows, unmap a range only they
#   own); the queued work is done by the next caller that takes the lock;
# * every wait has a bound (a timeout, or a check that the awaited thread still
#   runs): nothing shareddata does may hang a program.


class ForkSafeLock:
    """A lock that a ``fork`` child always gets unlocked (Note [One lock rule]).

    Example:
        >>> lock = ForkSafeLock()
        >>> with lock:
        ...     pass
        >>> import threading
        >>> ready = threading.Condition(ForkSafeLock())
        >>> with ready:
        ...     ready.wait(0.01)
        False
    """

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _FORK_SAFE_LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``."""
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """As ``threading.Lock.release``."""
        self._lock.release()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


_FORK_SAFE_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _unlock_in_child() -> None:
    for lock in list(_FORK_SAFE_LOCKS):
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    """The C library, with ``mmap``, ``munmap`` and ``madvise`` typed: the package's one ``CDLL``.

    Looked up when this module is imported, so before any fork: a fork child must
    not ``dlopen`` (the loader's lock may be held by a thread that does not exist in
    the child). ctypes releases the GIL during each call.

    Example:
        >>> libc().getpid() == os.getpid()
        True
    """
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.munmap.restype = ctypes.c_int
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    return lib


libc()

MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_FAILED = 2**64 - 1  # (void *) -1 as ctypes returns it
_PAGE = os.sysconf("SC_PAGE_SIZE")


def map_fd(
    fd: int, length: int, offset: int = 0, *, private: bool = False, at: int | None = None
) -> int:
    """Map ``length`` bytes of ``fd`` from ``offset`` (a multiple of the page size); the address.

    The package's one ``mmap`` wrapper: the mapping holds no descriptor and no Python
    object (unmap it with :func:`unmap`). ``private``: copy-on-write (reads share the
    file's pages; a write copies the page into this process). ``at``: replace the
    pages mapped at that address (``MAP_FIXED``).

    Raises:
        OSError: the kernel refused (``ENOMEM``: no address space or over ``ulimit -v``).

    Example:
        >>> fd = os.memfd_create("probe"); os.ftruncate(fd, 4096)
        >>> address = map_fd(fd, 4096)
        >>> array_at(address, 4)[:] = 65; os.pread(fd, 4, 0)
        b'AAAA'
        >>> unmap(address, 4096); os.close(fd)
    """
    flags = (MAP_PRIVATE if private else MAP_SHARED) | (_MAP_FIXED if at is not None else 0)
    address = libc().mmap(at, length, PROT_READ_WRITE, flags, fd, offset)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(address)


def unmap(address: int, length: int) -> None:
    """Unmap ``[address, address + length)`` (mapped by :func:`map_fd`)."""
    libc().munmap(address, length)


def array_at(address: int, length: int) -> Any:
    """A ``uint8`` numpy array over ``length`` bytes at ``address`` (it does not own them)."""
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))


def page_floor(offset: int) -> int:
    """``offset`` rounded down to a page boundary (what ``mmap`` offsets must be)."""
    return offset - offset % _PAGE


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise`` with the GIL released (ctypes); 0 or the errno.

    Example:
        >>> m = mmap.mmap(-1, 1 << 20)
        >>> madvise(address_of(m), len(m), MADV_HUGEPAGE) in (0, errno.EINVAL)
        True
        >>> m.close()
    """
    if libc().madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def address_of(mapped: mmap.mmap) -> int:
    """The address where a Python ``mmap`` is mapped (no buffer export is kept)."""
    view = ctypes.c_char.from_buffer(mapped)  # writable for ACCESS_WRITE and ACCESS_COPY
    address = ctypes.addressof(view)
    del view  # release the buffer export at once
    return address


def file_identity(fd: int) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of the file ``fd`` is open on: what tells a segment apart.

    A receiver that opens ``/proc/<pid>/fd/<n>`` compares it with the sender's, since
    the sender may have closed ``n`` and reused the number for another file.

    Example:
        >>> fd = os.memfd_create("probe")
        >>> file_identity(fd) == file_identity(fd)
        True
        >>> os.close(fd)
    """
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def is_tmpfs(fd: int) -> bool:
    """Whether ``fd`` is a file on tmpfs (its pages are RAM, like a memfd's).

    Example:
        >>> fd = os.memfd_create("probe")
        >>> is_tmpfs(fd)
        True
        >>> os.close(fd)
    """
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
    try:
        if libc().fstatfs(fd, buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == _TMPFS_MAGIC


def close_fd(fd: int) -> None:
    """Close ``fd``, ignoring a descriptor that is already closed."""
    try:
        os.close(fd)
    except OSError:
        pass


SEAL_SIZE = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
"""No growing, no shrinking, no further seal: what a writable ``SharedArray`` gets."""
SEAL_ALL = SEAL_SIZE | fcntl.F_SEAL_WRITE
"""And no write at all, from any descriptor or shared mapping: a loaded dataset."""


def anonymous_file(directory: str | None) -> int:
    """A new anonymous file: a memfd that can be sealed (RAM), or ``O_TMPFILE`` in ``directory``.

    Example:
        >>> fd = anonymous_file(None); os.ftruncate(fd, 4096)
        >>> add_seals(fd, SEAL_ALL), fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEAL_ALL
        (True, True)
        >>> os.close(fd)
    """
    if directory is None:
        return os.memfd_create("shareddata", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    return open_tmpfile(directory)


def add_seals(fd: int, seals: int) -> bool:
    """Seal the file ``fd`` is open on (``F_ADD_SEALS``); False where it cannot be sealed.

    Only a memfd made with ``MFD_ALLOW_SEALING`` can be: files in a ``storage_dir``
    (``EINVAL`` on a disk, ``EPERM`` on tmpfs) cannot.

    Raises:
        OSError: ``EBUSY`` for ``F_SEAL_WRITE`` while a writable shared mapping exists.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EPERM):
            return False
        raise
    return True


def open_tmpfile(directory: str) -> int:
    """An anonymous file in ``directory`` (``O_TMPFILE``; else created and unlinked at once)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    import tempfile

    fd, path = tempfile.mkstemp(prefix=".shareddata-", dir=directory)
    os.unlink(path)
    return fd


def replace_with_anonymous(address: int, size: int) -> bool:
    """Swap the pages mapped at ``address`` for anonymous zeros (``MAP_FIXED``), in place.

    Note [Freeing a failed load] in ``storage/_segment.py``: arrays over the range stay
    valid memory; the file's pages are no longer mapped here.

    Returns:
        True on success; False if the mapping could not be replaced.

    Example:
        >>> fd = os.memfd_create("probe"); os.ftruncate(fd, 4096)
        >>> address = map_fd(fd, 4096); array_at(address, 1)[0] = 7
        >>> replace_with_anonymous(address, 4096), int(array_at(address, 1)[0])
        (True, 0)
        >>> unmap(address, 4096); os.close(fd)
    """
    result = libc().mmap(address, size, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0)
    return bool(result == address)
