"""Lines of the package: all lines (``wc -l``) and code lines, per module and folder.

Code lines are those that hold a token of code: blank lines, comments and docstrings
(the string that opens a module, class or function, and a string standing alone as a
statement, such as an attribute's docstring) are not counted.

Usage: ``python scripts/count_lines.py [PACKAGE_DIR] [--modules]``; the last line is
the total.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import defaultdict
from pathlib import Path


def code_lines(source: str) -> int:
    """How many lines of ``source`` hold code (no docstring, comment or blank line)."""
    strings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        value = getattr(node, "value", None)
        if isinstance(node, ast.Expr) and isinstance(getattr(value, "value", None), str):
            strings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skip or token.type == tokenize.ENDMARKER:
            continue
        for line in range(token.start[0], token.end[0] + 1):
            if line not in strings:
                lines.add(line)
    return len(lines)


def main(argv: list[str]) -> None:
    """Print lines and code lines per folder (and per module with ``--modules``)."""
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0] if args else Path(__file__).parent.parent / "shareddata")
    folders: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    rows = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        total, code = source.count("\n"), code_lines(source)
        folder = str(path.parent.relative_to(root.parent))
        folders[folder][0] += 1
        folders[folder][1] += total
        folders[folder][2] += code
        rows.append((str(path.relative_to(root.parent)), total, code))
    if "--modules" in argv:
        for name, total, code in rows:
            print(f"{name:55} {total:6} {code:6}")
        print()
    print(f"{'folder':40} {'modules':>7} {'lines':>7} {'code':>7}")
    for folder, (modules, total, code) in sorted(folders.items()):
        print(f"{folder:40} {modules:7} {total:7} {code:7}")
    print(
        f"{'total':40} {sum(f[0] for f in folders.values()):7} "
        f"{sum(f[1] for f in folders.values()):7} {sum(f[2] for f in folders.values()):7}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
