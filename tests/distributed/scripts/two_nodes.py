"""Run as one "node" of a 2-node torchrun job on loopback.

Builds a full copy per node and a node shard, samples the shard with
NodeShardSampler through spawn workers, and gathers what every rank saw. Prints
``RESULT {json}`` on global rank 0. The process group is initialised *before* the
datasets are built (the other order from share_node.py).
"""

import argparse
import json
import multiprocessing
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import shareddata as sd


class Ids(Dataset):
    """A user Dataset whose items are their index (and a 16-float row)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        return i, torch.full((16,), float(i))


def identity(ds) -> list:
    return sorted(map(list, ds.segment_identity()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    full = sd.NumpyDataset(args.folder, progress=False)
    shard = sd.NumpyDataset(args.folder, shard="node", progress=False)
    ids = np.load(os.path.join(args.folder, "id.npy"), mmap_mode="r")
    s = shard.node_shard
    shard_ok = bool(
        np.array_equal(shard[0 : len(shard)]["id"].numpy(), ids[s.start : s.stop])
        and len(shard) == s.stop - s.start
    )
    wrapped = sd.SharedDataset(Ids(4096), shard="node", progress=False)
    w = wrapped.node_shard
    wrapped_ok = bool(
        len(wrapped) == w.stop - w.start
        and [wrapped[i][0] for i in (0, len(wrapped) - 1)] == [w.start, w.stop - 1]
        and (w.start, w.stop) == (s.start, s.stop)
    )
    listed = sd.SharedList(list(range(4096)), shard="node", progress=False)
    listed_ok = list(listed) == list(range(s.start, s.stop)) and listed.node_shard == s
    sampler = sd.NodeShardSampler(shard, shuffle=True, seed=3)
    loader = DataLoader(
        shard,
        batch_size=64,
        sampler=sampler,
        num_workers=1,
        multiprocessing_context=multiprocessing.get_context("spawn"),
        persistent_workers=True,
    )
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        epochs.append([int(i) for batch in loader for i in batch["id"]])
    mine = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "full_segments": identity(full),
        "shard_segments": identity(shard),
        "wrapped_segments": identity(wrapped),
        "wrapped_ok": wrapped_ok,
        "listed_ok": listed_ok,
        "node_shard": [s.start, s.stop, s.total, s.node, s.num_nodes],
        "shard_ok": shard_ok,
        "len_sampler": len(sampler),
        "epochs": epochs,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
