"""A DataLoader worker whose main process is killed exits, and frees the data it maps.

Note [Workers of a killed parent]
=================================
torch's worker exits when ``os.getppid()`` changes, but a ``forkserver`` worker's
parent is the fork server, which outlives a SIGKILLed main process. So when a
``spawn`` or ``forkserver`` child attaches a segment its ``multiprocessing`` parent
sent, a daemon thread polls that process's pidfd (Linux >= 5.3, ``POLL`` s at a
time); once it exits, a DataLoader worker of it ends (``os._exit``); any other
process is left alone. Both are checked when the sender dies (the child attaches
before ``multiprocessing`` names its parent). Without pidfds only torch's check
remains (``docs/troubleshooting.md``).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import time

from ._linux import close_fd

POLL = 1.0  # seconds per bounded wait on the parent's pidfd
_WORKER_WAIT = 10.0  # seconds a child whose parent died waits to show as a DataLoader worker
_STATE = {"pid": 0, "pidfd": -1}  # the process whose watcher runs, and its pidfd


def watch_parent(sender: int) -> None:
    """Exit this DataLoader worker once ``sender``, its parent, exits (cheap after the first)."""
    if _STATE["pid"] == os.getpid() or sender == os.getpid() or not hasattr(os, "pidfd_open"):
        return
    starting = getattr(multiprocessing.current_process(), "_inheriting", False)
    if not (starting or _is_parent(sender)):
        return
    try:
        pidfd = os.pidfd_open(sender)
    except OSError:  # gone already: the attach says so
        return
    _STATE.update(pid=os.getpid(), pidfd=pidfd)
    threading.Thread(
        target=_watch, args=(pidfd, sender), name="shareddata-parent", daemon=True
    ).start()


def _watch(pidfd: int, sender: int) -> None:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll(POLL * 1000):
        pass
    from torch.utils.data import get_worker_info

    deadline = time.monotonic() + _WORKER_WAIT  # the worker may still be starting
    while get_worker_info() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if get_worker_info() is None or not _is_parent(sender):
        return
    message = f"shareddata: DataLoader worker {os.getpid()} exits: its main process {sender} died\n"
    try:
        os.write(2, message.encode())
    finally:
        os._exit(1)


def _is_parent(pid: int) -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and parent.pid == pid


def forget_in_child() -> None:
    """In a fork child (``_segment.py``'s at-fork hook): the watcher is the parent's."""
    if _STATE["pidfd"] >= 0:
        close_fd(_STATE["pidfd"])
    _STATE.update(pid=0, pidfd=-1)
