"""Loads into shared memory: time and peak private memory, per format and against every peer.

The same float32 rows (4 KiB each) as ``.npy``, HDF5 (contiguous, chunked, gzip)
and Parquet (16384-row groups), in a warm page cache; every load in a fresh
process (a fork of the runner's zygote), ours and the others alternating, medians
of the repetitions. Private memory = ``RssAnon`` of the loading process sampled
every ~1 ms (``harness.memory.Sampler``): peak growth during the load and what is
left after it, over the data size. Times are also given against the fill limit
(``topics/limits.py``, measured here at the same size).

- formats: shareddata against each format's fastest private read (``np.load``,
  h5py ``read_direct`` into ``np.empty``, ``pq.read_table``);
- peers: every way of making a shareable dataset (``share_memory_()``, tensordict
  ``share_memory_()`` / ``memmap_``, HF ``Dataset.from_parquet``);
- optimisations: each of shareddata's load optimisations switched off in turn (a
  patch in the child), and alternatives tried and not kept;
- HDF5 records: a compound dataset (one column per field) against ``ds[()]``;
- huge pages (full runs, as root): the ``.npy`` load with ``storage_dir`` on a
  tmpfs mounted ``huge=never`` / ``huge=advise`` in a private mount namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from harness import cases
from harness.machine import GIB, MIB, median, shmem_enabled
from harness.render import fx, plot, table, verdict
from harness.runner import go
from harness.topics import limits

FORMATS = ["npy", "hdf5 contiguous", "hdf5 chunked", "hdf5 gzip", "parquet"]
BASELINE = {"npy": "np.load", "hdf5": "h5py read_direct", "parquet": "pq.read_table"}
PEERS = {  # the shareable datasets of the peers: (the file they read, what they do)
    "naive share_memory_()": ("npy", "`torch.from_numpy(np.load(npy)).share_memory_()`"),
    "tensordict shared": ("npy", "`TensorDict(np.load(npy)).share_memory_()`"),
    "tensordict memmap": ("npy", "`TensorDict(np.load(npy)).memmap_(prefix)` (disk)"),
    "HF datasets from Parquet": ("parquet", "`Dataset.from_parquet(parquet)` (to Arrow cache)"),
}
NEEDS = {"tensordict shared": "tensordict", "tensordict memmap": "tensordict"}
NEEDS["HF datasets from Parquet"] = "datasets"
NO_AHEAD = (
    "from shareddata import storage as _storage\nfrom shareddata.datasets import _load\n"
    "_load.allocate = lambda *a, ahead=False, **k: _storage.allocate(*a, **k)\n"
)
ABLATIONS = [  # (format, what is switched off, the patch that does it)
    (
        "npy",
        "as before: posix_fallocate, then 1 thread maps the pages, then the read",
        NO_AHEAD + "def _reserve(self, by_faults, ahead, directory, what):\n"
        "    os.posix_fallocate(self.fd, 0, self.size)\n"
        "    _storage.populate(self.address, self.size, threads=1)\n"
        "_storage.Segment._reserve = _reserve",
    ),
    ("npy", "all pages allocated by the threads first, then the read (no overlap)", NO_AHEAD),
    (
        "npy",
        "1 allocating thread ahead of the read (instead of one per core)",
        "from shareddata.storage import _pages\n_pages._POPULATE_MAX_THREADS = 1",
    ),
    (
        "hdf5 gzip",
        "read_direct (HDF5 inflates chunks in one thread) instead of threads",
        "from shareddata.sources import hdf5\nhdf5.HDF5Source._inflatable = lambda *a: None",
    ),
    (
        "parquet",
        "decode each row group whole (before) instead of 4 MiB batches",
        "from shareddata.sources import parquet\nparquet._BATCH_BYTES = 1 << 62",
    ),
    ("parquet", "whole row groups decoded ahead by 2 threads while copying (not kept)", ""),
]
RECORDS = {  # HDF5 converts each field into its column (bench_hdf5_readers.py)
    "HDF5Dataset": "",
    "h5py ds[()] (baseline)": "",
}


def _decode_ahead(path: str) -> Any:
    """The alternative not kept: whole row groups decoded by 2 threads while copying."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    import shareddata as sd

    md = pq.ParquetFile(path).metadata
    out = sd.SharedArray.empty((md.num_rows, 1024), np.float32)
    flat, local, pos = out.numpy().reshape(-1), threading.local(), 0

    def decode(i: int) -> Any:
        if not hasattr(local, "pf"):
            local.pf = pq.ParquetFile(path, metadata=md, memory_map=True)
        return local.pf.read_row_group(i, use_threads=False).column(0).chunks

    with ThreadPoolExecutor(2) as ex:
        ahead = [ex.submit(decode, i) for i in range(md.num_row_groups)]
        for i in range(md.num_row_groups):
            for c in ahead[i].result():
                v = c.values.to_numpy()
                flat[pos : pos + len(v)] = v
                pos += len(v)
            ahead[i] = None  # type: ignore[call-overload]
            pa.default_memory_pool().release_unused()
    return out


def load(how: str, fmt: str, path: str, work: str = "", patch: str = "") -> dict[str, Any]:
    """Child: one load of ``path`` one way; seconds (memory: sampled by the runner)."""
    import h5py
    import pyarrow.parquet as pq
    import torch

    import shareddata as sd

    if how.startswith("tensordict"):
        from tensordict import TensorDict
    if how.startswith("HF"):
        import datasets

        datasets.disable_progress_bars()
    exec(patch, {"os": os})
    go()
    t0 = time.perf_counter()
    kind = fmt.split()[0]
    if how == "ours":
        cls = {"npy": sd.NumpyDataset, "hdf5": sd.HDF5Dataset, "parquet": sd.ParquetDataset}
        keep: Any = cls[kind](path, progress=False)
    elif how.startswith("HDF5Dataset"):
        keep = sd.HDF5Dataset(path, progress=False)
    elif how.startswith("h5py ds[()]"):
        with h5py.File(path) as f:
            keep = f["rec"][()]
    elif how == "baseline" and kind == "hdf5":
        with h5py.File(path) as f:
            d = f["data"]
            keep = np.empty(d.shape, d.dtype)
            d.read_direct(keep)
    elif how == "baseline" and kind == "parquet":
        keep = pq.read_table(path).column("data")
    elif how.startswith("whole row groups"):
        keep = _decode_ahead(path)
    elif how == "baseline" or how.startswith("naive") or how.startswith("tensordict"):
        keep = np.load(path)
        if how.startswith("naive"):
            keep = torch.from_numpy(keep).share_memory_()
        elif how.startswith("tensordict"):
            td = TensorDict({"data": torch.from_numpy(keep)}, batch_size=[len(keep)])
            del keep
            shared = how == "tensordict shared"
            keep = td.share_memory_() if shared else td.memmap_(prefix=tempfile.mkdtemp(dir=work))
    elif how.startswith("HF"):
        cache = tempfile.mkdtemp(dir=work)
        keep = datasets.Dataset.from_parquet(path, cache_dir=cache, keep_in_memory=False)
    else:
        raise ValueError(how)
    seconds = time.perf_counter() - t0
    del keep
    return {"s": seconds}


def write_files(tmp: str, nbytes: int) -> dict[str, str]:
    """The same rows as .npy, HDF5 contiguous / chunked / gzip, Parquet and HDF5 records."""
    import h5py

    f = cases.write_files(tmp, "load", nbytes, 4096, ("parquet",))
    src = np.load(f.npy, mmap_mode="r")
    files = {"npy": f.npy, "parquet": str(f.parquet), "work": f.work_dir}
    chunked = {"chunks": (256, 1024)}
    for name, kw in [
        ("hdf5 contiguous", {}),
        ("hdf5 chunked", chunked),
        ("hdf5 gzip", {**chunked, "compression": "gzip", "compression_opts": 1}),
    ]:
        files[name] = os.path.join(tmp, name.replace(" ", "_") + ".h5")
        with h5py.File(files[name], "w") as h:
            d = h.create_dataset("data", shape=src.shape, dtype=np.float32, **kw)
            for a in range(0, len(src), 16384):
                d[a : a + 16384] = src[a : a + 16384]
    rec = np.dtype([("x", "<f4"), ("y", ">f8"), ("v", "<f4", (4,)), ("id", "<i8")])
    rec = np.dtype([*rec.descr, ("tag", "S8"), ("pos", [("lat", "<f8"), ("lon", "<f8")])])
    rows = nbytes // rec.itemsize
    files["records"] = os.path.join(tmp, "records.h5")
    with h5py.File(files["records"], "w") as h:
        d = h.create_dataset("rec", (rows,), rec, chunks=(1 << 14,))
        for a in range(0, rows, 1 << 18):
            block = np.zeros(min(1 << 18, rows - a), rec)
            block["x"] = block["id"] = np.arange(a, a + len(block))
            block["tag"] = b"tag"
            d[a : a + len(block)] = block
    for path in files.values():
        if os.path.isfile(path):
            cases.warm(path)
    return files


HUGE_CHILD = """
import json, sys, time, shareddata as sd
def huge():
    return sum(int(x.split()[1]) << 10 for x in open("/proc/meminfo") if "ShmemHugePages" in x)
h, t0 = huge(), time.perf_counter()
ds = sd.NumpyDataset(sys.argv[1], progress=False, storage_dir=sys.argv[2])
print(json.dumps({"s": time.perf_counter() - t0, "huge_bytes": huge() - h}))
"""


def huge_pages(npy: str, nbytes: int, reps: int, tmp: str) -> dict[str, Any]:
    """``.npy`` loads with storage_dir on tmpfs huge=never / huge=advise (root, unshare)."""
    out: dict[str, Any] = {"shmem_enabled": shmem_enabled()}
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return {**out, "skipped": "needs root and unshare(1) for a private tmpfs mount"}
    env = {**os.environ, "PYTHONPATH": os.path.dirname(cases.__file__) + "/../.."}
    for option in ("never", "advise"):
        mount, runs = os.path.join(tmp, f"huge-{option}"), []
        os.makedirs(mount, exist_ok=True)
        for _ in range(reps):
            script = (
                f"mount -t tmpfs -o size={(nbytes >> 20) + 64}m,huge={option} tmpfs {mount} && "
                f"{sys.executable} -c '{HUGE_CHILD}' {npy} {mount}"
            )
            proc = subprocess.run(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if proc.returncode != 0:
                return {**out, "skipped": f"tmpfs mount failed: {proc.stderr.strip()[-300:]}"}
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out[option] = {k: median(r[k] for r in runs) for k in ("s", "huge_bytes")}
        out[option]["min_s"] = min(r["s"] for r in runs)
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("s", "peak_private", "retained_private")
    return {**{k: median(r[k] for r in runs) for k in keys}, "runs": [r["s"] for r in runs]}


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every load at each size (256 MiB and 1 GiB; 4 MiB quick; ``--size``: that one)."""
    sizes = [opts.size] if opts.size else [4 * MIB] if quick else [256 * MIB, GIB]
    peers = [
        p
        for p in PEERS
        if NEEDS.get(p, "") not in opts.status or not opts.status[NEEDS[p]].startswith("not")
    ]
    out: dict[str, Any] = {
        "by_size": {},
        "peers": {p: PEERS[p][1] for p in PEERS},
        "status": opts.status,
    }
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="sd-load-", dir=opts.tmp_dir) as tmp:
            files = write_files(tmp, size)
            lim = limits.measure_all(
                opts.runner,
                files["npy"],
                opts.reps,
                limits.TOUCH[2:] + [limits.COPY, *limits.FILLS],
            )
            ways = [(f, how, "") for f in FORMATS for how in ("ours", "baseline")]
            ways += [(PEERS[p][0], p, "") for p in peers]
            ways += [(f, what, patch) for f, what, patch in ABLATIONS]
            ways += [("records", name, patch) for name, patch in RECORDS.items()]
            runs: dict[str, list[dict[str, Any]]] = {}
            errors: dict[str, str] = {}
            for _ in range(opts.reps):  # alternated: machine noise hits every way alike
                for fmt, how, patch in ways:
                    key = f"{fmt}|{how}"
                    if key in errors:
                        continue
                    try:
                        r = opts.runner.run(
                            "harness.topics.load",
                            "load",
                            how="ours" if patch and fmt != "records" else how,
                            fmt=fmt,
                            path=files[fmt],
                            work=files["work"],
                            patch=patch,
                        )
                    except (RuntimeError, TimeoutError) as e:
                        errors[key] = str(e)[-300:]
                        continue
                    runs.setdefault(key, []).append(r)
                    for name in os.listdir(files["work"]):
                        shutil.rmtree(os.path.join(files["work"], name), ignore_errors=True)
            nbytes = os.path.getsize(files["npy"]) - limits.npy_offset(files["npy"])
            huge = (
                {"shmem_enabled": shmem_enabled(), "skipped": "quick run"}
                if quick
                else huge_pages(files["npy"], nbytes, opts.reps, tmp)
            )
            out["by_size"][str(nbytes)] = {
                "loads": {k: _summary(v) for k, v in runs.items()},
                "errors": errors,
                "limits": lim,
                "huge_pages": huge,
                "records_bytes": os.path.getsize(files["records"]),
            }
            print(f"  load {size >> 20} MiB: done", flush=True)
    return out


def targets(r: dict[str, Any]) -> list[list[str]]:
    """Issue 3 (every format) and issue 7 (``.npy``, contiguous HDF5, Parquet, build)."""
    size = max(r["by_size"], key=int)
    res, n, rows = r["by_size"][size], int(size), []
    limit = limits.fill_limit_s(res["limits"])
    at = f"{n / MIB:.0f} MiB"
    for fmt in FORMATS:
        o, b = res["loads"].get(f"{fmt}|ours"), res["loads"].get(f"{fmt}|baseline")
        if not o or not b:
            continue
        label = BASELINE[fmt.split()[0]]
        t, peak, after = o["s"] / b["s"], o["peak_private"] / n, o["retained_private"] / n
        goal = 1.0 if fmt == "parquet" else 1.2 if fmt in ("npy", "hdf5 contiguous") else 1.3
        rows.append(
            [
                f"{fmt} load / {label}, {at}",
                fx(t),
                f"<= {goal}x",
                verdict(t, goal, False),
                f"fastest runs {min(o['runs']) / min(b['runs']):.2f}x",
            ]
        )
        rows.append(
            [
                f"{fmt} peak private / data, {at}",
                f"{peak:.3f}",
                "<= 0.25",
                verdict(peak, 0.25, False),
                f"private after {after:.3f} (<= 0.05: {verdict(after, 0.05, False)})",
            ]
        )
        if limit and fmt in ("npy", "hdf5 contiguous"):
            v = limit / o["s"]
            rows.append(
                [
                    f"{fmt} load, of the fill limit, {at}",
                    f"{v:.2f}",
                    ">= 0.8",
                    verdict(v, 0.8, True),
                    f"fill limit {limit:.3f} s",
                ]
            )
        if fmt == "parquet":
            v = o["peak_private"] / max(b["peak_private"], 1)
            rows.append(
                [
                    f"parquet peak / read_table's peak, {at}",
                    f"{v:.3f}",
                    "<= 0.25",
                    verdict(v, 0.25, False),
                    "",
                ]
            )
    o, t = res["loads"].get("npy|ours"), res["loads"].get("npy|tensordict memmap")
    if o and t:
        v = o["s"] / t["s"]
        rows.append(
            [
                f"build time, shareddata / tensordict memmap, {at}",
                fx(v),
                "<= 1.0x",
                verdict(v, 1.0, False),
                "",
            ]
        )
    return rows


def render(r: dict[str, Any]) -> str:
    """Per size: formats against their private reads, peers, optimisations, records, huge pages."""
    lines = [
        "## Loads into shared memory",
        "",
        "Each load in a fresh process from a warm page cache, ours and the others "
        "alternating; peak private memory = `RssAnon` sampled every ~1 ms, minus its value "
        "before; *of limit* = the fill limit's time / this load's time (1.00 = as fast as "
        "this machine fills fresh shared pages from a file; see the limits).",
        "",
    ]
    for size, res in r["by_size"].items():
        lines += _render_size(r, int(size), res)
    return "\n".join(lines)


def _render_size(r: dict[str, Any], n: int, res: dict[str, Any]) -> list[str]:
    loads, limit, lines = res["loads"], limits.fill_limit_s(res["limits"]), []

    def of(s: float) -> str:
        return f"{n / s / 1e9:.2f}" + (f" ({limit / s:.2f})" if limit else "")

    def mem(x: dict[str, Any]) -> list[str]:
        return [f"{x['peak_private'] / n:.3f}", f"{x['retained_private'] / n:.3f}"]

    rows = []
    for fmt in FORMATS:
        o, b = loads.get(f"{fmt}|ours"), loads.get(f"{fmt}|baseline")
        if o and b:
            fastest = f"{min(o['runs']) / min(b['runs']):.2f}x"
            rows.append(
                [
                    fmt,
                    BASELINE[fmt.split()[0]],
                    f"{o['s']:.3f}",
                    of(o["s"]),
                    f"{b['s']:.3f}",
                    fx(o["s"] / b["s"]),
                    fastest,
                    *mem(o),
                    *mem(b),
                ]
            )
        else:
            rows.append(
                [
                    fmt,
                    "failed",
                    res["errors"].get(f"{fmt}|ours", res["errors"].get(f"{fmt}|baseline", "-"))[
                        :80
                    ],
                ]
            )
    lines += [
        f"### {n / MIB:.0f} MiB: each format against its fastest private read",
        "",
        f"Fill limit {limit or float('nan'):.3f} s. Every run (s): "
        + "; ".join(
            f"{k}: {v['runs']}"
            for k, v in loads.items()
            if k.split("|")[0] in FORMATS and k.split("|")[1] in ("ours", "baseline")
        )
        + ".",
        "",
        table(
            [
                "format",
                "baseline",
                "ours s",
                "ours GB/s (of limit)",
                "baseline s",
                "ours / baseline",
                "fastest runs",
                "ours peak / data",
                "ours after / data",
                "baseline peak / data",
                "baseline after / data",
            ],
            rows,
        ),
        "",
    ]
    rows = []
    named = {"shareddata": ("npy|ours", "`sd.NumpyDataset(npy)`")}
    named |= {p: (f"{PEERS[p][0]}|{p}", PEERS[p][1]) for p in PEERS}
    named["shareddata from Parquet"] = ("parquet|ours", "`sd.ParquetDataset(parquet)`")
    for name, (key, what) in named.items():
        x = loads.get(key)
        need = NEEDS.get(name)
        if need and r["status"].get(need, "").startswith("not"):
            rows.append(cases.missing_row(name, 6))
        elif x:
            rows.append([name, what, f"{x['s']:.3f}", of(x["s"]), *mem(x)])
        else:
            rows.append([name, what, f"failed: {res['errors'].get(key, '-')[:60]}", "", "", ""])
    lines += [
        f"### {n / MIB:.0f} MiB: building a shareable dataset",
        "",
        table(
            [
                "method",
                "",
                "s",
                "GB/s (of limit)",
                "peak private / data",
                "private after / data",
            ],
            rows,
        ),
        "",
    ]
    rows = []
    for fmt, what, _ in ABLATIONS:
        x, o = loads.get(f"{fmt}|{what}"), loads.get(f"{fmt}|ours")
        if x and o:
            rows.append(
                [
                    fmt,
                    what,
                    f"{x['s']:.3f}",
                    f"{o['s']:.3f}",
                    fx(x["s"] / o["s"]),
                    f"{x['peak_private'] / n:.3f} -> {o['peak_private'] / n:.3f}",
                ]
            )
    w = res["limits"]["ways"]
    seq, overlap = w[limits.FILLS[0]]["s"], w[limits.FILLS[1]]["s"]
    rows.append(
        [
            "npy, raw system calls (limits)",
            "all pages first, then the read (instead of allocating ahead of it)",
            f"{seq:.3f}",
            f"{overlap:.3f}",
            fx(seq / overlap),
            "",
        ]
    )
    lines += [
        f"### {n / MIB:.0f} MiB: what each optimisation gains",
        "",
        "The same load with one optimisation switched off (a patch in the child), or done "
        "another way tried and not kept. Gain = that time / shareddata's.",
        "",
        table(
            [
                "format",
                "switched off / tried instead",
                "that s",
                "shareddata s",
                "gain",
                "peak private / data (that -> ours)",
            ],
            rows,
        ),
        "",
    ]
    rb = res["records_bytes"]
    rows = [
        [
            name,
            f"{x['s']:.2f}",
            f"{x['peak_private'] / MIB:.1f}",
            f"{x['peak_private'] / rb:.3f}",
        ]
        for name in RECORDS
        if (x := loads.get(f"records|{name}"))
    ]
    lines += [
        f"### {n / MIB:.0f} MiB: HDF5 records (a compound dataset, {rb / MIB:.0f} MiB)",
        "",
        table(["case", "s", "peak private MiB", "of the data"], rows),
        "",
    ]
    hp = res["huge_pages"]
    text = (
        f"`shmem_enabled` = `{hp['shmem_enabled']}` (memfd segments get huge pages under "
        "`always`, `within_size`, `force`, or `advise`, which shareddata asks for)."
    )
    if "skipped" in hp:
        lines += [text + f" Load with huge pages: skipped ({hp['skipped']}).", ""]
    else:
        rows = [
            [
                f"huge={k}",
                f"{hp[k]['s']:.3f}",
                f"{hp[k]['min_s']:.3f}",
                f"{hp[k]['huge_bytes'] / MIB:.0f} MiB",
            ]
            for k in ("never", "advise")
        ]
        lines += [
            text + " The `.npy` load with `storage_dir` on a tmpfs in a private mount namespace:",
            "",
            table(["tmpfs", "s", "fastest s", "huge pages used"], rows),
            "",
        ]
    return lines


def plot_png(r: dict[str, Any], img_dir: str) -> dict[str, str]:
    """Build time and peak private memory of each way, per size."""
    sizes = list(r["by_size"])
    keys = ["npy|ours", *(f"{PEERS[p][0]}|{p}" for p in PEERS), "parquet|ours"]
    width = 0.8 / max(1, len(sizes))

    def draw(ax: Any, i: int) -> None:
        field = ("s", "peak_private")[i]
        for j, size in enumerate(sizes):
            loads, scale = r["by_size"][size]["loads"], 1 if i == 0 else int(size)
            ys = [loads.get(k, {}).get(field, 0) / scale for k in keys]
            ax.bar(
                [k + j * width for k in range(len(keys))],
                ys,
                width,
                label=f"{int(size) / MIB:.0f} MiB",
            )
        ax.set_xticks(
            range(len(keys)),
            [k.split("|")[1].replace("ours", k.split("|")[0]) for k in keys],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.set_ylabel(("seconds", "peak private memory / data")[i])

    path = os.path.join(img_dir, "bench-build.png")
    return {"build time and peak memory": path} if plot(path, 2, draw) else {}
