"""The page-fault limit behind the load ratios: first touch of fresh pages, five ways.

    python benchmarks/bench_first_touch.py [--mib 1024] [--repeats 3]

Runs section 1 of ``bench_formats.py`` alone (each measurement in a fresh process)
and writes ``benchmarks/results/first_touch.md``. numpy asks for transparent huge
pages (``madvise(MADV_HUGEPAGE)``) on large private arrays, so a baseline that reads
into ``np.empty`` faults 2 MiB pages. Shared memory (memfd/tmpfs) gets huge pages
only when ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (or the tmpfs mount)
allows it, so a load into shared pages faults 4 KiB pages unless the kernel allows
more; shareddata allocates them with several threads (``_storage.populate``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_formats as bf  # noqa: E402  (the benchmarks folder is not a package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="sd-first-touch-") as tmp:
        path = os.path.join(tmp, "data.npy")
        np.save(path, np.ones(n, np.uint8))
        bf.warm(path)
        z = bf.Zygote()
        try:
            limits = bf.bench_limits(z, path, n, args.repeats)
        finally:
            z.close()
    base = limits["private numpy, huge pages"]["s"]
    lines = [
        f"# First touch of {args.mib} MiB (median of {args.repeats} fresh processes)",
        "",
        f"`shmem_enabled`: `{bf.shmem_enabled()}`; "
        f"{len(os.sched_getaffinity(0))} usable cores; load average {os.getloadavg()[0]:.2f}.",
        "",
        "| | s | GB/s | vs private + huge pages |",
        "|---|---:|---:|---:|",
    ]
    for label, v in limits.items():
        lines.append(f"| {label} | {v['s']:.3f} | {n / v['s'] / 1e9:.2f} | {v['s'] / base:.2f}x |")
    text = "\n".join(lines) + "\n"
    os.makedirs(bf.RESULTS, exist_ok=True)
    with open(os.path.join(bf.RESULTS, "first_touch.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
