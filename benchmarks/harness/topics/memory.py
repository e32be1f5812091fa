"""Memory against workers: how many times each case holds the data after an epoch.

``sd.verify(loader, max_duplication=None).duplication`` after one full epoch of
256 MiB of 4 KiB float32 rows, batch 256, for 0, 1, 2, 4 and 8 workers under
fork, spawn and forkserver, for shareddata and every peer: the PSS (without
file-backed pages) of the main process and every worker after the last batch, net
of each worker's interpreter baseline, over the data size (Note [How duplication is
measured] in ``shareddata/memory/_verify.py``). Each (case, start method,
repetition) is a fresh process that verifies each worker count in turn: every
count in the first repetition, the largest (the target's) in each.

Strings: a 1M-row Parquet file with a text column, 4 spawn workers, one epoch:
``sd.ParquetDataset`` against ``read_table().to_pylist()`` held by a plain Dataset
(and, in full runs, ours with 8x longer strings).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from harness import cases
from harness.machine import MIB, CpuMonitor, median
from harness.render import fx, others, plot, table, verdict

CASES = ["shareddata", "numpy array", "TensorDataset", "share_memory_()"]
CASES += ["h5py lazy", "HF datasets", "tensordict shared", "tensordict memmap"]
GOAL = 1.05  # ours, every start method, at the most workers
STRINGS_GOAL = 1.05


class Rows(Dataset):
    """The usual way: a table's rows as Python dicts in a list (``to_pylist()``)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def verify(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Child: for each job, build its case once and ``sd.verify`` one epoch per worker count.

    A job is ``{"id", "case", "files", "method", "workers", "batch"}``; the result maps
    each job's id to ``{workers: verify's report}`` or ``{"error": ...}``.
    """
    warnings.filterwarnings(
        "ignore", message=".*(worker processes in total|DataLoader will create).*"
    )
    out: dict[str, Any] = {}
    for job in jobs:
        f, case, batch = cases.Files(**job["files"]), job["case"], job["batch"]
        try:
            if case.startswith("strings"):
                import pyarrow.parquet as pq

                assert f.parquet is not None
                ours = sd.ParquetDataset(f.parquet, progress=False)
                nbytes = ours.nbytes
                ds: Any = ours if "Parquet" in case else Rows(pq.read_table(f.parquet).to_pylist())
                kw: dict[str, Any] = {"batch_size": batch}
            else:
                ds, nbytes = cases.build(case, f), f.nbytes
                kw = cases.loader_kwargs(case, ds, batch)
            got = out[job["id"]] = {}
            for w in job["workers"]:
                context = job["method"] if w else None
                loader = DataLoader(ds, num_workers=w, multiprocessing_context=context, **kw)
                t0 = time.perf_counter()
                report = sd.verify(loader, max_duplication=None, dataset_bytes=nbytes)
                r = report.to_dict()
                r.pop("processes", None)
                r["worker_uss"] = [p.uss for p in report.processes if p.role.startswith("worker")]
                got[str(w)] = {**r, "seconds": time.perf_counter() - t0, "dataset_bytes": nbytes}
                del loader, report
            del ds
        except Exception as e:
            out[job["id"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


def write_strings(path: str, rows: int, longest: int) -> None:
    """``rows`` rows: a text column (1 to ``longest`` ASCII characters), an int64 label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(rng.integers(1, longest + 1, rows), out=offsets[1:])
    letters = rng.integers(97, 123, int(offsets[-1]), dtype=np.uint8)
    letters[rng.random(len(letters)) < 0.15] = 32  # spaces: words
    text = pa.LargeStringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(letters))
    table_ = pa.table({"text": text.cast(pa.string()), "label": np.arange(rows) % 1000})
    pq.write_table(table_, path, row_group_size=1 << 17)


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every case x start method x repetition in a fresh process; then the strings."""
    methods = ["fork"] if quick else ["fork", "spawn", "forkserver"]
    counts = [0, 1] if quick else [0, 1, 2, 4, 8]
    todo = [c for c in CASES if cases.available(opts.status, c)]
    mon = CpuMonitor()
    with tempfile.TemporaryDirectory(prefix="sd-memory-", dir=opts.tmp_dir) as tmp:
        nbytes = opts.size or (4 * MIB if quick else 256 * MIB)
        files = vars(cases.peer_files(tmp, "memory", nbytes, 4096, opts.status))
        jobs = [
            {"id": f"{c}|{m}|{rep}", "case": c, "files": files, "method": m, "batch": 256}
            | {"workers": counts if rep == 0 else [max(counts)]}
            for rep in range(opts.reps)
            for m in methods
            for c in todo
        ]
        got = opts.runner.jobs("harness.topics.memory", "verify", jobs, quick)
        rows, workers = (20_000, 2) if quick else (1_000_000, 4)
        strings: dict[str, Any] = {"rows": rows, "workers": workers}
        longer = [] if quick else [("sd.ParquetDataset, 1-1000 characters per row", 1000)]
        sjobs = []
        for label, longest in [
            ("sd.ParquetDataset", 120),
            ("read_table().to_pylist() in a Dataset", 120),
            *longer,
        ]:
            path = os.path.join(tmp, f"strings-{longest}.parquet")
            if not os.path.exists(path):
                write_strings(path, rows, longest)
            strings.setdefault("file_bytes", os.path.getsize(path))
            f = cases.Files(npy="", rows=rows, row_floats=0, work_dir=tmp, parquet=path)
            case = f"strings: {label}"
            sjobs.append({"id": label, "case": case, "files": vars(f), "method": "spawn"})
            sjobs[-1] |= {"workers": [workers], "batch": 1024}
        for label, r in opts.runner.jobs("harness.topics.memory", "verify", sjobs, quick).items():
            strings[label] = r.get(str(workers), r)
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    errors: dict[str, str] = {}
    for key, by_w in got.items():
        case, method, _ = key.split("|")
        if "error" in by_w:
            errors[f"{case}|{method}"] = by_w["error"]
            print(f"  memory {key}: FAILED {by_w['error']}", flush=True)
        for w, r in by_w.items() if "error" not in by_w else []:
            runs.setdefault(case, {}).setdefault(method, {}).setdefault(w, []).append(r)
    summary = {
        c: {
            m: {
                w: {"duplication": median(r["duplication"] for r in rs), "n": len(rs)}
                for w, rs in by_w.items()
            }
            for m, by_w in by_m.items()
        }
        for c, by_m in runs.items()
    }
    return {
        "nbytes": nbytes,
        "methods": methods,
        "workers": counts,
        "reps": opts.reps,
        "summary": summary,
        "runs": runs,
        "errors": errors,
        "strings": strings,
        "cpu": mon.result(),
        "status": opts.status,
    }


def targets(r: dict[str, Any]) -> list[list[str]]:
    """Ours at the most workers, each start method, next to the lowest peer."""
    top, rows = str(max(r["workers"])), []
    for m in r["methods"]:
        v = r["summary"].get("shareddata", {}).get(m, {}).get(top, {}).get("duplication")
        peers = [
            (by[m][top]["duplication"], c)
            for c, by in r["summary"].items()
            if c != "shareddata" and top in by.get(m, {})
        ]
        low = min(peers, default=None)
        context = "1.00x (one copy); lowest peer: " + (f"{low[1]} {low[0]:.3f}x" if low else "-")
        rows.append(
            [f"memory, {top} workers, {m}", fx(v), f"<= {GOAL}x", verdict(v, GOAL, False), context]
        )
    s = r["strings"].get("sd.ParquetDataset", {}).get("duplication")
    rows.append(
        [
            f"strings, {r['strings']['workers']} spawn workers",
            fx(s, 3),
            f"<= {STRINGS_GOAL}x",
            verdict(s, STRINGS_GOAL, False),
            "",
        ]
    )
    return rows


def render(r: dict[str, Any]) -> str:
    """One duplication table per start method, then the strings table."""
    lines = [
        "## Memory against workers",
        "",
        f"{r['nbytes'] / MIB:.0f} MiB of float32 rows of 4096 B, batch 256, one full epoch, "
        "`sd.verify(loader, max_duplication=None).duplication`: the PSS (without file-backed "
        "pages) of the main process and every worker after the last batch, net of each "
        "worker's interpreter baseline, over the data size. 1.00x = the data is in RAM once. "
        "Data a case reads from files (h5py, HF datasets' Arrow memory map, tensordict's "
        "memmap) stays in the page cache, once, and is not counted. Each (case, start method, "
        "repetition) is a fresh process; the largest worker count is a median of "
        f"{r['reps']} repetitions, the others one run each.",
        "",
    ]
    for m in r["methods"]:
        rows = []
        for c in CASES:
            by = r["summary"].get(c, {}).get(m)
            if not cases.available(r["status"], c):
                rows.append(cases.missing_row(c, len(r["workers"]) + 1))
            elif by is None:
                err = r["errors"].get(f"{c}|{m}", "-")
                rows.append([c, f"failed: {err[:80]}", *[""] * (len(r["workers"]) - 1)])
            else:
                rows.append(
                    [c, *[fx(by.get(str(w), {}).get("duplication"), 3) for w in r["workers"]]]
                )
        lines += [
            f"### {m}",
            "",
            table(["case", *[f"{w} workers" for w in r["workers"]]], rows),
            "",
        ]
    lines += [others(r), ""]
    st = r["strings"]
    rows = [
        [
            k,
            f"{v['dataset_bytes'] / MIB:.1f}",
            fx(v["duplication"], 3),
            f"{v['total_pss'] / MIB:.0f}",
            f"{v['extra_bytes'] / MIB:.1f}",
            f"{v['seconds']:.1f}",
        ]
        if "error" not in v
        else [k, f"failed: {v['error'][:80]}", "", "", "", ""]
        for k, v in st.items()
        if isinstance(v, dict)
    ]
    ours = st.get("sd.ParquetDataset", {})
    per_worker = [(u - ours["baseline_bytes"]) / MIB for u in ours.get("worker_uss", [])]
    lines += [
        "### Strings: memory of spawn workers after an epoch",
        "",
        f"{st['rows']:,} rows (a text column of 1-120 characters and an int64 label; "
        f"{st.get('file_bytes', 0) / MIB:.1f} MiB of Parquet), {st['workers']} spawn workers, "
        "one epoch of batches of 1024, then `sd.verify` over the data size as shareddata "
        "holds it (the same size for both). What is beyond one copy is each worker's working "
        "memory (USS above the data-free worker: "
        + ", ".join(f"{x:.1f}" for x in per_worker)
        + " MiB).",
        "",
        table(["dataset", "data MiB", "duplication", "total PSS MiB", "extra MiB", "s"], rows),
        "",
    ]
    return "\n".join(lines)


def plot_png(r: dict[str, Any], img_dir: str) -> dict[str, str]:
    """Duplication against num_workers, one panel per start method."""

    def draw(ax: Any, i: int) -> None:
        m = r["methods"][i]
        for c, by in r["summary"].items():
            pts = sorted((int(w), v["duplication"]) for w, v in by.get(m, {}).items())
            if pts:
                ax.plot(*zip(*pts), marker="o", label=c)
        ax.set(title=m, xlabel="num_workers", ylabel="times the data is in RAM")

    path = os.path.join(img_dir, "bench-memory.png")
    return {"memory against num_workers": path} if plot(path, len(r["methods"]), draw, 5) else {}
