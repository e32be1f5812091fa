"""The Linux calls Python lacks, through one libc ``CDLL``, and :class:`ForkSafeLock`.

Facts relied on: ``docs/internals.md#memfd`` and ``docs/internals.md#allocating-pages``.
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

MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux >= 5.14; the mmap module names them only on 3.13+
MADV_POPULATE_WRITE = 23
PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
_TMPFS_MAGIC = 0x01021994


# Note [One lock rule]
# ====================
# Every lock is a :class:`ForkSafeLock` (Conditions are built over one), and:
#
# * a ``fork`` child gets every lock unlocked (a lock held by another thread at the
#   fork would stay held forever); what the locks guard is reset in the child by one
#   at-fork hook per owner (``_segment.py``, ``crossing/_transport.py``);
# * a weakref callback or finalizer never takes a lock (it may run while its thread
#   holds it): it only queues work (``deque.append``) or closes/unmaps what it owns;
# * every wait has a bound: nothing shareddata does may hang a program.


class ForkSafeLock:
    """A lock that a ``fork`` child always gets unlocked (Note [One lock rule])."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _FORK_SAFE_LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
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
    """The package's one ``CDLL``, loaded at import (a fork child must not ``dlopen``)."""
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
    """Map ``fd`` (holding no descriptor); ``private``: copy-on-write; ``at``: ``MAP_FIXED``.

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
    libc().munmap(address, length)


def array_at(address: int, length: int) -> Any:
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))


def page_floor(offset: int) -> int:
    return offset - offset % _PAGE


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise`` with the GIL released; 0 or the errno."""
    if libc().madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def address_of(mapped: mmap.mmap) -> int:
    """The address of a Python ``mmap`` (no buffer export is kept)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def file_identity(fd: int) -> tuple[int, int]:
    """``(st_dev, st_ino)``: a reused descriptor number is told apart by it."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def is_tmpfs(fd: int) -> bool:
    """Whether ``fd`` is a file on tmpfs (its pages are RAM).

    >>> fd = os.memfd_create("probe"); is_tmpfs(fd)
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
    try:
        os.close(fd)
    except OSError:
        pass


SEAL_SIZE = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL  # a writable SharedArray
SEAL_ALL = SEAL_SIZE | fcntl.F_SEAL_WRITE  # a loaded dataset


def anonymous_file(directory: str | None) -> int:
    """A sealable memfd (RAM), or an anonymous file in ``directory``.

    Example:
        >>> fd = anonymous_file(None); os.ftruncate(fd, 4096)
        >>> add_seals(fd, SEAL_ALL), fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEAL_ALL
        (True, True)
        >>> os.close(fd)
    """
    if directory is None:
        return os.memfd_create("shareddata", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    import tempfile

    fd, path = tempfile.mkstemp(prefix=".shareddata-", dir=directory)
    os.unlink(path)
    return fd


def add_seals(fd: int, seals: int) -> bool:
    """``F_ADD_SEALS``; False for a ``storage_dir`` file; EBUSY while mapped shared writable."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EPERM):
            return False
        raise
    return True


def replace_with_anonymous(address: int, size: int) -> bool:
    """Swap the mapping at ``address`` for anonymous zeros in place (Note [Freeing a failed load]).

    Example:
        >>> fd = os.memfd_create("probe"); os.ftruncate(fd, 4096)
        >>> address = map_fd(fd, 4096); array_at(address, 1)[0] = 7
        >>> replace_with_anonymous(address, 4096), int(array_at(address, 1)[0])
        (True, 0)
        >>> unmap(address, 4096); os.close(fd)
    """
    result = libc().mmap(address, size, PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0)
    return bool(result == address)
