"""The benchmark harness: one runner, one memory sampler, one renderer, one module per topic.

- ``runner.py``: runs a measurement (``module.function(**kwargs)``) in a fresh process
  (a fork of a pre-imported zygote, or a new interpreter) with a timeout; returns its JSON.
- ``memory.py``: samples RssAnon/RssShmem/VmRSS of a process (tree) every ms: peak, after.
- ``render.py``: Markdown tables, ratios, verdicts, plots.
- ``machine.py``: what the machine is and how busy it was.
- ``cases.py``: the data files and every way of serving them (shareddata and its peers).
- ``topics/``: limits, throughput, memory, ttfb, load, analysis, wrap, distributed,
  handoff, verify; each ``run(quick, opts) -> results`` and ``render(results) -> str``.

Entry: ``python benchmarks/bench.py [--quick] [--topics a,b]``.
"""
