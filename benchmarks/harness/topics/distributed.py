"""One copy per node: 1, 2 and 4 local ranks x 2 spawn workers, node sharing vs per-rank loading.

For each number of local ranks and each way of loading, ``tests/distributed/scripts/
share_node.py`` runs under ``torchrun --standalone`` and local rank 0's cross-rank
``sd.verify`` measures every process of the node. Every configuration is also run
over a 1 MiB dataset: "net PSS" is the difference of the two totals, a check of
verify's duplication that does not depend on its per-worker baselines. Ways:
``node`` (``sd.NumpyDataset(path)``, one copy per node), ``process``
(``share="process"``: one copy per rank), ``plain`` (``TensorDataset`` per rank),
``wrap``: ``sd.SharedDataset`` of 4 KiB items, ``list``: ``sd.SharedList`` of dicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from harness.machine import MIB
from harness.render import table
from harness.runner import REPO

MODES = {
    "node": [],
    "process": ["--share", "process"],
    "plain": ["--plain"],
    "wrap node": ["--kind", "shared_dataset"],
    "wrap process": ["--kind", "shared_dataset", "--share", "process"],
    # 64 items (256 KiB of Python objects) a batch: what a metadata list serves
    "list node": ["--kind", "shared_list", "--batch-size", "64"],
    "list process": ["--kind", "shared_list", "--share", "process", "--batch-size", "64"],
}
KIND = {"node": "NumpyDataset", "process": "NumpyDataset", "plain": "TensorDataset"}


def torchrun(ranks: int, mode: str, path: str) -> dict[str, Any]:
    """One configuration under torchrun; local rank 0's report."""
    script = os.path.join(REPO, "tests", "distributed", "scripts", "share_node.py")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={ranks}", script, path, out, "--batches", "16", *MODES[mode]]
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        with open(os.path.join(out, "rank0.json")) as f:
            return json.load(f)  # type: ignore[no-any-return]


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every (ranks, mode), and the same over 1 MiB (not in a quick run)."""
    mib = (opts.size or (16 * MIB if quick else 256 * MIB)) // MIB
    rows = []
    with tempfile.TemporaryDirectory(prefix="sd-dist-", dir=opts.tmp_dir) as tmp:
        big, tiny = os.path.join(tmp, "big.npy"), os.path.join(tmp, "tiny.npy")
        rng = np.random.default_rng(0)
        np.save(big, rng.standard_normal((mib * 256, 1024), dtype=np.float32))
        np.save(tiny, rng.standard_normal((256, 1024), dtype=np.float32))
        for ranks in opts.ranks or ([2] if quick else [1, 2, 4]):
            for mode in opts.modes or (["node", "wrap node"] if quick else list(MODES)):
                if ranks == 1 and mode.endswith("process"):
                    continue  # the same as "node" with one rank
                r = torchrun(ranks, mode, big)
                base = None if quick else torchrun(ranks, mode, tiny)
                rows.append({"ranks": ranks, "mode": mode, "big": r, "tiny": base})
                print(f"  {ranks} ranks, {mode}: {r['duplication']:.2f}x", flush=True)
    return {"mib": mib, "rows": rows}


def render(r: dict[str, Any]) -> str:
    """The PSS table."""
    rows = []
    for x in r["rows"]:
        big, tiny, mode = x["big"], x["tiny"], x["mode"]
        kind = KIND.get(mode, "SharedDataset" if mode.startswith("wrap") else "SharedList")
        net = big["total_pss"] - (tiny["total_pss"] if tiny else 0)
        data = big["dataset_bytes"] - (tiny["dataset_bytes"] if tiny else 0)
        rows.append(
            [x["ranks"], kind, mode.split()[-1], len(big["roles"]), f"{big['total_pss'] / MIB:.0f}"]
            + ([f"{net / MIB:.0f}", f"{net / data:.2f}x"] if tiny else ["-", "-"])
            + [f"{big['duplication']:.2f}x", big["rank_copies"]]
        )
    header = ["local ranks x 2 spawn workers", "dataset", "loading", "processes"]
    header += ["total PSS MiB", "net PSS MiB (- 1 MiB run)", "net / data"]
    header += ["verify duplication", "copies in mains"]
    return "\n".join(
        [
            f"# One copy per node: {r['mib']} MiB, local ranks x 2 spawn workers",
            "",
            "Each configuration under `torchrun --standalone`; local rank 0's cross-rank "
            "`sd.verify` measures every process of the node. Net PSS = total PSS minus the "
            "same run over a 1 MiB dataset (an independent check of verify's duplication).",
            "",
            table(header, rows),
            "",
        ]
    )
