"""The benchmark suite runs end to end (`--quick`) and writes its page, plots and data.

Checks that every section runs and is reported, not the timings (too small to mean
anything at these sizes).
"""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

SECTIONS = [
    "## Targets",
    "## The machine's limits",
    "## Batch throughput",
    "## Memory against workers",
    "## Spawn time to first batch",
    "## Building a shareable dataset",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "bench_suite.py"),
            "--quick",
            "--out-dir",
            str(out),
            "--tmp-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_quick_run_writes_every_section(quick_run):
    out, proc = quick_run
    page = (out / "benchmarks.md").read_text()
    for heading in SECTIONS:
        assert heading in page, heading
    results = json.loads((out / "suite.json").read_text())
    for section in ("limits", "throughput", "memory", "ttfb", "build"):
        assert section in results, section
    if "load" in results:  # quick runs it when bench_formats has a run() function
        assert "## Format loads" in page
    assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
    # every throughput point of shareddata and of the raw gather was measured
    by_size = results["throughput"]["by_size"]["1024"]["median"]
    for case in ("raw index_select(out=)", "shareddata", "shareddata fast path", "TensorDataset"):
        assert by_size.get(f"{case}|256/0", 0) > 0, case
    assert results["memory"]["summary"]["shareddata"]["fork"]["1"]["duplication"] > 0


def test_quick_run_draws_the_plots(quick_run):
    pytest.importorskip("matplotlib")
    out, _ = quick_run
    for name in ("bench-memory.png", "bench-throughput.png", "bench-ttfb.png", "bench-build.png"):
        png = out / "img" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"img/{name}" in (out / "benchmarks.md").read_text()


def test_every_peer_is_measured_or_reported_missing(quick_run):
    out, _ = quick_run
    results = json.loads((out / "suite.json").read_text())
    page = (out / "benchmarks.md").read_text()
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench_suite
    finally:
        sys.path.pop(0)
    for peer, status in results["peers"].items():
        assert status.startswith("not installed") or status[0].isdigit(), (peer, status)
    for case in bench_suite.MEMORY_CASES:
        needs = bench_suite.CASE[case].needs
        if bench_suite.available(results["peers"], needs):
            assert case in results["memory"]["summary"], case
    # a peer that is not installed gets a row that says so
    cfg = bench_suite.Config.quick_config()
    missing = {**results["peers"], "datasets": "not installed (ImportError: hidden)"}
    lines = "\n".join(bench_suite.render_throughput(results["throughput"], cfg, missing))
    assert re.search(r"\| HF datasets +\| not installed: pip install 'shareddata\[bench\]'", lines)
    assert "tensordict" in page
