"""First touch of fresh pages (its old name): ``bench.py --topics limits``.

    python benchmarks/bench_first_touch.py [--mib 256] [--reps 3]

First touch of private (huge and 4 KiB pages) and shared memfd pages, by one thread
and by shareddata's threads, the copy from the page cache and the fill limit;
writes ``benchmarks/results/limits.{md,json}``. See ``harness/topics/limits.py``.
"""

import sys

import bench

if __name__ == "__main__":
    sys.exit(bench.alias("limits"))
