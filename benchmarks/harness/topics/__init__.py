"""One module per topic, each with ``run(quick, opts) -> results`` and ``render(results) -> str``.

``TOPICS`` lists them in the order the suite runs them; ``SUITE`` are the ones
``docs/benchmarks.md`` shows (the default of ``bench_suite.py`` / ``bench.py``).
"""

TOPICS = [
    "limits",
    "throughput",
    "memory",
    "ttfb",
    "load",
    "analysis",
    "wrap",
    "distributed",
    "handoff",
    "verify",
]
SUITE = ["limits", "throughput", "memory", "ttfb", "load", "analysis"]
