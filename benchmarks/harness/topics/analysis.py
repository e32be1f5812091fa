"""Where a batch's time goes (1 KiB rows, batch 256), and the gather under CPU contention.

us per batch of each step of three paths, timed outside the DataLoader: (a)
``TensorDataset``'s per-sample fetch and its collate; (b) shareddata's
``__getitems__`` (index conversion, gather; its samples are made only when a
``collate_fn`` uses them: ``unbind`` into per-sample views, one row per sample) and
the collate shortcut; (c) the fast path's single
``ds[index_tensor]``. Rows marked ``old`` time the code the suite's optimisations
replaced. The contention probe: us per batch of the gather with the cores idle and
with one busy-loop process per core (standing for other ranks or jobs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from harness.machine import CpuMonitor
from harness.render import table


def cpu_seconds(procs: Sequence[subprocess.Popen[bytes]]) -> float:
    """User + system CPU seconds used so far by running child processes."""
    total = 0.0
    for proc in procs:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def contention_probe(
    ds: Any, tensor: torch.Tensor, batch: int, threads: Sequence[int], batches: int = 100
) -> list[dict[str, Any]]:
    """Per-batch gather cost with the cores idle and with every core kept busy.

    The busy cores are this benchmark's own busy-loop processes (one per core),
    standing in for other ranks or jobs on the machine; they are killed after.
    """
    perm = list(torch.randperm(len(tensor))[: batch * batches].split(batch))
    buf = torch.empty((batch, *tensor.shape[1:]), dtype=tensor.dtype)
    array, nbuf = tensor.numpy(), buf.numpy()
    ops: dict[str, Callable[[torch.Tensor], Any]] = {
        "(c) ds[index tensor]": ds.__getitem__,
        "raw index_select(out=)": lambda i: torch.index_select(tensor, 0, i, out=buf[: len(i)]),
        "raw np.take(out=)": lambda i: np.take(array, i.numpy(), axis=0, out=nbuf[: len(i)]),
    }
    rows: list[dict[str, Any]] = []
    default_threads = torch.get_num_threads()
    for spinners in (0, os.cpu_count() or 1):
        procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)
        ]
        try:
            time.sleep(0.3 if spinners else 0.0)
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                row: dict[str, Any] = {"busy_loops": spinners, "threads": n_threads}
                mon, spun = CpuMonitor(), cpu_seconds(procs)
                for name, op in ops.items():
                    for i in perm[:5]:
                        op(i)
                    t0 = time.perf_counter()
                    for i in perm:
                        op(i)
                    row[name] = (time.perf_counter() - t0) / len(perm) * 1e6
                # the busy loops are ours but not reaped yet: take their CPU out by hand
                cpu = mon.result()
                spun = (cpu_seconds(procs) - spun) / cpu["wall_s"]
                row["others_cores"] = max(0.0, cpu["others_cores"] - spun)
                rows.append(row)
        finally:
            torch.set_num_threads(default_threads)
            for proc in procs:
                proc.kill()
                proc.wait()
    return rows


def old_indices(n: int, indices: Any) -> torch.Tensor:
    """``ColumnDataset._indices`` before the benchmark suite's optimisation (for comparison).

    ``np.asarray`` of the list, ``torch.as_tensor``, dtype checks and two torch
    reductions for the bounds.
    """
    if isinstance(indices, (list, tuple)):
        indices = np.asarray(indices, dtype=np.int64 if len(indices) == 0 else None)
    idx = torch.as_tensor(indices)
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
    idx = idx.reshape(-1).to(torch.int64)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -n or hi >= n:
            raise IndexError(f"index {lo if lo < -n else hi} is out of range")
        if lo < 0:
            idx = torch.where(idx < 0, idx + n, idx)
    return idx


def profile_collate_path(
    ds: Any, tensor: torch.Tensor, batch: int, n_threads: int
) -> dict[str, float]:
    """Microseconds per batch of each step of the three paths, at ``n_threads``.

    Rows marked ``old`` time the code that the benchmark suite's optimisations
    replaced (index conversion, one plain dict per sample, the collate that stacks
    the samples into a second copy), next to what runs now.
    """
    from torch.utils.data import default_collate

    from shareddata.crossing._collate import Row

    threads = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        tds = TensorDataset(tensor)
        perm = torch.randperm(len(tensor))[: batch * 200].split(batch)
        lists = [p.tolist() for p in perm]
        col = ds._columns["data"]  # private, for the breakdown only
        gathered = [col.gather(ds._indices(x)) for x in lists[:50]]
        split = [col.split(g) for g in gathered]
        samples = [ds.__getitems__(x) for x in lists[:50]]
        n = len(ds)

        def per_batch(fn: Callable[[Any], Any], items: Sequence[Any]) -> float:
            for x in items[:5]:
                fn(x)
            t0 = time.perf_counter()
            for x in items:
                fn(x)
            return (time.perf_counter() - t0) / len(items) * 1e6

        buf = torch.empty((batch, *tensor.shape[1:]), dtype=tensor.dtype)
        array, nbuf = tensor.numpy(), buf.numpy()
        return {
            "(a) fetch: [tds[i] for i in idx]": per_batch(lambda x: [tds[i] for i in x], lists),
            "(a) default_collate": per_batch(
                default_collate, [[tds[i] for i in x] for x in lists[:50]]
            ),
            "(b) __getitems__ total": per_batch(ds.__getitems__, lists),
            "(b)   _indices(list)": per_batch(ds._indices, lists),
            "(b)   old _indices(list)": per_batch(lambda x: old_indices(n, x), lists),
            "(b)   gather (index_select)": per_batch(col.gather, [ds._indices(x) for x in lists]),
            "(b) __getitems__, every sample made": per_batch(
                lambda x: list(ds.__getitems__(x)), lists
            ),
            "(b)   split (unbind)": per_batch(col.split, gathered),
            "(b)   one Row per sample": per_batch(lambda s: [Row({"data": v}) for v in s], split),
            "(b)   old: one dict per sample": per_batch(
                lambda s: [dict(zip(["data"], row)) for row in zip(s)], split
            ),
            "(b) default_collate (shortcut)": per_batch(default_collate, samples),
            "(b) old: default_collate stacking": per_batch(
                default_collate, [list(s) for s in samples]
            ),
            "(c) ds[index tensor]": per_batch(ds.__getitem__, list(perm)),
            "(c)   _indices(tensor)": per_batch(ds._indices, list(perm)),
            "(c)   old _indices(tensor)": per_batch(lambda x: old_indices(n, x), list(perm)),
            "raw index_select(out=)": per_batch(
                lambda i: torch.index_select(tensor, 0, i, out=buf[: len(i)]), list(perm)
            ),
            "raw np.take(out=)": per_batch(
                lambda i: np.take(array, i.numpy(), axis=0, out=nbuf[: len(i)]), list(perm)
            ),
        }
    finally:
        torch.set_num_threads(threads)


def measure(rows: int) -> dict[str, Any]:
    """Child: the per-step costs at each thread count, then the contention probe."""
    import shareddata as sd

    tensor = torch.from_numpy(np.random.default_rng(0).random((rows, 256), dtype=np.float32))
    ds = sd.NumpyDataset(tensor.numpy(), progress=False)
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    steps = {str(t): profile_collate_path(ds, tensor, 256, t) for t in threads}
    return {"per_batch_us": steps, "contention": contention_probe(ds, tensor, 256, threads)}


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """One fresh process over 256 MiB of 1 KiB rows (4 MiB quick)."""
    rows = (opts.size or (4 << 20 if quick else 256 << 20)) // 1024
    return opts.runner.run("harness.topics.analysis", "measure", rows=max(1024, rows))


def render(r: dict[str, Any]) -> str:
    """The per-step table and the contention table."""
    per, probe = r["per_batch_us"], r["contention"]
    names = [k for k in probe[0] if k not in ("busy_loops", "threads", "others_cores")]
    steps = [[k, *(f"{per[t][k]:.1f}" for t in per)] for k in next(iter(per.values()))]
    busy = [
        [p["busy_loops"], p["threads"], *(f"{p[k]:.1f}" for k in names), f"{p['others_cores']:.2f}"]
        for p in probe
    ]
    return "\n".join(
        [
            "## Where a batch's time goes (1 KiB rows, batch 256)",
            "",
            "us per batch of each step, outside the DataLoader; `old` rows are the code before "
            "the suite's optimisations, kept for comparison:",
            "",
            table(["step", *(f"{t} thread{'s' if t != '1' else ''}" for t in per)], steps),
            "",
            "The gather under CPU contention: us per batch with the cores idle and with one "
            "busy-loop process per core:",
            "",
            table(["busy loops", "torch threads", *names, "others' cores"], busy),
            "",
        ]
    )
