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
peer's uid (``SO_PEERCRED``) before trusting a byte of it.

What each side waits for, and for how long (``timeout``: the ``timeout`` argument,
else ``$SHAREDDATA_TIMEOUT``, else 300 s):

* a rank that is not local rank 0 retries ``connect`` for up to ``timeout`` (rank 0
  has not started this dataset: it is still busy with something else, builds other
  datasets, or died). Once connected it waits as long as rank 0 keeps sending its
  one-second heartbeat while it loads (a 1 TB load is not an error), fails at once
  if rank 0 exits, and after ``timeout`` without a heartbeat;
* local rank 0 returns only once every local rank has attached (each sends an ack
  after unpickling), so its segments -- and the ``/proc/<pid>/fd`` entries the
  others open -- outlive every attach; it waits at most ``timeout`` after loading.
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
import select
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
from ._wire import Closed, connect, error_info, listen, peer, rebuild_error, recv, send, socket_name

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
    """Local rank 0's side: accept the other local ranks, beat while loading, then serve.

    A thread runs the select loop from before the load until every other local
    rank has acknowledged (or ``timeout`` after the load); the caller joins it.
    """

    def __init__(
        self, ctx: NodeContext, name: str, number: int, wanted: str, label: str, timeout: float
    ) -> None:
        self.ctx, self.name, self.number = ctx, name, number
        self.wanted, self.label, self.timeout = wanted, label, timeout
        self.expected = ctx.local_world_size - 1
        self.listener = listen(name, ctx.local_world_size)
        self.payload: tuple[str, Any] | None = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.done: dict[int, str | None] = {}  # local rank -> None (attached) or a problem
        self.problems: list[str] = []
        self.thread = threading.Thread(target=self._serve, name="shareddata-publish", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        clients: dict[socket.socket, dict[str, Any]] = {}
        last_beat = time.monotonic()
        deadline: float | None = None
        try:
            while not self.stop.is_set() and len(self.done) < self.expected:
                if self.ready.is_set() and deadline is None:
                    deadline = time.monotonic() + self.timeout
                if deadline is not None and time.monotonic() > deadline:
                    break
                readable, _, _ = select.select([self.listener, *clients], [], [], 0.1)
                for sock in readable:
                    if sock is self.listener:
                        self._accept(clients)
                    else:
                        self._read(sock, clients)
                if self.ready.is_set():
                    for sock, state in list(clients.items()):
                        if state["state"] == "hi":
                            self._try_send(sock, clients, self.payload)
                            state["state"] = "sent"
                            if self.payload is not None and self.payload[0] == "error":
                                self.done[state["rank"]] = None  # told: nothing to attach
                                clients.pop(sock, None)
                                sock.close()
                elif time.monotonic() - last_beat >= _HEARTBEAT:
                    last_beat = time.monotonic()
                    for sock, state in list(clients.items()):
                        if state["state"] == "hi":
                            self._try_send(sock, clients, ("beat", None))
        except BaseException as e:  # never die silently: the caller reports it
            self.problems.append(f"local rank 0's server failed: {e!r}")
        finally:
            for sock in clients:
                sock.close()

    def _accept(self, clients: dict[socket.socket, dict[str, Any]]) -> None:
        sock, _ = self.listener.accept()
        try:
            pid = peer(sock)
        except (LocalRankError, OSError) as e:
            self.problems.append(str(e))
            sock.close()
            return
        clients[sock] = {"state": "new", "pid": pid, "rank": None}

    def _try_send(
        self, sock: socket.socket, clients: dict[socket.socket, dict[str, Any]], message: Any
    ) -> None:
        try:
            sock.settimeout(10)
            send(sock, message)
        except OSError:  # the rank died; it will be reported missing
            clients.pop(sock, None)
            sock.close()

    def _read(self, sock: socket.socket, clients: dict[socket.socket, dict[str, Any]]) -> None:
        state = clients[sock]
        try:
            kind, data = recv(sock, 10)
        except (Closed, TimeoutError, OSError, pickle.UnpicklingError):
            clients.pop(sock, None)
            sock.close()
            return
        if kind == "hi":
            rank, fp, label = data
            state["rank"] = rank
            if fp != self.wanted:
                problem = (
                    f"it built dataset #{self.number} from {label}{_differ(label, self.label)}"
                )
                self.done[rank] = problem
                self._try_send(sock, clients, ("mismatch", self.label))
                clients.pop(sock, None)
                sock.close()
                return
            state["state"] = "hi"
        elif kind in ("ack", "fail"):
            self.done[state["rank"]] = None if kind == "ack" else str(data)
            clients.pop(sock, None)
            sock.close()

    def finish(self, payload: tuple[str, Any], strict: bool = True) -> None:
        """Serve ``payload`` to every local rank; with ``strict``, raise if any failed."""
        self.payload = payload
        self.ready.set()
        self.thread.join()
        if not strict:
            return
        missing = [r for r in range(1, self.ctx.local_world_size) if r not in self.done]
        failed = {r: p for r, p in self.done.items() if p is not None}
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
            extra = f" ({'; '.join(self.problems)})" if self.problems else ""
            raise LocalRankTimeoutError(
                f"on node {self.ctx.node}, local rank 0 loaded dataset #{self.number} "
                f"({self.label}) and waited {self.timeout:.0f} s for local rank(s) "
                f"{', '.join(map(str, missing))} to attach, but they never did{extra}. Every local "
                "rank must build the same datasets in the same order; pass share='process' to a "
                f"dataset built on some ranks only. Raise {TIMEOUT_ENV} if they are just slow."
            )

    def close(self) -> None:
        """Stop serving (idempotent); connected ranks that were not served see EOF."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        self.listener.close()


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
    sock = connect(name, time.monotonic() + timeout)
    if sock is None:
        raise LocalRankTimeoutError(
            f"{where} waited {timeout:.0f} s for local rank 0 to start loading {what} (on "
            f"socket @{name}), and it never did: local rank 0 is busy elsewhere, builds its "
            f"datasets in another order, or died (see its log). Raise {TIMEOUT_ENV} if it is "
            "just slow to get there; pass share='process' to a dataset that not every local "
            "rank builds."
        )
    with sock:
        pid = peer(sock)
        send(sock, ("hi", (ctx.local_rank, wanted, label)))
        while True:
            try:
                kind, data = recv(sock, timeout)
            except Closed:
                raise LocalRankError(
                    f"{where}: local rank 0 (pid {pid}) exited while loading {what}, before it "
                    "could publish it; its log says why."
                ) from None
            except TimeoutError:
                raise LocalRankTimeoutError(
                    f"{where}: local rank 0 (pid {pid}) stopped answering for {timeout:.0f} s "
                    f"while loading {what}. Raise {TIMEOUT_ENV} if it is expected."
                ) from None
            if kind == "beat":
                continue
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
                    send(sock, ("fail", f"{type(error).__name__}: {error}"))
                except OSError:
                    pass
                raise
            send(sock, ("ack", None))
            return columns
