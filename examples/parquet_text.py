"""Text in Parquet: strings and token lists loaded once into shared memory, for spawn workers.

Run: python examples/parquet_text.py [--rows N]

Variable-length columns are stored as one values buffer plus offsets, so a batch of
token lists becomes one flat tensor plus offsets: exactly what `nn.EmbeddingBag`
takes, with no padding. The file is written here so that the example runs anywhere.
"""

import argparse
import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shareddata as sd

VOCAB = [f"w{i}" for i in range(5000)]


def write_reviews(path: str, rows: int) -> None:
    """Synthetic reviews: text, its token ids (int32 lists), and a label."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 120, rows)
    labels = rng.integers(0, 2, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, len(VOCAB), int(offsets[-1])).astype(np.int32)
    tokens[offsets[:-1]] = labels  # the first word gives the label away: learnable
    text = [" ".join(VOCAB[t] for t in tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    table = pa.table(
        {
            "text": pa.array(text, pa.string()),
            "tokens": pa.LargeListArray.from_arrays(offsets, tokens),
            "label": pa.array(labels, pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=16_384)


def collate(samples: list[dict]) -> dict:
    """Token lists of varying length -> one flat tensor + offsets."""
    tokens = [s["tokens"] for s in samples]
    lengths = torch.tensor([len(t) for t in tokens])
    return {
        "tokens": torch.cat(tokens).long(),
        "offsets": torch.cumsum(lengths, 0) - lengths,
        "label": torch.stack([s["label"] for s in samples]),
        "text": [s["text"] for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)  # ~ 140 MiB
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reviews.parquet")
        write_reviews(path, args.rows)

        ds = sd.ParquetDataset(path, columns=["tokens", "label", "text"])
        print(ds)
        sample = ds[0]
        assert isinstance(sample["text"], str) and sample["tokens"].dtype == torch.int32
        assert len(sample["tokens"]) == len(sample["text"].split())

        loader = DataLoader(
            ds,
            batch_size=256,
            shuffle=True,
            collate_fn=collate,
            num_workers=args.workers,
            multiprocessing_context="spawn",
            persistent_workers=True,
        )
        model = torch.nn.EmbeddingBag(len(VOCAB), 2, mode="sum")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        correct = 0
        for batch in loader:  # one epoch
            logits = model(batch["tokens"], batch["offsets"])
            loss = F.cross_entropy(logits, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += int((logits.argmax(1) == batch["label"]).sum())
        print(f"epoch 0: accuracy {correct / len(ds):.2f}")

        report = sd.verify(loader, batches=20)  # fails if a worker holds a copy
        print(report)


if __name__ == "__main__":
    main()
