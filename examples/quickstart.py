"""Quickstart: a NumPy dataset loaded once, served to spawn workers, checked by verify.

Run: python examples/quickstart.py [--rows N]
"""

import argparse
import os
import tempfile

import numpy as np
from torch.utils.data import DataLoader

import shareddata as sd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        # Files as a training job would have them: one .npy per column.
        np.save(os.path.join(tmp, "x.npy"), np.random.rand(args.rows, 256).astype(np.float32))
        np.save(os.path.join(tmp, "y.npy"), np.random.randint(0, 10, args.rows))

        ds = sd.NumpyDataset(tmp, output="tuple", columns=["x", "y"])  # read once, into RAM
        print(ds)
        loader = DataLoader(
            ds, batch_size=256, shuffle=True, num_workers=2, multiprocessing_context="spawn"
        )
        for x, y in loader:  # a training loop would go here
            assert x.shape == (len(y), 256)
        report = sd.verify(loader, batches=50)  # fails if any worker holds a copy
        print(report)


if __name__ == "__main__":
    main()
