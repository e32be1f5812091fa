"""The machine's limits: memcpy, first touch of fresh pages, and filling shared pages from a file.

Each way runs in a fresh process (median of the repetitions, fastest run kept).
First touch of private numpy memory (numpy asks for transparent huge pages) and of
shared memfd pages (4 KiB unless ``shmem_enabled`` allows more), written by one
thread or populated by the kernel (``MADV_POPULATE_WRITE``, one thread or
shareddata's threads, ``_storage.populate``); the copy from the page cache into
pages already touched; and the whole fill of fresh shared pages from a file with
raw system calls, with the page allocation before or ahead of the read. The
*fill limit* is the fastest way found to get a file into fresh shared pages: the
least any load into shared memory costs here. Every load figure is given as a
fraction of it. The raw gather limit is in the throughput topic.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np

from harness.machine import MIB, median, shmem_enabled
from harness.render import table

TOUCH = [
    "private numpy, huge pages",
    "private numpy, 4 KiB pages",
    "shared memfd, written by 1 thread",
    "shared memfd, populated by 1 thread",
    "shared memfd, populated by shareddata's threads",
]
COPY = "copy from page cache into touched pages"
FILLS = [
    "fill from the file: populate in threads, then read",
    "fill from the file: threads populate 64 MiB ahead of the read",
]
MEMCPY = ["memcpy (Tensor.copy_), 1 thread", "memcpy (Tensor.copy_), torch's default threads"]
STEP = 64 << 20


def _read(src: int, view: memoryview, offset: int, lo: int, hi: int) -> None:
    pos = lo
    while pos < hi:
        pos += os.preadv(src, [view[pos : min(hi, pos + STEP)]], offset + pos)


def measure(way: str, nbytes: int, path: str = "", offset: int = 0) -> dict[str, Any]:
    """Child: seconds of one way of touching / filling ``nbytes`` fresh bytes."""
    from shareddata import storage as _storage
    from shareddata.storage._linux import MADV_POPULATE_WRITE, address_of, madvise

    if way.startswith("memcpy"):
        import torch

        src, dst = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)
        if "1 thread" in way:
            torch.set_num_threads(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        return {"s": time.perf_counter() - t0}
    if way.startswith("private"):
        if "4 KiB" in way:
            np._core.multiarray._set_madvise_hugepage(False)
        t0 = time.perf_counter()
        np.empty(nbytes, np.uint8).fill(1)
        return {"s": time.perf_counter() - t0}
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    address, view = address_of(m), memoryview(m)
    src = os.open(path, os.O_RDONLY) if path else -1
    if way == COPY:
        _storage.populate(address, nbytes)
    t0 = time.perf_counter()
    if way == "shared memfd, written by 1 thread":
        np.frombuffer(m, np.uint8).fill(1)
    elif way.startswith("shared memfd, populated"):
        assert _storage.populate(address, nbytes, threads=1 if "1 thread" in way else None) == 0
    elif way in (COPY, FILLS[0]):
        if way == FILLS[0]:
            assert _storage.populate(address, nbytes) == 0
        _read(src, view, offset, 0, nbytes)
    else:  # threads allocate 64 MiB parts ahead of the read
        parts = [(lo, min(nbytes, lo + STEP)) for lo in range(0, nbytes, STEP)]
        done = [threading.Event() for _ in parts]
        left = iter(range(len(parts)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    k = next(left, None)
                if k is None:
                    return
                lo, hi = parts[k]
                assert madvise(address + lo, hi - lo, MADV_POPULATE_WRITE) == 0
                done[k].set()

        workers = [
            threading.Thread(target=work) for _ in range(_storage.population_threads(nbytes))
        ]
        for t in workers:
            t.start()
        for k, (lo, hi) in enumerate(parts):
            done[k].wait()
            _read(src, view, offset, lo, hi)
        for t in workers:
            t.join()
    return {"s": time.perf_counter() - t0}


def npy_offset(path: str) -> int:
    """Where the data of a ``.npy`` file starts."""
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def measure_all(runner: Any, npy: str, reps: int, ways: list[str]) -> dict[str, Any]:
    """Every way over the data of ``npy``, ``reps`` fresh processes each, alternated."""
    offset = npy_offset(npy)
    n = os.path.getsize(npy) - offset
    runs: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(reps):
        for way in ways:
            runs[way].append(
                runner.run(
                    "harness.topics.limits", "measure", way=way, nbytes=n, path=npy, offset=offset
                )["s"]
            )
    out: dict[str, Any] = {w: {"s": median(r), "min_s": min(r), "runs": r} for w, r in runs.items()}
    if COPY in out:
        touch = min((out[k]["s"] for k in TOUCH[2:] if k in out), default=float("inf"))
        out["fill limit"] = {
            "s": min(touch + out[COPY]["s"], *(out[k]["s"] for k in FILLS if k in out))
        }
    return {"nbytes": n, "ways": out}


def fill_limit_s(res: dict[str, Any]) -> float | None:
    """The fill limit's seconds from a limits result (None if not measured)."""
    return res.get("ways", {}).get("fill limit", {}).get("s")


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every limit at ``opts.size`` (256 MiB; 16 MiB quick)."""
    from harness.runner import Runner

    size = opts.size or (16 * MIB if quick else 256 * MIB)
    with tempfile.TemporaryDirectory(prefix="sd-limits-", dir=opts.tmp_dir) as tmp:
        npy = os.path.join(tmp, "data.npy")
        np.save(npy, np.ones(size, np.uint8))
        with Runner() as runner:
            out = measure_all(runner, npy, opts.reps, [*MEMCPY, *TOUCH, COPY, *FILLS])
    out["shmem_enabled"] = shmem_enabled()
    return out


def render(r: dict[str, Any]) -> str:
    """The limits table: median and fastest seconds, GB/s, against private huge pages."""
    n, ways = r["nbytes"], r["ways"]
    base = ways.get("private numpy, huge pages", {}).get("s")
    rows = [
        [
            name,
            f"{v['s']:.3f}",
            f"{v['min_s']:.3f}" if "min_s" in v else "",
            f"{n / v['s'] / 1e9:.2f}",
            f"{v['s'] / base:.2f}x" if base else "",
        ]
        for name, v in ways.items()
    ]
    return "\n".join(
        [
            "## The machine's limits",
            "",
            f"{n / MIB:.0f} MiB, each way in a fresh process; `shmem_enabled` = "
            f"`{r['shmem_enabled']}`. The fill limit is the fastest fill of fresh shared "
            "pages from the file (or first touch + copy): the least a load into shared "
            "memory costs here.",
            "",
            table(["way", "median s", "fastest s", "GB/s", "vs private + huge pages"], rows),
            "",
        ]
    )
