"""Pool workers return big partial results and the parent merges them: SharedArray vs pickle.

Each task builds a partial result of ``mib`` MiB (float32) in a ``multiprocessing``
pool worker and returns it; the parent adds every partial into one total as the
results arrive (``imap_unordered``). ``numpy``: the worker returns a numpy array,
pickled through the pool's pipe into a private copy in the parent; ``shared``: it
builds the partial in ``sd.SharedArray.empty`` and the parent maps the worker's
pages (Note [Handing a segment over]). Each repetition is a fresh parent (a new
interpreter) whose RSS and private memory the runner samples during the merge.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np

import shareddata as sd
from harness.machine import median
from harness.render import table
from harness.runner import go

_N = 0


def _init(n: int) -> None:
    global _N
    _N = n


def build_numpy(k: int) -> np.ndarray:
    """A pool task: a partial result as a numpy array."""
    return np.full(_N, k, np.float32)


def build_shared(k: int) -> sd.SharedArray:
    """A pool task: the same partial in shared memory."""
    a = sd.SharedArray.empty(_N, np.float32)
    a.numpy()[:] = k
    return a


def merge(way: str, method: str, mib: int, tasks: int, workers: int) -> dict[str, Any]:
    """Child: the pool's map and the parent's merge, timed; memory sampled from go() on."""
    n = (mib << 20) // 4
    build = build_numpy if way == "numpy" else build_shared
    with mp.get_context(method).Pool(workers, _init, (n,)) as pool:
        pool.map(abs, range(workers))  # workers started before the clock
        total = np.zeros(n, np.float32)
        go()
        start = time.perf_counter()
        for part in pool.imap_unordered(build, range(tasks)):
            total += part.numpy() if way == "shared" else part
            del part
        seconds = time.perf_counter() - start
    assert float(total[0]) == sum(range(tasks)) == float(total[-1])
    return {"seconds": seconds}


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """8 partials of 128 MiB from a Pool(2), fork and spawn, repetitions interleaved."""
    mib, tasks = (opts.size >> 20 if opts.size else 8 if quick else 128), 4 if quick else 8
    rows = []
    for method in ("fork", "spawn"):
        runs: dict[str, list[dict[str, Any]]] = {"numpy": [], "shared": []}
        for _ in range(opts.reps):  # interleaved: both ways see the same machine load
            for way in runs:
                kw = {"way": way, "method": method, "mib": mib, "tasks": tasks, "workers": 2}
                runs[way].append(
                    opts.runner.run("harness.topics.handoff", "merge", interpreter=True, **kw)
                )
        for way, got in runs.items():
            rows.append({"method": method, "way": way})
            rows[-1] |= {k: median(r[k] for r in got) for k in ("seconds", "peak_rss")}
            rows[-1]["peak_private"] = median(r["peak_private"] for r in got)
    return {"mib": mib, "tasks": tasks, "workers": 2, "reps": opts.reps, "rows": rows}


def render(r: dict[str, Any]) -> str:
    """Map + merge time and the parent's peaks, per start method and way."""
    rows = []
    for x in r["rows"]:
        base = next(b for b in r["rows"] if b["method"] == x["method"] and b["way"] == "numpy")
        name = "numpy array (pickled)" if x["way"] == "numpy" else "sd.SharedArray"
        rows.append(
            [x["method"], name, f"{x['seconds']:.2f}", f"{x['seconds'] / base['seconds']:.2f}x"]
            + [f"{x['peak_rss'] / 2**20:.0f}", f"{x['peak_private'] / 2**20:.0f}"]
        )
    header = ["start method", "returned as", "map + merge s", "vs numpy"]
    header += ["parent peak RSS MiB", "parent peak anonymous MiB"]
    return "\n".join(
        [
            f"{r['tasks']} partial results of {r['mib']} MiB (float32, {r['mib'] * r['tasks']} MiB "
            f"in all) built by a Pool({r['workers']}) and summed by the parent as they arrive; "
            f"median of {r['reps']} runs, each in a fresh parent. Peaks are above the parent's "
            "start; the merged total itself is one result's size of anonymous memory.",
            "",
            table(header, rows),
            "",
        ]
    )
