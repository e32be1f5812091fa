"""A memory test to copy into your project: it fails when DataLoader workers copy the data.

Run: pytest -p shareddata.testing examples/test_memory_check.py -rP
     (-rP prints the measured tables; SHAREDDATA_EXAMPLE_ROWS=65536 for a smaller run)

The `shared_memory_check` fixture comes from the plugin `shareddata.testing`: enable it
with `pytest_plugins = ["shareddata.testing"]` in your top-level conftest.py, or
`addopts = "-p shareddata.testing"` in your pytest configuration. `assert_shared`
needs nothing. Build the loader the way your training code does (same dataset class,
workers, start method): that is what is checked.
"""

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from shareddata.testing import assert_shared

ROWS = int(os.environ.get("SHAREDDATA_EXAMPLE_ROWS", 131072))


def make_loader(dataset: Dataset, num_workers: int = 2) -> DataLoader:
    """Stands for your project's loader factory."""
    return DataLoader(
        dataset,
        batch_size=256,
        shuffle=True,
        num_workers=num_workers,
        multiprocessing_context="spawn",
    )


class InMemoryDataset(Dataset):
    """What a lot of training code does: a numpy array held as an attribute."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.array[i])


@pytest.fixture(scope="module")
def features() -> np.ndarray:
    return np.random.default_rng(0).random((ROWS, 256), dtype=np.float32)


def test_loader_holds_one_copy(shared_memory_check, features):
    loader = make_loader(sd.NumpyDataset(features))
    # raises if the data is duplicated
    report = shared_memory_check(loader, batches=10)
    assert report.num_workers == 2


def test_a_plain_dataset_is_caught(features):
    # Under spawn every worker unpickles its own copy of the array:
    # ~3x with 2 workers.
    with pytest.raises(AssertionError, match="dataset held") as err:
        assert_shared(make_loader(InMemoryDataset(features)), batches=10)
    assert err.value.report.duplication > 2.5
