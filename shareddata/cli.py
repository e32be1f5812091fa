"""``python -m shareddata``: ``demo``, ``info FILE``, ``verify MODULE:FUNCTION``, ``clean``.

Each command prints what it found in words; usage errors (a missing file, a file
shareddata cannot read, a ``MODULE:FUNCTION`` that does not give a DataLoader) are
one line on stderr and exit code 2. ``verify`` exits 1 when the data is duplicated
and 3 when it cannot tell; ``info`` exits 1 when the file does not fit in memory.
A command's ``--help`` is its function's docstring and the arguments it registers.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import multiprocessing
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader

from . import _info
from ._demo import run_demo
from ._info import CommandError, open_sources
from ._text import format_bytes, parse_size, plural
from .errors import DuplicationError, InconclusiveError, SharedDataError
from .memory import verify
from .storage._sweep import sweep

__all__ = ["build_parser", "main", "open_sources"]

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Command, tuple[Any, ...]]] = {}


def _command(name: str, *arguments: Any) -> Callable[[Command], Command]:
    """Register a command's function and its arguments (``_arg``), in --help's order."""

    def register(run: Command) -> Command:
        _COMMANDS[name] = (run, arguments)
        return run

    return register


def _arg(*flags: str, **options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return flags, options


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


def _split_target(target: str) -> tuple[str, str, str]:
    """``MODULE:NAME`` -> (the folder to import from, the module's name, NAME)."""
    module_name, sep, name = target.rpartition(":")
    if not sep or not module_name or not name:
        raise CommandError(
            f"expected MODULE:FUNCTION, a function that returns your DataLoader "
            f"(e.g. train:make_loader), got {target!r}"
        )
    if not module_name.endswith(".py"):
        return os.getcwd(), module_name, name
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
        raise CommandError(
            f"no file {path} (MODULE {module_name!r} read as a file path): check the "
            f"path, relative to the current folder {os.getcwd()}"
        )
    return os.path.dirname(path), os.path.basename(path)[:-3], name


def load_factory(target: str) -> Any:
    """The object named by ``MODULE:NAME`` (a module name or a ``.py`` file), imported.

    Raises:
        CommandError: ``target`` is malformed, or names no module or no object in it.
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
        top = module_name.split(".")[0]
        raise CommandError(
            f"no module named {module_name!r} in {folder} or on sys.path: run from the "
            f"folder that holds {top}.py, or pass its path (path/to/{top}.py:{name})"
        ) from None
    except Exception as e:
        traceback.print_exc()
        raise CommandError(
            f"importing {module_name} raised {type(e).__name__} (traceback above)"
        ) from None
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
        raise CommandError(
            f"module {module_name!r} ({module.__file__}) has no {name!r}; "
            f"its functions and classes: {', '.join(defined) or 'none'}"
        )
    return getattr(module, name)


def _make_loader(target: str) -> Any:
    loader = load_factory(target)
    if isinstance(loader, DataLoader):
        return loader
    if not callable(loader):
        raise CommandError(
            f"{target} is a {type(loader).__name__}, not a function: name a function that "
            "takes no arguments and returns your DataLoader"
        )
    try:
        loader = loader()
    except Exception as e:
        traceback.print_exc()
        raise CommandError(f"{target}() raised {type(e).__name__} (traceback above)") from None
    if not isinstance(loader, DataLoader):
        raise CommandError(
            f"{target}() returned a {type(loader).__name__}, not a torch.utils.data.DataLoader: "
            "return the DataLoader you train with (same num_workers and start method)"
        )
    return loader


@_command(
    "demo",
    _arg("--size", type=_size, default="256MiB", help="dataset size (KiB, MiB, GiB)"),
    _arg("--workers", type=_positive, default=2, help="DataLoader num_workers"),
    _arg(
        "--start-method",
        choices=["spawn", "forkserver", "fork"],
        default="spawn",
        help="how workers start; forkserver and spawn pickle the naive Dataset into each worker, "
        "fork shares it until written",
    ),
    _arg("--batch-size", type=_positive, default=64, help="samples per batch"),
    _arg(
        "--batches",
        type=_positive,
        default=8,
        help="batches to read before measuring (each worker has started by then)",
    ),
    _arg(
        "--plot",
        metavar="PNG",
        help="also write a bar chart of both runs' memory per process (needs matplotlib)",
    ),
)
def _demo(args: argparse.Namespace) -> int:
    """A naive Dataset vs shareddata: memory held and time to the first batch.

    Write a synthetic float32 dataset to a temporary .npy file and read it with
    DataLoader workers twice: as a plain numpy Dataset (the array is pickled into every
    worker) and as shareddata.NumpyDataset (one copy in shared memory). Prints how many
    times each holds the data, the memory saved and the time to the first batch.

    Examples:
        python -m shareddata demo
        python -m shareddata demo --size 1GiB --workers 4 --start-method forkserver
        python -m shareddata demo --plot memory.png
    """
    return run_demo(args)


_command(
    "info",
    _arg("file", metavar="FILE", help="the file or folder to describe"),
    _arg(
        "--keys",
        "--columns",
        dest="keys",
        action="append",
        metavar="NAME[,NAME...]",
        help="only these columns (HDF5: dataset paths such as grp/images); repeatable; "
        "default: all",
    ),
)(_info.info)


@_command(
    "verify",
    _arg(
        "target",
        metavar="MODULE:FUNCTION",
        help="a function taking no arguments that returns your DataLoader (or the DataLoader "
        "itself); MODULE may be a file path",
    ),
    _arg("--batches", type=_positive, help="batches to read before measuring; default: one epoch"),
    _arg(
        "--max-duplication",
        type=float,
        default=1.10,
        help="fail above this many copies of the dataset",
    ),
    _arg(
        "--dataset-size",
        type=_size,
        help="the dataset's size (e.g. 2GiB); default: dataset.nbytes or an estimate",
    ),
    _arg(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (the verdict goes to stderr)",
    ),
)
def _verify(args: argparse.Namespace) -> int:
    """Run your DataLoader and check that the dataset is held once.

    Import MODULE from the current folder, call FUNCTION() to build the DataLoader you
    train with, iterate it, measure every process (main and workers) and say how many
    times the dataset is held in memory. Exit code 0 when held once, 1 when duplicated,
    2 on a usage error, 3 when it cannot tell (and says what would).

    Examples:
        python -m shareddata verify train:make_loader
        python -m shareddata verify train:make_loader --batches 50 --max-duplication 1.2
        python -m shareddata verify src/data.py:loader --json > memory.json
    """
    loader = _make_loader(args.target)
    if loader.num_workers > 0:  # the forkserver preloads __main__, here shareddata: MODULE
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
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CommandError(
            f"{args.target}'s DataLoader failed while verify iterated it: "
            f"{type(e).__name__}: {first}"
        ) from e
    line = report.verdict_line()
    if args.json:
        print(report.to_json(indent=2))
        print(line, file=sys.stderr)
    else:
        print(report)  # it ends with the verdict line
    return 0 if report.passed else {"duplicated": 1, "inconclusive": 3}[report.status]


@_command(
    "clean",
    _arg("--dry-run", action="store_true", help="only list what would go"),
    _arg("--dir", default="/dev/shm", help="the shared-memory folder"),
    _arg("--min-age", type=float, default=5.0, help="leave names younger than this (seconds)"),
)
def _clean(args: argparse.Namespace) -> int:
    """Remove the shared-memory names that killed DataLoader processes left.

    Remove torch's /dev/shm names (batch buffers) whose process is dead, that no
    process holds and that are older than --min-age. A load does not do this unless
    SHAREDDATA_SWEEP=1 asks it to (off by default: these are torch's files).

    Examples:
        python -m shareddata clean --dry-run
        python -m shareddata clean
    """
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


def _texts(run: Callable[..., int]) -> dict[str, Any]:
    """A command's help, description and examples: its docstring (``{formats}`` filled in)."""
    summary, _, rest = inspect.cleandoc(run.__doc__ or "").partition("\n\n")
    description, _, examples = rest.partition("\n\nExamples:\n")
    return {
        "help": summary[:1].lower() + summary[1:].rstrip("."),
        "description": description.format(formats=_info.FORMATS),
        "epilog": "examples:\n" + textwrap.indent(textwrap.dedent(examples), "  "),
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m shareddata``."""
    texts = {name: _texts(run) for name, (run, _) in _COMMANDS.items()}
    firsts = "".join(text["epilog"].splitlines(keepends=True)[1] for text in texts.values())
    parser = argparse.ArgumentParser(
        prog="python -m shareddata",
        description="Load a dataset once into shared memory for every DataLoader worker "
        "and local rank, and check that it is held once.",
        epilog=f"examples:\n{firsts}\n`python -m shareddata COMMAND --help` explains each "
        "command.",  # each command's first example
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (run, arguments) in _COMMANDS.items():
        command = sub.add_parser(name, formatter_class=_Formatter, **texts[name])
        for flags, options in arguments:
            command.add_argument(*flags, **options)
        command.set_defaults(func=run)
    return parser


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
        message = str(e).strip()
        if args.command == "info" and ("keys=[" in message or "columns=[" in message):
            message += " On the command line: --keys NAME,NAME."  # the Python names as flags
        print(f"error: {message}", file=sys.stderr)
        return 2
