"""IndexBatchSampler's shuffle follows torch's random state, as RandomSampler's does; both
samplers resume under torchdata's StatefulDataLoader."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO
from torch.utils.data import DataLoader

import shareddata as sd


def _order(sampler: sd.IndexBatchSampler) -> list[int]:
    return torch.cat(list(sampler)).tolist()


def test_the_shuffle_follows_torch_manual_seed_like_random_sampler():
    orders = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        orders.append(_order(sd.IndexBatchSampler(100, 10, shuffle=True)))
    assert orders[0] == orders[1]  # seeded: the same order
    assert orders[0] != orders[2]  # another seed: another order
    assert sorted(orders[0]) == list(range(100))
    # DataLoader(shuffle=True) behaves the same way under the same calls
    torch.manual_seed(5)
    plain = [b.tolist() for b in DataLoader(range(100), batch_size=10, shuffle=True)]
    torch.manual_seed(5)
    again = [b.tolist() for b in DataLoader(range(100), batch_size=10, shuffle=True)]
    assert plain == again


def test_a_generator_argument_is_used_instead_of_torch_s_default():
    def order(seed: int) -> list[int]:
        torch.manual_seed(1234)  # the default generator's state must not matter
        generator = torch.Generator().manual_seed(seed)
        return _order(sd.IndexBatchSampler(50, 7, shuffle=True, generator=generator))

    assert order(3) == order(3)
    assert order(3) != order(4)


def test_epochs_differ_and_set_epoch_fixes_the_order():
    torch.manual_seed(0)
    sampler = sd.IndexBatchSampler(64, 8, shuffle=True)
    epochs = [_order(sampler) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3, "each pass is a new epoch with a new order"
    sampler.set_epoch(1)
    assert _order(sampler) == _order(sampler) == epochs[1]
    sampler.set_epoch(0)
    assert _order(sampler) == epochs[0]


def test_an_explicit_seed_is_the_same_on_every_run_and_its_epochs_are_its_own():
    def orders(seed: int, epoch: int) -> list[int]:
        sampler = sd.IndexBatchSampler(64, 8, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return _order(sampler)

    torch.manual_seed(1)
    first = orders(0, 0)
    torch.manual_seed(2)  # the global state does not change a seeded sampler
    assert orders(0, 0) == first
    assert orders(0, 1) != orders(1, 0), "seed 0's epoch 1 is not seed 1's epoch 0"
    assert orders(0, 0) != orders(0, 1)
    unseeded = sd.IndexBatchSampler(64, 8, shuffle=True, seed=7)
    assert _order(unseeded) == orders(7, 0) and _order(unseeded) == orders(7, 1)


def test_runs_differ_unless_seeded():
    code = (
        "import sys, torch, shareddata as sd\n"
        "if len(sys.argv) > 1: torch.manual_seed(int(sys.argv[1]))\n"
        "print(torch.cat(list(sd.IndexBatchSampler(1000, 100, shuffle=True))).tolist())\n"
    )

    def run(*args: str) -> str:
        command = [sys.executable, "-c", code, *args]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    assert run() != run(), "two runs without a seed gave the same order"
    assert run("3") == run("3")


def test_bad_arguments_are_named():
    for kwargs in ({"seed": 1.5}, {"seed": "0"}, {"generator": 3}):
        with pytest.raises(TypeError) as info:
            sd.IndexBatchSampler(10, 2, shuffle=True, **kwargs)
        assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(ValueError, match="batch_size"):
        sd.IndexBatchSampler(10, 0)


# -- resumed by torchdata's StatefulDataLoader -----------------------------------------

EPOCHS, ROWS = 4, 60


def _stateful_loader(kind: str, ctx: str) -> Any:
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is not installed (pip install torchdata)"
    )
    ds = sd.NumpyDataset(np.arange(ROWS), share="process")  # not loaded by rank 0
    if kind == "IndexBatchSampler":  # unseeded: the seed drawn from torch must be kept too
        sampler, batching = sd.IndexBatchSampler(ds, 8, shuffle=True), {"batch_size": None}
    else:  # rank 1 of 2 of a job, as a DistributedSampler that the loader batches
        sampler, batching = sd.NodeShardSampler(ds, seed=5), {"batch_size": 4}
    # spawn workers persist across epochs (torchdata's other path: the iterator is reset)
    return stateful.StatefulDataLoader(
        ds, sampler=sampler, num_workers=2, multiprocessing_context=ctx,
        persistent_workers=ctx == "spawn", **batching,
    )  # fmt: skip


def _epochs(
    loader: Any, epochs: range, stop: int | None = None, resumed: bool = False
) -> list[list[list[int]]]:
    """The batches of ``epochs``; in the last, only the first ``stop`` (None: all).

    ``set_epoch`` is called before every epoch, as a DDP loop does, but the first of a
    resumed run, whose epoch the loaded state holds.
    """
    seen = []
    for epoch in epochs:
        if isinstance(loader.sampler, sd.NodeShardSampler) and not (resumed and seen == []):
            loader.sampler.set_epoch(epoch)
        it = iter(loader)
        n = stop if epoch == epochs[-1] and stop is not None else None
        seen.append([b["data"].tolist() for b in itertools.islice(it, n)])
    return seen


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's own
@pytest.mark.parametrize("ctx", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["IndexBatchSampler", "NodeShardSampler"])
def test_a_resumed_stateful_dataloader_gives_the_rest_of_the_uninterrupted_run(
    kind, ctx, monkeypatch
):
    """Interrupted after k batches of epoch 0 or 2 (or at its end), a fresh loader that
    loads the state_dict gives exactly the remaining batches, then the next epochs."""
    for name, value in {"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "RANK": 1, "WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("SHAREDDATA_RANK_PID", str(os.getpid()))  # this process is the rank
    torch.manual_seed(0)
    loader = _stateful_loader(kind, ctx)
    if kind == "NodeShardSampler":
        assert (loader.sampler.local_rank, loader.sampler.local_world_size) == (1, 2)
    whole = _epochs(loader, range(EPOCHS))
    del loader
    assert len({str(e) for e in whole}) == EPOCHS  # every epoch has its own order
    per_epoch = len(whole[0])
    # (spawn: fewer fresh loaders, each starts two interpreters)
    for epoch, k in [(0, 3), (2, 2)] + [(2, per_epoch)] * (ctx == "fork"):
        torch.manual_seed(0)
        first = _stateful_loader(kind, ctx)
        before = _epochs(first, range(epoch + 1), stop=k)
        assert before[-1] == whole[epoch][:k]
        state = first.state_dict()
        del first
        torch.manual_seed(1)  # the resumed run's own draws do not matter
        resumed = _stateful_loader(kind, ctx)
        resumed.load_state_dict(state)
        after = _epochs(resumed, range(epoch, EPOCHS), resumed=True)
        assert after == [whole[epoch][k:], *whole[epoch + 1 :]], (epoch, k)


def test_the_state_holds_seed_epoch_and_position_and_a_bad_one_is_named():
    sampler = sd.IndexBatchSampler(20, 4, shuffle=True)
    assert sampler.state_dict()["epoch"] == 0 and sampler.state_dict()["batches"] == 0
    for _ in range(3):
        _order(sampler)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    assert (state["epoch"], state["batches"]) == (3, 1)
    again = sd.IndexBatchSampler(20, 4, shuffle=True)  # another seed until it loads
    again.load_state_dict(state)
    # a plain DataLoader with workers, which calls iter() twice and reads the second
    ds = sd.NumpyDataset(np.arange(20))
    loader = DataLoader(
        ds, sampler=again, batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    rest = torch.cat([b["data"] for b in loader]).tolist()
    assert rest == torch.cat(list(it)).tolist()  # the rest of epoch 3...
    seeded = sd.IndexBatchSampler(20, 4, shuffle=True, seed=state["seed"])
    seeded.set_epoch(4)
    assert _order(again) == _order(seeded)  # ...then epoch 4
    nodes = sd.NodeShardSampler(range(20), seed=3)
    nodes.set_epoch(2)
    order = list(nodes)
    it = iter(nodes)
    next(it), next(it)
    assert nodes.state_dict() == {"seed": 3, "epoch": 2, "indices": 2}  # the saved format
    fresh = sd.NodeShardSampler(range(20))
    fresh.load_state_dict(nodes.state_dict())
    assert list(fresh) == order[2:]
    for bad in ({}, {"seed": 0, "epoch": 0, "batches": 9}, {"seed": 0, "epoch": 0, "batches": "1"}):
        with pytest.raises(ValueError, match="IndexBatchSampler.load_state_dict") as info:
            sd.IndexBatchSampler(20, 4).load_state_dict(bad)
        assert isinstance(info.value, sd.SharedDataError)
    with pytest.raises(ValueError, match="20 indices per epoch"):
        fresh.load_state_dict({"seed": 0, "epoch": 0, "indices": 21})
    with pytest.raises(ValueError, match="NodeShardSampler.load_state_dict"):  # not a seed
        fresh.load_state_dict({"seed": "3", "epoch": 0, "indices": 1})
