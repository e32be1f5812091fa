"""Conversations (``messages: list<struct<role, content>>``): shareddata, HF datasets, a list.

One Parquet file of --rows conversations (1 to 4 turns of 20 to 400 characters,
written by pyarrow) is loaded three ways, side by side in one run:

* ``sd.ParquetDataset``: offsets + typed levels in shared memory (the ``"nested"`` kind);
* HF ``datasets.Dataset.from_parquet`` (an Arrow cache file, memory-mapped);
* a plain list of dicts (``pq.read_table(path).to_pylist()``), what a hand-written
  Dataset often holds.

For each: load time; samples/s over one epoch with 4 spawn workers (batches of 256,
``collate_fn=list``: the items as the model code would get them); memory after an
epoch with 4 spawn workers (``sd.verify``): the copies of the data held by all the
processes together, net of what a worker without data takes (``duplication``;
the target is <= 1.1 for shareddata), with the data's size taken as the shareddata
copy's ``nbytes`` for every method so the figures compare.

Run: python benchmarks/bench_conversations.py [--rows N] [--workers W] [--json PATH]
(under ``flock /tmp/shareddata-heavy.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, Dataset

import shareddata as sd


def conversations(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` conversations, built column-wise (no Python object per turn)."""
    rng = np.random.default_rng(seed)
    turns = rng.integers(1, 5, rows)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(turns, out=offsets[1:])
    n = int(offsets[-1])
    lengths = rng.integers(20, 401, n)
    text_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=text_offsets[1:])
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     .,", np.uint8)
    text = letters[rng.integers(0, len(letters), int(text_offsets[-1]))]
    content = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(text_offsets), pa.py_buffer(text.tobytes())
    ).cast(pa.string())
    position = np.arange(n) - np.repeat(offsets[:-1], turns)
    role = pa.DictionaryArray.from_arrays(
        pa.array(position % 2, pa.int8()), pa.array(["user", "assistant"])
    ).dictionary_decode()
    turn = pa.StructArray.from_arrays([role, content], names=["role", "content"])
    messages = pa.ListArray.from_arrays(pa.array(offsets), turn)
    # messages alone: an int column would make every sample carry a tensor, whose
    # pickling (collate_fn=list) then dominates what is measured here
    return pa.table({"messages": messages})


class ListOfDicts(Dataset):
    """A plain Python list of samples, as a hand-written Dataset keeps them."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def _loader(ds: Any, workers: int) -> DataLoader:
    return DataLoader(
        ds, batch_size=256, shuffle=True, num_workers=workers, collate_fn=list,
        multiprocessing_context="spawn" if workers else None, timeout=600 if workers else 0,
    )  # fmt: skip


def measure(name: str, load: Any, workers: int, data_bytes: int | None) -> dict[str, Any]:
    gc.collect()
    t0 = time.perf_counter()
    ds = load()
    load_s = time.perf_counter() - t0
    nbytes = data_bytes if data_bytes is not None else ds.nbytes
    t0 = time.perf_counter()
    count = sum(len(batch) for batch in _loader(ds, workers))
    epoch_s = time.perf_counter() - t0
    report = sd.verify(_loader(ds, workers), max_duplication=None, dataset_bytes=nbytes)
    result = {
        "method": name,
        "load_s": load_s,
        "samples_per_s": count / epoch_s,
        "memory_ratio": report.total_pss / nbytes,
        "duplication": report.duplication,
        "data_bytes": nbytes,
    }
    print(
        f"{name:<28} load {load_s:7.1f} s   {result['samples_per_s']:9.0f} samples/s   "
        f"after an epoch: {report.duplication:5.2f} copies of the data "
        f"(all processes' PSS {report.total_pss / 2**20:.0f} MiB)",
        flush=True,
    )
    del ds
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--skip", nargs="*", default=[], help="methods to leave out")
    parser.add_argument("--json", help="write the results (and the load average) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "conversations.parquet")
        table = conversations(args.rows)
        pq.write_table(table, path, row_group_size=64 * 1024)
        del table
        print(f"{args.rows} conversations, {os.path.getsize(path) / 2**20:.0f} MiB of Parquet")
        results = [
            measure(
                "shareddata ParquetDataset",
                lambda: sd.ParquetDataset(path, progress=False),
                args.workers,
                None,
            )
        ]
        data_bytes = results[0]["data_bytes"]
        print(f"data: {data_bytes / 2**20:.0f} MiB in shared memory")
        if "hf" not in args.skip:
            import datasets

            cache = os.path.join(tmp, "hf_cache")
            results.append(
                measure(
                    "HF datasets from_parquet",
                    lambda: datasets.Dataset.from_parquet(path, cache_dir=cache),
                    args.workers,
                    data_bytes,
                )
            )
        if "list" not in args.skip:
            results.append(
                measure(
                    "list of dicts",
                    lambda: ListOfDicts(pq.read_table(path).to_pylist()),
                    args.workers,
                    data_bytes,
                )
            )
    base = results[0]
    if args.json:
        with open(args.json, "w") as f:
            info = {"rows": args.rows, "workers": args.workers, "loadavg": os.getloadavg()}
            json.dump({**info, "results": results}, f, indent=2)
    for r in results[1:]:
        print(
            f"shareddata vs {r['method']}: load {base['load_s'] / r['load_s']:.2f}x the time, "
            f"{base['samples_per_s'] / r['samples_per_s']:.2f}x the samples/s, "
            f"{base['duplication'] / r['duplication']:.2f}x the copies of the data"
        )


if __name__ == "__main__":
    main()
