"""Segment: the one owner of a shared file in this process.

Note [How shared segments are made, shared and freed]
=====================================================
A segment is a ``memfd`` (RAM) or an ``O_TMPFILE`` in ``storage_dir``: never named,
so the kernel frees it with the last descriptor and mapping, whoever dies. In each
process one :class:`Segment` owns it: its descriptor, its one mapping, the threads
that populate it and the tickets drawn on it. It is made by :meth:`Segment.create`
(capacity checked first, every page populated up front: Note [Allocating shared
pages] in ``_pages.py``, so a full memory raises, never SIGBUSes), by
:meth:`Segment.adopt` (a file written with ``pwrite``) or by unpickling
(:func:`attach`). It is open until :meth:`Segment.close` (or until nothing refers to
it: every view holds it); a closed segment refuses every use. It pickles as a handle
``(pid, fd, dev, inode, size)`` plus a ticket; the receiver opens
``/proc/<pid>/fd/<fd>`` (checked by device and inode) and hands out its own
``(pid, fd)`` in turn; the sender's board holds the file until the ticket is
acknowledged (Note [Handing a segment over] in ``_handoff.py``). Read-only handles
are opened O_RDONLY and mapped ``MAP_PRIVATE``; a loaded dataset is sealed (Note
[Sealed segments]). What a process holds besides its segments (the ticket board, the
parent watcher) is reset in a fork child by this module's one at-fork hook.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ..errors import AttachError
from . import _handoff, _parent
from ._capacity import (
    FULL_ERRNOS,
    available_memory,
    check_capacity,
    descriptor_error,
    fallocate,
    full_error,
    named_os_errors,
    resolve_storage_dir,
)
from ._linux import (
    MADV_HUGEPAGE,
    MADV_POPULATE_READ,
    SEAL_ALL,
    SEAL_SIZE,
    ForkSafeLock,
    add_seals,
    anonymous_file,
    array_at,
    file_identity,
    is_tmpfs,
    madvise,
    map_fd,
    page_floor,
    replace_with_anonymous,
    unmap,
)
from ._pages import Population

SEAL_WAIT = 2.0  # seconds a seal against writes waits for others' writable mappings to go
_ATTACHED: weakref.WeakValueDictionary[tuple[str, bool], Segment] = weakref.WeakValueDictionary()
_ATTACH_LOCK = ForkSafeLock()  # one mapping per segment (and access mode) per process


class Segment:
    """One anonymous shared file, owned in this process (Note [How shared segments ...]).

    Made by :meth:`create`, :meth:`adopt` or unpickling; a context manager; after
    :meth:`close` every use raises ``ValueError``.

    Example:
        >>> with Segment.create(4096) as segment:
        ...     segment.view(0, 3)[:] = 7
        ...     segment.view(0, 3).tolist()
        [7, 7, 7]
        >>> segment.closed
        True
        >>> segment.view()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Segment(size=4096, ...) is closed...
    """

    closed = False
    _population: Population | None = None
    _start_population: Callable[[], Population] | None = None
    _room: tuple[str | None, str] = (None, "a shared segment")  # storage_dir, what (errors)

    def __init__(
        self,
        fd: int,
        size: int,
        token: str,
        writable: bool = True,
        *,
        created: bool = False,
        what: str = "a shared segment",
    ) -> None:
        self.fd, self.size, self.token, self.writable = fd, size, token, writable
        self.created_here = created  # only the creator may discard()
        self.identity = file_identity(fd)
        with named_os_errors(what, size):  # Note [One descriptor per segment]
            self.address = map_fd(fd, size, private=not writable)
        self._unmap = weakref.finalize(self, unmap, self.address, size)
        self._unmap.atexit = False  # other finalizers may still read it at exit
        self._release = weakref.finalize(self, _handoff.release, fd)

    @classmethod
    def create(
        cls,
        nbytes: int,
        storage_dir: str | os.PathLike[str] | None = None,
        what: str = "this allocation",
        reserve: bool = True,
        ahead: bool = False,
    ) -> Segment:
        """Allocate ``nbytes`` (RAM, or ``storage_dir``), every page populated first.

        ``reserve=False`` only sizes the file, for a writer using ``os.pwrite``.
        ``ahead`` returns while threads populate the pages (Note [Filling while the
        pages are allocated] in ``_pages.py``): write a range after :func:`ready`, end
        with :meth:`finish_population`. SharedMemoryFullError when there is no room.
        """
        directory = resolve_storage_dir(storage_dir)
        size = max(int(nbytes), 1)
        with named_os_errors(what):  # no descriptor left (reading the room takes one too)
            check_capacity(size, directory, what)
            fd = anonymous_file(directory)
            by_faults = reserve and (directory is None or is_tmpfs(fd))  # RAM: populated
            try:
                if reserve and not by_faults:  # a disk file is fallocate-d first
                    fallocate(fd, size, directory, what)
                try:
                    os.ftruncate(fd, size)
                except OSError as e:
                    if e.errno in FULL_ERRNOS:
                        raise full_error(size, available_memory(directory), directory, what) from e
                    raise
                segment = cls(fd, size, secrets.token_hex(8), created=True, what=what)
                segment._room = (directory, what)
            except BaseException:
                os.close(fd)
                raise
            if reserve:
                try:
                    segment._reserve(by_faults, ahead, directory, what)
                except BaseException:
                    segment.close()
                    raise
        return segment._register()

    def _reserve(self, by_faults: bool, ahead: bool, directory: str | None, what: str) -> None:
        """Populate every page (Note [Allocating shared pages] in ``_pages.py``)."""
        failed = None
        if by_faults:  # a page that cannot be had is SharedMemoryFullError
            failed = functools.partial(_population_failed, self.fd, self.size, directory, what)
            madvise(self.address, self.size, MADV_HUGEPAGE)  # a hint; may do nothing
        start = functools.partial(Population, self.address, self.size, failed=failed)
        if ahead and directory is None and available_memory(None) >= 2 * self.size:
            self._start_population = start  # by the first ready(): a copy_file needs none
        else:
            self._population = start()
            self.finish_population()

    @classmethod
    def adopt(cls, fd: int, written: int, what: str) -> Segment:
        """The file ``fd``, filled with ``pwrite`` (``written`` bytes), as a segment owning it.

        Its pages are mapped here by the seal that ends the load (Note [Sealed segments]).
        """
        size = max(written, 1)
        os.ftruncate(fd, size)
        return cls(fd, size, secrets.token_hex(8), created=True, what=what)._register()

    def _register(self) -> Segment:
        with _ATTACH_LOCK:
            _ATTACHED[(self.token, self.writable)] = self
        return self

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(
                f"{self!r} is closed: this process let go of its memory. Use the arrays "
                "of an open segment, or unpickle the handle again from a process holding it."
            )

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A writable ``uint8`` array over the mapping; it and its views hold the segment."""
        self._check_open()
        if nbytes is None:
            nbytes = self.size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) beyond a segment of {self.size}")
        # over the whole segment: ctypes keeps one array type per length, forever
        raw = (ctypes.c_uint8 * self.size).from_address(self.address)
        raw.segment = self  # type: ignore[attr-defined]  # the base of every view (ready())
        return np.frombuffer(memoryview(raw), np.uint8)[offset : offset + nbytes]

    def private_view(self, offset: int, nbytes: int) -> np.ndarray:
        """A copy-on-write mapping of its own over ``nbytes`` at ``offset``: writes stay here."""
        self._check_open()
        start = page_floor(offset)
        length = offset + nbytes - start
        with named_os_errors("a tensor received from another process", length):
            address = map_fd(self.fd, length, start, private=True)
        mapped = array_at(address, length)
        weakref.finalize(mapped, unmap, address, length).atexit = False
        return mapped[offset - start : offset - start + nbytes]

    def ready(self, end: int) -> None:
        """Wait until bytes ``[0, end)`` may be written; SharedMemoryFullError if a page failed."""
        start, self._start_population = self._start_population, None
        if start is not None:
            self._population = start()
            weakref.finalize(self, setattr, self._population, "stopped", True)  # if dropped
        population = self._population  # (read once: stop_population may clear it)
        if population is not None:
            population.wait(end)

    def copy_file(self, src: int, src_offset: int, offset: int, nbytes: int) -> int:
        """Copy up to ``nbytes`` of file ``src`` at ``src_offset`` to ``offset``: bytes copied.

        The kernel copies into the file (``sendfile``), not through the mapping, so its
        pages need no :meth:`ready` and a full memory is SharedMemoryFullError, never a
        SIGBUS; 0 means ``src`` ended. Note [Filling while the pages are allocated].
        """
        self._check_open()
        with named_os_errors(self._room[1]):  # its own file position
            fd = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.lseek(fd, offset, os.SEEK_SET)
            try:
                return os.sendfile(fd, src, src_offset, nbytes)
            except OSError as e:
                if e.errno not in FULL_ERRNOS:
                    raise
                directory, what = self._room
                raise full_error(self.size, available_memory(directory), directory, what) from e
        finally:
            os.close(fd)

    def finish_population(self) -> None:
        """Wait for every page of ``create(ahead=True)``; SharedMemoryFullError if one failed."""
        self._start_population = None
        population = self._population
        if population is not None:
            population.finish()
            self._population = None

    def stop_population(self) -> None:
        """Stop populating the pages of ``create(ahead=True)`` and wait for the threads."""
        population, self._population = self._population, None
        self._start_population = None
        if population is not None:
            population.stop()

    def handle(self, ticket: bool = False) -> tuple[Any, ...]:
        """What pickling sends; ``ticket`` holds the file until the receiver opened it."""
        self._check_open()
        drawn = _handoff.BOARD.ticket(self.fd, self.created_here) if ticket else ()
        return (os.getpid(), self.fd, self.identity, self.size, self.token, drawn)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce(ticket=False)

    def _reduce(self, ticket: bool) -> tuple[Any, ...]:
        return (attach, (*self.handle(ticket), self.writable))

    def seal(self, write: bool = True) -> bool:
        """Seal against resizing and, with ``write``, any write: Note [Sealed segments].

        Returns whether the file is sealed (False in a ``storage_dir``).
        """
        self._check_open()
        if write and self.writable:
            with named_os_errors("a loaded dataset's memory", self.size):
                map_fd(self.fd, self.size, private=True, at=self.address)
            # map its pages here again: a worker's pages are then shared, not private
            # (USS), as Note [Sealed segments] says
            madvise(self.address, self.size, MADV_POPULATE_READ)
            with _ATTACH_LOCK:
                _ATTACHED.pop((self.token, True), None)
                self.writable = False
                _ATTACHED[(self.token, False)] = self
        deadline = time.monotonic() + SEAL_WAIT
        while True:
            try:
                return add_seals(self.fd, SEAL_ALL if write else SEAL_SIZE)
            except OSError as e:  # EBUSY: another process still maps it shared and writable
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    break
            time.sleep(0.05)
        warnings.warn(
            f"{self!r}: another process still maps this memory shared and writable after "
            f"{SEAL_WAIT:.0f} s, so it is sealed against resizing only and that process can "
            "still write it (Note [Sealed segments]); let processes that wrote into a load "
            "exit before it completes.",
            RuntimeWarning,
            stacklevel=2,
        )
        return add_seals(self.fd, SEAL_SIZE)

    def close(self) -> None:
        """Let go of the file in this process now (idempotent): Note [Freeing a failed load].

        Arrays still over it read zeros; a receiver with a ticket still gets the file.
        """
        if self.closed:
            return
        self.closed = True
        self.stop_population()
        with _ATTACH_LOCK:
            if _ATTACHED.get((self.token, self.writable)) is self:
                del _ATTACHED[(self.token, self.writable)]
        if replace_with_anonymous(self.address, self.size):  # else the views keep it
            self._release()  # closed now, or held for receivers by the board

    def discard(self) -> None:
        """:meth:`close` with no receiver waited for: a failed load (the creator only)."""
        if not self.created_here:
            raise RuntimeError("only the process that created a segment may discard it")
        if not self.closed:
            _handoff.BOARD.forget(self.fd)
            self.close()

    def __enter__(self) -> Segment:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment(size={self.size}, fd={self.fd}, token={self.token!r})"


def _population_failed(fd: int, size: int, directory: str | None, what: str, error: int) -> None:
    """A page could not be populated: SharedMemoryFullError, or fallocate on Linux < 5.14."""
    if error in FULL_ERRNOS or error == errno.EFAULT:  # EFAULT: the fault hit SIGBUS
        raise full_error(size, available_memory(directory), directory, what)
    fallocate(fd, size, directory, what)  # EINVAL: MADV_POPULATE_WRITE unknown


def segment_of(array: np.ndarray) -> tuple[Segment, int] | None:
    """The segment under ``array`` (through its base, :meth:`Segment.view`) and its offset.

    Example:
        >>> segment_of(np.zeros(4)) is None  # private memory
        True
    """
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    segment = getattr(getattr(base, "obj", None), "segment", None)
    if not isinstance(segment, Segment):
        return None
    return segment, array.__array_interface__["data"][0] - segment.address


def ready(array: np.ndarray, nbytes: int | None = None) -> None:
    """Wait until the pages under ``array`` (its first ``nbytes``) may be written.

    Example:
        >>> ready(np.zeros(4))  # private memory: nothing to wait for
    """
    found = segment_of(array)
    if found is not None:
        segment, start = found
        segment.ready(start + (array.nbytes if nbytes is None else nbytes))


# Note [Freeing a failed load]
# ============================
# A failed load's traceback (or ``sys.last_value``) may still hold its arrays, which
# would keep a huge load in RAM and fail the retry. The loader discards the segment at
# once: the mapping is replaced in place by anonymous zero pages (``MAP_FIXED``), so
# leftover arrays read zeros, and the only descriptor is closed. ``close`` does the
# same, but leaves the descriptor to the board while receivers hold tickets.


# Note [One descriptor per segment]
# =================================
# A mapping holds no descriptor: ``map_fd`` (libc ``mmap``), not ``mmap.mmap``, which
# dups it (``ulimit -n`` reached at half as many datasets). Arrays hold the ``Segment``
# through a ctypes buffer; a finalizer unmaps when the last is gone (not at exit).


# Note [Sealed segments]
# ======================
# Any process of the user could reopen a segment read-write via ``/proc`` and write or
# ``ftruncate`` it. Once a load is complete (``seal`` in ``_array.py``) the loader
# remaps the file copy-on-write at the same address (``F_SEAL_WRITE`` is EBUSY while a
# shared writable mapping exists) and maps its pages again (``MADV_POPULATE_READ``:
# a page a worker reads is then shared with the loader, not private to the worker in
# its USS, which would look like a copy), then adds
# ``F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``. Receivers open it
# O_RDONLY and acknowledge on the sender's ticket board (``_handoff.py``). A
# ``SharedArray`` is sealed against resizing only; ``storage_dir`` files cannot be.


def attach(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    size: int,
    token: str,
    drawn: tuple[int, ...] = (),
    writable: bool = True,
) -> Segment:
    """Map the segment ``pid`` holds as ``fd`` (unpickling), then acknowledge ``drawn``."""
    with _ATTACH_LOCK:
        _parent.watch_parent(pid)  # a worker exits with its main process: Note in _parent.py
        # a writable mapping serves read-only arrays too, never the other way
        segment = _ATTACHED.get((token, True)) or (
            None if writable else _ATTACHED.get((token, False))
        )
        if segment is None:
            segment = _open(pid, fd, ident, size, token, drawn, writable)
            _ATTACHED[(token, writable)] = segment
            return segment
    _handoff.acknowledge(pid, drawn)  # mapped here already: the sender may let go
    return segment


def _open(
    pid: int, fd: int, ident: tuple[int, int], size: int, token: str, drawn: Any, writable: bool
) -> Segment:
    what = f"shared segment {token} sent by process {pid}"
    why = (
        f"the sender closed it, exited or was killed before this process received it, or "
        f"{_handoff.HOLD:.0f} s passed. Keep the dataset or SharedArray alive in the sending "
        "process until every receiver has unpickled it."
    )
    new_fd = open_sent(pid, fd, ident, what, why, writable=writable)
    try:
        _handoff.acknowledge(pid, drawn)  # the file is held here: the sender may let go
        return Segment(new_fd, size, token, writable, what=what)
    except BaseException:
        os.close(new_fd)
        raise


def open_sent(
    pid: int, fd: int, ident: tuple[int, int], what: str, why: str, *, writable: bool = False
) -> int:
    """Open ``/proc/<pid>/fd/<fd>`` (read-only unless ``writable``), checked to be ``ident``."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        new_fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise AttachError(
            f"cannot receive {what}: the sender no longer holds it ({path} is gone): {why}"
        ) from e
    except OSError as e:  # the descriptor limit, or access to /proc
        raise descriptor_error(e, what) or AttachError(
            f"cannot receive {what}: opening {path} failed ({e}). Receiving needs the "
            f"same user as process {pid} and read access to its /proc entry (ptrace read); a "
            "hardened /proc (hidepid) or a setuid/non-dumpable sender prevents it."
        ) from e
    if file_identity(new_fd) == tuple(ident):
        return new_fd
    os.close(new_fd)
    raise AttachError(
        f"cannot receive {what}: the sender no longer holds it ({path} now refers to "
        f"another file): {why}"
    )


def attached_segments() -> list[Segment]:
    """Every segment mapped in this process (each once, however many arrays use it)."""
    with _ATTACH_LOCK:
        return list(_ATTACHED.values())


def _after_fork_in_child() -> None:
    _handoff.renew_in_child()  # the parent's held descriptors and board are not ours
    _parent.forget_in_child()  # nor its parent watcher


os.register_at_fork(after_in_child=_after_fork_in_child)
# multiprocessing's pickler draws a ticket: Note [Handing a segment over]
ForkingPickler.register(Segment, functools.partial(Segment._reduce, ticket=True))
