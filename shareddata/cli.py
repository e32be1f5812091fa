"""``python -m shareddata``: ``demo``, ``info FILE``, ``verify MODULE:FUNCTION``, ``clean``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._columns import ColumnSpec
from ._storage import _fmt, available_memory
from .errors import DuplicationError, SharedDataError

__all__ = ["main", "open_source"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"1g"``, ``"4096"`` -> bytes.

    Example:
        >>> parse_size("512MiB"), parse_size("1.5g"), parse_size("100")
        (536870912, 1610612736, 100)
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def open_source(path: str) -> Any:
    """The source reader for a file or folder, chosen by its extension (metadata only)."""
    from .sources.npy import NumpySource

    lower = path.lower()
    if os.path.isdir(path):
        names = os.listdir(path)
        if any(n.endswith(".parquet") for n in names):
            lower = ".parquet"
        elif not any(n.endswith(".npy") for n in names):
            raise SharedDataError(f"folder {path} holds no .npy or .parquet files")
    if lower.endswith((".h5", ".hdf5", ".hdf", ".he5")):
        from .sources.hdf5 import HDF5Source

        return HDF5Source(path)
    if lower.endswith((".parquet", ".pq")):
        from .sources.parquet import ParquetSource

        return ParquetSource(path)
    return NumpySource(path)


# -- info ----------------------------------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    source = open_source(args.file)
    try:
        specs: list[ColumnSpec] = source.specs()
    finally:
        source.close()
    rows = specs[0].rows if specs else 0
    width = max([len("column")] + [len(s.name) for s in specs])
    print(f"{args.file}: {rows} rows, {len(specs)} columns")
    print(f"  {'column':<{width}}  {'type':<24} {'bytes':>12}")
    for s in specs:
        print(f"  {s.name:<{width}}  {s.describe():<24} {_fmt(s.nbytes):>12}")
    needed = sum(s.nbytes for s in specs)
    ram = available_memory()
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    print(f"shared memory needed: {_fmt(needed)} ({needed} bytes)")
    print(f"free for shareddata (RAM / memory cgroup): {_fmt(ram)}")
    print(f"free in /dev/shm (DataLoader batches pass through it): {_fmt(shm)}")
    if needed <= ram:
        print("fits: yes")
        return 0
    print("fits: NO - load fewer columns, or pass storage_dir='/path/on/local/disk'")
    return 1


# -- verify --------------------------------------------------------------------------------


def _load_factory(spec: str) -> Any:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise SystemExit(f"expected MODULE:FUNCTION (e.g. train:make_loader), got {spec!r}")
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise SystemExit(f"module {module_name!r} has no function {func_name!r}") from None


def _verify(args: argparse.Namespace) -> int:
    from torch.utils.data import DataLoader

    from .memory import verify

    loader = _load_factory(args.target)()
    if not isinstance(loader, DataLoader):
        raise SystemExit(
            f"{args.target} returned a {type(loader).__name__}; it must return the "
            "torch.utils.data.DataLoader to verify (with the workers you train with)."
        )
    try:
        report = verify(loader, batches=args.batches, max_duplication=args.max_duplication)
        failed = False
    except DuplicationError as e:
        report, failed = e.report, True
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 1 if failed else 0


# -- demo ----------------------------------------------------------------------------------


class NaiveDataset:
    """What most training code does: a numpy array held as an attribute.

    Under ``spawn``/``forkserver`` the DataLoader pickles it, array and all, into
    every worker.
    """

    def __init__(self, path: str) -> None:
        self.data = np.load(path)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(self.data[i])


def _demo(args: argparse.Namespace) -> int:
    from torch.utils.data import DataLoader

    from .memory import verify
    from .sources.npy import NumpyDataset

    if args.plot:  # fail now, not after the runs, when matplotlib is missing
        from .memory._plot import figure_class

        figure_class()
    row = 4096  # bytes per sample: 1024 float32
    rows = max(1, args.size // row)
    tmp = tempfile.mkdtemp(prefix="shareddata-demo-")
    try:
        path = os.path.join(tmp, "features.npy")
        print(f"writing a synthetic {_fmt(rows * row)} dataset ({rows} x 1024 float32) ...")
        data = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, 1024))
        for start in range(0, rows, 16384):
            data[start : start + 16384] = np.float32(start)
        data.flush()
        del data

        def run(dataset: Any, label: str) -> Any:
            loader = DataLoader(
                dataset,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=args.workers,
                multiprocessing_context=args.start_method if args.workers else None,
            )
            t0 = time.perf_counter()
            report = verify(loader, batches=args.batches, max_duplication=None)
            print(f"\n== {label} ({time.perf_counter() - t0:.1f} s) ==\n{report}")
            return report

        nbytes = rows * row
        naive = run(_Sized(NaiveDataset(path), nbytes), "naive numpy Dataset")
        t0 = time.perf_counter()
        shared_ds = NumpyDataset(path)
        load_s = time.perf_counter() - t0
        shared = run(shared_ds, f"shareddata.NumpyDataset (loaded in {load_s:.1f} s)")
        del shared_ds
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = naive.total_pss - shared.total_pss
    print(
        f"\n{args.workers} {args.start_method} workers over {_fmt(nbytes)}: the naive Dataset is "
        f"held {naive.duplication:.2f}x, shareddata {shared.duplication:.2f}x; total memory "
        f"{_fmt(naive.total_pss)} vs {_fmt(shared.total_pss)} "
        f"({naive.total_pss / max(shared.total_pss, 1):.2f}x less, {_fmt(saved)} saved)."
    )
    if args.plot:
        from .memory._plot import save

        who = f"{args.workers} {args.start_method} workers"
        panels = [(f"naive numpy Dataset, {who}", naive), (f"shareddata, {who}", shared)]
        print(f"chart written to {save(panels, args.plot)}")
    return 0


class _Sized:
    """A Dataset wrapper that tells verify() how big the naive dataset is."""

    def __init__(self, dataset: Any, nbytes: int) -> None:
        self.dataset = dataset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]


# -- clean ---------------------------------------------------------------------------------


def _clean(args: argparse.Namespace) -> int:
    from ._sweep import sweep

    found = sweep(args.dir, min_age=args.min_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for leftover in found:
        print(
            f"{verb} {leftover.path} ({_fmt(leftover.nbytes)}, left by process {leftover.pid}, "
            f"dead; {leftover.age:.0f} s old)"
        )
    total = sum(leftover.nbytes for leftover in found)
    print(
        f"{verb} {len(found)} name(s) left in {args.dir} by dead processes ({_fmt(total)}). "
        "shareddata's own segments have no name and cannot be left behind; these are "
        "torch's DataLoader batches."
    )
    return 0


# -- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m shareddata``."""
    parser = argparse.ArgumentParser(
        prog="python -m shareddata",
        description="Load datasets once into shared memory for every DataLoader worker.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="naive Dataset vs shareddata, memory side by side")
    demo.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--start-method", choices=["spawn", "forkserver", "fork"], default="spawn")
    demo.add_argument("--batch-size", type=int, default=256)
    demo.add_argument("--batches", type=int, default=None, help="default: one full epoch")
    demo.add_argument(
        "--plot", metavar="FILE", help="write a PNG chart of both runs' memory per process"
    )
    demo.set_defaults(func=_demo)

    info = sub.add_parser("info", help="columns, rows and shared memory needed by a file")
    info.add_argument("file")
    info.set_defaults(func=_info)

    ver = sub.add_parser("verify", help="measure a DataLoader built by MODULE:FUNCTION")
    ver.add_argument("target", metavar="MODULE:FUNCTION")
    ver.add_argument("--batches", type=int, default=None, help="default: one full epoch")
    ver.add_argument("--max-duplication", type=float, default=1.10)
    ver.add_argument("--json", action="store_true", help="print the report as JSON")
    ver.set_defaults(func=_verify)
    clean = sub.add_parser(
        "clean", help="remove shared-memory names that killed DataLoader processes left"
    )
    clean.add_argument("--dry-run", action="store_true", help="only list what would go")
    clean.add_argument("--dir", default="/dev/shm", help="the shared-memory folder")
    clean.add_argument(
        "--min-age", type=float, default=5.0, help="leave names younger than this (seconds)"
    )
    clean.set_defaults(func=_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SharedDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
