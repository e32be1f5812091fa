"""Segments: anonymous shared files, mapped here, pickled as handles, attached, sealed, freed.

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
arrays refer to it (:func:`attached_segments`).

Read-only handles (the datasets' columns) are opened read-only and mapped
copy-on-write (``MAP_PRIVATE``) by the receiver: reads map the same physical pages,
and a write forced through stays in the writer. A loaded dataset's file is sealed
against every write, so no process can change it at all (Note [Sealed segments]).
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
    """One anonymous shared file, mapped into this process.

    Use :meth:`create` or unpickle a handle; do not call the constructor directly.
    The segment is freed by the kernel when every process has dropped it.
    """

    def __init__(
        self, fd: int, size: int, token: str, writable: bool = True, what: str = "a shared segment"
    ) -> None:
        self.fd = fd
        self.size = size
        self.token = token
        self.writable = writable
        self._ident = file_identity(fd)
        # Note [One descriptor per segment]: mapped with no descriptor of its own
        with named_os_errors(what, size):  # no address space left: named
            self.address = map_fd(fd, size, private=not writable)
        # unmapped when nothing refers to the segment any more (every array over it
        # holds it: :meth:`view`); not at exit, where other finalizers may still read it
        self._unmap = weakref.finalize(self, unmap, self.address, size)
        self._unmap.atexit = False
        # closes fd, or holds it while a receiver has yet to open it (_handoff.release)
        self._finalizer = weakref.finalize(self, _handoff.release, fd)
        self.created_here = False  # set by create(): only the creator may discard()

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A writable ``uint8`` array over ``nbytes`` at ``offset`` of the mapping.

        The array, and every view of it (numpy or torch), holds the segment: the
        mapping stays as long as any of them does.
        """
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
        with named_os_errors(what):  # no descriptor left (reading the room takes one too)
            return cls._create(max(int(nbytes), 1), directory, what, reserve, ahead)

    @classmethod
    def _create(
        cls, size: int, directory: str | None, what: str, reserve: bool, ahead: bool
    ) -> Segment:
        check_capacity(size, directory, what)
        fd = anonymous_file(directory)
        # Shared memory (a memfd, or a file on tmpfs) is reserved by populating it:
        # Note [Allocating shared pages]
        by_faults = reserve and (directory is None or is_tmpfs(fd))
        try:
            # a disk file is reserved with fallocate; where it cannot be, sized only
            # (its capacity was checked above)
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
        """Seal the file against growing and shrinking and, with ``write``, any write.

        ``write`` is for a dataset's segment once it is filled: this process's mapping
        becomes copy-on-write first (a shared writable one would keep the seal out),
        and the segment read-only. A writable ``SharedArray`` is sealed with
        ``write=False``. Note [Sealed segments].

        Returns:
            Whether the file is sealed: False for a file in a ``storage_dir``.
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
        # views may be alive: swap the pages out from under them
        if not replace_with_anonymous(self.address, self.size):
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
# discards the segment at once, whatever still refers to it: the mapping is replaced
# in place by anonymous zero pages (``mmap`` with ``MAP_FIXED`` at the same address),
# so a leftover array stays valid memory and reads zeros instead of crashing, and the
# segment's descriptor, its only one in this process (Note [One descriptor per
# segment]), is closed. The kernel then frees the pages at once; the anonymous range
# is unmapped when the last array over it is gone. Nothing in ``shareddata`` touches
# a discarded segment again.


# Note [One descriptor per segment]
# =================================
# A process that maps a segment holds one descriptor of it: the one it hands out as
# ``/proc/<pid>/fd/<fd>`` (Note [How shared segments are made, shared and freed]).
# The mapping itself holds none: it is made with ``map_fd`` (``mmap`` through libc),
# not Python's ``mmap.mmap``, which keeps a duplicate of the descriptor for as long
# as it lives (two per segment: ``ulimit -n`` was reached at half as many datasets).
# Arrays over the segment are numpy arrays over a ctypes buffer that holds the
# ``Segment`` (:meth:`Segment.view`), so the mapping lives as long as any array,
# tensor or view over it, and is unmapped by a finalizer when the last is gone (not
# at exit: other finalizers may still read it). When the limit is reached anyway,
# :class:`~shareddata.TooManyOpenFilesError` names it and the fix; when the address
# space is (``ulimit -v``), :class:`~shareddata.SharedMemoryFullError`.


# Note [Sealed segments]
# ======================
# Any process of the user can reopen a segment read-write via ``/proc/<pid>/fd/<n>``
# and ``pwrite`` every process's rows, or ``ftruncate`` the file (SIGBUS in every
# reader). So segments are memfds made with ``MFD_ALLOW_SEALING``; once a load is
# complete (``seal`` in ``_array.py``, the loading path of every kind), the loader
# maps the file again copy-on-write at the same address (``F_SEAL_WRITE`` is EBUSY
# while a writable shared mapping exists; ``MADV_POPULATE_READ`` maps the pages back)
# and adds ``F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``: writes,
# shared writable mappings and resizing then fail with EPERM in every process, and a
# forced write into a copy-on-write mapping stays in the writer. Receivers open it
# O_RDONLY and acknowledge handoffs on the sender's ticket board (``_handoff.py``). A
# ``SharedArray`` is sealed against resizing only. Limit: ``storage_dir`` files
# cannot be sealed (``docs/how-it-works.md#sealed-segments``).


def attach(
    pid: int,
    fd: int,
    ident: tuple[int, int],
    size: int,
    token: str,
    drawn: tuple[int, ...] = (),
    writable: bool = True,
) -> Segment:
    """Map the segment that process ``pid`` holds as descriptor ``fd`` (unpickling).

    Acknowledges the ticket ``drawn`` once the file is held here, so the sender may
    let go of it (Note [Handing a segment over] in ``_handoff.py``).

    Raises:
        AttachError: the sender no longer holds the file, or may not be read.
        TooManyOpenFilesError: this process has no descriptor left (``ulimit -n``).
        SharedMemoryFullError: this process has no address space left (``ulimit -v``).
    """
    with _ATTACH_LOCK:
        watch_parent(pid)  # a DataLoader worker exits with its main process: Note in _parent.py
        # A writable mapping serves read-only arrays too; a copy-on-write one never
        # serves writable arrays (their writes must reach the other processes).
        existing = _ATTACHED.get((token, True)) or (
            None if writable else _ATTACHED.get((token, False))
        )
        if existing is not None:
            _handoff.acknowledge(pid, drawn)
            return existing
        path = f"/proc/{pid}/fd/{fd}"
        what = f"shared segment {token} sent by process {pid}"
        try:
            with named_os_errors(what):  # no descriptor left: named
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


def _open_for_attach(path: str, writable: bool) -> int:
    """Our own descriptor of the file at ``path``: read-only unless the arrays are writable."""
    return os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)


# multiprocessing's pickler (every queue, pipe, pool and process argument, torch's and
# the DataLoader's included) draws a ticket: Note [Handing a segment over].
ForkingPickler.register(Segment, functools.partial(Segment._reduce, ticket=True))
