"""Run under torchrun: every local rank builds one dataset; measure the node; hash the data.

Writes ``<out>/rank<RANK>.json`` per rank (files, not stdout: the ranks share one
pipe). The dataset is built before ``init_process_group`` (sharing must not need
it); the process group is used only to compare what the ranks saw.
"""

import argparse
import hashlib
import json
import multiprocessing
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import shareddata as sd
from shareddata.distributed import _dataset_identity


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
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")

    if args.plain:  # what ranks do without shareddata: each loads its own array
        ds = TensorDataset(torch.from_numpy(np.load(args.path)))
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
        "segments": sorted(map(list, _dataset_identity(ds) or ())),
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
