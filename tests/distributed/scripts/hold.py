"""Run under torchrun: build the dataset, start 2 spawn workers, say READY, and hold.

The test SIGKILLs the whole job while this runs. The workers are idle by then: a
batch in flight travels through torch's own /dev/shm file, which SIGKILL can catch
in the instant between torch's shm_open and unlink (not a shareddata segment).
"""

import multiprocessing
import sys
import time

from torch.utils.data import DataLoader

import shareddata as sd


def main() -> None:
    ds = sd.NumpyDataset(sys.argv[1], progress=False)
    loader = DataLoader(
        ds,
        batch_size=256,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    iterator = iter(loader)
    next(iterator)
    time.sleep(1.0)  # let the workers finish prefetching: idle, holding the data
    print("READY", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
