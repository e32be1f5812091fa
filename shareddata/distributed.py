"""One copy per node under ``torchrun``, node-sharded datasets, and :class:`NodeShardSampler`.

Every shareddata dataset built under ``torchrun`` (or once ``torch.distributed`` is
initialised) is loaded by local rank 0 of each node; the other local ranks of that
node attach to the same pages, and so do all their DataLoader workers. Nothing is
needed from the user; ``share="process"`` opts out. ``shard="node"`` loads only the
node's contiguous ``1/num_nodes`` of the rows, and :class:`NodeShardSampler` splits
them among the local ranks.

Note [How local ranks share one copy]
=====================================
Local rank 0 runs the ordinary load (``_dataset.load_columns``) into memfd
segments (Note [How shared segments are made, shared and freed] in ``_storage.py``),
pickles the columns -- handles ``(pid, fd, dev/inode, size, token)``, a few hundred
bytes, never data and never torch fd handles, which fail across ranks (FACTS.md) --
and hands them to the other local ranks, which unpickle them and so open
``/proc/<rank 0 pid>/fd/<fd>``: their own descriptor of the same file.

The hand-over goes through an *abstract* Unix socket (Linux; a name that starts with
a NUL byte and lives in no file system), named from the job, the node and the
dataset's number (``_socket_name``). Local rank 0 binds it *before* loading; the
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

import hashlib
import itertools
import math
import os
import pickle
import select
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch.utils.data import Sampler

from . import errors
from .errors import LocalRankError, LocalRankTimeoutError, ShardingNotSupportedError

__all__ = [
    "LocalRankError",
    "LocalRankTimeoutError",
    "NodeContext",
    "NodeShard",
    "NodeShardSampler",
    "ShardingNotSupportedError",
    "node_context",
    "node_rows",
]

Share = Literal["node", "process"]
Shard = Literal["node"]
T = TypeVar("T")

_TIMEOUT_ENV = "SHAREDDATA_TIMEOUT"
_RANK_PID_ENV = "SHAREDDATA_RANK_PID"
_DEFAULT_TIMEOUT = 300.0
_HEARTBEAT = 1.0  # seconds between local rank 0's "still loading" messages
_MAX_MESSAGE = 64 << 20


# --------------------------------------------------------------------------------------
# Where this process is: node, local rank, job


@dataclass(frozen=True)
class NodeContext:
    """This process's place in a distributed job.

    Attributes:
        local_rank: rank among the processes of this node (``LOCAL_RANK``).
        local_world_size: processes on this node (``LOCAL_WORLD_SIZE``).
        node: index of this node (``GROUP_RANK``).
        num_nodes: number of nodes (``GROUP_WORLD_SIZE``).
        rank: global rank (``RANK``).
        world_size: number of processes in the job (``WORLD_SIZE``).
        job: a string that is the same for every process of one run of one job.
    """

    local_rank: int
    local_world_size: int
    node: int
    num_nodes: int
    rank: int
    world_size: int
    job: str


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise errors.InvalidArgumentError(
            f"environment variable {name}={value!r} is not an integer"
        ) from e


def _is_rank_process() -> bool:
    """Whether this is the process the launcher started, not a child that inherited its env.

    DataLoader workers (any start method; also a spawn worker re-running an unguarded
    ``__main__``) and pools inherit ``LOCAL_RANK`` & co.; they must load on their own
    rather than pose as the rank. The rank marks itself in ``SHAREDDATA_RANK_PID``
    (at import and at first use), which its children inherit.
    """
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        return False
    owner = os.environ.get(_RANK_PID_ENV)
    if owner is None:
        os.environ[_RANK_PID_ENV] = str(os.getpid())
        return True
    return owner == str(os.getpid())


def _context_from_env() -> NodeContext | None:
    local_rank, local_size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if local_rank is None or local_size is None or not _is_rank_process():
        return None
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    node = _env_int("GROUP_RANK")
    if node is None:
        node = rank // local_size if rank is not None else 0
    nodes = _env_int("GROUP_WORLD_SIZE")
    if nodes is None:
        nodes = max(1, world // local_size) if world is not None else 1
    job = "|".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    )
    return NodeContext(
        local_rank=local_rank,
        local_world_size=local_size,
        node=node,
        num_nodes=nodes,
        rank=local_rank if rank is None else rank,
        world_size=local_size * nodes if world is None else world,
        job=job,
    )


def _host_identity() -> str:
    """What processes that can reach each other's /proc and abstract sockets share."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for ns in ("net", "pid"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            pass
    return "/".join(parts)


_GROUP_CONTEXT: dict[tuple[int, int], NodeContext] = {}


def _context_from_group() -> NodeContext | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    cached = _GROUP_CONTEXT.get((rank, world))
    if cached is not None:
        return cached
    mine = (_host_identity(), f"{os.getpid()}-{time.time_ns()}")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)  # collective: every rank builds the dataset
    hosts = list(dict.fromkeys(host for host, _ in everyone))
    same = [r for r, (host, _) in enumerate(everyone) if host == mine[0]]
    ctx = NodeContext(
        local_rank=same.index(rank),
        local_world_size=len(same),
        node=hosts.index(mine[0]),
        num_nodes=len(hosts),
        rank=rank,
        world_size=world,
        job=f"group|{everyone[0][1]}",
    )
    _GROUP_CONTEXT[(rank, world)] = ctx
    return ctx


def node_context() -> NodeContext | None:
    """This process's node and local rank, or ``None`` outside a distributed job.

    Read from the torchrun environment (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``); failing that,
    derived once from an initialised ``torch.distributed`` process group (a
    collective: every rank must get here).

    Example:
        >>> ctx = node_context()
        >>> ctx is None or ctx.local_rank < ctx.local_world_size
        True
    """
    return _context_from_env() or _context_from_group()


def resolve_timeout(timeout: float | None = None) -> float:
    """The coordination timeout in seconds: the argument, ``$SHAREDDATA_TIMEOUT``, or 300."""
    if timeout is None:
        raw = os.environ.get(_TIMEOUT_ENV)
        if raw is None or raw.strip() == "":
            return _DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError as e:
            raise errors.InvalidArgumentError(
                f"{_TIMEOUT_ENV}={raw!r} is not a number of seconds"
            ) from e
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise errors.ArgumentTypeError(
            f"the timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not timeout > 0:
        raise errors.InvalidArgumentError(
            f"the timeout must be a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


if "LOCAL_RANK" in os.environ:  # mark the rank before it starts any child
    _is_rank_process()


# --------------------------------------------------------------------------------------
# Node shards


@dataclass(frozen=True)
class NodeShard:
    """The rows of the whole dataset that one node holds (``shard="node"``).

    Row ``i`` of the node's dataset is row ``start + i`` of the whole dataset.

    Attributes:
        start: first row of the whole dataset held here.
        stop: one past the last row held here.
        total: rows of the whole dataset.
        node: index of the node holding them.
        num_nodes: number of nodes the rows are split over.
    """

    start: int
    stop: int
    total: int
    node: int
    num_nodes: int

    def __len__(self) -> int:
        return self.stop - self.start


def node_rows(total: int, node: int, num_nodes: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of ``total`` that node ``node`` holds.

    Shares differ by at most one row; the first nodes get the smaller ones.

    Example:
        >>> [node_rows(10, g, 3) for g in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    if not 0 <= node < num_nodes:
        raise ValueError(f"node {node} is not in range for {num_nodes} nodes")
    return node * total // num_nodes, (node + 1) * total // num_nodes


# --------------------------------------------------------------------------------------
# Fingerprints: the same arguments on every local rank give the same string

_SAMPLE_ELEMENTS = 4096


def _digest(obj: Any, h: Any, depth: int = 0) -> None:
    if depth > 6:
        h.update(b"...")
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    elif isinstance(obj, os.PathLike):
        h.update(b"path:" + os.fsencode(os.fspath(obj)))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        _digest_array(t.numpy(), h, f"tensor{tuple(obj.shape)}{obj.dtype}")
    elif isinstance(obj, np.ndarray):
        _digest_array(obj, h, f"ndarray{obj.shape}{obj.dtype}")
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k, v in obj.items():
            _digest(k, h, depth + 1)
            _digest(v, h, depth + 1)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest(v, h, depth + 1)
        h.update(b"]")
    else:  # anything else: its type (its repr may hold an address)
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())


def _digest_array(array: np.ndarray, h: Any, header: str) -> None:
    h.update(header.encode())
    if array.size == 0 or array.dtype.hasobject:
        return
    idx = np.linspace(0, array.size - 1, min(array.size, _SAMPLE_ELEMENTS)).astype(np.int64)
    h.update(np.ascontiguousarray(array.flat[idx]).tobytes())  # copies only the sample


def fingerprint(key: Any) -> str:
    """A short hash of a dataset's arguments (paths, names, shapes, a sample of arrays).

    Example:
        >>> fingerprint(("a.npy", None)) == fingerprint(("a.npy", None))
        True
        >>> fingerprint(np.zeros(3)) == fingerprint(np.ones(3))
        False
    """
    h = hashlib.sha1(usedforsecurity=False)
    _digest(key, h)
    return h.hexdigest()[:16]


def describe(key: Any, limit: int = 160) -> str:
    """A short human description of a dataset's arguments, for messages."""

    def short(obj: Any, depth: int = 0) -> str:
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            return f"{type(obj).__name__}(shape={tuple(obj.shape)}, dtype={obj.dtype})"
        if isinstance(obj, os.PathLike):
            return repr(os.fspath(obj))
        if isinstance(obj, Mapping) and depth < 3:
            return "{" + ", ".join(f"{k!r}: {short(v, depth + 1)}" for k, v in obj.items()) + "}"
        if isinstance(obj, (list, tuple)) and depth < 3:
            inner = ", ".join(short(v, depth + 1) for v in obj)
            return f"[{inner}]" if isinstance(obj, list) else f"({inner})"
        return repr(obj) if isinstance(obj, (str, int, float, type(None))) else type(obj).__name__

    if isinstance(key, tuple) and key and isinstance(key[0], str):  # ("NumpyDataset", ...)
        text = f"{key[0]}({', '.join(short(v, 1) for v in key[1:])})"
    else:
        text = short(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------
# The wire: length-prefixed pickles over an abstract Unix socket, peers checked by uid


class _Closed(Exception):
    """The peer closed the connection (or died)."""


def _socket_name(ctx: NodeContext, kind: str, number: int) -> str:
    digest = hashlib.sha1(
        f"{ctx.job}|{ctx.node}|{kind}|{number}".encode(), usedforsecurity=False
    ).hexdigest()
    return f"shareddata-{digest[:24]}-node{ctx.node}-{kind}{number}"


def _peer(sock: socket.socket) -> int:
    """The peer's pid, after checking that it runs as our user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        raise LocalRankError(
            f"process {pid} (uid {uid}) answered on shareddata's node socket, but this process "
            f"runs as uid {os.geteuid()}: refusing it. Every rank of a job must run as one user."
        )
    return pid


def _listen(name: str, backlog: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError as e:
        sock.close()
        raise LocalRankError(
            f"cannot bind shareddata's node socket @{name} ({e}): another process of this "
            "node serves the same job, node and dataset number. Is the same job (same "
            "TORCHELASTIC_RUN_ID, MASTER_ADDR:MASTER_PORT and GROUP_RANK) started twice?"
        ) from e
    sock.listen(max(1, backlog))
    return sock


def _connect(name: str, deadline: float) -> socket.socket | None:
    """Connect to local rank 0's socket, retrying until ``deadline``; ``None`` on timeout."""
    pause = 0.02
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            sock.close()
            return None
        sock.settimeout(remaining)
        try:
            sock.connect("\0" + name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
        except TimeoutError:
            sock.close()
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.25)


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except ConnectionResetError as e:
            raise _Closed() from e
        if not chunk:
            raise _Closed()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, timeout: float) -> Any:
    """One message; ``TimeoutError`` after ``timeout`` s, ``_Closed`` if the peer is gone."""
    sock.settimeout(max(timeout, 0.001))
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > _MAX_MESSAGE:
        raise LocalRankError(f"a {size}-byte message on shareddata's node socket: refused")
    return pickle.loads(_recv_exact(sock, size))


# --------------------------------------------------------------------------------------
# Errors that cross ranks: type and message


def _error_info(error: BaseException) -> dict[str, str]:
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return {
        "module": type(error).__module__,
        "type": type(error).__qualname__,
        "message": str(error),
        "where": where,
    }


def _rebuild_error(info: Mapping[str, str], prefix: str) -> BaseException:
    """An exception of the class local rank 0 raised, with ``prefix`` + its message.

    The class is looked up by name in :mod:`shareddata.errors` (every class the
    library raises lives there) or in builtins; any other class (a user's own, a
    library's) becomes a :class:`LocalRankError` naming it.
    """
    message = f"{prefix}{info['type']}: {info['message']} (raised at {info['where']})"
    cls: Any = None
    if info["module"].startswith("shareddata") and info["type"] in errors.__all__:
        cls = getattr(errors, info["type"])
    elif info["module"] == "builtins":
        import builtins

        cls = getattr(builtins, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return LocalRankError(message)


# --------------------------------------------------------------------------------------
# Loading once per node

_DATASETS = itertools.count()
_DATASETS_LOCK = threading.Lock()


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
        key: the dataset's arguments, equal on every local rank (fingerprinted).
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
    wanted = fingerprint((key, shard))
    label = describe(key)
    name = _socket_name(ctx, "dataset", number)
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
            server.finish(("error", _error_info(error)), strict=False)
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
        self.listener = _listen(name, ctx.local_world_size)
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
            pid = _peer(sock)
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
            _send(sock, message)
        except OSError:  # the rank died; it will be reported missing
            clients.pop(sock, None)
            sock.close()

    def _read(self, sock: socket.socket, clients: dict[socket.socket, dict[str, Any]]) -> None:
        state = clients[sock]
        try:
            kind, data = _recv(sock, 10)
        except (_Closed, TimeoutError, OSError, pickle.UnpicklingError):
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
                f"dataset built on some ranks only. Raise {_TIMEOUT_ENV} if they are just slow."
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
    sock = _connect(name, time.monotonic() + timeout)
    if sock is None:
        raise LocalRankTimeoutError(
            f"{where} waited {timeout:.0f} s for local rank 0 to start loading {what} (on "
            f"socket @{name}), and it never did: local rank 0 is busy elsewhere, builds its "
            f"datasets in another order, or died (see its log). Raise {_TIMEOUT_ENV} if it is "
            "just slow to get there; pass share='process' to a dataset that not every local "
            "rank builds."
        )
    with sock:
        pid = _peer(sock)
        _send(sock, ("hi", (ctx.local_rank, wanted, label)))
        while True:
            try:
                kind, data = _recv(sock, timeout)
            except _Closed:
                raise LocalRankError(
                    f"{where}: local rank 0 (pid {pid}) exited while loading {what}, before it "
                    "could publish it; its log says why."
                ) from None
            except TimeoutError:
                raise LocalRankTimeoutError(
                    f"{where}: local rank 0 (pid {pid}) stopped answering for {timeout:.0f} s "
                    f"while loading {what}. Raise {_TIMEOUT_ENV} if it is expected."
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
                raise _rebuild_error(
                    data, f"local rank 0 (pid {pid}) of node {ctx.node} failed to load {what}: "
                )
            try:
                columns = pickle.loads(data)
            except BaseException as error:
                try:
                    _send(sock, ("fail", f"{type(error).__name__}: {error}"))
                except OSError:
                    pass
                raise
            _send(sock, ("ack", None))
            return columns


# --------------------------------------------------------------------------------------
# A gather-and-reply round across the local ranks (used by verify)


def exchange(
    ctx: NodeContext,
    name: str,
    value: Any,
    respond: Callable[[list[Any]], list[Any]],
    timeout: float,
    what: str,
) -> Any:
    """Send ``value`` to local rank 0, which answers every local rank at once.

    Local rank 0 collects the values of all local ranks (by local rank), calls
    ``respond`` and sends each rank its element of the result. A barrier for the
    node that never hangs: every wait is bounded by ``timeout``, and an exited rank 0
    is seen at once.

    Returns:
        This rank's element of ``respond``'s result.
    """
    deadline = time.monotonic() + timeout
    size = ctx.local_world_size
    if ctx.local_rank == 0:
        listener = _listen(name, size)
        conns: dict[int, socket.socket] = {}
        try:
            values: dict[int, Any] = {0: value}
            pending: list[socket.socket] = []
            while len(values) < size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(size)) - set(values))
                    raise LocalRankTimeoutError(
                        f"on node {ctx.node}, local rank 0 waited {timeout:.0f} s in {what} for "
                        f"local rank(s) {', '.join(map(str, missing))}, which never came: it must "
                        f"be called on every local rank. Raise {_TIMEOUT_ENV} if they are slow."
                    )
                readable, _, _ = select.select([listener, *pending], [], [], min(remaining, 0.5))
                for sock in readable:
                    if sock is listener:
                        conn, _ = listener.accept()
                        _peer(conn)
                        pending.append(conn)
                        continue
                    pending.remove(sock)
                    try:
                        _, (rank, data) = _recv(sock, 10)
                    except (_Closed, TimeoutError, OSError):
                        sock.close()
                        continue
                    values[rank], conns[rank] = data, sock
            try:
                replies = respond([values[r] for r in range(size)])
            except Exception as error:
                for conn in conns.values():
                    _send(conn, ("error", _error_info(error)))
                raise
            for rank, conn in conns.items():
                _send(conn, ("reply", replies[rank]))
            return replies[0]
        finally:
            for conn in conns.values():
                conn.close()
            listener.close()
    where = f"local rank {ctx.local_rank} of node {ctx.node}"
    client = _connect(name, deadline)
    if client is None:
        raise LocalRankTimeoutError(
            f"{where} waited {timeout:.0f} s in {what} for local rank 0, which never came: it "
            f"must be called on every local rank. Raise {_TIMEOUT_ENV} if it is slow."
        )
    with client:
        pid = _peer(client)
        _send(client, ("hi", (ctx.local_rank, value)))
        try:
            kind, data = _recv(client, max(deadline - time.monotonic(), 0.001))
        except _Closed:
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) exited in {what}") from None
        except TimeoutError:
            raise LocalRankTimeoutError(
                f"{where} waited {timeout:.0f} s in {what} for the other local ranks"
            ) from None
        if kind == "error":
            raise _rebuild_error(data, f"local rank 0 (pid {pid}) failed in {what}: ")
        return data


# --------------------------------------------------------------------------------------
# The sampler


class NodeShardSampler(Sampler[int]):
    """A ``DistributedSampler`` for node-sharded data: each node samples its own rows.

    Node ``g`` of ``G`` owns rows ``node_rows(N, g, G)`` of the whole dataset's ``N``
    (exactly the rows ``shard="node"`` loads there). Every epoch the node's rows are
    shuffled (the same order on each local rank: ``seed + epoch``) and dealt out to
    its ``L`` local ranks (local rank ``l`` takes positions ``l, l + L, ...``), so one
    epoch visits every row of the whole dataset once across the job.

    Every rank of the job yields the same number of indices, as DDP needs:

    * ``drop_last=False`` (default): ``ceil(ceil(N / G) / L)`` per rank; a node whose
      rows do not fill that many is padded by repeating the start of its shuffled
      order (as ``DistributedSampler`` does), so a few rows are seen twice;
    * ``drop_last=True``: ``floor(floor(N / G) / L)`` per rank; the tail of each
      node's shuffled order is skipped (different rows each epoch when shuffling).

    When ``N`` divides by ``G * L`` both give every row exactly once.

    Works with a node-sharded dataset (``shard="node"``: indices are local to the
    shard) and with a full copy on every node (indices are global).

    Args:
        dataset: the dataset (anything with ``len``; ``node_shard`` if sharded).
        shuffle: reshuffle the node's rows every epoch.
        seed: base seed; epoch ``e`` uses ``seed + e`` (call :meth:`set_epoch`).
        drop_last: drop the tail instead of padding (see above).

    Raises:
        ValueError: the dataset was sharded for another layout of nodes, nodes hold
            different numbers of ranks, or a node has no rows to pad from.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> ds = sd.NumpyDataset(np.arange(8))
        >>> sampler = sd.NodeShardSampler(ds, shuffle=False)
        >>> list(sampler)
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        ctx = node_context()
        node, nodes, local, size = (
            (ctx.node, ctx.num_nodes, ctx.local_rank, ctx.local_world_size)
            if ctx is not None
            else (0, 1, 0, 1)
        )
        if ctx is not None and ctx.world_size != nodes * size:
            raise ValueError(
                f"NodeShardSampler needs the same number of ranks on every node, but the job "
                f"has {ctx.world_size} ranks on {nodes} nodes of {size} local ranks."
            )
        shard: NodeShard | None = getattr(dataset, "node_shard", None)
        if shard is not None:
            if (shard.node, shard.num_nodes) != (node, nodes):
                raise ValueError(
                    f"the dataset holds the rows of node {shard.node} of {shard.num_nodes}, but "
                    f"this process is on node {node} of {nodes}."
                )
            if len(dataset) != len(shard):
                raise ValueError(
                    f"the dataset has {len(dataset)} rows but its node_shard says {len(shard)}"
                )
            total, offset, rows = shard.total, 0, len(shard)
        else:
            total = len(dataset)
            start, stop = node_rows(total, node, nodes)
            offset, rows = start, stop - start
        self.total, self.offset, self.node_size = total, offset, rows
        self.local_rank, self.local_world_size = local, size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = (total // nodes) // size
        else:
            self.num_samples = math.ceil(math.ceil(total / nodes) / size)
            if self.num_samples > 0 and rows == 0:
                raise ValueError(
                    f"node {node} holds no rows of the {total}-row dataset ({nodes} nodes), so "
                    "it cannot pad its ranks' samples; use drop_last=True or fewer nodes."
                )
        self.total_size = self.num_samples * size

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call it before every epoch, as for DistributedSampler)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        # int32 while it fits: the order lives in the main process for the whole epoch
        dtype = torch.int32 if self.total < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.node_size, generator=generator, dtype=dtype)
        else:
            order = torch.arange(self.node_size, dtype=dtype)
        if self.total_size > len(order):
            order = order.repeat(math.ceil(self.total_size / max(len(order), 1)))
        mine = order[self.local_rank : self.total_size : self.local_world_size] + self.offset
        del order
        # In chunks: a list of every index would be ~36 bytes a row of private memory.
        for chunk in mine.split(4096):
            yield from chunk.tolist()

    def __len__(self) -> int:
        return self.num_samples


def global_indices(dataset: Any, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Rows of the whole dataset for indices into a node-sharded (or full) dataset.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> global_indices(sd.NumpyDataset(np.arange(4)), [1, 3]).tolist()
        [1, 3]
    """
    shard: NodeShard | None = getattr(dataset, "node_shard", None)
    idx = torch.as_tensor(indices, dtype=torch.int64)
    return idx if shard is None else idx + shard.start
