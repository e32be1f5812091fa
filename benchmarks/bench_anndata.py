"""A single-cell .h5ad: sd.HDF5Dataset against anndata.read_h5ad, load and memory.

Writes a CSR ``.h5ad`` of 20,000 cells x 2,000 genes at 5% density (float32 counts,
obs with a categorical and two numbers) with anndata, then runs each case in a fresh
interpreter, alternating the cases within each repetition so that a noisy neighbour
hits both:

* load time: ``anndata.read_h5ad`` (everything in private memory) against
  ``sd.HDF5Dataset`` (X as CSR rows plus obs, into shared memory);
* bytes: X's arrays as anndata holds them against ``ds.nbytes`` (shared), and what
  X would take densified (it never is);
* peak memory of the load (RSS sampled every millisecond, above the RSS before it:
  the data itself included, shared pages too);
* duplication with 4 spawn workers measured by ``sd.verify`` (one epoch): the
  shareddata dataset, and the plain Dataset a user writes over the AnnData object.

    .venv/bin/python benchmarks/bench_anndata.py              # ~4 min on 2 cores
    .venv/bin/python benchmarks/bench_anndata.py --quick      # 2,000 cells, 1 repetition

Writes ``benchmarks/results/anndata.md`` and ``.json`` (``--out-dir`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENES, DENSITY = 2000, 0.05

PRELUDE = """
import json, os, time, warnings
warnings.simplefilter("ignore")
import h5py  # imported before the measures, as anndata is
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
import shareddata as sd
PATH = {path!r}

import threading
import psutil


class Peak:
    '''The highest RSS of this process while the block runs (sampled every ms), in MiB.'''
    def __enter__(self):
        self.base = self.top = psutil.Process().memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()
        return self
    def _sample(self):
        process = psutil.Process()
        while not self.done.wait(0.001):
            self.top = max(self.top, process.memory_info().rss)
    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.top = max(self.top, psutil.Process().memory_info().rss)
        self.mib = (self.top - self.base) / 2**20

class AnnDataCells(Dataset):
    '''What a user writes over an AnnData object: one dense cell per item.'''
    def __init__(self, adata):
        self.adata = adata
    def __len__(self):
        return self.adata.n_obs
    def __getitem__(self, i):
        return {{"X": torch.from_numpy(self.adata.X[i].toarray()[0]),
                 "cell_type": int(self.adata.obs["cell_type"].cat.codes.iloc[i])}}
"""

CASES: dict[str, str] = {
    "anndata.read_h5ad": """
        import anndata as ad
        with Peak() as peak:
            t = time.perf_counter()
            adata = ad.read_h5ad(PATH)
            seconds = time.perf_counter() - t
        x = adata.X
        held = x.data.nbytes + x.indices.nbytes + x.indptr.nbytes
        print(json.dumps({"s": seconds, "bytes": held, "peak_mib": peak.mib,
                          "dense_bytes": x.shape[0] * x.shape[1] * x.dtype.itemsize}))
    """,
    "sd.HDF5Dataset": """
        with Peak() as peak:
            t = time.perf_counter()
            ds = sd.HDF5Dataset(PATH, progress=False)
            seconds = time.perf_counter() - t
        print(json.dumps({"s": seconds, "bytes": ds.specs["X"].nbytes,
                          "all_bytes": ds.nbytes, "peak_mib": peak.mib}))
    """,
    "verify sd.HDF5Dataset, 4 spawn workers": """
        ds = sd.HDF5Dataset(PATH, ["X", "obs/cell_type"], progress=False)
        loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=4,
                            multiprocessing_context="spawn")
        report = sd.verify(loader, max_duplication=None)
        print(json.dumps({"duplication": report.duplication,
                          "dataset_bytes": report.dataset_bytes}))
    """,
    "verify AnnData in a plain Dataset, 4 spawn workers": """
        import anndata as ad
        loader = DataLoader(AnnDataCells(ad.read_h5ad(PATH)), batch_size=256, shuffle=True,
                            num_workers=4, multiprocessing_context="spawn")
        report = sd.verify(loader, max_duplication=None)
        print(json.dumps({"duplication": report.duplication,
                          "dataset_bytes": report.dataset_bytes}))
    """,
}


def prepare(path: str, cells: int) -> None:
    """The .h5ad: CSR float32 counts, obs with a categorical, written by anndata."""
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    x = sp.random(cells, GENES, density=DENSITY, format="csr", dtype=np.float32, random_state=0)
    x.data = np.floor(x.data * 30) + 1
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["B", "T", "NK", "Mono", "DC"], cells)),
            "n_counts": np.asarray(x.sum(axis=1)).ravel(),
            "pct_mito": rng.random(cells).astype(np.float32),
        },
        index=[f"cell{i}" for i in range(cells)],
    )
    ad.AnnData(X=x, obs=obs).write_h5ad(path)


def run_case(code: str, path: str, timeout: float) -> dict:
    """Run ``code`` as a script file (spawn workers re-import it) in a fresh interpreter."""
    body = textwrap.indent(textwrap.dedent(code), "    ")
    script = PRELUDE.format(path=path) + '\nif __name__ == "__main__":\n' + body
    file = os.path.join(os.path.dirname(path), "case.py")
    with open(file, "w") as f:
        f.write(script)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, file], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(results: dict) -> str:
    runs = results["runs"]
    ad_runs, sd_runs = runs["anndata.read_h5ad"], runs["sd.HDF5Dataset"]
    t_ad, t_sd = _median(ad_runs, "s"), _median(sd_runs, "s")
    b_ad, b_sd = _median(ad_runs, "bytes"), _median(sd_runs, "bytes")
    p_ad, p_sd = _median(ad_runs, "peak_mib"), _median(sd_runs, "peak_mib")
    dense = _median(ad_runs, "dense_bytes")
    dup_sd = _median(runs["verify sd.HDF5Dataset, 4 spawn workers"], "duplication")
    dup_ad = _median(runs["verify AnnData in a plain Dataset, 4 spawn workers"], "duplication")
    mib = 1 << 20
    return "\n".join(
        [
            "# A single-cell .h5ad: sd.HDF5Dataset against anndata.read_h5ad",
            "",
            f"{results['cells']:,} cells x {GENES:,} genes, CSR at {DENSITY:.0%} density "
            f"({results['nnz']:,} nonzeros, float32), written by anndata {results['anndata']}; "
            f"medians of {results['reps']} repetitions, each case in a fresh interpreter "
            f"({results['when']}). Produced by `benchmarks/bench_anndata.py`.",
            "",
            "| measure | anndata.read_h5ad | sd.HDF5Dataset | shareddata / anndata |",
            "|---|---:|---:|---:|",
            f"| load time (X + obs) | {t_ad:.3f} s | {t_sd:.3f} s | {t_sd / t_ad:.2f}x |",
            f"| X held (indptr + indices + data) | {b_ad / mib:.1f} MiB private | "
            f"{b_sd / mib:.1f} MiB shared | {b_sd / b_ad:.2f}x |",
            f"| peak RSS growth of the load (data included) | {p_ad:.0f} MiB | {p_sd:.0f} MiB | "
            f"{p_sd / p_ad:.2f}x |"
            if p_ad
            else "| peak private memory | - | - | - |",
            f"| X densified (never done) | {dense / mib:.0f} MiB | - | - |",
            "",
            "`sd.verify` over one epoch, batch 256, 4 spawn workers (how many times the data "
            "is held by the loader's processes):",
            "",
            "| dataset | duplication |",
            "|---|---:|",
            f"| sd.HDF5Dataset(X, obs/cell_type) | {dup_sd:.2f}x |",
            f"| the AnnData object in a plain Dataset | {dup_ad:.2f}x |",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 cells, 1 repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cells", type=int, default=20_000)
    parser.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = parser.parse_args()
    cells, reps = (2_000, 1) if args.quick else (args.cells, args.reps)
    from importlib.metadata import version

    with tempfile.TemporaryDirectory(prefix="bench-anndata") as tmp:
        path = os.path.join(tmp, "cells.h5ad")
        prepare(path, cells)
        import h5py

        with h5py.File(path) as f:
            nnz = int(f["X/data"].shape[0])
        runs: dict[str, list[dict]] = {name: [] for name in CASES}
        for rep in range(reps):
            for name, code in CASES.items():
                runs[name].append(run_case(code, path, timeout=600))
                print(f"rep {rep + 1}/{reps} {name}: {runs[name][-1]}", flush=True)
    results = {
        "cells": cells, "nnz": nnz, "reps": reps, "runs": runs,
        "anndata": version("anndata"), "when": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_anndata.py" + (" --quick" if args.quick else ""),
    }  # fmt: skip
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "anndata.json"), "w") as f:
        json.dump(results, f, indent=1)
    page = render(results)
    with open(os.path.join(args.out_dir, "anndata.md"), "w") as f:
        f.write(page)
    print(page)


if __name__ == "__main__":
    main()
