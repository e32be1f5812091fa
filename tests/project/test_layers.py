"""The package's layers: no import circle, no private name used across modules.

What import-linter would check, from the source alone: every module-level import of
one ``shareddata`` module by another is an edge of a graph that must have no cycle
(an import made inside a function to dodge a circle counts too: it is the same
dependency); and no module imports another module's ``_private`` name (shared
helpers get a public name in a private module instead).
"""

from __future__ import annotations

import ast
import os
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


def _under_type_checking(path: str) -> set[int]:
    """Lines of imports under ``if TYPE_CHECKING:`` (annotations only, not run)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def test_no_import_circle():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        skip = _under_type_checking(path)
        for target, _, line in _imports(module, path, modules):
            if line in skip or target == module:
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
