"""Griffe extension for the API pages: render ``Example:`` sections as examples.

The package's docstrings use Google style's singular ``Example:`` heading, which
griffe reads as a generic admonition (its ``>>>`` lines would render as nested
Markdown quotes). This extension renames the heading to ``Examples:`` before the
docstrings are parsed, so the examples render as Python console code blocks.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headings to ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each loaded object."""
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
