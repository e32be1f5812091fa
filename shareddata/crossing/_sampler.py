"""The fast path: a sampler that yields whole batches of indices as one tensor."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sized
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .._compat import disabled_torch_function
from .._resume import ResumableSampler
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["IndexBatchSampler"]


class BatchIndices(torch.Tensor):
    """A batch of indices sent to a worker by value, not in a ``/dev/shm`` segment.

    For a few KiB, copying the values into the pickle is far cheaper than torch's
    segment and socket round trip. Every operation on it returns a plain tensor.
    """

    __torch_function__ = disabled_torch_function  # type: ignore[assignment]


def _indices_from(values: bytearray) -> torch.Tensor:
    return torch.frombuffer(values, dtype=torch.int64)


def _reduce_indices(t: BatchIndices) -> Any:
    # one bytearray (a numpy array pickles ~4x slower, in the feeder thread); a
    # BatchIndices is only ever one of the sampler's batches, a row of int64, never empty
    return _indices_from, (bytearray(t.contiguous().numpy()),)


ForkingPickler.register(BatchIndices, _reduce_indices)


class IndexBatchSampler(ResumableSampler[torch.Tensor]):
    """Yields each batch of indices as one int64 tensor, with no per-sample Python work.

    The ``sampler`` of a DataLoader with ``batch_size=None``: the dataset gathers each
    column once per batch (``dataset[indices]``). Without ``seed``, the base seed is
    drawn from ``generator`` (torch's default) at the first pass, as ``RandomSampler``
    does, so ``torch.manual_seed`` makes runs reproducible; each epoch's order comes
    from the base seed and the epoch, the next one each pass unless :meth:`set_epoch`
    fixes it. ``Stateful`` for torchdata's
    ``StatefulDataLoader``: a loader resumed from :meth:`state_dict` gives exactly the
    remaining batches, then the next epochs.

    Args:
        data_source: the dataset (or its length).
        batch_size: samples per batch.
        shuffle: a new random order every epoch (see :meth:`set_epoch`).
        drop_last: drop the last incomplete batch.
        seed: base seed of the shuffle; ``None`` draws it from ``generator``.
        generator: the ``torch.Generator`` to draw the base seed from.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> from torch.utils.data import DataLoader
        >>> ds = sd.NumpyDataset(np.arange(10))
        >>> loader = DataLoader(ds, sampler=sd.IndexBatchSampler(ds, 4), batch_size=None)
        >>> [b["data"].tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        >>> a = sd.IndexBatchSampler(10, 5, shuffle=True, seed=1)
        >>> b = sd.IndexBatchSampler(10, 5, shuffle=True, seed=1)
        >>> first = [t.tolist() for t in a]
        >>> first == [t.tolist() for t in b]  # one seed: the same orders, run after run
        True
        >>> first == [t.tolist() for t in a]  # the next pass is epoch 1: another order
        False
    """

    UNIT = "batches"

    def __init__(
        self,
        data_source: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ArgumentTypeError(
                f"seed must be an int or None (drawn from torch's generator), got {seed!r}"
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ArgumentTypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.generator = generator

    def _items(self) -> Iterator[torch.Tensor]:
        position = self._position()
        epoch, start = position
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self._base_seed(), epoch))
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        stop = self.n - self.n % self.batch_size if self.drop_last else self.n
        rest = order[start * self.batch_size : stop]
        for batch in rest.split(self.batch_size) if len(rest) else ():  # split(empty): 1 batch
            position[1] += 1  # before the yield: state_dict() is read while it waits there
            yield batch.as_subclass(BatchIndices)  # sent to workers by value

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s order: a hash, so no two (seed, epoch) pairs share one.

    Example:
        >>> epoch_seed(0, 1) == epoch_seed(1, 0)
        False
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**63
