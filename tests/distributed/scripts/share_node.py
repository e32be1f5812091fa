"""Run under torchrun: every local rank builds one dataset; measure the node; hash the data.

Writes ``<out>/rank<RANK>.json`` per rank (files, not stdout: the ranks share one
pipe). The dataset is built before ``init_process_group`` (sharing must not need
it); the process group is used only to compare what the ranks saw.

With ``--wrap``, every rank also wraps a user Dataset in ``SharedDataset`` and a list
of dicts in ``SharedList`` (as in the README: no code change for torchrun) and
measures the node for each; the user Dataset counts its ``__getitem__`` calls, which
must be zero on every local rank but 0.
"""

import argparse
import hashlib
import json
import multiprocessing
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset

import shareddata as sd

WRAP_ROWS = 8192  # x 4 KiB: 32 MiB in each wrapped dataset


def identity(ds) -> list:
    return sorted(map(list, ds.segment_identity()))


class Items(Dataset):
    """A user's map-style Dataset: (4 KiB tensor, int, str) items; counts its reads."""

    calls = 0

    def __init__(self, rows: int = WRAP_ROWS) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        Items.calls += 1
        return torch.full((1024,), float(i)), i, f"item {i}"


def records(rows: int = WRAP_ROWS):
    return ({"id": i, "blob": bytes([i % 251]) * 4000} for i in range(rows))


class Both(Dataset):
    """Item i of a SharedDataset and of a SharedList: one loader measures both at once."""

    def __init__(self, ds, names) -> None:
        self.ds, self.names = ds, names

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return self.ds[i][1], self.names[i]["id"]

    @property
    def nbytes(self) -> int:
        return self.ds.nbytes + self.names.nbytes

    def segment_identity(self) -> frozenset:
        return self.ds.segment_identity() | self.names.segment_identity()


def measure(ds, ctx, workers: int) -> float:
    loader = DataLoader(
        ds, batch_size=64, num_workers=workers, multiprocessing_context=ctx if workers else None
    )
    return sd.verify(loader, batches=8, max_duplication=None).duplication


def wrapped(ctx, workers: int) -> dict:
    """SharedDataset and SharedList on every rank: one copy per node, items intact."""
    ds = sd.SharedDataset(Items(), progress=False)
    names = sd.SharedList(records(), progress=False)
    calls = Items.calls
    ok = (
        len(ds) == WRAP_ROWS
        and ds[7][1] == 7
        and ds[-1][2] == f"item {WRAP_ROWS - 1}"
        and torch.equal(ds[100][0], torch.full((1024,), 100.0))
        and names[5] == {"id": 5, "blob": bytes([5]) * 4000}
        and names[-1]["id"] == WRAP_ROWS - 1
    )
    out = {
        "wrap_calls": calls,
        "wrap_ok": bool(ok),
        "dataset_segments": identity(ds),
        "list_segments": identity(names),
        "wrap_duplication": measure(Both(ds, names), ctx, workers),
    }
    del ds, names
    own = sd.SharedDataset(Items(), progress=False, share="process")
    listed = sd.SharedList(records(), progress=False, share="process")
    # the copies are in the mains: measured without workers (no second start of spawn workers)
    out["wrap_process_duplication"] = measure(Both(own, listed), ctx, 0)
    return out


def digest(loader: DataLoader) -> str:
    h = hashlib.sha1()
    for batch in loader:
        h.update(
            (batch[0] if isinstance(batch, list) else next(iter(batch.values()))).numpy().tobytes()
        )
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--share", default=None)
    parser.add_argument("--compare-process", action="store_true")
    parser.add_argument("--hash", action="store_true")
    parser.add_argument("--plain", action="store_true", help="np.load + TensorDataset per rank")
    parser.add_argument("--wrap", action="store_true", help="SharedDataset and SharedList too")
    parser.add_argument(
        "--kind",
        default="numpy",
        choices=["numpy", "shared_dataset", "shared_list"],
        help="the measured dataset: the .npy file, or as many 4 KiB items wrapped",
    )
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")

    rows = np.load(args.path, mmap_mode="r").shape[0]
    if args.plain:  # what ranks do without shareddata: each loads its own array
        ds = TensorDataset(torch.from_numpy(np.load(args.path)))
    elif args.kind == "shared_dataset":
        ds = sd.SharedDataset(Items(rows), share=args.share, progress=False)
    elif args.kind == "shared_list":
        ds = sd.SharedList(records(rows), share=args.share, progress=False)
    else:
        ds = sd.NumpyDataset(args.path, share=args.share, progress=False)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        num_workers=args.workers,
        multiprocessing_context=ctx,
        persistent_workers=True,  # the hash pass below reuses the workers verify started
    )
    report = sd.verify(loader, batches=args.batches, max_duplication=None)
    result = {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "pid": os.getpid(),
        "duplication": report.duplication,
        "local_ranks": report.local_ranks,
        "rank_copies": report.rank_copies,
        "roles": [p.role for p in report.processes],
        "segments": [] if args.plain else identity(ds),
        "total_pss": report.total_pss,
        "pss_before": report.pss_before,
        "dataset_bytes": report.dataset_bytes,
    }
    if int(os.environ["LOCAL_RANK"]) == 0:
        print(report, flush=True)
    if args.compare_process:
        own = sd.NumpyDataset(args.path, share="process", progress=False)
        own_loader = DataLoader(
            own, batch_size=args.batch_size, num_workers=args.workers, multiprocessing_context=ctx
        )
        result["process_duplication"] = sd.verify(
            own_loader, batches=args.batches, max_duplication=None
        ).duplication
        del own_loader, own
    if args.wrap:
        result.update(wrapped(ctx, args.workers))
    if args.hash:
        dist.init_process_group("gloo")  # after building: sharing did not need it
        mine = digest(loader)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        result["sha1"] = mine
        result["all_equal"] = len(set(everyone)) == 1
        dist.destroy_process_group()
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
