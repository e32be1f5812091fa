"""Thin wrappers over the Linux calls that Python does not expose (through libc).

``mmap`` at a fixed address, ``madvise`` with the GIL released, ``fstatfs``, the
address of a Python ``mmap``, and the anonymous files segments are made of. Facts
they rely on: ``docs/internals.md#memfd`` and ``docs/internals.md#allocating-pages``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import weakref
from typing import Any

__all__ = [
    "ForkSafeLock",
    "MADV_HUGEPAGE",
    "MADV_POPULATE_WRITE",
    "MAP_PRIVATE_ANONYMOUS_FIXED",
    "MAP_PRIVATE_FIXED",
    "PROT_READ_WRITE",
    "address_of",
    "close_fd",
    "file_identity",
    "is_tmpfs",
    "libc",
    "libc_mmap",
    "madvise",
    "open_tmpfile",
    "replace_with_anonymous",
]

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module names it only on 3.13+
PROT_READ_WRITE = 0x1 | 0x2
MAP_PRIVATE_FIXED = 0x02 | 0x10
MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
_TMPFS_MAGIC = 0x01021994


class ForkSafeLock:
    """A lock that a ``fork`` child always gets unlocked.

    A child is forked from one thread of its parent; a lock that another thread
    held at that moment stays held in the child forever, and its first use there
    deadlocks (a ``multiprocessing.Pool`` forks replacement workers from its
    worker-handler thread while its result-handler thread unpickles, and attaches,
    what workers returned). What such a lock guards here are registries whose worst
    state after a fork is an entry too many.

    Example:
        >>> lock = ForkSafeLock()
        >>> with lock:
        ...     pass
    """

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _FORK_SAFE_LOCKS.add(self)

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
    """The C library, with ``madvise`` and ``mmap`` typed (looked up once).

    Look it up before forking: a fork child must not ``dlopen`` (the loader's lock
    may be held by a thread that does not exist in the child).

    Example:
        >>> libc().getpid() == os.getpid()
        True
    """
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    return lib


def libc_mmap() -> Any:
    """The C library's ``mmap(addr, length, prot, flags, fd, offset)``, returning the address."""
    return libc().mmap


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


def replace_with_anonymous(mapped: mmap.mmap, size: int, ident: tuple[int, int]) -> bool:
    """Swap ``mapped``'s pages for anonymous zeros and let go of the file.

    Note [Freeing a failed load] in ``_storage/_segment.py``: the mapping is replaced in place
    (``MAP_FIXED``), and every descriptor of this process on the file ``ident``
    (device, inode) is pointed at ``/dev/null`` (``dup2``), so the ``mmap`` object's
    own duplicate stays valid and is closed by it later.

    Returns:
        True on success; False if the mapping could not be replaced.
    """
    address = address_of(mapped)
    result = libc_mmap()(address, size, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0)
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
