"""Run under torchrun with 2 local ranks: what the other rank sees when local rank 0 fails.

Scenarios (argv[1]):

* ``errors``: local rank 0 fails to load (a missing file; a dataset too large for
  memory); then the ranks build different data (a mismatch); then local rank 0
  never builds the dataset at all (the other rank must time out). Each rank prints
  ``RESULT {json}`` with what it raised and how long it took.
* ``dies``: local rank 0 is SIGKILLed in the middle of its load.
"""

import json
import os
import signal
import sys
import time

import numpy as np

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


def main():
    scenario, folder = sys.argv[1], sys.argv[2]
    if scenario == "errors":
        errors_scenario(folder)
    elif scenario == "selection":
        selection_scenario(folder)
    elif scenario == "dies":
        attempt("dies", lambda: build(lambda: _Dying()))


if __name__ == "__main__":
    main()
