"""Node shards (``shard="node"``) and :class:`NodeShardSampler`, which samples them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._resume import ResumableSampler
from ..errors import InvalidArgumentError
from ._context import ALONE, node_context

__all__ = ["NodeShard", "NodeShardSampler", "global_indices", "node_rows"]


@dataclass(frozen=True)
class NodeShard:
    """The rows of the whole dataset that one node holds (``shard="node"``).

    Rows ``[start, stop)`` of ``total``, on node ``node`` of ``num_nodes``: row ``i``
    of the node's dataset is row ``start + i`` of the whole one.
    """

    start: int
    stop: int
    total: int
    node: int
    num_nodes: int

    def __len__(self) -> int:
        return self.stop - self.start


def node_rows(total: int, node: int, num_nodes: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of ``total`` that node ``node`` holds.

    Example:
        >>> [node_rows(10, g, 3) for g in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    if not 0 <= node < num_nodes:
        raise InvalidArgumentError(f"node {node} is not in range for {num_nodes} nodes")
    return node * total // num_nodes, (node + 1) * total // num_nodes


class NodeShardSampler(ResumableSampler[int]):
    """A ``DistributedSampler`` for node-sharded data: each node samples its own rows.

    Node ``g`` of ``G`` owns rows ``node_rows(N, g, G)`` of the whole dataset (the rows
    ``shard="node"`` loads there); every epoch they are shuffled (``seed + epoch``, the
    same on each local rank) and dealt out to its ``L`` local ranks (local rank ``l``
    takes positions ``l, l + L, ...``). Every rank yields as many indices, as DDP needs:
    ``ceil(ceil(N / G) / L)``, padded by repeating the start of the node's order, or with
    ``drop_last`` ``floor(floor(N / G) / L)``, the tail skipped. Indices are local to a
    node-sharded dataset, global for a full copy. ``Stateful`` for torchdata's
    ``StatefulDataLoader``: a loader resumed from :meth:`state_dict` gives exactly the
    remaining batches of that epoch.

    Args:
        dataset: the dataset (anything with ``len``; ``node_shard`` if sharded).
        shuffle: reshuffle the node's rows every epoch.
        seed: base seed; epoch ``e`` uses ``seed + e`` (call :meth:`set_epoch`).
        drop_last: drop the tail instead of padding.

    Raises:
        ValueError: the dataset was sharded for another layout of nodes, nodes hold
            different numbers of ranks, or a node has no rows to pad from.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> ds = sd.NumpyDataset(np.arange(8))
        >>> sampler = sd.NodeShardSampler(ds, shuffle=False)
        >>> list(sampler)
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    UNIT = "indices"
    _epoch_set = True  # the epoch is set_epoch's, as for DistributedSampler

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        ctx = node_context() or ALONE
        node, nodes, local, size = ctx.node, ctx.num_nodes, ctx.local_rank, ctx.local_world_size
        if ctx.world_size != nodes * size:
            raise InvalidArgumentError(
                f"NodeShardSampler needs the same number of ranks on every node, but the job "
                f"has {ctx.world_size} ranks on {nodes} nodes of {size} local ranks."
            )
        shard: NodeShard | None = getattr(dataset, "node_shard", None)
        if shard is not None:
            if (shard.node, shard.num_nodes) != (node, nodes):
                raise InvalidArgumentError(
                    f"the dataset holds the rows of node {shard.node} of {shard.num_nodes}, but "
                    f"this process is on node {node} of {nodes}."
                )
            if len(dataset) != len(shard):
                raise InvalidArgumentError(
                    f"the dataset has {len(dataset)} rows but its node_shard says {len(shard)}"
                )
            total, offset, rows = shard.total, 0, len(shard)
        else:
            total = len(dataset)
            start, stop = node_rows(total, node, nodes)
            offset, rows = start, stop - start
        self.total, self.offset, self.node_size = total, offset, rows
        self.local_rank, self.local_world_size = local, size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if drop_last:
            self.num_samples = (total // nodes) // size
        else:
            self.num_samples = math.ceil(math.ceil(total / nodes) / size)
            if self.num_samples > 0 and rows == 0:
                raise InvalidArgumentError(
                    f"node {node} holds no rows of the {total}-row dataset ({nodes} nodes), so "
                    "it cannot pad its ranks' samples; use drop_last=True or fewer nodes."
                )
        self.total_size = self.num_samples * size

    def _items(self) -> Iterator[int]:
        position = self._position()
        epoch, start = position
        # int32 while it fits: the order lives in the main process for the whole epoch
        dtype = torch.int32 if self.total < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(self._base_seed() + epoch)
            order = torch.randperm(self.node_size, generator=generator, dtype=dtype)
        else:
            order = torch.arange(self.node_size, dtype=dtype)
        if self.total_size > len(order):
            order = order.repeat(math.ceil(self.total_size / max(len(order), 1)))
        mine = order[self.local_rank : self.total_size : self.local_world_size]
        mine = mine[start:] + self.offset
        del order
        # In chunks: a list of every index would be ~36 bytes a row of private memory.
        for chunk in mine.split(4096):
            for index in chunk.tolist():
                position[1] += 1  # before the yield: state_dict() is read while it waits there
                yield index

    def __len__(self) -> int:
        return self.num_samples


def global_indices(dataset: Any, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Rows of the whole dataset for indices into a node-sharded (or full) dataset.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> global_indices(sd.NumpyDataset(np.arange(4)), [1, 3]).tolist()
        [1, 3]
    """
    shard: NodeShard | None = getattr(dataset, "node_shard", None)
    idx = torch.as_tensor(indices, dtype=torch.int64)
    return idx if shard is None else idx + shard.start
