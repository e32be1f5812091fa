"""This tree against an earlier commit, side by side in one run: load, throughput, duplication.

A redesign must not make anything slower. This script checks out ``--baseline`` (by
default the commit before the one-loading-path redesign) into a temporary git
worktree, and runs every case in a fresh interpreter once against each tree,
alternating the trees within each repetition so that a noisy neighbour hits both.
Only the public API is used, so the same code runs on both trees.

    .venv/bin/python benchmarks/bench_compare.py                 # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_compare.py --quick         # smoke run, ~1 min
    .venv/bin/python benchmarks/bench_compare.py --baseline HEAD~5 --reps 5

Each case starts after ``--settle`` GiB (3) were touched and freed here (Note [Settling
memory] in ``harness/runner.py``: the machine's memory alternates between two speeds).

Writes ``benchmarks/results/compare.md`` and ``.json`` (``--out-dir`` to change):
medians per case, and the ratio this tree / baseline (for times < 1 is faster; for
samples/s > 1 is faster; duplication should stay ~1.0 on both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from harness.runner import settle  # noqa: E402

BASELINE = "0bcb8bd"  # main before the one-loading-path redesign (issue 13)

# Each case: (name, unit, higher_is_better, code). The code runs in a fresh interpreter
# with the tree on PYTHONPATH, gets DATA (a folder of prepared files) and SCALE, and
# prints one JSON number.
CASES: list[tuple[str, str, bool, str]] = [
    (
        "load .npy (NumpyDataset)",
        "s",
        False,
        """
        t = time.perf_counter()
        ds = sd.NumpyDataset(os.path.join(DATA, "x.npy"), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "load HDF5 contiguous (HDF5Dataset)",
        "s",
        False,
        """
        t = time.perf_counter()
        ds = sd.HDF5Dataset(os.path.join(DATA, "x.h5"), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "load Parquet (ParquetDataset)",
        "s",
        False,
        """
        t = time.perf_counter()
        ds = sd.ParquetDataset(os.path.join(DATA, "x.parquet"), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "load Parquet strings + token lists (ParquetDataset)",
        "s",
        False,
        """
        t = time.perf_counter()
        ds = sd.ParquetDataset(os.path.join(DATA, "text.parquet"), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "peak private MiB, load Parquet (ParquetDataset)",
        "MiB",
        False,
        """
        print(json.dumps(anon_peak(lambda: sd.ParquetDataset(os.path.join(DATA, "x.parquet"),
                                                             progress=False))))
        """,
    ),
    (
        "load Arrow table (ArrowDataset)",
        "s",
        False,
        """
        import pyarrow.parquet as pq
        table = pq.read_table(os.path.join(DATA, "text.parquet"))
        t = time.perf_counter()
        ds = sd.ArrowDataset(table, progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "load Arrow IPC file (ArrowDataset)",
        "s",
        False,
        """
        t = time.perf_counter()
        ds = sd.ArrowDataset(os.path.join(DATA, "x.arrow"), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "peak private MiB, load Arrow IPC file (ArrowDataset)",
        "MiB",
        False,
        """
        print(json.dumps(anon_peak(lambda: sd.ArrowDataset(os.path.join(DATA, "x.arrow"),
                                                           progress=False))))
        """,
    ),
    (
        "SharedDataset of 16384 items",
        "s",
        False,
        """
        class Items(torch.utils.data.Dataset):
            def __len__(self):
                return 16384 // SCALE
            def __getitem__(self, i):
                return torch.full((256,), float(i)), i, f"item {i}"
        t = time.perf_counter()
        ds = sd.SharedDataset(Items(), progress=False)
        print(json.dumps(time.perf_counter() - t))
        """,
    ),
    (
        "samples/s, batch 256, 1 KiB rows, num_workers=0",
        "samples/s",
        True,
        """
        ds = sd.NumpyDataset(os.path.join(DATA, "x.npy"), progress=False)
        print(json.dumps(rate(DataLoader(ds, batch_size=256, shuffle=True))))
        """,
    ),
    (
        "samples/s, batch 256, 1 KiB rows, 2 fork workers",
        "samples/s",
        True,
        """
        ds = sd.NumpyDataset(os.path.join(DATA, "x.npy"), progress=False)
        loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=2,
                            multiprocessing_context="fork", persistent_workers=True)
        print(json.dumps(rate(loader)))
        """,
    ),
    (
        "duplication, 4 spawn workers (sd.verify)",
        "x",
        False,
        """
        ds = sd.NumpyDataset(os.path.join(DATA, "x.npy"), progress=False)
        loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=4,
                            multiprocessing_context="spawn")
        print(json.dumps(sd.verify(loader, batches=64, max_duplication=None).duplication))
        """,
    ),
]

PRELUDE = """
import json, os, time, warnings
warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader
import shareddata as sd
DATA, SCALE = {data!r}, {scale!r}

def rate(loader, seconds=1.0):
    it = iter(loader)
    for _ in range(2):
        next(it)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        n += len(batch[next(iter(batch))] if isinstance(batch, dict) else batch[0])
    return n / (time.perf_counter() - t)

def anon_peak(load):  # peak growth of private memory (RssAnon, sampled every ~1 ms), MiB
    import threading
    def anon():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))
    start, peak, done = anon(), [0], threading.Event()
    def sample():
        while not done.wait(0.001):
            peak[0] = max(peak[0], anon())
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        keep = load()
    finally:
        done.set()
        thread.join()
    del keep
    return (max(peak[0], anon()) - start) / 1024
"""


def prepare(folder: str, rows: int) -> None:
    """``x.npy``/``x.h5``/``x.parquet``/``x.arrow``: ``rows`` rows of 256 float32 (1 KiB);
    ``text.parquet``: ``rows`` rows of a string and a list of int32 token ids."""
    import h5py
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.random.default_rng(0).standard_normal((rows, 256), dtype=np.float32)
    np.save(os.path.join(folder, "x.npy"), x)
    with h5py.File(os.path.join(folder, "x.h5"), "w") as f:
        f["x"] = x
    flat = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 256)
    pq.write_table(pa.table({"x": flat}), os.path.join(folder, "x.parquet"))
    with pa.ipc.new_file(os.path.join(folder, "x.arrow"), pa.schema([("x", flat.type)])) as w:
        w.write_table(pa.table({"x": flat}), max_chunksize=16384)
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 64, rows)
    tokens = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        pa.array(rng.integers(0, 30000, int(lengths.sum()), dtype=np.int32)),
    )
    text = pa.array([f"review {i}: " + "good " * (i % 40) for i in range(rows)])
    pq.write_table(pa.table({"text": text, "tokens": tokens}),
                   os.path.join(folder, "text.parquet"), row_group_size=16384)  # fmt: skip


def run_case(tree: str, code: str, data: str, scale: int, timeout: float, gib: float = 0) -> float:
    settle(gib)
    script = PRELUDE.format(data=data, scale=scale) + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tree,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"case failed on {tree}:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def render(results: dict, baseline: str, current: str) -> str:
    lines = [
        "# This tree against the commit before the redesign",
        "",
        f"Baseline `{baseline}`, this tree `{current}`; medians of {results['reps']} "
        f"repetitions, each case in a fresh interpreter, trees alternated "
        f"({results['rows']} rows of 1 KiB; {results['when']}). "
        "Produced by `benchmarks/bench_compare.py`.",
        "",
        "A ratio is called within noise when the two trees' ranges over the repetitions "
        "overlap (with one repetition, when it is within 10%).",
        "",
        "| case | baseline (range) | this tree (range) | this / baseline |",
        "|---|---:|---:|---:|",
    ]
    for case in results["cases"]:
        b, c = statistics.median(case["baseline"]), statistics.median(case["current"])
        ratio = c / b if b else float("nan")
        lo_b, hi_b = min(case["baseline"]), max(case["baseline"])
        lo_c, hi_c = min(case["current"]), max(case["current"])
        if len(case["baseline"]) > 1:
            noise = lo_c <= hi_b and lo_b <= hi_c
        else:
            noise = abs(ratio - 1) <= 0.10
        faster = ratio > 1 if case["higher_is_better"] else ratio < 1
        verdict = "within noise" if noise else ("faster" if faster else "slower")
        if case["unit"] == "x" and not noise:  # copies of the data: lower is better
            verdict = "lower" if ratio < 1 else "higher"
        unit = case["unit"]
        lines.append(
            f"| {case['name']} | {b:.3g} {unit} ({lo_b:.3g}-{hi_b:.3g}) "
            f"| {c:.3g} {unit} ({lo_c:.3g}-{hi_c:.3g}) | {ratio:.2f}x ({verdict}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per case and tree")
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repetition")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--only", nargs="*", help="substrings of case names to run")
    parser.add_argument("--settle", type=float, default=3.0, help="GiB touched before each")
    args = parser.parse_args()
    rows = 16384 if args.quick else 262144  # 16 MiB / 256 MiB
    scale = 16 if args.quick else 1
    reps = 1 if args.quick else args.reps
    current = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "baseline")
        subprocess.run(
            ["git", "worktree", "add", "--detach", base_tree, args.baseline],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
        try:
            data = os.path.join(tmp, "data")
            os.mkdir(data)
            prepare(data, rows)
            cases = [c for c in CASES if not args.only or any(o in c[0] for o in args.only)]
            out: list[dict] = []
            for name, unit, higher, code in cases:
                entry = {"name": name, "unit": unit, "higher_is_better": higher}
                entry.update(baseline=[], current=[])
                for rep in range(reps):
                    order = [("baseline", base_tree), ("current", REPO)]
                    for label, tree in order if rep % 2 == 0 else order[::-1]:
                        run = run_case(tree, code, data, scale, 600, args.settle)
                        entry[label].append(run)
                print(f"{name}: baseline {entry['baseline']} current {entry['current']}")
                out.append(entry)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", base_tree], cwd=REPO, capture_output=True
            )
    results = {
        "baseline": args.baseline,
        "current": current,
        "reps": reps,
        "settle_gib": args.settle,
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cases": out,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "compare-quick" if args.quick else "compare")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    text = render(results, args.baseline, current)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
