"""Peak private memory while HDF5 records (compound datasets) load into shared memory.

A compound dataset loads as one column per field (``rec/x``, ``rec/pos/lat``, ...),
each field copied out of bounded blocks of raw records (Note [Fields of raw
records] in ``sources/_hdf5_chunks.py``) or, with that switched off, converted by
HDF5 straight into its shared buffer; fixed-length string fields go through one
bounded block at a time. The private memory of the loading process should grow by
a few MiB, not by the data.

The baseline, in the same run: h5py reading the whole dataset (``ds[()]``), which
is what a user who converts records to columns by hand does first.

Private memory is ``RssAnon`` of ``/proc/self/status`` (shared memory counts under
``RssShmem``), sampled every 2 ms by a thread while each case runs.

Run: ``python benchmarks/bench_hdf5_records.py [--mib 256]``
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import tempfile
import threading
import time

import h5py
import numpy as np

from shareddata.sources.hdf5 import HDF5Dataset, HDF5Source


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_during(fn):  # type: ignore[no-untyped-def]
    """(result, seconds, peak RssAnon growth in bytes) of ``fn()``."""
    gc.collect()
    start = rss_anon()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        thread.join()
    peak[0] = max(peak[0], rss_anon())
    return result, seconds, peak[0] - start


CASES = ["columns", "raw", "converted", "whole"]


def run_case(case: str, path: str) -> tuple[float, float]:
    """One case in this (fresh) process: (seconds, peak private bytes)."""
    if case == "columns":
        ds = HDF5Dataset(path, progress=False)
        return float(len(ds.columns)), float(ds.nbytes)
    if case == "whole":

        def whole() -> int:
            with h5py.File(path) as f:
                return int(f["rec"][()].nbytes)

        _, seconds, peak = peak_during(whole)
        return seconds, peak
    if case == "converted":  # Note [Fields of raw records], switched off
        HDF5Source._record_runs = lambda *a: None  # type: ignore[method-assign]
    ds, seconds, peak = peak_during(lambda: HDF5Dataset(path, progress=False))
    assert ds[5]["rec/id"] == 5 and ds[5]["rec/tag"] == b"tag"
    return seconds, peak


def in_child(case: str, path: str) -> tuple[float, float]:
    """``run_case`` in a forked child, so that no case inherits another's heap."""
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        return pool.apply_async(run_case, (case, path)).get(timeout=600)  # type: ignore[no-any-return]


def write(path: str, mib: int) -> int:
    dtype = np.dtype(
        [
            ("x", "<f4"),
            ("y", ">f8"),
            ("v", "<f4", (4,)),
            ("id", "<i8"),
            ("tag", "S8"),
            ("pos", [("lat", "<f8"), ("lon", "<f8")]),
        ]
    )
    rows = (mib << 20) // dtype.itemsize
    step = 1 << 18
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("rec", (rows,), dtype, chunks=(1 << 14,))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            block = np.zeros(n, dtype)
            block["x"] = np.arange(start, start + n)
            block["id"] = np.arange(start, start + n)
            block["tag"] = b"tag"
            ds[start : start + n] = block
    return rows * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the records (MiB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.h5")
        nbytes = write(path, args.mib)
        with open(path, "rb") as f:  # the page cache warm for every case alike
            while f.read(64 << 20):
                pass
        results = {case: in_child(case, path) for case in CASES}
    columns, held = results["columns"]
    load_s, load_peak = results["raw"]
    conv_s, conv_peak = results["converted"]
    base_s, base_peak = results["whole"]
    mib = 1 << 20
    print(f"records: {nbytes / mib:.0f} MiB, {columns:.0f} columns, {held / mib:.0f} MiB shared")
    print(f"{'case':<34}{'seconds':>9}{'peak private MiB':>18}{'of the data':>13}")
    for name, s, peak in [
        ("HDF5Dataset (raw records)", load_s, load_peak),
        ("HDF5Dataset (HDF5 converts fields)", conv_s, conv_peak),
        ("h5py ds[()] (baseline)", base_s, base_peak),
    ]:
        print(f"{name:<34}{s:>9.2f}{peak / mib:>18.1f}{peak / nbytes:>13.3f}")
    print(f"ratio of peaks (raw records / h5py whole): {load_peak / max(base_peak, 1):.3f}")
    print(f"time, raw records / HDF5 converting: {load_s / conv_s:.2f}x")


if __name__ == "__main__":
    main()
