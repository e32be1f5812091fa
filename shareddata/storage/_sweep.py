"""Reclaim the shared-memory names that dead DataLoader processes left in ``/dev/shm``.

Note [What can be left behind, and the sweeper]
================================================
shareddata's own segments have no name (Note in ``storage/_segment.py``), so they cannot
be left behind. The batches that DataLoader workers send to the main process do
pass through named files: torch's ``file_descriptor`` sharing strategy (the
default) creates ``/dev/shm/torch_<pid>_<random>_<n>``, reserves its pages and
unlinks the name a moment later, keeping only the descriptor. Two things leave
such a name, and its pages, behind for good:

* the process is SIGKILLed inside that window (a whole-job kill while workers are
  building batches hits it now and then);
* ``/dev/shm`` is full: the reservation fails with ENOSPC and torch raises without
  unlinking the name it created (0 bytes each, one per failed batch).

A torch name under the default strategy is meant to exist for microseconds. One
whose creating process is gone, that is older than a few seconds and that no
process holds (as a descriptor or a mapping) is garbage. :func:`sweep` removes
those when asked: ``python -m shareddata clean [--dry-run]`` by hand, or at every
dataset load with ``SHAREDDATA_SWEEP=1`` (the "next start" of a job that was killed).
It is never on by default: these are torch's files, not shareddata's, and a process
cannot prove another program's file is garbage -- a ``/dev/shm`` shared with other
PID namespaces (containers) holds names whose creators this process cannot see, and
root passes any ownership check. It never touches a name of a process alive here,
nor one that any process of this machine still holds, nor anything under
``file_system`` sharing (where names legitimately outlive their creator) unless
asked by hand.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

__all__ = ["Leftover", "auto_sweep", "leftovers", "sweep"]

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
    """Whether ``pid`` runs (a zombie has exited: it holds no memory and no descriptor)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _held(inodes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of ``inodes`` some process of this machine holds as a descriptor or mapping."""
    held: set[tuple[int, int]] = set()
    numbers = {ino for _, ino in inodes}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in inodes:
                held.add((st.st_dev, st.st_ino))
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 5 or not parts[4].isdigit() or int(parts[4]) not in numbers:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            key = (os.makedev(major, minor), int(parts[4]))
            if key in inodes:
                held.add(key)
    return held


def leftovers(directory: str = "/dev/shm", min_age: float = 5.0) -> list[Leftover]:
    """The torch names in ``directory`` that dead processes left and nobody holds.

    Args:
        directory: the shared-memory folder.
        min_age: ignore names younger than this many seconds.

    Returns:
        The leftovers, oldest first (empty if the folder does not exist).

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

    Args:
        directory: the shared-memory folder.
        min_age: leave names younger than this many seconds.
        dry_run: only list them.

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
    """The sweep at a dataset's load, if ``SHAREDDATA_SWEEP=1`` asks for it; never raises."""
    if os.environ.get(_SWEEP_ENV, "") in ("", "0"):
        return
    try:
        import torch.multiprocessing

        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return
        sweep()
    except Exception:  # a sweep must never break a load
        return
