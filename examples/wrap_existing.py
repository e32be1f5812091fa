"""Wrap an existing Dataset in one line: every item is materialised once into shared memory.

Run: python examples/wrap_existing.py [--items N]

Measures the dataset as it is (each spawn worker unpickles its own copy), wraps it
in `sd.SharedDataset`, and measures again.
"""

import argparse

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd


class MyDataset(Dataset):
    """A user dataset: images in a numpy array, labels, captions in lists."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        # 12 KiB each
        self.images = rng.integers(0, 255, (n, 3, 64, 64), dtype=np.uint8)
        self.labels = [i % 10 for i in range(n)]
        self.captions = [f"image {i}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = torch.from_numpy(self.images[i])
        return image, self.labels[i], self.captions[i]


def make_loader(dataset: Dataset) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=128,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="spawn",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=20_000)  # 234 MiB of images
    args = parser.parse_args()

    original = MyDataset(args.items)
    before = sd.verify(make_loader(original), batches=10, max_duplication=None)

    shared = sd.SharedDataset(original)  # the one-line change
    image, label, caption = shared[0]  # same structure and types as MyDataset returned
    assert isinstance(label, int) and isinstance(caption, str)
    del original  # the shared copy is all the workers need
    after = sd.verify(make_loader(shared), batches=10)
    print(after)
    print(f"before: {before.verdict()}\nafter:  {after.verdict()}")


if __name__ == "__main__":
    main()
