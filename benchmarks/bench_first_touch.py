"""The page-fault limit behind HDF5/npy load ratios: first touch of 1 GiB, three ways.

    python benchmarks/bench_first_touch.py [--mib 1024]

numpy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on large private
arrays, so a baseline that reads into ``np.empty`` faults 2 MiB pages. Shared memory
(memfd/tmpfs) gets huge pages only when ``/sys/kernel/mm/transparent_hugepage/
shmem_enabled`` allows it, so a load into shared pages faults 4 KiB pages. The
second and third lines are the fair comparison; the first is what the baseline gets.
"""

import argparse
import mmap
import os
import time

import numpy as np


def touch(array: np.ndarray) -> float:
    start = time.perf_counter()
    array[...] = 1
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.mib << 20
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        print(f"shmem_enabled: {f.read().strip()}")
    times = {}
    for huge in (True, False):
        np._core.multiarray._set_madvise_hugepage(huge)
        label = f"private numpy array, huge pages {'on' if huge else 'off'}"
        times[label] = sorted(touch(np.empty(n, np.uint8)) for _ in range(args.repeats))
    np._core.multiarray._set_madvise_hugepage(True)
    shared = []
    for _ in range(args.repeats):
        fd = os.memfd_create("first-touch")
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as m:
            array = np.frombuffer(m, np.uint8)
            shared.append(touch(array))
            del array
        os.close(fd)
    times["shared memfd (what shareddata fills)"] = sorted(shared)
    base = times["private numpy array, huge pages on"][args.repeats // 2]
    print(f"| first touch of {args.mib} MiB | median s | vs private + huge pages |")
    print("|---|---:|---:|")
    for label, ts in times.items():
        median = ts[args.repeats // 2]
        print(f"| {label} | {median:.3f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
