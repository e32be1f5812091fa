"""The one benchmark command: runs harness topics side by side and writes their reports.

    python benchmarks/bench_suite.py                  # the suite (this, under its documented
                                                      # name): docs/benchmarks.md, docs/img/,
                                                      # benchmarks/results/suite.json
    python benchmarks/bench.py --quick --out-dir /tmp/suite   # smoke run of the suite
    python benchmarks/bench.py --only throughput memory      # part of the suite (its page
                                                             # goes to results/partial/)
    python benchmarks/bench.py --topics wrap,handoff         # results/<topic>.md/.json

Without ``--topics`` it runs the topics of the benchmarks page (``topics.SUITE``,
or those ``--only`` names) and writes the page; with ``--topics`` each topic writes
its own report to ``benchmarks/results/<topic>.{md,json}`` (``--quick``:
``results/quick/``). The measurements are the topics' (``benchmarks/harness/topics/``):
this file only parses options, calls each topic's ``run()`` and ``render()`` and
writes files. Sections of ``docs/benchmarks.md`` that other scripts write
(``EXTERNAL``) are kept as they are when the page is rewritten. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from harness import cases, machine  # noqa: E402
from harness.render import table  # noqa: E402
from harness.runner import Runner  # noqa: E402
from harness.topics import SUITE, TOPICS  # noqa: E402

QUICK_NOTE = ", QUICK smoke run: sizes too small for the figures to mean anything"
# A/B scripts that write their own section of docs/benchmarks.md: kept when it is rewritten
EXTERNAL = (
    "bench_ipc.py", "bench_conversations.py", "bench_compare.py", "bench_wrap_path.py",
    "bench_images.py", "bench_hdf5_readers.py", "bench_suite_compare.py",
)  # fmt: skip
ALIASES = {"build": "load"}  # bench_suite's old section name: the load topic builds too


def size(text: str) -> int:
    """``"1GiB"``, ``"256MiB"``, ``"64M"`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB, 256MiB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def topic(name: str) -> Any:
    """The module of topic ``name``."""
    return importlib.import_module(f"harness.topics.{name}")


def external(path: str) -> list[str]:
    """The ``##`` sections of the page at ``path`` that name a script of ``EXTERNAL``."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    parts = re.split(r"(?m)^(?=## )", text)[1:]
    return [p.rstrip() + "\n" for p in parts if any(name in p for name in EXTERNAL)]


def page(results: dict[str, Any], quick: bool, kept: Sequence[str] = ()) -> str:
    """The benchmarks page: the machine, every target, every topic's tables, ``kept``, plots."""
    info, head = results["machine"], results
    rows = [
        ["cores", f"{info['cores']} ({info['cores_usable']} usable), {info['cpu']}"],
        ["RAM", f"{info['ram_gib']} GiB"],
        ["kernel / THP (shmem)", f"{info['kernel']} / {info['thp_shmem']}"],
        ["python / torch / numpy", f"{info['python']} / {info['torch']} / {info['numpy']}"],
        ["torch threads (default)", info["torch_threads"]],
        ["shareddata", f"{info['shareddata']} (commit {info['commit']})"],
        *[[f"peer: {k}", v] for k, v in results["peers"].items()],
        ["load average at start / end", f"{head['load_start']} / {head['load_end']}"],
    ]
    lines = [
        "# Benchmarks",
        "",
        f"Every figure on this page comes from one run of `{results['command']}` "
        f"({results['started']}, {results['duration_s'] / 60:.1f} min"
        f"{QUICK_NOTE if quick else ''}), side by side with its peers and the machine's "
        f"limits; medians of {results['reps']} repetition(s). Raw data with every "
        f"repetition: `{results['json']}`. How each figure is measured: "
        "`benchmarks/README.md`.",
        "",
        table(["machine", ""], rows),
        "",
    ]
    failed = [n for n in TOPICS if "failed" in results.get(n, {})]
    done = [n for n in TOPICS if n in results and n not in failed]
    scored = [n for n in done if hasattr(topic(n), "targets")]
    goals = [row for n in scored for row in topic(n).targets(results[n])]
    if goals:
        header = ["target", "measured", "goal", "verdict", "limit / context"]
        lines += ["## Targets", "", table(header, goals), ""]
    lines += [topic(n).render(results[n]) for n in done]
    lines += [f"## {n}: FAILED\n\n    {results[n]['failed']}\n" for n in failed]
    lines += list(kept)
    if results.get("plots"):
        lines += ["## Plots", ""]
        lines += [f"![{t}](img/{os.path.basename(p)})" for t, p in results["plots"].items()]
        lines += [""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "benchmarks/bench.py") -> int:
    """Parse options, run the topics, write the page (or each topic's report)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    p.add_argument("--topics", help=f"comma-separated, or 'all': {','.join(TOPICS)}")
    p.add_argument("--only", nargs="+", help="the suite's page with only these topics")
    p.add_argument("--reps", "--repeats", type=int, help="repetitions (3; 1 with --quick)")
    p.add_argument("--size", type=size, help="data size of the topic (e.g. 256MiB, 1GiB)")
    p.add_argument("--mib", type=int, help="the same in MiB")
    p.add_argument("--items", type=int, nargs="+", help="wrap: dataset lengths")
    p.add_argument("--ranks", type=int, nargs="+", help="distributed: local ranks")
    p.add_argument("--modes", nargs="+", help="distributed: ways of loading")
    p.add_argument("--baseline", default="0bcb8bd", help="compare: the other commit")
    p.add_argument("--tmp-dir", help="where data files go (a local disk)")
    p.add_argument("--out-dir", help="where the reports go")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S", help="wait for idle")
    p.add_argument("--render", metavar="JSON", help="only rewrite the page from a suite.json")
    args = p.parse_args(argv)
    if args.topics and args.only:
        p.error("--topics (a report per topic) or --only (the suite's page), not both")
    names = args.topics.split(",") if args.topics else [ALIASES.get(n, n) for n in args.only or []]
    names = TOPICS if names == ["all"] else names
    if any(n not in TOPICS for n in names):
        p.error(f"unknown topic in {names}; topics: {', '.join(TOPICS)}")
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        md = os.path.join(args.out_dir or os.path.join(REPO, "docs"), "benchmarks.md")
        text = page(saved, saved["quick"], external(md))
        with open(md, "w") as f:
            f.write(text + "\n")
        return 0
    whole = not args.topics  # the suite's page (all of it, or the --only topics)
    names = [n for n in TOPICS if n in (names or SUITE)]
    args.reps = args.reps or (1 if args.quick else 3)
    args.size = args.size or (args.mib << 20 if args.mib else None)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M %z"),
        "command": " ".join(["python", prog, *(sys.argv[1:] if argv is None else argv)]),
        "quick": args.quick,
        "reps": args.reps,
        "machine": machine.machine_info(),
        "peers": cases.peer_status(),
        "load_start": machine.load_average(),
    }
    out = args.out_dir or (os.path.join(HERE, "results", "quick") if args.quick else None)
    if whole and args.only and not out:  # a partial page never replaces the docs' page
        out = os.path.join(HERE, "results", "partial")
    if whole:
        md = os.path.join(out or os.path.join(REPO, "docs"), "benchmarks.md")
        img = os.path.join(os.path.dirname(md), "img")
        js = os.path.join(out or os.path.join(HERE, "results"), "suite.json")
        results["json"] = os.path.relpath(js, REPO)
    t0 = time.time()
    args.status = results["peers"]
    tmp_dir = tempfile.TemporaryDirectory(prefix="sd-bench-", dir=args.tmp_dir)
    with Runner() as args.runner, tmp_dir as tmp:
        args.tmp_dir = tmp
        for name in names:
            print(f"{name}:", flush=True)
            if args.wait_idle:
                machine.wait_idle(args.wait_idle)
            start = time.time()
            try:
                results[name] = topic(name).run(args.quick, args)
            except Exception as e:  # the suite keeps the other topics' figures
                if not whole:
                    raise
                traceback.print_exc()
                results[name] = {"failed": f"{type(e).__name__}: {e}"[-2000:]}
            print(f"{name}: {time.time() - start:.0f} s", flush=True)
            if not whole:  # each topic its own report, as soon as it is done
                folder = out or os.path.join(HERE, "results")
                os.makedirs(folder, exist_ok=True)
                text = topic(name).render(results[name])
                with open(os.path.join(folder, f"{name}.md"), "w") as f:
                    f.write(text + "\n")
                with open(os.path.join(folder, f"{name}.json"), "w") as f:
                    own = {k: v for k, v in results.items() if k not in TOPICS or k == name}
                    json.dump(own, f, indent=1, default=str)
                print(text, flush=True)
    results["load_end"] = machine.load_average()
    results["duration_s"] = time.time() - t0
    if whole:
        results["plots"] = {}
        done = [n for n in names if "failed" not in results[n]]
        for name in done if not args.no_plots else []:
            if hasattr(topic(name), "plot_png"):
                results["plots"].update(topic(name).plot_png(results[name], img))
        text = page(results, args.quick, external(md) if out is None else ())
        os.makedirs(os.path.dirname(md), exist_ok=True)
        os.makedirs(os.path.dirname(js), exist_ok=True)
        with open(md, "w") as f:
            f.write(text + "\n")
        with open(js, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(text, f"\nwrote {md}, {js}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
