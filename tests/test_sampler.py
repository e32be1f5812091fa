"""IndexBatchSampler's shuffle follows torch's random state, as RandomSampler's does."""

from __future__ import annotations

import subprocess
import sys

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
