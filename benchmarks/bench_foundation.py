"""Benchmark of shareddata's foundation, side by side with the usual ways of doing it.

1. load: ``sd.NumpyDataset(path)`` vs ``torch.from_numpy(np.load(path)).share_memory_()``
   on a ``.npy`` file in a warm page cache; wall time and peak private memory, each
   repetition in a fresh process, sampled from the parent.
2. memory: ``sd.verify(loader).duplication`` of a full epoch with 4 workers under
   fork, spawn and forkserver, for ``sd.NumpyDataset`` vs a Dataset holding a numpy
   array; each run in a fresh process.
3. throughput: samples/s of a full epoch with ``num_workers=0``: ``TensorDataset``,
   ``sd.NumpyDataset`` with the default collate, the ``IndexBatchSampler`` fast path,
   and the raw ``torch.index_select`` gather they are all bounded by.

Run ``.venv/bin/python benchmarks/bench_foundation.py`` (about 6 minutes on 2 quiet cores;
``--quick`` for a smoke run of about a minute). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import shareddata as sd

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 64 << 20  # the chunk size shareddata reads .npy data with (sources/npy.py)
MADV_POPULATE_WRITE = 23
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

TARGETS = {
    "load_time_ratio": 0.6,  # ours / naive wall time, at most
    "load_peak_private_fraction": 0.1,  # ours' peak private memory / data size, at most
    "duplication": 1.05,  # ours, every start method, at most
    "collate_speedup": 1.2,  # (b) / (a), at least
    "fast_path_speedup": 3.0,  # (c) / (a), at least
}


# --------------------------------------------------------------------------------------
# Small helpers


def parse_size(text: str) -> int:
    """Parse ``"1GiB"``, ``"512MiB"``, ``"64M"`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB, 512MiB)")
    scale = {"": 1, "K": 1 << 10, "M": MIB, "G": GIB, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def median(values: Iterable[float]) -> float:
    """Median of the values (NaN for none)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def proc_fields(pid: int, name: str) -> dict[str, int]:
    """``Name:  123 kB`` fields of ``/proc/<pid>/<name>``, in bytes."""
    return kb_fields(f"/proc/{pid}/{name}")


def kb_fields(path: str) -> dict[str, int]:
    """``Name:  123 kB`` fields of a ``/proc`` file, in bytes."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other users of the machine show here)."""
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


class CpuMonitor:
    """CPU that other processes used during a section: machine busy time minus ours.

    Ours is this process and every child it has reaped (``os.times``), which covers
    the load and throughput sections exactly; in the memory section a forkserver
    outlives its parent and its CPU (a ``torch`` import) is counted as others'.
    """

    def __init__(self) -> None:
        self.start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / hz  # user nice system irq softirq
        steal = v[7] / hz if len(v) > 7 else 0.0
        t = os.times()
        return (
            time.monotonic(),
            busy,
            steal,
            t.user + t.system + t.children_user + t.children_system,
        )

    def result(self) -> dict[str, float]:
        """Cores used on average since the start: by others, by us, stolen by the host."""
        end = self._snap()
        wall = max(end[0] - self.start[0], 1e-9)
        ours = end[3] - self.start[3]
        return {
            "wall_s": wall,
            "others_cores": max(0.0, (end[1] - self.start[1]) - ours) / wall,
            "ours_cores": ours / wall,
            "steal_cores": (end[2] - self.start[2]) / wall,
        }


def wait_idle(limit_s: float, threshold: float = 0.2) -> float:
    """Wait up to ``limit_s`` for a 1 s window where others use < ``threshold`` cores."""
    deadline = time.monotonic() + limit_s
    while True:
        mon = CpuMonitor()
        time.sleep(1.0)
        others = mon.result()["others_cores"]
        if others < threshold or time.monotonic() >= deadline:
            return others


def cached_fraction(path: str) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore``), None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        size = os.path.getsize(path)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return float((np.frombuffer(vec, np.uint8) & 1).mean())
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path``."""
    best, kind = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def machine_info() -> dict[str, Any]:
    """Cores, RAM, kernel, CPU, versions: what the figures depend on."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "?"

    try:
        commit = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "ram_gib": round(kb_fields("/proc/meminfo")["MemTotal"] / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "numpy": np.__version__,
        "shareddata": sd.__version__,
        "commit": commit or "?",
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    }


def run_child(args: Sequence[str], timeout: float = 600, script: str = __file__) -> dict[str, Any]:
    """Run ``script`` (this one by default) in child mode; return the JSON it prints last."""
    cmd = [sys.executable, os.path.abspath(script), "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def emit(obj: dict[str, Any]) -> None:
    """Print one JSON line for the parent (child side)."""
    print(json.dumps(obj), flush=True)


# --------------------------------------------------------------------------------------
# 1. Load


def write_npy(path: str, nbytes: int, row_floats: int = 1024) -> tuple[int, ...]:
    """Write a float32 ``.npy`` of ~``nbytes`` in chunks (no full temporary); fsync it."""
    rows = max(1, nbytes // (4 * row_floats))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, row_floats))
    rng = np.random.default_rng(0)
    step = max(1, CHUNK // (4 * row_floats))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[start:stop] = rng.random((stop - start, row_floats), dtype=np.float32)
    out.flush()
    shape = out.shape
    del out
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # no writeback may run during a measurement
    finally:
        os.close(fd)
    return tuple(shape)


def warm(path: str) -> None:
    """Read the whole file once so that it sits in the page cache."""
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


class Sampler(threading.Thread):
    """Samples a process's ``RssAnon`` and ``RssShmem`` (``/proc/<pid>/status``) every ms.

    ``status`` reads the kernel's per-mm counters (O(1)); ``smaps_rollup`` walks
    every page table and took ~50 ms per read with 2 GiB mapped here, far too slow
    to sample a load with (see README).
    """

    def __init__(self, pid: int, interval: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[int, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        path = f"/proc/{self.pid}/status"
        while not self._stop_event.is_set():
            try:
                with open(path, encoding="ascii") as f:
                    text = f.read()
            except OSError:
                return
            anon = shmem = 0
            for line in text.splitlines():
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
            self.samples.append((anon, shmem))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def measure_load(method: str, path: str, script: str = __file__) -> dict[str, Any]:
    """One load in a fresh process: wall time (in the child) and memory (sampled here).

    The child (``script --child load METHOD PATH``) prints a JSON line when ready,
    loads on a ``go`` line, prints ``{"seconds": ..., "parts": {...}}``, and exits
    on the next line (:func:`child_load` here; ``bench_suite.py`` has its own).
    """
    cmd = [sys.executable, os.path.abspath(script), "--child", "load", method, path]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready = json.loads(proc.stdout.readline())
        pid = proc.pid
        status0 = proc_fields(pid, "status")
        smaps0 = proc_fields(pid, "smaps_rollup")
        sampler = Sampler(pid)
        sampler.start()
        time.sleep(0.02)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        sampler.stop()
        if not line:
            raise RuntimeError(f"load child {method} died (exit {proc.wait()})")
        result = json.loads(line)
        status1 = proc_fields(pid, "status")
        smaps1 = proc_fields(pid, "smaps_rollup")
        proc.stdin.write("exit\n")
        proc.stdin.flush()
    finally:
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    anon0 = status0["RssAnon"]
    shmem0 = status0.get("RssShmem", 0)
    samples = sampler.samples + [(status1["RssAnon"], status1.get("RssShmem", 0))]
    return {
        "method": method,
        "seconds": result["seconds"],
        "parts": result.get("parts", {}),
        "peak_private": max(a for a, _ in samples) - anon0,
        "peak_private_plus_shmem": max(a + s for a, s in samples) - anon0 - shmem0,
        "retained_private": status1["RssAnon"] - anon0,
        "smaps_anonymous_before": smaps0.get("Anonymous", 0),
        "smaps_anonymous_after": smaps1.get("Anonymous", 0),
        "smaps_shmem_after": smaps1.get("Pss_Shmem", 0),
        "hwm_growth": status1["VmHWM"] - status0["VmRSS"],
        "samples": len(samples),
        "child_ready_rss": ready["rss"],
    }


def child_load(method: str, path: str) -> None:
    """Child: wait for "go", load ``path`` one way, report, wait for "exit"."""
    gc.collect()
    emit({"rss": proc_fields(os.getpid(), "status")["VmRSS"]})
    sys.stdin.readline()
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    if method == "ours":
        keep: Any = sd.NumpyDataset(path, progress=False)
    else:
        array = np.load(path)
        t1 = time.perf_counter()
        keep = torch.from_numpy(array).share_memory_()
        del array
        parts = {"np.load": t1 - t0, "share_memory_": time.perf_counter() - t1}
    seconds = time.perf_counter() - t0
    emit({"seconds": seconds, "parts": parts})
    sys.stdin.readline()
    del keep


def child_breakdown(path: str) -> None:
    """Child: time the steps of shareddata's load, mirrored with raw system calls.

    Mirrors ``Segment.create`` (memfd, ``posix_fallocate``, ``MADV_POPULATE_WRITE``)
    and ``_NpyFile.read`` (``preadv`` in 64 MiB chunks), then times the copy again
    into the already-mapped pages (the copy's own cost) and, for comparison, a
    load through ``sendfile`` into an unmapped memfd (no page tables at all).
    """
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
    n = os.path.getsize(path) - offset
    src = os.open(path, os.O_RDONLY)

    def pread_all(view: memoryview) -> None:
        pos = 0
        while pos < n:
            pos += os.preadv(src, [view[pos : pos + CHUNK]], offset + pos)

    t0 = time.perf_counter()
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.posix_fallocate(fd, 0, n)
    t1 = time.perf_counter()
    m = mmap.mmap(fd, n)
    m.madvise(MADV_POPULATE_WRITE)
    t2 = time.perf_counter()
    view = memoryview(m)
    pread_all(view)
    t3 = time.perf_counter()
    pread_all(view)
    t4 = time.perf_counter()
    view.release()
    m.close()
    os.close(fd)
    t5 = time.perf_counter()
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    pos = 0
    while pos < n:
        pos += os.sendfile(fd, src, offset + pos, min(CHUNK, n - pos))
    t6 = time.perf_counter()
    os.close(fd)
    os.close(src)
    emit(
        {
            "fallocate": t1 - t0,
            "populate": t2 - t1,
            "preadv": t3 - t2,
            "preadv_again": t4 - t3,
            "mirror_total": t3 - t0,
            "sendfile_alternative": t6 - t5,
        }
    )


def bench_load(path: str, nbytes: int, reps: int) -> dict[str, Any]:
    """Repeat both loads (alternating which goes first) and the breakdown."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "naive": []}
    breakdown: list[dict[str, Any]] = []
    cached: list[float | None] = []
    for rep in range(reps):
        order = ("ours", "naive") if rep % 2 == 0 else ("naive", "ours")
        for method in order:
            cached.append(cached_fraction(path))
            r = measure_load(method, path)
            runs[method].append(r)
            print(
                f"  load rep {rep + 1}/{reps} {method:5s} {r['seconds']:.3f} s, peak private "
                f"{r['peak_private'] / MIB:.1f} MiB",
                flush=True,
            )
        breakdown.append(run_child(["breakdown", path]))
    summary: dict[str, Any] = {}
    for method, rs in runs.items():
        summary[method] = {
            key: median(r[key] for r in rs)
            for key in (
                "seconds",
                "peak_private",
                "peak_private_plus_shmem",
                "retained_private",
                "hwm_growth",
                "smaps_anonymous_before",
                "smaps_anonymous_after",
                "smaps_shmem_after",
                "samples",
            )
        }
    summary["naive"]["parts"] = {
        k: median(r["parts"][k] for r in runs["naive"]) for k in runs["naive"][0]["parts"]
    }
    summary["breakdown"] = {k: median(b[k] for b in breakdown) for k in breakdown[0]}
    ratio = summary["ours"]["seconds"] / summary["naive"]["seconds"]
    fraction = summary["ours"]["peak_private"] / nbytes
    return {
        "nbytes": nbytes,
        "reps": reps,
        "page_cache_fraction_min": min((c for c in cached if c is not None), default=None),
        "summary": summary,
        "time_ratio": ratio,
        "peak_private_fraction_ours": fraction,
        "peak_private_fraction_naive": summary["naive"]["peak_private"] / nbytes,
        "pass_time": ratio <= TARGETS["load_time_ratio"],
        "pass_memory": fraction <= TARGETS["load_peak_private_fraction"],
        "runs": runs,
        "breakdown_runs": breakdown,
    }


# --------------------------------------------------------------------------------------
# 2. Memory after an epoch with workers


class NumpyArrayDataset(Dataset):
    """The usual Dataset: a numpy array attribute, one row per sample."""

    def __init__(self, path: str) -> None:
        self.data = np.load(path)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.data[i])


def child_memory(kind: str, method: str, path: str, workers: int, batch: int) -> None:
    """Child: build the dataset, run ``sd.verify`` over one epoch, print its report."""
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    ds: Dataset = (
        sd.NumpyDataset(path, progress=False) if kind == "ours" else NumpyArrayDataset(path)
    )
    nbytes = int(np.load(path, mmap_mode="r").nbytes)
    loader = DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, multiprocessing_context=method
    )
    t0 = time.perf_counter()
    report = sd.verify(loader, max_duplication=None, dataset_bytes=nbytes)
    out = report.to_dict()
    out["seconds"] = time.perf_counter() - t0
    emit(out)


def bench_memory(
    path: str, methods: Sequence[str], reps: int, workers: int, batch: int
) -> dict[str, Any]:
    """``duplication`` of both datasets under every start method, fresh process per run."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: {"ours": [], "plain": []} for m in methods
    }
    for rep in range(reps):
        for method in methods:
            for kind in ("ours", "plain"):
                r = run_child(["memory", kind, method, path, str(workers), str(batch)])
                r.pop("processes", None)
                runs[method][kind].append(r)
                print(
                    f"  memory rep {rep + 1}/{reps} {method:10s} {kind:5s} "
                    f"{r['duplication']:.3f}x ({r['seconds']:.1f} s)",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    for method in methods:
        row: dict[str, Any] = {}
        for kind in ("ours", "plain"):
            rs = runs[method][kind]
            row[kind] = {
                "duplication": median(r["duplication"] for r in rs),
                "extra_bytes": median(r["extra_bytes"] for r in rs),
                "baseline_bytes": median(r["baseline_bytes"] for r in rs),
                "total_pss": median(r["total_pss"] for r in rs),
                "seconds": median(r["seconds"] for r in rs),
                "batches": rs[0]["batches"],
            }
        row["ratio"] = row["plain"]["duplication"] / row["ours"]["duplication"]
        row["pass"] = row["ours"]["duplication"] <= TARGETS["duplication"]
        summary[method] = row
    return {
        "nbytes": int(np.load(path, mmap_mode="r").nbytes),
        "workers": workers,
        "batch_size": batch,
        "reps": reps,
        "summary": summary,
        "runs": runs,
    }


# --------------------------------------------------------------------------------------
# 3. Batch throughput, num_workers=0


def epoch_rate(loader: Iterable[Any], expected: int) -> float:
    """Samples per second over one full epoch of ``loader``."""
    n = 0
    t0 = time.perf_counter()
    for batch in loader:
        x = batch["data"] if isinstance(batch, dict) else batch[0]
        n += len(x)
    seconds = time.perf_counter() - t0
    if n != expected:
        raise RuntimeError(f"an epoch gave {n} samples, expected {expected}")
    return n / seconds


class RawGather:
    """The limit: a fresh ``randperm`` split into batches, ``index_select`` into a buffer."""

    def __init__(self, tensor: torch.Tensor, batch: int) -> None:
        self.tensor = tensor
        self.batch = batch
        self.buf = torch.empty((batch, *tensor.shape[1:]), dtype=tensor.dtype)

    def __iter__(self) -> Any:
        for idx in torch.randperm(len(self.tensor)).split(self.batch):
            yield (torch.index_select(self.tensor, 0, idx, out=self.buf[: len(idx)]),)


class RawTake(RawGather):
    """The same gather with ``np.take(..., out=)`` (numpy's serial kernel)."""

    def __iter__(self) -> Any:
        array, buf = self.tensor.numpy(), self.buf.numpy()
        for idx in torch.randperm(len(self.tensor)).split(self.batch):
            yield (np.take(array, idx.numpy(), axis=0, out=buf[: len(idx)]),)


@dataclass
class ThroughputCase:
    """One way of iterating an epoch."""

    key: str
    label: str
    make: Callable[[], Iterable[Any]]


def bench_throughput(
    rows: int, row_floats: int, batch: int, reps: int, threads: Sequence[int]
) -> dict[str, Any]:
    """Full-epoch samples/s of every case, medians of ``reps``, for each thread count.

    Repetitions are the outer loop and thread counts and cases the inner ones, so
    that a burst of load from elsewhere falls on every case alike.
    """
    array = np.random.default_rng(0).random((rows, row_floats), dtype=np.float32)
    tensor = torch.from_numpy(array)
    ds = sd.NumpyDataset(array, progress=False)
    ds_tuple = sd.NumpyDataset(array, progress=False, output="tuple")
    cases = [
        ThroughputCase(
            "a",
            "(a) TensorDataset + default collate",
            lambda: DataLoader(TensorDataset(tensor), batch_size=batch, shuffle=True),
        ),
        ThroughputCase(
            "b",
            "(b) NumpyDataset + default collate",
            lambda: DataLoader(ds, batch_size=batch, shuffle=True),
        ),
        ThroughputCase(
            "b_tuple",
            "(b') same, output='tuple'",
            lambda: DataLoader(ds_tuple, batch_size=batch, shuffle=True),
        ),
        ThroughputCase(
            "c",
            "(c) NumpyDataset + IndexBatchSampler",
            lambda: DataLoader(
                ds, sampler=sd.IndexBatchSampler(ds, batch, shuffle=True), batch_size=None
            ),
        ),
        ThroughputCase("raw", "raw index_select(out=)", lambda: RawGather(tensor, batch)),
        ThroughputCase("take", "raw np.take(out=)", lambda: RawTake(tensor, batch)),
    ]
    loaders = {case.key: case.make() for case in cases}
    rates: dict[int, dict[str, list[float]]] = {t: {c.key: [] for c in cases} for t in threads}
    cpu: dict[int, list[dict[str, float]]] = {t: [] for t in threads}
    default_threads = torch.get_num_threads()
    try:
        for case in cases:  # warm-up: lazy imports, allocator, caches
            for i, _ in enumerate(loaders[case.key]):
                if i == 20:
                    break
        for rep in range(reps):
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                mon = CpuMonitor()
                for case in cases:
                    rates[n_threads][case.key].append(epoch_rate(loaders[case.key], rows))
                cpu[n_threads].append(mon.result())
                print(
                    f"  throughput rep {rep + 1}/{reps} threads={n_threads}: "
                    + ", ".join(f"{k} {v[-1] / 1e6:.3f}M/s" for k, v in rates[n_threads].items())
                    + f" (others used {cpu[n_threads][-1]['others_cores']:.2f} cores)",
                    flush=True,
                )
    finally:
        torch.set_num_threads(default_threads)
    results: dict[str, Any] = {}
    for n_threads in threads:
        r = rates[n_threads]
        med = {k: median(v) for k, v in r.items()}
        results[str(n_threads)] = {
            "cases": {
                c.key: {
                    "label": c.label,
                    "samples_per_s": med[c.key],
                    "min": min(r[c.key]),
                    "max": max(r[c.key]),
                    "vs_a": med[c.key] / med["a"],
                    "of_raw": med[c.key] / med["raw"],
                    "rates": r[c.key],
                }
                for c in cases
            },
            "b_over_a": med["b"] / med["a"],
            "c_over_a": med["c"] / med["a"],
            "pass_b": med["b"] / med["a"] >= TARGETS["collate_speedup"],
            "pass_c": med["c"] / med["a"] >= TARGETS["fast_path_speedup"],
            "others_cores": [c["others_cores"] for c in cpu[n_threads]],
        }
    per_batch = {str(t): profile_collate_path(ds, tensor, batch, t) for t in threads}
    contention = contention_probe(ds, tensor, batch, threads)
    return {
        "rows": rows,
        "row_bytes": row_floats * 4,
        "batch_size": batch,
        "reps": reps,
        "by_threads": results,
        "per_batch_us": per_batch,
        "contention": contention,
    }


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

    from shareddata._batch import make_samples

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
            "(b)   split (unbind)": per_batch(col.split, gathered),
            "(b)   one Row per sample": per_batch(
                lambda g: make_samples(["data"], [g[0]], [True], [g[1]], len(g[1])),
                list(zip(gathered, split)),
            ),
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


# --------------------------------------------------------------------------------------
# Report


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table with padded columns (readable as plain text too)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def reps_text(n: int, what: str) -> str:
    """``"median of 3 fresh processes"``, or ``"1 fresh process"``."""
    return f"median of {n} {what}{'es' if what.endswith('s') else 's'}" if n > 1 else f"1 {what}"


def ok(passed: bool) -> str:
    """A pass/miss mark."""
    return "met" if passed else "**MISSED**"


def mib(n: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / MIB:.1f}"


def cpu_note(section: dict[str, Any]) -> str:
    """One sentence on how busy the machine was with other work during a section."""
    cpu = section.get("cpu")
    if not cpu:
        return ""
    return (
        f"Other processes used {cpu['others_cores']:.2f} of the cores on average during this "
        f"section ({cpu['wall_s']:.0f} s; this benchmark {cpu['ours_cores']:.2f}, host steal "
        f"{cpu['steal_cores']:.2f})."
    )


def render(results: dict[str, Any]) -> str:
    """The Markdown report."""
    info = results["machine"]
    out = [
        "# shareddata foundation benchmark",
        "",
        f"Run {results['started']}, {results['duration_s']:.0f} s, "
        f"`{results['command']}`{' (QUICK smoke run)' if results['quick'] else ''}.",
        "",
        "## Machine",
        "",
        table(
            ["", ""],
            [
                ["cores", f"{info['cores']} ({info['cores_usable']} usable), {info['cpu']}"],
                ["RAM", f"{info['ram_gib']} GiB"],
                ["kernel", info["kernel"]],
                ["python / torch / numpy", f"{info['python']} / {info['torch']} / {info['numpy']}"],
                ["torch intra-op threads (default)", info["torch_threads"]],
                ["scheduling priority (nice) of the benchmark", info["nice"]],
                ["shareddata", f"{info['shareddata']} (commit {info['commit']})"],
                ["THP (anon / shmem)", f"{info['thp']} / {info['thp_shmem']}"],
                ["load average at start / end", f"{results['load_start']} / {results['load_end']}"],
            ],
        ),
        "",
    ]
    if "load" in results:
        ld = results["load"]
        s, o, nv = ld["summary"], ld["summary"]["ours"], ld["summary"]["naive"]
        size = ld["nbytes"]
        cache = ld["page_cache_fraction_min"]
        out += [
            f"## 1. Load of a {mib(size)} MiB `.npy` ({reps_text(ld['reps'], 'fresh process')})",
            "",
            f"File on {results['tmp_fs']} (`{results['tmp_dir']}`), written once and read "
            "once before measuring; nothing dropped from the page cache, so both methods "
            "read from a warm cache (smallest resident fraction seen before a run: "
            f"{'?' if cache is None else f'{cache:.0%}'}). ours = `sd.NumpyDataset(path)`, "
            "naive = `torch.from_numpy(np.load(path)).share_memory_()`. Private = "
            "`RssAnon` sampled every ~1 ms from the parent, minus its value before the "
            "load. " + cpu_note(ld),
            "",
            table(
                ["", "ours", "naive", "ours / naive", "target", ""],
                [
                    [
                        "wall time (s)",
                        f"{o['seconds']:.3f}",
                        f"{nv['seconds']:.3f}",
                        f"{ld['time_ratio']:.2f}x",
                        f"<= {TARGETS['load_time_ratio']}x",
                        ok(ld["pass_time"]),
                    ],
                    [
                        "peak private memory (MiB)",
                        mib(o["peak_private"]),
                        mib(nv["peak_private"]),
                        "",
                        "",
                        "",
                    ],
                    [
                        "peak private / data",
                        f"{ld['peak_private_fraction_ours']:.3f}",
                        f"{ld['peak_private_fraction_naive']:.3f}",
                        "",
                        f"ours <= {TARGETS['load_peak_private_fraction']}",
                        ok(ld["pass_memory"]),
                    ],
                    [
                        "peak private + shmem (MiB)",
                        mib(o["peak_private_plus_shmem"]),
                        mib(nv["peak_private_plus_shmem"]),
                        f"{o['peak_private_plus_shmem'] / nv['peak_private_plus_shmem']:.2f}x",
                        "",
                        "",
                    ],
                    [
                        "peak RSS growth, VmHWM (MiB)",
                        mib(o["hwm_growth"]),
                        mib(nv["hwm_growth"]),
                        "",
                        "",
                        "",
                    ],
                    [
                        "private left after load (MiB)",
                        mib(o["retained_private"]),
                        mib(nv["retained_private"]),
                        "",
                        "",
                        "",
                    ],
                    [
                        "smaps_rollup Anonymous before -> after (MiB)",
                        f"{mib(o['smaps_anonymous_before'])} -> {mib(o['smaps_anonymous_after'])}",
                        f"{mib(nv['smaps_anonymous_before'])} -> "
                        f"{mib(nv['smaps_anonymous_after'])}",
                        "",
                        "",
                        "",
                    ],
                    [
                        "memory samples per load",
                        f"{o['samples']:.0f}",
                        f"{nv['samples']:.0f}",
                        "",
                        "",
                        "",
                    ],
                ],
            ),
            "",
            "Where the time goes (medians, seconds). ours, mirrored step by step with raw "
            "system calls in a separate fresh process; naive, timed inside its run:",
            "",
            table(
                ["step", "s", "GiB/s"],
                [
                    [name, f"{t:.3f}", f"{size / GIB / t:.2f}"]
                    for name, t in [
                        (
                            "ours: memfd + posix_fallocate (allocate, zero)",
                            s["breakdown"]["fallocate"],
                        ),
                        (
                            "ours: mmap + MADV_POPULATE_WRITE (page tables)",
                            s["breakdown"]["populate"],
                        ),
                        ("ours: preadv from page cache into the mapping", s["breakdown"]["preadv"]),
                        ("ours: total of the mirror", s["breakdown"]["mirror_total"]),
                        (
                            "copy limit: same preadv again (pages mapped)",
                            s["breakdown"]["preadv_again"],
                        ),
                        (
                            "alternative: ftruncate + sendfile (no mapping)",
                            s["breakdown"]["sendfile_alternative"],
                        ),
                        ("naive: np.load", nv["parts"]["np.load"]),
                        ("naive: share_memory_()", nv["parts"]["share_memory_"]),
                    ]
                ],
            ),
            "",
        ]
    if "memory" in results:
        mem = results["memory"]
        rows = []
        for method, row in mem["summary"].items():
            rows.append(
                [
                    method,
                    f"{row['ours']['duplication']:.3f}x",
                    f"{row['plain']['duplication']:.3f}x",
                    f"{row['ratio']:.2f}",
                    mib(row["ours"]["extra_bytes"]),
                    mib(row["plain"]["extra_bytes"]),
                    mib(row["ours"]["baseline_bytes"]),
                    f"{row['ours']['seconds']:.1f} / {row['plain']['seconds']:.1f}",
                    ok(row["pass"]),
                ]
            )
        out += [
            f"## 2. Memory after a full epoch, {mem['workers']} workers "
            f"({reps_text(mem['reps'], 'fresh process')})",
            "",
            f"{mib(mem['nbytes'])} MiB of float32 rows of 4 KiB, `batch_size={mem['batch_size']}`, "
            "`shuffle=True`, default collate. Duplication = `sd.verify(loader, "
            "max_duplication=None).duplication`: PSS (without file pages) of the main "
            "process and every worker after the last batch, net of the main process before "
            "and of a data-free worker's baseline, over the data size. ours = "
            "`sd.NumpyDataset(path)`; plain = a Dataset holding `self.data = np.load(path)`."
            f" Target: ours <= {TARGETS['duplication']}x. " + cpu_note(mem),
            "",
            table(
                [
                    "start method",
                    "ours",
                    "plain",
                    "plain / ours",
                    "ours extra MiB",
                    "plain extra MiB",
                    "worker baseline MiB",
                    "run s (ours / plain)",
                    "target",
                ],
                rows,
            ),
            "",
        ]
    if "throughput" in results:
        th = results["throughput"]
        out += [
            f"## 3. Batch throughput, num_workers=0 ({reps_text(th['reps'], 'full epoch')})",
            "",
            f"{th['rows']} rows of {th['row_bytes']} B (float32), `batch_size={th['batch_size']}`, "
            "`shuffle=True`, one epoch = every row once. Targets: (b)/(a) >= "
            f"{TARGETS['collate_speedup']}x, (c)/(a) >= {TARGETS['fast_path_speedup']}x. "
            + cpu_note(th),
            "",
        ]
        for n_threads, res in th["by_threads"].items():
            note = " (torch default)" if int(n_threads) == info["torch_threads"] else ""
            if int(n_threads) == 1:
                note += " (what DataLoader workers use)"
            rows = [
                [
                    c["label"],
                    f"{c['samples_per_s'] / 1e6:.3f}",
                    f"{c['min'] / 1e6:.3f} - {c['max'] / 1e6:.3f}",
                    f"{c['vs_a']:.2f}x",
                    f"{c['of_raw']:.0%}",
                ]
                for c in res["cases"].values()
            ]
            out += [
                f"### torch threads = {n_threads}{note}",
                "",
                table(["case", "M samples/s", "range", "vs (a)", "of raw gather"], rows),
                "",
                f"(b)/(a) = {res['b_over_a']:.2f}x: {ok(res['pass_b'])}; (c)/(a) = "
                f"{res['c_over_a']:.2f}x: {ok(res['pass_c'])}. Cores used by other processes "
                "during each repetition: "
                + ", ".join(f"{x:.2f}" for x in res["others_cores"])
                + ".",
                "",
            ]
        probe = th["contention"]
        names = [k for k in probe[0] if k not in ("busy_loops", "threads", "others_cores")]
        out += [
            "Sensitivity to CPU contention: us/batch (100 batches) without and with one "
            "busy-loop process per core started by the benchmark (standing for other ranks "
            "or jobs), and the cores other processes used meanwhile:",
            "",
            table(
                ["busy loops", "torch threads", *names, "others' cores"],
                [
                    [
                        r["busy_loops"],
                        r["threads"],
                        *(f"{r[k]:.1f}" for k in names),
                        f"{r['others_cores']:.2f}",
                    ]
                    for r in probe
                ],
            ),
            "",
        ]
        per = th["per_batch_us"]
        keys = list(next(iter(per.values())))
        out += [
            "Per-batch cost of each step (us/batch, 200 batches, outside the DataLoader):",
            "",
            table(
                ["step", *(f"{t} thread{'s' if t != '1' else ''}" for t in per)],
                [[k, *(f"{per[t][k]:.1f}" for t in per)] for k in keys],
            ),
            "",
        ]
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmarks, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, ~1 minute")
    parser.add_argument("--size", type=parse_size, help="size of the load benchmark's .npy")
    parser.add_argument("--reps", type=int, help="repetitions (>= 3 for a real run)")
    parser.add_argument("--only", nargs="+", choices=["load", "memory", "throughput"])
    parser.add_argument("--tmp-dir", help="where to write the data files (a local disk)")
    parser.add_argument("--out", help="output path prefix (.md and .json are added)")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each timed section, wait up to S seconds for other processes to go quiet",
    )
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        kind, *rest = args.child
        if kind == "load":
            child_load(*rest)
        elif kind == "breakdown":
            child_breakdown(*rest)
        elif kind == "memory":
            child_memory(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
        else:
            parser.error(f"unknown child {kind}")
        return 0

    quick = args.quick
    load_size = args.size or (64 * MIB if quick else GIB)
    reps = args.reps or 3
    mem_reps = args.reps or (1 if quick else 3)
    mem_size = 32 * MIB if quick else 256 * MIB
    workers = 2 if quick else 4
    methods = ["fork", "spawn"] if quick else ["fork", "spawn", "forkserver"]
    rows = 32768 if quick else 262144
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    only = set(args.only or ["load", "memory", "throughput"])
    out_prefix = args.out or os.path.join(
        HERE, "results", "foundation-quick" if quick else "foundation"
    )

    t_start = time.time()
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["python", "benchmarks/bench_foundation.py", *sys.argv[1:]]),
        "quick": quick,
        "machine": machine_info(),
        "load_start": load_average(),
        "targets": TARGETS,
    }
    print(json.dumps(results["machine"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="sd-bench-", dir=args.tmp_dir) as tmp:
        results["tmp_dir"] = tmp
        results["tmp_fs"] = fs_type(os.path.realpath(tmp))
        if "load" in only:
            path = os.path.join(tmp, "load.npy")
            shape = write_npy(path, load_size)
            warm(path)
            nbytes = int(np.prod(shape)) * 4
            print(f"1. load: {mib(nbytes)} MiB, {reps} reps", flush=True)
            idle = wait_idle(args.wait_idle)
            mon = CpuMonitor()
            results["load"] = bench_load(path, nbytes, reps)
            results["load"]["cpu"] = {"others_before": idle, **mon.result()}
            os.unlink(path)
        if "memory" in only:
            path = os.path.join(tmp, "memory.npy")
            write_npy(path, mem_size)
            warm(path)
            print(f"2. memory: {mib(mem_size)} MiB, {workers} workers, {methods}", flush=True)
            mon = CpuMonitor()
            results["memory"] = bench_memory(path, methods, mem_reps, workers, 256)
            results["memory"]["cpu"] = mon.result()
        if "throughput" in only:
            print(f"3. throughput: {rows} rows of 1 KiB, threads {threads}", flush=True)
            idle = wait_idle(args.wait_idle)
            mon = CpuMonitor()
            results["throughput"] = bench_throughput(rows, 256, 256, reps, threads)
            results["throughput"]["cpu"] = {"others_before": idle, **mon.result()}
    results["load_end"] = load_average()
    results["duration_s"] = time.time() - t_start

    report = render(results)
    print()
    print(report)
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    with open(out_prefix + ".md", "w") as f:
        f.write(report + "\n")
    with open(out_prefix + ".json", "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {out_prefix}.md and {out_prefix}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
