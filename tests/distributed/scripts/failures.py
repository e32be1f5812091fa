"""Run under torchrun with 2 local ranks: what the other rank sees when local rank 0 fails.

Scenarios (argv[1]):

* ``errors``: local rank 0 fails to load (a missing file; a dataset too large for
  memory); then the ranks build different data (a mismatch); then local rank 0
  never builds the dataset at all (the other rank must time out). Each rank prints
  ``RESULT {json}`` with what it raised and how long it took.
* ``selection``: one file, a different selection per rank.
* ``wrapped``: SharedDataset / SharedList of one class and length over different data
  (refused), over the same data (shared; the attaching rank reads only a sample),
  and over a dataset whose items are randomly augmented (shared).
* ``dies``: local rank 0 is SIGKILLed in the middle of its load.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import shareddata as sd
from shareddata.columns._columns import ColumnSpec
from shareddata.datasets._load import build

LOCAL_RANK = int(os.environ["LOCAL_RANK"])


def attempt(name, run):
    start = time.monotonic()
    try:
        run()
        outcome = {"type": None, "message": ""}
    except Exception as e:  # report, keep going
        mro = [c.__name__ for c in type(e).__mro__]
        outcome = {"type": type(e).__name__, "message": str(e), "mro": mro}
    outcome.update(scenario=name, local_rank=LOCAL_RANK, seconds=time.monotonic() - start)
    # one write of < 4096 bytes: the two ranks' lines cannot interleave in the pipe
    sys.stdout.write("RESULT " + json.dumps(outcome) + "\n")
    sys.stdout.flush()


class _Huge:
    """A source whose one column would need 4 PiB: rank 0's capacity check refuses it."""

    label = "huge.bin"

    def specs(self):
        return [ColumnSpec("x", 1 << 50, np.dtype(np.float32))]

    def read(self, spec, buffers, progress):
        raise AssertionError("never reached")

    def close(self):
        pass


class _Dying:
    """A source that kills its own process (local rank 0) halfway through reading."""

    label = "dying.bin"

    def specs(self):
        return [ColumnSpec("x", 1024, np.dtype(np.float32))]

    def read(self, spec, buffers, progress):
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self):
        pass


def errors_scenario(folder):
    attempt("missing", lambda: sd.NumpyDataset(os.path.join(folder, "missing.npy")))
    attempt("full", lambda: build(lambda: _Huge()))
    data = np.full(1000, LOCAL_RANK, dtype=np.int64)  # differs between the ranks
    attempt("mismatch", lambda: sd.NumpyDataset(data))
    if LOCAL_RANK == 0:
        time.sleep(float(os.environ["SHAREDDATA_TIMEOUT"]) + 3)  # never builds it
    else:
        attempt("absent", lambda: sd.NumpyDataset(np.arange(10)))


def selection_scenario(folder):
    """One file, a different selection per rank: refused, never the other rank's data."""
    path = os.path.join(folder, "{}")
    keys = ["x", "y"] if LOCAL_RANK == 0 else ["y", "x"]
    attempt("hdf5 keys", lambda: sd.HDF5Dataset(path.format("xy.h5"), keys, output="tuple"))
    attempt("parquet columns", lambda: sd.ParquetDataset(path.format("xy.parquet"), keys))
    files = [
        path.format("xy.parquet"),
        path.format("more.parquet" if LOCAL_RANK else "xy2.parquet"),
    ]
    attempt("parquet files", lambda: sd.ParquetDataset(files))
    fill = -1 if LOCAL_RANK == 0 else -999
    attempt(
        "parquet fill", lambda: sd.ParquetDataset(path.format("nulls.parquet"), fill_value=fill)
    )
    shard = "node" if LOCAL_RANK == 0 else None
    attempt("shard", lambda: sd.HDF5Dataset(path.format("xy.h5"), ["x"], shard=shard))
    attempt("same", lambda: sd.HDF5Dataset(path.format("xy.h5"), ["x", "y"]))  # agreed: fine


class Rows(torch.utils.data.Dataset):
    """A user's dataset: 64 items ``(tensor, int)`` from ``offset``; ``noise`` adds a random
    augmentation drawn from torch's global generator (seeded differently on each rank)."""

    def __init__(self, offset, noise=False):
        self.offset, self.noise, self.calls = offset, noise, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.calls += 1
        x = torch.full((3,), float(i + self.offset))
        if self.noise:
            x = x + torch.rand(3)
        return x, i + self.offset


def wrapped_scenario(folder):
    """SharedDataset / SharedList of one class and length over different data: refused."""
    torch.manual_seed(1000 + LOCAL_RANK)  # each rank's own random state, as in training
    differ = 1 if LOCAL_RANK else 0  # rank 1's row 63 only differs (the last item sampled)
    rows = [{"id": i, "label": f"#{i}"} for i in range(64)]
    other = rows[:63] + [{"id": 63, "label": "#63" if not differ else "changed"}]
    attempt("shared dataset data", lambda: sd.SharedDataset(Rows(differ * 100)))
    attempt("shared list data", lambda: sd.SharedList(other))
    same = Rows(0)
    got = {}

    def wrap_same():
        got["ds"] = sd.SharedDataset(same)

    attempt("shared dataset same", wrap_same)
    ds = got.get("ds")
    line = {"scenario": "calls", "local_rank": LOCAL_RANK, "calls": same.calls}
    line["item"] = ds[5][1] if ds is not None else None
    sys.stdout.write("RESULT " + json.dumps(line) + "\n")
    sys.stdout.flush()
    attempt("shared list same", lambda: sd.SharedList(rows))
    noisy = Rows(0, noise=True)

    def wrap_noisy():
        got["noisy"] = sd.SharedDataset(noisy)

    attempt("shared dataset random", wrap_noisy)
    if "noisy" in got:  # every rank reads local rank 0's (random) items
        value = got["noisy"][7][0].tolist()
        line = {"scenario": "noisy item", "local_rank": LOCAL_RANK, "value": value}
        sys.stdout.write("RESULT " + json.dumps(line) + "\n")
        sys.stdout.flush()
    attempt("shared list generator", lambda: sd.SharedList(r for r in rows))


def main():
    scenario, folder = sys.argv[1], sys.argv[2]
    if scenario == "errors":
        errors_scenario(folder)
    elif scenario == "selection":
        selection_scenario(folder)
    elif scenario == "wrapped":
        wrapped_scenario(folder)
    elif scenario == "dies":
        attempt("dies", lambda: build(lambda: _Dying()))


if __name__ == "__main__":
    main()
