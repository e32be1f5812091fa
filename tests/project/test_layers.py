"""The package's layers: no import circle, no private name used across modules, data flows one way.

What import-linter would check, from the source alone: every module-level import of
one ``shareddata`` module by another is an edge of a graph that must have no cycle
(an import made inside a function to dodge a circle counts too: it is the same
dependency); and no module imports another module's ``_private`` name (shared
helpers get a public name in a private module instead).
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import sys
from collections.abc import Iterator

from conftest import REPO

PACKAGE = os.path.join(REPO, "shareddata")


def _modules() -> dict[str, str]:
    """Every module of the package by dotted name -> file path."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
            found[rel.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> Iterator[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for each import of the package."""
    is_package = path.endswith("__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "shareddata":
                    yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "shareddata":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    yield submodule, "", node.lineno
                else:
                    yield target, alias.name, node.lineno


def test_no_import_circle():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        # imports under TYPE_CHECKING count too: a circle for the type checker is a
        # circle for the reader (issue 21)
        for target, _, _ in _imports(module, path, modules):
            if target == module:
                continue
            # importing a package runs its __init__; a module inside it depends on it
            if target in modules and not module.startswith(target + "."):
                graph[module].add(target)
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_imported_across_modules():
    modules = _modules()
    found = []
    for module, path in modules.items():
        for target, name, line in _imports(module, path, modules):
            if name.startswith("_") and not name.startswith("__") and target != module:
                found.append(f"{os.path.relpath(path, REPO)}:{line} imports {target}.{name}")
    assert not found, "private names used across modules:\n" + "\n".join(found)


LAYERS = [
    ["shareddata.errors", "shareddata._text", "shareddata._compat"],
    ["shareddata._resume"],
    ["shareddata.storage"],
    ["shareddata.columns"],
    ["shareddata.sources", "shareddata.crossing", "shareddata.distributed"],
    ["shareddata.datasets"],
    ["shareddata.memory"],
    ["shareddata._demo", "shareddata._info", "shareddata.testing", "shareddata"],
    ["shareddata.cli"],
    ["shareddata.__main__"],
]
"""The folders (and top-level modules) from the bottom up, as docs/how-it-works.md draws them:
a module imports only from lower layers and from its own folder."""


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_every_import_goes_down_the_layers():
    rank = {unit: k for k, units in enumerate(LAYERS) for unit in units}
    modules = _modules()
    missing = sorted({_unit(m) for m in modules} - set(rank))
    assert not missing, f"not in LAYERS (add them where they belong): {missing}"
    found = []
    for module, path in modules.items():
        here = _unit(module)
        for target, _, line in _imports(module, path, modules):
            there = _unit(target)
            if there != here and rank[there] >= rank[here]:
                found.append(f"{os.path.relpath(path, REPO)}:{line}: {here} imports {there}")
    assert not found, "imports that go up or sideways:\n" + "\n".join(found)


def test_the_package_does_not_grow():
    """A ceiling on the package's size (``scripts/count_lines.py``), lowered as it slims.

    Modules are cut along their jobs, whatever their length; the package as a whole
    must not grow: a change that adds lines removes as many elsewhere.
    """
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        from count_lines import code_lines
    finally:
        sys.path.pop(0)
    texts = [pathlib.Path(path).read_text() for path in _modules().values()]
    lines = sum(text.count("\n") for text in texts)
    code = sum(code_lines(text) for text in texts)
    assert lines <= 16_420 and code <= 11_000, f"{lines} lines, {code} of code"


def _module_map() -> dict[str, set[str]]:
    """The module map of docs/how-it-works.md: layer (a folder or "top level") -> names."""
    with open(os.path.join(REPO, "docs", "how-it-works.md")) as f:
        text = f.read().split("## The code, module by module", 1)[1]
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("layer", "---"):
            continue
        folder = cells[0].strip("`").rstrip("/") if cells[0].startswith("`") else "top level"
        names = set(re.findall(r"`(_?_?\w+)(?:/)?`", cells[1]))
        rows.setdefault(folder, set()).update(names)
    return rows


def test_the_module_map_in_the_docs_names_every_module_where_it_is():
    rows = _module_map()
    missing, wrong = [], []
    for module in _modules():
        parts = module.split(".")[1:]  # without "shareddata"
        if not parts:
            folder, name = "top level", "__init__"
        elif len(parts) == 1:
            folder, name = ("top level", parts[0]) if parts[0] not in rows else (parts[0], None)
        else:
            folder, name = parts[0], parts[-1] if parts[-1] != parts[0] else None
            if len(parts) > 2 and parts[-1] == parts[1]:  # a sub-folder's __init__
                name = parts[1]
        if name is None or name == "__init__" and folder != "top level":
            continue
        if folder not in rows:
            wrong.append(f"{module}: no row for {folder}/")
        elif name not in rows[folder]:
            missing.append(f"{module} (row {folder})")
    assert not wrong and not missing, (
        "docs/how-it-works.md's module map is out of date:\n" + "\n".join(wrong + missing)
    )
