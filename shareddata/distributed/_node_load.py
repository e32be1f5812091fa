"""Loading once per node: local rank 0 loads, the other local ranks attach.

Note [How local ranks share one copy]
=====================================
Local rank 0 runs the ordinary load (``_load.build``) into memfd segments (Note
[How shared segments are made, shared and freed] in ``storage/_segment.py``), pickles the
columns -- handles ``(pid, fd, dev/inode, size, token)``, a few hundred bytes, never
data and never torch fd handles, which fail across ranks (docs/internals.md, "Across
torchrun ranks") -- and hands them to the other local ranks, which unpickle them and
so open ``/proc/<rank 0 pid>/fd/<fd>``: their own descriptor of the same file.

The hand-over goes through an *abstract* Unix socket (Linux; a name that starts with
a NUL byte and lives in no file system), named from the job, the node and the
dataset's number (``socket_name``). Local rank 0 binds it *before* loading; the
others connect and say which dataset they are building. Why this and not:

* the torchrun agent's ``TCPStore`` (``MASTER_ADDR:MASTER_PORT``): it exists only
  under torchrun, its reuse by clients other than ``init_process_group`` is an
  implementation detail of the agent, it cannot tell a dead rank 0 from a slow one
  (a waiter can only time out), and keys are not node-local;
* ``broadcast_object_list`` on the process group: needs ``init_process_group`` first,
  a subgroup per node created collectively by every rank, device tensors under NCCL,
  and its timeout is the process group's (30 min by default);
* a node-local file (``/tmp`` or ``/dev/shm``, keyed by run id and group rank): it
  is left behind when the job is SIGKILLed, and a waiter still cannot tell a dead
  writer from a slow one.

The socket has none of these problems: it needs neither torchrun's store nor an
initialised process group; it is node-local by construction (it is reachable exactly
where ``/proc/<pid>`` of the other ranks is, i.e. in the same network and PID
namespaces); it vanishes with the process, so a killed job leaves nothing; and a
connection *is* a liveness signal: when local rank 0 dies, every connected rank gets
``ECONNRESET``/EOF at once instead of waiting for a timeout. Both ends check the
peer's uid (``SO_PEERCRED``) before trusting a byte of it, and local rank 0 serves
each connection in a thread of its own, with a deadline on every read: a stray
process that connects is dropped alone (Note [Framing on the node socket] in
``_wire.py``).

What each side waits for, and for how long (``timeout``: the ``timeout`` argument,
else ``$SHAREDDATA_TIMEOUT``, else 300 s):

* a rank that is not local rank 0 retries ``connect`` for up to ``timeout`` (rank 0
  has not started this dataset: it is still busy with something else, builds other
  datasets, or died). Once connected it waits as long as rank 0 keeps sending its
  one-second heartbeat while it loads (a 1 TB load is not an error), fails at once
  if rank 0 exits, and after ``timeout`` without a message;
* local rank 0 returns only once every local rank has attached (each sends an ack
  after unpickling), so its segments -- and the ``/proc/<pid>/fd`` entries the
  others open -- outlive every attach; it waits at most ``timeout`` after loading.
  Each connection must say which dataset it builds within ``STALL`` (10 s) and
  acknowledge within ``timeout`` of the columns; a stalled peer costs only itself.
  Afterwards the attachers hold their own descriptors: rank 0 may drop the dataset
  or exit, and the memory is freed when the last process of the node lets go;
* when the load fails on local rank 0 (a missing file, not enough memory), it
  publishes the error's type and message instead of the columns; the others raise
  the same exception type, with a message naming local rank 0 and the cause.

Datasets are matched by a per-process counter of node-shared datasets (every local
rank must build the same datasets in the same order, as with collectives) plus a
fingerprint of the arguments (paths, column names, shapes and a sample of in-memory
arrays), checked on connect, so two datasets are never mixed up: a mismatch is an
error naming both.

``sd.verify`` across ranks meets on the same kind of socket (:func:`exchange`: every
local rank sends, local rank 0 answers all at once), not on the process group: it
works before ``init_process_group``, with NCCL (whose object collectives need
device tensors), and with the same bounded waits.

Only the rank process itself coordinates: DataLoader workers and other children
inherit the torchrun variables but load on their own (``_is_rank_process``).

Nodes are told apart by ``GROUP_RANK`` (torchrun's node index), never by host name:
two simulated nodes on one machine share the host name and ``/dev/shm``. Without the
torchrun environment but with an initialised process group, ranks are grouped by a
host identity (boot id and namespaces) gathered once with ``all_gather_object``.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import errors
from ..errors import LocalRankError, LocalRankTimeoutError
from ..storage._linux import ForkSafeLock
from ._context import TIMEOUT_ENV, NodeContext, Shard, Share, node_context, resolve_timeout
from ._fingerprint import describe, fingerprint
from ._wire import (
    STALL,
    Closed,
    Refused,
    Server,
    connect,
    error_info,
    hello,
    peer,
    rebuild_error,
    recv,
    send,
    socket_name,
)

__all__ = ["load_on_node"]

T = TypeVar("T")
_HEARTBEAT = 1.0  # seconds between local rank 0's "still loading" messages


_DATASETS = itertools.count()
_DATASETS_LOCK = ForkSafeLock()


def load_on_node(
    load: Callable[[tuple[int, int] | None], T],
    *,
    share: Share | None,
    shard: Shard | None,
    key: Any,
    close: Callable[[], None] | None = None,
    timeout: float | None = None,
) -> T:
    """Run ``load`` once per node and attach the other local ranks to what it made.

    See Note [How local ranks share one copy].

    Args:
        load: loads in this process; takes ``(node, num_nodes)`` for ``shard="node"``
            (``None`` for every row). What it returns is pickled to the other local
            ranks: handles of shared segments, never data.
        share: ``"node"``, ``"process"``, or ``None``: ``"node"`` under torchrun.
        shard: ``"node"`` to load only this node's rows, or ``None``.
        key: the dataset's arguments, equal on every local rank (fingerprinted), or a
            function that returns them, called only when local ranks share (for a
            key that costs reading data: a sample of items).
        close: called instead of ``load`` on ranks that attach (frees the source).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT`` or 300).

    Returns:
        What ``load`` returned on local rank 0 of this node.
    """
    if share not in (None, "node", "process"):
        raise errors.InvalidArgumentError(
            f"share must be 'node', 'process' or None (automatic), got {share!r}"
        )
    if shard not in (None, "node"):
        raise errors.InvalidArgumentError(
            f"shard must be 'node' or None (every row on every node), got {shard!r}"
        )
    ctx = node_context() if (share != "process" or shard is not None) else None
    place = None
    if shard == "node":
        place = (ctx.node, ctx.num_nodes) if ctx is not None else (0, 1)

    def here() -> T:
        return load(place)

    if share == "process" or ctx is None or ctx.local_world_size <= 1:
        return here()
    limit = resolve_timeout(timeout)
    with _DATASETS_LOCK:
        number = next(_DATASETS)
    if callable(key):
        key = key()
    wanted = fingerprint((key, shard))
    label = describe(key) if shard is None else f"{describe(key)} with shard={shard!r}"
    name = socket_name(ctx, "dataset", number)
    if ctx.local_rank == 0:
        return _publish(ctx, name, number, wanted, label, here, limit)
    if close is not None:
        close()
    return _receive(ctx, name, number, wanted, label, limit)  # type: ignore[no-any-return]


def _publish(
    ctx: NodeContext,
    name: str,
    number: int,
    wanted: str,
    label: str,
    load: Callable[[], T],
    timeout: float,
) -> T:
    server = _Publisher(ctx, name, number, wanted, label, timeout)
    try:
        try:
            columns = load()
        except Exception as error:
            server.finish(("error", error_info(error)), strict=False)
            raise
        server.finish(("data", pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)))
        return columns
    finally:
        server.close()


class _Publisher:
    """Local rank 0's side: serve every other local rank from before the load until it attached.

    Each connection has a thread of its own (:class:`Server`): it reads the rank's
    hello, beats while the load runs, sends the payload and reads the acknowledgement.
    :meth:`finish` waits for that of every local rank, at most ``timeout``.
    """

    def __init__(
        self, ctx: NodeContext, name: str, number: int, wanted: str, label: str, timeout: float
    ) -> None:
        self.ctx, self.number = ctx, number
        self.wanted, self.label, self.timeout = wanted, label, timeout
        self.payload: tuple[str, Any] | None = None  # set by finish, before ready
        self.ready = threading.Event()
        self.changed = threading.Condition()
        self.done: dict[int, str | None] = {}  # local rank -> None (attached) or a problem
        self.server = Server(name, ctx.local_world_size, self._serve)

    def _serve(self, sock: socket.socket, pid: int) -> None:
        _, message = recv(sock, time.monotonic() + STALL, ("hi",))
        rank, fp, label = hello(message, self.ctx, str, str)
        if fp != self.wanted:
            self._done(
                rank, f"it built dataset #{self.number} from {label}{_differ(label, self.label)}"
            )
            send(sock, "mismatch", self.label, time.monotonic() + STALL)
            return
        while not self.ready.wait(_HEARTBEAT):
            send(sock, "beat", None, time.monotonic() + STALL)
        kind, data = self.payload  # type: ignore[misc]
        send(sock, kind, data, time.monotonic() + STALL)
        if kind == "error":
            self._done(rank, None)  # told: nothing to attach
            return
        kind, data = recv(sock, time.monotonic() + self.timeout, ("ack", "fail"))
        self._done(rank, None if kind == "ack" else str(data))

    def _done(self, rank: int, problem: str | None) -> None:
        with self.changed:
            self.done[rank] = problem
            self.changed.notify_all()

    def finish(self, payload: tuple[str, Any], strict: bool = True) -> None:
        """Serve ``payload`` to every local rank; with ``strict``, raise if any failed.

        Waits until every other local rank has taken it, at most ``timeout``.
        """
        start = time.monotonic()
        self.payload = payload
        self.ready.set()
        ranks = range(1, self.ctx.local_world_size)
        with self.changed:
            self.changed.wait_for(lambda: all(r in self.done for r in ranks), self.timeout)
            done = dict(self.done)
        if not strict:
            return
        missing = [r for r in ranks if r not in done]
        failed = {r: p for r, p in done.items() if p is not None}
        if failed:
            listing = "; ".join(f"local rank {r}: {p}" for r, p in sorted(failed.items()))
            listing += f" (local rank 0 built it from {self.label})"
            raise LocalRankError(
                f"on node {self.ctx.node}, local ranks could not use dataset #{self.number} "
                f"({self.label}) loaded by local rank 0: {listing}. Every local rank must build "
                "the same datasets in the same order; pass share='process' to a dataset that "
                "differs between ranks or is built on some ranks only."
            )
        if missing:
            dropped = self.server.dropped[-3:]
            extra = f" ({'; '.join(dropped)})" if dropped else ""
            raise LocalRankTimeoutError(
                f"on node {self.ctx.node}, local rank 0 loaded dataset #{self.number} "
                f"({self.label}) and waited {time.monotonic() - start:.1f} s for local rank(s) "
                f"{', '.join(map(str, missing))} to attach, but they never did{extra}. Every local "
                "rank must build the same datasets in the same order; pass share='process' to a "
                f"dataset built on some ranks only. Raise {TIMEOUT_ENV} if they are just slow."
            )

    def close(self) -> None:
        """Stop serving (idempotent); connected ranks that were not served see EOF."""
        self.server.close()


def _differ(mine: str, theirs: str) -> str:
    if mine != theirs:
        return ""
    return (
        " (alike in shape, but in-memory data differs: arrays are compared by a sample of values)"
    )


def _receive(
    ctx: NodeContext, name: str, number: int, wanted: str, label: str, timeout: float
) -> Any:
    """Another local rank's side: connect, wait while rank 0 loads, attach, acknowledge."""
    where = f"local rank {ctx.local_rank} of node {ctx.node}"
    what = f"dataset #{number} ({label})"
    start = time.monotonic()
    sock = connect(name, start + timeout)
    if sock is None:
        raise LocalRankTimeoutError(
            f"{where} waited {time.monotonic() - start:.1f} s for local rank 0 to start loading "
            f"{what} (on socket @{name}), and it never did: local rank 0 is busy elsewhere, "
            "builds its datasets in another order, or died (see its log). Raise "
            f"{TIMEOUT_ENV} if it is just slow to get there; pass share='process' to a dataset "
            "that not every local rank builds."
        )
    with sock:
        pid = peer(sock)
        since = time.monotonic()
        try:
            send(sock, "hi", (ctx.local_rank, wanted, label), since + STALL)
            while True:
                since = time.monotonic()
                kind, data = recv(sock, since + timeout, ("beat", "data", "error", "mismatch"))
                if kind != "beat":
                    break
        except Closed:
            raise LocalRankError(
                f"{where}: local rank 0 (pid {pid}) exited while loading {what}, before it "
                "could publish it; its log says why."
            ) from None
        except TimeoutError:
            raise LocalRankTimeoutError(
                f"{where}: local rank 0 (pid {pid}) stopped answering: nothing for "
                f"{time.monotonic() - since:.1f} s while loading {what}. Raise {TIMEOUT_ENV} if "
                "it is expected."
            ) from None
        except Refused as e:
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) sent {e} for {what}") from None
        if kind == "mismatch":
            raise LocalRankError(
                f"{where} built {what}, but local rank 0 built dataset #{number} from "
                f"{data}{_differ(label, data)}: every local rank must build the same "
                "datasets in the same order. "
                "Pass share='process' to a dataset that differs between ranks or is built "
                "on some ranks only."
            )
        if kind == "error":
            raise rebuild_error(
                data, f"local rank 0 (pid {pid}) of node {ctx.node} failed to load {what}: "
            )
        try:
            columns = pickle.loads(data)
        except BaseException as error:
            try:
                problem = f"{type(error).__name__}: {error}"[:4000]
                send(sock, "fail", problem, time.monotonic() + STALL)
            except (Closed, OSError):
                pass
            raise
        try:
            send(sock, "ack", None, time.monotonic() + STALL)
        except (Closed, OSError):
            pass  # rank 0 left: this rank holds descriptors of its own already
        return columns
