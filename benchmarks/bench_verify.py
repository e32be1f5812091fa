"""What ``sd.verify`` reads on small datasets (its old name): ``bench.py --topics verify``.

    python benchmarks/bench_verify.py [--quick]

An 18 MiB ``SharedDataset`` of uint8 images (held once), the same images as a plain
numpy Dataset under fork and spawn, and a list of tuples under fork (copied as the
workers read it), 2 workers, one epoch each; writes ``benchmarks/results/verify.{md,json}``.
See ``harness/topics/verify.py``.
"""

import sys

import bench

if __name__ == "__main__":
    sys.exit(bench.alias("verify"))
