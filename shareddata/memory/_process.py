"""What the kernel says about one process: :class:`ProcessMemory`, :func:`measure`.

Totals from ``/proc/<pid>/smaps_rollup`` (psutil where it is absent), the segments'
pages from ``smaps``, a plain array's private pages from ``pagemap``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil

KIB, MIB = 1024, 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
#: A segment as ``/proc/<pid>/smaps`` names it: ``(st_dev, st_ino)``.
Segments = Collection[tuple[int, int]]
Pages = tuple[tuple[int, int], ...]  # (first, end) page numbers, sorted and disjoint


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in bytes.

    Attributes:
        pid: process id.
        role: ``"main"``, ``"forkserver"``, ``"worker 0"``, ...
        rss: resident pages (shared ones counted in full).
        uss: pages no other process maps (``Private_*``).
        pss: each resident page divided by the number of processes mapping it.
        shared: resident pages another process maps too (``Shared_*``).
        pss_file: the part of ``pss`` backed by files; 0 where not reported.
        data_rss: resident pages of the dataset's segments this process maps.
        data_pss: its share of them; ``data_copied`` the private copies writes made
            of them (``Anonymous``); ``data_file`` the part on disk (in ``pss_file``).
        transport: PSS of batches in flight (``shareddata-batch`` memfds).
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
        """PSS outside file pages, the dataset's segments and batches in flight."""
        return self.pss - self.pss_file - (self.data_pss - self.data_file) - self.transport

    def to_dict(self) -> dict[str, Any]:
        """Return the row as a JSON-serialisable dict."""
        return asdict(self)


def measure(pid: int | None = None, role: str = "", segments: Segments = ()) -> ProcessMemory:
    """Measure process ``pid`` (``None``: this one); ``segments``' pages go to ``data_*``.

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
        rss, pss, copied, file, transport = segment_pages(pid, segments)
        return ProcessMemory(
            pid=pid,
            role=role,
            rss=fields.get("Rss", 0),
            uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            pss=fields["Pss"],
            shared=fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
            pss_file=fields.get("Pss_File", 0),
            data_rss=rss,
            data_pss=pss,
            data_copied=copied,
            data_file=file if "Pss_File" in fields else 0,
            transport=transport,
        )
    if fields is not None and not os.path.exists(f"/proc/{pid}/exe"):  # a zombie holds nothing
        return ProcessMemory(pid=pid, role=role, rss=0, uss=0, pss=0, shared=0)
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.NoSuchProcess as err:
        raise ProcessLookupError(f"process {pid} does not exist") from err
    except psutil.AccessDenied as err:
        raise PermissionError(f"cannot read the memory of process {pid}: {err}") from err
    rss, uss = int(info.rss), int(info.uss)
    return ProcessMemory(pid, role, rss, uss, int(info.pss), max(rss - uss, 0))


def measure_all(
    procs: Iterable[tuple[int | None, str]], segments: Segments = ()
) -> list[ProcessMemory]:
    """Measure each ``(pid, role)``; processes that are gone are left out."""
    rows = []
    for pid, role in procs:
        try:
            rows += [measure(pid, role, segments)] if pid is not None else []
        except ProcessLookupError:
            continue
    return rows


def read_smaps_rollup(pid: int) -> dict[str, int] | None:
    """The fields of ``/proc/<pid>/smaps_rollup`` in bytes; ``None`` where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            lines = [line.split() for line in f]
    except OSError:
        return None
    return {
        p[0][:-1]: int(p[1]) * KIB
        for p in lines
        if len(p) == 3 and p[0].endswith(":") and p[1].isdigit() and p[2] == "kB"
    }


def segment_pages(pid: int, segments: Segments = ()) -> tuple[int, int, int, int, int]:
    """``(rss, pss, copied, file, transport)`` of ``pid``'s mappings of ``segments``.

    Mappings are matched by the device (hex ``major:minor``) and inode in their smaps
    header. ``copied``: their ``Anonymous`` pages; ``file``: the part of ``pss`` on
    disk; ``transport``: the PSS of batches in flight.
    """
    wanted = {(f"{os.major(d):02x}:{os.minor(d):02x}", str(i)) for d, i in segments}
    totals = {"data": [0, 0, 0, 0], "transport": [0, 0, 0, 0]}  # rss, pss, copied, file
    kind, on_file = "", False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5].rstrip("\n") if len(head) > 5 else ""
                    kind = "data" if (head[3], head[4]) in wanted else ""
                    if not kind and path.startswith("/memfd:shareddata-batch"):
                        kind = "transport"
                    on_file = kind == "data" and not path.startswith("/memfd:")
                    on_file = on_file and not _is_shmem(head[3])
                    continue
                field = {"Rss:": 0, "Pss:": 1, "Anonymous:": 2}.get(head[0]) if kind else None
                if field is not None:
                    value = int(head[1]) * KIB
                    totals[kind][field] += value
                    totals[kind][3] += value if field == 1 and on_file else 0
    except (OSError, ValueError):
        return 0, 0, 0, 0, 0
    rss, pss, copied, file = totals["data"]
    return rss, pss, copied, max(file - copied, 0), totals["transport"][1]


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


def private_pages(buffers: Iterable[tuple[int, int]]) -> Pages:
    """The whole pages of ``(address, nbytes)`` buffers in private anonymous mappings.

    Example:
        >>> a = np.ones(1 << 20)  # 8 MiB: its own mapping
        >>> sum(e - f for f, e in private_pages([(a.ctypes.data, a.nbytes)])) >= 2046
        True
    """
    anonymous: list[tuple[int, int]] = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[1][3:4] == "p" and fields[4] == "0":
                lo, _, hi = fields[0].partition("-")
                anonymous.append((int(lo, 16) // PAGE, int(hi, 16) // PAGE))
    found = []
    for address, nbytes in buffers:
        first, end = -(-address // PAGE), (address + nbytes) // PAGE
        found += [(max(first, lo), min(end, hi)) for lo, hi in anonymous if lo < end and hi > first]
    merged: list[tuple[int, int]] = []
    for first, end in sorted(found):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((first, end))
    return tuple(merged)


def copied_pages(pid: int, pages: Pages) -> int | None:
    """Bytes of this process's ``pages`` that fork child ``pid`` holds alone (copied).

    A ``pagemap`` entry's bit 63 is "present", bit 56 "exclusively mapped" (Linux >=
    4.2). ``None`` where it cannot be read.
    """
    mask = np.uint64((1 << 63) | (1 << 56))
    total = 0
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for first, end in pages:
                for start in range(first, end, 1 << 17):  # 1 MiB of entries at a time
                    f.seek(start * 8)
                    entries = np.frombuffer(f.read(min(1 << 17, end - start) * 8), np.uint64)
                    total += int(np.count_nonzero((entries & mask) == mask))
    except (OSError, ValueError):
        return None
    return total * PAGE
