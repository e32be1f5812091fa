"""A DataLoader worker whose main process is killed exits, and frees the data it maps.

Note [Workers of a killed parent]
=================================
torch's DataLoader worker exits when ``os.getppid()`` changes. A ``forkserver``
worker's parent is the fork server, which lives as long as any of its children
holds the server's "alive" pipe, and every worker does: the workers of a SIGKILLed
main process lived on, holding the dataset's memory. So when a ``spawn`` or
``forkserver`` child attaches a segment that its ``multiprocessing`` parent (the
process that owns the DataLoader) sent, a daemon thread watches that process
through a pidfd (``os.pidfd_open``, Linux >= 5.3; polled ``POLL`` seconds at a
time). Once it has exited, a DataLoader worker of it ends at once (``os._exit``),
its mappings with it; any other process is left alone (a ``Process`` may be meant to
outlive its parent). The child attaches while it unpickles its ``Process``, before
``multiprocessing`` names its parent, so both are checked when the sender dies. A
sender that died before its pidfd was opened fails the attach itself. Without
pidfds only torch's own check remains (``docs/troubleshooting.md``).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import time

from ._linux import close_fd

__all__ = ["POLL", "watch_parent"]

POLL = 1.0
"""Seconds between two checks that the parent still runs (each wait is bounded)."""
_WORKER_WAIT = 10.0  # seconds a child whose parent died waits to show as a DataLoader worker
_STATE = {"pid": 0, "pidfd": -1}  # the process whose watcher runs, and its pidfd


def watch_parent(sender: int) -> None:
    """Exit this DataLoader worker once ``sender`` exits, if it is our ``multiprocessing`` parent.

    Called by every attach of a segment that process ``sender`` sent; cheap after the first.
    """
    if _STATE["pid"] == os.getpid() or sender == os.getpid() or not hasattr(os, "pidfd_open"):
        return
    # a spawn/forkserver child unpickles its Process (the DataLoader's dataset in its
    # arguments) before multiprocessing names its parent: checked again when it dies
    starting = getattr(multiprocessing.current_process(), "_inheriting", False)
    if not (starting or _is_parent(sender)):
        return
    try:
        pidfd = os.pidfd_open(sender)
    except OSError:  # gone already (the attach that follows says so), or no pidfds
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
        return  # not a DataLoader worker of that process: its data is its own to keep
    message = f"shareddata: DataLoader worker {os.getpid()} exits: its main process {sender} died\n"
    try:
        os.write(2, message.encode())
    finally:
        os._exit(1)


def _is_parent(pid: int) -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and parent.pid == pid


def _after_fork_in_child() -> None:
    if _STATE["pidfd"] >= 0:  # the parent's watcher thread is not in this child
        close_fd(_STATE["pidfd"])
    _STATE.update(pid=0, pidfd=-1)


os.register_at_fork(after_in_child=_after_fork_in_child)
