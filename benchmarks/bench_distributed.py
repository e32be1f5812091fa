"""The PSS table: 1, 2 and 4 local ranks x 2 spawn workers, node sharing vs per-rank loading.

    python benchmarks/bench_distributed.py [--mib 256] [--ranks 1 2 4] [--modes ...]

Writes the table to stdout and to ``benchmarks/results/distributed.md``.

For each number of local ranks and each way of loading, runs ``share_node.py``
under ``torchrun --standalone`` and reads the node's ``sd.verify`` report (local
rank 0 measures every process of the node at once). Every configuration is also
run over a 1 MiB dataset: "net PSS" is the difference of the two totals, an
independent check on verify's duplication (which subtracts per-worker baselines).

Ways of loading:

* ``node``: ``sd.NumpyDataset(path)``: one copy per node (the default under torchrun);
* ``process``: ``sd.NumpyDataset(path, share="process")``: each rank loads its own
  copy, its workers share it;
* ``plain``: ``TensorDataset(torch.from_numpy(np.load(path)))``: each rank loads its
  own copy and every spawn worker gets another by pickling;
* ``wrap node`` / ``wrap process``: ``sd.SharedDataset(MyDataset())`` over as many
  4 KiB items (a float32 tensor of 1024 values, an int, a str), node-shared or per rank;
* ``list node`` / ``list process``: ``sd.SharedList`` of as many ``{"id", "blob"}``
  dicts of ~4 KiB pickled, node-shared or per rank.

The net/data column divides by the dataset's own bytes (its ``nbytes``, minus the
1 MiB run's), so every kind is compared with the data it holds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "dist_scripts")
MODES = {
    "node": [],
    "process": ["--share", "process"],
    "plain": ["--plain"],
    "wrap node": ["--kind", "shared_dataset"],
    "wrap process": ["--kind", "shared_dataset", "--share", "process"],
    # 64 items (256 KiB of Python objects) a batch: what a metadata list serves; at 512 the
    # unpickled batches in flight add ~0.1x of the data per rank (see results)
    "list node": ["--kind", "shared_list", "--batch-size", "64"],
    "list process": ["--kind", "shared_list", "--share", "process", "--batch-size", "64"],
}
KIND = {"node": "NumpyDataset", "process": "NumpyDataset", "plain": "TensorDataset"}


def run(ranks: int, mode: str, path: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                os.path.join(SCRIPTS, "share_node.py"),
                path,
                out,
                "--batches",
                "16",
                *MODES[mode],
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        with open(os.path.join(out, "rank0.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--quick", action="store_true", help="skip the 1 MiB runs (net PSS)")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "distributed.md")
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, tiny = os.path.join(tmp, "big.npy"), os.path.join(tmp, "tiny.npy")
        rng = np.random.default_rng(0)
        np.save(big, rng.standard_normal((args.mib * 256, 1024), dtype=np.float32))
        np.save(tiny, rng.standard_normal((256, 1024), dtype=np.float32))
        mib = 1 << 20
        lines = [
            f"# One copy per node: {args.mib} MiB, local ranks x 2 spawn workers",
            "",
            "Each configuration under `torchrun --standalone`; local rank 0's cross-rank "
            "`sd.verify` measures every process of the node. Net PSS = total PSS minus the "
            "same run over a 1 MiB dataset (an independent check of verify's duplication).",
            "",
            "| local ranks x 2 spawn workers | dataset | loading | processes | total PSS MiB | "
            "net PSS MiB (- 1 MiB run) | net / data | verify duplication | copies in mains |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(lines), flush=True)
        for ranks in args.ranks:
            for mode in args.modes:
                if ranks == 1 and mode.endswith("process"):
                    continue  # the same as "node" with one rank
                r = run(ranks, mode, big)
                base = None if args.quick else run(ranks, mode, tiny)
                net = r["total_pss"] - (base["total_pss"] if base else 0)
                data = r["dataset_bytes"] - (base["dataset_bytes"] if base else 0)
                kind = KIND.get(mode, "SharedDataset" if mode.startswith("wrap") else "SharedList")
                lines.append(
                    f"| {ranks} | {kind} | {mode.split()[-1]} | {len(r['roles'])} | "
                    f"{r['total_pss'] / mib:.0f} | "
                    + (f"{net / mib:.0f} | {net / data:.2f}x | " if base else "- | - | ")
                    + f"{r['duplication']:.2f}x | {r['rank_copies']} |"
                )
                print(lines[-1], flush=True)
                write(lines, args.out)  # row by row: a long run keeps what it measured
    print(f"wrote {args.out}")


def write(lines: list[str], out: str) -> None:
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
