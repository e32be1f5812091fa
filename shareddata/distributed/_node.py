"""The node socket, and the two rounds local ranks meet on: :func:`load_on_node`, :func:`exchange`.

Note [How local ranks share one copy]
=====================================
Local rank 0 loads into memfd segments and pickles the columns as handles (a few
hundred bytes; never data, never torch fd handles, which fail across ranks); the
other local ranks unpickle them and so open ``/proc/<rank 0 pid>/fd/<fd>``. They meet
on an abstract Unix socket named from job, node and the dataset's number, which rank
0 binds before it loads: it needs no store nor process group, is node-local, leaves
nothing when killed, and a dead rank 0 is seen at once (EOF); docs/internals.md,
"Abstract Unix sockets". The others connect (retrying up to ``timeout``), send the
dataset's fingerprint, then wait as long as rank 0's heartbeat comes (every second, or
a quarter of ``timeout``); rank 0 returns once every rank acknowledged (so its fds
outlive every attach), at most ``timeout`` after the load. A failed load sends its
error instead (re-raised as the same type), a fingerprint that differs gets a mismatch
(a ``LocalRankError`` on both sides). :func:`exchange` (``sd.verify``) is the same
round (:class:`_Round`, :func:`_attend`), its answers computed from every rank's hi.
Datasets are numbered per process: every local rank builds the same datasets in the
same order. Only the rank process coordinates: DataLoader workers load alone.

Note [Framing on the node socket]
=================================
Any process of the node can connect, so local rank 0 trusts nothing: a peer of
another uid (``SO_PEERCRED``) is dropped before a byte is read. A message is a 9-byte
header (``MAGIC``, a kind, the body's length) and a pickle; the kind must be one
expected there and the length within its bound, both checked before the body is
read. What peers send (``FROM_PEER``) is unpickled with no class (builtins only).
Every read has a deadline (``STALL`` for a started message); each connection has its
own thread, so a peer that breaks any of this is dropped and logged alone.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import itertools
import logging
import os
import pickle
import reprlib
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import numpy as np

from .. import errors
from ..errors import LocalRankError, LocalRankTimeoutError
from ..storage._linux import ForkSafeLock
from ._context import ALONE, TIMEOUT_ENV, NodeContext, Shard, Share, node_context, resolve_timeout
from ._fingerprint import describe, fingerprint

__all__ = ["STALL", "error_info", "exchange", "load_on_node", "rebuild_error", "socket_name"]

T = TypeVar("T")
log = logging.getLogger("shareddata")

STALL = 10.0  # seconds in which a peer that connected or started a message must complete it
MAGIC = b"SDN\x02"  # shareddata node protocol, version 2 (kinds renumbered)
FROM_PEER = ("hi", "ack", "fail")  # sent to local rank 0: builtins only
_KINDS = FROM_PEER + ("beat", "reply", "error", "mismatch")  # code: index + 1
_HEADER = struct.Struct("!4sBI")
_LIMIT = {"hi": 1 << 20, "ack": 64, "fail": 64 << 10, "beat": 64}  # else 64 MiB
_MAX_PEERS = 64  # connections local rank 0 serves at once
_HEARTBEAT = 1.0  # seconds between local rank 0's "still loading" messages
_DATASETS = itertools.count()
_DATASETS_LOCK = ForkSafeLock()


class Refused(Exception):
    """The peer sent bytes that are not the message of the protocol expected here."""


def socket_name(ctx: NodeContext, kind: str, number: int) -> str:
    text = f"{ctx.job}|{ctx.node}|{kind}|{number}".encode()
    digest = hashlib.sha1(text, usedforsecurity=False).hexdigest()
    return f"shareddata-{digest[:24]}-node{ctx.node}-{kind}{number}"


def peer(sock: socket.socket) -> int:
    """The peer's pid, after checking that it runs as our user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        raise LocalRankError(
            f"process {pid} (uid {uid}) is at the other end of shareddata's node socket, but "
            f"this process runs as uid {os.geteuid()}: refusing it. Every rank of a job must "
            "run as one user."
        )
    return pid


def connect(name: str, deadline: float) -> socket.socket | None:
    """Connect to local rank 0's socket, retrying until ``deadline``; ``None`` on timeout."""
    pause = 0.02
    while (remaining := deadline - time.monotonic()) > 0:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(remaining)
        try:
            sock.connect("\0" + name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            sock.close()
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.25)
    return None


def send(sock: socket.socket, kind: str, message: Any) -> None:
    """Send one message; ``TimeoutError`` after ``STALL`` s, ``ConnectionError`` if it left."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.settimeout(STALL)
    try:
        sock.sendall(_HEADER.pack(MAGIC, _KINDS.index(kind) + 1, len(body)) + body)
    except TimeoutError:
        raise TimeoutError(f"it read nothing in {STALL:.1f} s") from None


def _read(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        if (left := deadline - time.monotonic()) <= 0:
            raise TimeoutError()
        sock.settimeout(left)
        count = sock.recv_into(view[got:])
        if not count:
            raise ConnectionResetError("the peer closed the connection")
        got += count
    return buffer


class _Builtins(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def recv(sock: socket.socket, kinds: Collection[str], within: float) -> tuple[str, Any]:
    """One message of one of ``kinds``: ``(kind, value)``; Note [Framing on the node socket].

    Raises ``TimeoutError`` (incomplete ``within`` s), ``ConnectionError``, ``Refused``.
    """
    start = time.monotonic()
    deadline = start + within
    try:
        magic, code, size = _HEADER.unpack(_read(sock, _HEADER.size, deadline))
        if magic != MAGIC:
            raise Refused(f"bytes that are not shareddata's node protocol ({bytes(magic)!r}...)")
        kind = _KINDS[code - 1] if 0 < code <= len(_KINDS) else f"#{code}"
        if kind not in kinds:
            expected = " or ".join(map(repr, kinds))
            raise Refused(f"a message of kind {kind!r} where it expected {expected}")
        limit = _LIMIT.get(kind, 64 << 20)
        if size > limit:
            raise Refused(f"a header announcing a {size}-byte {kind!r} message (at most {limit})")
        body = _read(sock, size, deadline)
    except TimeoutError:
        elapsed = time.monotonic() - start
        raise TimeoutError(f"it sent no complete message in {elapsed:.1f} s") from None
    unpickler = _Builtins if kind in FROM_PEER else pickle.Unpickler
    try:
        return kind, unpickler(io.BytesIO(body)).load()
    except Exception as e:
        raise Refused(f"a {kind!r} message that does not unpickle ({e})") from e


def hello(message: Any, ctx: NodeContext, *types: type) -> tuple[Any, ...]:
    """A peer's ``"hi"``, ``(local rank, *values of types)``, checked; ``Refused`` otherwise."""
    if (
        isinstance(message, tuple)
        and len(message) == 1 + len(types)
        and type(message[0]) is int
        and 0 < message[0] < ctx.local_world_size
        and all(isinstance(v, t) for v, t in zip(message[1:], types))
    ):
        return message
    shape = ", ".join([f"a local rank 1..{ctx.local_world_size - 1}", *(t.__name__ for t in types)])
    raise Refused(f"a 'hi' of the wrong shape: {reprlib.repr(message)}, not ({shape})")


def plain(value: Any) -> Any:
    """``value`` as builtins (numpy scalars as numbers, any tuple as a tuple), as peers send."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = type(value) if type(value) in (list, set, frozenset) else tuple
        return kind(plain(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


class _Round:
    """Local rank 0's end of one round on socket ``name``; Note [How local ranks share one copy].

    Every connection is served in its own thread: a peer that fails the uid check or
    breaks the protocol is dropped and logged alone (``dropped``). A local rank says hi,
    ``(local rank, *values of types)`` (kept in ``said``); if ``check(*values)`` names a
    problem, the rank is sent it (``"mismatch"``) before it counts as done. Else it gets
    a heartbeat (every second, or a quarter of ``timeout``) until :meth:`run` has its
    answer, then the answer, and it counts as done (``done``: ``None`` or its problem)
    once it acknowledged a reply (``timeout``), or at once for an error.
    """

    def __init__(
        self,
        ctx: NodeContext,
        name: str,
        types: tuple[type, ...],
        timeout: float,
        check: Callable[..., str | None] = lambda *values: None,
    ) -> None:
        self.ctx, self.name, self.types, self.timeout, self.check = ctx, name, types, timeout, check
        self.ranks = range(1, ctx.local_world_size)
        self.said: dict[int, tuple[Any, ...]] = {}
        self.done: dict[int, str | None] = {}
        self.answers: list[tuple[str, Any]] = []  # by local rank, set before ready
        self.answered = 0.0  # when they were
        self.ready, self.changed = threading.Event(), threading.Condition()
        self.conns: set[socket.socket] = set()
        self.dropped: list[str] = []
        self.closed = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind("\0" + name)
        except OSError as e:
            self.listener.close()
            raise LocalRankError(
                f"cannot bind shareddata's node socket @{name} ({e}): another process of this "
                "node serves the same job, node and dataset number. Is the same job (same "
                "TORCHELASTIC_RUN_ID, MASTER_ADDR:MASTER_PORT and GROUP_RANK) started twice?"
            ) from e
        self.listener.listen(ctx.local_world_size)
        threading.Thread(target=self._accept, name="shareddata-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                pid = peer(conn)
            except (LocalRankError, OSError) as e:
                self._drop(conn, None, str(e))
                continue
            with self.changed:
                crowded = self.closed or len(self.conns) >= _MAX_PEERS
                if not crowded:
                    self.conns.add(conn)
            if crowded:
                self._drop(conn, pid, f"more than {_MAX_PEERS} connections at once")
                continue
            threading.Thread(
                target=self._run, args=(conn, pid), name="shareddata-peer", daemon=True
            ).start()

    def _run(self, conn: socket.socket, pid: int) -> None:
        try:
            self._serve(conn)
        except TimeoutError as e:
            self._drop(conn, pid, f"it stalled: {e}")
        except ConnectionError:
            self._drop(conn, pid, "it left in the middle of the exchange")
        except Refused as e:
            self._drop(conn, pid, f"it sent {e}")
        except Exception as e:  # never let one peer end the server
            self._drop(conn, pid, f"serving it failed: {e!r}")

    def _serve(self, conn: socket.socket) -> None:
        _, message = recv(conn, ("hi",), STALL)
        rank, *values = hello(message, self.ctx, *self.types)
        with self.changed:
            if rank in self.said:
                raise Refused(f"a 'hi' from local rank {rank}, which already said hi")
            self.said[rank] = tuple(values)
            self.changed.notify_all()
        problem = self.check(*values)
        if problem is not None:  # told before it counts as done: done, rank 0 closes the server
            try:
                send(conn, "mismatch", problem)
            finally:
                self._finish(rank, problem)
            return
        while not self.ready.wait(min(_HEARTBEAT, self.timeout / 4)):  # within any timeout
            send(conn, "beat", None)
        kind, data = self.answers[rank]
        send(conn, kind, data)
        if kind == "reply":
            kind, data = recv(conn, ("ack", "fail"), self.timeout)
            problem = None if kind == "ack" else str(data)
        self._finish(rank, problem)  # an error: told, nothing to attach

    def _finish(self, rank: int, problem: str | None) -> None:
        with self.changed:
            self.done[rank] = problem
            self.changed.notify_all()

    def wait(self, table: Mapping[int, Any], ranks: Collection[int], timeout: float) -> list[int]:
        """Wait until each of ``ranks`` is in ``table`` (at most ``timeout``); those missing."""
        with self.changed:
            self.changed.wait_for(lambda: all(r in table for r in ranks), max(0.0, timeout))
            return [r for r in ranks if r not in table]

    def run(
        self, produce: Callable[[], tuple[T, list[bytes]]], ranks: Collection[int], timeout: float
    ) -> tuple[T, dict[int, str | None]]:
        """``produce()``'s result, and ``done`` once ``ranks`` are done (at most ``timeout``).

        ``produce`` returns the result and each local rank's reply, a pickle; every
        rank is sent its reply, or else ``produce``'s error. Then the server closes.
        """
        try:
            try:
                result, replies = produce()
            except Exception as error:
                self._answer(
                    [("error", error_info(error))] * self.ctx.local_world_size, ranks, timeout
                )
                raise
            self._answer([("reply", body) for body in replies], ranks, timeout)
            with self.changed:
                return result, dict(self.done)
        finally:
            self.close()

    def _answer(
        self, answers: list[tuple[str, Any]], ranks: Collection[int], timeout: float
    ) -> None:
        self.answers[:] = answers
        self.answered = time.monotonic()
        self.ready.set()
        self.wait(self.done, ranks, timeout)

    def _drop(self, conn: socket.socket, pid: int | None, reason: str) -> None:
        with self.changed:
            self.conns.discard(conn)
            closed = self.closed
        if not closed:  # logged before the peer sees its end
            who = "a process" if pid is None else f"process {pid}"
            problem = f"{who} on node socket @{self.name} dropped: {reason}"
            self.dropped.append(problem)
            log.warning("%s", problem)
        conn.close()

    def why(self) -> str:
        """The last reasons peers were dropped, for a timeout's message."""
        return f" ({'; '.join(self.dropped[-3:])})" if self.dropped else ""

    def close(self) -> None:
        """Stop accepting and end every connection (idempotent; their threads exit)."""
        with self.changed:
            self.closed = True
            conns, self.conns = self.conns, set()
        for sock in (self.listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it (Linux)
            except OSError:
                pass
            sock.close()


def _attend(
    ctx: NodeContext, name: str, hi: tuple[Any, ...], timeout: float, doing: str, advice: str
) -> Any:
    """Another local rank's end of a round: hi, beats, the answer, then ack (or fail).

    ``doing`` says what local rank 0 does, ``advice`` what every rank must do (for
    messages).
    """
    where = f"local rank {ctx.local_rank} of node {ctx.node}"
    start = time.monotonic()
    sock = connect(name, start + timeout)
    if sock is None:
        raise LocalRankTimeoutError(
            f"{where} {_waited(start)} for local rank 0 to start {doing} (on socket @{name}), "
            f"and it never did: it is busy elsewhere or died (see its log); {advice}. Raise "
            f"{TIMEOUT_ENV} if it is just slow to get there."
        )
    with sock:
        pid = peer(sock)
        since = time.monotonic()
        try:
            send(sock, "hi", plain((ctx.local_rank, *hi)))
            kind = "beat"
            while kind == "beat":
                since = time.monotonic()
                kind, data = recv(sock, ("beat", "reply", "error", "mismatch"), timeout)
        except ConnectionError:
            raise LocalRankError(
                f"{where}: local rank 0 (pid {pid}) exited while {doing}, before it answered; "
                "its log says why."
            ) from None
        except TimeoutError:
            raise LocalRankTimeoutError(
                f"{where}: local rank 0 (pid {pid}) stopped answering: nothing for "
                f"{time.monotonic() - since:.1f} s while {doing}. Raise {TIMEOUT_ENV} if "
                "it is expected."
            ) from None
        except Refused as e:
            raise LocalRankError(
                f"{where}: local rank 0 (pid {pid}) sent {e} while {doing}"
            ) from None
        if kind == "mismatch":
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) refused it: {data}; {advice}.")
        if kind == "error":
            prefix = f"local rank 0 (pid {pid}) of node {ctx.node} failed while {doing}: "
            raise rebuild_error(data, prefix)
        try:
            value = pickle.loads(data)
        except BaseException as error:
            with contextlib.suppress(OSError):
                send(sock, "fail", f"{type(error).__name__}: {error}"[:4000])
            raise
        with contextlib.suppress(OSError):  # rank 0 left: the value is ours already
            send(sock, "ack", None)
        return value


def error_info(error: BaseException) -> dict[str, str]:
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return {
        "module": type(error).__module__,
        "type": type(error).__qualname__,
        "message": str(error),
        "where": where,
    }


def rebuild_error(info: Mapping[str, str], prefix: str) -> BaseException:
    """The exception local rank 0 raised, with ``prefix`` + its message.

    Classes of :mod:`shareddata.errors` and builtins are rebuilt; any other becomes a
    :class:`LocalRankError` naming it.
    """
    message = f"{prefix}{info['type']}: {info['message']} (raised at {info['where']})"
    cls: Any = None
    if info["module"].startswith("shareddata") and info["type"] in errors.__all__:
        cls = getattr(errors, info["type"])
    elif info["module"] == "builtins":
        cls = getattr(builtins, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return LocalRankError(message)


def _waited(start: float) -> str:
    return f"waited {time.monotonic() - start:.1f} s"


def exchange(
    ctx: NodeContext,
    name: str,
    value: Any,
    respond: Callable[[list[Any]], list[Any]],
    timeout: float,
    what: str,
) -> Any:
    """Send ``value`` to local rank 0, which answers every local rank at once.

    Returns this rank's element of ``respond(values by local rank)``, computed on
    local rank 0: a node barrier whose every wait is bounded by ``timeout``; an error
    of local rank 0 (one that never came included) is raised on every rank.
    """
    advice = "it must be called on every local rank"
    if ctx.local_rank != 0:
        return _attend(ctx, name, (value,), timeout, f"running {what}", advice)
    start = time.monotonic()
    meeting = _Round(ctx, name, (object,), timeout)

    def produce() -> tuple[Any, list[bytes]]:
        missing = meeting.wait(meeting.said, meeting.ranks, timeout)
        if missing:
            raise LocalRankTimeoutError(
                f"on node {ctx.node}, local rank 0 {_waited(start)} in {what} for local "
                f"rank(s) {', '.join(map(str, missing))}, which never came{meeting.why()}: "
                f"{advice}. Raise {TIMEOUT_ENV} if they are slow."
            )
        replies = respond([value, *(meeting.said[r][0] for r in meeting.ranks)])
        return replies[0], [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in replies]

    return meeting.run(produce, meeting.said, STALL)[0]


def load_on_node(
    load: Callable[[tuple[int, int] | None], T],
    *,
    share: Share | None,
    shard: Shard | None,
    key: Any,
    close: Callable[[], None] | None = None,
    timeout: float | None = None,
) -> T:
    """Run ``load`` once per node; the other local ranks attach to what it returned.

    ``load`` takes ``(node, num_nodes)`` for ``shard="node"`` (else ``None``) and
    returns handles, pickled to the other local ranks; ``key``: the dataset's
    arguments (fingerprinted), or a function returning them, called only when local
    ranks share; ``close``: called instead of ``load`` on ranks that attach;
    ``timeout``: else ``$SHAREDDATA_TIMEOUT`` or 300 s. Note [How local ranks share
    one copy].
    """
    if share not in (None, "node", "process"):
        raise errors.InvalidArgumentError(
            f"share must be 'node', 'process' or None (automatic), got {share!r}"
        )
    if shard not in (None, "node"):
        raise errors.InvalidArgumentError(
            f"shard must be 'node' or None (every row on every node), got {shard!r}"
        )
    if share == "process" and shard is None:  # no node_context(): it may be a collective
        return load(None)
    ctx = node_context() or ALONE
    place = (ctx.node, ctx.num_nodes) if shard == "node" else None
    if share == "process" or ctx.local_world_size <= 1:
        return load(place)
    limit = resolve_timeout(timeout)
    with _DATASETS_LOCK:
        number = next(_DATASETS)
    if callable(key):
        key = key()
    wanted = fingerprint((key, shard))
    label = describe(key) if shard is None else f"{describe(key)} with shard={shard!r}"
    name = socket_name(ctx, "dataset", number)
    if ctx.local_rank == 0:
        return _publish(ctx, name, number, wanted, label, lambda: load(place), limit)
    if close is not None:
        close()
    return _receive(ctx, name, number, wanted, label, limit)  # type: ignore[no-any-return]


_ADVICE = (
    "every local rank must build the same datasets in the same order; pass share='process' "
    "to a dataset that differs between ranks or is built on some ranks only"
)


def _publish(
    ctx: NodeContext,
    name: str,
    number: int,
    wanted: str,
    label: str,
    load: Callable[[], T],
    timeout: float,
) -> T:
    """Local rank 0's side: serve every other local rank from before the load until it attached."""

    def check(fp: str, theirs: str) -> str | None:
        if fp == wanted:
            return None
        problem = f"it built dataset #{number} from {theirs}, local rank 0 from {label}"
        if theirs == label:
            problem += " (alike in shape, but in-memory data differs: arrays are compared by a "
            problem += "sample of values)"
        return problem

    def produce() -> tuple[T, list[bytes]]:
        columns = load()
        body = pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)
        return columns, [body] * ctx.local_world_size

    meeting = _Round(ctx, name, (str, str), timeout, check)
    columns, got = meeting.run(produce, meeting.ranks, timeout)
    failed = {r: p for r, p in got.items() if p is not None}
    if failed:
        listing = "; ".join(f"local rank {r}: {p}" for r, p in sorted(failed.items()))
        raise LocalRankError(
            f"on node {ctx.node}, local ranks could not use dataset #{number} ({label}) loaded "
            f"by local rank 0: {listing}; {_ADVICE}."
        )
    missing = [r for r in meeting.ranks if r not in got]
    if missing:
        raise LocalRankTimeoutError(
            f"on node {ctx.node}, local rank 0 loaded dataset #{number} ({label}) and "
            f"{_waited(meeting.answered)} for local rank(s) {', '.join(map(str, missing))} to "
            f"attach, but they never did{meeting.why()}: {_ADVICE}. Raise {TIMEOUT_ENV} if they "
            "are just slow."
        )
    return columns


def _receive(
    ctx: NodeContext, name: str, number: int, wanted: str, label: str, timeout: float
) -> Any:
    """Another local rank's side: connect, wait while rank 0 loads, attach, acknowledge."""
    doing = f"loading dataset #{number} ({label})"
    return _attend(ctx, name, (wanted, label), timeout, doing, _ADVICE)
