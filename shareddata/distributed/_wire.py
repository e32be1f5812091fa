"""The node socket: framed pickles over an abstract Unix socket, peers checked by uid.

Also what crosses it when a rank fails (:func:`error_info`, :func:`rebuild_error`),
local rank 0's end of it (:class:`Server`), and the gather-and-reply round
``sd.verify`` uses across local ranks (:func:`exchange`). Why a socket: Note [How local
ranks share one copy] in ``_node_load.py``.

Note [Framing on the node socket]
=================================
Any process of the node can connect to an abstract socket, so local rank 0 trusts
nothing a peer sends. A peer whose uid (``SO_PEERCRED``) is not ours is dropped before
a byte of it is read. A message is a 9-byte header -- ``MAGIC`` (protocol name and
version), a kind, the body's length -- and a pickle: the kind must be one the reader
expects at that point of the exchange and the length within that kind's bound, both
checked before the body is read. What peers send (``FROM_PEER``) is unpickled with no
class at all (builtins only: no code runs, nothing big is built from a few bytes) and
its shape is checked; only local rank 0's messages, read by ranks that checked its uid,
may hold classes. Every read has a deadline: a peer that connects or starts a message
completes it within ``STALL`` seconds. Local rank 0 serves each connection in a thread
of its own, so a peer that breaks any of this, stalls or leaves is dropped alone and
logged (``logging.getLogger("shareddata")``); the others are served as if it were not
there. ``shutdown()`` of a socket wakes a thread blocked on it (Linux), which is how
:meth:`Server.close` ends every connection at once.
"""

from __future__ import annotations

import hashlib
import io
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
from typing import Any

import numpy as np

from .. import errors
from ..errors import LocalRankError, LocalRankTimeoutError
from ._context import TIMEOUT_ENV, NodeContext

__all__ = [
    "STALL",
    "Closed",
    "Refused",
    "Server",
    "connect",
    "error_info",
    "exchange",
    "hello",
    "listen",
    "peer",
    "plain",
    "rebuild_error",
    "recv",
    "send",
    "socket_name",
]

log = logging.getLogger("shareddata")

STALL = 10.0  # seconds in which a peer that connected or started a message must complete it
MAGIC = b"SDN\x01"  # shareddata node protocol, version 1
FROM_PEER = ("hi", "ack", "fail")  # sent to local rank 0: builtins only
FROM_RANK_0 = ("beat", "data", "error", "mismatch", "reply")
_KINDS = FROM_PEER + FROM_RANK_0  # a kind's code on the wire is its index + 1
_HEADER = struct.Struct("!4sBI")
_LIMIT = {"hi": 1 << 20, "ack": 64, "fail": 64 << 10, "beat": 64, "data": 64 << 20}
_MAX_PEERS = 64  # connections local rank 0 serves at once


class Closed(Exception):
    """The peer closed the connection (or died)."""


class Refused(Exception):
    """The peer sent bytes that are not the message of the protocol expected here."""


def socket_name(ctx: NodeContext, kind: str, number: int) -> str:
    digest = hashlib.sha1(
        f"{ctx.job}|{ctx.node}|{kind}|{number}".encode(), usedforsecurity=False
    ).hexdigest()
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


def listen(name: str, backlog: int) -> socket.socket:
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


def connect(name: str, deadline: float) -> socket.socket | None:
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


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError()
    return left


def send(sock: socket.socket, kind: str, message: Any, deadline: float) -> None:
    """Send one message; ``TimeoutError`` at ``deadline``, ``Closed`` if the peer is gone."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    start = time.monotonic()
    try:
        sock.settimeout(_left(deadline))
        sock.sendall(_HEADER.pack(MAGIC, _KINDS.index(kind) + 1, len(body)) + body)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise Closed() from e
    except TimeoutError:
        raise TimeoutError(f"it read nothing in {time.monotonic() - start:.1f} s") from None


def _read(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        sock.settimeout(_left(deadline))
        try:
            count = sock.recv_into(view[got:])
        except ConnectionResetError as e:
            raise Closed() from e
        if not count:
            raise Closed()
        got += count
    return buffer


class _Builtins(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def recv(sock: socket.socket, deadline: float, kinds: Collection[str]) -> tuple[str, Any]:
    """One message of one of ``kinds``: ``(kind, value)``; Note [Framing on the node socket].

    Raises:
        TimeoutError: the message was not complete at ``deadline`` (saying how long it took).
        Closed: the peer is gone.
        Refused: what came is not a message of one of ``kinds``.
    """
    start = time.monotonic()
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
    """``value`` as builtins: numpy scalars as numbers, tuples of any kind as tuples.

    What a peer sends local rank 0 is read with no class (Note [Framing on the node socket]).
    """
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = type(value) if type(value) in (list, set, frozenset) else tuple
        return kind(plain(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


class Server:
    """Local rank 0's end of a node socket: every connection served in its own thread.

    A thread accepts; each peer that passes the uid check is handed to ``serve(conn,
    pid)`` in a thread of its own (at most ``_MAX_PEERS`` at once). When ``serve``
    raises -- the peer broke the protocol (:class:`Refused`), stalled, left -- that
    connection is closed and logged, and nothing else changes; when it returns, the
    connection stays open until :meth:`close`. ``dropped`` lists why peers were dropped.
    """

    def __init__(
        self, name: str, backlog: int, serve: Callable[[socket.socket, int], None]
    ) -> None:
        self.name, self.serve = name, serve
        self.listener = listen(name, backlog)
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.dropped: list[str] = []
        self.closed = False
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
            with self.lock:
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
            self.serve(conn, pid)
        except TimeoutError as e:
            self._drop(conn, pid, f"it stalled: {e}")
        except Closed:
            self._drop(conn, pid, "it left in the middle of the exchange")
        except Refused as e:
            self._drop(conn, pid, f"it sent {e}")
        except Exception as e:  # never let one peer end the server
            self._drop(conn, pid, f"serving it failed: {e!r}")

    def _drop(self, conn: socket.socket, pid: int | None, reason: str) -> None:
        with self.lock:
            self.conns.discard(conn)
            closed = self.closed
        if not closed:  # logged before the peer sees its end
            who = "a process" if pid is None else f"process {pid}"
            problem = f"{who} on node socket @{self.name} dropped: {reason}"
            self.dropped.append(problem)
            log.warning("%s", problem)
        conn.close()

    def close(self) -> None:
        """Stop accepting and end every connection (idempotent; their threads exit)."""
        with self.lock:
            self.closed = True
            conns, self.conns = self.conns, set()
        for sock in (self.listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            except OSError:
                pass
            sock.close()


# --------------------------------------------------------------------------------------
# Errors that cross ranks: type and message


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
    node that never hangs: every wait is bounded by ``timeout``, an exited rank 0
    is seen at once, and stray peers are dropped (Note [Framing on the node socket]).
    ``value`` is sent as builtins (:func:`plain`).

    Returns:
        This rank's element of ``respond``'s result.
    """
    start = time.monotonic()
    deadline = start + timeout
    size = ctx.local_world_size
    if ctx.local_rank == 0:
        values: dict[int, Any] = {0: value}
        conns: dict[int, socket.socket] = {}
        arrived = threading.Condition()

        def serve(conn: socket.socket, pid: int) -> None:
            _, message = recv(conn, time.monotonic() + STALL, ("hi",))
            rank, data = hello(message, ctx, object)
            with arrived:
                if rank in values:
                    raise Refused(f"a 'hi' from local rank {rank}, which already said hi")
                values[rank], conns[rank] = data, conn
                arrived.notify_all()

        server = Server(name, size, serve)
        try:
            with arrived:
                arrived.wait_for(lambda: len(values) == size, deadline - time.monotonic())
                missing = sorted(set(range(size)) - set(values))
            if missing:
                dropped = f" ({'; '.join(server.dropped[-3:])})" if server.dropped else ""
                raise LocalRankTimeoutError(
                    f"on node {ctx.node}, local rank 0 waited {time.monotonic() - start:.1f} s "
                    f"in {what} for local rank(s) {', '.join(map(str, missing))}, which never "
                    f"came{dropped}: it must be called on every local rank. Raise {TIMEOUT_ENV} "
                    "if they are slow."
                )
            try:
                replies = respond([values[r] for r in range(size)])
            except Exception as error:
                info = error_info(error)
                _answer(conns, {r: ("error", info) for r in conns})
                raise
            _answer(conns, {r: ("reply", replies[r]) for r in conns})
            return replies[0]
        finally:
            server.close()
    where = f"local rank {ctx.local_rank} of node {ctx.node}"
    client = connect(name, deadline)
    if client is None:
        raise LocalRankTimeoutError(
            f"{where} waited {time.monotonic() - start:.1f} s in {what} for local rank 0, which "
            f"never came: it must be called on every local rank. Raise {TIMEOUT_ENV} if it is "
            "slow."
        )
    with client:
        pid = peer(client)
        try:
            send(client, "hi", (ctx.local_rank, plain(value)), time.monotonic() + STALL)
            kind, data = recv(client, deadline, ("reply", "error"))
        except Closed:
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) exited in {what}") from None
        except TimeoutError:
            raise LocalRankTimeoutError(
                f"{where} waited {time.monotonic() - start:.1f} s in {what} for the other local "
                f"ranks. Raise {TIMEOUT_ENV} if they are slow."
            ) from None
        except Refused as e:
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) sent {e} in {what}") from None
        if kind == "error":
            raise rebuild_error(data, f"local rank 0 (pid {pid}) failed in {what}: ")
        return data


def _answer(conns: Mapping[int, socket.socket], messages: Mapping[int, tuple[str, Any]]) -> None:
    """Send each rank its message; a rank that cannot take it within ``STALL`` s misses it."""
    for rank, conn in conns.items():
        try:
            send(conn, *messages[rank], time.monotonic() + STALL)
        except (Closed, TimeoutError, OSError) as e:
            log.warning("could not answer local rank %d on the node socket: %r", rank, e)
