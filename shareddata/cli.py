"""``python -m shareddata``: ``demo``, ``info FILE``, ``verify MODULE:FUNCTION``, ``clean``.

Each command prints what it found in words; usage errors (a missing file, a file
shareddata cannot read, a ``MODULE:FUNCTION`` that does not give a DataLoader) are
one line on stderr and exit code 2. ``verify`` exits 1 when the data is duplicated
and 3 when it cannot tell; ``info`` exits 1 when the file does not fit in memory.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from . import _info
from ._info import CommandError, open_sources
from ._text import format_bytes, parse_size, plural
from .errors import DuplicationError, InconclusiveError, SharedDataError

__all__ = ["build_parser", "main", "open_sources"]

# -- verify --------------------------------------------------------------------------------


def _split_target(target: str) -> tuple[str, str, str]:
    """``MODULE:NAME`` -> (the folder to import from, the module's name, NAME)."""
    module_name, sep, name = target.rpartition(":")
    if not sep or not module_name or not name:
        raise CommandError(
            f"expected MODULE:FUNCTION, a function that returns your DataLoader "
            f"(e.g. train:make_loader), got {target!r}"
        )
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise CommandError(
                f"no file {path} (MODULE {module_name!r} read as a file path): check the "
                f"path, relative to the current folder {os.getcwd()}"
            )
        return os.path.dirname(path), os.path.basename(path)[:-3], name
    return os.getcwd(), module_name, name


def load_factory(target: str) -> Any:
    """The function (or DataLoader) named by ``MODULE:NAME``, imported from the current folder.

    ``MODULE`` is a module name (``train``, ``pkg.data``) or a file (``train.py``).

    Raises:
        CommandError: ``target`` is malformed, the module does not exist or the name
            is not in it.
    """
    folder, module_name, name = _split_target(target)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            traceback.print_exc()
            raise CommandError(
                f"importing {module_name} failed: {e} (it imports a package that is not "
                "installed; the traceback above shows where)"
            ) from None
        raise CommandError(
            f"no module named {module_name!r} in {folder} or on sys.path: run from the "
            f"folder that holds {module_name.split('.')[0]}.py, or pass its path "
            f"(path/to/{module_name.split('.')[0]}.py:{name})"
        ) from None
    except Exception as e:
        traceback.print_exc()
        raise CommandError(
            f"importing {module_name} raised {type(e).__name__} (traceback above)"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        defined = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise CommandError(
            f"module {module_name!r} ({module.__file__}) has no {name!r}; "
            f"its functions and classes: {', '.join(defined) or 'none'}"
        ) from None


def _make_loader(target: str) -> Any:
    from torch.utils.data import DataLoader

    factory = load_factory(target)
    if isinstance(factory, DataLoader):
        return factory
    if not callable(factory):
        raise CommandError(
            f"{target} is a {type(factory).__name__}, not a function: name a function that "
            "takes no arguments and returns your DataLoader"
        )
    try:
        loader = factory()
    except Exception as e:
        traceback.print_exc()
        raise CommandError(f"{target}() raised {type(e).__name__} (traceback above)") from None
    if not isinstance(loader, DataLoader):
        raise CommandError(
            f"{target}() returned a {type(loader).__name__}, not a torch.utils.data.DataLoader: "
            "return the DataLoader you train with (same num_workers and start method)"
        )
    return loader


def verdict_line(report: Any) -> str:
    """``OK: ...``, ``FAIL: ...`` or ``CANNOT TELL: ...``: a report's verdict in words."""
    own = getattr(report, "verdict_line", None)
    if callable(own):
        return str(own())
    limit = report.max_duplication
    bound = "no limit" if limit is None else f"limit {limit:.2f}"
    if report.passed:
        return f"OK: the dataset is held {report.duplication:.2f}x ({bound})"
    return (
        f"FAIL: the dataset is duplicated {report.duplication:.2f}x across the main process "
        f"and {plural(report.num_workers, 'worker')} ({bound}): load it with a "
        "shareddata dataset (sd.NumpyDataset, sd.HDF5Dataset, sd.ParquetDataset) or wrap it "
        "in sd.SharedDataset(dataset), so that the workers index one copy"
    )


def _verify(args: argparse.Namespace) -> int:
    import multiprocessing

    from .memory import verify

    loader = _make_loader(args.target)
    # `python train.py` has its forkserver preload train.py (its __main__) and so what
    # it imports; here __main__ is shareddata: preload MODULE instead.
    if loader.num_workers > 0:
        module_name = _split_target(args.target)[1]
        multiprocessing.get_context("forkserver").set_forkserver_preload([module_name])
    try:
        report = verify(
            loader,
            batches=args.batches,
            max_duplication=args.max_duplication,
            dataset_bytes=args.dataset_size,
        )
    except (DuplicationError, InconclusiveError) as e:
        report = e.report
    except SharedDataError:
        raise
    except Exception as e:  # the user's loader failed: an error (2), not "duplicated" (1)
        raise CommandError(
            f"{args.target}'s DataLoader failed while verify iterated it: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e
    if args.json:
        print(report.to_json(indent=2))
        print(verdict_line(report), file=sys.stderr)
    else:
        text, line = str(report), verdict_line(report)
        print(text)
        if not text.rstrip().endswith(line):  # the table may end with it already
            print(line)
    codes = {"ok": 0, "duplicated": 1, "inconclusive": 3}  # 2: a usage error
    return codes["ok" if report.passed else report.status]


# -- demo and clean ------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from ._demo import DemoOptions, run_demo  # imports torch: only for the demo

    return run_demo(
        DemoOptions(
            size=args.size,
            workers=args.workers,
            start_method=args.start_method,
            batch_size=args.batch_size,
            batches=args.batches,
            plot=args.plot,
        )
    )


def _clean(args: argparse.Namespace) -> int:
    from .storage._sweep import sweep

    if not os.path.isdir(args.dir):
        raise CommandError(f"{args.dir} is not a folder")
    found = sweep(args.dir, min_age=args.min_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for leftover in found:
        print(
            f"{verb} {leftover.path}: {format_bytes(leftover.nbytes)}, left by process "
            f"{leftover.pid} (dead), {leftover.age:.0f} s old"
        )
    total = sum(leftover.nbytes for leftover in found)
    print(
        f"{verb} {plural(len(found), 'name')} ({format_bytes(total)}) that dead DataLoader "
        f"processes left in {args.dir}. These are torch's batch buffers: shareddata's own "
        "segments have no name and are never left behind."
    )
    return 0


# -- the parser ----------------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions, keeps the examples' line breaks, shows set defaults."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m shareddata``."""
    parser = argparse.ArgumentParser(
        prog="python -m shareddata",
        description="Load a dataset once into shared memory for every DataLoader worker "
        "and local rank, and check that it is held once.",
        epilog="examples:\n"
        "  python -m shareddata demo\n"
        "  python -m shareddata info data.h5\n"
        "  python -m shareddata verify train:make_loader\n"
        "  python -m shareddata clean --dry-run\n\n"
        "`python -m shareddata COMMAND --help` explains each command.",
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="a naive Dataset vs shareddata: memory held and time to the first batch",
        description="Write a synthetic float32 dataset to a temporary .npy file and read it "
        "with DataLoader workers twice: as a plain numpy Dataset (the array is pickled into "
        "every worker) and as shareddata.NumpyDataset (one copy in shared memory). Prints how "
        "many times each holds the data, the memory saved and the time to the first batch.",
        epilog="examples:\n"
        "  python -m shareddata demo\n"
        "  python -m shareddata demo --size 1GiB --workers 4 --start-method forkserver\n"
        "  python -m shareddata demo --plot memory.png",
        formatter_class=_Formatter,
    )
    demo.add_argument("--size", type=_size, default="256MiB", help="dataset size (KiB, MiB, GiB)")
    demo.add_argument("--workers", type=_positive, default=2, help="DataLoader num_workers")
    demo.add_argument(
        "--start-method",
        choices=["spawn", "forkserver", "fork"],
        default="spawn",
        help="how workers start; forkserver and spawn pickle the naive Dataset into each "
        "worker, fork shares it until written",
    )
    demo.add_argument("--batch-size", type=_positive, default=64, help="samples per batch")
    demo.add_argument(
        "--batches",
        type=_positive,
        default=8,
        help="batches to read before measuring (each worker has started by then)",
    )
    demo.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also write a bar chart of both runs' memory per process (needs matplotlib)",
    )
    demo.set_defaults(func=_demo)

    info = sub.add_parser(
        "info",
        help="a file's columns, dtypes, rows and bytes, and whether it fits in memory",
        description="Describe what the dataset class that reads FILE would load, without "
        "loading it (metadata, and a sizing read of variable-length Parquet columns): the "
        "files read, each column's dtype, row shape and size in shared memory, the total, "
        "and the room this machine has for it. "
        f"Reads {_info.FORMATS}. Exit code 1 when it does not fit, 2 where the load would "
        "fail (the same error).",
        epilog="examples:\n"
        "  python -m shareddata info data.h5\n"
        "  python -m shareddata info data.h5 --keys images,labels\n"
        "  python -m shareddata info train.parquet --columns text,label\n"
        "  python -m shareddata info features/   # a folder of .npy files",
        formatter_class=_Formatter,
    )
    info.add_argument("file", metavar="FILE", help="the file or folder to describe")
    info.add_argument(
        "--keys",
        "--columns",
        dest="keys",
        action="append",
        metavar="NAME[,NAME...]",
        default=None,
        help="only these columns (HDF5: dataset paths such as grp/images); repeatable; "
        "default: all",
    )
    info.set_defaults(func=_info.info)

    ver = sub.add_parser(
        "verify",
        help="run your DataLoader and check that the dataset is held once",
        description="Import MODULE from the current folder, call FUNCTION() to build the "
        "DataLoader you train with, iterate it, measure every process (main and workers) "
        "and say how many times the dataset is held in memory. Exit code 0 when held once, "
        "1 when duplicated, 2 on a usage error, 3 when it cannot tell (and says what would).",
        epilog="examples:\n"
        "  python -m shareddata verify train:make_loader\n"
        "  python -m shareddata verify train:make_loader --batches 50 --max-duplication 1.2\n"
        "  python -m shareddata verify src/data.py:loader --json > memory.json",
        formatter_class=_Formatter,
    )
    ver.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        help="a function taking no arguments that returns your DataLoader (or the "
        "DataLoader itself); MODULE may be a file path",
    )
    ver.add_argument(
        "--batches",
        type=_positive,
        default=None,
        help="batches to read before measuring; default: one epoch",
    )
    ver.add_argument(
        "--max-duplication",
        type=float,
        default=1.10,
        help="fail above this many copies of the dataset",
    )
    ver.add_argument(
        "--dataset-size",
        type=_size,
        default=None,
        help="the dataset's size (e.g. 2GiB); default: dataset.nbytes or an estimate",
    )
    ver.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (the verdict goes to stderr)",
    )
    ver.set_defaults(func=_verify)

    clean = sub.add_parser(
        "clean",
        help="remove the shared-memory names that killed DataLoader processes left",
        description="Remove torch's /dev/shm names (batch buffers) whose process is dead, "
        "that no process holds and that are older than --min-age. A load does not do this "
        "unless SHAREDDATA_SWEEP=1 asks it to (off by default: these are torch's files).",
        epilog="examples:\n  python -m shareddata clean --dry-run\n  python -m shareddata clean",
        formatter_class=_Formatter,
    )
    clean.add_argument("--dry-run", action="store_true", help="only list what would go")
    clean.add_argument("--dir", default="/dev/shm", help="the shared-memory folder")
    clean.add_argument(
        "--min-age", type=float, default=5.0, help="leave names younger than this (seconds)"
    )
    clean.set_defaults(func=_clean)
    return parser


def _hint(command: str, message: str) -> str:
    """Python keyword arguments named by a library message, as this command's flags."""
    if command == "info" and ("keys=[" in message or "columns=[" in message):
        return f"{message} On the command line: --keys NAME,NAME."
    return message


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["info", "no-such-file.npy"])
        2
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CommandError, SharedDataError) as e:
        message = _hint(args.command, str(e).strip())
        print(f"error: {message}", file=sys.stderr)
        return 2
