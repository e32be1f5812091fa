"""Samplers that resume: the position a ``state_dict`` saves and ``load_state_dict`` continues."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import Sampler

from .errors import InvalidArgumentError

__all__ = ["ResumableSampler"]

T = TypeVar("T")


class ResumableSampler(Sampler[T]):
    """A sampler that torchdata's ``StatefulDataLoader`` resumes from its ``state_dict``.

    A subclass sets ``seed`` and ``shuffle`` and gives ``__len__`` and ``_items``; the
    state is ``{"seed", "epoch", UNIT}``: the epoch of the pass and the items it gave.
    """

    UNIT = "items"  # what the position counts: the state's key, the word of its error
    seed: int | None
    shuffle: bool
    generator: torch.Generator | None = None
    epoch = 0  # of the next pass
    _epoch_set = False  # without set_epoch, each pass takes the next epoch
    _pass: list[int] | None = None  # [epoch, items given] of the pass under way
    _resume: list[int] | None = None  # a loaded pass, continued by the next iter()
    _items: Callable[[], Iterator[T]]  # the subclass's generator of a pass
    __len__: Callable[[], int]  # the subclass's items per epoch

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch``, as ``DistributedSampler.set_epoch`` does."""
        self.epoch = int(epoch)
        self._epoch_set = True

    def _base_seed(self) -> int:
        if self.seed is None:  # drawn once, as RandomSampler draws its seed
            self.seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator))
        return self.seed

    def __iter__(self) -> Iterator[T]:
        # Note [A pass starts when it is first read]: a DataLoader with workers calls
        # iter() twice per epoch and reads only the second iterator, so a pass takes its
        # epoch, or a loaded position, in _position, at its first read. But a loaded
        # position at the END of a pass is taken by iter() itself: StatefulDataLoader
        # restores a finished epoch into an iterator it may not read, then calls iter().
        self._pass = None
        if self._resume is not None and self._resume[1] >= len(self):
            self._pass, self._resume = self._resume, None
            return iter(())
        return self._items()

    def _position(self) -> list[int]:
        """The ``[epoch, items given]`` of the pass, which counts each item before its yield."""
        if self._resume is not None:  # a loaded pass (load_state_dict set the next epoch)
            position, self._resume = self._resume, None
        else:
            position = [self.epoch, 0]
            if not self._epoch_set:
                self.epoch += 1
        self._pass = position
        return position

    def state_dict(self) -> dict[str, Any]:
        """The position: base seed, the epoch under way (or to come), the items given."""
        epoch, given = self._resume or self._pass or (self.epoch, 0)
        seed = self._base_seed() if self.shuffle else self.seed
        return {"seed": seed, "epoch": epoch, self.UNIT: given}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass gives the rest of its epoch.

        Raises:
            InvalidArgumentError: ``state`` is not such a state, or counts more items
                than this sampler gives per epoch.
        """
        got = state if isinstance(state, dict) else {}
        seed, epoch, given = got.get("seed"), got.get("epoch"), got.get(self.UNIT)
        if not (
            isinstance(epoch, int)
            and isinstance(given, int)
            and 0 <= given <= len(self)
            and (seed is None or isinstance(seed, int))
        ):
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict needs a state_dict() of a sampler with "
                f"{len(self)} {self.UNIT} per epoch ({{'seed', 'epoch', '{self.UNIT}'}}), "
                f"got {state!r}"
            )
        if seed is not None:
            self.seed = seed
        self._resume = [epoch, given]
        if not self._epoch_set:
            self.epoch = epoch + 1
