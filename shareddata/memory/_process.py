"""Measuring one process: :class:`ProcessMemory` and :func:`measure`.

Each process is read from ``/proc/<pid>/smaps_rollup`` (``psutil`` as a fallback);
the pages of a shareddata dataset are found in ``/proc/<pid>/smaps`` by the device
and inode of its segments. What each field means is in Note [How duplication is
measured] in ``_verify.py``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

import psutil

MIB = 1024 * 1024
KIB = 1024

#: A segment as ``/proc/<pid>/smaps`` names it: ``(device, inode)`` from ``os.stat``.
Segments = Collection[tuple[int, int]]


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in bytes (see Note [How duplication is measured]).

    Attributes:
        pid: process id.
        role: ``"main"``, ``"worker 0"``, ``"worker 1"``, ...
        rss: resident set size (shared pages counted in full).
        uss: unique set size (pages no other process maps).
        pss: proportional set size (shared pages divided among their users).
        shared: resident pages that another process maps too.
        pss_file: the part of ``pss`` backed by files (code, libraries, mapped
            files); 0 where the kernel does not report it.
        data_rss: resident pages of the dataset's shared segments this process maps
            (0 when the dataset is not a shareddata dataset).
        data_pss: this process's share of those pages (part of ``pss``).
        data_copied: private copies of the dataset's pages made in this process
            (a write to a copy-on-write mapping of a segment; part of ``data_pss``).
        data_file: the part of ``data_pss`` already counted in ``pss_file`` (segments
            in a ``storage_dir`` on disk).
        transport: PSS of batches in flight between workers and the main process
            (shared memory the DataLoader moves batches in; not the dataset).
    """

    pid: int
    role: str
    rss: int
    uss: int
    pss: int
    shared: int
    pss_file: int = 0
    data_rss: int = 0
    data_pss: int = 0
    data_copied: int = 0
    data_file: int = 0
    transport: int = 0

    @property
    def working(self) -> int:
        """Anonymous and shared memory outside the dataset's segments (file pages left out).

        Batches in flight (:attr:`transport`) are left out too. This is where a copy
        of a dataset that is *not* in shareddata's segments lives (an unpickled
        array, Python objects copied on write) -- and the process's own working
        memory.
        """
        return self.pss - self.pss_file - (self.data_pss - self.data_file) - self.transport

    def to_dict(self) -> dict[str, Any]:
        """Return the row as a JSON-serialisable dict."""
        return asdict(self)


def measure(pid: int | None = None, role: str = "", segments: Segments = ()) -> ProcessMemory:
    """Measure one process from ``/proc/<pid>/smaps_rollup``, or psutil where absent.

    Args:
        pid: the process to measure; ``None`` is the calling process.
        role: a label kept in the row (``"main"``, ``"worker 0"``, ...).
        segments: ``(st_dev, st_ino)`` of the dataset's shared segments, whose pages
            are reported apart (``data_*`` fields) from ``/proc/<pid>/smaps``.

    Returns:
        The process's RSS, USS, PSS and shared bytes.

    Raises:
        ProcessLookupError: the process does not exist (any more).
        PermissionError: the process belongs to another user.

    Example:
        >>> row = measure(role="main")
        >>> 0 < row.uss <= row.rss
        True
    """
    pid = os.getpid() if pid is None else int(pid)
    fields = read_smaps_rollup(pid)
    if fields is not None and "Pss" in fields:
        pages = segment_pages(pid, segments)
        return ProcessMemory(
            pid=pid,
            role=role,
            rss=fields.get("Rss", 0),
            uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            pss=fields["Pss"],
            shared=fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
            pss_file=fields.get("Pss_File", 0),
            data_rss=pages.rss,
            data_pss=pages.pss,
            data_copied=pages.copied,
            data_file=pages.file if "Pss_File" in fields else 0,
            transport=pages.transport,
        )
    if fields is not None and not os.path.exists(f"/proc/{pid}/exe"):
        # A zombie: smaps_rollup reads empty, the process holds no memory any more.
        return ProcessMemory(pid=pid, role=role, rss=0, uss=0, pss=0, shared=0)
    return _measure_psutil(pid, role)


def read_smaps_rollup(pid: int) -> dict[str, int] | None:
    """The fields of ``/proc/<pid>/smaps_rollup`` in bytes; ``None`` where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            return parse_smaps(f.read())
    except OSError:
        return None


def parse_smaps(text: str) -> dict[str, int]:
    """Parse ``Name:  123 kB`` lines of an smaps file into bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0]) * KIB
    return fields


@dataclass(frozen=True)
class SegmentPages:
    """What one process maps of the dataset's segments and of the batch transport, in bytes."""

    rss: int = 0
    pss: int = 0
    copied: int = 0  # anonymous pages: private copies made by writes (copy-on-write)
    file: int = 0  # the part of pss the kernel counts as file pages (not shmem)
    transport: int = 0  # PSS of batches in flight (shareddata-batch memfds, torch's shm)


def is_transport(path: str) -> bool:
    """Whether a mapping's path is a batch in flight between a worker and the main process.

    shareddata's batches travel in memfds named ``shareddata-batch``. torch's own
    shared memory (``/dev/shm/torch_*``) is not told apart: a tensor a dataset put in
    shared memory looks the same as a batch, so it stays in the working memory.

    Example:
        >>> is_transport("/memfd:shareddata-batch (deleted)")
        True
        >>> is_transport("/memfd:shareddata (deleted)")
        False
    """
    return path.startswith("/memfd:shareddata-batch")


def segment_pages(pid: int, segments: Segments = ()) -> SegmentPages:
    """Sum the ``/proc/<pid>/smaps`` entries of the mappings of ``segments`` and of batches.

    A mapping's header line carries the device (``major:minor`` in hex) and inode
    of the mapped file: a memfd shows as ``/memfd:shareddata (deleted)``, a segment
    in ``storage_dir`` as the ``O_TMPFILE`` file's path, both with the inode
    ``os.fstat`` gives for the segment's descriptor. Batches in flight are found by
    name (:func:`is_transport`).

    Example:
        >>> import mmap, os
        >>> fd = os.memfd_create("shareddata")
        >>> os.ftruncate(fd, 1 << 20)
        >>> m = mmap.mmap(fd, 1 << 20)
        >>> m.write(b"x" * (1 << 20))
        1048576
        >>> st = os.fstat(fd)
        >>> segment_pages(os.getpid(), {(st.st_dev, st.st_ino)}).rss
        1048576
        >>> m.close(); os.close(fd)
    """
    wanted = {(f"{os.major(dev):02x}:{os.minor(dev):02x}", str(ino)) for dev, ino in segments}
    rss = pss = copied = file = transport = 0
    kind = ""  # "data", "transport" or "" for the current mapping
    on_file = False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5].rstrip("\n") if len(head) > 5 else ""
                    if (head[3], head[4]) in wanted:
                        kind = "data"
                        on_file = not path.startswith("/memfd:") and not _is_shmem(head[3])
                    else:
                        kind = "transport" if path and is_transport(path) else ""
                    continue
                if not kind or len(head) < 2:
                    continue
                if kind == "transport":
                    if head[0] == "Pss:":
                        transport += int(head[1]) * KIB
                elif head[0] == "Rss:":
                    rss += int(head[1]) * KIB
                elif head[0] == "Pss:":
                    value = int(head[1]) * KIB
                    pss += value
                    file += value if on_file else 0
                elif head[0] == "Anonymous:":
                    copied += int(head[1]) * KIB
    except (OSError, ValueError):
        return SegmentPages()
    # Anonymous pages of a file mapping are never file pages.
    return SegmentPages(
        rss=rss, pss=pss, copied=copied, file=max(file - copied, 0), transport=transport
    )


@functools.lru_cache(maxsize=64)
def _is_shmem(device: str) -> bool:
    """Whether the file system of device ``major:minor`` (hex) keeps its pages as shmem."""
    wanted = tuple(int(x, 16) for x in device.split(":"))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                major, _, minor = fields[2].partition(":")
                if (int(major), int(minor)) == wanted and " - " in line:
                    fstype = line.split(" - ", 1)[1].split()[0]
                    return fstype in ("tmpfs", "shm", "ramfs", "hugetlbfs")
    except (OSError, ValueError, IndexError):
        pass
    return False


def _measure_psutil(pid: int, role: str) -> ProcessMemory:
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.NoSuchProcess as err:
        raise ProcessLookupError(f"process {pid} does not exist") from err
    except psutil.AccessDenied as err:
        raise PermissionError(f"cannot read the memory of process {pid}: {err}") from err
    uss = int(getattr(info, "uss", info.rss))
    return ProcessMemory(
        pid=pid,
        role=role,
        rss=int(info.rss),
        uss=uss,
        pss=int(getattr(info, "pss", uss)),
        shared=max(int(info.rss) - uss, 0),
    )


def measure_all(
    procs: list[tuple[int | None, str]], segments: Segments = ()
) -> list[ProcessMemory]:
    """Measure each ``(pid, role)``; rows of processes that are gone are left out."""
    rows = []
    for pid, role in procs:
        if pid is None:
            continue
        try:
            rows.append(measure(pid, role, segments))
        except ProcessLookupError:  # gone: it holds nothing any more
            continue
    return rows


def working(rows: list[ProcessMemory]) -> int:
    """Sum of :attr:`ProcessMemory.working`: where copies of plain datasets live."""
    return sum(p.working for p in rows)


def data_copied(rows: list[ProcessMemory]) -> int:
    """Private copies of the dataset's segment pages, summed over ``rows``."""
    return sum(p.data_copied for p in rows)
