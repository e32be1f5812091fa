"""Pool workers return big partial results; the parent merges them: SharedArray vs pickle.

    python benchmarks/bench_handoff.py [--mib 128] [--tasks 8] [--workers 2] [--repeats 3]

Each task builds a partial result of ``--mib`` MiB (float32) in a ``multiprocessing``
pool worker and returns it; the parent adds every partial into one total as the
results arrive (``imap_unordered``). Two ways, side by side in one run, each
repetition in a fresh parent process:

* ``numpy``: the worker returns a numpy array, pickled through the pool's pipe and
  unpickled into a private copy in the parent;
* ``SharedArray``: the worker builds the partial in ``sd.SharedArray.empty`` and
  returns it; the parent maps the worker's pages (Note [Handing a segment over]).

Reported per way and start method: wall time of the whole map-and-merge, and the
parent's peak RSS (which counts the shared pages it maps) and peak anonymous memory
(private copies: pickle buffers, unpickled arrays) above its start, sampled every
5 ms from ``/proc/self/smaps_rollup``. Writes ``benchmarks/results/handoff.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

CHILD = r"""
import json, multiprocessing as mp, re, sys, threading, time
import numpy as np
import shareddata as sd

way, method, mib, tasks, workers = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
n = (mib << 20) // 4

def rollup():
    with open("/proc/self/smaps_rollup") as f:
        text = f.read()
    kb = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))
    return kb("Rss") << 10, kb("Anonymous") << 10

def build_numpy(k):
    return np.full(n, k, np.float32)

def build_shared(k):
    a = sd.SharedArray.empty(n, np.float32)
    a.numpy()[:] = k
    return a

if __name__ == "__main__":
    build = build_numpy if way == "numpy" else build_shared
    ctx = mp.get_context(method)
    with ctx.Pool(workers) as pool:
        pool.map(abs, range(workers))  # workers started before the clock
        total = np.zeros(n, np.float32)
        rss0, priv0 = rollup()
        peak = [rss0, priv0]
        done = threading.Event()
        def sample():
            while not done.is_set():
                rss, priv = rollup()
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], priv)
                time.sleep(0.005)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        for part in pool.imap_unordered(build, range(tasks)):
            total += part.numpy() if way == "shared" else part
            del part
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    assert float(total[0]) == sum(range(tasks)) and float(total[-1]) == sum(range(tasks))
    peaks = {"peak_rss": peak[0] - rss0, "peak_private": peak[1] - priv0}
    print(json.dumps({"seconds": seconds, **peaks}))
"""


def run_once(way: str, method: str, mib: int, tasks: int, workers: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="bench_handoff_") as script:
        script.write(CHILD)  # a file: spawn children import the worker functions from it
        script.flush()
        return _run(script.name, way, method, mib, tasks, workers)


def _run(script: str, way: str, method: str, mib: int, tasks: int, workers: int) -> dict:
    out = subprocess.run(
        [sys.executable, script, way, method, str(mib), str(tasks), str(workers)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="fork,spawn")
    args = parser.parse_args()
    rows = []
    for method in args.methods.split(","):
        runs: dict[str, list[dict]] = {"numpy": [], "shared": []}
        for _ in range(args.repeats):  # interleaved: both ways see the same machine load
            for way in runs:
                runs[way].append(run_once(way, method, args.mib, args.tasks, args.workers))
        for way, got in runs.items():
            rows.append(
                {
                    "method": method,
                    "way": way,
                    "seconds": statistics.median(r["seconds"] for r in got),
                    "peak_rss_mib": statistics.median(r["peak_rss"] for r in got) / 2**20,
                    "peak_private_mib": statistics.median(r["peak_private"] for r in got) / 2**20,
                }
            )
    total = args.mib * args.tasks
    lines = [
        f"{args.tasks} partial results of {args.mib} MiB (float32, {total} MiB in all) built by "
        f"a Pool({args.workers}) and summed by the parent as they arrive; median of "
        f"{args.repeats} runs, each in a fresh parent. Peaks are above the parent's start; "
        "the merged total itself is one result's size of anonymous memory.",
        "",
        "| start method | returned as | map + merge s | vs numpy | parent peak RSS MiB "
        "| parent peak anonymous MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"] and r["way"] == "numpy")
        name = "numpy array (pickled)" if row["way"] == "numpy" else "sd.SharedArray"
        lines.append(
            f"| {row['method']} | {name} | {row['seconds']:.2f} | "
            f"{row['seconds'] / base['seconds']:.2f}x | {row['peak_rss_mib']:.0f} | "
            f"{row['peak_private_mib']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "handoff.md"), "w") as f:
        f.write(text)
    with open(os.path.join(RESULTS, "handoff.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
