"""A PyTorch Lightning LightningDataModule over shareddata: one copy for every worker.

Run:
    python examples/lightning_datamodule.py                          # one device
    python examples/lightning_datamodule.py --devices 2 --strategy ddp   # 2 ranks, CPU
Needs: pip install 'torch-shareddata[lightning]'

Where things go: `prepare_data` runs once per node (on local rank 0) and writes
files; `setup` runs on every rank and builds the shareddata datasets there. Under a
multi-process strategy every local rank builds the same dataset and shareddata
loads it once per node (local rank 0 reads, the others attach).

Every rank must name the same folder, or the ranks ask to share different datasets
(``LocalRankError``). With ``strategy="ddp"`` Lightning starts the other ranks by
running this script again with this process's environment, so the temporary folder
made here is handed to them in ``SHAREDDATA_EXAMPLE_DATA``.
"""

import argparse
import multiprocessing
import os
import shutil
import tempfile

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shareddata as sd


class FeaturesDataModule(L.LightningDataModule):
    """Features and labels saved as .npy files in a folder, served by sd.NumpyDataset."""

    def __init__(self, folder: str, rows: int, batch_size: int = 256, workers: int = 2) -> None:
        super().__init__()
        self.folder, self.rows = folder, rows
        self.batch_size, self.workers = batch_size, workers

    def prepare_data(self) -> None:  # once per node: download, unpack, convert...
        if os.path.exists(os.path.join(self.folder, "y.npy")):
            return
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.rows, 256), dtype=np.float32)
        np.save(os.path.join(self.folder, "x.npy"), x)
        np.save(os.path.join(self.folder, "y.npy"), (x[:, :4].sum(1) > 0).astype(np.int64))

    def setup(self, stage: str) -> None:  # on every rank
        self.train = sd.NumpyDataset(self.folder, output="tuple", progress=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            shuffle=True,  # Lightning swaps in a DistributedSampler under DDP
            num_workers=self.workers,
            multiprocessing_context=multiprocessing.get_context("spawn") if self.workers else None,
            persistent_workers=self.workers > 0,
        )


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(256, 2)
        self.last_loss = float("nan")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class CheckMemory(L.Callback):
    """Before training, check that the datamodule's loader holds the data once.

    `on_fit_start` runs after `setup` and before Lightning builds its own loader:
    `sd.verify` gets a loader of its own (verifying the loader that Lightning is
    iterating would restart its workers under it).
    """

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        datamodule = trainer.datamodule  # type: ignore[attr-defined]
        report = sd.verify(datamodule.train_dataloader(), batches=10)  # on every rank
        if trainer.is_global_zero:
            print(report, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=250_000)  # 1 KiB rows: 246 MiB
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--batches", type=int, help="batches per epoch (default: all)")
    parser.add_argument("--data", help="a folder with x.npy and y.npy (default: synthetic)")
    args = parser.parse_args()

    folder = args.data or os.environ.get("SHAREDDATA_EXAMPLE_DATA")
    made = False
    # the launching process (rank 0): one folder for every rank
    if folder is None:
        folder, made = tempfile.mkdtemp(prefix="shareddata-lightning-"), True
        # inherited by the ranks Lightning starts
        os.environ["SHAREDDATA_EXAMPLE_DATA"] = folder
    try:
        data = FeaturesDataModule(folder, args.rows, workers=args.workers)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=args.strategy,
            max_epochs=args.epochs,
            limit_train_batches=args.batches,
            callbacks=[CheckMemory()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Classifier()
        trainer.fit(model, datamodule=data)
        if trainer.is_global_zero:
            print(f"trained {trainer.global_step} steps, last loss {model.last_loss:.3f}")
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
