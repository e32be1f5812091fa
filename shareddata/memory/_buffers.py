"""The pages of a dataset's numpy and torch buffers that ``fork`` workers copied, counted.

A ``fork`` worker inherits the parent's pages copy-on-write: a page of an array stays
one physical page, mapped by the parent and every worker, until a process writes to
it and gets its own copy. ``/proc/<pid>/pagemap`` has one 64-bit entry per virtual
page; bit 63 says the page is present and bit 56 that it is *exclusively mapped*
(by this process alone, Linux >= 4.2; readable without privileges, only the frame
numbers are hidden). A worker's page of the parent's array that is present and
exclusive is therefore a private copy of that page; one that is present and not
exclusive is still shared. The worker has the parent's addresses, so the parent's
buffer addresses are the worker's too.

Only whole pages of buffers in private anonymous mappings are checked (a buffer in
shared memory, a shareddata segment or a ``share_memory_()`` tensor, cannot be copied
by a write; a page-cache page of a mapped file is not a copy). See Note [How
duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRESENT = np.uint64(1 << 63)
_EXCLUSIVE = np.uint64(1 << 56)
_CHUNK = 1 << 17  # pagemap entries read at once (1 MiB)


@dataclass(frozen=True)
class Buffers:
    """Whole pages of a dataset's buffers in this process's private anonymous memory.

    Attributes:
        pages: ``(first, end)`` page numbers, sorted and disjoint.
        nbytes: bytes in those pages.
    """

    pages: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(end - first for first, end in self.pages) * PAGE


def private_buffers(buffers: Iterable[tuple[int, int]], pid: int | None = None) -> Buffers:
    """The whole pages of ``(address, nbytes)`` buffers that lie in private anonymous memory.

    Example:
        >>> import numpy as np
        >>> a = np.ones(1 << 20)  # 8 MiB: its own mapping
        >>> private_buffers([(a.ctypes.data, a.nbytes)]).nbytes >= a.nbytes - 2 * PAGE
        True
    """
    anonymous = _private_anonymous(pid)
    starts = [first for first, _ in anonymous]
    found: list[tuple[int, int]] = []
    for address, nbytes in buffers:
        first, end = -(-address // PAGE), (address + nbytes) // PAGE
        i = max(bisect.bisect_right(starts, first) - 1, 0)
        while first < end and i < len(anonymous):
            lo, hi = anonymous[i]
            if hi <= first:
                i += 1
                continue
            if lo >= end:
                break
            found.append((max(first, lo), min(end, hi)))
            i += 1
    return Buffers(tuple(_merge(found)))


def copied_bytes(pid: int, buffers: Buffers) -> int | None:
    """Bytes of ``buffers``' pages that process ``pid`` holds a private copy of.

    ``None`` when ``/proc/<pid>/pagemap`` cannot be read (the process is gone, or
    ``/proc`` is restricted).
    """
    total = 0
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for first, end in buffers.pages:
                for start in range(first, end, _CHUNK):
                    count = min(_CHUNK, end - start)
                    f.seek(start * 8)
                    entries = np.frombuffer(f.read(count * 8), dtype=np.uint64)
                    mask = _PRESENT | _EXCLUSIVE
                    total += int(np.count_nonzero((entries & mask) == mask))
    except (OSError, ValueError):
        return None
    return total * PAGE


def _private_anonymous(pid: int | None) -> list[tuple[int, int]]:
    """``(first, end)`` page numbers of the private anonymous mappings of ``pid``."""
    ranges: list[tuple[int, int]] = []
    try:
        with open(f"/proc/{pid or 'self'}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) < 5 or fields[1][3:4] != "p" or fields[4] != "0":
                    continue
                lo, _, hi = fields[0].partition("-")
                ranges.append((int(lo, 16) // PAGE, int(hi, 16) // PAGE))
    except (OSError, ValueError):
        return []
    return _merge(ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, end in sorted(ranges):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((first, end))
    return merged
