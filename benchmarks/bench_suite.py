"""The benchmark suite (its documented name): the harness's ``bench.py`` writing the page.

    python benchmarks/bench_suite.py                  # full run (~30 min on 2 cores): writes
                                                      # docs/benchmarks.md, docs/img/bench-*.png,
                                                      # benchmarks/results/suite.json
    python benchmarks/bench_suite.py --quick --out-dir /tmp/suite   # smoke run, < 1 min
    python benchmarks/bench_suite.py --only throughput memory --reps 5

Options are ``bench.py``'s (``--quick``, ``--only``, ``--reps``, ``--out-dir``, ...);
the measurements are the topics' in ``benchmarks/harness/topics/``. See
``benchmarks/README.md``.
"""

import sys

import bench

if __name__ == "__main__":
    sys.exit(bench.main(prog="benchmarks/bench_suite.py"))
