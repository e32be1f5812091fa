"""Format loads: shareddata vs each format's fastest private read, and the machine's limit.

    python benchmarks/bench_formats.py [--size 1GiB] [--repeats 3] [--quick]

One run measures, side by side (every load in a fresh process: a fork of a "zygote"
process that imported numpy, torch, h5py, pyarrow and shareddata once; median of
``--repeats``, ours and the baseline alternating; warm page cache):

1. **Limits.** First touch of ``size`` fresh bytes: private numpy (with and without
   transparent huge pages), shared memfd pages written by one thread, shared pages
   populated by shareddata's threads (``_storage.populate``); and the copy from the
   page cache into pages already touched. The *first-touch + copy* limit is the
   fastest shared first touch plus that copy: what any load into shared memory costs
   here at least.
2. **Loads** of ``size`` bytes of float32 rows of 4 KiB: ``.npy``, HDF5 contiguous,
   chunked and gzip, Parquet (16384-row row groups); shareddata vs ``np.load``, h5py
   ``read_direct`` into ``np.empty`` and ``pq.read_table``: wall time, peak private
   memory during the load (``RssAnon`` sampled every ~2 ms) and private memory left
   after it. Each time is also given as a fraction of the limit (limit / time).
3. **Optimisations**: each load optimisation of shareddata switched off in turn
   (by patching the library in the child), so its gain is measured in this run.
4. **Huge pages**: what ``shmem_enabled`` allows here; as root, a ``.npy`` load with
   ``storage_dir`` on a tmpfs mounted ``huge=never`` vs ``huge=advise`` in a private
   mount namespace (the library asks for huge pages with ``MADV_HUGEPAGE``).
5. **Strings**: a 1M-row Parquet file with a string column, 4 spawn workers, one
   epoch: ``sd.verify`` duplication and total PSS for ``ParquetDataset`` vs
   ``read_table().to_pylist()`` held by a plain Dataset.

Writes ``benchmarks/results/formats.md`` and ``formats.json``. ``run()`` is the entry
point for ``benchmarks/bench_suite.py``; ``--quick`` runs small sizes (~30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MIB = 1 << 20
ROW_FLOATS = 1024  # 4 KiB rows
TARGETS = {
    "time_vs_library": 1.3,  # issue 3: ours / the library's fastest private read, at most
    "peak_private": 0.25,  # issue 3: peak private / data, at most
    "after_private": 0.05,  # issue 3: private left after the load / data, at most
    "of_limit": 0.8,  # issue 7: .npy and contiguous HDF5, limit / time, at least
    "vs_private": 1.2,  # issue 7: .npy and contiguous HDF5 / np.load, read_direct, at most
    "parquet_time": 1.0,  # issue 7: ours / read_table, at most
    "parquet_peak": 0.25,  # issue 7: ours' peak / read_table's peak, at most
    "strings": 1.05,  # issue 3: duplication with 4 spawn workers, at most
}

# -- fresh processes: forks of one zygote ----------------------------------------------

ZYGOTE = r"""
import gc, json, os, sys, time
import numpy as np, torch, h5py, pyarrow, pyarrow.parquet, shareddata
import shareddata._storage, shareddata.sources.hdf5, shareddata.sources.npy
import shareddata.sources.parquet

def readline():
    buf = b""
    while not buf.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            os._exit(0)
        buf += c
    return buf.decode()

def say(*parts):
    os.write(1, (" ".join(map(str, parts)) + "\n").encode())

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0

say("ZYGOTE")
while True:
    job = json.loads(readline())
    pid = os.fork()
    if pid == 0:
        try:
            env = {"__name__": "job"}
            exec(job["setup"], env)
            gc.collect()
            say("READY", os.getpid(), anon())
            readline()
            t0 = time.perf_counter()
            exec(job["code"], env)
            seconds = time.perf_counter() - t0
            say("DONE", seconds, anon(), json.dumps(env.get("result", {})))
        except BaseException as e:
            say("ERROR", json.dumps(f"{type(e).__name__}: {e}"))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    say("EXITED")
"""


def _anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Zygote:
    """A process with every module imported that forks one fresh child per measurement."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._buf = b""
        self._expect("ZYGOTE", timeout=120)

    def _line(self, timeout: float, sample: Any = None) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if sample is not None:
                sample()
            ready, _, _ = select.select([fd], [], [], 0.002 if sample else 0.5)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError("the zygote process ended")
                self._buf += chunk
            elif time.monotonic() > deadline:
                raise TimeoutError("no answer from the zygote process")
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _expect(self, word: str, timeout: float = 600, sample: Any = None) -> list[str]:
        line = self._line(timeout, sample)
        parts = line.split(" ", 3)
        if parts[0] == "ERROR":
            self._line(60)  # EXITED
            raise RuntimeError(f"child failed: {json.loads(line.split(' ', 1)[1])}")
        if parts[0] != word:
            raise RuntimeError(f"expected {word}, got {line[:200]!r}")
        return parts[1:]

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def run(self, code: str, setup: str = "") -> dict[str, Any]:
        """Run ``code`` in a fresh child (after ``setup``): seconds, peak and final RssAnon."""
        setup = "import os\nimport numpy as np\n" + setup
        self._send(json.dumps({"setup": setup, "code": code}))
        pid_text, base_text = self._expect("READY")
        pid, base = int(pid_text), int(base_text)
        peak = [base]

        def sample() -> None:
            peak[0] = max(peak[0], _anon(pid))

        self._send("go")
        seconds, after, extra = self._expect("DONE", sample=sample)
        self._expect("EXITED")
        return {
            "s": float(seconds),
            "peak": max(peak[0], int(after)) - base,
            "after": int(after) - base,
            **json.loads(extra),
        }

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key medians of numeric results, plus every time measured."""
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in runs)
        for k in runs[0]
        if isinstance(runs[0][k], (int, float))
    }
    out["min_s"] = min(r["s"] for r in runs)
    out["runs"] = [round(r["s"], 4) for r in runs]
    return out


# -- data --------------------------------------------------------------------------------


def make_files(tmp: str, nbytes: int) -> dict[str, str]:
    """The same float32 rows as .npy, HDF5 (contiguous, chunked, gzip) and Parquet."""
    import h5py
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = max(1, nbytes // (4 * ROW_FLOATS))
    data = np.random.default_rng(0).random((rows, ROW_FLOATS), dtype=np.float32)
    files = {"npy": os.path.join(tmp, "data.npy")}
    np.save(files["npy"], data)
    for name, kw in [
        ("hdf5 contiguous", {}),
        ("hdf5 chunked", {"chunks": (256, ROW_FLOATS)}),
        ("hdf5 gzip", {"chunks": (256, ROW_FLOATS), "compression": "gzip", "compression_opts": 1}),
    ]:
        files[name] = os.path.join(tmp, name.replace(" ", "_") + ".h5")
        with h5py.File(files[name], "w") as f:
            f.create_dataset("x", data=data, **kw)
    files["parquet"] = os.path.join(tmp, "data.parquet")
    column = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), ROW_FLOATS)
    pq.write_table(pa.table({"x": column}), files["parquet"], row_group_size=16384)
    return files


def warm(path: str) -> None:
    """Read a file once so that every load finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def npy_data_offset(path: str) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


# -- 1. limits ---------------------------------------------------------------------------

SHARED_SETUP = """
import mmap, os, ctypes, numpy as np
from shareddata import _storage
n = {n}
fd = os.memfd_create("bench", os.MFD_CLOEXEC)
os.ftruncate(fd, n)
m = mmap.mmap(fd, n)
a = np.frombuffer(m, np.uint8)
address = ctypes.addressof(ctypes.c_char.from_buffer(m))
"""

LIMITS = {
    "private numpy, huge pages": ("", "a = np.empty({n}, np.uint8); a.fill(1)"),
    "private numpy, 4 KiB pages": (
        "np._core.multiarray._set_madvise_hugepage(False)",
        "a = np.empty({n}, np.uint8); a.fill(1)",
    ),
    "shared memfd, written by 1 thread": (SHARED_SETUP, "a.fill(1)"),
    "shared memfd, populated by 1 thread": (
        SHARED_SETUP,
        "assert _storage.populate(address, n, threads=1) == 0",
    ),
    "shared memfd, populated by shareddata's threads": (
        SHARED_SETUP,
        "assert _storage.populate(address, n) == 0\nresult = "
        "{{'threads': _storage.population_threads(n)}}",
    ),
    "copy from page cache into touched pages": (
        SHARED_SETUP
        + "assert _storage.populate(address, n) == 0\n"
        + "src = os.open({path!r}, os.O_RDONLY)\nview = memoryview(m)\n",
        "pos = 0\nwhile pos < n:\n"
        "    pos += os.preadv(src, [view[pos:pos + (64 << 20)]], {offset} + pos)",
    ),
}
FILL_SETUP = SHARED_SETUP + "src = os.open({path!r}, os.O_RDONLY)\nview = memoryview(m)\n"
READ = (
    "pos = {lo}\nwhile pos < {hi}:\n"
    "    pos += os.preadv(src, [view[pos:min({hi}, pos + (64 << 20))]], {offset} + pos)\n"
)
LIMITS["fill from the file: populate in threads, then read"] = (
    FILL_SETUP,
    "assert _storage.populate(address, n) == 0\n" + READ.format(lo=0, hi="n", offset="{offset}"),
)
LIMITS["fill from the file: threads populate 64 MiB ahead of the read"] = (
    FILL_SETUP,
    "import threading\n"
    "step = 64 << 20\n"
    "parts = [(lo, min(n, lo + step)) for lo in range(0, n, step)]\n"
    "done = [threading.Event() for _ in parts]\n"
    "left = iter(range(len(parts)))\n"
    "lock = threading.Lock()\n"
    "def work():\n"
    "    while True:\n"
    "        with lock:\n"
    "            k = next(left, None)\n"
    "        if k is None:\n"
    "            return\n"
    "        lo, hi = parts[k]\n"
    "        assert _storage._madvise(address + lo, hi - lo, 23) == 0\n"
    "        done[k].set()\n"
    "threads = [threading.Thread(target=work) for _ in range(_storage.population_threads(n))]\n"
    "for t in threads:\n"
    "    t.start()\n"
    "for k, (lo, hi) in enumerate(parts):\n"
    "    done[k].wait()\n"
    + "".join(
        "    " + line + "\n"
        for line in READ.format(lo="lo", hi="hi", offset="{offset}").split("\n")
        if line
    )
    + "for t in threads:\n    t.join()",
)
SHARED_TOUCH = [k for k in LIMITS if k.startswith("shared")]
FILLS = [k for k in LIMITS if k.startswith("fill")]


def bench_limits(z: Zygote, npy: str, nbytes: int, repeats: int) -> dict[str, Any]:
    offset = npy_data_offset(npy)
    n = os.path.getsize(npy) - offset
    out: dict[str, Any] = {}
    for name, (setup, code) in LIMITS.items():
        runs = [
            z.run(code.format(n=n, path=npy, offset=offset), setup.format(n=n, path=npy))
            for _ in range(repeats)
        ]
        out[name] = median_of(runs)
        print(f"  limit {name}: {out[name]['s']:.3f} s", flush=True)
    touch = min(out[k]["s"] for k in SHARED_TOUCH)
    copy = out["copy from page cache into touched pages"]["s"]
    out["first-touch + copy limit"] = {
        "s": min(touch + copy, *(out[k]["s"] for k in FILLS)),
        "touch": min(SHARED_TOUCH, key=lambda k: out[k]["s"]),
    }
    out["first-touch + copy limit, 1 thread"] = {
        "s": out["shared memfd, written by 1 thread"]["s"]
        + out["copy from page cache into touched pages"]["s"]
    }
    out["private first-touch + copy"] = {
        "s": out["private numpy, huge pages"]["s"]
        + out["copy from page cache into touched pages"]["s"]
    }
    return out


# -- 2. loads and 3. optimisations -------------------------------------------------------

OURS = {
    "npy": "ds = sd.NumpyDataset({path!r}, progress=False)",
    "hdf5": "ds = sd.HDF5Dataset({path!r}, progress=False)",
    "parquet": "ds = sd.ParquetDataset({path!r}, progress=False)",
}
BASELINES = {
    "npy": ("np.load", "a = np.load({path!r})"),
    "hdf5": (
        "h5py read_direct",
        "with h5py.File({path!r}) as f:\n"
        "    d = f['x']; a = np.empty(d.shape, d.dtype); d.read_direct(a)",
    ),
    "parquet": ("pq.read_table", "t = pyarrow.parquet.read_table({path!r}); x = t.column('x')"),
}
IMPORTS = "import numpy as np, h5py, pyarrow.parquet, shareddata as sd\n"

# Each optimisation, switched off by a patch in the child: (format, what, patch).
NO_AHEAD = (
    "from shareddata import _dataset, _storage\n"
    "_dataset.allocate = lambda *a, ahead=False, **k: _storage.allocate(*a, **k)\n"
)
ABLATIONS = [
    (
        "npy",
        "as before: posix_fallocate, then 1 thread maps the pages, then the read",
        NO_AHEAD + "import os\n"
        "def _reserve(self, by_faults, directory, what):\n"
        "    os.posix_fallocate(self.fd, 0, self.size)\n"
        "    _storage.populate(_storage._address(self.mmap), self.size, threads=1)\n"
        "_storage.Segment._reserve = _reserve",
    ),
    (
        "npy",
        "all pages allocated by the threads first, then the read (no overlap)",
        NO_AHEAD,
    ),
    (
        "npy",
        "1 allocating thread ahead of the read (instead of one per core)",
        "from shareddata import _storage\n_storage._POPULATE_MAX_THREADS = 1",
    ),
    (
        "hdf5 contiguous",
        "read_direct instead of preadv from the dataset's offset",
        "from shareddata.sources import hdf5\nhdf5.HDF5Source._raw_offset = lambda *a: None",
    ),
    (
        "hdf5 chunked",
        "read_direct instead of each chunk of whole rows preadv-ed by threads",
        "from shareddata.sources import hdf5\nhdf5.HDF5Source._inflatable = lambda *a: None",
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
]

# Alternatives tried and not kept: (format, what, code that loads the file its way).
ALTERNATIVES = [
    (
        "parquet",
        "whole row groups decoded ahead by 2 threads (own reader each) while copying",
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "import pyarrow as pa, pyarrow.parquet as pq\n"
        "path = {path!r}\n"
        "md = pq.ParquetFile(path).metadata\n"
        "groups = md.num_row_groups\n"
        "out = sd.SharedArray.empty((md.num_rows, 1024), np.float32)\n"
        "flat = out.numpy().reshape(-1)\n"
        "local = threading.local()\n"
        "def decode(i):\n"
        "    if not hasattr(local, 'pf'):\n"
        "        local.pf = pq.ParquetFile(path, metadata=md, memory_map=True)\n"
        "    return local.pf.read_row_group(i, columns=['x'], use_threads=False).column(0).chunks\n"
        "pos = 0\n"
        "with ThreadPoolExecutor(2) as ex:\n"
        "    ahead = [ex.submit(decode, i) for i in range(min(2, groups))]\n"
        "    for i in range(groups):\n"
        "        chunks = ahead[i].result()\n"
        "        ahead[i] = None\n"
        "        if i + 2 < groups:\n"
        "            ahead.append(ex.submit(decode, i + 2))\n"
        "        for c in chunks:\n"
        "            v = c.values.to_numpy()\n"
        "            flat[pos:pos + len(v)] = v\n"
        "            pos += len(v)\n"
        "        del chunks\n"
        "        pa.default_memory_pool().release_unused()\n"
        "pa.default_memory_pool().release_unused()",
    ),
]


def kind(name: str) -> str:
    return name.split()[0]


def bench_loads(
    z: Zygote, files: dict[str, str], repeats: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    loads: dict[str, Any] = {}
    ablations: dict[str, Any] = {}
    for name, path in files.items():
        warm(path)
        ours_code = OURS[kind(name)].format(path=path)
        label, base_code = BASELINES[kind(name)]
        patches = [(what, patch) for fmt, what, patch in ABLATIONS if fmt == name]
        others = [(what, code) for fmt, what, code in ALTERNATIVES if fmt == name]
        ours, theirs = [], []
        off: dict[str, list[dict[str, Any]]] = {what: [] for what, _ in patches + others}
        for _ in range(repeats):  # alternate, so that machine noise hits every method alike
            ours.append(z.run(ours_code, IMPORTS))
            theirs.append(z.run(base_code.format(path=path), IMPORTS))
            for what, patch in patches:
                off[what].append(z.run(ours_code, IMPORTS + patch))
            for what, code in others:
                off[what].append(z.run(code.format(path=path), IMPORTS))
        loads[name] = {"ours": median_of(ours), "baseline": median_of(theirs), "label": label}
        for what, runs in off.items():
            ablations[f"{name}: {what}"] = {
                "format": name,
                "without": median_of(runs),
                "with": loads[name]["ours"],
            }
        o, b = loads[name]["ours"], loads[name]["baseline"]
        print(
            f"  {name}: ours {o['s']:.3f} s (peak {o['peak'] / MIB:.0f} MiB), {label} "
            f"{b['s']:.3f} s (peak {b['peak'] / MIB:.0f} MiB)",
            flush=True,
        )
    return loads, ablations


# -- 4. huge pages -----------------------------------------------------------------------


def shmem_enabled() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read().strip()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text


HUGE_CHILD = r"""
import json, os, sys, time
import numpy as np, shareddata as sd
def meminfo(key):
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
huge = meminfo("ShmemHugePages")
t0 = time.perf_counter()
ds = sd.NumpyDataset(sys.argv[1], progress=False, storage_dir=sys.argv[2])
seconds = time.perf_counter() - t0
print(json.dumps({"s": seconds, "huge_bytes": meminfo("ShmemHugePages") - huge}))
"""


def bench_huge_pages(npy: str, nbytes: int, repeats: int, tmp: str) -> dict[str, Any]:
    """``.npy`` loads with storage_dir on tmpfs huge=never / huge=advise (root, unshare)."""
    out: dict[str, Any] = {"shmem_enabled": shmem_enabled()}
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        out["skipped"] = "needs root and unshare(1) for a private tmpfs mount"
        return out
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    size = f"{(nbytes >> 20) + 64}m"
    for option in ("never", "advise"):
        runs = []
        mount = os.path.join(tmp, f"huge-{option}")
        os.makedirs(mount, exist_ok=True)
        for _ in range(repeats):
            script = (
                f"mount -t tmpfs -o size={size},huge={option} tmpfs {mount} && "
                f"{sys.executable} -c '{HUGE_CHILD}' {npy} {mount}"
            )
            proc = subprocess.run(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                check=False,
            )
            if proc.returncode != 0:
                out["skipped"] = f"private tmpfs mount failed: {proc.stderr.strip()[-300:]}"
                return out
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out[option] = median_of(runs)
        print(f"  tmpfs huge={option}: {out[option]['s']:.3f} s", flush=True)
    return out


# -- 5. strings --------------------------------------------------------------------------


class PyListDataset(torch.utils.data.Dataset):
    """The usual way: the table's rows as Python dicts in a list (``to_pylist()``)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def make_strings(path: str, rows: int, longest: int = 120) -> None:
    """``rows`` rows: a text column (1 to ``longest`` ASCII characters), an int64 label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, longest + 1, rows)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    letters = rng.integers(97, 123, int(offsets[-1]), dtype=np.uint8)
    letters[rng.random(len(letters)) < 0.15] = 32  # spaces: words
    text = pa.LargeStringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(letters))
    table = pa.table({"text": text.cast(pa.string()), "label": np.arange(rows) % 1000})
    pq.write_table(table, path, row_group_size=1 << 17)


def child_strings(path: str, which: str, workers: int) -> None:
    """Child: one epoch of ``workers`` spawn workers, then ``sd.verify``; prints JSON."""
    import pyarrow.parquet as pq

    import shareddata as sd

    ours = sd.ParquetDataset(path, progress=False)
    nbytes = ours.nbytes
    if which == "ours":
        ds: Any = ours
    else:
        del ours
        ds = PyListDataset(pq.read_table(path).to_pylist())
    loader = torch.utils.data.DataLoader(
        ds, batch_size=1024, num_workers=workers, multiprocessing_context="spawn"
    )
    t0 = time.perf_counter()
    report = sd.verify(loader, max_duplication=None, dataset_bytes=nbytes)
    print(
        json.dumps(
            {
                "duplication": report.duplication,
                "total_pss": report.total_pss,
                "extra_bytes": report.extra_bytes,
                "dataset_bytes": nbytes,
                "baseline_bytes": report.baseline_bytes,
                "batches": report.batches,
                "s": time.perf_counter() - t0,
                "processes": [[p.role, p.pss, p.uss] for p in report.processes],
            }
        )
    )


def _strings_child(path: str, which: str, workers: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + HERE}
    proc = subprocess.run(
        [sys.executable, __file__, "--child-strings", path, which, str(workers)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"strings child ({which}) failed: {proc.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  strings {which}: duplication {result['duplication']:.3f}x", flush=True)
    return result


def bench_strings(tmp: str, rows: int, workers: int, long: bool) -> dict[str, Any]:
    """Section 5; ``long``: also ours with 1-1000 characters per row (8x the data)."""
    path = os.path.join(tmp, "strings.parquet")
    make_strings(path, rows)
    out: dict[str, Any] = {"rows": rows, "workers": workers, "file_bytes": os.path.getsize(path)}
    for which in ("ours", "to_pylist"):
        out[which] = _strings_child(path, which, workers)
    os.unlink(path)
    if long:
        make_strings(path, rows, longest=1000)
        out["ours, 1-1000 characters"] = _strings_child(path, "ours", workers)
        os.unlink(path)
    return out


# -- the run -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "usable cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "shmem_enabled": shmem_enabled(),
        "load average at start": [round(x, 2) for x in os.getloadavg()],
    }


def run(
    size: int = 1 << 30,
    repeats: int = 3,
    tmp_dir: str | None = None,
    out: str | None = None,
    quick: bool | None = None,
    strings_rows: int | None = None,
    strings_workers: int | None = None,
) -> dict[str, Any]:
    """Run every section at ``size`` bytes; write ``formats.md``/``.json`` to ``out``.

    Args:
        size: bytes of data per format.
        repeats: fresh-process loads per method (medians).
        tmp_dir: where the data files go (a temporary folder inside it).
        out: folder for ``formats.md`` and ``formats.json`` (``None``: not written).
        quick: skip the huge-page section (it re-imports per load) and shrink the
            string benchmark; default: when ``size`` is below 64 MiB.
        strings_rows: rows of the string benchmark (default 1M; 20k when ``quick``).
        strings_workers: its spawn workers (default 4; 2 when ``quick``).

    Returns:
        ``{format: {"ours", "baseline", "label"}, "limits", "optimisations",
        "huge_pages", "strings", "machine", "size", "repeats"}``; times in seconds,
        memory in bytes.
    """
    if quick is None:
        quick = size < 64 * MIB
    rows = strings_rows or (20_000 if quick else 1_000_000)
    workers = strings_workers or (2 if quick else 4)
    result: dict[str, Any] = {"size": size, "repeats": repeats, "machine": machine()}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sd-formats-", dir=tmp_dir) as tmp:
        print(f"writing {size / MIB:.0f} MiB per format to {tmp}", flush=True)
        files = make_files(tmp, size)
        nbytes = os.path.getsize(files["npy"]) - npy_data_offset(files["npy"])
        result["size"] = nbytes
        z = Zygote()
        try:
            warm(files["npy"])
            result["limits"] = bench_limits(z, files["npy"], nbytes, repeats)
            loads, ablations = bench_loads(z, files, repeats)
        finally:
            z.close()
        result.update(loads)
        result["optimisations"] = ablations
        if quick:
            result["huge_pages"] = {"shmem_enabled": shmem_enabled(), "skipped": "quick run"}
        else:
            result["huge_pages"] = bench_huge_pages(files["npy"], nbytes, repeats, tmp)
        for path in files.values():
            os.unlink(path)
        result["strings"] = bench_strings(tmp, rows, workers, long=not quick)
    result["machine"]["load average at end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = time.perf_counter() - started
    if out is not None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "formats.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "formats.md"), "w") as f:
            f.write(render(result))
    return result


# -- the report --------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _target_rows(r: dict[str, Any], formats: list[str], limit_s: float) -> list[list[str]]:
    """Each target: the median-based figure, its verdict, and the same from the fastest runs."""
    n = r["size"]
    rows = []

    def add(what: str, value: float, best: float | None, goal: str, ok: bool, fmt: str) -> None:
        text = fmt.format(value)
        rows.append([what, text, "" if best is None else fmt.format(best), goal, verdict_text(ok)])

    for name in formats:
        o, b, label = r[name]["ours"], r[name]["baseline"], r[name]["label"]
        ratio, fastest = o["s"] / b["s"], o["min_s"] / b["min_s"]
        goal = TARGETS["time_vs_library"]
        add(f"{name}: time / {label}", ratio, fastest, f"<= {goal}x", ratio <= goal, "{:.2f}x")
        peak, after = o["peak"] / n, o["after"] / n
        goal = TARGETS["peak_private"]
        add(f"{name}: peak private / data", peak, None, f"<= {goal}", peak <= goal, "{:.3f}")
        goal = TARGETS["after_private"]
        add(f"{name}: private after / data", after, None, f"<= {goal}", after <= goal, "{:.3f}")
        if name in ("npy", "hdf5 contiguous"):
            of, best = limit_s / o["s"], limit_s / o["min_s"]
            goal = TARGETS["of_limit"]
            add(f"{name}: limit / time", of, best, f">= {goal}", of >= goal, "{:.2f}")
            goal = TARGETS["vs_private"]
            add(
                f"{name}: time / {label} (issue 7)",
                ratio,
                fastest,
                f"<= {goal}x",
                ratio <= goal,
                "{:.2f}x",
            )
        if name == "parquet":
            goal = TARGETS["parquet_time"]
            add("parquet: time / read_table (issue 7)", ratio, fastest, f"<= {goal}x",
                ratio <= goal, "{:.2f}x")  # fmt: skip
            share = o["peak"] / b["peak"]
            goal = TARGETS["parquet_peak"]
            add("parquet: peak private / read_table's", share, None, f"<= {goal}",
                share <= goal, "{:.3f}")  # fmt: skip
    return rows


def verdict_text(ok: bool) -> str:
    return "met" if ok else "**missed**"


def render(r: dict[str, Any]) -> str:
    n = r["size"]
    lim = r["limits"]
    limit_s = lim["first-touch + copy limit"]["s"]
    m = r["machine"]
    formats = [k for k in r if isinstance(r[k], dict) and "ours" in r[k] and "baseline" in r[k]]
    lines = [
        f"# Format loads ({n / MIB:.0f} MiB of float32, 4 KiB rows)",
        "",
        f"`python benchmarks/bench_formats.py --size {n >> 20}MiB --repeats {r['repeats']}`, "
        f"{r['seconds']:.0f} s. Every load in a fresh process (a fork of one process that "
        f"imported everything), median of {r['repeats']} (and the fastest run), ours and the "
        "baseline alternating, warm page cache. Machine: "
        f"{m['usable cores']} cores, kernel {m['kernel']}, Python {m['python']}, torch "
        f"{m['torch']}, numpy {m['numpy']}; `shmem_enabled` = `{m['shmem_enabled']}`; load "
        f"average {m['load average at start']} at the start, {m.get('load average at end')} "
        "at the end (other work shares these cores).",
        "",
        "## 1. The machine's limits",
        "",
        f"First touch of {n / MIB:.0f} MiB of fresh pages, and the copy from the page cache "
        "into touched pages; then the whole fill of shared pages from the file done with raw "
        "system calls, first without and then with the page allocation running ahead of the "
        "read. The *first-touch + copy limit* is the fastest way found to get the file into "
        "fresh shared pages: the least any load into shared memory costs here.",
        "",
    ]
    rows = []
    for name, v in lim.items():
        best = f"{v['min_s']:.3f}" if "min_s" in v else ""
        rows.append([name, f"{v['s']:.3f}", best, f"{n / v['s'] / 1e9:.2f}"])
    lines += [table(["", "median s", "fastest s", "GB/s"], rows), ""]
    lines += [
        "## 2. Loads",
        "",
        "Private = `RssAnon` of the loading process: peak growth during the load, and what "
        "is left after it, over the data size. *Of limit* = the first-touch + copy limit's "
        "time / this load's time (1.00 = as fast as the machine allows).",
        "",
    ]
    rows = []
    for name in formats:
        o, b = r[name]["ours"], r[name]["baseline"]
        rows.append(
            [
                name,
                r[name]["label"],
                f"{o['s']:.3f}",
                f"{b['s']:.3f}",
                f"{o['s'] / b['s']:.2f}x",
                f"{o['min_s']:.3f} / {b['min_s']:.3f} = {o['min_s'] / b['min_s']:.2f}x",
                f"{limit_s / o['s']:.2f}",
                f"{o['peak'] / n:.3f}",
                f"{b['peak'] / n:.3f}",
                f"{o['after'] / n:.3f}",
                f"{b['after'] / n:.3f}",
            ]
        )
    lines += [
        table(
            [
                "format",
                "baseline",
                "ours s",
                "baseline s",
                "ours / baseline",
                "fastest runs (ours / baseline)",
                "ours of limit",
                "ours peak private / data",
                "baseline peak / data",
                "ours private after / data",
                "baseline after / data",
            ],
            rows,
        ),
        "",
        "Every run (s): "
        + "; ".join(
            f"{name}: ours {r[name]['ours']['runs']}, {r[name]['label']} "
            f"{r[name]['baseline']['runs']}"
            for name in formats
        )
        + ".",
        "",
        "Targets (issue 3: every format; issue 7: `.npy`, contiguous HDF5, Parquet); the "
        "verdict is on the medians, the fastest runs are shown next to them:",
        "",
        table(["target", "medians", "fastest runs", "goal", ""], _target_rows(r, formats, limit_s)),
        "",
    ]
    private = lim["private first-touch + copy"]["s"]
    touch = lim["private numpy, huge pages"]
    lines += [
        "What bounds `.npy` and contiguous HDF5 against `np.load` / `read_direct`: the "
        "baselines write private pages, which numpy backs with 2 MiB huge pages (first touch "
        f"+ copy {private:.3f} s); shared pages here are 4 KiB (`shmem_enabled` = "
        f"`{m['shmem_enabled']}`), and the fastest way to fill them takes {limit_s:.3f} s "
        f"({limit_s / private:.2f}x). A load into shared memory can therefore take at best "
        f"{limit_s / private:.2f}x the private read's time on this machine: the fastest runs "
        "show that ratio; section 4 shows the same load with huge pages. The baselines' own "
        f"times scatter (first touch of private huge pages: {touch['runs']} s): on this VM, "
        "memory that sat free is handed back to the host (free page reporting), and touching "
        "it again costs a host fault per page; the medians include that, the fastest runs "
        "do not.",
        "",
        "## 3. What each optimisation gains",
        "",
        "The same load with one optimisation switched off (patched in the child), or done "
        "another way that was tried and not kept, in the same run. Gain = that time / "
        "shareddata's time (medians).",
        "",
    ]
    rows = []
    for name, v in r["optimisations"].items():
        fmt, what = name.split(": ", 1)
        w, wo = v["with"], v["without"]
        rows.append(
            [
                fmt,
                what,
                f"{wo['s']:.3f}",
                f"{w['s']:.3f}",
                f"{wo['s'] / w['s']:.2f}x",
                f"{wo['peak'] / n:.3f} -> {w['peak'] / n:.3f}",
            ]
        )
    seq = lim["fill from the file: populate in threads, then read"]["s"]
    overlap = lim["fill from the file: threads populate 64 MiB ahead of the read"]["s"]
    rows.append(
        [
            "npy, raw system calls (section 1)",
            "all pages first, then the read (instead of allocating ahead of the read)",
            f"{seq:.3f}",
            f"{overlap:.3f}",
            f"{seq / overlap:.2f}x",
            "",
        ]
    )
    lines += [
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
        "## 4. Huge pages",
        "",
    ]
    hp = r["huge_pages"]
    lines.append(
        f"`/sys/kernel/mm/transparent_hugepage/shmem_enabled` = `{hp['shmem_enabled']}` "
        "(memfd segments get huge pages only under `always`, `within_size`, `force`, or "
        "`advise`, which shareddata asks for with `MADV_HUGEPAGE`)."
    )
    if "skipped" in hp:
        lines += ["", f"Load with huge pages: skipped ({hp['skipped']}).", ""]
    else:
        base = r["npy"]["baseline"]
        lines += [
            "",
            "The `.npy` load with `storage_dir` on a tmpfs mounted in a private mount "
            "namespace (the machine's settings untouched), without and with huge pages "
            "(each a fresh interpreter; medians):",
            "",
            table(
                ["tmpfs", "s", "fastest s", "huge pages used", "vs np.load (medians / fastest)"],
                [
                    [
                        f"huge={k}",
                        f"{v['s']:.3f}",
                        f"{v['min_s']:.3f}",
                        f"{v['huge_bytes'] / MIB:.0f} MiB",
                        f"{v['s'] / base['s']:.2f}x / {v['min_s'] / base['min_s']:.2f}x",
                    ]
                    for k, v in (("never", hp["never"]), ("advise", hp["advise"]))
                ],
            ),
            "",
        ]
    st = r["strings"]
    ours, base = st["ours"], st["to_pylist"]
    per_worker = [
        (uss - ours["baseline_bytes"]) / MIB
        for role, _, uss in ours["processes"]
        if role.startswith("worker")
    ]
    rows = [
        [
            label,
            f"{v['dataset_bytes'] / MIB:.1f}",
            f"{v['duplication']:.3f}x",
            f"{v['total_pss'] / MIB:.0f}",
            f"{v['extra_bytes'] / MIB:.1f}",
            f"{v['s']:.1f}",
        ]
        for label, v in (
            ("sd.ParquetDataset", ours),
            ("read_table().to_pylist() in a Dataset", base),
        )
    ]
    long = st.get("ours, 1-1000 characters")
    if long:
        rows.append(
            [
                "sd.ParquetDataset, 1-1000 characters per row",
                f"{long['dataset_bytes'] / MIB:.1f}",
                f"{long['duplication']:.3f}x",
                f"{long['total_pss'] / MIB:.0f}",
                f"{long['extra_bytes'] / MIB:.1f}",
                f"{long['s']:.1f}",
            ]
        )
    lines += [
        "## 5. Strings: memory of spawn workers after an epoch",
        "",
        f"{st['rows']:,} rows (a text column of 1-120 characters and an int64 label; "
        f"{st['file_bytes'] / MIB:.1f} MiB of Parquet), {st['workers']} spawn workers, one "
        "epoch of batches of 1024, then `sd.verify` (duplication = 1 + what the processes "
        "hold beyond one copy of the data, net of each worker's data-free interpreter, over "
        "the data size as shareddata holds it; the same size for both):",
        "",
        table(
            ["dataset", "data MiB", "duplication", "total PSS MiB", "extra MiB", "s"],
            rows,
        ),
        "",
        f"Target <= {TARGETS['strings']}x: "
        f"{verdict_text(ours['duplication'] <= TARGETS['strings'])} "
        f"({ours['duplication']:.3f}x). What is beyond one copy is each worker's working "
        "memory after iterating (USS above the data-free worker: "
        + ", ".join(f"{x:.1f}" for x in per_worker)
        + " MiB), the same whatever the data's size"
        + (
            f": with 8x longer strings the same workers read {long['duplication']:.3f}x."
            if long
            else "."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="data per format (e.g. 256MiB, 1GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    parser.add_argument("--child-strings", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_strings:
        path, which, workers = args.child_strings
        child_strings(path, which, int(workers))
        return 0
    from shareddata.cli import parse_size

    if args.quick:
        size, repeats = 16 * MIB, 1
        out = args.out or os.path.join(RESULTS, "quick")
    else:
        size, repeats = parse_size(args.size), args.repeats
        out = args.out or RESULTS
    result = run(size, repeats, out=out, quick=args.quick)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
