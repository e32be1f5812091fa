"""Run under ``torchrun --max-restarts=1``: local rank 1 SIGKILLs itself mid-epoch once.

Every rank of every incarnation builds the dataset from ``<npy>`` (local rank 0
loads, rank 1 attaches: node sharing) and iterates one epoch with a forked
DataLoader worker. In incarnation 0 (``TORCHELASTIC_RESTART_COUNT=0``) local rank 1
kills itself after two batches, while rank 0 is still in its epoch; the agent stops
rank 0 and starts both again. Each rank writes ``<out>/inc<N>-rank<R>.json``
(files, not stdout: the ranks share one pipe) with the segments it mapped, when
it has them, and then whether its epoch summed to the right value.
"""

import json
import os
import signal
import sys
import time

import numpy as np
from torch.utils.data import DataLoader

import shareddata as sd


def mapped_segments() -> list[list[int]]:
    """(device, inode) of the dataset segments this process maps (not batch memfds)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == "/memfd:shareddata (deleted)":
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                found.add((os.makedev(major, minor), int(parts[4])))
    return sorted(map(list, found))


def main() -> None:
    npy, out = sys.argv[1], sys.argv[2]
    incarnation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["LOCAL_RANK"])
    path = os.path.join(out, f"inc{incarnation}-rank{rank}.json")
    ds = sd.NumpyDataset(npy, progress=False)
    report = {
        "incarnation": incarnation,
        "rank": rank,
        "pid": os.getpid(),
        "segments": mapped_segments(),
        "done": False,
    }
    with open(path, "w") as f:
        json.dump(report, f)
    loader = DataLoader(
        ds, batch_size=256, num_workers=1, multiprocessing_context="fork", timeout=60
    )
    total = 0.0
    for i, batch in enumerate(loader):
        total += float(batch["data"].sum())
        if incarnation == 0 and rank == 1 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, once
        if incarnation == 0 and rank == 0:
            time.sleep(0.5)  # still in its epoch when rank 1 dies; the agent stops it
    expected = float(np.load(npy, mmap_mode="r").astype(np.float64).sum())
    report.update(done=True, correct=abs(total - expected) < 1e-6 * max(1.0, expected))
    with open(path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
