"""Format loads (its old name): ``bench.py --topics load``, the harness's load topic.

    python benchmarks/bench_formats.py [--size 1GiB] [--reps 3] [--quick]

Loads of ``.npy``, HDF5 (contiguous, chunked, gzip) and Parquet into shared memory
against each format's fastest private read, the builds of a shareable dataset, each
optimisation switched off, HDF5 records and huge pages; writes
``benchmarks/results/load.{md,json}``. See ``harness/topics/load.py``.
"""

import sys

import bench

if __name__ == "__main__":
    sys.exit(bench.alias("load"))
