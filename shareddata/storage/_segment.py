"""Segments: anonymous shared files, mapped here, pickled as handles, attached, sealed, freed.

Note [How shared segments are made, shared and freed]
=====================================================
A segment is a ``memfd`` (RAM) or an ``O_TMPFILE`` in ``storage_dir``: never named,
so the kernel frees it with the last descriptor and mapping, whoever dies. Capacity
is checked first and every page allocated up front (Note [Allocating shared pages]),
so a full memory raises, never SIGBUSes. A segment pickles as a handle ``(pid, fd,
dev, inode, size)`` plus a ticket; the receiver opens ``/proc/<pid>/fd/<fd>``
(checked by device and inode) and hands out its own ``(pid, fd)`` in turn; the
sender holds the file until the ticket is acknowledged (Note [Handing a segment
over] in ``_handoff.py``). One mapping per segment per process. Read-only handles
are opened O_RDONLY and mapped ``MAP_PRIVATE``; a loaded dataset is sealed (Note
[Sealed segments]).
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
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ..errors import AttachError
from . import _handoff
from ._capacity import (
    FULL_ERRNOS,
    available_memory,
    check_capacity,
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
    file_identity,
    is_tmpfs,
    madvise,
    map_fd,
    replace_with_anonymous,
    unmap,
)
from ._pages import Population, populate, population_failed
from ._parent import watch_parent

__all__ = ["SEAL_WAIT", "Segment", "attach", "attached_segments"]

SEAL_WAIT = 2.0
"""Seconds a seal against writes waits for other processes' writable mappings to go."""
_ATTACHED: weakref.WeakValueDictionary[tuple[str, bool], Segment] = weakref.WeakValueDictionary()
_ATTACH_LOCK = ForkSafeLock()


class Segment:
    """One anonymous shared file, mapped into this process (:meth:`create` or unpickle)."""

    def __init__(
        self, fd: int, size: int, token: str, writable: bool = True, what: str = "a shared segment"
    ) -> None:
        self.fd = fd
        self.size = size
        self.token = token
        self.writable = writable
        self._ident = file_identity(fd)
        with named_os_errors(what, size):  # Note [One descriptor per segment]
            self.address = map_fd(fd, size, private=not writable)
        self._unmap = weakref.finalize(self, unmap, self.address, size)
        self._unmap.atexit = False
        self._finalizer = weakref.finalize(self, _handoff.release, fd)
        self.created_here = False  # set by create(): only the creator may discard()

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A writable ``uint8`` array over the mapping; it and its views hold the segment."""
        if nbytes is None:
            nbytes = self.size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) beyond a segment of {self.size}")
        # over the whole segment: ctypes keeps one array type per length, forever
        raw = (ctypes.c_uint8 * self.size).from_address(self.address)
        raw.segment = self  # type: ignore[attr-defined]  # the base of every view
        return np.frombuffer(memoryview(raw), np.uint8)[offset : offset + nbytes]

    @classmethod
    def create(
        cls,
        nbytes: int,
        storage_dir: str | os.PathLike[str] | None = None,
        what: str = "this allocation",
        reserve: bool = True,
        ahead: bool = False,
    ) -> Segment:
        """Allocate ``nbytes`` (RAM, or ``storage_dir``), every page reserved first.

        ``reserve=False`` only sizes the file, for a writer using ``os.pwrite``.
        ``ahead`` returns while threads allocate the pages (Note [Filling while the
        pages are allocated]); end with :meth:`finish_population` or
        :meth:`stop_population`. Raises SharedMemoryFullError when there is no room.
        """
        directory = resolve_storage_dir(storage_dir)
        with named_os_errors(what):  # no descriptor left (reading the room takes one too)
            return cls._create(max(int(nbytes), 1), directory, what, reserve, ahead)

    @classmethod
    def _create(
        cls, size: int, directory: str | None, what: str, reserve: bool, ahead: bool
    ) -> Segment:
        check_capacity(size, directory, what)
        fd = anonymous_file(directory)
        # Note [Allocating shared pages]
        by_faults = reserve and (directory is None or is_tmpfs(fd))
        try:
            if reserve and not by_faults:
                fallocate(fd, size, directory, what)
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                if e.errno in FULL_ERRNOS:
                    raise full_error(size, available_memory(directory), directory, what) from e
                raise
            segment = cls(fd, size, secrets.token_hex(8), what=what)
        except BaseException:
            os.close(fd)
            raise
        segment.created_here = True
        if reserve:
            try:
                if ahead and directory is None and available_memory(None) >= 2 * size:
                    segment._population = Population(segment, directory, what)
                else:
                    segment._reserve(by_faults, directory, what)
            except BaseException:
                segment.close()
                raise
        return segment._register()

    _population: Population | None = None

    def _reserve(self, by_faults: bool, directory: str | None, what: str) -> None:
        """Allocate (``by_faults``) and map every page: Note [Allocating shared pages]."""
        if by_faults:
            madvise(self.address, self.size, MADV_HUGEPAGE)  # a hint; may do nothing
        error = populate(self.address, self.size)
        if by_faults and error:
            population_failed(error, self.fd, self.size, directory, what)

    def finish_population(self) -> None:
        """Wait for the pages of ``create(ahead=True)``; SharedMemoryFullError if one failed."""
        if self._population is not None:
            self._population.finish()
            self._population = None

    def stop_population(self) -> None:
        """Stop allocating the pages of ``create(ahead=True)`` and wait for the threads."""
        if self._population is not None:
            self._population.stop()
            self._population = None

    def handle(self, ticket: bool = False) -> tuple[Any, ...]:
        """What pickling sends; ``ticket`` holds the file until the receiver opened it."""
        drawn = _handoff.ticket(self.fd, self.created_here) if ticket else ()
        return (os.getpid(), self.fd, self._ident, self.size, self.token, drawn)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce(ticket=False)

    def _reduce(self, ticket: bool) -> tuple[Any, ...]:
        return (attach, (*self.handle(ticket), self.writable))

    def _register(self) -> Segment:
        with _ATTACH_LOCK:
            _ATTACHED[(self.token, self.writable)] = self
        return self

    def close(self) -> None:
        """Unmap and close now: for a segment that no array refers to (a failed create)."""
        _ATTACHED.pop((self.token, self.writable), None)
        self._unmap()
        self._finalizer()

    def seal(self, write: bool = True) -> bool:
        """Seal against resizing and, with ``write``, any write: Note [Sealed segments].

        Returns whether the file is sealed (False in a ``storage_dir``).
        """
        if write and self.writable:
            with named_os_errors("a loaded dataset's memory", self.size):
                map_fd(self.fd, self.size, private=True, at=self.address)
            madvise(self.address, self.size, MADV_POPULATE_READ)  # map its pages here again
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

    def discard(self) -> None:
        """Free now, whatever refers to it (creator only): Note [Freeing a failed load]."""
        if not self.created_here:
            raise RuntimeError("only the process that created a segment may discard it")
        _handoff.forget(self.fd)
        _ATTACHED.pop((self.token, self.writable), None)
        if not replace_with_anonymous(self.address, self.size):
            return  # could not: the views keep it until they are gone
        self._finalizer()

    def __repr__(self) -> str:
        return f"Segment(size={self.size}, fd={self.fd}, token={self.token!r})"


# Note [Freeing a failed load]
# ============================
# A failed load's traceback (or ``sys.last_value``) may still hold its arrays, which
# would keep a huge load in RAM and fail the retry. The loader discards the segment at
# once: the mapping is replaced in place by anonymous zero pages (``MAP_FIXED``), so
# leftover arrays read zeros, and the only descriptor is closed.


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
# shared writable mapping exists; ``MADV_POPULATE_READ`` maps the pages back) and adds
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
        watch_parent(pid)  # a DataLoader worker exits with its main process: Note in _parent.py
        # a writable mapping serves read-only arrays too, never the other way
        existing = _ATTACHED.get((token, True)) or (
            None if writable else _ATTACHED.get((token, False))
        )
        if existing is not None:
            _handoff.acknowledge(pid, drawn)
            return existing
        path = f"/proc/{pid}/fd/{fd}"
        what = f"shared segment {token} sent by process {pid}"
        try:
            with named_os_errors(what):
                new_fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
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
            if file_identity(new_fd) != tuple(ident):
                raise AttachError(
                    f"cannot attach shared segment {token}: {path} now refers to another "
                    "file (the sender closed the segment and reused the descriptor)."
                )
            _handoff.acknowledge(pid, drawn)
            segment = Segment(new_fd, size, token, writable=writable, what=what)
        except BaseException:
            os.close(new_fd)
            raise
        _ATTACHED[(token, writable)] = segment
        return segment


def attached_segments() -> list[Segment]:
    """Every segment mapped in this process (each once, however many arrays use it)."""
    with _ATTACH_LOCK:
        return list(_ATTACHED.values())


# multiprocessing's pickler draws a ticket: Note [Handing a segment over]
ForkingPickler.register(Segment, functools.partial(Segment._reduce, ticket=True))
