"""Arrow files by path: the loading process's peak memory, against reading the table first.

One table of --mib MiB (a 1 KiB float32 vector, an int64 label and a short string per
row) is written by pyarrow three ways: an IPC file (uncompressed), an IPC stream (how
HF ``datasets`` writes its ``.arrow`` files) and a Feather v2 file (lz4, Feather's
default). Each is loaded into shared memory, each way in a fresh interpreter:

* ``sd.ArrowDataset(path)``: the file memory-mapped, read one column at a time
  (Note [Reading Arrow IPC files one column at a time] in ``sources/_arrow_ipc.py``);
* ``read table, then ArrowDataset(table)``: what users had to write before
  (``pa.ipc.open_file(path).read_all()``, a private copy of the whole table);
* ``mapped table, then ArrowDataset(table)``: ``read_all()`` over ``pa.memory_map``
  (zero-copy when uncompressed, but every column's file pages end up mapped).

For each: the load time, the peak growth of the process's RSS over its start
(``VmHWM`` after ``clear_refs``, the kernel's own peak: shared copy + temporaries +
mapped file pages), and the peak growth of its private anonymous memory (``RssAnon``,
sampled by the parent every ~1 ms). The shared copy itself is ``nbytes``; figures are
quoted as ratios to it.

Run: python benchmarks/bench_arrow_files.py [--mib 256] [--reps 3] [--out benchmarks/results]
(under ``flock /tmp/shareddata-heavy.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather

ROW_FLOATS = 256  # 1 KiB per row

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import pyarrow as pa, shareddata as sd

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) << 10
        return out

    how, kind, path, warm = sys.argv[1:5]

    def load(path):
        if how == "path":
            return sd.ArrowDataset(path, progress=False)
        source = pa.memory_map(path) if how == "mapped" else pa.OSFile(path)
        reader = pa.ipc.open_stream(source) if kind == "stream" else pa.ipc.open_file(source)
        return sd.ArrowDataset(reader.read_all(), progress=False)

    load(warm)  # the same code path on a tiny file: lazy imports are not measured
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status()
    start = time.perf_counter()
    ds = load(path)
    seconds = time.perf_counter() - start
    after = status()
    print(json.dumps({"seconds": seconds, "nbytes": ds.nbytes, "before": before,
                      "after": after, "rows": len(ds)}))
    """
)

METHODS = {
    "path": "sd.ArrowDataset(path)",
    "read": "read table, then ArrowDataset(table)",
    "mapped": "mapped table, then ArrowDataset(table)",
}


def make_table(mib: int, seed: int = 0) -> pa.Table:
    rows = (mib << 20) // (ROW_FLOATS * 4 + 8 + 24)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(rows * ROW_FLOATS, dtype=np.float32)
    text = pa.array([f"sample {i:>12}" for i in range(rows)])
    return pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x), ROW_FLOATS),
            "label": pa.array(rng.integers(0, 1000, rows)),
            "text": text,
        }
    )


def write_files(folder: str, mib: int, name: str = "t") -> dict[str, str]:
    table = make_table(mib)
    paths = {
        "IPC file": os.path.join(folder, f"{name}.arrow"),
        "IPC stream": os.path.join(folder, f"{name}.arrows"),
        "Feather v2 (lz4)": os.path.join(folder, f"{name}.feather"),
    }
    batches = table.to_batches(max_chunksize=65536)
    with pa.ipc.new_file(paths["IPC file"], table.schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    with pa.ipc.new_stream(paths["IPC stream"], table.schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    feather.write_feather(table, paths["Feather v2 (lz4)"], chunksize=65536)
    return paths


def measure(how: str, kind: str, path: str, warm: str) -> dict[str, Any]:
    """One load in a fresh interpreter; the parent samples its RssAnon meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, how, kind, path, warm],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak_anon = 0
    status = f"/proc/{proc.pid}/status"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("RssAnon"):
                        peak_anon = max(peak_anon, int(line.split()[1]) << 10)
        except OSError:
            pass
        time.sleep(0.001)
    if proc.poll() is None:
        proc.kill()
        raise TimeoutError(f"{how} {path} took more than 600 s")
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(err[-2000:])
    result = json.loads(out)
    result["peak_anon"] = peak_anon
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    opts = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        paths = write_files(folder, opts.mib)
        tiny = write_files(folder, 1, "warm")
        for kind, path in paths.items():
            stream = "stream" if "stream" in kind else "file"
            for how, label in METHODS.items():
                runs = [measure(how, stream, path, tiny[kind]) for _ in range(opts.reps)]
                best = min(runs, key=lambda r: r["after"]["VmHWM"] - r["before"]["VmRSS"])
                data = best["nbytes"]
                rows.append(
                    {
                        "file": kind,
                        "method": label,
                        "data_mib": data / 2**20,
                        "seconds": min(r["seconds"] for r in runs),
                        "peak_rss": (best["after"]["VmHWM"] - best["before"]["VmRSS"]) / data,
                        "peak_anon": max(0, best["peak_anon"] - best["before"]["RssAnon"]) / data,
                        "runs": runs,
                    }
                )
                print(rows[-1]["file"], rows[-1]["method"], {k: round(v, 2) for k, v in
                      rows[-1].items() if isinstance(v, float)}, flush=True)  # fmt: skip
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "arrow_files.json"), "w") as f:
        json.dump({"mib": opts.mib, "reps": opts.reps, "rows": rows}, f, indent=1)
    lines = [
        "# Arrow files by path: peak memory of the loading process",
        "",
        f"`python benchmarks/bench_arrow_files.py --mib {opts.mib} --reps {opts.reps}`: one "
        "table (1 KiB float32 vector, int64 label, short string per row) written by "
        "pyarrow; each load in a fresh interpreter (after the same load of a 1 MiB file, "
        "so that lazy imports are not counted), best of the repetitions. Memory as "
        "multiples of the shared copy (`nbytes`): peak RSS growth (`VmHWM`: shared copy + "
        "temporaries + mapped file pages), peak private anonymous growth (`RssAnon`, "
        "sampled every ~1 ms).",
        "",
        "| file | method | data MiB | load s | peak RSS / data | peak RssAnon / data |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['file']} | {r['method']} | {r['data_mib']:.0f} | {r['seconds']:.2f} | "
            f"{r['peak_rss']:.2f}x | {r['peak_anon']:.2f}x |"
        )
    with open(os.path.join(opts.out, "arrow_files.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
