"""The benchmark suite's targets, this tree against another commit, in one run.

    python benchmarks/bench_suite_compare.py --baseline 527c53a   # ~65 min on 2 cores
    python benchmarks/bench_suite_compare.py --quick --out-dir /tmp/cmp   # smoke run

The other commit is checked out in a temporary git worktree. Topic by topic, the two
trees alternate: each runs its OWN ``benchmarks/bench.py --topics <topic>`` (the suite's
code of that commit, since the harness reaches into the package's internals) with its own
package first on ``PYTHONPATH``. The targets of ``docs/benchmarks.md`` are then worked out
from both trees' results by this tree's harness (``targets()`` of each topic): once from
the medians, and once per repetition, which gives each tree's spread. A target is called
worse only when this tree's spread lies wholly on the worse side of the other's (by
more than 2%). Writes ``suite-compare.md`` and ``.json`` to ``--out-dir``
(``benchmarks/results``).

Every measurement of both trees starts after the runner touched and freed ``--settle``
GiB (3; Note [Settling memory] in ``harness/runner.py``): the other tree runs with this
tree's ``harness/runner.py`` (the process machinery, the same file at 527c53a), or the
machine's alternating memory states would favour one tree by the order of its runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from harness.render import table  # noqa: E402
from harness.topics import SUITE  # noqa: E402

NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:e[-+]?\d+)?")
SAME = 1.02  # figures within 2% of each other are the same


def repetition(x: Any, k: int) -> Any:
    """``x`` (a topic's results) as if only repetition ``k`` had been measured."""
    if isinstance(x, list):
        return [repetition(v, k) for v in x]
    if not isinstance(x, dict):
        return x
    y = {key: repetition(v, k) for key, v in x.items()}
    runs = x.get("runs")
    if isinstance(runs, list) and runs and all(isinstance(v, (int, float)) for v in runs):
        for field in ("s", "median_s"):
            if field in y:
                y[field] = runs[min(k, len(runs) - 1)]
    if isinstance(runs, dict) and isinstance(x.get("median"), dict):
        y["median"] = {
            key: runs[key][min(k, len(runs[key]) - 1)] if runs.get(key) else v
            for key, v in x["median"].items()
        }
    return y


def scored(results: dict[str, Any], reps: int) -> dict[str, dict[str, Any]]:
    """``{target: {"goal", "median", "runs"}}`` from one tree's topic results."""
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        module = importlib.import_module(f"harness.topics.{name}")
        if "failed" in r or not hasattr(module, "targets"):
            continue
        for row in module.targets(r):
            out[row[0]] = {"goal": row[2], "median": value(row[1]), "runs": []}
        for k in range(reps):
            for row in module.targets(repetition(r, k)):
                if row[0] in out and value(row[1]) is not None:
                    out[row[0]]["runs"].append(value(row[1]))
    return out


def value(measured: str) -> float | None:
    m = NUMBER.search(measured)
    return float(m.group()) if m else None


def compare(base: dict[str, Any], ours: dict[str, Any]) -> list[list[str]]:
    """One row per target: both trees' medians (ranges), the ratio and the call."""
    rows = []
    for name, o in ours.items():
        b = base.get(name)
        if b is None or b["median"] is None or o["median"] is None:
            rows.append([name, o["goal"], "-", fmt(o), "-", "only in this tree"])
            continue
        lower = o["goal"].startswith("<=")  # lower is better
        lo_b, hi_b = spread(b)
        lo_o, hi_o = spread(o)
        worse = lo_o > hi_b * SAME if lower else hi_o * SAME < lo_b
        better = hi_o * SAME < lo_b if lower else lo_o > hi_b * SAME
        call = "worse beyond the spread" if worse else "better" if better else "within the spread"
        ratio = f"{o['median'] / b['median']:.2f}" if b["median"] else "-"
        rows.append([name, o["goal"], fmt(b), fmt(o), ratio, call])
    return rows


def spread(t: dict[str, Any]) -> tuple[float, float]:
    return min(t["runs"] + [t["median"]]), max(t["runs"] + [t["median"]])


def fmt(t: dict[str, Any]) -> str:
    lo, hi = spread(t)
    return f"{t['median']:.3g} ({lo:.3g}-{hi:.3g})"


def run_topic(tree: str, topic: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "bench.py"), "--topics", topic]
    cmd += ["--out-dir", out, "--reps", str(args.reps)] + (["--quick"] if args.quick else [])
    env = {**os.environ, "PYTHONPATH": tree, "BENCH_SETTLE_GIB": str(args.settle)}
    with open(os.path.join(out, f"{topic}.log"), "w") as log:
        done = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        return {"failed": f"exit {done.returncode}: see {out}/{topic}.log"}
    with open(os.path.join(out, f"{topic}.json")) as f:
        return json.load(f)[topic]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="527c53a", help="the other commit")
    p.add_argument("--reps", type=int, default=3, help="repetitions per topic and tree")
    p.add_argument("--only", nargs="+", default=SUITE, help="topics (the suite's page's)")
    p.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    p.add_argument("--settle", type=float, default=3.0, help="GiB touched before each run")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--render", metavar="JSON", help="only rewrite the table from a saved run")
    args = p.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        return write(saved, {k: saved[k] for k in ("baseline", "this")}, args.out_dir)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    run = {"revs": [args.baseline, head], "reps": args.reps, "quick": args.quick,
           "settle_gib": args.settle,
           "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    results: dict[str, dict[str, Any]] = {"baseline": {}, "this": {}}
    with tempfile.TemporaryDirectory(prefix="sd-suite-") as tmp:
        base_tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", base_tree, args.baseline],
                       cwd=REPO, check=True, capture_output=True)  # fmt: skip
        runner = os.path.join("benchmarks", "harness", "runner.py")  # the same settling
        if os.path.exists(os.path.join(base_tree, runner)):  # a commit with this harness
            shutil.copyfile(os.path.join(REPO, runner), os.path.join(base_tree, runner))
        try:
            for topic in args.only:
                for label, tree in (("baseline", base_tree), ("this", REPO)):
                    out = os.path.join(tmp, label)
                    os.makedirs(out, exist_ok=True)
                    print(f"{topic} on {label} ...", flush=True)
                    results[label][topic] = run_topic(tree, topic, out, args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=REPO,
                           capture_output=True)  # fmt: skip
    return write(run, results, args.out_dir)


def write(run: dict[str, Any], results: dict[str, dict[str, Any]], out_dir: str) -> int:
    """Score both trees, write ``suite-compare.{md,json}``; 1 if a topic failed."""
    (baseline, head), reps = run["revs"], run["reps"]
    base, ours = (scored(results[k], reps) for k in ("baseline", "this"))
    failed = [f"{k} {t}: {r['failed']}" for k in results for t, r in results[k].items()
              if "failed" in r]  # fmt: skip
    text = "\n".join(
        [
            f"# The suite's targets: this tree ({head}) against {baseline}",
            "",
            f"Produced by `benchmarks/bench_suite_compare.py --baseline {baseline}`"
            f"{' --quick' if run['quick'] else ''} ({run['started']}): each tree ran its own "
            f"suite, topic by topic alternated, {reps} repetition(s) each, every run after "
            f"{run.get('settle_gib', 0)} GiB touched and freed (Note [Settling memory] in "
            "`benchmarks/harness/runner.py`). Medians, with the range over the "
            "repetitions; ratio = this tree / baseline.",
            "",
            table(["target", "goal", baseline, head, "ratio", "call"], compare(base, ours)),
            "",
            *(f"FAILED: {f}" for f in failed),
        ]
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "suite-compare.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "suite-compare.json"), "w") as f:
        json.dump({**run, **results}, f, indent=1, default=str)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
