"""Every benchmark in one run: shareddata against its peers and against the machine's limits.

    python benchmarks/bench_suite.py                  # full run; writes docs/benchmarks.md,
                                                      # docs/img/bench-*.png, results/suite.json
    python benchmarks/bench_suite.py --quick --out-dir /tmp/suite   # smoke run, small sizes

Sections, each side by side in the same run, medians of ``--reps`` (>= 3):

- limits: memcpy bandwidth, first touch of fresh shared pages, raw gather
  (``index_select(out=)``) for random indices; every other figure is also given as
  a fraction of the limit that bounds it;
- throughput: samples/s against batch size and sample size, ``num_workers=0`` and 2,
  for shareddata (default collate, with and without its collate shortcut; the
  ``IndexBatchSampler`` fast path) and every peer, plus the per-batch IPC cost;
- memory: ``sd.verify`` duplication against ``num_workers`` (0, 1, 2, 4, 8) under
  fork, spawn and forkserver, each run in a fresh process;
- ttfb: time to the first batch with 2 spawn workers against dataset size;
- build: time and peak private memory to make each peer's shareable dataset;
- load: HDF5/Parquet/.npy loads, from ``bench_formats.py`` (run here, its own
  report kept as it is).

Peers: a Dataset over a numpy array, ``TensorDataset`` (plain and after
``share_memory_()``), a lazy h5py Dataset that opens the file in each worker,
Hugging Face ``datasets`` (Arrow memory map, ``with_format("torch")``) and
tensordict (``TensorDict.share_memory_()``, ``memmap_``). They come with
``pip install 'shareddata[bench]'``; one that is not installed is reported as such.
See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_foundation as bf  # noqa: E402  (the measurement helpers this suite reuses)

import shareddata as sd  # noqa: E402
from shareddata._columns import shared_empty  # noqa: E402
from shareddata._transport import worker_empty  # noqa: E402

MIB, GIB = bf.MIB, bf.GIB
MADV_POPULATE_WRITE = bf.MADV_POPULATE_WRITE

TARGETS = {
    "duplication_8_workers": 1.05,  # ours, every start method, at most
    "fast_path_of_raw": 0.5,  # fast path / raw gather, num_workers=0, at least
    "collate_vs_tensordataset_0": 1.2,  # default collate / TensorDataset, num_workers=0
    "collate_vs_tensordataset_2": 1.3,  # same with 2 workers
    "vs_hf_throughput": 10.0,  # ours / Hugging Face datasets, samples/s
    "ttfb_2gib_vs_1mib": 1.2,  # spawn time to first batch, 2 GiB / 1 MiB, at most
}

PEER_MODULES = {"h5py": "h5py", "datasets": "datasets", "tensordict": "tensordict"}
INSTALL_HINT = "pip install 'shareddata[bench]'"
QUICK_NOTE = ", QUICK smoke run: sizes too small for the figures to mean anything"


# --------------------------------------------------------------------------------------
# Configuration


@dataclass
class Config:
    """Sizes of every section (``--quick`` shrinks them all)."""

    quick: bool = False
    reps: int = 3
    limit_bytes: int = 256 * MIB
    sample_sizes: list[int] = field(default_factory=lambda: [1024, 16384])
    batch_sizes: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])
    throughput_bytes: int = 256 * MIB
    window_s: float = 0.4
    worker_batch: int = 256
    memory_bytes: int = 256 * MIB
    memory_row_bytes: int = 4096
    memory_workers: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    methods: list[str] = field(default_factory=lambda: ["fork", "spawn", "forkserver"])
    ttfb_sizes: list[int] = field(default_factory=lambda: [1 * MIB, 256 * MIB, 2 * GIB])
    ttfb_cases: list[str] | None = None  # None: every case
    build_methods: list[str] | None = None  # None: every method
    build_sizes: list[int] = field(default_factory=lambda: [256 * MIB, GIB])
    format_sizes: list[int] = field(default_factory=lambda: [256 * MIB, GIB])
    one_child: bool = False  # run all jobs of a section in one child process (quick)

    @classmethod
    def quick_config(cls) -> Config:
        """Small sizes and one repetition: checks that every part runs, not timings."""
        return cls(
            quick=True,
            reps=1,
            limit_bytes=16 * MIB,
            sample_sizes=[1024],
            batch_sizes=[64, 256],
            throughput_bytes=4 * MIB,
            window_s=0.03,
            memory_bytes=4 * MIB,
            memory_workers=[0, 1],
            methods=["fork"],
            ttfb_sizes=[MIB, 4 * MIB],
            ttfb_cases=["limit", "shareddata"],
            build_methods=["shareddata", "tensordict memmap", "HF datasets from Parquet"],
            build_sizes=[4 * MIB],
            format_sizes=[4 * MIB],
            one_child=True,
        )


# --------------------------------------------------------------------------------------
# Peers: what is installed, and one builder per case


def peer_status() -> dict[str, str]:
    """``{module: version}`` or ``{module: "not installed: ..."}`` for every optional peer."""
    status = {}
    for name, module in PEER_MODULES.items():
        try:
            mod = importlib.import_module(module)
            status[name] = f"{getattr(mod, '__version__', '?')}"
        except Exception as e:  # ImportError, or a broken install
            status[name] = f"not installed ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return status


def available(status: dict[str, str], needs: str | None) -> bool:
    """Whether the peer module ``needs`` (None: nothing) imported."""
    return needs is None or not status.get(needs, "").startswith("not installed")


def identity(batch: Any) -> Any:
    """collate_fn for datasets whose ``__getitems__`` returns a whole batch (tensordict)."""
    return batch


def stack_collate(batch: Sequence[Any]) -> Any:
    """Default collate without shareddata's shortcut: stacks the samples into a new batch.

    ``list(batch)`` is a plain list, so ``default_collate`` collates the samples one
    by one (what it did before the shortcut: the data is copied a second time).
    """
    return default_collate(list(batch))


class LazyH5Dataset(Dataset):
    """The usual lazy HDF5 Dataset: each process opens the file on first use, reads per sample."""

    def __init__(self, path: str, key: str = "data") -> None:
        import h5py

        self.path, self.key = path, key
        with h5py.File(path, "r") as f:
            self.n = len(f[key])
        self._pid = -1
        self._data: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._pid != os.getpid():  # a forked worker must not share the parent's handle
            import h5py

            self._data = h5py.File(self.path, "r")[self.key]
            self._pid = os.getpid()
        return torch.from_numpy(self._data[i])

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "key": self.key, "n": self.n, "_pid": -1, "_data": None}


class ReadyBatches(Dataset):
    """Returns a new batch of the right size without reading anything: the IPC floor.

    Used with :class:`sd.IndexBatchSampler` and ``batch_size=None``. In a worker the
    batch is allocated as a real batch would be: by torch in ``/dev/shm`` (what its
    default collate does, carried by torch's fd passing), or by shareddata in a memfd
    (``_transport.worker_empty``, what shareddata's datasets do). The time per batch
    in the main process is then the cost of carrying a batch out of a worker.
    """

    def __init__(self, rows: int, row_shape: tuple[int, ...], transport: str) -> None:
        self.rows, self.row_shape, self.transport = rows, row_shape, transport

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        from torch.utils.data import get_worker_info

        shape = (len(index), *self.row_shape)
        if get_worker_info() is None:
            return {"data": torch.empty(shape)}
        if self.transport == "torch":
            return {"data": shared_empty(shape, torch.float32)}
        return {"data": worker_empty(shape, torch.float32)}


IPC_CASES = {"IPC floor, torch /dev/shm": "torch", "IPC floor, shareddata memfd": "memfd"}


@dataclass(frozen=True)
class Case:
    """One way of serving the data: who, what it needs installed, how it is built."""

    name: str
    needs: str | None
    what: str  # one line for the report


CASES = [
    Case("shareddata", None, "`sd.NumpyDataset(path)`, default collate"),
    Case(
        "shareddata, no shortcut",
        None,
        "same, collated by stacking the samples (the collate path before the shortcut)",
    ),
    Case("shareddata fast path", None, "`IndexBatchSampler` + `batch_size=None`"),
    Case("numpy array", None, "a Dataset holding `np.load(path)`, one row per `__getitem__`"),
    Case("TensorDataset", None, "`TensorDataset(torch.from_numpy(np.load(path)))`"),
    Case("share_memory_()", None, "the same after `tensor.share_memory_()`"),
    Case("h5py lazy", "h5py", "opens the HDF5 file in each worker, reads one row per item"),
    Case("HF datasets", "datasets", "`Dataset.from_file(arrow).with_format('torch')` (memory map)"),
    Case(
        "tensordict shared",
        "tensordict",
        "`TensorDict(...).share_memory_()`, `collate_fn=identity`",
    ),
    Case(
        "tensordict memmap",
        "tensordict",
        "`TensorDict(...).memmap_(prefix)` (MemoryMappedTensor on disk), `collate_fn=identity`",
    ),
]
CASE = {c.name: c for c in CASES}
MEMORY_CASES = [
    "shareddata",
    "numpy array",
    "TensorDataset",
    "share_memory_()",
    "h5py lazy",
    "HF datasets",
    "tensordict shared",
    "tensordict memmap",
]
TTFB_CASES = ["limit", *MEMORY_CASES]
OURS = ("shareddata", "shareddata, no shortcut", "shareddata fast path")


@dataclass
class Files:
    """The same data in every format a case reads (float32 rows)."""

    npy: str
    h5: str | None
    arrow: str | None
    rows: int
    row_floats: int
    work_dir: str  # where a case may write (tensordict's memmap files)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_floats * 4


def write_files(tmp: str, tag: str, nbytes: int, row_bytes: int, status: dict[str, str]) -> Files:
    """Write ``nbytes`` of float32 rows as .npy, and as HDF5 / Arrow when those peers exist."""
    row_floats = row_bytes // 4
    npy = os.path.join(tmp, f"{tag}.npy")
    shape = bf.write_npy(npy, nbytes, row_floats)
    rows = shape[0]
    src = np.load(npy, mmap_mode="r")
    step = max(1, (64 * MIB) // row_bytes)
    h5 = arrow = None
    if available(status, "h5py"):
        import h5py

        h5 = os.path.join(tmp, f"{tag}.h5")
        with h5py.File(h5, "w") as f:
            d = f.create_dataset("data", shape=src.shape, dtype=np.float32)
            for a in range(0, rows, step):
                d[a : a + step] = src[a : a + step]
    if available(status, "datasets"):
        import pyarrow as pa

        arrow = os.path.join(tmp, f"{tag}.arrow")
        schema = pa.schema([("data", pa.list_(pa.float32(), row_floats))])
        with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for a in range(0, rows, step):
                block = np.ascontiguousarray(src[a : a + step])
                values = pa.array(block.reshape(-1))
                col = pa.FixedSizeListArray.from_arrays(values, row_floats)
                writer.write_batch(pa.record_batch([col], schema=schema))
    del src
    work = os.path.join(tmp, f"{tag}-work")
    os.makedirs(work, exist_ok=True)
    for path in (npy, h5, arrow):
        if path:
            bf.warm(path)
    return Files(npy, h5, arrow, rows, row_floats, work)


def build_case(name: str, files: Files, batch: int) -> tuple[Any, dict[str, Any]]:
    """The dataset of case ``name`` over ``files``, and the DataLoader arguments it needs.

    The loader arguments replace ``batch_size=batch, shuffle=True`` where the case
    uses its own sampler or collate function.
    """
    plain = {"batch_size": batch, "shuffle": True}
    if name == "limit":  # nothing to pickle: what starting the workers costs
        return TensorDataset(torch.zeros(batch, 1)), plain
    if name in OURS:
        ds = sd.NumpyDataset(files.npy, progress=False)
        if name == "shareddata fast path":
            return ds, {
                "sampler": sd.IndexBatchSampler(ds, batch, shuffle=True),
                "batch_size": None,
            }
        if name == "shareddata, no shortcut":
            return ds, {**plain, "collate_fn": stack_collate}
        return ds, plain
    if name == "numpy array":
        return bf.NumpyArrayDataset(files.npy), plain
    if name == "TensorDataset":
        return TensorDataset(torch.from_numpy(np.load(files.npy))), plain
    if name == "share_memory_()":
        return TensorDataset(torch.from_numpy(np.load(files.npy)).share_memory_()), plain
    if name == "h5py lazy":
        assert files.h5 is not None
        return LazyH5Dataset(files.h5), plain
    if name == "HF datasets":
        import datasets

        assert files.arrow is not None
        datasets.disable_progress_bars()
        return datasets.Dataset.from_file(files.arrow).with_format("torch"), plain
    if name in ("tensordict shared", "tensordict memmap"):
        from tensordict import TensorDict

        data = torch.from_numpy(np.load(files.npy))
        td = TensorDict({"data": data}, batch_size=[len(data)])
        if name == "tensordict shared":
            td = td.share_memory_()
        else:
            td = td.memmap_(prefix=tempfile.mkdtemp(dir=files.work_dir))
        del data
        return td, {**plain, "collate_fn": identity}
    raise ValueError(f"unknown case {name!r}")


def batch_len(batch: Any) -> int:
    """Samples in a batch of any case (tensor, dict, list, TensorDict)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


# --------------------------------------------------------------------------------------
# 1. Limits


def fresh_shared(nbytes: int) -> tuple[int, mmap.mmap]:
    """A new memfd of ``nbytes`` (no page touched yet), mapped shared."""
    fd = os.memfd_create("bench-suite", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def bench_limits(cfg: Config) -> dict[str, Any]:
    """memcpy, first touch of fresh shared pages (written by the CPU, or populated by the
    kernel), in GB/s; medians of ``cfg.reps`` (each the best of 3 back-to-back runs)."""
    n = cfg.limit_bytes
    src = torch.rand(n // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    default_threads = torch.get_num_threads()
    out: dict[str, list[float]] = {
        "memcpy, 1 thread": [],
        f"memcpy, {default_threads} threads": [],
        "first touch (write), 1 thread": [],
        "populate (MADV_POPULATE_WRITE)": [],
    }

    def best(fn: Callable[[], float]) -> float:
        return min(fn() for _ in range(3))

    def copy() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    def touch() -> float:
        fd, m = fresh_shared(n)
        try:
            arr = np.frombuffer(m, np.uint8)
            t0 = time.perf_counter()
            arr[...] = 1
            seconds = time.perf_counter() - t0
            del arr
        finally:
            m.close()
            os.close(fd)
        return seconds

    def populate() -> float:
        fd, m = fresh_shared(n)
        try:
            t0 = time.perf_counter()
            m.madvise(MADV_POPULATE_WRITE)
            return time.perf_counter() - t0
        finally:
            m.close()
            os.close(fd)

    try:
        for _ in range(cfg.reps):
            torch.set_num_threads(1)
            out["memcpy, 1 thread"].append(n / best(copy) / 1e9)
            torch.set_num_threads(default_threads)
            out[f"memcpy, {default_threads} threads"].append(n / best(copy) / 1e9)
            out["first touch (write), 1 thread"].append(n / best(touch) / 1e9)
            try:
                out["populate (MADV_POPULATE_WRITE)"].append(n / best(populate) / 1e9)
            except OSError:  # kernels before 5.14
                pass
    finally:
        torch.set_num_threads(default_threads)
    gbs = {k: bf.median(v) for k, v in out.items() if v}
    # Filling fresh shared memory from a source = first touch + copy, one after the other.
    fill = 1 / (1 / gbs["first touch (write), 1 thread"] + 1 / gbs["memcpy, 1 thread"])
    return {"nbytes": n, "gb_per_s": gbs, "runs": out, "fill_gb_per_s": fill}


# --------------------------------------------------------------------------------------
# 2. Throughput


class RawGather(bf.RawGather):
    """The gather limit over ``tensor`` (``index_select`` into one reused buffer)."""


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
        n += batch_len(batch)
        batches += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s and batches >= 5:
            return n / elapsed


def make_loader(
    name: str, files: Files, batch: int, workers: int, built: dict[str, Any]
) -> Iterable[Any]:
    """The DataLoader of a case (datasets are built once per data and reused)."""
    if name == "raw index_select(out=)":
        if "raw" not in built:
            built["raw"] = torch.from_numpy(np.load(files.npy))
        return RawGather(built["raw"], batch)
    if name in IPC_CASES:
        ds = ReadyBatches(files.rows, (files.row_floats,), IPC_CASES[name])
        kw: dict[str, Any] = {"sampler": sd.IndexBatchSampler(ds, batch), "batch_size": None}
    else:
        if name not in built:
            built[name] = build_case(name, files, batch)[0]
        ds = built[name]
        kw = build_kwargs(name, ds, batch)
    if workers:
        kw.update(num_workers=workers, persistent_workers=True, multiprocessing_context="fork")
    return DataLoader(ds, **kw)


def build_kwargs(name: str, ds: Any, batch: int) -> dict[str, Any]:
    """Loader arguments of a built case, for another batch size."""
    if name == "shareddata fast path":
        return {"sampler": sd.IndexBatchSampler(ds, batch, shuffle=True), "batch_size": None}
    kw: dict[str, Any] = {"batch_size": batch, "shuffle": True}
    if name == "shareddata, no shortcut":
        kw["collate_fn"] = stack_collate
    elif name.startswith("tensordict"):
        kw["collate_fn"] = identity
    return kw


THROUGHPUT_CASES = [
    "raw index_select(out=)",
    "shareddata fast path",
    "shareddata",
    "shareddata, no shortcut",
    "TensorDataset",
    "numpy array",
    "h5py lazy",
    "HF datasets",
    "tensordict shared",
    "tensordict memmap",
]


def bench_throughput(cfg: Config, tmp: str, status: dict[str, str]) -> dict[str, Any]:
    """samples/s per (sample size, batch size, workers, case); medians of ``cfg.reps``.

    ``num_workers=0`` over every batch size; 2 workers (fork, persistent) at
    ``cfg.worker_batch``, with the IPC floor. Repetitions are the outer loop so a
    burst of other work falls on every case alike.
    """
    results: dict[str, Any] = {"by_size": {}}
    for size in cfg.sample_sizes:
        files = write_files(tmp, f"tp-{size}", cfg.throughput_bytes, size, status)
        built: dict[str, Any] = {}
        grid = [(b, 0) for b in cfg.batch_sizes] + [(cfg.worker_batch, 2)]
        names = [n for n in THROUGHPUT_CASES if n not in CASE or available(status, CASE[n].needs)]
        rates: dict[str, dict[str, list[float]]] = {}
        errors: dict[str, str] = {}
        loaders: dict[tuple[str, int, int], Iterable[Any]] = {}
        mon = bf.CpuMonitor()
        try:
            for rep in range(cfg.reps):
                for batch, workers in grid:
                    point = f"{batch}/{workers}"
                    extra = list(IPC_CASES) if batch == cfg.worker_batch else []
                    for name in [*names, *extra]:
                        key = f"{name}|{point}"
                        if key in errors:
                            continue
                        try:
                            if (name, batch, workers) not in loaders:
                                loaders[name, batch, workers] = make_loader(
                                    name, files, batch, workers, built
                                )
                            rate = timed_rate(loaders[name, batch, workers], cfg.window_s)
                        except Exception as e:
                            errors[key] = f"{type(e).__name__}: {e}"
                            print(f"  throughput {size} B {key}: FAILED {errors[key]}", flush=True)
                            continue
                        rates.setdefault(key, []).append(rate)
                    print(
                        f"  throughput rep {rep + 1}/{cfg.reps}, {size} B rows, batch {batch}, "
                        f"workers {workers}: "
                        + ", ".join(
                            f"{k.split('|')[0]} {v[-1] / 1e6:.3f}M/s"
                            for k, v in rates.items()
                            if k.endswith(f"|{point}")
                        ),
                        flush=True,
                    )
        finally:
            for loader in loaders.values():  # stop persistent workers before the next size
                it = getattr(loader, "_iterator", None)
                if it is not None and hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
            loaders.clear()
            built.clear()
        results["by_size"][str(size)] = {
            "rows": files.rows,
            "median": {k: bf.median(v) for k, v in rates.items()},
            "runs": rates,
            "errors": errors,
            "cpu": mon.result(),
        }
        for path in (files.npy, files.h5, files.arrow):
            if path:
                os.unlink(path)
        shutil.rmtree(files.work_dir, ignore_errors=True)
    results["pin_memory"] = pin_memory_note()
    return results


def pin_memory_note() -> str:
    """Whether ``pin_memory=True`` can be measured here (it needs an accelerator)."""
    if torch.cuda.is_available():
        return "measurable"
    return (
        "not measurable on this machine: torch has no accelerator here and turns "
        "`pin_memory=True` off (with a warning); the fast path returns plain dicts of "
        "tensors, which the pin-memory thread pins as they are"
    )


# --------------------------------------------------------------------------------------
# 3. Memory (fresh processes)


def child_memory(jobs: list[dict[str, Any]]) -> None:
    """Child: for each job, build the case and ``sd.verify`` it at each worker count."""
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    warnings.filterwarnings("ignore", message=".*This DataLoader will create.*")
    for job in jobs:
        files = Files(**job["files"])
        try:
            ds, kw = build_case(job["case"], files, job["batch"])
            for workers in job["workers"]:
                context = job["method"] if workers else None
                loader = DataLoader(ds, num_workers=workers, multiprocessing_context=context, **kw)
                t0 = time.perf_counter()
                report = sd.verify(loader, max_duplication=None, dataset_bytes=files.nbytes)
                out = report.to_dict()
                out.pop("processes", None)
                bf.emit(
                    {
                        "job": job["id"],
                        "workers": workers,
                        "seconds": time.perf_counter() - t0,
                        **out,
                    }
                )
                del loader, report
            del ds, kw
        except Exception as e:
            bf.emit({"job": job["id"], "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()


def run_jobs(kind: str, jobs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Run ``jobs`` in one child of this script; every JSON line it prints is a result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, json.dumps(jobs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return [{"job": j["id"], "error": f"timed out after {timeout:.0f} s"} for j in jobs]
    results = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                results.append(json.loads(line))
    if proc.returncode != 0:
        done = {r["job"] for r in results}
        for j in jobs:
            if j["id"] not in done:
                results.append(
                    {
                        "job": j["id"],
                        "error": f"child exited {proc.returncode}: {proc.stderr[-800:]}",
                    }
                )
    return results


def bench_memory(cfg: Config, tmp: str, status: dict[str, str]) -> dict[str, Any]:
    """``sd.verify`` duplication per (case, start method, workers).

    Each (case, method, repetition) is a fresh process that builds the case once and
    verifies one full epoch at each worker count in turn: every count in the first
    repetition, the largest (the target's) in every repetition, so its figure is a
    median of ``cfg.reps`` (the others vary by < 1% between runs and would double
    the section's ~10 minutes).
    """
    files = write_files(tmp, "memory", cfg.memory_bytes, cfg.memory_row_bytes, status)
    cases = [c for c in MEMORY_CASES if available(status, CASE[c].needs)]
    jobs = [
        {
            "id": f"{case}|{method}|{rep}",
            "case": case,
            "method": method,
            # every worker count once; the target's (the most workers) every repetition
            "workers": cfg.memory_workers if rep == 0 else [max(cfg.memory_workers)],
            "batch": 256,
            "files": asdict(files),
        }
        for rep in range(cfg.reps)
        for method in cfg.methods
        for case in cases
    ]
    mon = bf.CpuMonitor()
    results: list[dict[str, Any]] = []
    groups = [jobs] if cfg.one_child else [[j] for j in jobs]
    for group in groups:
        for r in run_jobs("memory", group, timeout=1800):
            results.append(r)
            if "error" in r:
                print(f"  memory {r['job']}: FAILED {r['error'][:300]}", flush=True)
            else:
                print(
                    f"  memory {r['job']} workers={r['workers']}: {r['duplication']:.3f}x "
                    f"({r['seconds']:.1f} s)",
                    flush=True,
                )
    table: dict[str, dict[str, dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for r in results:
        case, method, _ = r["job"].split("|")
        if "error" in r:
            errors[f"{case}|{method}"] = r["error"]
            continue
        cell = table.setdefault(case, {}).setdefault(method, {}).setdefault(str(r["workers"]), [])
        cell.append(r)
    summary = {
        case: {
            method: {
                w: {
                    "duplication": bf.median(x["duplication"] for x in rs),
                    "extra_mib": bf.median(x["extra_bytes"] for x in rs) / MIB,
                    "baseline_mib": bf.median(x["baseline_bytes"] for x in rs) / MIB,
                    "n": len(rs),
                }
                for w, rs in by_w.items()
            }
            for method, by_w in by_m.items()
        }
        for case, by_m in table.items()
    }
    os.unlink(files.npy)
    for path in (files.h5, files.arrow):
        if path:
            os.unlink(path)
    shutil.rmtree(files.work_dir, ignore_errors=True)
    return {
        "nbytes": files.nbytes,
        "row_bytes": cfg.memory_row_bytes,
        "summary": summary,
        "errors": errors,
        "cpu": mon.result(),
    }


# --------------------------------------------------------------------------------------
# 4. Spawn time to first batch


def child_ttfb(jobs: list[dict[str, Any]]) -> None:
    """Child: build each case, then time ``next(iter(loader))`` with 2 spawn workers."""
    warnings.filterwarnings("ignore", message=".*This DataLoader will create.*")
    for job in jobs:
        files = Files(**job["files"])
        try:
            t0 = time.perf_counter()
            ds, kw = build_case(job["case"], files, job["batch"])
            build_s = time.perf_counter() - t0
            times = []
            for _ in range(job["reps"]):
                loader = DataLoader(ds, num_workers=2, multiprocessing_context="spawn", **kw)
                t0 = time.perf_counter()
                it = iter(loader)
                next(it)
                times.append(time.perf_counter() - t0)
                it._shutdown_workers()  # type: ignore[attr-defined]
                del it, loader
            bf.emit({"job": job["id"], "build_s": build_s, "seconds": times})
            del ds, kw
        except Exception as e:
            bf.emit({"job": job["id"], "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()


def bench_ttfb(cfg: Config, tmp: str, status: dict[str, str]) -> dict[str, Any]:
    """Time to the first batch of a new epoch, 2 spawn workers, per case and dataset size.

    One fresh process per (case, size) builds the dataset, then starts ``cfg.reps``
    epochs (new workers each, as without ``persistent_workers``).
    """
    names = cfg.ttfb_cases or TTFB_CASES
    names = [c for c in names if c == "limit" or available(status, CASE[c].needs)]
    out: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    mon = bf.CpuMonitor()
    all_files = [write_files(tmp, f"ttfb-{size}", size, 4096, status) for size in cfg.ttfb_sizes]
    jobs = [
        {
            "id": f"{case}|{files.nbytes}",
            "case": case,
            "batch": 256,
            "reps": cfg.reps,
            "files": asdict(files),
        }
        for files in all_files
        for case in names
    ]
    groups = [jobs] if cfg.one_child else [[j] for j in jobs]
    for group in groups:
        for r in run_jobs("ttfb", group, timeout=1800):
            case, size = r["job"].split("|")
            if "error" in r:
                errors[r["job"]] = r["error"]
                print(f"  ttfb {r['job']}: FAILED {r['error'][:300]}", flush=True)
                continue
            out.setdefault(case, {})[size] = {
                "median_s": bf.median(r["seconds"]),
                "first_s": r["seconds"][0],
                "runs": r["seconds"],
                "build_s": r["build_s"],
            }
            print(
                f"  ttfb {case} {int(size) / MIB:.0f} MiB: "
                + ", ".join(f"{x:.2f}" for x in r["seconds"])
                + " s",
                flush=True,
            )
    for files in all_files:
        for path in (files.npy, files.h5, files.arrow):
            if path:
                os.unlink(path)
        shutil.rmtree(files.work_dir, ignore_errors=True)
    return {"by_case": out, "errors": errors, "cpu": mon.result()}


# --------------------------------------------------------------------------------------
# 5. Build: time and peak private memory to make each peer's shareable dataset


BUILD_METHODS: list[tuple[str, str | None, str]] = [
    ("shareddata", None, "`sd.NumpyDataset(npy)`"),
    ("naive share_memory_()", None, "`torch.from_numpy(np.load(npy)).share_memory_()`"),
    ("tensordict shared", "tensordict", "`TensorDict(np.load(npy)).share_memory_()`"),
    ("tensordict memmap", "tensordict", "`TensorDict(np.load(npy)).memmap_(prefix)` (disk)"),
    ("shareddata from Parquet", None, "`sd.ParquetDataset(parquet)`"),
    ("HF datasets from Parquet", "datasets", "`Dataset.from_parquet(parquet)` (to Arrow cache)"),
]


def child_build(method: str, spec: str) -> None:
    """Child (``measure_load`` protocol): build ``method`` from the files in ``spec``."""
    files = json.loads(spec)
    import gc

    if method.startswith("HF"):
        import datasets

        datasets.disable_progress_bars()
    if method.startswith("tensordict"):
        import tensordict  # noqa: F401
    if "Parquet" in method:
        import pyarrow.parquet  # noqa: F401
    gc.collect()
    bf.emit({"rss": bf.proc_fields(os.getpid(), "status")["VmRSS"]})
    sys.stdin.readline()
    t0 = time.perf_counter()
    keep: Any
    if method == "shareddata":
        keep = sd.NumpyDataset(files["npy"], progress=False)
    elif method == "naive share_memory_()":
        keep = torch.from_numpy(np.load(files["npy"])).share_memory_()
    elif method.startswith("tensordict"):
        from tensordict import TensorDict

        data = torch.from_numpy(np.load(files["npy"]))
        td = TensorDict({"data": data}, batch_size=[len(data)])
        del data
        if method == "tensordict shared":
            keep = td.share_memory_()
        else:
            keep = td.memmap_(prefix=tempfile.mkdtemp(dir=files["work"]))
        del td
    elif method == "shareddata from Parquet":
        keep = sd.ParquetDataset(files["parquet"], progress=False)
    elif method == "HF datasets from Parquet":
        import datasets

        keep = datasets.Dataset.from_parquet(
            files["parquet"], cache_dir=tempfile.mkdtemp(dir=files["work"]), keep_in_memory=False
        )
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - t0
    bf.emit({"seconds": seconds, "parts": {}})
    sys.stdin.readline()
    del keep


def write_parquet(path: str, npy: str) -> None:
    """The rows of ``npy`` as a Parquet fixed-size-list column ``data``, 16384-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = np.load(npy, mmap_mode="r")
    schema = pa.schema([("data", pa.list_(pa.float32(), src.shape[1]))])
    with pq.ParquetWriter(path, schema) as writer:
        for a in range(0, len(src), 16384):
            block = np.ascontiguousarray(src[a : a + 16384])
            col = pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), src.shape[1])
            writer.write_table(pa.table({"data": col}))
    bf.warm(path)


def bench_build(cfg: Config, tmp: str, status: dict[str, str]) -> dict[str, Any]:
    """Each method in a fresh process per repetition, sampled by ``bf.measure_load``."""
    out: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    mon = bf.CpuMonitor()
    for size in cfg.build_sizes:
        npy = os.path.join(tmp, f"build-{size}.npy")
        bf.write_npy(npy, size, 1024)
        bf.warm(npy)
        parquet = os.path.join(tmp, f"build-{size}.parquet")
        write_parquet(parquet, npy)
        work = os.path.join(tmp, f"build-{size}-work")
        os.makedirs(work, exist_ok=True)
        spec = json.dumps({"npy": npy, "parquet": parquet, "work": work})
        nbytes = int(np.load(npy, mmap_mode="r").nbytes)
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(cfg.reps):
            for method, needs, _ in BUILD_METHODS:
                if cfg.build_methods is not None and method not in cfg.build_methods:
                    continue
                if not available(status, needs) or f"{method}|{size}" in errors:
                    continue
                try:
                    r = bf.measure_load(method, spec, script=__file__)
                except Exception as e:
                    errors[f"{method}|{size}"] = f"{type(e).__name__}: {e}"
                    print(f"  build {method} {size}: FAILED {e}", flush=True)
                    continue
                runs.setdefault(method, []).append(r)
                print(
                    f"  build rep {rep + 1}/{cfg.reps} {nbytes / MIB:.0f} MiB {method}: "
                    f"{r['seconds']:.3f} s, peak private {r['peak_private'] / MIB:.1f} MiB",
                    flush=True,
                )
                for name in os.listdir(work):  # tensordict / HF files of this run
                    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
        out[str(nbytes)] = {
            m: {
                "seconds": bf.median(r["seconds"] for r in rs),
                "peak_private": bf.median(r["peak_private"] for r in rs),
                "retained_private": bf.median(r["retained_private"] for r in rs),
                "runs": [r["seconds"] for r in rs],
            }
            for m, rs in runs.items()
        }
        for path in (npy, parquet):
            os.unlink(path)
        shutil.rmtree(work, ignore_errors=True)
    return {"by_size": out, "errors": errors, "cpu": mon.result()}


# --------------------------------------------------------------------------------------
# 6. Format loads: bench_formats.py


def _formats() -> Any:
    import bench_formats

    return bench_formats


def bench_load(cfg: Config, tmp: str) -> dict[str, Any]:
    """HDF5/Parquet(/npy) loads per size from ``bench_formats`` (its function, else its script).

    The script is run from a copy in ``tmp`` so that its own result files
    (``benchmarks/results/formats.*``) are left as they are.
    """
    out: dict[str, Any] = {}
    bench_formats = _formats()
    run = getattr(bench_formats, "run", None)
    for size in cfg.format_sizes:
        label = f"{size // MIB}MiB"
        try:
            if callable(run):
                # the full run's 1 GiB loads are also bench_formats' own results
                results = os.path.join(REPO, "benchmarks", "results")
                keep = results if size == GIB and not cfg.quick else None
                out[str(size)] = run(size=size, repeats=cfg.reps, tmp_dir=tmp, out=keep)
            else:
                copy_dir = os.path.join(tmp, f"formats-{label}")
                os.makedirs(copy_dir, exist_ok=True)
                script = os.path.join(copy_dir, "bench_formats.py")
                shutil.copy(bench_formats.__file__, script)
                env = {**os.environ, "PYTHONPATH": REPO}
                proc = subprocess.run(
                    [sys.executable, script, "--size", label, "--repeats", str(cfg.reps)],
                    capture_output=True,
                    text=True,
                    timeout=3600,
                    env=env,
                    check=False,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"bench_formats.py failed: {proc.stderr[-800:]}")
                with open(os.path.join(copy_dir, "results", "formats.json")) as f:
                    out[str(size)] = json.load(f)
                shutil.rmtree(copy_dir, ignore_errors=True)
            print(f"  load {label}: done", flush=True)
        except Exception as e:
            out[str(size)] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  load {label}: FAILED {e}", flush=True)
    return {"by_size": out, "source": "run()" if callable(run) else "script"}


# --------------------------------------------------------------------------------------
# 7. Analyses from bench_foundation: per-step costs and CPU contention (full runs only)


def bench_analysis(cfg: Config) -> dict[str, Any]:
    """Per-batch cost of each step, and the gather under CPU contention (1 KiB rows)."""
    rows = max(1024, cfg.throughput_bytes // 1024)
    array = np.random.default_rng(0).random((rows, 256), dtype=np.float32)
    tensor = torch.from_numpy(array)
    ds = sd.NumpyDataset(array, progress=False)
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    steps = {str(t): bf.profile_collate_path(ds, tensor, 256, t) for t in threads}
    contention = bf.contention_probe(ds, tensor, 256, threads)
    return {"per_batch_us": steps, "contention": contention}


# --------------------------------------------------------------------------------------
# Report


def fmt_rate(x: float | None) -> str:
    """Samples/s in M with 3 decimals (or a dash)."""
    return "-" if x is None or math.isnan(x) else f"{x / 1e6:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fx(x: float | None, digits: int = 2) -> str:
    """A ratio as ``1.23x``."""
    return "-" if x is None else f"{x:.{digits}f}x"


@dataclass
class Target:
    """One target of the issue, with its measured value."""

    what: str
    value: float | None
    goal: float
    at_least: bool
    limit: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.goal if self.at_least else self.value <= self.goal

    def verdict(self) -> str:
        if self.met is None:
            return "not measured"
        if self.met:
            return "met"
        off = self.goal / self.value if self.at_least else self.value / self.goal
        return f"**missed** by {off:.2f}x"

    def row(self) -> list[str]:
        sign = ">=" if self.at_least else "<="
        return [self.what, fx(self.value), f"{sign} {self.goal}x", self.verdict(), self.limit]


def throughput_at(res: dict[str, Any], size: int, case: str, batch: int, workers: int) -> Any:
    """Median samples/s of one point, or None."""
    by = res["by_size"].get(str(size))
    if by is None:
        return None
    return by["median"].get(f"{case}|{batch}/{workers}")


def targets(results: dict[str, Any], cfg: Config) -> list[Target]:
    """Every target of the issue that this run measured (load targets: bench_formats)."""
    out: list[Target] = []
    mem = results.get("memory")
    if mem:
        top = str(max(cfg.memory_workers))
        ours = mem["summary"].get("shareddata", {})
        for method in cfg.methods:
            cell = ours.get(method, {}).get(top)
            peers = [
                (c, by[method][top]["duplication"])
                for c, by in mem["summary"].items()
                if c != "shareddata" and method in by and top in by[method]
            ]
            lowest = min(peers, key=lambda p: p[1]) if peers else None
            out.append(
                Target(
                    f"memory, {top} workers, {method}",
                    cell["duplication"] if cell else None,
                    TARGETS["duplication_8_workers"],
                    at_least=False,
                    limit="1.00x (one copy); lowest peer: "
                    + (f"{lowest[0]} {lowest[1]:.3f}x" if lowest else "-"),
                )
            )
    tp = results.get("throughput")
    if tp:
        b = cfg.worker_batch
        for size in cfg.sample_sizes:
            raw = throughput_at(tp, size, "raw index_select(out=)", b, 0)
            fast = throughput_at(tp, size, "shareddata fast path", b, 0)
            out.append(
                Target(
                    f"fast path / raw gather, {size // 1024} KiB, batch {b}, 0 workers",
                    ratio(fast, raw),
                    TARGETS["fast_path_of_raw"],
                    at_least=True,
                    limit=f"raw gather {fmt_rate(raw)} M samples/s",
                )
            )
            for workers, goal in (
                (0, "collate_vs_tensordataset_0"),
                (2, "collate_vs_tensordataset_2"),
            ):
                ours = throughput_at(tp, size, "shareddata", b, workers)
                tds = throughput_at(tp, size, "TensorDataset", b, workers)
                peers = {
                    c: throughput_at(tp, size, c, b, workers)
                    for c in THROUGHPUT_CASES
                    if c not in OURS and not c.startswith("raw")
                }
                best = max(((v, c) for c, v in peers.items() if v), default=None)
                limit = f"best peer {best[1]} {fmt_rate(best[0])} M/s" if best else ""
                for label, key in (
                    ("torch", "IPC floor, torch /dev/shm"),
                    ("ours", "IPC floor, shareddata memfd"),
                ):
                    ipc = throughput_at(tp, size, key, b, workers) if workers else None
                    if ipc:
                        limit += f"; IPC floor ({label}) {b / ipc * 1e6:.0f} us/batch"
                out.append(
                    Target(
                        f"default collate / TensorDataset, {size // 1024} KiB, {workers} workers",
                        ratio(ours, tds),
                        TARGETS[goal],
                        at_least=True,
                        limit=limit,
                    )
                )
                fast = throughput_at(tp, size, "shareddata fast path", b, workers)
                top = max((v, c) for c, v in (("default collate", ours), ("fast path", fast)) if v)
                if best and top:
                    out.append(
                        Target(
                            f"shareddata {top[1]} / best peer ({best[1]}), {size // 1024} KiB, "
                            f"{workers} workers",
                            ratio(top[0], best[0]),
                            1.0,
                            at_least=True,
                        )
                    )
            hf = throughput_at(tp, size, "HF datasets", b, 2)
            paths = [
                throughput_at(tp, size, c, b, 2) for c in ("shareddata", "shareddata fast path")
            ]
            ours2 = max((v for v in paths if v), default=None)
            if hf:
                out.append(
                    Target(
                        f"best shareddata path / HF datasets, {size // 1024} KiB, 2 workers",
                        ratio(ours2, hf),
                        TARGETS["vs_hf_throughput"],
                        at_least=True,
                        limit=f"HF {fmt_rate(hf)} M/s",
                    )
                )
    ttfb = results.get("ttfb")
    if ttfb:
        ours = ttfb["by_case"].get("shareddata", {})
        if ours:
            sizes = sorted(ours, key=int)
            small, big = ours[sizes[0]], ours[sizes[-1]]
            limit = ttfb["by_case"].get("limit", {})
            lim = next(iter(limit.values()), None)
            out.append(
                Target(
                    f"spawn time to first batch, {int(sizes[-1]) / MIB:.0f} MiB / "
                    f"{int(sizes[0]) / MIB:.0f} MiB",
                    big["median_s"] / small["median_s"],
                    TARGETS["ttfb_2gib_vs_1mib"],
                    at_least=False,
                    limit=f"workers' start alone: {lim['median_s']:.2f} s" if lim else "",
                )
            )
    build = results.get("build")
    if build and build["by_size"]:
        size = max(build["by_size"], key=int)
        row = build["by_size"][size]
        if "shareddata" in row and "tensordict memmap" in row:
            out.append(
                Target(
                    f"build time, shareddata / tensordict memmap, {int(size) / MIB:.0f} MiB",
                    row["shareddata"]["seconds"] / row["tensordict memmap"]["seconds"],
                    1.0,
                    at_least=False,
                )
            )
    return out


def render(results: dict[str, Any], cfg: Config) -> str:
    """The Markdown page (docs/benchmarks.md)."""
    info = results["machine"]
    status = results["peers"]
    lines = [
        "# Benchmarks",
        "",
        "Every figure on this page comes from one run of `python benchmarks/bench_suite.py` "
        f"({results['started']}, {results['duration_s'] / 60:.1f} min"
        f"{QUICK_NOTE if cfg.quick else ''}"
        f"), side by side with its peers and the machine's limits; medians of {cfg.reps} "
        "repetition(s). Raw data with every repetition: "
        f"`{os.path.relpath(results['json_path'], REPO)}`."
        " How each figure is measured: `benchmarks/README.md`.",
        "",
        bf.table(
            ["machine", ""],
            [
                ["cores", f"{info['cores']} ({info['cores_usable']} usable), {info['cpu']}"],
                ["RAM", f"{info['ram_gib']} GiB"],
                ["kernel / THP (shmem)", f"{info['kernel']} / {info['thp_shmem']}"],
                ["python / torch / numpy", f"{info['python']} / {info['torch']} / {info['numpy']}"],
                ["torch threads (default)", info["torch_threads"]],
                ["shareddata", f"{info['shareddata']} (commit {info['commit']})"],
                *[[f"peer: {k}", v] for k, v in status.items()],
                ["load average at start / end", f"{results['load_start']} / {results['load_end']}"],
            ],
        ),
        "",
    ]
    tg = targets(results, cfg)
    if tg:
        lines += [
            "## Targets",
            "",
            "Each target of the performance issue, measured in this run (the load-speed "
            "targets are `bench_formats.py`'s, in its section below).",
            "",
            bf.table(
                ["target", "measured", "goal", "verdict", "limit / context"], [t.row() for t in tg]
            ),
            "",
        ]
    if "limits" in results:
        lim = results["limits"]
        lines += [
            "## The machine's limits",
            "",
            f"{lim['nbytes'] / MIB:.0f} MiB buffers, GB/s (10^9 bytes). First touch = writing "
            "every byte of a new memfd mapping (page faults + zeroing + the write); populate = "
            "the kernel faulting the pages in (`MADV_POPULATE_WRITE`). Filling fresh shared "
            f"memory from a source runs at most at 1 / (1/first touch + 1/memcpy) = "
            f"{lim['fill_gb_per_s']:.2f} GB/s. The raw gather limit is in the throughput "
            "tables (`raw index_select(out=)`).",
            "",
            bf.table(["limit", "GB/s"], [[k, f"{v:.2f}"] for k, v in lim["gb_per_s"].items()]),
            "",
        ]
    if "throughput" in results:
        lines += render_throughput(results["throughput"], cfg, status)
    if "memory" in results:
        lines += render_memory(results["memory"], cfg)
    if "ttfb" in results:
        lines += render_ttfb(results["ttfb"])
    if "build" in results:
        lines += render_build(results["build"], results.get("limits"))
    if "load" in results:
        lines += render_load(results["load"], results.get("limits"))
    if "analysis" in results:
        lines += render_analysis(results["analysis"])
    if results.get("plots"):
        lines += ["## Plots", ""]
        lines += [f"![{name}](img/{os.path.basename(p)})" for name, p in results["plots"].items()]
        lines += [""]
    return "\n".join(lines)


def unavailable_rows(status: dict[str, str], names: Iterable[str], width: int) -> list[list[str]]:
    """One row per case whose peer is not installed, saying so."""
    rows = []
    for name in names:
        case = CASE.get(name)
        if case and not available(status, case.needs):
            rows.append([name, f"not installed: {INSTALL_HINT}", *[""] * (width - 2)])
    return rows


def render_throughput(tp: dict[str, Any], cfg: Config, status: dict[str, str]) -> list[str]:
    """Throughput tables, one per sample size."""
    b = cfg.worker_batch
    lines = [
        "## Batch throughput",
        "",
        "Samples/s (millions) of `DataLoader(ds, batch_size=B, shuffle=True)` (or the case's own "
        f"sampler/collate), timed over >= {cfg.window_s} s per point after 2 warm-up batches, "
        "across epochs; fraction of the raw gather (`index_select(out=)` into one reused "
        "buffer, same rows, same batch size) in brackets. `num_workers=0` at torch's default "
        "threads; 2 workers: `multiprocessing_context='fork'`, `persistent_workers=True`, "
        f"batch {b}. "
        "Cases: "
        + "; ".join(f"**{c.name}**: {c.what}" for c in CASES if c.name in THROUGHPUT_CASES)
        + ".",
        "",
    ]
    for size, res in tp["by_size"].items():
        med = res["median"]
        header = ["case", *[f"B={x}" for x in cfg.batch_sizes], f"B={b}, 2 workers"]
        rows = []
        for name in THROUGHPUT_CASES:
            if name in CASE and not available(status, CASE[name].needs):
                continue
            row = [name]
            for batch, workers in [(x, 0) for x in cfg.batch_sizes] + [(b, 2)]:
                v = med.get(f"{name}|{batch}/{workers}")
                raw = med.get(f"raw index_select(out=)|{batch}/0")
                err = res["errors"].get(f"{name}|{batch}/{workers}")
                if err:
                    row.append(f"failed: {err[:60]}")
                elif v is None:
                    row.append("-")
                elif name.startswith("raw"):
                    row.append(fmt_rate(v))
                else:
                    row.append(f"{fmt_rate(v)} ({v / raw:.0%})" if raw else fmt_rate(v))
            rows.append(row)
        rows += unavailable_rows(status, THROUGHPUT_CASES, len(header))
        ipc0 = med.get(f"IPC floor, shareddata memfd|{b}/0")
        ipc_torch = med.get(f"IPC floor, torch /dev/shm|{b}/2")
        ipc2 = med.get(f"IPC floor, shareddata memfd|{b}/2")
        lines += [
            f"### {int(size) // 1024} KiB samples ({res['rows']} rows, "
            f"{res['rows'] * int(size) / MIB:.0f} MiB)",
            "",
            bf.table(header, rows),
            "",
        ]
        if ipc2 and ipc_torch and ipc0:
            per = {
                n: med.get(f"{n}|{b}/2")
                for n in ("shareddata", "shareddata, no shortcut", "TensorDataset")
            }
            lines += [
                f"Per-batch IPC cost (batch {b}, 2 workers): a loader whose workers return a new "
                "batch without reading anything delivers one every "
                f"{b / ipc_torch * 1e6:.0f} us when torch carries it (a `/dev/shm` segment, its "
                f"fd fetched from the worker), {b / ipc2 * 1e6:.0f} us in shareddata's memfd "
                "(Note [How a batch leaves a worker]); without workers, "
                f"{b / ipc0 * 1e6:.0f} us. Per batch with 2 workers: "
                + ", ".join(f"{n} {b / v * 1e6:.0f} us" for n, v in per.items() if v)
                + ".",
                "",
            ]
        spread = []
        for name in (
            "raw index_select(out=)",
            "shareddata fast path",
            "shareddata",
            "TensorDataset",
        ):
            runs = res["runs"].get(f"{name}|{b}/0")
            if runs:
                spread.append(f"{name} " + " / ".join(fmt_rate(x) for x in runs))
        unsteady = [
            k.split("|")[0]
            for k, runs in res["runs"].items()
            if len(runs) > 1 and min(runs) > 0 and max(runs) / min(runs) > 3
        ]
        lines += [
            f"Every repetition at B={b}, 0 workers (M samples/s): " + "; ".join(spread) + ". "
            f"Other processes used {res['cpu']['others_cores']:.2f} cores on average meanwhile."
            + (
                " Repetitions of some points differ by more than 3x ("
                + ", ".join(sorted(set(unsteady)))
                + "): other work took the cores, and every case that gathers with a "
                "multi-threaded `index_select` (the raw limit, shareddata, tensordict) stalls "
                "while torch's second thread waits for a core (see the contention probe "
                "below); per-sample indexing (`TensorDataset`, numpy, h5py) does not. The "
                "medians of those points measure the machine, not the code."
                if unsteady
                else ""
            ),
            "",
        ]
    lines += [f"`pin_memory=True`: {tp['pin_memory']}.", ""]
    return lines


def render_memory(mem: dict[str, Any], cfg: Config) -> list[str]:
    """Duplication tables, one per start method."""
    lines = [
        "## Memory against workers",
        "",
        f"{mem['nbytes'] / MIB:.0f} MiB of float32 rows of {mem['row_bytes']} B, batch 256, "
        "one full epoch, `sd.verify(loader, max_duplication=None).duplication`: the PSS "
        "(without file-backed pages) of the main process and every worker after the last "
        "batch, net of each worker's interpreter baseline, over the data size. 1.00x = the "
        "data is in RAM once. Data that a case reads from files (h5py, HF datasets' Arrow "
        "memory map, tensordict's memmap) stays in the page cache, once, and is not counted: "
        "those read as ~0-1x. Each (case, start method, repetition) is a fresh process that "
        "verifies each worker count in turn; the largest worker count is a median of "
        f"{cfg.reps} repetitions, the others one run each.",
        "",
    ]
    for method in cfg.methods:
        rows = []
        for case in MEMORY_CASES:
            by = mem["summary"].get(case, {}).get(method)
            err = mem["errors"].get(f"{case}|{method}")
            if by is None:
                rows.append(
                    [
                        case,
                        f"failed: {err[:80]}" if err else "-",
                        *[""] * (len(cfg.memory_workers) - 1),
                    ]
                )
                continue
            rows.append(
                [case, *[fx(by.get(str(w), {}).get("duplication"), 3) for w in cfg.memory_workers]]
            )
        lines += [
            f"### {method}",
            "",
            bf.table(["case", *[f"{w} workers" for w in cfg.memory_workers]], rows),
            "",
        ]
    lines += [
        f"Other processes used {mem['cpu']['others_cores']:.2f} cores on average meanwhile.",
        "",
    ]
    return lines


def render_ttfb(tt: dict[str, Any]) -> list[str]:
    """Spawn time-to-first-batch table."""
    sizes = sorted({s for by in tt["by_case"].values() for s in by}, key=int)
    rows = []
    for case in TTFB_CASES:
        by = tt["by_case"].get(case)
        if not by:
            errs = [e for k, e in tt["errors"].items() if k.startswith(case + "|")]
            if errs:
                rows.append([case, f"failed: {errs[0][:80]}", *[""] * (len(sizes) - 1)])
            continue
        rows.append(
            [
                case,
                *[
                    f"{by[s]['median_s']:.2f} (first {by[s]['first_s']:.2f})" if s in by else "-"
                    for s in sizes
                ],
            ]
        )
    return [
        "## Spawn time to first batch",
        "",
        "Seconds from `iter(DataLoader(ds, batch_size=256, num_workers=2, "
        "multiprocessing_context='spawn'))` to its first batch: median of the epochs "
        "(each starts new workers), the first epoch in brackets. `limit` = a dataset of "
        "nothing (the workers' start alone).",
        "",
        bf.table(["case", *[f"{int(s) / MIB:.0f} MiB" for s in sizes]], rows),
        "",
    ]


def render_build(bd: dict[str, Any], lim: dict[str, Any] | None) -> list[str]:
    """Build time / peak private memory per method and size."""
    lines = [
        "## Building a shareable dataset",
        "",
        "Each method in a fresh process, from a warm page cache; peak private memory = "
        "`RssAnon` sampled every ~1 ms (bench_foundation's sampler), minus its value before. "
        + (
            f"GB/s as a fraction of the fill limit ({lim['fill_gb_per_s']:.2f} GB/s, see limits)."
            if lim
            else ""
        ),
        "",
    ]
    for size, row in bd["by_size"].items():
        n = int(size)
        rows = []
        for method, _, what in BUILD_METHODS:
            r = row.get(method)
            err = bd["errors"].get(f"{method}|{n}")
            if r is None:
                rows.append([method, what, f"failed: {err[:60]}" if err else "-", "", "", ""])
                continue
            gbs = n / r["seconds"] / 1e9
            rows.append(
                [
                    method,
                    what,
                    f"{r['seconds']:.3f}",
                    f"{gbs:.2f}" + (f" ({gbs / lim['fill_gb_per_s']:.0%})" if lim else ""),
                    f"{r['peak_private'] / n:.2f}",
                    f"{r['retained_private'] / n:.2f}",
                ]
            )
        lines += [
            f"### {n / MIB:.0f} MiB",
            "",
            bf.table(
                [
                    "method",
                    "",
                    "s",
                    "GB/s (of limit)",
                    "peak private / data",
                    "private after / data",
                ],
                rows,
            ),
            "",
        ]
    return lines


def render_load(ld: dict[str, Any], lim: dict[str, Any] | None = None) -> list[str]:
    """bench_formats' figures per size (GB/s also as a fraction of the fill limit)."""
    lines = [
        "## Format loads (bench_formats.py)",
        "",
        "From `benchmarks/bench_formats.py` run inside this suite: each load in a fresh "
        "process, warm page cache; ratios ours / the format's own fastest read into private "
        "memory. Its targets: `.npy` and contiguous HDF5 >= 0.8x the first-touch + copy limit "
        "and <= 1.2x `np.load` / `read_direct`; Parquet <= 1.0x `pq.read_table` time at "
        "<= 0.25x its peak memory.",
        "",
    ]
    for size, res in ld["by_size"].items():
        lines += [f"### {int(size) / MIB:.0f} MiB", ""]
        if "error" in res:
            lines += [f"failed: {res['error']}", ""]
            continue
        rows = []
        for name, r in res.items():
            if not isinstance(r, dict) or "ours" not in r or "baseline" not in r:
                continue
            o, b = r["ours"], r["baseline"]
            n = int(size)
            gbs = n / o["s"] / 1e9
            rows.append(
                [
                    name,
                    f"{o['s']:.3f}",
                    f"{gbs:.2f}" + (f" ({gbs / lim['fill_gb_per_s']:.0%})" if lim else ""),
                    f"{b['s']:.3f}",
                    fx(o["s"] / b["s"]),
                    f"{o['peak'] / n:.3f}",
                    f"{b['peak'] / n:.3f}",
                ]
            )
        if rows:
            lines += [
                bf.table(
                    [
                        "format",
                        "ours s",
                        "ours GB/s (of fill limit)",
                        "baseline s",
                        "time ratio",
                        "ours peak / data",
                        "baseline peak / data",
                    ],
                    rows,
                ),
                "",
            ]
        else:
            lines += ["```", json.dumps(res, indent=1)[:3000], "```", ""]
    return lines


def render_analysis(an: dict[str, Any]) -> list[str]:
    """Per-step costs and the contention probe."""
    per = an["per_batch_us"]
    keys = list(next(iter(per.values())))
    probe = an["contention"]
    names = [k for k in probe[0] if k not in ("busy_loops", "threads", "others_cores")]
    return [
        "## Where a batch's time goes (1 KiB rows, batch 256)",
        "",
        "us per batch of each step, outside the DataLoader "
        "(`bench_foundation.profile_collate_path`); "
        "`old` rows are the code before this suite's optimisations, kept for comparison:",
        "",
        bf.table(
            ["step", *(f"{t} thread{'s' if t != '1' else ''}" for t in per)],
            [[k, *(f"{per[t][k]:.1f}" for t in per)] for k in keys],
        ),
        "",
        "The gather under CPU contention: us per batch with the cores idle and with one "
        "busy-loop process per core (`bench_foundation.contention_probe`):",
        "",
        bf.table(
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


# --------------------------------------------------------------------------------------
# Plots


def plot_all(results: dict[str, Any], cfg: Config, img_dir: str) -> dict[str, str]:
    """PNG plots of each section; ``{title: path}``. Needs matplotlib (extra ``bench``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  plots skipped: matplotlib is not installed", flush=True)
        return {}
    os.makedirs(img_dir, exist_ok=True)
    made: dict[str, str] = {}

    def save(fig: Any, name: str, title: str) -> None:
        path = os.path.join(img_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made[title] = path

    mem = results.get("memory")
    if mem and mem["summary"]:
        fig, axes = plt.subplots(
            1, len(cfg.methods), figsize=(5 * len(cfg.methods), 4), squeeze=False
        )
        for ax, method in zip(axes[0], cfg.methods):
            for case, by in mem["summary"].items():
                pts = sorted((int(w), v["duplication"]) for w, v in by.get(method, {}).items())
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=case)
            ax.set_title(f"{method}")
            ax.set_xlabel("num_workers")
            ax.set_ylabel("times the data is in RAM")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        save(fig, "bench-memory.png", "memory against num_workers")
    tp = results.get("throughput")
    if tp:
        sizes = list(tp["by_size"])
        fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
        for ax, size in zip(axes[0], sizes):
            med = tp["by_size"][size]["median"]
            for name in THROUGHPUT_CASES:
                pts = [(b, med.get(f"{name}|{b}/0")) for b in cfg.batch_sizes]
                pts = [(b, v) for b, v in pts if v]
                if pts:
                    ax.plot(
                        *zip(*pts),
                        marker="o",
                        label=name,
                        ls="--" if name.startswith("raw") else "-",
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{int(size) // 1024} KiB samples, num_workers=0")
            ax.set_xlabel("batch size")
            ax.set_ylabel("samples/s")
            ax.grid(alpha=0.3, which="both")
        axes[0][0].legend(fontsize=7)
        save(fig, "bench-throughput.png", "throughput against batch size")
    tt = results.get("ttfb")
    if tt and tt["by_case"]:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for case, by in tt["by_case"].items():
            pts = sorted((int(s) / MIB, v["median_s"]) for s, v in by.items())
            ax.plot(*zip(*pts), marker="o", label=case)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("dataset MiB")
        ax.set_ylabel("s to first batch (2 spawn workers)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        save(fig, "bench-ttfb.png", "spawn time to first batch against dataset size")
    bd = results.get("build")
    if bd and bd["by_size"]:
        sizes = list(bd["by_size"])
        methods = [m for m, _, _ in BUILD_METHODS]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        width = 0.8 / max(1, len(sizes))
        for i, size in enumerate(sizes):
            row = bd["by_size"][size]
            xs = [j + i * width for j in range(len(methods))]
            axes[0].bar(
                xs,
                [row.get(m, {}).get("seconds", 0) for m in methods],
                width,
                label=f"{int(size) / MIB:.0f} MiB",
            )
            axes[1].bar(
                xs,
                [row.get(m, {}).get("peak_private", 0) / int(size) for m in methods],
                width,
                label=f"{int(size) / MIB:.0f} MiB",
            )
        for ax, label in zip(axes, ("seconds", "peak private memory / data")):
            ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(methods))])
            ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        save(fig, "bench-build.png", "build time and peak memory")
    return made


# --------------------------------------------------------------------------------------
# Main


SECTIONS = ["limits", "throughput", "memory", "ttfb", "build", "load", "analysis"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the sections, write the page, the plots and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    parser.add_argument("--reps", type=int, help="repetitions (default 3; 1 with --quick)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--tmp-dir", help="where data files go (a local disk)")
    parser.add_argument(
        "--out-dir",
        help="write benchmarks.md, img/ and suite.json here (default: docs/benchmarks.md, "
        "docs/img/, benchmarks/results/suite.json; with --quick: benchmarks/results/quick/)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each section, wait up to S s for other processes to use < 0.2 cores",
    )
    parser.add_argument(
        "--render", metavar="JSON", help="only rewrite the page and plots from a saved suite.json"
    )
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        kind, *rest = args.child
        if kind == "memory":
            child_memory(json.loads(rest[0]))
        elif kind == "ttfb":
            child_ttfb(json.loads(rest[0]))
        elif kind == "load":  # bench_foundation.measure_load's protocol
            child_build(rest[0], rest[1])
        else:
            parser.error(f"unknown child {kind}")
        return 0

    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        cfg = Config(**saved["config"])
        out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.render))
        md = os.path.join(args.out_dir, "benchmarks.md") if args.out_dir else None
        img = os.path.join(out_dir, "img") if args.out_dir else os.path.join(REPO, "docs", "img")
        if not args.no_plots:
            saved["plots"] = plot_all(saved, cfg, img)
        with open(md or os.path.join(REPO, "docs", "benchmarks.md"), "w") as f:
            f.write(render(saved, cfg) + "\n")
        return 0

    cfg = Config.quick_config() if args.quick else Config()
    if args.reps:
        cfg.reps = args.reps
    only = [s for s in SECTIONS if s in set(args.only or SECTIONS)]
    if cfg.quick and not args.only:
        # analysis needs real sizes; bench_formats' script (without its run()) takes ~20 s
        skip = {"analysis"} | (set() if callable(getattr(_formats(), "run", None)) else {"load"})
        only = [s for s in only if s not in skip]
    if args.out_dir:
        md_path = os.path.join(args.out_dir, "benchmarks.md")
        img_dir = os.path.join(args.out_dir, "img")
        json_path = os.path.join(args.out_dir, "suite.json")
    elif cfg.quick:
        base = os.path.join(HERE, "results", "quick")
        md_path, img_dir, json_path = (
            os.path.join(base, "benchmarks.md"),
            os.path.join(base, "img"),
            os.path.join(base, "suite.json"),
        )
    else:
        md_path = os.path.join(REPO, "docs", "benchmarks.md")
        img_dir = os.path.join(REPO, "docs", "img")
        json_path = os.path.join(HERE, "results", "suite.json")

    status = peer_status()
    t_start = time.time()
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M %z"),
        "command": " ".join(["python", "benchmarks/bench_suite.py", *sys.argv[1:]]),
        "config": asdict(cfg),
        "machine": bf.machine_info(),
        "peers": status,
        "load_start": bf.load_average(),
        "targets": TARGETS,
        "json_path": json_path,
    }
    print(json.dumps({"machine": results["machine"], "peers": status}), flush=True)
    runners: dict[str, Callable[[str], Any]] = {
        "limits": lambda tmp: bench_limits(cfg),
        "throughput": lambda tmp: bench_throughput(cfg, tmp, status),
        "memory": lambda tmp: bench_memory(cfg, tmp, status),
        "ttfb": lambda tmp: bench_ttfb(cfg, tmp, status),
        "build": lambda tmp: bench_build(cfg, tmp, status),
        "load": lambda tmp: bench_load(cfg, tmp),
        "analysis": lambda tmp: bench_analysis(cfg),
    }
    with tempfile.TemporaryDirectory(prefix="sd-suite-", dir=args.tmp_dir) as tmp:
        for section in only:
            print(f"{section}:", flush=True)
            if args.wait_idle:
                bf.wait_idle(args.wait_idle)
            t0 = time.time()
            results[section] = runners[section](tmp)
            print(f"{section}: {time.time() - t0:.0f} s", flush=True)
            results.setdefault("section_s", {})[section] = time.time() - t0
    results["load_end"] = bf.load_average()
    results["duration_s"] = time.time() - t_start
    if not args.no_plots:
        results["plots"] = plot_all(results, cfg, img_dir)
    page = render(results, cfg)
    os.makedirs(os.path.dirname(md_path), exist_ok=True)
    with open(md_path, "w") as f:
        f.write(page + "\n")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print()
    print(page)
    print(
        f"\nwrote {md_path}, {json_path}"
        + (f", {img_dir}/bench-*.png" if results.get("plots") else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
