"""The hand-written HDF5 reader against h5py's ``read_direct``, per layout, in one run.

    python benchmarks/bench_hdf5_readers.py          # ~10 min on 2 cores: results/hdf5_readers.md
    python benchmarks/bench_hdf5_readers.py --quick  # smoke run, 16 MiB, 1 round
    python benchmarks/bench_hdf5_readers.py --mib 256 --rounds 5 --baseline 527c53a

Until issue 27, shareddata read some HDF5 layouts itself (``sources/_hdf5_chunks.py``):
``preadv`` from a contiguous dataset's offset, chunks of whole rows ``preadv``-ed and
gzip (+ shuffle) chunks inflated by threads, fields copied out of raw compound
records. Everything else went through ``read_direct``. Per layout, three loads of the
same file (~``--mib`` MiB of float32 rows of 1 KiB, a warm page cache):

- ``hand``: ``sd.HDF5Dataset(path)`` of ``--baseline`` (the tree with the hand reader,
  extracted by ``git archive``), which takes its hand path wherever it has one;
- ``h5py, chunk cache``: the same tree with the hand paths switched off
  (``HDF5Source._raw_offset``, ``_inflatable`` and ``_record_runs`` return None), so HDF5
  reads with ``read_direct`` (``ds.id.read`` for a record field) into the same shared
  pages, through the same loader: the reader is the only difference;
- ``h5py``: the same with HDF5's chunk cache off (``rdcc_nbytes=0``): every chunk is
  read once, so the cache only adds a copy through it (~9 MiB of private memory);
- ``this tree``: ``sd.HDF5Dataset(path)`` of this checkout.

Each load runs in a fresh fork of a zygote per tree (``harness.runner``); the rounds
alternate the readers so a noisy neighbour hits all of them. Time is the median;
peak private memory is the largest ``RssAnon`` growth sampled every ~1 ms
(``harness.memory``): what a temporary copy would occupy (the data itself is in shared
pages). The rule (issue 27): the hand reader stays for a layout only where it is
>= 1.3x faster than ``h5py`` or holds >= 4x less peak private memory (counted only
when the difference is at least 1% of the data: a constant few MiB of HDF5's own
buffers is not a copy of the data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

LAYOUTS: dict[str, dict[str, Any]] = {
    "contiguous": {},
    "chunked": {"chunks": True},
    "gzip": {"chunks": True, "compression": "gzip"},
    "lzf": {"chunks": True, "compression": "lzf"},
    "shuffle + gzip": {"chunks": True, "compression": "gzip", "shuffle": True},
    "fletcher32": {"chunks": True, "fletcher32": True},
    "records (compound, per field)": {"chunks": True},
}
HAND_OFF = (
    "from shareddata.sources.hdf5 import HDF5Source as S\n"
    "S._raw_offset = S._inflatable = S._record_runs = lambda *a: None"
)
NO_CHUNK_CACHE = """
import h5py
class File(h5py.File):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("rdcc_nbytes", 0)  # each chunk is read once: straight into the rows
        super().__init__(*args, **kwargs)
h5py.File = File
"""
ROW_FLOATS = 256  # rows of 1 KiB
CHUNK_ROWS = 1024  # chunks of whole rows, 1 MiB


def write(path: str, layout: str, rows: int) -> None:
    """``rows`` rows of random float32 (1 KiB each) in ``layout``, fsynced."""
    import h5py

    kw = dict(LAYOUTS[layout])
    if kw.pop("chunks", False):
        kw["chunks"] = (CHUNK_ROWS, ROW_FLOATS)
    rng = np.random.default_rng(0)
    step = 16 * CHUNK_ROWS
    with h5py.File(path, "w") as f:
        if layout.startswith("records"):
            dtype = np.dtype([("x", "<f4", (ROW_FLOATS // 2,)), ("y", "<f4", (ROW_FLOATS // 2,))])
            kw["chunks"] = (CHUNK_ROWS,)
            d = f.create_dataset("data", shape=(rows,), dtype=dtype, **kw)
        else:
            d = f.create_dataset("data", shape=(rows, ROW_FLOATS), dtype=np.float32, **kw)
        for a in range(0, rows, step):
            block = rng.random((min(rows, a + step) - a, ROW_FLOATS), dtype=np.float32)
            d[a : a + step] = block.view(d.dtype).reshape(-1) if d.dtype.names else block
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        while os.read(fd, 64 << 20):  # into the page cache
            pass
    finally:
        os.close(fd)


def load(path: str, patch: str) -> dict[str, Any]:
    """In a measured child: ``sd.HDF5Dataset(path)`` after ``patch``; seconds, checked."""
    import h5py
    from harness.runner import go

    import shareddata as sd

    exec(patch, {})  # noqa: S102 - a fixed switch of this script, not input
    with h5py.File(path, "r") as f:
        ds = f["data"]
        want = ds[len(ds) // 2]
    go()
    t = time.perf_counter()
    data = sd.HDF5Dataset(path, share="process")
    s = time.perf_counter() - t
    row = data[len(data) // 2]
    names = want.dtype.names or ("data",)
    for name in names:
        got = row[f"data/{name}" if want.dtype.names else "data"].numpy()
        if not np.array_equal(got, want[name] if want.dtype.names else want):
            raise AssertionError(f"{path}: column {name!r} reads wrong values")
    return {"s": s, "nbytes": data.nbytes}


def _tree(rev: str, into: str) -> str:
    """The ``shareddata`` package of ``rev``, extracted (no git worktree is created)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "shareddata"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    tar = os.path.join(into, "tree.tar")
    with open(tar, "wb") as f:
        f.write(archive)
    with tarfile.open(tar) as t:
        t.extractall(os.path.join(into, "tree"), filter="data")
    return os.path.join(into, "tree")


def measure(mib: int, rounds: int, baseline: str, quick: bool) -> dict[str, Any]:
    """Every layout x reader x round; medians and ratios."""
    from harness.runner import Runner

    rows = (mib << 20) // (4 * ROW_FLOATS)
    out: dict[str, Any] = {"mib": mib, "rounds": rounds, "baseline": baseline, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        old = _tree(baseline, tmp)
        preload = "numpy,h5py,shareddata"
        with Runner(old, preload) as before, Runner(REPO, preload) as now:
            readers = {
                "hand": (before, ""),
                "h5py, chunk cache": (before, HAND_OFF),
                "h5py": (before, HAND_OFF + NO_CHUNK_CACHE),
                "this tree": (now, ""),
            }
            for layout in LAYOUTS:
                path = os.path.join(tmp, "case.h5")
                write(path, layout, rows)
                runs: dict[str, list[dict[str, Any]]] = {r: [] for r in readers}
                for _ in range(rounds):
                    for name, (runner, patch) in readers.items():
                        runs[name].append(
                            runner.run("bench_hdf5_readers", "load", path=path, patch=patch)
                        )
                os.unlink(path)
                out["layouts"][layout] = {
                    name: {
                        "s": statistics.median(r["s"] for r in rs),
                        "every_s": [r["s"] for r in rs],
                        "peak_private_mib": max(r["peak_private"] for r in rs) / 2**20,
                        "nbytes": rs[0]["nbytes"],
                    }
                    for name, rs in runs.items()
                }
                print(layout, json.dumps(out["layouts"][layout]), file=sys.stderr, flush=True)
    return out


def verdict(case: dict[str, Any]) -> str:
    """Whether the hand reader earns its place for this layout (the rule in the docstring)."""
    hand, h5 = case["hand"], case["h5py"]  # h5py at its best: chunk cache off
    faster = h5["s"] / hand["s"]
    data_mib = hand["nbytes"] / 2**20
    less = h5["peak_private_mib"] / max(hand["peak_private_mib"], 0.1)
    if faster >= 1.3:
        return f"keep ({faster:.2f}x faster)"
    if less >= 4 and h5["peak_private_mib"] - hand["peak_private_mib"] >= 0.01 * data_mib:
        return f"keep ({less:.1f}x less memory)"
    return "h5py reads"


def render(results: dict[str, Any]) -> str:
    """The Markdown table of docs/benchmarks.md's section."""
    lines = [
        f"{results['mib']} MiB per layout (float32 rows of 1 KiB, chunks of 1024 whole rows, "
        f"a warm page cache), {results['rounds']} rounds, medians; `hand` = the hand "
        f"reader of {results['baseline']}, `h5py, chunk cache` = the same tree with it "
        "switched off (`read_direct` into the same shared pages), `h5py` = the same with "
        "HDF5's chunk cache off, `this tree` = after. Peak private = "
        "largest `RssAnon` growth during the load (the data is in shared pages).",
        "",
        "| layout | hand s | h5py, chunk cache s | h5py s | this tree s | h5py / hand "
        "(fastest runs) | peak private MiB: hand / h5py, chunk cache / h5py / this tree "
        "| decision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout, case in results["layouts"].items():
        hand, cached, h5, now = (
            case[r] for r in ("hand", "h5py, chunk cache", "h5py", "this tree")
        )
        fastest = min(h5["every_s"]) / min(hand["every_s"])
        lines.append(
            f"| {layout} | {hand['s']:.3f} | {cached['s']:.3f} | {h5['s']:.3f} | {now['s']:.3f} "
            f"| {h5['s'] / hand['s']:.2f}x ({fastest:.2f}x) | {hand['peak_private_mib']:.1f} / "
            f"{cached['peak_private_mib']:.1f} / {h5['peak_private_mib']:.1f} / "
            f"{now['peak_private_mib']:.1f} | {verdict(case)} |"
        )
    lines.append("")
    lines.append(
        "Every run (s): "
        + "; ".join(
            f"{layout} {name}: {[round(s, 3) for s in r['every_s']]}"
            for layout, case in results["layouts"].items()
            for name, r in case.items()
        )
        + "."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse options, measure, write ``benchmarks/results/hdf5_readers.{md,json}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="527c53a", help="the tree with the hand reader")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 round")
    parser.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = parser.parse_args()
    mib, rounds = (16, 1) if args.quick else (args.mib, args.rounds)
    results = measure(mib, rounds, args.baseline, args.quick)
    results["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "hdf5_readers-quick" if args.quick else "hdf5_readers")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
