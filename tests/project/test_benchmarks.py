"""The benchmark harness runs end to end (`--quick`) and reports every section and case.

Checks that every topic of the suite runs and that its page and data hold every
section and every case by name (a case renamed or dropped fails here), not the
timings (too small to mean anything at these sizes). Plus the runner's failure and
timeout paths.

The end-to-end run (about a minute) is opt-in, marked ``bench``: ``bash scripts/test.sh
--bench`` (README.md#tests). The runner's and the topics' tests run by default.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")

SECTIONS = [
    "## Targets",
    "## The machine's limits",
    "## Batch throughput",
    "### 1 KiB samples",
    "## Memory against workers",
    "### fork",
    "### Strings: memory of spawn workers after an epoch",
    "## Spawn time to first batch",
    "## Loads into shared memory",
    "MiB: each format against its fastest private read",
    "MiB: building a shareable dataset",
    "MiB: what each optimisation gains",
    "MiB: HDF5 records (a compound dataset",
    "## Where a batch's time goes (1 KiB rows, batch 256)",
    "## Plots",
]
TARGETS = [
    "| memory, ",
    "| fast path / raw gather, 1 KiB",
    "| default collate / TensorDataset, 1 KiB, 0 workers",
    "| default collate / TensorDataset, 1 KiB, 2 workers",
    "| spawn time to first batch",
    "| npy load / np.load",
    "| parquet load / pq.read_table",
]
LIMITS = [
    "memcpy (Tensor.copy_), 1 thread",
    "memcpy (Tensor.copy_), torch's default threads",
    "private numpy, huge pages",
    "private numpy, 4 KiB pages",
    "shared memfd, written by 1 thread",
    "shared memfd, populated by 1 thread",
    "shared memfd, populated by shareddata's threads",
    "copy from page cache into touched pages",
    "fill limit",
]
OURS = ["shareddata", "shareddata, no shortcut", "shareddata fast path"]
PEERS = ["numpy array", "TensorDataset", "h5py lazy", "HF datasets"]
PEERS += ["tensordict shared", "tensordict memmap"]
MEMORY = ["shareddata", "numpy array", "TensorDataset", "share_memory_()", "h5py lazy"]
MEMORY += ["HF datasets", "tensordict shared", "tensordict memmap"]
FORMATS = ["npy", "hdf5 contiguous", "hdf5 chunked", "hdf5 gzip", "parquet"]
BUILDS = ["shareddata", "naive share_memory_()", "tensordict shared", "tensordict memmap"]
BUILDS += ["HF datasets from Parquet", "shareddata from Parquet"]
STEPS = ["(a) default_collate", "(b) __getitems__ total", "(c) ds[index tensor]"]
STEPS += ["raw index_select(out=)", "raw np.take(out=)"]
PLOTS = ["bench-memory.png", "bench-throughput.png", "bench-ttfb.png", "bench-build.png"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    cmd = [sys.executable, os.path.join(BENCH, "bench_suite.py"), "--quick"]
    cmd += ["--out-dir", str(out), "--tmp-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (out / "benchmarks.md").read_text()
    return out, page, json.loads((out / "suite.json").read_text())


def row(page: str, name: str) -> bool:
    """Whether a table of the page has a row for ``name``."""
    return any(line.startswith(f"| {name} ") for line in page.splitlines())


def errors(x: object, where: str = "") -> list[str]:
    """Every ``{"error": ...}`` in the suite's results, with the keys that lead to it."""
    if isinstance(x, dict):
        if "error" in x:
            return [f"{where}: {str(x['error'])[-300:]}"]
        return [e for k, v in x.items() for e in errors(v, f"{where}/{k}")]
    if isinstance(x, list):
        return [e for i, v in enumerate(x) for e in errors(v, f"{where}[{i}]")]
    return []


@pytest.mark.bench
def test_every_section_and_target(quick_run):
    _, page, results = quick_run
    assert not errors(results), "\n".join(errors(results))
    for heading in SECTIONS + TARGETS:
        assert heading in page, heading
    for topic in ("limits", "throughput", "memory", "ttfb", "load", "analysis"):
        assert topic in results, topic
    assert "FAILED" not in page and "Traceback" not in page
    assert results["command"].startswith("python benchmarks/bench_suite.py --quick")


@pytest.mark.bench
def test_every_case_of_every_topic(quick_run):
    _, page, r = quick_run
    installed = {p: not s.startswith("not installed") for p, s in r["peers"].items()}
    assert set(r["limits"]["ways"]) >= set(LIMITS)
    points = r["throughput"]["by_size"]["1024"]["median"]
    for case in ["raw index_select(out=)", *OURS, *PEERS]:
        assert row(page, case), case
        if not case.startswith(("tensordict", "h5py", "HF")):
            assert points[f"{case}|256/0"] > 0 and points[f"{case}|256/2"] > 0, case
    for ipc in ("IPC floor, torch /dev/shm", "IPC floor, shareddata memfd"):
        assert points[f"{ipc}|256/2"] > 0, ipc
    for case in MEMORY:
        assert row(page, case), case
    for case in MEMORY[:4]:
        assert r["memory"]["summary"][case]["fork"]["1"]["duplication"] > 0, case
    assert set(r["ttfb"]["by_case"]) == {"limit", "shareddata"}
    loads = next(iter(r["load"]["by_size"].values()))["loads"]
    for fmt in FORMATS:
        assert row(page, fmt), fmt
        assert loads[f"{fmt}|ours"]["s"] > 0 and loads[f"{fmt}|baseline"]["s"] > 0
    for method in BUILDS:
        assert row(page, method), method
    for step in STEPS:
        assert row(page, step), step
    # a peer that is not installed still gets its row, saying so
    for peer, case in (("tensordict", "tensordict shared"), ("datasets", "HF datasets")):
        if not installed[peer]:
            hint = "not installed: pip install 'torch-shareddata[bench]'"
            assert f"| {case}" in page and hint in page


@pytest.mark.bench
def test_quick_run_draws_the_plots(quick_run):
    pytest.importorskip("matplotlib")
    out, page, _ = quick_run
    for name in PLOTS:
        assert (out / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"img/{name}" in page


@pytest.mark.bench
def test_a_rewritten_page_keeps_the_sections_of_other_scripts(tmp_path, quick_run):
    out, _, results = quick_run
    own = tmp_path / "benchmarks.md"
    own.write_text("# old\n\n## Batch throughput\n\nold\n\n## IPC (bench_ipc.py)\n\nkept\n")
    saved = tmp_path / "suite.json"
    saved.write_text(json.dumps(results))
    cmd = [sys.executable, os.path.join(BENCH, "bench.py"), "--render", str(saved)]
    subprocess.run([*cmd, "--out-dir", str(tmp_path)], check=True, timeout=120, cwd=REPO)
    page = own.read_text()
    assert "## IPC (bench_ipc.py)\n\nkept" in page and "\nold\n" not in page
    assert page.index("## IPC") < page.index("## Plots")


def runner():
    sys.path.insert(0, BENCH)
    try:
        from harness.runner import Runner
    finally:
        sys.path.remove(BENCH)
    return Runner


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "interpreter"])
def test_the_runner_reports_failures_and_timeouts(zygote):
    Runner = runner()
    with Runner(preload="json" if zygote else "") as r:
        assert r.run("json", "loads", s='{"a": 1}') == {"a": 1}
        with pytest.raises(RuntimeError, match="json.loads failed: JSONDecodeError"):
            r.run("json", "loads", s="{")
        with pytest.raises(TimeoutError):
            r.run("subprocess", "call", timeout=0.5, args=["sleep", "5"])
        # still usable after a timeout; jobs() turns a failure into an error entry
        assert r.jobs("json", "loads", [{"id": "x"}], one_process=True)["x"]["error"]
        assert r.run("json", "loads", s='{"b": 2}') == {"b": 2}


def test_the_runner_settles_memory_before_a_run_only_when_asked():
    # Note [Settling memory]: BENCH_SETTLE_GIB makes the runner touch and free that much
    code = (  # VmHWM: this process's own peak (ru_maxrss keeps the peak before exec)
        "import sys; sys.path.insert(0, sys.argv[1]); from harness import runner; "
        "runner.Runner(preload='').run('json', 'loads', s='1'); "
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    )

    def peak_mib(gib: float) -> float:
        env = {**os.environ, "BENCH_SETTLE_GIB": str(gib)}
        done = subprocess.run([sys.executable, "-c", code, BENCH], env=env, text=True,
                              capture_output=True, timeout=120, check=True)  # fmt: skip
        return int(done.stdout) / 1024

    unset, settled = peak_mib(0), peak_mib(0.5)
    assert settled > 512 > unset, (unset, settled)  # a 0.5 GiB array was touched


def test_every_topic_is_a_harness_module_and_the_suite_calls_the_harness():
    sys.path.insert(0, BENCH)
    try:
        import importlib

        from harness.topics import SUITE, TOPICS

        for name in TOPICS:
            module = importlib.import_module(f"harness.topics.{name}")
            assert callable(module.run) and callable(module.render), name
    finally:
        sys.path.remove(BENCH)
    assert set(SUITE) == {"limits", "throughput", "memory", "ttfb", "load", "analysis"}
    assert {"wrap", "distributed", "handoff", "verify"} <= set(TOPICS)
    assert "bench.main(" in Path(BENCH, "bench_suite.py").read_text()


def test_the_suite_comparison_scores_each_repetition_and_calls_worse_only_beyond_both_spreads():
    sys.path.insert(0, BENCH)
    try:
        import bench_suite_compare as cmp
    finally:
        sys.path.remove(BENCH)
    saved = {"limits": {"ways": {"x": {"s": 2.0, "runs": [1.0, 2.0, 3.0]}}},
             "by_size": {"1": {"median": {"a|1/0": 5.0}, "runs": {"a|1/0": [4.0, 5.0, 6.0]}}},
             "ttfb": {"median_s": 1.5, "runs": [1.5, 1.0]}}  # fmt: skip
    first = cmp.repetition(saved, 0)  # each median replaced by that repetition's run
    assert first["limits"]["ways"]["x"]["s"] == 1.0 and first["ttfb"]["median_s"] == 1.5
    assert first["by_size"]["1"]["median"] == {"a|1/0": 4.0}
    assert cmp.repetition(saved, 2)["ttfb"]["median_s"] == 1.0  # fewer runs: the last
    assert saved["limits"]["ways"]["x"]["s"] == 2.0  # the results themselves are kept

    def target(median, runs, goal="<= 1.2x"):
        return {"goal": goal, "median": median, "runs": runs}

    base = {"t": target(1.0, [0.9, 1.1]), "u": target(1.0, [0.9, 1.1], ">= 0.5x")}
    calls = {
        "t": [(1.3, [1.2, 1.4], "worse beyond the spread"), (1.1, [1.05, 1.3], "within"),
              (0.8, [0.7, 0.85], "better"), (1.12, [1.11, 1.12], "within")],
        "u": [(0.8, [0.7, 0.85], "worse beyond the spread"), (1.3, [1.2, 1.4], "better")],
    }  # fmt: skip
    for name, cases in calls.items():
        for median, runs, call in cases:
            row = cmp.compare(base, {name: target(median, runs, base[name]["goal"])})[0]
            assert row[-1].startswith(call), (name, median, runs, row)
    row = cmp.compare({}, {"v": target(1.0, [1.0])})[0]
    assert row[-1] == "only in this tree"
