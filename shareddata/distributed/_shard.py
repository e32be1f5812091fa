"""Node shards (``shard="node"``) and :class:`NodeShardSampler`, which samples them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import InvalidArgumentError
from ._context import node_context

__all__ = ["NodeShard", "NodeShardSampler", "global_indices", "node_rows"]


@dataclass(frozen=True)
class NodeShard:
    """The rows of the whole dataset that one node holds (``shard="node"``).

    Row ``i`` of the node's dataset is row ``start + i`` of the whole dataset.

    Attributes:
        start: first row of the whole dataset held here.
        stop: one past the last row held here.
        total: rows of the whole dataset.
        node: index of the node holding them.
        num_nodes: number of nodes the rows are split over.
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

    Shares differ by at most one row; the first nodes get the smaller ones.

    Example:
        >>> [node_rows(10, g, 3) for g in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    if not 0 <= node < num_nodes:
        raise InvalidArgumentError(f"node {node} is not in range for {num_nodes} nodes")
    return node * total // num_nodes, (node + 1) * total // num_nodes


class NodeShardSampler(Sampler[int]):
    """A ``DistributedSampler`` for node-sharded data: each node samples its own rows.

    Node ``g`` of ``G`` owns rows ``node_rows(N, g, G)`` of the whole dataset's ``N``
    (exactly the rows ``shard="node"`` loads there). Every epoch the node's rows are
    shuffled (the same order on each local rank: ``seed + epoch``) and dealt out to
    its ``L`` local ranks (local rank ``l`` takes positions ``l, l + L, ...``), so one
    epoch visits every row of the whole dataset once across the job.

    Every rank of the job yields the same number of indices, as DDP needs:

    * ``drop_last=False`` (default): ``ceil(ceil(N / G) / L)`` per rank; a node whose
      rows do not fill that many is padded by repeating the start of its shuffled
      order (as ``DistributedSampler`` does), so a few rows are seen twice;
    * ``drop_last=True``: ``floor(floor(N / G) / L)`` per rank; the tail of each
      node's shuffled order is skipped (different rows each epoch when shuffling).

    When ``N`` divides by ``G * L`` both give every row exactly once.

    Works with a node-sharded dataset (``shard="node"``: indices are local to the
    shard) and with a full copy on every node (indices are global).

    It is ``Stateful`` for torchdata's ``StatefulDataLoader``: :meth:`state_dict`
    holds the seed, the epoch under way and the indices it has given, and a loader
    resumed from it gives exactly the remaining batches of that epoch.

    Args:
        dataset: the dataset (anything with ``len``; ``node_shard`` if sharded).
        shuffle: reshuffle the node's rows every epoch.
        seed: base seed; epoch ``e`` uses ``seed + e`` (call :meth:`set_epoch`).
        drop_last: drop the tail instead of padding (see above).

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

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        ctx = node_context()
        node, nodes, local, size = (
            (ctx.node, ctx.num_nodes, ctx.local_rank, ctx.local_world_size)
            if ctx is not None
            else (0, 1, 0, 1)
        )
        if ctx is not None and ctx.world_size != nodes * size:
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
        self.epoch = 0
        self._pass: list[int] | None = None  # [epoch, indices given] of the pass under way
        self._resume: list[int] | None = None  # a loaded pass, continued by the next iter()
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

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call it before every epoch, as for DistributedSampler)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        # as IndexBatchSampler's (Note [A pass starts when it is first read])
        self._pass = None
        if self._resume is not None and self._resume[1] >= self.num_samples:
            self._pass, self._resume = self._resume, None
            return iter(())
        return self._indices()

    def _indices(self) -> Iterator[int]:
        position, self._resume = self._resume or [self.epoch, 0], None
        self._pass = position
        epoch, start = position
        # int32 while it fits: the order lives in the main process for the whole epoch
        dtype = torch.int32 if self.total < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
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

    def state_dict(self) -> dict[str, Any]:
        """The position: seed, the epoch under way and the indices it has given.

        Before a pass starts it is that of the pass to come (or the one loaded).
        """
        epoch, given = self._resume or self._pass or (self.epoch, 0)
        return {"seed": self.seed, "epoch": epoch, "indices": given}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass gives the rest of its epoch.

        Later passes take the epoch :meth:`set_epoch` gives, as before.

        Raises:
            InvalidArgumentError: ``state`` is not such a state, or counts more indices
                than this rank takes per epoch (another dataset or job layout).
        """
        got = state if isinstance(state, dict) else {}
        seed, epoch, given = got.get("seed"), got.get("epoch"), got.get("indices")
        if not (isinstance(seed, int) and isinstance(epoch, int) and isinstance(given, int)):
            seed, epoch, given = 0, 0, -1
        if not 0 <= given <= self.num_samples:
            raise InvalidArgumentError(
                f"NodeShardSampler.load_state_dict needs a state_dict() of a sampler with "
                f"{self.num_samples} indices per epoch ({{'seed', 'epoch', 'indices'}}), "
                f"got {state!r}"
            )
        self.seed = seed
        self._resume = [epoch, given]

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
