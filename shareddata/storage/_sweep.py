"""Reclaim the shared-memory names that dead DataLoader processes left in ``/dev/shm``.

Note [What can be left behind, and the sweeper]
================================================
shareddata's segments have no name, so nothing of ours is left behind. torch's
``file_descriptor`` strategy creates ``/dev/shm/torch_<pid>_<random>_<n>`` and
unlinks it a moment later; a SIGKILL in that window, or a full ``/dev/shm``
(ENOSPC, torch raises without unlinking), leaves the name for good. :func:`sweep`
removes names whose creator is gone, older than a few seconds and held by no
process (descriptor or mapping), only when asked: ``python -m shareddata clean
[--dry-run]``, or at every load with ``SHAREDDATA_SWEEP=1`` (never by default: they
are torch's files, and other PID namespaces may share ``/dev/shm``). Never under
``file_system`` sharing unless asked by hand.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

_TORCH_NAME = re.compile(r"^torch_(\d+)_")
_SWEEP_ENV = "SHAREDDATA_SWEEP"


@dataclass(frozen=True)
class Leftover:
    """A name in the shared-memory folder that a dead process left behind."""

    path: str
    pid: int
    nbytes: int
    age: float


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _held(inodes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of ``inodes`` a process holds as a descriptor or mapping."""
    held: set[tuple[int, int]] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            held.add((st.st_dev, st.st_ino))
        try:
            with open(f"/proc/{pid}/maps") as f:
                for parts in (line.split(None, 5) for line in f):
                    if len(parts) >= 5 and parts[4].isdigit() and parts[4] != "0":
                        major, minor = (int(x, 16) for x in parts[3].split(":"))
                        held.add((os.makedev(major, minor), int(parts[4])))
        except (OSError, ValueError):
            continue
    return held & inodes


def leftovers(directory: str = "/dev/shm", min_age: float = 5.0) -> list[Leftover]:
    """The torch names, at least ``min_age`` s old, that dead processes left and nobody holds.

    Example:
        >>> isinstance(leftovers(), list)
        True
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now = time.time()
    found: dict[tuple[int, int], Leftover] = {}
    for name in names:
        match = _TORCH_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        age = now - st.st_mtime
        if age < min_age or st.st_uid != os.geteuid():
            continue
        found[(st.st_dev, st.st_ino)] = Leftover(path, int(match.group(1)), st.st_size, age)
    if not found:
        return []
    for key in _held(set(found)):
        del found[key]
    return sorted(found.values(), key=lambda leftover: -leftover.age)


def sweep(
    directory: str = "/dev/shm", min_age: float = 5.0, dry_run: bool = False
) -> list[Leftover]:
    """Remove the :func:`leftovers` in ``directory``; return what was (or would be) removed.

    Example:
        >>> [leftover.path for leftover in sweep(dry_run=True)] == [
        ...     leftover.path for leftover in leftovers()]
        True
    """
    found = leftovers(directory, min_age)
    if dry_run:
        return found
    removed = []
    for leftover in found:
        try:
            os.unlink(leftover.path)
        except OSError:
            continue
        removed.append(leftover)
    return removed


def auto_sweep() -> None:
    """The sweep at a load, if ``SHAREDDATA_SWEEP=1``; never raises."""
    if os.environ.get(_SWEEP_ENV, "") in ("", "0"):
        return
    try:
        import torch.multiprocessing

        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return
        sweep()
    except Exception:
        return
