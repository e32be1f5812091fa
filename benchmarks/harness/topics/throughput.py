"""Batch throughput: samples/s against batch size and sample size, 0 and 2 workers.

For each sample size (1 KiB and 16 KiB rows, 256 MiB of float32), one fresh process
times every case at every batch size with ``num_workers=0`` (torch's default
threads) and at batch 256 with 2 fork workers (persistent): over >= ``window_s``
seconds per point after 2 warm-up batches, across epochs; the repetitions are the
outer loop so a burst of other work hits every case alike. The raw gather limit
(``index_select(out=)`` of random rows into one reused buffer) is measured at every
point, and every figure is also given as a fraction of it. The IPC floor: a loader
whose workers return a new batch without reading anything, carried by torch (a
``/dev/shm`` segment) or by shareddata (a memfd; Note [How a batch leaves a worker]).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from harness import cases
from harness.machine import CpuMonitor, median
from harness.render import fx, others, plot, rate, ratio, table, verdict

IPC = {"IPC floor, torch /dev/shm": "torch", "IPC floor, shareddata memfd": "memfd"}
RAW = "raw index_select(out=)"
NAMES = [RAW, "shareddata fast path", "shareddata", "shareddata, no shortcut", "TensorDataset"]
NAMES += ["numpy array", "h5py lazy", "HF datasets", "tensordict shared", "tensordict memmap"]
OURS = ("shareddata", "shareddata, no shortcut", "shareddata fast path")
TARGETS = {"fast_path_of_raw": 0.5, "vs_tensordataset_0": 1.2, "vs_tensordataset_2": 1.3}
TARGETS["vs_hf"] = 10.0


class RawGather:
    """The limit: a fresh ``randperm`` split into batches, ``index_select`` into one buffer."""

    def __init__(self, tensor: torch.Tensor, batch: int) -> None:
        self.tensor, self.batch = tensor, batch
        self.buf = torch.empty((batch, *tensor.shape[1:]), dtype=tensor.dtype)

    def __iter__(self) -> Any:
        for idx in torch.randperm(len(self.tensor)).split(self.batch):
            yield torch.index_select(self.tensor, 0, idx, out=self.buf[: len(idx)])


class ReadyBatches(Dataset):
    """A new batch of the right size, nothing read: the IPC floor (with ``IndexBatchSampler``).

    In a worker the batch is allocated as a real one would be: by torch in
    ``/dev/shm`` (what default collate does) or by shareddata in a memfd.
    """

    def __init__(self, rows: int, row_shape: tuple[int, ...], transport: str) -> None:
        self.rows, self.row_shape, self.transport = rows, row_shape, transport

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        from torch.utils.data import get_worker_info

        from harness.transport import shared_empty, transport

        worker_empty = transport().worker_empty

        shape = (len(index), *self.row_shape)
        if get_worker_info() is None:
            return {"data": torch.empty(shape)}
        make = shared_empty if self.transport == "torch" else worker_empty
        return {"data": make(shape, torch.float32)}


def timed_rate(loader: Iterable[Any], window_s: float, warmup: int = 2) -> float:
    """Samples/s over at least ``window_s`` seconds (and 5 batches), across epochs."""
    it = iter(loader)
    for _ in range(warmup):
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
    n = batches = 0
    t0 = time.perf_counter()
    while True:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        n += cases.batch_len(batch)
        batches += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s and batches >= 5:
            return n / elapsed


def _loader(name: str, files: cases.Files, batch: int, workers: int, built: dict[str, Any]) -> Any:
    if name == RAW:
        built.setdefault(RAW, torch.from_numpy(np.load(files.npy)))
        return RawGather(built[RAW], batch)
    if name in IPC:
        ds: Any = ReadyBatches(files.rows, (files.row_floats,), IPC[name])
        kw: dict[str, Any] = {"sampler": sd.IndexBatchSampler(ds, batch), "batch_size": None}
    else:
        ds = built[name] if name in built else built.setdefault(name, cases.build(name, files))
        kw = cases.loader_kwargs(name, ds, batch)
    if workers:
        kw.update(num_workers=workers, persistent_workers=True, multiprocessing_context="fork")
    return DataLoader(ds, **kw)


def measure(
    files: dict[str, Any],
    names: list[str],
    grid: list[list[int]],
    reps: int,
    window_s: float,
    ipc_batch: int,
) -> dict[str, Any]:
    """Child: samples/s of every (case, batch, workers) point, ``reps`` times each."""
    f = cases.Files(**files)
    built: dict[str, Any] = {}
    loaders: dict[str, Any] = {}
    rates: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    mon = CpuMonitor()
    for rep in range(reps):
        for batch, workers in grid:
            for name in [*names, *(IPC if batch == ipc_batch else [])]:
                key = f"{name}|{batch}/{workers}"
                if key in errors:
                    continue
                try:
                    if key not in loaders:
                        loaders[key] = _loader(name, f, batch, workers, built)
                    rates.setdefault(key, []).append(timed_rate(loaders[key], window_s))
                except Exception as e:
                    errors[key] = f"{type(e).__name__}: {e}"
            print(
                f"  throughput rep {rep + 1}/{reps}, {f.row_floats * 4} B rows, "
                f"batch {batch}, workers {workers}",
                flush=True,
            )
    return {
        "rows": f.rows,
        "median": {k: median(v) for k, v in rates.items()},
        "runs": rates,
        "errors": errors,
        "cpu": mon.result(),
    }


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every case at every point, one fresh process per sample size."""
    sizes = [1024] if quick else [1024, 16384]
    batches = [64, 256] if quick else [16, 64, 256, 1024]
    nbytes = opts.size or (4 << 20 if quick else 256 << 20)
    names = [n for n in NAMES if cases.available(opts.status, n)]
    out: dict[str, Any] = {
        "batch_sizes": batches,
        "worker_batch": 256,
        "window_s": 0.03 if quick else 0.4,
        "by_size": {},
    }
    with tempfile.TemporaryDirectory(prefix="sd-throughput-", dir=opts.tmp_dir) as tmp:
        for size in sizes:
            files = cases.peer_files(tmp, f"tp-{size}", nbytes, size, opts.status)
            grid = [[b, 0] for b in batches] + [[256, 2]]
            out["by_size"][str(size)] = opts.runner.run(
                "harness.topics.throughput",
                "measure",
                files=vars(files),
                names=names,
                grid=grid,
                reps=opts.reps,
                window_s=out["window_s"],
                ipc_batch=256,
            )
            files.remove()
    out["pin_memory"] = (
        "measurable"
        if torch.cuda.is_available()
        else (
            "not measurable on this machine: torch has no accelerator here and turns "
            "`pin_memory=True` off (with a warning); the fast path returns plain dicts of "
            "tensors, which the pin-memory thread pins as they are"
        )
    )
    out["status"] = opts.status
    return out


def at(r: dict[str, Any], size: str, case: str, batch: int, workers: int) -> float | None:
    """Median samples/s of one point (None if not measured)."""
    return r["by_size"].get(size, {}).get("median", {}).get(f"{case}|{batch}/{workers}")


def targets(r: dict[str, Any]) -> list[list[str]]:
    """The throughput targets: fast path / raw, default collate / TensorDataset, vs HF."""
    rows, b = [], r["worker_batch"]
    for size in r["by_size"]:
        kib = f"{int(size) // 1024} KiB"
        raw, fast = at(r, size, RAW, b, 0), at(r, size, "shareddata fast path", b, 0)
        v = ratio(fast, raw)
        rows.append(
            [
                f"fast path / raw gather, {kib}, batch {b}, 0 workers",
                fx(v),
                f">= {TARGETS['fast_path_of_raw']}x",
                verdict(v, TARGETS["fast_path_of_raw"], True),
                f"raw gather {rate(raw)} M samples/s",
            ]
        )
        for w in (0, 2):
            peers = {c: at(r, size, c, b, w) for c in NAMES if c not in OURS and c != RAW}
            best = max(((v, c) for c, v in peers.items() if v), default=None)
            context = f"best peer {best[1]} {rate(best[0])} M/s" if best else ""
            for label, key in (
                ("torch", "IPC floor, torch /dev/shm"),
                ("ours", "IPC floor, shareddata memfd"),
            ):
                ipc = at(r, size, key, b, w) if w else None
                context += f"; IPC floor ({label}) {b / ipc * 1e6:.0f} us/batch" if ipc else ""
            goal = TARGETS[f"vs_tensordataset_{w}"]
            v = ratio(at(r, size, "shareddata", b, w), at(r, size, "TensorDataset", b, w))
            rows.append(
                [
                    f"default collate / TensorDataset, {kib}, {w} workers",
                    fx(v),
                    f">= {goal}x",
                    verdict(v, goal, True),
                    context,
                ]
            )
            top = max(
                (at(r, size, c, b, w) or 0, c) for c in ("shareddata", "shareddata fast path")
            )
            if best and top[0]:
                v = top[0] / best[0]
                rows.append(
                    [
                        f"{top[1]} / best peer ({best[1]}), {kib}, {w} workers",
                        fx(v),
                        ">= 1.0x",
                        verdict(v, 1.0, True),
                        "",
                    ]
                )
        hf = at(r, size, "HF datasets", b, 2)
        ours = max(at(r, size, c, b, 2) or 0 for c in ("shareddata", "shareddata fast path"))
        if hf:
            v = ours / hf
            rows.append(
                [
                    f"best shareddata path / HF datasets, {kib}, 2 workers",
                    fx(v),
                    f">= {TARGETS['vs_hf']}x",
                    verdict(v, TARGETS["vs_hf"], True),
                    f"HF {rate(hf)} M/s",
                ]
            )
    return rows


def render(r: dict[str, Any]) -> str:
    """One table per sample size, the IPC cost and the spread of the repetitions."""
    b, batches = r["worker_batch"], r["batch_sizes"]
    what = "; ".join(f"**{c}**: {cases.CASES[c][1]}" for c in NAMES if c in cases.CASES)
    lines = [
        "## Batch throughput",
        "",
        "Samples/s (millions) of `DataLoader(ds, batch_size=B, shuffle=True)` (or the case's own "
        f"sampler/collate), timed over >= {r['window_s']} s per point after 2 warm-up batches, "
        "across epochs; fraction of the raw gather (`index_select(out=)` into one reused "
        "buffer, same rows, same batch size) in brackets. `num_workers=0` at torch's default "
        f"threads; 2 workers: fork, `persistent_workers=True`, batch {b}. Cases: {what}.",
        "",
    ]
    points = [(x, 0) for x in batches] + [(b, 2)]
    for size, res in r["by_size"].items():
        med, rows = res["median"], []
        for name in NAMES:
            if not cases.available(r["status"], name):
                rows.append(cases.missing_row(name, len(points) + 1))
                continue
            row = [name]
            for batch, workers in points:
                v, raw = med.get(f"{name}|{batch}/{workers}"), med.get(f"{RAW}|{batch}/0")
                err = res["errors"].get(f"{name}|{batch}/{workers}")
                cell = f"failed: {err[:60]}" if err else rate(v)
                row.append(cell + (f" ({v / raw:.0%})" if v and raw and name != RAW else ""))
            rows.append(row)
        header = ["case", *[f"B={x}" for x in batches], f"B={b}, 2 workers"]
        lines += [
            f"### {int(size) // 1024} KiB samples ({res['rows']} rows, "
            f"{res['rows'] * int(size) / (1 << 20):.0f} MiB)",
            "",
            table(header, rows),
            "",
        ]
        ipc = {
            k: med.get(f"{k}|{b}/{w}")
            for k, w in (("IPC floor, torch /dev/shm", 2), ("IPC floor, shareddata memfd", 2))
        }
        ipc0 = med.get(f"IPC floor, shareddata memfd|{b}/0")
        if all(ipc.values()) and ipc0:
            per = {
                n: med.get(f"{n}|{b}/2")
                for n in ("shareddata", "shareddata, no shortcut", "TensorDataset")
            }
            lines += [
                f"Per-batch IPC cost (batch {b}, 2 workers): a loader whose workers return a new "
                "batch without reading anything delivers one every "
                f"{b / ipc['IPC floor, torch /dev/shm'] * 1e6:.0f} us when torch carries it (a "
                "`/dev/shm` segment, its fd fetched from the worker), "
                f"{b / ipc['IPC floor, shareddata memfd'] * 1e6:.0f} us in shareddata's memfd "
                f"(Note [How a batch leaves a worker]); without workers, {b / ipc0 * 1e6:.0f} us. "
                "Per batch with 2 workers: "
                + ", ".join(f"{n} {b / v * 1e6:.0f} us" for n, v in per.items() if v)
                + ".",
                "",
            ]
        spread = [
            f"{n} " + " / ".join(rate(x) for x in res["runs"].get(f"{n}|{b}/0", []))
            for n in NAMES[:5]
        ]
        unsteady = sorted(
            {
                k.split("|")[0]
                for k, v in res["runs"].items()
                if len(v) > 1 and min(v) > 0 and max(v) / min(v) > 3
            }
        )
        lines += [
            f"Every repetition at B={b}, 0 workers (M samples/s): "
            + "; ".join(spread)
            + ". "
            + others(res)
            + (
                f" Repetitions of some points differ by more than 3x ({', '.join(unsteady)}): "
                "other work took the cores; a multi-threaded `index_select` (the raw limit, "
                "shareddata, tensordict) stalls while torch's second thread waits for a core "
                "(see the contention probe), per-sample indexing does not. Those medians "
                "measure the machine, not the code."
                if unsteady
                else ""
            ),
            "",
        ]
    return "\n".join([*lines, f"`pin_memory=True`: {r['pin_memory']}.", ""])


def plot_png(r: dict[str, Any], img_dir: str) -> dict[str, str]:
    """samples/s against batch size, one panel per sample size."""
    sizes = list(r["by_size"])

    def draw(ax: Any, i: int) -> None:
        med = r["by_size"][sizes[i]]["median"]
        for name in NAMES:
            pts = [(b, med[f"{name}|{b}/0"]) for b in r["batch_sizes"] if med.get(f"{name}|{b}/0")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, ls="--" if name == RAW else "-")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch size",
            ylabel="samples/s",
            title=f"{int(sizes[i]) // 1024} KiB samples, num_workers=0",
        )

    path = os.path.join(img_dir, "bench-throughput.png")
    return {"throughput against batch size": path} if plot(path, len(sizes), draw, 6) else {}
