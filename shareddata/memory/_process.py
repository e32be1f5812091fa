"""Measuring one process: :class:`ProcessMemory` and :func:`measure`.

Each process is read from ``/proc/<pid>/smaps_rollup`` (``psutil`` as a fallback);
what each field means is in Note [How duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import psutil

MIB = 1024 * 1024
KIB = 1024


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
    """

    pid: int
    role: str
    rss: int
    uss: int
    pss: int
    shared: int
    pss_file: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the row as a JSON-serialisable dict."""
        return asdict(self)


def measure(pid: int | None = None, role: str = "") -> ProcessMemory:
    """Measure one process from ``/proc/<pid>/smaps_rollup``, or psutil where absent.

    Args:
        pid: the process to measure; ``None`` is the calling process.
        role: a label kept in the row (``"main"``, ``"worker 0"``, ...).

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
        return ProcessMemory(
            pid=pid,
            role=role,
            rss=fields.get("Rss", 0),
            uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            pss=fields["Pss"],
            shared=fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
            pss_file=fields.get("Pss_File", 0),
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



def measure_all(procs: list[tuple[int | None, str]]) -> list[ProcessMemory]:
    """Measure each ``(pid, role)``; rows of processes that are gone are left out."""
    rows = []
    for pid, role in procs:
        if pid is None:
            continue
        try:
            rows.append(measure(pid, role))
        except ProcessLookupError:  # gone: it holds nothing any more
            continue
    return rows


def data_pss(rows: list[ProcessMemory]) -> int:
    """Anonymous + shared-memory PSS: where copies of data live (file pages left out)."""
    return sum(p.pss - p.pss_file for p in rows)
