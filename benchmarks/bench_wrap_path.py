"""SharedDataset and SharedList batches out of DataLoader workers, against NumpyDataset's.

    python benchmarks/bench_wrap_path.py                   # ~3 min on 2 cores; results/wrap_path.md
    python benchmarks/bench_wrap_path.py --baseline main   # and the code at main, alternated

The same arrays (64 Ki rows: ``x`` float32 x 256 = 1 KiB, ``y`` int64) served by
``sd.NumpyDataset({"x": x, "y": y})``, ``sd.SharedDataset(TensorDataset(x, y))``,
the plain ``TensorDataset(x, y)`` it wraps, and ``sd.SharedList`` of the rows as
dicts; each with 2 persistent fork workers, batches of 256, with the default collate
(``batch_size=256``, shuffled) and with ``sd.IndexBatchSampler(ds, 256,
shuffle=True)`` (``batch_size=None``; the plain TensorDataset indexes its tensors
with the batch's indices; SharedList has no batch indexing). Each case reports
samples per second over one epoch after 2 warm-up batches, and how its batches
reached the main process: worker batch memfds (shareddata's path, one per batch)
and torch ``/dev/shm`` segments (torch's path), counted per batch by wrapping the
functions that unpickle them, as ``tests/test_crossing.py`` does.

Every round runs every case, in turn, each in a fresh process of its own (a fork of
nothing else: ``--child``), so a case is not slowed by another's workers or heap;
with ``--baseline REV`` each round runs the cases for ``REV`` (a ``git worktree``,
removed afterwards) and for this tree alternately. Medians over the rounds, every
repetition in brackets; the goal (issue 22): SharedDataset >= 0.8x NumpyDataset with
both samplers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROWS, FLOATS, BATCH = 64 * 1024, 256, 256
CASES = [
    ("NumpyDataset", "default collate"),
    ("NumpyDataset", "IndexBatchSampler"),
    ("SharedDataset(TensorDataset)", "default collate"),
    ("SharedDataset(TensorDataset)", "IndexBatchSampler"),
    ("TensorDataset", "default collate"),
    ("TensorDataset", "IndexBatchSampler"),
    ("SharedList", "default collate"),
]


def _counting() -> dict[str, int]:
    """Count how the main process receives what workers send (torch segments, our memfds)."""
    from torch.multiprocessing import reductions

    counts: dict[str, int] = {}
    inbox = None
    for name in ("shareddata.crossing._transport", "shareddata.crossing._inbox",
                 "shareddata._transport"):  # fmt: skip
        try:
            inbox = __import__(name, fromlist=["receive"])
            break
        except ImportError:
            continue
    targets = [(reductions, "rebuild_storage_fd", "torch /dev/shm"),
               (reductions, "rebuild_storage_filename", "torch /dev/shm")]  # fmt: skip
    if inbox is not None and hasattr(inbox, "receive"):
        targets.append((inbox, "receive", "memfd"))
    for module, name, what in targets:
        original = getattr(module, name)

        def counted(*args: Any, _original: Any = original, _what: str = what) -> Any:
            counts[_what] = counts.get(_what, 0) + 1
            return _original(*args)

        counted.__name__ = counted.__qualname__ = name
        counted.__module__ = module.__name__
        setattr(module, name, counted)
    return counts


def run_case(dataset: str, sampler: str, rows: int, epochs: int = 3) -> dict[str, Any]:
    """Samples/s of one case over ``epochs`` epochs (persistent workers), its CPU per batch
    (main process and workers), and what its batches crossed as (per batch)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import shareddata as sd

    counts = _counting()
    rng = np.random.default_rng(0)
    x = rng.random((rows, FLOATS), dtype=np.float32)
    y = np.arange(rows, dtype=np.int64)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    if dataset == "NumpyDataset":
        ds: Any = sd.NumpyDataset({"x": x, "y": y}, progress=False)
    elif dataset == "SharedDataset(TensorDataset)":
        ds = sd.SharedDataset(TensorDataset(tx, ty), progress=False)
    elif dataset == "TensorDataset":
        ds = TensorDataset(tx, ty)
    else:
        items = ({"x": tx[i].clone(), "y": int(y[i])} for i in range(rows))  # not views
        ds = sd.SharedList(items, progress=False)
    del x, y
    kw: dict[str, Any] = {
        "num_workers": 2,
        "persistent_workers": True,
        "multiprocessing_context": "fork",
        "timeout": 120,
    }
    if sampler == "default collate":
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, **kw)
    else:
        loader = DataLoader(
            ds, sampler=sd.IndexBatchSampler(ds, BATCH, shuffle=True), batch_size=None, **kw
        )
    it = iter(loader)
    for _ in range(2):
        next(it)
    workers = [w.pid for w in getattr(it, "_workers", [])]
    counts.clear()
    t0, c0, w0 = time.perf_counter(), time.process_time(), _cpu_s(workers)
    n, batches = 0, 0
    for epoch in range(epochs):
        for batch in it if epoch == 0 else iter(loader):
            n += len(batch["x"] if isinstance(batch, dict) else batch[0])
            batches += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    workers_cpu = _cpu_s(workers) - w0
    first = next(iter(loader))
    x0 = first["x"] if isinstance(first, dict) else first[0]
    return {
        "samples_per_s": n / seconds,
        "batches": batches,
        "cpu_us_per_batch": (cpu + workers_cpu) / batches * 1e6,
        "per_batch": {k: v / batches for k, v in sorted(counts.items())},
        "batch": f"{type(first).__name__} of {type(x0).__name__} {tuple(x0.shape)}",
    }


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) that processes ``pids`` have used."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def child(args: argparse.Namespace) -> int:
    dataset, sampler = CASES[args.case]
    result = run_case(dataset, sampler, args.rows, args.epochs)
    import shareddata

    result["tree"] = os.path.dirname(os.path.dirname(shareddata.__file__))
    print(json.dumps(result))
    return 0


def _rev(repo: str, rev: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, "rev-parse", "--short", rev],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def _run_child(tree: str, case: int, rows: int, epochs: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", str(case),
           "--rows", str(rows), "--epochs", str(epochs)]  # fmt: skip
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.realpath(result.pop("tree")) != os.path.realpath(tree):
        raise RuntimeError(f"the child did not import {tree}")
    return result  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per measurement")
    parser.add_argument("--baseline", help="also run every case for this git revision")
    parser.add_argument("--cases", help="comma-separated case numbers (default: all)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("after", repo)]
    base = None
    if args.baseline:
        base = tempfile.mkdtemp(prefix="bench-wrap-path-baseline-")
        rev = _rev(repo, args.baseline)
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", base, rev], check=True)
        trees = [("before", base), ("after", repo)]
    cases = [int(c) for c in args.cases.split(",")] if args.cases else range(len(CASES))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    try:
        for r in range(args.rounds):
            for case in cases:
                for which, tree in trees:
                    result = _run_child(tree, case, args.rows, args.epochs)
                    runs.setdefault((which, case), []).append(result)
                    print(f"round {r + 1} {which} {CASES[case]}: "
                          f"{result['samples_per_s']:,.0f} samples/s {result['per_batch']}",
                          file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if base is not None:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base], check=False)
            shutil.rmtree(base, ignore_errors=True)
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = render(runs, trees, args, load_before, load_after, repo)
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wrap_path.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "wrap_path.json"), "w") as f:
        json.dump({f"{w} {CASES[c][0]} / {CASES[c][1]}": v for (w, c), v in runs.items()}, f,
                  indent=1)  # fmt: skip
    return 0


def render(
    runs: dict[tuple[str, int], list[dict[str, Any]]],
    trees: list[tuple[str, str]],
    args: argparse.Namespace,
    load_before: str,
    load_after: str,
    repo: str,
) -> list[str]:
    """The Markdown tables: samples/s per case and tree, ratios to NumpyDataset, paths."""
    import torch

    def med(which: str, case: int) -> float:
        return statistics.median(r["samples_per_s"] for r in runs[(which, case)])

    def reps(which: str, case: int) -> str:
        return "/".join(f"{r['samples_per_s'] / 1000:.0f}k" for r in runs[(which, case)])

    def ratio(which: str, case: int, base: int) -> str:
        """Median over rounds of the case's samples/s over NumpyDataset's in the same round."""
        per_round = [
            a["samples_per_s"] / b["samples_per_s"]
            for a, b in zip(runs[(which, case)], runs[(which, base)])
        ]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        return f"{statistics.median(per_round):.2f}x ({spread})"

    def path(which: str, case: int) -> str:
        per = runs[(which, case)][-1]["per_batch"]
        return ", ".join(f"{v:.2f} {k}" for k, v in per.items()) or "nothing counted"

    head = _rev(repo, "HEAD")
    names = [w for w, _ in trees]
    lines = [
        f"# SharedDataset and SharedList batches out of workers: {args.rows} rows of 1 KiB, "
        f"batches of {BATCH}, 2 fork workers",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; {args.rounds} rounds, every case in "
        f"a fresh process, trees alternated ({', '.join(names)}); load average {load_before} "
        f"before and {load_after} after. after = this tree (HEAD {head}"
        + (f"), before = {args.baseline}" if args.baseline else ")")
        + ". Medians, every repetition in brackets (thousands of samples/s); ratios: "
        "each round's samples/s over NumpyDataset's in the same round (same sampler), "
        "median and range over the rounds.",
        "",
        "| dataset | sampler | " + " | ".join(f"{w} samples/s" for w in names)
        + " | " + " | ".join(f"{w} / NumpyDataset" for w in names) + " |",
        "|---|---|" + "---:|" * (2 * len(names)),
    ]  # fmt: skip
    for case, (dataset, sampler) in enumerate(CASES):
        numpy_case = 0 if sampler == "default collate" else 1
        if (names[0], case) not in runs or (names[0], numpy_case) not in runs:
            continue
        cells = [f"{med(w, case):,.0f} ({reps(w, case)})" for w in names]
        ratios = [f"**{ratio(w, case, numpy_case)}**" for w in names]
        lines.append(f"| {dataset} | {sampler} | " + " | ".join(cells + ratios) + " |")
    lines += [
        "",
        "CPU per batch, main process and both workers together (us; less sensitive to "
        "other work on the machine than samples/s), medians:",
        "",
        "| dataset | sampler | " + " | ".join(f"{w} CPU us/batch" for w in names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for case, (dataset, sampler) in enumerate(CASES):
        if (names[0], case) not in runs:
            continue
        cells = [
            f"{statistics.median(r['cpu_us_per_batch'] for r in runs[(w, case)]):,.0f}"
            for w in names
        ]
        lines.append(f"| {dataset} | {sampler} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "How each batch reached the main process (per batch, last round): `memfd` = a "
        "worker batch memfd of shareddata, `torch /dev/shm` = a segment torch made for a "
        "tensor.",
        "",
        "| dataset | sampler | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for case, (dataset, sampler) in enumerate(CASES):
        if (names[0], case) not in runs:
            continue
        cells = [path(w, case) for w in names]
        lines.append(f"| {dataset} | {sampler} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
