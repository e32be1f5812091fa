"""The node socket: length-prefixed pickles over an abstract Unix socket, peers checked by uid.

Also what crosses it when a rank fails (:func:`error_info`, :func:`rebuild_error`) and
the gather-and-reply round ``sd.verify`` uses across local ranks (:func:`exchange`).
Why a socket: Note [How local ranks share one copy] in ``_node_load.py``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import socket
import struct
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .. import errors
from ..errors import LocalRankError, LocalRankTimeoutError
from ._context import TIMEOUT_ENV, NodeContext

__all__ = [
    "Closed",
    "connect",
    "error_info",
    "exchange",
    "listen",
    "peer",
    "rebuild_error",
    "recv",
    "send",
    "socket_name",
]

_MAX_MESSAGE = 64 << 20


class Closed(Exception):
    """The peer closed the connection (or died)."""


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
            f"process {pid} (uid {uid}) answered on shareddata's node socket, but this process "
            f"runs as uid {os.geteuid()}: refusing it. Every rank of a job must run as one user."
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


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except ConnectionResetError as e:
            raise Closed() from e
        if not chunk:
            raise Closed()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout: float) -> Any:
    """One message; ``TimeoutError`` after ``timeout`` s, ``Closed`` if the peer is gone."""
    sock.settimeout(max(timeout, 0.001))
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > _MAX_MESSAGE:
        raise LocalRankError(f"a {size}-byte message on shareddata's node socket: refused")
    return pickle.loads(_recv_exact(sock, size))


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
    node that never hangs: every wait is bounded by ``timeout``, and an exited rank 0
    is seen at once.

    Returns:
        This rank's element of ``respond``'s result.
    """
    deadline = time.monotonic() + timeout
    size = ctx.local_world_size
    if ctx.local_rank == 0:
        listener = listen(name, size)
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
                        f"be called on every local rank. Raise {TIMEOUT_ENV} if they are slow."
                    )
                readable, _, _ = select.select([listener, *pending], [], [], min(remaining, 0.5))
                for sock in readable:
                    if sock is listener:
                        conn, _ = listener.accept()
                        peer(conn)
                        pending.append(conn)
                        continue
                    pending.remove(sock)
                    try:
                        _, (rank, data) = recv(sock, 10)
                    except (Closed, TimeoutError, OSError):
                        sock.close()
                        continue
                    values[rank], conns[rank] = data, sock
            try:
                replies = respond([values[r] for r in range(size)])
            except Exception as error:
                for conn in conns.values():
                    send(conn, ("error", error_info(error)))
                raise
            for rank, conn in conns.items():
                send(conn, ("reply", replies[rank]))
            return replies[0]
        finally:
            for conn in conns.values():
                conn.close()
            listener.close()
    where = f"local rank {ctx.local_rank} of node {ctx.node}"
    client = connect(name, deadline)
    if client is None:
        raise LocalRankTimeoutError(
            f"{where} waited {timeout:.0f} s in {what} for local rank 0, which never came: it "
            f"must be called on every local rank. Raise {TIMEOUT_ENV} if it is slow."
        )
    with client:
        pid = peer(client)
        send(client, ("hi", (ctx.local_rank, value)))
        try:
            kind, data = recv(client, max(deadline - time.monotonic(), 0.001))
        except Closed:
            raise LocalRankError(f"{where}: local rank 0 (pid {pid}) exited in {what}") from None
        except TimeoutError:
            raise LocalRankTimeoutError(
                f"{where} waited {timeout:.0f} s in {what} for the other local ranks"
            ) from None
        if kind == "error":
            raise rebuild_error(data, f"local rank 0 (pid {pid}) failed in {what}: ")
        return data
