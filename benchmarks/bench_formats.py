"""HDF5 and Parquet loads: shareddata vs the format's own fastest read into private memory.

For each format (HDF5 contiguous, chunked, gzip; Parquet), side by side in one run,
each load in a fresh process (median of --repeats): wall time, peak private memory
during the load (``RssAnon`` sampled every ~2 ms) and private memory left after it,
as ratios. Baselines: ``h5py`` ``read_direct`` into a numpy array; ``pq.read_table``.

Run: python benchmarks/bench_formats.py [--size 1GiB] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(__file__), "results")

LOADERS = {
    "ours": "import shareddata as sd; ds = {ctor}",
    "h5py": (
        "import h5py, numpy as np\n"
        "with h5py.File({path!r}) as f:\n"
        "    d = f['x']; out = np.empty(d.shape, d.dtype); d.read_direct(out)"
    ),
    "arrow": "import pyarrow.parquet as pq; t = pq.read_table({path!r}); x = t.column('x')",
}

CHILD = """
import os, sys, time
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
{imports}
print("READY", anon(), flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
{load}
t1 = time.perf_counter()
print("DONE", t1 - t0, anon(), flush=True)
sys.stdin.readline()
"""


def _status_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def run_once(load: str, imports: str) -> dict[str, float]:
    code = CHILD.format(imports=imports, load=load)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin and proc.stdout
    ready = proc.stdout.readline().split()
    base = int(ready[1])
    peak = base
    proc.stdin.write("\n")
    proc.stdin.flush()
    os.set_blocking(proc.stdout.fileno(), False)
    line = ""
    while not line:
        peak = max(peak, _status_anon(proc.pid))
        time.sleep(0.002)
        line = proc.stdout.readline()
    _, seconds, after = line.split()
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(60)
    return {"s": float(seconds), "peak": peak - base, "after": int(after) - base}


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=str, default="1GiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from shareddata.cli import parse_size

    nbytes = parse_size(args.size)
    rows = nbytes // 4096
    imports = "import numpy, torch, h5py, pyarrow.parquet, shareddata"
    out: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        import h5py
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = np.random.default_rng(0).random((rows, 1024), dtype=np.float32)
        files = {}
        for name, kw in [
            ("hdf5 contiguous", {}),
            ("hdf5 chunked", {"chunks": (256, 1024)}),
            ("hdf5 gzip", {"chunks": (256, 1024), "compression": "gzip", "compression_opts": 1}),
        ]:
            path = os.path.join(tmp, name.replace(" ", "_") + ".h5")
            with h5py.File(path, "w") as f:
                f.create_dataset("x", data=data, **kw)
            files[name] = (path, f"sd.HDF5Dataset({path!r}, progress=False)", "h5py")
        path = os.path.join(tmp, "data.parquet")
        column = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), 1024)
        pq.write_table(pa.table({"x": column}), path, row_group_size=16384)
        files["parquet"] = (path, f"sd.ParquetDataset({path!r}, progress=False)", "arrow")
        del data, column
        for name, (path, ctor, base) in files.items():
            with open(path, "rb") as f:  # warm the page cache for both methods alike
                f.read()
            ours = [
                run_once(LOADERS["ours"].format(ctor=ctor), imports) for _ in range(args.repeats)
            ]
            theirs = [
                run_once(LOADERS[base].format(path=path), imports) for _ in range(args.repeats)
            ]
            out[name] = {"ours": median(ours), "baseline": median(theirs)}
            print(name, out[name], flush=True)
    lines = [
        f"# HDF5 and Parquet loads ({nbytes / 2**20:.0f} MiB of float32, 4 KiB rows)",
        "",
        "Each load in a fresh process, median of "
        f"{args.repeats}; warm page cache. Baselines: h5py `read_direct` into numpy, "
        "`pq.read_table`. Private = peak `RssAnon` growth during the load.",
        "",
        "| format | ours s | baseline s | time ratio | ours peak private / data | "
        "baseline peak / data | ours private after / data |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in out.items():
        o, b = r["ours"], r["baseline"]
        lines.append(
            f"| {name} | {o['s']:.2f} | {b['s']:.2f} | {o['s'] / b['s']:.2f}x | "
            f"{o['peak'] / nbytes:.3f} | {b['peak'] / nbytes:.3f} | {o['after'] / nbytes:.3f} |"
        )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "formats.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "formats.json"), "w") as f:
        json.dump(out, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
