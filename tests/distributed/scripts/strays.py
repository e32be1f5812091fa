"""Run under torchrun with 2 local ranks: stray peers on local rank 0's sockets.

Before it builds the dataset, local rank 1 sends local rank 0's dataset socket what a
stray process might: garbage, a 2 GiB length header, a pickle of the wrong shape, an
early ack, and a message it never finishes (a byte every 0.5 s); as root, a child that
runs as uid 65534 connects to it as well. Then it loads; before ``sd.verify``, the same
on the verify socket. Each rank writes ``<out>/rank<LOCAL_RANK>.json``: whether it
loaded the right data, the node's verify report, and the warnings it logged.
"""

import json
import logging
import os
import pickle
import struct
import sys
import threading
import time

import numpy as np
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata.distributed import node_context, socket_name
from shareddata.distributed._node import connect

MAGIC, HI, ACK = b"SDN\x02", 1, 2  # the protocol's name and version; two message kinds
NOBODY = 65534


def frame(code, message):
    body = pickle.dumps(message)
    return struct.pack("!4sBI", MAGIC, code, len(body)) + body


STRAYS = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    struct.pack("!4sBI", MAGIC, HI, 1 << 31),
    frame(HI, "hello"),
    frame(ACK, None),
]


def hung_up(name, data):
    """Send ``data`` as a stray peer: True if local rank 0 hung up on it."""
    sock = connect(name, time.monotonic() + 60)
    with sock:
        sock.sendall(data)
        sock.settimeout(20)
        try:
            return sock.recv(64) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def trickle(name):
    """Announce a 1000-byte message, then send a byte every 0.5 s until hung up on."""
    sock = connect(name, time.monotonic() + 60)
    with sock:
        sock.sendall(struct.pack("!4sBI", MAGIC, HI, 1000))
        try:
            for _ in range(120):
                time.sleep(0.5)
                sock.sendall(b"x")
        except OSError:
            pass


def strays(name):
    threading.Thread(target=trickle, args=(name,), daemon=True).start()
    return [hung_up(name, data) for data in STRAYS]


def foreign(names):
    """A child that runs as another user and connects to each socket in turn (root only).

    Returns its pid and a pipe that gets a byte each time local rank 0 hangs up on it.
    """
    if os.geteuid() != 0:
        return None, None
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    code = 0
    for name in names:
        sock = connect(name, time.monotonic() + 60)
        if sock is None:
            os._exit(2)
        with sock:
            sock.settimeout(30)
            try:
                code |= sock.recv(1) != b""
            except OSError:
                code |= 4
        os.write(write, b".")
    os._exit(code)


def main():
    path, out_dir = sys.argv[1], sys.argv[2]
    local_rank = int(os.environ["LOCAL_RANK"])
    ctx = node_context()
    names = [socket_name(ctx, "dataset", 0), socket_name(ctx, "verifybefore", 0)]
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("shareddata").addHandler(handler)
    child, dropped = foreign(names) if local_rank == 1 else (None, None)
    out = {"local_rank": local_rank}
    if local_rank == 1:
        out["dataset_strays"] = strays(names[0])
        if dropped is not None:
            os.read(dropped, 1)  # the other user's peer was hung up on
    ds = sd.NumpyDataset(path, progress=False)
    (rows,) = ds[0 : len(ds)].values()
    out["correct"] = bool(np.array_equal(rows.numpy(), np.load(path)))
    out["segments"] = sorted(ds.segment_identity())
    if local_rank == 1:
        out["verify_strays"] = strays(names[1])
        if dropped is not None:
            os.read(dropped, 1)
    report = sd.verify(DataLoader(ds, batch_size=64), batches=2, max_duplication=None)
    out["local_ranks"], out["rank_copies"] = report.local_ranks, report.rank_copies
    if child is not None:
        out["foreign_exit"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    out["warnings"] = warnings
    with open(os.path.join(out_dir, f"rank{local_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
