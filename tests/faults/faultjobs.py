"""Functions that scenarios hand to spawned workers (importable, hence picklable)."""

from __future__ import annotations


def check_label(sample):
    """A transform that fails on one sample, as a real data bug would."""
    if int(sample["i"]) == 700:
        raise ValueError("sample 700 has a bad label")
    return sample


def file_system_strategy(worker_id):
    """worker_init_fn: send batches by /dev/shm name instead of one descriptor per tensor."""
    import os

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    segments = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            segments += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shareddata")
        except OSError:
            pass
    print(f"@@WORKER {worker_id} holds {segments} segment descriptors", flush=True)


def try_writes(barrier, report, worker_id):
    """worker_init_fn: worker 0 tries every way to write to the dataset's memory.

    Rows 0-4 of column ``x`` (int64, row i == i): row 0 through the column's numpy
    array (refused), row 1 through a fetched sample (a copy), then forced writes: row 2
    after setting ``flags.writeable``, row 3 through the column's torch view, row 4
    through the raw mapping, and writes what it saw to the file ``report`` (not to
    stdout: a forkserver child's stdout is the one the server started with, which may
    be an earlier test's capture). The sibling worker waits on ``barrier`` until it is done.
    """
    import json

    import numpy as np
    from torch.utils.data import get_worker_info

    ds = get_worker_info().dataset
    shared = ds._columns["x"].arrays["data"]
    if worker_id == 0:
        out = {}
        arr = shared.numpy()
        try:
            arr[0] = -1
            out["numpy"] = "written"
        except ValueError:
            out["numpy"] = "refused"
        sample = ds[1]["x"]
        sample += 100
        out["sample_then"] = int(ds[1]["x"])
        try:
            arr.flags.writeable = True
            arr[2] = -2
            out["flag"] = "written"
        except ValueError:
            out["flag"] = "refused"
        shared.torch()[3] = -3
        raw = shared.segment.view(shared.offset + 4 * 8, 8).view(np.int64)
        raw[0] = -4
        out["own_view"] = shared.numpy()[:5].tolist()
        with open(report, "w") as f:
            json.dump(out, f)
    barrier.wait(timeout=120)
