"""Train with DDP on ONE copy of the data per node (shareddata under torchrun).

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py          # CPU, gloo
    python examples/ddp_train.py                                            # 1 process
    torchrun --standalone --nproc_per_node=8 examples/ddp_train.py          # GPUs, NCCL
    # two nodes, each holding only its half of the rows (on node NODE = 0 and 1):
    torchrun --nnodes=2 --node_rank=NODE --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 examples/ddp_train.py --shard

Every local rank builds the same ``sd.NumpyDataset``; local rank 0 of each node
loads it, the others attach, and all their DataLoader workers index the same pages.
``sd.verify`` (called on every rank) measures every process of the node.
"""

import argparse
import multiprocessing
import os
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import shareddata as sd


def make_data(folder: str, rows: int, features: int, classes: int) -> None:
    """A synthetic classification set: x (rows, features) float32, y int64."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = (x @ rng.standard_normal((features, classes), dtype=np.float32)).argmax(1)
    tmp = folder + ".part"
    os.makedirs(tmp, exist_ok=True)
    np.save(os.path.join(tmp, "x.npy"), x)
    np.save(os.path.join(tmp, "y.npy"), y.astype(np.int64))
    os.replace(tmp, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a folder with x.npy and y.npy (default: synthetic)")
    parser.add_argument("--rows", type=int, default=500_000)  # ~126 MiB
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard", action="store_true", help="each node loads only its rows")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    args = parser.parse_args()

    distributed = "LOCAL_RANK" in os.environ  # launched by torchrun
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if distributed:
        if args.backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(args.backend)
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", local_rank) if args.backend == "nccl" else torch.device("cpu")

    folder, made = args.data, False
    if folder is None:  # one synthetic copy on each node's disk
        run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
        folder = os.path.join(tempfile.gettempdir(), f"shareddata-ddp-{run}-node")
        folder += os.environ.get("GROUP_RANK", "0")
        made = local_rank == 0
        if made:
            make_data(folder, args.rows, features=64, classes=10)
        if distributed:
            dist.barrier()

    dataset = sd.NumpyDataset(
        folder,
        output="tuple",
        shard="node" if args.shard else None,
        progress=rank == 0,
    )
    # also fine for full copies
    sampler = sd.NodeShardSampler(dataset, shuffle=True, seed=0)
    shard = dataset.node_shard
    if shard is not None and local_rank == 0:
        print(
            f"rows {shard.start}:{shard.stop} of {shard.total} on node {shard.node} "
            f"of {shard.num_nodes}",
            flush=True,
        )
    spawn = multiprocessing.get_context("spawn")
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        multiprocessing_context=spawn if args.workers else None,
        persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda",
    )
    # On every rank (each gets the node's report). Below ~32 MiB the workers' few MiB
    # of working memory dominate the ratio: measure only.
    limit = 1.10 if dataset.nbytes >= 32 << 20 else None
    report = sd.verify(
        loader,
        batches=min(8, len(loader)),
        max_duplication=limit,
    )
    if rank == 0:
        print(report, flush=True)

    model: torch.nn.Module = torch.nn.Linear(64, 10).to(device)
    if distributed:
        model = DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, count = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(y)
            count += len(y)
        if distributed:
            dist.all_reduce(total)
        if rank == 0:
            world = dist.get_world_size() if distributed else 1
            print(f"epoch {epoch}: mean loss {total.item() / (count * world):.4f}", flush=True)

    del loader
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    if made:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
