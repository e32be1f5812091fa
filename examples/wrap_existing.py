"""Wrap an existing Dataset in one line: every item is materialised once into shared memory.

Run: python examples/wrap_existing.py [--items N]
"""

import argparse

import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd


class MyDataset(Dataset):
    """A typical user dataset: an image tensor, an int label and a caption."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 32, 32, generator=g), i % 10, f"image {i}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=8192)
    args = parser.parse_args()

    ds = sd.SharedDataset(MyDataset(args.items))  # the one-line change
    image, label, caption = ds[0]  # same structure and types as MyDataset returned
    assert isinstance(label, int) and isinstance(caption, str)
    loader = DataLoader(ds, batch_size=128, num_workers=2, multiprocessing_context="spawn")
    report = sd.verify(loader, batches=20)
    print(report)


if __name__ == "__main__":
    main()
