"""The node socket against stray peers: garbage, lies, stalls and other users.

Local rank 0 (``_publish`` for a dataset, ``exchange`` for ``sd.verify``) runs in a
thread of this process and the other local rank in another, with explicit
``NodeContext``s; the stray peers are raw sockets that write bytes of their own, and a
forked child that runs as another user. Each stray must be dropped alone and logged,
and the real rank served as if it were not there.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import re
import socket
import struct
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import hard_timeout

from shareddata.distributed import LocalRankError, LocalRankTimeoutError, NodeContext, _node
from shareddata.distributed._node import _publish, _receive

MAGIC = b"SDN\x02"  # the protocol's name and version
HI, ACK = 1, 2  # codes of two message kinds on the wire
NOBODY = 65534


def frame(code: int, message: object) -> bytes:
    body = pickle.dumps(message)
    return struct.pack("!4sBI", MAGIC, code, len(body)) + body


class Trap:
    """Unpickling it creates a file: proof that a peer's pickle ran code in local rank 0."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def strays(trap: str, bad_rank: tuple) -> dict[str, bytes]:
    """What stray peers send, keyed by what local rank 0's log must say of it."""
    return {
        "not shareddata's node protocol": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "announcing a 2147483648-byte 'hi'": struct.pack("!4sBI", MAGIC, HI, 1 << 31),
        "a 'hi' of the wrong shape: 'hello'": frame(HI, "hello"),
        f"a 'hi' of the wrong shape: {bad_rank}": frame(HI, bad_rank),  # local rank 7 of 2
        "it names io.open": frame(HI, (1, Trap(trap), "label")),
        "a message of kind 'ack' where it expected 'hi'": frame(ACK, None),
    }


def node(size: int = 2) -> list[NodeContext]:
    job = f"test-{uuid.uuid4().hex}"
    return [NodeContext(r, size, 0, 1, r, size, job) for r in range(size)]


def send_stray(name: str, data: bytes) -> bytes:
    """Connect, send ``data``, and return what comes back before local rank 0 hangs up."""
    sock = _node.connect(name, time.monotonic() + 30)
    assert sock is not None, "local rank 0 never listened"
    with sock:
        sock.sendall(data)
        sock.settimeout(30)
        try:
            return sock.recv(1 << 16)  # b"": dropped
        except ConnectionResetError:  # dropped with bytes of ours unread
            return b""


class Trickle(threading.Thread):
    """A peer that announces a 1000-byte 'hi' and then sends one byte every 0.2 s."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.name_, self.sent, self.connected = name, 0, threading.Event()

    def run(self) -> None:
        sock = _node.connect(self.name_, time.monotonic() + 30)
        assert sock is not None
        with sock:
            sock.sendall(struct.pack("!4sBI", MAGIC, HI, 1000))
            self.connected.set()
            try:
                while self.sent < 300:  # 60 s
                    time.sleep(0.2)
                    sock.sendall(b"x")
                    self.sent += 1
            except OSError:  # dropped
                pass


def in_thread(target, *args) -> dict:
    """Run ``target(*args)`` in a thread; the dict gets its ``result`` or ``error``."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = target(*args)
        except BaseException as e:
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def drops(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "shareddata")


def test_node_socket_drops_bad_peers_and_serves_the_rank(caplog, tmp_path):
    """Garbage, a 2 GiB length header, pickles of the wrong shape or with a class, an early
    ack, a peer stalled in the middle of a message: each dropped and logged while the
    real local rank 1 loads (before: the first one ended local rank 0's server and every
    rank's load failed; the slow one blocked it for good)."""
    caplog.set_level(logging.WARNING, "shareddata")
    zero, one = node()
    name = _node.socket_name(zero, "dataset", 0)
    go = threading.Event()
    payload = {"rows": list(range(100))}

    def load():
        go.wait(60)
        return payload

    rank_0 = in_thread(_publish, zero, name, 0, "fp", "label", load, 30.0)
    trap = str(tmp_path / "trap")
    for expected, data in strays(trap, (7, "fp", "label")).items():
        assert send_stray(name, data) == b"", expected  # hung up on, without a word
        assert expected in drops(caplog)
    slow = Trickle(name)
    slow.start()
    assert slow.connected.wait(30)
    go.set()
    assert _receive(one, name, 0, "fp", "label", 30.0) == payload  # while the slow one trickles
    rank_0["thread"].join(60)
    assert rank_0.get("result") == payload, rank_0
    slow.join(60)
    assert slow.sent < 300  # hung up on when local rank 0 was done
    assert not os.path.exists(trap)  # no peer's pickle ever ran code


def test_a_stalled_peer_is_dropped_and_verify_goes_on(caplog, monkeypatch):
    """The same strays on the socket ``sd.verify`` meets on, and a peer that stops in the
    middle of its message: dropped after STALL s, then every local rank gets its answer."""
    monkeypatch.setattr(_node, "STALL", 1.0, raising=False)  # (527c53a has none)
    caplog.set_level(logging.WARNING, "shareddata")
    zero, one, two = node(3)
    name = _node.socket_name(zero, "verifybefore", 0)

    def respond(values):
        return [sum(values)] * len(values)

    rank_0 = in_thread(_node.exchange, zero, name, 1, respond, 30.0, "sd.verify()")
    for expected, data in strays("/nonexistent/trap", (7, 1)).items():
        assert send_stray(name, data) == b"", expected
        assert expected in drops(caplog)
    slow = Trickle(name)
    slow.start()
    slow.join(30)
    assert not slow.is_alive()  # hung up on in the middle of its message
    assert "dropped: it stalled: it sent no complete message in " in drops(caplog)
    rank_2 = in_thread(_node.exchange, two, name, 100, respond, 30.0, "sd.verify()")
    # a numpy number crosses as a number (local rank 0 reads peers with no class)
    assert _node.exchange(one, name, np.int64(10), respond, 30.0, "sd.verify()") == 111
    for rank in (rank_0, rank_2):
        rank["thread"].join(60)
        assert rank.get("result") == 111, rank


def _foreign_peer(names: list[str], out: int) -> None:
    """As uid 65534: connect to each socket and say how it ended."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    ends = []
    for name in names:
        sock = _node.connect(name, time.monotonic() + 60)
        if sock is None:
            ends.append("never listened")
        else:
            with sock:
                sock.settimeout(30)
                try:
                    ends.append("dropped" if sock.recv(1) == b"" else "answered")
                except OSError as e:
                    ends.append(repr(e))
        os.write(out, (json.dumps(ends) + "\n").encode())
    os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_a_peer_of_another_user_is_dropped_on_both_sockets(caplog):
    """A bare connect by uid 65534 to the dataset and the verify socket: dropped before a
    byte is read, and both ranks load and verify (before: local rank 0's sd.verify raised
    and the other rank waited its timeout for 'local rank 0, which never came')."""
    caplog.set_level(logging.WARNING, "shareddata")
    zero, one = node()
    names = [_node.socket_name(zero, "dataset", 0), _node.socket_name(zero, "verifybefore", 0)]
    read, write = os.pipe()
    child = multiprocessing.get_context("fork").Process(target=_foreign_peer, args=(names, write))
    child.start()  # before this test starts a thread
    os.close(write)
    with os.fdopen(read) as lines:
        go = threading.Event()

        def rank_0_job():
            def load():
                go.wait(60)
                return "columns"

            columns = _publish(zero, names[0], 0, "fp", "label", load, 30.0)
            return columns, _node.exchange(zero, names[1], 1, lambda v: v, 30.0, "sd.verify()")

        rank_0 = in_thread(rank_0_job)
        assert json.loads(lines.readline()) == ["dropped"]
        go.set()
        assert _receive(one, names[0], 0, "fp", "label", 30.0) == "columns"
        assert json.loads(lines.readline()) == ["dropped", "dropped"]
        assert _node.exchange(one, names[1], 2, lambda v: v, 30.0, "sd.verify()") == 2
        rank_0["thread"].join(60)
        assert rank_0.get("result") == ("columns", 1), rank_0
    child.join(30)
    assert child.exitcode == 0
    assert drops(caplog).count(f"(uid {NOBODY}) is at the other end") == 2


def stated_wait(message: str) -> float:
    (seconds,) = re.findall(r"(?:waited|nothing for) (\d+(?:\.\d+)?) s", message)
    return float(seconds)


def test_every_wait_is_bounded_and_says_how_long_it_was():
    """A local rank 0 that never answers, a peer that never finishes its message, a rank
    that never comes: each wait ends at its bound, and the error states the time it
    waited (before: finish() waited for a stalled peer for good; messages echoed the
    configured timeout)."""
    zero, one = node()
    name = _node.socket_name(zero, "dataset", 0)
    with hard_timeout(120, "a wait on the node socket"):
        _bounded_waits(zero, one, name)


def _bounded_waits(zero: NodeContext, one: NodeContext, name: str) -> None:
    # local rank 0 accepts and then says nothing (not even a heartbeat)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind("\0" + name)
        mute.listen()
        start = time.monotonic()
        with pytest.raises(LocalRankTimeoutError, match="stopped answering") as error:
            _receive(one, name, 0, "fp", "label", 0.5)
        assert 0.5 <= stated_wait(str(error.value)) <= time.monotonic() - start + 0.05
    # a peer stalled in its message keeps neither finish() nor the ranks waiting
    slow = Trickle(name)
    slow.start()
    start = time.monotonic()
    with pytest.raises(LocalRankTimeoutError, match=r"local rank\(s\) 1 to attach") as error:
        _publish(zero, name, 0, "fp", "label", lambda: slow.connected.wait(30), 0.5)
    assert 0.5 <= stated_wait(str(error.value)) <= time.monotonic() - start + 0.05
    slow.join(30)
    assert not slow.is_alive()  # hung up on when local rank 0 gave up
    # a peer whose rank 0 answers garbage is told so, by name
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as liar:
        liar.bind("\0" + name)
        liar.listen()
        answered = threading.Event()

        def lie() -> None:
            with liar.accept()[0] as conn:
                conn.sendall(b"\xff" * 64)
                answered.wait(30)

        talk = in_thread(lie)
        with pytest.raises(LocalRankError, match="not shareddata's node protocol"):
            _receive(one, name, 0, "fp", "label", 5.0)
        answered.set()
        talk["thread"].join(10)


def test_a_rank_that_never_comes_to_verify_is_named_on_every_rank():
    """Local ranks 0 and 1 of 3 meet in sd.verify, local rank 2 never does: both raise a
    LocalRankTimeoutError naming local rank 2, local rank 1 with local rank 0's words
    (before: local rank 1 saw only that local rank 0 exited)."""
    zero, one, _ = node(3)
    name = _node.socket_name(zero, "verifybefore", 0)
    with hard_timeout(60, "sd.verify with a rank missing"):
        rank_0 = in_thread(_node.exchange, zero, name, 1, lambda v: v, 1.0, "sd.verify()")
        with pytest.raises(LocalRankTimeoutError, match=r"local rank 0 \(pid \d+\)") as error:
            _node.exchange(one, name, 2, lambda v: v, 1.0, "sd.verify()")
        rank_0["thread"].join(30)
    for message in (str(error.value), str(rank_0.get("error"))):
        assert "for local rank(s) 2, which never came" in message, message
    assert isinstance(rank_0.get("error"), LocalRankTimeoutError), rank_0
