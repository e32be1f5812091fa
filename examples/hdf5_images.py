"""Images in an HDF5 file: loaded once into shared memory, augmented in spawn workers.

Run: python examples/hdf5_images.py [--images N] [--size PIXELS]

The file is written here (compressed, chunked, with labels and a group of string
metadata) so that the example runs anywhere; point `sd.HDF5Dataset` at your own file.
"""

import argparse
import os
import tempfile

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shareddata as sd


def write_images(path: str, count: int, size: int) -> None:
    """A synthetic image set: the label is the brightest colour channel."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, count)
    with h5py.File(path, "w") as f:
        images = f.create_dataset(
            "images",
            (count, 3, size, size),
            np.uint8,
            chunks=(64, 3, size, size),
            compression="gzip",
        )
        for start in range(0, count, 1024):
            block = rng.integers(0, 128, (min(1024, count - start), 3, size, size), np.uint8)
            rows = np.arange(len(block))
            block[rows, labels[start : start + len(block)]] += 100
            images[start : start + len(block)] = block
        f["labels"] = labels
        f["meta/filename"] = [f"img_{i:06d}.png" for i in range(count)]


def augment(sample: dict) -> dict:
    """Runs in the worker, on each sample: a random horizontal flip.

    Images stay uint8 until they reach the training process (or the GPU):
    batches 4x smaller to pass between processes, less memory in each worker.
    """
    image = sample["images"]
    if torch.rand(()) < 0.5:
        image = image.flip(-1)
    return {
        "image": image,
        "label": sample["labels"],
        "filename": sample["meta/filename"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=64)  # 20000 x 3 x 64 x 64 = 234 MiB
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "images.h5")
        write_images(path, args.images, args.size)

        # Every dataset whose first dimension is the number of images, read once.
        ds = sd.HDF5Dataset(path, transform=augment)
        print(ds)
        loader = DataLoader(
            ds,
            batch_size=128,
            shuffle=True,
            num_workers=args.workers,
            multiprocessing_context="spawn",
            persistent_workers=True,
        )
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 3),
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        correct = 0
        for batch in loader:  # one epoch
            logits = model(batch["image"].float() / 255)
            loss = F.cross_entropy(logits, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += int((logits.argmax(1) == batch["label"]).sum())
            # strings come as a list
            assert len(batch["filename"]) == len(batch["label"])
        print(f"epoch 0: accuracy {correct / len(ds):.2f}")

        report = sd.verify(loader, batches=20)  # fails if a worker holds a copy
        print(report)


if __name__ == "__main__":
    main()
